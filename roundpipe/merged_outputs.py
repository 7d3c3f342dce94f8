"""The outputs of a call split into microbatches, put back together as eager PyTorch
computes them on the whole batch.

``merge_plan`` asks the prover (``passes/output_merge.py``) how each output merges for
the way this call split its inputs, before the call runs, and refuses what has no exact
merge; ``output_columns`` / ``merged_outputs`` build the outputs from the microbatches'
results (``runtime/microbatch.py``), re-running an output tail on the whole batch where
the plan has one.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.utils._pytree as pytree

from .config import ResolvedRunConfig
from .errors import MergeError
from .passes.output_merge import plan_output_merge
from .plan import InputSignature, OutputMergePlan
from .runtime.microbatch import (MergeColumn, merge_columns, merge_rules, merged_value,
                                 output_names, run_tail)
from .runtime.signature import flat_leaves, leading_size

if TYPE_CHECKING:  # pragma: no cover
    from .programs import CompiledProgram
    from .runtime.executor import RunResult


def merge_plan(entry: CompiledProgram, args: tuple[Any, ...], kwargs: dict[str, Any],
               mbs: list, cfg: ResolvedRunConfig, strict: bool = True
               ) -> OutputMergePlan | None:
    """How this call's outputs merge exactly (passes/output_merge.py), checked before
    the call runs; None where the user's ``merge_output`` decides, or for one
    microbatch (nothing to merge).  ``strict``: an output with no exact merge is an
    error (``pipe(x)``); else it keeps per-microbatch results, concatenated (the
    outputs of ``forward_backward``, whose loss is per microbatch too)."""
    if cfg.merge_output is not None or len(mbs) == 1:
        return None
    program = entry.plan.program
    split = split_dims(program.inputs, (args, kwargs), mbs[0])
    key = tuple(sorted(split.items(), key=str))
    plan = entry.merge_plans.get(key)
    if plan is None:
        available = frozenset(v for u in program.units for v in u.outputs) | frozenset(
            n for n in program.inputs.names if n is not None)
        plan = plan_output_merge(entry.analysis.traced, split, available)
        entry.merge_plans[key] = plan
    if plan.tail is not None:
        plan = _tail_within_guards(plan, program.inputs, (args, kwargs), split)
    refused = [(j, r) for j, r in enumerate(plan.rules) if r.kind == "none"]
    if (refused or plan.state_refusal) and strict:
        n = len(mbs)
        facts = []
        if refused:
            names = output_names(program.out_spec, len(program.outputs))
            j, rule = refused[0]
            facts.append(
                f"{names[j]} cannot be put back together from {n} microbatches exactly: "
                f"{rule.reason}. Eager PyTorch computes it on the whole batch; merging "
                "microbatch results would give another number")
        if plan.state_refusal:
            # A buffer write: eager makes it once per call (refused before anything runs).
            facts.append(
                ("Also, " if refused else f"this call cannot run as {n} microbatches "
                 "exactly: ") + f"{plan.state_refusal}. Eager PyTorch writes it once per "
                f"call, on the whole batch; each of the {n} microbatches would write it "
                "again. Nothing was run or written")
        raise MergeError(
            ". ".join(facts) + ". Ways out: num_microbatch=1 for this call (exact); "
            + ("model.eval() if the write happens only in training mode (BatchNorm's "
               "running statistics); " if plan.state_refusal else "")
            + "forward_backward(), whose loss is the sum of per-microbatch losses (and "
            "whose buffer writes are per microbatch) by definition; or, if "
            "per-microbatch results are what you want, RoundPipeRunConfig("
            "merge_output=...): 0 concatenates along dim 0, 'sum' adds, 'first' keeps "
            "the first microbatch's, or a pytree of those per output, or a callable "
            "over the list of per-microbatch outputs (buffers are then written per "
            "microbatch too)")
    return plan


def output_columns(entry: CompiledProgram, result: RunResult, mbs: list,
                   cfg: ResolvedRunConfig, plan: OutputMergePlan | None
                   ) -> tuple[list[MergeColumn], Callable[[list[Any]], Any]]:
    """The values to merge (columns) and how the outputs are built from them."""
    program = entry.plan.program
    outputs = result.outputs or []
    device = cfg.output_device
    if plan is None:  # the user's merge spec, or one microbatch
        per_mb = [pytree.tree_unflatten(o, program.out_spec) for o in outputs]
        sizes = [leading_size(a, k) for a, k in mbs]
        rules = merge_rules(per_mb, sizes, cfg.merge_output)
        columns = [MergeColumn(ref.value, rule, [o[j] for o in outputs])
                   for j, (ref, rule) in enumerate(zip(program.outputs, rules))]
        return columns, lambda values: pytree.tree_unflatten(values, program.out_spec)
    direct, tail_inputs = merge_columns(plan, outputs, result.values, program.outputs,
                                        device)
    if any(r.kind == "none" for r in plan.rules):  # per-microbatch results (not strict)
        per_mb = [pytree.tree_unflatten(o, program.out_spec) for o in outputs]
        sizes = [leading_size(a, k) for a, k in mbs]
        fallback = merge_rules(per_mb, sizes, None)
        direct = [MergeColumn(ref.value, fallback[j], [o[j] for o in outputs])
                  if rule.kind == "none" else c
                  for j, (ref, rule, c) in enumerate(zip(program.outputs, plan.rules,
                                                         direct))]
    columns = [c for c in direct if c is not None] + tail_inputs
    tail = plan.tail

    def build(values: list[Any]) -> Any:
        flat: list[Any] = []
        it = iter(values[:len(columns) - len(tail_inputs)])
        for c in direct:
            flat.append(None if c is None else next(it))
        if tail is not None:
            state = {slot: entry.host.tensors[slot] for slot in tail.program.state}
            for j, value in zip(tail.outputs,
                                run_tail(tail, values[len(values) - len(tail_inputs):],
                                         state, device)):
                flat[j] = value
        return pytree.tree_unflatten(flat, program.out_spec)
    return columns, build


def merged_outputs(entry: CompiledProgram, result: RunResult, mbs: list,
                   cfg: ResolvedRunConfig, plan: OutputMergePlan | None) -> Any:
    """The call's outputs, merged on ``cfg.output_device`` (or the user's callable's)."""
    if callable(cfg.merge_output):
        outputs = [pytree.tree_unflatten(o, entry.plan.program.out_spec)
                   for o in result.outputs or []]
        return cfg.merge_output(outputs)
    columns, build = output_columns(entry, result, mbs, cfg, plan)
    return build([merged_value(c, cfg.output_device) for c in columns])


