"""Device memory of each stage's job, from the lifetimes of its tensors.

Summing what every unit produces over-estimates a forward job (its values are freed as it
goes) and under-estimates an accumulating backward one (a fresh parameter gradient lives
next to the accumulated one).  Instead, one microbatch of the job is *replayed* the way
``runtime/job_runner.py`` runs it, on fake tensors (shapes only, nothing allocated), under
the :class:`~roundpipe.ops.storage_ledger.StorageLedger` that measures real runs:

* forward jobs: the stage's inputs uploaded, its units run under ``no_grad``, every unit
  output kept until the microbatch ends (the runner publishes them then);
* fused and backward jobs: each unit as its own autograd graph whose inputs are fresh
  leaves for the values gradients flow through, then the backward unit by unit in reverse
  (the fused job first runs a loss: a log-softmax over each output, the working set of a
  cross-entropy, the usual loss); at the layer grain one unit is recomputed at a time;
* from the second microbatch on, parameters hold an accumulated gradient, so the fresh
  one is added next to it.

A job's estimate is its weights + the replay's peak, plus, with several microbatches, the
accumulated gradients and, on one device, the outputs a forward job keeps for its earlier
microbatches (the next job runs only after it).  The next microbatch's inputs are not
added: ``JobRunner.run_microbatch`` uploads them once the current microbatch's values are
freed.  (It used to upload them before the current one computed when they were on the
host already: always on one device, but on several only when the producing job, on
another device, happened to be a microbatch ahead, so a stage's peak was one
microbatch's inputs more or not by thread timing: 12-21% of a ResNet backward stage's.)
A value leaves the device when its download is issued (a measured virtual device reads
it at once, as the ledger on CUDA sees it, not when its waiter thread gets to it, which
on a loaded host can be a microbatch later).  On virtual devices this lands within
0.95-1.15 of the measured ``RunStats.stage_peak_bytes`` (``tests/test_memory_model.py``).
"""

from __future__ import annotations

import builtins
import logging
import math
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.nn.modules import module as nn_module
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..ops import modes, rng
from ..ops.modcall import rehearsal
from ..ops.rng import RngKey
from ..ops.storage_ledger import StorageLedger
from ..plan import ModelProgram, UnitProgram

log = logging.getLogger(__name__)

_KEY = RngKey(seed=0, call=0, microbatch=0)  # dropout masks: shapes only


