"""The disk tier (``RoundPipe(..., offload_dir=PATH)``): masters and optimizer state in
files, staged into host memory only while a step updates them.

Every offloaded tensor keeps its Python object (the optimizer keys its state by the
master, ``opt.state`` holds the moments); while it is not staged its storage holds no
bytes.  Staging points the tensor (``tensor.set_``) at a page-aligned buffer of the
store's :class:`StagingPool`, reused from unit to unit and step to step, and reads the
bytes from the file straight into it; eviction points it back at an empty storage of its
own and hands the buffer back.  Tensors of a few bytes (AdamW's step counts) stay
resident; their values travel inline in the manifest.

Layout of ``PATH``::

    data.bin        two regions ("slots") per tensor, 4 KiB aligned
    lock            locked (flock) while a pipe has the directory open: a second pipe
                    on it, in any process, is refused
    manifest.json   the committed state: step number, and for each tensor its slot,
                    dtype and shape (inline bytes for the resident ones)

Crash safety: a step writes every tensor it changes into the slot its committed value
is *not* in, and only when the whole step is written (``fdatasync``) the manifest is
replaced atomically (temporary file, ``fsync``, ``os.replace``, ``fsync`` of the
directory).  A kill or an error anywhere before that leaves the previous manifest and the
slots it names untouched: step ``k`` stays readable until step ``k + 1`` is whole.  A step
that raises is rolled back (:meth:`OffloadStore.rollback`): each tensor points at the
slot it was in when the step began, the staged copies are dropped.

I/O: ``os.preadv``/``os.pwrite`` with ``O_DIRECT`` straight into and out of the staged
tensors' (pooled, aligned) memory, in chunks spread over a few threads (they release the
GIL).  See docs/architecture.md for
what the alternatives measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from ..errors import OffloadError
from .atomic_file import write_atomically

try:
    import fcntl
except ImportError:  # (no flock: the directory is not locked)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FORMAT = "roundpipe-offload-2"  # 2: both slots of each tensor, and "meta"
_READABLE = ("roundpipe-offload-1", FORMAT)
DATA_FILE = "data.bin"
MANIFEST = "manifest.json"
LOCK_FILE = "lock"
ALIGN = 4096
#: bytes per read or write call; chunks of one tensor go to several threads
CHUNK_BYTES = 8 << 20
#: tensors at most this big stay in host memory (step counts), inline in the manifest
RESIDENT_BYTES = 64
IO_THREADS = 4
#: units the window reads ahead of the one being updated: two keep a read queued while
#: the next unit's wait ends (measured: 15.3/14.5 against 16.5/17.2 s per B params with
#: one, docs/benchmarks.md), for one unit more in memory
READ_AHEAD = 2


_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class OffloadStats:
    """The disk tier's counters (``RoundPipe.offload_stats()``).

    Attributes:
        directory: where the files are (``data.bin``, ``manifest.json``).
        step: steps committed (the manifest's step number).
        staged_bytes: bytes of host memory the tier holds for masters and state now:
            the buffers staged tensors live in, and those its :class:`StagingPool` keeps
            for reuse (between steps only those: at most the window's peak).
        peak_staged_bytes: the most at once since the pipe was made.
        bytes_read: bytes read from the files since the pipe was made.
        bytes_written: bytes written to them since the pipe was made.
        pooled_bytes: of ``staged_bytes``, the buffers kept for reuse (no tensor in
            them).
    """

    directory: str
    step: int
    staged_bytes: int
    peak_staged_bytes: int
    bytes_read: int
    bytes_written: int
    pooled_bytes: int = 0


@dataclass
class _Entry:
    key: str
    tensor: torch.Tensor
    nbytes: int
    offsets: tuple[int, int]
    #: where the value is while not staged: 0 or 1 (a slot), "zeros" (never written:
    #: staging fills zeros), "resident" (small: always in memory)
    current: int | str
    committed: int | None = None  # the slot the committed manifest names
    staged: bool = False
    #: the pool buffer the staged tensor lives in (None: staged in its own storage)
    buffer: torch.Tensor | None = None


def _buffer(t: torch.Tensor, start: int, n: int) -> ctypes.Array:
    """A writable view of bytes ``start:start+n`` of ``t``'s memory (no copy)."""
    return (ctypes.c_char * n).from_address(t.data_ptr() + start)


_local = threading.local()


def _bounce() -> tuple[mmap.mmap, torch.Tensor]:
    """This I/O thread's page-aligned buffer of one chunk (reused for every chunk)."""
    buf = getattr(_local, "buffer", None)
    if buf is None:
        m = mmap.mmap(-1, CHUNK_BYTES)
        buf = _local.buffer = (m, torch.frombuffer(m, dtype=torch.uint8))
    return buf


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _room(t: torch.Tensor, start: int) -> int:
    """Bytes of ``t``'s storage from byte ``start`` of ``t`` on."""
    return t.untyped_storage().nbytes() - t.storage_offset() * t.element_size() - start


def _aligned(t: torch.Tensor, start: int, n: int) -> bool:
    """Whether bytes ``start:start+n`` of ``t`` can be read or written with O_DIRECT in
    place: they start on a 4 KiB boundary and the storage has room for the padded
    length (a pooled buffer)."""
    return (t.data_ptr() + start) % ALIGN == 0 and _room(t, start) >= _padded(n)


def _read_exact(fd: int, t: torch.Tensor, start: int, n: int, offset: int,
                direct: bool = False) -> None:
    """Read bytes ``start:start+n`` of ``t`` from ``offset``.  ``direct``: ``fd`` is
    O_DIRECT: whole 4 KiB blocks, straight into ``t`` where it is aligned with room for
    them (a pooled buffer), else into the thread's aligned buffer and copied."""
    if direct:
        inplace = _aligned(t, start, n)
        if inplace:
            m, view = _buffer(t, start, _padded(n)), None
        else:
            m, view = _bounce()
        padded = _padded(n)
        got = 0
        while got < n:
            k = os.preadv(fd, [memoryview(m)[got:padded]], offset + got)
            if k <= 0:
                raise OffloadError(f"the offload file ended at byte {offset + got} while "
                                   f"reading {n} bytes at {offset}: it was truncated")
            got += k
        if view is not None:
            _bytes(t)[start:start + n].copy_(view[:n])
        return
    done = 0
    while done < n:
        got = os.preadv(fd, [_buffer(t, start + done, n - done)], offset + done)
        if got <= 0:
            raise OffloadError(f"the offload file ended at byte {offset + done} while "
                               f"reading {n} bytes at {offset}: it was truncated")
        done += got


def _write_exact(fd: int, t: torch.Tensor, start: int, n: int, offset: int,
                 direct: bool = False) -> None:
    if direct:  # whole 4 KiB blocks (the region has room), in place where aligned
        padded = _padded(n)
        if _aligned(t, start, n):
            m = _buffer(t, start, padded)
        else:
            m, view = _bounce()
            view[:n].copy_(_bytes(t)[start:start + n])
        done = 0
        while done < padded:
            done += os.pwrite(fd, memoryview(m)[done:padded], offset + done)
        return
    done = 0
    while done < n:
        done += os.pwrite(fd, _buffer(t, start + done, n - done), offset + done)


class StagingPool:
    """Reusable host buffers that staged masters and state live in.

    Allocating a staged tensor's memory afresh costs a page fault per 4 KiB page (the
    kernel zeroes it) and freeing it an ``munmap`` of every touched page: on the 2-core
    VM of docs/benchmarks.md about as much CPU as the update itself.  The pool keeps each
    buffer once made, page-aligned and pre-faulted (``MAP_POPULATE``), its length padded
    to 4 KiB as the file's regions are, so ``O_DIRECT`` reads and writes go straight to
    and from it with no bounce copy.  Buffers are matched by padded length (a model's
    units repeat their shapes).

    The pool **is** staged memory: :attr:`nbytes` (buffers in use plus those kept for the
    next unit or step) is what ``OffloadStats.staged_bytes`` reports, and the kept ones
    are host memory (``HostMemory.staging``) between steps.  It never holds more than the
    most it had in use at once (the window's peak): a buffer of a length it does not
    keep first frees kept ones until that high-water mark holds.  :meth:`clear` frees
    the kept buffers."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.in_use = 0      # bytes of buffers staged tensors live in
        self.kept = 0        # bytes of buffers kept for reuse
        self.high_water = 0  # the most in use at once

    @property
    def nbytes(self) -> int:
        return self.in_use + self.kept

    @staticmethod
    def buffer_length(nbytes: int) -> int:
        """The length of the buffer a tensor of ``nbytes`` is staged in."""
        return _padded(max(nbytes, 1))

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (padded to 4 KiB), page-aligned."""
        size = self.buffer_length(nbytes)
        with self._lock:
            self.in_use += size
            free = self._free.get(size)
            if free:
                self.kept -= size
                return free.pop()
            self.high_water = max(self.high_water, self.in_use)
            for length in sorted(self._free, reverse=True):  # largest first
                kept = self._free[length]
                while kept and self.in_use + self.kept > self.high_water:
                    kept.pop()
                    self.kept -= length
                if not kept:
                    del self._free[length]
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                      | getattr(mmap, "MAP_POPULATE", 0))
        # the tensor's storage keeps the mapping alive; it is unmapped with the storage
        return torch.frombuffer(m, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self._lock:
            self.in_use -= size
            self._free.setdefault(size, []).append(buffer)
            self.kept += size

    def buffers(self) -> list[torch.Tensor]:
        """The buffers kept for reuse (for host-memory accounting)."""
        with self._lock:
            return [b for kept in self._free.values() for b in kept]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.kept = 0


class OffloadStore:
    """The files of one pipe's disk tier (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], io_threads: int = IO_THREADS,
                 direct: bool = True, resume: bool | str = False) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise OffloadError(f"offload_dir {self.directory!r} cannot be created ({e}); "
                               "pass a writable directory on a local disk") from e
        # unlocked at close(), or once the store is collected unclosed (a pipe dropped
        # without close() must not keep its directory for the rest of the process)
        self._unlock = weakref.finalize(self, _unlock_directory,
                                        _lock_directory(self.directory))
        try:
            self._open(io_threads, direct, resume)
        except BaseException:
            self._unlock()
            raise

    def _open(self, io_threads: int, direct: bool, resume: bool | str) -> None:
        path = os.path.join(self.directory, DATA_FILE)
        #: the committed manifest a resume continues from (None: a fresh directory)
        self.resumed: dict | None = None
        if os.path.exists(os.path.join(self.directory, MANIFEST)):
            manifest = read_manifest(self.directory)
            if not resume:
                raise OffloadError(
                    f"offload_dir {self.directory!r} holds the committed state of step "
                    f"{manifest.get('step')} of another run (its masters and optimizer "
                    "state). A new pipe does not overwrite it: pass offload_resume=True to "
                    "continue that run from it (the pipe checks that it is the same model "
                    "and optimizer), remove the directory (or pass another one) to start "
                    "afresh, or read it with roundpipe.runtime.offload.read_committed(path)")
            if manifest.get("format") != FORMAT or "meta" not in manifest:
                raise OffloadError(
                    f"offload_dir {self.directory!r} was written by an older roundpipe "
                    f"({manifest.get('format')}), whose manifest does not record the model "
                    "and optimizer it belongs to, so it cannot be resumed safely: load a "
                    "checkpoint instead, or read it with "
                    "roundpipe.runtime.offload.read_committed(path)")
            self.resumed = manifest
        elif resume is True:
            raise OffloadError(
                f"offload_resume=True but offload_dir {self.directory!r} holds no committed "
                "state to resume (no manifest.json: no step of a run with it finished). "
                "Pass offload_resume='auto' to resume when there is state and start afresh "
                "otherwise, or offload_resume=False for a fresh run")
        flags = os.O_RDWR | os.O_CREAT | (0 if self.resumed is not None else os.O_TRUNC)
        self._fd = os.open(path, flags, 0o600)
        # I/O bypasses the page cache where the file system allows (O_DIRECT): on the
        # disks measured, buffered writes flushed with fdatasync ran at a twentieth of
        # the direct ones (docs/architecture.md, "The disk tier").
        self._direct = direct and hasattr(os, "O_DIRECT")
        if self._direct:
            try:
                fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError:  # tmpfs and some file systems refuse it
                self._direct = False
            else:
                os.close(self._fd)
                self._fd = fd
        # a resumed file keeps its regions: new ones go after them
        self._end = -(-os.fstat(self._fd).st_size // ALIGN) * ALIGN
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._groups: dict[str, list[str]] = {}  # parameter name -> its keys
        # Reads and writes in pools of their own: unit k+1's read must not queue behind
        # unit k-1's write-back.
        self._pool = ThreadPoolExecutor(max_workers=io_threads,
                                        thread_name_prefix="roundpipe-offload-read")
        self._write_pool = ThreadPoolExecutor(max_workers=io_threads,
                                              thread_name_prefix="roundpipe-offload-write")
        self.step = 0 if self.resumed is None else int(self.resumed["step"])  # commits
        #: plain data written into every manifest (what the directory belongs to)
        self.meta: dict = {}
        #: called before each commit writes the manifest (updates ``meta``)
        self.before_commit: Callable[[], None] | None = None
        # What a step may roll back to: key -> current at begin(), resident bytes.
        self._begun: dict[str, int | str] | None = None
        self._resident_at_begin: dict[str, bytes] = {}
        self._committed_resident: dict[str, bytes] = {}
        self.staging = StagingPool()
        self._unpooled = 0  # staged bytes in tensors' own storages (while registering)
        self.staged_bytes = 0
        self.peak_staged_bytes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        # Tests inject faults here: called with ("read", key) before each tensor's read,
        # ("write", key) before its write-back and ("commit", step) before the manifest
        # is replaced.
        self.fault: Callable[[str, object], None] | None = None
        # While held (a load of masters and optimizer state), commit() only notes that a
        # commit is due: the whole load becomes one manifest switch at release.
        self._held = False
        self._commit_due = False
        self.closed = False

    # --- registration -----------------------------------------------------------------
    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def tensor(self, key: str) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.tensor

    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [k for k in self._entries if k.startswith(prefix)]

    def group_keys(self, names: Iterable[str]) -> list[str]:
        """The keys registered for the parameters ``names`` (masters and state)."""
        with self._lock:
            return [k for n in names for k in self._groups.get(n, ())]

    def staged_keys(self) -> list[str]:
        with self._lock:
            return [k for k, e in self._entries.items() if e.staged]

    def register(self, key: str, tensor: torch.Tensor, *, group: str,
                 zeros: bool = False) -> None:
        """Offload ``tensor`` under ``key``: its value now (``zeros``: it is all zeros,
        nothing is written) goes to the file and its memory is freed, unless it is small
        enough to stay resident.  A key registered before gets the new tensor in its
        regions (an optimizer made again over the same masters)."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise OffloadError(f"internal: {key} is not a contiguous CPU tensor")
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            old = self._entries.get(key)
            if old is None:
                self._groups.setdefault(group, []).append(key)
            elif old.staged and old.tensor is not tensor:
                self._unstage(old)  # a replaced tensor: its buffer back to the pool
            if nbytes <= RESIDENT_BYTES:
                if zeros:
                    with torch.no_grad():
                        tensor.zero_()
                self._entries[key] = _Entry(key, tensor, nbytes, (0, 0), "resident",
                                            committed=None if old is None else old.committed)
                return
            resumed = (self.resumed or {}).get("entries", {}).get(key, {})
            if old is not None and old.nbytes == nbytes and old.current != "resident":
                offsets = old.offsets
                committed = old.committed
            elif old is None and "slots" in resumed and resumed["dtype"] == \
                    _dtype_name(tensor.dtype) and list(resumed["shape"]) == \
                    list(tensor.shape):  # a resumed key not adopted: its regions
                offsets = (int(resumed["slots"][0]), int(resumed["slots"][1]))
                committed = offsets.index(int(resumed["offset"]))
            else:
                size = -(-nbytes // ALIGN) * ALIGN
                offsets = (self._end, self._end + size)
                self._reserve(self._end, 2 * size)
                self._end += 2 * size
                committed = None
            entry = _Entry(key, tensor, nbytes, offsets, "zeros", committed=committed,
                           staged=True)
            self._entries[key] = entry
            self._unpooled += nbytes
            self._count_staged()
        if zeros:
            self._evict(entry)
            return
        for f in self._write(entry):
            f.result()
        self._evict(entry)

    def _reserve(self, offset: int, length: int) -> None:
        """Allocate both slots' disk blocks now: a full disk fails here, when state is
        made, rather than in the middle of a step's write-back."""
        try:
            os.posix_fallocate(self._fd, offset, length)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise OffloadError(
                    f"offload_dir {self.directory!r} has no room for {length:,} more bytes "
                    f"({e}); free space there, or pass a directory on a larger disk") from e
            os.ftruncate(self._fd, max(offset + length, os.fstat(self._fd).st_size))

    def forget(self, keys: Iterable[str]) -> None:
        """Drop entries (state an optimizer dropped); their regions are not reused."""
        with self._lock:
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is not None and entry.staged:
                    self._unstage(entry)
                self._ungroup(key)
                if self.resumed is not None:  # not carried into later manifests
                    self.resumed["entries"].pop(key, None)

    def adopt(self, key: str, tensor: torch.Tensor, *, group: str) -> bool:
        """Resume: make ``tensor`` (the right shape and dtype, contiguous) the value the
        resumed manifest commits under ``key``, without reading it (its memory is freed;
        a resident one gets its inline bytes).  False if the manifest has no such key
        (or a key registered since)."""
        info = (self.resumed or {}).get("entries", {}).get(key)
        if info is None or self.has(key):
            return False
        nbytes = tensor.numel() * tensor.element_size()
        if (info["dtype"] != _dtype_name(tensor.dtype) or list(info["shape"]) !=
                list(tensor.shape) or not tensor.is_contiguous()):
            raise OffloadError(f"internal: {key} is {info['dtype']} {info['shape']} in "
                               f"the manifest, {tensor.dtype} {list(tensor.shape)} here")
        with self._lock:
            self._groups.setdefault(group, []).append(key)
            if "bytes" in info:
                data = bytes.fromhex(info["bytes"])
                if nbytes:
                    ctypes.memmove(tensor.data_ptr(), data, nbytes)
                self._entries[key] = _Entry(key, tensor, nbytes, (0, 0), "resident")
                return True
            slots = (int(info["slots"][0]), int(info["slots"][1]))
            slot = slots.index(int(info["offset"]))
            self._entries[key] = _Entry(key, tensor, nbytes, slots, slot, committed=slot)
        tensor.untyped_storage().resize_(0)
        return True

    def resumed_keys(self, prefix: str = "") -> list[str]:
        """Keys of the resumed manifest not adopted or registered (yet)."""
        entries = (self.resumed or {}).get("entries", {})
        with self._lock:
            return [k for k in entries if k.startswith(prefix) and k not in self._entries]

    def _ungroup(self, key: str) -> None:
        for keys in self._groups.values():
            if key in keys:
                keys.remove(key)
                return

    # --- staging ----------------------------------------------------------------------
    def _count_staged(self) -> None:
        self.staged_bytes = self.staging.nbytes + self._unpooled
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _entries_of(self, keys: Iterable[str]) -> list[_Entry]:
        with self._lock:
            return [e for k in keys if (e := self._entries.get(k)) is not None
                    and e.current != "resident"]

    def stage(self, keys: Iterable[str]) -> list[Future]:
        """Start reading ``keys`` into memory; wait for the futures before using them.
        If it raises part-way, the reads it started have ended (the caller evicts the
        keys: their buffers go back to the pool and must not be written into later)."""
        futures: list[Future] = []
        try:
            for entry in self._entries_of(keys):
                if not entry.staged:
                    futures.extend(self._stage_one(entry))
        except BaseException:
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.result()
            raise
        return futures

    def _stage_one(self, entry: _Entry) -> list[Future]:
        if self.fault is not None:
            self.fault("read", entry.key)
        buffer = self.staging.take(entry.nbytes)
        t = entry.tensor
        try:
            with torch.no_grad():  # the same tensor object, now in the pooled buffer
                t.set_(buffer.untyped_storage(), 0, t.shape, t.stride())
        except BaseException:
            self.staging.give(buffer)
            raise
        with self._lock:
            entry.staged = True
            entry.buffer = buffer
            self._count_staged()
        if entry.current == "zeros":
            with torch.no_grad():
                t.zero_()
            return []
        offset = entry.offsets[entry.current]
        self.bytes_read += entry.nbytes
        return [self._pool.submit(_read_exact, self._fd, buffer, start,
                                  min(CHUNK_BYTES, entry.nbytes - start), offset + start,
                                  self._direct)
                for start in range(0, entry.nbytes, CHUNK_BYTES)]

    def write_back(self, keys: Iterable[str]) -> list[Future]:
        """Start writing staged ``keys`` into the slot their committed value is not in."""
        futures: list[Future] = []
        for entry in self._entries_of(keys):
            if entry.staged:
                futures.extend(self._write(entry))
        return futures

    def _write(self, entry: _Entry) -> list[Future]:
        if self.fault is not None:
            self.fault("write", entry.key)
        slot = 0 if entry.committed is None else 1 - entry.committed
        offset = entry.offsets[slot]
        source = entry.tensor if entry.buffer is None else entry.buffer
        futures = [self._write_pool.submit(_write_exact, self._fd, source, start,
                                     min(CHUNK_BYTES, entry.nbytes - start), offset + start,
                                     self._direct)
                   for start in range(0, entry.nbytes, CHUNK_BYTES)]
        entry.current = slot
        self.bytes_written += entry.nbytes
        return futures

    def evict(self, keys: Iterable[str]) -> None:
        """Free the memory of staged ``keys`` (written back first, or unchanged)."""
        for entry in self._entries_of(keys):
            self._evict(entry)

    def _evict(self, entry: _Entry) -> None:
        with self._lock:
            if not entry.staged:
                return
            self._unstage(entry)

    def _unstage(self, entry: _Entry) -> None:
        """Free ``entry``'s memory: a pooled buffer goes back to the pool, the tensor
        gets an empty storage of its own (its shape kept); an own storage is resized
        to nothing."""
        entry.staged = False
        t, buffer, entry.buffer = entry.tensor, entry.buffer, None
        if buffer is None:
            self._unpooled -= entry.nbytes
            t.untyped_storage().resize_(0)
        else:
            # set_ checks the storage holds the shape: allocate it (untouched pages,
            # nothing faulted) and free it once the tensor points at it
            own = torch.UntypedStorage(entry.nbytes)
            with torch.no_grad():
                t.set_(own, 0, t.shape, t.stride())
            own.resize_(0)
            self.staging.give(buffer)
        self._count_staged()

    def read(self, key: str) -> torch.Tensor:
        """A new tensor with ``key``'s value (staged or not), read once from the file."""
        with self._lock:
            entry = self._entries[key]
        t = entry.tensor
        if entry.staged or entry.current == "resident":
            return t.detach().clone()
        out = torch.empty(t.shape, dtype=t.dtype)
        if entry.current == "zeros":
            return out.zero_()
        offset = entry.offsets[entry.current]
        self.bytes_read += entry.nbytes
        wait([self._pool.submit(_read_exact, self._fd, out, start,
                                min(CHUNK_BYTES, entry.nbytes - start), offset + start,
                                self._direct)
              for start in range(0, entry.nbytes, CHUNK_BYTES)])
        return out

    def assign(self, key: str, value: torch.Tensor) -> None:
        """Set ``key``'s value from ``value`` (a load): staged, copied, written, evicted."""
        wait(self.stage([key]))
        with torch.no_grad():
            self._entries[key].tensor.copy_(value)
        wait(self.write_back([key]))
        self.evict([key])

    # --- steps ------------------------------------------------------------------------
    def begin(self) -> None:
        """Mark what a failed step rolls back to."""
        with self._lock:
            self._begun = {k: e.current for k, e in self._entries.items()}
            self._resident_at_begin = {
                k: bytes(_buffer(e.tensor, 0, e.nbytes)) for k, e in self._entries.items()
                if e.current == "resident" and e.nbytes}

    def rollback(self) -> list[str]:
        """Undo everything since :meth:`begin`: staged copies are dropped, each tensor's
        value is the one it had then.  Returns the keys registered since (the caller
        drops them from the optimizer's state)."""
        with self._lock:
            begun = self._begun or {}
            dropped = [k for k in self._entries if k not in begun]
            entries = list(self._entries.values())
        for entry in entries:
            self._evict(entry) if entry.current != "resident" else None
        with self._lock:
            for key in dropped:
                self._entries.pop(key, None)
                self._ungroup(key)
            for key, current in begun.items():
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.current = current
                saved = self._resident_at_begin.get(key)
                if saved is not None and entry.current == "resident":
                    ctypes.memmove(entry.tensor.data_ptr(), saved, len(saved))
            self._begun = None
        return dropped

    def hold(self) -> None:
        """Start a load that is committed as one: mark what a failure rolls back to, and
        defer every :meth:`commit` until :meth:`release`."""
        self.begin()
        with self._lock:
            self._held, self._commit_due = True, False

    def release(self) -> bool:
        """End :meth:`hold`, committing once if a commit was asked for meanwhile (a
        failed commit leaves the marks of :meth:`begin` for a :meth:`rollback`).
        Returns whether one was due."""
        with self._lock:
            self._held, due = False, self._commit_due
            self._commit_due = False
        if due:
            self.commit()
        else:
            self._begun = None
        return due

    def release_without_commit(self) -> None:
        """End :meth:`hold` without committing (the caller rolls back)."""
        with self._lock:
            self._held = self._commit_due = False

    def commit(self) -> None:
        """Make everything written so far the committed state: wait, flush the data to
        disk, then replace the manifest atomically (the step counter advances).  While
        held (:meth:`hold`) it only notes that a commit is due."""
        with self._lock:
            if self._held:
                self._commit_due = True
                return
        if self.fault is not None:
            self.fault("commit", self.step + 1)
        if self.before_commit is not None:
            self.before_commit()
        os.fdatasync(self._fd)
        with self._lock:
            entries = {}
            for key, e in self._entries.items():
                info = {"dtype": _dtype_name(e.tensor.dtype), "shape": list(e.tensor.shape)}
                if e.current == "resident":
                    info["bytes"] = bytes(_buffer(e.tensor, 0, e.nbytes)).hex() \
                        if e.nbytes else ""
                elif e.current in (0, 1):
                    info["offset"] = e.offsets[e.current]
                    info["slots"] = list(e.offsets)
                else:
                    continue  # zeros never written: a resume starts it afresh
                entries[key] = info
            # what a resumed manifest holds and no optimizer took yet (a load before
            # the optimizer was made): committed as it was, its slots untouched
            for key in self.resumed_keys():
                entries[key] = self.resumed["entries"][key]  # type: ignore[index]
            manifest = {"format": FORMAT, "step": self.step + 1, "entries": entries,
                        "meta": self.meta}
            data = json.dumps(manifest, default=repr).encode()
            write_atomically(os.path.join(self.directory, MANIFEST), lambda f: f.write(data))
            self.step += 1
            for e in self._entries.values():
                if e.current in (0, 1):
                    e.committed = e.current  # type: ignore[assignment]
            self._begun = None

    # --- accounting -------------------------------------------------------------------
    def stats(self) -> OffloadStats:
        with self._lock:
            return OffloadStats(self.directory, self.step, self.staged_bytes,
                                self.peak_staged_bytes, self.bytes_read, self.bytes_written,
                                self.staging.kept)

    def disk_bytes(self, prefix: str) -> int:
        """Bytes of file regions (both slots) of the keys starting with ``prefix``."""
        with self._lock:
            return sum(2 * (e.offsets[1] - e.offsets[0]) for k, e in self._entries.items()
                       if k.startswith(prefix) and e.current != "resident")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        self.staging.clear()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._unlock()


# The lock file's descriptors of the stores open in this process (a forked child
# closes its copies, so that it does not hold the directories after the parent closes).
_LOCK_FDS: set[int] = set()


def _lock_directory(directory: str) -> int | None:
    """Lock ``directory`` for one store (``flock``, released when the store closes or
    its process ends): two pipes on one directory would write into each other's slots
    and commit manifests naming the other's bytes."""
    if fcntl is None:
        return None
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise OffloadError(f"offload_dir {directory!r} cannot be used ({e}); pass a "
                           "writable directory on a local disk") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            log.warning("roundpipe: offload_dir %s cannot be locked (%s): nothing stops "
                        "a second pipe from using it at the same time", directory, e)
            return None
        raise OffloadError(
            f"offload_dir {directory!r} is in use by another pipe (of this process or "
            "another): two pipes on one directory would overwrite each other's state. "
            "Close the other pipe first (pipe.close(), or let its process end), or pass "
            "another offload_dir") from None
    _LOCK_FDS.add(fd)
    return fd


def _unlock_directory(fd: int | None) -> None:
    if fd is not None and fd in _LOCK_FDS:
        _LOCK_FDS.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_locks_in_child() -> None:
    for fd in _LOCK_FDS:  # (closing a copy leaves the parent's lock held)
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_locks_in_child)


_BANDWIDTH: dict[str, float] = {}


def disk_bandwidth(directory: str, nbytes: int = 64 << 20) -> float:
    """The disk's bandwidth under ``directory`` in bytes per second (the mean of a
    sequential write, flushed, and a read with the page cache dropped; 4 threads, 8 MiB
    blocks), measured once per directory and process (~0.1-1 s)."""
    cached = _BANDWIDTH.get(directory)
    if cached is not None:
        return cached
    path = os.path.join(directory, f".bandwidth-{uuid.uuid4().hex[:8]}")
    buf = torch.full((CHUNK_BYTES,), 7, dtype=torch.uint8)
    blocks = max(1, nbytes // CHUNK_BYTES)
    direct = hasattr(os, "O_DIRECT")
    try:  # as the tier does its I/O
        fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with ThreadPoolExecutor(IO_THREADS) as pool:
            t = time.perf_counter()
            wait([pool.submit(_write_exact, fd, buf, 0, CHUNK_BYTES, i * CHUNK_BYTES,
                              direct) for i in range(blocks)])
            os.fdatasync(fd)
            write_s = time.perf_counter() - t
            with contextlib.suppress(AttributeError, OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            outs = [torch.empty(CHUNK_BYTES, dtype=torch.uint8) for _ in range(IO_THREADS)]
            t = time.perf_counter()
            wait([pool.submit(_read_exact, fd, outs[i % IO_THREADS], 0, CHUNK_BYTES,
                              i * CHUNK_BYTES, direct) for i in range(blocks)])
            read_s = time.perf_counter() - t
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    bandwidth = 2 * blocks * CHUNK_BYTES / (write_s + read_s)
    log.info("roundpipe: disk bandwidth under %s %.2f GB/s", directory, bandwidth / 1e9)
    _BANDWIDTH[directory] = bandwidth
    return bandwidth


def wait(futures: Sequence[Future]) -> None:
    """Wait for every future; raise the first error after all are done (no I/O is left
    running into memory that is about to be freed)."""
    error: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        if isinstance(error, OSError):
            raise OffloadError(f"offload I/O failed: {error}; the step changed nothing "
                               "the files' committed state holds") from error
        raise error


def read_manifest(directory: str | os.PathLike[str]) -> dict:
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise OffloadError(f"cannot read the offload manifest {path!r}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE:
        raise OffloadError(f"{path!r} is not a roundpipe offload manifest")
    return manifest


def read_committed(directory: str | os.PathLike[str]) -> tuple[int, dict[str, torch.Tensor]]:
    """The committed state of an offload directory: the step number and every tensor by
    key (``master/<parameter>``, ``state/<parameter>/<state key>``)."""
    manifest = read_manifest(directory)
    out: dict[str, torch.Tensor] = {}
    with open(os.path.join(os.fspath(directory), DATA_FILE), "rb") as f:
        for key, info in manifest["entries"].items():
            t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            n = t.numel() * t.element_size()
            if "bytes" in info:
                data = bytes.fromhex(info["bytes"])
            else:
                f.seek(info["offset"])
                data = f.read(n)
            if len(data) != n:
                raise OffloadError(f"the offload data of {key} is truncated")
            if n:
                ctypes.memmove(t.data_ptr(), data, n)
            out[key] = t
    return int(manifest["step"]), out


def master_key(name: str) -> str:
    return f"master/{name}"


def state_key(name: str, key: str) -> str:
    return f"state/{name}/{key}"


class OffloadWindow:
    """The disk tier's side of a step that updates the masters unit by unit (the
    callbacks of the :class:`~roundpipe.runtime.masters.UnitSchedule` the pipe sets on
    its ``LandedGrads`` for the step): before unit
    ``k`` its masters and state are staged (read ahead while earlier units updated) and
    the reads of units up to ``k + ahead`` start; after it, its write-back starts, and
    unit ``k - 2``'s write-back is waited for and its memory freed.  At most
    ``ahead + 2`` units are staged (four by default)."""

    def __init__(self, store: OffloadStore, units: Sequence[tuple[str, ...]],
                 ahead: int | None = None) -> None:
        self.store = store
        self.ahead = READ_AHEAD if ahead is None else ahead
        self.units = [tuple(u) for u in units]
        self._reads: dict[int, list[Future]] = {}
        self._writes: dict[int, list[Future]] = {}
        self._ready: set[int] = set()

    def _keys(self, k: int) -> list[str]:
        return self.store.group_keys(self.units[k])

    def _start_read(self, k: int) -> None:
        if 0 <= k < len(self.units) and k not in self._reads and k not in self._ready:
            self._reads[k] = self.store.stage(self._keys(k))

    def before_unit(self, k: int) -> None:
        self._retire(k - 2)
        if k in self._writes:  # updated once already this step (a second optimizer)
            wait(self._writes.pop(k))
        self._start_read(k)
        wait(self._reads.pop(k, []))
        self._ready.add(k)
        for j in range(k + 1, k + 1 + self.ahead):
            self._start_read(j)

    def after_unit(self, k: int) -> None:
        self._writes[k] = self.store.write_back(self._keys(k))

    def _retire(self, upto: int) -> None:
        for j in sorted(j for j in self._writes if j <= upto):
            wait(self._writes.pop(j))
            self.store.evict(self._keys(j))
            self._ready.discard(j)

    def finish(self) -> None:
        """Wait for every write-back and free every staged unit (a unit read ahead
        but not updated is freed unwritten)."""
        self._retire(len(self.units))
        for k in list(self._reads):
            wait(self._reads.pop(k))
        for k in list(self._ready):
            self.store.evict(self._keys(k))
        self._ready.clear()

    def drain(self) -> None:
        """After a failure: let every read and write in flight end (errors ignored), so
        no I/O runs into memory the rollback frees."""
        for futures in list(self._reads.values()) + list(self._writes.values()):
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.result()
        self._reads.clear()
        self._writes.clear()
