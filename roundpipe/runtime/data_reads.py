"""When each parameter last handed out ``.data``.

A write through ``p.data`` (``p.data.clamp_(-c, c)``, a WGAN's weight clipping) goes
through an alias with a version counter of its own: ``p._version`` does not move, and
only the values tell.  With masters, roundpipe must notice such a write to a weight
before the next step (``ModelState.adopt_edits``), but comparing every weight with its
master at every step costs several times the step itself (the master rounded to the
weight's dtype, then compared: ~5 ns an element against ~1 ns for the whole one-pass
update).  So ``Parameter.data`` is watched: torch's own getter and setter, which also
note the parameter, a tick and a weak reference to the alias handed out, and only
weights whose ``.data`` was taken since roundpipe last wrote them, or whose earlier
alias is still alive (``w = p.data`` kept, written later; its views and numpy arrays
keep it alive), are compared.  Installed once, when a pipe first keeps
masters; reads through the C API (torch's own kernels) are not Python reads and cannot
be user writes through an alias."""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

_GET = torch._C.TensorBase.data.__get__
_SET = torch._C.TensorBase.data.__set__
_ticks = itertools.count(1)  # next() on a count is atomic under the GIL
_last: dict[int, int] = {}  # id(parameter) -> tick of its last .data read or assignment
_aliases: dict[int, list[weakref.ref]] = {}  # id(parameter) -> the .data aliases handed out
_install_lock = threading.Lock()
_installed = False


def _touch(param: torch.Tensor) -> int:
    key = id(param)
    if key not in _last:  # once per parameter: forget it with the parameter
        weakref.finalize(param, _forget, key)
    _last[key] = next(_ticks)
    return key


def _forget(key: int) -> None:
    _last.pop(key, None)
    _aliases.pop(key, None)


class _WatchedData:
    """``torch.nn.Parameter.data``: torch's descriptor, noting the parameter."""

    def __get__(self, param: Any, owner: type | None = None) -> Any:
        if param is None:
            return self
        key = _touch(param)
        alias = _GET(param, owner)
        refs = [r for r in _aliases.get(key, ()) if r() is not None]
        refs.append(weakref.ref(alias))
        _aliases[key] = refs
        return alias

    def __set__(self, param: Any, value: torch.Tensor) -> None:
        _touch(param)
        _SET(param, value)


def watch() -> None:
    """Start noting ``.data`` reads of parameters (idempotent)."""
    global _installed
    with _install_lock:
        if not _installed:
            torch.nn.Parameter.data = _WatchedData()  # type: ignore[assignment]
            _installed = True


def now() -> int:
    """A tick: a parameter whose ``.data`` is taken later has ``taken_since(p, tick)``."""
    return next(_ticks)


def taken_since(param: torch.Tensor, tick: int) -> bool:
    """Whether a write through ``param.data`` may have happened after ``tick``: its
    ``.data`` was read or assigned since, or an alias handed out before is still alive
    (always, if not watched: the caller then cannot rule a write out)."""
    key = id(param)
    return (not _installed or _last.get(key, 0) > tick
            or any(r() is not None for r in _aliases.get(key, ())))
