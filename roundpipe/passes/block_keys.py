"""When two repeated blocks trace to the same graph: the keys of ``shared_blocks``.

Two keys, one cheap and one exact:

* :func:`attribute_key`: everything about a block that its Python can read apart from
  tensor values: the classes of its modules, their plain attributes by value (floats by
  their exact bits), any other attribute (a config, a function, a hook) by identity, and
  its state's names, layouts and ties.  Blocks of one class with equal keys run the same
  code on the same attributes; they are taken to compute the same (code that branches on
  module identity or global state is the exception this cannot see).
* :func:`fingerprint`: what the block computes.  It runs once on static fake tensors
  under a recording dispatch mode, and every aten op is recorded with its arguments: a
  tensor by where it came from (input ``i``, parameter ``"attn.qkv.weight"``, output
  ``j`` of op ``k``), anything else by value or identity.  In dynamic mode it runs a
  second time with every symbolic size one larger, so that a constant that happens to
  equal the example's size is told apart from the size itself.

A block is *not shareable* (:class:`NotShareable`) when it writes its inputs, its state
or a tensor it did not make, reads a tensor it was neither passed nor made (except small
literals it writes itself, such as the index of ``x[..., [-2]]``, keyed by value),
changes its own attributes, or cannot run on static fake tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


class NotShareable(Exception):
    """This block call is traced normally."""


_PLAIN = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, type(Ellipsis))

# x.device and the like: dispatched, but never a node of any graph.
_METADATA_QUERIES = frozenset(getattr(torch.ops.prim, name).default
                              for name in ("device", "layout") if hasattr(torch.ops.prim, name))


def value_key(value: Any, keep: list[Any], depth: int = 0) -> Any:
    """``value`` by value when it is plain data, by identity otherwise (``keep`` holds the
    object, so its id is not reused while the key is in use); an object with attributes
    (a shared context, a config) also by its attributes, as they are now, two levels deep."""
    if isinstance(value, float):
        return ("float", value.hex())  # -0.0 differs from 0.0; nan equals nan
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(value_key(v, keep, depth) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((value_key(k, keep, depth), value_key(v, keep, depth))
                              for k, v in value.items()))
    keep.append(value)
    attrs = getattr(value, "__dict__", None)
    if depth < 2 and type(attrs) is dict and not isinstance(
            value, (torch.nn.Module, torch.Tensor, type)):
        return ("obj", id(value), value_key(attrs, keep, depth + 1))
    return ("id", id(value))


def input_key(x: Any, keep: list[Any]) -> Any:
    """One flat input of a block call: a tensor by its symbolic layout, a symbolic int
    (``block(x, H, W)``) by its expression, anything else by value."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(str(s) for s in x.shape), tuple(str(s) for s in x.stride()),
                x.dtype, str(x.device), x.requires_grad)
    if isinstance(x, torch.SymInt):
        return ("symint", str(x))
    return value_key(x, keep)


def state_layout(state: dict[str, torch.Tensor]) -> Any:
    """Names, layouts and ties (which names hold one tensor) of a block's state."""
    first: dict[int, int] = {}
    return tuple((name, tuple(t.shape), t.stride(), t.dtype, t.requires_grad,
                  first.setdefault(id(t), i)) for i, (name, t) in enumerate(state.items()))


# Module attributes that never change what forward computes (state is keyed apart).
_IGNORED_ATTRIBUTES = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks"})


# Set on the forward wrappers shared_blocks installs, which the key must not see.
WRAPPER_MARK = "_roundpipe_block_wrapper"


def attribute_key(module: torch.nn.Module, keep: list[Any]) -> Any:
    """The classes and attributes of ``module`` and its submodules (see module doc)."""
    entries = []
    for name, m in module.named_modules(remove_duplicate=False):
        attrs = []
        for key, value in vars(m).items():
            if key in _IGNORED_ATTRIBUTES or (callable(value)
                                              and getattr(value, WRAPPER_MARK, False)):
                continue
            if key.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) \
                    and isinstance(value, dict):
                value = tuple(value.values())  # handle ids differ; the functions matter
            attrs.append((key, value_key(value, keep)))
        entries.append((name, type(m), tuple(sorted(attrs, key=lambda a: a[0]))))
    return tuple(entries)


