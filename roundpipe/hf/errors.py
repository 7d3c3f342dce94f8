"""The errors of ``roundpipe.hf``."""

from __future__ import annotations

from ..errors import ConfigError, RoundPipeError


class TrainerArgumentError(ConfigError):
    """A Trainer argument asks for something roundpipe cannot do (it names them)."""


class TrainerLossError(RoundPipeError, RuntimeError):
    """``compute_loss`` used the model in a way a pipelined step cannot replay."""
