"""Sharded checkpoints: a directory written through ``torch.distributed.checkpoint``.

Layout of ``path/``::

    .metadata, __0_0.distcp, ...   DCP: every tensor (model, optimizer state), by key
    roundpipe.pt                   the rest (format, names, scaler, extra, optimizer
                                   hyper-parameters), torch.save, read weights_only

Keys: ``model.<state dict key>``, ``published.<parameter>`` (the weights the next call
uses under the asynchronous schedule: one step behind the masters, or predicted),
``previous.<parameter>`` (the masters kept for the weight prediction) and
``optimizer.<parameter>.<state key>``; optimizer state is stored by parameter *name*, not
index, so any optimizer over the same parameters loads it (a plain one, or
``ZeroRedundancyOptimizer`` over any number of replicas).

Data parallel: every replica calls :func:`save_sharded`; each writes only what it owns.
Replicated tensors (the model, a plain optimizer's state) carry the same keys on every
replica and DCP's planner has one replica write each; a ``ZeroRedundancyOptimizer``
contributes only its own shard's state.  Loading never communicates: each process reads
the keys it needs (its shard, or everything), which is what makes resharding free.

Atomicity: the save writes ``.<name>.tmp-<pid>-<hex>/``, flushed, then moves the old
directory aside, renames the new one into place and deletes the old.  A kill between the
two renames leaves no ``path``: :func:`resolve` then finds the complete directory beside
it (``roundpipe.pt`` is written last, so its presence means complete).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import uuid
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import CheckpointError
from .atomic import alive, fsync_directory, write_atomically
from .save_load import check_model_state

if TYPE_CHECKING:  # pragma: no cover
    from ..api import RoundPipe
    from ..grad_scaler import GradScaler

log = logging.getLogger(__name__)
# One process without a group is a use we intend, not a mistake worth a warning per save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

FORMAT = "roundpipe-sharded-2"  # 2: a tied weight is written once (model_aliases)
_READABLE = ("roundpipe-sharded-1", FORMAT)
META_FILE = "roundpipe.pt"
_TENSOR = "<tensor>"  # marks an optimizer state entry stored through DCP
_WRITING: set[str] = set()  # directories this process is writing now
_groups: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


@dataclass
class Collected:
    """What one process saves: DCP's tensors and the plain data of ``roundpipe.pt``.

    ``live`` keys are tensors only the optimizer thread changes (masters, optimizer
    state): an asynchronous save may read them late, while it holds the optimizer.
    ``private`` keys are copies made for the save (the lagging weights).
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    live: set[str] = field(default_factory=set)
    private: set[str] = field(default_factory=set)  # copies already, nobody changes them


# --- what is saved ---------------------------------------------------------------------

def _is_zero(optimizer: Any) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _param_names(pipe: RoundPipe, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(t): n for n, t in pipe.optim_named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a {tuple(p.shape)} parameter that is not one of "
                    "pipe.optim_parameters(); a checkpoint stores optimizer state by the "
                    "pipe's parameter names: create the optimizer over "
                    "pipe.optim_parameters()")
    return names


