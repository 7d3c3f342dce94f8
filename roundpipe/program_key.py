"""Digests of the Python objects a traced program read from its modules besides plain
values and tensors: a config object (``self.config.scale``, transformers'
``PretrainedConfig`` pattern), a dict, list or tuple attribute (``self.cfg["scale"]``,
``self.scales[1]``), a function.  The program holds what its code read of them as
constants, so a changed content must trace again, as eager runs the forward again; a
digest of their plain content (bounded) is part of the program's key."""

from __future__ import annotations

import enum
import logging
import os
import types
from typing import Any, Iterable, Iterator

import torch

log = logging.getLogger(__name__)

# Compared by value (or, for functions and classes, identity): hashable, cheap to compare.
_ATOMS = frozenset({bool, int, float, complex, str, bytes, type(None), torch.dtype,
                    torch.device, torch.layout, torch.memory_format, types.FunctionType,
                    types.BuiltinFunctionType, types.MethodType, range, slice})
# Bounds of one object's digest: containers deeper, or leaves beyond the budget, are
# digested by identity alone (a change inside them is not seen).
_DEPTH = 4
_LEAVES = 256


class _Budget:
    __slots__ = ("left", "kept")

    def __init__(self) -> None:
        self.left = _LEAVES
        self.kept: list[Any] = []  # objects digested by id: kept alive with the key


def digest(value: Any, memo: dict[int, Any], kept: list[Any] | None = None) -> Any:
    """A comparable digest of ``value``'s plain content: equal digests mean equal
    content within the bounds.  ``memo`` (id -> digest) dedupes objects shared by several
    modules (one config read by every layer) within one call; ``kept`` receives the
    objects digested by identity (tensors, modules, opaque objects), which the key must
    keep alive so that their ids are not reused."""
    key = id(value)
    found = memo.get(key)
    if found is not None:
        return found
    budget = _Budget()
    result = _digest(value, _DEPTH, budget)
    memo[key] = result
    if kept is not None:
        kept.extend(budget.kept)
    return result


def _digest(value: Any, depth: int, budget: _Budget) -> Any:
    kind = type(value)
    if kind in _ATOMS or isinstance(value, (type, enum.Enum)):
        budget.left -= 1
        return (kind, value)
    if depth == 0 or budget.left <= 0 or isinstance(
            value, (torch.Tensor, torch.nn.Module, types.ModuleType, logging.Logger,
                    logging.LoggerAdapter)):
        budget.kept.append(value)
        return ("id", kind, id(value))
    depth -= 1
    if isinstance(value, dict):
        return (kind, tuple((_digest(k, depth, budget), _digest(v, depth, budget))
                            for k, v in list(value.items())))
    if isinstance(value, (list, tuple)):
        return (kind, tuple(_digest(v, depth, budget) for v in list(value)))
    if isinstance(value, (set, frozenset)):
        return (kind, frozenset(_digest(v, depth, budget) for v in list(value)))
    fields = getattr(value, "__dict__", None)
    if type(fields) is dict and not callable(value):  # a config, a dataclass, a namespace
        return (kind, tuple((k, _digest(v, depth, budget)) for k, v in list(fields.items())))
    budget.kept.append(value)
    return ("id", kind, id(value))


# (owner: a module or a globals dict, name, digest, objects kept alive, the value, whether
# the value is immutable: the same object then has the same digest, and no digest is
# taken at the call)
_ObjectKey = tuple


def _immutable(value: Any) -> bool:
    """Whether ``value``'s digest cannot change while it is the same object: an atom, or
    a tuple or frozenset of such (a tensor or module is digested by identity)."""
    kind = type(value)
    if kind in _ATOMS or isinstance(value, (type, enum.Enum, torch.Tensor, torch.nn.Module)):
        return True
    return isinstance(value, (tuple, frozenset)) and all(map(_immutable, value))


def _key(owner: Any, name: str, value: Any, memo: dict[int, Any]) -> _ObjectKey:
    kept: list[Any] = [value]
    return owner, name, digest(value, memo, kept), tuple(kept), value, _immutable(value)


def _same(keys: tuple[_ObjectKey, ...], table: Any) -> Iterator[bool]:
    memo: dict[int, Any] = {}
    verdicts: dict[tuple[int, int], bool] = {}  # a config shared by every layer: once
    for owner, name, d, _, value, immutable in keys:
        now = table(owner).get(name, _MISSING)
        if now is value and immutable:
            yield True
            continue
        pair = (id(now), id(d))
        same = verdicts.get(pair)
        if same is None:
            same = verdicts[pair] = now is not _MISSING and digest(now, memo) == d
        yield same


def _module_dict(m: torch.nn.Module) -> dict:
    return m.__dict__


def _itself(scope: dict) -> dict:
    return scope


def _keyable(value: Any) -> bool:
    return value is not _MISSING and type(value) not in _PLAIN and not isinstance(
        value, (torch.Tensor, torch.nn.Module))


# What nn.Module.__init__ puts in a module's __dict__ (parameter and hook tables): not the
# model's own objects.
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


def objects_before(model: torch.nn.Module) -> dict[tuple[int, str], Any]:
    """Digests of the objects ``model``'s modules hold (config objects, containers), taken
    before a trace, by (id of the module, attribute): ``object_attributes`` leaves out
    those the traced forward itself changed."""
    memo: dict[int, Any] = {}
    return {(id(m), name): digest(value, memo) for m in model.modules()
            for name, value in list(m.__dict__.items())
            if name not in _MODULE_INTERNALS and _keyable(value)}