# --- fingerprints ------------------------------------------------------------------------

class _Recorder(TorchDispatchMode):
    """Records every aten op with its arguments described by provenance."""

    def __init__(self, refs: dict[int, Any], guarded: set[Any], keep: list[Any]) -> None:
        super().__init__()
        self.refs = refs          # tensor id -> provenance
        self.guarded = guarded    # storages the block must not write (inputs, state)
        self.keep = keep          # objects whose ids are in the record
        self.alive: list[Any] = []  # every tensor described, so ids stay unique
        self.ops: list[Any] = []

    def describe(self, x: Any, literal: bool = False) -> Any:
        if isinstance(x, torch.Tensor):
            ref = self.refs.get(id(x))
            if ref is None:
                if not literal:
                    raise NotShareable("reads a tensor it was neither passed nor made")
                return _literal(x, self.keep)
            return ref
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise NotShareable("a symbolic value inside a static fake run")
        return value_key(x, self.keep)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_QUERIES:
            return func(*args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in pytree.tree_leaves(value):
                    if isinstance(t, torch.Tensor) and (_storage(t) in self.guarded
                                                        or id(t) not in self.refs):
                        raise NotShareable(f"{func} writes the block's input or state, "
                                           "or a tensor it did not make")
        # Real tensors reach an op as the argument of lift_fresh only when forward wrote a
        # literal (torch.tensor([...]), x[..., [-2]]); any other is state kept elsewhere.
        literal = func in _LIFTS
        record = (func, str(spec), torch.is_grad_enabled(),
                  tuple(self.describe(x, literal) for x in flat))
        out = func(*args, **kwargs)
        k = len(self.ops)
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.refs.setdefault(id(t), ("op", k, j))
                self.alive.append(t)
        self.ops.append(record)
        return out


# A tensor literal a block writes (torch.tensor([...]), the index of x[..., [-2], :]) is
# keyed by value up to this many elements; export makes it a constant, which the copies
# then share.
_LITERAL_MAX_ELEMENTS = 64
_LIFTS = frozenset(getattr(torch.ops.aten, name).default
                   for name in ("lift_fresh", "lift_fresh_copy", "lift")
                   if hasattr(torch.ops.aten, name))


def _literal(t: torch.Tensor, keep: list[Any]) -> Any:
    if isinstance(t, FakeTensor) or t.device.type != "cpu" or t.requires_grad \
            or t.numel() > _LITERAL_MAX_ELEMENTS:
        raise NotShareable("reads a tensor it was neither passed nor made")
    with _disable_current_modes():  # read the real values, not a fake copy of them
        values = t.flatten().tolist()
    return ("literal", t.dtype, tuple(t.shape), tuple(value_key(v, keep) for v in values))


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _size(x: Any, bump: bool) -> int:
    """A concrete size for ``x``: its hint, or with ``bump`` its expression evaluated with
    every free symbol one larger."""
    if not isinstance(x, torch.SymInt):
        return x
    node = x.node
    if not bump:
        if node.hint is None:
            raise NotShareable("a data-dependent size")
        return int(node.hint)
    values = getattr(node.shape_env, "backed_var_to_val", None)
    if values is None:  # torch before 2.12
        values = node.shape_env.var_to_val
    if any(s not in values for s in node.expr.free_symbols):
        raise NotShareable("a data-dependent size")
    return int(node.expr.xreplace({s: values[s] + 1 for s in node.expr.free_symbols}))


def has_symbolic_size(flat: list[Any]) -> bool:
    return any(isinstance(s, torch.SymInt) for x in flat if isinstance(x, torch.Tensor)
               for s in itertools.chain(x.shape, x.stride()))


# nn.Module's own __call__ and __getattr__: export's tracer patches the class while it
# runs, to track which module each op comes from.
_MODULE_CALL = torch.nn.Module.__call__
_MODULE_GETATTR = torch.nn.Module.__getattr__


@contextlib.contextmanager
def outside_export() -> Iterator[None]:
    """Step out of export's tracing for private work: its modes, and its patches of
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


def fingerprint(mode: FakeTensorMode, forward: Callable[..., Any], module: torch.nn.Module,
                state: dict[str, torch.Tensor], flat: list[Any], in_spec: Any,
                keep: list[Any], bump: bool = False) -> Any:
    """What the block computes on these inputs (sizes bumped with ``bump``), hashable.

    Raises:
        NotShareable: see the module doc.
    """
    with outside_export():
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
                    x = _empty_like(x, [_size(s, bump) for s in x.shape],
                                    [_size(s, bump) for s in x.stride()])
                    refs[id(x)] = ("in", i)
                elif isinstance(x, torch.SymInt):  # a size passed on: its (bumped) value
                    x = _size(x, bump)
                inputs.append(x)
        guarded = {_storage(t) for t in itertools.chain(fake_state.values(), inputs)
                   if isinstance(t, torch.Tensor)}
        recorder = _Recorder(refs, guarded, keep)
        recorder.alive.extend(inputs)
        args, kwargs = pytree.tree_unflatten(inputs, in_spec)
        before = {id(m): (m, _snapshot(m)) for m in module.modules()}
        try:
            with _reparametrize_module(module, fake_state), mode, recorder, _quiet_fake():
                out = forward(*args, **kwargs)
        finally:
            changed = _restore_attributes(before)
        if changed:
            raise NotShareable(f"forward sets attributes ({changed})")
        out_flat, out_spec = pytree.tree_flatten(out)
        return (tuple(recorder.ops), str(out_spec),
                tuple(recorder.describe(x) for x in out_flat))


@contextlib.contextmanager
def _quiet_fake() -> Iterator[None]:
    """Fake kernels log their failures as errors; here a failure only means "not
    shareable" (a bumped size the block cannot take), which is no news to the user."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _snapshot(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's attributes, and copies of the contents of its list, dict and set
    attributes (a forward may fill a cache in place)."""
    attrs = dict(vars(module))
    contents = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict)
                    else set(v))
                for k, v in attrs.items() if isinstance(v, (list, dict, set))
                and k not in _IGNORED_ATTRIBUTES}
    return attrs, contents


def _restore_attributes(before: dict[int, tuple[torch.nn.Module,
                                                tuple[dict[str, Any], dict[str, Any]]]]) -> str:
    """Put every module's attributes, and the contents of its containers, back as they
    were (a fake run must leave no trace: a counter bumped, a cache of fake tensors);
    returns the names that had changed."""
    changed = []
    for module, (attrs, contents) in before.values():
        now = vars(module)
        if now.keys() != attrs.keys() or any(now[k] is not v for k, v in attrs.items()):
            changed.extend(sorted(k for k in now.keys() | attrs.keys()
                                  if now.get(k, _MISSING) is not attrs.get(k, _MISSING)))
            now.clear()
            now.update(attrs)
        for k, saved in contents.items():
            container = now[k]
            if not _same_contents(container, saved):
                changed.append(k)
                container.clear()
                if isinstance(container, list):
                    container.extend(saved)
                else:
                    container.update(saved)
    return ", ".join(changed)


def _same_contents(container: Any, saved: Any) -> bool:
    if len(container) != len(saved):
        return False
    if isinstance(container, dict):
        return all(k in saved and saved[k] is v for k, v in container.items())
    if isinstance(container, list):
        return all(a is b for a, b in zip(container, saved))
    return container == saved


_MISSING = object()


def _empty_like(t: torch.Tensor, shape: Any, stride: Any) -> torch.Tensor:
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out
