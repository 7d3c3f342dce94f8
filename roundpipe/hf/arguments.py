"""What a Trainer on a pipe refuses, and ``pipe_options`` split into RoundPipe's
arguments and RoundPipeRunConfig's fields."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers

from ..api import RoundPipe
from ..config import RoundPipeRunConfig
from ..errors import UnknownConfigFieldError
from .errors import TrainerArgumentError, TrainerOptimizerError

# Trainer's built-in optimizers that take parameter groups and nothing else.
_PLAIN_OPTIMIZERS = frozenset({"adamw_torch", "adamw_torch_fused", "adafactor", "sgd",
                               "adagrad", "rmsprop"})


def unsupported(args: transformers.TrainingArguments | None, model_init: Any,
                 optimizers: Any, optimizer_cls_and_kwargs: Any,
                 num_microbatch: int | None, model: Any = None,
                 optim_dtype: torch.dtype | None = None) -> list[str]:
    """What in the Trainer's arguments cannot work on a pipe, each with its way out."""
    found = []
    if model_init is not None:
        found.append("model_init: the pipe is built around one model at construction; "
                     "pass model=")
    given = given_optimizer(optimizers, model, optim_dtype)
    if given is not None:
        found.append(given)
    if args is None:
        return found
    checks = [
        ("deepspeed", bool(args.deepspeed), "roundpipe keeps the model state on the host "
         "itself; drop it"),
        ("fsdp", bool(args.fsdp), "roundpipe keeps the model state on the host itself; "
         "drop it"),
        ("parallelism_config", args.parallelism_config is not None,
         "roundpipe places the model itself; drop it"),
        ("torch_compile", bool(args.torch_compile), "pass pipe_options=dict("
         "compile_units=True) to compile each layer's program"),
        ("fp16", bool(args.fp16), "use bf16=True (autocast, no loss scaling needed), or "
         "a loop of your own with roundpipe.GradScaler"),
        ("fp16_full_eval", bool(args.fp16_full_eval), "cast the model yourself"),
        ("bf16_full_eval", bool(args.bf16_full_eval), "cast the model yourself"),
        ("neftune_noise_alpha", args.neftune_noise_alpha is not None,
         "its hooks are added after the model is traced and would not run; drop it"),
        ("use_liger_kernel", bool(args.use_liger_kernel), "it patches the model after it "
         "is traced; drop it"),
        ("activation_offloading", bool(getattr(args, "activation_offloading", False)),
         "roundpipe keeps activations in check itself (backward stages recompute their "
         "forward, RoundPipeRunConfig.recompute_grain); drop it"),
        ("auto_find_batch_size", bool(args.auto_find_batch_size),
         "set per_device_train_batch_size and num_microbatch yourself"),
        ("debug", "underflow_overflow" in str(args.debug),
         "its hooks do not run inside traced stages; drop it"),
        ("world_size", args.world_size > 1, "one process drives every device of a pipe; "
         "launch one process (roundpipe's own data parallelism: docs/scaling.md)"),
        ("optim", optimizer_cls_and_kwargs is None and str(getattr(args.optim, "value",
                                                                   args.optim))
         not in _PLAIN_OPTIMIZERS,
         f"use one of {', '.join(sorted(_PLAIN_OPTIMIZERS))}, or pass "
         "optimizer_cls_and_kwargs=(cls, kwargs)"),
    ]
    for name, bad, way_out in checks:
        if bad:
            found.append(f"{name}={getattr(args, name, True)!r}: {way_out}")
    if num_microbatch is not None and args.per_device_train_batch_size < num_microbatch:
        found.append(f"per_device_train_batch_size={args.per_device_train_batch_size}: a "
                     f"batch is cut into num_microbatch={num_microbatch} microbatches of "
                     "at least one sample each; raise it or lower num_microbatch")
    return found


