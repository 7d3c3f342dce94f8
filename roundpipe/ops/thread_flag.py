"""A value that holds on one thread for the length of a block (``with flag.set(v):``)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


class ThreadFlag:
    """Per-thread value, ``default`` outside any ``set`` block; blocks nest."""

    def __init__(self, default: Any = False) -> None:
        self._local = threading.local()
        self._default = default

    def get(self) -> Any:
        return getattr(self._local, "value", self._default)

    @contextlib.contextmanager
    def set(self, value: Any = True) -> Iterator[None]:
        previous = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous
