"""Data parallelism across processes through ``torch.distributed``.

Each process (one per machine, launched by ``torchrun``) is a *replica*: it runs the whole
pipeline over its own devices on its shard of the batch.  The gradients of a call are
combined across replicas before they are committed, without giving up what a single
process guarantees:

* **overlap**: once the last microbatch's backward has passed a layer unit, the executor
  stages that unit's parameter gradients on the host and hands them to ``on_grads`` (on
  the device thread).  A reducer thread, one per call, copies them into buckets and
  starts an asynchronous all-reduce per bucket as soon as every layer unit of the bucket
  is done, while backward continues on earlier units;
* **one order on every rank**: collectives must be issued in the same order on all ranks,
  but jobs finish in different orders (different device counts, different timing).  The
  bucket layout is derived from the program alone (descending layer unit, then the unit's
  state order, as backward produces them), never from the plan or from completion order,
  and only the reducer thread issues bucket collectives, in layout order;
* **atomicity**: nothing is committed until every bucket has been reduced and one last
  small *status* all-reduce has shown that every replica's call succeeded.  A replica
  whose call fails still issues its remaining buckets (empty), so the others are not left
  waiting: every replica then raises, none commits, and the group stays usable;
* **the same fold**: reduced contributions are committed per (parameter, unit) through
  ``ModelState.commit_grads``, in descending unit order, as in a single process.
* **loss_fn's part**: a parameter ``loss_fn`` reads is reduced with the rest: its part
  joins the gradient of the last unit reading the parameter, and a parameter no unit
  reads has entries of its own, as unit ``len(units)``, last in the layout.

A gradient that a replica did not produce (a parameter its shard never reached) is sent
as zeros with a presence flag of 0 appended to the bucket; a contribution reaches the
masters when at least one replica produced it, so a parameter no replica used keeps
``grad = None``, as in a single process.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError, DataParallelError, ReplicaError
from .devices import parse_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import UnitProgram
    from .executor import RunResult
    from .host_state import HostState

log = logging.getLogger(__name__)

REDUCTIONS = ("mean", "sum")
_POLL_S = 0.0005         # how often waits look at their collective (and at Ctrl-C)
_SLACK_S = 5.0           # our own deadline is the group's timeout plus this
_FP_MOD = 1 << 20        # fingerprints are sent as float64: f and f*f stay exact
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DataParallelConfig:
    """How replicas combine their gradients (``RoundPipe(data_parallel=...)``).

    Attributes:
        reduction: ``"mean"`` (default, as DDP): the committed gradient is the average of
            the replicas' gradients, each a sum over that replica's microbatches, so the
            learning rate that suits one replica suits N; ``"sum"``: their sum, exactly
            the gradient one process would get on the whole global batch with
            ``num_microbatch`` = replicas x local microbatches.
        bucket_bytes: gradient bytes per all-reduce (``"25MiB"``).  Smaller buckets start
            communicating earlier; larger ones pay less per-message latency.
        reduce_dtype: dtype gradients are reduced in.  Default: the masters' dtype
            (``optim_dtype``, else the parameter's), the dtype the single-process fold
            uses; ``torch.bfloat16`` halves the traffic of a bf16 model with fp32 masters,
            at the cost of rounding the cross-replica sum in bf16.
        timeout_s: how long a collective may wait for the other replicas before the call
            raises :class:`~roundpipe.DataParallelError`.  It must cover the slowest
            replica's lag, the first call's compilation included.
        global_loss: ``forward_backward`` returns the loss the committed gradient belongs
            to: the replicas' loss sums averaged (``"mean"``) or summed (``"sum"``).
            ``False``: this replica's own loss sum.
        sync_buffers: after each call, buffers the model updates (BatchNorm statistics)
            are broadcast from rank 0, so every replica holds the same state, as DDP does.
        broadcast_init: at construction, rank 0's parameters, buffers and dropout seed are
            broadcast to every replica, so replicas start identical even when each seeded
            its own initialisation.
        group: the process group to reduce over (its backend must handle CPU tensors,
            e.g. gloo).  Default: a dedicated gloo group over every rank, created when the
            ``RoundPipe`` is; do not issue collectives of your own on a group you pass
            here while a call runs.
    """

    reduction: str = "mean"
    bucket_bytes: int | str = "25MiB"
    reduce_dtype: torch.dtype | None = None
    timeout_s: float = 600.0
    global_loss: bool = True
    sync_buffers: bool = True
    broadcast_init: bool = True
    group: Any = None

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        size = parse_bytes(self.bucket_bytes)
        if size is None or size <= 0:
            raise ConfigError(f"bucket_bytes must be a positive size such as '25MiB', got "
                              f"{self.bucket_bytes!r}")
        object.__setattr__(self, "bucket_bytes", size)
        if self.reduce_dtype is not None and not (isinstance(self.reduce_dtype, torch.dtype)
                                                  and self.reduce_dtype.is_floating_point):
            raise ConfigError(f"reduce_dtype must be a floating torch.dtype or None, got "
                              f"{self.reduce_dtype!r}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a positive number of seconds, got "
                              f"{self.timeout_s!r}")


@dataclass(frozen=True)
class DataParallelInfo:
    """What ``pipe.data_parallel`` reports: this replica's place and the settings."""

    rank: int
    world_size: int
    config: DataParallelConfig


@dataclass(frozen=True)
class BucketRecord:
    """One gradient bucket of a call; times in seconds from the start of the call.

    Attributes:
        ready_s: when the last gradient it holds arrived from its job.
        issued_s: when its all-reduce was started.
        done_s: when its all-reduce completed (None if the call failed first).
    """

    index: int
    nbytes: int
    contributions: int
    units: tuple[int, int]  # lowest and highest layer unit it holds
    ready_s: float
    issued_s: float
    done_s: float | None


@dataclass(frozen=True)
class DataParallelStats:
    """How the last call's gradients were reduced (``pipe.stats().data_parallel``).

    Attributes:
        grads_ready_s: when the last backward job handed over its gradients (seconds from
            the start of the call); None for a call without backward jobs.
        reduced_s: when every bucket's all-reduce had completed.
        finished_s: when the call's reduction ended (status exchange included).
    """

    rank: int
    world_size: int
    reduction: str
    buckets: tuple[BucketRecord, ...]
    grads_ready_s: float | None
    reduced_s: float
    finished_s: float

    @property
    def bytes_reduced(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def exposed_s(self) -> float:
        """Reduction time not hidden under backward: from the last gradient to the last
        completed bucket."""
        if self.grads_ready_s is None:
            return 0.0
        return max(0.0, self.reduced_s - self.grads_ready_s)

    @property
    def comm_s(self) -> float:
        """Time during which at least one bucket all-reduce was in flight."""
        spans = sorted((b.issued_s, b.done_s) for b in self.buckets if b.done_s is not None)
        total, end = 0.0, float("-inf")
        for start, stop in spans:
            if stop <= end:
                continue
            total += stop - max(start, end)
            end = stop
        return total


# --- layout --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    uid: int
    slot: str
    name: str
    shape: torch.Size
    numel: int
    offset: int


@dataclass(frozen=True)
class _Bucket:
    index: int
    dtype: torch.dtype
    entries: tuple[_Entry, ...]
    units: frozenset[int]
    numel: int  # gradient elements; one presence flag per entry follows them

    @property
    def size(self) -> int:
        return self.numel + len(self.entries)


@dataclass(frozen=True)
class _Layout:
    buckets: tuple[_Bucket, ...]
    digest: int  # identical on every replica running the same model


def _build_layout(host: HostState, units: Sequence[UnitProgram], reduce_dtype: Any,
                  cap_bytes: int) -> _Layout:
    """Contributions in descending unit order (the order backward produces them), grouped
    into buckets of about ``cap_bytes`` per reduce dtype.  Depends on the program only, so
    replicas with different device counts or plans agree."""
    state = host.shared
    closed: list[tuple[torch.dtype, list[_Entry]]] = []
    open_: dict[torch.dtype, tuple[list[_Entry], list[int]]] = {}
    order: list[torch.dtype] = []
    described: list[str] = []
    # Last, as unit len(units): the parameters no unit reads, whose gradient (if any)
    # comes from loss_fn (the executor hands them over when the fused job ends).
    read = {s for u in units for s in u.state}
    loss_only = [s for s in host.specs if s not in read and host.trainable(s)]
    for uid, slots in [*((u.index, u.state) for u in reversed(units)),
                       (len(units), loss_only)]:
        seen: set[str] = set()
        for slot in slots:
            if slot in seen or not host.trainable(slot):
                continue
            seen.add(slot)
            param = host.tensors[slot]
            dtype = reduce_dtype if reduce_dtype is not None else (
                state.optim_dtype if state.has_masters else param.dtype)
            entries, size = open_.setdefault(dtype, ([], [0]))
            if dtype not in order:
                order.append(dtype)
            name = host.specs[slot].fqn
            entries.append(_Entry(uid, slot, name, param.shape, param.numel(), size[0]))
            size[0] += param.numel()
            described.append(f"{uid}:{name}:{tuple(param.shape)}:{dtype}")
            if size[0] * dtype.itemsize >= cap_bytes:
                closed.append((dtype, entries))
                del open_[dtype]
                order.remove(dtype)
    for dtype in order:
        closed.append((dtype, open_[dtype][0]))
    buckets = tuple(
        _Bucket(i, dtype, tuple(entries), frozenset(e.uid for e in entries),
                sum(e.numel for e in entries))
        for i, (dtype, entries) in enumerate(closed))
    digest = int.from_bytes(hashlib.sha1("|".join(described).encode()).digest()[:8], "big")
    return _Layout(buckets, digest)


# --- helpers -------------------------------------------------------------------------------

def launched_by_torchrun() -> bool:
    """Whether the launcher variables ``torchrun`` sets are present."""
    return all(k in os.environ for k in _LAUNCHER_ENV)


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0
                     ) -> tuple[int, int]:
    """Initialise the default process group from ``torchrun``'s variables, if there are
    any, and return ``(rank, world_size)``.

    Without them (``python train.py``) nothing happens and ``(0, 1)`` is returned, so one
    script serves both.  ``backend`` defaults to ``"cpu:gloo,cuda:nccl"`` on machines with
    CUDA (roundpipe reduces host gradients through gloo; NCCL serves your own GPU
    collectives) and ``"gloo"`` elsewhere.  An already initialised group is kept.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not launched_by_torchrun():
        return 0, 1
    if not dist.is_available():
        raise ConfigError("torchrun started this process but this PyTorch build has no "
                          "torch.distributed; install a build with distributed support")
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    log.info("roundpipe: initialised torch.distributed (%s): rank %d of %d", backend,
             dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 2000 else text[:2000] + " ..."


# --- the runtime ---------------------------------------------------------------------------

class DataParallel:
    """One replica's side of data parallelism for one ``RoundPipe``."""

    def __init__(self, config: DataParallelConfig) -> None:
        self.config = config
        if config.group is not None:
            backend = str(dist.get_backend(config.group))
            if "gloo" not in backend and "mpi" not in backend:
                raise ConfigError(
                    f"the data-parallel group uses {backend!r}, which cannot reduce host "
                    "tensors (roundpipe keeps gradients in CPU memory); pass a gloo group "
                    "(dist.new_group(backend='gloo')) or leave group=None")
            self.group = config.group
        else:
            # A group of our own: its timeout is ours, and collectives the user issues on
            # the default group can never interleave with the gradient reduction.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(
                seconds=config.timeout_s))
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._root = dist.get_global_rank(self.group, 0)
        self.calls = 0
        self._broken: str | None = None
        # (host, units, trainable) -> layout; the host and units are kept so ids stay unique
        self._layouts: dict[tuple[int, int, frozenset[str]], tuple[Any, Any, _Layout]] = {}
        self._last_layout: _Layout | None = None
        self._flats: dict[tuple[int, int], torch.Tensor] = {}
        self._optimizer_group: Any = None
        log.info("roundpipe: data parallel, replica %d of %d, gradients %s", self.rank,
                 self.world_size, "averaged" if config.reduction == "mean" else "summed")

    @classmethod
    def create(cls, arg: Any) -> DataParallel | None:
        """Resolve ``RoundPipe(data_parallel=arg)``: ``None`` means on when a process group
        of more than one rank is initialised; ``True`` or a config means on (initialising
        the group from ``torchrun``'s variables if needed); ``False`` means off."""
        if arg is False:
            return None
        if arg is None:
            if not (dist.is_available() and dist.is_initialized()
                    and dist.get_world_size() > 1):
                return None
            config = DataParallelConfig()
        elif arg is True:
            config = DataParallelConfig()
        elif isinstance(arg, DataParallelConfig):
            config = arg
        else:
            raise ConfigError("data_parallel must be None, True, False or a "
                              f"roundpipe.DataParallelConfig, got {type(arg).__name__}")
        if not dist.is_available():
            raise ConfigError("data_parallel needs torch.distributed, which this PyTorch "
                              "build lacks; pass data_parallel=False")
        if not dist.is_initialized():
            if config.group is not None:
                raise ConfigError("DataParallelConfig.group was given but torch.distributed "
                                  "is not initialised; call dist.init_process_group first")
            init_distributed()
            if not dist.is_initialized():
                log.info("roundpipe: data_parallel requested but this process was not "
                         "started by torchrun and no process group exists: one replica")
                return None
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 and torch.cuda.is_available():
            log.warning("roundpipe: %s replicas run on this machine (torchrun "
                        "--nproc_per_node > 1); unless each was given its own devices "
                        "(devices=...), they share the same GPUs: launch one process per "
                        "machine (--nproc_per_node 1)", os.environ["LOCAL_WORLD_SIZE"])
        return cls(config)

    @property
    def info(self) -> DataParallelInfo:
        return DataParallelInfo(self.rank, self.world_size, self.config)

    # --- setup ---------------------------------------------------------------------------
    def broadcast_initial_state(self, model: torch.nn.Module, seed: int) -> int:
        """Make every replica start from rank 0's parameters, buffers and dropout seed;
        returns the agreed seed."""
        self._check_usable()
        seed_t = torch.tensor([seed], dtype=torch.int64)
        tensors = [seed_t]
        if self.config.broadcast_init:
            seen: set[int] = set()
            for t in list(model.parameters()) + list(model.buffers()):
                if id(t) not in seen and t.numel() > 0:
                    seen.add(id(t))
                    tensors.append(t)
        works = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for t in tensors:
                buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
                staged.append((t, buf))
                # Raw bytes: exact for every dtype, bool and integer buffers included.
                works.append(dist.broadcast(buf.reshape(-1).view(torch.uint8), src=self._root,
                                            group=self.group, async_op=True))
            deadline = self._deadline()
            for work in works:
                self._wait(work, "the broadcast of rank 0's initial state", deadline)
            for t, buf in staged:
                if buf is not t and buf.data_ptr() != t.data_ptr():
                    t.detach().copy_(buf)
        return int(seed_t.item())

    def optimizer_group(self) -> Any:
        """A gloo group for the optimizer's own collectives (ZeroRedundancyOptimizer):
        its step runs on the optimizer thread, concurrently with the next call's gradient
        reduction, and two threads must not issue collectives on one group.  Collective:
        every rank must call it at the same point."""
        if self._optimizer_group is None:
            self._optimizer_group = self.new_gloo_group()
        return self._optimizer_group

    def new_gloo_group(self) -> Any:
        """A new gloo group over this group's ranks.  Only they call it: when the
        data-parallel group is a subgroup of the world, the other processes never get here,
        so their barrier (torch's default for ``new_group``) would wait for them until the
        timeout; the group is then made with a barrier among its members."""
        ranks = dist.get_process_group_ranks(self.group)
        local = len(ranks) < dist.get_world_size() and dist.get_backend() != "mpi"
        return dist.new_group(ranks=ranks, backend="gloo",
                              timeout=datetime.timedelta(seconds=self.config.timeout_s),
                              use_local_synchronization=local)

    # --- calls ---------------------------------------------------------------------------
    def begin(self) -> _DataParallelCall:
        """Start the data-parallel side of one call (every replica calls in step)."""
        self._check_usable()
        self.calls += 1
        return _DataParallelCall(self, self.calls)

    def layout(self, host: HostState, units: Sequence[UnitProgram]) -> _Layout:
        trainable = frozenset(s for s in host.specs if host.trainable(s))
        key = (id(host), id(units), trainable)
        cached = self._layouts.get(key)
        if cached is None:
            layout = _build_layout(host, units, self.config.reduce_dtype,
                                   int(self.config.bucket_bytes))  # type: ignore[arg-type]
            self._layouts[key] = (host, units, layout)
        else:
            layout = cached[2]
        self._last_layout = layout
        return layout

    def flat_buffer(self, layout: _Layout, bucket: _Bucket) -> torch.Tensor:
        """The host buffer bucket ``bucket`` is reduced in (reused across calls: every
        call waits for its reductions before it returns)."""
        key = (layout.digest, bucket.index)
        flat = self._flats.get(key)
        if flat is None or flat.numel() != bucket.size or flat.dtype != bucket.dtype:
            flat = torch.empty(bucket.size, dtype=bucket.dtype)
            self._flats[key] = flat
        return flat

    def sync_buffers(self, host: HostState, units: Sequence[UnitProgram],
                     buffer_updates: Iterable[tuple[str, str]]) -> None:
        """Broadcast the buffers the program updates from rank 0 (DDP's behaviour)."""
        if not self.config.sync_buffers:
            return
        slots: list[str] = []
        for unit in units:
            slots.extend(s for s in unit.mutated_state if s not in slots)
        slots.extend(s for _, s in buffer_updates if s not in slots)
        tensors = [host.tensors[s] for s in slots
                   if host.specs[s].kind == "buffer" and host.tensors[s].numel() > 0]
        if not tensors:
            return
        self._check_usable()
        with torch.no_grad():
            works = []
            for t in tensors:
                buf = t if t.is_contiguous() else t.contiguous()
                works.append((t, buf, dist.broadcast(buf.reshape(-1).view(torch.uint8),
                                                     src=self._root, group=self.group,
                                                     async_op=True)))
            deadline = self._deadline()
            for t, buf, work in works:
                self._wait(work, "the broadcast of rank 0's buffers", deadline)
                if buf is not t:
                    t.copy_(buf)

    def check_replicas(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Raise :class:`DataParallelError` unless every replica holds bitwise the same
        tensors under the same names (a checksum of their bytes per tensor)."""
        self._check_usable()
        sums = torch.zeros(2 * len(named) + 1, dtype=torch.int64)
        sums[-1] = len(named)
        for i, (_, t) in enumerate(named):
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
            sums[2 * i] = raw.sum()
            # Position-weighted, so swapped bytes differ too (int64 wraps identically).
            weights = torch.arange(1, raw.numel() + 1, dtype=torch.int64) % 65521
            sums[2 * i + 1] = (raw * weights).sum()
        size = torch.tensor([sums.numel()], dtype=torch.int64)
        gathered_sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        self._run_sync(lambda: dist.all_gather(gathered_sizes, size, group=self.group,
                                               async_op=True), "the replica check")
        if len({int(s) for s in gathered_sizes}) != 1:
            raise DataParallelError(
                f"replicas hold different numbers of tensors "
                f"({[int(s) // 2 for s in gathered_sizes]} by rank): they do not run the "
                "same model")
        gathered = [torch.zeros_like(sums) for _ in range(self.world_size)]
        self._run_sync(lambda: dist.all_gather(gathered, sums, group=self.group,
                                               async_op=True), "the replica check")
        for rank, other in enumerate(gathered):
            diff = (other != gathered[0]).nonzero()
            if diff.numel():
                name = named[int(diff[0]) // 2][0]
                raise DataParallelError(
                    f"replica {rank} differs from replica 0 in {name!r} (checked on rank "
                    f"{self.rank}): the replicas diverged. Load the same checkpoint on "
                    "every replica, keep broadcast_init=True, and make every replica run "
                    "the same calls and optimizer steps")

    # --- waiting -------------------------------------------------------------------------
    def _deadline(self) -> float:
        return time.perf_counter() + self.config.timeout_s + _SLACK_S

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise DataParallelError(
                f"the data-parallel group failed earlier ({self._broken}); its collectives "
                "can no longer be matched between replicas. Stop every replica and restart "
                "them from the last checkpoint (torchrun --max-restarts does it for you)")

    def mark_broken(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason

    def _wait(self, work: Any, what: str, deadline: float) -> None:
        """Wait for one collective; a failure or timeout breaks the group for good."""
        try:
            while not work.is_completed():
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"no answer within {self.config.timeout_s:g} s")
                time.sleep(_POLL_S)
            work.wait()
        except (RuntimeError, TimeoutError) as e:
            reason = f"{what} failed on rank {self.rank} of {self.world_size}: {e}"
            self.mark_broken(reason)
            raise DataParallelError(
                f"{reason}. Another replica probably raised, exited or stopped calling "
                "forward_backward (every replica must make the same calls in the same "
                f"order; the timeout is DataParallelConfig.timeout_s = "
                f"{self.config.timeout_s:g} s). This replica's data-parallel group is "
                "unusable now: stop every replica and restart them from the last "
                "checkpoint (torchrun --max-restarts does it for you)") from e

    def _run_sync(self, issue: Callable[[], Any], what: str) -> None:
        try:
            work = issue()
        except RuntimeError as e:
            self.mark_broken(f"{what} could not start: {e}")
            raise DataParallelError(f"{what} could not start on rank {self.rank}: {e}") from e
        self._wait(work, what, self._deadline())


class _Reducer:
    """Issues one call's bucket all-reduces, in layout order, from its own thread."""

    def __init__(self, dp: DataParallel, layout: _Layout, t0: float, failed: bool) -> None:
        self.dp = dp
        self.layout = layout
        self.t0 = t0
        self._cond = threading.Condition()
        self._staged: dict[tuple[int, str], torch.Tensor] = {}
        self._ready: set[int] = set()
        self._ready_at: dict[int, float] = {}
        self._empty = failed       # the call failed here: send the rest as zeros
        self._complete = failed    # no more gradients will arrive
        self.grads_ready_at: float | None = None
        self.issued: list[tuple[_Bucket, torch.Tensor, Any, float, float]] = []
        self.done_at: dict[int, float] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"roundpipe-dp-reduce-{dp.rank}")
        self._thread.start()

    def on_grads(self, start: int, stop: int,
                 staged: list[tuple[str, int, torch.Tensor]]) -> None:
        """Executor hook (device thread): units ``[start, stop)`` have final parameter
        gradients; ``staged`` holds those not handed over before, on the host."""
        now = time.perf_counter()
        with self._cond:
            for slot, uid, grad in staged:
                self._staged[(uid, slot)] = grad
            for unit in range(start, stop):
                self._ready.add(unit)
                self._ready_at[unit] = now
            self.grads_ready_at = now
            self._cond.notify_all()

    def finish(self, failed: bool) -> None:
        with self._cond:
            self._complete = True
            self._empty = self._empty or failed
            self._cond.notify_all()

    def join(self) -> None:
        while self._thread.is_alive():  # in slices, so Ctrl-C still reaches the caller
            self._thread.join(0.05)

    def _main(self) -> None:
        dp = self.dp
        try:
            for bucket in self.layout.buckets:
                with self._cond:
                    while not (self._complete or bucket.units <= self._ready):
                        self._cond.wait()
                    empty = self._empty
                    grads = {} if empty else {(e.uid, e.slot): self._staged.get((e.uid, e.slot))
                                              for e in bucket.entries}
                    ready = max((self._ready_at.get(u, 0.0) for u in bucket.units),
                                default=0.0)
                flat = dp.flat_buffer(self.layout, bucket)
                flags = flat[bucket.numel:]
                with torch.no_grad():
                    for i, e in enumerate(bucket.entries):
                        piece = flat[e.offset:e.offset + e.numel]
                        grad = grads.get((e.uid, e.slot))
                        if grad is None:
                            piece.zero_()
                            flags[i] = 0
                        else:
                            piece.copy_(grad.reshape(-1))
                            flags[i] = 1
                issued = time.perf_counter()
                work = dist.all_reduce(flat, group=dp.group, async_op=True)
                index = bucket.index
                work.get_future().add_done_callback(
                    lambda _f, index=index: self.done_at.setdefault(index, time.perf_counter()))
                self.issued.append((bucket, flat, work, max(ready, self.t0), issued))
        except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
            self.error = e


