"""Pass 1, trace: turn an ``nn.Module`` into one flat graph with explicit state.

Before::

    model(idx, attention_mask=m)          # any nn.Module, any Python

After (``TracedGraph.graph_module``)::

    p_wte_weight, ..., b_bn_running_mean, ..., idx, attention_mask = placeholders
    embedding = aten.embedding(p_wte_weight, idx)
    ...
    return (linear_8, transpose_3)        # flat outputs; ``out_spec`` rebuilds the structure

Every parameter, buffer and constant tensor is a placeholder (a *state slot*); tied tensors
share one slot (deduplicated by tensor identity, not by name).  Each node carries
``meta["roundpipe.module_path"]`` (the innermost module that ran it) and, for in-place
writes to state, ``meta["roundpipe.mutates"]``.

``torch.export.export(strict=False)`` is tried first with input dimensions marked
``Dim.AUTO`` (export keeps what it can dynamic; image sizes stay static, see
``_dynamic_dims``), then with static shapes, then
``torch.fx`` symbolic tracing where the layer units are opaque leaves, called through
``torch.func.functional_call`` so their state stays explicit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import operator
import os
import re
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import Dim, ShapesCollection
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._sympy.symbol import SymT, symbol_is_type

from ..errors import ModelError, TraceError
from ..plan import InputSignature, OutputRef, StateSpec
from ..ops.hooks import mark_hooking
from ..ops.modcall import call_module_functional, tensor_leaves
from .forward_hooks import hooks_unwatched, watch_forward_hooks
from .custom_backward import CustomBackwardFunction, refuse_custom_backward
from .state_guard import StateChanges, state_kept, storage_key
from .leaves import (WRITES, failing_module, leaves_as_custom_ops, replace_opaque_calls,
                     tensor_attributes,
                     replaced_forward, resolve_leaf_modules, same_type_modules)
from .mode_regions import (MODES, export_keeps_mode_calls, fx_records_grad_mode,
                           inference_mode_as_no_grad, inline_mode_regions, mark_mode_regions)
from .shared_blocks import (SharingFailed, add_hidden_state, repeated_groups, shared_blocks,
                            splice_blocks)
from .tensor_hooks import (HOOKED, carry_hooks, code_registers_hooks, recorded_hooks,
                           refuse_hooked_placeholder)

log = logging.getLogger(__name__)

MODULE_PATH = "roundpipe.module_path"
MUTATES = "roundpipe.mutates"


@dataclass(frozen=True)
class TracedGraph:
    """Result of the trace pass.

    Attributes:
        graph_module: flat graph; placeholders are state slots (``state`` order) followed
            by user inputs.
        state: state slots, in placeholder order.
        inputs: how user ``(args, kwargs)`` map onto the flat user inputs.
        outputs: flat model outputs.
        out_spec: pytree spec rebuilding the model's output structure.
        buffer_updates: ``(state name, value name)`` for buffers the model reassigns
            (export's BUFFER_MUTATION outputs).
        constants: values of ``"constant"`` state slots.
        state_tensors: the tensor behind every state slot (the model's own parameters and
            buffers, not copies).
        example_inputs: flat example inputs, aligned with ``inputs.names``.
        method: ``"export"``, ``"export-static"``, ``"export-leaves"`` or ``"fx"``.
        notes: what was tried and why a fallback was used.
        leaves: paths of the modules export kept opaque (``"export-leaves"``).
        copied: paths of the repeated blocks whose nodes are copies of another block's
            trace (they compute the same; see :mod:`roundpipe.passes.shared_blocks`).
        tensor_hooks: where the forward registers tensor hooks (module and source line),
            each run once per microbatch (see :mod:`roundpipe.passes.tensor_hooks`).
    """

    graph_module: torch.fx.GraphModule
    state: tuple[StateSpec, ...]
    inputs: InputSignature
    outputs: tuple[OutputRef, ...]
    out_spec: Any
    buffer_updates: tuple[tuple[str, str], ...]
    constants: dict[str, torch.Tensor]
    state_tensors: dict[str, torch.Tensor]
    example_inputs: tuple[Any, ...]
    method: str
    notes: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()
    copied: tuple[str, ...] = ()
    tensor_hooks: tuple[str, ...] = ()
    # (module path, attribute) of the plain Python values (numbers, strings, None) and
    # plain tensors (neither parameters nor buffers) the model's code read from its
    # modules while traced, for every module of the reading module's class (copied blocks
    # read nothing), and of the attributes holding a constant slot's tensor: the program
    # holds them as constants (a tensor as a slot, or its values baked into the graph).
    # Other objects of a module's __dict__ it read (a config, a dict, a list) too.
    attribute_reads: tuple[tuple[str, str], ...] = ()
    # Whether the model's code asked torch.is_inference_mode_enabled() while traced (the
    # program then serves calls of the inference mode it was traced for only).
    reads_inference_mode: bool = False


def trace(
    model: torch.nn.Module,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    leaf_modules: Iterable[str] = (),
    opaque_modules: Iterable[str | type] = (),
    dynamic: bool = True,
    share_blocks: bool = True,
    grad: bool = True,
    inference: bool = False,
) -> TracedGraph:
    """Trace ``model`` on the example inputs.

    Args:
        model: the model, on the CPU.
        example_args, example_kwargs: one example call.
        leaf_modules: module paths kept opaque by the ``torch.fx`` fallback (the layer
            units found by :func:`roundpipe.passes.layers.find_unit_roots`).
        opaque_modules: modules (paths or classes) that ``torch.export`` keeps opaque
            (the user's ``leaf_modules``; see :mod:`roundpipe.passes.leaves`).  When export
            fails inside a submodule, every module of that class is made opaque and export
            is tried again, without being asked.
        dynamic: try dynamic shapes first.
        share_blocks: trace each distinct repeated block once and copy its graph into
            the blocks that compute the same (see :mod:`roundpipe.passes.shared_blocks`).
        grad: the grad mode the model's code sees while traced (the mode of the calls
            the program will serve: Python branches on ``torch.is_grad_enabled()`` or on
            ``requires_grad``, such as ``nn.MultiheadAttention``'s fast path, are fixed in
            the program).  Regions the model enters itself are marked relative to it.
        inference: what ``torch.is_inference_mode_enabled()`` tells the model's code
            (tracing itself cannot run in inference mode); whether it asked is
            ``reads_inference_mode``.

    Raises:
        ModelError: the model has no parameters.
        TraceError: every tracer failed; the message names the failing source line and
            lists what was tried.
    """
    refuse_lazy_parameters(model)
    _refuse_sparse_gradients(model)
    # Tracing cannot run in inference mode (export fails, and the fx fallback proves no
    # output merge): it runs with the mode off, grad mode as ``grad`` says, on ordinary
    # copies of inference tensors; the program then runs under the caller's mode.
    example_args, example_kwargs = _ordinary_tensors((example_args, example_kwargs))
    # One trace at a time: export, and the block sharing inside it, patch nn.Module
    # process-wide while they run.
    # The model's state is put back whatever happens (tracing runs the user's code on real
    # tensors in places); plain tensor attributes the forward rebinds (caches) only when
    # the model is refused.
    with _TRACE_LOCK, torch.inference_mode(False), torch.set_grad_enabled(grad), \
            fake_tensor_errors_to_debug(), \
            state_kept(model, copy_on_write=False, copy_attributes=True,
                       rebind_attributes="on_failure"):
        # The user's own hooks on the model (the passes below add theirs while tracing).
        _ROOT_HOOKS.ids = (frozenset(model._forward_pre_hooks),
                           frozenset(model._forward_hooks))
        try:
            with _watch_buffer_reassignment(model) as (reassigned, kept_tensors), \
                    _watch_attribute_reads(model) as reads, \
                    _inference_mode_as(inference) as asked, \
                    _watch_plain_writes(model, reads) as plain_writes, \
                    watch_forward_hooks(model) as hooks_watch:
                traced = _trace(model, example_args, example_kwargs,
                                leaf_modules=leaf_modules, opaque_modules=opaque_modules,
                                dynamic=dynamic, share_blocks=share_blocks)
        finally:
            del _ROOT_HOOKS.ids
        traced = dataclasses.replace(traced, attribute_reads=tuple(dict.fromkeys(
            [(path, name) for path, m in model.named_modules() for cls, name in sorted(
                reads.classes, key=lambda r: (r[0].__qualname__, r[1])) if type(m) is cls]
            + _constant_holders(model, traced.constants))),
            reads_inference_mode=bool(asked))
        if hooks_watch.found:
            hooks = "; ".join(k.describe() for k in hooks_watch.found)
            raise ModelError(
                f"{hooks} keeps a tensor of the call (an activation, or a value computed "
                "from one) after the call returns: the traced program runs the hook's tensor "
                "work but not its Python, so it would hold a fake tensor from tracing and "
                "never see a real call (eager stores each call's value). Return what you "
                "need from forward (and read it in loss_fn), or remove the hook while "
                "training with roundpipe")
        # (None or a missing attribute first is a lazy initialisation, whose branch the
        # program holds at every call: only a value of one type that changes is refused)
        changed = {name: (old, new) for name, (old, new) in plain_writes.items()
                   if type(old) is type(new) and old is not None
                   and not _same_plain(old, new)}
        if changed:
            for key, (old, _) in changed.items():  # (fx and tracing's eager rehearsal set
                owner, _, attr = key.rpartition(".")  # them for real: put back)
                object.__setattr__(model.get_submodule(owner), attr, old)
            name, (old, new) = sorted(changed.items())[0]
            way_out = (
                "Switch the mode outside the forward (module.train() / .eval() before the "
                "call: roundpipe keys its programs by every module's training flag)"
                if name.rpartition(".")[2] == "training" else
                "Keep such state in a buffer written in place "
                "(self.register_buffer('calls', torch.zeros((), dtype=torch.long)), then "
                "self.calls.add_(1)), or update it outside the forward")
            raise ModelError(
                f"{type(model).__name__}'s forward sets the Python attribute {name} "
                f"({old!r} -> {new!r}"
                + (f"; and {len(changed) - 1} more" if len(changed) > 1 else "")
                + "): roundpipe runs the forward's Python once, while tracing, so it would "
                "not change at every call as in eager PyTorch, and code reading it would "
                f"keep the traced value. {way_out}")
        if kept_tensors:
            name = sorted(kept_tensors)[0]
            raise ModelError(
                f"{type(model).__name__}'s forward stores a tensor of the call's graph on "
                f"the attribute {name}"
                + (f" (and {len(kept_tensors) - 1} more)" if len(kept_tensors) > 1 else "")
                + ", which is not a buffer: the traced program never writes it, so it would "
                "keep its value from before the call (an auxiliary loss read after the call "
                "would be stale, and backward would not reach it). Return it from forward "
                "and read it in loss_fn instead")
        if reassigned:
            where = ", ".join(sorted(reassigned))
            raise ModelError(
                f"{type(model).__name__}'s forward assigns a new tensor to buffer(s) {where} "
                "(self.buf = ...): the traced program cannot carry that write, so it would be "
                "lost silently; write the buffer in place instead, under torch.no_grad() "
                "where it needs no gradient (self.buf.copy_(new), self.buf.mul_(m).add_(x))")
        return traced


_TRACE_LOCK = threading.Lock()


def _ordinary_tensors(tree: Any) -> Any:
    """``tree`` with its inference tensors (made under ``torch.inference_mode()``)
    replaced by ordinary copies, which code outside inference mode may use freely."""
    if not any(isinstance(t, torch.Tensor) and t.is_inference()
               for t in pytree.tree_leaves(tree)):
        return tree
    with torch.inference_mode(False):
        return pytree.tree_map_only(torch.Tensor,
                                    lambda t: t.clone() if t.is_inference() else t, tree)


_PLAIN_VALUES = (bool, int, float, str, type(None))
# What Module.__init__ puts in a module's __dict__ (its tables, hooks, flags): not values
# of the model's own.
_INTERNALS = frozenset(vars(torch.nn.Module()))
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ROUNDPIPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's module classes' own forwards (Dropout.p, LayerNorm.eps, LeakyReLU.negative_slope)
# read values the program holds as constants too; nn.Module's machinery does not.
_TORCH_MODULES_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_TORCH_MODULE_PY = os.path.join(_TORCH_MODULES_DIR, "module.py")


def _constant_holders(model: torch.nn.Module, constants: dict[str, torch.Tensor]
                      ) -> list[tuple[str, str]]:
    """(module path, attribute) of every plain attribute holding one of the program's
    constant tensors (the fx fallback's opaque units read theirs at run time, not while
    traced; a tensor shared by several modules is held by each)."""
    ids = {id(t) for t in constants.values()}
    return [(path, name) for path, m in model.named_modules() for name, value in
            vars(m).items() if isinstance(value, torch.Tensor) and id(value) in ids]


def _reads_for_the_model(filename: str) -> bool:
    """Whether a read from code in ``filename`` is one the traced program holds."""
    if filename.startswith(_TORCH_DIR):
        return filename.startswith(_TORCH_MODULES_DIR) and filename != _TORCH_MODULE_PY
    return not filename.startswith(_ROUNDPIPE_DIR)


@dataclass
class _Reads:
    classes: set[tuple[type, str]]  # (module class, attribute)
    instances: set[tuple[int, str]]  # (id of the module, attribute)


@contextlib.contextmanager
def _inference_mode_as(inference: bool) -> Iterator[list[bool]]:
    """``torch.is_inference_mode_enabled()`` answers ``inference`` to the model's own code
    on the tracing thread (the calls the program serves run in that mode; tracing cannot),
    and the list yielded gets an entry when it asked: a no_grad and an inference_mode call
    used to share one program, so a branch on it took the first call's side."""
    real = torch.is_inference_mode_enabled
    thread = threading.get_ident()
    asked: list[bool] = []

    def answer() -> bool:
        if threading.get_ident() == thread and _reads_for_the_model(
                sys._getframe(1).f_code.co_filename):
            asked.append(True)
            return inference
        return real()

    torch.is_inference_mode_enabled = answer  # type: ignore[assignment]
    try:
        yield asked
    finally:
        torch.is_inference_mode_enabled = real  # type: ignore[assignment]


@contextlib.contextmanager
def _watch_attribute_reads(model: torch.nn.Module) -> Iterator[_Reads]:
    """The plain Python values (``self.scale``, ``self.n_heads``) and plain tensor
    attributes (``self.mask``, in the module's ``__dict__``: not a parameter or buffer)
    the model's own code reads from its modules while tracing.  The traced program holds
    them as constants (a tensor as a constant slot, or its values where Python read them:
    ``self.t.tolist()``), so a value changed after the call (``model.block.scale = 2.0``,
    ``model.mask = other``, ``model.mask.mul_(2)``) must make a new program
    (``RoundPipe`` compares them at every call); it used to keep the old value silently.
    ``training`` is keyed apart (its reads are in ``instances`` only); reads by torch's
    module classes count (``model.drop.p = 0.2`` after a call used to keep the traced p),
    reads by the rest of torch's and by roundpipe's own code do not.  Other objects in a
    module's ``__dict__`` (a config object, a dict, list or tuple, a function) are
    recorded too: their content is a constant of the program as well
    (``self.config.scale``, ``self.scales[1]``; ``RoundPipe`` keys on a digest of it).
    ``instances`` has the plain values' reads only."""
    modules = {id(m) for m in model.modules()}
    found = _Reads(set(), set())
    thread = threading.get_ident()
    getattribute = object.__getattribute__
    module = torch.nn.Module

    def watched(self: torch.nn.Module, name: str) -> Any:
        value = getattribute(self, name)
        plain = type(value) in _PLAIN_VALUES
        if ((plain or name in getattribute(self, "__dict__") and name not in _INTERNALS
             and not isinstance(value, module))
                and not name.startswith("__") and id(self) in modules
                and threading.get_ident() == thread
                and _reads_for_the_model(sys._getframe(1).f_code.co_filename)):
            if name != "training":  # (the program key holds every module's flag)
                found.classes.add((type(self), name))
            if plain:
                found.instances.add((id(self), name))
        return value

    torch.nn.Module.__getattribute__ = watched  # type: ignore[method-assign]
    try:
        yield found
    finally:
        del torch.nn.Module.__getattribute__
# Ids of the traced model's own forward pre-hooks and hooks, set by trace() (under the lock).
_ROOT_HOOKS = threading.local()


@contextlib.contextmanager
def _watch_buffer_reassignment(model: torch.nn.Module
                               ) -> Iterator[tuple[set[str], set[str]]]:
    """Names (``path.buffer``) of registered buffers of ``model`` that the model's own code
    rebinds to another tensor (``self.ema = self.ema * 0.9 + x``) while tracing.  Neither
    export nor the fx fallback records such a write (only in-place ones), nor does an
    opaque module's call.  Only the tracing thread's assignments made outside torch's own
    code count (export swaps state in and out with setattr).  Second: plain attributes
    (not buffers) given a traced tensor that requires grad, or a torch.fx Proxy
    (``self.aux_loss = ...``), which no program writes back either."""
    paths = {id(m): p for p, m in model.named_modules()}
    found: set[str] = set()
    kept: set[str] = set()  # plain attributes given a tensor of the call's graph
    from torch._subclasses.fake_tensor import is_fake
    thread = threading.get_ident()
    original = torch.nn.Module.__setattr__
    torch_dir = os.path.dirname(torch.__file__) + os.sep

    def setattr_(self: torch.nn.Module, name: str, value: Any) -> None:
        buffers = self.__dict__.get("_buffers")
        ours = (id(self) in paths and threading.get_ident() == thread
                and not _setattr_caller().startswith(torch_dir))
        path = paths.get(id(self), "")
        if (buffers is not None and name in buffers and buffers[name] is not None
                and value is not buffers[name]
                and isinstance(value, (torch.Tensor, torch.fx.Proxy)) and ours):
            found.add(f"{path}.{name}" if path else name)
        elif (buffers is not None and name not in buffers and ours
              and name not in self.__dict__.get("_parameters", {})
              and (isinstance(value, torch.fx.Proxy)
                   or isinstance(value, torch.Tensor) and value.requires_grad
                   and is_fake(value))):  # (an opaque module's real run: its own twin's)
            kept.add(f"{path}.{name}" if path else name)
        original(self, name, value)

    torch.nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
    try:
        yield found, kept
    finally:
        torch.nn.Module.__setattr__ = original  # type: ignore[method-assign]


_UNSET = object()


def _setattr_caller(past_torch: bool = False) -> str:
    """The file of the code whose assignment a ``setattr_`` watch below sees, past the
    other watches' ``setattr_`` frames (they patch ``nn.Module.__setattr__`` in turn);
    ``past_torch``: and past torch's own frames (``Module.train`` setting ``training``)."""
    frame = sys._getframe(2)
    while frame is not None and (
            frame.f_code.co_name == "setattr_" and frame.f_code.co_filename == __file__
            or past_torch and frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


@contextlib.contextmanager
def _watch_plain_writes(model: torch.nn.Module, reads: _Reads
                        ) -> Iterator[dict[str, tuple[Any, Any]]]:
    """``path.name -> (value before, last value set)`` for the plain Python values
    (numbers, strings, bools, None) the model's own code assigns to attributes of its
    modules it read first while tracing (``self.calls += 1``, ``self.on = not self.on``;
    ``_UNSET`` before: none).
    Export puts them back afterwards and no tracer records them: a program would never
    make that write, and the next call would read the old value.  (A write of a value
    read from nowhere, ``block.temp = 2.0`` before each call, computes the same at
    every call.)"""
    paths = {id(m): p for p, m in model.named_modules()}
    found: dict[str, tuple[Any, Any]] = {}
    blind: set[str] = set()  # written before any read
    thread = threading.get_ident()
    original = torch.nn.Module.__setattr__

    def setattr_(self: torch.nn.Module, name: str, value: Any) -> None:
        before = self.__dict__.get(name, _UNSET)
        # (torch's Module.train() sets ``training``: whose call it is, is the first
        # caller outside torch: the model's forward, or roundpipe's and export's own
        # switching, which do not count)
        if (type(value) in _PLAIN_VALUES and id(self) in paths and threading.get_ident() == thread
                and not _setattr_caller(past_torch=name == "training").startswith(
                    (_TORCH_DIR, _ROUNDPIPE_DIR))):
            path = paths[id(self)]
            key = f"{path}.{name}" if path else name
            if key not in found and (id(self), name) not in reads.instances:
                blind.add(key)
            found[key] = (found.get(key, (before, None))[0], value)
        original(self, name, value)

    torch.nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
    try:
        yield found
    finally:
        torch.nn.Module.__setattr__ = original  # type: ignore[method-assign]
        for key in blind:
            del found[key]


def _same_plain(old: Any, new: Any) -> bool:
    return type(old) is type(new) and (old == new or (old != old and new != new))


def _trace(model: torch.nn.Module, example_args: tuple[Any, ...],
           example_kwargs: dict[str, Any] | None, *, leaf_modules: Iterable[str],
           opaque_modules: Iterable[str | type], dynamic: bool,
           share_blocks: bool) -> TracedGraph:
    example_kwargs = dict(example_kwargs or {})
    if not any(True for _ in model.parameters()):
        raise ModelError(
            f"{type(model).__name__} has no parameters, so there is nothing to pipeline; "
            "roundpipe streams weights to devices, use the model directly instead"
        )
    attempts: list[tuple[str, BaseException]] = []
    user_leaves = resolve_leaf_modules(
        model, tuple(opaque_modules) + _backward_hooked_modules(model))
    tries: list[tuple[str, Callable[[], TracedGraph]]] = []
    if user_leaves:
        tries.append((f"{LEAVES_METHOD} ({_describe_leaves(model, user_leaves)} opaque)",
                      lambda: _trace_export(model, example_args, example_kwargs, False,
                                            user_leaves)))
    else:
        # Repeated blocks that compute the same thing are traced once and copied.
        shared = repeated_groups(model, tuple(leaf_modules)) if share_blocks else ()
        if dynamic:
            tries.append(("export", lambda: _trace_export_sharing(
                model, example_args, example_kwargs, True, shared)))
        tries.append(("export-static", lambda: _trace_export_sharing(
            model, example_args, example_kwargs, False, shared)))
    rehearsal: list[StateChanges] = []  # what the eager run before fx wrote
    tries.append(("fx", lambda: _trace_fx(model, example_args, example_kwargs,
                                          frozenset(leaf_modules), rehearsal)))
    for method, attempt in tries:
        if method == "export-static" and attempts and fails_alike(attempts[-1][1]):
            # (the failure was not about dynamic shapes: a static export fails the same)
            log.info("roundpipe: export-static not tried for %s: %s", type(model).__name__,
                     _first_line(attempts[-1][1]))
            continue
        if method == "fx" and attempts:
            # torch.fx records no shapes: it would trace a model that cannot run this
            # example, and the first call would fail inside a stage.  Tell "the model
            # cannot run this input" from "export cannot trace this model" first.
            rehearsal.append(refuse_unrunnable_example(model, example_args,
                                                       example_kwargs))
        traced = _attempt(model, method, attempt, attempts)
        if traced is not None:
            return traced
    # Export failed inside a submodule: keep every module of that class opaque (same code,
    # same failure) and export again, until export succeeds or blames no new module.
    leaves = user_leaves
    export_error = next(e for m, e in reversed(attempts) if m != "fx")
    for _ in range(_MAX_LEAF_ROUNDS):
        blamed = failing_module(model, export_error)
        if blamed is None:
            break
        wider = resolve_leaf_modules(model, leaves + same_type_modules(model, blamed))
        if wider == leaves:
            break
        leaves = wider
        traced = _attempt(model, f"{LEAVES_METHOD} ({_describe_leaves(model, leaves)} opaque)",
                          lambda: _trace_export(model, example_args, example_kwargs, False,
                                                leaves), attempts)
        if traced is not None:
            return traced
        export_error = attempts[-1][1]
    message = _trace_failure_message(model, attempts, failing_module(model, export_error),
                                     leaves)
    raise TraceError(message) from attempts[-1][1]


def refuse_unrunnable_example(model: torch.nn.Module, args: tuple[Any, ...],
                              kwargs: dict[str, Any], rebind_attributes: str = "on_failure"
                              ) -> StateChanges:
    """Run ``model`` once eagerly on the example (in the caller's grad mode, as tracing
    does; parameters, buffers, plain tensor attributes and the CPU RNG are put back,
    see :mod:`roundpipe.passes.state_guard`) and raise
    :class:`TraceError` if it fails there:
    a wrong example, not a tracing problem.  The error's ``example_error`` is the model's
    own exception (``original`` too).  ``rebind_attributes``: see
    :func:`roundpipe.passes.state_guard.state_kept` (tensor caches the forward sets are kept
    for the trace that follows unless ``"always"``)."""
    # on copies of the inputs: a model that writes its input in place (refused later,
    # with its own message) must not write the caller's tensors here
    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (tuple(args), dict(kwargs)))
    try:
        # (a real call: hooks that keep its activations are not tracing's concern)
        with torch.random.fork_rng(devices=[]), hooks_unwatched(), \
                state_kept(model, rebind_attributes=rebind_attributes) as changes:
            model(*args, **kwargs)
    except ModelError:  # the guard's refusal of what it could not undo
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the model's own code
        shapes = describe_tensors(args, kwargs)
        error = TraceError(
            f"{type(model).__name__} cannot run the example input ({shapes}): "
            f"{_describe(e)}. Pass example inputs that the model runs eagerly, shaped like "
            "the calls to come")
        error.example_error = e  # type: ignore[attr-defined]
        error.example_cause = _describe(e)  # type: ignore[attr-defined]
        error.original = e  # type: ignore[attr-defined]
        raise error from None
    if changes.flags:
        # (put back, as all else; export, run on fake parameters, does not show it)
        raise ModelError(
            f"{type(model).__name__}'s forward changes {changes.flags[0]} of the model "
            "itself: the traced program never makes that change, where eager PyTorch "
            "makes it at every call (and the gradients follow it). Set requires_grad and "
            ".grad outside the forward")
    return changes


def describe_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``input_args[0] (16, 33) float32, attention_mask (16, 33) int64``."""
    parts = []
    for path, leaf in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{_input_path(path)} {tuple(leaf.shape)} "
                         f"{str(leaf.dtype).replace('torch.', '')}")
    return ", ".join(parts) or "no tensors"


def _input_path(path: tuple[Any, ...]) -> str:
    """``input_args[0]``, ``input_kwargs['mask']`` (as the user wrote the call)."""
    head = "input_args" if getattr(path[0], "idx", None) == 0 else "input_kwargs"
    return head + "".join(f"[{getattr(k, 'idx', getattr(k, 'key', k))!r}]" for k in path[1:])


# torch logs every failing meta kernel at ERROR with a traceback ("failed while attempting
# to run meta for aten.mm.default", about 20 lines each, several per failed export).
_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"


@contextlib.contextmanager
def fake_tensor_errors_to_debug() -> Iterator[None]:
    """Move the fake-tensor ERROR records of this thread's tracing (a failed export, a
    fake interpretation) to roundpipe's debug log: each failure is reported once, by
    roundpipe.  Other threads' records pass as before."""
    logger = logging.getLogger(_FAKE_TENSOR_LOG)
    thread = threading.get_ident()

    def divert(record: logging.LogRecord) -> bool:
        if record.thread != thread:
            return True
        if log.isEnabledFor(logging.DEBUG):
            log.debug("roundpipe: torch (%s): %s", record.name, record.getMessage(),
                      exc_info=record.exc_info)
        return False

    logger.addFilter(divert)
    try:
        yield
    finally:
        logger.removeFilter(divert)


