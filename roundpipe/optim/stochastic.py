"""Stochastic rounding to bfloat16 for ``stochastic_rounding=True`` (issue 34, item 5).

A bf16 model trained with no fp32 masters loses every update smaller than half a bf16
step (2^-9 of the weight) when the new weight is rounded to nearest.  Rounding up with
probability equal to the distance from the lower neighbour keeps the expected weight
exact: add 16 random bits below bf16's mantissa to the float32 bit pattern and truncate.

The random bits are not drawn from a generator.  They are a hash of (seed, step,
parameter index, element index), so any thread count, any cut of the work into chunks,
any device count and a resume give the same bits, bit for bit:

* the per-call key: splitmix64's mixer chained over seed, step, parameter index (its
  place in the optimizer's parameter order, as torch's ``state_dict`` numbers it), the
  element index's upper 32 bits and the stream (0: the weight and the first moment,
  1: the second moment and its running maximum); its halves are ``ka`` and ``kb``;
* per element: ``fmix32(fmix32(lo ^ ka) + kb)`` (MurmurHash3's 32-bit finalizer, twice),
  ``lo`` the element index's lower 32 bits.  For one key it is a bijection of ``lo``, so
  the bits of a parameter's elements are evenly spread; the low 16 bits round the first
  value of the stream, the high 16 bits the second.

native_kernels.c computes the same per-element hash and rounding; this module holds the
key derivation (shared by both paths) and the torch implementation, in int64 arithmetic
that never overflows (32-bit products are taken in 16-bit halves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
#: the element index's lower part: one key covers this many elements
BLOCK = 1 << 32
#: streams: which values of an element share one 32-bit hash
WEIGHT_STREAM, SECOND_STREAM = 0, 1
#: elements per piece of the torch path: its ~40 int64 temporaries stay in cache (1 << 20
#: took 2.2x as long on the 2-core VM, 2026-11-26)
CHUNK = 1 << 15


def _mix64(z: int) -> int:
    """splitmix64's step: add the golden ratio, then its finalizer."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def keys(seed: int, step: int, param_index: int, block: int, stream: int) -> tuple[int, int]:
    """``(ka, kb)``, the 32-bit keys of elements ``block * 2**32 ...`` of one parameter
    at one step."""
    z = _mix64(seed & M64)
    for part in (step, param_index, block, stream):
        z = _mix64(z ^ (part & M64))
    return z & M32, z >> 32


def blocks(start: int, stop: int) -> list[tuple[int, int, int]]:
    """``[start, stop)`` cut where the element index's upper 32 bits change:
    ``(block, start, stop)`` each; ``start - block * BLOCK`` is the first one's ``lo``."""
    out = []
    while start < stop:
        block = start // BLOCK
        end = min(stop, (block + 1) * BLOCK)
        out.append((block, start, end))
        start = end
    return out


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for int64 ``h`` in [0, 2**32): two products below 2**48."""
    lo = h * (c & 0xFFFF)
    hi = (h * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return lo.add_(hi).bitwise_and_(M32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h.bitwise_xor(h.bitwise_right_shift(16))
    h = _mul32(h, 0x85EBCA6B)
    h = h.bitwise_xor_(h.bitwise_right_shift(13))
    h = _mul32(h, 0xC2B2AE35)
    return h.bitwise_xor_(h.bitwise_right_shift(16))


def hash_bits(lo: int, n: int, ka: int, kb: int) -> torch.Tensor:
    """The 32-bit hashes (int64) of the elements at ``lo .. lo + n`` within their block
    (the lower 32 bits of their index)."""
    lo = torch.arange(lo, lo + n, dtype=torch.int64)
    h = _fmix32(lo.bitwise_xor_(ka))
    return _fmix32(h.add_(kb).bitwise_and_(M32))


def round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to bfloat16 by adding ``bits`` (int64, 0..65535 each) to its
    bit pattern and truncating; every NaN becomes the quiet NaN 0x7fc0 (which NaN an
    operation returns differs between torch's operations and the native loop)."""
    u = x.view(torch.int32)
    nan = x.isnan()
    # For every non-NaN pattern u + bits stays inside int32 (at most 0x7f80ffff, and
    # negative patterns stay negative), so the arithmetic shift gives the bf16 pattern
    # sign-extended, which fits int16 exactly.
    rounded = torch.where(nan, 0, u).add_(bits.to(torch.int32)).bitwise_right_shift_(16)
    return torch.where(nan, 0x7FC0, rounded).to(torch.int16).view(torch.bfloat16)


