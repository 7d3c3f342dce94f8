"""Tensor hooks registered inside a forward (``h.register_hook(fn)``), carried into the
program.

``torch.export`` records no node for ``Tensor.register_hook``: the hook was dropped, and
the gradients upstream of it were those of a model without it.  While export runs, the
call is intercepted on the tracing thread and recorded as a marker op on the hooked value::

    linear = aten.linear(x, p_a_weight, p_a_bias)
    roundpipe.tensor_hook(linear, site=0)            # h.register_hook(fn) in forward

and after export (:func:`carry_hooks`) the marker becomes a call that registers the user's
function on the tensor the program computes, where a backward will reach it
(:func:`roundpipe.ops.hooks.register_tensor_hook`)::

    _tensor_hook_0 = self._tensor_hook_0             # the user's fn
    register_tensor_hook(linear, _tensor_hook_0)

The call is kept in the unit that computes the hooked value (``meta[HOOKED]``: the layers
pass merges units as it does for an in-place write), so the hook sees the gradient summed
over every reader, as in eager.  It fires once per microbatch and backward.

Refused (:class:`~roundpipe.errors.ModelError`, with the module and the source line):

* a hook whose function holds values of the forward (a closure over a tensor the forward
  computed): the traced function holds fake tensors of the trace, not the values of a
  call; such a module can be kept opaque (``leaf_modules=``), where its Python runs;
* a hook on a model input, a parameter or a buffer: those are the caller's tensors (or
  are registered anew by every call, which eager keeps adding up).

Opaque (leaf) modules run their own Python, hooks included (:mod:`roundpipe.passes.leaves`
records which ones register hooks, on which of their inputs).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.utils.hooks import RemovableHandle

from ..errors import ModelError
from ..ops.hooks import HookFunction, register_tensor_hook

# The values a hook registration must stay with (layers.py keeps them in one unit).
HOOKED = "roundpipe.hooked"
HOOK_ATTR_PREFIX = "_tensor_hook_"


@dataclass
class HookSite:
    """One ``register_hook`` call seen while tracing."""

    hook: Callable[..., Any]
    module: str  # the innermost module whose forward registered it ("" for the model's)
    line: str  # file:line: code
    removed: bool = False

    def where(self) -> str:
        return f"{self.module or 'the top-level forward'} ({self.line})"


_SITES: dict[int, HookSite] = {}
_NEXT_SITE = itertools.count()


@torch.library.custom_op("roundpipe::tensor_hook", mutates_args=())
def tensor_hook(tensor: torch.Tensor, site: int) -> None:
    """Marks ``tensor.register_hook(...)`` while exporting; replaced after export."""
    raise RuntimeError("roundpipe::tensor_hook is a tracing marker and never runs")


@tensor_hook.register_fake
def _tensor_hook_fake(tensor: torch.Tensor, site: int) -> None:
    return None


TENSOR_HOOK_OP = torch.ops.roundpipe.tensor_hook.default


@contextlib.contextmanager
def intercept_register_hook(callback: Callable[[torch.Tensor, Any, str], Any]
                            ) -> Iterator[None]:
    """While active, ``Tensor.register_hook(hook)`` called on this thread returns
    ``callback(tensor, hook, source line)`` instead of registering; other threads (a pipe
    training meanwhile) are not affected."""
    original = torch.Tensor.register_hook
    thread = threading.get_ident()

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        if threading.get_ident() != thread:
            return original(self, hook)
        return callback(self, hook, source_line(sys._getframe(1)))

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]


def source_line(frame: Any) -> str:
    """``file.py:12: code`` of ``frame``, skipping torch's own frames."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        frame = frame.f_back
    if frame is None:
        return "unknown line"
    import linecache
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}: {code}"


def calling_module(model: torch.nn.Module, frame: Any) -> str:
    """Path of the innermost module of ``model`` whose ``forward`` is on the stack."""
    by_id = {id(m): n for n, m in model.named_modules()}
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount:
            obj = frame.f_locals.get(code.co_varnames[0])  # self, whatever its name
            if obj is not None and id(obj) in by_id:
                return by_id[id(obj)]
        frame = frame.f_back
    return ""


def code_registers_hooks(module: torch.nn.Module) -> bool:
    """Whether the ``forward`` of ``module`` or of a module inside it (or a base class's
    ``forward``) calls ``register_hook``, read from the source: the torch.fx fallback
    never runs its opaque units while tracing.  A call from a helper function is not
    seen (the forward job then fails with torch's own error)."""
    for sub in module.modules():
        for cls in type(sub).__mro__:  # a subclass's forward calling super().forward()
            if "forward" not in vars(cls) or cls.__module__.startswith("torch."):
                continue
            try:
                source = inspect.getsource(vars(cls)["forward"])
            except (OSError, TypeError):
                continue
            if "register_hook(" in source:
                return True
    return False


def dummy_handle() -> RemovableHandle:
    return RemovableHandle(OrderedDict())


class _SiteHandle(RemovableHandle):
    """What ``register_hook`` returns while tracing: removing it drops the hook (the
    forward removed it before any backward could run it)."""

    def __init__(self, site: HookSite) -> None:
        super().__init__(OrderedDict())
        self._site = site

    def remove(self) -> None:
        self._site.removed = True


