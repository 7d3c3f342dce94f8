"""Pass 6, codegen: emit one program per layer unit and one per stage.

A unit program is a ``torch.fx.GraphModule`` with an explicit signature::

    def forward(self, <values read from earlier units>, <state slots>, [_device], [_rng]):
        ...
        return (<values later units or the model outputs read>,)

Three rewrites make programs runnable on any device and reproducible:

* device constants captured at trace time (``arange(..., device=cpu)``) read ``_device``;
* ``aten._assert_tensor_metadata`` (which asserts the trace device) is dropped;
* random ops draw from keyed streams (:mod:`roundpipe.ops.rng`), seeded by
  (call, microbatch, unit, op ordinal) through ``_rng``.

A stage program calls the unit programs of its range in order; it is what
``plan.stage_code(i)`` shows and what the composition test runs.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx.node import map_aggregate

from ..plan import ModelProgram, UnitProgram
from ..ops import modes, rng
from ..ops.modcall import call_module_functional
from .layers import LayerAssignment
from .mode_regions import MODES, Region
from .trace import MUTATES, TracedGraph

_DROPPED = {torch.ops.aten._assert_tensor_metadata.default}
_FUNCTIONAL_DROPOUT = {torch.nn.functional.dropout}
# Set on torch-level random calls (Dynamo graphs, passes/dynamo.py): run them seeded.
RANDOM = "roundpipe.random"


def generate_unit_programs(traced: TracedGraph, layers: LayerAssignment,
                           trace_device: torch.device = torch.device("cpu"),
                           keep: frozenset[str] = frozenset()) -> ModelProgram:
    """Cut the traced graph into one program per layer unit; the values in ``keep`` are
    outputs of their units even where no later unit reads them (an output tail's inputs,
    see :mod:`roundpipe.passes.output_merge`)."""
    graph = traced.graph_module.graph
    state_names = {s.name for s in traced.state}
    nodes_of: list[list[torch.fx.Node]] = [[] for _ in layers.units]
    for node in graph.nodes:
        if node.name in layers.node_unit:
            nodes_of[layers.node_unit[node.name]].append(node)

    units: list[UnitProgram] = []
    state_users: dict[str, list[int]] = {}
    for unit in layers.units:
        program = _unit_program(traced, unit.index, unit.name, nodes_of[unit.index],
                                state_names, trace_device, keep)
        units.append(program)
        for s in program.state:
            state_users.setdefault(s, []).append(unit.index)
    state = tuple(dataclasses.replace(s, units=tuple(state_users.get(s.name, ())))
                  for s in traced.state)
    return ModelProgram(
        units=tuple(units),
        state=state,
        inputs=traced.inputs,
        outputs=traced.outputs,
        out_spec=traced.out_spec,
        buffer_updates=traced.buffer_updates,
        constants=dict(traced.constants),
        trace_method=traced.method,
        tensor_hooks=traced.tensor_hooks,
    )


def tail_program(traced: TracedGraph, nodes: list[torch.fx.Node],
                 trace_device: torch.device = torch.device("cpu")) -> UnitProgram:
    """A program of ``nodes`` (in graph order) run after the pipeline, on whole-batch
    values (see :mod:`roundpipe.passes.output_merge`)."""
    return _unit_program(traced, -1, "tail", nodes, {s.name for s in traced.state},
                         trace_device)


def _is_random(node: torch.fx.Node) -> bool:
    """A seeded random op that really draws: ``scaled_dot_product_attention`` with
    ``dropout_p=0`` and ``dropout`` with ``p=0`` (the common cases) are tagged random but
    are not."""
    if node.meta.get(RANDOM):
        return True
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = node.target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p" or (arg.name == "p" and "dropout" in schema.name):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(
                arg.name, arg.default_value)
            if isinstance(value, (int, float)) and value == 0:
                return False
    return True


def draws_random(traced: TracedGraph, node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers (a seeded op, functional dropout, or an
    opaque module call that may)."""
    return (_is_random(node) or node.target in _FUNCTIONAL_DROPOUT
            or (node.target is call_module_functional
                and _may_be_random(_get_module(traced, node))))


