"""Saving and resuming training exactly.

``save_checkpoint(path, pipe, optimizer, scaler)`` writes one file with the pipe's state
dict (masters, buffers, the dropout streams' counters and, under the asynchronous
schedule, the weights the next call uses and the masters kept to predict them), the
optimizer's and the GradScaler's state; ``load_checkpoint`` restores them so training
continues bit for bit as if it had never stopped.  Files are read with
``torch.load(weights_only=True)``: a checkpoint from an untrusted source cannot execute
code, it fails to load.

A save is atomic (``atomic.py``): it writes a temporary file beside the target, flushes
it to disk and renames it into place, so a crash or a kill during the write leaves the
previous checkpoint whole; temporary files of killed saves are removed by the next save.

``sharded=True`` writes a directory through ``torch.distributed.checkpoint`` instead
(``sharded.py``: every data-parallel replica writes its own part, and a load
reshards); ``asynchronous=True`` writes in the background (``asynchronous.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from .atomic import write_atomically

if TYPE_CHECKING:  # pragma: no cover
    from ..api import RoundPipe
    from ..grad_scaler import GradScaler
    from .asynchronous import CheckpointSave

FORMAT = "roundpipe-checkpoint-1"


def save_checkpoint(path: str | os.PathLike[str], pipe: RoundPipe,
                    optimizer: torch.optim.Optimizer | None = None,
                    scaler: GradScaler | None = None, extra: Any = None, *,
                    sharded: bool | None = None, asynchronous: bool = False,
                    max_snapshot_bytes: int | None = None) -> CheckpointSave | None:
    """Write the training state to ``path`` (and nowhere else).

    Safe to call while an asynchronous step is pending: it waits for the step, without
    changing the schedule the run follows.  ``extra`` (plain data: numbers, strings,
    tensors, lists, dicts) is stored alongside, e.g. the data loader's position.

    Args:
        sharded: write a directory through ``torch.distributed.checkpoint``; default: when
            ``path`` is an existing directory.  Under data parallelism every replica
            calls it (collective) and writes only what it owns.
        asynchronous: capture the state now and write it in the background; returns a
            :class:`~roundpipe.checkpoint.CheckpointSave` future.  A later save or
            load waits for it.
        max_snapshot_bytes: cap on the host memory an asynchronous sharded save copies;
            the masters and optimizer state beyond it are copied one tensor at a time
            while the write holds the optimizer thread (the next ``step_fn`` waits).
    """
    from .asynchronous import save_file_async, wait_for_saves
    wait_for_saves()  # one save at a time
    path = os.fspath(path)
    if sharded is None:
        sharded = os.path.isdir(path)
    if max_snapshot_bytes is not None and not (sharded and asynchronous):
        raise CheckpointError(
            f"max_snapshot_bytes={max_snapshot_bytes} only applies to an asynchronous sharded "
            "save (one file cannot be written in pieces): pass sharded=True, "
            "asynchronous=True")
    if sharded:
        from . import sharded as sharded_dir
        group = sharded_dir.checkpoint_group(pipe)
        collected = sharded_dir.collect(pipe, optimizer, scaler, extra, group)
        if asynchronous:
            from .asynchronous import save_sharded_async
            return save_sharded_async(path, pipe, collected, group, max_snapshot_bytes)
        sharded_dir.write(path, collected, group)
        return None
    state = {
        "format": FORMAT,
        "model": pipe.state_dict(),  # waits for a pending step first
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": extra,
    }
    if asynchronous:
        return save_file_async(path, state, _write_file)
    _write_file(path, state)
    return None


def _write_file(path: str, state: dict[str, Any]) -> None:
    write_atomically(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | os.PathLike[str], pipe: RoundPipe,
                    optimizer: torch.optim.Optimizer | None = None,
                    scaler: GradScaler | None = None) -> Any:
    """Restore what :func:`save_checkpoint` wrote; returns its ``extra``.

    Create the optimizer over ``pipe.optim_parameters()`` before loading, as for a fresh
    run.  A sharded checkpoint (a directory) loads into any number of replicas and
    devices: each process reads what it needs.
    """
    from .asynchronous import wait_for_saves
    wait_for_saves()
    if os.path.isdir(path) or not os.path.exists(path):
        from . import sharded as sharded_dir
        try:
            directory = sharded_dir.resolve(os.fspath(path))
        except CheckpointError:
            directory = None  # no directory either: the file's error below
        if directory is not None:
            return sharded_dir.load_sharded(directory, pipe, optimizer, scaler)
        if not os.path.exists(path):
            raise CheckpointError(f"no such file: {os.fspath(path)!r} (nor a sharded "
                                  "checkpoint directory); check the path")
    try:
        state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - every unusable file gets the same clear error
        raise CheckpointError(
            f"cannot load {os.fspath(path)!r} as a checkpoint with weights_only=True "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); roundpipe "
            "never unpickles arbitrary objects: save it with roundpipe.save_checkpoint") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{os.fspath(path)!r} is not a roundpipe checkpoint "
                              f"(expected format {FORMAT!r})")
    # Before any change, the model's tensors first: another model's checkpoint is named
    # by its keys, not by the optimizer groups that differ with them.
    check_model_state(state.get("model"), pipe, os.fspath(path))
    if optimizer is not None and state.get("optimizer") is not None:
        _check_groups(state["optimizer"], optimizer, os.fspath(path))
    with pipe.loading():  # the disk tier commits masters and moments as one
        pipe.load_state_dict(state["model"])
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    return state.get("extra")


def check_model_state(saved: Any, pipe: RoundPipe, path: str) -> None:
    """Refuse a saved model state whose keys or shapes are not the pipe's model's,
    naming them (``load_state_dict``'s checks, made before anything is loaded)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path!r} holds no model state dict")
    mine = pipe.model.state_dict()
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    shapes = [f"{k!r} saved {list(saved[k].shape)}, the model's {list(v.shape)}"
              for k, v in mine.items() if k in saved and isinstance(v, torch.Tensor)
              and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"missing keys: {len(missing)} of the model's tensors are not in it "
                     f"({_few(missing)})")
    if unexpected:
        parts.append(f"unexpected keys: {len(unexpected)} of its tensors are not the "
                     f"model's ({_few(unexpected)})")
    if shapes:
        parts.append(f"other shapes: {len(shapes)} ({'; '.join(shapes[:2])}"
                     + ("; ..." if len(shapes) > 2 else "") + ")")
    raise CheckpointError(
        f"{path!r} holds another model's state than {type(pipe.model).__name__}'s: "
        + "; ".join(parts) + ". Nothing was loaded: load it into the model it was saved "
        "from")


def _few(names: list[str], limit: int = 4) -> str:
    return ", ".join(repr(n) for n in names[:limit]) + (", ..." if len(names) > limit else "")


def _check_groups(saved: Any, optimizer: torch.optim.Optimizer, path: str) -> None:
    """The checks ``optimizer.load_state_dict`` makes, made before the model's weights are
    loaded, so a mismatch leaves everything as it was."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    theirs = [len(g.get("params", ())) for g in groups or ()]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if theirs != mine:
        raise CheckpointError(
            f"{path!r} holds an optimizer with {len(theirs)} parameter group(s) of {theirs} "
            f"parameters, this one has {mine}; nothing was loaded: create the optimizer "
            "over pipe.optim_parameters() with the same groups as the saved run")
