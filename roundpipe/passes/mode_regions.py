"""Inline export's grad-mode and autocast sub-graphs, marking each node with its regions.

``torch.export`` turns ``with torch.no_grad():`` (and ``set_grad_enabled``,
``torch.autocast``) inside a model into a higher-order op that calls a sub-graph::

    wrap_with_set_grad_enabled = higher_order.wrap_with_set_grad_enabled(
        False, submod_4, b_ema, x, b_calls)           # submod_4: ema.mul_(0.9).add_(...)
    add_ = wrap_with_set_grad_enabled[0]

Everything that reads the flat graph (in-place writes to buffers, keyed random ops, layer
units, costs) would have to look inside those sub-graphs, and a write there was silently
never committed.  This pass splices the sub-graph's nodes into the parent instead::

    mul_ = aten.mul_.Tensor(b_ema, 0.9)                # meta["roundpipe.modes"] =
    ...                                                #   (Region("grad", (False,)),)
    add_ = aten.add_.Tensor(mul_, mul)

The marks say which regions (outermost first) a node ran in; codegen enters and leaves them
inside each unit program (:mod:`roundpipe.ops.modes`), so a region never spans two units and
unit boundaries stay where the layers pass puts them.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx
from torch.fx.node import map_aggregate

from ..errors import TraceError

MODES = "roundpipe.modes"


@dataclass(frozen=True)
class Region:
    """A grad-mode or autocast region: ``kind`` is ``"grad"`` (``args``: ``(enabled,)``)
    or ``"autocast"`` (``args``: ``(device_type, dtype, enabled, cache_enabled)``)."""

    kind: str
    args: tuple[Any, ...]


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name, None)


# higher-order op -> (region kind, number of leading arguments that describe the region)
_REGION_OPS: dict[Any, tuple[str, int]] = {
    op: spec for op, spec in ((_higher_order("wrap_with_set_grad_enabled"), ("grad", 1)),
                              (_higher_order("wrap_with_autocast"), ("autocast", 4)))
    if op is not None
}


def inline_mode_regions(gm: torch.fx.GraphModule) -> int:
    """Splice every grad-mode / autocast sub-graph of ``gm`` (nested ones too) into its
    graph, in place; returns how many were inlined."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _REGION_OPS:
            count += _inline(gm, node)
    if count:
        for node in list(gm.graph.nodes):  # the sub-graph modules nobody calls any more
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.delete_all_unused_submodules()
        gm.recompile()
    return count


def _inline(owner: torch.fx.GraphModule, call: torch.fx.Node) -> int:
    """Replace ``call``, a region op of ``owner``'s graph, by copies of its sub-graph's
    nodes (its own nested regions inlined first), inserted before it."""
    kind, n_region_args = _REGION_OPS[call.target]
    region = Region(kind, tuple(call.args[:n_region_args]))
    sub_ref, operands = call.args[n_region_args], call.args[n_region_args + 1:]
    if call.kwargs or not isinstance(sub_ref, torch.fx.Node) or sub_ref.op != "get_attr":
        raise TraceError(f"torch.export produced {call.format_node()}, a grad-mode or "
                         "autocast region roundpipe cannot read; please report it")
    sub: torch.fx.GraphModule = _get_attr(owner, sub_ref.target)
    count = 1
    for inner in list(sub.graph.nodes):
        if inner.op == "call_function" and inner.target in _REGION_OPS:
            count += _inline(sub, inner)
    graph = owner.graph
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, operands))
    results: tuple[Any, ...] = ()
    with graph.inserting_before(call):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = tuple(env[a] if isinstance(a, torch.fx.Node) else a
                                for a in inner.args[0])
                continue
            copy = graph.node_copy(inner, lambda a: env[a])
            if inner.op == "get_attr":  # re-rooted: the attribute lives on the sub-graph
                copy.target = _hoist(owner, sub, inner.target)
            copy.meta = dict(inner.meta)
            copy.meta[MODES] = (region,) + tuple(inner.meta.get(MODES, ()))
            if "nn_module_stack" not in copy.meta and "nn_module_stack" in call.meta:
                copy.meta["nn_module_stack"] = dict(call.meta["nn_module_stack"])
            env[inner] = copy
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            value = results[user.args[1]]
            if isinstance(value, torch.fx.Node):
                user.replace_all_uses_with(value)
            else:  # a constant result (None)
                for reader in list(user.users):
                    reader.args, reader.kwargs = map_aggregate(
                        (reader.args, reader.kwargs), lambda a: value if a is user else a)
            graph.erase_node(user)
        else:
            raise TraceError(f"{user.format_node()} reads a grad-mode or autocast region's "
                             "results as a whole, which roundpipe cannot inline; please "
                             "report it")
    graph.erase_node(call)
    return count