def _backward_hooked_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """Submodules with module backward hooks (``register_full_backward_hook``,
    ``register_full_backward_pre_hook``, ``register_backward_hook``).  The exported graph
    drops them silently, so they are kept opaque: a leaf runs as the module's own call, and
    its hooks act on the gradients as in eager.  Hooks on the model itself or global ones
    cannot be kept so: refused."""
    from torch.nn.modules import module as nn_module
    glob = [name for name in ("_global_backward_hooks", "_global_backward_pre_hooks")
            if getattr(nn_module, name, None)]
    if glob or model._backward_hooks or model._backward_pre_hooks:
        where = ("global module backward hooks are registered" if glob else
                 f"{type(model).__name__} itself has a module backward hook")
        raise ModelError(
            f"{where}: roundpipe cannot run them as eager does (the traced graph would "
            "drop them); register them on a submodule (kept opaque, so its hooks run), "
            "or register a tensor hook in the forward on a value it computes "
            "(h.register_hook(fn), which roundpipe runs where eager does)")
    return tuple(name for name, m in model.named_modules()
                 if name and (m._backward_hooks or m._backward_pre_hooks))


# Rounds of automatic leaf modules (each one a real run and an export).
_MAX_LEAF_ROUNDS = 4
LEAVES_METHOD = "export-leaves"


