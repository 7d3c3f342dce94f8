"""Soak test: many steps of a small GPT; memory and threads must stay flat.

Run ``python bench/soak.py [--steps 2000] [--devices 2]``.  Trains with asynchronous
steps and fp32 masters, sampling the process's resident memory (VmRSS) and
thread count every ``--every`` steps; after a warm-up (the first 10% of steps) both must
stay within 5% of their post-warm-up value.  Exits non-zero if they do not (not
with ``--smoke``, too short to judge).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402
from train_gpt import GPT  # noqa: E402
from benchutil import add_smoke_flag, apply_smoke, rss_bytes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--every", type=int, default=100)
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), steps=10, every=2)
    torch.manual_seed(0)
    model = GPT(32, d=64, layers=4, heads=4, dropout=0.1)
    pipe = RoundPipe(model, devices=["cpu"] * args.devices, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=args.devices + 1))
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
    samples = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randint(0, 32, (6, 32))
        y = torch.randint(0, 32, x.shape)
        loss = pipe.forward_backward(
            input_args=(x,), label=y,
            loss_fn=lambda o, t: F.cross_entropy(o.reshape(-1, 32), t.reshape(-1)))
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        if step % args.every == 0:
            samples.append((step, rss_bytes(), threading.active_count(), loss.item(),
                            time.perf_counter() - started))
    pipe.synchronize()
    pipe.close()
    warm = [s for s in samples if s[0] > args.steps // 10]
    base_rss, base_threads = warm[0][1], warm[0][2]
    rss_drift = max(abs(s[1] - base_rss) for s in warm) / base_rss
    thread_drift = max(abs(s[2] - base_threads) for s in warm) / base_threads
    print(tabulate([[s[0], f"{s[1] / 2**20:.1f}", s[2], f"{s[3]:.3f}", f"{s[4]:.0f}"]
                    for s in samples],
                   headers=["step", "RSS MiB", "threads", "loss", "seconds"]))
    ok = rss_drift <= 0.05 and thread_drift <= 0.05
    print(f"after warm-up (step {warm[0][0]}): RSS drift {rss_drift:.1%}, thread drift "
          f"{thread_drift:.1%} (limit 5%): {'flat' if ok else 'NOT FLAT'}")
    return 0 if ok or args.smoke else 1  # (a smoke run is too short to judge drift)


if __name__ == "__main__":
    sys.exit(main())
