"""Splitting calls into microbatches and merging their outputs.

Default rule: the batch size is the first dimension of the first tensor among the inputs;
every tensor whose first dimension equals it is split along dimension 0
(``torch.tensor_split``: sizes differ by at most one), everything else is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError, InputError
from ..plan import OutputMergePlan, OutputTail

_is_none = lambda x: x is None  # noqa: E731 - a leaf predicate for pytree


def batch_size_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    raise InputError(
        "no input tensor has a batch dimension, so the call cannot be split into "
        "microbatches; pass split_input=... in RoundPipeRunConfig to split it yourself"
    )


def input_path(path: tuple[Any, ...]) -> str:
    """Name a leaf of ``(args, kwargs)`` as the user wrote it: ``input_args[0]``,
    ``input_kwargs['attention_mask']``."""
    if not path:
        return "input"
    head = "input_args" if getattr(path[0], "idx", None) == 0 else "input_kwargs"
    return head + pytree.keystr(tuple(path[1:]))


def check_on_cpu(tree: Any, what: str) -> None:
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
            name = input_path(path) if what == "input" else what + pytree.keystr(path)
            raise InputError(
                f"{name} is on {leaf.device}, but roundpipe keeps all "
                "model state and inputs in host memory and streams them to devices itself; "
                "pass CPU tensors (drop the .to(device) / .cuda() call)"
            )


def _split_tensor(t: torch.Tensor, dim: int, num: int, what: str) -> list[torch.Tensor]:
    if t.dim() <= dim or t.shape[dim] < num:
        size = t.shape[dim] if t.dim() > dim else "no"
        raise InputError(
            f"{what} has {size} rows along dim {dim}, fewer than num_microbatch={num}; "
            f"use a batch of at least {num} or lower num_microbatch"
        )
    return list(torch.tensor_split(t, num, dim=dim))


def split_tree(tree: Any, num: int, batch: int, spec: Any, what: str) -> list[Any]:
    """Split a pytree into ``num`` microbatches.

    Args:
        tree: the inputs (or the label).
        num: number of microbatches.
        batch: batch size used by the default rule.
        spec: ``None`` for the default rule, or a pytree matching ``tree`` whose leaves
            are the dim to split along (int) or ``None`` (replicate).
        what: name used in error messages.
    """
    leaves, treespec = pytree.tree_flatten(tree)
    if spec is None:
        dims: list[int | None] = [0 if isinstance(x, torch.Tensor) and x.dim() >= 1
                                  and x.shape[0] == batch else None for x in leaves]
    else:
        dims = pytree.tree_flatten(spec, is_leaf=_is_none)[0]
        if len(dims) != len(leaves):
            raise ConfigError(
                f"split spec for {what} has {len(dims)} leaves but {what} has {len(leaves)}; "
                "give one int (dim) or None (replicate) per leaf"
            )
    pieces: list[list[Any]] = []
    for leaf, dim in zip(leaves, dims):
        if dim is None:
            pieces.append([leaf] * num)
        elif not isinstance(leaf, torch.Tensor):
            raise ConfigError(f"split spec asks to split a {type(leaf).__name__} in {what}")
        else:
            pieces.append(_split_tensor(leaf, dim, num, what))
    return [pytree.tree_unflatten([p[i] for p in pieces], treespec) for i in range(num)]


def split_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], num: int,
                 spec: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Split ``(args, kwargs)`` into ``num`` microbatches (see the module docstring)."""
    if callable(spec):
        parts = list(spec(args, kwargs, num))
        if len(parts) != num:
            raise ConfigError(f"split_input returned {len(parts)} microbatches, expected {num}")
        return [(tuple(a), dict(k)) for a, k in parts]
    batch = batch_size_of(args, kwargs) if spec is None else -1
    if spec is None and batch < num:
        raise InputError(
            f"the batch has {batch} samples but num_microbatch={num}; each microbatch needs "
            f"at least one sample: use a batch of at least {num} or lower num_microbatch"
        )
    return [(tuple(a), dict(k)) for a, k in split_tree((args, kwargs), num, batch, spec,
                                                       "input")]


def split_label(label: Any, num: int, batch: int, spec: Any) -> list[Any]:
    """Split ``label`` like the inputs; its batch dimension must match theirs."""
    if label is None:
        return [None] * num
    if callable(spec):
        parts = list(spec(label, num))
        if len(parts) != num:
            raise ConfigError(f"split_label returned {len(parts)} microbatches, expected {num}")
        return parts
    if spec is None:
        for path, leaf in pytree.tree_flatten_with_path(label)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] != batch:
                raise InputError(
                    f"label{pytree.keystr(path)} has batch size {leaf.shape[0]} but the inputs "
                    f"have {batch}; labels are split into microbatches like the inputs, so "
                    "their first dimensions must match (or pass split_label=...)"
                )
    return split_tree(label, num, batch, spec, "label")


