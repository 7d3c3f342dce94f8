"""Convergence on real text: does a pipe with one-step-stale (asynchronous) steps train
like plain PyTorch?

    python bench/convergence.py                      # 1,500 steps, seven runs
    python bench/convergence.py --steps 20 --eval-every 10   # a smoke run

At the defaults a step takes 8-12 s on two (shared) CPU cores, 6.4 s of CPU time: the seven
runs of 1,500 steps take most of a day there; ``--runs`` runs some of them.

Data: the Python standard library's own source files (``sysconfig``'s stdlib path, without
site-packages), read as bytes; every 20th file (by a hash of its path) is held out for
validation, so the validation text comes from files never trained on.  Model: the GPT of
``examples/train_gpt.py`` (byte vocabulary, tied embeddings), about 10.8 M parameters at
the defaults.  Four runs from the same initial weights and the same batches in the same
order, AdamW with warmup and cosine decay, gradients clipped to 1.0:

* ``eager``: plain PyTorch;
* ``exact``: roundpipe, ``step(is_async=False)``, one virtual CPU device;
* ``async``: roundpipe, ``step(is_async=True)`` with ``predict_weights=False`` (each call
  uses the weights from before the previous step), one device;
* ``async4``: the same on four virtual CPU devices; with ``num_microbatch`` fixed it must
  be bitwise equal to ``async`` (checked and printed);
* ``predict``: ``step(is_async=True)`` with weight prediction (the default: each call uses
  ``W_{k-1} + (W_{k-1} - W_{k-2})``), one device;
* ``warm``: ``predict`` after ``--warm-steps`` exact steps (``async_after``);
* ``stale``: plain PyTorch again, each gradient taken at the weights from before the
  previous step (the schedule ``async`` follows, without roundpipe): tells what the
  staleness costs from what roundpipe would add;
* ``sr``: a bfloat16 model with no masters (``optim_dtype=None``), exact steps,
  ``roundpipe.optim.AdamW(stochastic_rounding=True)`` with bfloat16 moments (6 bytes per
  parameter); compare with ``exact`` (float32 masters);
* ``bf16``: the same model and pipe with torch's fused AdamW, which computes in float32
  and rounds weights and moments to nearest (what stochastic rounding is against).

The validation loss of a pipe is measured on a copy of the model loaded with
``pipe.state_dict()`` (the masters, after every step taken), which waits for a pending
step without publishing it, so measuring does not change the schedule the run follows.
Writes the curves to ``--png`` (docs/convergence.png) and ``--json`` and prints the final
validation losses with each run's gap to eager's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import roundpipe  # noqa: E402
import roundpipe.optim  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402
from train_gpt import GPT  # noqa: E402
from benchutil import add_smoke_flag, apply_smoke  # noqa: E402

RUNS = ("eager", "exact", "async", "async4", "stale", "predict", "warm", "sr", "bf16")
#: runs of a bfloat16 model with no masters (optim_dtype=None): roundpipe.optim.AdamW with
#: stochastic rounding, and torch's fused AdamW (float32 math, rounded to nearest)
BF16_RUNS = ("sr", "bf16")


def corpus(holdout_every: int = 20) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(train bytes, validation bytes, train files, validation files)."""
    root = sysconfig.get_paths()["stdlib"]
    train, val, counts = [], [], [0, 0]
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                data = f.read()
            rel = os.path.relpath(path, root).encode()
            held = int(hashlib.sha1(rel).hexdigest(), 16) % holdout_every == 0
            (val if held else train).append(data)
            counts[held] += 1
    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
    return as_tensor(train), as_tensor(val), counts[0], counts[1]


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, ...]:
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    x, y = val
    total = 0.0
    for i in range(0, x.shape[0], 8):
        logits = model(x[i:i + 8])
        total += F.cross_entropy(logits.flatten(0, 1), y[i:i + 8].flatten(),
                                 reduction="sum").item()
    model.train()
    return total / y.numel()


