"""``roundpipe.optim.AdamW``: torch's AdamW, one pass over host memory for a pipe's
masters (see one_pass.py)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import OptimizerError
from . import kernels
from .one_pass import OnePass, flat, step_count


class AdamW(OnePass, torch.optim.AdamW):
    """``torch.optim.AdamW`` with the same arguments, param groups, ``state_dict`` and
    LR-scheduler support.  Given ``pipe.optim_parameters()`` each step reads every
    master's gradient where it landed (in the model's dtype, no fp32 ``.grad``) and
    writes master and moments in the same pass.  Plain parameters are
    stepped by torch's own AdamW.

    ``state_dtype=torch.bfloat16`` keeps the moments in bfloat16 (4 bytes per parameter
    less; the update is still computed in float32).  It applies to every CPU parameter.
    """

    _torch_base = torch.optim.AdamW

    def __init__(self, params: Any, *args: Any, state_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._init_one_pass(state_dtype)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        beta1, beta2 = (float(b) for b in group["betas"])
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0) or float(group["eps"]) < 0:
            raise OptimizerError(f"AdamW needs 0 <= betas < 1 and eps >= 0, got "
                                 f"betas={group['betas']!r}, eps={group['eps']!r}")

    def _update(self, p: torch.Tensor, grad: torch.Tensor,
                group: dict[str, Any], state: dict[str, Any]) -> None:
        amsgrad = bool(group["amsgrad"])
        if "exp_avg" not in state:
            state["exp_avg"] = self._moment(p)
            state["exp_avg_sq"] = self._moment(p)
            if amsgrad:
                state["max_exp_avg_sq"] = self._moment(p)
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        step = step_count(state)
        # As torch computes them: in double precision, then used as float32 by the kernels.
        bias1 = 1 - beta1 ** step
        bias2 = 1 - beta2 ** step
        s = torch.tensor([1 - lr * wd, 1 - beta1, beta2, 1 - beta2, math.sqrt(bias2), eps,
                          -(lr / bias1)], dtype=torch.float32)
        operands = [p, grad, state["exp_avg"], state["exp_avg_sq"],
                    state.get("max_exp_avg_sq") if amsgrad else None]
        flags = dict(decay=wd != 0, maximize=bool(group["maximize"]),
                     lerp_low=1 - beta1 < 0.5)
        if all(t is None or t.is_contiguous() for t in operands):
            operands = [flat(t) for t in operands]
            key = tuple(None if t is None else t.dtype for t in operands) + \
                tuple(flags.values())
            kernels.run(kernels.adamw_update, key, *operands, s, **flags)
        else:  # strided storage: the same arithmetic, eagerly
            kernels.adamw_update(*operands, s, **flags)
