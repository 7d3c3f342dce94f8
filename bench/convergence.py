"""Convergence on real text: does a pipe with one-step-stale (asynchronous) steps train
like plain PyTorch?

    python bench/convergence.py                      # 1,500 steps, seven runs
    python bench/convergence.py --steps 20 --eval-every 10   # a smoke run
    python bench/convergence.py --finetune --batch 8 --seq 64 --threads 1  # fine-tuning

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

``--finetune`` runs the fine-tuning study instead: the same GPT pretrained eagerly for
``--pretrain-steps`` on the standard library without its ``test/`` package (the weights
are kept in ``--pretrained-dir`` for the next run), then fine-tuned from them for
``--ft-steps`` at ``--ft-lr`` (default 1e-4) on ``test/``'s files, validating on held-out
``test/`` files; ``--ft-runs`` picks the runs.  ``--reuse`` takes runs a JSON recorded with
the same training arguments instead of running them again (eager's first steps are
re-run and compared bitwise with the record first); ``--plot-only`` redraws the PNG.

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
import tempfile
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


def corpus(holdout_every: int = 20, domain: str | None = None,
           inside: bool = False) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(train bytes, validation bytes, train files, validation files).  ``domain``: only
    the files under that top-level directory of the standard library (``inside``), or
    only the others; the hold-out by hash is the same either way."""
    root = sysconfig.get_paths()["stdlib"]
    train, val, counts = [], [], [0, 0]
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root)
            if domain is not None and (rel.split(os.sep)[0] == domain) != inside:
                continue
            with open(path, "rb") as f:
                data = f.read()
            held = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % holdout_every == 0
            (val if held else train).append(data)
            counts[held] += 1
    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
    return as_tensor(train), as_tensor(val), counts[0], counts[1]


def sample(data: torch.Tensor, count: int, args: argparse.Namespace,
           g: torch.Generator) -> list:
    return [windows(data, torch.randint(0, data.numel() - args.seq - 1, (args.batch,),
                                        generator=g), args.seq) for _ in range(count)]


