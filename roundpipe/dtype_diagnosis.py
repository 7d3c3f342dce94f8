"""Naming an input's dtype as the cause of a failed call.

A model given inputs of another dtype than its parameters usually fails deep inside
(``mat1 and mat2 must have the same dtype``), in the tracer's or a stage's words.  Many
models cast their inputs themselves, so a dtype difference alone is no error: only a
failure that mentions a dtype is turned into an :class:`~roundpipe.InputError` naming the
input and the cast to make.  A call whose inputs the model cannot run at all (a wrong
shape) is one ``InputError`` too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree

from .errors import InputError, RoundPipeError, StageError, TraceError
from .passes.trace import describe_tensors
from .runtime.microbatch import input_path


def dtype_mismatch(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> str | None:
    """Describe floating inputs whose dtype no floating parameter has, if any."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes:
        return None
    wanted = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and \
                leaf.dtype not in dtypes:
            got = str(leaf.dtype).replace("torch.", "")
            return (f"{input_path(path)} is {got} but the model's parameters are "
                    f"{wanted}: cast the input (x.to(torch.{wanted.split(', ')[0]})) or run "
                    f"the call under torch.autocast")
    return None


@contextlib.contextmanager
def diagnose_dtypes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    call: bool = True) -> Iterator[None]:
    """Turn a failure caused by inputs of another dtype than the model into a clear
    InputError.  Only on failure: many models cast their inputs themselves.  A call
    whose inputs the model cannot run (a wrong shape) is one InputError too."""
    try:
        yield
    except TraceError as e:
        cause = getattr(e, "example_cause", None)
        if call and cause is not None and dtype_mismatch(model, args, kwargs) is None:
            error = InputError(
                f"{type(model).__name__} cannot run this call's inputs "
                f"({describe_tensors(args, kwargs)}): {cause}")
            error.original = e  # type: ignore[attr-defined]
            raise error from None
        _raise_if_dtype_error(model, e, args, kwargs)
        raise
    except StageError as e:
        _raise_if_dtype_error(model, e, args, kwargs)
        raise


def _raise_if_dtype_error(model: torch.nn.Module, e: RoundPipeError, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> None:
    """Raise the InputError that says ``e`` came from an input's dtype, if it did."""
    hint = dtype_mismatch(model, args, kwargs)
    if hint is None or not _mentions_dtype(e):
        return
    # Raised from here, not chained: the cause is one line of the message (and
    # ``error.original`` for whoever wants the whole story).
    error = InputError(f"{hint}; the call failed with: {_root_line(e)}")
    error.original = e  # type: ignore[attr-defined]
    raise error from None


def _mentions_dtype(e: BaseException) -> bool:
    while e is not None:
        text = str(e).lower()
        if "dtype" in text or "scalar type" in text:
            return True
        e = e.__cause__  # type: ignore[assignment]
    return False


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _root_line(e: BaseException) -> str:
    """The first line of the innermost error that mentions a dtype (the op's own words,
    not the tracer's summary of them)."""
    found = e
    while e is not None:
        if "dtype" in str(e).lower() or "scalar type" in str(e).lower():
            found = e
        e = e.__cause__  # type: ignore[assignment]
    return f"{type(found).__name__}: {_first_line(found)}"
