"""Pass 2, layers: group graph nodes into layer units.

A *layer unit* is the atom the partitioner cuts between.  The units are:

* the children of every *repeated container* (an ``nn.ModuleList`` / ``nn.Sequential``
  with at least two children of one type that hold parameters), at any depth; where such a
  child is itself mostly made of repeated containers (``stages[i].blocks[j]``), the inner
  children are the units;
* every other module, at the shallowest path that is neither an ancestor of a unit nor
  an *opened* module (for ``LlamaForCausalLM``: ``model.embed_tokens``,
  ``model.rotary_emb``, ``model.norm``, ``lm_head``).  Opened (:func:`find_open_modules`):
  the root; a *run of layers* outside every repeated block (an ``nn.Sequential``,
  ``ModuleList`` or ``ModuleDict`` with two or more children holding parameters, of mixed
  types: ``Linear, ReLU, Linear``); and, below the root, each module that is the only
  one holding parameters (a wrapper: ``self.net = Net()``).  So a model with no repeated
  blocks gets one unit per layer of its run or of its trunk, however deeply it sits.

Nodes that run directly in an ancestor's ``forward`` (glue: mask building, residual adds
between blocks) join the unit before them.  Units are contiguous runs of nodes in graph
order, so a unit only reads values from earlier units.  A module called twice in separate
places (weight sharing) becomes two units, ``name`` and ``name#2``.  A module that holds
parameters and is applied several times in a row (ALBERT's one shared layer, a weight-tied
loop) is a repeated block in time: each application is a unit (``name``, ``name#2``, ...),
read from export's call numbering (``path@N`` in ``nn_module_stack``), so the plan can cut
between applications.

Writes ``node.meta["roundpipe.unit"]`` and returns a :class:`LayerAssignment`.
"""

from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx

from ..plan import LayerUnit
from .tensor_hooks import HOOKED
from .trace import (HIDDEN_WRITES, MODULE_PATH, MUTATES as MUTATES_KEY, TracedGraph,
                    alias_root, any_alias_root, normalize_module_path)

log = logging.getLogger(__name__)

UNIT = "roundpipe.unit"
# Values a node writes in place where no schema says so (torch-level IR: Dynamo graphs,
# set by passes/dynamo.py; the torch.fx fallback's graphs are read directly), already
# followed back to the written base value.
WRITES = "roundpipe.writes"

# A child of a repeated container is replaced by its own inner units when those cover at
# least this share of its parameters (nested repeats such as stages[i].blocks[j]).
_NESTED_COVERAGE = 0.5
# A module applied many times in a row (a recurrent cell over 1,000 time steps) gets at
# most this many units, of consecutive applications: each unit costs host work per
# microbatch, and this many cut points balance any realistic number of devices.
_MAX_APPLICATION_UNITS = 16
# Containers of modules: their children are the layers (runs, repeated blocks).
_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


@dataclass(frozen=True)
class LayerAssignment:
    """Layer units and the unit of every computing node (by node name)."""

    units: tuple[LayerUnit, ...]
    node_unit: dict[str, int]
    notes: tuple[str, ...] = ()  # why units were merged, for the plan's notes


@dataclass(frozen=True)
class ModuleTree:
    """What the unit rule reads of a module hierarchy, from an ``nn.Module``
    (:func:`module_tree`) or from the module paths a graph records
    (:func:`roundpipe.passes.dynamo.graph_module_tree`), so both front ends cut units by
    one rule.

    Paths are dotted (``""`` is the root).  ``kind`` is the module's type (None where
    unknown), ``numel`` the parameters it holds (tied ones once), ``sequences`` the
    containers of modules (``ModuleList``, ``Sequential``, ``ModuleDict``).
    """

    children: dict[str, tuple[str, ...]]
    kind: dict[str, type | None]
    numel: dict[str, int]
    sequences: frozenset[str]


