"""Can one call of a Dynamo graph be split into microbatches?  The proof ``pipe(x)`` uses.

Splitting a call is exact when every sample of the batch is computed independently and
each output can be put back together: an output that keeps the batch dimension is
concatenated, a sum over the batch is summed, a mean over the batch is averaged with
weights ``b_i / B``.  The backend proves it with the same transfer functions and op table
as ``pipe(x)`` (:func:`roundpipe.passes.output_merge.propagate`): Dynamo's torch-level
graph is lowered to the ATen ops ``torch.export`` gives ``pipe(x)``
(``make_fx(pre_dispatch=True)`` on fake copies of the example inputs), with the batch
dimension of the split inputs symbolic, so a batch size baked into the graph (static
shapes: ``view(8, ...)``) shows as the symbol being fixed to a constant.

What the backend does not do that ``pipe(x)`` does: recompute mixed outputs in a tail.
Its outputs must be per sample, replicated, a sum or a mean over the batch (a scalar
``aten.sum`` / ``aten.mean`` of a batch value, a pointwise loss with ``reduction`` sum
or mean, a class loss with ``sum``, and scalar arithmetic on those that stays exact), or
a batch size times a constant; anything else, and any in-place buffer update or tensor
hook, makes the answer "one microbatch", with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                   StatelessSymbolicContext)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .dynamo import DynamoGraph, hook_sites, module_path
from .output_merge import R, S, propagate
from .trace import MODULE_PATH, MUTATES


@dataclass(frozen=True)
class BatchSplit:
    """How calls of one graph are split into microbatches.

    Attributes:
        inputs: user inputs split along dimension 0 (the others are passed whole to every
            microbatch).
        sizes: SymInt inputs recomputed per microbatch, as ``(name, tensor input, dim)``.
        outputs: per flat output, how microbatch results merge: an ``int`` dimension
            (concatenate), ``"sum"``, ``"mean"`` (weights ``b_i / B``) or ``"first"`` (the
            same in every microbatch).
        batch: the batch size of the example call.
    """

    inputs: tuple[str, ...]
    sizes: tuple[tuple[str, str, int], ...]
    outputs: tuple[int | str, ...]
    batch: int


def analyze_batching(dg: DynamoGraph) -> BatchSplit | str:
    """A :class:`BatchSplit` when splitting calls is provably exact, else the reason."""
    graph = dg.traced.graph_module.graph
    mutates = [n for n in graph.nodes if n.meta.get(MUTATES)]
    if mutates:
        return (f"{_op(mutates[0])} updates buffers in place (each microbatch "
                "would update them again)")
    hooks = hook_sites(graph)
    if hooks:
        return (f"{_op(hooks[0])} registers a tensor hook, which would run once "
                "per microbatch on its share of the gradient (eager runs it once, on the "
                "whole batch's)")
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    # The batch: the most common leading size among tensor arguments of the frame.
    candidates: dict[int, list[str]] = {}
    for p in dg.placeholders:
        node = by_name.get(p.name)
        value = node.meta.get("example_value") if node is not None else None
        if p.kind == "tensor" and p.local and isinstance(value, torch.Tensor) \
                and value.dim() >= 1 and _hint(value.shape[0]) is not None:
            candidates.setdefault(_hint(value.shape[0]), []).append(p.name)
    if not candidates:
        return "no input has a batch dimension"
    batch, split = max(candidates.items(), key=lambda kv: len(kv[1]))
    if batch < 2:
        return f"the batch has {batch} sample"
    sizes: list[tuple[str, str, int]] = []
    for p in dg.placeholders:
        if p.kind == "symint" and p.size_of is not None and p.size_of[1] == 0 \
                and dg.placeholders[p.size_of[0]].name in split and p.name in by_name:
            sizes.append((p.name, dg.placeholders[p.size_of[0]].name, 0))
    lowered = _lower(dg, split, dict((name, base) for name, base, _ in sizes))
    if isinstance(lowered, str):
        return lowered
    lowered, names = lowered
    states, sized = propagate(lowered.graph, {names[name]: 0 for name in split},
                              sizes=[names[name] for name, _, _ in sizes])
    rules: list[int | str] = []
    out_node = next(n for n in lowered.graph.nodes if n.op == "output")
    for value in out_node.args[0]:
        s = states.get(value, R) if isinstance(value, torch.fx.Node) else R
        if s == R:
            rules.append("first")
        elif s[0] == "B" and s[2] == 1:  # samples in blocks along s[1]: concatenate
            rules.append(s[1])
        elif s[0] == "M" and len(s) == 3:
            rules.append(s[2])
        elif s == S and value in sized.proportional:
            rules.append("sum")
        else:
            return s[1] if s[0] == "M" else (
                f"output {value.name} cannot be merged across microbatches (a number "
                "computed from the batch size or the sample numbers)")
    if not any(r != "first" for r in rules):
        return "no output depends on the batch"
    return BatchSplit(inputs=tuple(split), sizes=tuple(sizes), outputs=tuple(rules),
                      batch=batch)


def _lower(dg: DynamoGraph, split: list[str], sizes: dict[str, str]
           ) -> tuple[torch.fx.GraphModule, dict[str, str]] | str:
    """The graph as ATen ops, and its placeholders' names by ``dg``'s, traced on fake inputs
    whose split inputs have a symbolic batch dimension; the reason when that cannot be
    done or the trace fixes the batch to a constant."""
    traced = dg.traced
    gm = traced.graph_module
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    users = [n for n in nodes if n.name not in traced.state_tensors]
    examples = dict(zip((n.name for n in users), traced.example_inputs))
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    # Its cache costs more than it saves here (outputs rebuilt with symbolic sizes).
    mode.cache_enabled = False
    fakes: dict[str, Any] = {}
    for node in nodes:
        value = traced.state_tensors.get(node.name, examples.get(node.name))
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, FakeTensor):  # not expected: Dynamo hands real inputs
            value = torch.empty_strided([_hint(s) for s in value.shape],
                                        [_hint(s) for s in value.stride()],
                                        dtype=value.dtype, device=value.device)
        dims = [DimDynamic.DYNAMIC if node.name in split and i == 0 else DimDynamic.STATIC
                for i in range(value.dim())]
        fakes[node.name] = mode.from_tensor(
            value, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))
    args = []
    for node in nodes:
        if node.name in fakes:
            args.append(fakes[node.name])
        elif node.name in sizes:
            args.append(fakes[sizes[node.name]].shape[0])
        else:
            example = examples.get(node.name, node.meta.get("example_value"))
            args.append(_hint(example) if isinstance(example, torch.SymInt) else example)

    # Python numbers Dynamo passes as 0-dim tensors (a module's dropout p or eps): their
    # values, not data-dependent symbols (``p < 0`` could not be decided).
    numbers = {n.name: examples[n.name].item() for n in users
               if isinstance(examples.get(n.name), torch.Tensor) and n.name not in split
               and examples[n.name].dim() == 0}

    fixed: list[torch.fx.Node] = []  # the node whose trace fixed the batch size

    class Lowering(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op == "call_method" and n.target == "item" and n.args[0].name in numbers:
                return numbers[n.args[0].name]
            out = super().run_node(n)
            if not fixed and any(_constant(fakes[name]) for name in split):
                fixed.append(n)
            return out

    def run(*flat: Any) -> Any:
        return Lowering(gm).run(*flat)
    try:
        with fx_traceback.preserve_node_meta(), mode:
            lowered = make_fx(run, pre_dispatch=True)(*args)
    except Exception as e:  # noqa: BLE001 - an op without a fake kernel, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return (f"the graph could not be traced to ATen ops to prove a split "
                f"({type(e).__name__}: {first})")
    if fixed:
        return (f"{_op(fixed[0])} fixes the batch size to the constant "
                f"{_hint(fakes[split[0]].shape[0])} (a size baked into the graph: static "
                "shapes' view(8, ...), or a replicated tensor as long as the batch that "
                "broadcasts against it); compile with dynamic=True, or mark the batch "
                "dimension dynamic, to microbatch it")
    for node in lowered.graph.nodes:
        if node.op == "call_function":
            node.meta[MODULE_PATH] = module_path(node)
    placeholders = [n.name for n in lowered.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(nodes):  # never expected: make_fx keeps every input
        return f"the graph's {len(nodes)} inputs were traced as {len(placeholders)}"
    return lowered, dict(zip((n.name for n in nodes), placeholders))


def _constant(fake: torch.Tensor) -> bool:
    size = fake.shape[0]
    return not isinstance(size, torch.SymInt) or bool(size.node.expr.is_number)


def _hint(size: Any) -> int | None:
    """A size as the example call's int (dynamic sizes are SymInts)."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _op(node: torch.fx.Node) -> str:
    """An op as a reason names it, on one short line: ``add_ (add, in module 'bn')``."""
    if node.op == "call_method":
        name = f".{node.target}()"
    else:
        name = getattr(node.target, "__name__", None) or str(node.target)
    where = node.meta.get(MODULE_PATH)
    return f"{name} ({node.name}" + (f", in module {where!r})" if where else ")")


def written_buffers(traced: Any) -> str:
    """The buffers a graph writes in place, by name (a few, then how many more); empty
    when it writes none.  (Each microbatch would write them again: such a graph runs as
    one microbatch.)"""
    fqn = {s.name: s.fqn for s in traced.state}
    names = list(dict.fromkeys(fqn.get(m, m) for n in traced.graph_module.graph.nodes
                               for m in n.meta.get(MUTATES, ())))
    if len(names) > 3:
        return f"{', '.join(names[:3])} and {len(names) - 3} more buffers"
    return ", ".join(names)