def _attempt(model: torch.nn.Module, method: str, attempt: Callable[[], TracedGraph],
             attempts: list[tuple[str, BaseException]]) -> TracedGraph | None:
    """Run one tracer; on failure record it in ``attempts`` and return None."""
    try:
        # a failed attempt leaves nothing for the next (a failed export left fake tensors
        # in the caches and buffers a forward fills lazily, which fx then read)
        with state_kept(model, copy_on_write=False, rebind_attributes="on_failure"):
            traced = attempt()
    except (ModelError, TraceError):
        raise
    except Exception as e:  # noqa: BLE001 - every tracer failure is reported at the end
        log.info("roundpipe: %s tracing of %s failed: %s", method, type(model).__name__,
                 _first_line(e))
        attempts.append((method, e))
        return None
    notes = tuple(f"{m} failed: {_describe(e)}" for m, e in attempts)
    if traced.leaves:
        notes += ("kept opaque (run eagerly, static shapes): "
                  + _describe_leaves(model, traced.leaves),)
    if notes:
        log.info("roundpipe: traced %s with %s after: %s", type(model).__name__, method,
                 "; ".join(notes))
    return dataclasses.replace(traced, notes=notes)


def _describe_leaves(model: torch.nn.Module, paths: tuple[str, ...]) -> str:
    by_type: dict[str, list[str]] = {}
    for p in paths:
        by_type.setdefault(type(model.get_submodule(p)).__name__, []).append(p)
    return "; ".join(f"{name} at {ps[0]}" + (f" and {len(ps) - 1} more" if len(ps) > 1
                                              else "") for name, ps in by_type.items())


