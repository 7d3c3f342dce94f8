"""``roundpipe.optim.SGD``: torch's SGD, one pass over host memory for a pipe's masters
(see one_pass.py)."""

from __future__ import annotations

from typing import Any

import torch

from . import kernels, native, stochastic
from .one_pass import OnePass


class SGD(OnePass, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize) with
    the same arguments, param groups, ``state_dict`` and LR-scheduler support.  Given
    ``pipe.optim_parameters()`` each step reads every master's gradient where it landed
    (no fp32 ``.grad``) and writes master and momentum in the same pass.  Plain
    parameters are stepped by torch's own SGD.  ``state_dtype``: the momentum buffer's
    dtype (default float32).  ``kernel``: as for :class:`roundpipe.optim.AdamW`
    (``"fused"``: bit for bit ``torch.optim.SGD(fused=True)``).

    ``stochastic_rounding=True``, ``seed``: a bfloat16 model trained with no masters, the
    update computed in float32 and the weight (and a bf16 momentum buffer, with its own
    bits) rounded stochastically, bitwise reproducible; as for
    :class:`roundpipe.optim.AdamW`, with the step count kept in the state as ``"step"``
    (torch's SGD keeps none)."""

    _torch_base = torch.optim.SGD
    # torch 2.11-2.13's fused CPU SGD skips whole vector blocks of bf16/fp16 parameters
    # (pytorch/pytorch#191763): those go through torch's single-tensor SGD.
    _fused_dtypes = frozenset({torch.float32, torch.float64})

    def __init__(self, params: Any, *args: Any, state_dtype: torch.dtype | None = None,
                 kernel: str = "auto", stochastic_rounding: bool = False, seed: int = 0,
                 **kwargs: Any) -> None:
        # param-group options (saved in state_dict), read by add_param_group
        self._sr_defaults = {"stochastic_rounding": stochastic_rounding, "seed": seed}
        super().__init__(params, *args, **kwargs)
        self._init_one_pass(state_dtype, kernel)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if float(group["momentum"]) != 0 else ()

    def _update_group(self, group: dict[str, Any],
                      pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        momentum = float(group["momentum"])
        hyper = dict(weight_decay=float(group["weight_decay"]), momentum=momentum,
                     lr=float(group["lr"]), dampening=float(group["dampening"]),
                     nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))
        # The fused kernel starts every buffer of a call (buffer = gradient) or none.
        first: list[kernels.Item] = []
        later: list[kernels.Item] = []
        for p, grad in pairs:
            if momentum == 0:
                later.append(kernels.Item(p, grad, [], scale=self._scale_of(p)))
                continue
            state = self.state[p]  # its buffer was allocated by OnePass.step
            fresh = self._is_fresh(p, "momentum_buffer")
            (first if fresh else later).append(
                kernels.Item(p, grad, [state["momentum_buffer"]], scale=self._scale_of(p)))
        for items, is_first in ((first, True), (later, False)):
            if not items:
                continue
            if group.get("stochastic_rounding"):
                rounded = dict(hyper)
                self._run_stochastic(
                    self._stochastic_items(group, items, rounded.pop("maximize")),
                    native.sgd_sr, stochastic.sgd, seed=group.get("seed", 0), first=is_first,
                    **rounded)
                continue

            def fused(params, grads, states, steps, is_first=is_first) -> None:
                torch._fused_sgd_(params, grads, states[0] if momentum != 0 else [],
                                  is_first_step=is_first, **hyper)

            lib, mine, rest = self._split_native(items)
            if mine:
                native.sgd(lib, [w for _, w in mine], first=is_first, **hyper)
            kernels.run_chunked(rest, 1 if momentum != 0 else 0, fused, self._scratch())
