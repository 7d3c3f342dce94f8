"""The optimizer thread: runs ``step_fn`` on the CPU, overlapping the next call.

Order of work for one ``step(fn)`` on the optimizer thread:

1. publish the masters into the model weights (the result of the *previous* step), unit by
   unit, opening each unit's fence;
2. run ``fn`` (the user's optimizer step, on the masters).

So with ``is_async=True`` the call that follows ``step(i)`` uses the weights from before
step ``i``: one step old, as in the seeds' reference system.  ``synchronize()`` waits and
publishes, making the weights current; ``is_async=False`` is ``step`` + ``synchronize``.
Without separate masters (``optim_dtype=None``) ``fn`` writes the model weights directly,
so the fences stay closed until ``fn`` returns and the next call waits for it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ..errors import StepError
from .host_state import ModelState

log = logging.getLogger(__name__)


class OptimizerWorker:
    """Runs optimizer steps on a dedicated CPU thread, one at a time, in order."""

    def __init__(self, host: ModelState) -> None:
        self.host = host
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roundpipe-optim")
        self._pending: Future | None = None

    def step(self, fn: Callable[[], Any], is_async: bool = True) -> None:
        if not callable(fn):
            raise StepError(f"step_fn must be callable, got {type(fn).__name__}")
        self.raise_if_failed()
        version = self.host.fences.schedule()
        self._pending = self._executor.submit(self._run, fn, version)
        if not is_async:
            self.synchronize()

    def _run(self, fn: Callable[[], Any], version: int) -> None:
        host = self.host
        if host.has_masters:
            host.publish(version)
        try:
            fn()
        except BaseException:
            if host.has_masters:
                # The model weights still hold the last published version; make the
                # masters agree so no half-applied update survives.
                host.reset_masters_to_weights()
            raise
        finally:
            if not host.has_masters:
                host.fences.publish_all(version)
        host.mark_dirty()

    def wait(self) -> None:
        """Wait for the pending step; raise :class:`StepError` if it failed."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as e:  # noqa: BLE001 - re-raised as StepError
            if not (pending.done() and pending.exception() is e):
                raise  # the caller was interrupted while waiting; the step goes on
            self._pending = None
            raise StepError(
                f"step_fn raised {type(e).__name__}: {e}. The model weights are unchanged "
                "since the last successful step"
                + (" and the masters were reset to them" if self.host.has_masters else
                   " unless step_fn itself wrote them (use optim_dtype to keep separate "
                   "masters)") + "; fix step_fn and call step() again"
            ) from e
        self._pending = None

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the optimizer thread, after any pending step, and wait for it.

        Used for the gradient commit: an interrupt of the waiting caller cannot stop it
        halfway, so gradients are committed whole or not at all.
        """
        return self._executor.submit(fn).result()

    def raise_if_failed(self) -> None:
        pending = self._pending
        if pending is not None and pending.done():
            self.wait()

    def synchronize(self) -> None:
        """Wait for the pending step and publish, so the model weights are current."""
        self.wait()
        if self.host.has_masters:
            version = self.host.fences.schedule()
            self.host.publish(version)

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
