"""Draw roundpipe's schedule as a Gantt chart (PNG) and write a Perfetto trace.

    pip install -e ".[plot]"
    python examples/plot_schedule.py --devices 4             # writes schedule.png here
    python examples/plot_schedule.py --devices 4 --out docs/schedule.png   # the README's

Each row is a device; each bar is one job (one stage over all microbatches), split into
its microbatches, coloured by kind: forward, fused tail (forward + loss + backward), and
backward (recompute + backward).  The trace JSON (``--trace``) opens in ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402
from train_gpt import GPT  # noqa: E402

COLORS = {"fwd": "#4C78A8", "fused": "#F58518", "bwd": "#54A24B"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices")
    parser.add_argument("--num-microbatch", type=int, default=None,
                        help="microbatches per batch (None: devices + 1)")
    parser.add_argument("--layers", type=int, default=8, help="GPT blocks")
    parser.add_argument("--out", default="schedule.png",
                        help="the chart, PNG (the default is in the current directory)")
    parser.add_argument("--trace", default=None, help="also write a Perfetto trace here")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise SystemExit("this example needs matplotlib: pip install -e '.[plot]'") from None

    torch.manual_seed(0)
    num_mb = args.num_microbatch or args.devices + 1
    model = GPT(64, d=192, layers=args.layers, heads=4)
    x = torch.randint(0, 64, (4 * num_mb, 64))
    y = torch.randint(0, 64, x.shape)
    pipe = RoundPipe(model, devices=["cpu"] * args.devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=num_mb))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    for _ in range(2):  # the second call is warm
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    print(pipe.plan)
    stats = pipe.stats()
    if args.trace:
        print(f"trace: {pipe.timeline(args.trace)}")

    devices = [d.name for d in stats.devices]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(devices) + 1.4))
    for record in stats.timeline:
        row = devices.index(record.device)
        for mb, (start, end) in enumerate(record.microbatch_s):
            ax.barh(row, (end - start) * 1e3, left=start * 1e3, height=0.7,
                    color=COLORS[record.kind], edgecolor="white", linewidth=0.6)
        mid = (record.start_s + record.end_s) / 2 * 1e3
        ax.text(mid, row, f"S{record.stage}", ha="center", va="center", fontsize=8,
                color="white")
    ax.set_yticks(range(len(devices)), devices)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"roundpipe schedule: {len(pipe.plan.stages)} stages, {num_mb} microbatches "
                 f"on {len(devices)} devices")
    ax.legend(handles=[Patch(color=c, label={"fwd": "forward", "fused": "fused tail",
                                             "bwd": "recompute + backward"}[k])
                       for k, c in COLORS.items()], loc="upper center", fontsize=8,
              bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"chart: {args.out}")
    pipe.close()


if __name__ == "__main__":
    main()
