"""Keyed random streams: dropout masks that do not depend on which device ran them.

Generated programs call these in place of random ops.  The seed of every random op is
derived from (base seed, call number, microbatch, layer unit, op ordinal in the unit), so
the forward pass and its recompute draw the same mask, and 1 or 8 devices draw the same
masks.  No global generator is touched, except by :func:`seeded` (ops without a generator
argument), which forks and restores the device's default generator under a lock.
"""

from __future__ import annotations

import functools
import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class RngKey:
    """Identifies one microbatch of one call; units and ops are mixed in by the program."""

    seed: int
    call: int
    microbatch: int


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(key: RngKey, unit: int, ordinal: int) -> int:
    """A 63-bit seed for op ``ordinal`` of ``unit`` in the microbatch ``key`` names."""
    h = 0
    for part in (key.seed, key.call, key.microbatch, unit, ordinal):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def dropout(x: torch.Tensor, p: float, train: bool | None, key: RngKey | None, unit: int,
            ordinal: int) -> torch.Tensor:
    """``aten.dropout`` with a keyed mask."""
    if not train or p == 0.0:
        return x
    if key is None:
        return torch.nn.functional.dropout(x, p, True)
    if p >= 1.0:
        return x * 0.0
    mask = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mask.bernoulli_(1.0 - p, generator=_generator(x.device, derive_seed(key, unit, ordinal)))
    return x * mask * (1.0 / (1.0 - p))


def native_dropout(x: torch.Tensor, p: float, train: bool | None, key: RngKey | None,
                   unit: int, ordinal: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` with a keyed mask; returns ``(output, bool mask)``."""
    if not train or p == 0.0 or key is None:
        return torch.ops.aten.native_dropout.default(x, p, train)
    keep = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    keep.bernoulli_(1.0 - p, generator=_generator(x.device, derive_seed(key, unit, ordinal)))
    mask = keep.bool()
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


@functools.lru_cache(maxsize=None)
def uncompiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (one of the keyed ops above or :func:`seeded`) marked for torch.compile to
    run as it is, between the compiled pieces of a unit: its RngKey differs per
    microbatch, and Dynamo would guard on the key's fields and recompile every call.
    Made on demand, so importing roundpipe does not import Dynamo."""
    return torch.compiler.disable(fn, recursive=True)


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _device_lock(device: torch.device) -> threading.Lock:
    name = str(device)
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(name, threading.Lock())


def resolve_op(name: str) -> Callable[..., Any]:
    """``"aten.rand.default"`` -> ``torch.ops.aten.rand.default``; ``"modcall"`` -> the
    functional module call used by torch.fx programs; ``"py:torch.bernoulli"`` -> a
    Python-level callable by its qualified name (torch-level calls of Dynamo graphs)."""
    if name.startswith("py:"):
        return _python_callable(name[3:])
    if name == "modcall":
        from .modcall import call_module_functional
        return call_module_functional
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


@functools.lru_cache(maxsize=None)
def _python_callable(path: str) -> Callable[..., Any]:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"cannot resolve {path!r}")


def seeded(op: str, key: RngKey | None, unit: int, ordinal: int,
           device: torch.device, /, *args: Any, **kwargs: Any) -> Any:
    """Call random op ``op`` (see :func:`resolve_op`), which takes no generator argument,
    with the device's default generator seeded from the key and restored afterwards.

    The leading arguments are positional-only: the op's own keywords (a factory's
    ``device=``, ``dtype=``) pass through ``kwargs`` whatever their names.
    Virtual CPU devices share the CPU default generator, hence the lock.
    """
    fn = resolve_op(op)
    if key is None:
        return fn(*args, **kwargs)
    device = torch.device(device)
    seed = derive_seed(key, unit, ordinal)
    with _device_lock(device):
        if device.type == "cuda":
            with torch.random.fork_rng(devices=[device], device_type="cuda"):
                torch.cuda.default_generators[device.index or 0].manual_seed(seed)
                return fn(*args, **kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            return fn(*args, **kwargs)


KEYED_OPS = (dropout, native_dropout, seeded)
