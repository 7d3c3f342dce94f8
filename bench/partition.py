"""Partition quality and compile time.

Run ``python bench/partition.py [--max-layers 512]``.

1. Balance.  For a transformer (heavy embedding and head), a conv net (channels double
   every stage) and a mixture-of-experts transformer, cut the layer units into K stages
   three ways and report the bottleneck stage over the ideal (total / K):
   * roundpipe: exact min-max on the cost model's per-unit times;
   * uniform: the same number of units per stage (DeepSpeed ``partition_method="uniform"``);
   * parameters: balanced parameter counts (DeepSpeed's default, ``"parameters"``).
   All three are scored with the same per-unit times, measured by running each unit on
   this CPU (median of several runs), so the cost model is checked too.
2. Compile time (trace + passes) against depth, 8 to 512 layers of a small GPT, with the
   trace of identical blocks shared (the default) and, up to 64 layers, without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roundpipe.compiler import analyze, compile_model  # noqa: E402
from roundpipe.passes.partition import min_max_partition  # noqa: E402
from roundpipe.ops.rng import RngKey  # noqa: E402


# --- models ------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ffn = ffn or nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, 4, C // 4).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                          .transpose(1, 2).reshape(B, T, C))
        return x + self.ffn(self.ln2(x))


class MoE(nn.Module):
    """Top-2 routing over 4 experts; experts run densely and are masked by the router."""

    def __init__(self, d: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                    nn.Linear(2 * d, d))
                                      for _ in range(experts)])

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        top, idx = weights.topk(2, dim=-1)
        gate = torch.zeros_like(weights).scatter(-1, idx, top)
        return sum(gate[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, moe: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, MoE(d) if moe else None) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1, stride) if (cin != cout or stride != 1) else None

    def forward(self, x):
        y = self.conv2(F.relu(self.conv1(x)))
        return F.relu(y + (self.skip(x) if self.skip is not None else x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        chans = [16, 16, 32, 32, 64, 64, 128, 128]
        self.blocks = nn.Sequential(*[ConvBlock(chans[max(i - 1, 0)], c, 2 if i in (2, 4, 6)
                                                else 1) for i, c in enumerate(chans)])
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.blocks(F.relu(self.stem(x))).mean((2, 3)))


# --- measurement ---------------------------------------------------------------------------

def measured_unit_times(analysis, model, example) -> list[float]:
    """Run each unit program alone on real tensors; median seconds per unit."""
    program = analysis.program
    state = {}
    for spec in program.state:
        state[spec.name] = (program.constants[spec.name] if spec.kind == "constant" else
                            model.get_parameter(spec.fqn) if spec.kind == "parameter"
                            else model.get_buffer(spec.fqn))
    values = dict(zip(program.inputs.names, example))
    key = RngKey(0, 0, 0)
    times = []
    with torch.no_grad():
        for unit in program.units:
            args = [values[v] for v in unit.inputs] + [state[s] for s in unit.state]
            if unit.needs_device:
                args.append(torch.device("cpu"))
            if unit.needs_rng:
                args.append(key)
            runs = []
            for _ in range(5):
                t = time.perf_counter()
                outs = unit.module(*args)
                runs.append(time.perf_counter() - t)
            times.append(statistics.median(runs))
            values.update(zip(unit.outputs, outs))
    return times


def bottleneck(times: list[float], bounds: tuple[int, ...]) -> float:
    return max(sum(times[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))


def greedy_bounds(weights: list[float], k: int) -> tuple[int, ...]:
    """Cut where the running sum crosses multiples of total / k (DeepSpeed-style)."""
    total, run, bounds = sum(weights), 0.0, [0]
    for i, w in enumerate(weights):
        run += w
        if len(bounds) < k and run >= total * len(bounds) / k and i + 1 < len(weights):
            bounds.append(i + 1)
    while len(bounds) < k:  # degenerate weights: split the tail
        bounds.append(bounds[-1] + 1)
    return tuple(bounds) + (len(weights),)


def balance_rows(stages: int) -> list[list[str]]:
    torch.manual_seed(0)
    cases = [
        ("transformer", LM(8192, 256, 8), (torch.randint(0, 8192, (4, 128)),)),
        ("conv net", ConvNet(), (torch.randn(8, 3, 64, 64),)),
        ("MoE transformer", LM(2048, 128, 8, moe=True), (torch.randint(0, 2048, (4, 64)),)),
    ]
    rows = []
    for name, model, example in cases:
        analysis = analyze(model, example)
        est = [c.fwd_time_s for c in analysis.report.units]
        real = measured_unit_times(analysis, model, example)
        params = [float(c.param_bytes) for c in analysis.report.units]
        n = len(real)
        ideal = sum(real) / stages
        ours = min_max_partition([max(1, round(t * 1e9)) for t in est], stages).bounds
        uniform = tuple(round(i * n / stages) for i in range(stages)) + (n,)
        by_params = greedy_bounds(params, stages)
        rows.append([name, n, f"{bottleneck(real, ours) / ideal:.2f}",
                     f"{bottleneck(real, uniform) / ideal:.2f}",
                     f"{bottleneck(real, by_params) / ideal:.2f}",
                     f"{statistics.correlation(est, real):.2f}"])
    return rows


def compile_rows(max_layers: int, repeats: int) -> list[list[str]]:
    """Median (and range) of ``repeats`` compiles per depth, with and without sharing the
    trace of identical blocks."""
    rows = []
    layers = 8
    while layers <= max_layers:
        times: dict[bool, list[float]] = {True: [], False: []}
        units = 0
        for _ in range(repeats):
            for share in (True, False) if layers <= 64 else (True,):
                torch.manual_seed(0)
                model = LM(64, 32, layers)
                idx = torch.randint(0, 64, (4, 16))
                t = time.perf_counter()
                plan = compile_model(model, (idx,), num_devices=4, share_blocks=share)
                times[share].append(time.perf_counter() - t)
                units = len(plan.units)
        med = statistics.median(times[True])
        unshared = (f"{statistics.median(times[False]):.2f}" if times[False]
                    else "(too slow to repeat)")
        rows.append([layers, units, f"{med:.2f}",
                     f"{min(times[True]):.2f}-{max(times[True]):.2f}",
                     f"{med / layers * 1e3:.1f}", unshared])
        layers *= 2
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--max-layers", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"Bottleneck stage / ideal, {args.stages} stages, scored with measured unit times "
          f"(lower is better, 1.00 is perfect)")
    print(tabulate(balance_rows(args.stages),
                   headers=["model", "units", "roundpipe", "uniform", "parameters",
                            "estimate~measured corr."]))
    print("\nCompile time (trace + all passes) of a width-32 GPT, median of "
          f"{args.repeats}")
    print(tabulate(compile_rows(args.max_layers, args.repeats),
                   headers=["layers", "units", "seconds", "range", "ms / layer",
                            "every block traced (share_blocks=False)"]))


if __name__ == "__main__":
    main()
