"""``transformers.Trainer`` (and TRL's ``SFTTrainer``) on roundpipe.

Only this module imports ``transformers``; ``import roundpipe`` does not (install the
``hf`` extra, then ``from roundpipe.hf import RoundPipeTrainer``)::

    trainer = RoundPipeTrainer(model=model, args=TrainingArguments(...),
                               train_dataset=ds, data_collator=collator,
                               pipe_options=dict(devices=["cuda:0", "cuda:1"],
                                                 num_microbatch=4,
                                                 optim_dtype=torch.float32))
    trainer.train()

How the Trainer's loop maps onto a pipe:

* Each ``training_step`` is one :meth:`~roundpipe.RoundPipe.forward_backward` on the
  collated batch.  ``compute_loss`` (Trainer's, or a subclass's) runs per microbatch on the
  device after the last stage, against the model's output for that microbatch; the losses
  are weighted so that they add up to the loss ``compute_loss`` gives on the whole batch.
* The optimizer Trainer creates updates ``pipe.optim_parameters()`` (the masters).  Its
  ``step()`` enqueues one pipe step (``pipe.step``, asynchronous unless
  ``async_step=False``) that clips the masters' gradients, steps and zeroes them, with the
  hyperparameters (the learning rate) the scheduler had set when the step was enqueued.
* Evaluation and prediction call ``pipe.forward`` under ``no_grad``, after
  ``pipe.synchronize()``.
* The model stays in host memory: Trainer and accelerate never move it.  Saved weights
  are the masters' values (the newest); a checkpoint also holds ``roundpipe.pt``
  (:func:`roundpipe.save_checkpoint`), from which a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .api import RoundPipe
from .checkpoint import load_checkpoint, save_checkpoint
from .config import RoundPipeRunConfig
from .errors import ConfigError, RoundPipeError, UnknownConfigFieldError

log = logging.getLogger(__name__)

#: The pipe's own state inside a Trainer checkpoint directory.
PIPE_STATE_NAME = "roundpipe.pt"

# Trainer's built-in optimizers that take parameter groups and nothing else.
_PLAIN_OPTIMIZERS = frozenset({"adamw_torch", "adamw_torch_fused", "adafactor", "sgd",
                               "adagrad", "rmsprop"})


class TrainerArgumentError(ConfigError):
    """A Trainer argument asks for something roundpipe cannot do (it names them)."""


class TrainerLossError(RoundPipeError, RuntimeError):
    """``compute_loss`` used the model in a way a pipelined step cannot replay."""


# --- the refusals ---------------------------------------------------------------------------

def _unsupported(args: transformers.TrainingArguments | None, model_init: Any,
                 optimizers: Any, optimizer_cls_and_kwargs: Any,
                 num_microbatch: int | None) -> list[str]:
    """What in the Trainer's arguments cannot work on a pipe, each with its way out."""
    found = []
    if model_init is not None:
        found.append("model_init: the pipe is built around one model at construction; "
                     "pass model=")
    if optimizers is not None and any(o is not None for o in optimizers):
        found.append("optimizers: an optimizer made before the pipe updates the model's "
                     "parameters, not the pipe's masters; pass optimizer_cls_and_kwargs="
                     "(cls, kwargs) (e.g. (roundpipe.optim.AdamW, {'lr': 1e-4})) and let "
                     "the trainer create it and its scheduler")
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


def _refuse(found: list[str], owner: str) -> None:
    if found:
        raise TrainerArgumentError(
            f"{owner} cannot run with {len(found)} of the given argument(s):\n  "
            + "\n  ".join(found))


def _split_pipe_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
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


# --- the optimizer Trainer steps ------------------------------------------------------------

