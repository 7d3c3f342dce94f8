"""Trace each distinct repeated block once and copy its graph into the others.

``torch.export`` costs tens of milliseconds per traced op (fake tensors, symbolic shapes,
functionalization), so a 512-layer model takes most of a minute, nearly all of it spent
re-tracing identical blocks.  While export runs, every repeated block's ``forward`` is a
wrapper that does this instead::

    # 1. fingerprint: run the block on static fake tensors under a recording dispatch
    #    mode; every aten op is recorded with its arguments (a tensor by where it came
    #    from: input i, parameter "attn.qkv.weight", output j of op k; anything else by
    #    value or identity).  Same fingerprint and same symbolic input shapes: the same
    #    exported nodes, whatever the block's Python looked like.
    # 2. the first block with a new key is traced for real, between two marker ops:
    h_0_in = roundpipe.block_enter([x], site=0)
    ...                                        # the aten ops of h.0
    h_0_out = roundpipe.block_exit([add_3], site=0)
    # 3. a later block with the same key is one op, its fake outputs shaped like h.0's:
    h_1_out = roundpipe.block_call([add_3, p_h_1_ln_1_weight, ...], site=1)
    # 4. after export (splice_blocks), each block_call becomes a copy of h.0's nodes that
    #    reads h.1's inputs and parameters, and the markers are removed.

Export also spends as long on each parameter as on a few ops (a fake copy, a placeholder),
so the state of the blocks that will be copies is hidden from it (``hide_state``): it is
taken out of their modules while export runs, and :func:`add_hidden_state` gives it
placeholders afterwards.  Should such a block have to be traced after all (its inputs
differ from its look-alikes'), :class:`SharingFailed` asks for a trace without hiding.

A block that writes to its inputs, its state or any tensor it did not create (BatchNorm
running statistics, a call counter), or that cannot run on static fake tensors, is traced
normally: only pure functions of (inputs, state) are copied.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .leaves import replaced_forward

log = logging.getLogger(__name__)


class SharingFailed(Exception):
    """The traced graph could not be spliced; the caller exports without sharing."""


@dataclass
class _Site:
    """One wrapped block call seen while exporting."""

    path: str
    num_inputs: int
    state: dict[str, torch.Tensor]  # local name -> the model's tensor
    rep: int | None = None  # site id of the traced block this call copies (None: traced)
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)  # fake tensors or constants


@dataclass
class SharedTrace:
    """What :func:`shared_blocks` learnt while export ran."""

    sites: dict[int, _Site] = field(default_factory=dict)
    # State taken out of the modules while export ran: (fully-qualified name, tensor, kind).
    hidden: list[tuple[str, torch.Tensor, str]] = field(default_factory=list)


_SITES: dict[int, _Site] = {}
_NEXT_SITE = itertools.count()


def _like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in tensors]


@torch.library.custom_op("roundpipe::block_enter", mutates_args=())
def block_enter(tensors: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    """Marks where a traced block's inputs enter it; removed after export."""
    raise RuntimeError("roundpipe::block_enter is a tracing marker and never runs")


