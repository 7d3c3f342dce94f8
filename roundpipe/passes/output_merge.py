"""How ``pipe(x)`` puts each output back together from its microbatches, exactly.

A pipelined call runs the program on every microbatch; eager PyTorch runs it once on the
whole batch.  An output whose values are computed sample by sample is the concatenation
of its microbatch pieces.  One that mixes samples (``x.mean()``, a mean cross-entropy over
the tokens that are not ignored, ``x.shape[0]``) is not: adding or picking pieces gives a
different number.  This pass proves, node by node on the traced graph, what every value is
with respect to the batch:

* ``R``: does not depend on the split inputs (weights, constants, replicated inputs);
* ``B(d)``: a tensor whose dimension ``d`` runs over samples in contiguous blocks, every
  element computed from its own sample only;
* ``S``: an integer that depends on the batch size (``x.size(0)``);
* ``M``: anything else: it mixes samples, or the pass cannot prove it does not.

Outputs that are ``B(d)`` are concatenated along ``d`` and ``R`` ones are taken from the
first microbatch.  The rest are recomputed by a *tail*: the graph's nodes from the last
per-sample values to the output, run once on the concatenated values after the pipeline
(a mean loss is then the mean over the whole batch, as in eager).  A tail that would read
trainable parameters (samples mixed early in the model, e.g. BatchNorm in training mode)
is refused: the call cannot be split exactly, and the merge rule says why.

Only ops the pass knows are allowed on batch-dependent values; any other op makes its
result ``M``, and so do opaque (leaf) module calls, whose Python the graph does not hold.

The analysis (:func:`propagate`) is the batching proof of both front ends: the
``torch.compile`` backend runs it on its Dynamo graph lowered to the same ATen ops
(:mod:`roundpipe.passes.batching`).  It has no tail, so an ``M`` scalar that is a sum or
a mean over every sample is marked as such (its microbatches' values are added or
averaged), and an ``S`` that is the batch size times a constant as proportional.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.modcall import call_module_functional
from ..plan import MergeRule, OutputMergePlan, OutputRef, OutputTail
from .codegen import draws_random, tail_program
from .trace import MODULE_PATH, MUTATES, TracedGraph

R = ("R",)
S = ("S",)


_ONE = sympy.Integer(1)


def _b(d: int, m: Any = _ONE, k: Any = _ONE) -> tuple:
    """``B(d)``: dimension ``d`` has size ``m * batch * k`` and element ``i`` of it belongs
    to sample ``(i // k) % batch`` (``m = k = 1``: one row per sample; ``k = T``: rows of
    a ``(B * T, C)`` view; ``m = T``: rows of a ``(T * B, C)`` view, samples interleaved)."""
    return ("B", d, m, k)


def _i(d: int) -> tuple:
    """The sample number of every element along dimension ``d`` (``arange(B)``
    reshaped): an index that picks each sample's own rows out of a batch value."""
    return ("I", d, _ONE, _ONE)


def _kind(s: tuple, d: int) -> tuple:
    """A batch state like ``s`` (its kind and the layout of samples in its batch
    dimension), along dimension ``d``."""
    return (s[0], d) + tuple(s[2:])


def _rows(s: tuple, d: int | None = None) -> bool:
    """Whether ``s`` is ``B`` with one element per sample along its batch dimension (and
    that dimension is ``d``, when given)."""
    return (s[0] == "B" and (d is None or s[1] == d)
            and s[2] == _ONE and s[3] == _ONE)


class _Batch:
    """The batch size as shape algebra: one symbol for every split input's batch size
    (export gives each input a symbol of its own; the split makes them equal), sizes as
    sympy expressions, equality and exact division as polynomial identities (true for
    every batch size the program runs with)."""

    def __init__(self, sizes: Sequence[Any]) -> None:
        exprs = [self._raw(s) for s in sizes]
        self.size: Any = exprs[0] if exprs else None
        self.subs = {e: self.size for e in exprs[1:] if isinstance(e, sympy.Symbol)}
        # S values proportional to the batch (its size times a constant): a microbatch's
        # is its share, so they add up to the whole batch's.
        self.proportional: set[torch.fx.Node] = set()

    @staticmethod
    def _raw(size: Any) -> Any:
        if isinstance(size, torch.SymInt):
            return size.node.expr
        if isinstance(size, int):
            return sympy.Integer(size)
        return size

    def expr(self, size: Any) -> Any:
        e = self._raw(size)
        return e.subs(self.subs) if self.subs and hasattr(e, "subs") else e

    def same(self, a: Any, b: Any) -> bool:
        try:
            return sympy.expand(self.expr(a) - self.expr(b)) == 0
        except Exception:  # noqa: BLE001
            return False

    def quotient(self, a: Any, b: Any) -> Any:
        """``a / b`` when ``b`` divides ``a`` exactly (as polynomials), else None."""
        try:
            num, den = sympy.fraction(sympy.cancel(self.expr(a) / self.expr(b)))
        except Exception:  # noqa: BLE001
            return None
        return num if den == 1 else None

    def per_sample(self, size: Any) -> Any:
        """``size / batch`` when the batch divides ``size``, else None."""
        return None if self.size is None else self.quotient(size, self.size)


def _m(reason: str, merge: str | None = None) -> tuple:
    """``M``; ``merge``: a scalar that is a ``"sum"`` or a ``"mean"`` over every sample
    (the backend adds or averages its microbatches' values; ``pipe(x)`` recomputes it
    in a tail like any other mix)."""
    return ("M", reason) if merge is None else ("M", reason, merge)


class _Mixing(Exception):
    """An op makes its value mix samples (caught per node: the value becomes M)."""

    def __init__(self, reason: str, merge: str | None = None) -> None:
        super().__init__(reason)
        self.merge = merge


def plan_output_merge(traced: TracedGraph, split: Mapping[str, int | None],
                      available: frozenset[str] | None = None) -> OutputMergePlan:
    """The merge rule of every flat output when the inputs named in ``split`` are split
    along the given dimensions (None: split some other way; the other inputs are passed
    whole to every microbatch).  A tail reads only ``available`` values (what the
    microbatches return: unit outputs and inputs; default: any value), and recomputes
    the per-sample values between those and where samples mix."""
    graph = traced.graph_module.graph
    written: dict[str, list[torch.fx.Node]] = {}  # buffer slot -> the nodes writing it
    for node in graph.nodes:
        for name in node.meta.get(MUTATES, ()):
            written.setdefault(name, []).append(node)
    by_name = {n.name: n for n in graph.nodes}
    for slot, value in traced.buffer_updates:  # reassigned: the new value is the write
        if value in by_name:
            written.setdefault(slot, []).append(by_name[value])
    if traced.method == "fx":
        fqn = {s.name: s.fqn for s in traced.state}
        return OutputMergePlan(tuple(
            MergeRule("first") if ref.value is None else MergeRule(
                "none", reason="the model was traced by torch.fx, whose graphs record no "
                "shapes to prove a merge with")
            for ref in traced.outputs), state_refusal=next((
                f"{fqn.get(slot, slot)} is written in forward, and the model was traced by "
                "torch.fx, whose graphs record no shapes to prove the write is the same "
                "for every microbatch" for slot in written), ""))
    state_names = {s.name for s in traced.state}
    states, _ = propagate(graph, split, traced)
    per_call, state_refusal = _state_writes(traced, states, written)
    rules: list[MergeRule] = []
    tail_outputs: list[int] = []
    for j, ref in enumerate(traced.outputs):
        node = _output_node(graph, ref)
        state = R if node is None else states.get(node, R)
        if state == R:
            rules.append(MergeRule("first"))
        elif state[0] == "B" and state[2] == _ONE:  # samples in blocks: concatenate
            rules.append(MergeRule("cat", dim=state[1]))
        else:
            rules.append(MergeRule("tail", reason=state[1] if state[0] == "M" else
                                   "a size that depends on the batch"))
            tail_outputs.append(j)
    if not tail_outputs:
        return OutputMergePlan(tuple(rules), None, per_call, state_refusal)
    tail, refusal = _tail(traced, states, [_output_node(graph, traced.outputs[j])
                                           for j in tail_outputs], state_names, available,
                          frozenset(written))
    if tail is None:
        rules = [MergeRule("none", reason=f"{r.reason}; {refusal}") if r.kind == "tail" else r
                 for r in rules]
        return OutputMergePlan(tuple(rules), None, per_call, state_refusal)
    values = tuple(traced.outputs[j].value for j in tail_outputs)
    missing = [v for v in values if v not in tail.program.outputs]
    if missing:  # never expected: every tail output is a node of the tail
        raise AssertionError(f"the output tail does not compute {missing}")
    return OutputMergePlan(tuple(rules), dataclasses.replace(
        tail, outputs=tuple(tail_outputs), output_values=values), per_call, state_refusal)