def train(run: str, init: dict[str, torch.Tensor], batches: list, val: tuple,
          args: argparse.Namespace, steps: int | None = None,
          snapshot_at: int | None = None) -> dict:
    """``steps`` steps (default all); ``snapshot_at``: also keep the weights after that
    many steps (what a shorter run must equal)."""
    steps = args.steps if steps is None else steps
    model = GPT(256, d=args.d, layers=args.layers, heads=args.heads, max_len=args.seq)
    model.load_state_dict(init)
    if run in BF16_RUNS:
        model = model.to(torch.bfloat16)
    mb = args.num_microbatch
    pipe = None
    lagged = None
    if run == "stale":  # eager, each gradient taken at the weights one step old
        lagged = GPT(256, d=args.d, layers=args.layers, heads=args.heads, max_len=args.seq)
        lagged.load_state_dict(init)
    if run in ("eager", "stale"):
        params = list(model.parameters())
    else:
        pipe = roundpipe.RoundPipe(model, devices=["cpu"] * (4 if run == "async4" else 1),
                                   optim_dtype=None if run in BF16_RUNS else torch.float32,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=mb),
                                   predict_weights=run in ("predict", "warm"),
                                   async_after=args.warm_steps if run == "warm" else 0)
        params = pipe.optim_parameters()
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt = (roundpipe.optim.AdamW(params, **hyper, stochastic_rounding=True) if run == "sr"
           else torch.optim.AdamW(params, **hyper, fused=run == "bf16"))
    probe = GPT(256, d=args.d, layers=args.layers, heads=args.heads, max_len=args.seq)

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # A mean per microbatch over equal microbatches, divided by their number: the
        # sum forward_backward returns is the batch's mean, as eager's.
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / mb

    def evaluate() -> float:
        if pipe is None:
            return val_loss(model, val)
        probe.load_state_dict(pipe.state_dict())  # the masters; the schedule is kept
        return val_loss(probe, val)

    curve, train_losses, snapshot = [], [], None
    started = time.perf_counter()
    bar = tqdm(range(steps), desc=run, dynamic_ncols=True)
    for step in bar:
        x, y = batches[step]
        lr = lr_at(step, args)
        if lagged is not None:
            loss = F.cross_entropy(lagged(x).flatten(0, 1), y.flatten())
            grads = torch.autograd.grad(loss, list(lagged.parameters()))
            for p, g in zip(params, grads):
                p.grad = g
            lagged.load_state_dict(model.state_dict())  # the weights this step starts from
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad()
        elif pipe is None:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad()
        else:
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)

            def step_fn(lr: float = lr) -> None:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                opt.zero_grad()
            pipe.step(step_fn, is_async=run not in ("exact",) + BF16_RUNS)
        train_losses.append(loss.item())
        if snapshot_at == step + 1:
            weights = pipe.state_dict() if pipe is not None else model.state_dict()
            snapshot = {k: v.detach().clone() for k, v in weights.items()}
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            curve.append((step + 1, evaluate()))
            bar.set_postfix(train=f"{train_losses[-1]:.3f}", val=f"{curve[-1][1]:.3f}")
    elapsed = time.perf_counter() - started
    final = (pipe.state_dict() if pipe is not None else model.state_dict())
    if pipe is not None:
        pipe.close()
    return {"curve": curve, "train": train_losses, "seconds": elapsed, "steps": steps,
            "weights": {k: v.detach().clone() for k, v in final.items()},
            "snapshot": snapshot}