# --- torch.export ----------------------------------------------------------------------

def _trace_export_sharing(model: torch.nn.Module, args: tuple[Any, ...],
                          kwargs: dict[str, Any], dynamic: bool,
                          shared: tuple[str, ...]) -> TracedGraph:
    """Export with the ``shared`` blocks traced once per distinct computation and the
    copies' state hidden from export; without hiding when a copy had to be traced after
    all (or its missing state was read), without sharing when the result cannot be
    spliced."""
    if shared:
        # Any failure of a sharing attempt is retried without it: a failure of the model's
        # own makes the plain export fail too, and is reported from there.
        visible = False
        try:
            return _trace_export(model, args, kwargs, dynamic, shared=shared, hide_state=True)
        except (SharingFailed, AttributeError) as e:
            log.info("roundpipe: tracing again with every block's state visible: %s", e)
            visible = True
        except Exception as e:  # noqa: BLE001
            if fails_alike(e):  # the model's own failure: without sharing it fails the same
                raise
            log.info("roundpipe: tracing again with every block traced: %s", _first_line(e))
        if visible:
            try:
                return _trace_export(model, args, kwargs, dynamic, shared=shared)
            except Exception as e:  # noqa: BLE001
                log.info("roundpipe: tracing every block on its own: %s", _first_line(e))
    return _trace_export(model, args, kwargs, dynamic)