def propagate(graph: torch.fx.Graph, split: Mapping[str, int | None],
              traced: TracedGraph | None = None, sizes: Sequence[str] = ()
              ) -> tuple[dict[torch.fx.Node, tuple], _Batch]:
    """Every value's state when the placeholders named in ``split`` are split along the
    given dimensions (None: some other way) and those named in ``sizes`` are the batch
    size (``S``, the backend's SymInt inputs); the others are replicated.  The one proof
    both front ends use: ``pipe(x)`` on export's graph, the backend on its Dynamo graph
    lowered to the same ATen ops (:mod:`roundpipe.passes.batching`)."""
    states: dict[torch.fx.Node, tuple] = {}
    # The batch size as each split input sees it: export gives inputs their own symbols
    # (equal at run time: the split makes them so).
    batch_sizes: list[Any] = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in sizes:
            states[node] = S
        elif node.name in split and split[node.name] is None:
            states[node] = _m(f"input {node.name} is split along no single dimension")
        elif node.name in split:
            states[node] = _b(split[node.name])  # type: ignore[arg-type]
            size = _shape(node)[split[node.name]]  # type: ignore[index]
            if not any(size is other for other in batch_sizes):
                batch_sizes.append(size)
        else:
            states[node] = R
    batch = _Batch(batch_sizes)
    batch.proportional.update(n for n in graph.nodes if n.op == "placeholder"
                              and n.name in sizes)
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            states[node] = R
            continue
        try:
            states[node] = _transfer(node, states, batch, traced)
        except _Mixing as e:
            states[node] = _m(str(e), e.merge)
        except Exception as e:  # noqa: BLE001 - an op the pass misreads: not proven
            states[node] = _m(f"{_where(node)} could not be analysed ({e})")
        if node.meta.get(MUTATES):
            # State written from batch values carries them into the next microbatch (and
            # is written once per microbatch, eager writes it once per call).
            for name in node.meta[MUTATES]:
                slot = next((n for n in graph.nodes if n.op == "placeholder"
                             and n.name == name), None)
                if slot is not None and states[node] != R:
                    states[slot] = _m(f"{_where(node)} writes {name} in place")
    return states, batch


def _state_writes(traced: TracedGraph, states: dict[torch.fx.Node, tuple],
                  written: Mapping[str, Sequence[torch.fx.Node]]) -> tuple[tuple[str, ...], str]:
    """The buffers the forward writes from values no sample changes (``R``: every
    microbatch computes eager's one write when it starts from the value the call began
    with), or why a write has no whole-batch equivalent: its value depends on the batch
    (BatchNorm's running statistics, an EMA of a batch mean), or it draws random numbers
    (each microbatch would draw its own)."""
    fqn = {s.name: s.fqn for s in traced.state}
    per_call: list[str] = []
    for slot, writers in written.items():
        for node in writers:
            state = states.get(node, R)
            where = (f"the opaque (leaf) module {node.meta.get(MODULE_PATH, '?')}"
                     if node.target is call_module_functional else _where(node))
            if state != R:
                why = (state[1] if state[0] == "M" else "the size of the batch" if state == S
                       else "values of the microbatch's own samples")
                return (), (f"{fqn.get(slot, slot)} is written in forward from values that "
                            "may depend on the batch: " + (why if why.startswith(_where(node))
                                                       else f"{where} writes it; {why}"))
            if _draws_random(traced, node):
                return (), (f"{fqn.get(slot, slot)} is written in forward by {where} from "
                            "random numbers, or from code that may draw them (an opaque "
                            "module in training mode): each microbatch would draw its own")
        per_call.append(slot)
    return tuple(per_call), ""


def _draws_random(traced: TracedGraph, node: torch.fx.Node) -> bool:
    """Whether ``node`` or a node it is computed from draws random numbers."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if draws_random(traced, n):
            return True
        stack.extend(n.all_input_nodes)
    return False


def default_split(traced: TracedGraph) -> dict[str, int | None]:
    """The inputs the default rule splits (``runtime/microbatch.split_inputs``): tensors
    whose first dimension is the batch size, that of the first tensor with a dimension."""
    tensors = [(n, x) for n, x in zip(traced.inputs.names, traced.example_inputs)
               if isinstance(x, torch.Tensor) and x.dim() >= 1]
    if not tensors:
        return {}
    batch = tensors[0][1].shape[0]
    return {n: 0 for n, x in tensors if n is not None and x.shape[0] == batch}


def _where(node: torch.fx.Node) -> str:
    """``aten.mean`` in ``blocks.0`` (model.py:38 ``x.mean(0)``): an op as a user finds it."""
    target = node.target
    schema = getattr(target, "_schema", None)
    op = (schema.name.replace("::", ".") if schema is not None
          else getattr(target, "__name__", str(target)))
    path = node.meta.get(MODULE_PATH) or ""
    where = f"{op} in {path}" if path else op
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    if len(lines) >= 2 and lines[-2].startswith("File "):
        match = re.match(r'File "([^"]+)", line (\d+)', lines[-2])
        if match:
            where += f" ({os.path.basename(match.group(1))}:{match.group(2)}: {lines[-1]})"
    return where


def _output_node(graph: torch.fx.Graph, ref: OutputRef) -> torch.fx.Node | None:
    if ref.value is None:
        return None
    return next(n for n in graph.nodes if n.name == ref.value)


def _tail(traced: TracedGraph, states: dict[torch.fx.Node, tuple],
          outputs: Sequence[torch.fx.Node], state_names: set[str],
          available: frozenset[str] | None, written: frozenset[str] = frozenset()
          ) -> tuple[OutputTail | None, str]:
    """The nodes from the per-sample values to ``outputs``, as a program.  It runs after
    the call has committed its buffer writes, so it may neither write a buffer again nor
    read one the forward writes (it would read the value the call left, not the one the
    graph reads at that point)."""
    inside: set[torch.fx.Node] = set()
    frontier: dict[str, tuple[str, int]] = {}  # value -> ("cat", dim) | ("first", 0)
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in inside:
            continue
        inside.add(node)
        if node.meta.get(MUTATES):
            return None, (f"the output is computed from a mix of samples before "
                          f"{_where(node)}, which writes a buffer")
        for arg in node.all_input_nodes:
            state = states.get(arg, R)
            if arg.op == "placeholder" and arg.name in state_names:
                spec = next(s for s in traced.state if s.name == arg.name)
                if spec.kind == "parameter" and traced.state_tensors[arg.name].requires_grad:
                    return None, (f"the output is computed from a mix of samples before "
                                  f"{_where(node)} reads the trainable {spec.fqn}")
                if arg.name in written:
                    return None, (f"the output is computed from a mix of samples before "
                                  f"{_where(node)} reads {spec.fqn}, which the forward "
                                  "writes")
                continue  # state the tail reads from the model
            readable = available is None or arg.name in available
            if arg.op == "get_attr":
                inside.add(arg)
            elif state[0] == "B" and state[2] == _ONE and readable:
                frontier[arg.name] = ("cat", state[1])
            elif state == R and readable:
                frontier[arg.name] = ("first", 0)
            elif arg.op == "placeholder":
                return None, f"input {arg.name} is split along no single dimension"
            else:  # mixed, or per-sample but not returned by the microbatches: recompute
                stack.append(arg)
    nodes = [n for n in traced.graph_module.graph.nodes if n in inside]
    program = tail_program(traced, nodes)
    if program.needs_rng:
        return None, "the mix of samples draws random numbers"
    inputs = tuple((v, *frontier[v]) for v in program.inputs)
    return OutputTail(program=program, inputs=inputs, outputs=()), ""


# --- transfer functions ----------------------------------------------------------------

def _shape(node: Any) -> tuple:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return ()


def _ndim(node: Any) -> int:
    return len(_shape(node))


def _true(condition: Any) -> bool:
    if isinstance(condition, bool):
        return condition
    try:
        return statically_known_true(condition)
    except Exception:  # noqa: BLE001 - not provable
        return False


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return _true(a == b)


def _st(value: Any, states: dict) -> tuple:
    if isinstance(value, torch.fx.Node):
        return states.get(value, R)
    if isinstance(value, (list, tuple)):
        inner = [_st(v, states) for v in value]
        batched = [s for s in inner if s != R]
        return batched[0] if len(batched) == 1 and len(inner) == 1 else (
            R if not batched else ("list", tuple(inner)))
    return R


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _named(node: torch.fx.Node, name: str, default: Any = None) -> Any:
    """The argument called ``name`` in the op's schema (positions differ between ops:
    ``norm(x, p, dim)``, ``roll(x, shifts, dims)``, ``hinge_embedding_loss(x, t, margin,
    reduction)``); ``default`` where the op has no such argument or it is not given."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.kwargs.get(name, default)
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            if i < len(node.args):
                return node.args[i]
            if name in node.kwargs:
                return node.kwargs[name]
            return arg.default_value if arg.has_default_value() else default
    return default


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