class _DataParallelCall:
    """The data-parallel side of one call: bind, then ``complete`` or ``fail``."""

    def __init__(self, dp: DataParallel, number: int) -> None:
        self.dp = dp
        self.number = number
        self.t0 = time.perf_counter()
        self.layout: _Layout | None = None
        self.reducer: _Reducer | None = None
        self.concluded = False  # the replicas have exchanged their outcome (or tried to)

    def bind(self, host: HostState, units: Sequence[UnitProgram]) -> Callable[..., None]:
        """The program is known: start the reducer; returns the executor's hook."""
        self.layout = self.dp.layout(host, units)
        self.reducer = _Reducer(self.dp, self.layout, self.t0, failed=False)
        return self.reducer.on_grads

    def complete(self, result: RunResult, local_loss: torch.Tensor | None
                 ) -> torch.Tensor | None:
        """The call succeeded here: reduce, then replace ``result.param_grads`` with the
        reduced contributions and attach the stats.  Returns the loss to report.  Raises
        :class:`ReplicaError` if another replica failed (nothing is to be committed)."""
        loss = 0.0 if local_loss is None else float(local_loss)
        status = self._conclude(failed=False, loss=loss, error=None)
        if self.reducer is None or self.layout is None:
            raise RuntimeError("internal: the replica call was completed before bind()")
        dp, w = self.dp, self.dp.world_size
        grads: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for bucket, flat, _work, _ready, _issued in self.reducer.issued:
            if dp.config.reduction == "mean":
                flat[:bucket.numel].div_(w)
            present = flat[bucket.numel:].tolist()
            for e, flag in zip(bucket.entries, present):
                if flag > 0:
                    grads.setdefault(e.slot, []).append(
                        (e.uid, flat[e.offset:e.offset + e.numel].view(e.shape)))
        result.param_grads = grads
        result.stats = dataclasses.replace(result.stats, data_parallel=self._stats())
        if local_loss is None or not dp.config.global_loss:
            return local_loss
        total = status[w].item()
        if dp.config.reduction == "mean":
            total /= w
        return torch.tensor(total, dtype=local_loss.dtype)

    def fail(self, error: BaseException) -> None:
        """The call failed here: let the other replicas know, so they raise instead of
        waiting; nothing is committed anywhere.  Never raises: the caller re-raises
        ``error`` (a note says what the other replicas saw).  A no-op once the replicas
        have exchanged their outcome (the error came after that, e.g. from the commit)."""
        if self.concluded:
            return
        try:
            self._conclude(failed=True, loss=0.0, error=error)
        except ReplicaError as other:
            error.add_note(f"roundpipe data parallel: {other}")
        except DataParallelError as broken:
            error.add_note(f"roundpipe data parallel: {broken}")
        except BaseException as e:  # noqa: BLE001 - the original error matters most
            log.warning("roundpipe: data-parallel failure protocol raised %s", _describe(e))
        else:
            error.add_note(f"roundpipe data parallel: replica {self.dp.rank} of "
                           f"{self.dp.world_size} failed; no replica committed this call")

    def _conclude(self, *, failed: bool, loss: float, error: BaseException | None
                  ) -> torch.Tensor:
        dp, w = self.dp, self.dp.world_size
        self.concluded = True
        if self.reducer is None:
            # Failed before the program was known: the layout of the previous call (same
            # model, same parameters) keeps the collectives matched.
            layout = self.layout or dp._last_layout
            if layout is None:
                dp.mark_broken("a replica failed before its first call reached the devices")
                raise DataParallelError(
                    f"replica {dp.rank} failed before its first call reached the devices, "
                    "so the other replicas cannot be told and will time out")
            self.layout = layout
            self.reducer = _Reducer(dp, layout, self.t0, failed=True)
        reducer = self.reducer
        reducer.finish(failed)
        reducer.join()
        if reducer.error is not None:
            dp.mark_broken(f"a gradient all-reduce could not start: {reducer.error}")
            raise DataParallelError(
                f"a gradient all-reduce could not start on rank {dp.rank}: "
                f"{_describe(reducer.error)}; the data-parallel group is unusable now: stop "
                "every replica and restart them from the last checkpoint") from reducer.error
        # status: one failure flag per rank, the loss sum, a fingerprint of the layout and
        # call number (and its square: all ranks agree iff w * sum(f^2) == sum(f)^2).
        fp = (self.layout.digest + self.number * 0x9E3779B1) % _FP_MOD  # type: ignore[union-attr]
        status = torch.zeros(w + 3, dtype=torch.float64)
        status[dp.rank] = 1.0 if failed else 0.0
        status[w] = loss
        status[w + 1] = fp
        status[w + 2] = float(fp * fp)
        try:
            status_work = dist.all_reduce(status, group=dp.group, async_op=True)
        except RuntimeError as e:
            dp.mark_broken(f"the status all-reduce could not start: {e}")
            raise DataParallelError(f"the status all-reduce could not start on rank "
                                    f"{dp.rank}: {e}") from e
        deadline = dp._deadline()
        n = len(reducer.issued)
        try:
            for bucket, _flat, work, _ready, _issued in reducer.issued:
                dp._wait(work, f"the all-reduce of gradient bucket {bucket.index} of {n} "
                         f"(call {self.number})", deadline)
            self.reduced_at = time.perf_counter()
            dp._wait(status_work, f"the status all-reduce of call {self.number}", deadline)
        except (KeyboardInterrupt, SystemExit) as e:
            # The other replicas may commit this call while this one will not.
            dp.mark_broken(f"rank {dp.rank} was interrupted ({type(e).__name__}) while the "
                           f"replicas were combining call {self.number}")
            raise
        self.finished_at = time.perf_counter()
        failed_ranks = [r for r in range(w) if status[r] > 0]
        if failed_ranks:
            messages: list[Any] = [None] * w
            mine = _describe(error) if error is not None else None
            try:
                dist.all_gather_object(messages, mine, group=dp.group)
            except RuntimeError as e:  # pragma: no cover - the group died meanwhile
                messages = [f"(message lost: {e})"] * w
            others = [r for r in failed_ranks if r != dp.rank]
            if others:
                what = "; ".join(f"replica {r}: {messages[r]}" for r in others)
                raise ReplicaError(
                    f"{len(others)} other replica(s) failed in call {self.number} "
                    f"({what}). No replica committed this call's gradients, so every "
                    "replica still holds the same state; fix the cause on that replica, or "
                    "skip the batch on every replica and continue", ranks=tuple(others),
                    messages=tuple(str(messages[r]) for r in others))
            return status
        total_f, total_f2 = int(status[w + 1].item()), int(status[w + 2].item())
        if w * total_f2 != total_f * total_f:
            reason = (f"call {self.number}: the replicas do not run the same program (their "
                      "gradient layouts or call counts differ)")
            dp.mark_broken(reason)
            raise DataParallelError(
                f"{reason}. Every replica must wrap the same model with the same trainable "
                "parameters and make the same calls in the same order; nothing was committed")
        return status

    def _stats(self) -> DataParallelStats:
        reducer = self.reducer
        if reducer is None:
            raise RuntimeError("internal: no reducer; bind() was not called")
        t0 = self.t0
        records = tuple(
            BucketRecord(index=b.index, nbytes=b.numel * b.dtype.itemsize,
                         contributions=len(b.entries),
                         units=(min(b.units, default=-1), max(b.units, default=-1)),
                         ready_s=ready - t0, issued_s=issued - t0,
                         done_s=(reducer.done_at[b.index] - t0
                                 if b.index in reducer.done_at else None))
            for b, _flat, _work, ready, issued in reducer.issued)
        return DataParallelStats(
            rank=self.dp.rank, world_size=self.dp.world_size,
            reduction=self.dp.config.reduction, buckets=records,
            grads_ready_s=(reducer.grads_ready_at - t0
                           if reducer.grads_ready_at is not None else None),
            reduced_s=max([self.reduced_at - t0 if not records else 0.0]
                          + [r.done_s for r in records if r.done_s is not None]),
            finished_s=self.finished_at - t0)
