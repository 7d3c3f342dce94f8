"""Data parallelism across processes on one CPU machine: step time of 2 replicas against 1,
and how much of the gradient all-reduce hides under backward.

Run ``python bench/data_parallel.py`` (``--steps``, ``--layers``, ``--d`` to change the
shape).  Every configuration runs in fresh processes started with the variables torchrun
sets (gloo on the loopback), each process with 2 virtual CPU devices and
``OMP_NUM_THREADS=1`` (as torchrun sets it):

* ``1 process``: the whole global batch, no data parallelism;
* ``2 processes, independent``: each its half of the batch, ``data_parallel=False``: the
  cost of sharing the machine, without any communication;
* ``2 replicas, bucket B``: each its half, gradients averaged in buckets of B bytes.

Reported per configuration: the median step time (``forward_backward`` + asynchronous
step), gradient bytes reduced per step, and for data parallelism:

* ``all-reduce alone``: the same buckets all-reduced back to back after training, nothing
  else running: what the reduction would cost if it were not overlapped;
* ``in flight``: time during which at least one bucket all-reduce was running
  (``pipe.stats().data_parallel.comm_s``), on rank 0;
* ``exposed``: from the end of the slower replica's backward to the completion of the
  last bucket (wall clock; ``pipe.stats().data_parallel.exposed_s`` is the same seen
  from one replica, which also counts waiting for a slower peer), the part a call waits
  for;
* ``hidden``: 1 - exposed / all-reduce alone.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from benchutil import add_smoke_flag, apply_smoke  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- one process ------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import roundpipe.distributed as rd
    from roundpipe import DataParallelConfig, RoundPipe, RoundPipeRunConfig
    from train_gpt import GPT

    rank, world = rd.init_distributed()
    # The all-reduce timed alone below runs on a group of its own (gloo over every rank,
    # as the pipe's), made before the pipe makes its groups, in the same order everywhere.
    alone_group = dist.new_group(backend="gloo") if args.bucket else None
    dp = (DataParallelConfig(bucket_bytes=args.bucket) if args.bucket else False)
    torch.manual_seed(0)
    model = GPT(64, d=args.d, layers=args.layers, heads=4)
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=args.num_microbatch),
                     data_parallel=dp)
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
    local = args.batch // world
    g = torch.Generator().manual_seed(1)

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    times: list[float] = []
    ready: list[float] = []
    reduced: list[float] = []
    comm: list[float] = []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, 64, (args.batch, args.seq), generator=g)
        x = x[rank * local:(rank + 1) * local]
        if world > 1 and not args.bucket:
            dist.barrier()  # independent processes: start each step together
        wall0, t0 = time.time(), time.perf_counter()
        pipe.forward_backward(input_args=(x,), label=x, loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            stats = pipe.stats().data_parallel
            if stats is not None:
                # wall-clock times (one machine: comparable across the processes)
                ready.append(wall0 + stats.grads_ready_s)
                reduced.append(wall0 + stats.reduced_s)
                comm.append(stats.comm_s)
    pipe.synchronize()
    result = {"step_s": statistics.median(times), "rank": rank}
    if args.bucket:
        stats = pipe.stats().data_parallel
        sizes = [b.nbytes // 4 + b.contributions for b in stats.buckets]
        # The same buckets, all-reduced back to back with nothing else running.
        group = alone_group
        flats = [torch.ones(n) for n in sizes]
        alone = []
        for _ in range(5):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for w in [dist.all_reduce(f, group=group, async_op=True) for f in flats]:
                w.wait()
            alone.append(time.perf_counter() - t0)
        result.update(ready=ready, reduced=reduced, comm_s=statistics.median(comm),
                      alone_s=statistics.median(alone), buckets=len(sizes),
                      bytes=stats.bytes_reduced)
    pipe.close()
    with open(args.out, "w") as f:
        json.dump(result, f)


# --- the driver --------------------------------------------------------------------------

def _rank_variables(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for one rank (none for a single process)."""
    if world == 1:
        return {}
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _worker_here(rank: int, world: int, port: int, out: str, bucket: str | None,
                 args: argparse.Namespace) -> None:
    """One rank in this process (its variables set meanwhile, its groups destroyed after)."""
    variables = _rank_variables(rank, world, port)
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        worker(argparse.Namespace(**{**vars(args), "out": out, "bucket": bucket}))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(world: int, bucket: str | None, args: argparse.Namespace, tag: str) -> list[dict]:
    port = _free_port()
    outs = [f"/tmp/roundpipe_bench_dp_{os.getpid()}_{tag}_{r}.json" for r in range(world)]
    # --smoke runs rank 0 here (an interpreter's start and imports less: seconds); the
    # other ranks start as every rank does otherwise: ``python data_parallel.py --worker``.
    first = 1 if args.smoke else 0
    procs = []
    for rank in range(first, world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
               **_rank_variables(rank, world, port)}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", outs[rank],
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--layers",
               str(args.layers), "--d", str(args.d), "--batch", str(args.batch), "--seq",
               str(args.seq), "--num-microbatch", str(args.num_microbatch)]
        if bucket:
            cmd += ["--bucket", bucket]
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        if first:
            _worker_here(0, world, port, outs[0], bucket, args)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"{tag}: a worker failed")
    results = []
    for path in outs:
        with open(path) as f:
            results.append(json.load(f))
        os.remove(path)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--num-microbatch", type=int, default=2, help="per process")
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), steps=1, warmup=0, layers=1, d=32, batch=4, seq=8)
    if args.worker:
        worker(args)
        return

    from tabulate import tabulate
    rows = []
    one = launch(1, None, args, "one")[0]
    rows.append(["1 process", f"{one['step_s'] * 1e3:.0f}", "1.00"] + [""] * 6)
    if not args.smoke:
        ind = launch(2, None, args, "independent")
        step = max(r["step_s"] for r in ind)
        rows.append(["2 processes, independent", f"{step * 1e3:.0f}",
                     f"{step / one['step_s']:.2f}"] + [""] * 6)
    for bucket in ("1MiB",) if args.smoke else ("1MiB", "4MiB", "25MiB"):
        res = launch(2, bucket, args, bucket)
        step = max(r["step_s"] for r in res)
        r0 = res[0]
        # Per step: from the end of the slower replica's backward to the completion of
        # the reduction (the last replica to see it complete).
        exposed = statistics.median(
            max(0.0, max(r["reduced"][i] for r in res) - max(r["ready"][i] for r in res))
            for i in range(len(r0["ready"])))
        hidden = 1 - exposed / r0["alone_s"]
        rows.append([f"2 replicas, bucket {bucket}", f"{step * 1e3:.0f}",
                     f"{step / one['step_s']:.2f}", f"{r0['bytes'] / MiB:.1f} MiB",
                     r0["buckets"], f"{r0['alone_s'] * 1e3:.1f}",
                     f"{r0['comm_s'] * 1e3:.1f}", f"{exposed * 1e3:.1f}", f"{hidden:.0%}"])
    print(f"GPT d={args.d} x {args.layers} layers, global batch {args.batch} x {args.seq} "
          f"tokens, {args.num_microbatch} microbatches per process, 2 virtual CPU devices "
          f"per process, gloo on loopback")
    print(tabulate(rows, headers=["configuration", "step (ms)", "vs 1 process",
                                  "grads reduced", "buckets", "all-reduce alone (ms)",
                                  "in flight (ms)", "exposed (ms)", "hidden"]))


if __name__ == "__main__":
    main()
