"""``loss.backward()`` through a pipelined :meth:`RoundPipe.forward`: its
:class:`~roundpipe.runtime.call.PipelinedCall`.

The forward ran with ``record=True``, so the host store holds what the backward stages
need.  The merged outputs go through the shared
:class:`~roundpipe.runtime.call.PipelinedFunction`, whose backward splits the output
gradients per microbatch and runs ``run_backward``: the backward jobs (the tail is
recomputed like any backward stage), with the parameter gradients committed to the
masters.  The gradients of inputs that require them are joined from their microbatch
pieces.

The trainable parameters are inputs of the Function too, though their values never go
through it: so the engine can say which gradients the running backward asks for
(:func:`~roundpipe.runtime.call.grad_targets`).  ``torch.autograd.grad(out, x)`` and
``backward(inputs=[x])`` then commit no parameter gradient, ``backward(inputs=[p])``
commits only ``p``'s, and ``torch.autograd.grad(out, p)`` returns ``p``'s without
committing it, as in eager PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from .errors import InputGradientError, ModelError, ParameterHookError
from .runtime.call import (GradTarget, PipelinedCall, SavedVersions, pipelined,
                           refuse_modified_since, saved_versions)
from .runtime.host_state import fold_unit_grads
from .runtime.microbatch import MergeColumn, input_path, join_input_grad
from .runtime.signature import flat_leaves

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ModelProgram
    from .runtime.executor import RunResult


@dataclass(frozen=True)
class GradRequest:
    """What one backward through a pipelined forward asks for.

    Attributes:
        only: the input values and parameter slots whose gradients to compute (None:
            every one).
        commit: the parameter slots whose gradients land in the masters; the others
            computed (``autograd.grad`` returns them) are left in the result.
        handed: hooked parameter slots whose gradient goes to autograd (no masters):
            each must get one, or autograd calls its hooks with None.
    """

    only: frozenset[str] | None
    commit: frozenset[str] | None
    handed: frozenset[str] = frozenset()


class _ForwardCall(PipelinedCall):
    """A ``RoundPipe.forward`` call whose forward already ran; what its backward needs."""

    def __init__(self, run_backward: Callable[[list[dict[str, torch.Tensor]], GradRequest],
                                              RunResult],
                 columns: list[MergeColumn], out_tensors: list[torch.Tensor],
                 grad_inputs: list[tuple[str, list[Any] | None]],
                 params: list[tuple[str, torch.Tensor]], fqns: dict[str, str],
                 hooked_to_autograd: bool, reread: SavedVersions = ()) -> None:
        self._run_backward = run_backward
        self.reread = reread  # what the recompute reads again, as the forward left it
        self.fqns = fqns  # slot -> parameter name, for messages
        # No masters: a hooked parameter's gradient goes to autograd, which sums its uses,
        # runs its hooks once and accumulates it in .grad (the master's), as eager does.
        self.hooked_to_autograd = hooked_to_autograd
        self.handed: frozenset[str] = frozenset()  # this backward's such parameters
        self.columns = columns  # the merged values connected to the backward
        self.out_tensors = out_tensors
        # (value name, its microbatch pieces or None if replicated) per input needing grad
        self.grad_inputs = grad_inputs
        self.params = params  # (slot, parameter) connected after the inputs

    def run_forward(self, needs_input_grad: Sequence[bool]
                    ) -> tuple[list[torch.Tensor], list[MergeColumn], list[int]]:
        outs = [t.detach() for t in self.out_tensors]
        self.out_tensors = []
        return outs, self.columns, []

    def run_backward(self, output_grads: list[dict[str, torch.Tensor]],
                     targets: Sequence[GradTarget], *, plain: bool) -> RunResult:
        refuse_modified_since(self.reread)
        n = len(self.grad_inputs)
        inputs, params = targets[:n], targets[n:]
        handed = set()
        for (slot, param), t in zip(self.params, params):
            if not (t is GradTarget.FLOWS and _has_hooks(param)):
                continue
            if self.hooked_to_autograd:
                handed.add(slot)
                continue
            # With masters, connected because it had no hooks at the call: the engine
            # runs the hooks registered since itself, once roundpipe has committed
            # everything (a tensor hook with None, as this Function hands it None; a
            # post-accumulate-grad hook a second time, after roundpipe's commit ran it).
            raise ParameterHookError(
                f"parameter {self.fqns.get(slot, slot)!r} got a hook after the pipelined "
                "call whose backward is running; with optim_dtype masters roundpipe reads "
                "a parameter's hooks when the call runs, and autograd would call this one "
                "with None or twice. Nothing was computed or committed. Register the hook "
                "before calling the pipe")
        self.handed = frozenset(handed)
        asked = {slot: t for (slot, _), t in zip(self.params, params)
                 if t is not GradTarget.NONE}
        if plain and not handed:
            request = GradRequest(None, None)  # every gradient, committed, as always
        elif plain:  # every parameter is connected (no masters)
            request = GradRequest(None, frozenset(s for s, _ in self.params
                                                  if s not in handed), self.handed)
        else:
            # With masters, a parameter left unconnected (it has hooks of its own) is
            # committed by a plain backward() only: the engine cannot say whether one
            # that names its inputs names it.
            request = GradRequest(
                only=frozenset([name for (name, _), t in zip(self.grad_inputs, inputs)
                                if t is not GradTarget.NONE] + list(asked)),
                commit=frozenset(s for s, t in asked.items()
                                 if t is GradTarget.FLOWS and s not in handed),
                handed=self.handed)
        return self._run_backward(output_grads, request)

    def input_grads(self, result: RunResult, targets: Sequence[GradTarget]
                    ) -> list[torch.Tensor | None]:
        per_mb = result.input_grads or []
        n = len(self.grad_inputs)
        grads: list[torch.Tensor | None] = [
            join_input_grad([g.get(name) for g in per_mb], split)
            if t is not GradTarget.NONE else None
            for (name, split), t in zip(self.grad_inputs, targets[:n])]
        for (slot, param), t in zip(self.params, targets[n:]):
            # Returned to autograd.grad, or to autograd's accumulation of a hooked
            # parameter (what else flows was committed, not returned).
            contributions = result.param_grads.get(slot)
            grads.append(fold_unit_grads(contributions, param.dtype)
                         if (t is GradTarget.RETURNED or slot in self.handed)
                         and contributions else None)
        return grads


def _has_hooks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_backward_hooks", None)
                or getattr(param, "_post_accumulate_grad_hooks", None))


def attach_backward(run_backward: Callable[[list[dict[str, torch.Tensor]], GradRequest],
                                           RunResult],
                    program: ModelProgram, params: Sequence[tuple[str, torch.Tensor]],
                    full_inputs: tuple[tuple[Any, ...], dict[str, Any]], mbs: list,
                    columns: list[MergeColumn], merged: list[Any],
                    build: Callable[[list[Any]], Any], *, masters: bool = True,
                    reread: SavedVersions = ()) -> Any:
    """The call's outputs, ``build(merged)``, with the merged floating tensors (one per
    ``columns`` entry) connected to a pipelined backward first.

    ``run_backward(output_grads, request)`` runs the backward jobs for the per-microbatch
    output gradients, commits the parameter gradients the :class:`GradRequest` commits
    and returns the executor's result, its ``param_grads`` those not committed (whose
    input gradients flow back to the inputs that require them).  ``params``: (slot,
    tensor) of the program's parameters.  ``masters``: the pipe has ``optim_dtype``
    masters (without, a hooked parameter's gradient is handed to autograd).  ``reread``:
    :func:`recompute_reads` at the forward's end, refused if changed at the backward.
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
    # Without masters (the parameters hold the gradients) a hooked parameter's gradient
    # is handed to autograd, which runs its hooks. With masters a parameter with hooks
    # of its own stays unconnected: the engine would call them with None (roundpipe
    # runs them where the gradients land).
    trainable = [(slot, p) for slot, p in params if p.requires_grad]
    connected = trainable if not masters else \
        [(slot, p) for slot, p in trainable if not _has_hooks(p)]

    values = [j for j, v in enumerate(merged) if isinstance(v, torch.Tensor)]
    call = _ForwardCall(run_backward, [columns[j] for j in values],
                        [merged[j] for j in values], grad_inputs, connected,
                        {spec.name: spec.fqn for spec in program.state}, not masters,
                        reread)
    outs = pipelined(call, grad_tensors + [p for _, p in connected])
    result = list(merged)
    for j, out in zip(values, outs):
        result[j] = out
    return build(result)


def recompute_reads(program: ModelProgram, tensors: Mapping[str, torch.Tensor],
                    full_inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> SavedVersions:
    """The versions, as the forward left them, of what the backward's recompute reads
    again from where the user can write it: the parameters, the buffers the forward does
    not write (it stashes those it writes as they were) and the tensor inputs the
    program uses.  ``tensors``: state slot -> host tensor."""
    written = {s for u in program.units for s in u.mutated_state} | {
        slot for slot, _ in program.buffer_updates}
    state = [(f"{spec.kind} {spec.fqn!r}", tensors[spec.name]) for spec in program.state
             if spec.kind == "parameter" or (spec.kind == "buffer"
                                             and spec.name not in written)]
    leaves = flat_leaves(program.inputs, *full_inputs) or []
    used = {id(leaf) for pos, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and program.inputs.names[pos] is not None}
    inputs = [(input_path(path), v)
              for path, v in pytree.tree_flatten_with_path(full_inputs)[0]
              if isinstance(v, torch.Tensor) and id(v) in used]
    return saved_versions(state + inputs)


def refuse_hooks_split_by_microbatches(model: torch.nn.Module, program: ModelProgram,
                                       microbatches: int) -> None:
    """``pipe(x)`` + ``backward()`` is one eager backward of the whole batch: a tensor hook
    the forward registers, or a module backward hook (its module kept opaque), would run
    once per microbatch instead, on that microbatch's gradients."""
    hooks = program.tensor_hooks
    if hooks:
        raise ModelError(
            f"{type(model).__name__}'s forward registers a tensor hook in "
            f"{hooks[0]}; split into {microbatches} microbatches, a hook runs once "
            "per microbatch on that microbatch's gradient, where eager PyTorch "
            "runs it once on the whole batch's (a hook that counts, or mixes "
            "samples, would differ). Ways out: num_microbatch=1 for this call "
            "(RoundPipeRunConfig(num_microbatch=1), exact), or "
            "forward_backward(), which is eager's per-microbatch loop by "
            "definition")
    hooked = [name for name, m in model.named_modules()
              if name and (m._backward_hooks or m._backward_pre_hooks)]
    if hooked:
        raise ModelError(
            f"module '{hooked[0]}'" + (f" (and {len(hooked) - 1} more)" if len(hooked) > 1
                                       else "")
            + f" has a module backward hook; split into {microbatches} microbatches, it "
            "would run once per microbatch on that microbatch's gradients, where eager "
            "PyTorch runs it once on the whole batch's. Ways out: num_microbatch=1 for "
            "this call (RoundPipeRunConfig(num_microbatch=1), exact), or "
            "forward_backward(), which is eager's per-microbatch loop by definition")


def refuse_unjoinable_splits(program: ModelProgram,
                             full_inputs: tuple[tuple[Any, ...], dict[str, Any]],
                             mbs: list) -> None:
    """``pipe(x)``'s backward joins an input's microbatch gradients by concatenating them
    along dim 0 (the default split) or summing them (read whole): an input that requires
    grad and that ``split_input`` split otherwise (a callable's own pieces, another dim)
    would get a wrong gradient, or a shape error at the backward.  Refused before the
    forward runs."""
    full_leaves = flat_leaves(program.inputs, *full_inputs) or []
    mb_leaves = [flat_leaves(program.inputs, *mb) or [] for mb in mbs]
    for pos, leaf in enumerate(full_leaves):
        if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad
                and program.inputs.names[pos] is not None):
            continue
        pieces = [leaves[pos] if pos < len(leaves) else None for leaves in mb_leaves]
        if all(p is leaf for p in pieces) or _dim0_split(leaf, pieces):
            continue
        paths = pytree.tree_flatten_with_path(full_inputs)[0]
        name = next((input_path(path) for path, v in paths if v is leaf), "an input")
        raise InputGradientError(
            f"{name} requires grad and split_input split it into microbatches otherwise "
            "than along dim 0 (a callable's pieces, or another dim); the backward of "
            "pipe(x) joins an input's gradient from its microbatch pieces by "
            "concatenating them along dim 0, so it would be wrong. Nothing was run. Use "
            "forward_backward(), which sends the gradient back through the pieces "
            "themselves, split along dim 0, or pass the input detached")


def _dim0_split(leaf: torch.Tensor, pieces: Sequence[Any]) -> bool:
    """Whether ``pieces`` are ``leaf``'s dim-0 ``tensor_split`` views."""
    if leaf.dim() == 0:
        return False
    with torch.no_grad():
        expected = torch.tensor_split(leaf, len(pieces))
    return all(isinstance(p, torch.Tensor) and p.data_ptr() == e.data_ptr()
               and p.shape == e.shape and p.stride() == e.stride()
               for p, e in zip(pieces, expected))
