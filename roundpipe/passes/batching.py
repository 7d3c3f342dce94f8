"""Can one call of a Dynamo graph be split into microbatches?  A conservative proof.

Splitting a call is exact when every sample of the batch is computed independently and
each output can be put back together: an output that keeps the batch dimension is
concatenated, a sum over the batch is summed, a mean over the batch is averaged with
weights ``b_i / B``.  :func:`analyze_batching` propagates, node by node, what each value
is with respect to the batch:

* ``R``: does not depend on the split inputs (weights, constants, replicated inputs);
* ``B(d)``: a tensor whose dimension ``d`` runs over samples in contiguous blocks (a
  sample's rows never mix with another's);
* ``S``: an integer proportional to the number of samples (``x.size(0)``, ``B * T``);
* ``sum`` / ``mean``: a scalar that is a sum / a mean over every sample;
* ``shape(d)``: ``x.size()`` of a ``B(d)`` tensor; a tuple of values (``unbind``).

Only ops it knows are allowed on batch-dependent values; anything else, a batch size baked
into the graph as a constant (static shapes: ``view(8, ...)``), an op mixing samples
(BatchNorm in training, a reduction over the batch dimension, a ``mean`` cross-entropy
whose denominator counts non-ignored targets) or an in-place buffer update makes the
answer "one microbatch", with the reason.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .dynamo import DynamoGraph, hook_sites
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


class _NotSafe(Exception):
    pass


# States: ("R",), ("B", d), ("S",), ("sum",), ("mean",), ("shape", d), ("multi", states).
R = ("R",)
S = ("S",)


def _b(d: int) -> tuple:
    return ("B", d)


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
        value = _example(node) if node is not None else None
        if p.kind == "tensor" and p.local and isinstance(value, torch.Tensor) \
                and value.dim() >= 1 and _hint(value.shape[0]) is not None:
            candidates.setdefault(_hint(value.shape[0]), []).append(p.name)
    if not candidates:
        return "no input has a batch dimension"
    batch, split = max(candidates.items(), key=lambda kv: len(kv[1]))
    if batch < 2:
        return f"the batch has {batch} sample"
    split_set = set(split)
    state: dict[torch.fx.Node, tuple] = {}
    sizes: list[tuple[str, str, int]] = []
    for p in dg.placeholders:
        node = by_name.get(p.name)
        if node is None or node in state:
            continue
        if p.name in split_set:
            state[node] = _b(0)
        elif p.kind == "symint" and p.size_of is not None:
            base = dg.placeholders[p.size_of[0]].name
            if base in split_set and p.size_of[1] == 0:
                state[node] = S
                sizes.append((p.name, base, 0))
            else:
                state[node] = R
        else:
            state[node] = R
    try:
        for node in graph.nodes:
            if node.op == "placeholder":
                state.setdefault(node, R)
            elif node.op == "get_attr":
                state[node] = R
            elif node.op in ("call_function", "call_method"):
                state[node] = _transfer(node, state)
        out_node = next(n for n in graph.nodes if n.op == "output")
        rules: list[int | str] = []
        for value in out_node.args[0]:
            rules.append(_merge_rule(value, state))
    except _NotSafe as e:
        return str(e)
    if not any(r != "first" for r in rules):
        return "no output depends on the batch"
    return BatchSplit(inputs=tuple(split), sizes=tuple(sizes), outputs=tuple(rules),
                      batch=batch)


def _merge_rule(value: Any, state: dict[torch.fx.Node, tuple]) -> int | str:
    if not isinstance(value, torch.fx.Node):
        return "first"
    s = state[value]
    if s == R:
        return "first"
    if s[0] == "B":
        return s[1]
    if s == S:
        return "sum"
    if s[0] in ("sum", "mean"):
        return s[0]
    raise _NotSafe(f"output {value.name} cannot be merged across microbatches")


# --- helpers ---------------------------------------------------------------------------------

def _hint(size: Any) -> int | None:
    """A size as the example call's int (dynamic sizes are SymInts)."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _op(node: torch.fx.Node) -> str:
    """An op as a reason names it, on one short line: ``multi_head_attention_forward
    (in module 'attn')``, ``view of x_3``."""
    if node.op == "call_method":
        name = f".{node.target}()"
    else:
        name = getattr(node.target, "__name__", None) or str(node.target)
    where = node.meta.get(MODULE_PATH)
    return f"{name} ({node.name}" + (f", in module {where!r})" if where else ")")


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node


def _ndim(node: Any) -> int:
    value = _example(node)
    if not isinstance(value, torch.Tensor):
        raise _NotSafe(f"{getattr(node, 'name', node)} has no tensor metadata")
    return value.dim()


def _shape(node: Any) -> tuple:
    return tuple(_example(node).shape)


def _is_one(size: Any) -> bool:
    return bool(statically_known_true(size == 1))