def forward_values(hook: Any) -> list[str]:
    """Names of the tensors of a trace that ``hook`` holds (closure cells, defaults,
    ``functools.partial`` arguments, a bound method's object), one container deep."""
    from torch._subclasses.fake_tensor import is_fake
    found: list[str] = []

    def look(name: str, value: Any, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            if is_fake(value):
                found.append(name)
        elif depth == 0 and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                look(f"{name}[{i}]", v, 1)
        elif depth == 0 and isinstance(value, dict):
            for k, v in value.items():
                look(f"{name}[{k!r}]", v, 1)

    fn = hook
    while isinstance(fn, functools.partial):
        for i, a in enumerate(fn.args):
            look(f"argument {i}", a)
        for k, v in fn.keywords.items():
            look(k, v)
        fn = fn.func
    if hasattr(fn, "__self__") and not isinstance(fn.__self__, torch.nn.Module):
        look("its object", fn.__self__)
    code = getattr(fn, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None)
                          or ()):
        try:
            look(name, cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    for i, v in enumerate(getattr(fn, "__defaults__", None) or ()):
        look(f"default {i}", v)
    for k, v in (getattr(fn, "__kwdefaults__", None) or {}).items():
        look(k, v)
    return found


@contextlib.contextmanager
def recorded_hooks(model: torch.nn.Module) -> Iterator[dict[int, HookSite]]:
    """While export traces ``model``, every ``register_hook`` on a traced tensor becomes a
    ``roundpipe::tensor_hook`` node; yields the sites by id (for :func:`carry_hooks`)."""
    sites: dict[int, HookSite] = {}

    def on_register(tensor: torch.Tensor, hook: Any, line: str) -> Any:
        from torch._subclasses.fake_tensor import is_fake
        if not is_fake(tensor):
            # A real run while tracing (an opaque module's recording run, under no_grad):
            # the trace of the module that runs it decides.
            return dummy_handle()
        module = calling_module(model, sys._getframe(1))
        site = HookSite(hook, module, line)
        if not tensor.requires_grad:
            raise ModelError(
                f"{type(model).__name__}'s forward registers a tensor hook in "
                f"{site.where()} on a tensor that does not require grad (traced with grad "
                f"{'enabled' if torch.is_grad_enabled() else 'disabled, as this call runs'}"
                "); eager PyTorch fails there too (cannot register a hook on a tensor "
                "that doesn't require gradient). Register it only where a backward can "
                "reach it: if h.requires_grad: h.register_hook(...)")
        held = forward_values(hook)
        if held:
            raise ModelError(
                f"{type(model).__name__}'s forward registers a tensor hook in "
                f"{site.where()} whose function holds a tensor the forward computed "
                f"({held[0]}); roundpipe carries the function into its program, where "
                "that value would be the trace's, not the call's. Compute what the hook "
                "needs from its gradient argument or from module state, or keep the "
                "module opaque (roundpipe.compile(model, ..., leaf_modules="
                f"[{module or 'a.submodule'!r}]): its forward then runs as written, and "
                "its hooks with it" + (", after moving that code into a submodule)" if
                                       not module else ")"))
        sid = next(_NEXT_SITE)
        _SITES[sid] = sites[sid] = site
        tensor_hook(tensor, sid)
        return _SiteHandle(site)

    try:
        with intercept_register_hook(on_register):
            yield sites
    finally:
        for sid in sites:
            _SITES.pop(sid, None)


def carry_hooks(model: torch.nn.Module, gm: torch.fx.GraphModule,
                sites: dict[int, HookSite], state: dict[str, str],
                inputs: set[str]) -> tuple[str, ...]:
    """Replace every ``roundpipe::tensor_hook`` marker by a :func:`register_tensor_hook`
    call on the user's function (an attribute of ``gm``); returns where each hook kept is
    registered.  ``state``: placeholder name -> fqn of parameters and buffers; ``inputs``:
    the model input placeholders."""
    graph = gm.graph
    where: list[str] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not TENSOR_HOOK_OP:
            continue
        value, sid = node.args
        site = sites.get(sid)
        if site is None:  # never expected: every marker was made by recorded_hooks
            raise RuntimeError(f"roundpipe: tensor hook marker {node.name} has no site")
        if site.removed:  # the forward removed it before any backward could run it
            graph.erase_node(node)
            continue
        refuse_hooked_placeholder(model, value, site.where(), state, inputs)
        attr = f"{HOOK_ATTR_PREFIX}{len(where)}"
        gm.add_submodule(attr, HookFunction(site.hook))
        with graph.inserting_before(node):
            ref = graph.get_attr(attr)
            call = graph.call_function(register_tensor_hook, (value, ref))
        for new in (ref, call):
            new.meta = dict(node.meta)
        call.meta[HOOKED] = (value,)
        graph.erase_node(node)
        where.append(site.where())
    return tuple(where)


def refuse_hooked_placeholder(model: torch.nn.Module, value: Any, where: str,
                              state: dict[str, str], inputs: set[str]) -> None:
    """A hook on a model input, a parameter or a buffer: refused (module doc)."""
    if not isinstance(value, torch.fx.Node) or value.op != "placeholder":
        return
    if value.name in state:
        raise ModelError(
            f"{type(model).__name__}'s forward registers a tensor hook on {state[value.name]} "
            f"in {where}; each call would register it again on the model's own tensor "
            "(eager PyTorch then runs it once per call made so far). Register it once, "
            "outside the forward (a hook on a parameter acts on its gradient)")
    if value.name in inputs:
        raise ModelError(
            f"{type(model).__name__}'s forward registers a tensor hook on its input "
            f"{value.name!r} in {where}; roundpipe runs each microbatch on a copy of its "
            "inputs, so the hook would see one microbatch's share of the gradient, not "
            "your tensor's. Register it on the tensor before passing it (pipe(x) returns "
            "the input's gradient to it), or register it on a value the forward computes")
