"""Forward hooks whose work the traced program cannot carry.

A module forward hook (or pre-hook) runs while the model is traced, and whatever it does
to tensors (returning a changed output, writing a buffer in place, flipping
``requires_grad``) is recorded in the program like the module's own code.  What it does in
Python is not: a hook that stores an activation for later (``feats.append(out)``,
``self.last = out.detach()``) runs once, on the tracer's fake tensors, and never again, so
the user would read fake tensors where eager gives each call's activations.

Such hooks are found by what they leave behind: while tracing, each user hook runs under a
watch that notes the tensors it was given and gained a reference to, and the tensors it
created; once tracing is over and the tracer's own references are gone, any of them still
alive was kept by the hook somewhere outside the model's call.  (Hooks that collect into a
container the forward itself returns, like transformers' output recorders, leave nothing
alive: the collection ends with the call.)  Python counters a hook bumps are not seen
(``docs/models.md``: such counters are fixed at their traced value).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ..ops.thread_flag import ThreadFlag

_TABLES = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"))


@dataclass(frozen=True)
class KeptActivation:
    """A hook that kept a tensor of the traced call alive after the call."""

    module: str  # path of the hooked module ('' for the model; '<global>' for global hooks)
    kind: str  # 'forward hook' or 'forward pre-hook'
    hook: str  # the hook's qualified name

    def describe(self) -> str:
        where = "a global module" if self.module == "<global>" else \
            f"module '{self.module}'" if self.module else "the model itself"
        return f"{self.kind} {self.hook} on {where}"


class _Created(TorchFunctionMode):
    """Notes every tensor a hook's torch calls return."""

    def __init__(self, sink: list[weakref.ref]) -> None:
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func: Callable, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.sink.append(weakref.ref(t))
        return out


def _name(fn: Any) -> str:
    """``qualname (file:line)`` for functions, the class name for hook objects."""
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    name = getattr(target, "__qualname__", None) or type(fn).__qualname__
    if code is None:
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


_real_run = ThreadFlag()


@contextlib.contextmanager
def hooks_unwatched() -> Iterator[None]:
    """Inside, on this thread, watched hooks run as the user's own: a real eager run of
    the model (not a trace) keeps what the user's hooks keep, as any eager call would."""
    with _real_run.set(True):
        yield


def _watched(fn: Callable, found: KeptActivation, suspects: list) -> Callable:
    def hook(*call: Any) -> Any:
        if _real_run.get():
            return fn(*call)
        given = [t for t in pytree.tree_leaves(call[1:]) if isinstance(t, torch.Tensor)]
        if any(isinstance(x, torch.fx.Proxy) for x in pytree.tree_leaves(call[1:])):
            return fn(*call)  # the torch.fx fallback's symbolic run: nothing real to watch
        counts = [sys.getrefcount(t) for t in given]
        attrs = getattr(call[0], "__dict__", {})
        held = {k: id(v) for k, v in attrs.items() if isinstance(v, torch.Tensor)}
        created: list[weakref.ref] = []
        with _Created(created):
            result = fn(*call)
        returned = {id(t) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)}
        # a tensor handed in that the hook put in a container (list, dict, an object's
        # attributes); the tracer's own records of its inputs are other objects
        kept = [weakref.ref(t) for t, n in zip(given, counts)
                if id(t) not in returned and sys.getrefcount(t) > n]
        # a tensor of the call a forward hook set on its module (m.last = out.detach())
        # counts as kept whatever becomes of it: tracing puts the module's attributes
        # back afterwards (passes/state_guard.py), which would leave it dead by the check
        # below.  (Pre-hooks set computed weights there: the old weight_norm.)
        if found.kind == "forward hook":
            ours = {id(t) for t in given} | {id(r()) for r in created if r() is not None}
            kept += [(lambda t=v: t) for k, v in attrs.items()
                     if isinstance(v, torch.Tensor) and held.get(k) != id(v)
                     and id(v) not in returned and id(v) in ours]
        suspects.append((found, kept + [r for r in created
                                        if r() is not None and id(r()) not in returned]))
        return result
    hook.__wrapped__ = fn  # type: ignore[attr-defined]
    return hook


class HookWatch:
    """What :func:`watch_forward_hooks` found."""

    def __init__(self) -> None:
        self.found: list[KeptActivation] = []
        # The model's inputs in each traced call: they outlive tracing by design (the
        # tracer's shape records hold them), so a hook handed one keeps nothing.
        self.inputs: list[weakref.ref] = []

    def _note_inputs(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self.inputs += [weakref.ref(t) for t in pytree.tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)]

    def _is_input(self, t: torch.Tensor) -> bool:
        return any(r() is t for r in self.inputs)


@contextlib.contextmanager
def watch_forward_hooks(model: torch.nn.Module) -> Iterator[HookWatch]:
    """While the body traces ``model``, every forward hook and pre-hook registered on it
    (or globally) runs watched; on exit ``found`` holds those that kept a tensor alive.
    The hooks are the user's own objects again on exit, whatever happens."""
    from torch.nn.modules import module as nn_module

    suspects: list[tuple[KeptActivation, list[weakref.ref]]] = []
    swapped: list[tuple[dict, Any, Callable]] = []
    places = [(path, m.__dict__) for path, m in model.named_modules()]
    places.append(("<global>", {"_forward_pre_hooks": nn_module._global_forward_pre_hooks,
                                "_forward_hooks": nn_module._global_forward_hooks}))
    for path, attrs in places:
        for table_name, kind in _TABLES:
            table = attrs.get(table_name)
            for key, fn in list((table or {}).items()):
                found = KeptActivation(path, kind, _name(fn))
                table[key] = _watched(fn, found, suspects)
                swapped.append((table, key, fn))
    watch = HookWatch()
    noting = model.register_forward_pre_hook(watch._note_inputs, prepend=True,
                                              with_kwargs=True)
    try:
        yield watch
    finally:
        noting.remove()
        for table, key, fn in swapped:
            if key in table:
                table[key] = fn
    if not any(r() is not None for _, refs in suspects for r in refs):
        return  # nothing left alive (most models: no hooks at all): no collection to pay
    gc.collect()  # the tracer's reference cycles hold its fake tensors until collected
    for hook, refs in suspects:
        alive = [r() for r in refs]
        if hook not in watch.found and any(t is not None and not watch._is_input(t)
                                           for t in alive):
            watch.found.append(hook)
