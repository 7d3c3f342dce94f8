"""One replica of the data-parallel tests (tests/test_data_parallel.py), and the recipes
the single-process references share with it.

Run as ``python tests/dp_worker.py GROUP OUT`` with the variables torchrun sets (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT); it runs the scenarios of GROUP in order and saves
what each produced to OUT (``torch.save``).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402
import roundpipe  # noqa: E402
import roundpipe.distributed as rd  # noqa: E402
from roundpipe import DataParallelConfig, RoundPipe, RoundPipeRunConfig  # noqa: E402

BATCH = 8        # global batch; each of the 2 replicas gets 4 rows
STEPS = 3
SEED = 1234      # dropout streams


def build_model(init_seed: int = 0) -> torch.nn.Module:
    """The zoo's GPT: tied embeddings (a parameter read by two units), an attention-mask
    keyword, dropout."""
    torch.manual_seed(init_seed)
    return models.GPT(layers=4, dropout=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 64, (BATCH, 8), generator=g)
    mask = torch.ones(BATCH, 8)
    mask[step % BATCH, -2:] = 0
    label = torch.randint(0, 64, (BATCH, 8), generator=g)
    return idx, mask, label


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def scaled_lm_loss(scale: float) -> Callable[[Any, Any], torch.Tensor]:
    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        loss = models.lm_loss(out, y)
        return loss * scale if scale != 1.0 else loss
    return loss_fn


def make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    # eps well above rounding noise: attention's key bias gets a gradient of pure noise
    # (softmax ignores a shift shared by all keys), which Adam with a tiny eps would turn
    # into full-size steps of random sign, so sums in another order could not even agree
    # to tolerance.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)


def train(pipe: RoundPipe, opt: torch.optim.Optimizer, steps: Sequence[int], rank: int,
          world: int, loss_fn: Callable, is_async: bool = False) -> list[float]:
    losses = []
    for step in steps:
        idx, mask, label = (shard(t, rank, world) for t in batch(step))
        loss = pipe.forward_backward(input_args=(idx,), input_kwargs={"attention_mask": mask},
                                     label=label, loss_fn=loss_fn)
        losses.append(loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
    pipe.synchronize()
    return losses


def train_autograd(pipe: RoundPipe, opt: torch.optim.Optimizer, rank: int, world: int,
                   scale: float) -> list[float]:
    """pipe(x) and loss.backward() instead of forward_backward."""
    losses = []
    for step in range(STEPS):
        idx, mask, label = (shard(t, rank, world) for t in batch(step))
        loss = models.lm_loss(pipe(idx, attention_mask=mask), label) * scale
        loss.backward()
        losses.append(loss.detach())
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    return losses


def reference_autograd() -> dict[str, torch.Tensor]:
    """One process: the loss of the whole batch, doubled (each of the two replicas'
    losses is the mean over half the batch, and their gradients are summed)."""
    pipe = RoundPipe(build_model(), devices=["cpu"] * 4, seed=SEED, data_parallel=False,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = make_optimizer("sgd", pipe.optim_parameters())
    train_autograd(pipe, opt, 0, 1, 2.0)
    sd = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return sd


def reference(opt_kind: str, num_microbatch: int, loss_scale: float = 1.0,
              is_async: bool = False, steps: Sequence[int] | None = None
              ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One process, four virtual devices, the whole batch."""
    pipe = RoundPipe(build_model(), devices=["cpu"] * 4, seed=SEED, data_parallel=False,
                     model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch))
    opt = make_optimizer(opt_kind, pipe.optim_parameters())
    losses = train(pipe, opt, steps or list(range(STEPS)), 0, 1,
                   scaled_lm_loss(loss_scale), is_async)
    sd = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return losses, sd


# --- scenarios (each rank runs the same ones, in the same order) --------------------------

def replica(rank: int, num_microbatch: int, **config: Any) -> RoundPipe:
    # Rank 1 initialises differently: broadcast_init must give it rank 0's weights.
    return RoundPipe(build_model(init_seed=rank), devices=["cpu"] * 2, seed=SEED + rank,
                     model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch),
                     data_parallel=DataParallelConfig(**config))


def state(pipe: RoundPipe) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def sgd_sum(rank: int, world: int) -> dict[str, Any]:
    """Summed gradients, one microbatch per replica, small buckets."""
    pipe = replica(rank, 1, reduction="sum", bucket_bytes="16KiB")
    opt = make_optimizer("sgd", pipe.optim_parameters())
    losses = train(pipe, opt, list(range(STEPS)), rank, world, models.lm_loss)
    dp = pipe.stats().data_parallel
    rd.check_replicas(pipe)
    out = {"losses": losses, "state": state(pipe), "buckets": len(dp.buckets),
           "bytes": dp.bytes_reduced, "info": pipe.data_parallel,
           # buckets whose all-reduce started before the last backward job had finished
           "early": sum(b.issued_s < dp.grads_ready_s for b in dp.buckets),
           "units": [b.units for b in dp.buckets]}
    pipe.close()
    return out


