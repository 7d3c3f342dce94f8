"""A pipe's compiled programs: one per input signature and mode (training flags, the
callers' autocast, grad mode), each with its executor and its plans by memory cap,
microbatch count and recompute grain (a per-call ``memory_fraction`` or
``num_microbatch`` re-partitions without tracing)."""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .compiler import Analysis
from .passes.cost import CostReport
from .plan import OutputMergePlan, StagePlan
from .runtime.executor import Executor
from .runtime.host_state import HostState


@contextlib.contextmanager
def tracing_autocast(kind: str, autocast: tuple[str, torch.dtype] | None) -> Iterator[None]:
    """Trace in the autocast state the calls of the program run in: the model's own code
    may branch on a dtype autocast decides (``if h.dtype != torch.float32``), and a
    program traced without autocast would take the float32 branch under bf16.  Tracing
    runs on the CPU, so a CUDA caller's state is traced as CPU autocast of the same dtype;
    the ops stay autocast-implicit in the graph and run under the caller's autocast."""
    with contextlib.ExitStack() as stack:
        for device_type in dict.fromkeys((kind, "cpu")):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        if autocast is not None:
            stack.enter_context(torch.autocast("cpu", dtype=autocast[1]))
        yield


@dataclass
class CompiledProgram:
    """One compiled program with its executor (a model may have several: new shapes,
    train/eval mode), and its plans by memory cap (a per-call ``memory_fraction``
    re-partitions without tracing)."""

    plan: StagePlan
    host: HostState
    executor: Executor
    training: tuple[bool, ...]
    analysis: Analysis
    autocast: tuple[str, torch.dtype] | None  # the callers' autocast when traced
    # The grad mode traced in: a pipe(x) under no_grad gets a program of its own, since
    # model code may branch on grad mode (nn.MultiheadAttention's fast path).
    grad: bool = True
    # The module tree and hooks traced against (RoundPipe._model_key).
    modules: tuple = ()
    # (module, attribute, value) of the plain values its code read (trace's
    # attribute_reads): another value makes another program.
    attributes: tuple = ()
    # (module, attribute, tensor, version) of the plain tensor attributes it read or
    # holds as constants (trace's attribute_reads): another object, or an in-place write
    # (a new version), makes another program (see api._tensor_attributes).
    tensors: tuple = ()
    # (module, attribute, digest, objects kept) of the other objects it read (a config,
    # a dict, a list: roundpipe/program_key.py): another content makes another program.
    objects: tuple = ()
    # (globals dict, name, digest, objects kept) of the module globals its model's code
    # may read (program_key.global_reads): another value makes another program.
    globals: tuple = ()
    # requires_grad of the model's parameters and buffers (api._requires_grad), and
    # requires_grad / is_contiguous() of the first microbatch's input tensors
    # (api._input_layout), when traced.
    flags: bytes = b""
    layout: tuple = ()
    # The inference mode traced for where the model's code asked for it (None: it did
    # not, and the program serves both).
    inference: bool | None = None
    # Output merge plans by the way calls split the inputs (value -> dim).
    merge_plans: dict[tuple, OutputMergePlan] = field(default_factory=dict)
    # Plans (and their executors) by (microbatch shapes, memory cap, num_microbatch,
    # recompute grain): the shapes the costs were estimated on (see ``costs``).
    by_cap: dict[tuple, tuple[StagePlan, Executor]] = field(default_factory=dict)
    # Cost reports by the per-microbatch input shapes they were estimated on, the most
    # recently used last (a bounded number: RoundPipe._use_cap), and the shapes of
    # ``plan``'s.  ``analysis.report`` is ``plan``'s report.
    costs: collections.OrderedDict[tuple, CostReport] = field(
        default_factory=collections.OrderedDict)
    shapes: tuple = ()
    # Executors by stage layout: plans of other shapes, caps or microbatch counts with the
    # same stage boundaries run on one (an executor holds the stage programs' wiring and
    # the torch.compile'd units, nothing of the costs).
    executors: dict[tuple, Executor] = field(default_factory=dict)
    # The plan as users see it (with its host step), by (plan, bound optimizer): the
    # same object until either changes.
    shown: tuple[tuple[int, int], StagePlan] | None = None


def stage_layout(plan: StagePlan) -> tuple:
    """What an executor depends on of a plan: its stages' kinds and unit ranges."""
    return tuple((s.kind, s.units) for s in plan.stages)


def plan_key(plan: StagePlan, grain: str) -> tuple:
    """(memory cap, num_microbatch, recompute grain) a plan was made for (a plan with no
    backward stage shows no grain: any will do)."""
    shown = next((s.recompute for s in plan.stages if s.kind == "bwd"), grain)
    return plan.memory_cap, plan.num_microbatch, shown
