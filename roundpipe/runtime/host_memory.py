"""What roundpipe holds in host memory, by category (``RoundPipe.host_memory()``).

Every category is a set of tensors; what is counted is their *storages*, each once: a
storage reachable from several categories (a tied weight, a master that is the
parameter itself when ``optim_dtype=None``, a converted gradient that became a master's
``.grad``) counts in the first category that reaches it, in the order of
:data:`CATEGORIES`.  A view counts its whole storage, since the storage is what stays
allocated.  Virtual CPU devices' copies are reported per device, apart from the total:
they exist during calls only (between calls a device holds nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from tabulate import tabulate

from ..errors import ConfigError

#: Categories in the order they claim shared storages.
CATEGORIES = ("weights", "masters", "prediction", "gradients", "optimizer_state", "landing",
              "constants", "staging")


@dataclass(frozen=True)
class DeviceCopies:
    """Host bytes a virtual CPU device holds as its own copies of what was uploaded."""

    name: str
    resident_bytes: int        # now (0 between calls)
    peak_bytes_last_call: int  # the most at once during the last call


@dataclass(frozen=True)
class HostMemory:
    """Bytes roundpipe holds in host memory, each storage counted once.

    Attributes:
        weights: the model's parameters and buffers (what uploads read).
        masters: the full-precision copies the optimizer updates (``optim_dtype``); 0
            when the masters are the parameters themselves.
        prediction: the masters kept from the last step's start to predict the weights
            of asynchronous steps (``predict_weights``): one more copy of the masters
            once an asynchronous step (or the last ``async_after`` exact one) ran, else 0.
        gradients: the masters' ``.grad`` (the parameters' without masters).
        optimizer_state: the state tensors of the optimizer passed to
            ``host_memory(optimizer)`` (moments, step counts); 0 without one.
        landing: gradient download buffers, and converted gradients kept for refilling
            that no ``.grad`` holds now.  After ``forward_backward(..., step=opt)``
            stepped as gradients landed: the pool of at most two units' buffers.
        constants: tensors the traced programs carry (made at trace time).
        pinned: of all the above, the bytes in page-locked memory (CUDA only).
        trainable_params: the number of elements of the trainable parameters.
        devices: the virtual CPU devices' own copies, apart from the total.
        disk_masters: with the disk tier (``offload_dir``), bytes of the masters' files
            (two slots per master: the committed step and the one being written); the
            masters then take no host memory between steps.
        disk_optimizer_state: the same for the optimizer's state (moments).
        staging: with the disk tier, the staging buffers it keeps for reuse between
            steps (``runtime/offload.py``'s ``StagingPool``: at most the peak of its
            window, a few units of masters and state); during a step the buffers in use
            count as the masters and state staged in them.
        landing_peak: the most bytes the gradient download buffers held at once since
            the last ``forward_backward`` began (not a category: a peak, not a holding).
            The whole model's gradients in the model's dtype when the step follows the
            call; a window of units when ``forward_backward(..., step=opt)`` stepped as
            they landed.
    """

    weights: int
    masters: int
    prediction: int
    gradients: int
    optimizer_state: int
    landing: int
    constants: int
    pinned: int
    trainable_params: int
    devices: tuple[DeviceCopies, ...] = ()
    disk_masters: int = 0
    disk_optimizer_state: int = 0
    staging: int = 0
    landing_peak: int = 0

    @property
    def disk_total(self) -> int:
        """Bytes on disk (the disk tier's files), not part of :attr:`total`."""
        return self.disk_masters + self.disk_optimizer_state

    @property
    def total(self) -> int:
        """Bytes of every category (the virtual devices' copies not included)."""
        return sum(getattr(self, c) for c in CATEGORIES)

    def bytes_per_param(self, category: str | None = None) -> float:
        """Bytes per trainable parameter of ``category``, or of everything beyond the
        model's own weights (``None``): the cost of training it on top of holding it."""
        if self.trainable_params == 0:
            return 0.0
        if category is None:
            return (self.total - self.weights) / self.trainable_params
        if category not in CATEGORIES:
            raise ConfigError(f"host memory has no category {category!r}; the categories "
                              f"are {', '.join(CATEGORIES)}, or None for all beyond weights")
        return getattr(self, category) / self.trainable_params

    def __str__(self) -> str:
        rows = [[c, f"{getattr(self, c) / 2**20:,.1f}", f"{self.bytes_per_param(c):.2f}"]
                for c in CATEGORIES]
        rows.append(["total", f"{self.total / 2**20:,.1f}",
                     f"{self.total / max(self.trainable_params, 1):.2f}"])
        text = tabulate(rows, headers=["host memory", "MiB", "B/trainable param"])
        text += (f"\n{self.bytes_per_param():.2f} B per trainable parameter beyond the "
                 f"weights; {self.pinned / 2**20:,.1f} MiB pinned")
        if self.landing_peak:
            text += (f"\ngradient landing at its peak in the last call: "
                     f"{self.landing_peak / 2**20:,.1f} MiB")
        if self.disk_total:
            n = max(self.trainable_params, 1)
            text += (f"\non disk (offload_dir): masters {self.disk_masters / 2**20:,.1f} "
                     f"MiB ({self.disk_masters / n:.2f} B/param), optimizer state "
                     f"{self.disk_optimizer_state / 2**20:,.1f} MiB "
                     f"({self.disk_optimizer_state / n:.2f} B/param), two slots each")
        for d in self.devices:
            text += (f"\nvirtual device {d.name}: {d.resident_bytes / 2**20:,.1f} MiB now, "
                     f"{d.peak_bytes_last_call / 2**20:,.1f} MiB at the peak of the last call")
        return text


def count_storages(categories: Mapping[str, Iterable[torch.Tensor]]
                   ) -> tuple[dict[str, int], int]:
    """Bytes of unique host storages per category (in the mapping's order: the first
    category to reach a storage gets it), and the bytes of those that are pinned."""
    seen: set[int] = set()
    sizes: dict[str, int] = {}
    pinned = 0
    # Only CUDA pins memory; asking an uninitialised CUDA would start it.
    can_pin = torch.cuda.is_available() and torch.cuda.is_initialized()
    for category, tensors in categories.items():
        total = 0
        for t in tensors:
            if t is None or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in seen:  # 0: an empty storage
                continue
            seen.add(key)
            total += storage.nbytes()
            if can_pin and t.is_pinned():
                pinned += storage.nbytes()
        sizes[category] = total
    return sizes, pinned


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors of an optimizer's per-parameter state (not the parameters)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def host_memory(weights: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                prediction: Sequence[torch.Tensor],
                gradients: Sequence[torch.Tensor | None],
                optimizer: torch.optim.Optimizer | None,
                landing: Sequence[torch.Tensor], constants: Sequence[torch.Tensor],
                trainable_params: int, devices: Sequence[DeviceCopies] = (),
                disk_masters: int = 0, disk_optimizer_state: int = 0,
                staging: Sequence[torch.Tensor] = (),
                landing_peak: int = 0) -> HostMemory:
    sizes, pinned = count_storages({
        "weights": weights, "masters": masters, "prediction": prediction,
        "gradients": [g for g in gradients if g is not None],
        "optimizer_state": optimizer_tensors(optimizer),
        "landing": landing, "constants": constants, "staging": staging})
    return HostMemory(**sizes, pinned=pinned, trainable_params=trainable_params,
                      devices=tuple(devices), disk_masters=disk_masters,
                      disk_optimizer_state=disk_optimizer_state,
                      landing_peak=landing_peak)
