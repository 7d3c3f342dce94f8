"""Trace each distinct repeated block once and copy its graph into the others.

``torch.export`` costs tens of milliseconds per traced op (fake tensors, symbolic shapes,
functionalization) and about as much per parameter, so a 512-layer model takes most of a
minute, nearly all of it spent re-tracing identical blocks.  While export runs, every
repeated block's ``forward`` is a wrapper that does this instead::

    # 1. key the call: the block's attribute key and the symbolic layout of its inputs
    #    (roundpipe.passes.block_keys); a block no other looks like (a per-layer index)
    #    is keyed by the fingerprint of what it computes instead.
    # 2. the first block with a new key is traced for real, between two marker ops:
    h_0_in = roundpipe.block_enter([x], site=0)
    ...                                        # the aten ops of h.0
    h_0_out = roundpipe.block_exit([add_3], site=0)
    # 3. a later block with the same key is one op, its fake outputs shaped like h.0's:
    h_1_out = roundpipe.block_call([add_3], site=1)
    # 4. after export (splice_blocks), each block_call becomes a copy of h.0's nodes that
    #    reads h.1's inputs and parameters, and the markers are removed.

The state of the blocks that will be copies is hidden from export (``hide_state``): it is
taken out of their modules while export runs, and :func:`add_hidden_state` gives it
placeholders afterwards.  Should such a block have to be traced after all (its inputs
differ from its look-alikes'), or should the model's own code read that state,
:class:`SharingFailed` asks for a trace without hiding; a graph that cannot be spliced
(a block reads a value it was neither passed nor holds) asks for one without sharing.

Blocks that are not shareable (they write their inputs or state, read tensors they were
not passed, set attributes; see ``block_keys``), and blocks called under ``no_grad`` or
autocast (export wraps those regions into sub-graphs), are traced normally.
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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .block_keys import (WRAPPER_MARK, attribute_key, fingerprint, has_symbolic_size,
                         input_key, outside_export, state_layout)
from .leaves import replaced_forward
from .tensor_hooks import TENSOR_HOOK_OP

log = logging.getLogger(__name__)


class HookedBlock(Exception):
    """A block to copy registers a tensor hook (export again without sharing)."""


class SharingFailed(Exception):
    """Sharing cannot go on as asked (a hidden block must be traced, the model read hidden
    state, the graph cannot be spliced); the caller exports again with less of it."""


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


# --- during export -----------------------------------------------------------------------

def _state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(itertools.chain(module.named_parameters(remove_duplicate=False),
                                module.named_buffers(remove_duplicate=False)))


def repeated_groups(model: torch.nn.Module, roots: tuple[str, ...]) -> tuple[str, ...]:
    """The roots worth wrapping: blocks with at least one sibling of the same class and
    state layout (a block without one has nothing to share)."""
    keys = {p: (type(model.get_submodule(p)), state_layout(_state_of(model.get_submodule(p))))
            for p in roots}
    counts: dict[Any, int] = {}
    for k in keys.values():
        counts[k] = counts.get(k, 0) + 1
    return tuple(p for p in roots if counts[keys[p]] > 1)


class _Watch:
    """Notices reads of hidden state by the model's own code while export traces it."""

    def __init__(self) -> None:
        self.armed = False
        self.touched: str | None = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        armed, self.armed = self.armed, False
        try:
            yield
        finally:
            self.armed = armed


