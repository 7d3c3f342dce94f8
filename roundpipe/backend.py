"""``torch.compile(model, backend="roundpipe")``: dispatch pipeline parallelism for users
who keep their own training loop (``loss.backward()``, their own optimizer).

Dynamo hands the backend one graph per compiled region, with the parameters as inputs.
Each graph goes through the same passes as :func:`roundpipe.compile` from ``layers`` on
(:mod:`roundpipe.passes.dynamo` turns it into the trace pass's output), and comes back as
a callable whose calls are autograd functions:

* forward: the forward stages run round-robin on the devices, each streaming its weights
  there; the inputs of every stage are stashed in host memory;
* backward (``loss.backward()``): every stage streams its weights again, recomputes from
  its stash and runs backward; the parameter gradients, folded in descending unit order,
  are returned for the parameter inputs, so autograd adds them to ``param.grad`` on the
  CPU, as eagerly.

Options go through ``torch.compile(..., options={...})`` (see :data:`OPTIONS`)::

    cmodel = torch.compile(model, backend="roundpipe",
                           options={"devices": ["cuda:0", "cuda:1"], "num_microbatch": 3})
    loss = loss_fn(cmodel(x), y); loss.backward(); opt.step(); opt.zero_grad()
    print(roundpipe.backend.plans()[-1])          # the stage plan of the last graph

Graph breaks give several graphs.  Every graph made with the same options shares one
:class:`RoundPipeBackend`: one device pool and one placement table, which keeps each layer
on the device it was first placed on, whichever graph (or recompiled graph) runs it.

A call is split into microbatches only where :mod:`roundpipe.passes.batching` proves it
exact; otherwise it runs as one microbatch (still streamed, stage by stage).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .compiler import PlanOptions, plan_from_traced
from .config import RoundPipeRunConfig
from .errors import (ConfigError, InputError, ModelError, RoundPipeError,
                     UnknownConfigFieldError, unknown_options_message)
from .passes.batching import BatchSplit, analyze_batching, written_buffers
from .passes.cost import DeviceModel
from .passes.dynamo import DynamoGraph, Unsupported, from_dynamo
from .plan import ModelProgram, StagePlan
from .runtime.call import (GradTarget, PipelinedCall, SavedVersions, autocast_state,
                           memory_budget, microbatch_keys, pipelined, refuse_modified_since,
                           saved_versions)
from .runtime.devices import Device, parse_bytes, resolve_devices
from .runtime.executor import Executor, RunResult, RunStats
from .runtime.host_state import WeightFences, fold_unit_grads
from .runtime.microbatch import MergeColumn, join_input_grad, merge_column
from .ops.rng import RngKey

log = logging.getLogger(__name__)

NAME = "roundpipe"

def _option(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class BackendOptions:
    """Validated options of the backend (hashable: graphs with equal options share one
    :class:`RoundPipeBackend`).  ``torch.compile(..., options={...})`` takes the same
    names; each field's ``help`` says what it does."""

    num_microbatch: int | None = _option(
        None, "microbatches per call where splitting is provably exact (default: "
              "devices + 1)")
    devices: tuple[str, ...] | None = _option(
        None, "device list such as ['cuda:0', 'cuda:1'] or ['cpu'] * 3 (virtual CPU "
              "devices); default: every visible CUDA device, else one CPU device")
    recompute_grain: str = _option("stage", "'stage' (default) or 'layer'")
    memory_fraction: float = _option(
        0.9, "share of the smallest device's free memory the plan may use (default 0.9)")
    memory_cap: int | None = _option(
        None, "bytes the plan may use on a device, a job and the next job's prefetched "
              "weights together (int or '512MiB'); overrides memory_fraction")
    device_memory: int | None = _option(
        None, "capacity of each virtual CPU device (int or '64MiB')")
    num_stages: int | None = _option(
        None, "exact number of stages per graph (default: devices + 1)")
    seed: int | None = _option(
        None, "base seed of the keyed dropout streams (default: torch.initial_seed())")
    preserve_rng_state: bool = _option(
        True, "recompute reproduces random ops exactly (default True)")

    @staticmethod
    def parse(options: Mapping[str, Any] | None) -> BackendOptions:
        """Validate ``torch.compile``'s ``options`` dict.

        Raises:
            UnknownConfigFieldError: an option that does not exist.
            ConfigError: a value that is not valid.
        """
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise UnknownConfigFieldError(
                unknown_options_message(f"backend {NAME!r}", unknown, OPTIONS)
                + f" (torch.compile(model, backend={NAME!r}, options={{'num_microbatch': "
                  "4, ...}))")
        # RoundPipeRunConfig validates the options it shares with the backend.
        run = RoundPipeRunConfig(
            num_microbatch=options.get("num_microbatch"),
            recompute_grain=options.get("recompute_grain"),
            memory_fraction=options.get("memory_fraction"),
            preserve_rng_state=options.get("preserve_rng_state"))
        devices = options.get("devices")
        if devices is not None:
            if isinstance(devices, (str, torch.device)):
                devices = [devices]
            if not isinstance(devices, (list, tuple)) or not devices:
                raise ConfigError(f"option devices must be a non-empty list such as "
                                  f"['cpu'] * 2 or ['cuda:0', 'cuda:1'], got {devices!r}")
            devices = tuple(str(d) for d in devices)
        num_stages = options.get("num_stages")
        if num_stages is not None and (isinstance(num_stages, bool)
                                       or not isinstance(num_stages, int) or num_stages < 1):
            raise ConfigError(f"option num_stages must be a positive int, got {num_stages!r}")
        seed = options.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"option seed must be an int, got {seed!r}")
        return BackendOptions(
            num_microbatch=run.num_microbatch,
            devices=devices,
            recompute_grain=run.recompute_grain or "stage",
            memory_fraction=(0.9 if run.memory_fraction is None
                             else float(run.memory_fraction)),
            memory_cap=parse_bytes(options.get("memory_cap")),
            device_memory=parse_bytes(options.get("device_memory")),
            num_stages=num_stages,
            seed=seed,
            preserve_rng_state=(True if run.preserve_rng_state is None
                                else run.preserve_rng_state),
        )


