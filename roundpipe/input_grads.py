"""The gradients a ``forward_backward`` call sends into its inputs and label.

Eager PyTorch's ``loss_fn(model(x), y).backward()`` fills ``x.grad`` for a leaf ``x`` that
requires grad, and backpropagates into whatever computed ``x`` (an embedding outside the
model, a frozen encoder's output with grad) or ``y`` (a teacher's output computed with
grad).  ``forward_backward`` runs the model and ``loss_fn`` on device threads, where an
input or label is a fresh leaf of its uploaded copy (no backward ever runs on the
caller's graph from a device thread); the executor returns each microbatch's gradients
of those leaves, and the caller's thread runs one ``torch.autograd.backward`` per
microbatch, in microbatch order, into the tensors that microbatch read (its piece of a
split input, an input it read whole, its label), as eager's loop runs one backward per
microbatch: a hook on an input (or on what computed it) runs once per microbatch and sees
that microbatch's gradient (through the split: zero outside the microbatch's rows), and
accumulation into ``.grad`` follows eager's order bitwise.

Where that graph reaches a parameter of the pipe's own model, its gradient lands on that
parameter (or master) after the pipe's own gradients were committed: the pipe adds it
(:meth:`~roundpipe.api.RoundPipe.forward_backward`), and refuses the cases it cannot make
exact (:func:`reached_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from .runtime.microbatch import input_path


@dataclass
class GradRoots:
    """What one call sends gradients into: per microbatch, the inputs (program value
    name -> tensor) and label leaves (flat index -> tensor) that require grad."""

    inputs: list[dict[str, torch.Tensor]]
    labels: list[dict[int, torch.Tensor]]
    # id(tensor) -> how the user names it (``input_args[0]``, ``label``), for messages
    names: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return any(self.inputs) or any(self.labels)

    def tensors(self) -> list[torch.Tensor]:
        """Each distinct tensor once, in microbatch order."""
        seen: dict[int, torch.Tensor] = {}
        for inputs, labels in zip(self.inputs, self.labels):
            for t in (*inputs.values(), *labels.values()):
                seen.setdefault(id(t), t)
        return list(seen.values())

    def name(self, t: torch.Tensor) -> str:
        """The user's name of ``t`` (or of the input it is a piece of)."""
        return self.names.get(id(t), "an input")


def _wants_grad(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.requires_grad
            and (value.is_floating_point() or value.is_complex()))


def grad_roots(flat: Sequence[Mapping[str, Any]], labels: Sequence[Any],
               user: tuple[tuple[Any, ...], dict[str, Any], Any]) -> GradRoots:
    """The call's inputs and label leaves that require grad, per microbatch.
    ``user``: the call's ``(input_args, input_kwargs, label)``, to name them."""
    inputs = [{n: v for n, v in mb.items() if _wants_grad(v)} for mb in flat]
    label_leaves = [{i: v for i, v in enumerate(pytree.tree_flatten(mb)[0]) if _wants_grad(v)}
                    for mb in labels]
    if not any(inputs) and not any(label_leaves):  # the common call: nothing to name
        return GradRoots(inputs, label_leaves)
    names: dict[int, str] = {}
    args, kwargs, label = user
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            names.setdefault(id(leaf), input_path(path))
    for path, leaf in pytree.tree_flatten_with_path(label)[0]:
        if isinstance(leaf, torch.Tensor):
            names.setdefault(id(leaf), "label" + pytree.keystr(path))
    # a microbatch's piece is named after the input it was split from
    for mb in inputs:
        for value, t in mb.items():
            base = getattr(t, "_base", None)
            names.setdefault(id(t), names.get(id(base), f"the input {value!r}")
                             if base is not None else f"the input {value!r}")
    for mb in label_leaves:
        for t in mb.values():
            base = getattr(t, "_base", None)
            names.setdefault(id(t), names.get(id(base), "the label")
                             if base is not None else "the label")
    return GradRoots(inputs, label_leaves, names)


def reached_parameters(roots: GradRoots, targets: Mapping[int, str]
                       ) -> dict[str, str]:
    """The parameters among ``targets`` (id(tensor) -> name) the roots' graphs
    accumulate gradients into (their ``AccumulateGrad`` nodes, or a root that is one of
    them): name -> the user's name of the first root reaching it."""
    found: dict[str, str] = {}
    seen: dict[int, Any] = {}  # id -> node, kept alive so that no id is reused
    for root in roots.tensors():
        if id(root) in targets:
            found.setdefault(targets[id(root)], roots.name(root))
        stack = [root.grad_fn] if root.grad_fn is not None else []
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            variable = getattr(node, "variable", None)  # an AccumulateGrad node
            if isinstance(variable, torch.Tensor) and id(variable) in targets:
                found.setdefault(targets[id(variable)], roots.name(root))
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return found


def send_grads(roots: GradRoots, input_grads: Sequence[Mapping[str, torch.Tensor]] | None,
               label_grads: Sequence[Mapping[int, torch.Tensor]] | None) -> None:
    """One backward per microbatch, in microbatch order, into the tensors that
    microbatch read (see the module docstring); on the calling thread, as eager's
    ``backward()`` runs.  The graphs are kept until the last microbatch's backward:
    microbatches share them (the split, an encoder whose output was split)."""
    n = len(roots.inputs)
    batches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for i in range(n):
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        where: dict[int, int] = {}
        pairs = [(t, input_grads[i].get(name) if input_grads else None)
                 for name, t in roots.inputs[i].items()]
        pairs += [(t, label_grads[i].get(index) if label_grads else None)
                  for index, t in roots.labels[i].items()]
        for t, g in pairs:
            if g is None:
                continue
            k = where.get(id(t))
            if k is None:  # (a download of its own: the engine may keep it as .grad)
                where[id(t)] = len(tensors)
                tensors.append(t)
                grads.append(g)
            else:  # one tensor read twice by the microbatch: one backward, summed
                grads[k] = grads[k] + g
        if tensors:
            batches.append((tensors, grads))
    for k, (tensors, grads) in enumerate(batches):
        torch.autograd.backward(tensors, grads, retain_graph=k < len(batches) - 1)