def _trace_export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  dynamic: bool, leaves: tuple[str, ...] = (),
                  shared: tuple[str, ...] = (), hide_state: bool = False) -> TracedGraph:
    hook = model.register_forward_hook(_register_output_dataclasses)
    try:
        with recorded_hooks(model) as hook_sites, \
                leaves_as_custom_ops(model, leaves, args, kwargs) as sites, \
                shared_blocks(model, shared, hide_state) as blocks, _packed_forward(model):
            # The model is called as model((args, kwargs)): export then never binds
            # (args, kwargs) to a forward(*args, **kwargs) signature itself, which in torch
            # 2.13 breaks dynamic shapes (PEFT's PeftModel.forward is one such signature).
            dynamic_shapes = None
            if dynamic:
                shapes = ShapesCollection()
                tensors = [t for t in pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor) and t.dim() > 0]
                for leaf in tensors:
                    shapes[leaf] = _dynamic_dims(leaf, tensors)
                dynamic_shapes = shapes.dynamic_shapes(model, ((args, kwargs),))
            ep = _quiet_export(model, ((args, kwargs),), {}, dynamic_shapes)
            gm = ep.graph_module
            sig = ep.graph_signature
            graph = gm.graph
            specs: dict[torch.fx.Node, Any] = dict(zip(
                [n for n in graph.nodes if n.op == "placeholder"], sig.input_specs))
            tensor_of = _state_lookup(model, specs)
            first_input = next((n for n, s in specs.items()
                                if s.kind == InputKind.USER_INPUT), None)
            for node, (fqn, tensor, kind) in add_hidden_state(gm, blocks.hidden,
                                                              first_input).items():
                specs[node] = _HiddenSpec(InputKind.PARAMETER if kind == "parameter"
                                          else InputKind.BUFFER, fqn)
                tensor_of[node] = tensor
            constants = frozenset(n for n, s in specs.items()
                                  if s.kind == InputKind.CONSTANT_TENSOR)
            copied = splice_blocks(gm, blocks.sites, tensor_of, constants) \
                if blocks.sites else ()
            if copied:
                log.info("roundpipe: traced %d of %d repeated blocks, copied the rest",
                         len(blocks.sites) - len(copied), len(blocks.sites))
    finally:
        hook.remove()
        _clear_dim_markers((args, kwargs))
    # no_grad / autocast blocks become marked nodes of the flat graph (their writes to
    # buffers and their random ops are then seen like any other).  Export runs in the
    # grad mode trace() was asked for.
    inline_mode_regions(gm)
    mark_mode_regions(graph, initial_grad=torch.is_grad_enabled())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]

    # State slots, deduplicated by tensor identity (tied weights keep one placeholder).
    named = _named_state(model)
    slot_of_tensor: dict[int, torch.fx.Node] = {}
    state: list[StateSpec] = []
    constants: dict[str, torch.Tensor] = {}
    state_tensors: dict[str, torch.Tensor] = {}
    user_inputs: list[torch.fx.Node] = []
    for node in placeholders:
        spec = specs[node]
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            tensor = (model.get_parameter(spec.target) if spec.kind == InputKind.PARAMETER
                      else model.get_buffer(spec.target))
            kind = "parameter" if spec.kind == InputKind.PARAMETER else "buffer"
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            tensor = ep.constants[spec.target]
            kind = "constant"
        else:
            raise TraceError(
                f"torch.export produced an input of kind {spec.kind.name} "
                f"({node.name}), which roundpipe does not support yet"
            )
        canonical = slot_of_tensor.get(id(tensor))
        if canonical is not None:
            node.replace_all_uses_with(canonical)
            graph.erase_node(node)
            continue
        slot_of_tensor[id(tensor)] = node
        fqn, aliases = named.get(id(tensor), (spec.target, ()))
        if kind == "constant":
            constants[node.name] = tensor
        state_tensors[node.name] = tensor
        state.append(_state_spec(node.name, fqn, aliases, kind, tensor))

    # User inputs are named after forward's parameters (export saw one packed argument).
    for node, name in zip(user_inputs, _input_names(model, args, kwargs)):
        node._rename(name)
        node.target = node.name

    # Outputs: user outputs (values or constants) and reassigned buffers.
    out_node = next(n for n in graph.nodes if n.op == "output")
    flat_out = list(out_node.args[0])
    outputs: list[OutputRef] = []
    buffer_updates: list[tuple[str, str]] = []
    state_name_by_fqn = {s.fqn: s.name for s in state}
    for alias_spec in state:
        for alias in alias_spec.aliases:
            state_name_by_fqn[alias] = alias_spec.name
    for value, spec in zip(flat_out, sig.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(OutputRef(value.name) if isinstance(value, torch.fx.Node)
                           else OutputRef(None, value))
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            buffer_updates.append((state_name_by_fqn[spec.target], value.name))
        else:
            raise TraceError(
                f"torch.export produced an output of kind {spec.kind.name} "
                f"({getattr(value, 'name', value)}); roundpipe supports user outputs and "
                "buffer updates only (a model that mutates its inputs in place is one cause)"
            )

    for node in graph.nodes:
        if node.op == "call_function":
            node.meta[MODULE_PATH] = _module_path(node)
    buffer_slots = {s.name for s in state if s.kind == "buffer"}
    _mark_state_mutations(graph, buffer_slots)
    _refuse_constant_writes(model, graph, {s.name: s.fqn for s in state
                                           if s.kind == "constant"}, _written_roots)
    _refuse_sparse_ops(model, graph, {s.name: s.fqn for s in state
                                      if s.kind == "parameter" and s.requires_grad})
    for node, path in replace_opaque_calls(gm, model, sites).items():
        node.meta[MODULE_PATH] = path
        if node.target is call_module_functional and model.get_submodule(path).training:
            # An opaque module in training mode may update its buffers (BatchNorm).
            written = sorted(v.name for v in node.args[1].values() if v.name in buffer_slots)
            # and a buffer passed to it as an argument that it writes
            written += [r for r in _written_roots(node) if r in buffer_slots]
            if written:
                seen = set(node.meta.get(MUTATES, ()))  # what its real run wrote
                node.meta[MUTATES] = tuple(sorted(set(written) | seen))
    # Tensor hooks the forward registers: carried into the program (traced code) or run
    # by the module's own Python (opaque modules).
    hooked_state = {s.name: s.fqn for s in state if s.kind != "constant"}
    tensor_hooks = carry_hooks(model, gm, hook_sites, hooked_state,
                               {n.name for n in user_inputs})
    for node in graph.nodes:
        if node.target is call_module_functional:  # an opaque module hooking its inputs
            for value in node.meta.get(HOOKED, ()):
                refuse_hooked_placeholder(
                    model, value, f"the opaque module {node.meta.get(MODULE_PATH)}",
                    hooked_state, {n.name for n in user_inputs})
    tensor_hooks += tuple(f"{s.path} (opaque; {line})" for s in sites.values()
                          for line in s.hooks)
    # after the opaque calls: the inputs their real run saw them write count too
    _refuse_input_writes(model, graph, {n.name for n in user_inputs}, _written_roots)
    _refuse_parameter_writes(model, graph, {s.name: s.fqn for s in state
                                            if s.kind == "parameter"})
    user_positions = [i for i, spec in enumerate(sig.output_specs)
                      if spec.kind == OutputKind.USER_OUTPUT]
    snapshots = _snapshot_written_state_outputs(graph, user_positions,
                                                torch.ops.aten.clone.default)
    outputs = [OutputRef(snapshots.get(o.value, o.value), o.constant) for o in outputs]
    copies = _copy_state_outputs(
        graph, [i for i, spec in enumerate(sig.output_specs)
                if spec.kind == OutputKind.USER_OUTPUT],
        {s.name for s in state}, torch.ops.aten.clone.default)
    outputs = [OutputRef(copies.get(o.value, o.value), o.constant) for o in outputs]
    gm.recompile()

    flat_inputs, in_spec = pytree.tree_flatten((args, kwargs))
    names = tuple(n.name if n.users else None for n in user_inputs)
    if len(flat_inputs) != len(user_inputs):
        raise TraceError(
            f"torch.export produced {len(user_inputs)} user inputs for "
            f"{len(flat_inputs)} flattened example inputs"
        )
    static = tuple(_static_signature(x, node, ep.range_constraints)
                   for x, node in zip(flat_inputs, user_inputs))
    return TracedGraph(
        graph_module=gm,
        state=tuple(state),
        inputs=InputSignature("pytree", in_spec, (), (), names, static),
        outputs=tuple(outputs),
        out_spec=ep.call_spec.out_spec,
        buffer_updates=tuple(buffer_updates),
        constants=constants,
        state_tensors=state_tensors,
        example_inputs=tuple(flat_inputs),
        method=LEAVES_METHOD if leaves else "export" if dynamic else "export-static",
        leaves=leaves,
        copied=copied,
        tensor_hooks=tensor_hooks,
    )


@dataclass(frozen=True)
class _HiddenSpec:
    """The input spec of a placeholder added for state hidden from export."""

    kind: InputKind
    target: str


def _state_lookup(model: torch.nn.Module, specs: dict[torch.fx.Node, Any]
                  ) -> dict[torch.fx.Node, torch.Tensor]:
    """The model parameter or buffer behind each exported state placeholder."""
    by_node: dict[torch.fx.Node, torch.Tensor] = {}
    for node, spec in specs.items():
        if spec.kind == InputKind.PARAMETER:
            by_node[node] = model.get_parameter(spec.target)
        elif spec.kind == InputKind.BUFFER:
            by_node[node] = model.get_buffer(spec.target)
    return by_node


def _input_names(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> list[str]:
    """A name per flat input: the forward parameter (or keyword) it was passed as, with
    the position inside nested containers appended (``input_ids``, ``pair_0``)."""
    try:
        positional = [p.name for p in inspect.signature(model.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                 for k in path]
        if path[0].idx == 0:  # type: ignore[attr-defined]
            i = int(parts[1])
            parts[1] = positional[i] if i < len(positional) else f"arg{i}"
        name = re.sub(r"\W", "_", "_".join(parts[1:]))
        names.append(name if name and not name[0].isdigit() else f"input_{name}")
    return names


def _clear_dim_markers(tree: Any) -> None:
    """Remove the dynamic-dimension marks export puts on input tensors (a failed export
    leaves them, and the next, static, attempt would then trace dynamic shapes)."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            for attr in [a for a in vars(leaf) if a.startswith(("_dynamo_", "_has_dynamo"))]:
                delattr(leaf, attr)


@contextlib.contextmanager
def _packed_forward(model: torch.nn.Module) -> Iterator[None]:
    """Give ``model`` (this instance) a ``forward(inputs)`` taking ``(args, kwargs)``.

    The user's forward pre-hooks and hooks on the model itself, and the global ones as
    they apply to it, run inside it, on the unpacked call, as eager's
    ``model(*args, **kwargs)`` runs them (global ones first): left to ``__call__``, they
    were handed the packed tuple, and a pre-hook's changed input (``(a[0] * 2,)``) was
    dropped silently.  Meanwhile the model's entries answer None, and the global ones
    answer None for the model only (same order, same keys for the users' handles);
    roundpipe's own hooks on the model still see the packed call."""
    inner = model.forward
    pre_ids, post_ids = getattr(_ROOT_HOOKS, "ids", (frozenset(), frozenset()))
    g = torch.nn.modules.module
    gpre, gpost = g._global_forward_pre_hooks, g._global_forward_hooks
    gpost_kwargs = g._global_forward_hooks_with_kwargs
    pre, post = model._forward_pre_hooks, model._forward_hooks
    pre_kwargs = model._forward_pre_hooks_with_kwargs
    post_kwargs = model._forward_hooks_with_kwargs
    moved = [(table, key, table[key]) for table, ids in ((pre, pre_ids), (post, post_ids))
             for key in list(table) if key in ids]
    shared = [(table, key, table[key]) for table in (gpre, gpost) for key in list(table)]
    pre_hooks = [(key, fn, False) for table, key, fn in shared if table is gpre] + [
        (key, fn, key in pre_kwargs) for table, key, fn in moved if table is pre]
    post_hooks = [(key, fn, key in gpost_kwargs) for table, key, fn in shared
                  if table is gpost] + [
        (key, fn, key in post_kwargs) for table, key, fn in moved if table is post]

    def forward(inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = inputs
        for _, hook, with_kwargs in pre_hooks:
            if with_kwargs:
                result = hook(model, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(model, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        out = inner(*args, **kwargs)
        for _, hook, with_kwargs in post_hooks:
            result = hook(model, args, kwargs, out) if with_kwargs else hook(model, args, out)
            if result is not None:
                out = result
        return out

    def not_for_the_model(hook: Callable[..., Any]) -> Callable[..., Any]:
        def skip(module: torch.nn.Module, *rest: Any) -> Any:
            return None if module is model else hook(module, *rest)
        return skip

    for table, key, _ in moved:
        table[key] = _no_hook
    for table, key, fn in shared:
        table[key] = not_for_the_model(fn)
    try:
        with replaced_forward(model, forward):
            yield
    finally:
        for table, key, fn in moved + shared:
            if key in table:
                table[key] = fn


def _no_hook(*_: Any, **__: Any) -> None:
    return None


def _quiet_export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  dynamic_shapes: Any) -> torch.export.ExportedProgram:
    """``torch.export.export`` without the partial graph it prints to stderr when tracing
    hits data-dependent code (hundreds of lines for a model that the next attempt handles);
    the graph goes to the debug log, anything else printed is passed through."""
    captured = io.StringIO()
    error: BaseException | None = None
    try:
        # Stack traces cost a tenth of export's time and nothing here reads them.
        with contextlib.redirect_stderr(captured), _no_stack_traces(), \
                refuse_custom_backward(), inference_mode_as_no_grad(), \
                export_keeps_mode_calls(), _quiet_logger(_SYMBOLIC_SHAPES_LOG):
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                       strict=False)
    except BaseException as e:
        error = e
        raise
    finally:
        text = captured.getvalue()
        partial = next((getattr(e, "partial_fx_graph") for e in _exception_chain(error)
                        if getattr(e, "partial_fx_graph", None)), None)
        if partial:
            text = text.replace(str(partial), "")  # printed once per nested wrapper
            log.debug("roundpipe: torch.export's partial graph before the failure:\n%s",
                      partial)
        if text.strip():
            sys.stderr.write(text)


# Warns of every data-dependent size it cannot place in user code ("Unable to find user
# code corresponding to {u0}") when export fails on data-dependent code; a failed attempt
# is reported once, by roundpipe, with what was tried next.
_SYMBOLIC_SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):  # older torch: nothing to switch off
        yield
        return
    previous = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = previous


def fails_alike(error: BaseException) -> bool:
    """Whether an export failure comes from the model's own code whatever the export's
    options (dynamic dimensions, shared blocks), so that exporting again without them
    would fail the same way: a user autograd.Function with a backward of its own, or a
    guard on a data-dependent value (``.item()``, ``nonzero``) whose expression holds only
    unbacked symbols (none of the input dimensions a static export would fix)."""
    for e in _exception_chain(error):
        if isinstance(e, CustomBackwardFunction):
            return True
        if isinstance(e, GuardOnDataDependentSymNode):
            symbols = getattr(getattr(e, "cond", None), "free_symbols", None)
            return bool(symbols) and all(
                symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)) for s in symbols)
    return False


def _exception_chain(error: BaseException | None) -> list[BaseException]:
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _register_output_dataclasses(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook: make plain dataclass outputs pytree nodes before export flattens them."""
    def visit(obj: Any) -> None:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            cls = type(obj)
            if cls not in pytree.SUPPORTED_NODES:
                torch.export.register_dataclass(
                    cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
    visit(output)


def _static_signature(value: Any, node: torch.fx.Node | None,
                      ranges: dict[Any, Any] | None = None) -> Any:
    """What a later call must match: dtype, the dims the trace specialised (ints), and
    the ranges export's guards put on dynamic dims (``(low, high)``, ``high`` None for
    unbounded: a branch on ``T > 4`` was traced for those sizes only; on the leading,
    microbatched dimension export's own floor of 2 is not kept, as microbatches of 1 run
    the same program).  ``None``: any size."""
    if not isinstance(value, torch.Tensor):
        return ("const", value)
    val = node.meta.get("val") if node is not None else None
    if isinstance(val, torch.Tensor):
        dims = tuple(_dim_signature(d, ranges or {}, leading=i == 0)
                     for i, d in enumerate(val.shape))
    else:
        dims = tuple(value.shape)
    return ("tensor", value.dtype, dims)


def _dim_signature(dim: Any, ranges: dict[Any, Any], leading: bool) -> Any:
    if isinstance(dim, int):
        return dim
    expr = dim.node.expr
    if expr.is_number:
        return int(expr)
    bounds = ranges.get(expr)
    if bounds is None:
        return None
    low = int(bounds.lower)
    try:
        high: int | None = int(bounds.upper)
    except (TypeError, ValueError, OverflowError, AttributeError):  # int_oo
        high = None
    if high is not None and high >= 2 ** 62:  # export's stand-ins for "no bound"
        high = None
    if leading and low <= 2:
        # Export's own floor (it specialises sizes 0 and 1) is dropped on the leading
        # dimension only: microbatching splits it, and a microbatch of one runs the same
        # program.  Elsewhere a size of 1 may have been traced past (`if T > 1`).
        low = 0
    return None if low == 0 and high is None else (low, high)


def _copy_state_outputs(graph: torch.fx.Graph, positions: list[int], state: set[str],
                        clone: Callable[..., Any]) -> dict[str, str]:
    """A model output that is a parameter or buffer itself (``return y, self.head.bias``)
    becomes a copy made in the unit that last reads it (or the last unit): no program
    produced that value, and the call failed (``KeyError`` / 'not produced before it was
    needed').  The copy is differentiable, so a loss reading the output reaches the
    parameter's gradient as in eager.  Returns {old output value: its copy}."""
    out_node = next(n for n in graph.nodes if n.op == "output")
    flat = list(out_node.args[0])
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in positions:
        value = flat[i]
        if not (isinstance(value, torch.fx.Node) and value.op == "placeholder"
                and value.name in state):
            continue
        if value not in copies:
            readers = [n for n in value.users if n.op != "output"]
            last = max(readers, key=_node_order(graph)) if readers else out_node.prev
            copies[value] = _insert_copy(graph, clone, value, last, where=bool(readers))
        flat[i] = copies[value]
    if copies:
        out_node.args = (type(out_node.args[0])(flat),) + tuple(out_node.args[1:])
    return {old.name: new.name for old, new in copies.items()}


def _insert_copy(graph: torch.fx.Graph, clone: Callable[..., Any], value: torch.fx.Node,
                 last: torch.fx.Node, where: bool = True) -> torch.fx.Node:
    """``clone(value)`` right after ``last``, in ``last``'s module and modes (``where``)
    with ``value``'s shape."""
    with graph.inserting_after(last):
        copy = graph.call_function(clone, (value,))
    if where:
        for key in ("nn_module_stack", "stack_trace", MODULE_PATH, MODES):
            if key in last.meta:
                copy.meta[key] = last.meta[key]
    for key in ("val", "tensor_meta"):
        if key in value.meta:
            copy.meta[key] = value.meta[key]
    return copy


def _node_order(graph: torch.fx.Graph) -> Callable[[torch.fx.Node], int]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_module_path(path)


def normalize_module_path(path: str) -> str:
    """Turn Dynamo-style paths (``L['self'].h[0].attn``) into ``h.0.attn``."""
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
        path = path.replace("[", ".").replace("]", "").replace("'", "")
    if path.startswith("_empty_nn_module_stack"):
        return ""
    return path


# Ops whose schema hides an in-place write (CompositeImplicit ops with running stats).
HIDDEN_WRITES: dict[Any, Callable[[torch.fx.Node], tuple[Any, ...]]] = {
    torch.ops.aten.batch_norm.default:
        lambda n: (n.args[3], n.args[4]) if _arg(n, 5, "training", False) else (),
    torch.ops.aten.instance_norm.default:
        lambda n: (n.args[3], n.args[4]) if _arg(n, 5, "use_input_stats", False) else (),
}


def _arg(node: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _written_roots(node: torch.fx.Node) -> set[str]:
    """Names of the base values ``node`` writes in place."""
    written: list[Any] = list(node.meta.get(WRITES, ()))  # opaque calls (leaves.py)
    hidden = HIDDEN_WRITES.get(node.target)
    if hidden is not None:
        written.extend(hidden(node))
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.append(_arg(node, i, arg.name, None))
    return {alias_root(w).name for w in written if isinstance(w, torch.fx.Node)}


def _mark_state_mutations(graph: torch.fx.Graph, buffers: set[str]) -> None:
    """Record in ``meta[MUTATES]`` which buffers a node writes in place."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        mutated = tuple(sorted(r for r in _written_roots(node) if r in buffers))
        if mutated:
            node.meta[MUTATES] = mutated


def any_alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow aliases back to the base value in either IR (ATen schemas, torch-level)."""
    from .dynamo import alias_root as torch_alias_root  # avoids a cycle
    while True:
        root = torch_alias_root(alias_root(node))
        if root is node:
            return node
        node = root


def _snapshot_written_state_outputs(graph: torch.fx.Graph, positions: list[int],
                                    clone: Callable[..., Any]) -> dict[str, str]:
    """A model output that is (a view of) a buffer the forward writes (``return y,
    self.counter``) is a copy taken where eager's would be read: after the last node
    that touches that buffer.  Left an alias, it showed the buffer as the later
    microbatches left it by the time the loss (or the caller) read it, since a pipeline
    runs a job's units on every microbatch before the next job: a wrong loss.  The
    buffer's writes and reads all lie in one unit (``layers`` merges them), so the copy
    is made in that unit.  An output of an opaque module that writes buffers (a leaf,
    or a unit of the torch.fx fallback) may alias one of them unseen: it is copied
    too.  Returns {old output value: its copy}."""
    written = {m for node in graph.nodes for m in node.meta.get(MUTATES, ())}
    if not written:
        return {}
    out_node = next(n for n in graph.nodes if n.op == "output")
    flat = list(out_node.args[0])
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in positions:
        value = flat[i]
        if not isinstance(value, torch.fx.Node):
            continue
        root = any_alias_root(value)
        if root.op == "placeholder" and root.name in written:
            slots = {root.name}
        else:
            # an output of an opaque module that writes buffers may be (a view of) one
            origin = root
            while origin.op == "call_function" and origin.target in (operator.getitem,
                                                                     tensor_leaves):
                origin = any_alias_root(origin.args[0])
            if origin.op != "call_function" or origin.target is not call_module_functional:
                continue
            slots = set(origin.meta.get(MUTATES, ()))
            if not slots:
                continue
        if value not in copies:
            last = value  # the value or the last node touching the buffers, in order
            for node in graph.nodes:
                if node.op in ("placeholder", "output"):
                    continue
                if node is value or slots & set(node.meta.get(MUTATES, ())) or any(
                        (r := any_alias_root(a)).op == "placeholder" and r.name in slots
                        for a in node.all_input_nodes):
                    last = node
            copies[value] = _insert_copy(graph, clone, value, last)
        flat[i] = copies[value]
    if copies:
        out_node.args = (type(out_node.args[0])(flat),) + tuple(out_node.args[1:])
    return {v.name: c.name for v, c in copies.items()}


def _torch_level_written_roots(node: torch.fx.Node) -> set[str]:
    """``_written_roots`` for torch-level graphs (torch.fx: ``x.mul_`` is a method call)."""
    from .dynamo import alias_root as torch_alias_root, written_values  # avoids a cycle
    if node.target is call_module_functional:
        return set()
    return {torch_alias_root(w).name for w in written_values(node)}


def _refuse_input_writes(model: torch.nn.Module, graph: torch.fx.Graph, inputs: set[str],
                         written_roots: Callable[[torch.fx.Node], set[str]]) -> None:
    """An in-place write to a tensor passed to forward (``x.mul_(2)``, ``mask[:, 0] = 1``)
    reached only the device's copy of the microbatch: eager PyTorch writes the caller's
    tensor, and a tensor passed whole to every microbatch is seen written by the
    microbatches after the first, where each got the unwritten copy (a wrong loss).
    Refused."""
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        hit = sorted(r for r in written_roots(node) if r in inputs)
        if hit:
            where = node.meta.get(MODULE_PATH) or _module_path(node) or \
                "the top-level forward"
            op = "the opaque module's call" if node.target is call_module_functional \
                else node.target
            raise ModelError(
                f"{type(model).__name__}'s forward writes its input {hit[0]!r} in place "
                f"({op} in {where}); roundpipe runs each microbatch on a copy of "
                "its inputs, so the write would not reach your tensor, and an input "
                "passed whole to every microbatch would not show one microbatch's write "
                "to the next as eager PyTorch does. Write to a copy instead "
                f"({hit[0]} = {hit[0]}.clone() before the write) or compute a new tensor "
                "(an out-of-place op)")


def _refuse_constant_writes(model: torch.nn.Module, graph: torch.fx.Graph,
                            constants: dict[str, str],
                            written_roots: Callable[[torch.fx.Node], set[str]]) -> None:
    """A plain tensor attribute (``self.stats = torch.zeros(8)``, neither a parameter nor
    a buffer) written in place in forward: it travels as a constant, whose device copies
    are never written back, so the write was dropped and later calls read the stale
    value.  Refused (a buffer's writes are carried)."""
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        hit = sorted(constants[r] for r in written_roots(node) if r in constants)
        if hit:
            where = node.meta.get(MODULE_PATH) or _module_path(node) or \
                "the top-level forward"
            owner, _, attr = hit[0].rpartition(".")
            raise ModelError(
                f"{type(model).__name__}'s forward writes the tensor attribute {hit[0]} in "
                f"place ({node.target} in {where}); it is neither a parameter nor a "
                "buffer, so roundpipe passes it as a constant and the write would be lost "
                "(eager PyTorch keeps it). Register it as a buffer, whose writes are "
                f"carried: {owner or 'self'}.register_buffer({attr!r}, tensor, "
                "persistent=False)")


def _refuse_parameter_writes(model: torch.nn.Module, graph: torch.fx.Graph,
                             params: dict[str, str],
                             written_roots: Callable[[torch.fx.Node], set[str]] = _written_roots
                             ) -> None:
    """A parameter written in place by the forward (``nn.Embedding(max_norm=...)``'s
    renorm, ``self.weight.clamp_(...)`` under no_grad, ``w.data.clamp_()``) is written on
    the device's copy only: the host weights, and so the optimizer's, never got the
    write.  Refused."""
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        hit = sorted(params[r] for r in written_roots(node) if r in params)
        if hit:
            where = node.meta.get(MODULE_PATH) or "the top-level forward"
            raise ModelError(
                f"{type(model).__name__}'s forward writes parameter {hit[0]} in place "
                f"({node.target} in {where}); roundpipe keeps the parameters on the host "
                "and would drop that write silently. Apply such constraints outside the "
                "forward (for example in the step, after the optimizer), or compute a new "
                "tensor from the parameter instead of writing it (nn.Embedding(max_norm=) "
                "renormalizes its weight in place: use max_norm=None)")


SPARSE_HINT = ("roundpipe keeps gradients dense (they are downloaded into dense host "
                "buffers and summed across microbatches and devices); use sparse=False "
                "(and a dense optimizer in place of SparseAdam), or freeze the weight")


def refuse_lazy_parameters(model: torch.nn.Module) -> None:
    """A lazy module's parameters and buffers (``nn.LazyLinear``, ``nn.LazyConv2d``, ...)
    have no shape until its first forward, which tracing cannot be (it initialises
    them from the global random generator, on real tensors): refused with the way out."""
    lazy = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if torch.nn.parameter.is_lazy(t)]
    if lazy:
        name = lazy[0][0]
        owner = model.get_submodule(name.rpartition(".")[0])
        raise ModelError(
            f"{name} is not initialised yet ({type(owner).__name__} is a lazy module, whose "
            "parameters get their shape at its first forward"
            + (f"; {len(lazy) - 1} more" if len(lazy) > 1 else "")
            + "): roundpipe needs every parameter's shape before it traces and streams "
            "them. Run one eager forward on an example batch first to materialise them "
            "(model(example_input), under torch.no_grad()), then wrap the model")


def _refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """``nn.Embedding(sparse=True)`` / ``EmbeddingBag`` with a trainable weight: refused
    before tracing (its sparse gradient failed in the backward stage, copying into a
    dense buffer)."""
    for path, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and \
                m.weight.requires_grad:
            raise ModelError(f"{path or type(model).__name__} ({type(m).__name__}) has "
                             f"sparse=True: {SPARSE_HINT}")


def _refuse_sparse_ops(model: torch.nn.Module, graph: torch.fx.Graph,
                       trainable: dict[str, str]) -> None:
    """The same for the functional form (``F.embedding(..., sparse=True)``) on a trainable
    parameter, as export's graph shows it."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        names = [a.name for a in schema.arguments]
        if "sparse" not in names or not _arg(node, names.index("sparse"), "sparse", False):
            continue
        weight = _arg(node, 0, names[0], None)
        if isinstance(weight, torch.fx.Node) and alias_root(weight).name in trainable:
            raise ModelError(
                f"{type(model).__name__}'s forward calls {node.target} with sparse=True on "
                f"parameter {trainable[alias_root(weight).name]}: {SPARSE_HINT}")


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow view ops (outputs aliasing their first input) back to the base value."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


# --- torch.fx fallback -----------------------------------------------------------------

_ASSERT_IS_NONE = getattr(torch.fx._symbolic_trace, "_assert_is_none", None)


class _LeafTracer(torch.fx.Tracer):
    """Symbolic tracer that keeps the layer units (and torch's own modules) opaque."""

    def __init__(self, leaves: frozenset[str]) -> None:
        super().__init__()
        self._leaves = leaves
        # Buffers become graph values too; otherwise ops on them (self.calls.add_(1))
        # would run once, for real, while tracing, and never again.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self._leaves or super().is_leaf_module(
            m, module_qualified_name)


def _trace_fx(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              leaves: frozenset[str], rehearsal: list[StateChanges] | None = None
              ) -> TracedGraph:
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    params = [p for p in sig.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(params) != len(sig.parameters):
        # Not a TraceError: this is one failed attempt, reported with the others.
        raise NotImplementedError(
            f"{type(model).__name__}.forward takes *args/**kwargs, which torch.fx cannot bind")
    if any(getattr(_ROOT_HOOKS, "ids", ())):
        # fx traces type(model).forward: the model's own hooks would be dropped.
        raise NotImplementedError(
            f"torch.fx traces {type(model).__name__}.forward without the forward hooks "
            "registered on the model itself")
    # Non-tensor arguments (and arguments left at their default) are specialised.
    values = {p.name: bound.arguments.get(p.name, p.default) for p in params}
    concrete = {name: v for name, v in values.items() if not isinstance(v, torch.Tensor)}
    tracer = _LeafTracer(leaves)
    initial_grad = torch.is_grad_enabled()
    with fx_records_grad_mode(tracer), inference_mode_as_no_grad(), \
            refuse_custom_backward(), _refuse_data_assignment(), \
            state_kept(model, rebind_attributes="on_failure") as changes:
        graph = tracer.trace(model, concrete_args=concrete)
    if changes.written or changes.moved or changes.flags:
        # fx made graph values of parameters and buffers reached as module attributes;
        # code on any other tensor ran once, for real (now undone), and is not in the graph
        raise ModelError(
            f"{type(model).__name__}'s forward changes {changes.first()} on a tensor that "
            "torch.fx does not trace (a plain tensor attribute, or a parameter or buffer "
            "reached other than as a module attribute, e.g. through self.parameters()): "
            "the program would never make that change, where eager PyTorch makes it at "
            "every call. Register a tensor written in place as a buffer "
            "(register_buffer(name, tensor, persistent=False)), or make the change "
            "outside the forward")
    mark_mode_regions(graph, initial_grad=initial_grad)
    for node in list(graph.nodes):
        # fx checks an argument specialised to None with a node reading its placeholder,
        # which no call feeds; the input signature checks it instead (a const entry).
        if node.op == "call_function" and node.target is _ASSERT_IS_NONE and not node.users:
            graph.erase_node(node)
    gm = torch.fx.GraphModule(model, graph)
    graph = gm.graph

    named = _named_state(model)
    state: list[StateSpec] = []
    constants: dict[str, torch.Tensor] = {}
    state_tensors: dict[str, torch.Tensor] = {}
    slot_of_tensor: dict[int, torch.fx.Node] = {}
    first_input = next(n for n in graph.nodes if n.op == "placeholder")

    def slot_for(tensor: torch.Tensor, kind: str, fallback_name: str) -> torch.fx.Node:
        node = slot_of_tensor.get(id(tensor))
        if node is None:
            fqn, aliases = named.get(id(tensor), (fallback_name, ()))
            prefix = {"parameter": "p_", "buffer": "b_", "constant": "c_"}[kind]
            with graph.inserting_before(first_input):
                node = graph.placeholder(prefix + fqn.replace(".", "_"))
            slot_of_tensor[id(tensor)] = node
            if kind == "constant":
                constants[node.name] = tensor
            state_tensors[node.name] = tensor
            state.append(_state_spec(node.name, fqn, aliases, kind, tensor))
        return node

    param_ids = {id(p) for p in model.parameters()}
    buffer_ids = {id(b) for b in model.buffers()}

    def kind_of(tensor: torch.Tensor) -> str:
        return ("parameter" if id(tensor) in param_ids
                else "buffer" if id(tensor) in buffer_ids else "constant")

    fx_hooks: list[str] = []
    for node in list(graph.nodes):
        if node.op == "get_attr":
            attr = _get_attr(gm, node.target)
            if isinstance(attr, torch.Tensor):
                slot = slot_for(attr, kind_of(attr), node.target)
                node.replace_all_uses_with(slot)
                graph.erase_node(node)
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            if code_registers_hooks(module):
                # Its Python runs at run time, hooks included (skipped in forward jobs).
                mark_hooking(module)
                fx_hooks.append(f"{node.target} (opaque unit on the torch.fx fallback)")
            mapping: dict[str, torch.fx.Node] = {}
            for local, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
                    module.named_buffers(remove_duplicate=False)) + tensor_attributes(module):
                mapping[local] = slot_for(tensor, kind_of(tensor), f"{node.target}.{local}")
            with graph.inserting_before(node):
                mod_ref = graph.get_attr(node.target)
                call = graph.call_function(call_module_functional,
                                           (mod_ref, mapping) + tuple(node.args),
                                           dict(node.kwargs))
            call.meta = dict(node.meta)
            call.meta[MODULE_PATH] = node.target
            if module.training:
                mutated = tuple(sorted(mapping[local].name for local, _ in
                                       module.named_buffers(remove_duplicate=False)))
                if mutated:
                    call.meta[MUTATES] = mutated
            node.replace_all_uses_with(call)
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method") and MODULE_PATH not in node.meta:
            node.meta[MODULE_PATH] = _module_path(node)
    _mark_torch_level_buffer_writes(graph, {s.name for s in state if s.kind == "buffer"})
    _refuse_input_writes(model, graph, {n.name for n in graph.nodes if n.op == "placeholder"
                                        and n not in slot_of_tensor.values()},
                         _torch_level_written_roots)
    _refuse_constant_writes(model, graph, {s.name: s.fqn for s in state
                                           if s.kind == "constant"},
                            _torch_level_written_roots)
    _refuse_parameter_writes(model, graph, {s.name: s.fqn for s in state
                                            if s.kind == "parameter"},
                             _torch_level_written_roots)
    if rehearsal:
        _refuse_writes_fx_missed(model, graph, state_tensors, rehearsal[-1])

    # Flat outputs from the returned structure.
    out_node = next(n for n in graph.nodes if n.op == "output")
    flat_out, out_spec = pytree.tree_flatten(out_node.args[0])
    out_node.args = (tuple(flat_out),)
    _snapshot_written_state_outputs(graph, list(range(len(flat_out))), torch.clone)
    flat_out = list(out_node.args[0])
    outputs = tuple(OutputRef(v.name) if isinstance(v, torch.fx.Node) else OutputRef(None, v)
                    for v in flat_out)
    gm.recompile()

    input_nodes = [n for n in graph.nodes if n.op == "placeholder"
                   and n not in slot_of_tensor.values()]
    by_target = {n.target: n for n in input_nodes}
    names = tuple(by_target[p.name].name if p.name in by_target
                  and by_target[p.name].users and p.name not in concrete else None
                  for p in params)
    flat_inputs = tuple(values[p.name] for p in params)
    static = tuple(("tensor", v.dtype, tuple(None for _ in v.shape))
                   if isinstance(v, torch.Tensor) else ("const", v) for v in flat_inputs)
    defaults = tuple(p.default for p in params)
    return TracedGraph(
        graph_module=gm,
        state=tuple(state),
        inputs=InputSignature("signature", None, tuple(p.name for p in params), defaults,
                              names, static),
        outputs=outputs,
        out_spec=out_spec,
        buffer_updates=(),
        constants=constants,
        state_tensors=state_tensors,
        example_inputs=flat_inputs,
        method="fx",
        tensor_hooks=tuple(fx_hooks),
    )


def _refuse_writes_fx_missed(model: torch.nn.Module, graph: torch.fx.Graph,
                             state_tensors: dict[str, torch.Tensor],
                             rehearsal: StateChanges) -> None:
    """A parameter or buffer the eager rehearsal saw written in place, which the fx graph
    does not write: the write happens inside one recorded call (``F.embedding`` with
    ``max_norm`` renormalizes the weight), on the device's copy only, so the program would
    drop it where eager PyTorch makes it at every call.  Refused, as export refuses it."""
    graph_writes = {storage_key(state_tensors[name]) for node in graph.nodes
                    for name in node.meta.get(MUTATES, ()) if name in state_tensors}
    missed = [label for key, label in rehearsal.written_storages.items()
              if key not in graph_writes]
    if missed:
        raise ModelError(
            f"{type(model).__name__}'s forward writes {missed[0]} in place (seen when the "
            "example ran eagerly) inside a call that torch.fx records as one operation "
            "(nn.Embedding(max_norm=) renormalizes its weight in F.embedding); the "
            "program would make that write on the device's copy only and drop it, where "
            "eager PyTorch keeps it at every call. Apply such constraints outside the "
            "forward (for example in the step, after the optimizer), or compute a new "
            "tensor instead of writing it (nn.Embedding: use max_norm=None)")


@contextlib.contextmanager
def _refuse_data_assignment() -> Iterator[None]:
    """``t.data = value`` on a traced value: torch.fx records no node for it (the
    attribute lands on the Proxy), so the write was dropped silently.  Fails the fx
    attempt instead."""
    def setattr_(proxy: torch.fx.Proxy, name: str, value: Any) -> None:
        if name == "data":
            raise NotImplementedError(
                f"the forward assigns {proxy}.data, which torch.fx cannot record; write "
                "in place instead (t.copy_(value) under torch.no_grad())")
        object.__setattr__(proxy, name, value)

    torch.fx.Proxy.__setattr__ = setattr_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del torch.fx.Proxy.__setattr__


def _mark_torch_level_buffer_writes(graph: torch.fx.Graph, buffers: set[str]) -> None:
    """Record in ``meta[MUTATES]`` the buffers torch-level code writes in place outside
    opaque modules (``self.calls.add_(1)`` in a top-level forward)."""
    from .dynamo import alias_root as torch_alias_root, written_values  # avoids a cycle
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or \
                node.target is call_module_functional:
            continue
        roots = {torch_alias_root(w).name for w in written_values(node)}
        mutated = roots & buffers
        if mutated:
            node.meta[MUTATES] = tuple(sorted(mutated | set(node.meta.get(MUTATES, ()))))


def _get_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# --- shared helpers --------------------------------------------------------------------

def _image_like(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dim() >= 4


def _dynamic_dims(tensor: torch.Tensor, inputs: list[torch.Tensor]) -> dict[int, Any]:
    """The dimensions export is asked to keep dynamic: all, except those past the batch
    of floating tensors with 4 or more (images, video) whose size no other input shares.
    Training images have one size, and symbolic image sizes make export of window-attention
    models (Swin's padding and window partition) about 50x slower; a new size gets a
    program of its own.  A size another input has too (a (B, 1, T, T) mask beside (B, T)
    token ids) stays dynamic, so sequence lengths do not each make a program."""
    if not _image_like(tensor):
        return {d: Dim.AUTO for d in range(tensor.dim())}
    shared = {size for other in inputs if not _image_like(other)
              for size in other.shape[1:] if size > 1}
    return {d: Dim.AUTO for d in range(tensor.dim()) if d == 0 or tensor.shape[d] in shared}


def _named_state(model: torch.nn.Module) -> dict[int, tuple[str, tuple[str, ...]]]:
    """Map tensor identity to (canonical name, other names) for parameters and buffers."""
    names: dict[int, list[str]] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    return {k: (v[0], tuple(v[1:])) for k, v in names.items()}


def _state_spec(name: str, fqn: str, aliases: tuple[str, ...], kind: str,
                tensor: torch.Tensor) -> StateSpec:
    return StateSpec(name=name, fqn=fqn, aliases=aliases, kind=kind,  # type: ignore[arg-type]
                     shape=tuple(tensor.shape), dtype=tensor.dtype,
                     nbytes=tensor.numel() * tensor.element_size(),
                     requires_grad=kind == "parameter" and tensor.requires_grad)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _user_frame(e: BaseException) -> str | None:
    """The innermost traceback frame outside torch and roundpipe: the user's source line
    (following chained exceptions, as export re-raises some errors as new ones)."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    for exc in _exception_chain(e):
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            if not frame.filename.startswith((torch_dir, here)) and "<" not in frame.filename:
                return (f'{frame.filename}:{frame.lineno} in {frame.name}: '
                        f'{(frame.line or "").strip()}')
    return None


def _describe(e: BaseException) -> str:
    where = _user_frame(e)
    return _first_line(e) + (f" (at {where})" if where else "")


_UNKNOWN_PYTREE = re.compile(r"Found <class '([^']+)'> in (output|input)")


def _unknown_pytree_type(attempts: list[tuple[str, BaseException]]) -> tuple[str, str] | None:
    """(class name, 'output'/'input') when export failed on an object of a class
    pytree does not know (``return MyOutput(logits)``): the ways out must say how to
    register it, not only speak of control flow and leaf modules."""
    for _, e in attempts:
        for exc in _exception_chain(e):
            found = _UNKNOWN_PYTREE.search(str(exc))
            if found:
                return found.group(1), "model " + found.group(2)
    return None


def _trace_failure_message(model: torch.nn.Module, attempts: list[tuple[str, BaseException]],
                           blamed: str | None, leaves: tuple[str, ...]) -> str:
    """What was tried, where it failed, and the ways out."""
    cls = type(model).__name__
    lines = [f"could not trace {cls}; tried:"]
    for method, e in attempts:
        lines.append(f"  - {method}: {_describe(e)}")
    opaque = blamed is not None and any(blamed == p or blamed.startswith(p + ".")
                                        for p in leaves)
    if blamed is None:
        lines.append(
            f"The failing code runs in {cls}.forward itself (or in functions it calls), not "
            "in a submodule, so it cannot be kept opaque as it is.")
    elif opaque:
        lines.append(
            f"It fails inside {blamed} ({type(model.get_submodule(blamed)).__name__}) even "
            "when kept opaque: a leaf module must run on the example inputs and return "
            "tensors in lists, tuples, dicts or dataclasses.")
    else:
        lines.append(f"It fails inside {blamed} "
                     f"({type(model.get_submodule(blamed)).__name__}).")
    leaf_hint = blamed if blamed is not None and not opaque else "a.submodule.path"
    lines.append("Ways out:")
    unknown = _unknown_pytree_type(attempts)
    if unknown is not None:
        lines.append(
            f"  * the {unknown[1]} holds a {unknown[0]} object, which tracing cannot take "
            "apart into tensors: register its class with "
            "torch.utils._pytree.register_pytree_node (how to flatten it and build it "
            "back)" + (", make it a dataclass" if unknown[1] == "model output" else "")
            + ", or use lists, tuples or dicts of tensors;")
    if blamed is None and any(isinstance(c, CustomBackwardFunction)
                              for _, e in attempts for c in _exception_chain(e)):
        lines.append(
            "  * call the autograd.Function from a submodule's forward: that submodule is "
            "then kept opaque by itself and runs eagerly, its backward included;")
    lines += [
        "  * if the model's config chooses between implementations of that code (Hugging "
        "Face configs: attn_implementation=..., experts_implementation=...), pick one "
        "without data-dependent Python control flow;",
        f"  * keep the module that runs it opaque: roundpipe.compile(model, ..., "
        f"leaf_modules=[{leaf_hint!r}]) (it then runs as plain Python, with static shapes)"
        + (", after moving the code into a submodule;" if blamed is None else ";"),
        "  * make the failing line traceable (avoid data-dependent Python control flow), or "
        "pass example inputs that match real calls.",
    ]
    return "\n".join(lines)


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
