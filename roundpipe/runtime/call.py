"""What both front ends (``RoundPipe`` and the ``torch.compile`` backend) decide per call
before the executor runs: the random-op keys of its microbatches, the caller's autocast
state, and the per-stage memory cap.  Splitting inputs and merging outputs (and their
gradients) live in :mod:`.microbatch`; folding parameter gradients in
:func:`.host_state.fold_unit_grads`."""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops.rng import RngKey
from .devices import Device


def microbatch_keys(seed: int, call: int, num_microbatch: int, *, enabled: bool = True,
                    first: int = 0) -> list[RngKey | None]:
    """The key of each microbatch's random ops in call number ``call``: they depend on
    the seed, the call and the microbatch only, never on the device that runs them, so
    results are bitwise the same on any number of devices.  ``first``: the number of
    this process's first microbatch in the global batch (data parallel replicas)."""
    if not enabled:
        return [None] * num_microbatch
    return [RngKey(seed, call, first + mb) for mb in range(num_microbatch)]


def autocast_state(devices: Sequence[Device]) -> tuple[str, torch.dtype] | None:
    """The caller's autocast state for the devices' type, replayed in worker threads
    (autocast is thread-local, and the stages run on the devices' threads)."""
    kind = devices[0].torch_device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return kind, torch.get_autocast_dtype(kind)


def memory_cap(devices: Sequence[Device], fraction: float) -> int | None:
    """Bytes one stage may use: half of ``fraction`` of the smallest free device memory
    (two stages' weights are resident per device while the next one streams in); None
    where a device cannot say how much is free."""
    free = [d.free_bytes() for d in devices]
    if any(f is None for f in free):
        return None
    return int(min(free) * fraction / 2)  # type: ignore[type-var]
