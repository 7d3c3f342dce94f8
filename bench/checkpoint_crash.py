"""Crash test of checkpoint saves: SIGKILL a process at random moments while it saves
over a good checkpoint, then load what is on disk.

Run ``python bench/checkpoint_crash.py [--kills 20] [--width 1024] [--sharded]``
(``--sharded``: directory checkpoints through torch.distributed.checkpoint, swapped in).

The child process saves generation after generation over one path (every parameter of
generation ``g`` holds ``g``; the checkpoint's ``extra`` says ``g``) and reports each
save that returned.  After each kill the parent loads the checkpoint and checks that
every tensor comes from one save, the last reported or the one whose rename landed just
before the kill.  It counts the kills that hit a write in progress (a temporary file
left beside the target) and checks that the next completed save removes them.
``tests/test_checkpoint_atomic.py`` runs 5 kills of this in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from roundpipe import RoundPipe, load_checkpoint, save_checkpoint  # noqa: E402
from benchutil import add_smoke_flag, apply_smoke  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}

_CHILD = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    from roundpipe import RoundPipe, save_checkpoint
    path, start, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sharded = sys.argv[4] == "1"
    if sharded:
        import torch.distributed.checkpoint  # imported before "ready": it takes seconds
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    with RoundPipe(model, devices=["cpu"]) as pipe:
        print("ready", flush=True)
        g = start
        while True:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(g)
            save_checkpoint(path, pipe, extra={"generation": g}, sharded=sharded)
            print(g, flush=True)
            g += 1
""")


def model(width: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def save_generation(path: str, width: int, g: int, sharded: bool = False) -> None:
    m = model(width)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(g)
    with RoundPipe(m, devices=["cpu"]) as pipe:
        save_checkpoint(path, pipe, extra={"generation": g}, sharded=sharded)


def generation_on_disk(path: str, width: int) -> int:
    """The generation of the checkpoint at ``path``; AssertionError if its tensors come
    from more than one save."""
    m = model(width)
    with RoundPipe(m, devices=["cpu"]) as pipe:
        g = load_checkpoint(path, pipe)["generation"]
    for p in m.parameters():
        if not torch.equal(p, torch.full_like(p, g)):
            raise AssertionError(f"generation {g}'s checkpoint holds tensors of another save")
    return g


def kill_during_saves(path: str, start: int, width: int, rng: random.Random,
                      max_delay_s: float = 0.6, sharded: bool = False
                      ) -> tuple[int, int, bool]:
    """Save from generation ``start`` in a child and SIGKILL it after a random delay.
    Returns (last generation reported saved, generation on disk, whether the kill left
    a temporary file, i.e. hit a write in progress)."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(start), str(width),
                              "1" if sharded else "0"],
                             stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the saving process did not start")
        time.sleep(rng.uniform(0.0, max_delay_s))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    saved = [int(line) for line in out.split() if line.strip().isdigit()]
    name = os.path.basename(path)
    torn = any(e.startswith((f".{name}.tmp-", f".{name}.old-"))
               for e in os.listdir(os.path.dirname(path)))
    return (saved[-1] if saved else start - 1), generation_on_disk(path, width), torn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded", action="store_true",
                        help="sharded (directory) checkpoints instead of one file")
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), kills=1, width=64)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ck" if args.sharded else "ck.pt")
        save_generation(path, args.width, 0, args.sharded)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path)
                   for f in fs) if args.sharded else os.path.getsize(path)
        start, torn, newer, bad, swapping = 1, 0, 0, 0, 0
        for k in range(args.kills):
            reported, on_disk, mid_write = kill_during_saves(path, start, args.width, rng,
                                                             sharded=args.sharded)
            torn += mid_write
            swapping += not os.path.lexists(path)  # killed between a sharded save's renames
            newer += on_disk == reported + 1
            bad += on_disk not in (reported, reported + 1)
            print(f"kill {k + 1}/{args.kills}: saves reported {reported}, on disk "
                  f"{on_disk}, {'mid-write' if mid_write else 'between writes'}", flush=True)
            start = on_disk + 1
        save_generation(path, args.width, start, args.sharded)
        leftovers = [e for e in os.listdir(tmp) if e != os.path.basename(path)]
    kind = "sharded" if args.sharded else "single-file"
    print(f"{args.kills} kills of a process saving {size / 2**20:.0f} MiB {kind} checkpoints: "
          f"{torn} hit a write in progress, {bad} left a checkpoint that was neither the "
          f"last reported save nor the next ({newer} had the rename land unreported); "
          f"temporary files left after the next save: {len(leftovers)}"
          + (f"; {swapping} killed between the renames of the swap" if args.sharded else ""))
    if bad or leftovers:
        sys.exit(1)


if __name__ == "__main__":
    main()
