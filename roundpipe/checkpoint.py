"""Saving and resuming training exactly.

``save_checkpoint(path, pipe, optimizer, scaler)`` writes one file with the pipe's state
dict (masters, buffers, the dropout streams' counters and, under the asynchronous
schedule, the weights one step behind the masters), the optimizer's and the GradScaler's
state; ``load_checkpoint`` restores them so training continues bit for bit as if it had
never stopped.  Files are read with ``torch.load(weights_only=True)``: a checkpoint from
an untrusted source cannot execute code, it fails to load.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .errors import RoundPipeError

if TYPE_CHECKING:  # pragma: no cover
    from .api import RoundPipe
    from .grad_scaler import GradScaler

_FORMAT = "roundpipe-checkpoint-1"


class CheckpointError(RoundPipeError, ValueError):
    """A checkpoint file cannot be used (not one of ours, or unsafe to load)."""


def save_checkpoint(path: str | os.PathLike[str], pipe: RoundPipe,
                    optimizer: torch.optim.Optimizer | None = None,
                    scaler: GradScaler | None = None, extra: Any = None) -> None:
    """Write the training state to ``path`` (and nowhere else).

    Safe to call while an asynchronous step is pending: it waits for the step, without
    changing the schedule the run follows.  ``extra`` (plain data: numbers, strings,
    tensors, lists, dicts) is stored alongside, e.g. the data loader's position.
    """
    state = {
        "format": _FORMAT,
        "model": pipe.state_dict(),  # waits for a pending step first
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": extra,
    }
    torch.save(state, os.fspath(path))


def load_checkpoint(path: str | os.PathLike[str], pipe: RoundPipe,
                    optimizer: torch.optim.Optimizer | None = None,
                    scaler: GradScaler | None = None) -> Any:
    """Restore what :func:`save_checkpoint` wrote; returns its ``extra``.

    Create the optimizer over ``pipe.optim_parameters()`` before loading, as for a fresh
    run.
    """
    try:
        state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - every unusable file gets the same clear error
        raise CheckpointError(
            f"cannot load {os.fspath(path)!r} as a checkpoint with weights_only=True "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); roundpipe "
            "never unpickles arbitrary objects: save it with roundpipe.save_checkpoint") from e
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise CheckpointError(f"{os.fspath(path)!r} is not a roundpipe checkpoint "
                              f"(expected format {_FORMAT!r})")
    pipe.load_state_dict(state["model"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    return state.get("extra")
