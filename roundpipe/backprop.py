"""``loss.backward()`` through a pipelined :meth:`RoundPipe.forward`: its
:class:`~roundpipe.runtime.call.PipelinedCall`.

The forward ran with ``record=True``, so the host store holds what the backward stages
need.  The merged outputs go through the shared
:class:`~roundpipe.runtime.call.PipelinedFunction`, whose backward splits the output
gradients per microbatch and runs ``run_backward``: the backward jobs (the tail is
recomputed like any backward stage), with the parameter gradients committed to the
masters.  The gradients of inputs that require them are joined from their microbatch
pieces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .runtime.call import PipelinedCall, PipelinedFunction
from .runtime.microbatch import MergeColumn, join_input_grad
from .runtime.signature import flat_leaves

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ModelProgram
    from .runtime.executor import RunResult


class _ForwardCall(PipelinedCall):
    """A ``RoundPipe.forward`` call whose forward already ran; what its backward needs."""

    def __init__(self, run_backward: Callable[[list[dict[str, torch.Tensor]]], RunResult],
                 columns: list[MergeColumn], out_tensors: list[torch.Tensor],
                 grad_inputs: list[tuple[str, list[Any] | None]]) -> None:
        self._run_backward = run_backward
        self.columns = columns  # the merged values connected to the backward
        self.out_tensors = out_tensors
        # (value name, its microbatch pieces or None if replicated) per input needing grad
        self.grad_inputs = grad_inputs

    def run_forward(self, needs_input_grad: Sequence[bool]
                    ) -> tuple[list[torch.Tensor], list[MergeColumn], list[int]]:
        outs = [t.detach() for t in self.out_tensors]
        self.out_tensors = []
        return outs, self.columns, []

    def run_backward(self, output_grads: list[dict[str, torch.Tensor]]) -> RunResult:
        return self._run_backward(output_grads)

    def input_grads(self, result: RunResult, needs_input_grad: Sequence[bool]
                    ) -> list[torch.Tensor | None]:
        per_mb = result.input_grads or []
        # The first input is the anchor, which only connects the graph.
        return [None] + [join_input_grad([g.get(name) for g in per_mb], split)
                         for name, split in self.grad_inputs]


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
    call = _ForwardCall(run_backward, [columns[j] for j in connected],
                        [merged[j] for j in connected], grad_inputs)
    # The anchor connects the outputs to autograd even where no input requires grad.
    anchor = torch.empty(0, requires_grad=True)
    outs = PipelinedFunction.apply(call, anchor, *grad_tensors)
    values = list(merged)
    for j, out in zip(connected, outs):
        values[j] = out
    return build(values)
