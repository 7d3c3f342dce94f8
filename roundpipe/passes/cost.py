"""Pass 3, cost: estimate what each layer unit costs, without running it for real.

The traced graph is interpreted on fake tensors (``FakeTensorMode``: shapes and dtypes,
no data, no compute) under ``FlopCounterMode``.  Per node we record

* FLOPs (matmul-like ops; the counter reports 0 for embedding, norms, softmax);
* bytes read and written, which stand for the memory-bound ops the counter ignores;
* the bytes of the value it produces.

A node's time is ``max(flops / peak, bytes / bandwidth) + launch overhead`` on a
:class:`DeviceModel`; views cost nothing.  Backward is estimated at twice the forward.
Liveness across every cut between units is computed on a ``networkx`` graph of values.
Measured times replace estimates through :func:`with_measured_times`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import networkx as nx
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
import torch.utils._pytree as pytree

from ..plan import ModelProgram, UnitCost
from .layers import LayerAssignment
from .memory import MemoryModel, build_memory_model
from .trace import TracedGraph, fake_tensor_errors_to_debug

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceModel:
    """Throughput figures used to turn FLOPs and bytes into seconds.

    Attributes:
        name: label shown in reports.
        flops_per_s: sustained matmul rate.
        bytes_per_s: device memory bandwidth.
        link_bytes_per_s: host-to-device bandwidth (weight and activation uploads).
        launch_s: fixed cost per op (kernel launch, Python dispatch).
        block_bytes: allocation granularity (the CUDA caching allocator rounds every
            tensor up to 512 bytes); memory estimates round each tensor up to it.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    link_bytes_per_s: float
    launch_s: float
    block_bytes: int = 1

    @staticmethod
    def for_device(device: torch.device | str) -> DeviceModel:
        """A rough model of ``device``; only ratios matter for balancing."""
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - GPU
            props = torch.cuda.get_device_properties(device)
            if "H100" in props.name or "H200" in props.name:
                return DeviceModel(props.name, 6.0e14, 3.0e12, 4.0e10, 6e-6, 512)
            return DeviceModel(props.name, 1.0e14, 1.0e12, 2.0e10, 8e-6, 512)
        return DeviceModel("cpu", 5.0e10, 1.0e10, 1.0e10, 4e-6)


@dataclass(frozen=True)
class ValueInfo:
    """One value crossing unit boundaries: where it is made, where it is read, its size."""

    name: str
    def_unit: int          # -1 for user inputs
    use_units: tuple[int, ...]  # len(units) stands for "a model output"
    nbytes: int


@dataclass(frozen=True)
class CostReport:
    """Per-unit costs, and the values that cross unit boundaries."""

    units: tuple[UnitCost, ...]
    values: Mapping[str, ValueInfo]
    cut_bytes: tuple[int, ...]  # cut c sits before unit c; cut n is the model outputs
    # replays stage jobs for their device memory (passes/memory.py); None: not on fake
    # tensors, stage memory is then summed from ``units``
    memory: MemoryModel | None = dataclasses.field(default=None, compare=False, repr=False)

    def crossing(self, start: int, stop: int) -> tuple[int, int]:
        """Activation bytes entering and leaving units ``[start, stop)``."""
        entering = sum(v.nbytes for v in self.values.values()
                       if v.def_unit < start and any(start <= u < stop for u in v.use_units))
        leaving = sum(v.nbytes for v in self.values.values()
                      if start <= v.def_unit < stop and any(u >= stop for u in v.use_units))
        return entering, leaving


def _tensor_bytes(value: Any) -> int:
    total = 0
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info
                is not None and not schema.returns[0].alias_info.is_write)


# Ops that read only the rows they gather from a state tensor, not all of it.
_GATHERS = {torch.ops.aten.embedding.default,
            torch.nn.functional.embedding}  # the torch-level call of Dynamo graphs


class _CostInterpreter(torch.fx.Interpreter):
    """Runs the graph and records, per node, FLOPs, the bytes it reads and writes, and the
    bytes of the value it produces.  Reads of state (weights) are kept apart: they do not
    shrink with the microbatch."""

    def __init__(self, gm: torch.fx.GraphModule, counter: FlopCounterMode,
                 state_names: set[str], memoize: bool = False) -> None:
        super().__init__(gm)
        self.counter = counter
        self.state_names = state_names
        self.flops: dict[str, int] = {}
        self.act_traffic: dict[str, int] = {}
        self.state_traffic: dict[str, int] = {}
        self.out_bytes: dict[str, int] = {}
        # On fake tensors an op's result depends only on its arguments' layouts, so the
        # copies of a repeated block run once: (op, layouts) -> (fake result, FLOPs).
        self.memo: dict[Any, tuple[Any, int]] | None = {} if memoize else None

    def run_node(self, n: torch.fx.Node) -> Any:
        key = self._memo_key(n)
        hit = self.memo.get(key) if key is not None and self.memo is not None else None
        if hit is not None:
            result, flops = hit
            self.env[n] = result
        else:
            before = self.counter.get_total_flops()
            result = super().run_node(n)
            flops = self.counter.get_total_flops() - before
            if key is not None and self.memo is not None:
                self.memo[key] = (result, flops)
        if n.op in ("call_function", "call_method", "call_module"):
            self.flops[n.name] = flops
            view = _is_view(n)
            produced = 0 if view else _tensor_bytes(result)
            act_read = state_read = 0
            for a in n.all_input_nodes:
                if a not in self.env:
                    continue
                if a.name in self.state_names:
                    state_read += produced if n.target in _GATHERS else _tensor_bytes(
                        self.env[a])
                else:
                    act_read += _tensor_bytes(self.env[a])
            self.act_traffic[n.name] = 0 if view else act_read + produced
            self.state_traffic[n.name] = 0 if view else state_read
            self.out_bytes[n.name] = produced
        elif n.op == "placeholder":
            self.out_bytes[n.name] = _tensor_bytes(result)
        return result

    def _memo_key(self, n: torch.fx.Node) -> Any:
        """A key for ops whose fake result is a function of argument layouts (None for
        anything else: opaque calls, ops that write to their arguments)."""
        if self.memo is None or n.op != "call_function" or not isinstance(
                n.target, torch._ops.OpOverload) or _writes(n.target):
            return None
        flat, spec = pytree.tree_flatten((n.args, n.kwargs))
        parts: list[Any] = [n.target, spec]
        for leaf in flat:
            value = self.env.get(leaf) if isinstance(leaf, torch.fx.Node) else leaf
            for v in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(v, torch.Tensor):
                    parts.append((tuple(v.shape), v.stride(), v.storage_offset(), v.dtype,
                                  v.device, v.requires_grad))
                elif isinstance(v, (int, float, bool, str, type(None), torch.dtype,
                                    torch.device, torch.layout, torch.memory_format)):
                    parts.append((type(v), v))
                else:
                    return None
        return tuple(parts)


def _writes(op: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write
               for a in op._schema.arguments)


def _cpu_sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                    out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu``, the kernel that
    ``scaled_dot_product_attention`` becomes on CPU (fake) tensors; ``FlopCounterMode``
    only knows the CUDA kernels and would count attention as 0."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# Ops FlopCounterMode misses on CPU tensors, with their formulas (taking shapes).
_EXTRA_FLOP_FORMULAS: dict[Any, Any] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FLOP_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = (
        _cpu_sdpa_flops)


def estimate_costs(traced: TracedGraph, layers: LayerAssignment, program: ModelProgram,
                   device_model: DeviceModel, *, scale: float = 1.0) -> CostReport:
    """Estimate per-unit costs by interpreting the graph on fake tensors.

    Args:
        traced, layers, program: outputs of the trace, layers and codegen passes.
        device_model: turns FLOPs and bytes into seconds.
        scale: factor from the example inputs to one microbatch (``1 / num_microbatch``
            when the example is a whole batch); applied to activation-sized quantities.
    """
    gm = traced.graph_module
    model_state = traced.state_tensors
    interp = _interpret(traced)

    n_units = len(layers.units)
    state_by_name = {s.name: s for s in program.state}
    units: list[UnitCost] = []
    for unit, unit_program in zip(layers.units, program.units):
        names = [name for name, u in layers.node_unit.items() if u == unit.index]
        flops = sum(interp.flops.get(nm, 0) for nm in names)
        traffic = sum(interp.act_traffic.get(nm, 0) * scale + interp.state_traffic.get(nm, 0)
                      for nm in names)
        kernels = sum(1 for nm in names if interp.act_traffic.get(nm, 1) > 0)
        activation = sum(interp.out_bytes.get(nm, 0) for nm in names)
        fwd = (max(flops * scale / device_model.flops_per_s,
                   traffic / device_model.bytes_per_s)
               + kernels * device_model.launch_s)
        params = sum(state_by_name[s].nbytes for s in unit_program.state)
        trainable = sum(state_by_name[s].nbytes for s in unit_program.state
                        if state_by_name[s].kind == "parameter"
                        and model_state[s].requires_grad)
        units.append(UnitCost(
            fwd_flops=int(flops * scale),
            fwd_bytes=int(traffic),
            fwd_time_s=fwd,
            bwd_time_s=2.0 * fwd,
            param_bytes=params,
            trainable_bytes=trainable,
            activation_bytes=int(activation * scale),
            output_bytes=0,
        ))

    values = _value_infos(gm.graph, layers, traced, interp.out_bytes, n_units, scale)
    cut_bytes = _cut_bytes(values, n_units)
    units = [dataclasses.replace(u, output_bytes=cut_bytes[i + 1]) for i, u in enumerate(units)]
    memory = build_memory_model(program, model_state, traced.example_inputs, scale=scale,
                                block_bytes=device_model.block_bytes)
    return CostReport(units=tuple(units), values=values, cut_bytes=cut_bytes, memory=memory)


