"""Calling an opaque module with explicit state (the torch.fx fallback's layer units and
export's leaf modules)."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree

from .thread_flag import ThreadFlag

from .hooks import registers_hooks, skipping_graphless_hooks


def call_module_functional(module: torch.nn.Module, state: dict[str, torch.Tensor],
                           *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with its parameters, buffers and tensor attributes replaced by
    ``state`` (names relative to ``module``).

    The call runs on a *twin* of the module tree, made for this call: every module copied
    shallowly, with its own parameter, buffer and submodule tables bound to ``state``.  The
    module itself is never touched: several devices' threads run the same opaque module at
    once, each with its own copies of the weights (``torch.func.functional_call`` swaps
    the tensors of the one shared module in place, and concurrent calls left the model
    holding device copies), and the user may read the model meanwhile.  Attributes the
    module's forward sets (caches) stay on the twin.

    A module whose forward registers tensor hooks runs where a forward job's ``no_grad``
    would make the registration fail: such registrations are skipped there (see
    :mod:`roundpipe.ops.hooks`).
    """
    if registers_hooks(module):
        with skipping_graphless_hooks():
            return _twin(module, state)(*args, **kwargs)
    return _twin(module, state)(*args, **kwargs)


_REHEARSAL = ThreadFlag()

# Module hooks that only a backward runs: a rehearsal's backward (the memory model's
# replay on fake tensors) must not call them, since eager never runs that backward.
_BACKWARD_HOOK_TABLES = ("_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def rehearsal() -> Iterator[None]:
    """Opaque modules called in this thread meanwhile run without their module backward
    hooks: the compiler's fake-tensor rehearsals of a job (``passes/memory.py``) run
    backwards that eager never runs, and a user's hook must see only eager's calls."""
    with _REHEARSAL.set(True):
        yield


def _twin(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    quiet = _REHEARSAL.get()
    twins: dict[int, torch.nn.Module] = {}  # a submodule reached twice is one twin
    by_path: dict[str, torch.nn.Module] = {}

    def twin_of(m: torch.nn.Module, path: str) -> torch.nn.Module:
        twin = twins.get(id(m))
        if twin is None:
            twin = object.__new__(type(m))
            attrs = twin.__dict__
            attrs.update(m.__dict__)
            # Its own tables: binding state or setting a submodule must not reach ``m``.
            # (Other attributes are shared, as a call on the module itself would share
            # them: a list the forward appends to is the module's list.)
            for table in _TABLES:
                if table in attrs:
                    attrs[table] = attrs[table].copy()
            if quiet:
                for table in _BACKWARD_HOOK_TABLES:
                    if attrs.get(table):
                        attrs[table] = type(attrs[table])()
            # Methods set on the instance (``m.forward = MethodType(f, m)``: TRL's fused
            # LM head, accelerate's wrappers) would run on ``m`` and its host weights:
            # bound to the twin, they read the device's.
            for name, value in attrs.items():
                if isinstance(value, types.MethodType) and value.__self__ is m:
                    attrs[name] = types.MethodType(value.__func__, twin)
            twins[id(m)] = twin
            subs = attrs["_modules"]
            for name, sub in subs.items():
                if sub is not None:
                    subs[name] = twin_of(sub, f"{path}{name}.")
        by_path.setdefault(path, twin)
        return twin

    root = twin_of(module, "")
    for name, tensor in state.items():
        owner_path, _, attr = name.rpartition(".")
        owner = by_path.get(owner_path + "." if owner_path else "")
        if owner is None:
            owner = root.get_submodule(owner_path)
        if attr in owner._parameters:
            owner._parameters[attr] = tensor  # type: ignore[assignment]
        elif attr in owner._buffers:
            owner._buffers[attr] = tensor
        else:
            owner.__dict__[attr] = tensor  # a plain tensor attribute
    return root


_TABLES = ("_parameters", "_buffers", "_modules")


def tensor_leaves(output: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a module's output structure, in pytree order (a leaf module's
    flat outputs; its structure is rebuilt by the traced graph)."""
    return tuple(x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor))
