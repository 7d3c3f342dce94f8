"""Runtime overhead on one CPU device against eager PyTorch.

Run ``python bench/overhead.py [--layers 8] [--width 256] [--repeats 7]``.

Compares, on the same GPT, the same microbatches and the same loss, the time of one
training step (forward + backward over all microbatches, no optimizer):

* eager PyTorch, no recompute;
* eager PyTorch with ``torch.utils.checkpoint`` around every block (per-layer recompute,
  what roundpipe's backward stages do);
* ``RoundPipe.forward_backward`` on one virtual CPU device;
* the two autograd front ends on the same device: ``loss_fn(pipe(x), y).backward()`` and
  ``torch.compile(model, backend=RoundPipeBackend(...))`` (``--no-front-ends`` skips them);
* peers: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` on a single-process gloo
  group (one stage, no recompute), and torchgpipe (``checkpoint="always"``) when it is
  installed; torchgpipe needs the model rewritten as ``nn.Sequential`` and refuses tied
  embeddings, so it runs an untied copy.

Runs are interleaved (A, B, C, A, B, C, ...) so machine noise hits all three alike; the
table reports medians and the spread (min-max) of the per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from train_gpt import GPT  # noqa: E402
from benchutil import add_smoke_flag, apply_smoke  # noqa: E402


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--num-microbatch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-front-ends", dest="front_ends", action="store_false",
                        help="skip pipe(x).backward() and the torch.compile backend")
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="skip torch.distributed.pipelining and torchgpipe")
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), layers=1, width=32, batch=4, seq=8, repeats=1)

    torch.manual_seed(0)
    model = GPT(32, d=args.width, layers=args.layers, heads=4)
    x = torch.randint(0, 32, (args.batch, args.seq))
    y = torch.randint(0, 32, (args.batch, args.seq))
    M = args.num_microbatch
    eager = copy.deepcopy(model)
    pipe = roundpipe.compile(copy.deepcopy(model), (x,), devices=["cpu"],
                             model_run_config=RoundPipeRunConfig(num_microbatch=M))

    def run_eager(ckpt: bool) -> None:
        for xx, yy in zip(x.chunk(M), y.chunk(M)):
            if ckpt:
                h = eager.tok(xx) + eager.pos(torch.arange(xx.shape[1]))
                for block in eager.blocks:
                    h = checkpoint(block, h, use_reentrant=False)
                loss = loss_fn(eager.head(eager.ln_f(h)), yy)
            else:
                loss = loss_fn(eager(xx), yy)
            loss.backward()

    def run_pipe() -> None:
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)

    runs = {"eager": lambda: run_eager(False), "eager + checkpoint": lambda: run_eager(True),
            "roundpipe": run_pipe}
    if args.front_ends:
        from roundpipe.backend import RoundPipeBackend
        compiled = torch.compile(copy.deepcopy(model), backend=RoundPipeBackend(
            devices=["cpu"], num_microbatch=M))
        runs["pipe(x).backward()"] = lambda: loss_fn(pipe(x), y).backward()
        runs["torch.compile backend"] = lambda: loss_fn(compiled(x), y).backward()
    notes: list[str] = []
    if args.peers:
        runs.update(peer_runs(model, x, y, M, notes))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)

    def ratio(a: str, b: str) -> str:
        r = [x / y for x, y in zip(times[a], times[b])]
        return f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"

    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} layers, width {args.width}, {params / 1e6:.1f} M params, "
          f"batch {args.batch}x{args.seq}, {M} microbatches, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(pipe.plan.summary())
    print(tabulate([[name, f"{statistics.median(t) * 1e3:.1f}",
                     f"{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}"] for name, t in times.items()],
                   headers=["run", "median ms", "spread ms"]))
    rows = [["roundpipe / eager + checkpoint", ratio("roundpipe", "eager + checkpoint"),
             "<= 1.10"],
            ["roundpipe / eager", ratio("roundpipe", "eager"), "floor ~1.33"]]
    rows += [[f"{name} / eager + checkpoint", ratio(name, "eager + checkpoint"), "<= 1.10"]
             for name in ("pipe(x).backward()", "torch.compile backend") if name in runs]
    rows += [[f"{name} / eager", ratio(name, "eager"), "peer"] for name in runs
             if name not in ("eager", "eager + checkpoint", "roundpipe", "pipe(x).backward()",
                             "torch.compile backend")]
    print(tabulate(rows, headers=["ratio", "median (spread)", "goal"]))
    for note in notes:
        print(f"note: {note}")
    pipe.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def peer_runs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, M: int,
              notes: list[str]) -> dict[str, Callable[[], None]]:
    """The peers that work here; a note for each one that does not."""
    runs: dict[str, Callable[[], None]] = {}
    try:
        import torch.distributed as dist
        from torch.distributed.pipelining import ScheduleGPipe, pipeline
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=0, world_size=1)
        ir = pipeline(copy.deepcopy(model), mb_args=(x.chunk(M)[0],))
        schedule = ScheduleGPipe(ir.build_stage(0, device=torch.device("cpu")),
                                 n_microbatches=M, loss_fn=loss_fn)
        runs["torch pipelining GPipe"] = lambda: schedule.step(x, target=y)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        notes.append(f"torch.distributed.pipelining: {type(e).__name__}: {e}")
    try:
        from torchgpipe import GPipe
        untied = copy.deepcopy(model)
        untied.head.weight = torch.nn.Parameter(untied.tok.weight.detach().clone())
        layers = torch.nn.Sequential(_Prologue(untied), *untied.blocks, _Epilogue(untied))
        gpipe = GPipe(layers, balance=[len(layers)], devices=["cpu"], chunks=M,
                      checkpoint="always")
        runs["torchgpipe"] = lambda: loss_fn(gpipe(x), y).backward()
        notes.append("torchgpipe refuses tied embeddings ('duplicate parameters in distinct "
                      "children'): it ran an untied copy rewritten as nn.Sequential")
    except ImportError:
        notes.append("torchgpipe is not installed (pip install torchgpipe)")
    return runs


class _Prologue(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class _Epilogue(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h))


if __name__ == "__main__":
    main()
