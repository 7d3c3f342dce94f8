"""roundpipe: train models larger than GPU memory with dispatch pipeline parallelism.

All model state lives in host memory; every device is a stateless worker to which each
stage's weights are streamed round-robin while microbatches flow through the stages.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys


def _cli_help_only() -> bool:
    """Whether this import starts ``python -m roundpipe`` with ``--help``/``-h`` (or no
    arguments): argparse answers without the package's contents, so torch (seconds to
    import) is not imported.  During the package's import by ``-m``, ``sys.argv[0]`` is
    ``"-m"`` and the rest are the command's arguments."""
    argv, orig = sys.argv, list(getattr(sys, "orig_argv", ()))
    if not argv or argv[0] != "-m":
        return False
    starts = [k for k, a in enumerate(orig) if a in ("-m", f"-m{__name__}")]
    if not starts:
        return False
    k = starts[0]
    if not (orig[k] == f"-m{__name__}" or (k + 1 < len(orig) and orig[k + 1] == __name__)):
        return False
    args = argv[1:]
    return not args or "-h" in args or "--help" in args


def _backend_entry_point_installed() -> bool:
    try:
        return any(ep.name == "roundpipe"
                   for ep in importlib.metadata.entry_points(group="torch_dynamo_backends"))
    except Exception:  # noqa: BLE001 - broken metadata: register by hand below
        return False


if not _cli_help_only():  # (the package's contents; the command line imports them itself)
    from .api import RoundPipe, compile
    from .checkpoint import CheckpointError, export_weights, load_checkpoint, save_checkpoint
    from .config import RoundPipeRunConfig
    from .grad_scaler import GradScaler
    from .errors import (ConfigError, InputError, InputGradientError, LossError,
                         MergeError, ModelError,
                         OutOfMemoryError, PartitionError, RoundPipeError, StageError,
                         StepError, TraceError, UnknownConfigFieldError)
    from .errors import (DataParallelError, DoubleBackwardError, GradModeError,
                         HostOutOfMemoryError,
                         NonFiniteGradientError, OffloadError,
                         OffloadMismatchError, OptimizerError, ParameterHookError,
                         ReplicaError)
    from .runtime.data_parallel import DataParallelConfig
    from .plan import StagePlan
    from .runtime.host_memory import HostMemory
    from . import optim  # roundpipe.optim.AdamW / SGD

    # Installed, Dynamo finds torch.compile(backend="roundpipe") through the entry point
    # and imports roundpipe.backend only then (importing Dynamo costs about a second); from
    # a source tree without it, the backend registers itself here.
    if not _backend_entry_point_installed():
        from . import backend
        backend.register()


def __getattr__(name: str) -> object:
    if name == "backend":  # roundpipe.backend.plans() without importing it first
        return importlib.import_module(".backend", __name__)
    raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = [
    "compile",
    "RoundPipe",
    "RoundPipeRunConfig",
    "StagePlan",
    "HostMemory",
    "GradScaler",
    "save_checkpoint",
    "load_checkpoint",
    "export_weights",
    "CheckpointError",
    "RoundPipeError",
    "ConfigError",
    "UnknownConfigFieldError",
    "ModelError",
    "ParameterHookError",
    "TraceError",
    "PartitionError",
    "InputError",
    "InputGradientError",
    "LossError",
    "MergeError",
    "StageError",
    "StepError",
    "DoubleBackwardError",
    "GradModeError",
    "OptimizerError",
    "NonFiniteGradientError",
    "OutOfMemoryError",
    "HostOutOfMemoryError",
    "OffloadError",
    "OffloadMismatchError",
    "DataParallelConfig",
    "DataParallelError",
    "ReplicaError",
]