def _norm(dim: Any, nd: int) -> int:
    if not isinstance(dim, int):
        raise _NotSafe(f"dimension {dim!r} is not a constant")
    return dim + nd if dim < 0 else dim


def _st(value: Any, state: dict) -> tuple:
    return state[value] if isinstance(value, torch.fx.Node) else R


def _flat(values: Any) -> list[Any]:
    out: list[Any] = []

    def visit(v: Any) -> None:
        if isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        else:
            out.append(v)
    visit(values)
    return out


def _bind(fn: Callable[..., Any], node: torch.fx.Node, args: tuple) -> dict[str, Any]:
    try:
        bound = inspect.signature(fn).bind(*args, **node.kwargs)
    except (TypeError, ValueError):
        raise _NotSafe(f"cannot read the arguments of {_op(node)}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _arg(node: torch.fx.Node, args: tuple, index: int, name: str, default: Any = None) -> Any:
    if len(args) > index:
        return args[index]
    return node.kwargs.get(name, default)


class _Op:
    """A node seen as ``fn(self_or_first, *rest)``: call_method and call_function alike."""

    def __init__(self, node: torch.fx.Node) -> None:
        self.node = node
        self.name = (str(node.target) if node.op == "call_method"
                     else getattr(node.target, "__name__", ""))
        self.args = tuple(node.args)


# --- the transfer function -------------------------------------------------------------------

def _transfer(node: torch.fx.Node, state: dict[torch.fx.Node, tuple]) -> tuple:
    inputs = [a for a in _flat((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
    if all(state[a] == R for a in inputs):
        return R
    op = _Op(node)
    handler = _handler(node, op)
    if handler is None:
        raise _NotSafe(f"{_op(node)} is applied to batch-dependent values and "
                       "roundpipe does not know whether it keeps samples apart")
    return handler(op, state)


def _handler(node: torch.fx.Node, op: _Op) -> Callable[[_Op, dict], tuple] | None:
    target = node.target
    if node.op == "call_function" and target is operator.getitem:
        return _getitem
    if node.op == "call_function" and target is getattr:
        return _getattr
    if node.op == "call_function" and target in _FUNCTIONS:
        return _FUNCTIONS[target]
    if node.op == "call_method":
        name = str(target)
        if name in _METHODS:
            return _METHODS[name]
        if name.endswith("_") and name[:-1] in _ELEMENTWISE_NAMES:
            return _elementwise
    return None


def _elementwise(op: _Op, state: dict) -> tuple:
    node = op.node
    args = [a for a in _flat((node.args, node.kwargs))]
    value = _example(node)
    states = [_st(a, state) for a in args]
    if not isinstance(value, torch.Tensor):
        return _int_arith(op, args, states)
    kinds = {s[0] for s in states}
    if kinds & {"sum", "mean"}:
        return _scalar_arith(op, args, states)
    if kinds - {"R", "B"}:
        raise _NotSafe(f"{_op(node)} mixes batch sizes into tensor values")
    out_nd = value.dim()
    aligned = {out_nd - (_ndim(a) - s[1]) for a, s in zip(args, states) if s[0] == "B"}
    if len(aligned) != 1:
        raise _NotSafe(f"{_op(node)} combines tensors batched along different "
                       "dimensions")
    d = aligned.pop()
    for a, s in zip(args, states):
        if s == R and isinstance(a, torch.fx.Node) and isinstance(_example(a), torch.Tensor):
            shape = _shape(a)
            i = d - (out_nd - len(shape))
            if 0 <= i < len(shape) and not _is_one(shape[i]):
                raise _NotSafe(f"{_op(node)} broadcasts {a.name} (not split, size "
                               f"{shape[i]}) against the batch dimension")
    return _b(d)


_PROPORTIONAL = {operator.mul, operator.imul}


def _int_arith(op: _Op, args: list[Any], states: list[tuple]) -> tuple:
    """Integer arithmetic: a batch size times a constant is still a batch size."""
    if op.node.target in _PROPORTIONAL and sum(s == S for s in states) == 1 and \
            all(s in (R, S) for s in states):
        return S
    raise _NotSafe(f"{_op(op.node)} computes with the batch size")


def _scalar_arith(op: _Op, args: list[Any], states: list[tuple]) -> tuple:
    """Arithmetic on sums and means over the batch that merging keeps exact."""
    target, name = op.node.target, op.name
    kinds = [s[0] for s in states]
    reduced = [s for s in states if s[0] in ("sum", "mean")]
    scalar_r = all(s == R and (not isinstance(a, torch.fx.Node) or _is_scalar(a))
                   for a, s in zip(args, states) if s[0] not in ("sum", "mean"))
    if len(args) == 1 or name in ("neg", "float", "double", "to", "clone", "detach",
                                  "contiguous", "type_as"):
        if len(reduced) == 1 and all(k in ("R", "sum", "mean") for k in kinds):
            return reduced[0]
    if len(args) == 2 and len(reduced) == 1:
        first_reduced = states[0][0] in ("sum", "mean")
        other = states[1] if first_reduced else states[0]
        kind = reduced[0][0]
        if target in (operator.mul, torch.mul) or name == "mul":
            if other == R and scalar_r:
                return reduced[0]
            if other == S and kind == "mean":  # mean_i * c*b_i sums to the total
                return ("sum",)
        if (target in (operator.truediv, torch.div) or name in ("div", "truediv")) \
                and first_reduced:
            if other == R and scalar_r:
                return reduced[0]
            if other == S and kind == "sum":  # sum_i / (c*b_i) averages with b_i / B
                return ("mean",)
    if len(args) == 2 and len(reduced) == 2 and reduced[0] == reduced[1] and (
            target in (operator.add, operator.sub, torch.add, torch.sub)
            or name in ("add", "sub")):
        return reduced[0]
    raise _NotSafe(f"{_op(op.node)} combines a sum or mean over the batch in a way "
                   "that does not merge exactly")


def _is_scalar(node: torch.fx.Node) -> bool:
    value = _example(node)
    return not isinstance(value, torch.Tensor) or value.dim() == 0


def _single_batched(op: _Op, state: dict) -> tuple[int, int]:
    """The first argument is B(d); every other tensor argument is R.  Returns (d, ndim)."""
    first = op.args[0] if op.args else None
    s = _st(first, state)
    if s[0] != "B":
        raise _NotSafe(f"{_op(op.node)}: its batch-dependent input is not its "
                       "first argument")
    for a in _flat((op.args[1:], op.node.kwargs)):
        if isinstance(a, torch.fx.Node) and state[a] != R:
            raise _NotSafe(f"{_op(op.node)} has several batch-dependent inputs")
    return s[1], _ndim(first)


def _dim_local(arg_index: int, name: str, default: Any = None) -> Callable[[_Op, dict], tuple]:
    """Ops acting along one dimension (softmax, cumsum): safe unless it is the batch's."""
    def handler(op: _Op, state: dict) -> tuple:
        d, nd = _single_batched(op, state)
        dim = _arg(op.node, op.args, arg_index, name, default)
        if dim is None or _norm(dim, nd) == d:
            raise _NotSafe(f"{_op(op.node)} runs along the batch dimension")
        return _b(d)
    return handler


def _dim_local_pair(arg_index: int, name: str, default: Any = None
                    ) -> Callable[[_Op, dict], tuple]:
    """``topk`` / ``sort`` along a dimension that is not the batch's: values and indices
    are batched like the input."""
    def handler(op: _Op, state: dict) -> tuple:
        d, nd = _single_batched(op, state)
        dim = _arg(op.node, op.args, arg_index, name, default)
        if dim is None or _norm(dim, nd) == d:
            raise _NotSafe(f"{_op(op.node)} runs along the batch dimension")
        return ("multi", (_b(d), _b(d)))
    return handler


def _gather_scatter(op: _Op, state: dict) -> tuple:
    """``gather`` / ``scatter`` / ``scatter_add`` / ``scatter_reduce`` along a dimension
    that is not the batch's, with the index (and source) batched like the input at the
    same size: row ``i`` reads and writes only row ``i`` (top-k routing in
    mixture-of-experts layers)."""
    node = op.node
    x = op.args[0] if op.args else None
    sx = _st(x, state)
    if sx[0] != "B":
        raise _NotSafe(f"{_op(node)} writes batch values into a replicated tensor")
    d, nd = sx[1], _ndim(x)
    dim = _arg(node, op.args, 1, "dim")
    if not isinstance(dim, int) or _norm(dim, max(nd, 1)) == d:
        raise _NotSafe(f"{_op(node)} indexes along the batch dimension")
    rows = _shape(x)[d]
    for a in _flat((op.args[2:], node.kwargs)):
        if not isinstance(a, torch.fx.Node) or _is_scalar(a):
            continue
        shape = _shape(a)
        if _st(a, state) != sx or len(shape) != nd \
                or not statically_known_true(shape[d] == rows):
            raise _NotSafe(f"{_op(node)}: {a.name} is not batched like "
                           f"{x.name}, so rows could move between samples")
    return _b(d)


def _layer_norm(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    shape = _arg(op.node, op.args, 1, "normalized_shape")
    count = 1 if isinstance(shape, int) else len(shape)
    if d >= nd - count:
        raise _NotSafe(f"{_op(op.node)} normalizes over the batch dimension")
    return _b(d)


def _batch_first(expected_ndim: Callable[[int], bool]) -> Callable[[_Op, dict], tuple]:
    """Ops on (N, C, ...) inputs (convolutions, pooling, group norm): the batch is dim 0."""
    def handler(op: _Op, state: dict) -> tuple:
        d, nd = _single_batched(op, state)
        if d != 0 or not expected_ndim(nd):
            raise _NotSafe(f"{_op(op.node)} needs the batch in dimension 0 of a "
                           "batched input")
        return _b(0)
    return handler


def _norm_layer(op: _Op, state: dict) -> tuple:
    """batch_norm with running statistics (eval), instance_norm: per sample."""
    args = _bind(op.node.target, op.node, op.args)
    d, nd = _single_batched(op, state)
    mixes = args.get("training") if "training" in args else False
    if mixes or d != 0 or nd < 2:
        raise _NotSafe(f"{_op(op.node)} computes statistics over the batch")
    return _b(0)


def _linear(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    if d >= nd - 1:
        raise _NotSafe(f"{_op(op.node)} contracts the batch dimension")
    return _b(d)


def _embedding(op: _Op, state: dict) -> tuple:
    d, _ = _single_batched(op, state)
    return _b(d)


def _one_hot(op: _Op, state: dict) -> tuple:
    d, _ = _single_batched(op, state)
    if _arg(op.node, op.args, 1, "num_classes", -1) == -1:  # inferred from every sample
        raise _NotSafe(f"{_op(op.node)} infers num_classes from the whole batch")
    return _b(d)


def _matmul(op: _Op, state: dict) -> tuple:
    a, b = op.args[0], op.args[1]
    sa, sb = _st(a, state), _st(b, state)
    na, nb, no = _ndim(a), _ndim(b), _ndim(op.node)
    if sa[0] == "B" and sb == R and nb <= 2 and na >= 2 and sa[1] < na - 1:
        return _b(sa[1] + no - na)
    if sa == R and sb[0] == "B" and na <= 2 and sb[1] < nb - 2:
        return _b(sb[1] + no - nb)
    if sa[0] == "B" and sb[0] == "B" and na == nb >= 3 and sa[1] == sb[1] < na - 2:
        return _b(sa[1])
    raise _NotSafe(f"{_op(op.node)} contracts or broadcasts the batch dimension")


def _sdpa(op: _Op, state: dict) -> tuple:
    q, k, v = op.args[0], op.args[1], op.args[2]
    states = {_st(x, state) for x in (q, k, v)}
    nd = _ndim(q)
    if len(states) != 1 or next(iter(states))[0] != "B" or next(iter(states))[1] >= nd - 2:
        raise _NotSafe(f"{_op(op.node)}: query, key and value are not batched "
                       "alike")
    d = next(iter(states))[1]
    mask = _arg(op.node, op.args, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node):
        sm = state[mask]
        shape = _shape(mask)
        i = d - (nd - len(shape))
        if sm == R:
            if 0 <= i < len(shape) and not _is_one(shape[i]):
                raise _NotSafe(f"{_op(op.node)}: the mask {mask.name} is not split "
                               "but has the batch's size")
        elif sm != _b(i):
            raise _NotSafe(f"{_op(op.node)}: the mask is batched along another "
                           "dimension")
    return _b(d)


def _multi_head_attention(op: _Op, state: dict) -> tuple:
    """``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, whose ``forward``
    transposes ``batch_first`` inputs to ``(L, N, E)`` first): row ``n`` of the query
    attends to row ``n`` of the key and value only, so it keeps samples apart when query,
    key and value are batched along dimension 1 alike.  The masks must be batched with
    them: ``key_padding_mask`` ``(N, S)`` along dimension 0, a 3-D ``attn_mask`` and
    ``static_k`` / ``static_v`` ``(N * heads, ...)`` along dimension 0 (sample ``n``'s
    heads are rows ``n * heads`` to ``n * heads + heads - 1``, whole blocks); a 2-D
    ``attn_mask`` is shared by every sample.  Returns (output along dimension 1, the
    attention weights, ``(N, ...)``, along dimension 0)."""
    node = op.node
    args = _bind(node.target, node, op.args)
    q = args["query"]
    rows = _shape(q)[1] if _ndim(q) == 3 else None
    for name in ("query", "key", "value"):
        x = args[name]
        if _ndim(x) != 3 or _st(x, state) != _b(1) or \
                not statically_known_true(_shape(x)[1] == rows):
            raise _NotSafe(f"{_op(node)}: its {name} is not batched along dimension 1 like "
                           "the query (an (L, N, E) input)")
    heads = args["num_heads"]
    batched_masks = {"key_padding_mask": (2, rows), "attn_mask": (3, None),
                     "static_k": (3, None), "static_v": (3, None)}
    for name, value in args.items():
        if name in ("query", "key", "value") or not isinstance(value, torch.fx.Node):
            continue
        s = state[value]
        if name == "attn_mask" and s == R and _ndim(value) == 2:
            continue  # (L, S): the same for every sample
        if name not in batched_masks:
            if s != R:
                raise _NotSafe(f"{_op(node)}: its {name} depends on the batch")
            continue
        ndim, size = batched_masks[name]
        size = size if size is not None else (rows * heads if isinstance(heads, int)
                                              else None)
        if s != _b(0) or _ndim(value) != ndim or size is None or \
                not statically_known_true(_shape(value)[0] == size):
            raise _NotSafe(f"{_op(node)}: its {name} is not batched along dimension 0 with "
                           "the query's samples")
    weights = _example(node)[1] if isinstance(_example(node), (tuple, list)) else None
    return ("multi", (_b(1), _b(0) if isinstance(weights, torch.Tensor) else R))


def _pad(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    pad = _arg(op.node, op.args, 1, "pad")
    if not isinstance(pad, (list, tuple)) or d >= nd - len(pad) // 2:
        raise _NotSafe(f"{_op(op.node)} pads the batch dimension")
    return _b(d)


_REDUCTIONS = {"sum": "sum", "mean": "mean"}


def _reduction(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    dim = _arg(op.node, op.args, 1, "dim")
    if op.name in ("var", "std") and len(op.args) > 2:  # positional unbiased/keepdim
        raise _NotSafe(f"cannot read the arguments of {_op(op.node)}")
    keepdim = bool(op.node.kwargs.get("keepdim", False) if op.name in ("var", "std")
                   else _arg(op.node, op.args, 2, "keepdim", False))
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        kind = _REDUCTIONS.get(op.name)
        if kind is None or _ndim(op.node) != 0:
            raise _NotSafe(f"{_op(op.node)} reduces over the whole batch")
        return (kind,)
    if isinstance(dim, torch.fx.Node):
        raise _NotSafe(f"{_op(op.node)}: the reduced dimension is not a constant")
    dims = {_norm(x, nd) for x in (dim if isinstance(dim, (list, tuple)) else [dim])}
    if d in dims:
        raise _NotSafe(f"{_op(op.node)} reduces over the batch dimension")
    new = d if keepdim else d - sum(1 for x in dims if x < d)
    if isinstance(_example(op.node), tuple):  # max/min with dim: (values, indices)
        return ("multi", tuple(_b(new) for _ in _example(op.node)))
    return _b(new)


def _binary_or_reduction(op: _Op, state: dict) -> tuple:
    """``torch.max(x, y)`` is elementwise, ``torch.max(x, dim)`` a reduction."""
    if len(op.args) > 1 and isinstance(op.args[1], torch.fx.Node) or "other" in op.node.kwargs:
        return _elementwise(op, state)
    return _reduction(op, state)


def _loss(op: _Op, state: dict) -> tuple:
    """Pointwise losses: ``none`` keeps the batch, ``sum`` and ``mean`` merge exactly
    (every element counts the same); class losses only with ``sum`` or ``none``."""
    fn = op.node.target
    args = _bind(fn, op.node, op.args)
    inp, tgt = args.get("input"), args.get("target")
    reduction = args.get("reduction", "mean")
    if args.get("size_average") is not None or args.get("reduce") is not None:
        raise _NotSafe(f"{_op(op.node)} uses the deprecated size_average/reduce")
    si, st = _st(inp, state), _st(tgt, state)
    for key, value in args.items():
        if key not in ("input", "target") and isinstance(value, torch.fx.Node) \
                and state[value] != R:
            raise _NotSafe(f"{_op(op.node)}: {key} depends on the batch")
    if si[0] != "B" or st[0] != "B":
        raise _NotSafe(f"{_op(op.node)}: input and target are not both batched")
    d = si[1]
    classwise = fn in (F.cross_entropy, F.nll_loss)
    if classwise:
        if d != 0 or st[1] != 0:
            raise _NotSafe(f"{_op(op.node)} needs the batch in dimension 0")
    elif st[1] != d or _ndim(inp) != _ndim(tgt):
        raise _NotSafe(f"{_op(op.node)}: input and target are batched differently")
    if reduction == "none":
        return _b(d)
    if reduction == "sum":
        return ("sum",)
    if reduction == "mean" and not classwise:
        return ("mean",)
    if reduction == "batchmean" and d == 0:
        return ("mean",)
    raise _NotSafe(f"{_op(op.node)} with reduction={reduction!r} divides by a count "
                   "that is not proportional to the batch (ignored targets, class weights); "
                   "use reduction='sum' and divide outside to microbatch it")


# --- shapes ----------------------------------------------------------------------------------

def _sizes_arg(op: _Op, start: int) -> list[Any]:
    sizes = list(op.args[start:])
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = list(sizes[0])
    for key in ("size", "shape"):
        if key in op.node.kwargs:
            sizes = list(op.node.kwargs[key])
    return sizes


def _prod(sizes: Sequence[Any]) -> Any:
    out: Any = 1
    for s in sizes:
        out = out * s
    return out


def _reshape(op: _Op, state: dict) -> tuple:
    """view/reshape: the batch dimension must start at the same flat offset, each sample
    must span whole rows of the new dimension, and its size must not be a constant."""
    node = op.node
    x = op.args[0]
    d, nd = _single_batched_any(op, state, x)
    in_shape, out_shape = _shape(x), _shape(node)
    if op.name in ("view_as", "reshape_as"):
        other = op.args[1]
        so = _st(other, state)
        size_states = [R] * len(out_shape)
        if so[0] == "B":
            size_states[so[1]] = S
    else:
        sizes = _sizes_arg(op, 1)
        if len(sizes) != len(out_shape):
            raise _NotSafe(f"cannot read the sizes of {_op(node)}")
        size_states = [_st(s, state) for s in sizes]
        if S not in size_states:  # an inferred size (-1) may take the batch
            inferred = [j for j, s in enumerate(sizes) if isinstance(s, int) and s == -1]
            if len(inferred) == 1:
                size_states[inferred[0]] = S
    before = _prod(in_shape[:d])
    per_sample = _prod(in_shape[d + 1:])
    if size_states.count(S) == 1:
        j = size_states.index(S)
        rest = _prod(out_shape[j + 1:])
        # Same flat offset before the batch, and each sample spans whole rows of dim j.
        if statically_known_true(_prod(out_shape[:j]) == before) and \
                statically_known_true(per_sample % rest == 0):
            return _b(j)
    raise _NotSafe(f"{_op(node)} reshapes the batch dimension (or gives its size as "
                   "a constant: compile with dynamic=True, or mark the batch dimension "
                   "dynamic, to microbatch it)")


def _single_batched_any(op: _Op, state: dict, x: Any) -> tuple[int, int]:
    s = _st(x, state)
    if s[0] != "B":
        raise _NotSafe(f"{_op(op.node)}: unexpected batch dependence")
    return s[1], _ndim(x)


def _flatten(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    start = _norm(_arg(op.node, op.args, 1, "start_dim", 0), nd)
    end = _norm(_arg(op.node, op.args, 2, "end_dim", -1), nd)
    if d < start:
        return _b(d)
    if d > end:
        return _b(d - (end - start))
    shape = _shape(op.args[0])
    if all(_is_one(shape[i]) for i in range(start, d)):
        return _b(start)
    raise _NotSafe(f"{_op(op.node)} merges the batch dimension with a dimension "
                   "before it")


def _unflatten(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    dim = _norm(_arg(op.node, op.args, 1, "dim"), nd)
    sizes = _arg(op.node, op.args, 2, "sizes")
    if dim == d or not isinstance(sizes, (list, tuple)):
        raise _NotSafe(f"{_op(op.node)} splits the batch dimension")
    return _b(d + len(sizes) - 1 if dim < d else d)


def _transpose(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    if op.name in ("t",):
        a, b = 0, 1
    elif op.name == "mT":
        a, b = nd - 2, nd - 1
    else:
        a = _norm(_arg(op.node, op.args, 1, "dim0"), nd)
        b = _norm(_arg(op.node, op.args, 2, "dim1"), nd)
    return _b(b if d == a else a if d == b else d)


def _permute(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    dims = _sizes_arg(op, 1) if "dims" not in op.node.kwargs else list(op.node.kwargs["dims"])
    dims = [_norm(x, nd) for x in dims]
    return _b(dims.index(d))


def _unsqueeze(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    k = _norm(_arg(op.node, op.args, 1, "dim"), nd + 1)
    return _b(d + 1 if k <= d else d)


def _squeeze(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    dim = _arg(op.node, op.args, 1, "dim")
    if dim is None:
        raise _NotSafe(f"{_op(op.node)} would drop the batch dimension of a "
                       "one-sample microbatch")
    dims = {_norm(x, nd) for x in (dim if isinstance(dim, (list, tuple)) else [dim])}
    if d in dims:
        raise _NotSafe(f"{_op(op.node)} squeezes the batch dimension")
    return _b(d - sum(1 for x in dims if x < d))


def _select_like(op: _Op, state: dict) -> tuple:
    """narrow / select along a dimension other than the batch's."""
    d, nd = _single_batched(op, state)
    dim = _norm(_arg(op.node, op.args, 1, "dim"), nd)
    if dim == d:
        raise _NotSafe(f"{_op(op.node)} indexes the batch dimension")
    if op.name == "select" and dim < d:
        return _b(d - 1)
    return _b(d)


def _split_like(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    index = 1 if op.name == "unbind" else 2
    dim = _norm(_arg(op.node, op.args, index, "dim", 0), nd)
    if dim == d:
        raise _NotSafe(f"{_op(op.node)} splits along the batch dimension")
    new = d - 1 if (op.name == "unbind" and dim < d) else d
    value = _example(op.node)
    count = len(value) if isinstance(value, (list, tuple)) else 0
    return ("multi", tuple(_b(new) for _ in range(count)))


def _cat(op: _Op, state: dict) -> tuple:
    tensors = _arg(op.node, op.args, 0, "tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise _NotSafe(f"cannot read the inputs of {_op(op.node)}")
    states = {_st(t, state) for t in tensors}
    if len(states) != 1 or next(iter(states))[0] != "B":
        raise _NotSafe(f"{_op(op.node)} joins batched and unbatched tensors")
    d = next(iter(states))[1]
    nd = _ndim(tensors[0])
    stack = op.name == "stack"
    dim = _norm(_arg(op.node, op.args, 1, "dim", 0), nd + (1 if stack else 0))
    if stack:
        return _b(d + 1 if dim <= d else d)
    if dim == d:
        raise _NotSafe(f"{_op(op.node)} concatenates along the batch dimension")
    return _b(d)


def _expand(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    out_nd = _ndim(op.node)
    j = d + out_nd - nd
    if op.name == "expand_as":
        return _b(j)
    sizes = _sizes_arg(op, 1)
    if len(sizes) != out_nd or not (sizes[j] == -1 or _st(sizes[j], state) == S):
        raise _NotSafe(f"{_op(op.node)} gives the batch size as a constant")
    return _b(j)


def _like(op: _Op, state: dict) -> tuple:
    """zeros_like(x) and friends: shaped like x."""
    s = _st(op.args[0], state)
    if s[0] != "B":
        raise _NotSafe(f"{_op(op.node)}: unexpected batch dependence")
    return s


def _factory(op: _Op, state: dict) -> tuple:
    """torch.zeros(B, T) / x.new_zeros(B, T): batched where the size is a batch size."""
    start = 1 if op.node.op == "call_method" else 0
    sizes = _sizes_arg(op, start)
    states = [_st(s, state) for s in sizes]
    if any(s not in (R, S) for s in states) or states.count(S) != 1:
        raise _NotSafe(f"{_op(op.node)} creates a tensor from batch-dependent "
                       "values")
    return _b(states.index(S))


def _size(op: _Op, state: dict) -> tuple:
    d, nd = _single_batched(op, state)
    dim = _arg(op.node, op.args, 1, "dim")
    if dim is None:
        return ("shape", d)
    return S if _norm(dim, nd) == d else R


def _getattr(op: _Op, state: dict) -> tuple:
    s = _st(op.args[0], state)
    attr = op.args[1]
    if attr == "shape" and s[0] == "B":
        return ("shape", s[1])
    if attr in ("dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"):
        return R
    if attr in ("values", "indices") and s[0] == "multi" and len(s[1]) == 2:
        return s[1][0 if attr == "values" else 1]  # topk / sort's named results
    if attr == "mT" and s[0] == "B":
        nd, d = _ndim(op.args[0]), s[1]
        return _b(nd - 1 if d == nd - 2 else nd - 2 if d == nd - 1 else d)
    if attr == "T" and s[0] == "B" and _ndim(op.args[0]) == 2:
        return _b(1 - s[1])
    raise _NotSafe(f"{_op(op.node)}: attribute {attr!r} of a batch-dependent value")


def _getitem(op: _Op, state: dict) -> tuple:
    base, index = op.args[0], op.args[1]
    s = _st(base, state)
    if s[0] == "multi":
        if not isinstance(index, int):
            raise _NotSafe(f"{_op(op.node)}: non-constant index")
        return s[1][index]
    if s[0] == "shape":
        if isinstance(index, int):
            return S if _norm(index, len(_example(base))) == s[1] else R
        raise _NotSafe(f"{_op(op.node)} slices a shape that holds the batch size")
    if s[0] != "B":
        raise _NotSafe(f"{_op(op.node)} indexes a batch-dependent value")
    items = list(index) if isinstance(index, tuple) else [index]
    bounds = [b for it in items if isinstance(it, slice) for b in (it.start, it.stop, it.step)]
    for a in _flat(items) + bounds:
        if isinstance(a, torch.fx.Node) and (isinstance(_example(a), torch.Tensor)
                                             or state[a] != R):
            raise _NotSafe(f"{_op(op.node)} indexes a batched tensor with a tensor "
                           "or with the batch size")
    nd = _ndim(base)
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    in_dim = out_dim = 0
    d = s[1]
    for it in items:
        if it is Ellipsis:
            skip = nd - consumed
            if in_dim <= d < in_dim + skip:
                return _b(out_dim + d - in_dim)
            in_dim += skip
            out_dim += skip
        elif it is None:
            out_dim += 1
        elif isinstance(it, int) and not isinstance(it, bool):
            if in_dim == d:
                raise _NotSafe(f"{_op(op.node)} picks one sample")
            in_dim += 1
        elif isinstance(it, slice):
            if in_dim == d:
                if it != slice(None, None, None):
                    raise _NotSafe(f"{_op(op.node)} slices the batch dimension")
                return _b(out_dim)
            in_dim += 1
            out_dim += 1
        else:
            raise _NotSafe(f"{_op(op.node)}: index {it!r} is not understood")
    return _b(out_dim + d - in_dim)  # the batch dimension lies after the indexed ones


# --- op tables -------------------------------------------------------------------------------

_ELEMENTWISE_NAMES = {
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow",
    "neg", "negative", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p",
    "sqrt", "rsqrt", "square", "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin", "acos",
    "atan", "atan2", "sigmoid", "relu", "relu6", "gelu", "silu", "mish", "elu", "selu",
    "celu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "softplus", "softsign",
    "logsigmoid", "tanhshrink", "threshold", "erf", "erfc", "erfinv", "clamp", "clip",
    "clamp_min", "clamp_max", "maximum", "minimum", "fmax", "fmin", "where", "lerp",
    "addcmul", "addcdiv", "masked_fill", "sign", "sgn", "reciprocal", "rsub", "floor",
    "ceil", "round", "trunc", "frac", "logical_and", "logical_or", "logical_not",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "eq", "ne",
    "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "nan_to_num", "float_power",
    "hypot", "xlogy", "logit", "dropout", "contiguous", "clone", "detach", "to", "type",
    "type_as", "float", "half", "bfloat16", "double", "int", "long", "bool", "byte",
}
_OPERATORS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
              operator.mod, operator.pow, operator.neg, operator.pos, operator.abs,
              operator.invert, operator.and_, operator.or_, operator.xor, operator.eq,
              operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
              operator.iadd, operator.isub, operator.imul, operator.itruediv,
              operator.iand, operator.ior}

_FUNCTIONS: dict[Any, Callable[[_Op, dict], tuple]] = {}
_METHODS: dict[str, Callable[[_Op, dict], tuple]] = {}


def _register(names: Sequence[str], handler: Callable[[_Op, dict], tuple], *,
              modules: Sequence[Any] = (torch, F, torch._C._nn, torch.special),
              methods: bool = True) -> None:
    for name in names:
        for module in modules:
            fn = getattr(module, name, None)
            if callable(fn):
                _FUNCTIONS.setdefault(fn, handler)
        if methods:
            _METHODS.setdefault(name, handler)


_register(sorted(_ELEMENTWISE_NAMES), _elementwise)
for _fn in _OPERATORS:
    _FUNCTIONS[_fn] = _elementwise
_register(["softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp"],
          _dim_local(1, "dim"))
_register(["glu"], _dim_local(1, "dim", -1))
_register(["argsort"], _dim_local(1, "dim", -1))
_register(["topk"], _dim_local_pair(2, "dim", -1))
_register(["sort"], _dim_local_pair(1, "dim", -1))
_register(["gather", "scatter", "scatter_add", "scatter_reduce"], _gather_scatter)
_register(["normalize"], _dim_local(2, "dim", 1), methods=False)
_register(["layer_norm", "rms_norm"], _layer_norm)
_register(["group_norm"], _batch_first(lambda nd: nd >= 2))
for _k in (1, 2, 3):
    _register([f"conv{_k}d", f"conv_transpose{_k}d", f"max_pool{_k}d", f"avg_pool{_k}d",
               f"adaptive_max_pool{_k}d", f"adaptive_avg_pool{_k}d", f"lp_pool{_k}d"],
              _batch_first(lambda nd, k=_k: nd == k + 2), methods=False)
_register(["linear"], _linear, methods=False)
_register(["embedding"], _embedding, methods=False)
_register(["one_hot"], _one_hot, modules=(F, torch._C._nn), methods=False)
_register(["matmul", "bmm"], _matmul)
_FUNCTIONS[operator.matmul] = _matmul
_register(["scaled_dot_product_attention"], _sdpa, methods=False)
_register(["multi_head_attention_forward"], _multi_head_attention, modules=(F,),
          methods=False)
_register(["pad"], _pad, modules=(F, torch._C._nn), methods=False)
_register(["sum", "mean", "amax", "amin", "prod", "var", "std", "logsumexp", "argmax",
           "argmin", "all", "any"], _reduction)
_register(["batch_norm", "instance_norm"], _norm_layer, methods=False)
_register(["max", "min"], _binary_or_reduction)
_register(["mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
           "cross_entropy", "nll_loss"], _loss, modules=(F,), methods=False)
_register(["view", "reshape", "view_as", "reshape_as"], _reshape)
_register(["flatten"], _flatten)
_register(["unflatten"], _unflatten)
_register(["transpose", "swapaxes", "swapdims", "t"], _transpose)
_register(["permute"], _permute)
_register(["unsqueeze"], _unsqueeze)
_register(["squeeze"], _squeeze)
_register(["narrow", "select"], _select_like)
_register(["split", "chunk", "unbind", "tensor_split"], _split_like)
_register(["cat", "concat", "concatenate", "stack"], _cat, methods=False)
_register(["expand", "expand_as"], _expand)
_register(["zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
           "randn_like"], _like, methods=False)
_register(["zeros", "ones", "empty", "full", "rand", "randn"], _factory, methods=False)
_register(["new_zeros", "new_ones", "new_empty", "new_full"], _factory)
_register(["size"], _size)
del _fn, _k


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
