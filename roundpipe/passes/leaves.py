"""Opaque leaf modules for ``torch.export``: modules that run as plain Python at run time.

Some modules cannot be exported: data-dependent control flow (``for e in mask.nonzero()``
in a mixture-of-experts layer), calls into libraries that export cannot see through.
Marked as *leaves* (by the user with ``leaf_modules=[...]``, or automatically when export
fails inside them), they appear in the exported graph as one opaque call.

How, for a leaf ``layers.0.mlp.experts``::

    # 1. the model runs once for real; forward hooks record each leaf call's output
    #    structure and tensor shapes (buffers and the RNG state are restored afterwards)
    # 2. during export the leaf's forward is replaced by a custom op whose fake
    #    implementation returns empty tensors of the recorded shapes:
    opaque_call = roundpipe.opaque_call([hidden, idx, weights, p_gate_up, p_down], [], [],
                                        site)
    # 3. after export that node becomes a functional call of the module itself:
    call = call_module_functional(_leaf_layers_0_mlp_experts,
                                  {"gate_up_proj": p_gate_up, "down_proj": p_down},
                                  hidden, idx, weights)
    outs = tensor_leaves(call)

The module's state stays explicit (placeholders, streamed like any other weight) and the
call is differentiated by ordinary eager autograd.  Shapes are those of the example, so a
graph with leaves is traced with static shapes (one program per input shape).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import ConfigError, ModelError
from ..ops.hooks import mark_hooking
from ..ops.modcall import call_module_functional, tensor_leaves
from .tensor_hooks import HOOKED, dummy_handle, intercept_register_hook

LEAF_PREFIX = "_leaf_"


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Site:
    """One call of a leaf module: what the real run recorded and what export passed."""

    path: str
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)  # _TensorMeta or constants
    in_spec: Any = None
    in_consts: dict[int, Any] = field(default_factory=dict)
    # flat input index -> ("int" | "bool" | "float", index in opaque_call's ints/floats):
    # symbolic scalars (a data-dependent ``.item()`` computed outside the leaf)
    in_scalars: dict[int, tuple[str, int]] = field(default_factory=dict)
    num_tensor_inputs: int = 0
    state_names: tuple[str, ...] = ()
    # indices (among the tensor inputs) the real run saw the leaf write in place
    written_inputs: tuple[int, ...] = ()
    # where the real run saw the leaf's Python register tensor hooks, and on which of its
    # tensor inputs (indices) it registered them
    hooks: tuple[str, ...] = ()
    hooked_inputs: tuple[int, ...] = ()
    # its own buffers (local names) the real run saw it write, in any mode
    written_state: tuple[str, ...] = ()


WRITES = "roundpipe.writes"  # layers.WRITES (layers imports this module through trace)

_SITES: dict[int, _Site] = {}
_NEXT_SITE = itertools.count()


@torch.library.custom_op("roundpipe::opaque_call", mutates_args=())
def opaque_call(tensors: list[torch.Tensor], ints: list[int], floats: list[torch.Tensor],
                site: int) -> list[torch.Tensor]:
    """Stands for one leaf module call while exporting; never runs for real.  ``ints``
    and ``floats`` (as 0-d tensors: the op schema takes no symbolic floats) carry symbolic
    scalars into the graph, where a constant would be baked."""
    raise RuntimeError("roundpipe::opaque_call is a tracing placeholder; it is replaced by "
                       "the module call before the graph runs")


@opaque_call.register_fake
def _opaque_call_fake(tensors: list[torch.Tensor], ints: list[int],
                      floats: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    info = _SITES[site]
    return [torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device=t.device)
            for t in info.out_leaves if isinstance(t, _TensorMeta)]


_OPAQUE_OP = torch.ops.roundpipe.opaque_call.default


def resolve_leaf_modules(model: torch.nn.Module,
                         leaf_modules: Iterable[str | type]) -> tuple[str, ...]:
    """Module paths for ``leaf_modules`` entries: a path (``"model.layers.0.mlp"``) or a
    module class (every instance).  Modules inside another leaf are dropped."""
    named = dict(model.named_modules())
    paths: list[str] = []
    for entry in leaf_modules:
        if isinstance(entry, type):
            found = [n for n, m in named.items() if n and type(m) is entry]
            if not found:
                raise ConfigError(f"leaf_modules: {type(model).__name__} has no submodule of "
                                  f"type {entry.__name__}")
            paths.extend(found)
        elif isinstance(entry, str) and entry in named and entry:
            paths.append(entry)
        else:
            examples = ", ".join(repr(n) for n in list(named)[1:4])
            raise ConfigError(
                f"leaf_modules: {entry!r} is not a submodule path or module class of "
                f"{type(model).__name__} (paths look like {examples}); give paths as "
                "model.named_modules() spells them, or classes")
    paths = sorted(set(paths))
    return tuple(p for p in paths
                 if not any(p.startswith(q + ".") for q in paths if q != p))


def same_type_modules(model: torch.nn.Module, path: str) -> tuple[str, ...]:
    """Every module of the same class as the one at ``path`` (same code, same failure)."""
    cls = type(model.get_submodule(path))
    return tuple(n for n, m in model.named_modules() if n and type(m) is cls)


def failing_module(model: torch.nn.Module, error: BaseException) -> str | None:
    """Path of the innermost submodule of ``model`` whose ``forward`` was running when
    ``error`` was raised (else whose code was: a method called from outside any forward),
    read from the traceback's frames, following chained exceptions.  The forward, not the
    innermost module frame: ``self.classifier.to(dtype)`` failing inside ``Linear._apply``
    is the calling module's code, and keeping every Linear opaque would not help."""
    by_id = {id(m): n for n, m in model.named_modules() if n}
    seen: set[int] = set()
    exc: BaseException | None = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        innermost = innermost_forward = None
        tb = exc.__traceback__
        while tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            if obj is not None and id(obj) in by_id:
                innermost = by_id[id(obj)]
                if tb.tb_frame.f_code.co_name == "forward":
                    innermost_forward = innermost
            tb = tb.tb_next
        if innermost_forward is not None or innermost is not None:
            return innermost_forward or innermost
        exc = exc.__cause__ or exc.__context__
    return None


