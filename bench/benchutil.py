"""What the scripts in ``bench/`` share, in one place: the ``--smoke`` flag, a Llama-shaped
model in plain PyTorch, the loss, host memory and timing helpers, and the wall-clock
instrumentation of a call's host-side phases.

The scripts use roundpipe's public API only; the one exception is :func:`instrument`,
which wraps named internal methods to time them (``gpu_profile.py``, ``gpu_optim.py``).
It raises at once if one of them is gone, and tests/test_bench_smoke.py runs it on the CPU,
so a rename fails the suite instead of rotting the bench.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "examples"), ROOT):  # roundpipe and train_gpt's GPT
    if _path not in sys.path:
        sys.path.insert(0, _path)

SMOKE_HELP = ("tiny sizes, a few seconds: checks that the script runs end to end "
              "(tests/test_bench_smoke.py); its figures mean nothing")


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def apply_smoke(args: argparse.Namespace, **sizes: Any) -> argparse.Namespace:
    """With ``--smoke``, replace the given arguments by the tiny ``sizes``."""
    if getattr(args, "smoke", False):
        for name, value in sizes.items():
            if not hasattr(args, name):
                raise AttributeError(f"--smoke sets {name!r}, which the script lacks")
            setattr(args, name, value)
    return args


# --- host memory and time ----------------------------------------------------------------

def rss_bytes() -> int:
    """This process's resident host memory (pinned pages included); 0 off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cuda_median_time(fn: Callable[[], Any], repeat: int = 5, warmup: int = 0) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, each waited for on the GPU (when one
    is there)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


#: seconds per call of each instrumented phase (filled by :func:`instrument`)
PHASES: dict[str, list[float]] = {}

#: the internal methods :func:`instrument` times: (module, class, method)
INSTRUMENTED = (("roundpipe.api", "RoundPipe", "_prepare"),
                ("roundpipe.api", "RoundPipe", "_finish"),
                ("roundpipe.runtime.executor", "Executor", "train"),
                ("roundpipe.runtime.host_state", "ModelState", "commit_grads"),
                ("roundpipe.runtime.host_state", "ModelState", "publish"),
                ("roundpipe.runtime.optimizer", "OptimizerWorker", "wait"),
                ("roundpipe.runtime.optimizer", "OptimizerWorker", "_run"))


def instrument() -> None:
    """Wrap the host-side phases of a call with wall-clock timers (per call, any thread).

    A profiling hook on internal methods (their names are not an API): a missing one
    raises here rather than leaving a phase silently untimed."""
    import functools
    import importlib

    for module, cls_name, name in INSTRUMENTED:
        cls = getattr(importlib.import_module(module), cls_name)
        fn = getattr(cls, name)  # AttributeError: the bench must follow the rename
        if getattr(fn, "bench_instrumented", False):
            continue

        def wrapped(*a, __fn=fn, __key=f"{cls_name}.{name}", **k):
            t = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                PHASES.setdefault(__key, []).append(time.perf_counter() - t)
        functools.update_wrapper(wrapped, fn)
        wrapped.bench_instrumented = True  # type: ignore[attr-defined]
        setattr(cls, name, wrapped)


# --- a Llama-shaped model in plain PyTorch (no transformers needed on the GPU box) --------

class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.norm2 = RMSNorm(d)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, C))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([LlamaBlock(d, heads, ffn) for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, d // heads, 2).float() / (d // heads)))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        t = torch.arange(T, device=idx.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed(idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def lm_loss(logits: Any, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in float32 (``logits`` may be a Hugging Face output)."""
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
