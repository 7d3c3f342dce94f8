"""The job list of a call: which stages run, in which order, and what each one reads
from the host store, publishes to it, hands to the next job on the same device and
uploads.  Pure: no threads and no tensors, so it can be checked exactly.

A *job* is one stage over every microbatch; job ``j`` runs on device ``j % D`` (after the
rotation the caller chose).  A call in mode

* ``"train"`` runs every stage: forward stages, the fused tail (loss and backward),
  backward stages;
* ``"forward"`` runs the forward stages and the tail as a forward stage;
* ``"backward"`` (of a recorded forward) runs the tail as a backward stage (recomputed
  like any other), then the backward stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..plan import StagePlan

MODES = ("train", "forward", "backward")


@dataclass(frozen=True)
class Job:
    index: int
    stage: int          # index in plan.stages
    kind: str           # "fwd", "fused" or "bwd"
    start: int          # units [start, stop)
    stop: int
    reads: tuple[str, ...] = ()     # host values it reads (bwd: the stash)
    publishes: frozenset[str] = frozenset()  # values it writes to the host store
    handoff: frozenset[str] = frozenset()    # values the next job (same device) takes
    slots: tuple[str, ...] = ()     # state slots it uploads
    skip: bool = False              # a backward job through which no gradient flows

    def __repr__(self) -> str:  # compact, for test failures and logs
        extra = " skip" if self.skip else ""
        return (f"Job({self.index}: stage {self.stage} {self.kind} units "
                f"{self.start}-{self.stop}{extra})")


def stage_jobs(plan: StagePlan, mode: str) -> list[Job]:
    """The jobs of ``mode``, not yet wired (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    stages, tail = plan.stages, plan.fused_stage
    if mode == "train":
        return [Job(i, i, s.kind, *s.units) for i, s in enumerate(stages)]
    if mode == "forward":
        fwd = [s for s in stages if s.kind == "fwd"]
        jobs = [Job(i, s.index, "fwd", *s.units) for i, s in enumerate(fwd)]
        jobs.append(Job(len(jobs), tail.index, "fwd", tail.units[0], len(plan.program.units)))
        return jobs
    bwd = [s for s in stages if s.kind == "bwd"]
    return ([Job(0, tail.index, "bwd", *tail.units)]
            + [Job(i + 1, s.index, "bwd", *s.units) for i, s in enumerate(bwd)])


def plan_jobs(plan: StagePlan, mode: str, grain: str, *, num_devices: int,
              carries: frozenset[str] | None = None, want_outputs: bool = False,
              keep: frozenset[str] = frozenset(), stash_for_backward: bool = False
              ) -> tuple[Job, ...]:
    """The wired jobs of one call.

    Args:
        plan: the stage plan.
        mode: ``"train"``, ``"forward"`` or ``"backward"``.
        grain: ``"stage"`` or ``"layer"`` (what a backward job reads: the stage's inputs,
            or every unit's inputs).
        num_devices: devices the jobs rotate over (on one device, values pass from a
            job to the next without a host copy).
        carries: values and state slots through which gradients flow; a backward job
            reading none of them is skipped.  None: every value carries.
        want_outputs: the model's outputs must reach the host.
        keep: more values that must reach the host (an output tail's inputs).
        stash_for_backward: a recorded forward: what the backward reads must reach the
            host.
    """
    program = plan.program
    units = program.units
    outputs = [o.value for o in program.outputs if o.value is not None]
    producer = {v: u.index for u in units for v in u.outputs}
    reads_of: list[tuple[str, ...]] = []
    jobs = stage_jobs(plan, mode)
    for job in jobs:
        if job.kind == "bwd" and grain == "layer":
            reads: list[str] = []
            for unit in units[job.start:job.stop]:
                reads.extend(v for v in unit.inputs if v not in reads)
            job_reads = tuple(reads)
        else:
            job_reads = program.range_inputs(job.start, job.stop)
        if job.kind == "fused":  # the loss reads the outputs made by earlier jobs
            job_reads += tuple(v for v in outputs
                               if producer.get(v, -1) < job.start and v not in job_reads)
        reads_of.append(job_reads)
    kept: set[str] = set(keep)  # what must reach the host whoever reads it next
    if stash_for_backward:
        for per_stage in plan.stash[grain]:
            kept.update(per_stage)
        tail = plan.fused_stage
        for unit in units[tail.units[0]:tail.units[1]]:
            kept.update(unit.inputs)
    if want_outputs:
        kept.update(outputs)
    same_device = num_devices == 1  # consecutive jobs share a device
    wired: list[Job] = []
    for k, job in enumerate(jobs):
        mine = units[job.start:job.stop]
        produced = {v for u in mine for v in u.outputs}
        slots: list[str] = []
        for unit in mine:
            slots.extend(s for s in unit.state if s not in slots)
        skip = job.kind == "bwd" and carries is not None and not any(
            v in carries for u in mine for v in list(u.inputs) + list(u.state))
        handoff: frozenset[str] = frozenset()
        if same_device and k + 1 < len(jobs) and jobs[k + 1].kind != "bwd":
            # What the next job reads goes to it on the device; the host copy is made
            # only for other readers (later jobs, the backward stash, the outputs).
            handoff = frozenset(produced & set(reads_of[k + 1]))
            others = set(kept).union(*reads_of[k + 2:])
        else:
            others = set(kept).union(*reads_of[k + 1:])
        wired.append(Job(job.index, job.stage, job.kind, job.start, job.stop,
                         reads=reads_of[k], publishes=frozenset(produced & others),
                         handoff=handoff, slots=tuple(slots), skip=skip))
    return tuple(wired)


def describe(jobs: Sequence[Job]) -> list[str]:
    """One line per job: what it reads, publishes, hands off (for tests and debugging)."""
    return [f"{j.index} {j.kind} {j.start}-{j.stop} reads {sorted(j.reads)} publishes "
            f"{sorted(j.publishes)} handoff {sorted(j.handoff)}"
            + (" skip" if j.skip else "") for j in jobs]
