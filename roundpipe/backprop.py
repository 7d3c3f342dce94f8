"""``loss.backward()`` through a pipelined :meth:`RoundPipe.forward`.

The forward ran with ``record=True``, so the host store holds what the backward stages
need.  The merged outputs are returned through an ``autograd.Function`` whose backward
splits the output gradients per microbatch (the inverse of the merge), runs the backward
jobs (the tail is recomputed like any backward stage), commits parameter gradients to the
masters and returns the gradients of inputs that require them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .runtime.microbatch import MergeColumn
from .runtime.signature import flat_leaves

if TYPE_CHECKING:  # pragma: no cover
    from .api import RoundPipe, _Compiled
    from .config import ResolvedRunConfig
    from .runtime.executor import RunResult
    from .ops.rng import RngKey


class _Context:
    """Everything the backward needs from the forward call."""

    def __init__(self, pipe: RoundPipe, entry: _Compiled, result: RunResult,
                 columns: list[MergeColumn], cfg: ResolvedRunConfig,
                 keys: list[RngKey | None], grad_inputs: list[tuple[str, bool]]) -> None:
        self.pipe = pipe
        self.entry = entry
        self.stash = result.stash
        self.columns = columns  # the merged values connected to the backward
        self.cfg = cfg
        self.keys = keys
        self.grad_inputs = grad_inputs  # (value name, was split) per input requiring grad
        self.version = pipe._state.fences.target
        self.autocast = pipe._autocast()


class _PipelineBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, context: _Context, anchor: torch.Tensor, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.context = context  # anchor and tensors only connect the graph
        outs = tuple(t.detach() for t in context.out_tensors)  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        context: _Context = ctx.context
        if context.stash is None:
            raise RuntimeError("this forward was not recorded for backward")
        program = context.entry.plan.program
        num_mb = len(context.columns[0].pieces) if context.columns else 0
        output_grads: list[dict[str, torch.Tensor]] = [{} for _ in range(num_mb)]
        for column, grad in zip(context.columns, grads):
            if grad is None or column.value is None:
                continue
            for mb, piece in enumerate(_split_grad(grad, column.rule, column.pieces)):
                if piece is None:
                    continue
                store = output_grads[mb]
                value = column.value
                store[value] = store[value] + piece if value in store else piece
        pipe = context.pipe
        pipe._check_open()
        with pipe._lock, pipe._replica_call() as dp_call:
            entry = context.entry
            on_grads = dp_call.bind(entry.host, program.units) if dp_call else None
            result = entry.executor.backward(
                context.stash, output_grads, grain=context.cfg.recompute_grain,
                keys=context.keys, fence_version=context.version, autocast=context.autocast,
                on_grads=on_grads)
            pipe._optimizer.wait()
            if dp_call is not None:  # all-reduced across replicas before anything commits
                dp_call.complete(result, None)
            pipe._finish(entry, result, count_call=False)
            if dp_call is not None:
                pipe._sync_replica_buffers(entry)
        context.stash = None  # a second backward through the same graph is an error
        input_grads: list[torch.Tensor | None] = []
        for name, was_split in context.grad_inputs:
            pieces = [g.get(name) for g in result.input_grads or []]
            if all(p is None for p in pieces):
                input_grads.append(None)
            elif was_split:
                input_grads.append(torch.cat([p for p in pieces if p is not None]))
            else:
                total = None
                for p in pieces:
                    if p is not None:
                        total = p if total is None else total + p
                input_grads.append(total)
        return (None, None, *input_grads)


def _split_grad(grad: torch.Tensor, rule: Any, per_mb: list[Any]) -> list[torch.Tensor | None]:
    if rule == "sum":
        return [grad] * len(per_mb)
    if rule == "stack":
        return list(grad.unbind(0))
    if rule == "first":
        return [grad] + [None] * (len(per_mb) - 1)
    sizes = [t.shape[rule] for t in per_mb]
    return list(torch.split(grad, sizes, dim=rule))


def attach_backward(pipe: RoundPipe, entry: _Compiled, result: RunResult,
                    full_inputs: tuple[tuple[Any, ...], dict[str, Any]], mbs: list,
                    columns: list[MergeColumn], merged: list[Any],
                    build: Callable[[list[Any]], Any], cfg: ResolvedRunConfig,
                    keys: list[RngKey | None]) -> Any:
    """The call's outputs, ``build(merged)``, with the merged floating tensors (one per
    ``columns`` entry) connected to a pipelined backward first."""
    program = entry.plan.program

    full_leaves = flat_leaves(program.inputs, *full_inputs) or []
    grad_inputs: list[tuple[str, bool]] = []
    grad_tensors: list[torch.Tensor] = []
    first_mb_leaves = flat_leaves(program.inputs, *mbs[0]) or []
    for pos, leaf in enumerate(full_leaves):
        name = program.inputs.names[pos]
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and name is not None:
            was_split = first_mb_leaves[pos] is not leaf
            grad_inputs.append((name, was_split))
            grad_tensors.append(leaf)

    connected = [j for j, v in enumerate(merged) if isinstance(v, torch.Tensor)]
    context = _Context(pipe, entry, result, [columns[j] for j in connected], cfg, keys,
                       grad_inputs)
    context.out_tensors = [merged[j] for j in connected]  # type: ignore[attr-defined]
    anchor = torch.empty(0, requires_grad=True)
    outs = _PipelineBackward.apply(context, anchor, *grad_tensors)
    values = list(merged)
    for j, out in zip(connected, outs):
        values[j] = out
    return build(values)

