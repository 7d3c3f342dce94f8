"""Device memory measured from the tensors themselves, per device and per job.

A virtual CPU device shares the host's allocator, so nothing like CUDA's allocator
statistics tells its bytes apart from the host's.  What does is *where* a tensor was made:
every tensor of a device is created on one of its threads (the controller runs jobs, the
loaders make the copies of uploads).  A :class:`StorageLedger` watches those threads with
a dispatch mode, enters each new storage an op returns (a view or an in-place op returns
none: storages are counted once, by identity) and takes it out when torch frees it (a
weak reference to the storage, whose Python object lives exactly as long as the storage).

Each storage has an *owner*, the job it was made for (uploads carry the job that asked for
them), so a job's own peak leaves out the weights already loading for a later job.  This
costs a Python call per op on the watched threads, so it runs only when asked
(``measure_memory``); see ``docs/architecture.md`` for the measured slowdown.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Hashable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# op -> per return: whether it is a new tensor (no alias annotation: not a view, not the
# written input of an in-place or out= op)
_FRESH: dict[Any, tuple[bool, ...]] = {}


def _fresh_returns(func: Any) -> tuple[bool, ...]:
    flags = _FRESH.get(func)
    if flags is None:
        flags = _FRESH[func] = tuple(r.alias_info is None for r in func._schema.returns)
    return flags


class StorageLedger:
    """Live bytes of the storages made on one device's threads: now, at most since the
    last :meth:`reset`, and the same per owner (a job index)."""

    def __init__(self, device_type: str, block_bytes: int = 1) -> None:
        self.device_type = device_type  # tensors of other types (host buffers) are not ours
        # Sizes are rounded up to this (the CUDA caching allocator hands out 512-byte
        # blocks; an estimate for a CUDA device counts what it would reserve).
        self.block_bytes = block_bytes
        self._lock = threading.RLock()  # an entry can be freed while the lock is held
        self._storages: dict[int, list[Any]] = {}  # storage id -> [bytes, owner, weakref]
        self._live = 0
        self._peak = 0
        self._owner_live: dict[Hashable, int] = {}
        self._owner_peak: dict[Hashable, int] = {}
        self._local = threading.local()  # .mode: this thread's _Watch, if watched

    # --- threads -------------------------------------------------------------------------
    @contextlib.contextmanager
    def watching(self, owner: Hashable) -> Iterator[None]:
        """Count the storages this thread makes, for ``owner``, until the block ends."""
        mode = getattr(self._local, "mode", None)
        if mode is not None:  # already watched (nested): only the owner changes
            previous, mode.owner = mode.owner, owner
            try:
                yield
            finally:
                mode.owner = previous
            return
        mode = _Watch(self, owner)
        self._local.mode = mode
        try:
            with mode:
                yield
        finally:
            self._local.mode = None

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """A block whose allocations are host memory (download buffers, host-side hooks)."""
        mode = getattr(self._local, "mode", None)
        if mode is None:
            yield
            return
        paused, mode.paused = mode.paused, True
        try:
            yield
        finally:
            mode.paused = paused

    def owner(self) -> Hashable:
        """The owner this thread counts for (None when it is not watched)."""
        mode = getattr(self._local, "mode", None)
        return None if mode is None else mode.owner

    # --- entries -------------------------------------------------------------------------
    def add(self, tensor: torch.Tensor, owner: Hashable) -> None:
        """Enter ``tensor``'s storage, unless it is entered already or not ours."""
        if tensor.device.type != self.device_type:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, subclasses)
            return
        key = storage._cdata
        with self._lock:
            if key in self._storages:
                return
            nbytes = storage.nbytes()
            if nbytes == 0:
                return
            nbytes = -(-nbytes // self.block_bytes) * self.block_bytes
            ref = weakref.ref(storage, functools.partial(self._freed, key))
            self._storages[key] = [nbytes, owner, ref]
            self._live += nbytes
            self._peak = max(self._peak, self._live)
            self._charge(owner, nbytes)

    def adopt(self, tensor: torch.Tensor, owner: Hashable) -> None:
        """Make ``owner`` the holder of ``tensor``'s storage (a value handed from one job
        to the next on one device: the next job holds it from now on)."""
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        with self._lock:
            entry = self._storages.get(key)
            if entry is None or entry[1] == owner:
                return
            self._charge(entry[1], -entry[0])
            entry[1] = owner
            self._charge(owner, entry[0])

    def _charge(self, owner: Hashable, nbytes: int) -> None:
        live = self._owner_live.get(owner, 0) + nbytes
        self._owner_live[owner] = live
        if nbytes > 0 and live > self._owner_peak.get(owner, 0):
            self._owner_peak[owner] = live

    def _freed(self, key: int, _ref: Any) -> None:
        with self._lock:
            entry = self._storages.pop(key, None)
            if entry is None:
                return
            self._live -= entry[0]
            self._charge(entry[1], -entry[0])

    # --- reading -------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a call: the peak restarts from what is live; owners are forgotten (what
        an earlier call left behind is nobody's)."""
        with self._lock:
            for entry in self._storages.values():
                entry[1] = None
            self._owner_live = {None: self._live} if self._live else {}
            self._owner_peak = {}
            self._peak = self._live

    def live_bytes(self) -> int:
        with self._lock:
            return self._live

    def peak_bytes(self) -> int:
        with self._lock:
            return self._peak

    def owner_peaks(self) -> dict[Hashable, int]:
        """Most bytes each owner held at once since the last reset."""
        with self._lock:
            return {o: p for o, p in self._owner_peak.items() if o is not None}


class _Watch(TorchDispatchMode):
    """Enters the storages of the new tensors every op on this thread returns."""

    # Higher-order ops (torch.cond, flex attention) come here too, rather than failing
    # for want of a rule; the ops inside them run unwatched (see __torch_dispatch__).
    supports_higher_order_operators = True

    def __init__(self, ledger: StorageLedger, owner: Hashable) -> None:
        super().__init__()
        self.ledger = ledger
        self.owner = owner
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        if isinstance(func, torch._ops.HigherOrderOperator):
            # No schema to read: whatever it returns outside its inputs' storages is new
            # (its temporaries inside are not seen).
            inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                    self.ledger.add(t, self.owner)
            return out
        fresh = _fresh_returns(func)
        if isinstance(out, torch.Tensor):
            if fresh and fresh[0]:
                self.ledger.add(out, self.owner)
        elif isinstance(out, (tuple, list)):
            if len(fresh) == 1:  # one Tensor[] return: a flag for every element
                fresh = fresh * len(out)
            for is_new, t in zip(fresh, out):
                if is_new and isinstance(t, torch.Tensor):
                    self.ledger.add(t, self.owner)
        return out
