"""Which pipe the code running on this thread belongs to: a ``loss_fn`` or ``step_fn``
that a pipe is running, else the pipe this thread called last.  A
:class:`~roundpipe.GradScaler` made without its pipe (``GradScaler(8192.0)``, as
``torch.amp``'s is made) finds it here when it is first used."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

from .ops.thread_flag import ThreadFlag

_local = threading.local()
_running = ThreadFlag(None)


@contextlib.contextmanager
def running(pipe: Any) -> Iterator[None]:
    """Code in this block runs for ``pipe`` (its ``loss_fn`` or ``step_fn``)."""
    with _running.set(pipe):
        yield


def called(pipe: Any) -> None:
    """This thread has just called ``pipe``."""
    _local.last = weakref.ref(pipe)


def current_pipe() -> Any:
    pipe = _running.get()
    if pipe is not None:
        return pipe
    last = getattr(_local, "last", None)
    return last() if last is not None else None
