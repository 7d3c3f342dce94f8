"""``roundpipe.hf.RoundPipeTrainer`` against plain ``transformers.Trainer`` (and TRL's
``SFTTrainer``): the same logged losses, gradient norms, learning rates and weights with
exact steps; a bitwise resume in a fresh process; LoRA through ``peft_config``; and the
arguments refused at construction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import hf_models as hf
import roundpipe

from transformers import Trainer, TrainingArguments  # hf_models skips without it

from roundpipe.hf import RoundPipeTrainer, TrainerArgumentError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPE = dict(devices=["cpu"] * 2, num_microbatch=2, optim_dtype=torch.float32)
STEPS = 6  # the resume test's: steps 1-3, a checkpoint, steps 4-6 again
EXACT_STEPS = 4  # the exact-steps comparisons' (each step is a plain and a pipe step)


def _rows(n: int = 24, seq: int = 12, seed: int = 0, ragged: bool = True) -> list[dict]:
    """Token rows with right padding of varying length (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, seq + 1, (), generator=g)) if ragged else seq
        ids = torch.randint(1, hf.VOCAB, (seq,), generator=g)
        mask = (torch.arange(seq) < length).long()
        rows.append(dict(input_ids=ids, attention_mask=mask,
                         labels=ids.masked_fill(mask == 0, -100)))
    return rows


def _args(out: str, **overrides) -> TrainingArguments:
    options = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4,
                   learning_rate=1e-2, lr_scheduler_type="linear", optim="adamw_torch",
                   logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                   disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(**options)


def _model(dropout: float = 0.0) -> torch.nn.Module:
    # Two decoder layers, the fewest that make them units of their own (block detection
    # needs 2 repeated siblings; with 1 the whole LlamaModel is one unit): Trainer's
    # padded batches then cross stage boundaries with the mask and rotary inputs, a layer
    # sits in the fused stage, and LoRA adapters spread over several units.
    model = hf.build("llama", num_hidden_layers=2)
    for module in model.modules():  # attention dropout: the keyed streams must resume too
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    return model


def _logged(trainer: Trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if "loss" in h]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("accumulation,clip,loss_kwargs,one_pass",
                         [(1, 0.0, True, False), (2, 0.5, False, True)])
def test_exact_steps_log_what_plain_trainer_logs(tmp_path, accumulation, clip, loss_kwargs,
                                                 one_pass):
    """Same model, data, seed, AdamW and linear schedule: the losses, gradient norms and
    learning rates of 4 steps, the final weights and predict()'s loss and logits.  With
    ``loss_kwargs`` the model normalises its loss by Trainer's token count (the
    microbatches' losses add up); without, it returns a mean per call, which the pipe
    weights by each microbatch's share of the tokens.  ``one_pass``: the pipe steps with
    roundpipe.optim.AdamW, plain Trainer with torch's fused AdamW (equal bit for bit)."""
    args = dict(gradient_accumulation_steps=accumulation, max_grad_norm=clip,
                max_steps=EXACT_STEPS)
    extra = {}
    if one_pass:
        args["optim"] = "adamw_torch_fused"
        extra["optimizer_cls_and_kwargs"] = (roundpipe.optim.AdamW, dict(
            lr=1e-2, betas=(0.9, 0.999), eps=1e-8))
    data, held_out = _rows(), _rows(8, seed=1)

    def model() -> torch.nn.Module:
        m = _model()
        m.accepts_loss_kwargs = loss_kwargs  # what Trainer reads to pass num_items_in_batch
        return m

    plain = Trainer(model=model(), args=_args(str(tmp_path / "plain"), **args),
                    train_dataset=data)
    plain.train()
    piped = RoundPipeTrainer(model=model(), args=_args(str(tmp_path / "pipe"), **args),
                             train_dataset=data, pipe_options=PIPE, async_step=False, **extra)
    assert piped.model_accepts_loss_kwargs is loss_kwargs
    piped.train()

    for key in ("loss", "grad_norm", "learning_rate"):
        want, got = _logged(plain, key), _logged(piped, key)
        assert len(got) == EXACT_STEPS, key
        assert max(_rel(g, w) for g, w in zip(got, want)) <= 1e-5, (key, got, want)
    # The steps did change the loss (a run that never stepped would fail above too).
    assert len(set(_logged(piped, "loss"))) == EXACT_STEPS
    if clip:  # clipping acted: unclipped norms above it
        assert max(_logged(piped, "grad_norm")) > clip
    # Adam divides by sqrt(v): a gradient element near zero that differs in its last bits
    # moves its weight by up to lr; a wrong step would move every weight by about lr.
    want = dict(plain.model.named_parameters())
    for name, p in piped.model.named_parameters():  # synchronized by train()
        assert torch.allclose(p, want[name], rtol=0, atol=5e-3 * 1e-2), name

    stepped = piped.optimizer.optimizer.inner  # accelerate's wrapper, then the pipe's
    assert type(stepped) is (roundpipe.optim.AdamW if one_pass else torch.optim.AdamW)

    # Prediction runs through pipe.forward: the whole batch's loss and logits.
    ref, out = plain.predict(held_out), piped.predict(held_out)
    assert _rel(out.metrics["test_loss"], ref.metrics["test_loss"]) <= 1e-5
    assert torch.allclose(torch.as_tensor(out.predictions), torch.as_tensor(ref.predictions),
                          rtol=1e-4, atol=1e-5)


