"""The call layer both front ends (``RoundPipe`` and the ``torch.compile`` backend) share.

Per call, before the executor runs: the random-op keys of its microbatches, the caller's
autocast state, and the device memory cap.  Around autograd: one ``autograd.Function``
(:class:`PipelinedFunction`) over a :class:`PipelinedCall`, which each front end
implements.  Splitting inputs and merging outputs (and their gradients) live in
:mod:`.microbatch`; folding parameter gradients in :func:`.host_state.fold_unit_grads`.
"""

from __future__ import annotations

import abc
import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from ..errors import DoubleBackwardError, RoundPipeError
from ..ops.rng import RngKey
from .devices import Device
from .microbatch import MergeColumn, split_output_grads

if TYPE_CHECKING:  # pragma: no cover
    from .executor import RunResult


def microbatch_keys(seed: int, call: int, num_microbatch: int, *, enabled: bool = True,
                    first: int = 0) -> list[RngKey | None]:
    """The key of each microbatch's random ops in call number ``call``: they depend on
    the seed, the call and the microbatch only, never on the device that runs them, so
    results are bitwise the same on any number of devices.  ``first``: the number of
    this process's first microbatch in the global batch (data parallel replicas)."""
    if not enabled:
        return [None] * num_microbatch
    return [RngKey(seed, call, first + mb) for mb in range(num_microbatch)]


def autocast_state(devices: Sequence[Device]) -> tuple[str, torch.dtype] | None:
    """The caller's autocast state for the devices' type, replayed in worker threads
    (autocast is thread-local, and the stages run on the devices' threads)."""
    kind = devices[0].torch_device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return kind, torch.get_autocast_dtype(kind)


def memory_budget(devices: Sequence[Device], fraction: float) -> tuple[int | None, str]:
    """Bytes the plan may use on each device, ``fraction`` of the smallest free memory
    (one job at its peak and the weights prefetched for the next, together: the fraction
    is the only margin), and where that figure came from, for error messages.  (None,
    "") where a device cannot say how much is free."""
    free = [d.free_bytes() for d in devices]
    if any(f is None for f in free):
        return None, ""
    i = min(range(len(free)), key=lambda k: free[k])  # type: ignore[arg-type,return-value]
    cap = int(free[i] * fraction)  # type: ignore[operator]
    return cap, (f"memory_fraction {fraction:g} of the {free[i] / 2**20:.1f} MiB measured "
                 f"free on {devices[i].name}")


def memory_cap(devices: Sequence[Device], fraction: float) -> int | None:
    """The cap of :func:`memory_budget` alone."""
    return memory_budget(devices, fraction)[0]


# --- autograd ------------------------------------------------------------------------------

class PipelinedCall(abc.ABC):
    """One call of a pipelined forward as autograd sees it.

    :class:`PipelinedFunction` drives it: ``run_forward`` when the function is applied,
    then, at ``backward()``, the output gradients split per microbatch (the inverse of the
    merge rules), ``run_backward`` with them, and ``input_grads`` of its result.  What a
    front end does with parameter gradients is its own: ``RoundPipe`` commits them to the
    masters (on the optimizer thread) inside ``run_backward``; the backend returns them
    from ``input_grads`` for the parameters Dynamo passed in, so autograd accumulates them.
    """

    @abc.abstractmethod
    def run_forward(self, needs_input_grad: Sequence[bool]
                    ) -> tuple[Sequence[torch.Tensor], Sequence[MergeColumn], Sequence[int]]:
        """The call's tensor outputs, the column each was merged from (same order) and
        the microbatch sizes.  ``needs_input_grad``: per tensor input of the function."""

    @abc.abstractmethod
    def run_backward(self, output_grads: list[dict[str, torch.Tensor]]) -> RunResult:
        """Run the backward jobs for these per-microbatch value gradients."""

    @abc.abstractmethod
    def input_grads(self, result: RunResult, needs_input_grad: Sequence[bool]
                    ) -> Sequence[torch.Tensor | None]:
        """The gradient of each tensor input of the function."""


def _first_order_only(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Refuse a backward that must build a graph (``create_graph=True``: the engine runs
    it in grad mode) before it runs anything.  ``once_differentiable`` alone would only
    fail at the second backward, after the first had committed its gradients."""
    @functools.wraps(backward)
    def checked(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            raise DoubleBackwardError(
                "double backward through a pipelined call is not supported: this backward "
                "was asked to build a graph (create_graph=True, as gradient penalties such "
                "as WGAN-GP's do with torch.autograd.grad(..., create_graph=True)), but "
                "roundpipe runs it as pipelined jobs on the devices, whose gradients "
                "carry no graph. Nothing was computed or committed, and a first-order "
                "backward of the same graph still works. Compute the penalty on a "
                "non-pipelined copy of the model (copy.deepcopy(model), loaded with the "
                "current weights), or with torch.func (torch.func.vjp/jacrev over "
                "torch.func.functional_call)")
        return backward(ctx, *grads)
    return checked


class PipelinedFunction(torch.autograd.Function):
    """``PipelinedFunction.apply(call, *tensor_inputs)``: the outputs of ``call`` connected
    to autograd.  The tensor inputs only say what needs a gradient (and connect the graph);
    the call reads its values itself."""

    @staticmethod
    def forward(ctx: Any, call: PipelinedCall, *inputs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        outs, columns, sizes = call.run_forward(ctx.needs_input_grad[1:])
        # An output the loss ignores gets None, not zeros: what only it reads then gets
        # no gradient, as in eager PyTorch.
        ctx.set_materialize_grads(False)
        ctx.call, ctx.columns, ctx.sizes = call, list(columns), list(sizes)
        ctx.mark_non_differentiable(*[o for o in outs
                                      if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    @_first_order_only  # its backward is not differentiable: refused, not first-order
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        call: PipelinedCall | None = ctx.call
        needs = ctx.needs_input_grad[1:]
        if call is None:
            raise RoundPipeError(
                "backward through a pipelined call ran twice; its stashed activations were "
                "freed after the first (retain_graph=True is not supported): run the "
                "forward again for a second backward")
        output_grads = split_output_grads(ctx.columns, grads, ctx.sizes)
        if not any(output_grads):  # no output depends on a value the pipeline made
            ctx.call = ctx.columns = None
            return (None,) * (1 + len(needs))
        result = call.run_backward(output_grads)
        ctx.call = ctx.columns = None  # the stash is freed; a second backward is an error
        return (None, *call.input_grads(result, needs))
