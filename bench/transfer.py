"""Bytes moved per training step and peak residency, against what the plan says is ideal.

Run ``python bench/transfer.py``.  For 1, 2, 4 and 8 virtual CPU devices it trains a small
GPT for a few steps and reports, for the last step:

* bytes uploaded (weights, activations, labels, activation gradients) and downloaded;
* the ratio of weight uploads to the ideal (each stage's state once per job: the sum of the
  stages' parameter bytes) and of activation uploads to the ideal (each stage's inputs once
  per microbatch, minus what is handed over on the device); goal 1.00;
* peak resident weight bytes per device against its two largest stages; goal <= 1.0.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402
from train_gpt import GPT  # noqa: E402
from benchutil import add_smoke_flag, lm_loss as loss_fn  # noqa: E402

MiB = 2**20


def measure(devices: int, num_mb: int = 9, layers: int = 8) -> list[str]:
    torch.manual_seed(0)
    model = GPT(32, d=128, layers=layers, heads=4)
    x = torch.randint(0, 32, (num_mb * 2, 32))
    y = torch.randint(0, 32, x.shape)
    pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=num_mb))
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
    for _ in range(3):
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
    pipe.synchronize()
    plan, stats = pipe.plan, pipe.stats()
    up = {c: sum(d.uploaded[c] for d in stats.devices) for c in stats.devices[0].uploaded}
    down = sum(d.bytes_downloaded for d in stats.devices)
    ideal_weights = sum(s.param_bytes for s in plan.stages)
    ideal_acts = num_mb * sum(s.act_in_bytes for s in plan.stages)
    peak_ratio = max(
        d.peak_weight_bytes / sum(sorted((s.param_bytes for s in plan.stages
                                          if s.index % devices == i), reverse=True)[:2])
        for i, d in enumerate(stats.devices))
    pipe.close()
    return [devices, len(plan.stages), f"{up['weights'] / MiB:.2f}",
            f"{up['weights'] / ideal_weights:.2f}", f"{up['activations'] / MiB:.2f}",
            f"{up['activations'] / ideal_acts:.2f}",
            f"{(up['labels'] + up['grads']) / MiB:.2f}", f"{down / MiB:.2f}",
            f"{peak_ratio:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_flag(parser)
    args = parser.parse_args()
    layers, num_mb, counts = (2, 3, (1, 2)) if args.smoke else (8, 9, (1, 2, 4, 8))
    rows = [measure(d, num_mb, layers) for d in counts]
    print(f"GPT, {layers} layers, width 128, {num_mb} microbatches of 2 x 32 tokens, "
          "last of 3 steps")
    print(tabulate(rows, headers=[
        "devices", "stages", "weights up MiB", "/ ideal", "activations up MiB", "/ ideal",
        "labels+grads up MiB", "down MiB", "peak weights / 2 stages"]))
    print("activation ideal counts every stage input once per microbatch; with one device, "
          "values handed over on the device make the ratio fall below 1")


if __name__ == "__main__":
    main()
