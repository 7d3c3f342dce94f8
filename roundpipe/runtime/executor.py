"""The executor: runs one call of a stage plan as jobs dispatched round-robin to devices.

A *job* is one stage x all microbatches on one device.  Job ``k`` runs on device
``k % D``; its microbatch ``i`` starts when job ``k-1`` finished microbatch ``i``.  A job
uploads its stage's state once, runs every microbatch, then downloads gradients once.
Values cross jobs through a per-microbatch store in host memory.

Numerics do not depend on the stage cuts or the device count, because the unit, not the
stage, is the unit of autograd:

* in backward and fused jobs every layer unit runs as its own autograd graph, its inputs
  (activations and parameters) being fresh leaves;
* the gradient of a value read by several units is folded in descending unit order,
  whether the readers share a job or not;
* parameter gradients accumulate per (parameter, unit) over microbatches on the device and
  are folded into the masters in descending unit order at commit.

Transfers overlap compute through the device interface: the weights of job ``k + D`` (the
next job on the same device) start uploading when job ``k`` starts (double buffering, at
most two stages resident), the next microbatch's inputs upload once the current one's
values are freed (on a GPU, beside its kernels still running), and when consecutive jobs
share a device (one device) values are handed over on the device instead of making the
host round trip.

Nothing is committed to host state until every job succeeded; a failing call leaves
weights, gradients and buffers as they were.

What one job does runs in :class:`~.job_runner.JobRunner`, over the call's shared
:class:`~.call_state.CallState`; it reads the executor through the public names below
(``units``, ``host``, ``landing``, ``readers``, ``buffer_update``, ``grad_dtype``,
``runnable``, ``start_load``, ``ready``), never its private ones.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import functools
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import OutOfMemoryError, RoundPipeError, StageError
from ..plan import StagePlan, UnitProgram
from ..ops import modes, rng
from .devices import Device, DeviceCounters, DeviceMemoryExceeded
from .grad_flow import live_nodes
from .grad_landing import GradLanding
from .host_state import HostView
from .call_state import CallState
from .job_runner import JobRunner
from .param_hooks import NO_HOOKS, HookPlan
from .jobs import Job, plan_jobs
from ..ops.rng import RngKey

log = logging.getLogger(__name__)

_POLL_S = 0.05


class _Aborted(Exception):
    """Raised in a job when an upstream job failed or the call was interrupted."""


@dataclass(frozen=True)
class JobRecord:
    """One job of the timeline reported by ``pipe.stats()``."""

    job: int
    stage: int
    kind: str
    units: str
    device: str
    start_s: float
    end_s: float
    microbatches: int
    weights_requested_s: float | None = None  # when the upload of its weights was issued
    microbatch_s: tuple[tuple[float, float], ...] = ()  # (start, end) of each microbatch


@dataclass(frozen=True)
class RunStats:
    """Counters of the last call: transfers and peak residency per device, the timeline,
    and measured per-unit seconds (summed over microbatches)."""

    devices: tuple[DeviceCounters, ...]
    timeline: tuple[JobRecord, ...]
    unit_fwd_s: dict[int, float]
    unit_bwd_s: dict[int, float]
    wall_s: float
    started_at: float = 0.0  # time.perf_counter() when the call started
    # Parameter-gradient bytes downloaded, per parameter name (summed over jobs); frozen
    # parameters never appear (``devices[i].downloaded["grads"]`` also counts activations').
    grad_bytes: dict[str, int] = field(default_factory=dict)
    # How the gradients were combined across replicas (a DataParallelStats), or None.
    data_parallel: Any = None
    # Stage -> the most bytes its job held on its device at once (its weights, inputs,
    # activations, tensors saved for backward, gradients; not the weights prefetched for a
    # later job): what StageSpec.memory_bytes estimates.  Measured from the tensors made
    # on the device's threads (runtime/device_memory.py); empty unless measure_memory.
    stage_peak_bytes: dict[int, int] = field(default_factory=dict)

    # Seconds the call's jobs stood still waiting for weights that a step in flight had
    # not published yet (the union over devices): the part of an overlapped step the
    # call did not hide.
    weights_wait_s: float = 0.0

    @property
    def grad_bytes_downloaded(self) -> int:
        return sum(self.grad_bytes.values())

    @property
    def bytes_uploaded(self) -> int:
        return sum(d.bytes_uploaded for d in self.devices)

    @property
    def bytes_downloaded(self) -> int:
        return sum(d.bytes_downloaded for d in self.devices)

    def __str__(self) -> str:  # print(pipe.stats()): a table (the repr keeps every field)
        from .stats_table import render
        return render(self)


class Stash(list):
    """What :meth:`Executor.forward` keeps for the backward: per microbatch, the values
    the backward reads; and ``state``, the buffers the forward updates as they were before
    it (its updates are committed when it ends), so the recompute replays the forward's
    updates from the same start and reads what the forward read (``fresh_state``: the
    buffers every microbatch started from that first value)."""

    state: dict[str, torch.Tensor]
    fresh_state: frozenset[str]


@dataclass
class RunResult:
    """What a call produced; committed by the caller once the optimizer allows it."""

    losses: list[torch.Tensor | None]
    outputs: list[list[Any]] | None
    param_grads: dict[str, list[tuple[int, torch.Tensor]]]
    buffers: dict[str, torch.Tensor]
    input_grads: list[dict[str, torch.Tensor]] | None
    stats: RunStats
    stash: Stash | None = None
    # The slots whose param_grads are fresh tensors in the masters' dtype that the commit
    # may keep as .grad; the others are reused download (or reduction) buffers.
    grads_owned: frozenset[str] = frozenset()
    # The slots whose one contribution is a download buffer the host state may hold
    # (HostView.lands_in_place): no later download reuses a buffer while it is held.
    grads_holdable: frozenset[str] = frozenset()
    # Slot -> the 2-norm of its holdable gradient, measured on the device (float32, on
    # the host), when the host state asked for norms (LandedGrads.wants_norms).
    grad_norms: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per microbatch, the values asked for with ``keep`` (an output tail's inputs).
    values: list[dict[str, Any]] = field(default_factory=list)
    # Slot -> (microbatch, unit, gradient) of the parameters whose hooks need each
    # microbatch's gradient (HookPlan.per_microbatch), in the parameter's dtype.
    mb_grads: dict[str, list[tuple[int, int, torch.Tensor]]] = field(default_factory=dict)
    # Per microbatch, the gradients of the label's leaves that require grad (by flat
    # leaf index); None unless a training call asked for input gradients.
    label_grads: list[dict[int, torch.Tensor]] | None = None
    # Slot -> [(microbatch, gradient)] that loss_fn gave a parameter no unit reads (after
    # its tensor hooks, in its dtype, by microbatch), for the commit to add; empty where
    # on_grads took them (as unit len(units)).
    loss_grads: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)


class Executor:
    """Runs calls of one :class:`StagePlan` on a pool of devices."""

    def __init__(self, plan: StagePlan, host: HostView, devices: Sequence[Device],
                 landing: GradLanding | None = None, compile_backend: str | None = None
                 ) -> None:
        self.plan = plan
        self.program = plan.program
        self.host = host
        self.devices = list(devices)
        self.units = self.program.units
        self.buffer_update = {v: slot for slot, v in self.program.buffer_updates}
        self._carries_cache: dict[Any, frozenset[str]] = {}
        # Host buffers gradients are downloaded into, reused across calls; pass one
        # GradLanding to the executors of every program of a model, so each new shape or
        # mode does not hold a model's worth more.  Calls of one model never overlap, and a
        # call is done with them (conversions included) when it returns.
        self.landing = landing if landing is not None else GradLanding(convert=False)
        self._grad_dtypes: dict[str, torch.dtype] = {}
        self.readers = collections.Counter(s for u in self.units for s in u.state)
        self.last_reader = {s: u.index for u in self.units for s in u.state}
        # torch.compile'd unit programs (by unit index), made on first use.
        self.compile_backend = compile_backend
        self._runnables: dict[tuple[int, str], Callable[..., Any]] = {}
        self._runnables_lock = threading.Lock()
        # Buffers the forward writes (in place or reassigned).
        self._written_state = tuple(dict.fromkeys(
            [s for u in self.units for s in u.mutated_state]
            + [slot for slot, _ in self.program.buffer_updates]))
        # Units that enter grad-mode / autocast regions (restored if they fail inside one).
        self.with_regions = frozenset(u.index for u in self.units
                                      if modes.uses_regions(u.module))
        self.region_device_types = tuple(dict.fromkeys(
            ["cpu"] + [d.torch_device.type for d in self.devices]))

    # --- public entry points -------------------------------------------------------------
    def train(self, inputs: list[dict[str, Any]], labels: list[Any], loss_fn: Callable,
              *, grain: str, want_outputs: bool, keys: list[RngKey | None],
              fence_version: int, autocast: tuple[str, torch.dtype] | None = None,
              nonfinite_loss_ok: bool = False,
              on_grads: Callable[..., None] | None = None,
              keep: frozenset[str] = frozenset(), hooks: HookPlan = NO_HOOKS,
              on_losses: Callable[[], None] | None = None,
              admit: Callable[..., None] | None = None,
              input_grads: bool = False) -> RunResult:
        """Forward stages, fused tail (loss + backward), backward stages.

        ``input_grads``: also compute the gradients of the inputs (and label leaves) that
        require grad, returned per microbatch in ``RunResult.input_grads`` (and
        ``label_grads``) for the caller to send into its own graph.  On the devices
        those inputs are fresh leaves of copies (``JobRunner._leaf``, detached uploads):
        no backward runs on the caller's graph from a device thread.

        A NaN or infinite loss raises :class:`LossError` (nothing is committed) unless
        ``nonfinite_loss_ok`` (a GradScaler skips the step instead).  ``on_grads`` sees
        each unit's staged parameter gradients as soon as they are final (see
        ``CallState``); ``on_losses()`` once every loss is in and checked; ``admit(unit, abort)`` before a
        unit's final gradients are downloaded.
        ``hooks``: where the parameters' autograd hooks run (runtime/param_hooks.py)."""
        call = self._new_call("train", inputs, labels, loss_fn, grain, want_outputs, keys,
                              fence_version, autocast=autocast, input_grads=input_grads)
        call.nonfinite_loss_ok = nonfinite_loss_ok
        call.on_grads = on_grads
        call.on_losses = on_losses
        call.admit = admit
        call.keep = keep
        call.hooks = hooks
        # read as the call starts (requires_grad may change between calls)
        trainable = [s for s in self.host.specs if self.host.trainable(s)]
        # (a master read in loss_fn, pipe.optim_parameters(), counts as its parameter)
        tensors = [(s, t) for s in trainable
                   for t in (self.host.tensors[s], self.host.master_of(s)) if t is not None]
        call.loss_params = {id(t): (s, t) for s, t in tensors}
        call.loss_joins = {s: self.last_reader[s] for s in trainable if s in self.last_reader}
        return self._run(self._jobs(call, stash_for_backward=False), call)

    def forward(self, inputs: list[dict[str, Any]], *, record: bool, grain: str,
                keys: list[RngKey | None], fence_version: int,
                autocast: tuple[str, torch.dtype] | None = None,
                keep: frozenset[str] = frozenset(),
                fresh_state: frozenset[str] = frozenset()) -> RunResult:
        """Forward stages and the tail as a forward stage; with ``record`` the values the
        backward needs are kept in ``RunResult.stash``.  Every microbatch starts from the
        call's first value of the buffers in ``fresh_state`` (so each makes the same
        write, and the last one's is committed)."""
        call = self._new_call("forward", inputs, [None] * len(inputs), None, grain, True, keys,
                              fence_version, record=record, autocast=autocast)
        call.keep = keep
        call.fresh_state = fresh_state
        jobs = self._jobs(call, stash_for_backward=record)
        before = {slot: self.host.tensors[slot].clone() for slot in self._written_state
                  } if record else {}
        result = self._run(jobs, call)
        if record:
            result.stash = Stash(call.store)
            result.stash.state = before
            result.stash.fresh_state = fresh_state
        return result

    def backward(self, stash: Stash | list[dict[str, Any]], output_grads: list[dict[str, Any]], *,
                 grain: str, keys: list[RngKey | None], fence_version: int,
                 autocast: tuple[str, torch.dtype] | None = None,
                 on_grads: Callable[..., None] | None = None,
                 hooks: HookPlan = NO_HOOKS,
                 only: frozenset[str] | None = None) -> RunResult:
        """Backward of a recorded :meth:`forward`: the tail recomputes like a backward
        stage, then the backward stages run.  ``only``: the inputs and parameter slots
        whose gradients are asked for (``torch.autograd.grad(out, x)``,
        ``backward(inputs=...)``); the others are not computed, and jobs through which
        none of those flows are skipped.  None: every one."""
        call = self._new_call("backward", [dict(s) for s in stash], [None] * len(stash), None,
                              grain, False, keys, fence_version, record=True,
                              autocast=autocast, only=only)
        call.state = dict(getattr(stash, "state", {}))
        call.fresh_state = getattr(stash, "fresh_state", frozenset())
        call.on_grads = on_grads
        call.hooks = hooks
        for mb, grads in enumerate(output_grads):
            call.grads[mb].update(grads)
        return self._run(self._jobs(call, stash_for_backward=False), call)

    # --- setup ---------------------------------------------------------------------------
    def _new_call(self, mode: str, inputs: list[dict[str, Any]], labels: list[Any],
                  loss_fn: Callable | None, grain: str, want_outputs: bool,
                  keys: list[RngKey | None], fence_version: int, record: bool = True,
                  autocast: tuple[str, torch.dtype] | None = None,
                  only: frozenset[str] | None = None, input_grads: bool = True
                  ) -> CallState:
        num_mb = len(inputs)
        # The inputs whose gradients flow back: through forward() + backward(), or
        # returned by a training call that asks (forward_backward sends them into the
        # caller's graph).  Any microbatch's piece may require grad (a split_input
        # callable's pieces need not agree).
        grad_inputs = frozenset(
            name for mb in inputs for name, v in mb.items()
            if isinstance(v, torch.Tensor) and v.requires_grad
            and (only is None or name in only)) \
            if input_grads else frozenset()
        carries = self._carries(grad_inputs, only) if (mode != "forward" or record) \
            else frozenset()
        return CallState(
            mode=mode, num_mb=num_mb, grain=grain, keys=keys,
            store=[dict(x) for x in inputs], grads=[{} for _ in range(num_mb)],
            labels=labels, loss_fn=loss_fn, want_outputs=want_outputs,
            fence_version=fence_version, carries=carries, abort=threading.Event(),
            done={}, losses=[None] * num_mb, autocast=autocast, steps=self.landing.steps(),
            measure_norms=self.host.wants_grad_norms(),
            label_grads=[{} for _ in range(num_mb)] if mode == "train" and input_grads
            else None)

    def _carries(self, grad_inputs: frozenset[str], only: frozenset[str] | None = None
                 ) -> frozenset[str]:
        """Values through which gradients flow: those depending on a trainable parameter
        (among ``only``, if given) or on an input that requires grad (node-level, inside
        every unit program)."""
        trainable = frozenset(s for s in self.host.specs if self.host.trainable(s)
                              and (only is None or s in only))
        key = (trainable, grad_inputs)
        cached = self._carries_cache.get(key)
        if cached is not None:
            return cached
        carries = set(grad_inputs) | set(trainable)
        for unit in self.units:
            graph = unit.module.graph  # type: ignore[union-attr]
            live: set[str] = set()
            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            names = list(unit.inputs) + list(unit.state)
            for node, name in zip(placeholders, names):
                if name in carries:
                    live.add(node.name)
            live = live_nodes(graph, live)
            out_node = next(n for n in graph.nodes if n.op == "output")
            for value, name in zip(out_node.args[0], unit.outputs):
                if isinstance(value, torch.fx.Node) and value.name in live:
                    carries.add(name)
        result = frozenset(carries)
        self._carries_cache[key] = result
        return result

    def _jobs(self, call: CallState, *, stash_for_backward: bool) -> list[Job]:
        jobs = list(plan_jobs(self.plan, call.mode, call.grain, num_devices=len(self.devices),
                              carries=call.carries, want_outputs=call.want_outputs,
                              keep=call.keep, stash_for_backward=stash_for_backward))
        return jobs

    # --- running -------------------------------------------------------------------------
    def _run(self, jobs: list[Job], call: CallState) -> RunResult:
        for device in self.devices:
            device.reset_counters()
        for job in jobs:
            for mb in range(call.num_mb):
                fut = call.done[(job.index, mb)] = Future()
                if mb == 0:
                    fut.add_done_callback(functools.partial(
                        _stamp, call.done_at, (job.index, mb)))
        call.t0 = time.perf_counter()
        call.jobs = jobs
        # Each device's first job starts loading its weights at once.
        for job in jobs[:len(self.devices)]:
            self.start_load(call, job)
        futures = []
        errors: list[tuple[Job, Device, BaseException]] = []
        try:
            for job in jobs:
                device = self.devices[job.index % len(self.devices)]
                futures.append((job, device, device.submit(self._job_main, job, device, call)))
            for job, device, fut in futures:
                try:
                    fut.result()
                except _Aborted:
                    pass
                except BaseException as e:  # noqa: BLE001 - collected and re-raised below
                    errors.append((job, device, e))
                    call.abort.set()
        except BaseException:
            call.abort.set()  # KeyboardInterrupt in the caller: stop the workers, then raise
            for _, _, fut in futures:
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - the interrupt is what matters
                    pass
            raise
        finally:
            for transfer in call.weights.values():  # prefetches nobody consumed
                transfer.release()
            call.weights.clear()
            call.handoff.clear()
            # Nothing may still read the download buffers once the call returns.
            concurrent.futures.wait(list(call.converted.values()))
            if call.converted:
                self.landing.retain({(uid, slot) for slot, uid in call.converted})
        if errors:
            job, device, e = min(errors, key=lambda x: x[0].index)
            described = self._describe_error(job, device, e, call.grain)
            if described is e:
                raise e
            raise described from e
        if call.loss_grads:  # never dropped silently
            mb, slot = min(call.loss_grads)
            raise RuntimeError(f"internal: loss_fn's gradient of {self.host.specs[slot].fqn!r} "
                               f"(microbatch {mb}) was not joined by a unit; nothing was "
                               "committed")
        for table, shares, device, start, end in call.timings:
            seconds = device.seconds_between(start, end)
            for unit, share in shares.items():
                table[unit] = table.get(unit, 0.0) + seconds * share
        stats = RunStats(
            devices=tuple(d.counters() for d in self.devices),
            timeline=tuple(sorted(call.timeline, key=lambda r: r.job)),
            unit_fwd_s=dict(call.unit_fwd_s),
            unit_bwd_s=dict(call.unit_bwd_s),
            wall_s=time.perf_counter() - call.t0,
            started_at=call.t0,
            grad_bytes={self.host.specs[slot].fqn: sum(g.numel() * g.element_size()
                                                       for *_, g in grads)
                        for slot, grads in (*call.param_grads.items(),
                                            *call.mb_grads.items())},
            stage_peak_bytes=self._stage_peaks(jobs),
            weights_wait_s=_union_length(call.weight_stalls),
        )
        outputs = None
        if call.want_outputs:
            outputs = [[call.store[mb][o.value] if o.value is not None else o.constant
                        for o in self.program.outputs] for mb in range(call.num_mb)]
        values = [{v: call.store[mb][v] for v in call.keep} for mb in range(call.num_mb)]
        input_grads = None
        if call.mode == "backward" or call.label_grads is not None:
            names = {n for n in self.program.inputs.names if n is not None}
            input_grads = [{k: v for k, v in g.items() if k in names} for g in call.grads]
        param_grads, owned = call.param_grads, set()
        if call.converted:
            param_grads = {}
            for slot, grads in call.param_grads.items():
                converted = [call.converted[(slot, uid)].result()
                             if (slot, uid) in call.converted else None for uid, _ in grads]
                if all(c is not None for c in converted):
                    param_grads[slot] = [(uid, c) for (uid, _), c in zip(grads, converted)]
                    owned.add(slot)
                else:
                    param_grads[slot] = grads
        return RunResult(losses=call.losses, outputs=outputs, param_grads=param_grads,
                         buffers=call.buffers, input_grads=input_grads, stats=stats,
                         grads_owned=frozenset(owned), values=values,
                         grads_holdable=frozenset(s for s in call.in_place
                                                  if len(param_grads.get(s, ())) == 1),
                         grad_norms=dict(call.grad_norms),
                         mb_grads={s: sorted(g, key=lambda c: c[:2])
                                   for s, g in call.mb_grads.items()},
                         label_grads=call.label_grads,
                         loss_grads={} if call.on_grads is not None else
                         {s: sorted(g, key=lambda c: c[0]) for s, g in call.loss_only.items()})

    def _stage_peaks(self, jobs: list[Job]) -> dict[int, int]:
        """Each measured job's own peak, by stage (owners are job indices)."""
        peaks: dict[int, int] = {}
        for job in jobs:
            device = self.devices[job.index % len(self.devices)]
            if device.measure_memory and not job.skip:
                peak = device.memory.owner_peaks().get(job.index, 0)
                peaks[job.stage] = max(peaks.get(job.stage, 0), peak)
        return peaks

    def runnable(self, unit: UnitProgram, device: torch.device | None = None
                 ) -> Callable[..., Any]:
        """What runs ``unit`` on ``device`` (default: the first device's): its program, or
        the program through torch.compile (keyed random ops run uncompiled between its
        pieces, see ops/rng.py).  Each torch device compiles its own copy:
        Dynamo keeps its compiled versions per code object and guards on the device, so
        one copy shared by eight GPUs would pass its recompile limit and fall back to the
        traced program unannounced."""
        device = torch.device(device) if device is not None else self.devices[0].torch_device
        key = (unit.index, str(device))
        fn = self._runnables.get(key)
        if fn is None:
            with self._runnables_lock:
                fn = self._runnables.get(key)
                if fn is None:
                    fn = unit.module
                    if self.compile_backend is not None:
                        first = not any(k[0] == unit.index for k in self._runnables)
                        fn = torch.compile(_for_compile(unit.module, fresh=not first),
                                           backend=self.compile_backend)
                    self._runnables[key] = fn
        return fn

    def grad_dtype(self, slot: str) -> torch.dtype:
        """The dtype a slot's gradient is committed in (the host view's, cached)."""
        dtype = self._grad_dtypes.get(slot)
        if dtype is None:
            dtype = self._grad_dtypes[slot] = self.host.grad_dtype(slot)
        return dtype

    def _describe_error(self, job: Job, device: Device, e: BaseException,
                        grain: str = "stage") -> BaseException:
        mb = getattr(e, "_roundpipe_microbatch", None)
        names = ", ".join(u.name for u in self.units[job.start:job.stop])
        where = (f"stage {job.stage} ({job.kind}, units {names}) on {device.name}"
                 + (f" at microbatch {mb}" if mb is not None else ""))
        if isinstance(e, (DeviceMemoryExceeded, torch.OutOfMemoryError)):
            return self._out_of_memory(job, device, where, e, grain)
        if isinstance(e, RoundPipeError):
            e.args = (f"{where}: {e}",) + tuple(e.args[1:])
            return e
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        hint = getattr(e, "_roundpipe_in_loss_fn", None)  # the user's loss_fn raised (api.py)
        if hint is not None:  # named as such, not as the stage it ran after
            where = (f"in loss_fn(output, label) (microbatch {mb}, on {device.name}, after "
                     f"stage {job.stage}, the model's last)")
            return StageError(f"{where}: {type(e).__name__}: {e}{hint}", stage=job.stage,
                              device=device.name, microbatch=mb)
        return StageError(f"{where} raised {type(e).__name__}: {e}", stage=job.stage,
                          device=device.name, microbatch=mb)

    def _out_of_memory(self, job: Job, device: Device, where: str, e: BaseException,
                       grain: str = "stage") -> OutOfMemoryError:
        mib = 2**20
        if isinstance(e, DeviceMemoryExceeded):
            have = (f"an upload of {e.needed / mib:.2f} MiB found {e.free / mib:.2f} MiB free "
                    f"of {e.capacity / mib:.2f} MiB")
        else:  # pragma: no cover - CUDA
            free = device.free_bytes()
            have = f"the device ran out of memory ({(free or 0) / mib:.2f} MiB free)"
        stage = self.plan.stages[job.stage] if 0 <= job.stage < len(self.plan.stages) else None
        need = (f"the plan estimated {stage.memory_bytes / mib:.2f} MiB for this stage's job "
                f"and {self.plan.device_memory_bytes / mib:.2f} MiB for a device with the "
                f"next weights prefetched"
                + (f", under a cap of {self.plan.memory_cap / mib:.2f} MiB "
                   f"(memory_fraction of the free memory measured when it was planned, "
                   f"or RoundPipe(memory_cap=); that is the only margin)"
                   if self.plan.memory_cap else "")
                + "; " if stage is not None else "")
        layer = ("; if that is not enough, use recompute_grain='layer'"
                 if grain != "layer" else "")
        return OutOfMemoryError(
            f"{where} does not fit: {need}{have}. Lower memory_fraction (smaller stages, "
            f"more margin) or raise num_microbatch (smaller microbatches, less activation "
            f"memory){layer}; or give the devices more memory")

    def start_load(self, call: CallState, job: Job) -> None:
        """Start uploading ``job``'s state on its device's weight loader."""
        if job.skip or job.index in call.weights:
            return
        device = self.devices[job.index % len(self.devices)]
        host = self.host
        names = host.param_names(job.slots)

        def before() -> None:  # on the loader thread: wait for the optimizer's publish
            start = time.perf_counter()
            if not host.fences.wait(names, call.fence_version, call.abort):
                raise _Aborted()
            end = time.perf_counter()
            if end - start > 1e-4:  # the fence was closed: a step was publishing
                call.fence_waits[job.index] = (start, end)
            for name in names:
                host.fences.record("upload", name, call.fence_version)

        call.load_requested[job.index] = time.perf_counter() - call.t0
        call.weights[job.index] = device.load_weights(
            {slot: call.state.get(slot, host.tensors[slot]) for slot in job.slots}, before,
            owner=job.index)

    def _wait_for(self, call: CallState, job: Job, mb: int) -> None:
        if job.index == 0:
            if call.abort.is_set():
                raise _Aborted()
            return
        fut = call.done[(job.index - 1, mb)]
        while True:
            if call.abort.is_set():
                raise _Aborted()
            try:
                fut.result(timeout=_POLL_S)
                return
            except TimeoutError:
                continue
            except BaseException:
                raise _Aborted() from None

    @staticmethod
    def ready(call: CallState, job: Job, mb: int) -> bool:
        """Whether microbatch ``mb``'s inputs are all on the host already."""
        if mb >= call.num_mb:
            return False
        if job.index == 0:
            return True
        fut = call.done[(job.index - 1, mb)]
        return fut.done() and fut.exception() is None

    def _job_main(self, job: Job, device: Device, call: CallState) -> None:
        start = time.perf_counter() - call.t0
        runner = JobRunner(self, job, device, call)
        spans: list[tuple[float, float]] = []
        mb = 0
        # Named for torch.profiler, so stages show in PyTorch's own traces too.
        with torch.profiler.record_function(f"roundpipe stage {job.stage} ({job.kind})"), \
                device.watching(job.index):
            try:
                runner.setup()
                for mb in range(call.num_mb):
                    self._wait_for(call, job, mb)
                    t = time.perf_counter() - call.t0
                    try:
                        runner.run_microbatch(mb, self.ready(call, job, mb + 1))
                    except _Aborted:
                        raise
                    except BaseException as e:
                        e._roundpipe_microbatch = mb  # type: ignore[attr-defined]
                        raise
                    spans.append((t, time.perf_counter() - call.t0))
                    # Readers of this microbatch's host values start once its downloads
                    # have landed; this thread goes on with the next microbatch meanwhile.
                    device.after_downloads().add_done_callback(
                        functools.partial(_settle, call.done[(job.index, mb)]))
                runner.finish()
            except BaseException:
                for rest in range(mb, call.num_mb):
                    _settle(call.done[(job.index, rest)], None)
                raise
            finally:
                runner.release()
                # Nothing of this job may still be copying into host memory when the call
                # returns, failed or not (its error, if any, is already on its way).
                with contextlib.suppress(BaseException):
                    device.wait_downloads()
        with call.lock:
            call.timeline.append(JobRecord(
                job=job.index, stage=job.stage, kind=job.kind,
                units=", ".join(u.name for u in self.units[job.start:job.stop]),
                device=device.name, start_s=start, end_s=time.perf_counter() - call.t0,
                microbatches=call.num_mb,
                weights_requested_s=call.load_requested.get(job.index),
                microbatch_s=tuple(spans)))


