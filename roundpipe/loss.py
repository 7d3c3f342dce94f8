"""What ``forward_backward`` returns as its loss, and how a failing ``loss_fn`` is named.

The loss comes back after the backward has run on the devices: it is a value, with no
graph.  ``loss.backward()`` on a plain tensor would only say "element 0 of tensors does
not require grad", which reads as a bug in roundpipe; the returned tensor is therefore
of a subclass whose ``backward`` explains.  Everything else about it is a plain tensor:
ops on it, copies and pickles give plain tensors, and it prints as one.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import BackwardAlreadyRunError


class ForwardBackwardLoss(torch.Tensor):
    """The loss ``forward_backward`` returns (its backward has run already)."""

    # Ops on it give plain tensors (a sum of losses, a .detach(), a .clone()).
    __torch_function__ = torch._C._disabled_torch_function_impl

    def backward(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        raise BackwardAlreadyRunError(
            "forward_backward() already ran the backward: the gradients are in the "
            "masters' .grad (pipe.optim_parameters()) and the loss it returns is a value "
            "with no graph. Drop loss.backward() and step with pipe.step(...); to "
            "backpropagate yourself, call pipe(x) (pipe.forward), compute the loss, then "
            "loss.backward()")

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return repr(self.as_subclass(torch.Tensor))

    def __format__(self, format_spec: str) -> str:
        # Tensor.__format__ formats a 0-dim tensor as its float only when its type is
        # exactly Tensor; f"{loss:.3f}" would otherwise be a TypeError.
        return self.as_subclass(torch.Tensor).__format__(format_spec)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


def returned_loss(loss: torch.Tensor) -> torch.Tensor:
    return loss.as_subclass(ForwardBackwardLoss)


def sum_losses(losses: list[torch.Tensor | None]) -> torch.Tensor:
    """The call's loss: the microbatches' losses added in microbatch order, in float32 for
    half-precision losses (their sum would round at every addition); 0 for none."""
    values = [l for l in losses if l is not None]
    if not values:
        return torch.tensor(0.0)
    dtype = values[0].dtype
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    total = values[0].to(acc_dtype).reshape(())
    for v in values[1:]:
        total = total + v.to(acc_dtype).reshape(())
    return total


def mark_loss_fn_error(error: BaseException, *, label_given: bool) -> None:
    """Mark an exception ``loss_fn`` raised: the executor then names ``loss_fn`` (and the
    microbatch and device) rather than the stage it ran after, as the model ran fine."""
    try:
        error._roundpipe_in_loss_fn = (  # type: ignore[attr-defined]
            "" if label_given else
            "; forward_backward was called without label=, so loss_fn got label=None: pass "
            "label=... (split into microbatches as the inputs are) if it needs one")
    except (AttributeError, TypeError):  # an exception type without a __dict__
        pass
