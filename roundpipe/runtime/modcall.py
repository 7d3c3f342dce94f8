"""Calling an opaque module with explicit state (used by programs traced with torch.fx)."""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call


def call_module_functional(module: torch.nn.Module, state: dict[str, torch.Tensor],
                           *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with its parameters and buffers replaced by ``state``.

    The torch.fx fallback keeps layer units opaque; this keeps their state explicit, so the
    runtime can pass device copies exactly as it does for exported programs.
    """
    return functional_call(module, dict(state), args, kwargs, tie_weights=False, strict=False)