def _settle(done: Future, landed: Future | None) -> None:
    """Complete a microbatch's ``done`` future from its downloads' future (``None``: the
    job failed); whichever of the job and the download waiter comes first wins."""
    if landed is None or landed.cancelled():
        error: BaseException | None = _Aborted()
    else:
        error = landed.exception()
    try:
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
    except InvalidStateError:
        pass


def _for_compile(module: torch.nn.Module, *, fresh: bool) -> torch.nn.Module:
    """The unit program to hand to torch.compile: a copy (``fresh``, or when it calls keyed
    random ops, which the copy calls through :func:`rng.uncompiled`), else itself."""
    graph = getattr(module, "graph", None)
    keyed = graph is not None and any(
        n.op == "call_function" and n.target in rng.KEYED_OPS for n in graph.nodes)
    if not (fresh or keyed):
        return module
    module = copy.deepcopy(module)
    if keyed:
        for node in module.graph.nodes:  # type: ignore[union-attr]
            if node.op == "call_function" and node.target in rng.KEYED_OPS:
                node.target = rng.uncompiled(node.target)
        module.recompile()  # type: ignore[operator]
    return module


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _stamp(times: dict[tuple[int, int], float], key: tuple[int, int], _: Future) -> None:
    times[key] = time.perf_counter()
