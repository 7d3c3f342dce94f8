"""``RoundPipeSFTTrainer``: TRL's ``SFTTrainer`` on a pipe (made by ``roundpipe.hf`` on
first use, so that TRL stays optional).

SFTTrainer computes its loss with a *fused LM head*: it replaces the base model's
``forward`` by one that projects the hidden states through the head with a custom
``torch.autograd.Function``.  roundpipe cannot export a Function with a backward of its
own, so it would keep the whole model opaque: one stage, no pipelining.  Here the fused
forward is replaced by one that computes the same outputs (log-probabilities of the
labels, entropy, top-1 hits, label mask, loss) with plain operations, which trace and cut
into stages like the rest of the model.  The logits of a microbatch exist on its device.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from .arguments import refuse
from .errors import TrainerArgumentError
from .trainer import RoundPipeTrainerMixin

# Config fields that change the head's logits, which the traceable head does not apply.
_LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                 "lm_head_multiplier", "logits_scaling")


def make_sft_trainer() -> type:
    from trl import SFTTrainer
    from trl.trainer.utils import FusedCausalLMOutput

    def fused_forward(self: torch.nn.Module, *args: Any, fused_lm_head: bool = False,
                      labels: torch.Tensor | None = None,
                      shift_labels: torch.Tensor | None = None,
                      num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if not fused_lm_head:  # the class's forward, on whatever module ``self`` is
            for key, value in (("labels", labels), ("shift_labels", shift_labels),
                               ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[key] = value
            return type(self).forward(self, *args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]  # type: ignore[index]
        else:
            labels = shift_labels
        logits = self.get_output_embeddings()(hidden).float()
        log_p = logits.log_softmax(-1)
        mask = labels != -100
        target = labels.clamp(min=0).unsqueeze(-1)
        log_probs = log_p.gather(-1, target).squeeze(-1).masked_fill(~mask, 0.0)
        entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(~mask, 0.0)
        is_top1 = (logits.argmax(-1, keepdim=True) == target).squeeze(-1) & mask
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs,
                                   entropy=entropy, is_top1=is_top1, label_mask=mask)

    class RoundPipeSFTTrainer(RoundPipeTrainerMixin, SFTTrainer):
        """TRL's ``SFTTrainer`` on a :class:`~roundpipe.RoundPipe` (LoRA through
        ``peft_config`` included), with a fused LM head roundpipe can trace."""

        def _prepare_model_for_pipe(self) -> None:
            args, found = self.args, []
            if getattr(self, "padding_free", False):
                name = (f"packing=True, packing_strategy={args.packing_strategy!r}"
                        if args.packing and not args.padding_free else "padding_free=True")
                found.append(f"{name}: the collator flattens a batch into one row with the "
                             "sequences' boundaries beside it (position_ids, cu_seq_lens), "
                             "which cannot be cut into microbatches; use packing_strategy="
                             "'wrapped' (rows of max_length) or padding_free=False")
            # SFTTrainer.compute_loss then calls the model twice (the logits, then the
            # fused head for its metrics); a pipelined step runs it once per microbatch.
            twice = "SFTTrainer calls the model twice per step with it, a pipe runs it " \
                "once; train with RoundPipeTrainer (same arguments) or drop it"
            if self.compute_loss_func is not None:
                found.append(f"compute_loss_func: {twice}")
            if self.label_smoother is not None and args.loss_type == "nll":
                found.append(f"label_smoothing_factor={args.label_smoothing_factor!r}: {twice}")
            refuse(found, type(self).__name__)
            model = self.model
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            text = base.config.get_text_config()
            used = [f for f in _LOGIT_FIELDS if getattr(text, f, None) not in (None, 1.0)]
            if used or getattr(text, "output_router_logits", False):
                raise TrainerArgumentError(
                    f"{type(base).__name__}'s config sets "
                    f"{', '.join(used) or 'output_router_logits'}, which the traceable "
                    "head of RoundPipeSFTTrainer does not apply; train it with "
                    "RoundPipeTrainer and the model's own loss")
            base.forward = types.MethodType(fused_forward, base)

    RoundPipeSFTTrainer.__module__ = "roundpipe.hf"
    return RoundPipeSFTTrainer
