"""GPU benchmarks (skipped without CUDA).  Run: ``python bench/gpu.py [--quick]``.

Measures, in one run so ratios are comparable:

1. the machine: pinned and pageable host-to-device copy bandwidth, bf16 matmul rate, and
   the crossover tokens/microbatch above which a layer's weight upload hides under its
   compute (matmul rate / PCIe bandwidth);
   the ``pin_memory`` modes: tokens/s, upload GB/s, set-up time and host memory growth of
   ``"off"``, ``"register"`` and ``"alloc"`` on the same model;
2. a sweep of tokens per microbatch on a Llama-shaped stack: roundpipe tokens/s, GPU busy
   fraction (compute-kernel time / wall time) and achieved upload GB/s;
3. a ~1.3B-parameter Llama-shaped bf16 model under a 24 GiB memory cap
   (``torch.cuda.set_per_process_memory_fraction``): eager training (expected to run out
   of memory) against roundpipe;
4. a model that fits: tokens/s of eager PyTorch, of FSDP2 with ``CPUOffloadPolicy`` (one
   GPU, the closest peer: parameters live on the CPU too) and of roundpipe; and the same
   model with ``compile_units=True`` (inductor unit programs) against the traced ones;
5. with ``--largest``: Llama shapes of about 3B and 7B parameters under the same 24 GiB
   cap, each either training (tokens/s) or failing (how).

Results print as tables and are written to ``bench/results/gpu-<device>.json`` after
every section (a crash keeps what was measured; a failed measurement is recorded as text).
A full run can exceed a 10-minute command limit: split it with ``--sections machine,sweep``
then ``--sections capped,fits``; the JSON file collects them.  Copy the figures into
``docs/benchmarks.md`` with the device name and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import Llama, cuda_median_time, lm_loss, rss_bytes  # noqa: E402

GiB = 2**30


# --- measurements -----------------------------------------------------------------------

def median_time(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> float:
    return cuda_median_time(fn, repeat=repeat, warmup=warmup)


def copy_bandwidth(pinned: bool, nbytes: int = 512 * 2**20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / median_time(lambda: dst.copy_(src, non_blocking=pinned)) / 1e9


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / median_time(lambda: a @ b) / 1e12


def busy_fraction(run: Callable[[], Any]) -> float:
    """Compute-kernel time over wall time, from the profiler (copies excluded)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernel_us = 0.0
    kernels = 0
    for event in prof.events():
        # device-side record_function ranges overlap the kernels they contain
        if (event.device_type == torch.autograd.DeviceType.CUDA
                and not getattr(event, "is_user_annotation", False)
                and not event.name.startswith(("Memcpy", "Memset"))):
            kernel_us += event.time_range.elapsed_us()
            kernels += 1
    if kernels == 0:  # the profiler saw no kernel of the worker threads: no figure
        return float("nan")
    return kernel_us / 1e6 / wall / max(1, torch.cuda.device_count())


def roundpipe_step(model: nn.Module, batch: int, seq: int, vocab: int, num_mb: int,
                   steps: int, pin_memory: str = "alloc", compile_units: bool = False,
                   devices: list[str] | None = None) -> dict[str, float]:
    import roundpipe
    from roundpipe import RoundPipeRunConfig
    x = torch.randint(0, vocab, (batch, seq))
    y = torch.randint(0, vocab, (batch, seq))
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    pipe = roundpipe.compile(model, (x,), optim_dtype=torch.float32, pin_memory=pin_memory,
                             compile_units=compile_units, devices=devices,
                             model_run_config=RoundPipeRunConfig(num_microbatch=num_mb),
                             predict_weights=False)  # as recorded: before prediction
    compile_s = time.perf_counter() - t0  # tracing, planning and pinning
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-4)

    def step() -> None:
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=lm_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)  # as recorded

    try:
        seconds = median_time(step, repeat=steps)
        stats = pipe.stats()
        busy = busy_fraction(step)
        pipe.synchronize()
        return {
            "tokens_per_s": batch * seq / seconds,
            "step_s": seconds,
            "upload_GBps": stats.bytes_uploaded / stats.wall_s / 1e9,
            "busy_fraction": busy,
            "stages": len(pipe.plan.stages),
            "peak_allocated_GiB": torch.cuda.max_memory_allocated() / GiB,
            # the plan's estimate for the same (two stages resident): how pessimistic
            # the memory model is decides how many stages a memory cap forces
            "plan_device_memory_GiB": pipe.plan.device_memory_bytes / GiB,
            "compile_s": compile_s,
            "host_rss_growth_GiB": (rss_bytes() - rss0) / GiB,
            "model_GiB": sum(p.numel() * p.element_size() for p in model.parameters()) / GiB,
        }
    finally:
        pipe.close()
        release_memory()