def _mean_loss_func(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func that averages over the call's labelled tokens (it ignores
    num_items_in_batch): with loss_is_scaled_for_ga=False, Trainer divides it by the
    accumulation steps."""
    logits = outputs["logits"][:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def _masked_rows() -> list[dict]:
    rows = _rows(seed=3)
    for row in rows:  # BERT's masked LM: a loss on every other token
        row["labels"] = row["labels"].clone()
        row["labels"][::2] = -100
    return rows


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"]))


class _MeanLoss:
    """A compute_loss of one's own: a mean over the call's labelled tokens."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _mean_loss_func(outputs, labels)
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("case", ["mean_model_loss", "unlabelled_microbatch",
                                  "label_smoothing", "mean_compute_loss_func",
                                  "own_mean_compute_loss", "lora_label_smoothing"])
def test_losses_that_do_not_add_up_over_microbatches_log_what_plain_trainer_logs(tmp_path,
                                                                                 case):
    """Losses that are means over the call, not sums normalised by Trainer's
    num_items_in_batch: BERT's (its forward takes num_items_in_batch among its kwargs and
    never reads it), label smoothing without loss kwargs, a compute_loss_func that averages
    (loss_is_scaled_for_ga=False).  Each microbatch's loss is weighted by its share of the
    labels, so the pipe logs plain Trainer's losses and norms, with accumulation.  With
    LoRA, label smoothing shifts the labels as for the causal LM under the adapters, in
    training and in evaluation."""
    args, extra, data, build = dict(max_steps=3, gradient_accumulation_steps=2), {}, _rows(), _model
    plain_cls, pipe_cls = Trainer, RoundPipeTrainer
    if case in ("mean_model_loss", "unlabelled_microbatch"):
        data, build = _masked_rows(), lambda: hf.build("bert", num_hidden_layers=1)
        if case == "unlabelled_microbatch":
            # In order, each batch's second microbatch has no label: its mean is NaN
            # (0/0), which counts for nothing (LossError before); the batch's is not.
            args["train_sampling_strategy"] = "sequential"
            for i, row in enumerate(data):
                if i % 4 >= 2:
                    row["labels"][:] = -100
    elif case == "label_smoothing":
        args["label_smoothing_factor"] = 0.1

        def build():
            m = _model()
            m.accepts_loss_kwargs = False
            return m
    elif case == "mean_compute_loss_func":
        extra["compute_loss_func"] = _mean_loss_func
        plain_cls = type("MeanLossTrainer", (Trainer,), {"loss_is_scaled_for_ga": False})
        pipe_cls = type("MeanLossPipeTrainer", (RoundPipeTrainer,),
                        {"loss_is_scaled_for_ga": False})
    elif case == "own_mean_compute_loss":
        plain_cls = type("OwnLossTrainer", (_MeanLoss, Trainer), {})
        pipe_cls = type("OwnLossPipeTrainer", (_MeanLoss, RoundPipeTrainer), {})
    else:
        args["label_smoothing_factor"] = 0.1

        def build():
            return _lora(_model())
    plain = plain_cls(model=build(), args=_args(str(tmp_path / "plain"), **args),
                      train_dataset=data, **extra)
    plain.train()
    piped = pipe_cls(model=build(), args=_args(str(tmp_path / "pipe"), **args),
                     train_dataset=data, pipe_options=PIPE, async_step=False, **extra)
    piped.train()
    for key in ("loss", "grad_norm"):
        want, got = _logged(plain, key), _logged(piped, key)
        assert len(got) == 3 and max(_rel(g, w) for g, w in zip(got, want)) <= 1e-5, \
            (key, got, want)
    if case == "lora_label_smoothing":
        held_out = _rows(8, seed=1)
        assert _rel(piped.evaluate(held_out)["eval_loss"],
                    plain.evaluate(held_out)["eval_loss"]) <= 1e-5


