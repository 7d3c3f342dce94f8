"""Host memory: the process's resident-set growth against ``RoundPipe.host_memory()``.

Run ``python bench/host_memory.py [--params-millions 500] [--configs bf16-fp32-adamw,...]``.

Each configuration runs in a fresh process (so one's freed memory is not the next one's
baseline): it builds a stack of square linear layers of about ``--params-millions``
parameters, trains ``--steps`` steps on one virtual CPU device and then reads

* the resident-set growth of the process since before the model was built (``VmRSS``);
* ``pipe.host_memory(optimizer)``: the accounting; and the virtual device's copies at
  the peak of the last call (host memory during calls, freed after; the allocator may
  keep some of it, which then shows in the growth);
* the bytes per trainable parameter beyond the model's weights, per category.

A configuration is ``<model dtype>-<masters dtype or none>-<optimizer>``, optimizers
``sgd`` (momentum 0.9), ``adamw``; ``lora`` trains rank-8 adapters beside frozen weights;
``rpsgd``, ``rpadamw`` and ``rpadamwbf16`` are ``roundpipe.optim.SGD`` / ``AdamW`` (the
last with bf16 moments), stepped asynchronously as in training (so the staged weights of
one step and the next call's gradients hold two landing buffer sets).  ``rpadamwdisk``
is ``roundpipe.optim.AdamW`` with the disk tier (``offload_dir`` under ``--offload-dir``),
stepped exactly unit by unit (``pipe.step(opt)``); ``rpadamwdisklanding`` the same with
``forward_backward(..., step=opt)``, which consumes each unit's gradients as they land
(a window of units held, not the model's).  Their rows also give the process's peak
resident set (``VmHWM``) against the peak the accounting implies (weights, the landed
gradients' measured peak, the staging window's peak, the virtual device's copies at the
peak of a call).  Every row gives the landing buffers' peak during a call
(``host_memory().landing_peak``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
from tabulate import tabulate
from benchutil import add_smoke_flag, apply_smoke, rss_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

CONFIGS = ("fp32-none-sgd", "fp32-none-adamw", "bf16-fp32-sgd", "bf16-fp32-adamw",
           "bf16-fp32-lora", "bf16-fp32-rpsgd", "bf16-fp32-rpadamw", "bf16-fp32-rpadamwbf16",
           "bf16-fp32-rpadamwdisk", "bf16-fp32-rpadamwdisklanding")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "none": None}


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype)
                              * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Stack(nn.Module):
    def __init__(self, width: int, layers: int, dtype: torch.dtype, lora: bool) -> None:
        super().__init__()
        blocks = [nn.Linear(width, width, dtype=dtype) for _ in range(layers)]
        self.blocks = nn.ModuleList(LoRALinear(b) if lora else b for b in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def peak_rss_bytes() -> int:
    """The process's peak resident set (VmHWM); 0 off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_one(config: str, params_millions: int, steps: int, width: int = 4096,
            offload_dir: str | None = None) -> dict:
    import tempfile

    import roundpipe
    from progress import Progress

    model_dtype, master, optim = config.split("-")
    landing = optim.endswith("landing")
    optim = optim.removesuffix("landing")
    disk = optim.endswith("disk")
    layers = max(2, round(params_millions * 1e6 / (width * width + width)))
    base = rss_bytes()
    model = Stack(width, layers, DTYPES[model_dtype], lora=optim == "lora")
    x = torch.randn(4, width, dtype=DTYPES[model_dtype])
    tier = tempfile.mkdtemp(dir=offload_dir) if disk else None
    pipe = roundpipe.RoundPipe(model, devices=["cpu"], optim_dtype=DTYPES[master],
                               model_run_config=roundpipe.RoundPipeRunConfig(
                                   num_microbatch=2),
                               offload_dir=os.path.join(tier, "t") if tier else None)
    params = pipe.optim_parameters()
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=1e-4, momentum=0.9),
           "adamw": lambda: torch.optim.AdamW(params, lr=1e-4),
           "lora": lambda: torch.optim.AdamW(params, lr=1e-4),
           "rpsgd": lambda: roundpipe.optim.SGD(params, lr=1e-4, momentum=0.9),
           "rpadamw": lambda: roundpipe.optim.AdamW(params, lr=1e-4),
           "rpadamwbf16": lambda: roundpipe.optim.AdamW(params, lr=1e-4,
                                                         state_dtype=torch.bfloat16),
           "rpadamwdisk": lambda: roundpipe.optim.AdamW(params, lr=1e-4),
           }[optim]()
    peak_device = peak_landing = 0
    progress = Progress(range(steps), steps, config)
    for _ in progress:
        pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean(),
                              step=opt if landing else None)
        mem = pipe.host_memory()
        peak_device = max(peak_device, sum(d.peak_bytes_last_call for d in mem.devices))
        peak_landing = max(peak_landing, mem.landing_peak)
        if landing:  # the call was the whole step
            pass
        elif disk:
            pipe.step(opt)  # exact, unit by unit: at most three units staged
            pipe.synchronize()
        else:
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        if not optim.startswith("rp"):
            pipe.synchronize()
        progress.show(rss_gib=f"{(rss_bytes() - base) / 2**30:.2f}")
    progress.close()
    # The steady state between calls: the last call's gradients committed, not stepped
    # (stepping as they land, none is held between calls).
    pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().pow(2).mean(),
                          step=opt if landing else None)
    pipe.synchronize()
    grown = rss_bytes() - base
    mem = pipe.host_memory(opt)
    devices = sum(d.peak_bytes_last_call for d in mem.devices)
    result = {"config": config, "params": sum(p.numel() for p in model.parameters()),
              "trainable": mem.trainable_params, "rss_growth": grown,
              "accounted": mem.total, "device_copies": devices,
              "per_param": {c: mem.bytes_per_param(c) for c in
                            ("masters", "gradients", "optimizer_state", "landing")},
              "beyond_weights": mem.bytes_per_param(), "weights": mem.weights,
              "landing_peak": max(peak_landing, mem.landing_peak)}
    if disk:
        store = pipe.offload_stats()
        # the most at once: weights, landed bf16 gradients (their measured peak), the
        # staging window, the device's copies during a call
        landing_peak = result["landing_peak"]
        # stepping as gradients land, the step's staging runs during the call, beside
        # the device's copies (virtual CPU devices: host memory; a GPU's are not)
        during = (store.peak_staged_bytes + peak_device if landing
                  else max(store.peak_staged_bytes, peak_device))
        result.update(peak_rss_growth=peak_rss_bytes() - base,
                      peak_staged=store.peak_staged_bytes, disk=mem.disk_total,
                      accounted_peak=mem.weights + landing_peak + during)
    pipe.close()
    if tier:
        import shutil
        shutil.rmtree(tier, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=int, default=500)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--width", type=int, default=4096, help="of each square layer")
    parser.add_argument("--offload-dir", default=None,
                        help="where rpadamwdisk's files go (default: a temporary dir)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's config
    add_smoke_flag(parser)
    # --smoke: 4 layers of 512 (1 M parameters), its rows cover both tables
    args = apply_smoke(parser.parse_args(), params_millions=1, steps=1, width=512,
                       configs="bf16-fp32-rpadamwdisk")
    if args.one:
        print(json.dumps(run_one(args.one, args.params_millions, args.steps, args.width,
                                 args.offload_dir)))
        return
    rows, disk_rows = [], []
    for config in args.configs.split(","):
        out = subprocess.run(
            [sys.executable, __file__, "--one", config, "--params-millions",
             str(args.params_millions), "--steps", str(args.steps), "--width",
             str(args.width)] + (["--offload-dir", args.offload_dir] if args.offload_dir
                                 else []),
            capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{config}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append([config, f"{r['params'] / 1e6:.0f} M", f"{r['trainable'] / 1e6:.1f} M",
                     f"{r['rss_growth'] / 2**30:.2f}", f"{r['accounted'] / 2**30:.2f}",
                     f"{r['device_copies'] / 2**30:.2f}",
                     f"{r['rss_growth'] / r['accounted']:.3f}",
                     *(f"{r['per_param'][c]:.2f}" for c in
                       ("masters", "gradients", "optimizer_state", "landing")),
                     f"{r['beyond_weights']:.2f}", f"{r['landing_peak'] / 2**20:.1f}"])
        if "peak_rss_growth" in r:
            disk_rows.append([config, f"{r['peak_rss_growth'] / 2**30:.2f}",
                              f"{r['accounted_peak'] / 2**30:.2f}",
                              f"{r['peak_rss_growth'] / r['accounted_peak']:.3f}",
                              f"{(r['peak_rss_growth'] - r['weights']) / r['trainable']:.2f}",
                              f"{r['peak_staged'] / 2**20:.1f}", f"{r['disk'] / 2**30:.2f}"])
    print(tabulate(rows, headers=[
        "config", "params", "trainable", "RSS growth GiB", "accounted GiB",
        "device copies GiB (peak, freed)", "RSS / accounted", "masters B/p", "grads B/p",
        "optim B/p", "landing B/p", "beyond weights B/p", "landing peak MiB"]))
    if disk_rows:
        print(tabulate(disk_rows, headers=[
            "disk tier", "peak RSS growth GiB", "accounted peak GiB", "peak / accounted",
            "peak RSS beyond weights B/p", "staging window peak MiB", "on disk GiB"]))


if __name__ == "__main__":
    main()
