"""The state one call shares across its jobs (:class:`CallState`): the executor
(:mod:`.executor`) makes it and collects its results; every job's
:class:`~roundpipe.runtime.job_runner.JobRunner` reads its inputs and writes its values,
gradients and timings there."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ..ops.rng import RngKey
from .devices import Device, Transfer
from .jobs import Job
from .param_hooks import NO_HOOKS, HookPlan

if TYPE_CHECKING:  # pragma: no cover
    from .executor import JobRecord


@dataclass
class CallState:
    """Shared state of one call across its jobs: what the executor sets up and
    collects, and what each job's :class:`~roundpipe.runtime.job_runner.JobRunner` reads
    and writes (under ``lock`` where jobs on several devices write the same field)."""

    mode: str                       # "train", "forward" or "backward"
    num_mb: int
    grain: str
    keys: list[RngKey | None]
    store: list[dict[str, Any]]     # host values per microbatch
    grads: list[dict[str, torch.Tensor]]  # host gradients of values per microbatch
    labels: list[Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    want_outputs: bool
    fence_version: int
    carries: frozenset[str]         # values (and state slots) through which grads flow
    abort: threading.Event
    done: dict[tuple[int, int], Future]
    losses: list[torch.Tensor | None]
    param_grads: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    timeline: list[JobRecord] = field(default_factory=list)
    unit_fwd_s: dict[int, float] = field(default_factory=dict)
    unit_bwd_s: dict[int, float] = field(default_factory=dict)
    # (table, {unit: share}, device, start mark, end mark), resolved when the call ends
    timings: list[tuple[dict[int, float], dict[int, float], Device, Any, Any]] = field(
        default_factory=list)
    autocast: tuple[str, torch.dtype] | None = None
    weights: dict[int, Transfer] = field(default_factory=dict)  # loads, by job index
    load_requested: dict[int, float] = field(default_factory=dict)
    handoff: dict[tuple[int, str], Any] = field(default_factory=dict)  # (mb, value)
    jobs: list[Job] = field(default_factory=list)
    nonfinite_loss_ok: bool = False
    # on_grads(start, stop, [(slot, unit, host tensor)]), on the device thread: units
    # [start, stop) have final parameter gradients, those listed staged on the host.
    # Called per unit once the last microbatch's backward passed it, and when a fused/bwd
    # job finishes (covering all its units; frozen or skipped units have no gradients).
    on_grads: Callable[[int, int, list[tuple[str, int, torch.Tensor]]], None] | None = None
    # Called once the fused job has every loss and checked them (a step that consumes
    # gradients as they land may update nothing before: a later loss could still fail).
    on_losses: Callable[[], None] | None = None
    # admit(unit, abort) before a unit's final gradients are downloaded: waits while the
    # step consuming them is a window of units behind (forward_backward(step=...)).
    admit: Callable[[int, threading.Event], None] | None = None
    # (slot, unit) -> the gradient in its master's dtype, copied off the download buffer
    # once it landed (GradLanding); replaces param_grads when the call succeeds.
    converted: dict[tuple[str, int], Future] = field(default_factory=dict)
    in_place: set[str] = field(default_factory=set)  # slots left in their download buffer
    grad_norms: dict[str, torch.Tensor] = field(default_factory=dict)  # of in_place slots
    measure_norms: bool = False  # read once at the start (HostView.wants_grad_norms)
    steps: list[Future] = field(default_factory=list)  # optimizer steps pending at start
    # Slot -> the tensor uploaded instead of the host's (a backward's buffers as they were
    # before its forward, see Stash).
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    t0: float = 0.0
    # job index -> (start, end) of its upload's wait for the optimizer's publish, where
    # the fence was closed; and the intervals a job stood waiting for such an upload
    fence_waits: dict[int, tuple[float, float]] = field(default_factory=dict)
    weight_stalls: list[tuple[float, float]] = field(default_factory=list)
    # (job index, microbatch) -> when its outputs were handed on: the next job's
    # first microbatch could not start before (a weight wait then stalls nothing)
    done_at: dict[tuple[int, int], float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: frozenset[str] = frozenset()  # more values returned per microbatch (RunResult.values)
    hooks: HookPlan = NO_HOOKS  # where the parameters' autograd hooks run
    mb_grads: dict[str, list[tuple[int, int, torch.Tensor]]] = field(default_factory=dict)
    # loss_fn's reads of the model's trainable parameters (forward_backward): id of the
    # parameter (or of its master) -> (its slot, the tensor), and slot -> the last unit
    # reading it (its backward runs first), which joins loss_fn's part of the
    # microbatch gradient into its own
    loss_params: Mapping[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    loss_joins: Mapping[str, int] = field(default_factory=dict)
    # (microbatch, slot) -> loss_fn's part of a parameter's gradient a unit reads, held
    # until that unit joins it (never on the parameter's .grad: a failed call drops it)
    loss_grads: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # slot -> [(microbatch, gradient)] of the parameters only loss_fn reads, held until
    # the commit (RunResult.loss_grads) or handed to on_grads as unit len(units)
    loss_only: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    # Buffers every microbatch reads as the call began (pipe(x): eager writes them once
    # per call, from values no sample changes; see OutputMergePlan.per_call_state).
    fresh_state: frozenset[str] = frozenset()
    # Per microbatch, the host gradients of the label's leaves that require grad (flat
    # leaf index -> gradient); None: the call does not return them.
    label_grads: list[dict[int, torch.Tensor]] | None = None