def plot(results: dict[str, dict], path: str, args: argparse.Namespace) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f'matplotlib is missing (pip install -e ".[plot]"): no {path}')
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"eager": "-", "exact": "--", "async": "-", "async4": ":", "stale": "-.",
              "predict": "-", "warm": "--", "sr": "-", "bf16": ":"}
    for run, result in results.items():
        steps, losses = zip(*result["curve"])
        ax.plot(steps, losses, styles[run], label=f"{run} ({losses[-1]:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"GPT {args.params / 1e6:.1f} M on stdlib source bytes, held-out files")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="bytes per sequence")
    parser.add_argument("--d", type=int, default=384, help="model width")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--num-microbatch", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--val-sequences", type=int, default=128)
    parser.add_argument("--runs", default=",".join(RUNS), help="which runs, in order")
    parser.add_argument("--warm-steps", type=int, default=100,
                        help="exact steps before the asynchronous ones of the warm run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async4-steps", type=int, default=None,
                        help="run async4 this many steps only and compare it bitwise with "
                             "async's weights after as many (default: all steps)")
    parser.add_argument("--png", default=os.path.join(ROOT, "docs", "convergence.png"))
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results",
                                                       "convergence.json"))
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), steps=3, batch=4, seq=32, d=32, layers=1,
                       heads=2, warmup=1, eval_every=2, val_sequences=4,
                       runs="eager,exact,async,predict,warm", warm_steps=1, png="",
                       json="")
    runs = [r for r in args.runs.split(",") if r]
    unknown = set(runs) - set(RUNS)
    if unknown:
        parser.error(f"unknown run(s) {sorted(unknown)}; choose from {RUNS}")
    if args.threads:
        torch.set_num_threads(args.threads)

    train_data, val_data, n_train, n_val = corpus()
    print(f"stdlib: {n_train} training files ({train_data.numel() / 1e6:.1f} MB), "
          f"{n_val} held-out files ({val_data.numel() / 1e6:.1f} MB)")
    g = torch.Generator().manual_seed(args.seed)
    batches = [windows(train_data, torch.randint(0, train_data.numel() - args.seq - 1,
                                                  (args.batch,), generator=g), args.seq)
               for _ in range(args.steps)]
    val = windows(val_data, torch.randint(0, val_data.numel() - args.seq - 1,
                                          (args.val_sequences,), generator=g), args.seq)
    torch.manual_seed(args.seed)
    init = GPT(256, d=args.d, layers=args.layers, heads=args.heads,
               max_len=args.seq).state_dict()
    args.params = sum(v.numel() for k, v in init.items() if k != "head.weight")  # tied
    print(f"GPT: {args.params / 1e6:.2f} M parameters, {args.steps} steps of "
          f"{args.batch} x {args.seq} bytes, {args.num_microbatch} microbatches")

    short = args.async4_steps if args.async4_steps else args.steps
    results: dict[str, dict] = {}
    for run in runs:
        results[run] = train(run, init, batches, val, args,
                             steps=short if run == "async4" else None,
                             snapshot_at=short if run == "async" else None)
        print(f"{run}: {results[run]['seconds'] / results[run]['steps']:.2f} s/step")

    eager = results.get("eager")
    print(f"\n{'run':8} {'final val loss':>15} {'vs eager':>9} {'s/step':>7}")
    for run, result in results.items():
        if result["steps"] != args.steps:
            continue  # the shortened bitwise check: no final loss to compare
        final = result["curve"][-1][1]
        gap = f"{(final / eager['curve'][-1][1] - 1) * 100:+.2f}%" if eager else ""
        print(f"{run:8} {final:15.4f} {gap:>9} {result['seconds'] / result['steps']:7.2f}")
    if "async" in results and "async4" in results:
        a, b = results["async"], results["async4"]
        n = b["steps"]
        same = a["train"][:n] == b["train"] and all(
            torch.equal(a["snapshot"][k], b["weights"][k]) for k in a["snapshot"])
        print(f"async on 4 devices bitwise equal to async on 1 over {n} steps (losses and "
              f"weights): {'yes' if same else 'NO'}")

    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()},
                       "runs": {r: {"curve": v["curve"], "train": v["train"],
                                    "seconds_per_step": v["seconds"] / v["steps"]}
                                for r, v in results.items()}}, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        plot(results, args.png, args)


if __name__ == "__main__":
    main()
