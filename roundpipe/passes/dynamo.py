"""Front end for ``torch.compile``: turn a Dynamo graph into the trace pass's output.

Dynamo hands a backend a ``GraphModule`` whose placeholders are the frame's inputs *and*
the module state it reads: parameters (the example input is the ``nn.Parameter`` itself),
buffers, and SymInt sizes under dynamic shapes.  Tied weights already share one
placeholder.  Before::

    l_self_modules_h_modules_0_modules_qkv_parameters_weight_, ..., l_idx_ = placeholders
    linear = torch._C._nn.linear(layer_norm, l_self_modules_h_..._weight_, ...)
    view = linear.view(2, 8, 3, 2, 16)            # torch-level IR, not ATen
    return (linear_16,)

After (:func:`from_dynamo`, a :class:`~roundpipe.passes.trace.TracedGraph`)::

    p_h_0_qkv_weight, ..., idx = placeholders      # state slots first, then user inputs
    ...                                            # same nodes, with roundpipe.* meta

State slots are the placeholders whose example is a parameter or whose source is a module
buffer (``L['self']._modules['h']._modules['0']._buffers['running_mean']``); their names
come from the source.  Everything else is a user input.  The graph has no ``nn.Module``,
so the layer units come from the ``nn_module_stack`` paths and types recorded on the nodes
(:func:`graph_module_tree`, read by :func:`~roundpipe.passes.layers.find_unit_roots` as
``roundpipe.compile`` reads the model's own tree).

Torch-level IR hides what ATen schemas say, so this pass also records:

* ``meta["roundpipe.mutates"]``: buffers written in place (``num_batches_tracked.add_(1)``,
  ``F.batch_norm(..., training=True)``);
* ``meta["roundpipe.writes"]``: values written in place, so the layers pass keeps a write
  in the unit that defines the value;
* ``meta["roundpipe.random"]``: random calls codegen does not already key (the dropout
  variants, ``scaled_dot_product_attention`` with ``dropout_p > 0``, ``torch.rand``...),
  so that recompute draws the same numbers as the forward pass.

A graph roundpipe cannot run faithfully raises :class:`Unsupported`; the backend then runs
that graph eagerly.
"""

from __future__ import annotations

import inspect
import logging
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

from ..errors import ModelError
from ..ops.hooks import register_tensor_hook
from ..plan import InputSignature, OutputRef, StateSpec
from .codegen import RANDOM
from .layers import WRITES, ModuleTree
from .mode_regions import mark_mode_regions
from .tensor_hooks import HOOKED
from .trace import MODULE_PATH, MUTATES, SPARSE_HINT, TracedGraph

log = logging.getLogger(__name__)

METHOD = "dynamo"


try:
    from torch._higher_order_ops.register_hook import register_hook_op as _REGISTER_HOOK_OP
except ImportError:  # older torch: Dynamo registers intermediate hooks otherwise
    _REGISTER_HOOK_OP = None


class Unsupported(Exception):
    """The graph cannot be pipelined faithfully; the message says why."""


@dataclass(frozen=True)
class Placeholder:
    """One input of the Dynamo graph, in call order.

    Attributes:
        name: value name in the converted graph (a state slot or a user input).
        source: Dynamo's name for where the value came from (``L['x']``,
            ``L['self']._modules['fc']._parameters['weight']``, ``L['x'].size()[0]``).
        kind: ``"parameter"``, ``"buffer"``, ``"tensor"`` (user tensor), ``"symint"``
            or ``"other"``.
        size_of: for a SymInt that is a size of another input, ``(input index, dim)``.
        local: the value is a frame argument (or an item of one), not an attribute of a
            module or a global: only such inputs may be split into microbatches.
    """

    name: str
    source: str
    kind: str
    size_of: tuple[int, int] | None = None
    local: bool = False


@dataclass(frozen=True)
class DynamoGraph:
    """A Dynamo graph converted for the passes from ``layers`` on."""

    traced: TracedGraph
    module_tree: ModuleTree  # the layers pass finds the units in it
    placeholders: tuple[Placeholder, ...]
    # Per output: whether eager's output requires grad (Dynamo's example value says;
    # True where it cannot tell).  Dynamo guards on the inputs' requires_grad and on the
    # grad mode, so what held when the graph was traced holds at every call.
    differentiable: tuple[bool, ...] = ()


