"""The optimizer Trainer and its scheduler step: a front for the one the pipe's
optimizer thread runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..api import RoundPipe
from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import RoundPipeTrainerMixin


class PipeOptimizer(torch.optim.Optimizer):
    """The optimizer Trainer (and its LR scheduler) sees: ``step()`` enqueues a pipe step
    that runs ``inner`` on the pipe's optimizer thread.

    The scheduler changes this object's ``param_groups``, never ``inner``'s: a step reads
    the hyperparameters they held when it was enqueued, though the scheduler moves on
    before an asynchronous step runs.  ``share_groups``: the groups are ``inner``'s own
    (an optimizer given to the trainer, whose scheduler may be built on it; its steps
    are synchronous).
    """

    def __init__(self, inner: torch.optim.Optimizer, pipe: RoundPipe, *,
                 max_grad_norm: float, is_async: bool, share_groups: bool = False) -> None:
        # Not Optimizer.__init__: this object holds no state of its own.
        self.inner = inner
        self.pipe = pipe
        self.max_grad_norm = max_grad_norm
        self.is_async = is_async
        self.defaults = inner.defaults
        self.param_groups = (inner.param_groups if share_groups
                             else [dict(g) for g in inner.param_groups])
        self.grad_norm: torch.Tensor | None = None  # of the last step, once it ran
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._zero_grad_profile_name = "PipeOptimizer.zero_grad"

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def _hyper(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("a pipe step takes no closure: the loss is computed by "
                              "forward_backward before the step")
        hyper = self._hyper()
        norm = torch.zeros((), dtype=torch.float32)
        self.grad_norm = norm
        inner, max_norm, pipe = self.inner, self.max_grad_norm, self.pipe
        if not self.is_async and pipe.step_overlap(inner) == "per unit":
            # The exact step the next call overlaps (pipe.step(optimizer)): the clip's
            # norm first (the whole gradient, on the optimizer thread), then the update
            # unit by unit with the hyperparameters of now.
            for group, values in zip(inner.param_groups, hyper):
                group.update(values)
            norm.copy_(pipe.clip_grad_norm_(max_norm if max_norm > 0 else float("inf")))
            pipe.step(inner)
            return

        def step_fn() -> None:  # on the pipe's optimizer thread
            for group, values in zip(inner.param_groups, hyper):
                group.update(values)
            # Trainer measures the norm at every step, clipping or not (inf: no clipping).
            # The pipe's clip leaves gradients held where they landed (roundpipe.optim);
            # torch's would read p.grad, which converts each to a float32 .grad.
            total = pipe.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"))
            norm.copy_(total)
            inner.step()
            inner.zero_grad()

        self.pipe.step(step_fn, is_async=self.is_async)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each step zeroes the gradients it used."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self.pipe.wait()  # the step in flight, not published (the run is kept)
        state = self.inner.state_dict()
        for group, values in zip(state["param_groups"], self._hyper()):
            group.update(values)  # the scheduler's newest values, as Trainer saves them
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.pipe.wait()
        self.inner.load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("the pipe's optimizer has the groups Trainer made; add none")


class NormOfNextStep:
    """The gradient norm of the step Trainer is about to enqueue (read after it ran)."""

    def __init__(self, trainer: RoundPipeTrainerMixin) -> None:
        self.trainer = trainer

    def value(self) -> float | None:
        optimizer = self.trainer.optimizer
        while not isinstance(optimizer, PipeOptimizer) and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer  # accelerate's wrapper (twice after two train())
        norm = getattr(optimizer, "grad_norm", None)
        if norm is None:
            return None
        self.trainer.pipe.wait()  # the step, not published: the run is kept
        return norm.item()
