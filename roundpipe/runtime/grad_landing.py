"""Where parameter gradients land on the host, shared by every program of one model.

Downloads go into host buffers reused across calls (pinned on CUDA, where allocating
pinned memory is slow), keyed by (unit, slot).  Committing them used to be the caller's
work after the call: converting each gradient to its master's dtype (bf16 -> fp32) took
longer than the optimizer step on a 1B model, with the GPUs idle.  With ``convert=True``
a conversion thread copies each gradient into a fresh tensor of the master's dtype as soon
as its download has landed, while the backward goes on; the commit then only assigns (or,
when gradients accumulate across calls, adds) tensors the call owns.

Those tensors are kept and refilled by the next call once nothing else holds them (the
optimizer's ``zero_grad`` dropped them, and the caller kept no reference or view): memory
the allocator hands out fresh is page-faulted in on first write, which made a bf16 -> fp32
copy 5-7 times slower than one into memory already in use.  The price: between calls the
host keeps one full-precision gradient set even after ``zero_grad(set_to_none=True)``;
the peak, during a call, is what it was.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence, Union

import torch

log = logging.getLogger(__name__)

_KEPT_PER_KEY = 2

#: how many download buffers a gradient may have (``RoundPipe(landing_buffers=...)``)
LandingBuffers = Union[int, str]
LANDING_BUFFERS = (1, 2, "auto")
#: ``"auto"`` lands into a second buffer only while the host keeps this share of its
#: memory available after the allocation
HOST_MARGIN = 0.10


class GradLanding:
    """``steps``: the optimizer steps still pending when a call starts.  A conversion
    waits for them: a step reads the previous gradients, which ``zero_grad`` then frees,
    so the host never holds two sets of full-precision gradients because of the overlap."""

    def __init__(self, convert: bool = True,
                 steps: Callable[[], list[Future]] | None = None,
                 busy: Callable[[torch.Tensor], bool] | None = None,
                 sets: LandingBuffers = 2) -> None:
        # Download buffers by (unit, slot).  Usually one each; a buffer the host state
        # holds (``busy``: a gradient a one-pass optimizer reads in place, or the weight
        # its step staged there) is not reused, so a second one alternates with it.
        self.buffers: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.busy = busy if busy is not None else (lambda t: False)
        self.steps = steps if steps is not None else list
        # 2: a gradient whose buffer a pending step still reads lands into a second one;
        # 1: its download waits for the step (2 bytes per bf16 parameter less); "auto": 1
        # only when the host's memory would run short.
        self.sets = sets
        self.wait_seconds = 0.0  # spent waiting for steps instead of a second buffer
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="roundpipe-grads")
                      if convert else None)
        self._lock = threading.Lock()
        # The last conversion of each (unit, slot): refilled when no one else holds it.
        # Only the conversion thread touches it.
        self._spare: dict[tuple[int, str], torch.Tensor] = {}
        # A call that steps as its gradients land (forward_backward(step=opt)) gives each
        # unit's download buffers back once the unit is updated (recycle): they wait here,
        # oldest first, for a later unit's download of the same shape, so the buffers
        # held are a window of units, not the whole model.  Capped at two units' bytes.
        self._recycled: list[torch.Tensor] = []
        self._pool_cap = 0
        self._pool_lock = threading.Lock()
        # Bytes of the download buffers kept (by key and pooled), and the most at once.
        self._owned: dict[int, int] = {}
        self.bytes = 0
        self.peak_bytes = 0

    def buffer_for(self, key: tuple[int, str], steps: Sequence[Future] = (),
                   like: torch.Tensor | None = None) -> torch.Tensor | None:
        """A download buffer of ``key`` free to be overwritten, if one is kept (None: the
        download allocates one).  When every kept buffer is held by a gradient a step in
        ``steps`` reads (and its ``zero_grad`` then releases), the landing may wait for
        those steps rather than allocate a second buffer (see ``sets``)."""
        free = self._free(key)
        kept = self.buffers.get(key)
        if free is None and not kept and like is not None:
            return self._from_pool(like)
        if free is not None or not kept or all(f.done() for f in steps):
            return free
        if self.sets == 2 or (self.sets == "auto" and _affordable(_nbytes(kept[0]))):
            return None
        start = time.perf_counter()
        wait(steps)
        self.wait_seconds += time.perf_counter() - start
        return self._free(key)  # still held (no zero_grad): a second buffer after all

    def _free(self, key: tuple[int, str]) -> torch.Tensor | None:
        return next((t for t in self.buffers.get(key, ()) if not self.busy(t)), None)

    def keep(self, key: tuple[int, str], buffer: torch.Tensor) -> None:
        """Remember ``buffer`` (the one a download of ``key`` went into) for reuse."""
        kept = self.buffers.setdefault(key, [])
        if any(t is buffer for t in kept):
            return
        kept.append(buffer)
        self._own(buffer)
        if len(kept) > _KEPT_PER_KEY:  # shapes changed, or a held buffer was let go
            victim = next((t for t in kept if t is not buffer and not self.busy(t)), None)
            if victim is not None:
                kept.remove(victim)
                self._disown(victim)

    # --- the window of a call that steps as gradients land ---------------------------------
    def _own(self, buffer: torch.Tensor) -> None:
        with self._pool_lock:
            if id(buffer) not in self._owned:
                n = self._owned[id(buffer)] = _nbytes(buffer)
                self.bytes += n
                self.peak_bytes = max(self.peak_bytes, self.bytes)

    def _disown(self, buffer: torch.Tensor) -> None:
        with self._pool_lock:
            self.bytes -= self._owned.pop(id(buffer), 0)

    def _from_pool(self, like: torch.Tensor) -> torch.Tensor | None:
        with self._pool_lock:
            for i, t in enumerate(self._recycled):
                if t.shape == like.shape and t.dtype == like.dtype:
                    return self._recycled.pop(i)
        return None

    def recycle(self, keys: Sequence[tuple[int, str]]) -> None:
        """The gradients of ``keys`` were consumed (their unit updated): their buffers go
        to the pool a later unit's download takes from, the oldest beyond two units'
        bytes are freed."""
        freed: list[torch.Tensor] = []
        batch = 0
        for key in keys:
            for t in self.buffers.pop(key, ()):
                if self.busy(t):  # held by the host state: not ours to reuse
                    self.buffers.setdefault(key, []).append(t)
                    continue
                batch += _nbytes(t)
                with self._pool_lock:
                    self._recycled.append(t)
        with self._pool_lock:
            self._pool_cap = max(self._pool_cap, 2 * batch)
            total = sum(_nbytes(t) for t in self._recycled)
            while self._recycled and total > self._pool_cap:
                victim = self._recycled.pop(0)
                total -= _nbytes(victim)
                freed.append(victim)
        for t in freed:
            self._disown(t)

    def reset_peak(self) -> None:
        with self._pool_lock:
            self.peak_bytes = self.bytes

    @property
    def converts(self) -> bool:
        return self._pool is not None

    def convert_after(self, landed: Future, host: torch.Tensor, dtype: torch.dtype,
                      steps: Sequence[Future] = (),
                      wanted: Callable[[], bool] = lambda: True,
                      key: tuple[int, str] | None = None) -> Future:
        """A future of ``host`` copied to ``dtype``, started once ``landed`` completes (it
        fails with ``landed``'s error, and the copy is never made then) and ``steps``
        have finished (failed or not: the call reports a failed step itself).  It is
        None when ``wanted()`` says no at that point (the master already has a gradient
        to add to: a full copy would only double the memory the commit needs).  ``key``
        names the gradient across calls, for refilling the tensor of the last one."""
        if self._pool is None:
            raise RuntimeError("internal: this GradLanding does not convert")
        result: Future = Future()

        def copy() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                wait(steps)
                result.set_result(self._copy(host, dtype, key) if wanted() else None)
            except BaseException as e:  # noqa: BLE001 - reaches the call through the future
                result.set_exception(e)

        def start(f: Future) -> None:
            error = f.exception() if not f.cancelled() else RuntimeError("download cancelled")
            if error is not None:
                result.set_exception(error)
                return
            with self._lock:
                if self._pool is None:  # closed meanwhile
                    result.set_exception(RuntimeError("roundpipe was closed"))
                    return
                self._pool.submit(copy)

        landed.add_done_callback(start)
        return result

    def _copy(self, host: torch.Tensor, dtype: torch.dtype, key: tuple[int, str] | None
              ) -> torch.Tensor:
        spare = self._spare.pop(key, None) if key is not None else None
        if spare is not None and _REFCOUNT_SEES_HOLDERS and _unshared(spare) \
                and spare.shape == host.shape and spare.dtype == dtype:
            out = spare.copy_(host)
        else:
            out = host.to(dtype, copy=True)
        del spare
        if key is not None:
            self._spare[key] = out
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The download buffers and the kept conversions (for host memory accounting)."""
        with self._pool_lock:
            pool = list(self._recycled)
        return [t for kept in self.buffers.values() for t in kept] + pool + \
            list(self._spare.values())

    def retain(self, keys: set[tuple[int, str]]) -> None:
        """Drop the kept tensors of gradients a call no longer produced (a parameter
        frozen since, another program's numbering); after the call's own conversions."""
        def prune() -> None:
            for key in [k for k in self._spare if k not in keys]:
                del self._spare[key]
        with self._lock:
            if self._pool is not None:
                self._pool.submit(prune)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._spare.clear()
        with self._pool_lock:
            self._recycled.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _affordable(nbytes: int) -> bool:
    """Whether ``nbytes`` more leave ``HOST_MARGIN`` of the memory this process may use
    available (unknown: yes)."""
    memory = _host_memory()
    if memory is None:
        return True
    total, available = memory
    return available - nbytes >= HOST_MARGIN * total


#: (limit, usage) files of a container's memory cgroup: v2, then v1
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
_MEMORY_CACHE: list = [0.0, None]  # [when, (total, available)]: re-read at most 4x/s


def _host_memory() -> tuple[int, int] | None:
    """(total, available) bytes for this process: Linux's MemTotal/MemAvailable, or a
    container's cgroup limit and headroom where smaller (a container's /proc/meminfo
    shows the whole machine)."""
    now = time.monotonic()
    if now - _MEMORY_CACHE[0] < 0.25:
        return _MEMORY_CACHE[1]
    result: tuple[int, int] | None = None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.startswith(("MemTotal:", "MemAvailable:"))}
        result = (info["MemTotal"], info["MemAvailable"])
    except (OSError, KeyError, ValueError, IndexError):
        pass
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and (result is None or int(limit) < result[0]):
            result = (int(limit), max(0, int(limit) - usage))
        break
    _MEMORY_CACHE[:] = [now, result]
    return result


def _unshared(t: torch.Tensor) -> bool:
    """Nothing but the caller's one name refers to ``t`` or its memory: no Python reference
    (a kept ``p.grad``), no view, no ``.grad`` slot.  Conservative: unsure means shared."""
    try:
        views = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return False
    # getrefcount: the caller's name, this parameter and the call's own argument
    return sys.getrefcount(t) <= 3 and views <= 2 and not t.requires_grad


def _sees_holders() -> bool:
    """Whether :func:`_unshared` notices a tensor held only from C++ (as a ``.grad``),
    which depends on how this torch keeps tensors' Python objects alive.  Refilling is
    off where it does not: a kept tensor must never be overwritten."""
    def probe() -> bool:
        held = torch.zeros(1)
        owner = torch.nn.Parameter(torch.zeros(1))
        owner.grad = held
        return not _unshared(held)
    try:
        return probe()
    except Exception:  # noqa: BLE001 - unsure means off
        return False


_REFCOUNT_SEES_HOLDERS = _sees_holders()
