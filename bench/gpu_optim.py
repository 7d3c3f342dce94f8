"""Large Llama shapes on one GPU under a memory cap: torch's AdamW against roundpipe.optim's.

Run: ``python bench/gpu_optim.py --shape 3b --optims torch,rp --rounds 2`` (skipped without
CUDA).  Each round builds, for each optimizer in turn, a fresh bf16 model with fp32 masters
in this process (the optimizers alternate, so the host's drift falls on both) and reports:

- the overlapped step (``forward_backward`` + async ``pipe.step``), median of ``--steps``,
  and tokens/s;
- ``forward_backward`` alone and the host step alone (each waited for);
- the host phases (the optimizer thread's step: publish + update; the commit of the
  landed gradients), medians;
- host memory: ``pipe.host_memory(opt)``, the process's resident set now and at its peak;
- model FLOP utilisation against the bf16 matmul rate measured in the same process
  (``--peak``): 6 x parameters + attention per token, and with stage recompute 8 x.

``torch`` = ``torch.optim.AdamW(fused=True)`` on fp32 ``.grad``; ``rp`` =
``roundpipe.optim.AdamW`` (its native loop); ``rp-fused`` = the same with
``kernel="fused"`` (torch's kernels through scratch); ``rp-bf16`` = ``rp`` with
``state_dtype=torch.bfloat16``.
Results go to ``--out`` as JSON, one file per shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import PHASES, Llama, cuda_median_time as timed, instrument, lm_loss  # noqa: E402
from gpu import matmul_rate  # noqa: E402

GiB = 2**30
SHAPES = {  # d, layers, heads, ffn (bench/gpu.py's "largest" shapes)
    "1b": (2048, 24, 16, 5632),
    "3b": (3072, 26, 24, 8192),
    "7b": (4096, 32, 32, 11008),
}


def proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def make_optimizer(kind: str, params):
    import roundpipe
    if kind == "torch":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    if kind == "rp":
        return roundpipe.optim.AdamW(params, lr=1e-5)
    if kind == "rp-fused":
        return roundpipe.optim.AdamW(params, lr=1e-5, kernel="fused")
    if kind == "rp-bf16":
        return roundpipe.optim.AdamW(params, lr=1e-5, state_dtype=torch.bfloat16)
    raise SystemExit(f"unknown optimizer {kind!r}; choose torch, rp, rp-fused or rp-bf16")


def run_one(kind: str, shape: tuple[int, int, int, int], args, peak_tflops: float | None
            ) -> dict:
    import roundpipe
    from roundpipe import RoundPipeRunConfig
    vocab = 32000
    torch.manual_seed(0)
    rss0 = proc_status("VmRSS")
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # no fp32 copy of the model while it is built
    try:
        model = Llama(vocab, *shape)
    finally:
        torch.set_default_dtype(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, vocab, (args.batch, args.seq))
    y = torch.randint(0, vocab, (args.batch, args.seq))
    pipe = roundpipe.compile(model, (x,), optim_dtype=torch.float32,
                             landing_buffers=args.landing_buffers,
                             model_run_config=RoundPipeRunConfig(num_microbatch=args.mb),
                             predict_weights=False)  # as recorded: before prediction
    opt = make_optimizer(kind, pipe.optim_parameters())
    build_s = time.perf_counter() - t0
    fb = lambda: pipe.forward_backward(input_args=(x,), label=y, loss_fn=lm_loss)  # noqa
    step_fn = lambda: (opt.step(), opt.zero_grad())  # noqa: E731

    def both() -> None:
        fb()
        pipe.step(step_fn, is_async=True)  # the recorded figures overlap the step

    try:
        for _ in range(2):
            both()
        pipe.synchronize()
        PHASES.clear()
        t_both = timed(lambda: both(), args.steps)
        pipe.synchronize()
        phases = {k: statistics.median(v) for k, v in PHASES.items()}
        t_fb = timed(lambda: (fb(), pipe.synchronize()), 2)
        host_times = []
        for _ in range(3):  # the host step alone: gradients landed, nothing else running
            fb()
            pipe.synchronize()
            t = time.perf_counter()
            pipe.step(step_fn, is_async=False)
            host_times.append(time.perf_counter() - t)
        t_host = statistics.median(host_times)
        mem = pipe.host_memory(opt)
        tokens = args.batch * args.seq
        d, layers = shape[0], shape[1]
        flops_tok = 6 * n_params + 12 * layers * d * args.seq  # PaLM's count, causal ignored
        recompute_tok = 2 * n_params
        row = {
            "optimizer": kind, "params": n_params, "stages": len(pipe.plan.stages),
            "build_s": build_s, "step_s": t_both, "tokens_per_s": tokens / t_both,
            "forward_backward_s": t_fb, "host_step_s": t_host,
            "host_step_s_per_B": t_host / (n_params / 1e9),
            "phases_s": phases,
            "host_memory_total_GiB": mem.total / GiB,
            "host_memory_B_per_param": mem.total / n_params,
            "host_memory": {k: getattr(mem, k) for k in
                            ("weights", "masters", "gradients", "optimizer_state",
                             "landing", "pinned")},
            "rss_growth_GiB": (proc_status("VmRSS") - rss0) / GiB,
            "rss_GiB": proc_status("VmRSS") / GiB, "rss_peak_GiB": proc_status("VmHWM") / GiB,
            "gpu_peak_GiB": torch.cuda.max_memory_allocated() / GiB,
        }
        if peak_tflops:
            row["mfu"] = tokens / t_both * flops_tok / (peak_tflops * 1e12)
            row["hfu_with_recompute"] = (tokens / t_both * (flops_tok + recompute_tok)
                                         / (peak_tflops * 1e12))
        return row
    finally:
        pipe.close()
        del pipe, opt, model
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()  # pinned blocks the CUDA host allocator keeps cached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="3b", choices=sorted(SHAPES))
    parser.add_argument("--optims", default="torch,rp")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--mb", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--peak", action="store_true", help="measure the bf16 matmul rate")
    parser.add_argument("--landing-buffers", default="auto",
                        type=lambda v: v if v == "auto" else int(v),
                        help="1: one set of gradient landing buffers (7B AdamW in 128 GiB)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_optim.py: skipped, no CUDA device is visible")
        return 0
    from tabulate import tabulate
    instrument()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), 0)
    peak = matmul_rate() if args.peak else None
    if peak:
        print(f"bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_optim-{args.shape}.json")
    rows: list[dict] = []
    kinds = [k.strip() for k in args.optims.split(",") if k.strip()]
    for r in tqdm(range(args.rounds), desc="rounds"):
        for kind in kinds:
            try:
                row = run_one(kind, SHAPES[args.shape], args, peak)
            except Exception as e:  # noqa: BLE001 - a failure is a result too
                row = {"optimizer": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            row["round"] = r
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            with open(path, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                           "bf16_TFLOPs": peak, "rows": rows}, f, indent=2, default=str)
    print(tabulate([[r["round"], r["optimizer"], r.get("error", "")[:60] or
                     f"{r['tokens_per_s']:,.0f}", f"{r.get('step_s', 0) * 1e3:,.0f}",
                     f"{r.get('forward_backward_s', 0) * 1e3:,.0f}",
                     f"{r.get('host_step_s', 0) * 1e3:,.0f}",
                     f"{r.get('host_step_s_per_B', 0):.2f}",
                     f"{r.get('host_memory_B_per_param', 0):.1f}",
                     f"{r.get('rss_GiB', 0):.1f}/{r.get('rss_peak_GiB', 0):.1f}",
                     f"{r.get('mfu', 0):.2f}", r.get("stages")]
                    for r in rows],
                   headers=["round", "optim", "tok/s", "step ms", "fb ms", "host step ms",
                            "host s/B", "host B/param", "RSS/peak GiB", "MFU", "stages"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