@dataclass(frozen=True, eq=False)
class MemoryModel:
    """Fake values of one microbatch, enough to replay any stage's job.

    Attributes:
        program: the unit programs.
        values: every program value of one microbatch (fake tensors, no autograd graph).
        state: every state slot (fake).
        trainable: state slots that get gradients.
        carries: values gradients flow through (the runner makes leaves of these).
        scale: factor from the traced example to one microbatch (1 when the example is a
            microbatch; activation bytes are scaled by it otherwise).
        block_bytes: allocation granularity of the device (CUDA's caching allocator: 512).
    """

    program: ModelProgram
    values: Mapping[str, Any]
    state: Mapping[str, torch.Tensor]
    trainable: frozenset[str]
    carries: frozenset[str]
    scale: float
    block_bytes: int
    fake_mode: FakeTensorMode = field(repr=False)
    _cache: dict[Any, int] = field(default_factory=dict, repr=False)
    # per unit index / value / state slot: its part of the replay cache's key (None: not
    # keyable), computed once
    _unit_keys: dict[int, Any] = field(default_factory=dict, repr=False)
    _value_keys: dict[str, Any] = field(default_factory=dict, repr=False)
    _state_keys: dict[str, Any] = field(default_factory=dict, repr=False)

    def stage_bytes(self, kind: str, units: tuple[int, int], *, num_microbatch: int,
                    num_devices: int, grain: str = "stage") -> int:
        """Most device bytes the job of stage ``units`` (of ``kind``) holds at once,
        weights included, prefetched weights of the next job excluded."""
        key = (kind, units, num_microbatch > 1, num_devices == 1, grain)
        cached = self._cache.get(key)
        if cached is None:
            try:
                cached = self._cache[key] = self._stage_bytes(kind, units, num_microbatch,
                                                              num_devices, grain)
            except Exception as e:  # noqa: BLE001 - the estimate must not stop a plan
                raise ReplayFailed(f"the {kind} job of units {units[0]}-{units[1] - 1} "
                                   f"does not replay on fake tensors ({type(e).__name__}: "
                                   f"{e})") from e
        if kind == "fwd" and num_devices == 1 and num_microbatch > 1:
            # outputs handed to the next job, kept for the earlier microbatches
            cached += (num_microbatch - 1) * self._act_out_bytes(units)
        return cached

    def unit_bytes(self, index: int, *, num_microbatch: int, num_devices: int,
                   grain: str = "stage") -> int:
        """The most unit ``index`` needs in a stage of its own (forward, or backward: the
        fused tail when it is the last unit): the smallest cap it fits under."""
        last = index == len(self.program.units) - 1
        rng = (index, index + 1)
        return max(self.stage_bytes(kind, rng, num_microbatch=num_microbatch,
                                    num_devices=num_devices, grain=grain)
                   for kind in ("fwd", "fused" if last else "bwd"))

    def _stage_bytes(self, kind: str, units: tuple[int, int], num_microbatch: int,
                     num_devices: int, grain: str) -> int:
        start, stop = units
        slots = {s for u in self.program.units[start:stop] for s in u.state}
        weights = sum(self._nbytes(self.state[s]) for s in slots)
        accumulated = num_microbatch > 1 and kind != "fwd"
        trainable = [s for s in slots if s in self.trainable] if kind != "fwd" else []
        peak = self._replay(kind, start, stop, accumulated, grain)
        grads = sum(self._nbytes(self.state[s]) for s in trainable)
        if self.scale != 1.0:
            # The replay ran at the example's size: activations shrink, gradients do not.
            peak = int(peak * self.scale) + (grads if kind != "fwd" else 0)
        # The next microbatch's inputs are not added: the runner uploads them once this
        # one's values are freed (JobRunner.run_microbatch).
        return weights + peak + (grads if accumulated else 0)

    def _reads(self, kind: str, start: int, stop: int, grain: str) -> tuple[str, ...]:
        """The host values the job uploads for a microbatch (all before it computes); at
        the layer grain every unit reads its inputs from the stash, values of its own
        stage included."""
        if kind == "bwd" and grain == "layer":
            return tuple(dict.fromkeys(v for u in self.program.units[start:stop]
                                       for v in u.inputs))
        return self.program.range_inputs(start, stop)

    def _act_out_bytes(self, units: tuple[int, int]) -> int:
        start, stop = units
        later = {v for u in self.program.units[stop:] for v in u.inputs}
        later |= {o.value for o in self.program.outputs if o.value is not None}
        made = [v for u in self.program.units[start:stop] for v in u.outputs if v in later]
        return int(self._bytes_of(dict.fromkeys(made)) * self.scale)

    def _bytes_of(self, names: Any) -> int:
        return sum(self._nbytes(self.values[v]) for v in names
                   if isinstance(self.values.get(v), torch.Tensor))

    def _nbytes(self, t: torch.Tensor) -> int:
        n = t.numel() * t.element_size()
        return -(-n // self.block_bytes) * self.block_bytes

    # --- the replay ----------------------------------------------------------------------
    def _replay(self, kind: str, start: int, stop: int, accumulated: bool,
                grain: str) -> int:
        """Peak bytes of one microbatch beyond the weights (and the accumulated
        gradients): a replay of the same computation earlier in the process (another
        pipe of the same model, another device count or cap) gives it at once."""
        key = self._replay_key(kind, start, stop, accumulated, grain)
        if key is not None:
            peak = _REPLAYS.get(key)
            if peak is not None:
                return peak
        peak = self._run_replay(kind, start, stop, accumulated, grain)
        if key is not None:
            _REPLAYS.put(key, peak)
        return peak

    def _run_replay(self, kind: str, start: int, stop: int, accumulated: bool,
                    grain: str) -> int:
        """The replay itself: one microbatch on fake tensors under a fresh ledger."""
        units = self.program.units[start:stop]
        ledger = StorageLedger("cpu", block_bytes=self.block_bytes)
        with self.fake_mode, rehearsal():
            state = {}
            for slot in {s for u in units for s in u.state}:
                weight = torch.empty_like(self.state[slot])  # uploaded: counted apart
                if kind != "fwd" and slot in self.trainable:
                    weight.requires_grad_(True)
                    if accumulated:
                        weight.grad = torch.zeros_like(weight)
                state[slot] = weight
            with ledger.watching(0):
                uploaded = {v: self._upload(v) for v in self._reads(kind, start, stop, grain)}
                if kind == "fwd":
                    self._forward(units, state, uploaded)
                else:
                    host, held = self._host_grads(kind, stop), []
                    if kind == "bwd" and grain == "layer":
                        self._backward_layers(units, state, uploaded, host, held)
                    else:
                        self._backward_stage(kind, units, state, uploaded, host, held)
                    del held
                del uploaded
        return ledger.peak_bytes()

    # --- the replay cache's key ----------------------------------------------------------
    # A replay's peak is a function of exactly what it reads, and the key holds all of it:
    # * its arguments kind, accumulated, grain, and block_bytes (the ledger's rounding);
    # * per unit of the range, the program it calls: every node of the GraphModule's graph
    #   (op, target, args/kwargs with nodes by position, constants by exact type and value,
    #   get_attr tensors by metadata and, when tiny, value: fake mode propagates those),
    #   the unit's inputs/state/outputs names and needs_device/needs_rng (the extras
    #   ``_call`` passes).  Only programs whose every call is fixed by its name are keyed:
    #   aten/prims ops, operator/math/a few builtins, the keyed random ops (``seeded`` only
    #   for aten/prims/torch-level ops) and the region enter/exit calls; a call_module, a
    #   user's op, an opaque module call or an unkeyable constant leaves the replay uncached;
    # * the values it may upload (every unit input of the range, and for a fused job the
    #   program outputs the stand-in loss reads): metadata (shape, stride, offset, dtype,
    #   device, layout, conj/neg bits, requires_grad, a fake constant's value) and whether
    #   gradients flow through them (``carries``); non-tensors by exact type and value;
    # * every state slot of the range: metadata and whether it is trainable;
    # * what the job derives from the rest of the program: ``_reads``, ``_host_grads`` and
    #   the loss's output names (``program.outputs``, in order);
    # * the thread's modes the replay runs under (default dtype, grad/inference mode); no
    #   caching under autocast, a dispatch/function mode or global module hooks.
    # Nothing else is read: ``fake_mode`` is made alike for every model, ``_KEY`` and the
    # device passed are constants, and ``scale`` is applied after (stage_bytes).
    def _replay_key(self, kind: str, start: int, stop: int, accumulated: bool,
                    grain: str) -> tuple[Any, ...] | None:
        units = self.program.units[start:stop]
        unit_keys = []
        for i, u in zip(range(start, stop), units):
            if i not in self._unit_keys:
                self._unit_keys[i] = _unit_key(u)
            if self._unit_keys[i] is None:
                return None
            unit_keys.append(self._unit_keys[i])
        names = [v for u in units for v in u.inputs]
        loss_outputs = tuple(o.value for o in self.program.outputs if o.value is not None) \
            if kind == "fused" else ()
        value_keys = []
        for v in dict.fromkeys(names + list(loss_outputs)):
            if v not in self._value_keys:
                self._value_keys[v] = _value_key(self.values, v)
            if self._value_keys[v] is None:
                return None
            value_keys.append((v, self._value_keys[v], v in self.carries))
        state_keys = []
        for slot in sorted({s for u in units for s in u.state}):
            if slot not in self._state_keys:
                self._state_keys[slot] = (_tensor_key(self.state[slot]) if slot in self.state
                                          else ("missing",))
            meta = self._state_keys[slot]
            if meta is None:
                return None
            state_keys.append((slot, meta, slot in self.trainable))
        thread = _thread_modes()
        if thread is None:
            return None
        return (kind, accumulated, grain, self.block_bytes, thread, tuple(unit_keys),
                tuple(value_keys), tuple(state_keys), self._reads(kind, start, stop, grain),
                tuple(sorted(self._host_grads(kind, stop))), loss_outputs)

    def _upload(self, name: str) -> Any:
        value = self.values[name]
        return value.clone() if isinstance(value, torch.Tensor) else value

    def _call(self, unit: UnitProgram, args: list[Any], state: Mapping[str, Any]
              ) -> tuple[Any, ...]:
        extras = ([torch.device("cpu")] if unit.needs_device else []) + \
            ([_KEY] if unit.needs_rng else [])
        return tuple(unit.module(*args, *[state[s] for s in unit.state], *extras))

    def _forward(self, units: Any, state: Mapping[str, Any], uploaded: dict[str, Any]
                 ) -> None:
        vals: dict[str, Any] = dict(uploaded)
        with torch.no_grad():
            for u in units:
                args = [vals[v] for v in u.inputs]
                vals.update(zip(u.outputs, self._call(u, args, state)))

    def _forward_grad(self, u: UnitProgram, vals: dict[str, Any], uploaded: dict[str, Any],
                      leaves: dict[str, torch.Tensor], state: Mapping[str, Any],
                      from_host_only: bool = False) -> None:
        args = []
        for v in u.inputs:
            if v in vals and not from_host_only:
                x = vals[v]
            else:
                x = uploaded[v] if v in uploaded else uploaded.setdefault(v, self._upload(v))
            if isinstance(x, torch.Tensor) and v in self.carries and (
                    x.is_floating_point() or x.is_complex()):
                x = leaves[v] = x.detach().requires_grad_(True)
            args.append(x)
        with torch.enable_grad():
            vals.update(zip(u.outputs, self._call(u, args, state)))

    def _host_grads(self, kind: str, stop: int) -> frozenset[str]:
        """Values whose gradient a later stage's backward (run before this job) left on
        the host: those read after the stage, and the model outputs."""
        if kind != "bwd":
            return frozenset()
        later = {v for u in self.program.units[stop:] for v in u.inputs}
        later |= {o.value for o in self.program.outputs if o.value is not None}
        return frozenset(later & self.carries)

    def _host_grad(self, v: str, like: torch.Tensor, host: frozenset[str],
                   held: list[torch.Tensor]) -> torch.Tensor | None:
        if v not in host:
            return None
        g = torch.ones_like(like)  # uploaded; the runner holds uploads until the
        held.append(g)             # microbatch ends
        return g

    def _backward_unit(self, u: UnitProgram, vals: dict[str, Any],
                       acc: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor],
                       host: frozenset[str], held: list[torch.Tensor]) -> None:
        tensors, grads = [], []
        for v in u.outputs:
            out = vals.get(v)
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                continue
            g = acc.pop(v, None)
            if g is None:
                g = self._host_grad(v, out, host, held)
            if g is not None:
                tensors.append(out)
                grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for v in u.inputs:
            leaf = leaves.pop(v, None)
            if leaf is not None and leaf.grad is not None:
                if v in acc:
                    acc[v] = acc[v] + leaf.grad
                else:
                    earlier = self._host_grad(v, leaf.grad, host, held)
                    acc[v] = leaf.grad if earlier is None else earlier + leaf.grad

    def _backward_stage(self, kind: str, units: Any, state: Mapping[str, Any],
                        uploaded: dict[str, Any], host: frozenset[str],
                        held: list[torch.Tensor]) -> None:
        vals: dict[str, Any] = {}
        leaves: dict[str, torch.Tensor] = {}
        unit_leaves = []
        for u in units:  # every unit's graph kept until its backward
            mine: dict[str, torch.Tensor] = {}
            self._forward_grad(u, vals, uploaded, mine, state)
            unit_leaves.append(mine)
        acc: dict[str, torch.Tensor] = {}
        # the loss's leaves keep their gradients until the job ends, as the runner's do
        loss_leaves = self._loss(vals, uploaded, acc) if kind == "fused" else []
        for u, mine in zip(reversed(units), reversed(unit_leaves)):
            leaves.update(mine)
            self._backward_unit(u, vals, acc, leaves, host, held)
        del loss_leaves

    def _backward_layers(self, units: Any, state: Mapping[str, Any],
                         uploaded: dict[str, Any], host: frozenset[str],
                         held: list[torch.Tensor]) -> None:
        acc: dict[str, torch.Tensor] = {}
        for u in reversed(units):  # recompute one unit, run its backward, free it
            vals: dict[str, Any] = {}
            leaves: dict[str, torch.Tensor] = {}
            self._forward_grad(u, vals, uploaded, leaves, state, from_host_only=True)
            self._backward_unit(u, vals, acc, leaves, host, held)

    def _loss(self, vals: dict[str, Any], uploaded: dict[str, Any],
              acc: dict[str, torch.Tensor]) -> list[Any]:
        """A stand-in loss: the user's is unknown at plan time.  A cross-entropy over the
        last dimension, the usual one, holds the most: an output-sized float32
        log-softmax, and in its backward two output-sized gradients."""
        leaves = []
        for ref in self.program.outputs:
            if ref.value is None:
                continue
            base = vals[ref.value] if ref.value in vals else uploaded.setdefault(
                ref.value, self._upload(ref.value))
            if isinstance(base, torch.Tensor) and base.requires_grad:
                leaves.append((ref.value, base.detach().requires_grad_(True)))
        if not leaves:
            return leaves
        with torch.enable_grad():
            loss = sum(_cross_entropy(x) for _, x in leaves)
        loss.backward()  # type: ignore[union-attr]
        for name, leaf in leaves:
            if leaf.grad is not None:
                acc[name] = acc[name] + leaf.grad if name in acc else leaf.grad
        return leaves


