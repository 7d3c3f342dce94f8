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

from .errors import RoundPipeError
from .runtime.microbatch import MergeColumn, join_input_grad, split_grad
from .runtime.signature import flat_leaves

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ModelProgram
    from .runtime.executor import RunResult


class _Context:
    """Everything the backward needs from the forward call."""

    def __init__(self, run_backward: Callable[[list[dict[str, torch.Tensor]]], RunResult],
                 columns: list[MergeColumn],
                 grad_inputs: list[tuple[str, list[Any] | None]],
                 out_tensors: list[torch.Tensor]) -> None:
        self.run_backward: Callable[..., RunResult] | None = run_backward
        self.columns = columns  # the merged values connected to the backward
        # (value name, its microbatch pieces or None if replicated) per input needing grad
        self.grad_inputs = grad_inputs
        self.out_tensors = out_tensors


class _PipelineBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, context: _Context, anchor: torch.Tensor, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.context = context  # anchor and tensors only connect the graph
        outs = tuple(t.detach() for t in context.out_tensors)
        context.out_tensors = []
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        context: _Context = ctx.context
        run_backward = context.run_backward
        if run_backward is None:
            raise RoundPipeError(
                "backward through a pipelined forward ran twice; its stashed activations "
                "were freed after the first (retain_graph is not supported)")
        num_mb = len(context.columns[0].pieces) if context.columns else 0
        output_grads: list[dict[str, torch.Tensor]] = [{} for _ in range(num_mb)]
        for column, grad in zip(context.columns, grads):
            if grad is None or column.value is None:
                continue
            for mb, piece in enumerate(split_grad(grad, column.rule, column.pieces)):
                if piece is None:
                    continue
                store = output_grads[mb]
                value = column.value
                store[value] = store[value] + piece if value in store else piece
        result = run_backward(output_grads)
        context.run_backward = None  # a second backward through the same graph is an error
        input_grads = [join_input_grad([g.get(name) for g in result.input_grads or []], split)
                       for name, split in context.grad_inputs]
        return (None, None, *input_grads)


def attach_backward(run_backward: Callable[[list[dict[str, torch.Tensor]]], RunResult],
                    program: ModelProgram,
                    full_inputs: tuple[tuple[Any, ...], dict[str, Any]], mbs: list,
                    columns: list[MergeColumn], merged: list[Any],
                    build: Callable[[list[Any]], Any]) -> Any:
    """The call's outputs, ``build(merged)``, with the merged floating tensors (one per
    ``columns`` entry) connected to a pipelined backward first.

    ``run_backward(output_grads)`` runs the backward jobs for the per-microbatch output
    gradients, commits the parameter gradients and returns the executor's result (whose
    input gradients flow back to the inputs that require them).
    """
    full_leaves = flat_leaves(program.inputs, *full_inputs) or []
    grad_inputs: list[tuple[str, list[Any] | None]] = []
    grad_tensors: list[torch.Tensor] = []
    mb_leaves = [flat_leaves(program.inputs, *mb) or [] for mb in mbs]
    for pos, leaf in enumerate(full_leaves):
        name = program.inputs.names[pos]
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and name is not None:
            pieces = [leaves[pos] for leaves in mb_leaves]
            # split: each microbatch read its own rows; else each read the whole input
            grad_inputs.append((name, pieces if pieces[0] is not leaf else None))
            grad_tensors.append(leaf)

    connected = [j for j, v in enumerate(merged) if isinstance(v, torch.Tensor)]
    context = _Context(run_backward, [columns[j] for j in connected], grad_inputs,
                       [merged[j] for j in connected])
    anchor = torch.empty(0, requires_grad=True)
    outs = _PipelineBackward.apply(context, anchor, *grad_tensors)
    values = list(merged)
    for j, out in zip(connected, outs):
        values[j] = out
    return build(values)
