"""Devices: stateless workers that receive uploads, run stage jobs and return downloads.

Each device owns one worker thread; jobs submitted to it run in submission order.  The
scheduler only uses this interface, so CUDA specifics (streams, pinned memory, prefetch)
live in :class:`CUDADevice` and nowhere else.

A :class:`VirtualCPUDevice` makes a real copy of everything uploaded to it, so a test on a
machine with no GPU exercises the transfers, the bookkeeping and aliasing bugs exactly as
a GPU run would.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceCounters:
    """Transfer and memory counters of one device over one call."""

    name: str
    bytes_uploaded: int
    bytes_downloaded: int
    peak_resident_bytes: int


class Device:
    """A worker device.  Subclasses implement the copies; accounting is shared."""

    kind = "abstract"

    def __init__(self, name: str, torch_device: torch.device) -> None:
        self.name = name
        self.torch_device = torch_device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"roundpipe-{name}")
        self._lock = threading.Lock()
        self.reset_counters()

    # --- accounting ----------------------------------------------------------------------
    def reset_counters(self) -> None:
        with self._lock:
            self._up = 0
            self._down = 0
            self._resident = 0
            self._peak = 0

    def counters(self) -> DeviceCounters:
        with self._lock:
            return DeviceCounters(self.name, self._up, self._down, self._peak)

    def _account_upload(self, nbytes: int) -> None:
        with self._lock:
            self._up += nbytes
            self._resident += nbytes
            self._peak = max(self._peak, self._resident)

    def _account_download(self, nbytes: int) -> None:
        with self._lock:
            self._down += nbytes

    def release(self, nbytes: int) -> None:
        """Mark ``nbytes`` of uploaded data as freed."""
        with self._lock:
            self._resident -= nbytes

    # --- work ----------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on this device's worker thread."""
        return self._executor.submit(fn, *args)

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy a host tensor to the device (called on the worker thread)."""
        raise NotImplementedError

    def download(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy a device tensor to host memory (called on the worker thread)."""
        raise NotImplementedError

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class VirtualCPUDevice(Device):
    """A CPU "device" with its own thread and its own copies of uploaded tensors."""

    kind = "cpu"

    def __init__(self, index: int) -> None:
        super().__init__(f"cpu:{index}", torch.device("cpu"))

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.detach().clone(memory_format=torch.contiguous_format)
        self._account_upload(_nbytes(copy))
        return copy

    def download(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.detach().clone(memory_format=torch.contiguous_format)
        self._account_download(_nbytes(copy))
        return copy


class CUDADevice(Device):  # pragma: no cover - needs a GPU
    """A CUDA device (CUDA-only).  Streams and pinned buffers arrive with the streaming
    runtime; this version copies synchronously on the worker thread."""

    kind = "cuda"

    def __init__(self, index: int) -> None:
        super().__init__(f"cuda:{index}", torch.device("cuda", index))
        self.submit(torch.cuda.set_device, index).result()

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.detach().to(self.torch_device, non_blocking=False, copy=True)
        self._account_upload(_nbytes(copy))
        return copy

    def download(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.detach().to("cpu", copy=True)
        self._account_download(_nbytes(copy))
        return copy


def resolve_devices(devices: Sequence[str | torch.device] | None) -> list[Device]:
    """Build the device pool.

    ``None`` means ``ROUNDPIPE_DEVICES`` (e.g. ``cpu,cpu,cpu,cpu``) if set, else every
    visible CUDA device (``CUDA_VISIBLE_DEVICES`` is honoured by CUDA itself), else one
    virtual CPU device.
    """
    if devices is None:
        env = os.environ.get("ROUNDPIPE_DEVICES", "").strip()
        if env:
            devices = [d.strip() for d in env.split(",") if d.strip()]
        elif torch.cuda.is_available():  # pragma: no cover - GPU
            devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        else:
            devices = ["cpu"]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    if len(devices) == 0:
        raise ConfigError("devices is empty; pass at least one device, e.g. devices=['cpu']")
    pool: list[Device] = []
    cpu_count = 0
    for spec in devices:
        try:
            dev = torch.device(spec)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"{spec!r} is not a device: {e}") from None
        if dev.type == "cpu":
            pool.append(VirtualCPUDevice(cpu_count))
            cpu_count += 1
        elif dev.type == "cuda":  # pragma: no cover - GPU
            if not torch.cuda.is_available():
                raise ConfigError(f"device {spec!r} requested but CUDA is not available")
            index = dev.index if dev.index is not None else 0
            if index >= torch.cuda.device_count():
                raise ConfigError(
                    f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA "
                    "device(s) are visible")
            pool.append(CUDADevice(index))
        else:
            raise ConfigError(f"device type {dev.type!r} is not supported; use 'cpu' or 'cuda'")
    kinds = {d.kind for d in pool}
    if len(kinds) > 1:
        raise ConfigError(f"mixing device kinds {sorted(kinds)} is not supported")
    return pool
