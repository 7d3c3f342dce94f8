"""Native one-pass kernels: the update reads a gradient in the model's dtype (and moments
in ``state_dtype``) where they are, with no conversion pass.

Why not only torch's parts (kernels.py): torch's fused CPU kernels want every operand in
the parameter's dtype, so a bf16 gradient is first converted into a scratch buffer chunk
by chunk, and that costs about a third of the update (measured on 2 cores: AdamW 1.34 s
per billion parameters against 0.72-0.79 here, bench/optimizer.py).  Inductor-compiled
update functions read bf16 directly but are called with the GIL held, which on an H100
host slowed the overlapped training step by 25-30% (docs/benchmarks.md).  So the update is
a small C loop (native_kernels.c), compiled once per machine with the C compiler that
inductor also needs, called through ctypes (which releases the GIL) from a few threads.
Without a compiler everything falls back to kernels.py, with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import stochastic

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("native_kernels.c")
# No -ffast-math: IEEE division and square root, no reassociation; no contraction into
# FMAs, so the vector loop and its scalar remainder round alike.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC",
          "-shared", "-std=c11"]
#: Elements below which a second thread is not worth starting.
_MIN_PER_THREAD = 1 << 16

_C_DTYPES = {torch.float32: "32", torch.bfloat16: "16"}
_f, _i, _i64, _p = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_ADAMW_ARGS = [_p, _p, _p, _p, _p, _i64, _f, _f, _i, _f, _f, _f, _f, _f, _f, _f]
_SGD_ARGS = [_p, _p, _p, _i64, _f, _f, _f, _f, _i, _i, _f, _f]
_u32 = ctypes.c_uint32
_ADAMW_SR_ARGS = [_p, _p, _p, _p, _p, _i64] + [_f] * 10 + [_u32] * 5
_SGD_SR_ARGS = _SGD_ARGS + [_u32] * 3

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_failure = ""
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _after_fork_in_child() -> None:
    """A forked child has none of the pool's threads (work queued to it would never run)
    and may hold a copy of the lock taken by a thread that is not there."""
    global _lock, _pool, _pool_size
    _lock, _pool, _pool_size = threading.Lock(), None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _cache_dir() -> Path:
    root = os.environ.get("ROUNDPIPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "roundpipe")
    return Path(root)


def _cpu_signature() -> str:
    """What -march=native compiles for: a library built on another CPU (a shared home
    directory) could hold instructions this one lacks."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + platform.processor() + flags


def _compile(command: list[str], target: Path) -> None:
    """Compile into ``target``, which is whole or absent, if two processes build at once."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*command, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(target: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(target))
    for g in _C_DTYPES.values():
        getattr(lib, f"rp_sgd_plain_g{g}").argtypes = _SGD_ARGS
        for s in _C_DTYPES.values():
            getattr(lib, f"rp_adamw_g{g}_s{s}").argtypes = _ADAMW_ARGS
            getattr(lib, f"rp_adamw_ams_g{g}_s{s}").argtypes = _ADAMW_ARGS
            getattr(lib, f"rp_sgd_g{g}_s{s}").argtypes = _SGD_ARGS
            getattr(lib, f"rp_adamw_sr_g{g}_s{s}").argtypes = _ADAMW_SR_ARGS
            getattr(lib, f"rp_adamw_sr_ams_g{g}_s{s}").argtypes = _ADAMW_SR_ARGS
            getattr(lib, f"rp_sgd_sr_g{g}_s{s}").argtypes = _SGD_SR_ARGS
        getattr(lib, f"rp_sgd_sr_plain_g{g}").argtypes = _SGD_SR_ARGS
    lib.rp_round_sr.argtypes = [_p, _p, _i64, _u32, _u32, _u32]
    return lib


def _build() -> ctypes.CDLL:
    # CC is a command line, as make reads it ("ccache gcc", "gcc -m64").
    command = shlex.split(os.environ.get("CC", "")) or [
        c for c in [shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")] if c]
    if not command:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(command + _FLAGS).encode()
                         + _cpu_signature().encode()).hexdigest()[:20]
    name = f"optim-{key}.so"
    target = _cache_dir() / name
    if not target.exists():
        target = _writable(target)
        _compile(command, target)
    try:
        return _load(target)
    except (OSError, AttributeError):
        # A truncated or foreign file under our name: build it again, once.
        target = _writable(target)
        _compile(command, target)
        return _load(target)


def _writable(target: Path) -> Path:
    """``target``, or the same name in a private directory where the cache cannot be
    written (a read-only home)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.access(target.parent, os.W_OK):
            return target
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="roundpipe-optim-")) / target.name


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be built."""
    global _library, _tried, _failure
    with _lock:
        if not _tried:
            # _tried is set only once an attempt has ended (not if interrupted).
            if os.environ.get("ROUNDPIPE_NATIVE_OPTIM", "1") == "0":
                _failure = "ROUNDPIPE_NATIVE_OPTIM=0"
            else:
                try:
                    _library = _build()
                except Exception as e:  # noqa: BLE001 - any failure means the fallback
                    _failure = f"{type(e).__name__}: {e}"
                    log.warning("roundpipe.optim: native kernels unavailable (%s); using "
                                "torch's fused kernels, which convert bf16 gradients "
                                "through a scratch buffer (slower)", _failure)
            _tried = True
        return _library


def unavailable_reason() -> str:
    """Why :func:`library` returned None ('' if it did not, or was not asked yet)."""
    return _failure


@dataclass
class Work:
    """One parameter's operands for a native call (see :func:`accepts`)."""

    param: torch.Tensor
    grad: torch.Tensor
    states: list[torch.Tensor]
    scale: tuple[float, float] = (1.0, 1.0)