def _record_calls(model: torch.nn.Module, leaves: tuple[str, ...], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> dict[str, list[_Site]]:
    """Run the model once for real and record every leaf call's output structure.

    The model's state and the CPU RNG state are restored afterwards, so the run leaves no
    trace.
    """
    calls: dict[str, list[_Site]] = {p: [] for p in leaves}
    handles = []
    state = _model_state(model)
    before: dict[str, list[tuple[str, torch.Tensor, int]]] = {}
    running: list[str] = []  # the leaves whose forward is running, innermost last
    hooks: dict[str, list[tuple[str, int | None]]] = {}  # path -> (line, hooked input)
    state_names = {id(t): n for n, t in reversed(state)}
    guard: list[Any] = []  # the run's StateChanges: counts writes through .data too

    def stamp(tensor: torch.Tensor) -> tuple[int | None, int]:
        return _version(tensor), guard[0].writes(tensor) if guard else 0

    def on_register(tensor: torch.Tensor, hook: Any, line: str) -> Any:
        """A leaf's Python registers a tensor hook (it runs so at run time too, see
        ops/hooks.py); nothing is registered on this run's tensors."""
        if running:
            path = running[-1]
            if id(tensor) in state_names:
                raise ModelError(
                    f"the opaque (leaf) module {path} registers a tensor hook on "
                    f"{state_names[id(tensor)]} in its forward ({line}); each call would "
                    "register it again on the model's own tensor (eager PyTorch then runs "
                    "it once per call made so far). Register it once, outside the forward")
            inputs = before.get(path + "#inputs", ())
            hooked = next((int(i) for i, t, _ in inputs if t is tensor), None)
            hooks.setdefault(path, []).append((line, hooked))
        return dummy_handle()
    for path in leaves:
        own = {id(t) for _, t in _model_state(model.get_submodule(path))}
        outside = [(n, t) for n, t in state if id(t) not in own]
        # its own plain tensor attributes travel as constants, never written back
        outside += [(f"{path}.{n}", t) for n, t in tensor_attributes(model.get_submodule(path))]

        def pre_hook(module: torch.nn.Module, inputs: Any, kw: Any, path: str = path,
                     outside: list[tuple[str, torch.Tensor]] = outside) -> None:
            before[path] = [(n, t, stamp(t)) for n, t in outside]
            before[path + "#own"] = [(n, t, stamp(t)) for n, t
                                     in module.named_buffers(remove_duplicate=False)]
            # (the storage too: ``weight.data = ...`` moves it without a write)
            before[path + "#params"] = [(n, t, (stamp(t), _where(t))) for n, t
                                        in module.named_parameters(remove_duplicate=False)]
            tensors = [x for x in pytree.tree_leaves((inputs, kw))
                       if isinstance(x, torch.Tensor)]
            before[path + "#inputs"] = [(str(i), t, _version(t))
                                        for i, t in enumerate(tensors)]
            running.append(path)

        def hook(module: torch.nn.Module, inputs: Any, kw: Any, output: Any,
                 path: str = path) -> None:
            running.pop()
            inputs_seen = before.pop(path + "#inputs", ())
            written_state = tuple(n for n, t, version in before.pop(path + "#own", ())
                                  if stamp(t) != version)
            params = before.pop(path + "#params", ())
            written_params = [n for n, t, (version, _) in params if stamp(t) != version]
            moved_params = [n for n, t, (_, where) in params if _where(t) != where]
            if moved_params and not written_params:
                raise ModelError(
                    f"the opaque (leaf) module {path} gives its parameter "
                    f"{path}.{moved_params[0]} another tensor in its forward (.data = ...); "
                    "roundpipe runs a leaf on the device's copies of its parameters, so "
                    "the change would be lost (eager PyTorch keeps it). Apply such "
                    "constraints outside the forward (after the optimizer step), or let "
                    "the module be traced (not a leaf)")
            if written_params:
                raise ModelError(
                    f"the opaque (leaf) module {path} writes its parameter "
                    f"{path}.{written_params[0]} in place in its forward; roundpipe runs a "
                    "leaf on the device's copies of its parameters, so the write would be "
                    "lost (eager PyTorch keeps it). Apply such constraints outside the "
                    "forward (after the optimizer step), or let the module be traced "
                    "(not a leaf)")
            written_inputs = tuple(int(i) for i, t, version in inputs_seen
                                   if _version(t) != version)
            passed = {id(t) for _, t, _ in inputs_seen}  # arrive as graph values: carried
            written = [n for n, t, version in before.pop(path, ())
                       if stamp(t) != version and id(t) not in passed]
            if written:
                if written[0].startswith(path + "."):
                    raise ModelError(
                        f"the opaque (leaf) module {path} writes its tensor attribute "
                        f"{written[0]} in place; it is neither a parameter nor a buffer, "
                        "so roundpipe passes it as a constant and the write would be lost "
                        "(eager PyTorch keeps it). Register it as a buffer, whose writes "
                        "are carried (register_buffer(name, tensor, persistent=False))")
                raise ModelError(
                    f"the opaque (leaf) module {path} writes {written[0]} in place, which "
                    f"is not its own state ({type(model).__name__}'s, outside {path}); "
                    "roundpipe runs a leaf on a copy holding its own parameters and "
                    "buffers only, so that write would reach the host tensor directly, "
                    "from the device's thread, once per microbatch and again in "
                    "recompute. Register that state on the leaf module, pass it as an "
                    "argument and write it outside the leaf, or let the module be traced "
                    "(not a leaf)")
            flat, spec = pytree.tree_flatten(output)
            leaves_meta = [_TensorMeta(tuple(x.shape), x.stride(), x.dtype, x.device)
                           if isinstance(x, torch.Tensor) else x for x in flat]
            registered = hooks.pop(path, [])
            calls[path].append(_Site(
                path, spec, leaves_meta, written_inputs=written_inputs,
                written_state=written_state,
                hooks=tuple(line for line, _ in registered),
                hooked_inputs=tuple(sorted({i for _, i in registered if i is not None}))))
        module = model.get_submodule(path)
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    # the whole state is put back, written or not (a refused write must leave no trace
    # either, and an accepted one is the program's to make, once per step)
    from .state_guard import state_kept  # (imports this module)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                intercept_register_hook(on_register), \
                state_kept(model, rebind_attributes="on_failure") as changes:
            guard.append(changes)
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if guard[0].flags:  # (put back, as all else)
        raise ModelError(
            f"{type(model).__name__}'s forward changes {guard[0].flags[0]} of the model "
            "itself (seen when its opaque modules' calls were recorded): the traced "
            "program never makes that change, where eager PyTorch makes it at every call. "
            "Set requires_grad and .grad outside the forward")
    return calls


def _where(tensor: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's storage and layout (``.data = ...`` changes them, not the version)."""
    return (tensor.untyped_storage().data_ptr(), tuple(tensor.shape), tensor.stride(),
            tensor.storage_offset(), tensor.dtype, tensor.device)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _model_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and plain tensor attribute of ``module``'s tree."""
    found = list(module.named_parameters(remove_duplicate=False))
    found += list(module.named_buffers(remove_duplicate=False))
    return found + tensor_attributes(module)


@contextlib.contextmanager
def leaves_as_custom_ops(model: torch.nn.Module, leaves: tuple[str, ...],
                         args: tuple[Any, ...], kwargs: dict[str, Any]
                         ) -> Iterator[dict[int, _Site]]:
    """While active, each leaf's ``forward`` is one ``roundpipe::opaque_call``.

    Yields the sites (by id) that export traced; :func:`replace_opaque_calls` needs them.
    """
    if not leaves:
        yield {}
        return
    calls = _record_calls(model, leaves, args, kwargs)
    counters = dict.fromkeys(leaves, 0)
    used: dict[int, _Site] = {}

    def make_forward(path: str, module: torch.nn.Module) -> Any:
        def forward(*f_args: Any, **f_kwargs: Any) -> Any:
            recorded = calls[path]
            if not recorded:
                raise RuntimeError(f"leaf module {path} ran while tracing but not in the "
                                   "real run with the same inputs")
            template = recorded[counters[path] % len(recorded)]
            counters[path] += 1
            site = _Site(path, template.out_spec, template.out_leaves,
                         written_inputs=template.written_inputs, hooks=template.hooks,
                         hooked_inputs=template.hooked_inputs,
                         written_state=template.written_state)
            sid = next(_NEXT_SITE)
            _SITES[sid] = site
            used[sid] = site
            flat, site.in_spec = pytree.tree_flatten((f_args, f_kwargs))
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            ints: list[Any] = []
            floats: list[Any] = []
            for i, x in enumerate(flat):
                if isinstance(x, torch.Tensor):
                    continue
                if isinstance(x, torch.SymBool):
                    site.in_scalars[i] = ("bool", len(ints))
                    ints.append(torch.sym_ite(x, 1, 0))
                elif isinstance(x, torch.SymInt):
                    site.in_scalars[i] = ("int", len(ints))
                    ints.append(x)
                elif isinstance(x, torch.SymFloat):
                    site.in_scalars[i] = ("float", len(floats))
                    floats.append(torch.full((), x, dtype=torch.float64))
                else:
                    site.in_consts[i] = x
            site.num_tensor_inputs = len(tensors)
            state = (list(module.named_parameters(remove_duplicate=False))
                     + list(module.named_buffers(remove_duplicate=False))
                     + tensor_attributes(module))
            site.state_names = tuple(n for n, _ in state)
            outs = iter(opaque_call(tensors + [t for _, t in state], ints, floats, sid))
            flat_out = [next(outs) if isinstance(x, _TensorMeta) else x
                        for x in site.out_leaves]
            return pytree.tree_unflatten(flat_out, site.out_spec)
        return forward

    try:
        with contextlib.ExitStack() as stack:
            for path in leaves:
                module = model.get_submodule(path)
                stack.enter_context(replaced_forward(module, make_forward(path, module)))
            yield used
    finally:
        for sid in used:
            _SITES.pop(sid, None)


def tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Plain tensor attributes (neither parameters nor buffers) of ``module`` and its
    children: they travel with the state, so the leaf runs on the device's copies."""
    found = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found.append((f"{prefix}.{name}" if prefix else name, value))
    return found


@contextlib.contextmanager
def replaced_forward(module: torch.nn.Module, forward: Any) -> Iterator[None]:
    """Make ``forward`` this instance's forward (an instance attribute shadows the class's
    method); whatever instance attribute was there before is put back."""
    missing = object()
    previous = module.__dict__.get("forward", missing)
    module.forward = forward
    try:
        yield
    finally:
        if previous is missing:
            del module.forward
        else:
            module.forward = previous


def replace_opaque_calls(gm: torch.fx.GraphModule, model: torch.nn.Module,
                         sites: dict[int, _Site]) -> dict[torch.fx.Node, str]:
    """Turn every ``opaque_call`` node into ``call_module_functional`` on the real module.

    The module is attached to ``gm`` as ``_leaf_<path>``; returns the new nodes with the
    path of the module they call.
    """
    graph = gm.graph
    made: dict[torch.fx.Node, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _OPAQUE_OP:
            continue
        tensors, ints, floats, sid = node.args
        site = sites[sid]
        attr = LEAF_PREFIX + site.path.replace(".", "_")
        if not hasattr(gm, attr):
            gm.add_submodule(attr, model.get_submodule(site.path))
        inputs = iter(tensors[:site.num_tensor_inputs])
        flat: list[Any] = []
        with graph.inserting_before(node):
            for i in range(site.in_spec.num_leaves):
                if i in site.in_consts:
                    flat.append(site.in_consts[i])
                elif i in site.in_scalars:
                    kind, k = site.in_scalars[i]
                    value = floats[k] if kind == "float" else ints[k]
                    if kind == "float":  # carried as a 0-d tensor
                        value = graph.call_method("item", (value,))
                    elif kind == "bool":  # carried as sym_ite(b, 1, 0)
                        value = (graph.call_function(operator.ne, (value, 0))
                                 if isinstance(value, torch.fx.Node) else bool(value))
                    flat.append(value)
                else:
                    flat.append(next(inputs))
        call_args, call_kwargs = pytree.tree_unflatten(flat, site.in_spec)
        mapping = dict(zip(site.state_names, tensors[site.num_tensor_inputs:]))
        with graph.inserting_before(node):
            ref = graph.get_attr(attr)
            call = graph.call_function(call_module_functional,
                                       (ref, mapping) + tuple(call_args), dict(call_kwargs))
            outs = graph.call_function(tensor_leaves, (call,))
        for new in (ref, call, outs):
            new.meta = dict(node.meta)
        if site.hooks:
            # Its Python registers tensor hooks: skipped where no backward will run
            # (forward jobs), kept with the unit that makes the inputs it hooks.
            mark_hooking(model.get_submodule(site.path))
            hooked = [tensors[i] for i in site.hooked_inputs
                      if isinstance(tensors[i], torch.fx.Node)]
            if hooked:
                call.meta[HOOKED] = tuple(hooked)
        if site.written_inputs:
            # The leaf writes these inputs in place (seen in the real run): ``layers``
            # keeps it with the unit that made them, as for any in-place write, and the
            # trace refuses writes to the model's inputs and parameters.
            from .trace import alias_root  # passes/trace.py imports this module
            written = [tensors[i] for i in site.written_inputs
                       if isinstance(tensors[i], torch.fx.Node)]
            call.meta[WRITES] = tuple(alias_root(t) for t in written)
        if site.written_state:
            # Its own buffers the real run saw it write (in eval mode too: a counter):
            # what the trace records of a traced write, so ``pipe(x)`` can tell.
            from .trace import MUTATES
            call.meta[MUTATES] = tuple(sorted(
                mapping[n].name for n in site.written_state
                if isinstance(mapping.get(n), torch.fx.Node)))
        node.replace_all_uses_with(outs)
        graph.erase_node(node)
        made[call] = site.path
        made[outs] = site.path
    return made