def _unit_program(traced: TracedGraph, index: int, name: str, nodes: list[torch.fx.Node],
                  state_names: set[str], trace_device: torch.device,
                  keep: frozenset[str] = frozenset()) -> UnitProgram:
    inside = set(nodes)
    inputs: list[torch.fx.Node] = []
    state: list[torch.fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in inside:
                continue
            bucket = state if arg.name in state_names else inputs
            if arg not in bucket:
                bucket.append(arg)
    outputs = [n for n in nodes if n.name in keep or any(u not in inside for u in n.users)]

    needs_device = any(_has_device(n.args, trace_device) or _has_device(n.kwargs, trace_device)
                       for n in nodes if n.target not in _DROPPED)
    needs_rng = any(draws_random(traced, n) for n in nodes)
    # An autocast region the model opened for the device it was traced on follows the
    # program to the device it runs on.
    needs_device = needs_device or any(
        r.kind == "autocast" and r.args[0] == trace_device.type
        for n in nodes for r in n.meta.get(MODES, ()))
    needs_device = needs_device or (needs_rng and any(
        (_is_random(n) and n.target not in (torch.ops.aten.dropout.default,
                                                   torch.ops.aten.native_dropout.default))
        or n.target is call_module_functional for n in nodes))

    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in inputs + state:
        env[node] = g.placeholder(node.name)
        env[node].meta = dict(node.meta)
    device_ph = g.placeholder("_device") if needs_device else None
    rng_ph = g.placeholder("_rng") if needs_rng else None

    def rewrite_device(value: Any) -> Any:
        if isinstance(value, torch.device) and value == trace_device and device_ph is not None:
            return device_ph
        return value

    ordinal = 0
    mutated: list[str] = []
    regions = _RegionEmitter(g, device_ph, trace_device)
    for node in nodes:
        if node.target in _DROPPED:
            continue
        regions.move_to(node.meta.get(MODES, ()))
        mutated.extend(m for m in node.meta.get(MUTATES, ()) if m not in mutated)
        args = map_aggregate(node.args, lambda a: env[a] if isinstance(a, torch.fx.Node)
                             else rewrite_device(a))
        kwargs = map_aggregate(node.kwargs, lambda a: env[a] if isinstance(a, torch.fx.Node)
                               else rewrite_device(a))
        new: torch.fx.Node
        if node.op == "call_function" and rng_ph is not None and draws_random(traced, node):
            new = _random_call(g, node, args, kwargs, rng_ph, device_ph, index, ordinal,
                               traced)
            ordinal += 1
        else:
            new = g.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = dict(node.meta)
        env[node] = new
    regions.move_to(())  # a region never outlives its unit: the next may run elsewhere
    g.output(tuple(env[n] for n in outputs))
    module = torch.fx.GraphModule(traced.graph_module, g, class_name=f"Unit{index}")
    return UnitProgram(
        index=index,
        name=name,
        module=module,
        inputs=tuple(n.name for n in inputs),
        state=tuple(n.name for n in state),
        outputs=tuple(n.name for n in outputs),
        mutated_state=tuple(mutated),
        needs_device=needs_device,
        needs_rng=needs_rng,
    )


class _RegionEmitter:
    """Emits the enter/exit calls that put each node of a unit program in the grad-mode and
    autocast regions it ran in when traced (``meta[MODES]``, outermost first)."""

    def __init__(self, g: torch.fx.Graph, device_ph: torch.fx.Node | None,
                 trace_device: torch.device) -> None:
        self.g = g
        self.device_ph = device_ph
        self.trace_device = trace_device
        self.open: list[tuple[Region, torch.fx.Node]] = []

    def move_to(self, wanted: tuple[Region, ...]) -> None:
        common = 0
        while (common < len(self.open) and common < len(wanted)
               and self.open[common][0] == wanted[common]):
            common += 1
        while len(self.open) > common:
            region, token = self.open.pop()
            self.g.call_function(modes.exit_grad_mode if region.kind == "grad"
                                 else modes.exit_autocast, (token,))
        for region in wanted[common:]:
            if region.kind == "grad":
                token = self.g.call_function(modes.enter_grad_mode, region.args)
            else:
                device_type, *rest = region.args
                device: Any = device_type
                if device_type == self.trace_device.type and self.device_ph is not None:
                    device = self.device_ph
                token = self.g.call_function(modes.enter_autocast, (device, *rest))
            self.open.append((region, token))


def _random_call(g: torch.fx.Graph, node: torch.fx.Node, args: tuple, kwargs: dict,
                 rng_ph: torch.fx.Node, device_ph: torch.fx.Node | None, unit: int,
                 ordinal: int, traced: TracedGraph) -> torch.fx.Node:
    """Replace a random op by its keyed equivalent."""
    target = node.target
    if target in (torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default):
        fn: Callable[..., Any] = (rng.dropout if target is torch.ops.aten.dropout.default
                                  else rng.native_dropout)
        x, p, train = (list(args) + [kwargs.get("p"), kwargs.get("train")])[:3]
        return g.call_function(fn, (x, p, train, rng_ph, unit, ordinal))
    if target in _FUNCTIONAL_DROPOUT:
        x = args[0]
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("training", True)
        return g.call_function(rng.dropout, (x, p, train, rng_ph, unit, ordinal))
    if node.meta.get(RANDOM):  # torch-level: the callable by its qualified name
        op = "py:" + (torch.fx.node._get_qualified_name(target) if node.op == "call_function"
                      else f"torch.Tensor.{target}")
    elif target is call_module_functional:
        op = "modcall"
    else:
        op = f"{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    return g.call_function(rng.seeded, (op, rng_ph, unit, ordinal, device_ph) + tuple(args),
                           kwargs)