def merge_rules(outputs: Sequence[Any], sizes: Sequence[int], spec: Any) -> list[Any]:
    """The rule merging each flat output column: a dim (concatenate), ``"sum"`` or
    ``"first"``.  Used by :func:`merge_outputs` and to route gradients back."""
    flat = [pytree.tree_flatten(o)[0] for o in outputs]
    columns = list(zip(*flat))
    if spec is None:
        given: list[Any] = [None] * len(columns)
    elif isinstance(spec, (int, str)) and len(columns) != 1:
        # one rule for every output it applies to (a dim: the tensors that have it)
        given = [spec if isinstance(c[0], torch.Tensor) and (
            not isinstance(spec, int) or c[0].dim() > spec) else None for c in columns]
    else:
        given = pytree.tree_flatten(spec, is_leaf=_is_none)[0]
        if len(given) != len(columns):
            raise ConfigError(
                f"merge spec has {len(given)} leaves but the output has {len(columns)}; "
                "give one rule per output leaf, or a single rule for all of them")
    rules = []
    for column, rule in zip(columns, given):
        first = column[0]
        if not isinstance(first, torch.Tensor):
            rules.append("first")
        elif rule is not None:
            if rule not in ("sum", "stack", "first") and not isinstance(rule, int):
                raise ConfigError(
                    f"unknown merge rule {rule!r}; use an int dim, 'sum', 'stack', 'first' "
                    "or None")
            rules.append(rule)
        elif first.dim() >= 1 and all(isinstance(v, torch.Tensor) and v.dim() >= 1
                                      and v.shape[0] == n for v, n in zip(column, sizes)):
            rules.append(0)
        elif first.dim() == 0 and first.is_floating_point():
            rules.append("sum")
        else:
            rules.append("first")
    return rules


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int], spec: Any,
                  device: torch.device) -> Any:
    """Merge per-microbatch outputs (see ``RoundPipeRunConfig.merge_output``)."""
    if callable(spec):
        return spec(list(outputs))
    treespec = pytree.tree_flatten(outputs[0])[1]
    columns = list(zip(*(pytree.tree_flatten(o)[0] for o in outputs)))
    merged = []
    for column, rule in zip(columns, merge_rules(outputs, sizes, spec)):
        value = merge_column(list(column), rule)
        if isinstance(value, torch.Tensor) and value.device != device:
            value = value.to(device)
        merged.append(value)
    return pytree.tree_unflatten(merged, treespec)


def merge_column(values: Sequence[Any], rule: Any, sizes: Sequence[int] = ()) -> Any:
    """Merge one output's microbatch values by ``rule``: an int dim (concatenate),
    ``"sum"``, ``"mean"`` (weighted by the microbatch ``sizes``), ``"stack"`` or
    ``"first"``.  Both front ends merge here; :func:`split_grad` is the inverse."""
    values = list(values)
    if rule == "first" or len(values) == 1 and rule in ("sum", "mean"):  # the value itself
        return values[0]
    if rule == "sum":
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total
    if rule == "mean":
        batch = sum(sizes)
        total = values[0] * (sizes[0] / batch)
        for v, b in zip(values[1:], sizes[1:]):
            total = total + v * (b / batch)
        return total
    if rule == "stack":
        return torch.stack(values)
    return _cat_keeping_layout(values, rule)


