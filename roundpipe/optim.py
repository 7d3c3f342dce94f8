"""Optimizers that publish the weights in the same pass as the update.

``roundpipe.optim.AdamW`` and ``roundpipe.optim.SGD`` are ``torch.optim.AdamW`` /
``torch.optim.SGD`` with ``fused=True`` (same arguments, param groups, state dicts, LR
schedulers; interchangeable state).  Given plain parameters they *are* torch's
optimizers.  Given a pipe's masters (``pipe.optim_parameters()`` with ``optim_dtype``),
they take over the publish that ``pipe.step`` would otherwise do as a separate pass
before the update: parameter by parameter, in chunks small enough to stay in cache, each
chunk of the model's weight is written from its master and the master is then updated by
torch's fused kernel, so the master is read from memory once for both.  The schedule is
unchanged (the call after ``step(i)`` still uses the weights from before step ``i``, the
fences open unit by unit), and the results are bitwise those of torch's fused optimizer.

Measured (``bench/optimizer.py``, 2-core VM, 33.6 M parameters): no speed-up beyond the
noise yet (0.93-1.10x of torch's fused AdamW plus the separate publish pass), because
torch's kernels still read the fp32 ``.grad`` the landing made and each chunk costs two
kernel calls.  A single compiled kernel that reads the landed bf16 gradient and writes
master, moments and weight in one loop measured 1.54x on the same machine (0.71 against
1.09 s per billion parameters for conversion + publish + update); that is the next step.

Only asynchronous steps (``pipe.step(fn)``, the default) fuse: a synchronous step
publishes the updated masters afterwards, at ``synchronize()``, as a pass of its own.
Not yet (issue 17): reading the landed low-precision gradients directly (the fp32
``.grad`` is still materialised), ``state_dtype``, clipping inside the update.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .runtime.host_state import ModelState, owner_of

log = logging.getLogger(__name__)

#: Elements per chunk: the five streams of a chunk (about 18 MiB for AdamW) stay in a
#: 32 MiB L3 between the publish and the update; smaller chunks lose more to per-call
#: overhead (~30 us) than they gain (bench/optimizer.py, 2-core EPYC VM: 2^16 0.64x,
#: 2^20 1.10x, whole tensors 0.99x against the separate publish pass).
CHUNK = 1 << 20


class _PublishingStep:
    """Shared by the optimizers: find the pipe the parameters belong to, and run the
    update inside its publish when a step owes one."""

    _host: ModelState | None

    def _bind(self, params: list[torch.Tensor]) -> None:
        owners = {id(o): o for o in (owner_of(p) for p in params)}
        host = next(iter(owners.values())) if len(owners) == 1 else None
        self._host = host
        if host is not None:
            host.bind_step_publisher(self)
        elif len(owners) > 1 and None not in owners.values():
            log.info("roundpipe.optim: parameters of several pipes; publishing separately")

    def _fusable(self) -> bool:
        # GradScaler's fused path hands the scale through attributes; publish first then.
        return getattr(self, "grad_scale", None) is None and \
            getattr(self, "found_inf", None) is None

    def _step_publishing(self, closure: Callable[[], Any] | None,
                         torch_step: Callable[..., Any],
                         update: Callable[[dict, torch.Tensor, torch.Tensor], None]) -> Any:
        host = self._host
        version = host.take_publish() if host is not None else None
        if version is None:
            return torch_step(closure)
        if not self._fusable():
            host.publish(version)
            return torch_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = {id(p): g for g in self.param_groups for p in g["params"]}  # type: ignore[attr-defined]

        def publish_and_update(name: str, master: torch.Tensor, weight: torch.Tensor) -> None:
            group = groups.get(id(master))
            if group is None or master.grad is None:
                weight.copy_(master)
                return
            update(group, master, weight)
        host.publish_in_step(version, publish_and_update)
        return loss


def _chunks(master: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None
            ) -> list[tuple[torch.Tensor, ...]]:
    """Matching flat chunks of ``master``, ``weight`` and ``others`` (or one whole chunk
    where a tensor is not contiguous)."""
    tensors = (master, weight) + tuple(o for o in others if o is not None)
    if not all(t.is_contiguous() for t in tensors) or master.numel() <= CHUNK:
        return [tensors]
    flat = [t.view(-1) for t in tensors]
    n = master.numel()
    return [tuple(f[i:i + CHUNK] for f in flat) for i in range(0, n, CHUNK)]


class AdamW(_PublishingStep, torch.optim.AdamW):
    """``torch.optim.AdamW(..., fused=True)`` that publishes a pipe's weights in the same
    pass as the update (see the module's documentation)."""

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, fused=True)
        self._bind([p for g in self.param_groups for p in g["params"]])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._step_publishing(closure, super().step, self._update)

    def _update(self, group: dict, master: torch.Tensor, weight: torch.Tensor) -> None:
        state = self.state[master]
        if not state:  # as torch.optim.AdamW initialises it (fused: step on the device)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master,
                                                   memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(
                    master, memory_format=torch.preserve_format)
        step = state["step"]
        step += 1
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        for chunk in _chunks(master, weight, master.grad, state["exp_avg"],
                             state["exp_avg_sq"], state.get("max_exp_avg_sq")):
            m, w, g, ea, eas = chunk[:5]
            w.copy_(m)  # the publish: the weight gets the master from before this step
            torch._fused_adamw_(
                [m], [g], [ea], [eas], [chunk[5]] if amsgrad else [], [step],
                amsgrad=amsgrad, lr=group["lr"], beta1=beta1, beta2=beta2,
                weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=group["maximize"], grad_scale=None, found_inf=None)


class SGD(_PublishingStep, torch.optim.SGD):
    """``torch.optim.SGD(..., fused=True)`` (momentum, dampening, nesterov, weight decay)
    that publishes a pipe's weights in the same pass as the update."""

    def __init__(self, params: Any, lr: float | torch.Tensor = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float = 0, nesterov: bool = False, *,
                 maximize: bool = False) -> None:
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         fused=True)
        self._bind([p for g in self.param_groups for p in g["params"]])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._step_publishing(closure, super().step, self._update)

    def _update(self, group: dict, master: torch.Tensor, weight: torch.Tensor) -> None:
        momentum = group["momentum"]
        state = self.state[master]
        buffer = state.get("momentum_buffer")
        first = momentum != 0 and buffer is None
        if first:
            buffer = torch.empty_like(master.grad)
        for chunk in _chunks(master, weight, master.grad, buffer):
            m, w, g = chunk[:3]
            w.copy_(m)
            torch._fused_sgd_(
                [m], [g], [chunk[3]] if momentum != 0 else [],
                weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"],
                maximize=group["maximize"], is_first_step=first, grad_scale=None,
                found_inf=None)
        if momentum != 0:
            state["momentum_buffer"] = buffer
