"""One-pass update kernels: the gradient (in the model's dtype) in, master and moments out.

Each function reads every operand once and writes every result once; ``torch.compile``
(inductor) turns it into one vectorised, OpenMP-parallel loop on the CPU, so a step moves
the bytes the roofline counts and no more.  The arithmetic follows torch's single-tensor
implementations operation by operation (same order, float32 scalars as torch's CPU
kernels use), so results agree with ``torch.optim`` to rounding.

Tensors are 1-D views of contiguous storage (one compiled kernel serves every size);
scalars come in one float32 tensor, so schedules and bias corrections never recompile.
Where inductor cannot compile (no C++ compiler), the same functions run eagerly: several
passes, same results to rounding.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Scalar slots of the AdamW kernel's ``s``.
ADAMW_SCALARS = ("decay", "beta1_weight", "beta2", "beta2_weight", "bias2_sqrt", "eps",
                 "neg_step_size")
SGD_SCALARS = ("weight_decay", "momentum", "dampening_weight", "neg_lr")


def _load(t: torch.Tensor) -> torch.Tensor:
    # Always a copy (free in the compiled loop): a result that aliases an input the
    # kernel also writes is read back after the write by the compiled program (found
    # with SGD's first momentum buffer).
    return t.to(torch.float32, copy=True)


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None,
                 s: torch.Tensor, *, decay: bool, maximize: bool,
                 lerp_low: bool = True) -> None:
    """AdamW on one tensor (torch's ``_single_tensor_adam`` with decoupled decay).
    ``lerp_low``: ``1 - beta1 < 0.5``, which picks the one of ``torch.lerp``'s two
    formulas it uses (computing both and blending cost 35% of the kernel's time).
    Every result is computed before anything is written (run eagerly, an error midway
    leaves the operands as they were)."""
    g = _load(grad)
    if maximize:
        g = -g
    p = _load(param)
    if decay:
        p = p * s[0]
    m0 = _load(exp_avg)
    m = m0 + s[1] * (g - m0) if lerp_low else g - (g - m0) * (1 - s[1])
    v = _load(exp_avg_sq) * s[2] + s[3] * g * g
    vmax = torch.maximum(_load(max_exp_avg_sq), v) if max_exp_avg_sq is not None else v
    denom = vmax.sqrt() / s[4] + s[5]
    p = p + s[6] * m / denom
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if max_exp_avg_sq is not None:
        max_exp_avg_sq.copy_(vmax)
    param.copy_(p)


def sgd_update(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None,
               s: torch.Tensor, *, decay: bool, nesterov: bool, maximize: bool) -> None:
    """SGD on one tensor (torch's ``_single_tensor_sgd``).  The first step passes a zero
    ``buf`` and a dampening weight of 1, which makes the buffer the gradient exactly, as
    torch starts it."""
    g = _load(grad)
    if maximize:
        g = -g
    p = _load(param)
    if decay:
        g = g + s[0] * p
    b = None
    if buf is not None:
        b = _load(buf) * s[1] + s[2] * g
        g = g + s[1] * b if nesterov else b
    p = p + s[3] * g
    if buf is not None:
        buf.copy_(b)
    param.copy_(p)


_compiled: dict[tuple, Callable[..., None]] = {}
_failed: set[str] = set()
_lock = threading.Lock()


def _eager_only() -> bool:
    return os.environ.get("ROUNDPIPE_OPTIM_EAGER", "") not in ("", "0")


def kernel(fn: Callable[..., None], key: tuple) -> Callable[..., None]:
    """``fn`` compiled for one combination of flags and dtypes (``key``), or ``fn`` itself
    where compiling is off or failed."""
    if _eager_only() or fn.__name__ in _failed:
        return fn
    with _lock:
        compiled = _compiled.get((fn.__name__,) + key)
        if compiled is None:
            # A code object of its own per key: Dynamo keeps compiled versions per code
            # object, and the variants of one function would share its recompile limit.
            own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                     fn.__defaults__, fn.__closure__)
            own.__kwdefaults__ = fn.__kwdefaults__
            # dynamic_threads: with symbolic sizes inductor otherwise emits a serial loop
            # (measured 2.1x slower on 2 cores); OpenMP then splits it over all threads.
            compiled = torch.compile(own, dynamic=True, fullgraph=True,
                                     options={"cpp.dynamic_threads": True})
            _compiled[(fn.__name__,) + key] = compiled
    return compiled


def run(fn: Callable[..., None], key: tuple, *args: object, **flags: object) -> None:
    """Run ``fn`` compiled (see :func:`kernel`).  A compile that fails falls back to eager
    for good; it fails before the kernel writes anything."""
    compiled = kernel(fn, key)
    if compiled is fn:
        fn(*args, **flags)
        return
    try:
        compiled(*args, **flags)
    except Exception as e:  # noqa: BLE001 - logged; the eager function gives the same result
        from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError, Unsupported
        if not isinstance(e, (BackendCompilerFailed, TorchRuntimeError, Unsupported)):
            raise
        with _lock:
            _failed.add(fn.__name__)
        log.warning("roundpipe.optim: torch.compile of %s failed (%s: %s); running it "
                    "eagerly (same results, several passes over memory)", fn.__name__,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        fn(*args, **flags)