def module_tree(model: torch.nn.Module) -> ModuleTree:
    children: dict[str, tuple[str, ...]] = {}
    kind: dict[str, type | None] = {}
    numel: dict[str, int] = {}
    sequences = set()
    for path, module in model.named_modules(remove_duplicate=False):
        kind[path] = type(module)
        numel[path] = sum(p.numel() for p in module.parameters())
        children[path] = tuple(_join(path, n) for n, _ in module.named_children())
        if isinstance(module, _CONTAINERS):
            sequences.add(path)
    return ModuleTree(children, kind, numel, frozenset(sequences))


def find_unit_roots(model: torch.nn.Module | ModuleTree, opaque: Iterable[str] = ()
                    ) -> tuple[str, ...]:
    """Module paths of the repeated blocks of ``model`` (children of repeated containers).

    Modules in ``opaque`` (leaf modules, run as one call) are not looked into: experts in a
    ``ModuleList`` inside an opaque mixture-of-experts block cannot be units, so the layer
    holding the block is one.
    """
    tree = model if isinstance(model, ModuleTree) else module_tree(model)
    hidden = frozenset(opaque)

    def repeated(path: str) -> bool:
        kids = tree.children.get(path, ())
        kinds = {tree.kind.get(k) for k in kids}
        return (path in tree.sequences and len(kids) >= 2 and len(kinds) == 1
                and None not in kinds and all(tree.numel.get(k, 0) > 0 for k in kids))

    def expand(container: str) -> list[str]:
        roots: list[str] = []
        for kid in tree.children.get(container, ()):
            # A child that is itself a repeated container (ModuleList of ModuleLists) is
            # expanded like one: its children are units too, at any depth.
            if kid in hidden:
                inner: list[str] = []
            else:
                inner = expand(kid) if repeated(kid) else roots_in(kid)
            covered = sum(tree.numel.get(r, 0) for r in inner)
            total = tree.numel.get(kid, 0)
            if inner and total and covered >= _NESTED_COVERAGE * total:
                roots.extend(inner)
            else:
                roots.append(kid)
        return roots

    def roots_in(path: str) -> list[str]:
        roots: list[str] = []
        for kid in tree.children.get(path, ()):
            if kid in hidden:
                continue
            roots.extend(expand(kid) if repeated(kid) else roots_in(kid))
        return roots

    return tuple(expand("") if repeated("") else roots_in(""))


def find_open_modules(model: torch.nn.Module | ModuleTree, roots: Iterable[str] = (),
                      opaque: Iterable[str] = ()) -> tuple[str, ...]:
    """Modules, outside every unit root in ``roots``, whose children are units of their
    own (the root always is): runs of layers (a container with two or more children that
    hold parameters: ``nn.Sequential(Linear, ReLU, Linear)``), and the trunk below the
    root (each module that is the only child holding parameters, at any depth: a wrapper
    around the model's layers).  Where the layers sit then does not change the units:
    ``self.layers = nn.Sequential(...)`` gets the units a bare ``nn.Sequential`` gets.

    A module is opened only when its children hold all of its parameters (its own code
    would otherwise become glue); leaf modules (``opaque``) and what is inside them never
    are.
    """
    tree = model if isinstance(model, ModuleTree) else module_tree(model)
    inside = tuple(roots) + tuple(opaque)

    def covered(path: str) -> bool:
        return any(path == r or path.startswith(r + ".") for r in inside)

    def holders(path: str) -> list[str]:
        return [k for k in tree.children.get(path, ()) if tree.numel.get(k, 0) > 0]

    def splittable(path: str) -> bool:
        kids = holders(path)
        return bool(kids) and not covered(path) and \
            sum(tree.numel.get(k, 0) for k in kids) >= tree.numel.get(path, 0)

    opened: list[str] = []
    path = ""
    while True:  # the trunk: wrappers around the model's layers
        kids = holders(path)
        if len(kids) != 1 or not splittable(kids[0]):
            break
        path = kids[0]
        opened.append(path)
    for path in tree.children:  # runs of layers, wherever they sit
        if path and path in tree.sequences and len(holders(path)) >= 2 \
                and splittable(path) and path not in opened:
            opened.append(path)
    return tuple(opened)


