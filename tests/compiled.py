"""Shared helpers for the compiler tests (test_trace, test_layers, test_cost, test_codegen,
test_plan).

* :func:`compiled` runs :func:`roundpipe.compiler.compile_model` once per (model, dtype,
  factory options) for the whole session and keeps every pass's output (traced graph, layer
  assignment, unit programs, cost report) next to the plan.  torch.export of the GPT takes
  about 2 s, so the test files share these results instead of tracing again.
* :func:`run_stages` is the reference runner: it composes the plan's forward and fused stage
  programs in order on the CPU, the way the runtime chains them, and rebuilds the model's
  output structure.

Nothing here mutates a cached model: callers that run a model take ``copy.deepcopy`` first.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import models
from roundpipe import compiler
from roundpipe.passes.cost import CostReport
from roundpipe.passes.layers import LayerAssignment
from roundpipe.passes.trace import TracedGraph
from roundpipe.plan import ModelProgram, StagePlan
from roundpipe.ops.rng import RngKey

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Compiled:
    """One ``compile_model`` run with the intermediate results of its passes."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    traced: TracedGraph
    layers: LayerAssignment
    program: ModelProgram
    report: CostReport
    plan: StagePlan


def compile_capturing(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      **options: Any) -> Compiled:
    """``compile_model(model, args, kwargs, **options)``, recording what each pass returned.

    The passes are wrapped (not replaced) inside ``roundpipe.compiler``, so the plan is
    exactly what ``compile_model`` produces.
    """
    seen: dict[str, Any] = {}

    def recording(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            seen[name] = fn(*a, **k)
            return seen[name]
        return wrapper

    names = ("trace", "assign_layers", "generate_unit_programs", "estimate_costs")
    patches = [mock.patch.object(compiler, n, recording(n, getattr(compiler, n))) for n in names]
    for p in patches:
        p.start()
    try:
        plan = compiler.compile_model(model, args, kwargs, **options)
    finally:
        for p in reversed(patches):
            p.stop()
    return Compiled(model, args, kwargs, seen["trace"], seen["assign_layers"],
                    seen["generate_unit_programs"], seen["estimate_costs"], plan)


@functools.cache
def compiled(name: str, dtype: torch.dtype = torch.float32, *, eval_mode: bool = False,
             num_devices: int = 2, **factory_kwargs: Any) -> Compiled:
    """The model ``models.ALL[name]`` (or a factory of this module), compiled once.

    Cached for the session: do not mutate the returned model or plan.
    """
    factory = models.ALL.get(name) or EXTRA[name]
    model, args, kwargs = models.to_dtype(*factory(**factory_kwargs), dtype)
    if eval_mode:
        model.eval()
    return compile_capturing(model, args, kwargs, num_devices=num_devices)


# --- running a plan ---------------------------------------------------------------------

def flat_user_inputs(program: ModelProgram, model: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map a call's ``(args, kwargs)`` onto the program's input value names (independently
    of the runtime's own flattening, so the two can disagree in a test)."""
    sig = program.inputs
    if sig.kind == "pytree":
        leaves, spec = pytree.tree_flatten((args, kwargs))
        assert spec == sig.spec, f"call structure {spec} differs from the traced {sig.spec}"
    else:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        leaves = [bound.arguments[p] for p in sig.params]
    assert len(leaves) == len(sig.names)
    return {name: v for name, v in zip(sig.names, leaves) if name is not None}


def state_values(program: ModelProgram, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state slot's tensor: parameters and buffers from ``model`` by fully-qualified
    name, constants from ``program.constants``."""
    out: dict[str, torch.Tensor] = {}
    for spec in program.state:
        if spec.kind == "parameter":
            out[spec.name] = model.get_parameter(spec.fqn)
        elif spec.kind == "buffer":
            out[spec.name] = model.get_buffer(spec.fqn)
        else:
            out[spec.name] = program.constants[spec.name]
    return out


def placeholders(module: torch.fx.GraphModule) -> list[str]:
    return [n.target for n in module.graph.nodes if n.op == "placeholder"]


def output_names(module: torch.fx.GraphModule) -> list[str]:
    out = next(n for n in module.graph.nodes if n.op == "output")
    return [n.name for n in out.args[0]]


def run_stages(plan: StagePlan, state_model: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any], *, key: RngKey | None = RngKey(0, 0, 0),
               device: torch.device = CPU) -> Any:
    """Compose the forward stages and then the fused stage, in order, on one device.

    Each stage module is called as ``module(*inputs, *state, _device, _rng)``; its inputs
    are looked up by name among the user inputs and the values earlier stages returned.
    The backward stages are skipped: they repeat the forward stages' units for recompute.
    Returns the model's output structure, rebuilt with ``program.out_spec``.
    """
    program = plan.program
    env: dict[str, Any] = flat_user_inputs(program, state_model, args, kwargs)
    state = state_values(program, state_model)
    for spec, module in zip(plan.stages, plan.stage_modules):
        if spec.kind == "bwd":
            continue
        call = []
        for name in placeholders(module):
            if name == "_device":
                call.append(device)
            elif name == "_rng":
                call.append(key)
            elif name in state:
                call.append(state[name])
            else:
                call.append(env[name])
        results = module(*call)
        names = output_names(module)
        assert len(results) == len(names)
        env.update(zip(names, results))
    flat = [env[o.value] if o.value is not None else o.constant for o in program.outputs]
    return pytree.tree_unflatten(flat, program.out_spec)


def eager_and_staged(c: Compiled, args: tuple[Any, ...], kwargs: dict[str, Any],
                     **run_options: Any) -> tuple[Any, Any, nn.Module, nn.Module]:
    """Run the model eagerly and through its stages, each on its own copy of the model.

    Returns ``(eager output, staged output, eager model, staged model)`` so buffers the
    call updated (BatchNorm running stats) can be compared as well.
    """
    eager_model = copy.deepcopy(c.model)
    staged_model = copy.deepcopy(c.model)
    with torch.no_grad():
        expected = eager_model(*args, **kwargs)
        got = run_stages(c.plan, staged_model, args, kwargs, **run_options)
    return expected, got, eager_model, staged_model


def assert_same_structure_and_values(expected: Any, got: Any) -> None:
    """Same pytree structure (dict keys, dataclass type) and bitwise-equal leaves."""
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    got_leaves, got_spec = pytree.tree_flatten(got)
    assert type(got) is type(expected)
    assert got_spec == exp_spec
    for e, g in zip(exp_leaves, got_leaves):
        if isinstance(e, torch.Tensor):
            assert g.dtype == e.dtype and g.shape == e.shape
            # Exact: the stage programs run the same ATen ops in the same order as eager.
            assert torch.equal(g, e), f"max abs diff {(g - e).abs().max().item()}"
        else:
            assert g == e


# --- extra small models (not in models.ALL, so the runtime tests are unaffected) -----------

class ConstNet(nn.Module):
    """A plain tensor attribute and a tensor literal: two ``"constant"`` state slots."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([models.ResBlock(8) for _ in range(2)])
        self.offset = torch.linspace(-1.0, 1.0, 8)  # not a buffer: export lifts a constant
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = x + self.offset
        for b in self.blocks:
            x = b(x)
        return self.head(x) + torch.tensor([1.0, 2.0])


def const_net(batch: int = 4):
    torch.manual_seed(0)
    return ConstNet(), (torch.randn(batch, 8),), {}


class DropBlock(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc(x))


class DropNet(nn.Module):
    """Blocks with real dropout (p = 0.5)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DropBlock(16, p) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def drop_net(batch: int = 4):
    torch.manual_seed(0)
    return DropNet(), (torch.randn(batch, 16),), {}


class GroupedNet(nn.Module):
    """Repeated containers of repeated containers: ``groups[i][j]`` (ModuleList of
    ModuleLists of blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.groups = nn.ModuleList([nn.ModuleList([models.ResBlock(8) for _ in range(3)])
                                     for _ in range(2)])
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for group in self.groups:
            for block in group:
                x = block(x)
        return self.out(x)


def grouped_net(batch: int = 4):
    torch.manual_seed(0)
    return GroupedNet(), (torch.randn(batch, 4),), {}


EXTRA = {"const_net": const_net, "drop_net": drop_net, "grouped_net": grouped_net}
