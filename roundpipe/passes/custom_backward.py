"""User ``torch.autograd.Function``\\ s with their own backward, refused while exporting.

Non-strict export writes a Function's forward out as plain operations, and the program
is then differentiated through them: the Function's own backward is dropped without a
word (a straight-through estimator's gradient becomes zero, a surrogate gradient becomes
the true one).  While export runs, a call of such a Function raises
:class:`CustomBackwardFunction` inside the module that made it; the trace pass then keeps
that module opaque (see :mod:`roundpipe.passes.leaves`), so it runs eagerly and autograd
calls the Function's backward as in eager PyTorch.  The ``torch.fx`` fallback is refused
the same way: symbolic tracing runs the Function's forward on proxies and records its
operations, so its backward would be dropped there too.

torch's own Functions are left alone (their backward is the derivative of their
forward), except reentrant ``torch.utils.checkpoint``, whose forward runs under
``no_grad``: exported, the checkpointed parameters would get no gradient.  So are calls in
the model's own ``no_grad`` regions.  Export runs with grad enabled (a first call under
``torch.no_grad()`` makes the program later training reuses), and a Function is refused
whenever a floating-point tensor reaches it, whether or not it requires grad now (frozen
parameters may be unfrozen without a new trace).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree


class CustomBackwardFunction(Exception):
    """A user autograd.Function ran while exporting (the module that called it is kept
    opaque)."""

    def __init__(self, function: type) -> None:
        super().__init__(
            f"{function.__module__}.{function.__qualname__} is a torch.autograd.Function "
            "with a backward of its own, which tracing would replace by the derivative of "
            "its forward")
        self.function = function


def _needs_own_backward(function: type, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> bool:
    module = function.__module__ or ""
    if module.split(".")[0] == "torch" and function.__name__ != "CheckpointFunction":
        return False
    # A torch.fx Proxy (the fallback tracer's values) carries no dtype: counted too.
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.fx.Proxy)
        or isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
        for x in pytree.tree_leaves((args, kwargs)))


@contextlib.contextmanager
def refuse_custom_backward() -> Iterator[None]:
    """While active (and grad enabled), user Functions called on this thread with
    floating-point inputs raise :class:`CustomBackwardFunction`; other threads (a pipe
    training meanwhile) are not affected."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]
    tracing = threading.get_ident()

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == tracing and _needs_own_backward(cls, args, kwargs):
            raise CustomBackwardFunction(cls)
        return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        base.apply = original  # type: ignore[method-assign]
