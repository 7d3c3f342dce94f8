"""Where a roundpipe training step spends its time on a GPU (skipped without CUDA).

Run: ``python bench/gpu_profile.py [--out DIR]`` (``--smoke``: the same path at tiny sizes
on two virtual CPU devices, no profiler).  For the Llama-shaped model of
``bench/gpu.py``'s "fits" section it prints, for a few microbatch counts:

- the step split into ``forward_backward`` and the optimizer (each waited for alone);
- the job timeline of one call (start, end, and idle gap before each job per device);
- the profiler's top CPU and CUDA operators of one step;

and writes the Chrome traces (roundpipe's job timeline and the profiler's) to ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import PHASES, Llama, add_smoke_flag, instrument, lm_loss  # noqa: E402
from benchutil import cuda_median_time as timed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/profile")
    parser.add_argument("--mbs", default="2,4")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--grain", default="stage")
    parser.add_argument("--profile", action="store_true", help="also run torch.profiler")
    parser.add_argument("--only-step", action="store_true",
                        help="only time the overlapped step (7 repeats), for A/B runs")
    add_smoke_flag(parser)
    args = parser.parse_args()
    devices = None  # roundpipe's default: every visible GPU
    if args.smoke:  # the CPU path: tiny sizes on two virtual CPU devices, no profiler
        import tempfile
        args.out, args.mbs, args.layers, args.width = tempfile.mkdtemp(), "2", 2, 128
        args.batch, args.seq, args.profile, devices = 4, 16, False, ["cpu"] * 2
    elif not torch.cuda.is_available():
        print("bench/gpu_profile.py: skipped, no CUDA device is visible")
        return 0
    import roundpipe
    from roundpipe import RoundPipeRunConfig
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(args.out, exist_ok=True)
    instrument()
    vocab = 64 if args.smoke else 32000
    torch.manual_seed(0)
    x = torch.randint(0, vocab, (args.batch, args.seq))
    y = torch.randint(0, vocab, (args.batch, args.seq))
    for num_mb in [int(v) for v in args.mbs.split(",")]:
        model = Llama(vocab, args.width, args.layers, args.width // 128, args.width * 11 // 4
                      ).to(torch.bfloat16)
        cfg = RoundPipeRunConfig(num_microbatch=num_mb, recompute_grain=args.grain)
        pipe = roundpipe.compile(model, (x,), optim_dtype=torch.float32, devices=devices,
                                 model_run_config=cfg)
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-4)
        fb = lambda: pipe.forward_backward(input_args=(x,), label=y, loss_fn=lm_loss)  # noqa
        opt_step = lambda: pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)  # noqa

        def both() -> None:
            fb()
            pipe.step(lambda: (opt.step(), opt.zero_grad()))

        for _ in range(2):
            both()
        pipe.synchronize()
        if args.only_step:
            t_both = timed(both, repeat=7)
            pipe.synchronize()
            print(f"=== step {t_both * 1e3:.1f} ms ({args.batch * args.seq / t_both:,.0f} "
                  f"tok/s), microbatches {num_mb}", flush=True)
            pipe.close()
            del pipe, model, opt
            torch.cuda.empty_cache()
            continue
        t_fb = timed(lambda: (fb(), pipe.synchronize()))
        t_opt = timed(opt_step)
        t_both = timed(both)
        pipe.synchronize()
        tokens = args.batch * args.seq
        print(f"\n=== microbatches {num_mb}, stages {len(pipe.plan.stages)}, grain "
              f"{args.grain}: forward_backward {t_fb * 1e3:.1f} ms, optimizer "
              f"{t_opt * 1e3:.1f} ms, overlapped step {t_both * 1e3:.1f} ms "
              f"({tokens / t_both:,.0f} tok/s)", flush=True)
        PHASES.clear()
        for _ in range(3):
            both()
        pipe.synchronize()
        for key, values in sorted(PHASES.items()):
            print(f"  {key:36s} calls {len(values):3d} median {statistics.median(values) * 1e3:8.1f} ms")
        fb()
        stats = pipe.stats()
        print(f"wall {stats.wall_s * 1e3:.1f} ms, uploaded {stats.bytes_uploaded / 1e9:.2f} GB, "
              f"downloaded {stats.bytes_downloaded / 1e9:.2f} GB")
        last_end: dict[str, float] = {}
        for r in stats.timeline:
            gap = r.start_s - last_end.get(r.device, 0.0)
            last_end[r.device] = r.end_s
            mbs = " ".join(f"{(e - s) * 1e3:.1f}" for s, e in r.microbatch_s)
            print(f"  job {r.job:3d} {r.device:8s} stage {r.stage:2d} {r.kind:5s} "
                  f"start {r.start_s * 1e3:7.1f} end {r.end_s * 1e3:7.1f} gap {gap * 1e3:6.1f}"
                  f" weights_req {(r.weights_requested_s or 0) * 1e3:7.1f} | mb ms {mbs}")
        pipe.timeline(os.path.join(args.out, f"timeline-mb{num_mb}.json"))
        print(pipe.plan)
        if args.profile:
            pipe.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                both()
                pipe.synchronize()
                torch.cuda.synchronize()
            avg = prof.key_averages()
            print(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
            print(avg.table(sort_by="self_cuda_time_total", row_limit=20,
                            max_name_column_width=50))
            path = os.path.join(args.out, f"profile-mb{num_mb}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                g.write(f.read())
            os.remove(path)
        pipe.close()
        del pipe, model, opt
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
