"""Command line: ``python -m roundpipe plan MODULE:FACTORY [options]``.

Prints the stage plan of a model built by ``FACTORY()`` from ``MODULE`` (an importable
module or a path to a ``.py`` file).  The factory returns a model, ``(model, args)`` or
``(model, args, kwargs)``; otherwise pass ``--example`` with a Python expression for the
example input(s) (``torch`` is in scope), e.g. ``--example "torch.randint(0, 100, (8, 64))"``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from typing import Any, Sequence


class UsageError(Exception):
    """A mistake in the command line or what it names: printed as one line, exit 2."""


def _load_factory(spec: str) -> Any:
    if ":" not in spec:
        raise UsageError(f"expected MODULE:FACTORY, got {spec!r}")
    module_name, attr = spec.rsplit(":", 1)
    if module_name.endswith(".py") or os.path.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise UsageError(f"no such file: {path}")
        sys.path.insert(0, os.path.dirname(path))
        loader_spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(path))[0], path)
        if loader_spec is None or loader_spec.loader is None:
            raise UsageError(f"cannot load {path}")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise UsageError(f"cannot import {module_name!r} ({e}); give an importable "
                             "module or a path to a .py file") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"{module_name} has no attribute {attr!r}") from None


def _plan(args: argparse.Namespace) -> int:
    import torch  # here, not above: --help answers without it

    import roundpipe

    built = _load_factory(args.factory)()
    example_args: Any = ()
    example_kwargs: dict[str, Any] = {}
    if isinstance(built, tuple):
        model, *rest = built
        if rest:
            example_args = rest[0]
        if len(rest) > 1:
            example_kwargs = rest[1]
    else:
        model = built
    if args.example is not None:
        example_args = eval(args.example, {"torch": torch})  # noqa: S307 - user's own input
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    if not example_args and not example_kwargs:
        raise UsageError("no example input: return (model, args) from the factory or pass "
                         "--example")
    devices = ["cpu"] * args.devices if args.devices else None
    config = roundpipe.RoundPipeRunConfig(num_microbatch=args.num_microbatch,
                                          recompute_grain=args.recompute_grain)
    pipe = roundpipe.compile(model, example_args, example_kwargs, devices=devices,
                             model_run_config=config, memory_cap=args.memory_cap,
                             num_stages=args.num_stages)
    if args.json:
        print(json.dumps(pipe.plan.to_dict(), indent=2))
    else:
        print(pipe.plan)
        for note in pipe.plan.notes:
            print(f"note: {note}")
        if args.code is not None:
            print(pipe.plan.stage_code(args.code))
    pipe.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roundpipe",
                                     description="roundpipe command line")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the stage plan of a model",
                          description=__doc__.split("\n\n", 1)[1])
    plan.add_argument("factory", help="MODULE:FACTORY or path/to/file.py:FACTORY")
    plan.add_argument("--example", help="Python expression for the example input(s)")
    plan.add_argument("--devices", type=int, default=None,
                      help="plan for this many devices (virtual CPU devices)")
    plan.add_argument("--num-microbatch", type=int, default=None,
                      help="microbatches per batch (default: devices + 1)")
    plan.add_argument("--recompute-grain", choices=["stage", "layer"], default=None,
                      help="recompute per stage or per layer (default: stage)")
    plan.add_argument("--memory-cap", default=None,
                      help="device memory cap for a job and the next job's prefetched weights, e.g. 512MiB (default: none)")
    plan.add_argument("--num-stages", type=int, default=None,
                      help="exact number of stages (default: devices + 1, more to fit the "
                      "cap)")
    plan.add_argument("--code", type=int, default=None, metavar="STAGE",
                      help="also print the generated code of this stage")
    plan.add_argument("--json", action="store_true", help="print plan.to_dict() as JSON")
    plan.add_argument("-v", "--verbose", action="store_true")
    plan.add_argument("--debug", action="store_true",
                      help="show the full traceback of an error")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    from roundpipe.errors import RoundPipeError
    try:
        return _plan(args)
    except (UsageError, RoundPipeError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        print("(run with --debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
