"""The stage plan: what the compiler produces and the runtime executes.

Data only.  The runtime imports this module and torch, never the compiler passes, so a
hand-written :class:`StagePlan` runs as well as a compiled one.

Vocabulary:

* a *value* is a node of the traced graph, named by the node's name; values cross unit
  boundaries through a per-microbatch store on the host.
* a *state slot* is a parameter, buffer or constant tensor of the model; programs receive
  state as explicit inputs (nothing is captured), so the runtime can pass device copies.
* a *unit* is a layer unit (a repeated block, a prologue or an epilogue); it is the atom of
  partitioning, of recompute, of gradient accumulation and of dropout seeding.
* a *stage* is a contiguous range of units executed as one job on one device.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch
from tabulate import tabulate

StageKind = Literal["fwd", "fused", "bwd"]
StateKind = Literal["parameter", "buffer", "constant"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class StateSpec:
    """One state slot (parameter, buffer or constant) of the traced model.

    Attributes:
        name: placeholder name used by the programs.
        fqn: canonical name in the model (as ``named_parameters()`` / ``named_buffers()``
            yield it); tied tensors have one slot, the other names are in ``aliases``.
        aliases: other fully-qualified names of the same tensor.
        kind: ``"parameter"``, ``"buffer"`` or ``"constant"`` (a tensor created inside
            ``forward``; its value is stored in ``ModelProgram.constants``).
        shape, dtype, nbytes: metadata of the tensor at trace time.
        units: indices of the layer units that read it.
        requires_grad: whether the parameter was trainable at trace time (the runtime
            reads the live flag; this one feeds memory estimates).
    """

    name: str
    fqn: str
    aliases: tuple[str, ...]
    kind: StateKind
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    units: tuple[int, ...] = ()
    requires_grad: bool = False


@dataclass(frozen=True)
class UnitProgram:
    """The generated program of one layer unit.

    ``module(*inputs, *state, [device], [rng])`` returns a tuple with one entry per name in
    ``outputs``.  ``device`` is passed when ``needs_device`` (factory ops such as
    ``arange`` create tensors on the executing device); ``rng`` is a
    :class:`roundpipe.ops.rng.RngKey` passed when ``needs_rng``.
    """

    index: int
    name: str
    module: torch.nn.Module
    inputs: tuple[str, ...]
    state: tuple[str, ...]
    outputs: tuple[str, ...]
    mutated_state: tuple[str, ...] = ()
    needs_device: bool = False
    needs_rng: bool = False


@dataclass(frozen=True)
class OutputRef:
    """One flat model output: a value name, or a constant when ``value`` is None."""

    value: str | None
    constant: Any = None


@dataclass(frozen=True)
class InputSignature:
    """How user ``(args, kwargs)`` map onto the program's flat input values.

    Attributes:
        kind: ``"pytree"``: flatten ``(args, kwargs)`` with ``spec`` (torch.export);
            ``"signature"``: bind to ``forward``'s parameters ``params`` (torch.fx), each
            bound argument is one flat input.
        spec: the pytree spec of ``(args, kwargs)`` for ``"pytree"``.
        params: ordered ``forward`` parameter names for ``"signature"``.
        defaults: default values of those parameters (``inspect.Parameter.empty`` if none).
        names: value name of each flat input (``None`` for an input the graph never reads).
        static: per flat input, what a new call must match to reuse this program: for a
            tensor, ``(dtype, shape)`` with ``None`` for dynamic dimensions and ``(low,
            high)`` for dynamic dimensions export's guards bounded (``high`` None:
            unbounded); otherwise the constant value the trace specialised on.
    """

    kind: Literal["pytree", "signature"]
    spec: Any
    params: tuple[str, ...]
    defaults: tuple[Any, ...]
    names: tuple[str | None, ...]
    static: tuple[Any, ...]


@dataclass(frozen=True)
class ModelProgram:
    """The traced model cut into unit programs."""

    units: tuple[UnitProgram, ...]
    state: tuple[StateSpec, ...]
    inputs: InputSignature
    outputs: tuple[OutputRef, ...]
    out_spec: Any
    buffer_updates: tuple[tuple[str, str], ...] = ()
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)
    trace_method: str = "export"
    # Where the forward registers tensor hooks (module and source line): each runs once
    # per microbatch and backward, as in eager's per-microbatch loop.
    tensor_hooks: tuple[str, ...] = ()

    def state_by_name(self) -> dict[str, StateSpec]:
        return {s.name: s for s in self.state}

    def range_inputs(self, start: int, stop: int) -> tuple[str, ...]:
        """Values read by units ``[start, stop)`` that are made outside the range."""
        produced: set[str] = set()
        needed: list[str] = []
        for unit in self.units[start:stop]:
            needed.extend(v for v in unit.inputs if v not in produced and v not in needed)
            produced.update(unit.outputs)
        return tuple(needed)


@dataclass(frozen=True)
class MergeRule:
    """How ``pipe(x)`` puts one flat output back together from its microbatches.

    ``kind``: ``"cat"`` (concatenate along ``dim``: the output is computed sample by
    sample), ``"first"`` (the same in every microbatch), ``"tail"`` (recomputed after the
    pipeline from the concatenated per-sample values it depends on: it mixes samples, as a
    mean loss does) or ``"none"`` (no exact merge: ``reason`` says why).
    """

    kind: Literal["cat", "first", "tail", "none"]
    dim: int = 0
    reason: str = ""


@dataclass(frozen=True)
class OutputTail:
    """The nodes from the last per-sample values to the outputs that mix samples, as one
    program run once on the whole batch.

    Attributes:
        program: a unit program (``index`` -1) whose inputs are per-sample values.
        inputs: per program input, ``(value, "cat" | "first", dim)``: concatenated over
            the microbatches along ``dim``, or taken from the first one.
        outputs: the flat outputs it computes, by position.
        output_values: the value each of those is (a program output of ``program``).
    """

    program: UnitProgram
    inputs: tuple[tuple[str, str, int], ...]
    outputs: tuple[int, ...]
    output_values: tuple[str, ...] = ()


@dataclass(frozen=True)
class OutputMergePlan:
    """The merge rule of every flat output for one way of splitting the inputs, and what
    becomes of the buffers the forward writes.

    Attributes:
        per_call_state: buffers the forward writes from values no sample changes (a call
            counter, spectral norm's power iteration): eager writes them once per call, so
            every microbatch starts from the value the call began with and computes that
            one write (the last microbatch's copy is committed).
        state_refusal: why a buffer write has no exact whole-batch equivalent (a write
            from batch values, such as BatchNorm's running statistics, or from random
            numbers), naming the buffer; empty when there is none.
    """

    rules: tuple[MergeRule, ...]
    tail: OutputTail | None = None
    per_call_state: tuple[str, ...] = ()
    state_refusal: str = ""


@dataclass(frozen=True)
class LayerUnit:
    """A layer unit as the plan table shows it."""

    index: int
    name: str
    kind: Literal["prologue", "block", "epilogue", "module"]
    module_paths: tuple[str, ...]
    num_nodes: int


@dataclass(frozen=True)
class UnitCost:
    """Cost estimate of one layer unit, for one microbatch.

    Attributes:
        fwd_flops: forward floating-point operations (FlopCounterMode on fake tensors).
        fwd_bytes: forward memory traffic (bytes read and written by every op).
        fwd_time_s, bwd_time_s: estimated forward and backward (without recompute) times.
        param_bytes: bytes of the state the unit reads (a tied weight counts once per unit).
        trainable_bytes: bytes of the parameters that require grad.
        activation_bytes: bytes of every value the unit produces (its autograd footprint).
        output_bytes: bytes of the values live across the cut right after this unit.
        measured_fwd_s, measured_bwd_s: times measured by the runtime, when fed back.
    """

    fwd_flops: int
    fwd_bytes: int
    fwd_time_s: float
    bwd_time_s: float
    param_bytes: int
    trainable_bytes: int
    activation_bytes: int
    output_bytes: int
    measured_fwd_s: float | None = None
    measured_bwd_s: float | None = None

    @property
    def fwd_s(self) -> float:
        return self.measured_fwd_s if self.measured_fwd_s is not None else self.fwd_time_s

    @property
    def bwd_s(self) -> float:
        return self.measured_bwd_s if self.measured_bwd_s is not None else self.bwd_time_s


@dataclass(frozen=True)
class StageSpec:
    """One stage of the plan, in execution order.

    Attributes:
        index: position in execution order (forward stages, the fused tail, then backward
            stages from the last units to the first).
        kind: ``"fwd"``, ``"fused"`` (forward + loss + backward, never recomputed) or
            ``"bwd"`` (recompute + backward).
        units: ``(start, stop)`` range of layer units.
        unit_names: compact rendering, e.g. ``"wte, h.0-5"``.
        param_bytes: bytes of state uploaded for the stage.
        est_time_s: estimated time per microbatch (measured unit times when available).
        act_in_bytes, act_out_bytes: activation bytes entering / leaving per microbatch.
        memory_bytes: estimated device memory for one job: the most its tensors hold at
            once (weights, gradients, one microbatch's values by their lifetimes), from a
            replay on fake tensors (passes/memory.py).
        recompute: ``"none"`` for forward and fused stages, else the default grain.
        reason: why the stage boundary is where it is.
    """

    index: int
    kind: StageKind
    units: tuple[int, int]
    unit_names: str
    param_bytes: int
    est_time_s: float
    act_in_bytes: int
    act_out_bytes: int
    memory_bytes: int
    recompute: str
    reason: str = ""


@dataclass(frozen=True)
class HostStepEstimate:
    """The host's share of a training step (landing, update, publish), from the bytes
    it moves per parameter and the host's measured memory bandwidth."""

    optimizer: str          # the optimizer it was estimated for
    assumed: bool           # True: none was known, torch's AdamW was assumed
    params: int             # trainable parameters
    bytes_per_param: float  # host bytes read and written per parameter per step
    bandwidth: float        # bytes per second (STREAM triad, this process)
    seconds: float          # params * bytes_per_param / bandwidth
    device_seconds: float   # the plan's estimated device time per step
    # How an exact step of this optimizer runs: "per unit" (pipe.step(opt): the next
    # call waits for about ``exposed_share`` of it, the first stage's weights) or
    # "whole update: <why>" (the next call waits for all of it).
    exact_step: str = ""
    exposed_share: float = 1.0
    # The disk tier (offload_dir): bytes read and written per parameter per step, the
    # disk's bandwidth (measured once per directory) and the time they take; 0 without.
    disk_bytes_per_param: float = 0.0
    disk_bandwidth: float = 0.0
    disk_seconds: float = 0.0

    @property
    def host_bound(self) -> bool:
        """Whether the host step (its memory passes, or the disk tier's I/O, which
        overlap) outlasts the devices' step, so it is not hidden."""
        return max(self.seconds, self.disk_seconds) > self.device_seconds

    def __str__(self) -> str:
        # two lines, so the plan's summary fits 120 columns
        verdict = "the host is the bottleneck" if self.host_bound else "hidden behind them"
        disk = ""
        if self.disk_bytes_per_param:
            disk = (f"\n  disk tier: {self.disk_bytes_per_param:.0f} B/param read and written "
                    f"per step, {_fmt_time(self.disk_seconds)} at "
                    f"{self.disk_bandwidth / 1e9:.2f} GB/s")
        return (f"host step {_fmt_time(max(self.seconds, self.disk_seconds))} per step beside "
                f"{_fmt_time(self.device_seconds)} on the devices: {verdict}\n"
                f"  ({self.optimizer}" + (", assumed" if self.assumed else "")
                + f": {self.bytes_per_param:.0f} B/param x {_fmt_count(self.params)} at "
                f"{self.bandwidth / 1e9:.1f} GB/s"
                + ("; more tokens per step would hide it, see docs/guide.md)"
                   if self.host_bound else ")")
                + (f"\n  exact steps: {self.exact_step}" + (
                    f" with pipe.step(opt), about {self.exposed_share:.0%} of it exposed"
                    if self.exact_step == "per unit" else "")
                   if self.exact_step else "") + disk)


@dataclass(frozen=True)
class StagePlan:
    """The compiled plan: layer units, their costs, the stages, and the programs.

    ``str(plan)`` renders the table; ``plan.to_dict()`` is JSON-ready;
    ``plan.stage_code(i)`` shows the generated code of stage ``i``.

    Fields a training loop may read: ``num_devices``; ``num_microbatch``, the
    microbatches each call with this plan is split into (``pipe.plan`` is the latest
    call's, per-call ``run_config`` included: divide ``forward_backward``'s summed loss
    by it for the mean); ``memory_cap`` (bytes per device, None: unlimited);
    ``est_step_time_s``, the estimated device time of one training step.
    """

    program: ModelProgram
    units: tuple[LayerUnit, ...]
    costs: tuple[UnitCost, ...]
    stages: tuple[StageSpec, ...]
    stage_modules: tuple[torch.nn.Module, ...]
    stash: Mapping[str, tuple[tuple[str, ...], ...]]
    num_devices: int
    num_microbatch: int
    memory_cap: int | None
    est_step_time_s: float
    passes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # Filled by RoundPipe.plan for training plans (runtime facts: optimizer, bandwidth).
    host_step: HostStepEstimate | None = None

    # --- views -------------------------------------------------------------------------
    @property
    def forward_stages(self) -> tuple[StageSpec, ...]:
        return tuple(s for s in self.stages if s.kind == "fwd")

    @property
    def fused_stage(self) -> StageSpec:
        return next(s for s in self.stages if s.kind == "fused")

    @property
    def backward_stages(self) -> tuple[StageSpec, ...]:
        return tuple(s for s in self.stages if s.kind == "bwd")

    @property
    def bottleneck_ratio(self) -> float:
        """Largest stage time over the ideal (total time / number of stages)."""
        times = [s.est_time_s for s in self.stages]
        ideal = sum(times) / len(times) if times else 0.0
        return max(times) / ideal if ideal > 0 else 1.0

    @property
    def device_memory_bytes(self) -> int:
        """Memory a device needs: the largest stage's job, and the largest weights
        prefetched for the next job meanwhile (its activations come only after)."""
        if not self.stages:
            return 0
        return (max(s.memory_bytes for s in self.stages)
                + max(s.param_bytes for s in self.stages))

    def stage_code(self, index: int) -> str:
        """Readable generated code of stage ``index`` and of the unit programs it calls."""
        if not 0 <= index < len(self.stages):
            raise IndexError(f"stage {index} does not exist; the plan has {len(self.stages)}")
        stage = self.stages[index]
        module = self.stage_modules[index]
        lines = [
            f"# stage {stage.index} ({stage.kind}): units {stage.unit_names}",
            f"# generated by roundpipe passes: {' -> '.join(self.passes)}",
            _module_code(module, f"Stage{stage.index}"),
        ]
        for u in range(*stage.units):
            unit = self.program.units[u]
            lines.append(f"# unit {u}: {unit.name}")
            lines.append(_module_code(unit.module, f"Unit{u}"))
        return "\n".join(lines)

    # --- rendering ---------------------------------------------------------------------
    def table_rows(self) -> list[list[Any]]:
        """One row per stage; unit names lose the prefix every unit shares
        (``base_model.model.`` under PEFT), and a stage whose list is too long for its
        column names its units by their shortest distinct ends (``embed_tokens``,
        ``layers.0-3``) before any is left out, so the table fits 120 columns
        (``to_dict()`` keeps the full names)."""
        prefix = _common_prefix([u.name for u in self.units])
        names = [u.name[len(prefix):] for u in self.units]
        short = short_unit_names(names)
        return [
            [
                s.index,
                s.kind,
                fit_unit_names(names[s.units[0]:s.units[1]], short, _UNITS_WIDTH),
                f"{s.param_bytes / MiB:.2f}",
                _fmt_time(s.est_time_s),
                f"{s.act_in_bytes / MiB:.2f} / {s.act_out_bytes / MiB:.2f}",
                s.recompute,
            ]
            for s in self.stages
        ]

    def summary(self) -> str:
        n_f, n_b = len(self.forward_stages), len(self.backward_stages)
        prefix = _common_prefix([u.name for u in self.units])
        return (
            f"{len(self.stages)} stages ({n_f} fwd, 1 fused, {n_b} bwd) over "
            f"{len(self.units)} units on {self.num_devices} device(s), "
            f"{self.num_microbatch} microbatches\nlargest stage {self.bottleneck_ratio:.2f}x "
            f"the ideal balance; device memory needed {self.device_memory_bytes / MiB:.1f} MiB"
            + (f" (cap {self.memory_cap / MiB:.1f} MiB)" if self.memory_cap else "")
            + (f"\n{self.host_step}" if self.host_step is not None else "")
            + (f"\nunit names without their common prefix {prefix!r}" if prefix else "")
        )

    def __str__(self) -> str:
        headers = ["stage", "kind", "units", "params (MiB)", "est. time",
                   "act in/out (MiB)", "recompute"]
        return tabulate(self.table_rows(), headers=headers, disable_numparse=True) + "\n" + self.summary()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description of the plan (no programs)."""
        return json.loads(json.dumps({
            "num_devices": self.num_devices,
            "num_microbatch": self.num_microbatch,
            "memory_cap": self.memory_cap,
            "est_step_time_s": self.est_step_time_s,
            "bottleneck_ratio": self.bottleneck_ratio,
            "device_memory_bytes": self.device_memory_bytes,
            "trace_method": self.program.trace_method,
            "passes": list(self.passes),
            "notes": list(self.notes),
            "host_step": (dataclasses.asdict(self.host_step)
                          if self.host_step is not None else None),
            "units": [dataclasses.asdict(u) for u in self.units],
            "costs": [dataclasses.asdict(c) for c in self.costs],
            "stages": [dataclasses.asdict(s) for s in self.stages],
        }))


def _module_code(module: torch.nn.Module, title: str) -> str:
    code = getattr(module, "code", None)
    if code is None:
        return f"# {title}: {type(module).__name__} (not a GraphModule)"
    body = "\n".join("    " + line for line in code.strip("\n").splitlines() if line.strip())
    return f"class {title}(torch.nn.Module):\n{body}"


def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit} parameters"
    return f"{n} parameters"


def _fmt_time(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


_UNITS_WIDTH = 41  # the units column; the whole table then fits 120 columns (79 + 41)


def _common_prefix(names: list[str]) -> str:
    """The dotted prefix every name shares (``"base_model.model."``), if any; a name is
    never emptied by it."""
    if len(names) < 2:
        return ""
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    if any(len(p) <= len(common) for p in parts):
        common = common[:min(len(p) for p in parts) - 1]
    return ".".join(common) + "." if common else ""


def short_unit_names(names: list[str]) -> dict[str, str]:
    """Each name by the shortest dotted end that tells it apart, not only a number:
    ``model.embed_tokens -> embed_tokens``; a numbered unit by its list's shortest
    distinct end (``model.layers.7 -> layers.7``, but ``encoder.block.0`` beside
    ``decoder.block.0`` keeps ``encoder``)."""
    def split(name: str) -> tuple[str, str | None]:  # (a list's path, index) or (name, None)
        m = _INDEXED.match(name)
        return (m.group(1)[:-1], m.group(2)) if m and m.group(1) else (name, None)

    def ends(path: str) -> list[str]:
        parts = path.split(".")
        return [".".join(parts[-k:]) for k in range(1, len(parts) + 1)
                if not all(p.isdigit() for p in parts[-k:])]

    bases = {split(n)[0] for n in names}
    counts = collections.Counter(e for b in bases for e in ends(b))
    short = {}
    for name in names:
        base, index = split(name)
        end = next((e for e in ends(base) if counts[e] == 1), base)
        short[name] = end if index is None else f"{end}.{index}"
    return short


def fit_unit_names(names: list[str], short: dict[str, str], width: int) -> str:
    """A stage's units in ``width`` characters: all full names; else single modules by
    their short names (``embed_tokens``) beside whole layer ranges (``model.layers.0-3``);
    else every name short; only then some left out."""
    text = compact_unit_names(names)
    if len(text) <= width:
        return text
    mixed = compact_unit_names([n if _INDEXED.match(n) else short.get(n, n) for n in names])
    if len(mixed) <= width:
        return mixed
    return _fit(compact_unit_names([short.get(n, n) for n in names]), width)


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters: its first and last items and how many were
    left out."""
    if len(text) <= width:
        return text
    items = text.split(", ")
    head, tail = items[0], items[-1]
    middle = f", ... ({len(items) - 2} more), " if len(items) > 2 else ", "
    short = head + middle + tail
    return short if len(short) <= width else short[:width - 3] + "..."


# A numbered path component ("h.7", "7"), not a name that ends in a digit ("conv1").
_INDEXED = re.compile(r"^((?:.*\.)?)(\d+)$")


def compact_unit_names(names: list[str]) -> str:
    """Render unit names compactly: ``["wte", "h.0", "h.1", "h.2"] -> "wte, h.0-2"``."""
    out: list[str] = []
    run_prefix: str | None = None
    run_start = run_end = -1
    for name in names + [""]:
        m = _INDEXED.match(name)
        if m and m.group(1) == run_prefix and int(m.group(2)) == run_end + 1:
            run_end += 1
            continue
        if run_prefix is not None:
            out.append(f"{run_prefix}{run_start}" if run_start == run_end
                       else f"{run_prefix}{run_start}-{run_end}")
            run_prefix = None
        if m:
            run_prefix, run_start, run_end = m.group(1), int(m.group(2)), int(m.group(2))
        elif name:
            out.append(name)
    return ", ".join(out)
