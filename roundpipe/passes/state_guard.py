"""Leave the model's state as it was after tracing runs the user's code on real tensors.

Tracing runs the user's Python for real in a few places: the eager rehearsal of the
example before the ``torch.fx`` fallback (``trace.refuse_unrunnable_example``), the
recording run of opaque (leaf) modules (``leaves._record_calls``), and ``torch.fx``'s
symbolic trace itself, whose ops on tensors it does not turn into graph values (a plain
tensor attribute, a parameter reached through ``self.parameters()``) run for real.
Whatever such a run writes, the model must come out of it exactly as it went in, whether
the trace then succeeds (the program makes the write at the first real step, once) or is
refused (the user gets the model back untouched): parameters and buffers (values,
storage, ``requires_grad``, ``.grad``) and plain tensor attributes.

Nothing is copied up front (a model's weights may be most of the host's memory): a
tensor's storage is copied only before the first in-place write to it, seen by a
``TorchDispatchMode`` (writes through ``.data`` or ``detach()`` share the storage but not
the version counter, so ``_version`` alone would miss them).  Rebinding (``p.data = t``,
``self.buf = t``, ``p.requires_grad_(False)``, ``p.grad = None``) costs nothing to undo:
the old tensors are held.  Writes that bypass the dispatcher (through ``numpy()``, a raw
``data_ptr``) cannot be seen and are not undone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ModelError
from .leaves import tensor_attributes


@dataclass
class StateChanges:
    """What a guarded run changed (and what was then put back), by state name."""

    written: list[str] = field(default_factory=list)  # values written in place
    rebound: list[str] = field(default_factory=list)  # a registry entry set to another
    moved: list[str] = field(default_factory=list)  # ``.data`` rebound (storage, shape, dtype)
    flags: list[str] = field(default_factory=list)  # requires_grad or .grad changed
    # the storages written in place (by storage address), with the name they were seen by
    written_storages: dict[int, str] = field(default_factory=dict)
    # registered by the run and written after (not kept: see ``state_kept``)
    lazy_written: list[str] = field(default_factory=list)

    # the run's copy-on-write mode, while it runs (see ``writes``)
    mode: Any = field(default=None, repr=False, compare=False)

    def writes(self, tensor: torch.Tensor) -> int:
        """In-place writes seen so far to ``tensor``'s storage, when it is watched (through
        any alias: ``.data``, ``detach()``, a view); 0 otherwise.  A run's code can tell
        from it which call wrote what, where ``_version`` misses ``.data`` writes."""
        key = storage_key(tensor)
        return self.mode.counts.get(key, 0) if self.mode is not None else 0

    def __bool__(self) -> bool:
        return bool(self.written or self.rebound or self.moved or self.flags)

    def first(self) -> str:
        """The first change, in words (``head.weight written in place``)."""
        for names, what in ((self.written, "written in place"),
                            (self.rebound, "rebound to another tensor"),
                            (self.moved, "given another .data"),
                            (self.flags, "")):
            if names:
                return f"{names[0]} {what}".rstrip()
        return ""


_WRITES: dict[Any, tuple[tuple[int, str, int | None], ...]] = {}
# Arguments ATen writes without saying so in the schema (``native_batch_norm``'s running
# statistics; nor does it bump their version counters), and only in training mode, as
# the schemas that declare them write them only then: the op's ``training`` argument
# decides (eval-mode batch norm only reads them; ``..._no_training``, ``..._no_update``
# and the backward ops have no such argument and never write them).  An op with an
# undeclared write not listed here would escape the copy, as would writes that bypass the
# dispatcher (``numpy()``, ``data_ptr``).
_UNDECLARED_WRITES = frozenset({"running_mean", "running_var"})


def _written_arguments(op: Any) -> tuple[tuple[int, str, int | None], ...]:
    """(position, name, position of the ``training`` flag that decides the write, or
    None) of the arguments ``op`` writes (cached per overload)."""
    found = _WRITES.get(op)
    if found is None:
        schema = getattr(op, "_schema", None)
        args = list(schema.arguments) if schema is not None else []
        training = next((i for i, a in enumerate(args) if a.name == "training"), None)
        found = []
        for i, a in enumerate(args):
            declared = a.alias_info is not None and a.alias_info.is_write
            if a.name in _UNDECLARED_WRITES:
                if training is not None:
                    found.append((i, a.name, training))
                elif declared:  # (_batch_norm_with_update: always)
                    found.append((i, a.name, None))
            elif declared:
                found.append((i, a.name, None))
        found = _WRITES[op] = tuple(found)
    return found


def storage_key(tensor: torch.Tensor) -> int | None:
    """The identity of ``tensor``'s storage (its ``StorageImpl``: every alias shares it,
    ``.data = ...`` changes it); None for storages nothing can write for real (fake,
    meta, functional, sparse, empty).  Not its data pointer: asking for that of a
    copy-on-write storage (``state_kept``'s lazy copies) copies it."""
    try:
        if tensor.layout != torch.strided or isinstance(tensor, FakeTensor) \
                or tensor.device.type == "meta":
            return None
        storage = tensor.untyped_storage()
        if storage.device.type == "meta" or not storage.nbytes():
            return None
        return storage._cdata
    except (RuntimeError, NotImplementedError):  # functional, sparse, ...
        return None


class _CopyOnWrite(TorchDispatchMode):
    """Copies a watched storage before the first op that writes it."""

    def __init__(self, watched: dict[int, tuple[torch.UntypedStorage, str]]) -> None:
        super().__init__()
        self.watched = watched
        self.saved: dict[int, torch.UntypedStorage] = {}
        self.counts: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = []
        for i, name, training in _written_arguments(func):
            if training is not None and not (args[training] if training < len(args)
                                             else kwargs.get("training")):
                continue  # (eval-mode batch norm reads its running statistics)
            value = args[i] if i < len(args) else kwargs.get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    key = storage_key(t)
                    if key is not None and key in self.watched:
                        if func in _RESIZES:
                            _refuse_resize(func, t, args, self.watched[key][1])
                        if key not in self.saved:
                            # (the mode is off inside its own handler: a plain copy)
                            self.saved[key] = self.watched[key][0].clone()
                        self.counts[key] = self.counts.get(key, 0) + 1
                        written.append((key, t, tuple(t.shape)))
        out = func(*args, **kwargs)
        for key, t, shape in written:
            storage = self.watched[key][0]
            if storage.nbytes() != self.saved[key].nbytes():
                # an out= argument of another shape is resized inside the kernel; the
                # exit gives the storage its size and bytes back, not its address
                raise ModelError(
                    f"the forward resizes {self.watched[key][1]} inside {func} (an out= "
                    f"argument of shape {shape}, now {tuple(t.shape)}), which moved its "
                    "storage: roundpipe runs the forward while tracing and could not put "
                    "the model's state back exactly. Give the forward a new tensor (no "
                    "out= into the model's state), or write a result of the same shape")
        return out


_RESIZES = frozenset({torch.ops.aten.resize_.default, torch.ops.aten.resize_as_.default})


def _refuse_resize(func: Any, t: torch.Tensor, args: Any, name: str) -> None:
    """A resize may move the storage that every alias of ``name`` holds: nothing could
    put its address back, so it is refused before it runs (a same-shape resize is a no-op)."""
    shape = tuple(args[1].shape) if func is torch.ops.aten.resize_as_.default \
        else tuple(args[1])
    if shape != tuple(t.shape):
        raise ModelError(
            f"the forward resizes {name} in place ({func}, {tuple(t.shape)} -> {shape}), "
            "which may move its storage: roundpipe runs the forward while tracing and "
            "could not put the model's state back exactly. Resize it outside the forward, "
            "or give the forward a new tensor")


@dataclass
class _Tensor:
    tensor: torch.Tensor
    name: str
    alias: torch.Tensor  # detached, on the storage it had: undoes ``.data = ...``
    requires_grad: bool
    grad: torch.Tensor | None
    layout: tuple[Any, ...]


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (storage_key(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
            t.device)


@contextlib.contextmanager
def state_kept(model: torch.nn.Module, extra: tuple[tuple[str, torch.Tensor], ...] = (),
               copy_on_write: bool = True, copy_attributes: bool = False,
               rebind_attributes: str = "always") -> Iterator[StateChanges]:
    """While active, the model's parameters, buffers and tensor attributes (and the
    ``extra`` named tensors) may be written by real code; on exit every one is put back
    exactly: the module's registries (``_parameters``, ``_buffers``, tensor attributes),
    each tensor's storage and layout, values, ``requires_grad`` and ``.grad`` (value and
    identity).  Yields the changes, filled on exit.

    ``copy_on_write=False`` (for ``torch.export``, which fails under another dispatch
    mode): only the bindings are watched, which is enough for parameters and buffers,
    since export runs the forward on fake copies of them; ``copy_attributes``: the plain
    tensor attributes, which export runs on for real, get copy-on-write copies
    (``torch._lazy_clone``: bytes are copied only when the storage is written, or when
    its data pointer is asked for while the copy lives) and are put back when written.

    ``rebind_attributes``: when a plain tensor attribute that the run set to another
    tensor (or to a tensor from None or nothing) is set back: ``"always"`` or only when
    the run raises (``"on_failure"``).  A trace that succeeds keeps such caches (a
    recurrent block's state, set by its forward), which the program may hold as constants:
    put back, the previous tensor would be stale (it may even carry a freed graph).  With
    ``"on_failure"``, a parameter or buffer the run registered (a lazy initialisation)
    stays when the run succeeds, if it is a real tensor the run did not write after
    registering it (else ModelError: the program would make that write again).  A tracer's
    stand-in (fake tensor, Proxy) left in an attribute is always removed.  Each restore
    of the exit runs on its own; the first error is raised after all were tried."""
    modules = list(model.named_modules(remove_duplicate=True))
    tables = [(m, dict(m._parameters), dict(m._buffers),
               {k: v for k, v in vars(m).items() if v is None or isinstance(v, torch.Tensor)
                and not isinstance(v, torch.nn.Parameter)}) for _, m in modules]
    named = (list(model.named_parameters(remove_duplicate=False))
             + list(model.named_buffers(remove_duplicate=False))
             + tensor_attributes(model) + list(extra))
    tensors: dict[int, _Tensor] = {}
    watched: dict[int, tuple[torch.UntypedStorage, str]] = {}
    for name, t in named:
        if not isinstance(t, torch.Tensor) or id(t) in tensors:
            continue
        grad = t.grad if t.is_leaf else None
        tensors[id(t)] = _Tensor(t, name, t.detach(), t.requires_grad, grad, _layout(t))
        for value, label in ((t, name), (grad, f"{name}.grad")):
            key = storage_key(value) if value is not None else None
            if key is not None and key not in watched:
                watched[key] = (value.untyped_storage(), label)
    copies = {}
    if copy_attributes:
        for name, t in tensor_attributes(model):
            key = storage_key(t)
            if key is not None and key not in copies:
                copies[key] = (t.untyped_storage(), _lazy_copy(t.untyped_storage()), name)
    mode = _CopyOnWrite(watched) if copy_on_write else None
    changes = StateChanges(mode=mode)
    failed = False
    try:
        with mode if mode is not None else contextlib.nullcontext():
            yield changes
    except BaseException:
        failed = True
        raise
    finally:
        changes.mode = None
        # each restore on its own: one that fails does not skip the others; the first
        # error is raised once all were tried
        errors: list[BaseException] = []
        for key, (storage, copy, name) in copies.items():
            with _collected(errors):
                if storage.nbytes() != copy.nbytes() or \
                        not torch.equal(_bytes(storage), _bytes(copy)):
                    changes.written.append(name)
                    changes.written_storages[key] = name
                    _restore(storage, copy)
        copies.clear()  # (the lazy copies that nothing wrote: nothing was ever copied)
        _put_back(modules, tables, tensors, changes,
                  attributes=rebind_attributes == "always" or failed, errors=errors)
        if mode is not None:
            for key, copy in mode.saved.items():
                with _collected(errors):
                    storage, label = watched[key]
                    changes.written.append(label)
                    changes.written_storages[key] = label
                    _restore(storage, copy)
        if errors and not failed:
            raise errors[0]
        if changes.lazy_written and not failed:
            raise ModelError(
                f"the forward registers {changes.lazy_written[0]} and writes it in place "
                "in the same call: roundpipe runs the forward while tracing and keeps the "
                "registration (as eager keeps it after its first call), but the program "
                "would make that write again at its first call. Register it in __init__, "
                "or write it before registering it")


@contextlib.contextmanager
def _collected(errors: list[BaseException]) -> Iterator[None]:
    try:
        yield
    except Exception as e:  # noqa: BLE001 - raised by the caller after every restore
        errors.append(e)


def _restore(storage: torch.UntypedStorage, copy: torch.UntypedStorage) -> None:
    """The bytes back, and the size where a write resized the storage."""
    if storage.nbytes() != copy.nbytes():
        storage.resize_(copy.nbytes())
    storage.copy_(copy)


def _lazy_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A copy-on-write copy: the bytes are copied only when either side is written (the
    plain tensor attributes export writes for real are rarely written at all, and may be
    large: a preallocated KV cache)."""
    lazy_clone = getattr(torch, "_lazy_clone", None)
    if lazy_clone is None:  # (older torch: a whole copy)
        return storage.clone()
    return lazy_clone(_bytes(storage)).untyped_storage()


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _put_back(modules: list[tuple[str, torch.nn.Module]], tables: list[Any],
              tensors: dict[int, _Tensor], changes: StateChanges, attributes: bool,
              errors: list[BaseException]) -> None:
    for module_and_table in zip(modules, tables):
        try:
            _put_back_module(*module_and_table, changes, attributes)
        except Exception as e:  # noqa: BLE001 - raised by state_kept after every restore
            errors.append(e)
    with torch.no_grad():
        for entry in tensors.values():
            try:
                _put_back_tensor(entry, changes)
            except Exception as e:  # noqa: BLE001 - as above
                errors.append(e)


def _put_back_module(named: tuple[str, torch.nn.Module], table_of: Any,
                     changes: StateChanges, attributes: bool) -> None:
    (path, module), (_, params, buffers, attrs) = named, table_of
    prefix = f"{path}." if path else ""
    for table, saved in ((module._parameters, params), (module._buffers, buffers)):
        for k in [k for k in table if k not in saved]:  # registered by the run
            value = table[k]
            if not attributes and _real(value):
                if not _version(value):
                    continue  # a lazy registration, which eager keeps too
                # written after it was registered: not kept (the program would make
                # that write again), refused by ``state_kept``
                changes.lazy_written.append(prefix + k)
            changes.rebound.append(prefix + k)
            del table[k]
        for k, v in saved.items():
            if table.get(k, _MISSING) is not v:
                changes.rebound.append(prefix + k)
                table[k] = v
            module.__dict__.pop(k, None)  # (shadowing the registry entry)
    for k, now in list(vars(module).items()):
        before = attrs.get(k, _MISSING)
        if now is before:
            continue
        # (tracing's values, a fake tensor or a Proxy, never stay: a failed export
        # left a fake tensor in a cache the next tracer then read)
        if not attributes and not _tracing_value(now) \
                or isinstance(now, torch.nn.Parameter):
            continue
        if isinstance(now, torch.Tensor) or _tracing_value(now) \
                or before is not None and before is not _MISSING:
            changes.rebound.append(prefix + k)
            if before is _MISSING:
                del module.__dict__[k]
            else:
                module.__dict__[k] = before
    for k, before in attrs.items():
        if attributes and k not in vars(module):  # deleted by the run
            changes.rebound.append(prefix + k)
            module.__dict__[k] = before


def _put_back_tensor(entry: _Tensor, changes: StateChanges) -> None:
    t = entry.tensor
    if _layout(t) != entry.layout:
        changes.moved.append(entry.name)
        t.data = entry.alias
    if t.requires_grad != entry.requires_grad and t.is_leaf:
        changes.flags.append(f"{entry.name}.requires_grad")
        t.requires_grad_(entry.requires_grad)
    if t.is_leaf and t.grad is not entry.grad:
        changes.flags.append(f"{entry.name}.grad")
        t.grad = entry.grad


_MISSING = object()


def _tracing_value(value: Any) -> bool:
    """A tracer's stand-in (a fake tensor, a torch.fx Proxy), never the user's value."""
    return isinstance(value, (FakeTensor, torch.fx.Proxy))


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return 0


def _real(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) \
        and value.device.type != "meta"
