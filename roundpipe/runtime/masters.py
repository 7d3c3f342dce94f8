"""Master weights whose gradients may stay where they landed, in the model's precision.

A one-pass optimizer (``roundpipe.optim``) *binds* masters.  For a bound master, a call's
gradient (one contribution, nothing to add it to) is kept as the download buffer itself, in
the model's dtype: no full-precision copy is made, and the step reads it there.  Like a
``.grad`` it is held until ``zero_grad()`` (or an assignment to ``p.grad``); while held, no
download reuses the buffer (:meth:`LandedGrads.busy`), so the next call lands into a second
one.

``p.grad`` stays truthful: reading it converts a held gradient into an ordinary
full-precision ``.grad`` (which the step then reads: slower, same result), so code that
reads or edits gradients (clipping, a GradScaler) works unchanged.

Clipping and unscaling through roundpipe (``pipe.clip_grad_norm_``, ``GradScaler``) do not
convert: they read a held gradient's norm (measured on the device as it was produced, when
asked for) and record the factor they would have multiplied ``.grad`` by; whoever reads the
gradient (the step's chunks, ``p.grad``, a commit that adds to it) applies the factors in
order, as the in-place multiplications would have been.

The new weight is not staged into the landing buffer for publishing: a write to the master
through ``.data`` after the step bumps no version counter, so a staged copy could not be
known to be stale.

Every state change happens under one lock; the commit, the step and the publish run on
the optimizer thread.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary


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


# The disk tier without masters (optim_dtype=None, stochastic rounding): model parameter
# -> (a weak reference to its pipe's LandedGrads, its name), so that a roundpipe.optim
# optimizer over it finds the store its state lives in.  Apart from _OWNERS: these are
# not masters (no landed gradients, no publish).
_TIERED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def tier_param(landed: LandedGrads, param: torch.Tensor, name: str) -> None:
    """Mark a model parameter the optimizer updates in place as keeping its optimizer
    state in ``landed``'s disk tier."""
    _TIERED[param] = (weakref.ref(landed), name)


def tier_owner_of(t: torch.Tensor) -> tuple[LandedGrads, str] | None:
    """The landing state and name of a tensor whose optimizer state the pipe's disk
    tier holds: a master (:func:`owner_of`), or a parameter marked by
    :func:`tier_param`; None for any other tensor."""
    owner = owner_of(t)
    if owner is not None:
        return owner
    entry = _TIERED.get(t)
    if entry is None:
        return None
    landed = entry[0]()
    return None if landed is None else (landed, entry[1])


class UnitSchedule:
    """The order in which a step updates a pipe's masters: unit by unit, as the next call
    uploads them.  ``units``: master names per unit (each once, forward order).  An
    optimizer that steps unit by unit calls ``before_unit(k)``, updates every master of
    unit ``k`` (across its groups), then ``after_unit(k)``; ``started`` says whether
    some unit's update began (a failure before that wrote nothing)."""

    def __init__(self, landed: LandedGrads, units: Sequence[Sequence[str]],
                 before_unit: Callable[[int], None] | None = None,
                 after_unit: Callable[[int], None] | None = None) -> None:
        self.landed = landed
        self.units = tuple(tuple(u) for u in units)
        self._before = before_unit
        self._after = after_unit
        self.started = False
        self.finished = 0  # units whose after_unit has run

    def index(self) -> dict[str, int]:
        return {name: k for k, names in enumerate(self.units) for name in names}

    def before_unit(self, k: int) -> None:
        self.started = True
        if self._before is not None:
            self._before(k)

    def after_unit(self, k: int) -> None:
        if self._after is not None:
            self._after(k)
        self.finished = k + 1


