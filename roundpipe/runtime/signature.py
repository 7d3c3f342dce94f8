"""Matching calls against a compiled program's input signature, and flattening them."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import InputError
from ..plan import InputSignature


def leading_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return 0


def flat_leaves(sig: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> list[Any] | None:
    if sig.kind == "pytree":
        spec_kwargs = _spec_kwargs_order(sig.spec)
        if spec_kwargs is not None and set(spec_kwargs) == set(kwargs):
            kwargs = {k: kwargs[k] for k in spec_kwargs}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return leaves if spec == sig.spec else None
    params = list(sig.params)
    if len(args) > len(params) or any(k not in params for k in kwargs):
        return None
    values = dict(zip(params, args))
    values.update(kwargs)
    out = []
    for name, default in zip(params, sig.defaults):
        if name in values:
            out.append(values[name])
        elif default is inspect.Parameter.empty:
            return None
        else:
            out.append(default)
    return out


def _spec_kwargs_order(spec: Any) -> list[str] | None:
    try:
        kw = spec.child(1)
        return list(kw.context)
    except (AttributeError, IndexError, TypeError):
        return None


def matches(sig: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    leaves = flat_leaves(sig, args, kwargs)
    if leaves is None or len(leaves) != len(sig.static):
        return False
    for value, static in zip(leaves, sig.static):
        if static[0] == "const":
            if isinstance(value, torch.Tensor) or not _same_const(value, static[1]):
                return False
        else:
            if not isinstance(value, torch.Tensor) or value.dtype != static[1]:
                return False
            dims = static[2]
            if value.dim() != len(dims) or not all(
                    _dim_matches(d, s) for d, s in zip(dims, value.shape)):
                return False
    return True


def _dim_matches(dim: Any, size: int) -> bool:
    """``dim`` is None (any size), an int (that size) or ``(low, high)`` (a range export's
    guards allowed; ``high`` None for unbounded)."""
    if dim is None:
        return True
    if isinstance(dim, tuple):
        low, high = dim
        return size >= low and (high is None or size <= high)
    return dim == size


def _same_const(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - objects without a usable __eq__
        return a is b


def flatten_inputs(sig: InputSignature, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> dict[str, Any]:
    leaves = flat_leaves(sig, args, kwargs)
    if leaves is None:
        raise InputError("inputs do not match the compiled signature")
    return {name: v for name, v in zip(sig.names, leaves) if name is not None}