def with_schedule(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


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


STYLES = {"eager": "-", "exact": "--", "async": "-", "async4": ":", "stale": "-.",
          "predict": "-", "warm": "--", "warm200": "-.", "sr": "-", "bf16": ":"}


def plot(data: dict, path: str) -> None:
    """The from-scratch curves and, when measured, the fine-tuning ones beside them."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f'matplotlib is missing (pip install -e ".[plot]"): no {path}')
        return
    panels = [(data["args"], data["runs"], "from scratch, lr {lr:g}")] if data.get(
        "runs") else []
    if data.get("finetune"):
        ft = data["finetune"]
        panels.append((ft["args"], ft["runs"],
                       "fine-tuning on test/ after {pretrain_steps} steps, lr {ft_lr:g}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.4), squeeze=False)
    for ax, (args, runs, title) in zip(axes[0], panels):
        eager = dict(map(tuple, runs["eager"]["curve"])) if "eager" in runs else {}
        for run, result in runs.items():
            steps, losses = zip(*result["curve"])
            if run == "async4":  # the bitwise check's few steps: async's curve
                continue
            gap = (f", {(losses[-1] / eager[steps[-1]] - 1) * 100:+.2f}%"
                   if run != "eager" and steps[-1] in eager else "")
            stopped = (f"stopped at {steps[-1]}: "
                       if result.get("stopped_at") else "")
            ax.plot(steps, losses, STYLES[run],
                    label=f"{run} ({stopped}{losses[-1]:.4f}{gap})")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"GPT {args['params'] / 1e6:.1f} M, {title.format(**args)}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# What a run's result depends on: a recorded run with these arguments equal is the same
# run (eager and the pipes are deterministic at a fixed thread count).
TRAINING_ARGS = ("steps", "batch", "seq", "d", "layers", "heads", "lr", "warmup",
                 "num_microbatch", "eval_every", "val_sequences", "seed", "threads",
                 "warm_steps")


def reusable(paths: str, args: argparse.Namespace, wanted: list[str]) -> dict[str, dict]:
    """The runs in ``wanted`` that the JSON files in ``paths`` recorded with the same
    training arguments (later files win)."""
    found: dict[str, dict] = {}
    for path in [p for p in paths.split(",") if p]:
        with open(path) as f:
            data = json.load(f)
        saved = data["args"]
        differ = [k for k in TRAINING_ARGS if k in saved and saved[k] != getattr(args, k)
                  and not (k == "warm_steps" and "warm" not in data["runs"])]
        if differ:
            print(f"{path}: not reused, other {', '.join(differ)}")
            continue
        for run, v in data["runs"].items():
            if run in wanted and not v.get("stopped_at"):  # not one stopped early
                found[run] = {"curve": [tuple(c) for c in v["curve"]], "train": v["train"],
                              "seconds": v["seconds_per_step"] * len(v["train"]),
                              "steps": len(v["train"]), "reused": path}
    return found


def finetune(args: argparse.Namespace, save=None) -> dict:
    """Pretrain eagerly on the standard library without its ``test/`` package, then
    fine-tune the same weights on ``test/``'s files (never seen in pretraining) at a
    fine-tuning learning rate, validating on held-out ``test/`` files."""
    pre_train, pre_val, n_pre, _ = corpus(domain="test", inside=False)
    ft_train, ft_val, n_ft, n_ft_val = corpus(domain="test", inside=True)
    print(f"pretraining: {n_pre} files without test/ ({pre_train.numel() / 1e6:.1f} MB); "
          f"fine-tuning: {n_ft} files of test/ ({ft_train.numel() / 1e6:.1f} MB), "
          f"validation on {n_ft_val} others")
    g = torch.Generator().manual_seed(args.seed)
    pre_args = with_schedule(args, steps=args.pretrain_steps)
    pre_batches = sample(pre_train, args.pretrain_steps, args, g)
    pre_val_windows = windows(pre_val, torch.randint(0, pre_val.numel() - args.seq - 1,
                                                     (args.val_sequences,), generator=g),
                              args.seq)
    ft_args = with_schedule(args, steps=args.ft_steps, lr=args.ft_lr, warmup=args.ft_warmup,
                            eval_every=args.ft_eval_every)
    ft_batches = sample(ft_train, args.ft_steps, args, g)
    ft_val_windows = windows(ft_val, torch.randint(0, ft_val.numel() - args.seq - 1,
                                                   (args.val_sequences,), generator=g),
                             args.seq)
    torch.manual_seed(args.seed)
    init = GPT(256, d=args.d, layers=args.layers, heads=args.heads,
               max_len=args.seq).state_dict()
    key = hashlib.sha1(repr([getattr(args, k) for k in TRAINING_ARGS if k != "steps"]
                            + [args.pretrain_steps]).encode()).hexdigest()[:12]
    saved = os.path.join(args.pretrained_dir, f"convergence-pretrained-{key}.pt")
    if os.path.exists(saved):
        pre = torch.load(saved, weights_only=True)
        print(f"pretrained weights from {saved}")
    else:
        pre = train("eager", init, pre_batches, pre_val_windows, pre_args)
        pre = {"weights": pre["weights"], "curve": pre["curve"], "seconds": pre["seconds"]}
        if args.pretrained_dir:
            os.makedirs(args.pretrained_dir, exist_ok=True)
            torch.save(pre, saved)
            print(f"saved the pretrained weights to {saved}")
    start = {"curve": [(0, val_loss(_loaded(args, pre["weights"]), ft_val_windows))]}
    print(f"pretrained: validation loss {pre['curve'][-1][1]:.4f} on held-out non-test "
          f"files, {start['curve'][0][1]:.4f} on held-out test/ files")
    results: dict[str, dict] = {}

    def record() -> dict:
        return {"args": {k: v for k, v in vars(ft_args).items()},
                "pretrain_curve": pre["curve"],
                "runs": {r: {"curve": v["curve"], "train": v["train"], "steps": v["steps"],
                             "seconds_per_step": v["seconds"] / v["steps"]}
                         for r, v in results.items()}}
    for run in [r for r in args.ft_runs.split(",") if r]:
        results[run] = train(run, pre["weights"], ft_batches, ft_val_windows, ft_args)
        results[run]["curve"] = start["curve"] + results[run]["curve"]
        print(f"fine-tune {run}: {results[run]['seconds'] / results[run]['steps']:.2f} "
              "s/step")
        if save is not None:  # after each run: a long study stopped keeps what ran
            save(record())
    table(results, args.ft_steps, "fine-tuning")
    return record()


def _loaded(args: argparse.Namespace, weights: dict) -> torch.nn.Module:
    model = GPT(256, d=args.d, layers=args.layers, heads=args.heads, max_len=args.seq)
    model.load_state_dict(weights)
    return model


def table(results: dict[str, dict], steps: int, what: str) -> None:
    eager = results.get("eager")
    print(f"\n{what}: {'run':8} {'final val loss':>15} {'vs eager':>9} {'s/step':>7}")
    for run, result in results.items():
        if result["steps"] != steps:
            continue  # the shortened bitwise check: no final loss to compare
        final = result["curve"][-1][1]
        gap = f"{(final / eager['curve'][-1][1] - 1) * 100:+.2f}%" if eager else ""
        note = "  (recorded)" if result.get("reused") else ""
        print(f"{run:8} {final:15.4f} {gap:>9} "
              f"{result['seconds'] / result['steps']:7.2f}{note}")


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
    parser.add_argument("--reuse", default="",
                        help="comma-separated JSON files this bench wrote: runs recorded "
                             "there with the same training arguments are taken as "
                             "measured, not run again (eager's first --reuse-check steps "
                             "are re-run and must equal the record bitwise)")
    parser.add_argument("--reuse-check", type=int, default=20)
    parser.add_argument("--finetune", action="store_true",
                        help="the fine-tuning study instead: pretrain eagerly on the "
                             "standard library without test/, fine-tune on test/")
    parser.add_argument("--pretrain-steps", type=int, default=500)
    parser.add_argument("--ft-steps", type=int, default=300)
    parser.add_argument("--ft-lr", type=float, default=1e-4)
    parser.add_argument("--ft-warmup", type=int, default=30)
    parser.add_argument("--ft-eval-every", type=int, default=25)
    parser.add_argument("--ft-runs", default="eager,exact,predict")
    parser.add_argument("--pretrained-dir", default=tempfile.gettempdir(),
                        help="where the pretrained weights are kept for the next run "
                             "(empty: not kept)")
    parser.add_argument("--plot-only", action="store_true",
                        help="draw --png from the curves in --json, run nothing")
    parser.add_argument("--png", default=os.path.join(ROOT, "docs", "convergence.png"))
    parser.add_argument("--json", default=os.path.join(ROOT, "bench", "results",
                                                       "convergence.json"))
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), steps=2, batch=4, seq=32, d=32, layers=1,
                       heads=2, warmup=1, eval_every=1, val_sequences=4, num_microbatch=2,
                       runs="eager,exact,async,predict,warm", warm_steps=1, png="",
                       json="", pretrain_steps=2, ft_steps=3, ft_warmup=1, ft_eval_every=2,
                       ft_runs="eager,exact,predict", pretrained_dir="", reuse_check=2)
    runs = [r for r in args.runs.split(",") if r]
    unknown = (set(runs) | set(args.ft_runs.split(",")) - {""}) - set(RUNS)
    if unknown:
        parser.error(f"unknown run(s) {sorted(unknown)}; choose from {RUNS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    recorded: dict = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            recorded = json.load(f)

    if args.plot_only:
        plot(recorded, args.png)
        return
    if args.finetune:
        torch.manual_seed(args.seed)
        args.params = sum(v.numel() for k, v in GPT(
            256, d=args.d, layers=args.layers, heads=args.heads,
            max_len=args.seq).state_dict().items() if k != "head.weight")  # tied
        def save(part: dict) -> None:
            write({**recorded, "finetune": part}, args, png=False)
        write({**recorded, "finetune": finetune(args, save)}, args)
        return

    train_data, val_data, n_train, n_val = corpus()
    print(f"stdlib: {n_train} training files ({train_data.numel() / 1e6:.1f} MB), "
          f"{n_val} held-out files ({val_data.numel() / 1e6:.1f} MB)")
    g = torch.Generator().manual_seed(args.seed)
    batches = sample(train_data, args.steps, args, g)
    val = windows(val_data, torch.randint(0, val_data.numel() - args.seq - 1,
                                          (args.val_sequences,), generator=g), args.seq)
    torch.manual_seed(args.seed)
    init = GPT(256, d=args.d, layers=args.layers, heads=args.heads,
               max_len=args.seq).state_dict()
    args.params = sum(v.numel() for k, v in init.items() if k != "head.weight")  # tied
    print(f"GPT: {args.params / 1e6:.2f} M parameters, {args.steps} steps of "
          f"{args.batch} x {args.seq} bytes, {args.num_microbatch} microbatches")

    results: dict[str, dict] = reusable(args.reuse, args, runs) if args.reuse else {}
    if "eager" in results:  # deterministic: the record must be what a run gives now
        n = min(args.reuse_check, args.steps)
        check = train("eager", init, batches, val, args, steps=n)
        same = check["train"] == results["eager"]["train"][:n]
        print(f"recorded eager run re-run over {n} steps: training losses "
              f"{'bitwise equal' if same else 'DIFFERENT'}")
        if not same:
            sys.exit("the recorded eager run is not what eager gives here (another "
                     "torch, CPU or thread count?): run it again, without --reuse")
    short = args.async4_steps if args.async4_steps else args.steps
    for run in runs:
        if run in results:
            continue
        results[run] = train(run, init, batches, val, args,
                             steps=short if run == "async4" else None,
                             snapshot_at=short if run == "async" else None)
        print(f"{run}: {results[run]['seconds'] / results[run]['steps']:.2f} s/step")
    results = {r: results[r] for r in runs if r in results}
    table(results, args.steps, "from scratch")
    if "async" in results and "async4" in results and not (
            results["async"].get("reused") or results["async4"].get("reused")):
        a, b = results["async"], results["async4"]
        n = b["steps"]
        same = a["train"][:n] == b["train"] and all(
            torch.equal(a["snapshot"][k], b["weights"][k]) for k in a["snapshot"])
        print(f"async on 4 devices bitwise equal to async on 1 over {n} steps (losses and "
              f"weights): {'yes' if same else 'NO'}")
    out = {**recorded,
           "args": {k: v for k, v in vars(args).items()},
           "runs": {r: {"curve": v["curve"], "train": v["train"],
                        "seconds_per_step": v["seconds"] / v["steps"]}
                    for r, v in results.items()}}
    write(out, args)


def write(out: dict, args: argparse.Namespace, png: bool = True) -> None:
    """The JSON keeps what it held of the other study; the PNG shows both."""
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.png and png:
        plot(out, args.png)


if __name__ == "__main__":
    main()