class PipeOptimizer(torch.optim.Optimizer):
    """The optimizer Trainer (and its LR scheduler) sees: ``step()`` enqueues a pipe step
    that runs ``inner`` on the pipe's optimizer thread.

    The scheduler changes this object's ``param_groups``, never ``inner``'s: a step reads
    the hyperparameters they held when it was enqueued, though the scheduler moves on
    before an asynchronous step runs.
    """

    def __init__(self, inner: torch.optim.Optimizer, pipe: RoundPipe, *,
                 max_grad_norm: float, is_async: bool) -> None:
        # Not Optimizer.__init__: this object holds no state of its own.
        self.inner = inner
        self.pipe = pipe
        self.max_grad_norm = max_grad_norm
        self.is_async = is_async
        self.defaults = inner.defaults
        self.param_groups = [dict(g) for g in inner.param_groups]
        self.grad_norm: torch.Tensor | None = None  # of the last step, once it ran
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._zero_grad_profile_name = "PipeOptimizer.zero_grad"

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def _hyper(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("a pipe step takes no closure: the loss is computed by "
                              "forward_backward before the step")
        hyper = self._hyper()
        norm = torch.zeros((), dtype=torch.float32)
        self.grad_norm = norm
        inner, max_norm = self.inner, self.max_grad_norm
        params = [p for g in inner.param_groups for p in g["params"]]

        def step_fn() -> None:  # on the pipe's optimizer thread
            for group, values in zip(inner.param_groups, hyper):
                group.update(values)
            # Trainer measures the norm at every step, clipping or not (inf: no clipping).
            total = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0
                                                   else float("inf"))
            norm.copy_(total)
            inner.step()
            inner.zero_grad()

        self.pipe.step(step_fn, is_async=self.is_async)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each step zeroes the gradients it used."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self.pipe._optimizer.wait()  # the step in flight, not published (the run is kept)
        state = self.inner.state_dict()
        for group, values in zip(state["param_groups"], self._hyper()):
            group.update(values)  # the scheduler's newest values, as Trainer saves them
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.pipe._optimizer.wait()
        self.inner.load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("the pipe's optimizer has the groups Trainer made; add none")


# --- the model as compute_loss sees it --------------------------------------------------------

class _Called(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model called")
        self.args, self.kwargs = args, kwargs


class _ModelStandIn:
    """Passed to ``compute_loss`` as its ``model``: attributes are the real model's;
    calling it is what the subclasses decide."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.__dict__["_model"] = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)


class _Recorder(_ModelStandIn):
    """Stops ``compute_loss`` at its model call and reports the call's arguments."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _Called(args, kwargs)


class _Replay(_ModelStandIn):
    """Returns the pipeline's output for one microbatch to the model call it was made for."""

    def __init__(self, model: torch.nn.Module, output: Any, keys: frozenset[str],
                 nargs: int) -> None:
        super().__init__(model)
        self.__dict__.update(_output=output, _keys=keys, _nargs=nargs, _used=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._used:
            raise TrainerLossError(
                "compute_loss called the model a second time in one training step; a "
                "pipelined step runs the model once per microbatch (forward and backward "
                "together), so override compute_loss to call it once")
        if frozenset(kwargs) != self._keys or len(args) != self._nargs:
            raise TrainerLossError(
                f"compute_loss called the model with keywords {sorted(kwargs)} on a "
                f"microbatch, but with {sorted(self._keys)} on the whole batch; make the "
                "call's arguments independent of the batch")
        self.__dict__["_used"] = True
        # The pipeline's outputs are autograd leaves; losses get a copy that in-place
        # arithmetic (Trainer's ``loss *= ...``) may change, as on a model's own output.
        return pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) and t.dim() == 0
            and t.requires_grad and t.is_leaf else t, self._output)


class _Forward(_ModelStandIn):
    """The model for evaluation and prediction: a pipelined forward."""

    def __init__(self, model: torch.nn.Module, pipe: RoundPipe,
                 autocast: contextlib.AbstractContextManager) -> None:
        super().__init__(model)
        self.__dict__.update(_pipe=pipe, _autocast=autocast)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), self._autocast:
            return self._pipe.forward(*args, **kwargs)


# --- the trainer ---------------------------------------------------------------------------