def from_dynamo(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> DynamoGraph:
    """Convert Dynamo's graph (left untouched) into a :class:`TracedGraph`.

    Raises:
        Unsupported: the graph holds something roundpipe cannot run as it would run
            eagerly (module calls left opaque, writes to parameters or inputs, ...).
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    new_gm = torch.fx.GraphModule(gm, graph)
    graph = new_gm.graph
    old_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders = [env[n] for n in old_placeholders]
    if len(placeholders) != len(example_inputs):
        raise Unsupported(f"the graph has {len(placeholders)} inputs but Dynamo gave "
                          f"{len(example_inputs)} example inputs")
    if any(n.op == "call_module" for n in graph.nodes):
        raise Unsupported("the graph calls modules opaquely (torch._dynamo.config."
                          "inline_inbuilt_nn_modules is off), so their weights are not "
                          "graph inputs")

    # --- placeholders: state slots (by tensor identity) and user inputs ---------------------
    sources = [_source_name(old) for old in old_placeholders]
    slot_of_tensor: dict[int, torch.fx.Node] = {}
    state: list[StateSpec] = []
    state_tensors: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    infos: list[tuple[str, str, bool]] = []  # (kind, node name placeholder i maps to, local)
    user_nodes: list[torch.fx.Node] = []
    user_examples: list[Any] = []
    for node, source, example in zip(placeholders, sources, example_inputs):
        kind = _input_kind(source, example)
        if kind in ("parameter", "buffer"):
            fqn = _fqn(source) or node.name
            canonical = slot_of_tensor.get(id(example))
            if canonical is not None:  # the same tensor twice: one slot
                node.replace_all_uses_with(canonical)
                graph.erase_node(node)
                aliases[canonical.name].append(fqn)
                infos.append((kind, canonical.name, False))
                continue
            node._rename(("p_" if kind == "parameter" else "b_") + re.sub(r"\W", "_", fqn))
            node.target = node.name
            slot_of_tensor[id(example)] = node
            aliases[node.name] = [fqn]
            state_tensors[node.name] = example
            infos.append((kind, node.name, False))
        else:
            local = _is_local(source)
            name = _input_name(source)
            if name and name != node.name:
                node._rename(name)
                node.target = node.name
            user_nodes.append(node)
            user_examples.append(_concrete(example))
            infos.append((kind, node.name, local))
    # Tensors captured as attributes of the graph module become constant slots.
    for node in list(graph.nodes):
        if node.op == "get_attr":
            value = _get_attr(new_gm, node.target)
            if isinstance(value, torch.Tensor):
                with graph.inserting_before(next(iter(graph.nodes))):
                    ph = graph.placeholder("c_" + re.sub(r"\W", "_", str(node.target)))
                node.replace_all_uses_with(ph)
                graph.erase_node(node)
                constants[ph.name] = value
                state_tensors[ph.name] = value
                aliases[ph.name] = [str(node.target)]
    # State slots first, then user inputs (the order the cost pass expects).
    slot_nodes = [n for n in graph.nodes if n.op == "placeholder" and n.name in state_tensors]
    anchor = next((n for n in graph.nodes if n not in slot_nodes), None)
    if anchor is not None:
        for node in slot_nodes:
            anchor.prepend(node)  # each goes right before the anchor: order is kept
    kinds = {n: k for k, n, _ in infos if k in ("parameter", "buffer")}
    for node in slot_nodes:
        tensor = state_tensors[node.name]
        kind = kinds.get(node.name, "constant")
        names = aliases[node.name]
        state.append(StateSpec(
            name=node.name, fqn=names[0], aliases=tuple(names[1:]),
            kind=kind,  # type: ignore[arg-type]
            shape=tuple(tensor.shape), dtype=tensor.dtype,
            nbytes=tensor.numel() * tensor.element_size(),
            requires_grad=kind == "parameter" and tensor.requires_grad))

    # --- meta the passes read -------------------------------------------------------------
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            node.meta[MODULE_PATH] = module_path(node)
    buffers = {s.name for s in state if s.kind == "buffer"}
    params = {s.name for s in state if s.kind == "parameter"}
    user_names = {n.name for n in user_nodes}
    _refuse_sparse_gradients(graph, {s.name: s.fqn for s in state if s.requires_grad})
    for node in graph.nodes:
        written = [alias_root(w) for w in written_values(node)]
        if not written:
            continue
        node.meta[WRITES] = tuple(written)
        roots = {w.name for w in written}
        if roots & params:
            raise Unsupported(f"{node.format_node()} writes to a parameter in place")
        if roots & user_names:
            raise Unsupported(f"{node.format_node()} writes to an input of the graph in "
                              "place; roundpipe works on copies, so the write would be lost")
        mutated = tuple(sorted(roots & buffers))
        if mutated:
            node.meta[MUTATES] = mutated
    for node in graph.nodes:
        if is_random(node):
            node.meta[RANDOM] = True
    _carry_hooks(graph)
    # no_grad / autocast blocks: each node is marked with its regions, which every unit
    # program enters and leaves itself (so a region never forces two units together).
    mark_mode_regions(graph, initial_grad=_initial_grad_mode(graph))

    # --- outputs ----------------------------------------------------------------------------
    out_node = next(n for n in graph.nodes if n.op == "output")
    flat_out = list(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) \
        else [out_node.args[0]]
    outputs: list[OutputRef] = []
    differentiable: list[bool] = []
    for value in flat_out:
        example = value.meta.get("example_value") if isinstance(value, torch.fx.Node) \
            else None
        differentiable.append(not isinstance(example, torch.Tensor) or example.requires_grad)
        if isinstance(value, torch.fx.Node):
            if value.name in state_tensors:
                raise Unsupported(f"the graph returns its state input {value.name} itself")
            outputs.append(OutputRef(value.name))
        else:
            outputs.append(OutputRef(None, value))
    out_node.args = (tuple(flat_out),)
    new_gm.recompile()

    index_of_source = {src: i for i, src in enumerate(sources)}
    infos_out: list[Placeholder] = []
    for i, ((kind, name, local), source) in enumerate(zip(infos, sources)):
        size_of = _size_source(example_inputs[i], old_placeholders[i], index_of_source)
        infos_out.append(Placeholder(name=name, source=source, kind=kind, size_of=size_of,
                                     local=local))
    names = tuple(n.name if n.users else None for n in user_nodes)
    static = tuple(("tensor", x.dtype, tuple(None for _ in x.shape))
                   if isinstance(x, torch.Tensor) else ("const", x) for x in user_examples)
    traced = TracedGraph(
        graph_module=new_gm,
        state=tuple(state),
        inputs=InputSignature("signature", None, tuple(n.name for n in user_nodes),
                              tuple(inspect.Parameter.empty for _ in user_nodes), names,
                              static),
        outputs=tuple(outputs),
        out_spec=pytree.tree_flatten(tuple(range(len(outputs))))[1],
        buffer_updates=(),
        constants=constants,
        state_tensors=state_tensors,
        example_inputs=tuple(user_examples),
        method=METHOD,
    )
    return DynamoGraph(traced=traced, module_tree=graph_module_tree(graph, state),
                       placeholders=tuple(infos_out), differentiable=tuple(differentiable))


def _carry_hooks(graph: torch.fx.Graph) -> None:
    """``h.register_hook(fn)`` on a value the graph computes is Dynamo's
    ``register_hook`` higher-order op (the hook traced into a body graph, with the
    forward values it reads as extra arguments; a hook with Python side effects makes a
    graph break instead, and runs eagerly).  Run as it is, it failed in forward jobs,
    under ``no_grad``; it becomes :func:`roundpipe.ops.hooks.register_tensor_hook`, which
    registers where a backward will run, kept in the unit that makes the value."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _REGISTER_HOOK_OP:
            value = node.args[0]
            if not isinstance(value, torch.fx.Node) or value.op == "placeholder":
                raise Unsupported(f"{node.format_node()} registers a hook on an input of "
                                  "the graph")
            node.target = register_tensor_hook
            node.meta[HOOKED] = (value,)


def hook_sites(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes of a converted graph that register tensor hooks."""
    return [n for n in graph.nodes
            if n.op == "call_function" and n.target is register_tensor_hook]


# --- sources --------------------------------------------------------------------------------

def _source_name(node: torch.fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return ""
    name = source.name
    return name() if callable(name) else str(name)


_STATE_PART = re.compile(
    r"\.(?:__dict__\[')?_(modules|parameters|buffers)(?:'\])?\['([^']*)'\]")


def _fqn(source: str) -> str:
    """``L['self']._modules['h']._modules['0']._parameters['weight']`` -> ``h.0.weight``;
    also through ``__dict__['_modules']['h']`` (a ``super().forward`` after a graph
    break)."""
    return ".".join(m.group(2) for m in _STATE_PART.finditer(source))


def _input_kind(source: str, example: Any) -> str:
    if isinstance(example, torch.nn.Parameter):
        return "parameter"
    if isinstance(example, torch.Tensor):
        return "buffer" if "._buffers[" in source else "tensor"
    if isinstance(example, torch.SymInt):
        return "symint"
    return "other"


# A frame argument or an item of one: L['x'], L['batch']['input_ids'], L['args'][0].
_LOCAL = re.compile(r"^L\['[^']+'\](\[[^\]]+\])*$")


def _is_local(source: str) -> bool:
    return bool(_LOCAL.match(source))


def _input_name(source: str) -> str:
    """A readable value name for a user input: ``L['x']`` -> ``x``."""
    if not _is_local(source):
        return ""
    name = re.sub(r"\W+", "_", source[1:]).strip("_")
    return name if name and not name[0].isdigit() else f"input_{name}"


def _concrete(example: Any) -> Any:
    """A SymInt example as the int it stands for (the cost pass runs on real sizes)."""
    if isinstance(example, torch.SymInt):
        hint = getattr(example.node, "hint", None)
        return int(hint) if hint is not None else example
    return example


def _size_source(example: Any, node: torch.fx.Node, index_of_source: Mapping[str, int]
                 ) -> tuple[int, int] | None:
    """For a SymInt input ``L['x'].size()[d]``: (placeholder index of ``x``, ``d``)."""
    if not isinstance(example, torch.SymInt):
        return None
    source = getattr(node.meta.get("grapharg"), "source", None)
    try:
        from torch._dynamo.source import TensorProperty, TensorPropertySource
    except ImportError:  # pragma: no cover - older torch
        return None
    if not isinstance(source, TensorPropertySource) or source.prop != TensorProperty.SIZE:
        return None
    base = source.base.name
    base = base() if callable(base) else str(base)
    if base not in index_of_source or source.idx is None:
        return None
    return index_of_source[base], int(source.idx)


def _get_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# --- module paths and layer units ------------------------------------------------------------

def normalize_path(path: str) -> str:
    """Dynamo's module paths relative to the compiled frame's root object:
    ``L['self'].h.0.attn`` and ``L['self'].h[0].attn`` -> ``h.0.attn``; a module reached
    through ``__dict__['_modules']`` (a ``super().forward`` call after a graph break) too."""
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    path = re.sub(r"(^|\.)__dict__\._modules(?=\.|$)", "", path)
    return path.strip(".")


def module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return normalize_path(list(stack.values())[-1][0])


def graph_module_tree(graph: torch.fx.Graph, state: Iterable[StateSpec]) -> ModuleTree:
    """The module hierarchy as the graph shows it: paths and types from the nodes'
    ``nn_module_stack``, parameter counts from the state's names.  A module whose children
    are all numbered (``h.0``, ``h.1``) stands for a ``ModuleList`` / ``Sequential``, one
    never called whose children are for a ``ModuleDict``."""
    types: dict[str, type | None] = {}
    for node in graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            types[normalize_path(path)] = cls if isinstance(cls, type) else None
    numel: dict[str, int] = {}
    for spec in state:
        if spec.kind != "parameter":
            continue
        size = 1
        for d in spec.shape:
            size *= int(d)
        for fqn in (spec.fqn,) + spec.aliases:
            parts = fqn.split(".")
            for i in range(len(parts)):  # every ancestor module (and the root, "")
                prefix = ".".join(parts[:i])
                numel[prefix] = numel.get(prefix, 0) + size
                types.setdefault(prefix, None)
    types.setdefault("", None)
    children: dict[str, list[str]] = {path: [] for path in types}
    # A graph may name a module whose parent it never enters (a graph break inside the
    # root's forward leaves ``layers.0`` without ``layers``): add the missing ancestors.
    pending = list(types)
    while pending:
        path = pending.pop()
        if path:
            parent = path.rpartition(".")[0]
            children.setdefault(parent, []).append(path)
            if parent not in types:
                types[parent] = None
                pending.append(parent)
    ordered = {path: tuple(sorted(kids, key=_path_key)) for path, kids in children.items()}
    # Containers: numbered children (ModuleList, Sequential), a container class, or a
    # module below the root that is never called itself while its children are (a
    # ModuleDict, whose owner calls self.blocks[k]): Dynamo records only called modules.
    sequences = frozenset(
        path for path, kids in ordered.items()
        if kids and (all(k.rpartition(".")[2].isdigit() for k in kids)
                     or (types.get(path) is None and path
                         and all(types.get(k) is not None for k in kids))
                     or (isinstance(types.get(path), type) and issubclass(
                         types[path], (torch.nn.ModuleList, torch.nn.Sequential,
                                       torch.nn.ModuleDict)))))
    return ModuleTree(ordered, types, numel, sequences)


def _path_key(path: str) -> tuple:
    last = path.rpartition(".")[2]
    return (0, int(last), "") if last.isdigit() else (1, 0, last)


# --- in-place writes -----------------------------------------------------------------------------

# In-place operator forms (``x += y`` on a tensor), which write their first argument.
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul}


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _inplace_flag(fn: Callable[..., Any], node: torch.fx.Node) -> bool:
    """``F.relu(x, inplace=True)`` and the like, the flag given by keyword or position."""
    if "inplace" in node.kwargs:
        return bool(node.kwargs["inplace"])
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    if "inplace" in params:
        i = params.index("inplace")
        return i < len(node.args) and bool(node.args[i])
    return False


# Torch-level ops whose schema (at this level there is none) would hide an in-place write
# to running statistics.
_HIDDEN_WRITES: dict[Any, Callable[[torch.fx.Node], tuple[Any, ...]]] = {
    F.batch_norm: lambda n: (_arg(n, 1, "running_mean"), _arg(n, 2, "running_var"))
    if _arg(n, 5, "training", False) else (),
    F.instance_norm: lambda n: (_arg(n, 1, "running_mean"), _arg(n, 2, "running_var"))
    if _arg(n, 5, "use_input_stats", True) else (),
    # nn.Embedding(max_norm=...) / EmbeddingBag: the looked-up rows of the weight are
    # renormalised in place (torch.embedding_renorm_ inside the function)
    F.embedding: lambda n: (_arg(n, 1, "weight"),)
    if _arg(n, 3, "max_norm") is not None else (),
    F.embedding_bag: lambda n: (_arg(n, 1, "weight"),)
    if _arg(n, 3, "max_norm") is not None else (),
}


# Where F.embedding / F.embedding_bag take ``sparse``.
_SPARSE_ARG = {F.embedding: 6, F.embedding_bag: 7}


def _refuse_sparse_gradients(graph: torch.fx.Graph, trainable: Mapping[str, str]) -> None:
    """``nn.Embedding(sparse=True)`` (or ``EmbeddingBag``, or the functional form) on a
    trainable parameter: refused before the graph runs, as the other front ends refuse
    it; its sparse gradient failed inside the backward (StageError), after the forward.
    ``trainable``: placeholder name -> parameter name."""
    for node in graph.nodes:
        index = _SPARSE_ARG.get(node.target) if node.op == "call_function" else None
        if index is None or not _arg(node, index, "sparse", False):
            continue
        weight = _arg(node, 1, "weight")
        if isinstance(weight, torch.fx.Node) and alias_root(weight).name in trainable:
            raise ModelError(
                f"the compiled graph looks up parameter {trainable[alias_root(weight).name]} "
                f"with sparse=True ({node.format_node()}): {SPARSE_HINT}")


def _is_tensor_value(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("example_value"),
                                                          torch.Tensor)


def written_values(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Values ``node`` writes in place (torch-level IR)."""
    written: list[Any] = []
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("_") and name != "requires_grad_":
            written.append(node.args[0])
    elif node.op == "call_function":
        target = node.target
        if target in _INPLACE_OPERATORS and _is_tensor_value(node.args[0]):
            written.append(node.args[0])
        elif target is operator.setitem:
            written.append(node.args[0])
        elif target in _HIDDEN_WRITES:
            written.extend(_HIDDEN_WRITES[target](node))
        else:
            name = getattr(target, "__name__", "")
            if name.endswith("_") and not name.startswith("_") and node.args:
                written.append(node.args[0])  # torch.relu_(x), torch._C._nn.elu_(x)
            elif callable(target) and node.args and _inplace_flag(target, node):
                written.append(node.args[0])
            out = node.kwargs.get("out")
            if out is not None:
                written.extend(pytree.tree_leaves(out))
    return [w for w in written if isinstance(w, torch.fx.Node)]


# Methods and functions whose result may share memory with their first argument.
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t",
                 "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "select",
                 "as_strided", "flatten", "unflatten", "split", "chunk", "unbind",
                 "contiguous", "detach", "movedim", "swapaxes", "swapdims", "diagonal",
                 "unfold", "real", "imag", "view_as_real", "view_as_complex", "T", "mT",
                 "tensor_split", "split_with_sizes", "to", "type_as", "float", "half",
                 "bfloat16", "double", "int", "long", "bool", "type"}
_VIEW_FUNCTIONS = {torch.transpose, torch.permute, torch.reshape, torch.unsqueeze,
                   torch.squeeze, torch.narrow, torch.select, torch.flatten, torch.split,
                   torch.chunk, torch.unbind, torch.movedim, torch.swapaxes, torch.t,
                   torch.diagonal, torch.as_strided, torch.tensor_split, torch.detach,
                   operator.getitem,
                   torch._C._autograd._get_data_attr}  # ``t.data`` in Dynamo's graphs


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow ops whose result may alias their first argument back to the base value
    (over-approximating aliasing only merges units that could have stayed apart)."""
    while True:
        aliasing = ((node.op == "call_method" and node.target in _VIEW_METHODS)
                    or (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)
                    # ``t.data`` (torch.fx records the attribute read): t's storage
                    or (node.op == "call_function" and node.target is getattr
                        and node.args[1:2] == ("data",)))
        if not aliasing or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return node
        node = node.args[0]


# --- grad mode and autocast regions -----------------------------------------------------------

def _initial_grad_mode(graph: torch.fx.Graph) -> bool:
    """The grad mode a Dynamo graph starts in: Dynamo emits ``_set_grad_enabled`` only when
    the mode changes, so the first call sets the opposite of the starting mode."""
    first = next((n for n in graph.nodes
                  if n.op == "call_function" and n.target is torch._C._set_grad_enabled), None)
    return True if first is None else not bool(first.args[0])


# --- random calls ----------------------------------------------------------------------------

_RANDOM_FUNCTIONS = {torch.rand, torch.randn, torch.randint, torch.randperm,
                     torch.rand_like, torch.randn_like, torch.randint_like,
                     torch.bernoulli, torch.multinomial, torch.normal, torch.poisson,
                     F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                     F.feature_alpha_dropout, F.gumbel_softmax, F.rrelu,
                     F.fractional_max_pool2d, F.fractional_max_pool3d}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_",
                   "exponential_", "geometric_", "cauchy_", "log_normal_", "multinomial"}
_SDPA = {F.scaled_dot_product_attention}


def is_random(node: torch.fx.Node) -> bool:
    """A torch-level call that draws random numbers and that codegen does not already
    replace by a keyed stream (it does for ``F.dropout``)."""
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    if node.target in _SDPA:
        p = _arg(node, 4, "dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    if node.target is F.multi_head_attention_forward:  # nn.MultiheadAttention(dropout=p)
        p, training = _arg(node, 10, "dropout_p", 0.0), _arg(node, 13, "training", True)
        return training is not False and not (isinstance(p, (int, float)) and p == 0)
    return node.target in _RANDOM_FUNCTIONS
