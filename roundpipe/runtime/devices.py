"""Devices: stateless workers that receive uploads, run stage jobs and return downloads.

Every device has the same three threads and the scheduler only uses this interface, so a
virtual CPU device exercises the same ordering logic a GPU does:

* the *controller* runs jobs in submission order (``submit``);
* the *weight loader* uploads a stage's state ahead of its job (``load_weights``): while
  job ``k`` computes, job ``k + D``'s weights are already on their way (double buffering);
* the *activation loader* uploads a microbatch's inputs ahead of its compute
  (``upload_async``; the job runner asks for the next microbatch's once the current one's
  values are freed: on a GPU its kernels are still running then);
* the *download waiter* learns when downloads have landed in host memory
  (``after_downloads``), so the controller never blocks on a copy: it goes on launching
  the next microbatch while the host side of the last one completes.

A copy in flight is a :class:`Transfer`; ``result()`` returns the device tensor once the
consumer may use it.  On CUDA the loaders enqueue copies on their own streams and record
an event, and ``result()`` makes the compute stream wait for that event: ordering by
events, never by device-wide synchronisation.  A download returns its host tensor at once;
its contents are valid only once a later ``after_downloads()`` future has completed.  A
:class:`VirtualCPUDevice` makes a real copy of everything uploaded to it, so aliasing bugs
show without a GPU, it can be given a memory capacity that uploads must fit in, and its
downloads are copied on the waiter thread, so a host read that does not wait for them sees
an unfilled tensor in the tests instead of a race that only a GPU would show.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import ConfigError
from .device_memory import StorageLedger

log = logging.getLogger(__name__)

#: Transfer categories counted by ``pipe.stats()``: uploads are weights, activations,
#: labels and gradients of activations; downloads are activations, gradients, updated
#: buffers and losses.
CATEGORIES = ("weights", "activations", "labels", "grads", "buffers", "losses")


class DeviceMemoryExceeded(Exception):
    """An upload did not fit in a device's capacity (turned into OutOfMemoryError with the
    stage named by the executor)."""

    def __init__(self, device: str, needed: int, free: int, capacity: int) -> None:
        super().__init__(f"{device}: needs {needed} more bytes, {free} of {capacity} free")
        self.device = device
        self.needed = needed
        self.free = free
        self.capacity = capacity


@dataclass(frozen=True)
class DeviceCounters:
    """Transfer and memory counters of one device over one call.

    Attributes:
        name: device name, e.g. ``cpu:1`` or ``cuda:0``.
        bytes_uploaded, bytes_downloaded: all host-to-device / device-to-host bytes.
        uploaded: bytes uploaded per category (``weights``, ``activations``, ``labels``,
            ``grads``).
        downloaded: bytes downloaded per category (``activations``, ``grads``, ...).
        peak_resident_bytes: most bytes uploaded and not yet released at once.
        peak_weight_bytes: the same for stage weights alone (at most two stages: the one
            computing and the one prefetched).
        peak_allocated_bytes: the most bytes of tensors alive on the device at once during
            the call: weights (prefetched ones too), activations, tensors saved for
            backward, stashed inputs, gradients.  CUDA: the allocator's peak over what was
            allocated when the call started (a GPU shared by logical devices reports the
            whole GPU's).  Virtual CPU devices: measured from the storages made on the
            device's threads (``runtime/device_memory.py``), only when ``measure_memory``
            is on; None otherwise.
    """

    name: str
    bytes_uploaded: int
    bytes_downloaded: int
    uploaded: Mapping[str, int]
    downloaded: Mapping[str, int]
    peak_resident_bytes: int
    peak_weight_bytes: int
    peak_allocated_bytes: int | None = None


class Transfer:
    """A copy in flight.

    ``result()`` waits for it and returns the copied value; ``release()`` returns its bytes
    to the device's budget once the consumer is done with them (a failed copy holds none).
    """

    def __init__(self, future: Future, on_result: Callable[[Any], Any], device: Device,
                 nbytes: int, category: str) -> None:
        self._future = future
        self._on_result = on_result
        self.device = device
        self.nbytes = nbytes
        self.category = category
        self._released = False

    def result(self) -> Any:
        return self._on_result(self._future.result())

    def release(self) -> None:
        """Free the copy's bytes in the accounting (waits for a copy still in flight)."""
        if self._released:
            return
        self._released = True
        try:
            self._future.result()
        except BaseException:  # noqa: BLE001 - a failed copy was never accounted
            return
        self.device.release(self.nbytes, self.category)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- layouts ------------------------------------------------------------------------------
# A value's strides must not depend on whether it crossed a device: kernels round
# differently on permuted or channels-last inputs than on contiguous ones, and where the
# stage boundaries fall depends on the device count.  Transfers keep a dense tensor's
# strides; values that are not dense (expanded, overlapping, or views with gaps) cannot
# be copied as they are, so the executor makes every value passed between layer units
# dense, crossing or not (:func:`dense`).

def copy_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides of a copy of ``tensor``: its own where it is non-overlapping and dense
    (permuted, channels-last), contiguous otherwise (what ``clone()`` does)."""
    if tensor.is_contiguous():
        return tensor.stride()
    return torch.empty_like(tensor, device="meta").stride()


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when a copy keeps its strides, else a dense copy of it."""
    if tensor.is_contiguous() or tensor.stride() == copy_strides(tensor):
        return tensor
    return tensor.clone()


class Device:
    """A worker device.  Subclasses implement the copies; threads and accounting are
    shared."""

    kind = "abstract"

    def __init__(self, name: str, torch_device: torch.device,
                 capacity_bytes: int | None = None) -> None:
        self.name = name
        self.torch_device = torch_device
        self.capacity_bytes = capacity_bytes
        prefix = f"roundpipe-{name}"
        self._controller = ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}-jobs")
        self._weights = ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}-weights")
        self._activations = ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}-acts")
        self._downloads = ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}-downloads")
        self._download_errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._resident = 0
        self._weight_resident = 0
        # Storages made on this device's threads, per job (when measure_memory is on).
        self.memory = StorageLedger(torch_device.type)
        self.measure_memory = False
        self.reset_counters()

    # --- accounting ----------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Start a call: zero the counters, forget an earlier call's failed download."""
        with self._lock:
            self._up = dict.fromkeys(CATEGORIES, 0)
            self._down = dict.fromkeys(CATEGORIES, 0)
            self._peak = self._resident
            self._weight_peak = self._weight_resident
            self._download_errors = []
        self.memory.reset()

    def counters(self) -> DeviceCounters:
        with self._lock:
            return DeviceCounters(self.name, sum(self._up.values()), sum(self._down.values()),
                                  dict(self._up), dict(self._down), self._peak,
                                  self._weight_peak, self._peak_allocated())

    def _peak_allocated(self) -> int | None:
        return self.memory.peak_bytes() if self.measure_memory else None

    def watching(self, owner: Any) -> Any:
        """A block whose tensors count as this device's memory, held by ``owner`` (a job
        index), when ``measure_memory`` is on (run it on this device's threads)."""
        if not self.measure_memory:
            return contextlib.nullcontext()
        return self.memory.watching(owner)

    def resident_bytes(self) -> int:
        """Bytes uploaded and not yet released."""
        with self._lock:
            return self._resident

    def free_bytes(self) -> int | None:
        """Bytes still available for uploads (None: unbounded)."""
        if self.capacity_bytes is None:
            return None
        with self._lock:
            return self.capacity_bytes - self._resident

    def _account_upload(self, nbytes: int, category: str) -> None:
        with self._lock:
            if self.capacity_bytes is not None and \
                    self._resident + nbytes > self.capacity_bytes:
                raise DeviceMemoryExceeded(self.name, nbytes,
                                           self.capacity_bytes - self._resident,
                                           self.capacity_bytes)
            self._up[category] += nbytes
            self._resident += nbytes
            self._peak = max(self._peak, self._resident)
            if category == "weights":
                self._weight_resident += nbytes
                self._weight_peak = max(self._weight_peak, self._weight_resident)

    def _account_download(self, nbytes: int, category: str) -> None:
        with self._lock:
            self._down[category] += nbytes

    def release(self, nbytes: int, category: str = "activations") -> None:
        """Mark ``nbytes`` of uploaded data as freed."""
        with self._lock:
            self._resident -= nbytes
            if category == "weights":
                self._weight_resident -= nbytes

    # --- work ----------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on this device's controller thread."""
        return self._controller.submit(fn, *args)

    def load_weights(self, tensors: Mapping[str, torch.Tensor],
                     before: Callable[[], None] | None = None, owner: Any = None) -> Transfer:
        """Upload a stage's state on the weight loader; ``before`` runs first there (the
        wait for the optimizer's fences).  ``result()`` gives ``{name: device tensor}``;
        ``owner`` is the job the copies are measured for."""
        def work() -> Any:
            if before is not None:
                before()
            copies: dict[str, torch.Tensor] = {}
            try:
                with self.watching(owner):
                    for name, t in tensors.items():
                        copies[name] = self._copy_in(t, "weights", self._weight_stream())
            except BaseException:
                self.release(sum(_nbytes(c) for c in copies.values()), "weights")
                raise
            return copies, self._record(self._weight_stream())
        nbytes = sum(_nbytes(t) for t in tensors.values())
        return Transfer(self._weights.submit(work), self._ready, self, nbytes, "weights")

    def upload_async(self, tensor: torch.Tensor, category: str = "activations") -> Transfer:
        """Upload one tensor on the activation loader (measured for the job the calling
        thread runs)."""
        owner = self.memory.owner()

        def work() -> Any:
            with self.watching(owner):
                copy = self._copy_in(tensor, category, self._activation_stream())
            return copy, self._record(self._activation_stream())
        return Transfer(self._activations.submit(work), self._ready, self, _nbytes(tensor),
                        category)

    def download(self, tensor: torch.Tensor, category: str = "activations",
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Start copying a device tensor to host memory (into ``out`` when it has the same
        shape and dtype) and return the host tensor, which must not be read before a later
        :meth:`after_downloads` future completes.  Call on the controller thread."""
        raise NotImplementedError

    def after_downloads(self) -> Future:
        """A future that completes once every download started so far on the controller
        thread has landed (with the error of one that failed)."""
        return self._downloads.submit(self._land_downloads, self._download_fence())

    def wait_downloads(self) -> None:
        """Block until the downloads started so far have landed."""
        self.after_downloads().result()

    def _land_downloads(self, fence: Any) -> None:
        self._wait_fence(fence)
        with self._lock:
            error = self._download_errors[0] if self._download_errors else None
        if error is not None:  # sticky until the next call: its host values are unfilled
            raise error

    def mark(self) -> Any:
        """A point in this device's compute, for timing (on the controller thread)."""
        return time.perf_counter()

    def seconds_between(self, start: Any, end: Any) -> float:
        """Compute time between two marks (once the work between them is done)."""
        return end - start

    # --- hooks for subclasses ------------------------------------------------------------
    def _download_fence(self) -> Any:
        """Mark the downloads issued so far (on the controller thread)."""
        return None

    def _wait_fence(self, fence: Any) -> None:
        """Wait, on the waiter thread, until the downloads before ``fence`` are done."""

    def _copy_in(self, tensor: torch.Tensor, category: str, stream: Any) -> torch.Tensor:
        raise NotImplementedError

    def _weight_stream(self) -> Any:
        return None

    def _activation_stream(self) -> Any:
        return None

    def _record(self, stream: Any) -> Any:
        return None

    def _ready(self, value: Any) -> Any:
        """Make the copy usable by the controller thread's compute; returns the copies."""
        copies, _event = value
        return copies

    def close(self) -> None:
        for pool in (self._controller, self._weights, self._activations, self._downloads):
            pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def _fits(out: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    """Whether a reused download buffer receives ``tensor`` with its layout."""
    return (out is not None and out.shape == tensor.shape and out.dtype == tensor.dtype
            and out.stride() == tensor.stride())


class VirtualCPUDevice(Device):
    """A CPU "device" with its own threads and its own copies of uploaded tensors."""

    kind = "cpu"

    def __init__(self, index: int, capacity_bytes: int | None = None) -> None:
        super().__init__(f"cpu:{index}", torch.device("cpu"), capacity_bytes)

    def _copy_in(self, tensor: torch.Tensor, category: str, stream: Any) -> torch.Tensor:
        nbytes = _nbytes(tensor)
        self._account_upload(nbytes, category)
        try:
            return tensor.detach().clone()  # keeps a dense tensor's strides
        except BaseException:
            self.release(nbytes, category)  # the copy never existed
            raise

    def download(self, tensor: torch.Tensor, category: str = "activations",
                 out: torch.Tensor | None = None) -> torch.Tensor:
        tensor = dense(tensor.detach())
        if not _fits(out, tensor):
            with self.memory.host():
                out = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        self._account_download(_nbytes(out), category)
        if self.measure_memory:
            # The source is read now, into a host copy the waiter fills ``out`` from: a
            # pending copy holding the device tensor would count it as this device's
            # memory for as long as the waiter thread lags (on a loaded host, a microbatch
            # or more), where a GPU's copy engine frees it right after the kernels that
            # made it (and the ledger on CUDA sees its Python reference go at once).
            with self.memory.host():
                tensor = tensor.clone()
        # Copied on the waiter thread, like a copy on a CUDA download stream: the host
        # tensor is filled only once an after_downloads() future issued after it completes.
        self._downloads.submit(self._fill, out, tensor)
        return out

    def _fill(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        try:
            out.copy_(tensor)
        except BaseException as e:  # noqa: BLE001 - reported by the next after_downloads
            with self._lock:
                self._download_errors.append(e)


class CUDADevice(Device):  # pragma: no cover - needs a GPU
    """A CUDA device (CUDA-only code is kept here).

    Weight and activation uploads run on two streams of their own, from pinned host memory
    when the source is pinned; compute runs on a fourth stream, current on the controller
    thread, and waits on each copy's event.  Large weight copies are split so activation copies can
    slot in between them.
    """

    kind = "cuda"
    #: weight copies larger than this are issued in chunks of this size
    chunk_bytes = 64 * 2**20

    def __init__(self, index: int, share: int = 0, shares: int = 1) -> None:
        # ``shares`` > 1: one of several logical devices on one GPU (``["cuda:0"] * 2``),
        # each with its own threads and streams; the only way to run the multi-device
        # schedule on real hardware with one GPU.  They split its free memory evenly.
        name = f"cuda:{index}" if shares == 1 else f"cuda:{index}#{share}"
        super().__init__(name, torch.device("cuda", index), None)
        self.index = index
        self.shares = shares
        self._streams = {
            "compute": torch.cuda.Stream(self.torch_device),
            "weights": torch.cuda.Stream(self.torch_device),
            "activations": torch.cuda.Stream(self.torch_device),
            "download": torch.cuda.Stream(self.torch_device),
        }
        for pool in (self._controller, self._weights, self._activations, self._downloads):
            pool.submit(torch.cuda.set_device, index).result()
        # Compute runs on a stream of its own, so that work the caller queues on the
        # default stream (and its implicit synchronisation) stays out of the pipeline.
        self._controller.submit(torch.cuda.set_stream, self._streams["compute"]).result()

    def free_bytes(self) -> int | None:
        """What this process can still allocate here: the driver's free memory plus what
        the caching allocator holds unused, within ``set_per_process_memory_fraction``
        (which the driver's count does not see)."""
        free, total = torch.cuda.mem_get_info(self.torch_device)
        allocated = torch.cuda.memory_allocated(self.torch_device)
        cached = torch.cuda.memory_reserved(self.torch_device) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch>=2.6
        limit = (fraction(self.torch_device) if fraction is not None else 1.0) * total
        return max(0, int(min(free + cached, limit - allocated))) // self.shares

    def reset_counters(self) -> None:
        super().reset_counters()
        # The allocator's peak is per GPU: restart it, and report it over what is
        # allocated now (the caller's own tensors are not the pipeline's).
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        self._allocated_at_start = torch.cuda.memory_allocated(self.torch_device)

    def _peak_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.torch_device) - self._allocated_at_start

    def _weight_stream(self) -> Any:
        return self._streams["weights"]

    def _activation_stream(self) -> Any:
        return self._streams["activations"]

    def _copy_in(self, tensor: torch.Tensor, category: str, stream: Any) -> torch.Tensor:
        nbytes = _nbytes(tensor)
        self._account_upload(nbytes, category)
        try:
            return self._cuda_copy(tensor.detach(), category, stream)
        except BaseException:
            self.release(nbytes, category)  # the copy never existed
            raise

    def _cuda_copy(self, src: torch.Tensor, category: str, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            dst = torch.empty_strided(src.shape, copy_strides(src), dtype=src.dtype,
                                      device=self.torch_device)
            step = max(1, self.chunk_bytes // max(1, src.element_size()))
            if category == "weights" and src.numel() > step and src.is_contiguous():
                flat_src, flat_dst = src.view(-1), dst.view(-1)
                for start in range(0, flat_src.numel(), step):
                    flat_dst[start:start + step].copy_(flat_src[start:start + step],
                                                       non_blocking=True)
            else:
                dst.copy_(src, non_blocking=True)
        return dst

    def _record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _ready(self, value: Any) -> Any:
        copies, event = value
        current = torch.cuda.current_stream(self.torch_device)
        current.wait_event(event)
        tensors = copies.values() if isinstance(copies, dict) else [copies]
        for t in tensors:
            t.record_stream(current)  # the caching allocator must not reuse it early
        return copies

    def download(self, tensor: torch.Tensor, category: str = "activations",
                 out: torch.Tensor | None = None) -> torch.Tensor:
        tensor = dense(tensor.detach())
        stream = self._streams["download"]
        stream.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(stream):
            if not _fits(out, tensor):
                out = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                          pin_memory=True)
            out.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # not reused by compute before the copy is done
        self._account_download(_nbytes(out), category)
        return out

    def mark(self) -> Any:
        # GPU time, not launch time: the controller runs ahead of the kernels it queues.
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current (compute) stream
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def _download_fence(self) -> Any:
        # A blocking-sync event: the waiter sleeps instead of spinning on a core the
        # optimizer thread wants.
        event = torch.cuda.Event(blocking=True)
        event.record(self._streams["download"])
        return event

    def _wait_fence(self, fence: Any) -> None:
        fence.synchronize()  # on the waiter thread: the controller keeps launching work


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_bytes(value: int | str | None) -> int | None:
    """``64MiB`` -> 67108864; ints pass through; None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"cannot read {value!r} as a size; write e.g. 512MiB, 2GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[unit])


def _cuda_index(spec: str | torch.device) -> int | None:
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        return None
    return (dev.index or 0) if dev.type == "cuda" else None


def resolve_devices(devices: Sequence[str | torch.device] | None,
                    device_memory: int | str | None = None,
                    measure_memory: bool | None = None) -> list[Device]:
    """Build the device pool.

    ``None`` means ``ROUNDPIPE_DEVICES`` (e.g. ``cpu,cpu,cpu,cpu``) if set, else every
    visible CUDA device (``CUDA_VISIBLE_DEVICES`` is honoured by CUDA itself), else one
    virtual CPU device.  ``device_memory`` (or ``ROUNDPIPE_VIRTUAL_MEMORY``) gives virtual
    CPU devices a capacity.  ``measure_memory`` (default: ``ROUNDPIPE_MEASURE_MEMORY=1``)
    measures the tensors each device holds (``DeviceCounters.peak_allocated_bytes`` on
    virtual devices, ``RunStats.stage_peak_bytes`` on all).
    """
    source = "devices"
    if devices is None:
        env = os.environ.get("ROUNDPIPE_DEVICES", "").strip()
        if env:
            devices = [d.strip() for d in env.split(",") if d.strip()]
            source = f"ROUNDPIPE_DEVICES={env!r}"
        elif torch.cuda.is_available():  # pragma: no cover - GPU
            devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        else:
            devices = ["cpu"]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    if len(devices) == 0:
        raise ConfigError("devices is empty; pass at least one device, e.g. devices=['cpu']")
    capacity = parse_bytes(device_memory if device_memory is not None
                           else os.environ.get("ROUNDPIPE_VIRTUAL_MEMORY") or None)
    pool: list[Device] = []
    cpu_count = 0
    cuda_indices = [_cuda_index(spec) for spec in devices]
    for spec in devices:
        try:
            dev = torch.device(spec)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"{spec!r} (from {source}) is not a device: {e}") from None
        if dev.type == "cpu":
            pool.append(VirtualCPUDevice(cpu_count, capacity))
            cpu_count += 1
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                why = ("a CPU-only build" if torch.version.cuda is None
                       else "no GPU is visible")
                raise ConfigError(
                    f"device {spec!r} (from {source}) was asked for, but this PyTorch sees "
                    f"no CUDA device ({why}); without a GPU, use virtual CPU devices: "
                    f"devices=['cpu'] * {len(devices)} (or ROUNDPIPE_DEVICES="
                    f"{','.join(['cpu'] * len(devices))})")
            index = dev.index if dev.index is not None else 0  # pragma: no cover - GPU
            if index >= torch.cuda.device_count():
                raise ConfigError(
                    f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA "
                    "device(s) are visible")
            shares = cuda_indices.count(index)
            share = cuda_indices[:len(pool)].count(index)
            pool.append(CUDADevice(index, share, shares))
        else:
            raise ConfigError(f"device type {dev.type!r} is not supported; use 'cpu' or 'cuda'")
    kinds = {d.kind for d in pool}
    if len(kinds) > 1:
        raise ConfigError(f"mixing device kinds {sorted(kinds)} is not supported")
    if measure_memory is None:
        measure_memory = os.environ.get("ROUNDPIPE_MEASURE_MEMORY", "").strip().lower() in (
            "1", "true", "on", "yes")
    for device in pool:
        device.measure_memory = bool(measure_memory)
    return pool