def test_a_last_batch_smaller_than_num_microbatch_runs(tmp_path):
    """9 rows in batches of 4: the epoch's last batch (and evaluation's) has one row, fewer
    than num_microbatch=2; it runs as one microbatch (it raised InputError at the end of
    the epoch), with plain Trainer's losses."""
    args = dict(max_steps=-1, num_train_epochs=1, per_device_eval_batch_size=4)
    plain = Trainer(model=_model(), args=_args(str(tmp_path / "plain"), **args),
                    train_dataset=_rows(9))
    plain.train()
    piped = RoundPipeTrainer(model=_model(), args=_args(str(tmp_path / "pipe"), **args),
                             train_dataset=_rows(9), pipe_options=PIPE, async_step=False)
    piped.train()
    want, got = _logged(plain, "loss"), _logged(piped, "loss")
    assert len(got) == 3 and max(_rel(g, w) for g, w in zip(got, want)) <= 1e-5, (got, want)
    held_out = _rows(9, seed=1)
    assert _rel(piped.evaluate(held_out)["eval_loss"],
                plain.evaluate(held_out)["eval_loss"]) <= 1e-5


def test_own_compute_loss_without_loss_is_scaled_for_ga_is_warned_about(tmp_path):
    unset = type("Unset", (_MeanLoss,), {"loss_is_scaled_for_ga": None})
    for cls, warned in ((type("A", (unset, RoundPipeTrainer), {}), True),
                        (type("B", (_MeanLoss, RoundPipeTrainer), {}), False),
                        (RoundPipeTrainer, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(model=_model(), args=_args(str(tmp_path)), train_dataset=_rows(),
                pipe_options=PIPE)
        found = [w for w in caught if "loss_is_scaled_for_ga" in str(w.message)]
        assert bool(found) is warned, cls
        if warned:
            assert "_MeanLoss.compute_loss" in str(found[0].message)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_trainer_counts_on_its_device_and_the_pipe_gets_cpu_inputs(tmp_path):
    """Without use_cpu, args.device is cuda:0 and Trainer counts num_items_in_batch there
    (in training and in evaluation); the pipe takes its inputs on the CPU."""
    trainer = RoundPipeTrainer(model=_model(), args=_args(str(tmp_path), max_steps=2,
                                                         use_cpu=False),
                               train_dataset=_rows(), eval_dataset=_rows(8, seed=1),
                               pipe_options=dict(PIPE, devices=["cuda:0"] * 2),
                               async_step=False)
    assert trainer.args.device.type == "cuda" and trainer.model_accepts_loss_kwargs
    trainer.train()
    assert len(_logged(trainer, "loss")) == 2
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))


class _RecordingTrainer(RoundPipeTrainer):
    """Records the learning rate each step ran with, on the pipe's optimizer thread."""

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        inner, self.used_lr = optimizer.inner, []
        step = inner.step

        def recording_step(*args, **kwargs):
            self.used_lr.append(inner.param_groups[0]["lr"])
            return step(*args, **kwargs)
        inner.step = recording_step
        return optimizer


_OPTIM_ARGS = dict(max_steps=3, max_grad_norm=0.5, optim="adamw_torch_fused")


@pytest.fixture(scope="module")
def plain_fused_logs(tmp_path_factory) -> dict[str, list[float]]:
    """Plain Trainer's losses and gradient norms with fused AdamW and torch's clipping (3
    steps clipped at 0.5): the reference of the two roundpipe.optim tests below, run once
    for both (plain floats)."""
    out = tmp_path_factory.mktemp("plain_fused")
    plain = Trainer(model=_model(), args=_args(str(out), **_OPTIM_ARGS), train_dataset=_rows())
    plain.train()
    return {key: _logged(plain, key) for key in ("loss", "grad_norm")}