def one_unit_reason(tree: ModuleTree, hidden: Iterable[str], layers: LayerAssignment
                    ) -> str:
    """Why a model got a single unit (so one stage, nothing pipelined), in one line."""
    hidden = frozenset(hidden)
    path = ""
    while True:  # down the wrappers to where the parameters sit
        kids = [k for k in tree.children.get(path, ()) if tree.numel.get(k, 0) > 0]
        if len(kids) != 1 or path in hidden:
            break
        path = kids[0]
    kind = tree.kind.get(path)
    what = repr(path) if path else "the model"
    if kind is not None:
        what += f" ({kind.__name__})"
    own = tree.numel.get(path, 0) - sum(tree.numel.get(k, 0) for k in kids)
    if layers.notes:
        why = layers.notes[-1].removeprefix("layers: ")
    elif path and path in hidden:
        why = f"its parameters are all in {what}, which is kept opaque (a leaf module)"
    elif not kids and path:
        why = f"its parameters are all in one layer, {what}"
    elif not kids:
        why = f"{what} holds its parameters itself (no submodule holds any)"
    elif own > 0:
        why = (f"{what} computes with parameters of its own besides its children's, so "
               "it is not split between them")
    else:
        why = ("the layers it calls read or write each other's values in place, or were "
               "kept together for another reason given in the plan's notes")
    return ("layers: the whole model is one unit, so the plan has 1 stage and nothing is "
            f"pipelined: {why}; roundpipe cuts between modules holding parameters (repeated "
            "blocks in a ModuleList/Sequential/ModuleDict, or a run of layers such as "
            "nn.Sequential(Linear, ReLU, Linear))")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


_CALL_NUMBER = re.compile(r"@(\d+)$")


def _calls(node: torch.fx.Node) -> dict[str, int]:
    """Module path -> which application of that module the node runs in (0 for the first;
    export numbers later ones ``path@N``; Dynamo's graphs have no numbering: always 0)."""
    calls: dict[str, int] = {}
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        match = _CALL_NUMBER.search(str(key))
        calls[normalize_module_path(value[0])] = int(match.group(1)) if match else 0
    return calls


def _applied_in_a_row(nodes: list[torch.fx.Node], roots: tuple[str, ...],
                      param_paths: set[str]) -> dict[str, int]:
    """Modules holding parameters applied two or more times in a row, outside every unit
    root (only glue, code of their ancestors, runs between two applications), with their
    number of applications."""
    spans: dict[str, dict[int, list[int]]] = {}
    for i, node in enumerate(nodes):
        for path, call in _calls(node).items():
            span = spans.setdefault(path, {}).setdefault(call, [i, i])
            span[1] = i

    def inside(path: str, other: str) -> bool:
        return path == other or path.startswith(other + ".")

    def glue_for(path: str, node: torch.fx.Node) -> bool:
        where = node.meta.get(MODULE_PATH, "")
        return where == "" or path.startswith(where + ".")

    found: dict[str, int] = {}
    for path, calls in spans.items():
        if (not path or len(calls) < 2 or path not in param_paths
                or any(inside(path, r) or inside(r, path) for r in roots)):
            continue
        order = [calls[c] for c in sorted(calls)]
        if all(a[1] < b[0] and all(glue_for(path, n) for n in nodes[a[1] + 1:b[0]])
               for a, b in zip(order, order[1:])):
            found[path] = len(calls)
    return {p: n for p, n in found.items()
            if not any(p != q and inside(p, q) for q in found)}


