"""A step that consumes a call's gradients unit by unit as they land
(``pipe.forward_backward(..., step=opt)``).

The backward runs from the last unit to the first; once the last microbatch's backward
has passed unit ``k`` and its gradients have landed on the host (the executor's
``on_grads``), the optimizer thread updates unit ``k``'s masters from those download
buffers, publishes its weights (opening its fences at the step's version) and gives the
buffers back to the landing pool, where a later unit's download reuses them.  So the
gradients held at any time are a window of units, not the whole model, and no
full-model ``.grad`` is ever made.

Order and exactness: units are updated in descending order (the order their gradients
become final), each by the optimizer's own elementwise kernels, so every master, moment
and weight is bitwise what ``forward_backward`` followed by ``pipe.step(opt)`` makes.
Nothing is updated before the fused job has every loss and has checked them (a later
microbatch's loss could still fail the call); once a unit was updated, a failure leaves
the pipe refusing calls until state is loaded (``ModelState.mixed``), as a per-unit step
that fails part-way does.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import StepError
from .grad_landing import GradLanding
from .masters import UnitSchedule

#: units whose gradients may be downloaded and not yet consumed by their update
WINDOW = 2


class LandingStep:
    """The link between one training call's backward and its step.

    ``units``: per program unit, ``(slot -> master name)`` of its trainable parameters;
    ``publish``: per program unit, every parameter name its fences cover;
    ``outside(names)``: the gradients autograd left on those model parameters during the
    call (a use outside the pipe), taken off them; ``loss_only``: slot -> master name of
    the parameters no unit reads, whose gradients (from ``loss_fn``) the call hands to
    :meth:`on_grads` as those of unit ``len(units)``."""

    def __init__(self, optimizer: Any, groups: list[dict[str, Any]],
                 masters: dict[str, torch.Tensor], units: Sequence[dict[str, str]],
                 publish: Sequence[tuple[str, ...]], landing: GradLanding,
                 outside: Callable[[Iterable[str]], dict[str, torch.Tensor]] = dict,
                 loss_only: dict[str, str] | None = None) -> None:
        self.outside = outside
        self.loss_only = dict(loss_only or {})
        self.optimizer = optimizer
        self.groups = groups
        self.masters = masters
        self.units = list(units)
        self.publish = list(publish)
        # masters no unit reads (a parameter only loss_fn reads, one the forward skips):
        # stepped last, once the call ended, with what outside uses left on them
        read = {n for u in self.units for n in u.values()}
        self.rest = tuple(n for n in masters if n not in read)
        self.landing = landing
        self._cond = threading.Condition()
        self._grads: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
        self._final: set[int] = set()
        self._gate = False   # every loss is in and finite
        self._ended: bool | None = None  # the call returned (True) or raised (False)
        self.updated = 0     # units whose update ran
        self.future: Future | None = None  # the step on the optimizer thread
        # The window: a unit's gradients are downloaded (admit) only while fewer than
        # WINDOW admitted units wait for their update, or when it is the unit the
        # update waits for; so the buffers in use are a few units whatever the timing.
        self._admitted: set[int] = set()
        self._consumed: set[int] = set()
        self._next = len(units) - 1  # the unit the update waits for
        self._stopped = False        # the update ended (done or failed)

    # --- the call's side (device threads, download waiters) ---------------------------------
    def on_grads(self, start: int, stop: int,
                 staged: list[tuple[str, int, torch.Tensor]]) -> None:
        with self._cond:
            for slot, uid, t in staged:
                self._grads.setdefault(uid, []).append((slot, uid, t))
            self._final.update(range(start, stop))
            self._cond.notify_all()

    def admit(self, k: int, abort: threading.Event) -> None:
        """Before unit ``k``'s gradients are downloaded (on its device's thread): wait
        while the window is full and ``k`` is not the unit the update needs next.  Polls
        ``abort`` (a failed job), so a failure elsewhere never leaves it waiting."""
        with self._cond:
            while (len(self._admitted - self._consumed) >= WINDOW and k < self._next
                   and not self._stopped and self._ended is None
                   and not abort.is_set()):
                self._cond.wait(0.05)
            self._admitted.add(k)

    def on_losses(self) -> None:
        with self._cond:
            self._gate = True
            self._cond.notify_all()

    def end(self, ok: bool) -> None:
        with self._cond:
            if self._ended is None:  # the first word stands
                self._ended = ok
            self._cond.notify_all()

    def _ready(self, k: int) -> bool:
        """Wait until unit ``k``'s gradients are final (True) or the call failed (False)."""
        with self._cond:
            while True:
                if self._ended is not None:
                    return self._ended
                if self._gate and k in self._final:
                    return True
                self._cond.wait()

    # --- the optimizer thread's side ----------------------------------------------------------
    def order(self) -> list[tuple[str, ...]]:
        """Master names per step unit, in the order they are updated (descending
        program units)."""
        return [tuple(dict.fromkeys(self.units[k].values()))
                for k in reversed(range(len(self.units)))] + ([self.rest] if self.rest else [])

    def publish_order(self) -> list[tuple[str, ...]]:
        """The parameter names published after each entry of :meth:`order`."""
        return [self.publish[k] for k in reversed(range(len(self.units)))] + (
            [self.rest] if self.rest else [])

    def run(self, schedule: UnitSchedule,
            stage: Callable[[list[tuple[torch.Tensor, str]]], None] | None) -> bool:
        """Update every unit as its gradients land; False if the call failed first
        (``schedule.started`` says whether some unit was updated)."""
        try:
            return self._run(schedule, stage)
        finally:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def _run(self, schedule: UnitSchedule,
             stage: Callable[[list[tuple[torch.Tensor, str]]], None] | None) -> bool:
        n = len(self.units)
        for i, k in enumerate(reversed(range(n))):
            with self._cond:
                self._next = k
                self._cond.notify_all()
            if not self._ready(k):
                return False
            with self._cond:
                staged = self._grads.pop(k, [])
            grads = {id(self.masters[self.units[k][slot]]): t for slot, _, t in staged
                     if slot in self.units[k]}
            # (loss_fn's part of a parameter this unit reads is in the unit's gradient.)
            # A use outside the pipe left a gradient on the parameter: pipe.step adds it
            # to the master's gradient (ModelState.fold_outside_grads), and so here.
            for name, extra in self.outside(self.units[k].values()).items():
                master = self.masters[name]
                add = extra.to(master.dtype)
                held = grads.get(id(master))
                grads[id(master)] = add if held is None else held.to(master.dtype) + add
            schedule.before_unit(i)
            if grads:
                self.optimizer.step_landed(self.groups, grads, stage)
            schedule.after_unit(i)
            self.updated += 1
            # the gradients are consumed: a later unit's download reuses their buffers
            self.landing.recycle([(uid, slot) for slot, uid, _ in staged])
            with self._cond:
                self._consumed.add(k)
                self._cond.notify_all()
        # What no unit reads gets its gradient (if any) from loss_fn (handed over as unit
        # n's, summed over the microbatches in the parameter's dtype, as the plain
        # commit sums it) and from outside uses, final once the call ended; a gradient
        # reaching a unit's parameter from outside after its update could no longer be
        # added (none should: a call whose inputs' graph reaches a parameter of the
        # pipe's model steps in the plain order), so it fails the step rather than vanish.
        with self._cond:
            while self._ended is None:
                self._cond.wait()
            held = self._grads.pop(n, [])
        if self.rest:
            grads = {}
            for slot, _, t in held if self._ended else ():
                master = self.masters[self.loss_only[slot]]
                grads[id(master)] = t.to(master.dtype)
            for name, t in (self.outside(self.rest) if self._ended else {}).items():
                master = self.masters[name]
                add = t.to(master.dtype)
                held_grad = grads.get(id(master))
                grads[id(master)] = add if held_grad is None else held_grad + add
            schedule.before_unit(n)
            if grads:
                self.optimizer.step_landed(self.groups, grads, stage)
            schedule.after_unit(n)
        late = self.outside(self.masters) if self._ended else {}
        if late:
            raise StepError(
                f"parameter {next(iter(late))!r} got a gradient from outside the pipe "
                "after its unit was updated: forward_backward(step=...) cannot add it to "
                "this step. Use forward_backward(...) then pipe.step(opt)")
        return True
