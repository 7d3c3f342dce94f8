"""Eager PyTorch references the runtime is compared against (no roundpipe code here)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F

import models


def split(x: Any, num: int, batch: int) -> list[Any]:
    """Split like the seeds describe: tensors with the batch dim are split (sizes differ
    by at most one, larger first), everything else is replicated."""
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch:
        base, extra = divmod(batch, num)
        sizes = [base + (1 if i < extra else 0) for i in range(num)]
        return list(torch.split(x, sizes))
    if isinstance(x, dict):
        parts = {k: split(v, num, batch) for k, v in x.items()}
        return [{k: parts[k][i] for k in x} for i in range(num)]
    if isinstance(x, tuple):
        parts = [split(v, num, batch) for v in x]
        return [tuple(p[i] for p in parts) for i in range(num)]
    return [x] * num


def eager_forward_backward(model: torch.nn.Module, args: tuple, kwargs: dict, label: Any,
                           loss_fn: Callable, num_mb: int) -> torch.Tensor:
    """Sum of per-microbatch losses; gradients accumulate in the parameters' .grad."""
    batch = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)).shape[0]
    total = None
    for a, k, y in zip(split(args, num_mb, batch), split(kwargs, num_mb, batch),
                       split(label, num_mb, batch)):
        loss = loss_fn(model(*a, **k), y)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def first_float(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return first_float(next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        return first_float(out[0])
    return first_float(next(iter(vars(out).values())))


def mse_first(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(first_float(out), y)


def dataclass_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    # reads both outputs, so gradients enter through two model outputs
    return F.mse_loss(out.pred, y) + 0.1 * out.features.pow(2).mean()


def case(name: str, dtype: torch.dtype = torch.float64, **kw: Any):
    """(model, args, kwargs, label, loss_fn) for a model of the zoo, in ``dtype``."""
    model, args, kwargs = models.ALL[name](**kw)
    model, args, kwargs = models.to_dtype(model, args, kwargs, dtype)
    torch.manual_seed(1)
    batch = args[0].shape[0]
    if name == "gpt":
        label = torch.randint(0, 64, args[0].shape)
        return model, args, kwargs, label, models.lm_loss
    with torch.no_grad():
        out = copy.deepcopy(model)(*args, **kwargs)  # shapes only; the model is untouched
    if name == "dataclass_net":
        return model, args, kwargs, torch.randn(out.pred.shape, dtype=dtype), dataclass_loss
    target = first_float(out)
    assert target.shape[0] == batch
    return model, args, kwargs, torch.randn(target.shape, dtype=dtype), mse_first
