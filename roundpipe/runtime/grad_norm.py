"""Gradient norms and clipping that read a held gradient without converting it.

With a ``roundpipe.optim`` optimizer a master's gradient stays where it landed, in the
model's dtype (runtime/masters.py).  ``torch.nn.utils.clip_grad_norm_`` would read
``p.grad``, which converts every such gradient into a float32 ``.grad``: 4 more bytes per
parameter and two more passes over host memory.  Here a held gradient's norm comes from
the device that produced it (measured as it was downloaded, once norms were asked for) or,
until then, from the held buffer in cache-sized float32 pieces; the clip factor is recorded
and applied by whoever reads the gradient (the step's chunks, ``p.grad``).  Other
gradients are read and multiplied as torch's function does.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import NonFiniteGradientError
from .masters import owner_of, raw_grad

#: elements per float32 piece when a held gradient's norm is computed on the host
_PIECE = 1 << 20


def held_grad_norm(p: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor | None:
    """The ``norm_type``-norm of ``p``'s gradient if it is held where it landed (in
    ``p``'s dtype, its factors applied); None when ``p`` holds none."""
    owner = owner_of(p)
    if owner is None:
        return None
    landed, name = owner
    buffer, factors = landed.peek_with_factors(name)
    if buffer is None:
        return None
    measured = None
    if norm_type == 2.0:
        landed.norms_requested = True  # the devices measure them (see LandedGrads)
        measured = landed.norm(name)
    if measured is not None:
        norm = measured.to(p.dtype)
    else:
        flat = buffer.reshape(-1)
        pieces = [torch.linalg.vector_norm(flat[i:i + _PIECE].to(p.dtype), norm_type)
                  for i in range(0, flat.numel(), _PIECE)] or [torch.zeros((), dtype=p.dtype)]
        stacked = torch.stack(pieces)
        norm = stacked.sum() if norm_type == 0 else torch.linalg.vector_norm(stacked, norm_type)
    for f in factors:
        norm = (norm * (f != 0)) if norm_type == 0 else norm * f.abs()
    return norm


def scale_grad_(p: torch.Tensor, factor: torch.Tensor) -> None:
    """Multiply ``p``'s gradient by ``factor`` (a 0-dim tensor): recorded for a held
    gradient, in place for a ``.grad``."""
    owner = owner_of(p)
    # Low-precision masters keep the factor in float32 (1/scale of a loss scale would
    # underflow in fp16), as torch multiplies by a Python float in float32.
    dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
    if owner is not None and owner[0].scale(owner[1], factor.to(dtype)):
        return
    grad = raw_grad(p)
    if grad is not None:
        grad.mul_(factor.to(grad.device))


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False
                    ) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a pipe's parameters: the same total norm and
    the same multiplication, without converting held gradients.  Returns the total norm
    of the gradients before clipping."""
    norm_type = float(norm_type)
    params = [p for p in parameters]
    norms: list[torch.Tensor] = []
    with torch.no_grad():
        for p in params:
            norm = held_grad_norm(p, norm_type)
            if norm is None:
                grad = raw_grad(p)
                if grad is None:
                    continue
                norm = torch.linalg.vector_norm(grad, norm_type)
            norms.append(norm)
        if not norms:
            return torch.tensor(0.0)
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise NonFiniteGradientError(
                f"the total {norm_type:g}-norm of {len(norms)} gradients is {total.item()}, "
                "so they cannot be clipped; pass error_if_nonfinite=False to clip anyway "
                "(the update then turns non-finite), or skip this step (a GradScaler "
                "does that for you)")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if held_or_grad(p):
                scale_grad_(p, coef)
    return total


def held_or_grad(p: torch.Tensor) -> bool:
    owner = owner_of(p)
    return (owner is not None and owner[0].peek(owner[1]) is not None) or \
        raw_grad(p) is not None
