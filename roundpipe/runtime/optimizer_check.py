"""Which optimizers a ``step_fn`` steps, checked before each one writes anything.

With ``optim_dtype`` the gradients land on master copies (``pipe.optim_parameters()``);
the model's own parameters never get a ``.grad``.  An optimizer built the usual way,
``torch.optim.AdamW(model.parameters())``, would then step nothing and leave the weights
as they were, with no error.  torch's global optimizer step pre-hook sees every optimizer
that steps; while a pipe's ``step_fn`` runs on its optimizer thread, the hook checks what
the optimizer holds and refuses, before its step, one that holds the model's parameters
in place of their masters, or one that holds nothing of the pipe and nothing with a
gradient (its step is a no-op).  Optimizers over other modules' parameters (a step_fn may
train something else too) pass.  Other threads are not watched.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import OptimizerError
from .host_state import ModelState
from .masters import owner_of, raw_grad

_local = threading.local()
_hook_lock = threading.Lock()
_hook: Any = None  # the global pre-hook's handle, registered once per process
# Open pipes with masters: an optimizer over their masters (or over the model parameters
# the masters stand in for) stepped outside pipe.step would update nothing that the next
# call reads, silently (a plain PyTorch loop: forward_backward, opt.step(), no pipe.step).
_open_with_masters: "weakref.WeakSet[ModelState]" = weakref.WeakSet()


class MisbuiltOptimizerError(OptimizerError):
    """An optimizer stepped inside ``pipe.step`` cannot update the pipe's weights."""


class StepWatch:
    """One step of one pipe: what its optimizers hold."""

    def __init__(self, state: ModelState, on_pass: Callable[[], None] = lambda: None
                 ) -> None:
        self.state = state
        self.on_pass = on_pass
        self.stepped_pipe = False  # an optimizer over the pipe's parameters stepped
        # An optimizer that held nothing of the pipe and nothing with a gradient: refused
        # at the step's end only if nothing stepped the pipe, since beside the pipe's own
        # optimizer it is an ordinary no-op (a head not used this step), as in eager.
        self.stray: MisbuiltOptimizerError | None = None
        self._ids: tuple[dict[int, str], dict[int, str]] | None = None

    def _names(self) -> tuple[dict[int, str], dict[int, str]]:
        """(id -> name) of the pipe's optimized tensors, and of the model's trainable
        parameters that masters stand in for (empty without masters)."""
        if self._ids is None:
            named = self.state.named_masters()
            shadowed = ({id(self.state.model.get_parameter(n)): n for n, _ in named}
                        if self.state.has_masters else {})
            self._ids = {id(t): n for n, t in named}, shadowed
        return self._ids

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        optimized, shadowed = self._names()
        groups = getattr(optimizer, "param_groups", None) or []
        held: list[list[str]] = []   # per group: the pipe's tensors it holds
        wrong: list[list[str]] = []  # per group: model parameters standing for masters
        n_params = 0
        with_grad = False
        for group in groups:
            params = list(group.get("params", ()))
            n_params += len(params)
            held.append([optimized[id(p)] for p in params if id(p) in optimized])
            wrong.append([shadowed[id(p)] for p in params if id(p) in shadowed])
            with_grad = with_grad or any(raw_grad(p) is not None or owner_of(p) is not None
                                         for p in params if isinstance(p, torch.Tensor))
        name = _optimizer_name(optimizer)
        total = len(optimized)
        if any(wrong):
            raise MisbuiltOptimizerError(_shadowed_message(
                name, held, wrong, total, self.state.optim_dtype, len(groups)))
        if any(held) and self.state.offload is not None and \
                optimizer not in self.state.landed.optimizers:
            raise MisbuiltOptimizerError(
                f"{name} steps the masters (without masters: the parameters) of a pipe "
                "with the disk tier (offload_dir), where the masters and the optimizer "
                "state live in files and are read in only for roundpipe.optim's "
                "optimizers, unit by unit; another optimizer would find them not in "
                "memory and keep its state in host memory. Use "
                f"roundpipe.optim.AdamW or roundpipe.optim.SGD over "
                "pipe.optim_parameters(), or drop offload_dir")
        if any(held):
            self.stepped_pipe = True
            self.on_pass()
            return
        if not with_grad and self.stray is None:
            self.stray = MisbuiltOptimizerError(
                f"{name}, stepped inside pipe.step, holds {n_params} tensor(s), none of "
                f"them the pipe's and none with a gradient, so its step changes nothing. "
                f"It should hold the pipe's {total} trainable tensor(s), "
                f"pipe.optim_parameters(): build it as {name}(pipe.optim_parameters(), "
                "...) (param groups by name: pipe.optim_named_parameters())")

    def finish(self) -> None:
        """At the step's end: refuse a step whose only optimizers stepped nothing."""
        if self.stray is not None and not self.stepped_pipe:
            raise self.stray


