"""Tensor hooks a model registers in its forward (``h.register_hook(fn)``), at run time.

Eager PyTorch registers such a hook on every forward and runs it once, in that forward's
backward.  A pipeline runs a unit's forward without autograd (forward jobs, under
``no_grad``) and again with it where the backward needs the graph (the fused job, or the
recompute of a backward job): the hook belongs on the graph the backward walks, so it is
registered where the tensor requires grad and skipped where it does not.  It then fires
once per microbatch and backward, where eager's per-microbatch loop fires it.

* :func:`register_tensor_hook` is what a traced program calls where the forward
  registered a hook (export's graph: the user's function; Dynamo's: its traced body);
* opaque modules whose Python registers hooks (``call_module_functional``) run under
  :func:`skipping_graphless_hooks`, so the registration in a forward job is skipped
  instead of failing ("cannot register a hook on a tensor that doesn't require gradient").

Fake and meta tensors (the memory replay, cost estimates) never get a hook: a hook with a
side effect (a counter) must not run for them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle


def _graphless(tensor: torch.Tensor) -> bool:
    """No backward will reach a hook on ``tensor`` (or it is not a real tensor)."""
    if not tensor.requires_grad or tensor.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import is_fake
    return bool(is_fake(tensor))


class HookFunction(torch.nn.Module):
    """A user's hook function, held by a program as a submodule (what ``get_attr`` can
    name); never called as a module."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def register_tensor_hook(tensor: torch.Tensor, hook: Callable[..., Any],
                         *freevars: Any) -> torch.Tensor:
    """Register ``hook`` on ``tensor`` where a backward will walk it; returns ``tensor``.

    ``freevars`` (Dynamo's hook bodies read the forward's values as extra arguments) are
    passed after the gradient.
    """
    if isinstance(hook, HookFunction):
        hook = hook.fn
    if not _graphless(tensor):
        if freevars:
            tensor.register_hook(lambda grad: hook(grad, *freevars))
        else:
            tensor.register_hook(hook)
    return tensor


# Export would drop a node with no users; this one registers a hook.
torch.fx.node.has_side_effect(register_tensor_hook)


class _SkipGraphlessHooks(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.Tensor.register_hook and _graphless(args[0]):
            return RemovableHandle(OrderedDict())
        return func(*args, **(kwargs or {}))


# Opaque modules whose forward registered a tensor hook when traced (their calls run under
# skipping_graphless_hooks; others run without the mode, which costs every op a Python call).
_HOOKING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def mark_hooking(module: torch.nn.Module) -> None:
    """``module``'s forward registers tensor hooks (seen when it was traced)."""
    _HOOKING.add(module)


def registers_hooks(module: torch.nn.Module) -> bool:
    return module in _HOOKING


@contextlib.contextmanager
def skipping_graphless_hooks() -> Iterator[None]:
    """While active on this thread, ``Tensor.register_hook`` on a tensor no backward
    reaches (computed under ``no_grad``, fake) does nothing and returns a handle."""
    with _SkipGraphlessHooks():
        yield