def f32(x: float) -> float:
    """``x`` rounded to float32 (how both paths hold their constants)."""
    return torch.tensor(x, dtype=torch.float32).item()


@dataclass
class Item:
    """One bfloat16 parameter's operands for a stochastically rounded update: ``states``
    in the optimizer's fixed order, ``step`` the step count after this step, ``index`` the
    parameter's place in the optimizer's parameter order, ``scale`` the gradient's two
    factors (maximize already folded into the first)."""

    param: torch.Tensor
    grad: torch.Tensor
    states: list[torch.Tensor]
    step: int
    index: int
    scale: tuple[float, float] = (1.0, 1.0)


def adamw_constants(step: int, *, lr: float, beta1: float, beta2: float,
                    weight_decay: float, eps: float) -> tuple[float, ...]:
    """(decay, beta1, 1 - beta1, beta2, 1 - beta2, step size, sqrt of the second bias
    correction, eps), each a float32 value, as both paths use them."""
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = (1.0 - beta2 ** step) ** 0.5
    return tuple(f32(c) for c in (1.0 - lr * weight_decay, beta1, 1.0 - beta1, beta2,
                                  1.0 - beta2, lr / bc1, bc2_sqrt, eps))


def sgd_constants(*, lr: float, weight_decay: float, momentum: float,
                  dampening: float) -> tuple[float, ...]:
    """(lr, weight decay, momentum, 1 - dampening), each a float32 value."""
    return tuple(f32(c) for c in (lr, weight_decay, momentum, 1.0 - dampening))


def _pieces(item: Item, chunk: int):
    """``(start, stop, block)`` over the item's elements, at most ``chunk`` long, never
    across a block."""
    n = item.param.numel()
    for start in range(0, n, chunk):
        for block, a, b in blocks(start, min(n, start + chunk)):
            yield a, b, block


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A flat view of ``t``, or a contiguous copy (True: to be written back)."""
    t = t.detach()
    if t.is_contiguous():
        return t.view(-1), False
    return t.reshape(-1).clone(), True


def sqrt_f32(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (as C's sqrtf).  torch's own float32
    sqrt is not (MKL's, on CPU: about one element in six differs by an ulp).  The
    float64 root rounded to float32 is within one ulp; it is then checked against the
    two midpoints to its neighbours, whose squares (50 bits) are exact in float64."""
    r = v.double().sqrt().float()
    finite = v.isfinite() & (v > 0)
    up = torch.nextafter(r, torch.tensor(float("inf")))
    down = torch.nextafter(r, torch.tensor(0.0))
    x, rd = v.double(), r.double()
    hi, lo = (rd + up.double()) / 2, (rd + down.double()) / 2
    r = torch.where(finite & (x > hi * hi), up, r)
    return torch.where(finite & (x < lo * lo), down, r)