def assign_layers(traced: TracedGraph, unit_roots: Iterable[str],
                  opened: Iterable[str] = ()) -> LayerAssignment:
    """Assign every computing node of ``traced`` to a layer unit; the children of the
    ``opened`` modules (:func:`find_open_modules`) are units of their own."""
    graph = traced.graph_module.graph
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    param_paths = {".".join(name.split(".")[:i])
                   for spec in traced.state if spec.kind == "parameter"
                   for name in (spec.fqn, *spec.aliases)
                   for i in range(1, name.count(".") + 1)}
    roots = tuple(unit_roots)
    applied = _applied_in_a_row(nodes, roots, param_paths)
    roots += tuple(applied)
    # Applications per unit, ceil(n / _MAX_APPLICATION_UNITS), for every module: a block
    # of a ModuleList looped 100 times is capped like a module found by _applied_in_a_row.
    applications: dict[str, set[int]] = {}
    for node in nodes:
        for path, call in _calls(node).items():
            applications.setdefault(path, set()).add(call)
    per_unit = {p: -(-len(c) // _MAX_APPLICATION_UNITS) for p, c in applications.items()}
    root_set = set(roots)
    ancestors = {""}
    for r in roots + tuple(opened):
        parts = r.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    # an opened module's children are units: it is an ancestor, unless a unit holds it
    ancestors.update(p for p in opened if not any(
        p == r or p.startswith(r + ".") for r in roots))

    def key_of(path: str) -> str | None:
        parts = path.split(".") if path else []
        for i in range(len(parts), 0, -1):  # the innermost enclosing unit root wins
            prefix = ".".join(parts[:i])
            if prefix in root_set:
                return prefix
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in ancestors:
                return prefix
        return None  # glue: runs in an ancestor of the units (or the root) itself

    def unit_key(node: torch.fx.Node) -> tuple[str, int] | None:
        key = key_of(node.meta.get(MODULE_PATH, ""))
        # Each application of a module is its own run (consecutive ones included).
        return None if key is None else (key, _calls(node).get(key, 0) // per_unit.get(key, 1))

    state_names = {s.name for s in traced.state}
    keys: dict[torch.fx.Node, tuple[str, int] | None] = {}
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem and isinstance(
                node.args[0], torch.fx.Node) and node.args[0] in keys:
            keys[node] = keys[node.args[0]]
        elif node.op == "get_attr":
            keys[node] = None  # fixed below: joins the unit of its first user
        else:
            keys[node] = unit_key(node)
    for node in nodes:
        if node.op == "get_attr" and node.users:
            keys[node] = keys.get(next(iter(node.users)))

    # Contiguous runs; glue joins the run before it (or the first run).
    runs: list[tuple[tuple[str, int] | None, list[torch.fx.Node]]] = []
    for node in nodes:
        key = keys[node]
        if runs and (key is None or key == runs[-1][0] or runs[-1][0] is None):
            if runs[-1][0] is None and key is not None:
                runs[-1] = (key, runs[-1][1])
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    if not runs:
        runs = [(("model", 0), [])]

    # Units that read no state and are not blocks (activations, dropout, glue modules)
    # join their neighbour: they cost little and would only clutter the plan.
    def reads_state(run_nodes: list[torch.fx.Node]) -> bool:
        return any(isinstance(a, torch.fx.Node) and a.name in state_names
                   for n in run_nodes for a in n.all_input_nodes)

    merged_runs: list[tuple[tuple[str, int] | None, list[torch.fx.Node]]] = []
    for key, run_nodes in runs:
        if merged_runs and _base(key) not in root_set and not reads_state(run_nodes):
            merged_runs[-1][1].extend(run_nodes)
        elif (merged_runs and _base(merged_runs[-1][0]) not in root_set
              and not reads_state(merged_runs[-1][1])):
            merged_runs[-1] = (key, merged_runs[-1][1] + run_nodes)
        else:
            merged_runs.append((key, list(run_nodes)))
    merged = _merge_cross_unit_writes([(_base(k), n) for k, n in merged_runs])
    merged, notes = _merge_written_state(merged, traced)

    first_block = next((i for i, (k, _) in enumerate(merged) if k in root_set), None)
    last_block = max((i for i, (k, _) in enumerate(merged) if k in root_set), default=None)
    seen: dict[str, int] = {}
    units: list[LayerUnit] = []
    node_unit: dict[str, int] = {}
    for index, (key, run_nodes) in enumerate(merged):
        base = key or "model"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        if key in root_set:
            kind = "block"
        elif first_block is None:
            kind = "module"
        elif index < first_block:
            kind = "prologue"
        elif last_block is not None and index > last_block:
            kind = "epilogue"
        else:
            kind = "module"
        paths = tuple(dict.fromkeys(n.meta.get(MODULE_PATH, "") for n in run_nodes
                                    if n.meta.get(MODULE_PATH)))
        units.append(LayerUnit(index=index, name=name, kind=kind,  # type: ignore[arg-type]
                               module_paths=paths, num_nodes=len(run_nodes)))
        for node in run_nodes:
            node.meta[UNIT] = index
            node_unit[node.name] = index
    return LayerAssignment(units=tuple(units), node_unit=node_unit, notes=notes)


def _base(key: tuple[str, int] | None) -> str | None:
    return None if key is None else key[0]


def parallel_containers(traced: TracedGraph, layers: LayerAssignment) -> frozenset[str]:
    """Repeated containers whose children do not feed one another.

    Layers of a network form a chain: block ``i + 1`` reads what block ``i`` made.  The
    experts of a mixture-of-experts layer, or the branches of an inception module, all
    read the same input instead; as units they would be no layers at all, so their
    container is returned, to be kept whole (the layer holding it becomes the unit).
    Only the block's own nodes are checked, not glue that joined its unit (the sum over
    experts reads every expert's output).
    """
    graph = traced.graph_module.graph
    produced: dict[int, set[str]] = {}
    own_reads: dict[int, set[str]] = {}
    blocks = {u.index: u.name for u in layers.units if u.kind == "block" and "#" not in u.name}
    for node in graph.nodes:
        unit = layers.node_unit.get(node.name)
        if unit is None:
            continue
        produced.setdefault(unit, set()).add(node.name)
        root = blocks.get(unit)
        path = node.meta.get(MODULE_PATH, "")
        if root is not None and (path == root or path.startswith(root + ".")):
            own_reads.setdefault(unit, set()).update(
                a.name for a in node.all_input_nodes if layers.node_unit.get(a.name) != unit)
    siblings: dict[str, list[int]] = {}
    for index, name in sorted(blocks.items()):
        siblings.setdefault(name.rpartition(".")[0], []).append(index)
    parallel = set()
    for parent, units in siblings.items():
        for a, b in zip(units, units[1:]):
            if not own_reads.get(b, set()) & produced.get(a, set()):
                parallel.add(parent)
                break
    return frozenset(parallel)


def _merge_written_state(
    runs: list[tuple[str | None, list[torch.fx.Node]]], traced: TracedGraph
) -> tuple[list[tuple[str | None, list[torch.fx.Node]]], tuple[str, ...]]:
    """Merge the units from the first to the last that reads or writes a piece of state
    written during the forward (a counter or a running average one module keeps for
    several blocks, a buffer reassigned in one block and read in another).

    Eager PyTorch runs every unit on microbatch 0, then every unit on microbatch 1; a
    pipeline runs a job's units on every microbatch before the next job starts.  The two
    orders give the same state only when each piece of state is touched by one unit (jobs
    never split a unit), so a unit that read such state from another job would see it a
    microbatch late, and the jobs' copies of it would overwrite each other's writes.
    """
    state = {s.name for s in traced.state}
    run_of = {n: i for i, (_, ns) in enumerate(runs) for n in ns}
    placeholders = {n.name: n for n in traced.graph_module.graph.nodes
                    if n.op == "placeholder" and n.name in state}
    written: set[torch.fx.Node] = set()
    for node in run_of:
        for value in _written_by(node, placeholders):
            root = any_alias_root(value)
            if root.op == "placeholder" and root.name in state:
                written.add(root)
    by_value = {n.name: n for n in run_of}
    for slot, value in traced.buffer_updates:  # reassigned: the writer is the new value's
        if slot in placeholders and value in by_value:
            written.add(placeholders[slot])
    if not written:
        return runs, ()
    span: dict[torch.fx.Node, list[int]] = {}
    for node, i in run_of.items():
        touched = [any_alias_root(a) for a in node.all_input_nodes]
        touched += [placeholders[slot] for slot, value in traced.buffer_updates
                    if value == node.name and slot in placeholders]
        for root in touched:
            if root in written:
                lo_hi = span.setdefault(root, [i, i])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], i), max(lo_hi[1], i)
    join_previous = [False] * len(runs)
    fqn = {s.name: s.fqn for s in traced.state}
    notes = []
    for root, (lo, hi) in span.items():
        for k in range(lo + 1, hi + 1):
            join_previous[k] = True
        if hi > lo:
            notes.append(f"layers: {runs[lo][0] or 'model'} .. {runs[hi][0] or 'model'} are "
                         f"one unit: they all read or write {fqn[root.name]}, which the "
                         "forward updates (its updates must keep eager's order)")
    out: list[tuple[str | None, list[torch.fx.Node]]] = []
    for i, (key, run_nodes) in enumerate(runs):
        if join_previous[i] and out:
            out[-1] = (out[-1][0], out[-1][1] + list(run_nodes))
        else:
            out.append((key, list(run_nodes)))
    if notes:
        log.info("roundpipe: %s", "; ".join(notes))
    return out, tuple(notes)


def _written_by(node: torch.fx.Node, placeholders: dict[str, torch.fx.Node]
                ) -> list[torch.fx.Node]:
    """The values ``node`` writes in place, in either IR (ATen schemas, export's hidden
    writes, opaque module calls; torch-level calls of Dynamo graphs and the torch.fx
    fallback)."""
    found = list(node.meta.get(WRITES, ()))
    found += [placeholders[m] for m in node.meta.get(MUTATES_KEY, ()) if m in placeholders]
    schema = getattr(node.target, "_schema", None)
    if node.op == "call_function" and schema is not None:
        for j, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[j] if j < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, torch.fx.Node):
                    found.append(value)
        hidden = HIDDEN_WRITES.get(node.target)
        if hidden is not None:
            found.extend(v for v in hidden(node) if isinstance(v, torch.fx.Node))
    elif node.op == "call_method" or node.op == "call_function":
        from .dynamo import written_values  # passes/dynamo.py imports this module
        found.extend(written_values(node))
    return found


