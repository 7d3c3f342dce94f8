"""The optimizer thread: runs ``step_fn`` on the CPU, overlapping the next call.

Order of work for one ``step(fn)`` on the optimizer thread:

1. publish the masters into the model weights (the result of the *previous* step), unit by
   unit, opening each unit's fence;
2. run ``fn`` (the user's optimizer step, on the masters).

So with ``is_async=True`` the call that follows ``step(i)`` uses the weights from before
step ``i``: one step old, as in the seeds' reference system.  With ``predict=True`` the
publish writes the prediction ``W_{i-1} + (W_{i-1} - W_{i-2})`` of step ``i``'s result
instead (``ModelState.publish``), the masters staying exact.  ``synchronize()`` waits and
publishes, making the weights current; ``is_async=False`` is ``step`` + ``synchronize``.
Without separate masters (``optim_dtype=None``) ``fn`` writes the model weights directly,
so the fences stay closed until ``fn`` returns and the next call waits for it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ..errors import OptimizerError, StepError
from .host_state import ModelState
from .masters import UnitSchedule
from .optimizer_check import MisbuiltOptimizerError, watching

log = logging.getLogger(__name__)


class _Verdict:
    """Whether a step's optimizers passed the checks of optimizer_check.py: set once an
    optimizer over the pipe's tensors is about to step, or when the step ends."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.misbuilt = False


class _CallFailed(Exception):
    """The call whose gradients a landing step consumes failed."""


class _Unchanged(Exception):
    """A step that failed before writing anything (its message says so)."""


class _MixedStep(Exception):
    """A step that failed after publishing some units (its message says so)."""


def _mark_mixed(host: ModelState, version: int, why: str) -> _MixedStep:
    """A step failed after some unit was updated and published: every later call and
    step refuses (``host.mixed``) and the step's fences fail, until state is loaded."""
    log.error("roundpipe: %s", why)
    host.mixed = why
    host.fences.fail(version, why)
    return _MixedStep(why)