def _load(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy (never the operand itself: the update works in place on it)."""
    return t.to(torch.float32, copy=True)


def _store(dst: torch.Tensor, value: torch.Tensor, bits: torch.Tensor | None) -> None:
    """Write float32 ``value`` into ``dst``: rounded stochastically into bfloat16 with
    ``bits``, or as it is into float32."""
    if dst.dtype == torch.bfloat16:
        dst.copy_(round_bf16(value, bits))
    else:
        dst.copy_(value)


def _write_back(pairs: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
    for original, flat, copied in pairs:
        if copied:
            original.detach().copy_(flat.view_as(original))


def adamw(items: list[Item], seed: int, *, amsgrad: bool, chunk: int, **hyper: float
          ) -> None:
    """AdamW on bfloat16 parameters in torch operations, bit for bit as
    native_kernels.c's ``rp_adamw_sr_*`` (the same float32 operations in the same order,
    each rounded once)."""
    for item in items:
        (decay, beta1, omb1, beta2, omb2, step_size, bc2_sqrt,
         eps) = (torch.tensor(c, dtype=torch.float32)
                 for c in adamw_constants(item.step, **hyper))
        s0, s1 = (torch.tensor(c, dtype=torch.float32) for c in item.scale)
        flats = [(t, *_flat(t)) for t in [item.param, item.grad, *item.states]]
        p, g, m, v = (f for _, f, _ in flats[:4])
        vmax = flats[4][1] if amsgrad else None
        for a, b, block in _pieces(item, chunk):
            ka0, kb0 = keys(seed, item.step, item.index, block, WEIGHT_STREAM)
            h0 = hash_bits(a - block * BLOCK, b - a, ka0, kb0)
            gi = _load(g[a:b]).mul_(s0).mul_(s1)
            pi = _load(p[a:b]).mul_(decay)
            mi = _load(m[a:b]).mul_(beta1).add_(gi * omb1)
            vi = _load(v[a:b]).mul_(beta2).add_(gi.mul(omb2).mul_(gi))
            h1 = None
            if m.dtype == torch.bfloat16:
                ka1, kb1 = keys(seed, item.step, item.index, block, SECOND_STREAM)
                h1 = hash_bits(a - block * BLOCK, b - a, ka1, kb1)
            _store(m[a:b], mi, None if h1 is None else h0.bitwise_right_shift(16))
            _store(v[a:b], vi, None if h1 is None else h1.bitwise_and(0xFFFF))
            vd = vi
            if vmax is not None:
                vm = _load(vmax[a:b])
                vd = torch.where((vm > vi) | vm.isnan(), vm, vi)
                _store(vmax[a:b], vd, None if h1 is None else h1.bitwise_right_shift(16))
            upd = mi.mul_(step_size).div_(sqrt_f32(vd).div_(bc2_sqrt).add_(eps))
            p[a:b].copy_(round_bf16(pi.sub_(upd), h0.bitwise_and_(0xFFFF)))
        _write_back(flats[:1] + flats[2:])


def sgd(items: list[Item], seed: int, *, first: bool, nesterov: bool, chunk: int,
        **hyper: float) -> None:
    """SGD on bfloat16 parameters in torch operations, bit for bit as native_kernels.c's
    ``rp_sgd_sr_*``."""
    lr, weight_decay, momentum, omd = (torch.tensor(c, dtype=torch.float32)
                                       for c in sgd_constants(**hyper))
    for item in items:
        s0, s1 = (torch.tensor(c, dtype=torch.float32) for c in item.scale)
        flats = [(t, *_flat(t)) for t in [item.param, item.grad, *item.states]]
        p, g = flats[0][1], flats[1][1]
        buf = flats[2][1] if len(flats) > 2 else None
        for a, b, block in _pieces(item, chunk):
            ka0, kb0 = keys(seed, item.step, item.index, block, WEIGHT_STREAM)
            h0 = hash_bits(a - block * BLOCK, b - a, ka0, kb0)
            pi = _load(p[a:b])
            d = _load(g[a:b]).mul_(s0).mul_(s1)
            if weight_decay.item() != 0.0:
                d = d.add_(pi * weight_decay)
            if buf is not None:
                bi = d.clone() if first else _load(buf[a:b]).mul_(momentum).add_(d * omd)
                _store(buf[a:b], bi, h0.bitwise_right_shift(16))
                d = d.add_(bi * momentum) if nesterov else bi
            p[a:b].copy_(round_bf16(pi.sub_(d.mul_(lr)), h0.bitwise_and_(0xFFFF)))
        _write_back(flats[:1] + flats[2:])
