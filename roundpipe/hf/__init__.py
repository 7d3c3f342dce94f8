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

from typing import Any

from .errors import TrainerArgumentError, TrainerLossError, TrainerOptimizerError
from .optimizer import PipeOptimizer
from .trainer import PIPE_STATE_NAME, RoundPipeTrainer, RoundPipeTrainerMixin


def __getattr__(name: str) -> Any:
    # TRL is optional: RoundPipeSFTTrainer is built on first use.
    if name == "RoundPipeSFTTrainer":
        from .sft import make_sft_trainer

        cls = make_sft_trainer()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# (RoundPipeSFTTrainer too, made on first access: TRL is imported only then.)
__all__ = ["PIPE_STATE_NAME", "PipeOptimizer", "RoundPipeTrainer", "RoundPipeTrainerMixin",
           "TrainerArgumentError", "TrainerLossError", "TrainerOptimizerError"]
