"""``roundpipe.optim.SGD``: torch's SGD, one pass over host memory for a pipe's masters
(see one_pass.py)."""

from __future__ import annotations

from typing import Any

import torch

from . import kernels
from .one_pass import OnePass, flat


class SGD(OnePass, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize) with
    the same arguments, param groups, ``state_dict`` and LR-scheduler support.  Given
    ``pipe.optim_parameters()`` each step reads every master's gradient where it landed
    (no fp32 ``.grad``) and writes master and momentum in the same pass.
    Plain parameters are stepped by torch's own SGD.  ``state_dtype``: the momentum
    buffer's dtype (default float32)."""

    _torch_base = torch.optim.SGD

    def __init__(self, params: Any, *args: Any, state_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._init_one_pass(state_dtype)

    def _update(self, p: torch.Tensor, grad: torch.Tensor,
                group: dict[str, Any], state: dict[str, Any]) -> None:
        momentum = float(group["momentum"])
        buf = state.get("momentum_buffer") if momentum != 0 else None
        first = momentum != 0 and buf is None
        if first:
            buf = state["momentum_buffer"] = self._moment(p)
        wd = float(group["weight_decay"])
        damp = 1.0 if first else 1 - float(group["dampening"])  # see kernels.sgd_update
        s = torch.tensor([wd, momentum, damp, -float(group["lr"])], dtype=torch.float32)
        operands = [p, grad, buf]
        flags = dict(decay=wd != 0, nesterov=bool(group["nesterov"]),
                     maximize=bool(group["maximize"]))
        if all(t is None or t.is_contiguous() for t in operands):
            operands = [flat(t) for t in operands]
            key = tuple(None if t is None else t.dtype for t in operands) + \
                tuple(flags.values())
            kernels.run(kernels.sgd_update, key, *operands, s, **flags)
        else:
            kernels.sgd_update(*operands, s, **flags)
