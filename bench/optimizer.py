"""CPU optimizer-step throughput of roundpipe's asynchronous step path.

Run ``python bench/optimizer.py [--width 2048] [--layers 8] [--repeats 5]``.

Reports parameters per second for:

* ``torch.optim.AdamW(fused=True)`` stepping the parameters directly;
* roundpipe's async step path: ``pipe.step(lambda: (opt.step(), opt.zero_grad()))`` with
  fp32 masters, which also publishes the masters into the model weights (one extra copy);
* the memory-bandwidth roofline: measured streaming bandwidth (best of a copy and an add)
  over the 28 bytes AdamW moves per parameter.

It also reports how long the next ``forward_backward`` waits for a pending step: its time
right after an async step against its time with no step pending; and the host's work per
step for a bf16 model with fp32 masters, in seconds per billion parameters, phase by phase
(landing: bf16 gradient -> fp32 ``.grad``; update: fused AdamW; publish: fp32 masters ->
bf16 weights) against ``roundpipe.optim``'s one pass (update reading the landed bf16
gradient; the same publish), against the one-pass
roofline: bytes per parameter over the STREAM-triad bandwidth measured in the same run
with all threads.  ``--host-only`` runs just that table.

Last, the disk tier (``offload_dir``, ``--disk-only`` runs just this): the exact step
``pipe.step(opt)`` with ``roundpipe.optim.AdamW`` on fp32 masters of a bf16 model, in
seconds per billion parameters, in host memory and with the tier (page cache dropped
before each step, so reads come from the disk), beside the disk's sequential write and
read bandwidth measured in the same run (4 threads, 8 MiB blocks) by three mechanisms:
``os.pwrite``/``os.preadv``, the same with ``O_DIRECT`` (what the tier uses where the
file system takes it, and the bound's bandwidth), and a memory map.  The goal: the tier's step within 1.25x of its bytes over the bandwidth.
The VM's disk is shared and its bandwidth drifts, so each timed tier step is also held
against the ``O_DIRECT`` bandwidth measured just before it (the same bytes each way).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402
from benchutil import add_smoke_flag, apply_smoke  # noqa: E402


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best of a copy (2 streams) and an add (3 streams), in bytes moved per second.

    Write-allocate traffic is not counted, so this is what streaming code achieves, the
    figure AdamW's 28 bytes per parameter should be divided into."""
    a, b, c = (torch.rand(nbytes // 4) for _ in range(3))
    best = 0.0
    for streams, op in ((2, lambda: c.copy_(a)), (3, lambda: torch.add(a, b, out=c))):
        op()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            op()
            times.append(time.perf_counter() - t)
        best = max(best, streams * nbytes / statistics.median(times))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host-only", action="store_true")
    parser.add_argument("--disk-only", action="store_true",
                        help="only the disk tier's step against the disk's bandwidth")
    parser.add_argument("--disk-dir", default=None,
                        help="where the disk tier's files go (default: a temporary dir)")
    parser.add_argument("--disk-width", type=int, default=4096)
    parser.add_argument("--disk-layers", type=int, default=16)
    # Not options: the sizes of the measurements beside the model's (a bandwidth's
    # buffers, the smallest disk-bandwidth file, the idle reference of gil_share), set
    # here so that --smoke can shrink them.
    parser.set_defaults(bandwidth_mib=256, disk_min_mib=64, idle_s=0.5)
    add_smoke_flag(parser)
    args = apply_smoke(parser.parse_args(), width=128, layers=2, repeats=1, disk_width=256,
                       disk_layers=4, bandwidth_mib=4, disk_min_mib=8, idle_s=0.02)
    if args.disk_only:
        import tempfile
        disk_tier(args.disk_width, args.disk_layers, args.repeats,
                  args.disk_dir or tempfile.gettempdir(), args.disk_min_mib << 20)
        return
    if args.host_only:
        host_step(args.width * args.width * args.layers, args.repeats,
                  bandwidth_bytes=args.bandwidth_mib << 20, idle_s=args.idle_s)
        return
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, args.width)

    # Eager fused AdamW on the parameters themselves, and roundpipe's step on the
    # optimizer thread (publish + fused AdamW on the masters), interleaved round by round.
    eager = copy.deepcopy(model)
    for p in eager.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-4, fused=True)
    opt.step()
    pipe = RoundPipe(model, devices=["cpu"], optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    popt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-4, fused=True)
    call = dict(input_args=(x,), label=torch.zeros(4, args.width), loss_fn=F.mse_loss)
    pipe.forward_backward(**call)
    pipe.step(lambda: popt.step(), is_async=False)
    eager_s, step_s, fb_alone, fb_after = [], [], [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        opt.step()
        eager_s.append(time.perf_counter() - t)
        pipe.synchronize()
        t = time.perf_counter()
        pipe.forward_backward(**call)
        fb_alone.append(time.perf_counter() - t)
        t = time.perf_counter()
        pipe.step(lambda: popt.step())  # async: publish previous masters, then step
        pipe.synchronize()             # also publishes the new masters
        step_s.append(time.perf_counter() - t)
        pipe.step(lambda: popt.step())
        t = time.perf_counter()
        pipe.forward_backward(**call)  # overlaps the step; waits for it before committing
        fb_after.append(time.perf_counter() - t)
    pipe.synchronize()
    pipe.close()

    roofline = memory_bandwidth(args.bandwidth_mib << 20) / 28
    med = statistics.median
    rows = [
        ["torch.optim.AdamW(fused=True)", f"{n / med(eager_s) / 1e9:.3f}",
         f"{n / med(eager_s) / roofline:.2f}"],
        ["roundpipe async step (+ publish)", f"{n / med(step_s) / 1e9:.3f}",
         f"{n / med(step_s) / roofline:.2f}"],
        ["roofline (memory bandwidth / 28 B)", f"{roofline / 1e9:.3f}", "1.00"],
    ]
    print(f"{n / 1e6:.1f} M fp32 parameters, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print(tabulate(rows, headers=["step", "Gparam/s", "/ roofline"]))
    waits = [(a - b) * 1e3 for a, b in zip(fb_after, fb_alone)]
    print(tabulate([[f"{med(fb_alone) * 1e3:.1f}", f"{med(fb_after) * 1e3:.1f}",
                     f"{med(waits):.1f} ({min(waits):.1f} to {max(waits):.1f})"]],
                   headers=["forward_backward ms (no step pending)",
                            "ms (async step pending)", "difference ms (spread)"]))
    grad_landing(n, args.repeats)
    host_step(n, args.repeats, bandwidth_bytes=args.bandwidth_mib << 20, idle_s=args.idle_s)
    import tempfile
    disk_tier(args.disk_width, args.disk_layers, args.repeats,
              args.disk_dir or tempfile.gettempdir(), args.disk_min_mib << 20)


def triad_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """STREAM triad ``a = b + s * c`` (3 streams) with every thread, in bytes per second."""
    a, b, c = (torch.rand(nbytes // 4) for _ in range(3))
    torch.add(b, c, alpha=3.0, out=a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - t)
    return 3 * nbytes / statistics.median(times)


def _one_pass_work(n: int, weight: torch.Tensor, landed: torch.Tensor, kind: str,
                   kernel: str):
    """roundpipe.optim's step on one flat master, as its optimizers run it on a pipe's
    masters (``step_pairs``, their documented entry point for this: the native loop, or
    torch's fused kernel through cache-sized scratch, reads the bf16 gradient where it
    landed); publishing converts the master."""
    import roundpipe.optim
    master = torch.nn.Parameter(weight.float())
    grad = landed.clone()
    if kind == "sgd":
        opt = roundpipe.optim.SGD([master], lr=1e-4, momentum=0.9, kernel=kernel)
    else:
        opt = roundpipe.optim.AdamW([master], lr=1e-4, kernel=kernel, state_dtype=(
            torch.float32 if kind == "adamw" else torch.bfloat16))
    return {"refill": lambda: grad.copy_(landed),
            "update": lambda: opt.step_pairs([(master, grad)]),
            "publish": lambda: weight.copy_(master.detach())}


def gil_share(fn: Callable[[], object], repeats: int = 3, idle_s: float = 0.5) -> float:
    """How much Python another thread runs while ``fn`` runs, against while the caller
    sleeps: near 1 when ``fn`` releases the GIL (torch's kernels), near 0 when it holds it
    (the pipeline's threads that launch GPU work would stall)."""
    def count(seconds_or_fn: object) -> float:
        stop, out = threading.Event(), []

        def spin() -> None:
            c = 0
            while not stop.is_set():
                c += 1
            out.append(c)
        thread = threading.Thread(target=spin)
        thread.start()
        t = time.perf_counter()
        if callable(seconds_or_fn):
            for _ in range(repeats):
                seconds_or_fn()
        else:
            time.sleep(seconds_or_fn)
        elapsed = time.perf_counter() - t
        stop.set()
        thread.join()
        return out[0] / elapsed
    busy = count(fn)
    return busy / count(idle_s)


def host_step(n: int, repeats: int, kernels: tuple[str, ...] = ("native", "fused"),
              bandwidth_bytes: int = 256 * 2**20, idle_s: float = 0.5) -> None:
    """The host's work per step (bf16 model, fp32 masters), phase by phase: torch's path
    (three passes: landing bf16 -> fp32 .grad, fused AdamW, publish fp32 -> bf16) against
    roundpipe.optim's (one pass that reads the landed bf16 gradient, then the same
    publish; with the native kernel and with torch's fused one through scratch),
    interleaved round by round, against the one-pass
    roofline: bytes per parameter (28 AdamW, 20 AdamW with bf16 state, 12 SGD with
    momentum) over the STREAM-triad bandwidth measured in the same run."""
    weight = torch.randn(n).to(torch.bfloat16)
    landed = torch.randn(n).to(torch.bfloat16) * 1e-3  # a downloaded bf16 gradient
    master = torch.nn.Parameter(weight.float())
    master.grad = torch.empty(n)
    opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
    master.grad.copy_(landed)
    opt.step()
    paths = {"torch AdamW (fused)": {"landing": lambda: master.grad.copy_(landed),
                                     "update": opt.step,
                                     "publish": lambda: weight.copy_(master.detach())}}
    bytes_per_param = {"torch AdamW (fused)": 28}
    for kind, label, nbytes in (("adamw", "roundpipe.optim.AdamW", 28),
                                ("adamw-bf16", "roundpipe.optim.AdamW(state_dtype=bf16)", 20),
                                ("sgd", "roundpipe.optim.SGD(momentum)", 12)):
        for kernel in kernels:
            work = _one_pass_work(n, weight, landed, kind, kernel)
            for _ in range(2):  # build, warm
                work["refill"]()
                work["update"]()
            paths[f"{label}, {kernel}"] = work
            bytes_per_param[f"{label}, {kernel}"] = nbytes
    gil = {label: gil_share(work["update"], idle_s=idle_s) for label, work in paths.items()}
    times: dict[str, dict[str, list[float]]] = {k: {} for k in paths}
    for _ in range(repeats):
        for label, work in paths.items():
            for phase, fn in work.items():
                if phase == "refill":  # the next call's download: not host step work
                    fn()
                    continue
                t = time.perf_counter()
                fn()
                times[label].setdefault(phase, []).append(time.perf_counter() - t)
    bandwidth = triad_bandwidth(bandwidth_bytes)
    per_b = 1e9 / n
    rows = []
    old_total = None
    torch_phases = times["torch AdamW (fused)"]
    torch_totals = [sum(p[i] for p in torch_phases.values()) for i in range(repeats)]
    for label, phases in times.items():
        med = {k: statistics.median(v) * per_b for k, v in phases.items()}
        total = sum(med.values())
        if old_total is None:
            old_total = total
        roofline = bytes_per_param[label] * 1e9 / bandwidth
        # the same ratio round by round (each round runs every path once, in turn), so a
        # slow spell of the VM shows as spread rather than skewing one path's median
        totals = [sum(p[i] for p in phases.values()) for i in range(repeats)]
        ratios = sorted(o / t for o, t in zip(torch_totals, totals))
        rows.append([label, f"{med.get('landing', 0.0):.2f}", f"{med['update']:.2f}",
                     f"{med['publish']:.2f}", f"{total:.2f}", f"{roofline:.2f}",
                     f"{roofline / total:.2f}", f"{old_total / total:.2f}",
                     f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})",
                     f"{gil[label]:.2f}"])
    print(f"host step, bf16 model with fp32 masters, {n / 1e6:.1f} M parameters, triad "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s with {torch.get_num_threads()} threads, "
          f"median of {repeats}, seconds per billion parameters")
    print(tabulate(rows, headers=["path", "landing", "update", "publish", "total",
                                  "roofline", "roofline / total", "speed-up vs torch",
                                  "per round: median (range)",
                                  "other thread's Python during update"]))


def grad_landing(n: int, repeats: int) -> None:
    """What converting a bf16 gradient into an fp32 ``.grad`` costs in memory the allocator
    hands out fresh (page-faulted on first write) against memory reused from the last call
    (what roundpipe's GradLanding does), interleaved."""
    src = torch.randn(n).to(torch.bfloat16)
    reused = src.to(torch.float32)
    fresh_s, reused_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        out = src.to(torch.float32, copy=True)
        fresh_s.append(time.perf_counter() - t)
        del out
        t = time.perf_counter()
        reused.copy_(src)
        reused_s.append(time.perf_counter() - t)
    ratios = [a / b for a, b in zip(fresh_s, reused_s)]
    print(tabulate([[f"{statistics.median(fresh_s) * 1e3:.1f}",
                     f"{statistics.median(reused_s) * 1e3:.1f}",
                     f"{statistics.median(ratios):.1f} ({min(ratios):.1f}-{max(ratios):.1f})"]],
                   headers=[f"bf16 -> fp32 .grad, {n / 1e6:.1f} M: fresh memory ms",
                            "reused memory ms", "fresh / reused (spread)"]))


# --- the disk tier (offload_dir) ------------------------------------------------------------

def _drop_cache(path: str) -> None:
    """Evict a file's clean pages from the page cache, so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _parallel(jobs: list[Callable[[], object]], threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()


def disk_bandwidth(directory: str, nbytes: int, threads: int = 4,
                   block: int = 8 << 20, direct_only: bool = False
                   ) -> dict[str, tuple[float, float]]:
    """Sequential write and read bandwidth (bytes/s) of ``directory``'s disk, by
    mechanism: os.pwrite/os.preadv from threads into one reused buffer per thread (what
    the tier uses), the same with O_DIRECT, and a shared memory map (copy in, msync;
    copy out).  Each write ends with fdatasync; the page cache is dropped before reads.
    ``direct_only``: only O_DIRECT (what the tier uses)."""
    import ctypes
    import mmap
    path = os.path.join(directory, "bandwidth.bin")
    nbytes = max(block, nbytes // block * block)
    blocks = nbytes // block
    out: dict[str, tuple[float, float]] = {}
    # page-aligned reused buffers (mmap'd anonymous memory), filled with data
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]
    for b in buffers:
        b.write(os.urandom(1 << 16) * (block >> 16))

    def run(flags: int) -> tuple[float, float]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)

            def writer(t: int) -> Callable[[], None]:
                def go() -> None:
                    for i in range(t, blocks, threads):
                        os.pwrite(fd, buffers[t], i * block)
                return go

            def reader(t: int) -> Callable[[], None]:
                def go() -> None:
                    for i in range(t, blocks, threads):
                        os.preadv(fd, [buffers[t]], i * block)
                return go
            t0 = time.perf_counter()
            _parallel([writer(t) for t in range(threads)], threads)
            os.fdatasync(fd)
            w = nbytes / (time.perf_counter() - t0)
            _drop_cache(path)
            t0 = time.perf_counter()
            _parallel([reader(t) for t in range(threads)], threads)
            r = nbytes / (time.perf_counter() - t0)
            return w, r
        finally:
            os.close(fd)
            os.unlink(path)

    if not direct_only:
        out["pwrite/preadv, threads"] = run(0)
    try:
        out["O_DIRECT, threads"] = run(os.O_DIRECT)
    except OSError as e:  # tmpfs and some file systems refuse O_DIRECT
        if direct_only:
            return {"pwrite/preadv, threads": run(0)}
        print(f"O_DIRECT not available here: {e}")
    if direct_only:
        return out
    # memory map: copy each block in (then msync), copy out after dropping the cache
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        m = mmap.mmap(fd, nbytes)
        src = torch.frombuffer(buffers[0], dtype=torch.uint8)
        view = torch.frombuffer(m, dtype=torch.uint8)

        def copy_in(t: int) -> Callable[[], None]:
            return lambda: [view[i * block:(i + 1) * block].copy_(src)
                            for i in range(t, blocks, threads)]
        t0 = time.perf_counter()
        _parallel([copy_in(t) for t in range(threads)], threads)
        m.flush()
        w = nbytes / (time.perf_counter() - t0)
        _drop_cache(path)
        dst = [torch.empty(block, dtype=torch.uint8) for _ in range(threads)]

        def copy_out(t: int) -> Callable[[], None]:
            return lambda: [dst[t].copy_(view[i * block:(i + 1) * block])
                            for i in range(t, blocks, threads)]
        t0 = time.perf_counter()
        _parallel([copy_out(t) for t in range(threads)], threads)
        out["mmap, threads"] = (w, nbytes / (time.perf_counter() - t0))
        del view, src
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)
    del ctypes
    return out


def disk_tier(width: int, layers: int, repeats: int, directory: str,
              min_bytes: int = 64 << 20) -> None:
    """The disk tier's exact step (pipe.step(opt): AdamW, fp32 masters of a bf16 model,
    fp32 moments) in seconds per billion parameters, beside the same step in host memory
    and the disk's own bandwidth measured here; the page cache is dropped before each
    timed step, so the reads come from the disk."""
    import tempfile
    import roundpipe
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, dtype=torch.bfloat16)
                            for _ in range(layers)])
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, width, dtype=torch.bfloat16)
    call = dict(input_args=(x,), loss_fn=lambda out, _: out.float().square().mean())
    bandwidth = disk_bandwidth(directory, max(min_bytes, 12 * n), threads=4)
    times: dict[str, list[float]] = {}
    moved = 0
    # The VM's disk is shared: its bandwidth drifts within minutes.  So each timed tier
    # step is also held against the bandwidth measured just before it (the same bytes).
    adjacent: list[float] = []
    for tier in (False, True):
        with tempfile.TemporaryDirectory(dir=directory) as d:
            pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float32,
                             model_run_config=RoundPipeRunConfig(num_microbatch=1),
                             offload_dir=os.path.join(d, "tier") if tier else None)
            opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-4)
            key = "disk tier" if tier else "host memory"
            times[key] = []
            for i in range(repeats + 1):
                pipe.forward_backward(**call)
                pipe.synchronize()
                stats = pipe.offload_stats()
                if stats is not None and i:
                    (w, r), = disk_bandwidth(directory, 12 * n, threads=4,
                                             direct_only=True).values()
                    adjacent.append(12 * n / r + 12 * n / w)
                if stats is not None:
                    _drop_cache(os.path.join(stats.directory, "data.bin"))
                    before = stats.bytes_read + stats.bytes_written
                t = time.perf_counter()
                pipe.step(opt)
                pipe.synchronize()
                if i:  # the first step allocates the state
                    times[key].append(time.perf_counter() - t)
                    if stats is not None:
                        stats = pipe.offload_stats()
                        moved = stats.bytes_read + stats.bytes_written - before
            pipe.close()
    med = statistics.median
    # the mechanism the tier uses: O_DIRECT where the file system takes it
    write_bw, read_bw = bandwidth.get("O_DIRECT, threads",
                                      bandwidth["pwrite/preadv, threads"])
    # the tier reads and writes the same bytes: half the traffic each way
    bound = moved / 2 / read_bw + moved / 2 / write_bw
    print(f"\ndisk tier: {n / 1e6:.1f} M parameters, {moved / n:.1f} B/param moved per "
          f"step, files in {directory}, median of {repeats}")
    print(tabulate([[m, f"{w / 1e9:.2f}", f"{r / 1e9:.2f}"] for m, (w, r) in bandwidth.items()],
                   headers=["disk I/O (4 threads, 8 MiB blocks)", "write GB/s", "read GB/s"]))
    rows = [[k, f"{med(v) / n * 1e9:.2f}"] for k, v in times.items()]
    rows.append(["bytes moved / disk bandwidth", f"{bound / n * 1e9:.2f}"])
    print(tabulate(rows, headers=["exact step (pipe.step(opt))", "s per B params"]))
    print(f"disk tier step / I/O bound: {med(times['disk tier']) / bound:.2f}")
    ratios = [t / b for t, b in zip(times["disk tier"], adjacent)]
    print(f"disk tier step / I/O bound measured just before it: {med(ratios):.2f} "
          f"({', '.join(f'{x:.2f}' for x in ratios)}; bound {med(adjacent) / n * 1e9:.2f} "
          f"s per B params)")


if __name__ == "__main__":
    main()
