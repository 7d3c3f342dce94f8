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
3. Stage counts under a memory cap (``--sections capped``): the 1.36B Llama shape of
   ``bench/gpu.py`` (24 x 2048, bf16, vocab 32000), one device, 2 microbatches of
   4 x 2048 tokens, built on the meta device (nothing allocated), planned under a 24 GiB
   cap for an H100 (512-byte blocks; the plan may use ``memory_fraction`` 0.9 of it) with
   the memory estimate summed from unit costs (before issue 18: each stage within half
   the cap) and with the lifetime replay (``passes/memory.py``: the largest job with the
   largest prefetched weights within the cap).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roundpipe.compiler import analyze, compile_model  # noqa: E402
from roundpipe.passes.partition import min_max_partition  # noqa: E402
from roundpipe.ops.rng import RngKey  # noqa: E402
from benchutil import add_smoke_flag, apply_smoke  # noqa: E402


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
    def __init__(self, chans: tuple[int, ...] = (16, 16, 32, 32, 64, 64, 128, 128)) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.blocks = nn.Sequential(*[ConvBlock(chans[max(i - 1, 0)], c, 2 if i in (2, 4, 6)
                                                else 1) for i, c in enumerate(chans)])
        self.head = nn.Linear(chans[-1], 10)

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


def balance_rows(stages: int, smoke: bool = False) -> list[list[str]]:
    torch.manual_seed(0)
    cases = [
        ("transformer", LM(8192, 256, 8), (torch.randint(0, 8192, (4, 128)),)),
        ("conv net", ConvNet(), (torch.randn(8, 3, 64, 64),)),
        ("MoE transformer", LM(2048, 128, 8, moe=True), (torch.randint(0, 2048, (4, 64)),)),
    ] if not smoke else [  # each still cut into more units than stages (4)
        ("transformer", LM(64, 32, 2), (torch.randint(0, 64, (2, 8)),)),
        ("conv net", ConvNet((16, 16, 32)), (torch.randn(1, 3, 16, 16),)),
        ("MoE transformer", LM(64, 32, 2, moe=True), (torch.randint(0, 64, (2, 8)),)),
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
    """Median (and range) of ``repeats`` compiles per depth (from 8 layers, or
    ``max_layers`` if fewer), with and without sharing the trace of identical blocks."""
    rows = []
    layers = min(8, max_layers)
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


def capped_rows(cap_gib: float = 24.0) -> list[list[str]]:
    """Stage count, estimated step time and memory of the 1.36B shape, old against new."""
    import roundpipe.passes.cost as cost
    from roundpipe.passes.cost import DeviceModel
    from benchutil import Llama
    h100 = DeviceModel("H100", 6.0e14, 3.0e12, 4.0e10, 6e-6, 512)
    with torch.device("meta"):
        model = Llama(32000, 2048, 24, 16, 5632).to(torch.bfloat16)
        x = torch.randint(0, 32000, (4, 2048))
    rows = []
    build = cost.build_memory_model
    for name, builder in (("summed unit costs (before)", lambda *a, **k: None),
                          ("lifetime replay", build)):
        cost.build_memory_model = builder
        try:
            t = time.perf_counter()
            plan = compile_model(model, (x,), num_devices=1, num_microbatch=2,
                                 example_is_microbatch=True, device_model=h100,
                                 memory_cap=int(0.9 * cap_gib * 2**30))
            seconds = time.perf_counter() - t
        finally:
            cost.build_memory_model = build
        GiB = 2**30
        rows.append([name, len(plan.stages), f"{plan.est_step_time_s * 1e3:.0f}",
                     f"{max(s.memory_bytes for s in plan.stages) / GiB:.2f}",
                     f"{plan.device_memory_bytes / GiB:.2f}", f"{seconds:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--max-layers", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="balance,compile,capped")
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), max_layers=2, repeats=1, sections="balance,compile")
    sections = args.sections.split(",")
    if "capped" in sections:
        print("1.36B Llama (24 x 2048, bf16), 1 device, 2 x 4 x 2048 tokens, 24 GiB cap")
        print(tabulate(capped_rows(), headers=[
            "stage memory from", "stages", "est. step ms", "largest stage GiB",
            "device_memory_bytes GiB", "compile s"]))
    if "balance" not in sections and "compile" not in sections:
        return
    print(f"Bottleneck stage / ideal, {args.stages} stages, scored with measured unit times "
          f"(lower is better, 1.00 is perfect)")
    print(tabulate(balance_rows(args.stages, args.smoke),
                   headers=["model", "units", "roundpipe", "uniform", "parameters",
                            "estimate~measured corr."]))
    print("\nCompile time (trace + all passes) of a width-32 GPT, median of "
          f"{args.repeats}")
    print(tabulate(compile_rows(args.max_layers, args.repeats),
                   headers=["layers", "units", "seconds", "range", "ms / layer",
                            "every block traced (share_blocks=False)"]))


if __name__ == "__main__":
    main()