class LandedGrads:
    """The low-precision gradients held for bound masters."""

    def __init__(self, serial: Callable[[Callable[[], object]], object] | None = None
                 ) -> None:
        self._lock = threading.Lock()
        self._bound: Counter[str] = Counter()
        self._landed: dict[str, torch.Tensor] = {}   # name -> pending gradient
        # name -> factors a held gradient is multiplied by when read (clipping, unscaling)
        self._factors: dict[str, tuple[torch.Tensor, ...]] = {}
        # name -> the held gradient's 2-norm (float32), measured on its device
        self._norms: dict[str, torch.Tensor] = {}
        # Once something asked for norms (norms_requested), the next commit turns them
        # on (wants_norms): calls that start from then on measure each gradient that may
        # be held, as it is downloaded.  Switching at a commit, which follows the step
        # that asked, makes the first measuring call the same whatever the timing (a
        # measured norm and one computed on the host differ in the last bits).
        self.norms_requested = False
        self.wants_norms = False
        # The roundpipe.optim optimizers bound here (their step is what the host runs).
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self._busy: dict[int, torch.Tensor] = {}   # id -> buffer no download may reuse
        # Runs a function on the thread that commits, steps and publishes (the pipe's
        # optimizer thread), after the steps already enqueued.
        self.serial = serial if serial is not None else (lambda fn: fn())
        # Whether the calling thread runs a step_fn (where the masters may be updated).
        self.on_step_thread: Callable[[], bool] = lambda: True
        # Set by the pipe for the length of a step that walks the masters unit by unit
        # (an optimizer that can updates unit k between the schedule's two calls).
        self.unit_schedule: UnitSchedule | None = None
        # The disk tier's store (runtime/offload.py) when the pipe has offload_dir: a
        # bound optimizer registers the state it makes for these masters there.
        self.offload: Any = None
        # With the disk tier: puts an optimizer's state (just loaded) into the files.
        self.absorb: Callable[[Any], None] | None = None
        # With a resumed disk tier: checks an optimizer just bound and hands it the
        # state the directory holds for its masters.
        self.resume: Callable[[Any], None] | None = None

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
        """Whether ``buffer`` holds a pending gradient."""
        with self._lock:
            return id(buffer) in self._busy

    def hold(self, name: str, buffer: torch.Tensor, norm: torch.Tensor | None = None
             ) -> None:
        """Keep ``buffer`` (a call's only contribution) as ``name``'s gradient; ``norm``:
        its 2-norm, if the device measured it."""
        with self._lock:
            if name in self._landed:
                raise RuntimeError(f"internal: {name} already holds a landed gradient")
            self._landed[name] = buffer
            self._busy[id(buffer)] = buffer
            if norm is not None:
                self._norms[name] = norm

    def take(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Remove ``name``'s pending gradient and return it as a new ``dtype`` tensor,
        its factors applied (None if none is held)."""
        with self._lock:
            return self._take_locked(name, dtype)

    def _take_locked(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        buffer = self._landed.pop(name, None)
        factors = self._factors.pop(name, ())
        self._norms.pop(name, None)
        if buffer is None:
            return None
        try:
            with torch.no_grad():
                out = buffer.to(dtype, copy=True)
                for f in factors:
                    out.mul_(f)
            return out
        finally:
            self._busy.pop(id(buffer), None)

    def has_landed(self, name: str) -> bool:
        with self._lock:
            return name in self._landed

    def release(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            with self._lock:
                self._busy.pop(id(buffer), None)

    # --- the step -------------------------------------------------------------------------
    def peek_with_factors(self, name: str
                          ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """:meth:`peek` and :meth:`factors` at once (a ``p.grad`` read on another thread
        cannot come between them)."""
        with self._lock:
            return self._landed.get(name), self._factors.get(name, ())

    def peek(self, name: str) -> torch.Tensor | None:
        """``name``'s pending gradient, left held: as with a ``.grad``, it stays until
        ``zero_grad()`` (a second step applies it again, as torch's would).  Its value
        is this tensor times :meth:`factors`."""
        with self._lock:
            return self._landed.get(name)

    def factors(self, name: str) -> tuple[torch.Tensor, ...]:
        with self._lock:
            return self._factors.get(name, ())

    def scale(self, name: str, factor: torch.Tensor) -> bool:
        """Multiply ``name``'s held gradient by ``factor`` (a 0-dim tensor) when read;
        False if none is held (any more: the caller multiplies ``.grad`` then)."""
        with self._lock:
            if name not in self._landed:
                return False
            self._factors[name] = self._factors.get(name, ()) + (factor,)
            return True

    def norm(self, name: str) -> torch.Tensor | None:
        """The held gradient's 2-norm as measured on its device (float32, before the
        factors), or None."""
        with self._lock:
            return self._norms.get(name) if name in self._landed else None

    # --- what p.grad sees -----------------------------------------------------------------
    def materialize(self, name: str, master: torch.Tensor) -> None:
        """Turn a landed gradient into ``master``'s full-precision ``.grad``."""
        with self._lock:  # no step may see it neither held nor set
            grad = self._take_locked(name, master.dtype)
            if grad is not None:
                set_raw_grad(master, grad)

    def discard(self, name: str) -> bool:
        """``name``'s gradient was set to None or replaced; whether one was held."""
        with self._lock:
            buffer = self._landed.pop(name, None)
            self._factors.pop(name, None)
            self._norms.pop(name, None)
            if buffer is not None:
                self._busy.pop(id(buffer), None)
            return buffer is not None

    def tensors(self) -> list[torch.Tensor]:
        """The buffers held (pending gradients), for accounting."""
        with self._lock:
            return list(self._busy.values())