def test_roundpipe_optim_steps_from_the_gradients_where_they_landed(tmp_path,
                                                                     plain_fused_logs):
    """With roundpipe.optim.AdamW, clipping (and the logged norm) goes through
    pipe.clip_grad_norm_: no float32 .grad is made (4 bytes per parameter on the host),
    and the losses and norms stay plain Trainer's (fused AdamW, torch's clipping)."""
    from roundpipe.runtime.masters import raw_grad

    class Counting(RoundPipeTrainer):
        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            inner, self.fp32_grads = optimizer.inner, []
            params = [p for g in inner.param_groups for p in g["params"]]
            step = inner.step

            def counting_step(*args, **kwargs):
                self.fp32_grads.append(sum(raw_grad(p) is not None for p in params))
                return step(*args, **kwargs)
            inner.step = counting_step
            return optimizer

    piped = Counting(model=_model(), args=_args(str(tmp_path / "pipe"), **_OPTIM_ARGS),
                     train_dataset=_rows(), pipe_options=PIPE, async_step=False,
                     optimizer_cls_and_kwargs=(roundpipe.optim.AdamW, dict(lr=1e-2)))
    piped.train()
    assert piped.fp32_grads == [0, 0, 0]
    for key, want in plain_fused_logs.items():
        got = _logged(piped, key)
        assert len(got) == 3 and max(_rel(g, w) for g, w in zip(got, want)) <= 1e-5, key


def test_exact_steps_with_roundpipe_optim_overlap_the_next_call_and_match_trainer(
        tmp_path, monkeypatch, plain_fused_logs):
    """RoundPipeTrainer's exact step with a roundpipe.optim optimizer takes the overlapped
    path (pipe.step(optimizer): per-unit publish) and still logs plain Trainer's losses
    and gradient norms."""
    frozen = []
    real = roundpipe.optim.AdamW.step_frozen

    def counting(self, *args, **kwargs):
        frozen.append(1)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(roundpipe.optim.AdamW, "step_frozen", counting)
    piped = RoundPipeTrainer(model=_model(), args=_args(str(tmp_path / "pipe"), **_OPTIM_ARGS),
                             train_dataset=_rows(), pipe_options=PIPE, async_step=False,
                             optimizer_cls_and_kwargs=(roundpipe.optim.AdamW,
                                                       dict(lr=1e-2)))
    piped.train()
    assert len(frozen) == 3
    for key, want in plain_fused_logs.items():
        got = _logged(piped, key)
        assert len(got) == 3 and max(_rel(g, w) for g, w in zip(got, want)) <= 1e-5, key


def _resume_run(out: str, checkpoint: str | None) -> RoundPipeTrainer:
    trainer = _RecordingTrainer(
        model=_model(dropout=0.1),
        args=_args(out, save_strategy="steps", save_steps=3, gradient_accumulation_steps=2),
        train_dataset=_rows(), pipe_options={**PIPE, "async_after": 2}, async_step=True)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


def test_resume_from_a_checkpoint_in_a_fresh_process_is_bitwise(forkserver, tmp_path):
    """Asynchronous steps (two exact ones first, then predicted weights), dropout,
    accumulation: 6 steps in one go, and steps 4-6 again in another process from the
    checkpoint of step 3: the same losses and weights, bit for bit."""
    whole = _resume_run(str(tmp_path / "whole"), None)
    assert whole.pipe.predict_weights and whole.pipe.async_after == 2
    assert whole.pipe.host_memory().prediction > 0  # the steps predicted
    # Each asynchronous step ran with the learning rate of its own time, though the
    # scheduler had moved on when it ran.
    assert whole.used_lr == _logged(whole, "learning_rate")
    assert len(set(whole.used_lr)) == STEPS
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / "roundpipe.pt").is_file() and (checkpoint / "optimizer.pt").is_file()
    result = tmp_path / "resumed.json"
    # A fresh process (forked: tests/forkserver.py), this checkout's roundpipe first.
    proc = forkserver.run(os.path.abspath(__file__), [str(tmp_path / "resumed"),
                                                      str(checkpoint), str(result)])
    assert proc.returncode == 0, proc.output[-3000:]
    resumed = json.loads(result.read_text())
    assert len(resumed["losses"]) == STEPS  # 1-3 from the checkpoint, 4-6 run again
    assert resumed["losses"] == _logged(whole, "loss")
    weights = torch.load(tmp_path / "resumed" / "weights.pt")
    for name, p in whole.model.state_dict().items():
        assert torch.equal(weights[name], p), name