def release_memory() -> None:
    """Between measurements: what one model cached must not shrink the next one's plan."""
    import gc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def attempt(fn: Callable[[], Any]) -> Any:
    """Run one measurement; a failure is recorded as text (it is a result too)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported, and the other sections still run
        release_memory()
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def timed_training(model: nn.Module, batch: int, seq: int, vocab: int, steps: int
                   ) -> dict[str, float] | str:
    """Tokens/s of plain SGD steps on ``model`` (already where it computes), or how it
    ran out of memory."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randint(0, vocab, (batch, seq), device="cuda")
    y = torch.randint(0, vocab, (batch, seq), device="cuda")

    def step() -> None:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    try:
        seconds = median_time(step, repeat=steps)
    except torch.OutOfMemoryError as e:
        return f"out of memory ({str(e).splitlines()[0][:80]})"
    finally:
        torch.cuda.empty_cache()
    return {"tokens_per_s": batch * seq / seconds, "step_s": seconds}


def eager_step(model: nn.Module, batch: int, seq: int, vocab: int, steps: int
               ) -> dict[str, float] | str:
    try:
        return timed_training(model.cuda(), batch, seq, vocab, steps)
    except torch.OutOfMemoryError as e:  # moving the model itself did not fit
        return f"out of memory ({str(e).splitlines()[0][:80]})"
    finally:
        model.cpu()
        torch.cuda.empty_cache()


def fsdp2_offload_step(model: nn.Module, batch: int, seq: int, vocab: int, steps: int
                       ) -> dict[str, float] | str:
    """FSDP2 on one GPU with parameters, gradients and optimizer state offloaded to the
    CPU (``CPUOffloadPolicy``), each decoder layer its own unit."""
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    except ImportError as e:
        return f"unavailable ({e})"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    return timed_training(model, batch, seq, vocab, steps)


def logical_devices_agree(vocab: int, count: int) -> bool:
    """One call on ``["cuda:0"]`` against ``["cuda:0"] * count``: loss and every master's
    gradient bit for bit."""
    import roundpipe
    from roundpipe import RoundPipeRunConfig
    x = torch.randint(0, vocab, (8, 2048), generator=torch.Generator().manual_seed(1))
    results = []
    for devices in (["cuda:0"], ["cuda:0"] * count):
        torch.manual_seed(0)
        model = Llama(vocab, 512, 4, 4, 1408).to(torch.bfloat16)
        pipe = roundpipe.compile(model, (x,), optim_dtype=torch.float32, devices=devices,
                                 model_run_config=RoundPipeRunConfig(num_microbatch=4))
        loss = pipe.forward_backward(input_args=(x,), label=x, loss_fn=lm_loss)
        results.append((loss, [p.grad.clone() for p in pipe.optim_parameters()]))
        pipe.close()
    (l1, g1), (l2, g2) = results
    return bool(torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2)))