# --- the backend ---------------------------------------------------------------------------

#: The options ``torch.compile(..., backend="roundpipe", options={...})`` accepts, with
#: what each does (read off :class:`BackendOptions`).
OPTIONS: Mapping[str, str] = {f.name: f.metadata["help"]
                              for f in dataclasses.fields(BackendOptions)}


class RoundPipeBackend:
    """A ``torch.compile`` backend with its own device pool and placement table.

    ``torch.compile(model, backend=RoundPipeBackend(devices=["cpu"] * 2))`` works as well
    as the registered name; the instance then also gives :attr:`plans` and
    :meth:`placement` of what it compiled.
    """

    def __init__(self, options: BackendOptions | None = None, **kwargs: Any) -> None:
        if options is not None and kwargs:
            raise ConfigError("pass either a BackendOptions or keyword options, not both")
        self.options = options if options is not None else BackendOptions.parse(kwargs)
        self._devices: list[Device] | None = None
        self._lock = threading.RLock()
        self._placement = _Placement()
        self._plans: list[StagePlan] = []
        self._calls = 0
        self._stats: RunStats | None = None
        self.seed = torch.initial_seed() if self.options.seed is None else self.options.seed
        self.__name__ = NAME  # torch.compile names the backend after this

    # --- resources -----------------------------------------------------------------------
    @property
    def devices(self) -> list[Device]:
        with self._lock:
            if self._devices is None:
                self._devices = resolve_devices(
                    list(self.options.devices) if self.options.devices else None,
                    self.options.device_memory)
            return self._devices

    @property
    def plans(self) -> tuple[StagePlan, ...]:
        """The plan of every graph this backend compiled, in compile order."""
        return tuple(self._plans)

    def placement(self) -> dict[str, int]:
        """Layer unit (module path as Dynamo names it) -> device index of its forward.

        A frame compiled once and run with several weight sets (a block whose forward has
        a graph break) lists each weight set: ``ln1``, ``ln1#2``, ...
        """
        return self._placement.table()

    def stats(self) -> RunStats:
        """Transfers, residency and the job timeline of the last forward or backward run
        by any graph of this backend."""
        if self._stats is None:
            raise RoundPipeError("no graph of this backend has run yet, so there are no stats")
        return self._stats

    def _memory_cap(self) -> tuple[int | None, str]:
        """The device cap and where it came from (see ``RoundPipe(memory_cap=)``)."""
        if self.options.memory_cap is not None:
            return self.options.memory_cap, ""
        return memory_budget(self.devices, self.options.memory_fraction)

    def _next_call(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    # --- compilation ---------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 **options: Any) -> Callable[..., Any]:
        if options:  # torch.compile(backend=RoundPipeBackend(), options=...)
            return _raise_on_call(ConfigError(
                f"torch.compile passed {', '.join(sorted(options))} to a RoundPipeBackend "
                "instance; give its options to the instance itself: "
                "RoundPipeBackend(devices=[...], num_microbatch=...)"))
        params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
        if not params:
            log.info("roundpipe: a graph of %d nodes reads no parameters; it runs eagerly",
                     len(gm.graph.nodes))
            return gm.forward
        off_cpu = [x for x in example_inputs if isinstance(x, torch.Tensor)
                   and x.device.type != "cpu"]
        if off_cpu:
            return _raise_on_call(ModelError(
                f"{len(off_cpu)} input(s) of the compiled graph are on {off_cpu[0].device} "
                "(parameters or inputs); roundpipe keeps the model and its inputs in host "
                "memory and streams them to the devices itself: keep the model on the CPU "
                "(no .to(device) / .cuda()) and pass CPU tensors"))
        try:
            dg = from_dynamo(gm, list(example_inputs))
        except Unsupported as e:
            log.warning("roundpipe: running a graph of %d nodes eagerly: %s",
                        len(gm.graph.nodes), e)
            return gm.forward
        except RoundPipeError as e:  # refused (a sparse gradient): at the call, as is
            return _raise_on_call(e)
        try:
            graph = _PipelinedGraph(self, dg)
        except RoundPipeError as e:  # e.g. a stage that cannot fit the memory cap
            return _raise_on_call(e)
        with self._lock:
            self._plans.append(graph.plan)
            _ALL_PLANS.append(graph.plan)
        return graph

    def __repr__(self) -> str:
        changed = {f.name: getattr(self.options, f.name)
                   for f in dataclasses.fields(self.options)
                   if getattr(self.options, f.name) != f.default}
        return f"RoundPipeBackend({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


class _GraphHost:
    """The executor's :class:`~roundpipe.runtime.host_state.HostView` over the tensors
    of the current call: a Dynamo graph receives its parameters and buffers as inputs.
    The fences' target stays 0, so uploads never wait (the user's optimizer runs between
    calls)."""

    def __init__(self, program: ModelProgram) -> None:
        self.specs = program.state_by_name()
        self.fences = WeightFences()
        self._constants = dict(program.constants)
        self.tensors: dict[str, torch.Tensor] = dict(self._constants)

    def bind(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = {**self._constants, **tensors}

    def trainable(self, slot: str) -> bool:
        return self.specs[slot].kind == "parameter" and self.tensors[slot].requires_grad

    def param_names(self, slots: Sequence[str]) -> list[str]:
        return [self.specs[s].fqn for s in slots if self.specs[s].kind == "parameter"]

    def grad_dtype(self, slot: str) -> torch.dtype:
        return self.tensors[slot].dtype  # returned to autograd, which wants the input's

    def master_of(self, slot: str) -> torch.Tensor | None:
        return None  # the parameters are what autograd accumulates into

    def has_no_grad(self, slot: str) -> bool:
        return self.tensors[slot].grad is None

    def lands_in_place(self, slot: str) -> bool:
        return False  # gradients go back to autograd

    def wants_grad_norms(self) -> bool:
        return False


class _Placement:
    """Which device runs each layer's forward, shared by every graph of one backend.

    A layer is known by the first state tensor its unit reads (the same ``Parameter``
    object whichever graph, recompiled graph or reused frame passes it), so graphs split
    by graph breaks agree; a graph starts on the device of its first unit, or where the
    round robin left off.
    """

    def __init__(self) -> None:
        self._device = WeakIdKeyDictionary()   # anchor tensor -> device index
        self._table: dict[str, int] = {}
        self._next = 0
        self._lock = threading.Lock()

    def table(self) -> dict[str, int]:
        with self._lock:
            return dict(self._table)

    def start(self, anchor: torch.Tensor | None, num_devices: int) -> int:
        with self._lock:
            if anchor is not None and anchor in self._device:
                return self._device[anchor] % num_devices
            return self._next % num_devices

    def record(self, units: Sequence[tuple[str, torch.Tensor | None, int]], last: int,
               num_devices: int) -> None:
        """``units``: (unit name, anchor, device) of the forward; ``last``: the device
        of the last forward job (the next new graph starts after it)."""
        with self._lock:
            for name, anchor, device in units:
                if anchor is None or anchor in self._device:
                    continue
                key, k = name, 1
                while key in self._table:
                    k += 1
                    key = f"{name}#{k}"
                self._device[anchor] = device
                self._table[key] = device
            self._next = (last + 1) % num_devices


# --- one compiled graph ----------------------------------------------------------------------

class _PipelinedGraph:
    """The callable returned to Dynamo for one graph."""

    def __init__(self, backend: RoundPipeBackend, dg: DynamoGraph) -> None:
        self.backend = backend
        self.placeholders = dg.placeholders
        self.differentiable = dg.differentiable
        opts = backend.options
        devices = backend.devices
        traced = dg.traced
        wanted = opts.num_microbatch if opts.num_microbatch is not None else len(devices) + 1
        # the proof lowers the graph (make_fx): only worth it where a split is asked for
        split = analyze_batching(dg) if wanted > 1 else "num_microbatch=1"
        if isinstance(split, BatchSplit) and wanted > 1:
            self.split: BatchSplit | None = split
            self.num_microbatch = min(wanted, split.batch)
            note = (f"microbatches: {self.num_microbatch} (split inputs: "
                    f"{', '.join(split.inputs)})")
        else:
            self.split = None
            self.num_microbatch = 1
            written = written_buffers(traced)
            if written and wanted > 1:
                # Eager writes them once per call, from the whole batch; every microbatch
                # would write them again (a counter counts twice, spectral norm iterates
                # twice): the call runs as one microbatch, which is eager (the warning
                # below names them).
                split = (f"the forward writes {written}, which eager writes once per call "
                         "from the whole batch")
            note = ("microbatches: 1 (" + (split if isinstance(split, str) else
                                           "num_microbatch=1") + ")")
        if self.num_microbatch < wanted:
            # Asked for more: say so once, at compile time, not only in plan.notes.
            log.warning("roundpipe: calls of this graph run as %d microbatch%s, not the %d "
                        "asked for (num_microbatch): %s", self.num_microbatch,
                        "" if self.num_microbatch == 1 else "es", wanted,
                        split if isinstance(split, str) else
                        f"the batch has {split.batch} samples")
        else:
            log.info("roundpipe: %s", note)
        cap, origin = backend._memory_cap()
        # The passes from layers on, as roundpipe.compile runs them.
        self.plan, _, _ = plan_from_traced(
            traced, dg.module_tree,
            PlanOptions(num_devices=len(devices), num_microbatch=self.num_microbatch,
                        device_model=DeviceModel.for_device(devices[0].torch_device),
                        memory_cap=cap, memory_cap_origin=origin, num_stages=opts.num_stages,
                        recompute_grain=opts.recompute_grain),
            cost_scale=1.0 / self.num_microbatch, notes=(note,))
        self.program = self.plan.program
        self.host = _GraphHost(self.program)
        self._executors: dict[int, Executor] = {}
        self.last_stats: RunStats | None = None
        # Placeholder i -> state slot or user value; the first placeholder of a slot
        # receives its gradient (a tensor passed twice is one slot).
        self.slot_at: list[str | None] = []
        self.value_at: list[str | None] = []
        specs = self.program.state_by_name()
        seen: set[str] = set()
        self.grad_slot_at: list[str | None] = []
        for p in self.placeholders:
            is_slot = p.name in specs
            self.slot_at.append(p.name if is_slot else None)
            self.value_at.append(None if is_slot else p.name)
            first = is_slot and p.name not in seen and specs[p.name].kind == "parameter"
            self.grad_slot_at.append(p.name if first else None)
            seen.add(p.name)
        self.used_inputs = {n for n in self.program.inputs.names if n is not None}
        # Outputs eager computes outside autograd (a buffer's new value written under
        # no_grad, which Dynamo then assigns back to the module: spectral norm's u and v).
        out_node = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
        self.no_grad_outputs = frozenset(
            j for j, v in enumerate(out_node.args[0]) if isinstance(v, torch.fx.Node)
            and isinstance(v.meta.get("example_value"), torch.Tensor)
            and not v.meta["example_value"].requires_grad)
        # The first state slot of each unit stands for the unit in the placement table.
        self.unit_anchor = [next(iter(u.state), None) for u in self.program.units]

    def executor(self, rotation: int) -> Executor:
        """An executor whose job 0 runs on device ``rotation`` (round robin from there)."""
        ex = self._executors.get(rotation)
        if ex is None:
            devices = self.backend.devices
            ex = Executor(self.plan, self.host, devices[rotation:] + devices[:rotation])
            self._executors[rotation] = ex
        return ex

    def __call__(self, *args: Any) -> list[Any]:
        if len(args) != len(self.placeholders):
            raise InputError(f"the compiled graph takes {len(self.placeholders)} inputs, "
                             f"got {len(args)}")
        call = _Call(self, args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        record = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if not record:
            return call.forward(record=False)
        outs = pipelined(call, tensors)
        # As in eager, they carry no graph: a later call reading them must not run this
        # call's backward again.
        return [o.detach() if j in self.no_grad_outputs and isinstance(o, torch.Tensor)
                else o for j, o in enumerate(call.assemble(outs))]


class _Call(PipelinedCall):
    """One call of a compiled graph: its inputs, microbatches, and what backward needs."""

    def __init__(self, graph: _PipelinedGraph, args: tuple[Any, ...]) -> None:
        self.graph = graph
        self.args = args
        self.state = {slot: a for slot, a in zip(graph.slot_at, args) if slot is not None}
        self.values = {v: a for v, a in zip(graph.value_at, args) if v is not None}
        self.sizes = self._microbatch_sizes()
        self.stash: list[dict[str, Any]] | None = None
        self.rules: list[Any] = []
        self.pieces: dict[int, list[Any]] = {}  # output column -> its microbatch values
        self.outputs: list[Any] = []
        self.tensor_columns: list[int] = []
        self.versions: SavedVersions = ()

    def _microbatch_sizes(self) -> list[int]:
        split = self.graph.split
        if split is None:
            return [0]  # one microbatch (its size is never needed)
        firsts = {self.values[n].shape[0] for n in split.inputs
                  if isinstance(self.values.get(n), torch.Tensor) and self.values[n].dim()}
        if len(firsts) != 1 or len(split.inputs) != sum(
                isinstance(self.values.get(n), torch.Tensor) for n in split.inputs):
            return [0]  # the split inputs disagree on the batch size in this call
        batch = int(firsts.pop())
        num = min(self.graph.num_microbatch, batch)
        base, extra = divmod(batch, num)
        return [base + (1 if i < extra else 0) for i in range(num)]

    def _inputs(self, needs_grad: Mapping[str, bool]) -> list[dict[str, Any]]:
        """Per-microbatch values of the used inputs; those needing a gradient become
        leaves that require grad (split pieces are made under no_grad)."""
        def prepare(name: str, v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                v = v.detach()
                if needs_grad.get(name):
                    v.requires_grad_(True)
            return v

        used = self.graph.used_inputs
        split = self.graph.split
        if len(self.sizes) == 1:
            return [{n: prepare(n, v) for n, v in self.values.items() if n in used}]
        mbs: list[dict[str, Any]] = [{} for _ in self.sizes]
        for name, value in self.values.items():
            if name not in used:
                continue
            if name in split.inputs:  # type: ignore[union-attr]
                pieces = torch.split(value.detach(), self.sizes)
                for mb, piece in zip(mbs, pieces):
                    mb[name] = prepare(name, piece)
            else:
                for mb in mbs:
                    mb[name] = prepare(name, value)
        for name, base, dim in split.sizes:  # type: ignore[union-attr]
            if name in used:  # SymInt sizes of split inputs: the microbatch's own
                for mb, rows in zip(mbs, self.sizes):
                    mb[name] = rows if dim == 0 else int(self.values[base].shape[dim])
        return mbs

    def keys(self) -> list[RngKey | None]:
        backend = self.graph.backend
        enabled = backend.options.preserve_rng_state
        return microbatch_keys(backend.seed, backend._next_call() if enabled else 0,
                               len(self.sizes), enabled=enabled)

    # --- forward -----------------------------------------------------------------------
    def forward(self, record: bool, needs_grad: Mapping[str, bool] | None = None) -> list[Any]:
        graph, backend = self.graph, self.graph.backend
        inputs = self._inputs(needs_grad or {})
        self.key_list = self.keys()
        self.autocast = autocast_state(backend.devices)
        anchor_slot = graph.unit_anchor[0] if graph.unit_anchor else None
        with backend._lock:
            num_devices = len(backend.devices)
            self.rotation = backend._placement.start(
                self.state.get(anchor_slot) if anchor_slot else None, num_devices)
            graph.host.bind(self.state)
            result = graph.executor(self.rotation).forward(
                inputs, record=record, grain=backend.options.recompute_grain,
                keys=self.key_list, fence_version=0, autocast=self.autocast)
            self._commit_buffers(result)
            self._record_placement(num_devices)
            graph.last_stats = backend._stats = result.stats
        if record:
            self.stash = result.stash
        return self._merge(result)

    def _commit_buffers(self, result: RunResult) -> None:
        with torch.no_grad():
            for slot, value in result.buffers.items():
                self.state[slot].copy_(value)

    def _record_placement(self, num_devices: int) -> None:
        graph = self.graph
        forward = [s for s in graph.plan.stages if s.kind == "fwd"] + [graph.plan.fused_stage]
        units: list[tuple[str, torch.Tensor | None, int]] = []
        for job, stage in enumerate(forward):
            device = (self.rotation + job) % num_devices
            for u in range(*stage.units):
                slot = graph.unit_anchor[u]
                units.append((graph.program.units[u].name,
                              self.state.get(slot) if slot else None, device))
        graph.backend._placement.record(units, (self.rotation + len(forward) - 1) % num_devices,
                                        num_devices)

    def _merge(self, result: RunResult) -> list[Any]:
        """Microbatch outputs -> the graph's flat outputs."""
        per_mb = result.outputs or []
        n_out = len(self.graph.program.outputs)
        rules = (list(self.graph.split.outputs) if self.graph.split is not None
                 and len(per_mb) > 1 else ["first"] * n_out)
        merged: list[Any] = []
        seen: set[int] = set()
        inputs = {id(v) for v in self.values.values() if isinstance(v, torch.Tensor)}
        stashed = {id(v) for mb in (result.stash or []) for v in mb.values()}
        for j, rule in enumerate(rules):
            column = [o[j] for o in per_mb]
            if not isinstance(column[0], (torch.Tensor, int)):
                rule = rules[j] = "first"
            value = merge_column(column, rule, self.sizes)
            self.pieces[j] = column
            # Autograd needs distinct outputs that are not (views of) the inputs, and the
            # stash the recompute reads must not change if the user writes to an output.
            if isinstance(value, torch.Tensor):
                if id(value) in seen or id(value) in inputs or id(value) in stashed \
                        or value._base is not None:
                    value = value.clone()
                seen.add(id(value))
            merged.append(value)
        self.rules = rules
        return merged

    # --- autograd (runtime.call.PipelinedFunction drives these) -------------------------
    def run_forward(self, needs_input_grad: Sequence[bool]
                    ) -> tuple[list[torch.Tensor], list[MergeColumn], list[int]]:
        """Forward with a stash; ``needs_input_grad`` per tensor argument."""
        needs: dict[str, bool] = {}
        tensors = [(name, a) for name, a in zip(self.graph.value_at, self.args)
                   if isinstance(a, torch.Tensor)]
        for (name, a), need in zip(tensors, needs_input_grad):
            if name is not None:
                needs[name] = bool(need) and (a.is_floating_point() or a.is_complex())
        self.outputs = self.forward(record=True, needs_grad=needs)
        self._save_versions()
        # An output eager computes without a graph (under no_grad, say) stays out of
        # autograd: Dynamo may store it back into the module (spectral_norm's ``self._u =
        # normalize(..., out=self._u)``), and with a grad_fn the next call's graph would
        # read that buffer as an input needing a gradient and send one into this
        # call's backward, which had already run ("ran twice").
        diff = self.graph.differentiable
        self.tensor_columns = [j for j, o in enumerate(self.outputs)
                               if isinstance(o, torch.Tensor) and (j >= len(diff) or diff[j])]
        refs = self.graph.program.outputs
        columns = [MergeColumn(refs[j].value, self.rules[j], self.pieces[j])
                   for j in self.tensor_columns]
        return [self.outputs[j] for j in self.tensor_columns], columns, self.sizes

    def assemble(self, tensor_outs: Sequence[torch.Tensor]) -> list[Any]:
        out = list(self.outputs)
        for j, t in zip(self.tensor_columns, tensor_outs):
            out[j] = t
        return out

    def _save_versions(self) -> None:
        """Versions of the trainable parameters and inputs the recompute will read."""
        specs = self.graph.program.state_by_name()
        self.versions = saved_versions(
            [(specs[slot].fqn, t) for slot, t in self.state.items()
             if specs[slot].kind == "parameter" and t.requires_grad]
            + [(f"input {name}", t) for name, t in self.values.items()
               if isinstance(t, torch.Tensor) and name in self.graph.used_inputs])

    def run_backward(self, output_grads: list[dict[str, torch.Tensor]],
                     targets: Sequence[GradTarget], *, plain: bool) -> RunResult:
        graph, backend = self.graph, self.graph.backend
        # Only what this backward asks for is computed (autograd.grad(out, x) computes no
        # parameter gradient); autograd would drop the rest anyway.
        only: set[str] | None = None
        if not plain:
            only = set()
            tensors = [i for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
            for k, i in enumerate(tensors):
                if targets[k] is not GradTarget.NONE:
                    only.add(graph.slot_at[i] or graph.value_at[i] or "")
        if self.stash is None:  # (PipelinedFunction refuses a second backward before this)
            raise RoundPipeError("internal: a pipelined call's backward ran twice")
        refuse_modified_since(self.versions)
        with backend._lock:
            graph.host.bind(self.state)
            result = graph.executor(self.rotation).backward(
                self.stash, output_grads, grain=backend.options.recompute_grain,
                keys=self.key_list, fence_version=0, autocast=self.autocast,
                only=None if only is None else frozenset(only))
            graph.last_stats = backend._stats = result.stats
        self.stash = None
        return result

    def input_grads(self, result: RunResult, targets: Sequence[GradTarget]
                    ) -> list[torch.Tensor | None]:
        """Parameter gradients (folded per unit) go back to Dynamo's parameter inputs,
        so autograd accumulates them in ``param.grad``; value gradients to the values."""
        graph = self.graph
        param_grads = {slot: fold_unit_grads(c) for slot, c in result.param_grads.items()}
        value_grads = self._value_grads(result)
        out: list[torch.Tensor | None] = []
        tensors = [i for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        for k, i in enumerate(tensors):
            if targets[k] is GradTarget.NONE:
                out.append(None)
            elif graph.grad_slot_at[i] is not None:
                out.append(param_grads.get(graph.grad_slot_at[i]))
            elif graph.value_at[i] is not None:
                out.append(value_grads.get(graph.value_at[i]))
            else:
                out.append(None)
        return out

    def _value_grads(self, result: RunResult) -> dict[str, torch.Tensor]:
        per_mb = result.input_grads or []
        split = set(self.graph.split.inputs) if self.graph.split is not None else set()
        out: dict[str, torch.Tensor] = {}
        for name, value in self.values.items():
            if not isinstance(value, torch.Tensor):
                continue
            pieces = ([p.detach() for p in torch.split(value, self.sizes)]
                      if name in split and len(per_mb) > 1 else None)
            grad = join_input_grad([g.get(name) for g in per_mb], pieces)
            if grad is not None:
                out[name] = grad
        return out


def _raise_on_call(error: RoundPipeError) -> Callable[..., Any]:
    """A compiled function that raises ``error``: Dynamo would wrap an error raised while
    compiling in ``BackendCompilerFailed``; raised at the call, the user gets it as is."""
    def compiled(*args: Any) -> Any:
        raise error
    return compiled


# --- the registered entry point --------------------------------------------------------------

_INSTANCES: dict[BackendOptions, RoundPipeBackend] = {}
_ALL_PLANS: list[StagePlan] = []
_REGISTRY_LOCK = threading.Lock()


def roundpipe_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                      options: Mapping[str, Any] | None = None, mode: str | None = None,
                      **unexpected: Any) -> Callable[..., Any]:
    """The ``"roundpipe"`` backend (entry point ``torch_dynamo_backends``).

    Graphs compiled with equal options share one :class:`RoundPipeBackend`.
    """
    try:
        if mode not in (None, "default"):
            raise ConfigError(f"backend {NAME!r} has no mode {mode!r}; use options={{...}} "
                              f"(valid options: {', '.join(OPTIONS)})")
        if unexpected:
            raise UnknownConfigFieldError(
                f"backend {NAME!r} got unexpected argument(s) {', '.join(sorted(unexpected))}"
                f"; pass options={{...}} with: {', '.join(OPTIONS)}")
        opts = BackendOptions.parse(options)
    except ConfigError as e:
        return _raise_on_call(e)
    with _REGISTRY_LOCK:
        backend = _INSTANCES.get(opts)
        if backend is None:
            backend = _INSTANCES[opts] = RoundPipeBackend(opts)
    return backend(gm, example_inputs)


def plans() -> tuple[StagePlan, ...]:
    """The :class:`~roundpipe.plan.StagePlan` of every graph compiled by the ``"roundpipe"``
    backend (and by :class:`RoundPipeBackend` instances), in compile order."""
    with _REGISTRY_LOCK:
        return tuple(_ALL_PLANS)


def backend_for(options: Mapping[str, Any] | None = None) -> RoundPipeBackend:
    """The shared :class:`RoundPipeBackend` behind ``torch.compile(..., options=options)``
    (for its :meth:`~RoundPipeBackend.placement` and :attr:`~RoundPipeBackend.plans`)."""
    opts = BackendOptions.parse(options)
    with _REGISTRY_LOCK:
        backend = _INSTANCES.get(opts)
        if backend is None:
            backend = _INSTANCES[opts] = RoundPipeBackend(opts)
        return backend


def reset() -> None:
    """Forget the recorded plans and the shared backends (``torch._dynamo.reset()`` calls
    this).  Graphs compiled before keep working with their own backend."""
    with _REGISTRY_LOCK:
        _INSTANCES.clear()
        _ALL_PLANS.clear()


roundpipe_backend.reset = reset  # type: ignore[attr-defined]


def register() -> None:
    """Register ``"roundpipe"`` with Dynamo (``import roundpipe`` does this).

    When Dynamo has already found the entry point and is loading it (which imports this
    module), it registers the function itself; registering here too would be a duplicate.
    """
    from torch._dynamo.backends import registry

    compiler_fns = getattr(registry, "_COMPILER_FNS", {})
    known = getattr(registry, "_BACKENDS", {})
    if NAME in compiler_fns or known.get(NAME) is not None:
        return
    registry.register_backend(roundpipe_backend, name=NAME)