def tail_values(plan: OutputMergePlan | None) -> frozenset[str]:
    """The values an output tail reads, kept per microbatch by the executor."""
    if plan is None or plan.tail is None:
        return frozenset()
    return frozenset(value for value, _, _ in plan.tail.inputs)


def _tail_within_guards(plan: OutputMergePlan, sig: InputSignature,
                        full: tuple[tuple[Any, ...], dict[str, Any]],
                        split: dict[str, int | None]) -> OutputMergePlan:
    """The output tail reruns part of the program on the whole batch; the trace may have
    fixed or bounded the batch dimension (``x[:3]`` traced at a microbatch of 2 is no slice
    at all), so a whole batch outside those guards cannot run it: such outputs are
    refused rather than computed by a program made for other shapes."""
    for name, value, spec in zip(sig.names, flat_leaves(sig, *full) or [], sig.static):
        d = split.get(name) if name is not None else None
        if d is None or not isinstance(value, torch.Tensor) or not (
                isinstance(spec, tuple) and len(spec) == 3 and spec[0] == "tensor"):
            continue
        size, bound = value.shape[d], spec[2][d]
        fixed = isinstance(bound, int) and bound != size
        outside = isinstance(bound, tuple) and (size < bound[0] or (
            bound[1] is not None and size > bound[1]))
        if fixed or outside:
            reason = (f"it is recomputed on the whole batch after the pipeline, but the "
                      f"program was traced for {name}'s dimension {d} "
                      f"{'fixed at' if fixed else 'within'} {bound} (the trace specialised "
                      f"on the microbatch's size), and the whole batch has {size}")
            rules = tuple(dataclasses.replace(r, kind="none", reason=reason)
                          if r.kind == "tail" else r for r in plan.rules)
            return dataclasses.replace(plan, rules=rules, tail=None)
    return plan


def split_dims(sig: InputSignature, full: tuple[tuple[Any, ...], dict[str, Any]],
                first: tuple[tuple[Any, ...], dict[str, Any]]) -> dict[str, int | None]:
    """Which program inputs a call split, and along which dimension (None: split in a way
    that is not one dimension), read off the whole inputs and the first microbatch's."""
    whole = flat_leaves(sig, *full) or []
    piece = flat_leaves(sig, *first) or []
    split: dict[str, int | None] = {}
    for name, a, b in zip(sig.names, whole, piece):
        if name is None or a is b:
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim():
            dims = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
            split[name] = dims[0] if len(dims) == 1 else None
        else:
            split[name] = None
    return split