def object_attributes(reads: Iterable[tuple[torch.nn.Module, str]],
                      before: dict[tuple[int, str], Any] | None = None
                      ) -> tuple[_ObjectKey, ...]:
    """The keys of the objects ``reads`` names that are neither plain values, tensors
    nor modules (those are keyed apart).  An object whose content the traced forward
    changed (``before``: its digest before the trace; a list the forward appends to, a
    memo dict it fills) is the forward's state, not a constant of the program: keyed, it
    would trace again whenever that content moves (a log the user clears each step);
    it is left out, with a warning, since the program does not repeat the write."""
    memo: dict[int, Any] = {}
    out = []
    for m, name in reads:
        value = m.__dict__.get(name, _MISSING)
        if not _keyable(value):
            continue
        key = _key(m, name, value, memo)
        if before is not None and before.get((id(m), name), key[2]) != key[2]:
            log.warning("roundpipe: %s's forward changed the content of its attribute %s "
                        "(a %s) while traced: roundpipe runs the forward's Python once, "
                        "when tracing, so the program does not repeat that change at "
                        "every call as eager does (state a forward updates belongs in a "
                        "buffer written in place, or outside the forward)",
                        type(m).__name__, name, type(value).__name__)
            continue
        out.append(key)
    return tuple(out)


_PLAIN = frozenset({bool, int, float, str, type(None)})
_MISSING = object()


def same_objects(objects: tuple[_ObjectKey, ...]) -> bool:
    """Whether every object a program read still has the content it was traced with."""
    return all(_same(objects, _module_dict))


def changed_objects(objects: tuple[_ObjectKey, ...], paths: dict[int, str]) -> Iterator[str]:
    for key, same in zip(objects, _same(objects, _module_dict)):
        if not same:
            path = paths.get(id(key[0]), "?")
            yield (f"{path + '.' if path else ''}{key[1]} "
                   f"(a {type(key[4]).__name__}: its content)")


# Module-level globals the model's code reads (``y * SCALE``): found from the code
# objects of the forwards of the model's own module classes and of the functions of its
# own files they name (``co_names``, which also lists attribute names: a global of that
# name is keyed too, harmlessly), not by running anything.  Reads through another module
# (``cfg.SCALE`` where ``cfg`` is an imported module) and config objects held in globals
# (a logger's state changes as it logs) are not seen.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ROUNDPIPE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MAX_FUNCTIONS = 256


def _own_code(code: types.CodeType) -> bool:
    return not code.co_filename.startswith((_TORCH_DIR, _ROUNDPIPE_DIR, "<"))


def global_reads(model: torch.nn.Module, before: tuple[_ObjectKey, ...] | None = None
                 ) -> tuple[_ObjectKey, ...]:
    """Keys (globals dict, name, digest, kept) of the module globals the forwards of
    ``model``'s own classes, and the functions of their files these name, may read:
    plain values and containers (a function or class rebound is keyed by identity;
    imported modules and other objects, a logger, are not).  ``before``: the keys taken
    before a trace; those whose content the trace changed are left out."""
    todo: list[tuple[types.CodeType, dict]] = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        forward = getattr(cls, "forward", None)
        code = getattr(forward, "__code__", None)
        if code is not None and _own_code(code):
            todo.append((code, forward.__globals__))
    seen: set[int] = set()
    found: dict[tuple[int, str], tuple[dict, str]] = {}
    while todo and len(seen) < _MAX_FUNCTIONS:
        code, scope = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        todo.extend((c, scope) for c in code.co_consts if isinstance(c, types.CodeType))
        for name in code.co_names:
            if name not in scope:
                continue
            value = scope[name]
            if isinstance(value, types.FunctionType):
                if _own_code(value.__code__):
                    todo.append((value.__code__, value.__globals__))
            if name.startswith("__") or not (type(value) in _ATOMS or isinstance(
                    value, (type, enum.Enum, dict, list, tuple, set, frozenset))):
                continue  # (an imported module; an object whose state is its own)
            found[(id(scope), name)] = (scope, name)
    memo: dict[int, Any] = {}
    keys = tuple(_key(scope, name, scope[name], memo) for scope, name in found.values())
    if before is None:
        return keys
    # a global the traced forward changed (a list it appends to): its state, not a
    # constant of the program (see object_attributes)
    was = {(id(k[0]), k[1]): k[2] for k in before}
    kept = []
    for k in keys:
        if was.get((id(k[0]), k[1]), k[2]) != k[2]:
            log.warning("roundpipe: the traced forward changed the content of the global "
                        "%s.%s (a %s): roundpipe runs the forward's Python once, when "
                        "tracing, so the program does not repeat that change at every "
                        "call as eager does", k[0].get("__name__", "?"), k[1],
                        type(k[4]).__name__)
            continue
        kept.append(k)
    return tuple(kept)


def same_globals(reads: tuple[_ObjectKey, ...]) -> bool:
    return all(_same(reads, _itself))


def changed_globals(reads: tuple[_ObjectKey, ...]) -> Iterator[str]:
    for key, same in zip(reads, _same(reads, _itself)):
        if not same:
            yield f"global {key[0].get('__name__', '?')}.{key[1]}"