def _interpret(traced: TracedGraph) -> _CostInterpreter:
    """Interpret the graph on fake tensors; when that fails (data-dependent code, which is
    also what sends a model to the torch.fx fallback), run it once for real, on copies of
    the state so buffers are not updated."""
    gm = traced.graph_module
    model_state = traced.state_tensors
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def inputs(convert: Any) -> list[Any]:
        values, example = [], iter(traced.example_inputs)
        for node in placeholders:
            value = model_state[node.name] if node.name in model_state else next(example)
            values.append(convert(value) if isinstance(value, torch.Tensor) else value)
        return values

    state_names = set(model_state)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fake_args = inputs(fake_mode.from_tensor)
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
    interp = _CostInterpreter(gm, counter, state_names, memoize=True)
    try:
        with fake_mode, counter, fake_tensor_errors_to_debug():
            interp.run(*fake_args)
        return interp
    except Exception as e:  # noqa: BLE001 - any failure: measure with real tensors instead
        log.info("roundpipe: cost estimation on fake tensors failed (%s); running the "
                 "example once for real", e)
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
    interp = _CostInterpreter(gm, counter, state_names)
    try:
        with torch.no_grad(), counter:
            interp.run(*inputs(lambda t: t.detach().clone()))
    except Exception as e:  # noqa: BLE001 - estimates are optional
        log.warning("roundpipe: cost estimation failed (%s); balancing by parameter size", e)
        interp = _CostInterpreter(gm, counter, state_names)
    return interp


def _value_infos(graph: torch.fx.Graph, layers: LayerAssignment, traced: TracedGraph,
                 out_bytes: Mapping[str, int], n_units: int, scale: float
                 ) -> dict[str, ValueInfo]:
    """Where every value that leaves its unit is defined and read (networkx value graph)."""
    state = {s.name for s in traced.state}
    g = nx.DiGraph()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in state:
            continue
        for user in node.users:
            g.add_edge(node.name, user.name)
    unit_of = dict(layers.node_unit)
    infos: dict[str, ValueInfo] = {}
    outputs = {n.name for n in graph.nodes if n.op == "output"}
    for name in g.nodes:
        if name in outputs:
            continue
        def_unit = unit_of.get(name, -1)
        uses = set()
        for succ in g.successors(name):
            uses.add(n_units if succ in outputs else unit_of.get(succ, -1))
        uses.discard(def_unit)
        if not uses:
            continue
        infos[name] = ValueInfo(name=name, def_unit=def_unit, use_units=tuple(sorted(uses)),
                                nbytes=int(out_bytes.get(name, 0) * scale))
    return infos


def _cut_bytes(values: Mapping[str, ValueInfo], n_units: int) -> tuple[int, ...]:
    """Bytes live across each cut: cut c lies before unit c (cut n: the model outputs)."""
    diff = [0] * (n_units + 2)
    for v in values.values():
        first = max(v.def_unit + 1, 0)
        last = max(v.use_units)
        diff[first] += v.nbytes
        diff[last + 1] -= v.nbytes
    cuts, running = [], 0
    for c in range(n_units + 1):
        running += diff[c]
        cuts.append(running)
    return tuple(cuts)


def with_measured_times(costs: tuple[UnitCost, ...], fwd_s: Mapping[int, float],
                        bwd_s: Mapping[int, float] | None = None) -> tuple[UnitCost, ...]:
    """Return costs where measured forward/backward seconds replace the estimates."""
    bwd_s = bwd_s or {}
    return tuple(dataclasses.replace(c, measured_fwd_s=fwd_s.get(i, c.measured_fwd_s),
                                     measured_bwd_s=bwd_s.get(i, c.measured_bwd_s))
                 for i, c in enumerate(costs))
