"""Model weights as sharded safetensors with an index, the layout ``transformers`` reads.

``model.safetensors`` when everything fits one shard, else ``model-00001-of-0000N.
safetensors`` ... plus ``model.safetensors.index.json`` (``{"metadata": {"total_size":
bytes}, "weight_map": {name: file}}``).  Tensors are assigned to shards in state-dict
order, a new shard starting when the next tensor would pass ``max_shard_size`` (a tensor
larger than that gets a shard of its own).  Names that alias another tensor's storage
(tied weights) are written once, under the first name, as ``transformers`` does.

``safetensors`` is imported when a function here runs (it belongs to the ``hf`` extra).
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, RoundPipeError
from ..runtime.devices import parse_bytes
from .atomic import fsync_directory, write_atomically

if TYPE_CHECKING:  # pragma: no cover
    from ..api import RoundPipe

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")


class MissingDependencyError(RoundPipeError, ImportError):
    """An optional package a feature needs is not installed."""


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:
        raise MissingDependencyError(
            "writing safetensors needs the safetensors package, which is not installed: "
            "pip install 'roundpipe[hf]' (or pip install safetensors)") from e
    return safetensors.torch


def _unique(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors only, each storage once (first name wins), contiguous, on the CPU."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    dropped = []
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() > 0 and key in seen:
            dropped.append(f"{name} (= {seen[key]})")
            continue
        seen[key] = name
        # safetensors refuses tensors that share memory: a slice of a bigger one is copied
        whole = (t.is_contiguous() and t.storage_offset() == 0
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        out[name] = t if whole else t.clone()
    if dropped:
        log.info("roundpipe: tied weights written once: %s", ", ".join(dropped))
    return out


def save_sharded(state: dict[str, Any], out_dir: str | os.PathLike[str],
                 max_shard_size: int | str = "5GB",
                 metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``state``'s tensors to ``out_dir`` as safetensors shards (+ index); returns
    the files written.  Each file is written atomically; shards of an earlier export that
    the new index does not name are removed."""
    st = _safetensors()
    limit = parse_bytes(max_shard_size)
    if limit is None or limit <= 0:
        raise RoundPipeError(f"max_shard_size must be a positive size such as '5GB', got "
                             f"{max_shard_size!r}")
    tensors = _unique(state)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    names = [WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    # Every shard is written and flushed under a temporary name first, then all are renamed
    # in one go: an export interrupted while writing (the long part) leaves the earlier
    # export whole, never new shards beside old ones under the old index.
    temps = [os.path.join(out_dir, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
             for name in names]
    try:
        for temp, shard in zip(temps, shards):
            st.save_file(shard, temp, metadata=meta)
            with open(temp, "rb+") as f:
                os.fsync(f.fileno())
        for temp, name in zip(temps, names):
            os.replace(temp, os.path.join(out_dir, name))
    except BaseException:
        for temp in temps:
            if os.path.exists(temp):
                os.unlink(temp)
        raise
    written = [os.path.join(out_dir, n) for n in names]
    index_path = os.path.join(out_dir, INDEX)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {t: n for n, shard in zip(names, shards) for t in shard}}
        write_atomically(index_path, lambda f: f.write(json.dumps(index, indent=2).encode()))
        written.append(index_path)
    elif os.path.exists(index_path):
        os.unlink(index_path)  # an earlier, sharded export's
    for entry in os.listdir(out_dir):
        if (_SHARD.match(entry) or (entry == WEIGHTS and len(shards) > 1)) \
                and entry not in names:
            os.unlink(os.path.join(out_dir, entry))
    fsync_directory(out_dir)
    return written


def save_pretrained(pipe: RoundPipe, save_directory: str | os.PathLike[str],
                    max_shard_size: int | str = "5GB") -> list[str]:
    """A plain module's weights (every step taken) as sharded safetensors."""
    pipe.synchronize()
    return save_sharded(pipe.model.state_dict(), save_directory, max_shard_size)


def export_weights(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                   max_shard_size: int | str = "5GB",
                   dtype: torch.dtype | None = None) -> list[str]:
    """Write a checkpoint's model weights (the masters, where the run had them) as sharded
    safetensors, without reading its optimizer state.

    Args:
        checkpoint: a file or directory :func:`roundpipe.save_checkpoint` wrote.
        dtype: cast floating-point weights to it (e.g. ``torch.bfloat16``); default: as
            stored (fp32 masters stay fp32).

    Returns:
        The files written.
    """
    from . import sharded
    from .asynchronous import wait_for_saves
    from .save_load import FORMAT
    _safetensors()  # fail before reading anything
    wait_for_saves()  # an asynchronous save to this path may still be writing it
    path = os.fspath(checkpoint)
    if os.path.isdir(path) or not os.path.exists(path):
        directory = sharded.resolve(path)
        model = sharded.model_state(directory, sharded.read_meta(directory))
    else:
        try:  # mmap: the optimizer's tensors are never read from disk
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - every unusable file gets the same error
            raise CheckpointError(f"cannot load {path!r} as a checkpoint with "
                                  f"weights_only=True ({type(e).__name__}: {e})") from e
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{path!r} is not a roundpipe checkpoint")
        model = state["model"]
    if dtype is not None:
        model = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                 else v for k, v in model.items()}
    return save_sharded(model, out_dir, max_shard_size)