def accepts(param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
            n_scales: int) -> bool:
    """Whether the native kernels take these operands: a float32 CPU parameter, gradient
    and states in float32 or bfloat16 (the states all alike), all dense, contiguous and of
    the parameter's size, and at most two gradient factors."""
    return param.dtype == torch.float32 and _operands_fit(param, grad, states, n_scales)


def accepts_sr(param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
               n_scales: int) -> bool:
    """Whether the stochastic-rounding kernels take these operands: as :func:`accepts`,
    with a bfloat16 parameter in place of a float32 one."""
    return param.dtype == torch.bfloat16 and _operands_fit(param, grad, states, n_scales)


def _operands_fit(param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
                  n_scales: int) -> bool:
    if n_scales > 2:
        return False
    tensors = [param, grad, *states]
    if any(t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous()
           or t.numel() != param.numel() for t in tensors):
        return False
    if grad.dtype not in _C_DTYPES or any(s.dtype not in _C_DTYPES for s in states):
        return False
    return len({s.dtype for s in states}) <= 1


def _suffix(work: Work) -> str:
    state = work.states[0].dtype if work.states else torch.float32
    return f"g{_C_DTYPES[work.grad.dtype]}_s{_C_DTYPES[state]}"


def _f32(x: float) -> float:
    """``x`` rounded to float32, as torch's kernels hold their float constants."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _factors(work: Work, maximize: bool) -> tuple[float, float]:
    """The gradient's factors; maximize negates the first (exact, so -(g s0) s1)."""
    return (-work.scale[0] if maximize else work.scale[0]), work.scale[1]


def _ptr(t: torch.Tensor | None, start: int) -> int | None:
    return None if t is None else t.data_ptr() + start * t.element_size()


Call = Callable[[int, int], None]