def _merge_cross_unit_writes(
    runs: list[tuple[str | None, list[torch.fx.Node]]]
) -> list[tuple[str | None, list[torch.fx.Node]]]:
    """Merge units so that no node writes in place to a value another unit defined, or
    registers a tensor hook on one.

    Units exchange values as copies, so an in-place write (or a hook) must stay with the
    definition.
    """
    run_of = {n: i for i, (_, ns) in enumerate(runs) for n in ns}
    reach = list(range(len(runs)))  # reach[i]: the first run that run i must merge with
    for i, (_, run_nodes) in enumerate(runs):
        for node in run_nodes:
            # A tensor hook sees the value's whole gradient only where the value's
            # readers all are: another unit holds a copy, whose gradient is that unit's
            # share (a value read by this unit alone can be hooked here, on its copy).
            for value in node.meta.get(HOOKED, ()):
                if value in run_of and run_of[value] < i and any(
                        run_of.get(u) != i for u in value.users if u is not node):
                    reach[i] = min(reach[i], run_of[value])
            bases = node.meta.get(WRITES)
            if bases is None and (node.op == "call_method" or (
                    node.op == "call_function" and not hasattr(node.target, "_schema"))):
                # torch-level IR without the meta (the torch.fx fallback): x.add_(y), ...
                # (imported here: passes/dynamo.py imports this module)
                from .dynamo import alias_root as torch_alias_root, written_values
                bases = [torch_alias_root(w) for w in written_values(node)]
            for base in bases or ():
                if base in run_of and run_of[base] < i:
                    reach[i] = min(reach[i], run_of[base])
            schema = getattr(node.target, "_schema", None)
            if node.op != "call_function" or schema is None:
                continue
            for j, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = node.args[j] if j < len(node.args) else node.kwargs.get(arg.name)
                if not isinstance(value, torch.fx.Node):
                    continue
                base = alias_root(value)
                if base in run_of and run_of[base] < i:
                    reach[i] = min(reach[i], run_of[base])
    join_previous = [False] * len(runs)
    for i, r in enumerate(reach):
        for k in range(r + 1, i + 1):
            join_previous[k] = True
    out: list[tuple[str | None, list[torch.fx.Node]]] = []
    for i, (key, run_nodes) in enumerate(runs):
        if join_previous[i] and out:
            out[-1] = (out[-1][0], out[-1][1] + list(run_nodes))
        else:
            out.append((key, list(run_nodes)))
    return out
