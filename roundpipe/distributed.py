"""Training on several machines: one roundpipe process per machine, each a data-parallel
replica (``docs/scaling.md``).

::

    import roundpipe, roundpipe.distributed as rd

    rank, world = rd.init_distributed()         # from torchrun's variables; (0, 1) without
    pipe = roundpipe.RoundPipe(model, optim_dtype=torch.float32)   # data-parallel when world > 1
    opt = rd.zero_optimizer(pipe, torch.optim.AdamW, lr=1e-4)      # optimizer state sharded
    for x, y in shard_of_the_batch:
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))

The same script runs unchanged with ``python train.py`` (one replica, no process group) and
with ``torchrun --nnodes N --nproc_per_node 1 train.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError
from .runtime.data_parallel import (BucketRecord, DataParallelConfig, DataParallelInfo,
                                    DataParallelStats, init_distributed, launched_by_torchrun)

if TYPE_CHECKING:  # pragma: no cover
    from .api import RoundPipe

__all__ = [
    "DataParallelConfig",
    "DataParallelInfo",
    "DataParallelStats",
    "BucketRecord",
    "init_distributed",
    "launched_by_torchrun",
    "zero_optimizer",
    "check_replicas",
]


def zero_optimizer(pipe: RoundPipe, optimizer_class: type[torch.optim.Optimizer],
                   **defaults: Any) -> torch.optim.Optimizer:
    """An optimizer over ``pipe.optim_parameters()`` whose state is sharded across the
    replicas (``torch.distributed.optim.ZeroRedundancyOptimizer``): each replica keeps the
    state of about 1/N of the parameters, steps them, and broadcasts them to the others.

    Use it with ``pipe.step(lambda: (opt.step(), opt.zero_grad()))``, asynchronous or not:
    its collectives run on the optimizer thread, on a process group of their own, so they
    never interleave with the gradient reduction of the next call.  Call it on every
    replica at the same point (creating that group is collective).  Without data
    parallelism it returns a plain ``optimizer_class``, so the script still runs alone.

    Checkpoints: ``opt.consolidate_state_dict(to=0)`` on every replica (after
    ``pipe.synchronize()``), then save ``opt.state_dict()`` on rank 0; every replica loads
    the whole state dict and keeps its shard.
    """
    dp = pipe._dp
    params = pipe.optim_parameters()
    if dp is None:
        return optimizer_class(params, **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class,
                                   process_group=dp.optimizer_group(), **defaults)


def check_replicas(pipe: RoundPipe) -> None:
    """Raise :class:`~roundpipe.DataParallelError` unless every replica holds bitwise the
    same masters, model weights and buffers (waits for a pending step first).  Collective:
    call it on every replica, e.g. after loading a checkpoint or every few thousand steps."""
    dp = pipe._dp
    if dp is None:
        raise ConfigError("check_replicas needs a data-parallel RoundPipe (data_parallel "
                          "on and more than one replica)")
    pipe.synchronize()
    named = [(f"master {n}", t) for n, t in pipe.optim_named_parameters()]
    named += [(n, t) for n, t in pipe.model.state_dict(keep_vars=True).items()
              if isinstance(t, torch.Tensor)]
    dp.check_replicas(named)
