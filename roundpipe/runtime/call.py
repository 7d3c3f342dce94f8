"""The call layer both front ends (``RoundPipe`` and the ``torch.compile`` backend) share.

Per call, before the executor runs: the random-op keys of its microbatches, the caller's
autocast state, and the device memory cap.  Around autograd: one ``autograd.Function``
(:class:`PipelinedFunction`) over a :class:`PipelinedCall`, which each front end
implements.  Splitting inputs and merging outputs (and their gradients) live in
:mod:`.microbatch`; folding parameter gradients in :func:`.host_state.fold_unit_grads`.
"""

from __future__ import annotations

import abc
import enum
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch.autograd.function import once_differentiable

from ..errors import DoubleBackwardError, InputError, RoundPipeError
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

SavedVersions = tuple[tuple[str, torch.Tensor, int], ...]


def saved_versions(named: Iterable[tuple[str, torch.Tensor]]) -> SavedVersions:
    """(what, tensor, version) of each tensor a recorded forward's backward reads again:
    taken when the forward has ended, checked by :func:`refuse_modified_since` when its
    backward starts.  An inference tensor (an input made under ``torch.inference_mode()``)
    has no version counter: it cannot be written outside that mode, and is left out."""
    return tuple((what, t, t._version) for what, t in named if not t.is_inference())


def refuse_modified_since(saved: SavedVersions) -> None:
    """Refuse a backward whose recompute would read a tensor written in place since the
    forward (a weight an optimizer stepped, an input edited): it would compute with the
    new values, silently.  Eager autograd refuses it too ("one of the variables needed
    for gradient computation has been modified by an inplace operation")."""
    for what, t, version in saved:
        if t._version != version:
            raise InputError(
                f"{what} was modified in place between forward and backward (version "
                f"{version} -> {t._version}); roundpipe recomputes the forward from it "
                "in backward, so the gradients would be those of the new values (eager "
                "autograd refuses this too: a variable needed for gradient computation "
                "has been modified by an inplace operation). Nothing was computed or "
                "committed. Call backward() before changing it (e.g. before "
                "optimizer.step()), or run the forward again after the change")


class GradTarget(enum.Enum):
    """What the running backward does with the gradient of one input of a pipelined call
    (the engine knows which gradients the current ``backward()`` or
    ``torch.autograd.grad()`` asked for; the Function has to ask it, its
    ``needs_input_grad`` says only what *could* get a gradient)."""

    NONE = "none"          # not asked for: neither computed nor committed
    FLOWS = "flows"        # the engine uses it: passed on through the graph, or
    #                        accumulated into a leaf's .grad (backward(), backward(inputs=))
    RETURNED = "returned"  # a leaf whose gradient torch.autograd.grad() returns: nothing
    #                        may be accumulated for it


class PipelinedCall(abc.ABC):
    """One call of a pipelined forward as autograd sees it.

    :class:`PipelinedFunction` drives it: ``run_forward`` when the function is applied,
    then, at ``backward()``, the output gradients split per microbatch (the inverse of the
    merge rules), ``run_backward`` with them and the :class:`GradTarget` of each input,
    and ``input_grads`` of its result.  What a front end does with parameter gradients is
    its own: ``RoundPipe`` commits those that flow to the masters (on the optimizer
    thread) inside ``run_backward``; the backend returns them from ``input_grads`` for
    the parameters Dynamo passed in, so autograd accumulates them.
    """

    @abc.abstractmethod
    def run_forward(self, needs_input_grad: Sequence[bool]
                    ) -> tuple[Sequence[torch.Tensor], Sequence[MergeColumn], Sequence[int]]:
        """The call's tensor outputs, the column each was merged from (same order) and
        the microbatch sizes.  ``needs_input_grad``: per tensor input of the function."""

    @abc.abstractmethod
    def run_backward(self, output_grads: list[dict[str, torch.Tensor]],
                     targets: Sequence[GradTarget], *, plain: bool) -> RunResult:
        """Run the backward jobs for these per-microbatch value gradients, computing the
        gradients of the inputs whose target is not ``NONE`` (per tensor input).
        ``plain``: a plain ``backward()``, which asks for every gradient in the graph."""

    @abc.abstractmethod
    def input_grads(self, result: RunResult, targets: Sequence[GradTarget]
                    ) -> Sequence[torch.Tensor | None]:
        """The gradient to hand autograd for each tensor input of the function."""


def grad_targets(ctx: Any, needs: Sequence[bool]) -> tuple[list[GradTarget], bool]:
    """The :class:`GradTarget` of each input after the anchor, asked of the engine, and
    whether this is a plain ``backward()``.

    The Function's first tensor input is an anchor leaf nobody names in
    ``backward(inputs=)`` or ``autograd.grad``: when the engine will run its
    accumulator, this is a plain ``backward()``, which runs every node of the graph, and
    one question answers all.  Otherwise each input's node is asked (about 1 us each);
    the engine refuses to answer for a leaf ``autograd.grad`` captures, which is what it
    is then.
    """
    edges = ctx.next_functions  # one per tensor input, the anchor first
    if torch._C._will_engine_execute_node(edges[0][0]):
        return [GradTarget.FLOWS if n else GradTarget.NONE for n in needs], True
    targets: list[GradTarget] = []
    for need, (node, _) in zip(needs, edges[1:]):
        if not need or node is None:
            targets.append(GradTarget.NONE)
            continue
        try:
            wanted = torch._C._will_engine_execute_node(node)
        except RuntimeError:  # "a leaf node was passed ... running autograd.grad()"
            targets.append(GradTarget.RETURNED)
            continue
        targets.append(GradTarget.FLOWS if wanted else GradTarget.NONE)
    return targets, False


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
    """``PipelinedFunction.apply(call, anchor, *tensor_inputs)`` (see :func:`pipelined`):
    the outputs of ``call`` connected to autograd.  The tensor inputs only say what needs
    a gradient (and connect the graph); the call reads its values itself."""

    @staticmethod
    def forward(ctx: Any, call: PipelinedCall, anchor: torch.Tensor, *inputs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        outs, columns, sizes = call.run_forward(ctx.needs_input_grad[2:])
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
        needs = ctx.needs_input_grad[2:]
        if call is None:
            raise RoundPipeError(
                "backward through a pipelined call ran twice; its stashed activations were "
                "freed after the first (retain_graph=True is not supported): run the "
                "forward again for a second backward")
        targets, plain = grad_targets(ctx, needs)
        output_grads = split_output_grads(ctx.columns, grads, ctx.sizes)
        if not any(output_grads) or all(t is GradTarget.NONE for t in targets):
            # no output depends on a value the pipeline made, or nothing is asked for
            ctx.call = ctx.columns = None
            return (None,) * (2 + len(needs))
        result = call.run_backward(output_grads, targets, plain=plain)
        ctx.call = ctx.columns = None  # the stash is freed; a second backward is an error
        return (None, None, *call.input_grads(result, targets))


def pipelined(call: PipelinedCall, inputs: Sequence[torch.Tensor]
              ) -> tuple[torch.Tensor, ...]:
    """The outputs of ``call`` connected to autograd through ``inputs`` (those that need
    a gradient, parameters included): :class:`PipelinedFunction` with a fresh anchor,
    which also connects the outputs where no input requires grad."""
    anchor = torch.empty(0, requires_grad=True)
    return PipelinedFunction.apply(call, anchor, *inputs)
