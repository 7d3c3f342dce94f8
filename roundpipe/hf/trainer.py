"""``RoundPipeTrainerMixin``: the overrides that put a ``transformers.Trainer`` on a
pipe (see the package's docstring), and ``RoundPipeTrainer``."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..api import RoundPipe
from ..checkpoint import load_checkpoint, save_checkpoint
from ..config import RoundPipeRunConfig
from ..errors import ConfigError
from ..runtime.signature import flat_leaves
from .arguments import refuse, split_pipe_options, unsupported
from .errors import TrainerArgumentError, TrainerLossError
from .optimizer import NormOfNextStep, PipeOptimizer
from .standins import Called, Forward, Recorder, Replay, fitted_run_config

log = logging.getLogger(__name__)

#: The pipe's own state inside a Trainer checkpoint directory.
PIPE_STATE_NAME = "roundpipe.pt"


class RoundPipeTrainerMixin:
    """The roundpipe side of :class:`RoundPipeTrainer`, for any ``transformers.Trainer``
    subclass (``class MyTrainer(RoundPipeTrainerMixin, SomeTrainer)``).

    Args (keywords, besides the trainer's own):
        pipe_options: :class:`~roundpipe.RoundPipe`'s arguments (``devices``,
            ``optim_dtype``, ...) and :class:`~roundpipe.RoundPipeRunConfig`'s fields
            (``num_microbatch``, ...).
        async_step: ``False`` (the default): exact steps, the same losses as plain
            ``Trainer``; ``True``: each step overlaps the next call, which computes with
            a prediction of the step's result (``pipe_options={"predict_weights":
            False}``: with the weights from before the step, one step old).
            ``pipe_options={"async_after": N}`` keeps the first ``N`` steps exact.
    """

    pipe: RoundPipe

    def __init__(self, *args: Any, pipe_options: dict[str, Any] | None = None,
                 async_step: bool = False, **kwargs: Any) -> None:
        if not isinstance(async_step, bool):
            raise ConfigError(f"async_step must be True or False, got {async_step!r}")
        pipe_kwargs, run_kwargs = split_pipe_options(dict(pipe_options or {}))
        run_config = pipe_kwargs.pop("model_run_config", None) or RoundPipeRunConfig()
        if run_kwargs:
            run_config = run_config.overridden_by(RoundPipeRunConfig(**run_kwargs))
        owner = type(self).__name__
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        refuse(unsupported(training_args if isinstance(
            training_args, transformers.TrainingArguments) else None,
            kwargs.get("model_init"), kwargs.get("optimizers"),
            kwargs.get("optimizer_cls_and_kwargs"), run_config.num_microbatch,
            kwargs.get("model", args[0] if args else None), pipe_kwargs.get("optim_dtype")),
            owner)
        self._async_step = async_step
        super().__init__(*args, **kwargs)
        if getattr(self.args, "activation_checkpointing", False):
            # What it asks for, roundpipe does already: backward stages recompute their
            # forward (RoundPipeRunConfig.recompute_grain), so the model is left unpatched.
            log.info("roundpipe: activation_checkpointing=True is what roundpipe does "
                     "already; the model is not patched for it")
            self.args.activation_checkpointing = self.args.gradient_checkpointing = False
        # Defaults the trainer filled in (TRL's config) are checked too.
        refuse(unsupported(self.args, None, None, self.optimizer_cls_and_kwargs,
                             run_config.num_microbatch), owner)
        # One process drives every device: Trainer's own multi-GPU (DataParallel) and its
        # batch-size scaling stay off, as for a model placed across devices.
        self.args._n_gpu = 1
        self._train_batch_size = self.args.per_device_train_batch_size
        _warn_if_loss_scale_unknown(self, run_config.num_microbatch)
        self._prepare_model_for_pipe()
        self.pipe = RoundPipe(self.model, model_run_config=run_config, **pipe_kwargs)
        if self._async_step and not self.pipe.has_masters:
            # Without masters the optimizer updates the weights the next call reads: the
            # call would wait for the step anyway, and Trainer's model.zero_grad() after
            # step() must not race it.
            log.info("roundpipe: optim_dtype=None (no masters): steps run synchronously")
            self._async_step = False
        if self.optimizer is not None:  # given, over the model's parameters (no masters)
            self.optimizer = PipeOptimizer(self.optimizer, self.pipe,
                                           max_grad_norm=self.args.max_grad_norm,
                                           is_async=self._async_step, share_groups=True)

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
        return NormOfNextStep(self)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any,
                                 **kwargs: Any) -> None:
        if isinstance(grad_norm, NormOfNextStep):
            grad_norm = grad_norm.value() if self.control.should_log else None
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # --- one training step: one forward_backward -------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        if isinstance(num_items_in_batch, torch.Tensor):
            # Trainer counts on args.device (a GPU); the pipe takes its inputs on the CPU.
            num_items_in_batch = num_items_in_batch.cpu()
        explicit = self.loss_is_scaled_for_ga
        if explicit is not None:
            scaled = explicit
        else:  # Trainer's rule: whether it divides the loss by the accumulation steps
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        call_args, call_kwargs = self._model_call(inputs, num_items_in_batch)
        keys, nargs = frozenset(call_kwargs), len(call_args)
        # A loss normalised by num_items_in_batch adds up over microbatches; a mean does
        # not: weight each microbatch's by its share of the batch's items.  Trainer's
        # rule counts the model's own loss as normalised when the model takes loss
        # kwargs; one whose traced program never reads num_items_in_batch (BERT's, any
        # plain CrossEntropyLoss) returns a mean all the same.
        if explicit is not None:
            adds_up: bool | None = explicit
        elif num_items_in_batch is None:
            adds_up = False
        elif self.compute_loss_func is not None or self.label_smoother is not None:
            adds_up = True
        elif "num_items_in_batch" in call_kwargs:
            adds_up = None  # the traced program decides (_reads_num_items)
        else:
            adds_up = scaled
        total = _items(inputs, self._loss_shifts_labels)
        steps = 1 if scaled else self.current_gradient_accumulation_steps

        def loss_fn(output: Any, mb_inputs: dict[str, Any]) -> torch.Tensor:
            share = _items(mb_inputs, self._loss_shifts_labels) / total if total else 0.0
            with self.compute_loss_context_manager():
                # A copy: compute_loss pops the labels (label smoothing, compute_loss_func).
                loss = self.compute_loss(Replay(self.model, output, keys, nargs),
                                         dict(mb_inputs), num_items_in_batch=num_items_in_batch)
            normalised = adds_up if adds_up is not None else self._reads_num_items(
                call_args, call_kwargs)
            if not normalised:
                if share == 0:
                    # A mean over no labelled item is NaN (0/0); on the whole batch it
                    # counts for nothing, and so does it here (its gradients are zero).
                    return (loss * 0.0).nan_to_num(0.0)
                loss = loss * share
            return loss / steps if steps != 1 else loss

        with self._autocast():
            loss = self.pipe.forward_backward(
                input_args=call_args, input_kwargs=call_kwargs, label=dict(inputs),
                loss_fn=loss_fn,
                run_config=fitted_run_config(self.pipe, call_args, call_kwargs))
        return loss.detach().to(self.args.device)

    def _reads_num_items(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the program of the pipe's current call reads the model's
        ``num_items_in_batch`` argument (unknown: as Trainer assumes, it does)."""
        entry = getattr(self.pipe, "_current", None)
        if entry is None:
            return True
        signature = entry.plan.program.inputs
        marker = object()
        leaves = flat_leaves(signature, args, {**kwargs, "num_items_in_batch": marker})
        if leaves is None or len(leaves) != len(signature.names):
            return True
        return next((name is not None for name, leaf in zip(signature.names, leaves)
                     if leaf is marker), True)

    def _model_call(self, inputs: dict[str, Any], num_items_in_batch: Any
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments ``compute_loss`` calls the model with on this batch: found by
        running it up to that call."""
        try:
            with self.compute_loss_context_manager():
                self.compute_loss(Recorder(self.model), dict(inputs),
                                  num_items_in_batch=num_items_in_batch)
        except Called as call:
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
        return super().prediction_step(Forward(self.model, self.pipe, self._autocast()), inputs,
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
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            # Masters, the weights the next call reads and the dropout streams' counter:
            # what a bitwise resume needs beyond the model files and optimizer.pt.  Written
            # first: Trainer's trainer_state.json (written last) then marks a complete
            # checkpoint, and a push of the folder (hub_strategy) finds it.
            os.makedirs(folder, exist_ok=True)
            save_checkpoint(os.path.join(folder, PIPE_STATE_NAME), self.pipe)
        super()._save_checkpoint(model, trial)

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


def _warn_if_loss_scale_unknown(trainer: Any, num_microbatch: int | None) -> None:
    """A ``compute_loss`` of the user's own, with ``loss_is_scaled_for_ga`` unset, counts
    as normalised by ``num_items_in_batch`` (Trainer's rule), so its microbatch losses
    are added: a mean would come out ``num_microbatch`` times too large.  Say so."""
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    if trainer.loss_is_scaled_for_ga is not None or num_microbatch == 1 \
            or owner is transformers.Trainer or owner.__module__.split(".")[0] == "trl":
        return
    warnings.warn(
        f"{owner.__name__}.compute_loss is your own and loss_is_scaled_for_ga is unset, so "
        "its loss counts as normalised by num_items_in_batch, as Trainer counts it: the "
        "pipe adds the microbatches' losses, and a mean over the call comes out "
        "num_microbatch times too large. Set loss_is_scaled_for_ga on the trainer class: "
        "False for a mean (each microbatch's is weighted by its share of the labels), True "
        "for a loss divided by num_items_in_batch", UserWarning, stacklevel=3)


def _items(inputs: dict[str, Any], shifted: bool) -> float:
    """What a mean loss over ``inputs`` averages: labels that are not -100 (from the
    second position on where the model shifts them; none may be), else samples."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and shifted and labels.dim() >= 2:
            labels = labels[..., 1:]
    if isinstance(labels, torch.Tensor):
        return float(labels.ne(-100).sum())
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