def _cross_entropy(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        return x.float().sum()
    logits = x.float().reshape(-1, x.shape[-1])
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=x.device)
    return torch.nn.functional.cross_entropy(logits, target)


class ReplayFailed(Exception):
    """A stage's job does not replay on fake tensors (a module that rebinds its own
    parameters in forward, say), though the units ran on them once: the plan falls back to
    summed unit costs (compiler.make_plan)."""


# --- the process-wide replay cache ---------------------------------------------------------
class _ReplayCache:
    """Replay peaks by the content of their computation (``MemoryModel._replay_key``):
    a process often plans the same model several times (device counts, caps, re-created
    pipes).  Least recently used entries go first; shared by the threads that plan."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[Any, int] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> int | None:
        with self._lock:
            peak = self._entries.get(key)
            if peak is not None:
                self._entries.move_to_end(key)
            return peak

    def put(self, key: Any, peak: int) -> None:
        with self._lock:
            self._entries[key] = peak
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_REPLAYS = _ReplayCache(maxsize=2048)


def clear_replay_cache() -> None:
    """Forget every cached replay peak (tests compare with fresh replays)."""
    _REPLAYS.clear()


class _Keyed:
    """A unit's part of a key, its hash computed once (a key holds several)."""

    __slots__ = ("data", "hash")

    def __init__(self, data: tuple[Any, ...]) -> None:
        self.data = data
        self.hash = hash(data)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Keyed) and self.hash == other.hash
                                 and self.data == other.data)


