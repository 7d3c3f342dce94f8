"""What ``compute_loss`` and ``prediction_step`` get as their ``model``: stand-ins that
record the model call, replay a microbatch's pipelined output, or run a pipelined
forward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..api import RoundPipe
from ..config import RoundPipeRunConfig
from ..runtime.signature import leading_size
from .errors import TrainerLossError


def fitted_run_config(pipe: RoundPipe, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> RoundPipeRunConfig | None:
    """A batch with fewer rows than ``num_microbatch`` (an epoch's last, evaluation's
    last) runs as one microbatch per row; None: the pipe's own configuration."""
    config = pipe.resolve_run_config()
    rows = leading_size(args, kwargs)
    if config.split_input is None and 0 < rows < config.num_microbatch:
        return RoundPipeRunConfig(num_microbatch=rows)
    return None


class Called(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model called")
        self.args, self.kwargs = args, kwargs


class ModelStandIn:
    """Passed to ``compute_loss`` as its ``model``: attributes are the real model's;
    calling it is what the subclasses decide."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.__dict__["_model"] = model

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() answers for the model
        # Trainer.compute_loss asks _is_peft_model(model) (isinstance) to find the causal
        # LM under LoRA adapters, whose labels label smoothing shifts.
        return type(self.__dict__["_model"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)


class Recorder(ModelStandIn):
    """Stops ``compute_loss`` at its model call and reports the call's arguments."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise Called(args, kwargs)


class Replay(ModelStandIn):
    """Returns the pipeline's output for one microbatch to the model call it was made for."""

    def __init__(self, model: torch.nn.Module, output: Any, keys: frozenset[str],
                 nargs: int) -> None:
        super().__init__(model)
        self.__dict__.update(_output=output, _keys=keys, _nargs=nargs, _used=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._used:
            raise TrainerLossError(
                "compute_loss called the model a second time in one training step; a "
                "pipelined step runs the model once per microbatch (forward and backward "
                "together), so override compute_loss to call it once")
        if frozenset(kwargs) != self._keys or len(args) != self._nargs:
            raise TrainerLossError(
                f"compute_loss called the model with keywords {sorted(kwargs)} on a "
                f"microbatch, but with {sorted(self._keys)} on the whole batch; make the "
                "call's arguments independent of the batch")
        self.__dict__["_used"] = True
        # The pipeline's outputs are autograd leaves; losses get a copy that in-place
        # arithmetic (Trainer's ``loss *= ...``) may change, as on a model's own output.
        return pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) and t.dim() == 0
            and t.requires_grad and t.is_leaf else t, self._output)


class Forward(ModelStandIn):
    """The model for evaluation and prediction: a pipelined forward."""

    def __init__(self, model: torch.nn.Module, pipe: RoundPipe,
                 autocast: contextlib.AbstractContextManager) -> None:
        super().__init__(model)
        self.__dict__.update(_pipe=pipe, _autocast=autocast)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Trainer counts num_items_in_batch on args.device (a GPU); the pipe's inputs
        # stay on the CPU.
        args, kwargs = pytree.tree_map(
            lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        with torch.no_grad(), self._autocast:
            return self._pipe.forward(
                *args, run_config=fitted_run_config(self._pipe, args, kwargs), **kwargs)
