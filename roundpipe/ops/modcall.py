"""Calling an opaque module with explicit state (the torch.fx fallback's layer units and
export's leaf modules)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call


def call_module_functional(module: torch.nn.Module, state: dict[str, torch.Tensor],
                           *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with its parameters and buffers replaced by ``state``.

    The torch.fx fallback keeps layer units opaque; this keeps their state explicit, so the
    runtime can pass device copies exactly as it does for exported programs.
    """
    return functional_call(module, dict(state), args, kwargs, tie_weights=False, strict=False)


def tensor_leaves(output: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a module's output structure, in pytree order (a leaf module's
    flat outputs; its structure is rebuilt by the traced graph)."""
    return tuple(x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor))