@torch.library.custom_op("roundpipe::block_exit", mutates_args=())
def block_exit(tensors: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    """Marks a traced block's outputs; removed after export."""
    raise RuntimeError("roundpipe::block_exit is a tracing marker and never runs")


@torch.library.custom_op("roundpipe::block_call", mutates_args=())
def block_call(tensors: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    """Stands for a block that computes what a traced one does; replaced after export."""
    raise RuntimeError("roundpipe::block_call is a tracing placeholder and never runs")


block_enter.register_fake(lambda tensors, site: _like(tensors))
block_exit.register_fake(lambda tensors, site: _like(tensors))


@block_call.register_fake
def _block_call_fake(tensors: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    rep = _SITES[_SITES[site].rep]  # type: ignore[index]
    return _like([t for t in rep.out_leaves if isinstance(t, torch.Tensor)])


_ENTER = torch.ops.roundpipe.block_enter.default
_EXIT = torch.ops.roundpipe.block_exit.default
_CALL = torch.ops.roundpipe.block_call.default


class _NotShareable(Exception):
    """This block call is traced normally."""


# --- fingerprints ------------------------------------------------------------------------

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, type(Ellipsis))


_METADATA_QUERIES = frozenset(getattr(torch.ops.prim, name).default
                              for name in ("device", "layout") if hasattr(torch.ops.prim, name))


class _Recorder(TorchDispatchMode):
    """Records every aten op with its arguments described by provenance."""

    def __init__(self, refs: dict[int, Any], guarded: set[Any]) -> None:
        super().__init__()
        self.refs = refs          # tensor id -> provenance
        self.guarded = guarded    # storages the block must not write (inputs, state)
        self.ops: list[Any] = []
        self.keep: list[Any] = []  # keeps every described tensor alive: ids stay unique

    def describe(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            ref = self.refs.get(id(x))
            if ref is None:  # a tensor the block did not get or make: same object only
                self.keep.append(x)
                ref = self.refs[id(x)] = ("ext", id(x))
            return ref
        if isinstance(x, _PLAIN):
            return (type(x).__name__, x)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _NotShareable("symbolic value inside a fake run")
        return ("obj", type(x).__qualname__, id(x))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_QUERIES:  # x.device and the like: no node in any graph
            return func(*args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in pytree.tree_leaves(value):
                    if isinstance(t, torch.Tensor) and (
                            self.refs.get(id(t), ("ext",))[0] == "ext"
                            or _storage(t) in self.guarded):
                        raise _NotShareable(f"{func} writes a tensor the block did not make")
        record = (func, str(spec), torch.is_grad_enabled(),
                  tuple(self.describe(x) for x in flat))
        out = func(*args, **kwargs)
        k = len(self.ops)
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.refs.setdefault(id(t), ("op", k, j))
                self.keep.append(t)
        self.ops.append(record)
        return out


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _hint(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        if hint is None:
            raise _NotShareable("a data-dependent size")
        return int(hint)
    return x


# nn.Module's own __call__ and __getattr__: export's tracer patches the class while it
# runs, to track which module each op comes from.
_MODULE_CALL = torch.nn.Module.__call__
_MODULE_GETATTR = torch.nn.Module.__getattr__


@contextlib.contextmanager
def _outside_export() -> Iterator[None]:
    """Step out of export's tracing for a private fake run: its modes, and its patches of
    nn.Module (an exception inside a patched call would leave its module stack
    unbalanced).  Nothing done here reaches export's graph."""
    function_modes = []
    while torch._C._len_torch_function_stack() > 0:
        function_modes.append(torch._C._pop_torch_function_stack())
    patched = (torch.nn.Module.__call__, torch.nn.Module.__getattr__)
    torch.nn.Module.__call__ = _MODULE_CALL  # type: ignore[method-assign]
    torch.nn.Module.__getattr__ = _MODULE_GETATTR  # type: ignore[method-assign]
    try:
        with _disable_current_modes():
            yield
    finally:
        torch.nn.Module.__call__, torch.nn.Module.__getattr__ = patched  # type: ignore
        for mode in reversed(function_modes):
            torch._C._push_on_torch_function_stack(mode)


def _fingerprint(mode: FakeTensorMode, forward: Callable[..., Any], module: torch.nn.Module,
                 state: dict[str, torch.Tensor], flat: list[Any], in_spec: Any) -> Any:
    """What the block computes on these inputs, as a hashable value (see module doc)."""
    with _outside_export():
        refs: dict[int, Any] = {}
        fake_state: dict[str, torch.Tensor] = {}
        by_id: dict[int, torch.Tensor] = {}
        inputs: list[Any] = []
        with mode:
            # Values never matter to a fake run: empty tensors of the right layout will do
            # (and cost a fraction of converting the real ones).
            for name, real in state.items():
                if id(real) not in by_id:
                    by_id[id(real)] = _empty_like(real, real.shape, real.stride())
                    refs[id(by_id[id(real)])] = ("state", name)
                fake_state[name] = by_id[id(real)]
            for i, x in enumerate(flat):
                if isinstance(x, torch.Tensor):
                    x = _empty_like(x, [_hint(s) for s in x.shape],
                                    [_hint(s) for s in x.stride()])
                    refs[id(x)] = ("in", i)
                inputs.append(x)
        guarded = {_storage(t) for t in itertools.chain(fake_state.values(), inputs)
                   if isinstance(t, torch.Tensor)}
        recorder = _Recorder(refs, guarded)
        recorder.keep.extend(inputs)
        args, kwargs = pytree.tree_unflatten(inputs, in_spec)
        with _reparametrize_module(module, fake_state), mode, recorder:
            out = forward(*args, **kwargs)
        out_flat, out_spec = pytree.tree_flatten(out)
        return (tuple(recorder.ops), str(out_spec),
                tuple(recorder.describe(x) for x in out_flat))


def _empty_like(t: torch.Tensor, shape: Any, stride: Any) -> torch.Tensor:
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


# Module attributes that never change what forward computes.
_IGNORED_ATTRIBUTES = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks"})


def attribute_key(module: torch.nn.Module) -> Any:
    """Everything about ``module`` and its submodules that forward's Python can see,
    except parameter and buffer values: classes, state names and layouts, plain
    attributes by value, any other attribute (a config, a function, a hook) by identity.
    Two blocks with equal keys trace to the same graph on the same inputs."""
    entries = []
    for name, m in module.named_modules(remove_duplicate=False):
        attrs = []
        for key, value in vars(m).items():
            if key in _IGNORED_ATTRIBUTES:
                continue
            if key.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) \
                    and isinstance(value, dict):
                value = tuple(value.values())  # handle ids differ; the functions matter
            attrs.append((key, _value_key(value)))
        state = tuple((n, tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
                      for n, t in itertools.chain(m._parameters.items(), m._buffers.items())
                      if t is not None)
        entries.append((name, type(m), tuple(sorted(attrs, key=lambda a: a[0])), state))
    return tuple(entries)


def _value_key(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_value_key(k), _value_key(v)) for k, v in value.items()))
    return ("id", id(value))


def _shape_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(str(s) for s in x.shape), tuple(str(s) for s in x.stride()),
                x.dtype, str(x.device), x.requires_grad)
    return ("const", type(x).__name__, x if isinstance(x, _PLAIN) else id(x))


# --- during export -----------------------------------------------------------------------

def repeated_groups(model: torch.nn.Module, roots: tuple[str, ...]) -> tuple[str, ...]:
    """The roots worth wrapping: blocks with at least one sibling of the same class and
    parameter shapes (a block without one has nothing to share)."""
    def key(path: str) -> Any:
        m = model.get_submodule(path)
        return (type(m), tuple((n, tuple(t.shape), t.dtype) for n, t in
                               itertools.chain(m.named_parameters(remove_duplicate=False),
                                               m.named_buffers(remove_duplicate=False))))
    counts: dict[Any, int] = {}
    keys = {p: key(p) for p in roots}
    for k in keys.values():
        counts[k] = counts.get(k, 0) + 1
    return tuple(p for p in roots if counts[keys[p]] > 1)


@contextlib.contextmanager
def shared_blocks(model: torch.nn.Module, paths: tuple[str, ...], hide_state: bool = False
                  ) -> Iterator[SharedTrace]:
    """While active, the blocks at ``paths`` trace once per distinct computation.

    Yields a :class:`SharedTrace`, filled in as export runs; :func:`add_hidden_state` and
    :func:`splice_blocks` need it.  With ``hide_state``, the state of every block but the
    first two of each look-alike group is hidden from export.
    """
    result = SharedTrace()
    if not paths:
        yield result
        return
    used = result.sites
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # one for every run: its cache helps
    traced_once: dict[Any, int] = {}
    unshareable: set[Any] = set()
    attributes = {p: ("attributes", attribute_key(model.get_submodule(p))) for p in paths}
    attribute_counts: dict[Any, int] = {}
    for key in attributes.values():
        attribute_counts[key] = attribute_counts.get(key, 0) + 1
    real_state = {p: dict(itertools.chain(
        model.get_submodule(p).named_parameters(remove_duplicate=False),
        model.get_submodule(p).named_buffers(remove_duplicate=False))) for p in paths}
    hidden_blocks: set[str] = set()
    if hide_state:
        seen: dict[Any, int] = {}
        for p in paths:
            seen[attributes[p]] = seen.get(attributes[p], 0) + 1
            if attribute_counts[attributes[p]] > 1 and seen[attributes[p]] > 2:
                hidden_blocks.add(p)

    def make_forward(path: str, module: torch.nn.Module) -> Callable[..., Any]:
        inner = module.forward

        def forward(*f_args: Any, **f_kwargs: Any) -> Any:
            flat, in_spec = pytree.tree_flatten((f_args, f_kwargs))
            with _outside_export():  # reading shapes through export's modes is slow
                shapes = (str(in_spec), tuple(_shape_key(x) for x in flat))
            key = (attributes[path], shapes)
            unique = attribute_counts[attributes[path]] == 1
            if path in hidden_blocks and (key not in traced_once or key in unshareable):
                raise SharingFailed(f"{path} has to be traced, but its state is hidden")
            if unique or key not in traced_once:
                # The first of a look-alike group is checked for writes to what it did
                # not make (nothing is copied if it does); a block no other looks like (a
                # per-layer index, say) is compared by what it computes instead.
                if key in unshareable:
                    return inner(*f_args, **f_kwargs)
                try:
                    computation = _fingerprint(mode, inner, module, real_state[path], flat,
                                               in_spec)
                except Exception as e:  # noqa: BLE001 - any failure: export traces it
                    log.debug("roundpipe: %s is traced on its own: %s", path, e)
                    unshareable.add(key)
                    return inner(*f_args, **f_kwargs)
                if unique:
                    key = (computation, shapes)
            tensor_pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
            site = _Site(path, len(tensor_pos), dict(real_state[path]))
            sid = next(_NEXT_SITE)
            _SITES[sid] = used[sid] = site
            rep = traced_once.get(key)
            if rep is None:
                traced_once[key] = sid
                entered = iter(block_enter([flat[i] for i in tensor_pos], sid))
                flat = [next(entered) if isinstance(x, torch.Tensor) else x for x in flat]
                args, kwargs = pytree.tree_unflatten(flat, in_spec)
                out_flat, site.out_spec = pytree.tree_flatten(inner(*args, **kwargs))
                exited = iter(block_exit([x for x in out_flat if isinstance(x, torch.Tensor)],
                                         sid))
                site.out_leaves = [next(exited) if isinstance(x, torch.Tensor) else x
                                   for x in out_flat]
                return pytree.tree_unflatten(site.out_leaves, site.out_spec)
            site.rep = rep
            outs = iter(block_call([flat[i] for i in tensor_pos], sid))
            template = _SITES[rep]
            return pytree.tree_unflatten(
                [next(outs) if isinstance(x, torch.Tensor) else x for x in template.out_leaves],
                template.out_spec)
        return forward

    try:
        with contextlib.ExitStack() as stack:
            for path in paths:
                module = model.get_submodule(path)
                stack.enter_context(replaced_forward(module, make_forward(path, module)))
            if hidden_blocks:
                stack.enter_context(_hidden_state(model, hidden_blocks, result.hidden))
            yield result
    finally:
        for sid in used:
            _SITES.pop(sid, None)


@contextlib.contextmanager
def _hidden_state(model: torch.nn.Module, blocks: set[str],
                  hidden: list[tuple[str, torch.Tensor, str]]) -> Iterator[None]:
    """Take the state only ``blocks`` hold out of their modules (appending it to
    ``hidden``), and put it back on exit.  Modules and tensors that anything else in the
    model also holds (a shared projection, a tied weight) stay."""
    elsewhere_modules: set[int] = set()
    elsewhere_tensors: set[int] = set()

    def visit(module: torch.nn.Module, path: str) -> None:
        if path in blocks or id(module) in elsewhere_modules:
            return
        elsewhere_modules.add(id(module))
        elsewhere_tensors.update(id(t) for t in itertools.chain(
            module._parameters.values(), module._buffers.values()) if t is not None)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    saved: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]] = []
    done: set[int] = set()
    try:
        for path in sorted(blocks):
            for local, module in model.get_submodule(path).named_modules(
                    prefix=path, remove_duplicate=False):
                if id(module) in elsewhere_modules or id(module) in done:
                    continue
                done.add(id(module))
                params, buffers = module._parameters, module._buffers
                saved.append((module, params, buffers))
                module._parameters = {k: v for k, v in params.items()
                                      if v is None or id(v) in elsewhere_tensors}
                module._buffers = {k: v for k, v in buffers.items()
                                   if v is None or id(v) in elsewhere_tensors}
                for kind, before, after in (("parameter", params, module._parameters),
                                            ("buffer", buffers, module._buffers)):
                    hidden.extend((f"{local}.{k}", v, kind) for k, v in before.items()
                                  if k not in after)
        yield
    finally:
        for module, params, buffers in saved:
            module._parameters, module._buffers = params, buffers