def _cat_keeping_layout(values: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` whose result has the dimension order of the pieces' layout, as
    eager's whole-batch value has: a microbatch of a permuted or transposed value
    (batch not outermost) concatenated contiguously had other strides than eager's, and
    stride-reading code after the merge (an output tail's ``as_strided``) read other
    elements.  Contiguous and channels-last pieces are concatenated as before."""
    first = values[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.is_contiguous():
        return torch.cat(values, dim=dim)
    strides = torch.empty_like(first, device="meta").stride()
    order = sorted(range(first.dim()), key=lambda d: (-strides[d], d))
    if order == list(range(first.dim())) or any(
            not isinstance(v, torch.Tensor) or v.dim() != first.dim() for v in values):
        return torch.cat(values, dim=dim)
    dim = dim % first.dim()
    merged = torch.cat([v.permute(order) for v in values], dim=order.index(dim))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return merged.permute(inverse)


def split_grad(grad: torch.Tensor, rule: Any, pieces: Sequence[Any],
               sizes: Sequence[int] = ()) -> list[torch.Tensor | None]:
    """The gradient of each microbatch value ``pieces[i]`` of an output merged by
    ``rule`` (see :func:`merge_column`), given the merged output's gradient."""
    n = len(pieces)
    if rule == "stack":  # (even of one microbatch: the merge added a dimension)
        return list(grad.unbind(0))
    if rule == "first" or n == 1:
        return [grad] + [None] * (n - 1)
    if rule == "sum":
        return [grad] * n
    if rule == "mean":
        batch = sum(sizes)
        return [grad * (b / batch) for b in sizes]
    return list(torch.split(grad, [int(p.shape[rule]) for p in pieces], dim=rule))


def join_input_grad(pieces: Sequence[torch.Tensor | None], split: Sequence[Any] | None
                    ) -> torch.Tensor | None:
    """An input's gradient from its microbatch gradients.

    ``split``: the input's microbatch pieces where it was split along dim 0 (their
    gradients are concatenated; a microbatch that gave none contributes zeros of its
    piece's shape), or None where every microbatch read the whole input (their
    gradients are summed).  The result never aliases a microbatch gradient.
    """
    if all(p is None for p in pieces):
        return None
    if split is not None:
        return torch.cat([g if g is not None else torch.zeros_like(x, dtype=_dtype(pieces))
                          for g, x in zip(pieces, split)])
    total: torch.Tensor | None = None
    for p in pieces:
        if p is not None:
            total = p.clone() if total is None else total + p
    return total


def _dtype(pieces: Sequence[torch.Tensor | None]) -> torch.dtype:
    return next(p.dtype for p in pieces if p is not None)


# --- merging by the program's proven rules (plan.OutputMergePlan) -------------------------

@dataclass
class MergeColumn:
    """One merged value of a call: a model output or an input of the output tail, with
    the rule that merged it and its microbatch pieces (what a backward splits back)."""

    value: str | None    # the program value (None: a constant output)
    rule: Any            # an int dim (concatenated), "first", "sum", "mean" or "stack"
    pieces: list[Any]


def split_output_grads(columns: Sequence[MergeColumn], grads: Sequence[torch.Tensor | None],
                       sizes: Sequence[int] = ()) -> list[dict[str, torch.Tensor]]:
    """The gradient of each program value per microbatch, from the gradients of the
    merged ``columns`` (``sizes``: the microbatch sizes, for the ``"mean"`` rule).  A
    value merged into several outputs gets the sum of their gradients."""
    num_mb = max((len(c.pieces) for c in columns), default=0)
    per_mb: list[dict[str, torch.Tensor]] = [{} for _ in range(num_mb)]
    for column, grad in zip(columns, grads):
        if grad is None or column.value is None:
            continue
        for mb, piece in enumerate(split_grad(grad, column.rule, column.pieces, sizes)):
            if piece is None:
                continue
            store = per_mb[mb]
            store[column.value] = (store[column.value] + piece if column.value in store
                                   else piece)
    return per_mb


def merge_columns(plan: OutputMergePlan, outputs: Sequence[Sequence[Any]],
                  values: Sequence[Mapping[str, Any]], refs: Sequence[Any],
                  device: torch.device) -> tuple[list[MergeColumn | None], list[MergeColumn]]:
    """Merge every flat output the plan merges directly (``None`` where the tail
    computes it), and the tail's inputs."""
    direct: list[MergeColumn | None] = []
    for j, rule in enumerate(plan.rules):
        if rule.kind in ("tail", "none"):
            direct.append(None)
            continue
        pieces = [o[j] for o in outputs]
        direct.append(MergeColumn(refs[j].value, rule.dim if rule.kind == "cat" else "first",
                                  pieces))
    tail_inputs = []
    if plan.tail is not None:
        for value, kind, dim in plan.tail.inputs:
            pieces = [v[value] for v in values]
            tail_inputs.append(MergeColumn(value, dim if kind == "cat" else "first", pieces))
    return direct, tail_inputs


def merged_value(column: MergeColumn, device: torch.device) -> Any:
    value = merge_column(list(column.pieces), column.rule)
    if isinstance(value, torch.Tensor) and value.device != device:
        value = value.to(device)
    return value


def run_tail(tail: OutputTail, inputs: Sequence[Any], state: Mapping[str, torch.Tensor],
             device: torch.device) -> list[Any]:
    """Run the output tail once on the merged values; returns the flat outputs it
    computes, in ``tail.outputs`` order."""
    program = tail.program
    args = list(inputs) + [state[s].to(device) for s in program.state]
    if program.needs_device:
        args.append(device)
    results = program.module(*args)
    by_name = dict(zip(program.outputs, results))
    return [by_name[name] for name in tail.output_values]


def output_names(out_spec: Any, count: int) -> list[str]:
    """How a user names each flat output: ``output``, ``output.loss``, ``output[1]``."""
    tree = pytree.tree_unflatten(list(range(count)), out_spec)
    names = [""] * count
    for path, index in pytree.tree_flatten_with_path(tree)[0]:
        names[index] = "output" + pytree.keystr(path) if path else "the output"
    return names
