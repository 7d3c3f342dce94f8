"""Master weights whose gradients may stay where they landed, in the model's precision.

A one-pass optimizer (``roundpipe.optim``) *binds* masters.  For a bound master, a call's
gradient (one contribution, nothing to add it to) is kept as the download buffer itself, in
the model's dtype: no full-precision copy is made.  The optimizer's step reads it, updates
the master and its moments, and writes the new low-precision weight into the same buffer
(*staged*); the next publish copies that into the model weight instead of converting the
master again.  Every byte is then read or written once per step (issue 17).

``p.grad`` stays truthful.  Reading it converts a landed gradient into an ordinary
full-precision ``.grad`` (which the step then reads: slower, same result).  Once a step
consumed a landed gradient its buffer holds weights, so reading ``p.grad`` raises
:class:`GradConsumedError` until ``zero_grad()`` or an assignment.

Every state change happens under one lock; the buffers themselves are only read or written
by the commit, the step and the publish, which all run on the optimizer thread, and by
the downloads, which never pick a buffer that is :meth:`LandedGrads.busy`.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import GradConsumedError

_RAW_GRAD = torch.Tensor.grad  # the C++ slot, under the Python property below


def raw_grad(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad`` without converting a landed gradient."""
    return _RAW_GRAD.__get__(t)


def set_raw_grad(t: torch.Tensor, value: torch.Tensor | None) -> None:
    _RAW_GRAD.__set__(t, value)


class Master(torch.nn.Parameter):
    """A master weight (an ``nn.Parameter``); its ``grad`` sees landed gradients."""

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        owner = owner_of(self)
        if owner is not None:
            owner[0].materialize(owner[1], self)
        return raw_grad(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        owner = owner_of(self)
        if owner is not None:
            owner[0].discard(owner[1])
        set_raw_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None


# master -> (a weak reference to its LandedGrads, its parameter name); kept outside the
# tensor so that copies, pickles and deep copies of a master are plain parameters, and
# weak both ways so that a closed pipe's masters and state are freed.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def owner_of(t: torch.Tensor) -> tuple[LandedGrads, str] | None:
    """The landing state and name of a pipe's master, or None for any other tensor."""
    entry = _OWNERS.get(t)
    if entry is None:
        return None
    landed = entry[0]()
    return None if landed is None else (landed, entry[1])


class LandedGrads:
    """The low-precision gradients held for bound masters, and the staged weights."""

    def __init__(self, serial: Callable[[Callable[[], object]], object] | None = None
                 ) -> None:
        self._lock = threading.Lock()
        self._bound: Counter[str] = Counter()
        self._landed: dict[str, torch.Tensor] = {}   # name -> pending gradient
        self._staged: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (weight, version)
        self._consumed: set[str] = set()
        self._busy: dict[int, torch.Tensor] = {}   # id -> buffer no download may reuse
        # Runs a function on the thread that commits, steps and publishes (the pipe's
        # optimizer thread), after the steps already enqueued.
        self.serial = serial if serial is not None else (lambda fn: fn())
        # Whether the calling thread runs a step_fn (where the masters may be updated).
        self.on_step_thread: Callable[[], bool] = lambda: True

    # --- binding (the optimizer) ------------------------------------------------------
    def adopt(self, master: Master, name: str) -> None:
        _OWNERS[master] = (weakref.ref(self), name)

    def bind(self, name: str) -> None:
        with self._lock:
            self._bound[name] += 1

    def unbind(self, name: str) -> None:
        with self._lock:
            self._bound[name] -= 1
            if self._bound[name] <= 0:
                del self._bound[name]

    def bound(self, name: str) -> bool:
        with self._lock:
            return self._bound[name] > 0

    # --- the landing --------------------------------------------------------------------
    def busy(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` holds a pending gradient or a staged weight."""
        with self._lock:
            return id(buffer) in self._busy

    def check_not_consumed(self, names: list[str]) -> None:
        with self._lock:
            consumed = sorted(n for n in names if n in self._consumed)
        if consumed:
            raise GradConsumedError(
                f"{len(consumed)} parameter(s) (first: {consumed[0]!r}) would accumulate a "
                "new gradient onto one the last optimizer step consumed (a "
                "roundpipe.optim step writes the new weights into the gradient's landing "
                "buffer, so it cannot be added to). Call opt.zero_grad() after "
                "opt.step(), as in pipe.step(lambda: (opt.step(), opt.zero_grad()))")

    def hold(self, name: str, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (a call's only contribution) as ``name``'s gradient."""
        with self._lock:
            if name in self._landed:
                raise RuntimeError(f"internal: {name} already holds a landed gradient")
            self._landed[name] = buffer
            self._busy[id(buffer)] = buffer

    def pop_landed(self, name: str) -> torch.Tensor | None:
        """Remove ``name``'s pending gradient; the caller must :meth:`release` it."""
        with self._lock:
            return self._landed.pop(name, None)

    def has_landed(self, name: str) -> bool:
        with self._lock:
            return name in self._landed

    def release(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            with self._lock:
                self._busy.pop(id(buffer), None)

    # --- the step -------------------------------------------------------------------------
    def take(self, name: str) -> torch.Tensor | None:
        """The step takes ``name``'s pending gradient; afterwards it must :meth:`stage` or
        :meth:`release` the buffer."""
        with self._lock:
            buffer = self._landed.pop(name, None)
            if buffer is not None:
                self._consumed.add(name)
            return buffer

    def stage(self, name: str, buffer: torch.Tensor, master: torch.Tensor) -> None:
        """``buffer`` now holds ``master`` rounded to the model's dtype."""
        with self._lock:
            old = self._staged.pop(name, None)
            if old is not None and old[0] is not buffer:
                self._busy.pop(id(old[0]), None)
            self._staged[name] = (buffer, master._version)

    def pop_staged(self, name: str, master: torch.Tensor) -> torch.Tensor | None:
        """The staged weight of ``name`` if ``master`` was not written since, else None;
        the caller must :meth:`release` what it gets."""
        with self._lock:
            staged = self._staged.pop(name, None)
            if staged is None:
                return None
            if staged[1] != master._version:  # written after the step: publish the master
                self._busy.pop(id(staged[0]), None)
                return None
            return staged[0]

    def drop_staged(self) -> None:
        """Forget every staged weight (the masters were reset or loaded)."""
        with self._lock:
            for buffer, _ in self._staged.values():
                self._busy.pop(id(buffer), None)
            self._staged.clear()

    # --- what p.grad sees -----------------------------------------------------------------
    def materialize(self, name: str, master: torch.Tensor) -> None:
        """Turn a landed gradient into ``master``'s full-precision ``.grad``."""
        with self._lock:
            if name in self._consumed:
                raise GradConsumedError(
                    f"the gradient of {name!r} was consumed by a roundpipe.optim step: its "
                    "landing buffer now holds the new weights. Read p.grad before "
                    "opt.step() (that keeps a full-precision .grad, 4 more bytes per "
                    "parameter), and call opt.zero_grad() after it")
            buffer = self._landed.pop(name, None)
            if buffer is None:
                return
            try:
                with torch.no_grad():
                    set_raw_grad(master, buffer.to(master.dtype, copy=True))
            finally:
                self._busy.pop(id(buffer), None)

    def discard(self, name: str) -> None:
        """``name``'s gradient was set to None or replaced."""
        with self._lock:
            buffer = self._landed.pop(name, None)
            if buffer is not None:
                self._busy.pop(id(buffer), None)
            self._consumed.discard(name)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers held (pending gradients and staged weights), for accounting."""
        with self._lock:
            return list(self._busy.values())
