"""Where parameter gradients land on the host, shared by every program of one model.

Downloads go into host buffers reused across calls (pinned on CUDA, where allocating
pinned memory is slow), keyed by (unit, slot).  Committing them used to be the caller's
work after the call: converting each gradient to its master's dtype (bf16 -> fp32) took
longer than the optimizer step on a 1B model, with the GPUs idle.  With ``convert=True``
a conversion thread copies each gradient into a fresh tensor of the master's dtype as soon
as its download has landed, while the backward goes on; the commit then only assigns (or,
when gradients accumulate across calls, adds) tensors the call owns.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch


class GradLanding:
    """``steps``: the optimizer steps still pending when a call starts.  A conversion
    waits for them: a step reads the previous gradients, which ``zero_grad`` then frees,
    so the host never holds two sets of full-precision gradients because of the overlap."""

    def __init__(self, convert: bool = True,
                 steps: Callable[[], list[Future]] | None = None) -> None:
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}
        self.steps = steps if steps is not None else list
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="roundpipe-grads")
                      if convert else None)
        self._lock = threading.Lock()

    @property
    def converts(self) -> bool:
        return self._pool is not None

    def convert_after(self, landed: Future, host: torch.Tensor, dtype: torch.dtype,
                      steps: Sequence[Future] = (),
                      wanted: Callable[[], bool] = lambda: True) -> Future:
        """A future of ``host`` copied to ``dtype``, started once ``landed`` completes (it
        fails with ``landed``'s error, and the copy is never made then) and ``steps``
        have finished (failed or not: the call reports a failed step itself).  It is
        None when ``wanted()`` says no at that point (the master already has a gradient
        to add to: a full copy would only double the memory the commit needs)."""
        if self._pool is None:
            raise RuntimeError("internal: this GradLanding does not convert")
        result: Future = Future()

        def copy() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                wait(steps)
                result.set_result(host.to(dtype, copy=True) if wanted() else None)
            except BaseException as e:  # noqa: BLE001 - reaches the call through the future
                result.set_exception(e)

        def start(f: Future) -> None:
            error = f.exception() if not f.cancelled() else RuntimeError("download cancelled")
            if error is not None:
                result.set_exception(error)
                return
            with self._lock:
                if self._pool is None:  # closed meanwhile
                    result.set_exception(RuntimeError("roundpipe was closed"))
                    return
                self._pool.submit(copy)

        landed.add_done_callback(start)
        return result

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