def adamw_mean(rank: int, world: int) -> dict[str, Any]:
    """Averaged gradients, two microbatches per replica (four in all)."""
    pipe = replica(rank, 2, reduction="mean", bucket_bytes="64KiB")
    opt = make_optimizer("adamw", pipe.optim_parameters())
    losses = train(pipe, opt, list(range(STEPS)), rank, world, models.lm_loss)
    out = {"losses": losses, "state": state(pipe)}
    pipe.close()
    return out


def adamw_async(rank: int, world: int) -> dict[str, Any]:
    """Averaged gradients under the asynchronous (one step delayed) schedule."""
    pipe = replica(rank, 1, reduction="mean", bucket_bytes="16KiB")
    opt = make_optimizer("adamw", pipe.optim_parameters())
    losses = train(pipe, opt, list(range(STEPS)), rank, world, models.lm_loss, is_async=True)
    out = {"losses": losses, "state": state(pipe)}
    pipe.close()
    return out


def autograd_backward(rank: int, world: int) -> dict[str, Any]:
    """loss.backward() through pipe(x) reduces across replicas as forward_backward does."""
    pipe = replica(rank, 1, reduction="sum", bucket_bytes="16KiB")
    opt = make_optimizer("sgd", pipe.optim_parameters())
    train_autograd(pipe, opt, rank, world, 1.0)
    out = {"state": state(pipe), "buckets": len(pipe.stats().data_parallel.buckets)}
    pipe.close()
    return out


def batchnorm_buffers(rank: int, world: int) -> dict[str, Any]:
    """BatchNorm statistics, updated by each replica from its own shard, are rank 0's on
    every replica after each call."""
    torch.manual_seed(rank)
    model = models.BNNet()
    pipe = RoundPipe(model, devices=["cpu"] * 2, data_parallel=DataParallelConfig(),
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = make_optimizer("sgd", pipe.optim_parameters())
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 2, generator=g)
        pipe.forward_backward(shard(x, rank, world), label=shard(y, rank, world),
                              loss_fn=torch.nn.functional.mse_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    rd.check_replicas(pipe)
    out = {"state": state(pipe)}
    pipe.close()
    return out


def zero_checkpoint(rank: int, world: int, path: str) -> dict[str, Any]:
    """ZeroRedundancyOptimizer through pipe.step (asynchronous), a checkpoint saved by
    rank 0 after step 2 and loaded by every replica into a fresh pipe for step 3."""
    import torch.distributed as dist
    pipe = replica(rank, 1, reduction="mean", bucket_bytes="16KiB")
    opt = rd.zero_optimizer(pipe, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-3)
    train(pipe, opt, [0, 1], rank, world, models.lm_loss, is_async=True)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.optim.state.values()
                      for t in s.values() if isinstance(t, torch.Tensor))
    opt.consolidate_state_dict(to=0)  # collective, after the pipe synchronised
    if rank == 0:
        roundpipe.save_checkpoint(path, pipe, opt)
    dist.barrier()
    pipe.close()
    pipe = replica(rank, 1, reduction="mean", bucket_bytes="16KiB")
    opt = rd.zero_optimizer(pipe, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-3)
    roundpipe.load_checkpoint(path, pipe, opt)
    rd.check_replicas(pipe)
    losses = train(pipe, opt, [2], rank, world, models.lm_loss, is_async=True)
    out = {"losses": losses, "state": state(pipe), "state_bytes": state_bytes}
    pipe.close()
    return out


def sharded_checkpoint(rank: int, world: int, path: str) -> dict[str, Any]:
    """ZeroRedundancyOptimizer, summed gradients (= one process with 2 microbatches): an
    asynchronous, capped sharded checkpoint after step 2, each replica writing its own shard; the
    test loads it into one process (2 -> 1 replicas) for step 3."""
    pipe = replica(rank, 1, reduction="sum", bucket_bytes="16KiB")
    opt = rd.zero_optimizer(pipe, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-3)
    train(pipe, opt, [0, 1], rank, world, models.lm_loss, is_async=True)
    # Capped: most of the state is copied late, while the optimizer thread (and ZeRO's
    # collectives on it) waits for the writer.
    future = roundpipe.save_checkpoint(path, pipe, opt, extra={"step": 2}, sharded=True,
                                       asynchronous=True, max_snapshot_bytes=64 * 1024)
    losses = train(pipe, opt, [2], rank, world, models.lm_loss, is_async=True)  # overlaps
    future.result(timeout=120)
    out = {"losses": losses, "state": state(pipe), "path": path,
           "files": sorted(os.listdir(path)), "held": future.held_bytes}
    pipe.close()
    return out


