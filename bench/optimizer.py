"""CPU optimizer-step throughput of roundpipe's asynchronous step path.

Run ``python bench/optimizer.py [--width 2048] [--layers 8] [--repeats 5]``.

Reports parameters per second for:

* ``torch.optim.AdamW(fused=True)`` stepping the parameters directly;
* roundpipe's async step path: ``pipe.step(lambda: (opt.step(), opt.zero_grad()))`` with
  fp32 masters, which also publishes the masters into the model weights (one extra copy);
* the memory-bandwidth roofline: measured streaming bandwidth (best of a copy and an add)
  over the 28 bytes AdamW moves per parameter.

It also reports how long the next ``forward_backward`` waits for a pending step: its time
right after an async step against its time with no step pending; and the host's work per
step for a bf16 model with fp32 masters, in seconds per billion parameters, phase by phase
(landing: bf16 gradient -> fp32 ``.grad``; update: fused AdamW; publish: fp32 masters ->
bf16 weights), against the one-pass roofline: 28 bytes per parameter (AdamW, fp32 state)
over the STREAM-triad bandwidth measured in the same run with all threads.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best of a copy (2 streams) and an add (3 streams), in bytes moved per second.

    Write-allocate traffic is not counted, so this is what streaming code achieves, the
    figure AdamW's 28 bytes per parameter should be divided into."""
    a, b, c = (torch.rand(nbytes // 4) for _ in range(3))
    best = 0.0
    for streams, op in ((2, lambda: c.copy_(a)), (3, lambda: torch.add(a, b, out=c))):
        op()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
        best = max(best, streams * nbytes / statistics.median(times))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, args.width)

    # Eager fused AdamW on the parameters themselves, and roundpipe's step on the
    # optimizer thread (publish + fused AdamW on the masters), interleaved round by round.
    eager = copy.deepcopy(model)
    for p in eager.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-4, fused=True)
    opt.step()
    pipe = RoundPipe(model, devices=["cpu"], optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    popt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-4, fused=True)
    call = dict(input_args=(x,), label=torch.zeros(4, args.width), loss_fn=F.mse_loss)
    pipe.forward_backward(**call)
    pipe.step(lambda: popt.step(), is_async=False)
    eager_s, step_s, fb_alone, fb_after = [], [], [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        opt.step()
        eager_s.append(time.perf_counter() - t)
        pipe.synchronize()
        t = time.perf_counter()
        pipe.forward_backward(**call)
        fb_alone.append(time.perf_counter() - t)
        t = time.perf_counter()
        pipe.step(lambda: popt.step())  # async: publish previous masters, then step
        pipe.synchronize()             # also publishes the new masters
        step_s.append(time.perf_counter() - t)
        pipe.step(lambda: popt.step())
        t = time.perf_counter()
        pipe.forward_backward(**call)  # overlaps the step; waits for it before committing
        fb_after.append(time.perf_counter() - t)
    pipe.synchronize()
    pipe.close()

    roofline = memory_bandwidth() / 28
    med = statistics.median
    rows = [
        ["torch.optim.AdamW(fused=True)", f"{n / med(eager_s) / 1e9:.3f}",
         f"{n / med(eager_s) / roofline:.2f}"],
        ["roundpipe async step (+ publish)", f"{n / med(step_s) / 1e9:.3f}",
         f"{n / med(step_s) / roofline:.2f}"],
        ["roofline (memory bandwidth / 28 B)", f"{roofline / 1e9:.3f}", "1.00"],
    ]
    print(f"{n / 1e6:.1f} M fp32 parameters, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print(tabulate(rows, headers=["step", "Gparam/s", "/ roofline"]))
    waits = [(a - b) * 1e3 for a, b in zip(fb_after, fb_alone)]
    print(tabulate([[f"{med(fb_alone) * 1e3:.1f}", f"{med(fb_after) * 1e3:.1f}",
                     f"{med(waits):.1f} ({min(waits):.1f} to {max(waits):.1f})"]],
                   headers=["forward_backward ms (no step pending)",
                            "ms (async step pending)", "difference ms (spread)"]))
    grad_landing(n, args.repeats)
    host_step(n, args.repeats)


def triad_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """STREAM triad ``a = b + s * c`` (3 streams) with every thread, in bytes per second."""
    a, b, c = (torch.rand(nbytes // 4) for _ in range(3))
    torch.add(b, c, alpha=3.0, out=a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - t)
    return 3 * nbytes / statistics.median(times)


def host_step(n: int, repeats: int) -> None:
    """Today's three passes over host memory per step (bf16 model, fp32 masters, AdamW),
    each timed on its own, interleaved round by round."""
    weight = torch.randn(n).to(torch.bfloat16)
    landed = torch.randn(n).to(torch.bfloat16) * 1e-3  # a downloaded bf16 gradient
    master = torch.nn.Parameter(weight.float())
    master.grad = torch.empty(n)
    opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
    master.grad.copy_(landed)
    opt.step()
    phases: dict[str, list[float]] = {"landing": [], "update": [], "publish": []}
    work = {"landing": lambda: master.grad.copy_(landed), "update": opt.step,
            "publish": lambda: weight.copy_(master.detach())}
    for _ in range(repeats):
        for name, fn in work.items():
            t = time.perf_counter()
            fn()
            phases[name].append(time.perf_counter() - t)
    bandwidth = triad_bandwidth()
    per_b = 1e9 / n
    med = {k: statistics.median(v) * per_b for k, v in phases.items()}
    total = sum(med.values())
    roofline = 28 * 1e9 / bandwidth
    rows = [[k, f"{v:.2f}"] for k, v in med.items()]
    rows += [["old path: landing + update + publish", f"{total:.2f}"],
             ["one-pass roofline: 28 B/param / triad bandwidth", f"{roofline:.2f}"],
             ["old path / roofline", f"{total / roofline:.2f}"]]
    print(f"host step, bf16 model with fp32 masters and AdamW, {n / 1e6:.1f} M parameters, "
          f"triad bandwidth {bandwidth / 1e9:.1f} GB/s with {torch.get_num_threads()} "
          "threads")
    print(tabulate(rows, headers=["phase", "s per billion parameters"]))


def grad_landing(n: int, repeats: int) -> None:
    """What converting a bf16 gradient into an fp32 ``.grad`` costs in memory the allocator
    hands out fresh (page-faulted on first write) against memory reused from the last call
    (what roundpipe's GradLanding does), interleaved."""
    src = torch.randn(n).to(torch.bfloat16)
    reused = src.to(torch.float32)
    fresh_s, reused_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        out = src.to(torch.float32, copy=True)
        fresh_s.append(time.perf_counter() - t)
        del out
        t = time.perf_counter()
        reused.copy_(src)
        reused_s.append(time.perf_counter() - t)
    ratios = [a / b for a, b in zip(fresh_s, reused_s)]
    print(tabulate([[f"{statistics.median(fresh_s) * 1e3:.1f}",
                     f"{statistics.median(reused_s) * 1e3:.1f}",
                     f"{statistics.median(ratios):.1f} ({min(ratios):.1f}-{max(ratios):.1f})"]],
                   headers=[f"bf16 -> fp32 .grad, {n / 1e6:.1f} M: fresh memory ms",
                            "reused memory ms", "fresh / reused (spread)"]))


if __name__ == "__main__":
    main()