def collect(pipe: RoundPipe, optimizer: torch.optim.Optimizer | None,
            scaler: GradScaler | None, extra: Any, group: Any) -> Collected:
    """Gather this process's share of the training state (waits for a pending step)."""
    sd = pipe.state_dict()
    metadata = dict(getattr(sd, "_metadata", {}) or {})
    rp = dict(metadata.pop("roundpipe", {}) or {})
    published = rp.pop("published", None) or {}
    previous = rp.pop("previous", None) or {}  # kept masters (weight prediction)
    params = {n for n, _ in pipe.model.named_parameters(remove_duplicate=False)}
    tensors: dict[str, torch.Tensor] = {}
    live: set[str] = set()
    other: dict[str, Any] = {}
    aliases: dict[str, str] = {}  # a tied weight's second name -> the key written
    seen: dict[tuple[Any, ...], str] = {}
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            view = _view_key(value)
            if view in seen:
                aliases[key] = seen[view]
                continue
            seen[view] = key
            tensors["model." + key] = value.detach()
            if key in params:
                live.add("model." + key)
        else:
            other[key] = value
    for name, value in published.items():
        tensors["published." + name] = value  # already a copy
    for name, value in previous.items():  # live, as the masters: only a step changes them
        tensors["previous." + name] = value
        live.add("previous." + name)
    meta: dict[str, Any] = {
        "format": FORMAT, "model_keys": list(sd.keys()), "model_other": other,
        "model_aliases": aliases,
        "model_metadata": metadata, "roundpipe": rp, "published": sorted(published),
        "previous": sorted(previous),
        "scaler": scaler.state_dict() if scaler is not None else None, "extra": extra,
        "optimizer": None,
    }
    private = {"published." + n for n in published}
    if pipe.offload_stats() is not None:  # the disk tier: pipe.state_dict() read the
        # masters from their files, so they are copies already
        private.update(k for k in tensors if k.startswith("model.") and k in live)
        live.difference_update(private)
    if optimizer is not None:
        names = _param_names(pipe, optimizer)
        local = optimizer.optim.state if _is_zero(optimizer) else optimizer.state
        layout: dict[str, dict[str, Any]] = {}
        for p, entries in local.items():
            name = names[id(p)]
            layout[name] = {}
            for k, v in entries.items():
                if isinstance(v, torch.Tensor):
                    key = f"optimizer.{name}.{k}"
                    from_file = pipe.read_offloaded_state(name, k, v)  # disk tier
                    if from_file is not None:  # read once
                        tensors[key] = from_file
                        private.add(key)
                    else:
                        tensors[key] = v.detach()
                        live.add(key)
                    layout[name][k] = _TENSOR
                else:
                    layout[name][k] = v
        if _is_zero(optimizer) and group is not None:
            import torch.distributed as dist
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, layout, group=group)  # our own processes
            layout = {n: e for part in gathered for n, e in part.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        meta["optimizer"] = {"param_groups": groups, "state": layout}
    return Collected(tensors, meta, live, private)


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two names of one tensor (tied weights): written once, as torch.save and
    safetensors exports do.  A conjugate or negative view of the same memory holds other
    values (``b.conj()``): not the same tensor."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg())


# --- writing ---------------------------------------------------------------------------

def checkpoint_group(pipe: RoundPipe) -> Any:
    """The process group saves run their collectives on (None without data parallelism):
    a gloo group of its own, since an asynchronous save runs while training issues
    collectives on the pipe's groups.  Created, collectively, by the first save."""
    if pipe.data_parallel is None:
        return None
    group = _groups.get(pipe)
    if group is None:
        group = _groups[pipe] = pipe.new_gloo_group()
    return group


def write(path: str, collected: Collected, group: Any,
          resolve: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Write ``collected`` as the sharded checkpoint ``path`` (collective under ``group``).

    ``resolve(key, tensor)`` is asked for each tensor as DCP writes it (the asynchronous
    save copies live tensors there)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    path = os.path.realpath(path)  # a link to the checkpoint stays a link: write its target
    directory, name = os.path.split(path)
    rank = dist.get_rank(group) if group is not None else 0
    if os.path.isfile(path):
        raise CheckpointError(f"{path!r} is a single-file checkpoint; a sharded save needs "
                              "a directory path: pass another path or remove the file")
    ours = all(os.path.isfile(os.path.join(path, f)) for f in (META_FILE, ".metadata"))
    if os.path.isdir(path) and not ours:
        entries = os.listdir(path)
        if entries:  # the swap would delete them
            raise CheckpointError(
                f"{path!r} is a directory of {len(entries)} entries that is not a roundpipe "
                "checkpoint, and a sharded save replaces the whole directory: pass a new "
                f"path, e.g. {os.path.join(path, 'checkpoint')!r}")
    temp = [os.path.join(directory, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")]
    if group is not None:
        dist.broadcast_object_list(temp, src=dist.get_global_rank(group, 0), group=group)
    temp_dir = temp[0]
    _WRITING.add(temp_dir)
    try:
        _on_rank_0(group, rank, f"create {temp_dir!r}", lambda: os.makedirs(temp_dir))

        class _Planner(DefaultSavePlanner):
            def resolve_data(self, write_item: Any) -> Any:
                data = super().resolve_data(write_item)
                if resolve is not None and isinstance(data, torch.Tensor):
                    data = resolve(write_item.index.fqn, data)
                return data

        with _dcp_errors("writing", temp_dir):
            dcp.save(collected.tensors, planner=_Planner(), process_group=group,
                     storage_writer=FileSystemWriter(temp_dir, sync_files=True),
                     no_dist=group is None)

        def finish() -> None:
            write_atomically(os.path.join(temp_dir, META_FILE),
                             lambda f: torch.save(collected.meta, f))
            fsync_directory(temp_dir)
            _swap_in(temp_dir, path)
        # Every replica returns once the new directory is in place, or raises rank 0's error.
        _on_rank_0(group, rank, f"write {META_FILE} and move the checkpoint into {path!r}",
                   finish)
    except BaseException:
        if rank == 0:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    finally:
        _WRITING.discard(temp_dir)
    if rank == 0:
        _remove_stale(directory, name)


def _on_rank_0(group: Any, rank: int, what: str, work: Callable[[], None]) -> None:
    """``work()`` on rank 0, then every replica learns how it went (a collective): a
    failure on rank 0 is raised on every replica at once, not after the group's timeout."""
    failure: BaseException | None = None
    if rank == 0:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - told to the other replicas, re-raised
            failure = e
    if group is not None:
        import torch.distributed as dist
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
        if rank != 0 and outcome[0] is not None:
            raise CheckpointError(
                f"replica 0 failed to {what} ({outcome[0]}), so the save failed on every "
                "replica and the previous checkpoint, if any, is kept: fix the cause on "
                "rank 0's host (e.g. free disk space) and save again")
    if failure is not None:
        raise failure


@contextlib.contextmanager
def _dcp_errors(action: str, path: str) -> Any:
    """DCP wraps every failure in a ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` misses: raise the underlying error instead (an interrupt first,
    as it is)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except CheckpointException as e:
        errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        # An interrupt (KeyboardInterrupt, SystemExit) stays one: not an Exception to catch.
        for error in sorted((x for x in errors if isinstance(x, BaseException)),
                            key=lambda x: isinstance(x, Exception)):
            raise error from None
        raise CheckpointError(f"{action} {path!r} failed: {e}") from e


def _swap_in(temp_dir: str, path: str) -> None:
    directory, name = os.path.split(path)
    aside = None
    if os.path.lexists(path):
        aside = os.path.join(directory, f".{name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        _WRITING.add(aside)
        os.replace(path, aside)
    os.replace(temp_dir, path)
    fsync_directory(directory)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
        _WRITING.discard(aside)


def _sides(directory: str, name: str) -> list[tuple[str, int]]:
    """Directories beside ``name`` left by saves: (path, pid of the saver)."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(?:tmp|old)-(\d+)-[0-9a-f]{{8}}$")
    found = []
    for entry in os.listdir(directory):
        match = pattern.match(entry)
        if match is not None:
            found.append((os.path.join(directory, entry), int(match.group(1))))
    return found


def _remove_stale(directory: str, name: str) -> None:
    """Delete what killed saves left beside ``name`` (``name`` itself is whole now)."""
    for side, pid in _sides(directory, name):
        if side in _WRITING or (pid != os.getpid() and alive(pid)):
            continue
        if os.path.isdir(side):
            shutil.rmtree(side, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(side)


def resolve(path: str) -> str:
    """The directory to load for ``path``: itself, or, when a save was killed between
    moving the old directory aside and renaming the new one in, the newest complete one
    beside it."""
    if os.path.isdir(path):
        return path
    directory, name = os.path.split(os.path.abspath(path))
    complete = [s for s, _ in _sides(directory, name)
                if os.path.isfile(os.path.join(s, META_FILE))] if os.path.isdir(directory) else []
    if not complete:
        raise CheckpointError(f"no checkpoint at {path!r}")
    best = max(complete, key=lambda s: os.path.getmtime(os.path.join(s, META_FILE)))
    log.warning("roundpipe: %s is missing (a save was killed while swapping it in); "
                "loading the complete checkpoint %s", path, best)
    return best


# --- reading ---------------------------------------------------------------------------

def read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, META_FILE)
    try:
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - every unusable file gets the same clear error
        raise CheckpointError(f"cannot load {meta_path!r} with weights_only=True "
                              f"({type(e).__name__}: {e}); save it with "
                              "roundpipe.save_checkpoint") from e
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE:
        hint = (f": it holds a one-file checkpoint, load {meta_path!r}"
                if isinstance(meta, dict) and "model" in meta else "")
        raise CheckpointError(f"{path!r} is not a roundpipe sharded checkpoint "
                              f"(expected format {FORMAT!r}){hint}")
    return meta


def read_tensors(path: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """Read the tensors ``keys`` from the DCP files of ``path`` (no collectives)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .safe_dcp import SafeFileSystemReader, TensorOnlyLoadPlanner

    reader = SafeFileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        md = stored.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{path!r} lacks the tensor {key!r}: the checkpoint is "
                                  "incomplete or not roundpipe's")
        out[key] = torch.empty(md.size, dtype=md.properties.dtype)
    if out:
        with _dcp_errors("reading", path):
            dcp.load(out, storage_reader=SafeFileSystemReader(path),
                     planner=TensorOnlyLoadPlanner(), no_dist=True)
    return out


def model_state(path: str, meta: dict[str, Any]) -> collections.OrderedDict:
    """The model's state dict as ``pipe.state_dict()`` returned it."""
    other = meta["model_other"]
    aliases = meta.get("model_aliases", {})  # absent before tied weights were written once
    tensor_keys = [k for k in meta["model_keys"] if k not in other and k not in aliases]
    read = read_tensors(path, ["model." + k for k in tensor_keys]
                        + ["published." + n for n in meta["published"]]
                        + ["previous." + n for n in meta.get("previous", ())])
    sd: collections.OrderedDict = collections.OrderedDict(
        (k, other[k] if k in other else read["model." + aliases.get(k, k)])
        for k in meta["model_keys"])
    rp = dict(meta["roundpipe"])
    if meta["published"]:
        rp["published"] = {n: read["published." + n] for n in meta["published"]}
    if meta.get("previous"):  # absent before weight prediction
        rp["previous"] = {n: read["previous." + n] for n in meta["previous"]}
    sd._metadata = {**meta["model_metadata"], "roundpipe": rp}  # type: ignore[attr-defined]
    return sd


def load_optimizer(path: str, meta: dict[str, Any], pipe: RoundPipe,
                   optimizer: torch.optim.Optimizer) -> None:
    """Load the optimizer state by parameter name; a ``ZeroRedundancyOptimizer`` reads
    only its own shard's."""
    optimizer.load_state_dict(optimizer_state(path, meta, pipe, optimizer))


def optimizer_state(path: str, meta: dict[str, Any], pipe: RoundPipe,
                    optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict :func:`load_optimizer` loads, read and checked against
    ``optimizer``'s groups without changing anything."""
    saved = meta["optimizer"]
    names = _param_names(pipe, optimizer)
    index: dict[str, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[names[id(p)]] = len(index)
    groups = saved["param_groups"]
    mine = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if [sorted(g["params"]) for g in groups] != [sorted(g) for g in mine]:
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} parameter group(s) of "
            f"{[len(g['params']) for g in groups]} parameters, this one "
            f"{[len(g) for g in mine]} (or other names): create the optimizer over "
            "pipe.optim_parameters() with the same groups as the saved run")
    wanted = set(index)
    if _is_zero(optimizer):
        wanted = {names[id(p)] for p, r in optimizer._param_to_rank.items()
                  if r == optimizer.rank}
    layout = {n: e for n, e in saved["state"].items() if n in wanted}
    read = read_tensors(path, [f"optimizer.{n}.{k}" for n, e in layout.items()
                               for k, v in e.items() if v == _TENSOR])
    state = {index[n]: {k: read[f"optimizer.{n}.{k}"] if v == _TENSOR else v
                        for k, v in e.items()} for n, e in layout.items()}
    # torch matches state to parameters by position: the positions of this optimizer's
    # own order (the saved run may have listed the same parameters in another).
    param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                     "params": [index[n] for n in names_here]}
                    for g, names_here in zip(groups, mine)]
    return {"state": state, "param_groups": param_groups}


def load_sharded(path: str, pipe: RoundPipe, optimizer: torch.optim.Optimizer | None,
                 scaler: GradScaler | None) -> Any:
    path = resolve(path)
    meta = read_meta(path)
    model = model_state(path, meta)
    # Everything read and checked before anything changes, the model's tensors first: an
    # optimizer with other groups is refused with the model's weights untouched.
    check_model_state(model, pipe, path)
    opt_state = (optimizer_state(path, meta, pipe, optimizer)
                 if optimizer is not None and meta.get("optimizer") is not None else None)
    with pipe.loading():  # the disk tier commits masters and moments as one
        pipe.load_state_dict(model)
        if opt_state is not None:
            optimizer.load_state_dict(opt_state)  # type: ignore[union-attr]
    if scaler is not None and meta.get("scaler") is not None:
        scaler.load_state_dict(meta["scaler"])
    return meta.get("extra")

