"""Checkpoint saves: time and throughput against the disk, and what an asynchronous save
costs the training steps that overlap it.

Run ``python bench/checkpoint.py [--width 2048 --layers 12] [--dir DIR]``.

* the disk's write bandwidth: a file of the checkpoint's size written in 64 MiB pieces,
  fsync'd;
* synchronous saves, one file and sharded (DCP): seconds, bytes on disk, GB/s;
* training steps while an asynchronous sharded save runs, against steps without one:
  the slowdown, the time the training thread was blocked by the save call, the
  snapshot's extra host memory (bytes copied, and the peak resident-set growth beyond
  what the same steps reach without a save); the same with ``max_snapshot_bytes`` at a
  quarter of the state.

The model: ``--layers`` bias-free ``Linear(width, width)`` (``--dtype``, fp32 by default)
with fp32 masters and torch's AdamW on two virtual CPU devices: 12 bytes per parameter in
a checkpoint (masters and two moments).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from roundpipe import RoundPipe, RoundPipeRunConfig, save_checkpoint  # noqa: E402
from benchutil import add_smoke_flag, apply_smoke  # noqa: E402

GB = 1e9


def disk_bandwidth(directory: str, nbytes: int) -> float:
    """GB/s of a write of ``nbytes`` in 64 MiB pieces, fsync included."""
    piece = os.urandom(1 << 20) * 64
    path = os.path.join(directory, "bandwidth.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(piece)
            written += len(piece)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return written / seconds / GB


def disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class RSSPeak:
    """The process's peak resident set while active, sampled every 5 ms."""

    def __init__(self) -> None:
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> RSSPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def build(width: int, layers: int, dtype: torch.dtype
          ) -> tuple[RoundPipe, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    pipe = RoundPipe(model.to(dtype), devices=["cpu"] * 2,
                     optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-4)
    x = torch.randn(64, width, dtype=dtype)
    return pipe, opt, x


def step(pipe: RoundPipe, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    pipe.forward_backward(input_args=(x,), label=x,
                          loss_fn=lambda o, y: (o.float() - y.float()).pow(2).mean())
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
    return time.perf_counter() - t0


def overlapped(pipe: RoundPipe, opt: torch.optim.Optimizer, x: torch.Tensor, path: str,
               cap: int | None) -> dict[str, float]:
    pipe.synchronize()
    base = RSSPeak.now()
    with RSSPeak() as rss:
        t0 = time.perf_counter()
        future = save_checkpoint(path, pipe, opt, sharded=True, asynchronous=True,
                                 max_snapshot_bytes=cap)
        blocked = time.perf_counter() - t0
        times = []
        while not future.done():
            times.append(step(pipe, opt, x))
        future.result()
        total = time.perf_counter() - t0
    return {"blocked_s": blocked, "save_s": total, "steps": times,
            "snapshot": future.snapshot_bytes, "held": future.held_bytes,
            "rss": rss.peak - base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=8, help="steps timed without a save")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's dtype (bf16 matmuls are slow on CPUs without "
                             "native support)")
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), width=64, layers=2, steps=2)
    work = tempfile.mkdtemp(prefix="rp-ckpt-", dir=args.dir)
    try:
        pipe, opt, x = build(args.width, args.layers, getattr(torch, args.dtype))
        params = sum(p.numel() for p in pipe.model.parameters())
        for _ in range(3):
            step(pipe, opt, x)
        pipe.synchronize()
        state = params * 12
        print(f"# {params / 1e6:.1f}M parameters, ~{state / GB:.2f} GB of state; "
              f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
        save_checkpoint(os.path.join(work, "warm"), pipe, opt, sharded=True)  # imports DCP
        bw = statistics.median(disk_bandwidth(work, state) for _ in range(3))
        print(f"disk write bandwidth (fsync'd, median of 3): {bw:.2f} GB/s")
        print("\n| save | seconds | GB on disk | GB/s | of disk bandwidth |")
        print("|---|---|---|---|---|")
        for name, kwargs in (("one file (torch.save)", {"sharded": False}),
                             ("sharded (DCP)", {"sharded": True})):
            path = os.path.join(work, "ck.pt" if not kwargs["sharded"] else "ck")
            t0 = time.perf_counter()
            save_checkpoint(path, pipe, opt, **kwargs)
            seconds = time.perf_counter() - t0
            size = disk_bytes(path)
            print(f"| {name} | {seconds:.2f} | {size / GB:.2f} | {size / seconds / GB:.2f} | "
                  f"{size / seconds / GB / bw:.0%} |")
        pipe.synchronize()
        rss0 = RSSPeak.now()
        with RSSPeak() as rss:
            base = [step(pipe, opt, x) for _ in range(args.steps)]
        base_s = statistics.median(base)
        train_rss = rss.peak - rss0  # training's own transient memory
        print(f"\ntraining step without a save: median {base_s * 1e3:.0f} ms "
              f"({args.steps} steps), resident set +{train_rss / GB:.2f} GB at peak; "
              f"load average {os.getloadavg()[0]:.1f}")
        print("\n| async sharded save | save call blocks | save total | steps overlapped "
              "| step median | slowdown | snapshot copied | held (copied late) | RSS growth beyond "
              "training's |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, cap in (("no cap", None), ("cap = 1/4 of state", state // 4)):
            r = overlapped(pipe, opt, x, os.path.join(work, "ck"), cap)
            med = statistics.median(r["steps"]) if r["steps"] else float("nan")
            print(f"| {name} | {r['blocked_s'] * 1e3:.0f} ms | {r['save_s']:.2f} s | "
                  f"{len(r['steps'])} | {med * 1e3:.0f} ms | {med / base_s - 1:+.0%} | "
                  f"{r['snapshot'] / GB:.2f} GB | {r['held'] / GB:.2f} GB | "
                  f"{(r['rss'] - train_rss) / GB:.2f} GB |")
        pipe.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