SECTIONS = ("machine", "pinning", "sweep", "capped", "fits", "compiled", "logical", "fsdp3b",
            "largest")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    parser.add_argument("--largest", action="store_true",
                        help="also try ~3B and ~7B Llama shapes under the 24 GiB cap")
    parser.add_argument("--sections", default=",".join(SECTIONS[:-1]),
                        help=f"comma-separated subset of {','.join(SECTIONS)}, so a run can "
                             "be split over several commands; results are merged into the "
                             "JSON file")
    args = parser.parse_args()
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    if args.largest:
        sections.add("largest")
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        print("bench/gpu.py: skipped, no CUDA device is visible")
        return 0
    from tabulate import tabulate
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(0)
    total = torch.cuda.get_device_properties(0).total_memory
    steps = 3 if args.quick else 5
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"gpu-{name.replace(' ', '_')}{'-quick' if args.quick else ''}"
                                 ".json")
    results: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    results.update({"device": name, "count": torch.cuda.device_count(),
                    "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__})

    def save(key: str, value: Any) -> None:  # after every section: a crash keeps the rest
        results[key] = value
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {key} to {path}", flush=True)

    cell = lambda v: v if isinstance(v, str) else f"{v['tokens_per_s']:,.0f}"  # noqa: E731
    vocab = 32000
    cap = min(1.0, 24 * GiB / total)

    if "machine" in sections:
        pinned, pageable, rate = copy_bandwidth(True), copy_bandwidth(False), matmul_rate()
        crossover = rate * 1e12 / (pinned * 1e9)  # tokens: 2*P*T flops vs 2*P bytes (bf16)
        save("machine", {"pinned_GBps": pinned, "pageable_GBps": pageable,
                         "bf16_TFLOPs": rate, "crossover_tokens": crossover})
        print(tabulate([[name, f"{pinned:.1f}", f"{pageable:.1f}", f"{rate:.0f}",
                         f"{crossover:,.0f}"]],
                       headers=["device", "pinned H2D GB/s", "pageable GB/s", "bf16 TFLOP/s",
                                "crossover tokens/mb"]))
        release_memory()

    if "pinning" in sections:
        # What each pin_memory mode costs: host memory (fp32 masters and the optimizer's
        # own state included, alike in every mode), set-up time and upload speed.
        rows = []
        # A throwaway run first: the first export and the CUDA context's start must not
        # land on whichever mode is measured first.
        attempt(lambda: roundpipe_step(Llama(vocab, 256, 2, 4, 704).to(torch.bfloat16),
                                       2, 256, vocab, 2, 1))
        for mode in ("off", "register", "alloc"):
            model = Llama(vocab, 2048, 4 if args.quick else 8, 16, 5632).to(torch.bfloat16)
            r = attempt(lambda: roundpipe_step(model, 8, 2048, vocab,
                                               torch.cuda.device_count() + 1, steps, mode))
            del model
            release_memory()
            rows.append({"pin_memory": mode, **({"error": r} if isinstance(r, str) else r)})
            save("pinning", rows)
        print(tabulate([[r["pin_memory"], r.get("error") or f"{r['tokens_per_s']:,.0f}",
                         f"{r.get('upload_GBps', 0):.1f}", f"{r.get('compile_s', 0):.1f}",
                         f"{r.get('host_rss_growth_GiB', 0):.2f}",
                         f"{r.get('model_GiB', 0):.2f}"] for r in rows],
                       headers=["pin_memory", "tokens/s", "upload GB/s", "compile s",
                                "host RSS growth GiB", "model GiB"]))

    if "sweep" in sections:
        d, layers, heads, ffn = (1024, 8, 8, 2816) if args.quick else (2048, 16, 16, 5632)
        sweep = []
        for tokens in ([2048, 8192] if args.quick else [2048, 8192, 16384, 32768]):
            seq = 2048
            num_mb = torch.cuda.device_count() + 1
            batch = max(num_mb, tokens * num_mb // seq)
            model = Llama(vocab, d, layers, heads, ffn).to(torch.bfloat16)
            r = attempt(lambda: roundpipe_step(model, batch, seq, vocab, num_mb, steps))
            del model
            if isinstance(r, str):
                r = {"error": r}
            r["tokens_per_microbatch"] = batch * seq // num_mb
            sweep.append(r)
            save("sweep", sweep)
        print(tabulate([[r["tokens_per_microbatch"], r.get("error") or
                         f"{r['tokens_per_s']:,.0f}", f"{r.get('busy_fraction', 0):.2f}",
                         f"{r.get('upload_GBps', 0):.1f}", r.get("stages")] for r in sweep],
                       headers=["tokens/mb", "tokens/s", "GPU busy", "upload GB/s", "stages"]))

    if "capped" in sections:
        # A ~1.3B model under a 24 GiB cap: eager should not fit, roundpipe should train.
        torch.cuda.set_per_process_memory_fraction(cap, 0)
        big = (2048, 24, 16, 5632) if not args.quick else (2048, 8, 16, 5632)
        seq, batch = 2048, 8
        model = Llama(vocab, *big).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        eager = eager_step(model, batch, seq, vocab, steps)
        release_memory()
        rp = attempt(lambda: roundpipe_step(model, batch, seq, vocab,
                                            torch.cuda.device_count() + 1, steps))
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        del model
        save("capped", {"params": params, "cap_GiB": cap * total / GiB, "eager": eager,
                        "roundpipe": rp})
        print(tabulate([[f"{params / 1e9:.2f} B", f"{cap * total / GiB:.0f} GiB",
                         cell(eager), cell(rp),
                         "" if isinstance(rp, str) else f"{rp['busy_fraction']:.2f}"]],
                       headers=["model", "memory cap", "eager tok/s", "roundpipe tok/s",
                                "GPU busy"]))

    if "fits" in sections:
        # A model that fits: roundpipe against eager and FSDP2 with CPU offload.
        fits = lambda: Llama(vocab, 1024, 12, 8, 2816).to(torch.bfloat16)  # noqa: E731
        e = attempt(lambda: eager_step(fits(), 8, 2048, vocab, steps))
        release_memory()
        f = attempt(lambda: fsdp2_offload_step(fits(), 8, 2048, vocab, steps))
        release_memory()
        r = attempt(lambda: roundpipe_step(fits(), 8, 2048, vocab,
                                           torch.cuda.device_count() + 1, steps))
        save("fits", {"eager": e, "fsdp2_cpu_offload": f, "roundpipe": r})
        print(tabulate([[cell(e), cell(f), cell(r)]],
                       headers=["eager tok/s", "FSDP2 + CPUOffload tok/s", "roundpipe tok/s"]))

    if "compiled" in sections:
        # compile_units: the unit programs through inductor, against the traced programs,
        # on the model that fits (launch-bound at 2,048 tokens per microbatch) and at 8,192.
        rows = []
        for tokens in (2048, 8192, 16384):
            num_mb = torch.cuda.device_count() + 1
            batch = max(num_mb, tokens * num_mb // 2048)
            row: dict[str, Any] = {"tokens_per_microbatch": tokens}
            for compile_units in (False, True):
                model = Llama(vocab, 1024, 12, 8, 2816).to(torch.bfloat16)
                r = attempt(lambda: roundpipe_step(model, batch, 2048, vocab, num_mb, steps,
                                                   compile_units=compile_units))
                del model
                row["compiled" if compile_units else "traced"] = r
            rows.append(row)
            save("compiled", rows)
        print(tabulate([[r["tokens_per_microbatch"], cell(r["traced"]), cell(r["compiled"]),
                         "" if isinstance(r["compiled"], str)
                         else f"{r['compiled']['busy_fraction']:.2f}"] for r in rows],
                       headers=["tokens/mb", "traced tok/s", "compile_units tok/s",
                                "GPU busy (compiled)"]))

    if "logical" in sections:
        # Two logical devices on one GPU: the multi-device schedule on real hardware.
        agree = attempt(lambda: logical_devices_agree(vocab, 2))
        rows = []
        for devices in (["cuda:0"], ["cuda:0"] * 2):
            model = Llama(vocab, 1024, 12, 8, 2816).to(torch.bfloat16)
            r = attempt(lambda: roundpipe_step(model, 8, 2048, vocab, len(devices) + 1, steps,
                                               devices=devices))
            del model
            release_memory()
            rows.append({"devices": devices, **({"error": r} if isinstance(r, str) else r)})
        save("logical", {"bitwise_equal": agree, "runs": rows})
        print(f"two logical devices on cuda:0 bitwise equal to one: {agree}")
        print(tabulate([[len(r["devices"]), r.get("error") or f"{r['tokens_per_s']:,.0f}",
                         r.get("stages")] for r in rows],
                       headers=["logical devices", "tokens/s", "stages"]))

    if "fsdp3b" in sections:
        # The closest peer on a model that does not fit eagerly: FSDP2 with CPU offload
        # (whole GPU, no cap) against roundpipe (24 GiB cap), same 16,384 tokens per step.
        shape = (3072, 26, 24, 8192)
        model = Llama(vocab, *shape).to(torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        f = attempt(lambda: fsdp2_offload_step(model, 8, 2048, vocab, 3))
        del model
        release_memory()
        torch.cuda.set_per_process_memory_fraction(cap, 0)
        model = Llama(vocab, *shape).to(torch.bfloat16)
        r = attempt(lambda: roundpipe_step(model, 8, 2048, vocab,
                                           torch.cuda.device_count() + 1, 3))
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        del model
        release_memory()
        save("fsdp3b", {"params": n, "fsdp2_cpu_offload": f, "roundpipe": r})
        print(tabulate([[f"{n / 1e9:.2f} B", cell(f), cell(r)]],
                       headers=["model", "FSDP2 + CPUOffload tok/s (no cap)",
                                "roundpipe tok/s (24 GiB cap)"]))

    if "largest" in sections:
        torch.cuda.set_per_process_memory_fraction(cap, 0)
        largest = []
        for label, shape in (("~3B", (3072, 26, 24, 8192)), ("~7B", (4096, 32, 32, 11008))):
            model = Llama(vocab, *shape).to(torch.bfloat16)
            n = sum(p.numel() for p in model.parameters())
            rp = attempt(lambda: roundpipe_step(model, 8, 2048, vocab,
                                                torch.cuda.device_count() + 1, 2))
            largest.append([label, f"{n / 1e9:.2f} B", cell(rp)])
            del model
            release_memory()
            save("largest", largest)
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        print(tabulate(largest, headers=["shape", "params", "roundpipe tok/s under 24 GiB"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