def add_hidden_state(gm: torch.fx.GraphModule, hidden: list[tuple[str, torch.Tensor, str]],
                     first_input: torch.fx.Node | None
                     ) -> dict[torch.fx.Node, tuple[str, torch.Tensor, str]]:
    """Give every hidden tensor a placeholder among the state placeholders (before
    ``first_input``, the first user input, as export orders them); a tensor held under two
    names gets one."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    made: dict[torch.fx.Node, tuple[str, torch.Tensor, str]] = {}
    seen: set[int] = set()
    for fqn, tensor, kind in hidden:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        name = ("p_" if kind == "parameter" else "b_") + fqn.replace(".", "_")
        with graph.inserting_before(first_input) if first_input is not None \
                else graph.inserting_after(placeholders[-1]):
            node = graph.placeholder(name)
        made[node] = (fqn, tensor, kind)
    return made


# --- after export ------------------------------------------------------------------------

def splice_blocks(gm: torch.fx.GraphModule, sites: dict[int, _Site],
                  tensor_of: dict[torch.fx.Node, torch.Tensor]) -> tuple[str, ...]:
    """Replace every ``block_call`` with a copy of its traced block and drop the markers.

    Args:
        gm: the exported graph module.
        sites: what :func:`shared_blocks` yielded.
        tensor_of: the model tensor behind each state placeholder.

    Returns the paths of the blocks whose nodes are copies.  The caller recompiles
    ``gm``.

    Raises:
        SharingFailed: a traced block's nodes are read outside it (the graph then cannot be
            copied safely; export again without sharing).
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    node_of = {id(t): n for n, t in tensor_of.items()}
    enter: dict[int, torch.fx.Node] = {}
    exit_: dict[int, torch.fx.Node] = {}
    calls: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (_ENTER, _EXIT, _CALL):
            sid = node.args[1]
            {_ENTER: enter, _EXIT: exit_}.get(node.target, {})[sid] = node
            if node.target is _CALL:
                calls.append(node)
    regions: dict[int, list[torch.fx.Node]] = {}
    for sid, start in enter.items():
        if sid not in exit_:
            raise SharingFailed(f"block {sites[sid].path} has no exit marker")
        regions[sid] = [n for n in graph.nodes
                        if order[start] < order[n] < order[exit_[sid]]
                        and not _reads(n, start)]
    for call in calls:
        site = sites[call.args[1]]
        rep_sid = site.rep
        if rep_sid not in regions:
            raise SharingFailed(f"block {site.path} copies a block that was not traced")
        rep = sites[rep_sid]
        args = list(call.args[0])
        env: dict[torch.fx.Node, Any] = {}
        for user in enter[rep_sid].users:
            env[user] = args[user.args[1]]
        rep_local = {id(t): name for name, t in rep.state.items()}
        region = regions[rep_sid]
        members = set(region)
        with graph.inserting_before(call):
            for node in region:
                for inp in node.all_input_nodes:
                    if inp in env or inp in members:
                        continue
                    local = rep_local.get(id(tensor_of.get(inp)))
                    if local is not None:
                        own = node_of.get(id(site.state[local]))
                        if own is None:
                            raise SharingFailed(f"{site.path}.{local} has no placeholder")
                        env[inp] = own
                    elif inp.op == "call_function" and isinstance(
                            inp.meta.get("val"), torch.Tensor):
                        raise SharingFailed(f"block {rep.path} reads {inp.name}, an "
                                            "activation it was not passed")
                new = graph.node_copy(node, lambda n: env.get(n, n))
                new.meta = _moved_meta(node.meta, rep.path, site.path,
                                       call.meta.get("nn_module_stack"))
                env[node] = new
        outs = [env.get(a, a) for a in exit_[rep_sid].args[0]]
        for user in list(call.users):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(call)
    for sid, start in enter.items():
        region = set(regions[sid])
        for node in region:
            if any(u not in region and u is not exit_[sid] and not _is_symbolic(node)
                   for u in node.users):
                raise SharingFailed(f"block {sites[sid].path}: {node.name} is read "
                                    "outside the block")
        for marker in (start, exit_[sid]):
            inputs = marker.args[0]
            for user in list(marker.users):
                user.replace_all_uses_with(inputs[user.args[1]])
                graph.erase_node(user)
            graph.erase_node(marker)
    return tuple(sites[c.args[1]].path for c in calls)


def _reads(node: torch.fx.Node, marker: torch.fx.Node) -> bool:
    """``node`` is ``marker[i]`` (the marker's output unpacking, not block code)."""
    return node.op == "call_function" and node.args[:1] == (marker,)


def _is_symbolic(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _moved_meta(meta: dict[str, Any], rep_path: str, path: str,
                call_stack: dict[str, Any] | None) -> dict[str, Any]:
    """The copy's metadata: the call's module stack, then the traced block's entries
    inside it moved from ``rep_path`` to ``path``."""
    from .trace import _normalize_path  # avoids a cycle
    new = dict(meta)
    stack = dict(call_stack or {})
    for key, (where, cls) in (meta.get("nn_module_stack") or {}).items():
        where = _normalize_path(where)
        if where.startswith(rep_path + "."):
            stack[f"{key}@{path}"] = (path + where[len(rep_path):], cls)
    new["nn_module_stack"] = stack
    new.pop("unbacked_bindings", None)
    return new