class Injected(RuntimeError):
    pass


def subgroup_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """A data-parallel group of rank 0 alone, a subgroup of the world: its sharded save
    (and ZeRO's optimizer group) are made by rank 0 only, while rank 1 waits at a barrier.
    They were made with a barrier over the whole world, which waited for rank 1 until the
    group's timeout."""
    import torch.distributed as dist
    sub = dist.new_group(ranks=[0], backend="gloo")  # every rank makes it: torch's rule
    out: dict[str, Any] = {}
    if rank == 0:
        pipe = RoundPipe(build_model(), devices=["cpu"] * 2, seed=SEED,
                         model_run_config=RoundPipeRunConfig(num_microbatch=2),
                         data_parallel=DataParallelConfig(group=sub, timeout_s=20))
        opt = rd.zero_optimizer(pipe, torch.optim.AdamW, lr=1e-2, eps=1e-3)
        train(pipe, opt, [0, 1], 0, 1, models.lm_loss)
        t0 = time.perf_counter()
        roundpipe.save_checkpoint(path, pipe, opt, extra={"step": 2}, sharded=True)
        out = {"elapsed": time.perf_counter() - t0, "path": path, "state": state(pipe)}
        pipe.close()
    dist.barrier()
    return out


def failed_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """Rank 0 cannot write roundpipe.pt (a full disk) during a sharded save: every replica
    raises at once (not after the group's timeout), and a second save succeeds."""
    import roundpipe.checkpoint.sharded as cs
    pipe = replica(rank, 1, reduction="sum", bucket_bytes="16KiB", timeout_s=20)
    opt = make_optimizer("adamw", pipe.optim_parameters())
    train(pipe, opt, [0], rank, world, models.lm_loss, is_async=True)
    real = cs.write_atomically
    if rank == 0:
        def full_disk(*args: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device")
        cs.write_atomically = full_disk
    t0 = time.perf_counter()
    try:
        roundpipe.save_checkpoint(path, pipe, opt, sharded=True)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = (type(e).__name__, str(e))
    elapsed = time.perf_counter() - t0
    cs.write_atomically = real
    exists = os.path.exists(path)
    roundpipe.save_checkpoint(path, pipe, opt, sharded=True)
    out = {"error": error, "elapsed": elapsed, "existed": exists,
           "files": sorted(os.listdir(os.path.dirname(path)))}
    pipe.close()
    return out


def replica_failure(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's loss_fn raises in step 2: both replicas raise, neither commits, both go
    on with step 3."""
    pipe = replica(rank, 1, reduction="sum", bucket_bytes="16KiB", timeout_s=30)
    opt = make_optimizer("sgd", pipe.optim_parameters())
    errors: list[tuple[str, str, Any]] = []

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        if fail_now and rank == 1:
            raise Injected("injected failure in loss_fn")
        return models.lm_loss(out, y)

    for step in range(STEPS):
        fail_now = step == 1
        idx, mask, label = (shard(t, rank, world) for t in batch(step))
        t0 = time.perf_counter()
        try:
            pipe.forward_backward(input_args=(idx,), input_kwargs={"attention_mask": mask},
                                  label=label, loss_fn=loss_fn)
        except roundpipe.RoundPipeError as e:
            errors.append((type(e).__name__, "\n".join([str(e)] + getattr(e, "__notes__", [])),
                           getattr(e, "ranks", None)))
            errors.append(("elapsed", f"{time.perf_counter() - t0:.3f}", None))
            continue
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    rd.check_replicas(pipe)
    out = {"errors": errors, "state": state(pipe)}
    pipe.close()
    return out


def hung_replica(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 raises in its own code before step 2 and stops taking part (without exiting):
    rank 0 must get a DataParallelError within the timeout, not hang."""
    timeout = 3.0
    pipe = replica(rank, 1, reduction="sum", timeout_s=timeout)
    opt = make_optimizer("sgd", pipe.optim_parameters())
    train(pipe, opt, [0], rank, world, models.lm_loss)
    out: dict[str, Any] = {"timeout": timeout}
    if rank == 1:
        try:
            raise Injected("rank 1 broke in user code")
        except Injected:
            time.sleep(timeout + 6)  # alive, but never calls forward_backward again
        return out
    idx, mask, label = (shard(t, rank, world) for t in batch(1))
    t0 = time.perf_counter()
    try:
        pipe.forward_backward(input_args=(idx,), input_kwargs={"attention_mask": mask},
                              label=label, loss_fn=models.lm_loss)
        out["error"] = None
    except roundpipe.RoundPipeError as e:
        out["error"] = (type(e).__name__, str(e))
    out["elapsed"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:  # the group is broken: the next call says so at once
        pipe.forward_backward(input_args=(idx,), input_kwargs={"attention_mask": mask},
                              label=label, loss_fn=models.lm_loss)
        out["second"] = None
    except roundpipe.RoundPipeError as e:
        out["second"] = (type(e).__name__, str(e))
    out["second_elapsed"] = time.perf_counter() - t0
    return out


def dead_replica(rank: int, world: int, save: Callable[[dict[str, Any]], None]
                 ) -> dict[str, Any]:
    """Rank 1's process dies after step 1: rank 0 learns at once (the connection closes),
    long before its 60 s timeout."""
    pipe = replica(rank, 1, reduction="sum", timeout_s=60)
    opt = make_optimizer("sgd", pipe.optim_parameters())
    train(pipe, opt, [0], rank, world, models.lm_loss)
    out: dict[str, Any] = {}
    if rank == 1:
        save(out)
        os._exit(0)  # dies without any goodbye, as a killed process would
    idx, mask, label = (shard(t, rank, world) for t in batch(1))
    t0 = time.perf_counter()
    try:
        pipe.forward_backward(input_args=(idx,), input_kwargs={"attention_mask": mask},
                              label=label, loss_fn=models.lm_loss)
        out["error"] = None
    except roundpipe.RoundPipeError as e:
        out["error"] = (type(e).__name__, str(e))
    out["elapsed"] = time.perf_counter() - t0
    return out


# One group: each launch's processes pay for the first trace's imports and the process
# group again (~2 s of CPU per process), so the failure scenarios follow the others.
GROUPS: dict[str, list[str]] = {
    "replicas": ["sgd_sum", "adamw_mean", "adamw_async", "zero_checkpoint",
                 "sharded_checkpoint", "autograd_backward", "batchnorm_buffers",
                 "input_grads",
                 # the replicas are out of step while rank 0 alone saves, until its barrier
                 "subgroup_save",
                 # failures last: they break groups, and in the last one rank 1 dies
                 "replica_failure", "failed_save", "hung_replica", "dead_replica"],
}


def input_grads_data() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A small float64 model, an input table outside it and the global batch (rows of
    the table, labels) for ``input_grads``."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 2)).double()
    g = torch.Generator().manual_seed(6)
    table = torch.randn(10, 4, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 10, (BATCH,), generator=g)
    label = torch.randn(BATCH, 2, generator=g, dtype=torch.float64)
    return model, table, ids, label


def input_grads(rank: int, world: int) -> dict[str, Any]:
    """forward_backward sends each replica's own input gradient into its graph (local, as
    with DDP); an input reaching the pipe's own parameter is refused on every replica
    before anything runs, and the group stays usable."""
    model, table, ids, label = input_grads_data()
    table = torch.nn.Parameter(table)
    pipe = RoundPipe(model, devices=["cpu"] * 2, data_parallel=DataParallelConfig(),
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    mine, y = shard(ids, rank, world), shard(label, rank, world)
    loss_fn = torch.nn.functional.mse_loss
    pipe.forward_backward(table[mine] * 2, label=y, loss_fn=loss_fn)
    out: dict[str, Any] = {"table_grad": table.grad.clone()}
    try:
        pipe.forward_backward(pipe.model[0].weight[:BATCH // world] * 1,
                              label=y, loss_fn=loss_fn)
    except roundpipe.InputGradientError as e:
        out["refused"] = str(e)
    pipe.forward_backward(table[mine].detach(), label=y, loss_fn=loss_fn)
    out["state"] = state(pipe)
    pipe.close()
    return out


def main() -> None:
    group, out_path = sys.argv[1], sys.argv[2]
    rank, world = rd.init_distributed(timeout_s=60)
    results: dict[str, Any] = {}
    for name in GROUPS[group]:
        t0 = time.perf_counter()
        try:
            fn = globals()[name]
            if name == "dead_replica":
                def save(out: dict[str, Any]) -> None:
                    results[name] = out
                    torch.save(results, out_path)
                results[name] = fn(rank, world, save)
            elif name in ("zero_checkpoint", "sharded_checkpoint", "failed_save",
                          "subgroup_save"):
                # the replicas' outputs share a directory: so does the checkpoint
                results[name] = fn(rank, world, os.path.join(os.path.dirname(out_path),
                                                             f"{name}.ckpt"))
            else:
                results[name] = fn(rank, world)
        except BaseException:  # noqa: BLE001 - reported to the test
            results[name] = {"crash": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - t0
        torch.save(results, out_path)
    os._exit(0)  # a hung peer's collectives must not delay the exit


if __name__ == "__main__":
    main()