def _run(calls: list[tuple[Call, int]]) -> None:
    """Run ``call(start, stop)`` over every ``(call, numel)``, the elements split evenly
    over up to ``torch.get_num_threads()`` threads (the calling one included)."""
    global _pool, _pool_size
    total = sum(n for _, n in calls)
    threads = max(1, min(torch.get_num_threads(), total // _MIN_PER_THREAD))
    shares: list[list[tuple[Call, int, int]]] = [[] for _ in range(threads)]
    quota, t, filled = -(-total // threads), 0, 0
    for call, n in calls:
        start = 0
        while start < n:
            take = min(n - start, quota - filled)
            shares[t].append((call, start, start + take))
            start += take
            filled += take
            if filled == quota and t < threads - 1:
                t, filled = t + 1, 0

    def run_share(share: list[tuple[Call, int, int]]) -> None:
        for call, start, stop in share:
            call(start, stop)

    if threads == 1:
        run_share(shares[0])
        return
    futures = []
    try:
        # Submitted under the lock: a concurrent step that grows the pool shuts the old one
        # down only after these are queued (a shut-down pool still runs what it holds).
        with _lock:
            if _pool is None or _pool_size < threads - 1:
                if _pool is not None:
                    _pool.shutdown(wait=False)
                _pool = ThreadPoolExecutor(max_workers=threads - 1,
                                           thread_name_prefix="roundpipe-optim-native")
                _pool_size = threads - 1
            for share in shares[1:]:
                futures.append(_pool.submit(run_share, share))
        run_share(shares[0])
    finally:
        # Even when interrupted: no thread may still be writing after the step returns.
        for f in futures:
            while True:
                try:
                    f.result()
                    break
                except BaseException:  # noqa: BLE001 - waiting again; the first raise wins
                    if f.done():
                        break
    for f in futures:
        f.result()  # a worker's own error, if any


def adamw(lib: ctypes.CDLL, items: Sequence[Work], steps: Sequence[float], *, lr: float,
          beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool,
          maximize: bool) -> None:
    """torch.optim.AdamW's update of every item, ``steps[i]`` its step count after
    this step."""
    # torch.lerp from the nearer end: m + w (g - m) for w < 0.5, else g + (w - 1)(g - m)
    w = _f32(1.0 - beta1)
    from_grad = abs(w) >= 0.5
    lerp_weight = _f32(w - 1.0) if from_grad else w
    calls: list[tuple[Call, int]] = []
    for work, step in zip(items, steps):
        fn = getattr(lib, f"rp_adamw_{'ams_' if amsgrad else ''}{_suffix(work)}")
        bc1 = 1.0 - beta1 ** step
        bc2_sqrt = (1.0 - beta2 ** step) ** 0.5
        m, v = work.states[0], work.states[1]
        vmax = work.states[2] if amsgrad else None
        consts = (1.0 - lr * weight_decay, lerp_weight, int(from_grad), beta2, 1.0 - beta2,
                  lr / bc1, bc2_sqrt, eps, *_factors(work, maximize))

        def call(start: int, stop: int, fn=fn, work=work, m=m, v=v, vmax=vmax,
                 consts=consts) -> None:
            fn(_ptr(work.param, start), _ptr(work.grad, start), _ptr(m, start),
               _ptr(v, start), _ptr(vmax, start), stop - start, *consts)

        calls.append((call, work.param.numel()))
    _run(calls)


def sgd(lib: ctypes.CDLL, items: Sequence[Work], *, first: bool, lr: float,
        weight_decay: float, momentum: float, dampening: float, nesterov: bool,
        maximize: bool) -> None:
    """torch.optim.SGD's update of every item (``first``: the momentum buffers start
    now)."""
    calls: list[tuple[Call, int]] = []
    for work in items:
        buf = work.states[0] if work.states else None
        fn = getattr(lib, f"rp_sgd_{_suffix(work)}" if buf is not None else
                     f"rp_sgd_plain_g{_C_DTYPES[work.grad.dtype]}")
        consts = (lr, weight_decay, momentum, 1.0 - dampening, int(nesterov), int(first),
                  *_factors(work, maximize))

        def call(start: int, stop: int, fn=fn, work=work, buf=buf, consts=consts) -> None:
            fn(_ptr(work.param, start), _ptr(work.grad, start), _ptr(buf, start),
               stop - start, *consts)

        calls.append((call, work.param.numel()))
    _run(calls)


def _sr_calls(items: Sequence[stochastic.Item], seed: int, make: Callable[
        [stochastic.Item, int, int, int, list[int]], None]) -> list[tuple[Call, int]]:
    """One call per item; each cuts its range where the element index's upper 32 bits
    change and hands ``make(item, start, stop, lo, keys)`` the keys of that block (stream
    0's ``ka, kb``, then stream 1's)."""
    calls: list[tuple[Call, int]] = []
    for item in items:
        def call(start: int, stop: int, item=item) -> None:
            for block, a, b in stochastic.blocks(start, stop):
                ks = [k for stream in (stochastic.WEIGHT_STREAM, stochastic.SECOND_STREAM)
                      for k in stochastic.keys(seed, item.step, item.index, block, stream)]
                make(item, a, b, a - block * stochastic.BLOCK, ks)

        calls.append((call, item.param.numel()))
    return calls


def _sr_suffix(item: stochastic.Item) -> str:
    state = item.states[0].dtype if item.states else torch.float32
    return f"g{_C_DTYPES[item.grad.dtype]}_s{_C_DTYPES[state]}"


def adamw_sr(lib: ctypes.CDLL, items: Sequence[stochastic.Item], seed: int, *,
             amsgrad: bool, **hyper: float) -> None:
    """AdamW on bfloat16 parameters, rounded stochastically (stochastic.py): bit for bit
    ``stochastic.adamw``."""
    def make(item: stochastic.Item, start: int, stop: int, lo: int, ks: list[int]) -> None:
        fn = getattr(lib, f"rp_adamw_sr_{'ams_' if amsgrad else ''}{_sr_suffix(item)}")
        m, v = item.states[0], item.states[1]
        vmax = item.states[2] if amsgrad else None
        fn(_ptr(item.param, start), _ptr(item.grad, start), _ptr(m, start), _ptr(v, start),
           _ptr(vmax, start), stop - start, *stochastic.adamw_constants(item.step, **hyper),
           *item.scale, lo, *ks)

    _run(_sr_calls(items, seed, make))


def sgd_sr(lib: ctypes.CDLL, items: Sequence[stochastic.Item], seed: int, *, first: bool,
           nesterov: bool, **hyper: float) -> None:
    """SGD on bfloat16 parameters, rounded stochastically: bit for bit ``stochastic.sgd``."""
    consts = stochastic.sgd_constants(**hyper)

    def make(item: stochastic.Item, start: int, stop: int, lo: int, ks: list[int]) -> None:
        buf = item.states[0] if item.states else None
        fn = getattr(lib, f"rp_sgd_sr_{_sr_suffix(item)}" if buf is not None else
                     f"rp_sgd_sr_plain_g{_C_DTYPES[item.grad.dtype]}")
        fn(_ptr(item.param, start), _ptr(item.grad, start), _ptr(buf, start), stop - start,
           *consts, int(nesterov), int(first), *item.scale, lo, *ks[:2])

    _run(_sr_calls(items, seed, make))


def round_sr(lib: ctypes.CDLL, x: torch.Tensor, lo: int, ka: int, kb: int) -> torch.Tensor:
    """float32 ``x`` (contiguous) rounded as the kernels round the weights of the
    elements at ``lo ...`` within a block, under keys ``(ka, kb)`` (for tests)."""
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib.rp_round_sr(x.data_ptr(), out.data_ptr(), x.numel(), lo, ka, kb)
    return out