def _may_be_random(module: torch.nn.Module) -> bool:
    """Whether an opaque module call may draw random numbers: it is in training mode and
    holds a dropout layer or code roundpipe cannot see into (non-torch.nn modules)."""
    if not module.training:
        return False
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd):
            return True
        if not type(sub).__module__.startswith("torch.nn.modules"):
            return True
    return False


def _get_module(traced: TracedGraph, node: torch.fx.Node) -> torch.nn.Module:
    ref = node.args[0]
    return traced.graph_module.get_submodule(ref.target)  # type: ignore[union-attr]


def _has_device(value: Any, device: torch.device) -> bool:
    found = False

    def visit(v: Any) -> Any:
        nonlocal found
        if isinstance(v, torch.device) and v == device:
            found = True
        return v

    map_aggregate(value, visit)
    return found


def build_stage_module(program: ModelProgram, start: int, stop: int,
                       outputs: Sequence[str] | None = None) -> tuple[torch.fx.GraphModule,
                                                                     tuple[str, ...],
                                                                     tuple[str, ...]]:
    """A program for units ``[start, stop)`` that calls the unit programs in order.

    Its signature is ``(*inputs, *state, _device, _rng)``; it returns ``outputs`` (default:
    every value produced in the range and read after it, or by the model outputs).

    Returns:
        The module, its input value names and its state names.
    """
    units = program.units[start:stop]
    produced: set[str] = set()
    inputs: list[str] = []
    state: list[str] = []
    for unit in units:
        inputs.extend(v for v in unit.inputs if v not in produced and v not in inputs)
        state.extend(s for s in unit.state if s not in state)
        produced.update(unit.outputs)
    if outputs is None:
        later = {v for u in program.units[stop:] for v in u.inputs}
        later.update(o.value for o in program.outputs if o.value is not None)
        later.update(v for _, v in program.buffer_updates)
        outputs = [v for u in units for v in u.outputs if v in later]

    g = torch.fx.Graph()
    root = torch.nn.Module()
    # The unit programs sit one level down: a GraphModule recompiles the GraphModules among
    # its direct children, and they are compiled already.
    root.add_module("units", torch.nn.Module())
    env: dict[str, torch.fx.Node] = {}
    for name in inputs + state:
        env[name] = g.placeholder(name)
    device_ph = g.placeholder("_device")
    rng_ph = g.placeholder("_rng")
    for unit in units:
        attr = f"units.unit_{unit.index}"
        root.units.add_module(f"unit_{unit.index}", unit.module)
        call_args = [env[v] for v in unit.inputs] + [env[s] for s in unit.state]
        if unit.needs_device:
            call_args.append(device_ph)
        if unit.needs_rng:
            call_args.append(rng_ph)
        result = g.call_module(attr, tuple(call_args))
        for i, out in enumerate(unit.outputs):
            env[out] = g.call_function(operator.getitem, (result, i), name=out)
    g.output(tuple(env[o] for o in outputs))
    return (torch.fx.GraphModule(root, g, class_name=f"Stage_{start}_{stop}"),
            tuple(inputs), tuple(state))
