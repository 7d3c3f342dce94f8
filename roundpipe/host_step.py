"""How long the host's share of a training step takes, estimated from bytes moved.

Per step the host converts the landed gradients (or reads them where they landed), runs
the optimizer's update and publishes the new weights: memory-bound passes whose bytes per
parameter depend on the optimizer and the dtypes.  Divided by the host's memory bandwidth
(a STREAM-triad probe, measured once per process) and multiplied by the trainable
parameters, that is the time the asynchronous step needs; when it exceeds the devices'
time per step, the host is the bottleneck and more tokens per step would hide it.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from typing import Any

import torch

from .plan import HostStepEstimate

log = logging.getLogger(__name__)

#: elements per array of the bandwidth probe: 3 x 64 MiB, beyond any cache
_PROBE_ELEMENTS = 1 << 24


@functools.lru_cache(maxsize=1)
def host_bandwidth() -> float:
    """The host's memory bandwidth in bytes per second: STREAM triad ``a = b + s * c``
    with torch's threads, median of 3 (measured once per process, ~0.1-0.5 s)."""
    a, b, c = (torch.rand(_PROBE_ELEMENTS) for _ in range(3))
    torch.add(b, c, alpha=3.0, out=a)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - t)
    bandwidth = 3 * a.numel() * a.element_size() / statistics.median(times)
    log.info("roundpipe: host memory bandwidth (triad) %.1f GB/s", bandwidth / 1e9)
    return bandwidth


def _states(optimizer: Any) -> tuple[int, str]:
    """(state tensors per parameter, a name) of a torch-style optimizer; None stands
    for torch's AdamW."""
    if optimizer is None:
        return 2, "AdamW"
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        return (1 if group.get("momentum", 0) else 0), name
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return (3 if group.get("amsgrad") else 2), name
    return 2, name + " (taken as 2 state tensors per parameter)"


def bytes_per_param(optimizer: Any, model_bytes: int, master_bytes: int | None,
                    predict: bool = False) -> float:
    """Host bytes read and written per trainable parameter per step.

    ``model_bytes``: the model's element size (2 for bf16); ``master_bytes``: the
    masters' (4 for fp32), None without masters (the optimizer updates the model's
    parameters, nothing is published).  ``predict``: the publish predicts the weights
    (``predict_weights``): it reads the kept masters, then refreshes them from the
    masters (3 master-sized passes more)."""
    # roundpipe.optim's optimizers say so with a class attribute: the core does not
    # import roundpipe.optim (tests/test_layering.py)
    reads_landed = getattr(type(optimizer), "reads_landed_grads", False) is True
    n_states, _ = _states(optimizer)
    master = master_bytes if master_bytes is not None else model_bytes
    one_pass = reads_landed and master_bytes is not None
    state = master
    if reads_landed and getattr(optimizer, "state_dtype", None) is not None:
        state = optimizer.state_dtype.itemsize
    if one_pass:  # the landed gradient is read in the update itself
        landing, grad = 0, model_bytes
    else:  # the landing converts it into a .grad, which the update reads
        landing, grad = model_bytes + master, master
    update = grad + 2 * master + 2 * state * n_states
    publish = master + model_bytes if master_bytes is not None else 0
    if predict and master_bytes is not None:
        publish += 3 * master
    return float(landing + update + publish)


def disk_bytes_per_param(optimizer: Any, master_bytes: int | None,
                         model_bytes: int = 2) -> float:
    """Bytes the disk tier reads and writes per parameter per step: each master and
    each state tensor read once and written once (an exact ``pipe.step(opt)``, which
    publishes the staged masters; a ``step_fn`` re-reads the masters to publish them,
    ``master_bytes`` more).  ``master_bytes`` None: no masters (stochastic rounding),
    the files hold the moments only, in the model's dtype unless a state dtype was
    given."""
    n_states, _ = _states(optimizer)
    if master_bytes is None:
        given = getattr(optimizer, "_state_dtype_given", None)
        state = given.itemsize if isinstance(given, torch.dtype) else model_bytes
        return float(2 * n_states * state)
    state = master_bytes
    if getattr(optimizer, "state_dtype", None) is not None:
        state = optimizer.state_dtype.itemsize
    return float(2 * (master_bytes + n_states * state))


def estimate(optimizer: Any, params: int, model_bytes: int, master_bytes: int | None,
             device_seconds: float, predict: bool = False,
             disk_bandwidth: float | None = None) -> HostStepEstimate:
    """The host step of ``optimizer`` (None: torch's AdamW, assumed) on ``params``
    trainable parameters, beside the devices' ``device_seconds`` per step.
    ``disk_bandwidth``: with the disk tier, the disk's bytes per second (its I/O then
    joins the estimate)."""
    bpp = bytes_per_param(optimizer, model_bytes, master_bytes, predict)
    disk = {}
    if disk_bandwidth:
        dbpp = disk_bytes_per_param(optimizer, master_bytes, model_bytes)
        disk = dict(disk_bytes_per_param=dbpp, disk_bandwidth=disk_bandwidth,
                    disk_seconds=params * dbpp / disk_bandwidth)
    _, name = _states(optimizer)
    if type(optimizer).__module__.startswith("roundpipe.optim"):
        name = f"roundpipe.optim.{name}"
    bandwidth = host_bandwidth()
    return HostStepEstimate(optimizer=name, assumed=optimizer is None, params=params,
                            bytes_per_param=bpp, bandwidth=bandwidth,
                            seconds=params * bpp / bandwidth, device_seconds=device_seconds,
                            **disk)