class _Unkeyable(Exception):
    pass


_ATOMS = (int, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format)
_SEQUENCES = (tuple, list, immutable_list)
_MAPPINGS = (dict, immutable_dict)
_MAX_VALUE_NUMEL = 16  # tensors this small are keyed by value too (fake mode keeps 1)
_BUILTINS = frozenset({builtins.getattr, builtins.len, builtins.int, builtins.float,
                       builtins.bool, builtins.min, builtins.max, builtins.abs,
                       builtins.round, builtins.divmod, builtins.pow, builtins.sum,
                       builtins.range, builtins.slice})
_REGION_CALLS = {modes.enter_grad_mode: "enter_grad_mode",
                 modes.exit_grad_mode: "exit_grad_mode",
                 modes.enter_autocast: "enter_autocast",
                 modes.exit_autocast: "exit_autocast",
                 torch._C._set_grad_enabled: "torch._C._set_grad_enabled",
                 torch.amp.autocast_mode._enter_autocast: "_enter_autocast",
                 torch.amp.autocast_mode._exit_autocast: "_exit_autocast"}
_OP_NAMESPACES = ("aten", "prims")


def _constant_key(value: Any, positions: Mapping[torch.fx.Node, int] | None = None) -> Any:
    """An exact key of a constant (a node by its position when ``positions`` is given);
    raises _Unkeyable for anything else."""
    kind = type(value)
    if kind is torch.fx.Node:
        if positions is None or value not in positions:
            raise _Unkeyable(value)
        return ("node", positions[value])
    if kind is float:
        return (float, value.hex())  # -0.0 and 0.0 apart
    if kind in _ATOMS:
        return (kind, value)
    if kind is torch.device:
        return (torch.device, value.type, value.index)
    if value is Ellipsis:
        return ("...",)
    if kind is slice:
        return (slice, _constant_key(value.start, positions),
                _constant_key(value.stop, positions), _constant_key(value.step, positions))
    if kind in _SEQUENCES:
        return (kind, tuple(_constant_key(x, positions) for x in value))
    if kind in _MAPPINGS:
        return (kind, tuple((_constant_key(k), _constant_key(v, positions))
                            for k, v in value.items()))
    raise _Unkeyable(value)