def given_optimizer(optimizers: Any, model: Any, optim_dtype: torch.dtype | None
                    ) -> str | None:
    """Why ``optimizers=(opt, scheduler)`` cannot train the pipe, or None.

    Without masters (``optim_dtype=None``) the model's trainable parameters are what the
    pipe's optimizer updates: an optimizer over them (and a scheduler on it) trains as
    one the trainer makes.  With masters, the optimizer must hold tensors that exist only
    once the trainer has built the pipe."""
    opt, sched = (tuple(optimizers or ()) + (None, None))[:2]
    if opt is None and sched is None:
        return None
    names = ({id(p): n for n, p in model.named_parameters() if p.requires_grad}
             if isinstance(model, torch.nn.Module) else {})
    way_out = ("pass optimizer_cls_and_kwargs=(cls, kwargs) (e.g. (roundpipe.optim.AdamW, "
               "{'lr': 1e-4})) and let the trainer create the optimizer over "
               "pipe.optim_parameters() and its scheduler (lr_scheduler_type) on it")
    if opt is None:
        return (f"optimizers=(None, {type(sched).__name__}): the scheduler is built on "
                f"{_optimizer_name(getattr(sched, 'optimizer', None))}, not on the optimizer "
                f"the trainer creates, so its learning rates would change nothing; {way_out}")
    params = [p for g in getattr(opt, "param_groups", ()) for p in g["params"]]
    held = [names[id(p)] for p in params if id(p) in names]
    listed = ", ".join(repr(n) for n in held[:3]) + (", ..." if len(held) > 3 else "")
    if optim_dtype is not None:
        dtype = str(optim_dtype).replace("torch.", "")
        others = len(params) - len(held)
        return (f"optimizers: the given {_optimizer_name(opt)} holds {len(held)} of the "
                f"model's own parameters{f' ({listed})' if held else ''}"
                f"{f' and {others} other tensor(s)' if others else ''}"
                f"; with optim_dtype=torch.{dtype} the pipe updates {dtype} masters "
                "(pipe.optim_parameters()), made when the trainer builds the pipe, and the "
                "model's parameters get no gradients, so this optimizer would step nothing; "
                + way_out)
    if len(held) < len(params):
        return (f"optimizers: the given {_optimizer_name(opt)} holds "
                f"{len(params) - len(held)} tensor(s) that are not the model's trainable "
                f"parameters (and {len(held)} that are); it should hold the model's "
                "trainable parameters (model.parameters())")
    if sched is not None and getattr(sched, "optimizer", None) is not opt:
        return (f"optimizers: the scheduler {type(sched).__name__} is built on "
                f"{_optimizer_name(getattr(sched, 'optimizer', None))}, not on the given "
                f"{_optimizer_name(opt)}, so its learning rates would change nothing; build "
                "it on the optimizer you pass")
    return None


def _optimizer_name(optimizer: Any) -> str:
    if optimizer is None:
        return "no optimizer"
    cls = type(optimizer)
    module = cls.__module__
    prefix = ("torch.optim." if module.startswith("torch.optim") else
              "roundpipe.optim." if module.startswith("roundpipe.optim") else "")
    return f"{prefix}{cls.__name__}"


def refuse(found: list[str], owner: str) -> None:
    if found:
        # An optimizer that could not train the pipe is an OptimizerError too.
        error = (TrainerOptimizerError if any(f.startswith("optimizers") for f in found)
                 else TrainerArgumentError)
        raise error(
            f"{owner} cannot run with {len(found)} of the given argument(s):\n  "
            + "\n  ".join(found))


def split_pipe_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``pipe_options`` into RoundPipe's arguments and RoundPipeRunConfig's fields."""
    pipe_names = set(inspect.signature(RoundPipe.__init__).parameters) - {"self", "model",
                                                                          "unknown"}
    run_names = set(inspect.signature(RoundPipeRunConfig.__init__).parameters) - {"self"}
    unknown = set(options) - pipe_names - run_names - {"model_run_config"}
    if unknown:
        raise UnknownConfigFieldError(
            f"pipe_options has no option(s) {', '.join(sorted(map(repr, unknown)))}; it takes "
            f"RoundPipe's ({', '.join(sorted(pipe_names))}) and RoundPipeRunConfig's "
            f"({', '.join(sorted(run_names))})")
    pipe = {k: v for k, v in options.items() if k in pipe_names or k == "model_run_config"}
    run = {k: v for k, v in options.items() if k in run_names}
    return pipe, run