class _WatchedDict(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` or ``_buffers`` with some entries hidden; any read while
    the watch is armed is recorded (the model's code then saw the state missing)."""

    def __init__(self, entries: dict[str, Any], watch: _Watch, path: str) -> None:
        super().__init__(entries)
        self._watch, self._path = watch, path

    def _seen(self) -> None:
        if self._watch.armed and self._watch.touched is None:
            self._watch.touched = self._path

    def __getitem__(self, key: Any) -> Any:
        self._seen()
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self._seen()
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Any]:
        self._seen()
        return super().__iter__()

    def __len__(self) -> int:
        self._seen()
        return super().__len__()

    def get(self, key: Any, default: Any = None) -> Any:
        self._seen()
        return super().get(key, default)

    def items(self) -> Any:
        self._seen()
        return super().items()

    def keys(self) -> Any:
        self._seen()
        return super().keys()

    def values(self) -> Any:
        self._seen()
        return super().values()

    def copy(self) -> dict[Any, Any]:
        self._seen()
        return dict(super().items())

    def __eq__(self, other: object) -> bool:
        self._seen()
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        self._seen()
        return super().__ne__(other)

    def __or__(self, other: Any) -> Any:
        self._seen()
        return dict(super().items()) | other

    def __ror__(self, other: Any) -> Any:
        self._seen()
        return other | dict(super().items())

    def __reversed__(self) -> Iterator[Any]:
        self._seen()
        return super().__reversed__()

    def __repr__(self) -> str:
        self._seen()
        return super().__repr__()

    __hash__ = None  # type: ignore[assignment]  # as dict's


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(getattr(m, name, None) for m in module.modules()
               for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                            "_backward_pre_hooks"))


def _global_hooks() -> bool:
    """Hooks every module runs (``register_module_forward_hook`` and kin)."""
    from torch.nn.modules import module as torch_module
    return any(getattr(torch_module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


def _autocast_on() -> bool:
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    return bool(check()) if check is not None else torch.is_autocast_enabled()


@contextlib.contextmanager
def shared_blocks(model: torch.nn.Module, paths: tuple[str, ...], hide_state: bool = False
                  ) -> Iterator[SharedTrace]:
    """While active, the blocks at ``paths`` trace once per distinct computation.

    Yields a :class:`SharedTrace`, filled in as export runs; :func:`add_hidden_state` and
    :func:`splice_blocks` need it.  With ``hide_state``, the state of every block but the
    first two of each look-alike group is hidden from export.
    """
    result = SharedTrace()
    if not paths or _global_hooks():
        yield result
        return
    keep: list[Any] = []  # objects whose ids are in keys: no id is reused while we run
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # one for every run: its cache helps
    grad_enabled = torch.is_grad_enabled()
    traced_once: dict[Any, int] = {}
    unshareable: set[Any] = set()
    real_state = {p: _state_of(model.get_submodule(p)) for p in paths}
    layouts = {p: state_layout(real_state[p]) for p in paths}
    looks = {p: (layouts[p], attribute_key(model.get_submodule(p), keep)) for p in paths}
    counts: dict[Any, int] = {}
    for key in looks.values():
        counts[key] = counts.get(key, 0) + 1
    hidden_blocks: set[str] = set()
    if hide_state:
        seen: dict[Any, int] = {}
        for p in paths:
            seen[looks[p]] = seen.get(looks[p], 0) + 1
            if counts[looks[p]] > 1 and seen[looks[p]] > 2:
                hidden_blocks.add(p)

    def make_forward(path: str, module: torch.nn.Module) -> Callable[..., Any]:
        inner = module.forward

        def forward(*f_args: Any, **f_kwargs: Any) -> Any:
            with watch.paused():
                traced = share(path, module, inner, f_args, f_kwargs)
            return inner(*f_args, **f_kwargs) if traced is None else traced()
        setattr(forward, WRAPPER_MARK, True)
        return forward

    def share(path: str, module: torch.nn.Module, inner: Callable[..., Any],
              f_args: tuple[Any, ...], f_kwargs: dict[str, Any]
              ) -> Callable[[], Any] | None:
        """Decide how this call is traced: None to trace it normally, else a function
        that traces it (between markers, or as one ``block_call``)."""
        if torch.is_grad_enabled() != grad_enabled or _autocast_on() or _has_hooks(module):
            # Export wraps no_grad and autocast regions into sub-graphs, which are not
            # spliced; hooks would run, and keep what they saw, in the fake run.
            if path in hidden_blocks:
                raise SharingFailed(f"{path} runs under no_grad or autocast, or has hooks")
            return None
        flat, in_spec = pytree.tree_flatten((f_args, f_kwargs))
        with outside_export():  # reading shapes through export's modes is slow
            # Attributes as they are now (a parent may set them before each call).
            look = (layouts[path], attribute_key(module, keep))
            shapes = (str(in_spec), tuple(input_key(x, keep) for x in flat))
        key = (look, shapes)
        unique = counts.get(look, 0) < 2
        if unique and any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
                          for x in flat):
            # A size passed on reaches the fake run as a plain number, where it cannot be
            # told from a constant of the same value: compare such blocks by trace only.
            unshareable.add(key)
        if unique or key not in traced_once:
            if path in hidden_blocks:
                raise SharingFailed(f"{path} has to be traced, but its state is hidden")
            if key in unshareable:
                return None
            # The first of a look-alike group is checked for writes to what it did not
            # make; a block no other looks like (a per-layer index, say) is compared by
            # what it computes instead.
            try:
                computed = fingerprint(mode, inner, module, real_state[path], flat, in_spec,
                                       keep)
                if unique and has_symbolic_size(flat):
                    computed = (computed, fingerprint(mode, inner, module, real_state[path],
                                                      flat, in_spec, keep, bump=True))
            except Exception as e:  # noqa: BLE001 - any failure: export traces it
                log.debug("roundpipe: %s is traced on its own: %s", path, e)
                unshareable.add(key)
                return None
            if unique:
                key = ((layouts[path], computed), shapes)
        tensor_pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        site = _Site(path, len(tensor_pos), real_state[path])
        sid = next(_NEXT_SITE)
        _SITES[sid] = result.sites[sid] = site
        rep = traced_once.get(key)
        if rep is None:
            traced_once[key] = sid
            return lambda: trace_between_markers(site, sid, inner, flat, in_spec, tensor_pos)
        site.rep = rep
        return lambda: copy_call(sid, rep, flat, tensor_pos)

    def trace_between_markers(site: _Site, sid: int, inner: Callable[..., Any],
                              flat: list[Any], in_spec: Any, tensor_pos: list[int]) -> Any:
        entered = iter(block_enter([flat[i] for i in tensor_pos], sid))
        flat = [next(entered) if isinstance(x, torch.Tensor) else x for x in flat]
        args, kwargs = pytree.tree_unflatten(flat, in_spec)
        out_flat, site.out_spec = pytree.tree_flatten(inner(*args, **kwargs))
        with watch.paused():
            exited = iter(block_exit([x for x in out_flat if isinstance(x, torch.Tensor)],
                                     sid))
            site.out_leaves = [next(exited) if isinstance(x, torch.Tensor) else x
                               for x in out_flat]
        return pytree.tree_unflatten(site.out_leaves, site.out_spec)

    def copy_call(sid: int, rep: int, flat: list[Any], tensor_pos: list[int]) -> Any:
        with watch.paused():
            outs = iter(block_call([flat[i] for i in tensor_pos], sid))
            template = _SITES[rep]
            return pytree.tree_unflatten(
                [next(outs) if isinstance(x, torch.Tensor) else x for x in template.out_leaves],
                template.out_spec)

    watch = _Watch()

    def arm(*_: Any) -> None:
        watch.armed = True

    def disarm(*_: Any) -> None:
        watch.armed = False

    try:
        with contextlib.ExitStack() as stack:
            for path in paths:
                module = model.get_submodule(path)
                stack.enter_context(replaced_forward(module, make_forward(path, module)))
            if hidden_blocks:
                stack.enter_context(_hidden_state(model, hidden_blocks, result.hidden, watch))
                # Armed only while the model's own forward runs (export reads the state
                # it sees before and after).
                stack.callback(model.register_forward_pre_hook(arm, prepend=True).remove)
                stack.callback(model.register_forward_hook(disarm, always_call=True).remove)
            try:
                yield result
            except Exception as e:
                if watch.touched is not None:  # whatever failed may have missed the state
                    raise SharingFailed(f"the model read the hidden state of "
                                        f"{watch.touched}") from e
                raise
            if watch.touched is not None:
                raise SharingFailed(f"the model read the hidden state of {watch.touched}")
    finally:
        for sid in result.sites:
            _SITES.pop(sid, None)


@contextlib.contextmanager
def _hidden_state(model: torch.nn.Module, blocks: set[str],
                  hidden: list[tuple[str, torch.Tensor, str]], watch: _Watch
                  ) -> Iterator[None]:
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
                module._parameters = _WatchedDict(
                    {k: v for k, v in params.items() if v is None or id(v) in elsewhere_tensors},
                    watch, local)
                module._buffers = _WatchedDict(
                    {k: v for k, v in buffers.items() if v is None or id(v) in elsewhere_tensors},
                    watch, local)
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
    # Passes read shapes from meta["val"] (output_merge, costs): a placeholder without
    # one would read as a 0-dim tensor.  The export's own fake mode makes them.
    fake_mode = next((n.meta["val"].fake_mode for n in graph.nodes
                      if isinstance(n.meta.get("val"), FakeTensor)), None)
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
        if fake_mode is not None:
            node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
        made[node] = (fqn, tensor, kind)
    return made


# --- after export ------------------------------------------------------------------------

def splice_blocks(gm: torch.fx.GraphModule, sites: dict[int, _Site],
                  tensor_of: dict[torch.fx.Node, torch.Tensor],
                  constants: frozenset[torch.fx.Node] = frozenset()) -> tuple[str, ...]:
    """Replace every ``block_call`` with a copy of its traced block and drop the markers.

    Args:
        gm: the exported graph module.
        sites: what :func:`shared_blocks` yielded.
        tensor_of: the model tensor behind each state placeholder.
        constants: the placeholders of lifted constants (tensor literals): a copy reads
            the traced block's, which the fingerprint found equal to its own.

    Returns the paths of the blocks whose nodes are copies.  The caller recompiles
    ``gm``.

    Raises:
        SharingFailed: a traced block's nodes are read outside it (the graph then cannot be
            copied safely; export again without sharing).
        HookedBlock: a traced block registers a tensor hook (export again without
            sharing).
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

        def outside(inp: torch.fx.Node) -> Any:
            """What a value the traced block reads from outside is in the copy."""
            local = rep_local.get(id(tensor_of.get(inp)))
            if local is not None:  # the traced block's own state: the copy's own
                own = node_of.get(id(site.state[local]))
                if own is None:
                    raise SharingFailed(f"{site.path}.{local} has no placeholder")
                return own
            if inp in constants or _is_symbolic(inp) or (inp.op == "get_attr" and isinstance(
                    _attr(gm, inp.target), torch.fx.GraphModule)):
                return inp  # a literal, a size, or the body of a higher-order op: the same
            raise SharingFailed(f"block {rep.path} reads {inp.name}, which it was not "
                                "passed and does not hold")

        region = regions[rep_sid]
        if any(n.op == "call_function" and n.target is TENSOR_HOOK_OP for n in region):
            # The hook's function is the traced block's (a closure over its module, say):
            # each block registers its own, so each is traced.
            raise HookedBlock(f"block {rep.path} registers a tensor hook")
        members = set(region)
        with graph.inserting_before(call):
            for node in region:
                for inp in node.all_input_nodes:
                    if inp not in env and inp not in members:
                        env[inp] = outside(inp)
                new = graph.node_copy(node, lambda n: env[n])
                new.meta = _moved_meta(node.meta, rep.path, site.path,
                                       call.meta.get("nn_module_stack"))
                env[node] = new
        outs = [env[a] if a in env else outside(a) for a in exit_[rep_sid].args[0]]
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
    for name, sub in gm.named_modules():
        if isinstance(sub, torch.fx.GraphModule) and sub is not gm and any(
                n.op == "call_function" and n.target in (_ENTER, _EXIT, _CALL)
                for n in sub.graph.nodes):
            raise SharingFailed(f"a shared block was traced inside the sub-graph {name}")
    return tuple(sites[c.args[1]].path for c in calls)


def _attr(root: torch.nn.Module, target: Any) -> Any:
    obj: Any = root
    for part in str(target).split("."):
        obj = getattr(obj, part, None)
    return obj


def _reads(node: torch.fx.Node, marker: torch.fx.Node) -> bool:
    """``node`` is ``marker[i]`` (the marker's output unpacking, not block code)."""
    return node.op == "call_function" and node.args[:1] == (marker,)


def _is_symbolic(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _moved_meta(meta: dict[str, Any], rep_path: str, path: str,
                call_stack: dict[str, Any] | None) -> dict[str, Any]:
    """The copy's metadata: the call's module stack, then the traced block's entries
    inside it moved from ``rep_path`` to ``path``."""
    from .trace import normalize_module_path  # avoids a cycle
    new = dict(meta)
    stack = dict(call_stack or {})
    for key, (where, cls) in (meta.get("nn_module_stack") or {}).items():
        where = normalize_module_path(where)
        if where.startswith(rep_path + "."):
            stack[f"{key}@{path}"] = (path + where[len(rep_path):], cls)
    new["nn_module_stack"] = stack
    new.pop("unbacked_bindings", None)
    return new