def _sft_data():
    """A character tokenizer (made anew per call) and tokenized rows for SFTTrainer."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{chr(40 + i): i for i in range(3, hf.VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    rows = Dataset.from_list([{"input_ids": r["input_ids"].tolist()}
                              for r in _rows(16, ragged=False)])

    def tokenizer():
        return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                       eos_token="<eos>", unk_token="<unk>")
    return tokenizer, rows


def test_roundpipe_pt_is_in_the_checkpoint_before_trainer_state(tmp_path, monkeypatch):
    """Trainer writes trainer_state.json last (and may push the folder to the Hub just
    before): the pipe's state is already there then."""
    from transformers.trainer_callback import TrainerState

    seen, save = [], TrainerState.save_to_json

    def recording_save(self, path):
        seen.append(os.path.isfile(os.path.join(os.path.dirname(path), "roundpipe.pt")))
        return save(self, path)
    monkeypatch.setattr(TrainerState, "save_to_json", recording_save)
    trainer = RoundPipeTrainer(model=_model(), args=_args(str(tmp_path), max_steps=2,
                                                         save_strategy="steps", save_steps=1),
                               train_dataset=_rows(), pipe_options=PIPE)
    trainer.train()
    assert seen == [True, True]


def test_sft_trainer_with_lora_trains_the_adapters_only(tmp_path):
    """TRL's SFTTrainer with peft_config: the same losses as plain SFTTrainer; the base
    weights stay as they were, the adapters move."""
    import trl  # in the test extra
    from peft import LoraConfig

    from roundpipe.hf import RoundPipeSFTTrainer

    make_tokenizer, rows = _sft_data()

    def run(cls, **extra):
        tokenizer = make_tokenizer()
        args = trl.SFTConfig(output_dir=str(tmp_path / cls.__name__), max_steps=3,
                             per_device_train_batch_size=4, learning_rate=1e-2, bf16=False,
                             optim="adamw_torch", logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True)
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj"])
        model = _model()
        base = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = cls(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                      peft_config=lora, **extra)
        adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                    if p.requires_grad}
        trainer.train()
        return trainer, base, adapters

    plain, _, _ = run(trl.SFTTrainer)
    piped, base, adapters = run(RoundPipeSFTTrainer, pipe_options=PIPE, async_step=False)
    want, got = _logged(plain, "loss"), _logged(piped, "loss")
    assert len(got) == 3 and max(_rel(g, w) for g, w in zip(got, want)) <= 1e-5, (got, want)
    assert adapters and all("lora_" in n for n in adapters)
    # TRL's fused head is replaced by a traceable one: the model is cut into stages.
    plan = piped.pipe.plan
    assert len(plan.stages) > 1 and not any("opaque" in note for note in plan.notes)
    params = dict(piped.model.named_parameters())
    for name, before in adapters.items():
        if "lora_A" in name:  # B starts at zero; A moves once B does
            assert not torch.equal(params[name], before), name
    for name, p in piped.model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name


@pytest.mark.parametrize("packing", [dict(padding_free=True, max_length=None),
                                     dict(packing=True), dict(activation_offloading=True),
                                     dict(label_smoothing_factor=0.1), {}])
def test_sft_options_a_pipe_cannot_run_are_refused_at_construction(tmp_path, packing):
    """padding_free (and packing's default 'bfd' strategy, which implies it) put a batch
    in one row with its sequences' boundaries beside it: refused, naming the argument and
    packing_strategy='wrapped'.  activation_offloading too (before TRL hooks the model),
    and label smoothing and compute_loss_func, with which SFTTrainer calls the model twice
    per step (TrainerLossError at the first step before)."""
    import trl

    from roundpipe.hf import RoundPipeSFTTrainer

    make_tokenizer, rows = _sft_data()
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                         bf16=False, report_to=[], use_cpu=True, **packing)
    extra = {} if packing else {"compute_loss_func": _mean_loss_func}
    with pytest.raises(TrainerArgumentError) as error:
        RoundPipeSFTTrainer(model=_model(), args=args, train_dataset=rows,
                            processing_class=make_tokenizer(), pipe_options=PIPE, **extra)
    name = next(iter(packing), "compute_loss_func")
    assert f"{name}={packing[name]!r}" in str(error.value) if packing \
        else f"{name}:" in str(error.value)
    if name in ("padding_free", "packing"):
        assert "packing_strategy='wrapped'" in str(error.value)
    if name in ("label_smoothing_factor", "compute_loss_func"):  # it calls the model twice
        assert "RoundPipeTrainer" in str(error.value)