_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def mark_mode_regions(graph: torch.fx.Graph, initial_grad: bool) -> int:
    """Turn in-graph mode calls (``torch._C._set_grad_enabled(v)``, ``_enter_autocast``
    ... ``_exit_autocast``: Dynamo's graphs, and export's before it wraps them into
    sub-graphs) into ``meta[MODES]`` marks on the nodes they govern, and remove them.

    A grad region is recorded only where the mode differs from ``initial_grad``, the mode
    the graph was traced in: elsewhere a node runs in whatever mode its job runs (no grad in
    forward jobs).  Returns how many calls were removed.
    """
    grad = initial_grad
    autocast: list[tuple[torch.fx.Node, Region]] = []
    calls: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.op != "call_function":
            if node.op in ("call_method", "call_module"):
                node.meta[MODES] = (_current(autocast, grad, initial_grad)
                                    + tuple(node.meta.get(MODES, ())))
            continue
        if node.target is torch._C._set_grad_enabled:
            grad = bool(node.args[0])
            calls.append(node)
        elif node.target is _ENTER_AUTOCAST:
            autocast.append((node, Region("autocast", tuple(node.args))))
            calls.append(node)
        elif node.target is _EXIT_AUTOCAST:
            entered = node.args[0] if node.args else None
            autocast = [(n, r) for n, r in autocast if n is not entered]
            calls.append(node)
        else:  # inside regions inlined from export's sub-graphs, if any
            node.meta[MODES] = (_current(autocast, grad, initial_grad)
                                + tuple(node.meta.get(MODES, ())))
    for node in reversed(calls):
        if any(u not in calls for u in node.users):
            raise TraceError(f"{node.format_node()} is read by other nodes than the mode "
                             "calls; roundpipe cannot turn it into a region")
        graph.erase_node(node)
    return len(calls)


def _current(autocast: list[tuple[torch.fx.Node, Region]], grad: bool,
             initial_grad: bool) -> tuple[Region, ...]:
    regions = tuple(r for _, r in autocast)
    return regions + ((Region("grad", (grad,)),) if grad != initial_grad else ())


@contextlib.contextmanager
def export_keeps_mode_calls() -> Iterator[None]:
    """While exporting, keep grad-mode and autocast changes as plain calls in the graph
    (for :func:`mark_mode_regions`) instead of letting export wrap them into sub-graphs:
    torch 2.13's wrapping loses a ``no_grad`` block nested in a ``torch.autocast`` one
    (its ops run with grad enabled, and a buffer written there gets a graph).  Where the
    passes cannot be switched off, :func:`inline_mode_regions` reads the sub-graphs."""
    patched = []
    for module_name, name in _EXPORT_WRAPPING_PASSES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            patched.append((module, name, getattr(module, name)))
            setattr(module, name, _keep_graph)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


_EXPORT_WRAPPING_PASSES = (
    ("torch._export.passes.replace_set_grad_with_hop_pass", "replace_set_grad_with_hop_pass"),
    ("torch._export.passes.replace_autocast_with_hop_pass", "replace_autocast_with_hop_pass"),
)


def _keep_graph(gm: Any, signature: Any) -> tuple[Any, Any]:
    return gm, signature


@contextlib.contextmanager
def fx_records_grad_mode(tracer: torch.fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces a model on this thread, record the model's grad-mode
    changes (``torch.no_grad()`` and friends, which fx runs but does not see) as
    ``torch._C._set_grad_enabled`` calls in its graph, for :func:`mark_mode_regions`."""
    original = torch._C._set_grad_enabled
    tracing_thread = threading.get_ident()

    def recording(mode: bool) -> None:
        graph = getattr(tracer, "graph", None)
        if threading.get_ident() == tracing_thread and graph is not None:
            graph.call_function(original, (bool(mode),))
        original(mode)

    torch._C._set_grad_enabled = recording
    try:
        yield
    finally:
        torch._C._set_grad_enabled = original


@contextlib.contextmanager
def inference_mode_as_no_grad() -> Iterator[None]:
    """While tracing, ``torch.inference_mode()`` blocks act as ``torch.no_grad()``: export
    writes their ops out as plain ops, and gradients would then flow through them.  The
    numbers are the same either way (a model that works eagerly never differentiates
    through an inference tensor)."""
    cls = torch.inference_mode
    enter, exit_ = cls.__enter__, cls.__exit__
    tracing_thread = threading.get_ident()

    # Only the tracing thread's blocks change: other threads (workers of other pipes
    # running opaque modules) keep inference mode, and a block entered before the patch
    # leaves as it entered.
    def as_grad_mode_enter(self: Any) -> None:
        if threading.get_ident() != tracing_thread:
            return enter(self)
        self._roundpipe_grad_mode = torch.set_grad_enabled(not self.mode)
        self._roundpipe_grad_mode.__enter__()

    def as_grad_mode_exit(self: Any, *exc: Any) -> None:
        grad_mode = self.__dict__.pop("_roundpipe_grad_mode", None)
        if grad_mode is None:
            return exit_(self, *exc)
        grad_mode.__exit__(*exc)

    cls.__enter__, cls.__exit__ = as_grad_mode_enter, as_grad_mode_exit  # type: ignore
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_  # type: ignore[method-assign]


def _get_attr(owner: torch.nn.Module, target: str) -> Any:
    obj: Any = owner
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _hoist(gm: torch.fx.GraphModule, sub: torch.nn.Module, target: str) -> str:
    """Register ``sub``'s attribute ``target`` on ``gm`` under a fresh name."""
    value = _get_attr(sub, target)
    base = "_region_" + target.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    if isinstance(value, torch.nn.Module):
        gm.add_module(name, value)
    elif isinstance(value, torch.nn.Parameter):
        gm.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        gm.register_buffer(name, value)
    else:
        setattr(gm, name, value)
    return name
