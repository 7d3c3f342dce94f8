"""The errors of ``roundpipe.hf``."""

from __future__ import annotations

from ..errors import ConfigError, OptimizerError, RoundPipeError


class TrainerArgumentError(ConfigError):
    """A Trainer argument asks for something roundpipe cannot do (it names them)."""


class TrainerOptimizerError(TrainerArgumentError, OptimizerError):
    """The optimizer (or scheduler) given to the Trainer could not train the pipe."""


class TrainerLossError(RoundPipeError, RuntimeError):
    """``compute_loss`` used the model in a way a pipelined step cannot replay."""
