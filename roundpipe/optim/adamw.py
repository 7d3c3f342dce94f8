"""``roundpipe.optim.AdamW``: torch's AdamW, one pass over host memory for a pipe's
masters (see one_pass.py)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OptimizerError
from . import kernels, native, stochastic
from .one_pass import OnePass, advance_step


class AdamW(OnePass, torch.optim.AdamW):
    """``torch.optim.AdamW`` with the same arguments, param groups, ``state_dict`` and
    LR-scheduler support.  Given ``pipe.optim_parameters()`` each step reads every
    master's gradient where it landed (in the model's dtype, no fp32 ``.grad``) and
    writes master and moments in the same pass.  Plain parameters are stepped by torch's
    own AdamW.

    ``state_dtype=torch.bfloat16`` keeps the moments in bfloat16 (4 bytes per parameter
    less; the update is still computed in float32).  It applies to every CPU parameter.

    ``kernel``: ``"native"`` runs roundpipe's compiled loop (one pass, reading bf16 where it
    is; within 1e-6 of torch's AdamW, bitwise the same on any thread or device count),
    ``"fused"`` torch's fused kernel through a scratch conversion (bit for bit
    ``torch.optim.AdamW(fused=True)`` on the same gradients, slower), ``"auto"`` (default)
    the native one where a C compiler can build it, else the fused one.

    ``stochastic_rounding=True`` (experimental; issue 34): train a bfloat16 model with no
    float32 masters, ``RoundPipe(model.bfloat16(), optim_dtype=None)`` and this optimizer
    over ``pipe.optim_parameters()`` (the model's own bf16 parameters).  The update is
    computed in float32 from the bf16 weight, gradient and moments, and the new weight is
    rounded to bf16 stochastically: up with probability equal to its distance from the
    lower neighbour, so updates smaller than half a bf16 step are kept on average instead
    of lost (roundpipe/optim/stochastic.py).  The moments default to bf16 (6 bytes per
    parameter of weights and state; ``state_dtype=torch.float32`` keeps them in float32)
    and are rounded stochastically too, with their own random bits: rounded to nearest, a
    second moment that moves by ``1 - beta2 = 0.001`` of itself per step never moves at
    all in bf16 (its step is 2^-8 of it), so it would neither decay nor grow slowly.

    The random bits are a counter-based hash of (``seed``, the parameter's step count,
    its index in this optimizer's parameter order, the element's index), never a
    generator's state: results are bitwise the same for any thread count, device count
    and ``kernel`` (the native loop and the torch fallback compute the same float32
    operations in the same order), and a resume from ``state_dict()`` / a checkpoint
    (which carry the seed, a param-group option, and the step counts) continues bit for
    bit.  Build the optimizer over the parameters in the same order to resume.  Both
    options are param-group options (``{"params": ..., "stochastic_rounding": False}``
    turns it off for a group).  Refused before anything runs (OptimizerError): a pipe's
    master copies (with masters the update is already exact in float32: pointless), a
    float32 parameter (nothing to round), another dtype (only bf16 rounding exists), a
    parameter off the CPU, and ``state_dtype`` other than bf16 or float32.
    """

    _torch_base = torch.optim.AdamW

    def __init__(self, params: Any, *args: Any, state_dtype: torch.dtype | None = None,
                 kernel: str = "auto", stochastic_rounding: bool = False, seed: int = 0,
                 **kwargs: Any) -> None:
        # param-group options (saved in state_dict), read by add_param_group
        self._sr_defaults = {"stochastic_rounding": stochastic_rounding, "seed": seed}
        super().__init__(params, *args, **kwargs)
        self._init_one_pass(state_dtype, kernel)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        beta1, beta2 = (float(b) for b in group["betas"])
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0) or float(group["eps"]) < 0:
            raise OptimizerError(f"AdamW needs 0 <= betas < 1 and eps >= 0, got "
                                 f"betas={group['betas']!r}, eps={group['eps']!r}")

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _update_group(self, group: dict[str, Any],
                      pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        amsgrad = bool(group["amsgrad"])
        items = []
        for p, grad in pairs:
            state = self.state[p]  # its moments were allocated by OnePass.step
            moments = [state["exp_avg"], state["exp_avg_sq"]]
            if amsgrad:
                moments.append(state["max_exp_avg_sq"])
            items.append(kernels.Item(p, grad, moments, advance_step(state),
                                      self._scale_of(p)))
        beta1, beta2 = (float(b) for b in group["betas"])
        hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                     weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                     amsgrad=amsgrad, maximize=bool(group["maximize"]))

        if group.get("stochastic_rounding"):
            rounded = {k: v for k, v in hyper.items() if k not in ("amsgrad", "maximize")}
            self._run_stochastic(self._stochastic_items(group, items, hyper["maximize"]),
                                 native.adamw_sr, stochastic.adamw, seed=group.get("seed", 0),
                                 amsgrad=amsgrad, **rounded)
            return

        def fused(params, grads, states, steps) -> None:
            torch._fused_adamw_(params, grads, states[0], states[1],
                                states[2] if amsgrad else [], steps, **hyper)

        lib, mine, rest = self._split_native(items)
        if mine:
            native.adamw(lib, [w for _, w in mine], [float(i.step) for i, _ in mine],
                         **hyper)
        kernels.run_chunked(rest, 3 if amsgrad else 2, fused, self._scratch())