def _optimizer_name(optimizer: Any) -> str:
    cls = type(optimizer)
    module = cls.__module__
    if module.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    if module.startswith("roundpipe.optim"):
        return f"roundpipe.optim.{cls.__name__}"
    return cls.__name__


def _listed(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _shadowed_message(name: str, held: list[list[str]], wrong: list[list[str]], total: int,
                      dtype: torch.dtype | None, n_groups: int) -> str:
    n_wrong = sum(map(len, wrong))
    n_held = sum(map(len, held))
    where = ""
    if n_groups > 1:
        where = " (" + "; ".join(
            f"group {i}: {len(w)} model parameter(s), {len(h)} master(s)"
            for i, (w, h) in enumerate(zip(wrong, held)) if w or h) + ")"
    dtype_name = str(dtype).replace("torch.", "")
    return (
        f"{name}, stepped inside pipe.step, holds {n_wrong} of the model's own parameters "
        f"({_listed([n for w in wrong for n in w])})"
        + (f" and {n_held} of the pipe's {dtype_name} masters" if n_held else "")
        + where + f". With optim_dtype=torch.{dtype_name} the gradients and the update "
        f"go to {dtype_name} master copies, pipe.optim_parameters() ({total} tensor(s)); "
        "the model's parameters never get a .grad, so this optimizer would leave them "
        f"unchanged. It should hold the masters: {name}(pipe.optim_parameters(), ...), or "
        "param groups built from pipe.optim_named_parameters(), which has the model's "
        "names (e.g. to keep biases out of weight decay)")


def _pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    watch = getattr(_local, "watch", None)
    if watch is not None:
        watch.check(optimizer)
    elif _open_with_masters:
        _refuse_outside_step(optimizer)


def _refuse_outside_step(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer over an open pipe's masters (or the parameters they stand for)
    stepping outside ``pipe.step``: refused before it writes anything."""
    held = {id(p) for group in getattr(optimizer, "param_groups", None) or []
            for p in group.get("params", ()) if isinstance(p, torch.Tensor)}
    if not held:
        return
    for state in list(_open_with_masters):
        named = state.named_masters()
        if any(id(t) in held for _, t in named) or any(
                id(state.model.get_parameter(n)) in held for n, _ in named):
            name = _optimizer_name(optimizer)
            raise OptimizerError(
                f"{name}.step() ran outside pipe.step (not in a step_fn), over a pipe "
                "whose gradients and "
                "update go to master copies (optim_dtype): the masters would change but "
                "the model's weights, which the next call uploads, would not, so training "
                "would silently stand still. Nothing was changed. Step inside the pipe: "
                "pipe.step(lambda: (opt.step(), opt.zero_grad())) after "
                "pipe.forward_backward(...), with the optimizer built over "
                "pipe.optim_parameters()")


def watch_outside_steps(state: ModelState) -> None:
    """From now until :func:`unwatch_outside_steps`, refuse an optimizer over ``state``'s
    masters that steps outside ``pipe.step`` (called for pipes with masters)."""
    _ensure_hook()
    _open_with_masters.add(state)


def unwatch_outside_steps(state: ModelState) -> None:
    _open_with_masters.discard(state)


def _ensure_hook() -> None:
    global _hook
    with _hook_lock:
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_pre_hook)


@contextlib.contextmanager
def watching(state: ModelState, on_pass: Callable[[], None] = lambda: None
             ) -> Iterator[StepWatch]:
    """Check every optimizer that steps on this thread inside the block; ``on_pass``:
    called when one over the pipe's tensors passed."""
    _ensure_hook()
    previous = getattr(_local, "watch", None)
    watch = StepWatch(state, on_pass)
    _local.watch = watch
    try:
        yield watch
        watch.finish()
    finally:
        _local.watch = previous


def has_user_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step hooks other than roundpipe's own check run around ``optimizer.step()``
    (its own, or global ones): a step that bypasses ``step()`` would skip them."""
    from torch.optim import optimizer as torch_optimizer
    globals_ = [h for h in (*torch_optimizer._global_optimizer_pre_hooks.values(),
                            *torch_optimizer._global_optimizer_post_hooks.values())
                if h is not _pre_hook]
    return bool(globals_ or optimizer._optimizer_step_pre_hooks
                or optimizer._optimizer_step_post_hooks)