class OptimizerWorker:
    """Runs optimizer steps on a dedicated CPU thread, one at a time, in order."""

    def __init__(self, host: ModelState) -> None:
        self.host = host
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roundpipe-optim")
        self._pending: list[Future] = []  # steps not yet waited for, in order
        self._local = threading.local()  # on the optimizer thread: the running step
        # Until a step has run whole, pipe.step waits for its step: an optimizer that
        # cannot update the pipe (optimizer_check.py) fails the first pipe.step itself.
        self._checked = False
        # Steps that consume a call's gradients as they land (step_landing).
        self._landing: weakref.WeakSet = weakref.WeakSet()

    @property
    def on_worker(self) -> bool:
        """Whether the calling thread is the optimizer thread (inside ``step_fn``)."""
        return getattr(self._local, "inside", False)

    @property
    def current_version(self) -> int | None:
        """The fence version of the step running on this thread (None elsewhere)."""
        return getattr(self._local, "version", None)

    def step(self, fn: Callable[[], Any], is_async: bool = True,
             on_enqueue: Callable[[int], None] | None = None, predict: bool = False,
             record: bool = False) -> None:
        """Enqueue ``fn``; ``on_enqueue(version)`` runs once the step is sure to be
        enqueued and before it can start (GradScaler keys its scale by the version).
        ``predict`` (asynchronous steps): the overlapping call computes with predicted
        weights; ``record``: keep this step's starting masters for a prediction by the
        next step (see ``ModelState.publish``)."""
        if not callable(fn):
            raise StepError(f"step_fn must be callable, got {type(fn).__name__}")
        version = self._schedule(on_enqueue)
        checked = _Verdict()
        publish = {"predict": predict and is_async, "record": record}
        self._pending.append(self._executor.submit(self._run, fn, version, checked,
                                                   publish))
        if not is_async:
            self.synchronize()
        elif not self._checked:
            # Until one step has passed, wait for this one's verdict (its first optimizer
            # over the pipe's tensors about to step, or its end), not for the whole step.
            checked.event.wait()
            if checked.misbuilt:
                self.wait()  # raises it; other failures are reported as before, later

    def _run(self, fn: Callable[[], Any], version: int, checked: _Verdict | None = None,
             publish: dict[str, bool] | None = None) -> None:
        host = self.host
        checked = checked or _Verdict()
        if host.has_masters:
            try:  # the user's writes to the model's weights since the last publish
                host.adopt_edits()
            except StepError as e:
                checked.event.set()
                raise _Unchanged(str(e)) from None
            # a backward outside any pipe(x) call left gradients on the model's parameters
            host.fold_outside_grads(host.outside_grads())
            host.publish(version, at_step=True, **(publish or {}))
        self._local.inside, self._local.version = True, version
        versions = host.master_versions() if host.has_masters else None
        try:
            if host.offload is not None:
                host.offload_begin()
            with watching(host, on_pass=lambda: self._passed(checked)):
                fn()
            if host.offload is not None:  # the step's files are whole: commit them
                host.offload_finish(version)
            self._passed(checked)
        except BaseException as e:
            checked.misbuilt = isinstance(e, MisbuiltOptimizerError)
            if host.has_masters:
                # Make the masters what they were when the step started, so no
                # half-applied update survives.
                host.restore_masters(versions)
            elif host.offload is not None:
                # The disk tier without masters: the files stay at the last whole step;
                # weights updated in place before the failure no longer match them.
                host.fail_unmastered_step(e)
            raise
        finally:
            self._local.inside, self._local.version = False, None
            if not host.has_masters:
                host.fences.publish_all(version)
            checked.event.set()
        host.mark_dirty()

    def _schedule(self, on_enqueue: Callable[[int], None] | None) -> int:
        """The fence version of a step about to be enqueued (after the checks every
        step makes); ``on_enqueue(version)`` runs before it can start."""
        if self.on_worker:
            raise StepError("pipe.step() was called from inside a step_fn; call it from "
                            "the training loop")
        self.raise_if_failed()
        version = self.host.fences.schedule()
        if on_enqueue is not None:
            on_enqueue(version)
        return version

    def step_by_unit(self, optimizer: Any, groups: list[dict[str, Any]],
                     on_enqueue: Callable[[int], None] | None = None) -> None:
        """An exact step the next call overlaps: ``optimizer.step_frozen(groups)`` (then
        ``zero_grad()``) walks the masters unit by unit, each unit published as soon as
        it is updated (``ModelState.publishing_schedule``), so the next call's uploads
        wait only for their own units.  Returns once the step is prepared (gradients
        found, state allocated: what can fail has run), so a failing step raises here
        and changes nothing.  The caller made sure no older step is pending or
        unpublished."""
        version = self._schedule(on_enqueue)
        prepared, ready = threading.Event(), []

        def on_prepared() -> None:
            ready.append(True)
            prepared.set()

        self._pending.append(self._executor.submit(
            self._run_by_unit, optimizer, groups, version, prepared, on_prepared))
        prepared.wait()
        if not ready:  # it failed while preparing: nothing was written
            self.wait()

    def _run_by_unit(self, optimizer: Any, groups: list[dict[str, Any]], version: int,
                     prepared: threading.Event, on_prepared: Callable[[], None]) -> None:
        host = self.host
        try:  # (nothing is unpublished here: an edit is adopted, never refused)
            host.adopt_edits()
        except BaseException:
            host.fences.publish_all(version)
            prepared.set()
            raise
        host.fold_outside_grads(host.outside_grads())
        schedule = host.publishing_schedule(version)
        if host.offload is not None:  # stage each unit around its update and publish
            schedule = host.offload_begin(schedule)
        host.landed.unit_schedule = schedule
        self._local.inside, self._local.version = True, version
        try:
            optimizer.step_frozen(groups, on_prepared=on_prepared)
            optimizer.zero_grad(groups=groups)  # the groups it stepped, not later ones
            if host.offload is not None:
                host.offload_finish(version)
            self._checked = True
        except BaseException as e:
            if host.offload is not None:  # the files stay at the last whole step
                host.offload_rollback()
            if not schedule.started:  # nothing was written: the weights are this version's
                host.fences.publish_all(version)
                raise
            # Not expected (what can fail ran before the first unit): units before
            # schedule.finished were published with the new weights, the others not;
            # every later call and step refuses until state is loaded.
            why = (f"an exact step failed part-way ({type(e).__name__}: {e}) after "
                   f"{schedule.finished} of {len(schedule.units)} units were updated and "
                   "published (a later unit may be updated but not published): the "
                   "masters, the optimizer state and the weights mix two steps. Load a "
                   "checkpoint (load_checkpoint, or pipe.load_state_dict and the "
                   "optimizer's) to go on")
            raise _mark_mixed(host, version, why) from e
        finally:
            host.landed.unit_schedule = None
            self._local.inside, self._local.version = False, None
            prepared.set()
        host.fences.publish_all(version)

    def step_landing(self, step: Any, on_enqueue: Callable[[int], None] | None = None
                     ) -> int:
        """Enqueue a step that consumes the coming call's gradients as they land
        (``runtime/landing_step.py``); returns its fence version.  The caller made sure
        no older step is pending or unpublished, and tells ``step`` how the call ended."""
        version = self._schedule(on_enqueue)
        future = step.future = self._executor.submit(self._run_landing, step, version)
        self._landing.add(future)
        self._pending.append(future)
        return version

    def _run_landing(self, step: Any, version: int) -> None:
        host = self.host
        try:  # (nothing is unpublished here: an edit is adopted, never refused)
            host.adopt_edits()
        except BaseException:
            host.fences.publish_all(version)
            raise
        schedule = host.publishing_schedule(version, groups=step.publish_order())
        # the update order's master names (publishing_schedule keeps those with a master)
        schedule = UnitSchedule(host.landed, step.order(), after_unit=schedule._after)
        if host.offload is not None:  # stage each unit around its update and publish
            schedule = host.offload_begin(schedule)
        host.landed.unit_schedule = schedule
        self._local.inside, self._local.version = True, version
        try:
            if not step.run(schedule, host.stage_new_state):
                raise _CallFailed()
            step.optimizer.zero_grad(groups=step.groups)
            if host.offload is not None:
                host.offload_finish(version)
            self._checked = True
        except BaseException as e:
            if host.offload is not None:  # the files stay at the last whole step
                host.offload_rollback()
            if not schedule.started:  # nothing was written: the weights are this version's
                host.fences.publish_all(version)
                if isinstance(e, _CallFailed):
                    return  # the call reports its own error
                raise _Unchanged(
                    f"a step taken as gradients landed (forward_backward(step=...)) failed "
                    f"before it updated anything ({type(e).__name__}: {e}): the weights, "
                    "masters and optimizer state are unchanged and this call's gradients "
                    "were dropped; run the call again") from e
            cause = ("the call failed" if isinstance(e, _CallFailed)
                     else f"{type(e).__name__}: {e}")
            why = (f"a step taken as gradients landed (forward_backward(step=...)) failed "
                   f"part-way ({cause}) after {step.updated} of {len(step.units)} units "
                   "were updated and published: the masters, the optimizer state and the "
                   "weights mix two steps. Load a checkpoint (load_checkpoint, or "
                   "pipe.load_state_dict and the optimizer's) to go on")
            raise _mark_mixed(host, version, why) from e
        finally:
            host.landed.unit_schedule = None
            self._local.inside, self._local.version = False, None
        host.fences.publish_all(version)

    def _passed(self, checked: _Verdict) -> None:
        self._checked = True
        checked.event.set()

    def wait(self) -> None:
        """Wait for every pending step; raise :class:`StepError` for the first that failed.

        A no-op on the optimizer thread itself (a ``step_fn`` that calls the pipe)."""
        if self.on_worker:
            return
        while self._pending:
            pending = self._pending[0]
            try:
                pending.result()
            except BaseException as e:  # noqa: BLE001 - re-raised as StepError
                if not (pending.done() and pending.exception() is e):
                    raise  # the caller was interrupted while waiting; the step goes on
                self._pending.pop(0)
                if isinstance(e, (_MixedStep, _Unchanged)):
                    raise StepError(str(e)) from e.__cause__
                unchanged = ("The model weights are unchanged since the last successful "
                             "step" + (" and the masters were reset to them"
                                       if self.host.has_masters else
                                       " unless step_fn itself wrote them (use optim_dtype "
                                       "to keep separate masters)"))
                if isinstance(e, MisbuiltOptimizerError):  # the optimizer, not step_fn
                    raise OptimizerError(f"{e}. {unchanged}") from None
                raise StepError(
                    f"step_fn raised {type(e).__name__}: {e}. {unchanged}; fix step_fn "
                    "and call step() again") from e
            self._pending.pop(0)

    def pending_steps(self) -> list[Future]:
        """The steps enqueued and not yet waited for (none inside a ``step_fn``, which
        must not wait for itself)."""
        # (not a step consuming the running call's gradients: it waits for the call)
        return [] if self.on_worker else [p for p in self._pending
                                          if p not in self._landing]

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the optimizer thread, after any pending step, and wait for it.

        Used for commits and publishes: an interrupt of the waiting caller cannot stop
        them halfway, so they happen whole or not at all.
        """
        if self.on_worker:
            return fn()
        return self._executor.submit(fn).result()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` on the optimizer thread without waiting: steps enqueued later run
        after it (an asynchronous checkpoint holds them while it reads the masters)."""
        return self._executor.submit(fn)

    def raise_if_failed(self) -> None:
        if self.host.mixed is not None:
            if not self.on_worker:  # the failed step is reported here, once and for all
                self._pending = [p for p in self._pending
                                 if not isinstance(p.exception(), _MixedStep)]
            raise StepError(self.host.mixed)
        if any(p.done() for p in self._pending):
            done = [p for p in self._pending if p.done()]
            if any(p.exception() is not None for p in done):
                self.wait()
            else:
                self._pending = [p for p in self._pending if not p.done()]

    def synchronize(self) -> None:
        """Wait for the pending steps and publish, so the model weights are current."""
        self.wait()
        if self.host.mixed is not None:  # publishing would hand the mix to every call
            raise StepError(self.host.mixed)
        if self.host.has_masters and not self.on_worker:
            def publish() -> None:
                self.host.adopt_edits()  # the user's writes since the last publish stand
                self.publish_now()
            self.run(publish)

    def publish_now(self) -> None:
        """Raise the fences' target and publish the masters (on the optimizer thread)."""
        self.host.publish(self.host.fences.schedule())

    def close(self) -> None:
        self._executor.shutdown(wait=True)