def _tensor_bytes(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist())


def _tensor_key(t: Any) -> tuple[Any, ...] | None:
    """Everything of a tensor a fake replay can see; None when that is not all known."""
    try:
        if t.layout is not torch.strided:
            return None
        shape = tuple(t.shape)
        stride = t.stride()
        if not all(type(n) is int for n in shape + stride):
            return None  # symbolic sizes
        value: Any = None
        if type(t) is FakeTensor:
            if t.constant is not None:
                value = _tensor_bytes(t.constant)
        elif type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            if t.numel() <= _MAX_VALUE_NUMEL:
                value = _tensor_bytes(t)
        else:
            return None  # a subclass: its ops are its own
        return ("tensor", type(t), shape, stride, t.storage_offset(), t.dtype, t.device,
                t.is_conj(), t.is_neg(), t.requires_grad, t.is_inference(), value)
    except Exception:  # noqa: BLE001 - an unreadable tensor is not keyed
        return None


def _value_key(values: Mapping[str, Any], name: str) -> Any:
    if name not in values:
        return ("missing",)  # the replay fails (KeyError) and is not cached
    value = values[name]
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    try:
        return _constant_key(value)
    except _Unkeyable:
        return None


def _target_key(node: torch.fx.Node) -> Any:
    """The key of a call_function target whose behaviour its name fixes."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace in _OP_NAMESPACES:
            return ("op", target.name())
    elif isinstance(target, torch._ops.OpOverloadPacket):
        if target._qualified_op_name.split("::")[0] in _OP_NAMESPACES:
            return ("packet", target._qualified_op_name)
    elif target is rng.dropout or target is rng.native_dropout:
        return ("rng", target.__name__)
    elif target is rng.seeded:
        op = node.args[0] if node.args else None
        if isinstance(op, str) and (op.startswith("py:torch.")
                                    or op.split(".")[0] in _OP_NAMESPACES):
            return ("rng", "seeded")
    elif target in _REGION_CALLS:
        return ("mode", _REGION_CALLS[target])
    elif target in _BUILTINS:
        return ("builtins", target.__name__)
    elif getattr(target, "__module__", None) in ("_operator", "math") and getattr(
            operator if target.__module__ == "_operator" else math,
            getattr(target, "__name__", ""), None) is target:
        return (target.__module__, target.__name__)
    raise _Unkeyable(target)


def _unit_key(unit: UnitProgram) -> _Keyed | None:
    """A unit program's computation, node by node; None unless every call in it is fixed
    by its name (see MemoryModel._replay_key)."""
    module = unit.module
    if not isinstance(module, torch.fx.GraphModule) or "forward" in module.__dict__:
        return None
    if type(module.graph._codegen) is not torch.fx.graph.CodeGen:
        return None
    if any(getattr(module, table) for table in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")):
        return None
    positions: dict[torch.fx.Node, int] = {}
    nodes = []
    try:
        for node in module.graph.nodes:
            if node.op in ("placeholder", "output"):
                target: Any = node.target
            elif node.op == "call_method" and type(node.target) is str:
                target = node.target
            elif node.op == "get_attr":
                obj: Any = module
                for part in node.target.split("."):
                    obj = getattr(obj, part)
                target = (node.target, _tensor_key(obj) if isinstance(obj, torch.Tensor)
                          else None)
                if target[1] is None:
                    return None  # a submodule, a user object: not keyable
            elif node.op == "call_function":
                target = _target_key(node)
            else:
                return None  # call_module: a user's module
            nodes.append((node.op, target, _constant_key(node.args, positions),
                          _constant_key(node.kwargs, positions)))
            positions[node] = len(positions)
    except Exception:  # noqa: BLE001 - _Unkeyable, an unhashable target: not keyed
        return None
    return _Keyed((tuple(nodes), unit.inputs, unit.state, unit.outputs, unit.needs_device,
                   unit.needs_rng))


_MODULE_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks",
                 "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")


def _thread_modes() -> tuple[Any, ...] | None:
    """The modes of this thread the replay runs under; None when some are not keyable."""
    if (torch._C._is_any_autocast_enabled() or _get_current_dispatch_mode_stack()
            or _get_current_function_mode_stack()
            or any(getattr(nn_module, h, None) for h in _MODULE_HOOKS)):
        return None
    return (torch.get_default_dtype(), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled())


def build_memory_model(program: ModelProgram, state_tensors: Mapping[str, torch.Tensor],
                       example_inputs: Any, *, scale: float = 1.0, block_bytes: int = 1
                       ) -> MemoryModel | None:
    """Run the unit programs once on fake copies of the example: the values every replay
    starts from, and which of them carry gradients.  None when they do not run on fake
    tensors (data-dependent code): plans then fall back to summed unit costs."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    constants = program.constants
    try:
        with fake:
            state = {s.name: fake.from_tensor(state_tensors[s.name]
                                              if s.name in state_tensors
                                              else constants[s.name])
                     for s in program.state}
            trainable = frozenset(s.name for s in program.state if s.requires_grad)
            graded = {s: state[s].detach().requires_grad_(True) if s in trainable
                      else state[s] for s in state}
            values: dict[str, Any] = {}
            for name, value in zip(program.inputs.names, example_inputs):
                if name is not None:
                    values[name] = (fake.from_tensor(value) if isinstance(value, torch.Tensor)
                                    else value)
            with torch.enable_grad():
                for unit in program.units:
                    args = [values[v] for v in unit.inputs]
                    extras = ([torch.device("cpu")] if unit.needs_device else []) + \
                        ([_KEY] if unit.needs_rng else [])
                    outs = unit.module(*args, *[graded[s] for s in unit.state], *extras)
                    values.update(zip(unit.outputs, outs))
    except Exception as e:  # noqa: BLE001 - the estimate is optional
        log.info("roundpipe: the memory replay does not run on fake tensors (%s); stage "
                 "memory is estimated from summed unit costs", e)
        return None
    carries = frozenset(trainable | {v for v, x in values.items()
                                     if isinstance(x, torch.Tensor) and x.requires_grad})
    values = {v: x.detach() if isinstance(x, torch.Tensor) else x for v, x in values.items()}
    return MemoryModel(program=program, values=values, state=state, trainable=trainable,
                       carries=carries, scale=scale, block_bytes=block_bytes, fake_mode=fake)