class RoundPipeTrainerMixin:
    """The roundpipe side of :class:`RoundPipeTrainer`, for any ``transformers.Trainer``
    subclass (``class MyTrainer(RoundPipeTrainerMixin, SomeTrainer)``).

    Args (keywords, besides the trainer's own):
        pipe_options: :class:`~roundpipe.RoundPipe`'s arguments (``devices``,
            ``optim_dtype``, ...) and :class:`~roundpipe.RoundPipeRunConfig`'s fields
            (``num_microbatch``, ...).
        async_step: ``True``: each step overlaps the next call, which uses the weights
            from before the step (one step old); ``False``: exact steps.
    """

    pipe: RoundPipe

    def __init__(self, *args: Any, pipe_options: dict[str, Any] | None = None,
                 async_step: bool = True, **kwargs: Any) -> None:
        if not isinstance(async_step, bool):
            raise ConfigError(f"async_step must be True or False, got {async_step!r}")
        pipe_kwargs, run_kwargs = _split_pipe_options(dict(pipe_options or {}))
        run_config = pipe_kwargs.pop("model_run_config", None) or RoundPipeRunConfig()
        if run_kwargs:
            run_config = run_config.overridden_by(RoundPipeRunConfig(**run_kwargs))
        owner = type(self).__name__
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse(_unsupported(training_args if isinstance(
            training_args, transformers.TrainingArguments) else None,
            kwargs.get("model_init"), kwargs.get("optimizers"),
            kwargs.get("optimizer_cls_and_kwargs"), run_config.num_microbatch), owner)
        self._async_step = async_step
        super().__init__(*args, **kwargs)
        if getattr(self.args, "activation_checkpointing", False):
            # What it asks for, roundpipe does already: backward stages recompute their
            # forward (RoundPipeRunConfig.recompute_grain), so the model is left unpatched.
            log.info("roundpipe: activation_checkpointing=True is what roundpipe does "
                     "already; the model is not patched for it")
            self.args.activation_checkpointing = self.args.gradient_checkpointing = False
        # Defaults the trainer filled in (TRL's config) are checked too.
        _refuse(_unsupported(self.args, None, None, self.optimizer_cls_and_kwargs,
                             run_config.num_microbatch), owner)
        # One process drives every device: Trainer's own multi-GPU (DataParallel) and its
        # batch-size scaling stay off, as for a model placed across devices.
        self.args._n_gpu = 1
        self._train_batch_size = self.args.per_device_train_batch_size
        self._prepare_model_for_pipe()
        self.pipe = RoundPipe(self.model, model_run_config=run_config, **pipe_kwargs)
        if self._async_step and not self.pipe._state.has_masters:
            # Without masters the optimizer updates the weights the next call reads: the
            # call would wait for the step anyway, and Trainer's model.zero_grad() after
            # step() must not race it.
            log.info("roundpipe: optim_dtype=None (no masters): steps run synchronously")
            self._async_step = False

    def _prepare_model_for_pipe(self) -> None:
        """Called once the trainer has set up ``self.model``, before the pipe wraps it."""

    # --- placement: the model stays in host memory -----------------------------------------
    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        pass  # roundpipe streams the weights to the devices itself

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # bf16 runs as torch.autocast around the pipe's calls (_autocast), not through
        # accelerate, which would patch the model's forward before it is traced.
        return {**super()._build_accelerator_args(**kwargs), "device_placement": False,
                "mixed_precision": "no"}

    def _autocast(self) -> contextlib.AbstractContextManager:
        """``bf16=True``: the pipe's calls run under autocast (replayed on its devices)."""
        if not self.args.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.pipe.devices[0].torch_device.type, dtype=torch.bfloat16)

    def _wrap_model(self, model: torch.nn.Module, training: bool = True,
                    dataloader: Any = None) -> torch.nn.Module:
        return model  # no DataParallel, no compile: the pipe is the parallelism

    def _prepare_input(self, data: Any) -> Any:
        return data  # batches stay on the CPU; the pipe uploads microbatches

    # --- the optimizer -----------------------------------------------------------------------
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        decay = set(self.get_decay_parameter_names(self.model))
        named = self.pipe.optim_named_parameters()
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay":
             self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        kwargs = dict(kwargs)
        taken = sorted(set(kwargs) & {"params", "model", "optimizer_dict"})
        if taken or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TrainerArgumentError(
                f"the optimizer {getattr(cls, '__name__', cls)!r} is built from the model "
                f"({', '.join(taken) or 'a factory'}), not from parameter groups; use an "
                "optimizer over parameters (optim='adamw_torch', or optimizer_cls_and_kwargs)")
        inner = cls(groups, **kwargs)
        self.optimizer = PipeOptimizer(inner, self.pipe, max_grad_norm=self.args.max_grad_norm,
                                       is_async=self._async_step)
        return self.optimizer

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor | None:
        return None  # the step clips the masters' gradients (PipeOptimizer.step)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        # Filled in by the step about to be enqueued; read once that step ran (below).
        return _NormOfNextStep(self)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any,
                                 **kwargs: Any) -> None:
        if isinstance(grad_norm, _NormOfNextStep):
            grad_norm = grad_norm.value() if self.control.should_log else None
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # --- one training step: one forward_backward -------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        call_args, call_kwargs = self._model_call(inputs, num_items_in_batch)
        keys, nargs = frozenset(call_kwargs), len(call_args)
        # A loss normalised by num_items_in_batch adds up over microbatches; a mean does
        # not: weight each microbatch's by its share of the batch's items, then divide by
        # the accumulation steps as Trainer does.
        total = None if scaled else _items(inputs, self._loss_shifts_labels)
        steps = 1 if scaled else self.current_gradient_accumulation_steps

        def loss_fn(output: Any, mb_inputs: dict[str, Any]) -> torch.Tensor:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(_Replay(self.model, output, keys, nargs),
                                         mb_inputs, num_items_in_batch=num_items_in_batch)
            if total is not None:
                loss = loss * (_items(mb_inputs, self._loss_shifts_labels) / total)
            return loss / steps if steps != 1 else loss

        with self._autocast():
            loss = self.pipe.forward_backward(input_args=call_args, input_kwargs=call_kwargs,
                                              label=dict(inputs), loss_fn=loss_fn)
        return loss.detach().to(self.args.device)

    def _model_call(self, inputs: dict[str, Any], num_items_in_batch: Any
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments ``compute_loss`` calls the model with on this batch: found by
        running it up to that call."""
        try:
            with self.compute_loss_context_manager():
                self.compute_loss(_Recorder(self.model), dict(inputs),
                                  num_items_in_batch=num_items_in_batch)
        except _Called as call:
            return call.args, call.kwargs
        raise TrainerLossError("compute_loss returned without calling the model; a "
                               "pipelined step needs the model's output to compute the loss")

    # --- evaluation and prediction ---------------------------------------------------------
    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.pipe.synchronize()  # evaluate the newest weights
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        self.pipe.synchronize()
        return super().predict(*args, **kwargs)

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: list[str] | None = None
                        ) -> Any:
        return super().prediction_step(_Forward(self.model, self.pipe, self._autocast()), inputs,
                                       prediction_loss_only, ignore_keys=ignore_keys)

    # --- training's end, saving and resuming ---------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        result = super().train(*args, **kwargs)
        self.pipe.synchronize()  # the model holds the trained weights afterwards
        return result

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None:
            state_dict = _newest_weights(self.pipe)
        super()._save(output_dir, state_dict=state_dict)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            # Masters, the weights the next call reads and the dropout streams' counter:
            # what a bitwise resume needs beyond the model files and optimizer.pt.
            save_checkpoint(os.path.join(folder, PIPE_STATE_NAME), self.pipe)

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_pipe_state(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        super()._load_best_model()
        if self.state.best_model_checkpoint is not None:
            self._load_pipe_state(self.state.best_model_checkpoint)

    def _load_pipe_state(self, folder: str) -> None:
        path = os.path.join(folder, PIPE_STATE_NAME)
        if os.path.isfile(path):
            load_checkpoint(path, self.pipe)
        else:  # a plain Trainer's checkpoint: the masters start from the loaded weights
            log.info("roundpipe: %s has no %s; masters taken from the loaded weights",
                     folder, PIPE_STATE_NAME)
            self.pipe.load_state_dict(self.model.state_dict())


class _NormOfNextStep:
    """The gradient norm of the step Trainer is about to enqueue (read after it ran)."""

    def __init__(self, trainer: RoundPipeTrainerMixin) -> None:
        self.trainer = trainer

    def value(self) -> float | None:
        optimizer = self.trainer.optimizer
        while not isinstance(optimizer, PipeOptimizer) and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer  # accelerate's wrapper (twice after two train())
        norm = getattr(optimizer, "grad_norm", None)
        if norm is None:
            return None
        self.trainer.pipe._optimizer.wait()  # the step, not published: the run is kept
        return norm.item()


def _items(inputs: dict[str, Any], shifted: bool) -> float:
    """What a mean loss over ``inputs`` averages: labels that are not -100 (from the
    second position on where the model shifts them), else samples."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and shifted and labels.dim() >= 2:
            labels = labels[..., 1:]
    if isinstance(labels, torch.Tensor):
        count = int(labels.ne(-100).sum())
        if count:
            return float(count)
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return float(value.shape[0])
    return 1.0


def _newest_weights(pipe: RoundPipe) -> dict[str, torch.Tensor]:
    """The model's state dict with the masters' values (after every step taken, without
    publishing them) in the model's dtypes; tied weights stay one tensor."""
    model_sd = pipe.model.state_dict()
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name, value in pipe.state_dict().items():
        want = model_sd[name].dtype if name in model_sd else value.dtype
        key = id(value)
        if key not in cast:
            cast[key] = value.to(want) if value.dtype != want else value
        out[name] = cast[key]
    return out


class RoundPipeTrainer(RoundPipeTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training its model through a :class:`~roundpipe.RoundPipe`
    (see the module's docstring and :class:`RoundPipeTrainerMixin`)."""


def __getattr__(name: str) -> Any:
    # TRL is optional: RoundPipeSFTTrainer is built on first use.
    if name == "RoundPipeSFTTrainer":
        from ._trl import make_sft_trainer

        cls = make_sft_trainer(RoundPipeTrainerMixin, TrainerArgumentError)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# (RoundPipeSFTTrainer too, made on first access: TRL is imported only then.)
__all__ = ["PIPE_STATE_NAME", "PipeOptimizer", "RoundPipeTrainer", "RoundPipeTrainerMixin",
           "TrainerArgumentError", "TrainerLossError"]
