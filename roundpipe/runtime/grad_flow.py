"""Which values of a unit program carry gradients, in-place writes included.

A value depends on a trainable input when one of its inputs does; and a tensor written in
place with such a value (``outs[:, i] = x`` into a buffer made by ``torch.zeros``)
carries it too, as do its views, whenever they were made.  Without the second rule a
model that fills a preallocated buffer lost every gradient upstream of the buffer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx


def _alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow view ops (ATen schemas whose output aliases the first input) to the base."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if (schema is None or not schema.returns or schema.returns[0].alias_info is None
                or not node.args or not isinstance(node.args[0], torch.fx.Node)):
            break
        node = node.args[0]
    return node


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The values ``node`` writes in place: ATen arguments marked written in the schema;
    in torch-level programs, ``x.add_(...)``-style methods and ``x[i] = v``."""
    written: list[torch.fx.Node] = []
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, torch.fx.Node):
                    written.append(value)
        elif node.target is operator.setitem and isinstance(node.args[0], torch.fx.Node):
            written.append(node.args[0])
    elif (node.op == "call_method" and node.target.endswith("_")
          and not node.target.endswith("__") and node.args
          and isinstance(node.args[0], torch.fx.Node)):
        written.append(node.args[0])
    return written


def live_nodes(graph: torch.fx.Graph, live_inputs: set[str]) -> set[str]:
    """Names of the nodes of ``graph`` that carry a gradient, given the placeholders in
    ``live_inputs`` (by node name)."""
    live = set(live_inputs)
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    roots = {n: _alias_root(n) for n in nodes}
    changed = True
    while changed:  # a write can make earlier views live: repeat until nothing moves
        changed = False
        for node in nodes:
            if node.name not in live and (
                    any(a.name in live for a in node.all_input_nodes)
                    or roots[node].name in live):
                live.add(node.name)
                changed = True
            if node.name in live:
                for target in _written(node):
                    base = _alias_root(target)
                    if base.name not in live and base.op != "placeholder":
                        live.add(base.name)
                        changed = True
    return live