def test_what_cannot_run_on_a_pipe_is_refused_at_construction(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TrainerArgumentError) as error:
        RoundPipeTrainer(model=model, train_dataset=_rows(),
                         args=_args(str(tmp_path), torch_compile=True,
                                    auto_find_batch_size=True, neftune_noise_alpha=5.0,
                                    per_device_train_batch_size=1),
                         optimizers=(opt, None), pipe_options=PIPE)
    message = str(error.value)
    for name in ("torch_compile", "auto_find_batch_size", "neftune_noise_alpha",
                 "optimizers", "per_device_train_batch_size=1", "num_microbatch=2"):
        assert name in message, name
    assert "compile_units=True" in message  # the way out
    with pytest.raises(TrainerArgumentError, match="optim='adafactor'|optim"):
        RoundPipeTrainer(model=model, args=_args(str(tmp_path), optim="lion_32bit"),
                         train_dataset=_rows(), pipe_options=PIPE)
    from roundpipe import UnknownConfigFieldError
    with pytest.raises(UnknownConfigFieldError, match="num_microbatches"):
        RoundPipeTrainer(model=model, args=_args(str(tmp_path)), train_dataset=_rows(),
                         pipe_options=dict(num_microbatches=2))


def test_an_optimizer_given_to_a_trainer_with_masters_names_what_it_holds(tmp_path):
    """With optim_dtype the pipe's optimizer must hold masters made with the pipe: one
    made before (over model.parameters()) would step nothing; so would a scheduler on
    another optimizer than the trainer's."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(roundpipe.OptimizerError) as error:
        RoundPipeTrainer(model=model, args=_args(str(tmp_path)), train_dataset=_rows(),
                         optimizers=(opt, None), pipe_options=PIPE)
    message = str(error.value)
    assert isinstance(error.value, TrainerArgumentError)
    n = sum(1 for p in model.parameters())
    for part in (f"torch.optim.AdamW holds {n} of the model's own parameters",
                 "'model.embed_tokens.weight'", "optim_dtype=torch.float32",
                 "pipe.optim_parameters()", "optimizer_cls_and_kwargs=(cls, kwargs)"):
        assert part in message, (part, message)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    with pytest.raises(roundpipe.OptimizerError, match=r"optimizers=\(None, LambdaLR\): "
                       "the scheduler is built on torch.optim.AdamW, not on the optimizer "
                       "the trainer creates"):
        RoundPipeTrainer(model=model, args=_args(str(tmp_path)), train_dataset=_rows(),
                         optimizers=(None, sched), pipe_options=PIPE)
    other = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(roundpipe.OptimizerError, match="the scheduler LambdaLR is built on "
                       "torch.optim.AdamW, not on the given torch.optim.SGD"):
        RoundPipeTrainer(model=model, args=_args(str(tmp_path)), train_dataset=_rows(),
                         optimizers=(other, sched), pipe_options=dict(PIPE, optim_dtype=None))


def test_without_masters_a_given_optimizer_and_scheduler_train_as_in_plain_trainer(tmp_path):
    """optim_dtype=None: the model's parameters are what the pipe optimizes, so the
    optimizer and scheduler a user gives train exactly as plain Trainer's (they were
    refused before)."""
    def optimizers(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    args = dict(max_steps=3)
    data = _rows(12)
    model = _model()
    plain = Trainer(model=model, args=_args(str(tmp_path / "plain"), **args),
                    train_dataset=data, optimizers=optimizers(model))
    plain.train()
    model = _model()
    piped = RoundPipeTrainer(model=model, args=_args(str(tmp_path / "pipe"), **args),
                             train_dataset=data, optimizers=optimizers(model),
                             pipe_options=dict(PIPE, optim_dtype=None))
    piped.train()
    for key in ("loss", "learning_rate"):
        want, got = _logged(plain, key), _logged(piped, key)
        assert len(got) == 3 and len(set(got)) == 3, (key, got)
        assert max(_rel(g, w) for g, w in zip(got, want)) <= 1e-5, (key, got, want)
    want = dict(plain.model.named_parameters())
    for name, p in piped.model.named_parameters():
        assert torch.allclose(p, want[name], rtol=0, atol=5e-3 * 1e-2), name


def test_import_roundpipe_leaves_transformers_alone():
    code = ("import sys, roundpipe; assert 'transformers' not in sys.modules; "
            "assert 'trl' not in sys.modules")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


if __name__ == "__main__":  # the resumed half of the resume test, in a fresh process
    out, checkpoint, result = sys.argv[1:]
    trainer = _resume_run(out, checkpoint)
    with open(result, "w") as f:
        json.dump({"losses": _logged(trainer, "loss")}, f)
    torch.save(trainer.model.state_dict(), os.path.join(out, "weights.pt"))
