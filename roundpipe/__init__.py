"""roundpipe: train models larger than GPU memory with dispatch pipeline parallelism.

All model state lives in host memory; every device is a stateless worker to which each
stage's weights are streamed round-robin while microbatches flow through the stages.
"""

from __future__ import annotations

from .api import RoundPipe, compile
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import RoundPipeRunConfig
from .grad_scaler import GradScaler
from .errors import (ConfigError, InputError, LossError, ModelError, OutOfMemoryError,
                     PartitionError, RoundPipeError, StageError, StepError, TraceError,
                     UnknownConfigFieldError)
from .errors import DataParallelError, ReplicaError
from .runtime.data_parallel import DataParallelConfig
from .plan import StagePlan
from . import backend

# torch.compile(model, backend="roundpipe") also works from a source tree without the
# installed entry point.
backend.register()

__version__ = "0.1.0"

__all__ = [
    "compile",
    "RoundPipe",
    "RoundPipeRunConfig",
    "StagePlan",
    "GradScaler",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "RoundPipeError",
    "ConfigError",
    "UnknownConfigFieldError",
    "ModelError",
    "TraceError",
    "PartitionError",
    "InputError",
    "LossError",
    "StageError",
    "StepError",
    "OutOfMemoryError",
    "DataParallelConfig",
    "DataParallelError",
    "ReplicaError",
]
