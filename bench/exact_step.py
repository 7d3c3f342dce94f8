"""How much of an exact step the next call waits for: the overlapped exact step
(``pipe.step(opt)`` with ``roundpipe.optim``: the masters are updated and published unit
by unit, the next call's uploads wait only for their own units) against the whole update.

    python bench/exact_step.py                 # S = 4 stages on 4 virtual CPU devices
    python bench/exact_step.py --smoke

Steps alternate between the plain exact step (``pipe.step(lambda: (opt.step(),
opt.zero_grad()))``: ``step`` returns once the whole update is published; its duration is
the whole update) and the overlapped one (``pipe.step(opt)``); the next call's
``pipe.stats().weights_wait_s`` is the time its jobs stood still waiting for weights the
step had not published yet: the exposed update.  Both schedules are exact and bitwise
equal (tests/test_overlapped_step.py), so alternating does not change the training.
The goal: exposed / whole <= 1/S + 10% when nothing global is needed.  A clipped run
(``pipe.clip_grad_norm_`` before the step: the total norm is taken over the whole
gradient after the whole backward) is measured too: it stays per unit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from benchutil import add_smoke_flag, apply_smoke  # noqa: E402  (puts roundpipe on the path)

import roundpipe  # noqa: E402
import roundpipe.optim  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402


def model_of(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU())
                           for _ in range(layers))).to(torch.bfloat16)


def measure(args: argparse.Namespace, clip: bool) -> dict[str, float]:
    model = model_of(args.width, args.layers)
    x = torch.randn(args.batch, args.width, dtype=torch.bfloat16)
    y = torch.randn(args.batch, args.width, dtype=torch.bfloat16)
    whole, exposed, waited_whole = [], [], []
    with roundpipe.RoundPipe(model, devices=["cpu"] * args.devices,
                             num_stages=args.num_stages, optim_dtype=torch.float32,
                             model_run_config=RoundPipeRunConfig(
                                 num_microbatch=args.microbatches)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-4)
        how = pipe.step_overlap(opt)
        overlapped = False
        for i in tqdm(range(args.warmup + 2 * args.steps), desc=f"clip={clip}",
                      leave=False):
            pipe.forward_backward(input_args=(x,), label=y,
                                  loss_fn=lambda o, t: F.mse_loss(o.float(), t.float()))
            if i > args.warmup:
                (exposed if overlapped else waited_whole).append(
                    pipe.stats().weights_wait_s)
            if clip:
                pipe.clip_grad_norm_(1.0)
            overlapped = i % 2 == 1
            if overlapped:
                pipe.step(opt)
            else:
                t = time.perf_counter()
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
                if i >= args.warmup:
                    whole.append(time.perf_counter() - t)
        pipe.synchronize()
        # what the next call must wait for at least: the first stage's weights
        stages = pipe.plan.stages
        forward = [s for s in stages if s.kind in ("fwd", "fused")]
        first = stages[0].param_bytes / sum(s.param_bytes for s in forward)
    update, wait = statistics.median(whole), statistics.median(exposed)
    return {"update_s": update, "exposed_s": wait, "ratio": wait / update,
            "plain_wait_s": statistics.median(waited_whole), "how": how, "first": first,
            "forward_stages": len(forward)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=None,
                        help="all stages (forward, tail, backward); default: the plan's")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), width=64, layers=4, devices=2, batch=8,
                       steps=2, warmup=1)
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.layers} x Linear({args.width}) = {params / 1e6:.1f} M parameters, "
          f"bf16 weights, fp32 masters, roundpipe.optim.AdamW; {args.devices} virtual "
          f"CPU devices, {args.microbatches} microbatches of "
          f"{args.batch // args.microbatches}; medians over {args.steps} steps each")
    print("| gradients | how the exact step runs | forward stages S | first stage's "
          "share of the weights | whole update (s) | exposed (s) | exposed / whole | "
          "goal (first share + 10%) |")
    print("|---|---|---|---|---|---|---|---|")
    for clip in (False, True):
        r = measure(args, clip)
        print(f"| {'clipped to 1.0' if clip else 'as they are'} | {r['how']} | "
              f"{r['forward_stages']} | {r['first']:.2f} | {r['update_s']:.4f} | "
              f"{r['exposed_s']:.4f} | {r['ratio']:.2f} | "
              f"{'met' if r['ratio'] <= r['first'] + 0.10 else 'not met'} "
              f"(<= {r['first'] + 0.10:.2f}) |")


if __name__ == "__main__":
    main()
