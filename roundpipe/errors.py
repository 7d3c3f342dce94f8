"""Errors raised by roundpipe.

Every error is a :class:`RoundPipeError` and also subclasses the builtin type a caller
would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for failures while
running, ``MemoryError`` for out-of-memory).  Messages state the fact, the numbers and the
way out.
"""

from __future__ import annotations

import difflib
from typing import Iterable


class RoundPipeError(Exception):
    """Base class of every error roundpipe raises on purpose."""


class ConfigError(RoundPipeError, ValueError):
    """A configuration value (``RoundPipeRunConfig``, compile options) is invalid."""


class UnknownConfigFieldError(ConfigError, TypeError):
    """A configuration was given a field it does not have."""


class ModelError(RoundPipeError, ValueError):
    """The model cannot be pipelined as given (for example, it has no parameters)."""


class ParameterHookError(ModelError):
    """A hook registered on a parameter (``register_hook``,
    ``register_post_accumulate_grad_hook``) cannot run where and as often as eager
    PyTorch runs it; refused before the call runs."""


class TraceError(RoundPipeError, RuntimeError):
    """Neither ``torch.export`` nor the ``torch.fx`` fallback could trace the model."""


class PartitionError(RoundPipeError, ValueError):
    """No partition satisfies the constraints (stage count, memory cap)."""


class InputError(RoundPipeError, ValueError):
    """Inputs or labels passed to a call are unusable (device, batch size, structure)."""


class InputGradientError(InputError):
    """The gradient a call would send into its inputs or label cannot reach where it
    belongs exactly (``forward_backward``: their graph reaches a parameter of the pipe's
    own model under data parallelism, or one with hooks; ``pipe(x)``: an input that
    requires grad split otherwise than along dim 0); refused before anything runs."""


class MergeError(RoundPipeError, ValueError):
    """An output of a split call cannot be put back together exactly (it mixes samples in
    a way roundpipe cannot recompute on the whole batch)."""


class LossError(RoundPipeError, ValueError):
    """``loss_fn`` returned something that is not a finite scalar tensor."""


class GradModeError(RoundPipeError, RuntimeError):
    """``forward_backward`` was called where autograd records nothing
    (``torch.no_grad()``, ``torch.inference_mode()``): eager's backward raises there."""


class BackwardAlreadyRunError(RoundPipeError, RuntimeError):
    """``backward()`` was called on the loss ``forward_backward`` returned (whose backward
    has run already)."""


class StageError(RoundPipeError, RuntimeError):
    """An exception was raised while a stage ran on a device.

    Attributes:
        stage: index of the failing stage in execution order.
        device: name of the device it ran on.
        microbatch: index of the microbatch being processed (``None`` if outside one).
    """

    def __init__(self, message: str, *, stage: int | None = None, device: str | None = None,
                 microbatch: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.device = device
        self.microbatch = microbatch


class DoubleBackwardError(RoundPipeError, RuntimeError):
    """A backward through a pipelined call was asked to build a graph of its own
    (``create_graph=True``: double backward, gradient penalties); refused before that
    backward runs anything."""


class StepError(RoundPipeError, RuntimeError):
    """The ``step_fn`` passed to ``RoundPipe.step`` raised."""


class OptimizerError(RoundPipeError, ValueError):
    """An optimizer cannot update what it was given: a ``roundpipe.optim`` optimizer's
    arguments, or an optimizer stepped inside ``pipe.step`` that holds the model's
    parameters in place of their masters, or nothing it could step."""


class NonFiniteGradientError(RoundPipeError, RuntimeError):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` found an inf/NaN total norm (a
    RuntimeError, as torch's function raises)."""


class OutOfMemoryError(RoundPipeError, MemoryError):
    """A stage does not fit in a device's memory."""


class HostOutOfMemoryError(RoundPipeError, MemoryError):
    """The host could not allocate what roundpipe needs (an optimizer's state, say)."""


class CheckpointError(RoundPipeError, ValueError):
    """A checkpoint file cannot be used (not one of ours, or unsafe to load)."""


class OffloadError(RoundPipeError, RuntimeError):
    """The disk tier (``offload_dir``) cannot do what was asked: a directory it cannot
    use or that holds another run's state, a disk without room, an I/O error."""


class OffloadMismatchError(OffloadError):
    """``offload_resume`` found a directory whose committed state belongs to another
    model or optimizer than this pipe's (the manifest records what it belongs to);
    nothing was resumed."""


class DataParallelError(RoundPipeError, RuntimeError):
    """Replicas could not combine their gradients (a collective failed or timed out, or
    the replicas do not run the same program); the group is unusable afterwards, except
    after its subclass :class:`ReplicaError`."""


class ReplicaError(DataParallelError):
    """Another replica failed during the same call.  No replica committed the call, so
    they all still agree and the group stays usable.

    Attributes:
        ranks: the replicas that failed.
        messages: their errors, as text.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (),
                 messages: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.messages = messages


__all__ = [
    "RoundPipeError",
    "ConfigError",
    "UnknownConfigFieldError",
    "ModelError",
    "ParameterHookError",
    "TraceError",
    "PartitionError",
    "InputError",
    "LossError",
    "BackwardAlreadyRunError",
    "StageError",
    "DoubleBackwardError",
    "StepError",
    "OutOfMemoryError",
    "HostOutOfMemoryError",
    "CheckpointError",
    "OffloadError",
    "DataParallelError",
    "ReplicaError",
]


def unknown_options_message(owner: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """``RoundPipe`` has no option ``device`` (did you mean ``devices``?); the valid
    options are: ..."""
    names = [k for k in known if k not in ("self", "model") and not k.startswith("_")
             and k not in ("unknown", "args", "kwargs")]
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, names, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"{owner} has no option(s) {', '.join(parts)}; the valid options are: "
            f"{', '.join(names)}")
