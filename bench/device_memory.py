"""Measured device memory on virtual CPU devices: its cost, and the plan's estimate held
against it.

Run ``python bench/device_memory.py [--what overhead|ratios|both] [--steps 6]``.

* ``overhead``: one training step of the example GPT (``examples/train_gpt.py``, d=256,
  4 layers, 8 x 64 tokens) on 4 virtual devices, with ``measure_memory`` off and on,
  interleaved rounds; medians.
* ``ratios``: for the example GPT and a small Hugging Face Llama, at 1 and 4 microbatches
  on 1 and 4 virtual devices, each stage's ``StageSpec.memory_bytes`` (the cost pass's
  estimate) against ``RunStats.stage_peak_bytes`` (measured: the tensors its job held at
  once, prefetched weights left out).  Issue 18 asks for the estimate in [0.95, 1.15] x
  measured.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_gpt import GPT

import roundpipe
from roundpipe import RoundPipeRunConfig
from benchutil import add_smoke_flag, apply_smoke, lm_loss  # noqa: E402

MiB = 2**20


def gpt_case(batch: int = 8, seq: int = 64, d: int = 256,
             layers: int = 4) -> tuple[torch.nn.Module, tuple, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(96, d=d, layers=layers)
    x = torch.randint(0, 96, (batch, seq))
    return model, (x,), torch.randint(0, 96, (batch, seq))


def llama_case(batch: int = 8, seq: int = 64) -> tuple[torch.nn.Module, tuple, torch.Tensor]:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 512, (batch, seq))
    return model, (x,), torch.randint(0, 512, (batch, seq))


def pipe_for(case: Callable, devices: int, microbatches: int, measure: bool,
             grain: str = "stage") -> Any:
    model, args, labels = case()
    pipe = roundpipe.compile(model, args, devices=["cpu"] * devices,
                             measure_memory=measure,
                             model_run_config=RoundPipeRunConfig(num_microbatch=microbatches,
                                                                 recompute_grain=grain))
    return pipe, args, labels


def step(pipe: Any, args: tuple, labels: torch.Tensor) -> float:
    start = time.perf_counter()
    pipe.forward_backward(input_args=args, label=labels, loss_fn=lm_loss)
    pipe.synchronize()
    return time.perf_counter() - start


def overhead(steps: int, gpt: Callable = gpt_case) -> None:
    pipes = {m: pipe_for(gpt, 4, 5, m) for m in (False, True)}
    for m, (pipe, args, labels) in pipes.items():
        step(pipe, args, labels)  # warm up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(steps):
        for m, (pipe, args, labels) in pipes.items():
            times[m].append(step(pipe, args, labels))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"example GPT, 4 virtual devices, 5 microbatches: step {off * 1e3:.0f} ms "
          f"unmeasured, {on * 1e3:.0f} ms measured ({on / off:.2f}x)")
    for pipe, _, _ in pipes.values():
        pipe.close()


def ratios(grain: str, smoke: bool = False, gpt: Callable = gpt_case) -> None:
    """Per stage: the estimate, the measured peak and their ratio; then the estimate's
    parts (weights, gradients, activations) against the measured peak less the same
    weights and gradients (what the job held besides them)."""
    print(f"{'model':6} {'dev':>3} {'mb':>3} {'stage':>5} {'kind':5} {'est MiB':>8} "
          f"{'meas MiB':>8} {'est/meas':>8} | {'weights':>7} {'grads':>6} {'est act':>7} "
          f"{'meas rest':>9} {'act ratio':>9}")
    cases = (("gpt", gpt),) if smoke else (("gpt", gpt), ("llama", llama_case))
    for name, case in cases:
        for devices in (2,) if smoke else (1, 4):
            for mb in (2,) if smoke else (1, 4):
                pipe, args, labels = pipe_for(case, devices, mb, True, grain)
                step(pipe, args, labels)
                stats, plan = pipe.stats(), pipe.plan
                for spec in plan.stages:
                    measured = stats.stage_peak_bytes.get(spec.index, 0)
                    ratio = spec.memory_bytes / measured if measured else float("nan")
                    act = sum(c.activation_bytes for c in plan.costs[slice(*spec.units)])
                    grads = spec.memory_bytes - spec.param_bytes - act
                    rest = measured - spec.param_bytes - grads
                    print(f"{name:6} {devices:>3} {mb:>3} {spec.index:>5} {spec.kind:5} "
                          f"{spec.memory_bytes / MiB:8.2f} {measured / MiB:8.2f} "
                          f"{ratio:8.2f} | {spec.param_bytes / MiB:7.2f} {grads / MiB:6.2f} "
                          f"{act / MiB:7.2f} {rest / MiB:9.2f} "
                          f"{act / rest if rest > 0 else float('nan'):9.2f}")
                device_peaks = [d.peak_allocated_bytes or 0 for d in stats.devices]
                print(f"{'':6} device peaks (MiB): "
                      + ", ".join(f"{p / MiB:.2f}" for p in device_peaks)
                      + f"; plan device_memory_bytes {plan.device_memory_bytes / MiB:.2f}")
                pipe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("overhead", "ratios", "both"), default="both")
    parser.add_argument("--steps", type=int, default=6, help="timed rounds (overhead)")
    parser.add_argument("--grain", choices=("stage", "layer"), default="stage",
                        help="recompute grain (ratios)")
    # Not options: the example GPT's shape and tokens, which --smoke shrinks.
    parser.set_defaults(gpt_d=256, gpt_layers=4, seq=64)
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), steps=1, gpt_d=32, gpt_layers=2, seq=8)
    gpt = functools.partial(gpt_case, seq=args.seq, d=args.gpt_d, layers=args.gpt_layers)
    if args.what in ("overhead", "both"):
        overhead(args.steps, gpt)
    if args.what in ("ratios", "both"):
        ratios(args.grain, args.smoke, gpt)


if __name__ == "__main__":
    main()
