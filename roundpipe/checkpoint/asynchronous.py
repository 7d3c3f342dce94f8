"""Asynchronous checkpoint saves: the state is captured at a step boundary, written by a
background thread while training goes on.

Capture, for a sharded save: tensors the forward pass may change (buffers such as
BatchNorm statistics) are always copied; the live tensors that only the optimizer thread
changes (masters, optimizer state) are copied up to ``max_snapshot_bytes``.  Those beyond
the cap are read during the write while the optimizer thread is *held*: the next call's
forward and backward run meanwhile, and its ``step_fn`` starts once the last of them has
been copied (one tensor at a time, as DCP writes it).  So extra host memory is at most the
cap plus one tensor, and with no cap training never waits for the disk.  A single-file
save copies everything (one pickle cannot be written in pieces).

One save at a time per process: a second save, or a load, first waits for the one in
flight.  A background save that fails logs the error and raises it from its future's
``result()``.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..api import RoundPipe
    from .sharded import Collected

log = logging.getLogger(__name__)

_lock = threading.Lock()
_in_flight: list[Future] = []


class CheckpointSave(Future):
    """The future of an asynchronous save; ``result()`` waits for the write and raises its
    error.  ``snapshot_bytes``: host memory the copies took; ``held_bytes``: bytes read
    while holding the optimizer thread (beyond ``max_snapshot_bytes``)."""

    snapshot_bytes: int = 0
    held_bytes: int = 0


def wait_for_saves() -> None:
    """Wait until no asynchronous save of this process is in flight (errors were logged
    and are raised by the saves' own futures)."""
    with _lock:
        pending = list(_in_flight)
    for future in pending:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - reported by the save's future and the log
            pass


def _lower_priority() -> None:
    """Let training threads run first when the cores are busy: the write can wait, the
    step should not (Linux sets a nice value per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: write at normal priority
        pass


def _run(future: CheckpointSave, name: str, work: Callable[[], None]) -> None:
    def body() -> None:
        _lower_priority()
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the future
            log.error("roundpipe: the asynchronous checkpoint save to %s failed: %s: %s",
                      name, type(e).__name__, e)
            future.set_exception(e)
        else:
            future.set_result(None)
        finally:
            with _lock:
                _in_flight.remove(future)

    # Running from now on: cancel() cannot stop the write, so it must return False.
    future.set_running_or_notify_cancel()
    with _lock:
        _in_flight.append(future)
    # Not a daemon: the interpreter waits for a save in flight before it exits.
    threading.Thread(target=body, name="roundpipe-checkpoint", daemon=False).start()


def _copy(obj: Any) -> Any:
    """A deep copy of the tensors in ``obj`` (dicts, lists, tuples), keeping the state
    dict's ``_metadata``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = type(obj)()
        for k, v in obj.items():
            out[k] = _copy(v)
        if hasattr(obj, "_metadata"):  # copied too: it may hold live tensors (the
            # masters kept for the weight prediction)
            out._metadata = _copy(obj._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(v) for v in obj)
    return obj


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def save_file_async(path: str, state: dict[str, Any],
                    write: Callable[[str, dict[str, Any]], None]) -> CheckpointSave:
    """Copy ``state`` now, ``write(path, copy)`` in the background."""
    snapshot = _copy(state)
    future = CheckpointSave()
    future.snapshot_bytes = _nbytes(snapshot)
    _run(future, path, lambda: write(path, snapshot))
    return future


def _uses(t: torch.Tensor) -> int:
    """How many tensors (views included) hold ``t``'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _StagingPool:
    """Buffers for the tensors copied while the optimizer is held, reused once nothing
    holds a view of them any more: fresh allocations per tensor were not returned to the
    system (the process grew by most of the held bytes, not by one tensor).

    A buffer is free when no tensor but the pool's own uses its storage: DCP detaches the
    copy (a new view), and when CUDA is available it resolves tensors up to its copy-ahead
    limit before writing them, so the Python object this returns dies long before its
    bytes are written."""

    def __init__(self) -> None:
        self._buffers: dict[int, list[tuple[torch.Tensor, int]]] = {}  # (buffer, idle uses)
        self._lock = threading.Lock()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t.clone()
        nbytes = t.numel() * t.element_size()
        with self._lock:
            buffers = self._buffers.setdefault(nbytes, [])
            buf = next((b for b, idle in buffers if _uses(b) <= idle), None)
            if buf is None:
                buf = torch.empty(nbytes, dtype=torch.uint8)
                buffers.append((buf, _uses(buf)))
            # Exactly the tensor's bytes: DCP copies a tensor whose storage is larger.
            out = buf.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


def save_sharded_async(path: str, pipe: RoundPipe, collected: Collected, group: Any,
                       max_snapshot_bytes: int | None) -> CheckpointSave:
    """Capture ``collected`` (see the module's docstring) and write it in the background."""
    from .sharded import write

    tensors = dict(collected.tensors)
    # roundpipe.pt is written after the tensors: its data (the extra, the optimizer's
    # hyper-parameters and non-tensor state) as it is now, not as training leaves it.
    meta = _copy(collected.meta)
    copied = _nbytes(meta)
    deferred: set[str] = set()
    for key, t in tensors.items():  # everything the forward pass may change: always
        if key not in collected.live and key not in collected.private:
            tensors[key] = t.clone()
            copied += t.numel() * t.element_size()
    for key, t in tensors.items():
        if key in collected.live:
            size = t.numel() * t.element_size()
            if max_snapshot_bytes is None or copied + size <= max_snapshot_bytes:
                tensors[key] = t.clone()
                copied += size
            else:
                deferred.add(key)
    future = CheckpointSave()
    future.snapshot_bytes = copied
    future.held_bytes = sum(tensors[k].numel() * tensors[k].element_size() for k in deferred)
    held, released = threading.Event(), threading.Event()
    if deferred:
        # Queued now, before any later step: the optimizer thread waits here until the
        # writer has copied the last deferred tensor.
        pipe.enqueue_on_optimizer_thread(lambda: (held.set(), released.wait()))
    remaining = set(deferred)
    remaining_lock = threading.Lock()
    pool = _StagingPool()

    def resolve(key: str, t: torch.Tensor) -> torch.Tensor:
        if key not in deferred:
            return t
        copy = pool.copy(t)
        with remaining_lock:
            remaining.discard(key)
            if not remaining:
                released.set()
        return copy

    def work() -> None:
        try:
            if deferred:
                held.wait()
            write(path, type(collected)(tensors, meta, set()), group, resolve)
        finally:
            released.set()  # never leave the optimizer thread held

    _run(future, path, work)
    return future
