"""Grad-mode and autocast regions of a traced model, entered and left by generated code.

``torch.export`` wraps ``with torch.no_grad()`` / ``torch.set_grad_enabled`` /
``torch.autocast`` blocks of a model into sub-graphs; the trace pass inlines them and marks
each node with the regions it ran in (:mod:`roundpipe.passes.mode_regions`).  A unit
program then enters the regions its nodes need and leaves them before it returns, so a
region never spans two units (the modes are per thread, and units of one region may run on
different devices' threads).  Each ``enter_*`` returns what its ``exit_*`` restores.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def enter_grad_mode(enabled: bool) -> bool:
    """Set grad mode; returns the mode to restore."""
    previous = torch.is_grad_enabled()
    torch._C._set_grad_enabled(enabled)
    return previous


def exit_grad_mode(previous: bool) -> None:
    torch._C._set_grad_enabled(previous)


def enter_autocast(device: str | torch.device, dtype: torch.dtype | None, enabled: bool,
                   cache_enabled: bool | None) -> Any:
    """Enter ``torch.autocast`` for ``device``'s type (a device, when the model named the
    device it was traced on: the region then follows the program to the device it runs
    on); returns the context to leave."""
    device_type = device.type if isinstance(device, torch.device) else device
    return torch.amp.autocast_mode._enter_autocast(device_type, dtype, enabled,
                                                   cache_enabled)


def exit_autocast(context: Any) -> None:
    torch.amp.autocast_mode._exit_autocast(context)


ENTERS = frozenset({enter_grad_mode, enter_autocast})


def uses_regions(module: torch.nn.Module) -> bool:
    """Whether a unit program enters grad-mode or autocast regions."""
    graph = getattr(module, "graph", None)
    return graph is not None and any(n.op == "call_function" and n.target in ENTERS
                                     for n in graph.nodes)


@contextlib.contextmanager
def left_on_error(device_types: tuple[str, ...]) -> Iterator[None]:
    """Restore grad mode and autocast if a program fails inside one of its regions (its
    exit calls never ran, and the modes are the worker thread's for its next jobs)."""
    grad = torch.is_grad_enabled()
    cache = torch.is_autocast_cache_enabled()
    saved = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
             for d in device_types]
    try:
        yield
    except BaseException:
        torch._C._set_grad_enabled(grad)
        for device_type, enabled, dtype in saved:
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_cache_enabled(cache)
        raise