def _name(node: torch.fx.Node) -> str:
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _transfer(node: torch.fx.Node, states: dict, batch: Any,
              traced: TracedGraph | None) -> tuple:
    inputs = node.all_input_nodes
    if all(states.get(a, R) == R for a in inputs):
        return R
    mixed = [states[a] for a in inputs if states.get(a, R)[0] == "M"]
    if mixed and all(len(s) == 3 for s in mixed):  # sums and means over the batch
        raise _Mixing(mixed[0][1], _merged_scalar(node, states, batch))
    for a in inputs:
        s = states.get(a, R)
        if s[0] == "M":
            raise _Mixing(s[1])
        if a.op == "placeholder" and "val" not in a.meta:  # its shape would read as ()
            raise _Mixing(f"{_where(node)} reads {a.name}, whose shape the graph lacks")
    if node.op == "call_function" and node.target is operator.getitem:
        s = states[node.args[0]]
        if s[0] == "list":
            return s[1][node.args[1]]
        raise _Mixing(f"{_where(node)} indexes a batch value")
    if node.op == "call_function" and node.target is call_module_functional:
        return _opaque(node, states, traced)
    if node.op != "call_function":
        raise _Mixing(f"{_where(node)} is not an op roundpipe can follow")
    if not hasattr(node.target, "_schema"):
        return _python_scalar(node, states, batch)
    name = _name(node)
    handler = _HANDLERS.get(name) or _HANDLERS.get(name.rstrip("_"))
    if handler is not None:
        return handler(node, states, batch)
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return _elementwise(node, states, batch)
    raise _Mixing(f"{_where(node)}: roundpipe cannot prove it keeps samples apart")


def _python_scalar(node: torch.fx.Node, states: dict, batch: _Batch) -> tuple:
    """Arithmetic on sizes (``sym_size * 2``) and other Python-level calls."""
    kinds = {states.get(a, R)[0] for a in node.all_input_nodes}
    if kinds <= {"R", "S"}:
        sizes = [a for a in node.args if states.get(a, R) == S]  # type: ignore[arg-type]
        if node.target in (operator.mul, operator.imul) and len(sizes) == 1 \
                and sizes[0] in batch.proportional and not node.kwargs:
            batch.proportional.add(node)  # c * B
        return S
    raise _Mixing(f"{_where(node)} computes a Python value from batch tensors")


def _opaque(node: torch.fx.Node, states: dict, traced: TracedGraph) -> tuple:
    """A leaf module's call on batch values: its Python is not in the graph, so nothing
    proves it keeps samples apart (a normalisation over the batch inside it would be
    merged wrongly)."""
    module = traced.graph_module.get_submodule(node.args[0].target)  # type: ignore[union-attr]
    raise _Mixing(f"{type(module).__name__} at {node.meta.get(MODULE_PATH, '?')} runs as "
                  "Python roundpipe cannot see into (a leaf module), so whether it keeps "
                  "samples apart is not proven")


def _same(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """Ops that keep their first argument's layout of samples (copies, casts)."""
    s = _st(node.args[0], states)
    others = [states.get(a, R) for a in node.all_input_nodes if a is not node.args[0]]
    if any(o != R for o in others):
        return _elementwise(node, states, batch)
    if s[0] == "I" and (_name(node) not in _KEEPS_VALUES or others):
        raise _Mixing(f"{_where(node)} computes with the sample numbers")
    if isinstance(node.meta.get("val"), (tuple, list)):  # native_dropout: (out, mask)
        return ("list", (s,) * len(node.meta["val"]))
    return s


def _elementwise(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    out_nd = _ndim(node)
    aligned: list[tuple] = []
    for value in _tensor_args(node):
        s = states.get(value, R)
        nd = _ndim(value)
        if s == S or s[0] == "I":
            raise _Mixing(f"{_where(node)} computes with the batch size or the "
                          "sample numbers")
        if s[0] == "B":
            aligned.append((out_nd - (nd - s[1]),) + tuple(s[2:]))
        elif s[0] != "R":
            raise _Mixing(f"{_where(node)} mixes a batch value it cannot align")
    if not aligned or any(a[0] != aligned[0][0] or not batch.same(a[1], aligned[0][1])
                          or not batch.same(a[2], aligned[0][2]) for a in aligned):
        raise _Mixing(f"{_where(node)} combines batch dimensions that do not align")
    d, m, k = aligned[0]
    for value in _tensor_args(node):
        if states.get(value, R) == R:
            shape = _shape(value)
            pos = d - (out_nd - len(shape))
            if 0 <= pos < len(shape) and not _eq(shape[pos], 1):
                raise _Mixing(f"{_where(node)} combines samples with a replicated "
                              "tensor as long as the batch")
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, torch.fx.Node) and states.get(a, R) == S:
            raise _Mixing(f"{_where(node)} computes with the batch size")
    return _b(d, m, k)


def _broadcasts_past(shape: tuple, out_nd: int, d: int) -> bool:
    """Whether a replicated operand of ``shape``, broadcast to ``out_nd`` dimensions, has
    no extent along output dimension ``d`` (the batch's): else each sample would meet a
    different slice of it, by its position in the batch."""
    pos = d - (out_nd - len(shape))
    return not (0 <= pos < len(shape)) or _eq(shape[pos], 1)


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    found = []

    def visit(v: Any) -> None:
        if isinstance(v, torch.fx.Node):
            if isinstance(v.meta.get("val"), torch.Tensor):
                found.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
    visit(node.args)
    visit(tuple(node.kwargs.values()))
    return found


def _single(node: torch.fx.Node, states: dict,
            moves: bool = False) -> tuple[torch.fx.Node, int]:
    """The op's one batch tensor argument and its batch dimension; the other tensor
    arguments must be replicated.  The sample numbers (``I``) are accepted only by ops
    that move elements without changing them (``moves``): any other op's result holds
    other values (``one_hot``, ``diff``, ``pad``'s zeros), which must not index as
    sample numbers."""
    batched = [a for a in node.all_input_nodes
               if states.get(a, R) != R and isinstance(a.meta.get("val"), torch.Tensor)]
    if len(batched) != 1 or states[batched[0]][0] not in (("B", "I") if moves else ("B",)):
        raise _Mixing(f"{_where(node)} reads several batch values" if len(batched) != 1
                      or states[batched[0]][0] != "I" else
                      f"{_where(node)} computes with the sample numbers")
    return batched[0], states[batched[0]][1]


def _reshape(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    if x is not node.args[0]:
        raise _Mixing(f"{_where(node)} takes its shape from a batch value")
    sizes = [s for s in node.args[1:2] if isinstance(s, (list, tuple))]
    if sizes and any(isinstance(s, torch.fx.Node) and states.get(s, R) not in (R, S)
                     for s in sizes[0]):
        raise _Mixing(f"{_where(node)} takes its shape from batch values")
    s = states[x]
    j, m, k = _regroup(_shape(x), s, _shape(node), batch, node)
    return (s[0], j, m, k)


def _regroup(shape_in: tuple, s: tuple, shape_out: tuple, batch: _Batch,
             node: torch.fx.Node) -> tuple[int, Any, Any]:
    """Where the batch lands when ``shape_in`` is reshaped to ``shape_out`` (row-major
    order is kept): with ``Q`` elements before the batch factor and ``P`` after it, the
    output dimension ``j`` of size ``m' * batch * k'`` with ``prod(out[:j]) * m' = Q``
    and ``k' * prod(out[j+1:]) = P``."""
    d, m, k = s[1], s[2], s[3]
    before = batch.expr(_prod(shape_in[:d])) * m
    after = k * batch.expr(_prod(shape_in[d + 1:]))
    for j in range(len(shape_out)):
        m2 = batch.quotient(before, _prod(shape_out[:j]))
        k2 = batch.quotient(after, _prod(shape_out[j + 1:]))
        if m2 is not None and k2 is not None and batch.same(shape_out[j],
                                                             m2 * batch.size * k2):
            return j, m2, k2
    raise _Mixing(f"{_where(node)} reshapes the batch dimension into others")


def _prod(sizes: Sequence[Any]) -> Any:
    total: Any = 1
    for s in sizes:
        total = total * s
    return total


def _permute(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    dims = [_norm(int(i), _ndim(x)) for i in node.args[1]]
    return _kind(states[x], dims.index(d))


def _transpose(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    nd = _ndim(x)
    if _name(node) in ("t", "numpy_T"):
        a, b = 0, nd - 1
    else:
        a, b = _norm(int(node.args[1]), nd), _norm(int(node.args[2]), nd)
    return _kind(states[x], b if d == a else a if d == b else d)


def _unsqueeze(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    dim = _norm(int(node.args[1]), _ndim(x) + 1)
    return _kind(states[x], d + 1 if dim <= d else d)


def _squeeze(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    nd = _ndim(x)
    shape = _shape(x)
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        dims = [i for i in range(nd) if _eq(shape[i], 1)]
    elif not isinstance(dims, (list, tuple)):
        dims = [dims]
    dims = [_norm(int(i), nd) for i in dims if _eq(shape[_norm(int(i), nd)], 1)]
    if d in dims:
        raise _Mixing(f"{_where(node)} squeezes the batch dimension")
    return _kind(states[x], d - sum(1 for i in dims if i < d))


def _expand(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    if states.get(node.args[0], R) == R:  # expanded to the batch size: the same rows
        return _sized_factory(node, states, batch)
    if _name(node) == "expand_as":  # the second tensor gives only its shape
        x = node.args[0]
        if states[x][0] != "B":
            raise _Mixing(f"{_where(node)} expands the batch size or the sample numbers")
        d = states[x][1]
    else:
        x, d = _single(node, states, moves=True)
    out = _shape(node)
    d2 = d + len(out) - _ndim(x)
    if not batch.same(out[d2], _shape(x)[d]):
        raise _Mixing(f"{_where(node)} expands the batch dimension")
    sizes = node.args[1] if _name(node) == "expand" and len(node.args) > 1 else ()
    if any(isinstance(s, torch.fx.Node) and states.get(s, R) != R
           for j, s in enumerate(sizes) if j != d2):
        raise _Mixing(f"{_where(node)} expands to the batch size in another dimension")
    return _kind(states[x], d2)


def _slice(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    dim = _norm(int(_arg(node, 1, "dim", 0)), _ndim(x))
    if dim != d:
        return _kind(states[x], d)
    start, end, step = (_arg(node, 2, "start"), _arg(node, 3, "end"), _arg(node, 4, "step", 1))
    whole = start in (None, 0) and step == 1 and (
        end is None or (isinstance(end, int) and end >= 2**62)
        or batch.same(end, _shape(x)[d]))
    if whole:
        return _kind(states[x], d)
    raise _Mixing(f"{_where(node)} slices the batch dimension")


def _select(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    dim = _norm(int(node.args[1]), _ndim(x))
    if dim == d:
        raise _Mixing(f"{_where(node)} picks one sample")
    return _kind(states[x], d - 1 if dim < d else d)


def _split(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    name = _name(node)
    nd = _ndim(x)
    dim = _norm(int(_arg(node, 2 if name != "unbind" else 1, "dim",
                         0 if name != "chunk" else 0)), nd) if name != "unbind" else \
        _norm(int(_arg(node, 1, "dim", 0)), nd)
    if dim == d:
        raise _Mixing(f"{_where(node)} splits the batch dimension")
    if name == "unbind":
        return ("list", (_kind(states[x], d - 1 if dim < d else d),)
                * len(node.meta.get("val", ())))
    return ("list", (states[x],) * len(node.meta.get("val", ())))


def _cat(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    tensors = node.args[0]
    nd = _ndim(node)
    dim = _norm(int(_arg(node, 1, "dim", 0)), nd)
    found = {states.get(t, R) for t in tensors}
    if len(found) != 1 or next(iter(found))[0] != "B":
        raise _Mixing(f"{_where(node)} joins batch and replicated values")
    state = next(iter(found))
    d = state[1]
    if _name(node) == "stack":
        return _kind(state, d + 1 if dim <= d else d)
    if dim == d:
        raise _Mixing(f"{_where(node)} concatenates along the batch dimension")
    return state


def _reduction(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states)
    if x is not node.args[0]:
        raise _Mixing(f"{_where(node)} reduces with batch values")
    nd = _ndim(x)
    dims = _named(node, "dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        # Every sample has as many elements: the whole batch's sum is its microbatches'
        # sum, its mean their mean weighted by b_i / B.
        full = _name(node) in ("sum", "mean") and _ndim(node) == 0
        raise _Mixing(f"{_where(node)} reduces over the batch", _name(node) if full else None)
    dims = [_norm(int(i), nd) for i in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if d in dims:
        raise _Mixing(f"{_where(node)} reduces over the batch")
    keep = bool(_named(node, "keepdim", False))
    out = _kind(states[x], d if keep else d - sum(1 for i in dims if i < d))
    if isinstance(node.meta.get("val"), (tuple, list)):
        return ("list", (out,) * len(node.meta["val"]))
    return out


def _along(name: str = "dim") -> Callable[..., tuple]:
    """Ops working along dimensions named ``name`` in their schema (softmax, cumsum,
    sort, flip, roll): fine unless one of them is the batch's."""
    def handler(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
        x, d = _single(node, states)
        if x is not node.args[0]:
            raise _Mixing(f"{_where(node)} reads a batch value")
        dim = _named(node, name)
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        nd = max(1, _ndim(x))
        if dim is None or not dims or any(_norm(int(i), nd) == d for i in dims):
            raise _Mixing(f"{_where(node)} works along the batch dimension")
        if isinstance(node.meta.get("val"), (tuple, list)):
            return ("list", (states[x],) * len(node.meta["val"]))
        return states[x]
    return handler


def _along_one(name: str) -> Callable[..., tuple]:
    """Ops that treat each slice along dimension ``name`` on its own (``renorm``): per
    sample only when that dimension is the batch's."""
    def handler(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
        x, d = _single(node, states)
        if x is not node.args[0] or _norm(int(_named(node, name)), _ndim(x)) != d:
            raise _Mixing(f"{_where(node)} computes across the batch dimension")
        return states[x]
    return handler


def _one_hot(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """A class dimension is appended; without ``num_classes`` its size is the batch's
    largest label."""
    x, _ = _single(node, states)
    if int(_named(node, "num_classes", -1)) < 0:
        raise _Mixing(f"{_where(node)} sizes its classes by the whole batch's largest "
                      "label (pass num_classes)")
    return states[x]


def _repeat(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``repeat``/``tile``: per sample when the batch dimension is repeated once."""
    x, d = _single(node, states, moves=True)
    if x is not node.args[0]:
        raise _Mixing(f"{_where(node)} repeats by batch values")
    reps = [int(r) if isinstance(r, int) else r for r in node.args[1]]
    if any(not isinstance(r, int) and states.get(r, R) != R for r in reps):
        raise _Mixing(f"{_where(node)} repeats by the batch size")
    nd = _ndim(x)
    if _name(node) == "tile" and len(reps) < nd:
        reps = [1] * (nd - len(reps)) + reps
    out = d + len(reps) - nd
    if out < 0 or not _eq(reps[out], 1):
        raise _Mixing(f"{_where(node)} repeats the batch dimension")
    return _kind(states[x], out)


def _movedim(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states, moves=True)
    nd = _ndim(x)
    # where dimension d lands: move a tensor whose sizes name the dimensions
    probe = torch.empty([2 + i for i in range(nd)], device="meta")
    moved = torch.movedim(probe, node.args[1], node.args[2]).shape
    return _kind(states[x], list(moved).index(2 + d))


def _index_fill(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states)
    if x is not node.args[0] or _norm(int(node.args[1]), _ndim(x)) == d:
        raise _Mixing(f"{_where(node)} fills along the batch dimension")
    return states[x]


def _tensor_unfold(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``Tensor.unfold(dimension, size, step)``: windows along one dimension, in a new
    last one; the other dimensions keep their places."""
    x, d = _single(node, states, moves=True)
    if x is not node.args[0] or _norm(int(node.args[1]), _ndim(x)) == d:
        raise _Mixing(f"{_where(node)} slides windows along the batch dimension")
    return states[x]


def _lookup(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``bucketize(x, boundaries)``: every value is placed among all the boundaries, so
    they must be replicated."""
    x, _ = _single(node, states)
    if x is not node.args[0]:
        raise _Mixing(f"{_where(node)} looks values up among batch boundaries")
    return states[x]


def _last_two(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """Ops on the last two dimensions as a matrix (``tril``, ``triu``)."""
    x, d = _single(node, states)
    if d >= _ndim(x) - 2:
        raise _Mixing(f"{_where(node)} treats the batch dimension as a matrix's")
    return states[x]


def _full_reduction(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    raise _Mixing(f"{_where(node)} reduces over the batch")


def _leading_batch(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """Ops that treat dimension 0 as independent samples (convolution, pooling,
    interpolation, group norm): per-sample when the batch is dimension 0."""
    x = node.args[0]
    s = states.get(x, R)
    if not _rows(s, 0):
        raise _Mixing(f"{_where(node)} reads a batch value not along dimension 0")
    for a in node.all_input_nodes:
        if a is not x and states.get(a, R) != R:
            raise _Mixing(f"{_where(node)} reads batch weights")
    if isinstance(node.meta.get("val"), (tuple, list)):
        return ("list", tuple(_b(0) for _ in node.meta["val"]))
    return _b(0)


def _pad(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states)
    pads = node.args[1]
    padded = len(pads) // 2  # the last dimensions, from the last one backwards
    if d >= _ndim(x) - padded:
        raise _Mixing(f"{_where(node)} pads the batch dimension")
    return states[x]


def _layer_norm(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states)
    if x is not node.args[0]:
        raise _Mixing(f"{_where(node)} normalises with batch weights")
    normalized = node.args[1] if len(node.args) > 1 else ()
    n = len(normalized) if isinstance(normalized, (list, tuple)) else 1
    if _name(node) == "rms_norm" and isinstance(normalized, (list, tuple)):
        n = len(normalized)
    if d >= _ndim(x) - n:
        raise _Mixing(f"{_where(node)} normalises over the batch")
    if isinstance(node.meta.get("val"), (tuple, list)):
        return ("list", tuple(states[x] for _ in node.meta["val"]))
    return states[x]


def _batch_norm(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    name = _name(node)
    training = {"batch_norm": (5, "training"), "native_batch_norm": (5, "training"),
                "_native_batch_norm_legit": (5, "training"),
                "_native_batch_norm_legit_functional": (5, "training")}.get(name)
    if name == "_native_batch_norm_legit_no_training":
        is_training = False
    elif training is not None:
        is_training = bool(_arg(node, *training, False))
    else:
        is_training = True
    if is_training:
        raise _Mixing(f"{_where(node)} normalises with the statistics of the whole "
                      "batch (BatchNorm in training mode)")
    return _leading_batch(node, states, batch)


def _linear(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, d = _single(node, states)
    if x is not node.args[0] or d >= _ndim(x) - 1:
        raise _Mixing(f"{_where(node)} contracts over the batch")
    return states[x]


def _matmul(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    a, b = node.args[0], node.args[1]
    sa, sb = states.get(a, R), states.get(b, R)
    na, nb, nout = _ndim(a), _ndim(b), _ndim(node)
    name = _name(node)
    bias_state = R
    if name in ("addmm", "baddbmm", "addbmm"):
        bias, a, b = node.args[0], node.args[1], node.args[2]
        bias_state = states.get(bias, R)
        if bias_state != R and bias_state[0] != "B":
            raise _Mixing(f"{_where(node)} adds a batch value")
        sa, sb = states.get(a, R), states.get(b, R)
        na, nb = _ndim(a), _ndim(b)
    out = None
    if sa[0] == "B" and sb == R:
        if na >= 2 and sa[1] <= na - 2:
            out = nout - (na - sa[1]) if sa[1] < na - 2 or nb >= 2 else None
            if sa[1] == na - 2:  # rows: stay rows
                out = nout - 2 if nb >= 2 else nout - 1
    elif sa == R and sb[0] == "B":
        if nb >= 2 and sb[1] == nb - 1:  # columns: stay columns
            out = nout - 1
        elif nb >= 3 and sb[1] < nb - 2:
            out = nout - (nb - sb[1])
    elif sa[0] == "B" and sb[0] == "B":
        da, db = nout - (na - sa[1]), nout - (nb - sb[1])
        if da == db and sa[1] < na - 2 and sb[1] < nb - 2:
            out = da
    if out is None or out < 0:
        raise _Mixing(f"{_where(node)} contracts over the batch")
    # A replicated operand must not vary along the batch: its broadcast dimensions (all
    # but the matrix's two) and an added bias (broadcast like an elementwise op).
    for t, st in ((a, sa), (b, sb)):
        shape = _shape(t)
        if st == R and len(shape) >= 3 and out < nout - 2 \
                and not _broadcasts_past(shape[:-2], nout - 2, out):
            raise _Mixing(f"{_where(node)} pairs each sample with a replicated slice")
    if name in ("addmm", "baddbmm", "addbmm") and bias_state == R \
            and not _broadcasts_past(_shape(node.args[0]), nout, out):
        raise _Mixing(f"{_where(node)} adds a replicated bias that varies along the batch")
    if bias_state != R and nout - (_ndim(node.args[0]) - bias_state[1]) != out:
        # A per-sample bias (nn.MultiheadAttention's key padding mask) must hold its
        # samples where the product does.
        raise _Mixing(f"{_where(node)} adds a batch value along another dimension")
    layouts = {tuple(t[2:]) for t in (sa, sb, bias_state) if t[0] == "B"}
    if len(layouts) != 1:
        raise _Mixing(f"{_where(node)} multiplies batch values laid out differently")
    return ("B", out) + layouts.pop()


def _einsum_letters(equation: str, ndims: Sequence[int]) -> tuple[list[str], str] | None:
    """Each operand's subscripts and the output's, one letter per dimension (an
    ellipsis spelled out as upper-case letters einsum's own lower-case ones never use),
    or None when the equation cannot be read."""
    equation = equation.replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims) or any(not re.fullmatch(r"[a-zA-Z]*(\.\.\.)?[a-zA-Z]*", t)
                                       for t in terms + [out]):
        return None
    if any(t.isascii() and any(c.isupper() for c in t) for t in terms):
        return None  # upper-case subscripts: the spelled-out ellipsis would clash
    spelled, widest = [], 0
    for term, nd in zip(terms, ndims):
        if "..." in term:
            head, _, tail = term.partition("...")
            n = nd - len(head) - len(tail)
            if n < 0:
                return None
            widest = max(widest, n)
            # broadcast dimensions line up from the right
            term = head + "".join(chr(ord("Z") - i) for i in reversed(range(n))) + tail
        if len(term) != nd:
            return None
        spelled.append(term)
    ellipsis = "".join(chr(ord("Z") - i) for i in reversed(range(widest)))
    if arrow:
        out = out.replace("...", ellipsis)
    else:  # implicit output: the ellipsis, then the letters used once, sorted
        letters = "".join(spelled)
        out = ellipsis + "".join(sorted(c for c in set(letters)
                                        if letters.count(c) == 1 and c.islower()))
    return spelled, out


def _einsum(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``einsum``: per sample when the batch dimension's subscript is one letter, at the
    batch dimension of every batch operand (laid out alike), in no replicated operand,
    and kept in the output (so it is neither summed over nor paired with a replicated
    tensor's slices)."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or not isinstance(operands, (list, tuple)):
        raise _Mixing(f"{_where(node)}: an equation roundpipe cannot read")
    read = _einsum_letters(equation, [_ndim(t) for t in operands])
    if read is None:
        raise _Mixing(f"{_where(node)}: an equation roundpipe cannot read ({equation!r})")
    terms, out = read
    letters, layouts = set(), set()
    for term, t in zip(terms, operands):
        st = _st(t, states)
        if st == R:
            continue
        if st[0] != "B":
            raise _Mixing(f"{_where(node)} reads the batch size or the sample numbers")
        letters.add(term[st[1]])
        layouts.add(tuple(st[2:]))
        if term.count(term[st[1]]) != 1:
            raise _Mixing(f"{_where(node)} takes a diagonal along the batch dimension")
    if len(letters) != 1 or len(layouts) != 1:
        raise _Mixing(f"{_where(node)} pairs batch dimensions that do not align")
    letter = letters.pop()
    for term, t in zip(terms, operands):
        st = _st(t, states)
        if st[0] == "B" and term.index(letter) != st[1]:
            raise _Mixing(f"{_where(node)} pairs the batch with another dimension")
        if st == R and letter in term:
            raise _Mixing(f"{_where(node)} pairs each sample with a replicated slice")
    if out.count(letter) != 1:
        raise _Mixing(f"{_where(node)} contracts over the batch")
    return ("B", out.index(letter)) + layouts.pop()


def _cdist(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``cdist(x1 (.., P, M), x2 (.., R, M))`` -> ``(.., P, R)``: per sample when the batch
    runs along x1's rows (x2 replicated), x2's rows (x1 replicated), or a leading
    dimension of both (laid out alike; a replicated operand then has no extent there)."""
    x1, x2 = node.args[0], node.args[1]
    s1, s2 = states.get(x1, R), states.get(x2, R)
    n1, n2, nout = _ndim(x1), _ndim(x2), _ndim(node)
    if any(s not in (R,) and s[0] != "B" for s in (s1, s2)):
        raise _Mixing(f"{_where(node)} reads the batch size or the sample numbers")
    out = None
    if s1[0] == "B" and s2 == R and s1[1] == n1 - 2:
        out = nout - 2
    elif s2[0] == "B" and s1 == R and s2[1] == n2 - 2:
        out = nout - 1
    elif all(s[0] == "B" for s in (s1, s2)) and s1[2:] == s2[2:] \
            and s1[1] < n1 - 2 and n1 - s1[1] == n2 - s2[1]:
        out = nout - (n1 - s1[1])
    elif s1[0] == "B" and s2 == R and s1[1] < n1 - 2 \
            and _broadcasts_past(_shape(x2)[:-2], nout - 2, nout - (n1 - s1[1])):
        out = nout - (n1 - s1[1])
    elif s2[0] == "B" and s1 == R and s2[1] < n2 - 2 \
            and _broadcasts_past(_shape(x1)[:-2], nout - 2, nout - (n2 - s2[1])):
        out = nout - (n2 - s2[1])
    if out is None:
        raise _Mixing(f"{_where(node)} measures distances between samples")
    st = s1 if s1[0] == "B" else s2
    return ("B", out) + tuple(st[2:])


def _embedding(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    weight, idx = node.args[0], node.args[1]
    if states.get(weight, R) != R or states.get(idx, R)[0] != "B":
        raise _Mixing(f"{_where(node)} looks up batch weights")
    return states[idx]


def _sdpa(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    q, k, v = node.args[0], node.args[1], node.args[2]
    qs = [states.get(t, R) for t in (q, k, v)]
    dims = {_ndim(node.args[0]) - (_ndim(t) - s[1]) for t, s in zip((q, k, v), qs)
            if s[0] == "B"}
    if len(dims) != 1 or any(s[0] == "B" and not _rows(s) for s in qs):
        raise _Mixing(f"{_where(node)} attends across the batch")
    d = dims.pop()
    if d >= _ndim(q) - 2:
        raise _Mixing(f"{_where(node)} attends across the batch")
    for t, s in zip((q, k, v), qs):
        if s == R:
            shape = _shape(t)
            pos = d - (_ndim(q) - len(shape))
            if 0 <= pos < len(shape) and not _eq(shape[pos], 1):
                raise _Mixing(f"{_where(node)} attends to replicated keys")
    mask = _arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node):
        ms = states.get(mask, R)
        if ms[0] == "B" and _ndim(q) - (_ndim(mask) - ms[1]) != d:
            raise _Mixing(f"{_where(node)} masks across the batch")
        if ms == R:
            shape = _shape(mask)
            pos = d - (_ndim(q) - len(shape))
            if 0 <= pos < len(shape) and not _eq(shape[pos], 1):
                raise _Mixing(f"{_where(node)} masks with a tensor as long as the batch")
    if isinstance(node.meta.get("val"), (tuple, list)):
        return ("list", tuple(_b(d) if isinstance(o, torch.Tensor) and o.dim() > d else R
                              for o in node.meta["val"]))
    return _b(d)


_POINTWISE_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
                     "binary_cross_entropy", "binary_cross_entropy_with_logits",
                     "soft_margin_loss"}
_CLASS_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss2d"}


def _loss(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``reduction`` 0 (none) is per sample.  A ``sum`` (2) merges by adding; a ``mean``
    (1) of a pointwise loss by averaging (every element counts the same); a class loss's
    mean divides by the weight of the targets not ignored, which is not proportional to
    the batch."""
    reduction, name = _named(node, "reduction", 1), _name(node)
    if reduction == 0:
        return _elementwise(node, states, batch)
    merge = None
    if name in _CLASS_LOSSES:
        x, t = node.args[0], node.args[1]
        if reduction == 2 and _rows(states.get(x, R), 0) and _rows(states.get(t, R), 0) \
                and all(states.get(a, R) == R for a in node.all_input_nodes[2:]):
            merge = "sum"
        elif reduction == 1:
            raise _Mixing(f"{_where(node)} reduces a loss over the batch (reduction='mean' "
                          "divides by a count that is not proportional to the batch: ignored "
                          "targets, class weights; use reduction='sum' and divide outside "
                          "to microbatch it)")
    elif name in _POINTWISE_LOSSES and reduction in (1, 2):
        _elementwise(node, states, batch)  # input and target aligned
        merge = "mean" if reduction == 1 else "sum"
    raise _Mixing(f"{_where(node)} reduces a loss over the batch", merge)


def _merged_scalar(node: torch.fx.Node, states: dict, batch: _Batch) -> str | None:
    """A scalar computed from sums and means over the batch that still merges exactly:
    a copy or negation, a product with (a quotient by) a replicated scalar, a sum of two
    alike, a mean times the batch size (a sum), a sum over it (a mean); else None."""
    val = node.meta.get("val")  # a float scalar (a cast to int would round each piece)
    if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() != 0 \
            or not val.is_floating_point():
        return None
    name = _name(node)
    kinds = [(_st(a, states)[2] if _st(a, states)[0] == "M" else
              "S" if _st(a, states) == S and a in batch.proportional else
              "R" if _st(a, states) == R and _ndim(a) == 0 else None) for a in node.args]
    merged = [k for k in kinds if k in ("sum", "mean")]
    if len(merged) == 1 and kinds[0] in merged and name in _KEEPS_VALUES | {"neg"}:
        return merged[0]
    if len(kinds) != 2 or node.kwargs or None in kinds:
        return None
    if name in ("add", "sub") and kinds[0] == kinds[1]:
        return kinds[0]
    other = kinds[1] if kinds[0] in merged else kinds[0]
    if len(merged) == 1 and other == "R" and (name == "mul" or name == "div" and kinds[1] == "R"):
        return merged[0]
    if name == "mul" and merged == ["mean"] and other == "S":
        return "sum"  # mean_i * c * b_i adds up to the whole batch's c * B * mean
    if name == "div" and kinds == ["sum", "S"]:
        return "mean"  # sum_i / (c * b_i) averages with weights b_i / B
    return None


def _sym_size(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x = node.args[0]
    s = states.get(x, R)
    if s[0] != "B":
        raise _Mixing(f"{_where(node)} reads the size of a mixed value")
    if _name(node) == "sym_numel" or int(node.args[1]) == s[1]:
        batch.proportional.add(node)
        return S
    return R


def _factory_like(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``zeros_like(x)`` and friends: x's layout of samples, values of their own."""
    x = node.args[0]
    if any(isinstance(a, torch.fx.Node) and states.get(a, R) == S
           for a in (*node.args, *node.kwargs.values())):  # full_like(x, x.shape[0])
        raise _Mixing(f"{_where(node)} fills with the batch size")
    return states.get(x, R) if states.get(x, R)[0] == "B" else _elementwise(node, states, batch)


def _sized_factory(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``zeros(B, T)``, ``full((B,), 1)``: constant values in a batch-long dimension;
    ``arange(B)``: the sample numbers (``I``), for indexing a batch value by sample."""
    name = _name(node)
    if name == "arange" and len(node.args) == 1 and batch.size is not None \
            and batch.same(_shape(node)[0], batch.size):
        return _i(0)
    if name in ("arange", "linspace", "randperm", "logspace"):
        raise _Mixing(f"{_where(node)} numbers positions across the batch")
    # new_zeros(x, size): x only gives the dtype and device
    sized = node.all_input_nodes[1:] if name.startswith("new_") else node.all_input_nodes
    if any(states.get(a, R) not in (R, S) for a in sized):
        raise _Mixing(f"{_where(node)} reads batch values")
    fill = _named(node, "fill_value")
    if isinstance(fill, torch.fx.Node) and states.get(fill, R) != R:
        raise _Mixing(f"{_where(node)} fills with the batch size")
    shape = _shape(node)
    for j in range(len(shape)):  # constant values: each sample's slice is the same
        k = batch.per_sample(shape[j])
        if k is not None:
            return _b(j, _ONE, k)
    raise _Mixing(f"{_where(node)} is sized by the batch in a way roundpipe cannot "
                  "follow")


def _index_select(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, idx = node.args[0], node.args[2]
    dim = _norm(int(node.args[1]), _ndim(x))
    sx, si = states.get(x, R), states.get(idx, R)
    if sx[0] == "B" and si == R and dim != sx[1]:
        return sx
    raise _Mixing(f"{_where(node)} selects across the batch")


def _gather(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    x, idx = node.args[0], node.args[2]
    dim = _norm(int(node.args[1]), max(1, _ndim(x)))
    sx, si = states.get(x, R), states.get(idx, R)
    if _rows(sx) and si == sx and sx[1] != dim:  # each sample's rows from its own
        return sx
    raise _Mixing(f"{_where(node)} gathers across the batch")


def _scatter(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``scatter`` / ``scatter_add`` / ``scatter_reduce`` along a dimension that is not
    the batch's: row ``i`` of ``index`` and ``src`` writes only into row ``i`` of
    ``self``, so a sample's rows are made from its own (top-k routing:
    ``zeros_like(w).scatter(-1, idx, top)``)."""
    x, idx = node.args[0], node.args[2]
    src = node.args[3] if len(node.args) > 3 else None
    dim = _norm(int(node.args[1]), max(1, _ndim(x)))
    sx = states.get(x, R)
    others = [states.get(idx, R)] + ([states.get(src, R)]
                                     if isinstance(src, torch.fx.Node) else [])
    if _rows(sx) and sx[1] != dim and all(o == sx for o in others):
        return sx
    raise _Mixing(f"{_where(node)} scatters across the batch")


def _index(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """Advanced indexing ``x[i0, i1, ...]``: per sample when a batch value is indexed by
    the sample numbers along its batch dimension (Hugging Face's masks:
    ``padding_mask[batch_idx, kv_idx]``), or a replicated table by per-sample indices."""
    x, indices = node.args[0], list(node.args[1])
    sx = states.get(x, R)
    positions = [k for k, i in enumerate(indices) if i is not None]
    if not positions or positions != list(range(positions[0], positions[-1] + 1)):
        raise _Mixing(f"{_where(node)} indexes in a way roundpipe cannot follow")
    first = positions[0]
    idx_states = {k: states.get(indices[k], R) for k in positions}
    width = max(_ndim(indices[k]) for k in positions)  # broadcast rank of the indices
    result: int | None = None
    layout: tuple = _b(0)
    sample_index: int | None = None  # the index tensor that carries the samples
    if sx[0] == "B":
        if not _rows(sx):
            raise _Mixing(f"{_where(node)} indexes a batch value laid out in blocks")
        d = sx[1]
        if d in positions:
            si = idx_states[d]
            if si[0] != "I" or any(s != R for k, s in idx_states.items() if k != d):
                raise _Mixing(f"{_where(node)} indexes the batch dimension")
            sample_index = d
        else:
            if any(s != R for s in idx_states.values()):
                raise _Mixing(f"{_where(node)} indexes with batch values")
            result = d if d < first else d - len(positions) + width
    elif sx == R:
        batched = [(k, s) for k, s in idx_states.items() if s != R]
        if len(batched) != 1 or batched[0][1][0] != "B":
            raise _Mixing(f"{_where(node)} indexes with batch values")
        sample_index, layout = batched[0]
    if sample_index is not None:
        si = idx_states[sample_index]
        at = width - _ndim(indices[sample_index]) + si[1]  # in the indices' broadcast
        for k in positions:
            if k != sample_index and not _broadcasts_past(_shape(indices[k]), width, at):
                raise _Mixing(f"{_where(node)} pairs samples with replicated indices")
        result = first + at
    if result is None:
        raise _Mixing(f"{_where(node)} indexes a mixed value")
    return _kind(layout, result)


def _rnn(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``: each sequence on its own.
    The input is batch-first (``B(0)``) or time-first (``B(1)``); the hidden states are
    ``(layers, B, H)``."""
    x = node.args[0]
    hidden = node.args[1]
    params = node.args[2]
    batch_first = bool(node.args[-1])
    sx = states.get(x, R)
    expected = _b(0) if batch_first else _b(1)
    if not _rows(sx, expected[1]):
        raise _Mixing(f"{_where(node)} runs across the batch")
    for h in (hidden if isinstance(hidden, (list, tuple)) else [hidden]):
        if not _rows(states.get(h, R), 1):
            raise _Mixing(f"{_where(node)} starts from hidden states shared by the batch")
    if any(states.get(p, R) != R for p in params):
        raise _Mixing(f"{_where(node)} has batch weights")
    count = len(node.meta.get("val", ()))
    return ("list", (expected,) + (_b(1),) * (count - 1))


def _broadcast_tensors(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    tensors = node.args[0]
    out_nd = max(_ndim(t) for t in tensors)
    aligned = {(out_nd - (_ndim(t) - states[t][1]),) + tuple(states[t][2:]) for t in tensors
               if states.get(t, R)[0] == "B"}
    if len(aligned) != 1 or any(states.get(t, R) not in (R,) and states[t][0] != "B"
                                for t in tensors):
        raise _Mixing(f"{_where(node)} aligns batch dimensions that do not match")
    d, m, k = aligned.pop()
    for t in tensors:
        if states.get(t, R) == R:
            shape = _shape(t)
            pos = d - (out_nd - len(shape))
            if 0 <= pos < len(shape) and not _eq(shape[pos], 1):
                raise _Mixing(f"{_where(node)} broadcasts a tensor as long as the batch")
    return ("list", (_b(d, m, k),) * len(tensors))


def _rowwise(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    """Ops that work on each row (the last dimension) on its own: ``multinomial``."""
    x, d = _single(node, states)
    if d >= _ndim(x) - 1:
        raise _Mixing(f"{_where(node)} works along the batch dimension")
    return states[x]


def _masked_fill(node: torch.fx.Node, states: dict, batch: Any) -> tuple:
    return _elementwise(node, states, batch)


_SAME = ["clone", "contiguous", "detach", "alias", "_to_copy", "to", "type_as",
         "lift_fresh_copy", "_assert_tensor_metadata", "dropout", "native_dropout",
         "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "bernoulli", "copy",
         "_to_dtype", "view_as_real", "view_as_complex", "real", "imag", "conj",
         "resolve_conj", "resolve_neg", "_conj", "fill", "zero", "normal", "uniform",
         "exponential", "random", "cauchy", "geometric", "log_normal"]

# copies that keep the values (the sample numbers stay sample numbers)
_KEEPS_VALUES = {"clone", "contiguous", "detach", "alias", "_to_copy", "to", "type_as",
                 "lift_fresh_copy", "_assert_tensor_metadata", "_to_dtype", "resolve_conj",
                 "resolve_neg"}

_HANDLERS: dict[str, Callable[[torch.fx.Node, dict, Any], tuple]] = {
    **{n: _same for n in _SAME},
    **{n: _reshape for n in ("view", "_unsafe_view", "reshape", "view_copy",
                             "_reshape_alias", "flatten", "unflatten")},
    "permute": _permute, "transpose": _transpose, "t": _transpose, "swapaxes": _transpose,
    "swapdims": _transpose,
    "unsqueeze": _unsqueeze, "squeeze": _squeeze, "expand": _expand, "expand_as": _expand,
    "slice": _slice, "select": _select, "narrow": _slice,
    **{n: _split for n in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split",
                           "unsafe_split", "unsafe_chunk")},
    "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _cat,
    **{n: _reduction for n in ("sum", "mean", "amax", "amin", "max", "min", "var", "std",
                               "var_mean", "std_mean", "logsumexp", "argmax", "argmin",
                               "prod", "any", "all", "norm", "linalg_vector_norm",
                               "count_nonzero", "nansum", "nanmean", "median", "mode")},
    **{n: _along() for n in ("softmax", "_softmax", "log_softmax", "_log_softmax",
                             "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
                             "sort", "argsort", "special_softmax", "_safe_softmax", "topk",
                             "kthvalue")},
    "flip": _along("dims"), "roll": _along("dims"),
    "tril": _last_two, "triu": _last_two,
    "layer_norm": _layer_norm, "native_layer_norm": _layer_norm, "rms_norm": _layer_norm,
    "_fused_rms_norm": _layer_norm,
    **{n: _batch_norm for n in ("batch_norm", "native_batch_norm",
                                "_native_batch_norm_legit",
                                "_native_batch_norm_legit_no_training",
                                "_native_batch_norm_legit_functional")},
    **{n: _leading_batch for n in (
        "convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "_convolution", "max_pool1d", "max_pool2d", "max_pool3d",
        "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d",
        "avg_pool3d", "max_pool1d_with_indices", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
        "_adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "upsample_bilinear2d", "upsample_bicubic2d", "upsample_linear1d", "_upsample_nearest_exact2d",
        "_upsample_bilinear2d_aa", "group_norm", "native_group_norm", "instance_norm",
        "pixel_shuffle", "pixel_unshuffle", "im2col", "col2im", "grid_sampler",
        "grid_sampler_2d", "reflection_pad1d", "reflection_pad2d",
        "replication_pad1d", "replication_pad2d", "channel_shuffle")},
    **{n: _pad for n in ("constant_pad_nd", "pad")},
    "linear": _linear,
    **{n: _matmul for n in ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm")},
    "embedding": _embedding,
    "einsum": _einsum, "cdist": _cdist, "_cdist_forward": _cdist,
    **{n: _along() for n in ("glu", "cross", "linalg_cross", "diff", "fft_fft", "fft_ifft",
                             "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft")},
    "renorm": _along_one("dim"), "one_hot": _one_hot, "repeat": _repeat, "tile": _repeat,
    "movedim": _movedim, "moveaxis": _movedim, "index_fill": _index_fill,
    "unfold": _tensor_unfold, "aminmax": _reduction,
    "log_sigmoid": _same, "bucketize": _lookup,
    # elementwise with broadcasting, though not tagged pointwise
    **{n: _elementwise for n in ("polar", "complex", "lerp", "copysign", "xlogy",
                                 "hardswish", "pow", "float_power", "fmod", "remainder")},
    **{n: _sdpa for n in ("scaled_dot_product_attention",
                          "_scaled_dot_product_flash_attention_for_cpu",
                          "_scaled_dot_product_flash_attention",
                          "_scaled_dot_product_efficient_attention",
                          "_scaled_dot_product_cudnn_attention")},
    **{n: _loss for n in ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d",
                          "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                          "binary_cross_entropy", "binary_cross_entropy_with_logits",
                          "kl_div", "soft_margin_loss", "hinge_embedding_loss")},
    "sym_size": _sym_size, "sym_numel": _sym_size,
    **{n: _factory_like for n in ("zeros_like", "ones_like", "full_like", "empty_like",
                                  "rand_like", "randn_like", "randint_like")},
    **{n: _sized_factory for n in ("zeros", "ones", "full", "empty", "empty_strided",
                                   "new_zeros", "new_ones", "new_full", "new_empty",
                                   "arange", "linspace", "logspace", "randperm", "rand",
                                   "randn", "randint", "scalar_tensor")},
    "index_select": _index_select, "gather": _gather, "index": _index,
    **{n: _scatter for n in ("scatter", "scatter_add", "scatter_reduce")},
    **{n: _rnn for n in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
    "broadcast_tensors": _broadcast_tensors, "multinomial": _rowwise,
    **{n: _elementwise for n in ("__and__", "__or__", "__xor__", "__invert__",
                                 "__lshift__", "__rshift__", "bitwise_not",
                                 "logical_and", "logical_or", "logical_xor")},
    "masked_fill": _masked_fill, "where": _masked_fill,
    **{n: _full_reduction for n in ("item", "_local_scalar_dense", "nonzero",
                                    "masked_select", "unique", "_unique2", "bincount")},
}
