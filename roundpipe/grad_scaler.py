"""Dynamic loss scaling for fp16 models that works with the asynchronous optimizer.

Usage::

    pipe = RoundPipe(model.half(), optim_dtype=torch.float32)
    scaler = roundpipe.GradScaler(pipe)          # or GradScaler(8192.0), as torch.amp's
    opt = torch.optim.AdamW(pipe.optim_parameters())
    for x, y in data:
        loss = pipe.forward_backward(input_args=(x,), label=y,
                                     loss_fn=lambda out, y: scaler.scale(loss_fn(out, y)))
        pipe.step(lambda: scaler.step(opt))      # unscale, skip on inf/NaN, step, update

    # torch.amp's loop runs unchanged, with the pipe's forward and step:
    scaler.scale(loss_fn(pipe(x), y)).backward()
    pipe.step(lambda: scaler.step(opt))
    scaler.update()                              # a no-op: step() updated the scale

Made without its pipe, the scaler binds to the pipe it is first used with: the one whose
``loss_fn`` or ``step_fn`` calls it, else the one the calling thread used last.

Why it differs from ``torch.amp.GradScaler``: with ``step(is_async=True)`` the next call
runs while the optimizer thread is still stepping, so a scale changed by that step must
not reach a call already under way, and each step must unscale by the scale its gradients
were made with.  The scale calls use therefore changes only at step boundaries: when
``pipe.step`` enqueues a step, the scale the calls since the previous step used is recorded
under that step's version, and calls from then on use the newest scale the optimizer
thread has computed.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from . import current
from .errors import ConfigError
from .runtime.grad_norm import held_grad_norm, scale_grad_

if TYPE_CHECKING:  # pragma: no cover
    from .api import RoundPipe

log = logging.getLogger(__name__)


class GradScaler:
    """Loss scaling with growth and back-off, for :class:`~roundpipe.RoundPipe`.

    Args:
        pipe: the pipe whose ``step`` calls this scaler's :meth:`step`; or, as
            ``torch.amp.GradScaler`` takes them first, a device string (ignored: the pipe
            places the work) or the first scale; or None: bound on first use.
        init_scale: the first scale.
        growth_factor: multiplies the scale after ``growth_interval`` steps without
            inf/NaN gradients.
        backoff_factor: multiplies the scale after a step with inf/NaN gradients (which
            is skipped).
        growth_interval: steps without inf/NaN before the scale grows.
        enabled: ``False`` makes every method a pass-through.
    """

    def __init__(self, pipe: RoundPipe | str | float | None = None,
                 init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, *, device: str | None = None) -> None:
        from .api import RoundPipe
        if isinstance(pipe, (int, float)) and not isinstance(pipe, bool):
            # GradScaler(8192.0): torch.cuda.amp's order, the scale first
            pipe, init_scale = None, float(pipe)
        elif isinstance(pipe, str):  # GradScaler("cuda", ...): torch.amp's order
            pipe = None
        elif pipe is not None and not isinstance(pipe, RoundPipe):
            raise ConfigError(
                f"GradScaler's first argument is the RoundPipe (or, as torch.amp takes it, "
                f"the device or the initial scale); got a {type(pipe).__name__}. Use "
                "GradScaler(pipe), GradScaler(init_scale=...) or GradScaler()")
        if not isinstance(init_scale, (int, float)) or isinstance(init_scale, bool):
            raise ConfigError(f"init_scale must be a number, got {init_scale!r}")
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval >= 1):
            raise ConfigError(
                f"GradScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                f"and growth_interval >= 1; got {init_scale}, {growth_factor}, "
                f"{backoff_factor}, {growth_interval}")
        self.enabled = enabled
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._visible = float(init_scale)   # what scale() multiplies by
        self._latest = float(init_scale)    # the newest scale computed by a step
        self._good_steps = 0
        # The scale each enqueued step's gradients were made with, by the step's version.
        self._step_scales: dict[int, float] = {}
        self._pipe: RoundPipe | None = None
        self._lock = threading.Lock()
        self.skipped_steps = 0
        # optimizer id -> (step version, finite, scale) of an unscale_ whose step() has
        # not run yet
        self._unscaled: dict[int, tuple[int | None, bool, float]] = {}
        if pipe is not None:
            self._bind(pipe)

    def _bind(self, pipe: RoundPipe) -> None:
        self._pipe = pipe
        pipe.attach_step_observer(on_step_enqueued=self._on_step_enqueued,
                                  on_synchronized=self._on_synchronized,
                                  nonfinite_loss_ok=self.enabled)  # inf/NaN skips the step

    def _bound(self) -> RoundPipe | None:
        """The pipe, binding to the one this code runs for (or last used) if need be."""
        if self._pipe is None:
            pipe = current.current_pipe()
            if pipe is not None:
                with self._lock:
                    if self._pipe is None:
                        self._bind(pipe)
        return self._pipe

    # --- used in loss_fn (device threads) ------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale."""
        if not self.enabled:
            return loss
        self._bound()
        return loss * self._visible

    def update(self, new_scale: float | None = None) -> None:
        """For ``torch.amp``'s loop: :meth:`step` has updated the scale already (on the
        optimizer thread, at the step it belongs to), so this does nothing; a
        ``new_scale`` is set for the calls after the next step."""
        if new_scale is not None:
            with self._lock:
                self._latest = float(new_scale)

    def get_scale(self) -> float:
        """The scale calls use now."""
        return self._visible if self.enabled else 1.0

    def unscale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a call returned, without the scale (call it before the next step)."""
        return loss / self.get_scale()

    # --- used in step_fn (optimizer thread) ----------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale their calls used, as
        ``torch.amp.GradScaler.unscale_`` does: in ``step_fn``, before clipping, e.g.
        ``scaler.unscale_(opt); pipe.clip_grad_norm_(1.0); scaler.step(opt)``.  The
        following :meth:`step` does not unscale again (and skips the step if a
        gradient was inf/NaN)."""
        if not self.enabled:
            return
        version, scale = self._running_scale("unscale_", pop=False)
        earlier = self._unscaled.get(id(optimizer))
        if earlier is not None and earlier[0] == version:
            raise ConfigError("unscale_() was already called on this optimizer since its "
                              "last step(); call it once per step")
        self._unscaled[id(optimizer)] = (version, self._unscale(optimizer, scale), scale)

    def step(self, optimizer: torch.optim.Optimizer, zero_grad: bool = True) -> bool:
        """Unscale the gradients (unless :meth:`unscale_` did), step unless one is
        inf/NaN, update the scale.

        Returns True if the optimizer stepped.
        """
        if not self.enabled:
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad()
            return True
        version, scale = self._running_scale("step", pop=True)
        unscaled = self._unscaled.pop(id(optimizer), None)
        if unscaled is not None and unscaled[0] == version:  # (not a failed step's)
            _, finite, scale = unscaled
        else:
            finite = self._unscale(optimizer, scale)
        if finite:
            optimizer.step()
        else:
            self.skipped_steps += 1
            log.info("roundpipe: GradScaler skipped a step (inf/NaN gradients at scale %g)",
                     scale)
        if zero_grad:
            optimizer.zero_grad()
        self._update(finite, scale)
        return finite

    def _running_scale(self, method: str, pop: bool) -> tuple[int | None, float]:
        """The running step's version and the scale its calls were made with."""
        pipe = self._bound()
        if pipe is None:
            raise ConfigError(
                f"GradScaler.{method}(opt) runs outside any pipe's step: call it inside "
                f"pipe.step(lambda: scaler.{method}(opt)), or make the scaler with "
                "GradScaler(pipe)")
        version = pipe.running_step
        with self._lock:
            if version is None:
                return None, self._visible
            scale = (self._step_scales.pop(version, self._visible) if pop
                     else self._step_scales.get(version, self._visible))
            # Steps before this one that never called scaler.step leave their entry behind.
            for stale in [v for v in self._step_scales if v < version]:
                del self._step_scales[stale]
        return version, scale

    def _unscale(self, optimizer: torch.optim.Optimizer, scale: float) -> bool:
        """Multiply the gradients by 1/scale; whether all are finite."""
        inv = 1.0 / scale
        finite = True
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    # A gradient held where it landed (roundpipe.optim) is not converted:
                    # its norm says whether it is finite, and the optimizer's update
                    # applies the factor.
                    norm = held_grad_norm(p)
                    if norm is not None:
                        if finite and not bool(torch.isfinite(norm)):
                            finite = False
                        scale_grad_(p, torch.tensor(inv, dtype=torch.float64))
                        continue
                    if p.grad is None:
                        continue
                    p.grad.mul_(inv)
                    if finite and not bool(torch.isfinite(p.grad).all()):
                        finite = False
        return finite

    def _update(self, finite: bool, scale: float) -> None:
        with self._lock:
            if not finite:
                self._latest = scale * self.backoff_factor
                self._good_steps = 0
                return
            self._good_steps += 1
            self._latest = scale
            if self._good_steps >= self.growth_interval:
                self._latest = scale * self.growth_factor
                self._good_steps = 0

    # --- pipe hooks (caller thread) ------------------------------------------------------
    def _on_step_enqueued(self, version: int) -> None:
        with self._lock:
            self._step_scales[version] = self._visible
            self._visible = self._latest

    def _on_synchronized(self) -> None:
        with self._lock:
            # Every step has run; an entry left is a step that never called scaler.step.
            self._step_scales.clear()
            self._visible = self._latest

    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs: the newest scale, the one calls use now
        (they differ between a step and the next one's enqueue), and the counters.
        Take it after ``pipe.synchronize()`` or ``pipe.state_dict()``, so no step is
        queued."""
        with self._lock:
            return {"scale": self._latest, "visible_scale": self._visible,
                    "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._latest = float(state["scale"])
            self._visible = float(state.get("visible_scale", state["scale"]))
            self._good_steps = int(state["good_steps"])
            self.skipped_steps = int(state.get("skipped_steps", 0))
            self._step_scales.clear()
