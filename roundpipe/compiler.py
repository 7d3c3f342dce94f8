"""The compiler: model -> :class:`~roundpipe.plan.StagePlan`, one pass after another."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .errors import ConfigError, PartitionError
from .passes.codegen import build_stage_module, generate_unit_programs
from .passes.cost import CostReport, DeviceModel, estimate_costs
from .passes.layers import (LayerAssignment, ModuleTree, assign_layers, find_open_modules,
                            find_unit_roots, module_tree, one_unit_reason,
                            parallel_containers)
from .passes.leaves import resolve_leaf_modules
from .passes.memory import MemoryModel, ReplayFailed
from .passes.output_merge import default_split, plan_output_merge
from .passes.partition import (PipelineCuts, max_pipeline_stages, partition_pipeline,
                               simulate_round_robin)
from .passes.recompute import plan_recompute
from .passes.trace import TracedGraph, trace
from .plan import LayerUnit, ModelProgram, StagePlan, StageSpec, UnitCost, compact_unit_names

log = logging.getLogger(__name__)

PASSES = ("trace", "layers", "codegen(units)", "cost", "partition", "recompute",
          "codegen(stages)")


@dataclass(frozen=True)
class Analysis:
    """What the passes up to cost produce; enough to partition again without tracing."""

    program: ModelProgram
    units: tuple[LayerUnit, ...]
    report: CostReport
    notes: tuple[str, ...]
    leaves: tuple[str, ...] = ()  # modules the trace kept opaque (asked for or found)
    traced: TracedGraph | None = None  # the flat graph (output merges are proven on it)
    layers: LayerAssignment | None = None  # the units' nodes (costs are estimated again)


def analyze(
    model: torch.nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    cost_scale: float = 1.0,
    device_model: DeviceModel | None = None,
    leaf_modules: Sequence[str | type] = (),
    share_blocks: bool = True,
    grad: bool = True,
    inference: bool = False,
) -> Analysis:
    """Trace ``model`` and estimate its per-unit costs.

    Args:
        model, example_args, example_kwargs: the model (on the CPU) and one example call.
        cost_scale: factor from the example to one microbatch (``1 / num_microbatch``
            when the example is a whole batch).
        device_model: throughput figures for the cost model (default: the CPU's).
        leaf_modules: modules (paths or classes) tracing keeps opaque.
        share_blocks: trace each distinct repeated block once (see :func:`trace`).
        grad: the grad mode the program serves (see :func:`trace`).
        inference: whether it serves inference-mode calls (see :func:`trace`).
    """
    device_model = device_model or DeviceModel.for_device("cpu")
    # 1. trace: one flat graph, state as placeholders, tied weights deduplicated.
    tree = module_tree(model)
    roots = find_unit_roots(tree, resolve_leaf_modules(model, leaf_modules))
    traced = trace(model, tuple(example_args), dict(example_kwargs or {}), leaf_modules=roots,
                   opaque_modules=leaf_modules, share_blocks=share_blocks, grad=grad,
                   inference=inference)
    # Leaves found while tracing hide what is inside them.
    hidden = frozenset(resolve_leaf_modules(model, leaf_modules)) | frozenset(traced.leaves)
    layers = assign_units(traced, tree, hidden)
    # 6a. codegen: one program per unit; cuts only ever fall between units.  Where an
    # output mixes samples, the per-sample values it is computed from (under the usual
    # split of the inputs) are unit outputs, so pipe(x) can recompute it on the batch.
    try:
        merge = plan_output_merge(traced, default_split(traced))
        keep = frozenset(v for v, _, _ in merge.tail.inputs) if merge.tail else frozenset()
    except Exception as e:  # noqa: BLE001 - the call checks again, and says why
        log.info("roundpipe: no output merge proven at compile time: %s", e)
        keep = frozenset()
    program = generate_unit_programs(traced, layers, keep=keep)
    # 3. cost: FLOPs and bytes per unit on fake tensors, liveness across every cut.
    report = estimate_costs(traced, layers, program, device_model, scale=cost_scale)
    return Analysis(program, layers.units, report, traced.notes + layers.notes,
                    traced.leaves, traced, layers)


def estimate_again(analysis: Analysis, example_inputs: Sequence[Any], *,
                   cost_scale: float = 1.0, device_model: DeviceModel | None = None
                   ) -> CostReport | None:
    """Pass 3 again, on the analysed program with other example inputs (flat, aligned with
    ``analysis.traced.inputs.names``): a call whose microbatch has other shapes than the
    traced example gets costs and stage memory that describe it.  ``cost_scale`` as for
    :func:`analyze`.  None when the analysis kept no graph to interpret."""
    if analysis.traced is None or analysis.layers is None:
        return None
    traced = dataclasses.replace(analysis.traced, example_inputs=tuple(example_inputs))
    # A graph that does not run on fake tensors is run once for real: it must not draw
    # from the caller's random number generator (dropout), as eager would not.
    with torch.random.fork_rng(devices=[]):
        return estimate_costs(traced, analysis.layers, analysis.program,
                              device_model or DeviceModel.for_device("cpu"),
                              scale=cost_scale)


def assign_units(traced: TracedGraph, tree: ModuleTree,
                 hidden: frozenset[str] = frozenset()) -> LayerAssignment:
    """Pass 2, layers, as both front ends run it: group nodes into layer units
    (repeated blocks, prologue, epilogue); sibling blocks that do not feed one another
    (experts) are kept whole."""
    def assign(hidden: frozenset[str]) -> LayerAssignment:
        roots = find_unit_roots(tree, hidden)
        return assign_layers(traced, roots, find_open_modules(tree, roots, hidden))

    layers = assign(hidden)
    parallel = parallel_containers(traced, layers)
    if parallel:
        layers = assign(hidden | parallel)
    if len(layers.units) == 1:
        # Nothing to pipeline: say why, in the plan and at compile time.
        note = one_unit_reason(tree, hidden, layers)
        log.warning("roundpipe: %s", note)
        layers = dataclasses.replace(layers, notes=layers.notes + (note,))
    return layers


@dataclass(frozen=True)
class PlanOptions:
    """How a program is cut into stages (what :func:`make_plan` needs besides costs)."""

    num_devices: int
    """Devices the plan is balanced for (round robin over them)."""
    num_microbatch: int
    """Microbatches per call; the schedule estimate runs this many."""
    device_model: DeviceModel
    """Throughput figures of the devices (compute, PCIe link)."""
    memory_cap: int | None = None
    """Bytes a device may hold: one job at its peak together with the weights prefetched
    for the next job, i.e. a bound on ``StagePlan.device_memory_bytes`` (None:
    unlimited)."""
    num_stages: int | None = None
    """Exact number of stages (None: the fewest, at least ``num_devices + 1``, that fit
    the cap)."""
    recompute_grain: str = "stage"
    """Grain shown in the plan and assumed by the OOM advice (each call may override)."""
    memory_cap_origin: str = ""
    """Where the cap came from (e.g. ``memory_fraction 0.9 of the 21.3 GiB measured free
    on cuda:0``), for the error when nothing fits."""


def plan_from_traced(traced: TracedGraph, tree: ModuleTree, options: PlanOptions, *,
                     cost_scale: float = 1.0, notes: Sequence[str] = ()
                     ) -> tuple[StagePlan, LayerAssignment, CostReport]:
    """The passes from layers on, for a graph a front end already traced (the
    ``torch.compile`` backend's Dynamo graphs): layers, codegen, cost, partition,
    recompute."""
    layers = assign_units(traced, tree)
    program = generate_unit_programs(traced, layers)
    report = estimate_costs(traced, layers, program, options.device_model, scale=cost_scale)
    if options.num_stages is not None:
        options = dataclasses.replace(
            options, num_stages=min(options.num_stages, max_pipeline_stages(len(layers.units))))
    plan = make_plan(program, layers.units, report, options,
                     notes=tuple(traced.notes) + tuple(layers.notes) + tuple(notes))
    return plan, layers, report


def compile_model(
    model: torch.nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    num_devices: int = 1,
    num_microbatch: int | None = None,
    example_is_microbatch: bool = False,
    device_model: DeviceModel | None = None,
    memory_cap: int | None = None,
    num_stages: int | None = None,
    recompute_grain: str = "stage",
    leaf_modules: Sequence[str | type] = (),
    share_blocks: bool = True,
) -> StagePlan:
    """Trace ``model`` and cut it into a stage plan.

    Args:
        model: the model (on the CPU).
        example_args, example_kwargs: one example call (a whole batch unless
            ``example_is_microbatch``).
        num_devices: devices the plan is balanced for.
        num_microbatch: microbatches per batch (default ``num_devices + 1``); costs are
            estimated per microbatch.
        example_is_microbatch: the example is one microbatch rather than a whole batch.
        device_model: throughput figures for the cost model (default: the CPU's).
        memory_cap: bytes a device may hold, a job and the next job's prefetched weights
            together (None: unlimited).
        num_stages: exact number of stages (default: ``num_devices + 1``, more when the
            memory cap demands it).
        recompute_grain: default grain shown in the plan (each call may override it).
        leaf_modules: modules (paths or classes) tracing keeps opaque.
        share_blocks: trace each distinct repeated block once (see :func:`analyze`).
    """
    if num_microbatch is None:
        num_microbatch = num_devices + 1
    if isinstance(num_microbatch, bool) or not isinstance(num_microbatch, int) \
            or num_microbatch < 1:
        raise ConfigError(f"num_microbatch must be a positive int, got {num_microbatch!r}")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError(f"num_devices must be a positive int, got {num_devices!r}")
    started = time.perf_counter()
    device_model = device_model or DeviceModel.for_device("cpu")
    analysis = analyze(model, example_args, example_kwargs,
                       cost_scale=1.0 if example_is_microbatch else 1.0 / num_microbatch,
                       device_model=device_model, leaf_modules=leaf_modules,
                       share_blocks=share_blocks)
    plan = make_plan(analysis.program, analysis.units, analysis.report,
                     PlanOptions(num_devices, num_microbatch, device_model, memory_cap,
                                 num_stages, recompute_grain),
                     notes=analysis.notes)
    log.info("roundpipe: compiled %s (%s, %d units, %d stages) in %.2f s",
             type(model).__name__, analysis.program.trace_method, len(analysis.units),
             len(plan.stages), time.perf_counter() - started)
    return plan


def make_plan(
    program: ModelProgram,
    units: Sequence[LayerUnit],
    report: CostReport,
    options: PlanOptions,
    *,
    notes: Sequence[str] = (),
) -> StagePlan:
    """Partition, plan recompute and generate stage programs from unit costs.

    Separate from :func:`compile_model` so a plan can be recomputed from measured times
    without tracing again.
    """
    try:
        return _make_plan(program, units, report, options, notes=notes)
    except ReplayFailed as e:
        log.info("roundpipe: %s; stage memory is estimated from summed unit costs", e)
        return _make_plan(program, units, dataclasses.replace(report, memory=None), options,
                          notes=tuple(notes) + (
                              "stage memory from summed unit costs: " + str(e),))


def _make_plan(
    program: ModelProgram,
    units: Sequence[LayerUnit],
    report: CostReport,
    options: PlanOptions,
    *,
    notes: Sequence[str] = (),
) -> StagePlan:
    num_devices, num_microbatch = options.num_devices, options.num_microbatch
    memory_cap, recompute_grain = options.memory_cap, options.recompute_grain
    costs = report.units
    # 4. partition: exact min-max over forward, fused tail and backward stages.
    weights = _UnitWeights(program)
    cuts = _choose_cuts(costs, num_devices=num_devices, memory_cap=memory_cap,
                        num_stages=options.num_stages, names=[u.name for u in units],
                        recompute_grain=recompute_grain,
                        fits=_fits_by_lifetimes(report.memory, options, weights),
                        unit_memory=_unit_memory(report.memory, options, weights),
                        cap_origin=options.memory_cap_origin)
    ranges = ([("fwd", p) for p in cuts.forward_parts]
              + [("fused", (cuts.tail_start, len(costs)))]
              + [("bwd", p) for p in reversed(cuts.backward_parts)])
    # 5. recompute: what each backward stage needs stashed, per grain.
    stash = plan_recompute(program, ranges)
    # 6b. codegen: a program per stage that calls its unit programs in order.
    stage_modules = tuple(build_stage_module(program, a, b)[0] for _, (a, b) in ranges)
    prefetch = max(weights.stage(a, b) for _, (a, b) in ranges)
    stages = tuple(_stage_spec(i, kind, rng, program, units, report, cuts, options, prefetch)
                   for i, (kind, rng) in enumerate(ranges))
    schedule = simulate_round_robin(
        [s.est_time_s for s in stages], num_microbatch, num_devices,
        upload_times=[s.param_bytes / options.device_model.link_bytes_per_s for s in stages])
    return StagePlan(
        program=program,
        units=tuple(units),
        costs=tuple(costs),
        stages=stages,
        stage_modules=stage_modules,
        stash=stash,
        num_devices=num_devices,
        num_microbatch=num_microbatch,
        memory_cap=memory_cap,
        est_step_time_s=schedule.makespan,
        passes=PASSES,
        notes=tuple(notes),
    )


def _ns(seconds: float) -> int:
    return max(1, round(seconds * 1e9))


def _size(nbytes: int) -> str:
    """``"1048576 bytes (1.0 MiB)"``: exact for small sizes, readable for large ones."""
    return f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"


def _fwd_memory(c: UnitCost) -> int:
    return c.param_bytes + c.activation_bytes


def _bwd_memory(c: UnitCost) -> int:
    return c.param_bytes + c.trainable_bytes + c.activation_bytes


class _UnitWeights:
    """Bytes of state a stage of units ``[start, stop)`` uploads (shared slots once)."""

    def __init__(self, program: ModelProgram) -> None:
        self._units = program.units
        self._nbytes = {s.name: s.nbytes for s in program.state}

    def stage(self, start: int, stop: int) -> int:
        return sum(self._nbytes[s] for s in {s for u in self._units[start:stop] for s in u.state})

    def largest_unit(self) -> int:
        return max((self.stage(i, i + 1) for i in range(len(self._units))), default=0)


def _fits_by_lifetimes(memory: MemoryModel | None, options: PlanOptions,
                       weights: _UnitWeights) -> Callable[[PipelineCuts], bool] | None:
    """Whether some cuts fit the cap by the lifetime estimate: the largest job together
    with the largest weights a device prefetches meanwhile, ``device_memory_bytes`` of
    the plan they make (None without a cap or without the estimate: the summed unit
    costs decide alone)."""
    cap = options.memory_cap
    if memory is None or cap is None:
        return None

    def fits(cuts: PipelineCuts) -> bool:
        ranges = ([("fwd", p) for p in cuts.forward_parts]
                  + [("fused", (cuts.tail_start, len(memory.program.units)))]
                  + [("bwd", p) for p in cuts.backward_parts])
        prefetch = max(weights.stage(*rng) for _, rng in ranges)
        return all(memory.stage_bytes(kind, rng, num_microbatch=options.num_microbatch,
                                      num_devices=options.num_devices,
                                      grain=options.recompute_grain) + prefetch <= cap
                   for kind, rng in ranges)
    return fits


def _unit_memory(memory: MemoryModel | None, options: PlanOptions, weights: _UnitWeights
                 ) -> list[int] | None:
    """What each unit needs on a device in a stage of its own, by the lifetime estimate:
    its job, and the largest unit's weights prefetched meanwhile (one unit per stage is
    the least any plan prefetches)."""
    if memory is None or options.memory_cap is None:
        return None
    prefetch = weights.largest_unit()
    return [memory.unit_bytes(i, num_microbatch=options.num_microbatch,
                              num_devices=options.num_devices, grain=options.recompute_grain)
            + prefetch for i in range(len(memory.program.units))]


def _choose_cuts(costs: Sequence[UnitCost], *, num_devices: int, memory_cap: int | None,
                 num_stages: int | None, names: Sequence[str],
                 recompute_grain: str = "stage",
                 fits: Callable[[PipelineCuts], bool] | None = None,
                 unit_memory: Sequence[int] | None = None,
                 cap_origin: str = "") -> PipelineCuts:
    """The fewest stages (at least devices + 1) that satisfy the memory cap, balanced.

    ``memory_cap`` bounds a device: a job and the weights prefetched for the next one.
    Without the lifetime estimate, each stage's summed unit costs must fit half of it
    (the stage computing and the one prefetched, each at most that).

    With ``fits`` (the lifetime estimate, passes/memory.py), a stage count is taken when
    its balanced cuts, or else the cuts the summed unit costs allow under the cap, fit by
    that estimate; the summed costs alone count every value a unit makes for as long as
    the job runs, and would ask for stages the device does not need."""
    fwd = [_ns(c.fwd_s) for c in costs]
    bwd = [_ns(c.fwd_s + c.bwd_s) for c in costs]  # recompute + backward
    kwargs = dict(fwd_memory=[_fwd_memory(c) for c in costs],
                  bwd_memory=[_bwd_memory(c) for c in costs],
                  tail_memory=[_bwd_memory(c) for c in costs],
                  memory_cap=None if memory_cap is None else memory_cap // 2)
    n = len(costs)
    most = max_pipeline_stages(n)
    cap_text = "" if memory_cap is None else (
        f"the device memory cap is {_size(memory_cap)}"
        + (f" ({cap_origin}; that fraction is the plan's only margin)" if cap_origin else ""))
    advice = ("raise num_microbatch to shrink activations"
              + (", use recompute_grain='layer'" if recompute_grain != "layer" else "")
              + (", raise memory_fraction (up to 1.0)" if cap_origin else "")
              + ", or give the devices more memory")
    if memory_cap is not None:
        alone = unit_memory or [2 * _bwd_memory(c) for c in costs]
        worst = max(range(n), key=lambda i: alone[i])
        need = alone[worst]
        if need > memory_cap:
            raise PartitionError(
                f"unit {names[worst]} alone needs an estimated {_size(need)} (weights, "
                f"gradients and one microbatch's values, with the next stage's weights "
                f"prefetched) but {cap_text}; {advice}")
    uncapped = dict(kwargs, memory_cap=None)

    def attempt(count: int) -> PipelineCuts:
        if fits is None:
            return partition_pipeline(fwd, bwd, bwd, count, **kwargs)
        balanced = partition_pipeline(fwd, bwd, bwd, count, **uncapped)
        if fits(balanced):
            return balanced
        try:
            summed = partition_pipeline(fwd, bwd, bwd, count, **kwargs)
        except PartitionError:
            summed = None
        if summed is not None and fits(summed):
            return summed
        raise PartitionError(f"no cuts into {count} stages found fit by the lifetime "
                             f"estimate: {cap_text}")

    if num_stages is not None:
        return attempt(num_stages)
    first = min(num_devices + 1, most)
    if first == 2:  # two stages cannot hold forward, fused and backward stages
        first = 3 if most >= 3 else 1
    last_error: PartitionError | None = None
    for count in range(first, most + 1):
        if count == 2:
            continue
        try:
            return attempt(count)
        except PartitionError as e:
            last_error = e
            if memory_cap is None:
                raise
    if fits is not None:
        raise PartitionError(
            f"no stage count between {first} and {most} fits: {cap_text}, and even with one "
            f"unit per stage some job with the prefetched weights holds more (weights, "
            f"gradients and one microbatch's values by their lifetimes); {advice}"
        ) from last_error
    raise last_error or PartitionError(f"no stage count between {first} and {most} works")


def _stage_spec(index: int, kind: str, units_range: tuple[int, int], program: ModelProgram,
                units: Sequence[LayerUnit], report: CostReport, cuts: PipelineCuts,
                options: PlanOptions, prefetch: int = 0) -> StageSpec:
    memory_cap, grain = options.memory_cap, options.recompute_grain
    start, stop = units_range
    costs = report.units[start:stop]
    state = {s for u in program.units[start:stop] for s in u.state}
    by_name = program.state_by_name()
    param_bytes = sum(by_name[s].nbytes for s in state)
    trainable = sum(by_name[s].nbytes for s in state if by_name[s].requires_grad)
    activations = sum(c.activation_bytes for c in costs)
    act_in, act_out = report.crossing(start, stop)
    if kind == "fwd":
        est = sum(c.fwd_s for c in costs)
        memory = param_bytes + activations
    else:
        est = sum(c.fwd_s + c.bwd_s for c in costs)
        memory = param_bytes + trainable + activations
    if report.memory is not None:  # the job replayed: tensors' lifetimes, not sums
        memory = report.memory.stage_bytes(kind, units_range,
                                           num_microbatch=options.num_microbatch,
                                           num_devices=options.num_devices, grain=grain)
    # The partitioner's costs, in the same integer nanoseconds (see _choose_cuts).
    cost_ns = sum(_ns(c.fwd_s) if kind == "fwd" else _ns(c.fwd_s + c.bwd_s) for c in costs)
    if memory_cap is not None and memory + prefetch > 0.9 * memory_cap:
        reason = "memory cap"
    elif cost_ns == cuts.bottleneck:
        reason = "bottleneck"
    elif kind == "fused":
        reason = "largest tail within the bottleneck"
    else:
        reason = "balanced"
    return StageSpec(
        index=index,
        kind=kind,  # type: ignore[arg-type]
        units=units_range,
        unit_names=compact_unit_names([u.name for u in units[start:stop]]),
        param_bytes=param_bytes,
        est_time_s=est,
        act_in_bytes=act_in,
        act_out_bytes=act_out,
        memory_bytes=memory,
        recompute="none" if kind != "bwd" else grain,
        reason=reason,
    )
