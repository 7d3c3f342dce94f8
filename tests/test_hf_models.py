"""Hugging Face models, unchanged: Llama, Qwen3, GPT-2 (tied embeddings), BERT (an
encoder) and Qwen3-MoE / Mixtral (data-dependent routing) compile to one unit per layer and
train with loss and gradients equal to eager PyTorch (the per-microbatch loop of
``reference.py``) on 1 and 3 virtual CPU devices, loss inside or outside the model."""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import pytest
import torch

import hf_models as hf
from conftest import SHARED_PIPES
import reference
from roundpipe import RoundPipe, RoundPipeRunConfig, RoundPipeError, TraceError

NUM_MB = 3
_pipes: dict[tuple, tuple[RoundPipe, torch.nn.Module]] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_pipes():
    yield
    for pipe, _ in _pipes.values():
        pipe.close()
    _pipes.clear()


@pytest.fixture(autouse=True)
def _reset_shared_pipes():
    """Each test sees the shared pipes as new: no gradients, call number 0 (the dropout
    keys), training mode; so results do not depend on which tests ran before."""
    for pipe, eager in _pipes.values():
        for p in pipe.optim_parameters():
            p.grad = None
        eager.zero_grad(set_to_none=True)
        pipe.call_number = 0
        pipe.train()
        eager.train()
    yield


def _pipe(name: str, devices: int, dtype: torch.dtype = torch.float32,
          **overrides: Any) -> tuple[RoundPipe, torch.nn.Module]:
    """A pipe and an identical eager model, shared by the tests of this module (each test
    clears the gradients it reads)."""
    key = (name, devices, dtype, tuple(sorted(overrides.items())))
    if key not in _pipes:
        model = hf.build(name, dtype, **overrides)
        eager = copy.deepcopy(model)
        pipe = RoundPipe(model, devices=["cpu"] * devices,
                         model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB))
        SHARED_PIPES.add(pipe)
        _pipes[key] = (pipe, eager)
    return _pipes[key]


def _compare(pipe: RoundPipe, eager: torch.nn.Module, inputs: dict, label: Any, loss_fn,
             tol: float) -> torch.Tensor:
    """One forward_backward against the eager loop; returns the loss."""
    for p in pipe.optim_parameters():
        p.grad = None
    eager.zero_grad(set_to_none=True)
    loss = pipe.forward_backward(input_kwargs=inputs, label=label, loss_fn=loss_fn)
    ref = reference.eager_forward_backward(eager, (), inputs, label, loss_fn, NUM_MB)
    assert hf.rel_err(loss, ref) <= tol, (loss, ref)
    ref_params = dict(eager.named_parameters())
    named = pipe.optim_named_parameters()
    assert [n for n, _ in named] == [n for n, p in eager.named_parameters() if p.requires_grad]
    for pname, p in named:
        ref_grad = ref_params[pname].grad
        if ref_grad is None or not ref_grad.any():
            assert p.grad is None or not p.grad.any(), pname
            continue
        assert p.grad is not None, f"{pname} got no gradient"
        assert hf.rel_err(p.grad, ref_grad) <= tol, (pname, hf.rel_err(p.grad, ref_grad))
    return loss


# --- plans --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", hf.ALL)
def test_plan_has_one_block_unit_per_layer(name: str) -> None:
    pipe, _ = _pipe(name, 3)
    inputs, labels = hf.batch(name)
    plan = pipe.compile((), {**inputs, "labels": labels})
    blocks = [u.name for u in plan.units if u.kind == "block"]
    assert blocks == hf.decoder_layers(pipe.model)
    assert plan.units[0].kind == "prologue" and plan.units[-1].kind == "epilogue"
    assert plan.program.trace_method == "export" and plan.notes == ()
    # Three devices: devices + 1 stages, forward first, one fused tail, backward last.
    kinds = [s.kind for s in plan.stages]
    assert len(kinds) == 4 and kinds.count("fused") == 1
    assert kinds[0] == "fwd" and kinds[-1] == "bwd"
    assert "fused" in str(plan)


def test_tied_embeddings_are_one_state_slot() -> None:
    """GPT-2's lm_head.weight is transformer.wte.weight: one slot, read by two units, and
    one gradient holding both contributions (checked against eager in the tests below)."""
    pipe, _ = _pipe("gpt2", 3)
    inputs, labels = hf.batch("gpt2")
    plan = pipe.compile((), {**inputs, "labels": labels})
    tied = [s for s in plan.program.state if "lm_head.weight" in (s.fqn,) + s.aliases]
    assert len(tied) == 1 and set((tied[0].fqn,) + tied[0].aliases) == {
        "transformer.wte.weight", "lm_head.weight"}
    assert len(tied[0].units) == 2


# --- exactness ----------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("name", hf.ALL)
def test_loss_inside_the_model_matches_eager(name: str, devices: int) -> None:
    pipe, eager = _pipe(name, devices)
    inputs, labels = hf.batch(name)
    _compare(pipe, eager, {**inputs, "labels": labels}, None, hf.inner_loss, 1e-5)


# Each family with 3 devices (its program without labels, cut into stages); one device for
# a causal LM and for BERT (the two losses): one device runs the same schedule and the
# same user loss for every causal LM, each of which has its own 1-device program with
# labels above.  (qwen3, gpt2 and qwen3_moe on 1 device: one trace each, ~2.5 s CPU.)
@pytest.mark.parametrize("name,devices",
                         [("llama", 1), ("bert", 1)] + [(name, 3) for name in hf.ALL])
def test_loss_outside_the_model_matches_eager(name: str, devices: int) -> None:
    pipe, eager = _pipe(name, devices)
    inputs, labels = hf.batch(name)
    _compare(pipe, eager, inputs, labels, hf.outer_loss(name), 1e-5)


def test_float64_llama_with_variable_sequence_length_is_one_dynamic_program() -> None:
    """Export keeps batch and sequence dimensions dynamic: new lengths reuse the program,
    and the results equal eager to float64 precision for each of them."""
    pipe, eager = _pipe("llama", 3, torch.float64)
    for seq in (10, 7, 13):
        inputs, labels = hf.batch("llama", seq=seq, seed=seq)
        _compare(pipe, eager, {**inputs, "labels": labels}, None, hf.inner_loss, 1e-10)
    assert len(pipe.plans) == 1
    # Any batch, any length from 2 (export traces lengths 0 and 1 apart).
    assert all(dims == (None, (2, None)) for _, _, dims in pipe.plan.program.inputs.static)


def test_data_dependent_moe_runs_its_experts_as_leaves_in_float64() -> None:
    """Mixtral with ``experts_implementation="eager"`` loops over the experts that the
    router picked (``for e in mask.nonzero()``): export fails inside MixtralExperts, so that
    class is kept opaque and the rest is exported.  Shapes are then static: a new sequence
    length is one recompile, which goes straight to the leaves."""
    pipe, eager = _pipe("mixtral", 3, torch.float64, _experts_implementation="eager")
    inputs, labels = hf.batch("mixtral")
    _compare(pipe, eager, {**inputs, "labels": labels}, None, hf.inner_loss, 1e-10)
    plan = pipe.plan
    assert plan.program.trace_method == "export-leaves"
    assert plan.notes[0].startswith("export failed") and "modeling_mixtral.py:" in plan.notes[0]
    assert "MixtralExperts at model.layers.0.mlp.experts and 1 more" in plan.notes[-1]
    assert [u.name for u in plan.units if u.kind == "block"] == hf.decoder_layers(pipe.model)
    inputs, labels = hf.batch("mixtral", seq=7, seed=7)
    _compare(pipe, eager, {**inputs, "labels": labels}, None, hf.inner_loss, 1e-10)
    assert len(pipe.plans) == 2
    assert pipe.plan.notes == (plan.notes[-1],)  # no failed attempts the second time


# --- side inputs --------------------------------------------------------------------------

def test_side_inputs_reach_every_stage() -> None:
    """The padding mask and position ids enter in the prologue; the mask built from them and
    the rotary cos/sin are read by every decoder layer, including those in later stages."""
    pipe, eager = _pipe("llama", 3)
    inputs, labels = hf.batch("llama")
    # Different spacing per row (rotary attention only sees relative positions).
    position_ids = torch.arange(10) * (torch.arange(6).unsqueeze(1) + 1)
    inputs = {**inputs, "position_ids": position_ids, "labels": labels}
    loss = _compare(pipe, eager, inputs, None, hf.inner_loss, 1e-5)
    plan = pipe.plan
    program = plan.program
    producer = {v: u.index for u in program.units for v in u.outputs}
    rotary = next(u.index for u in plan.units if u.name.endswith("rotary_emb"))
    blocks = [u for u in program.units if plan.units[u.index].kind == "block"]
    side = [{v for v in u.inputs if producer.get(v, -1) < blocks[0].index} for u in blocks]
    # Every layer but the first reads the same prologue values (layer 0 also reads the
    # embeddings): the mask and the rotary cos/sin among them.
    assert all(s == side[-1] for s in side[1:]) and side[-1] <= side[0]
    assert sum(producer.get(v) == rotary for v in side[-1]) == 2
    mask_unit = next(u.index for u in program.units if "attention_mask" in u.inputs)
    assert any(producer.get(v) == mask_unit for v in side[-1])
    last = next(s for s in plan.stages
                if s.kind != "bwd" and s.units[0] <= blocks[-1].index < s.units[1])
    assert last.units[0] > rotary  # they really cross into another stage
    # And they matter: other position ids or no padding give another loss.
    default = {**inputs, "position_ids": torch.arange(10).repeat(6, 1)}
    assert not torch.equal(pipe.forward_backward(input_kwargs=default,
                                                 loss_fn=hf.inner_loss), loss)
    unpadded = {**inputs, "attention_mask": torch.ones_like(inputs["attention_mask"])}
    assert not torch.equal(pipe.forward_backward(input_kwargs=unpadded,
                                                 loss_fn=hf.inner_loss), loss)


# --- caches -------------------------------------------------------------------------------

def test_use_cache_is_turned_off_with_a_log_line(caplog) -> None:
    """Left on, the model returns a DynamicCache, which export cannot flatten."""
    model = hf.build("llama")
    assert model.config.use_cache is True
    with caplog.at_level(logging.INFO, logger="roundpipe"):
        pipe = RoundPipe(model, devices=["cpu"])
    assert model.config.use_cache is False
    assert any("use_cache = False in 1 config(s) of LlamaForCausalLM" in r.getMessage()
               and r.levelno == logging.INFO for r in caplog.records)
    pipe.close()


def test_encoder_decoder_with_a_config_per_stack_trains() -> None:
    """T5's decoder stack holds its own copy of the config, whose use_cache must go off too
    (else the decoder returns an EncoderDecoderCache); then it matches eager."""
    torch.manual_seed(0)
    config = hf.transformers.T5Config(vocab_size=hf.VOCAB, d_model=32, d_kv=8, d_ff=64,
                                      num_layers=2, num_heads=4, dropout_rate=0.0,
                                      decoder_start_token_id=0)
    model = hf.transformers.T5ForConditionalGeneration(config)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB))
    assert model.decoder.config.use_cache is False
    inputs, _ = hf.batch("llama")
    inputs["labels"] = inputs["input_ids"][:, 2:8].contiguous()
    _compare(pipe, eager, inputs, None, hf.inner_loss, 1e-5)
    blocks = [u.name for u in pipe.plan.units if u.kind == "block"]
    assert blocks == ["encoder.block.0", "encoder.block.1", "decoder.block.0",
                      "decoder.block.1"]
    pipe.close()


# --- what an untraceable model gets -------------------------------------------------------

class _ClampedLlama(hf.transformers.LlamaForCausalLM):
    """A user's subclass with data-dependent control flow in the top-level forward."""

    def forward(self, input_ids=None, **kwargs):
        if input_ids.max() >= 64:  # data-dependent: no tracer handles this
            input_ids = input_ids % 64
        return super().forward(input_ids=input_ids, **kwargs)


def test_untraceable_hf_model_error_names_class_line_and_ways_out() -> None:
    model = _ClampedLlama(hf.config("llama"))
    pipe = RoundPipe(model, devices=["cpu"])
    inputs, _ = hf.batch("llama")
    with pytest.raises(RoundPipeError) as info:
        pipe.compile((), inputs)
    message = str(info.value)
    assert isinstance(info.value, TraceError)
    lines, start = inspect.getsourcelines(_ClampedLlama.forward)
    line = start + next(i for i, s in enumerate(lines) if "input_ids.max() >= 64" in s)
    assert message.startswith("could not trace _ClampedLlama;")
    assert f"test_hf_models.py:{line} in forward: if input_ids.max() >= 64:" in message
    assert "runs in _ClampedLlama.forward itself" in message
    assert "leaf_modules=" in message and "attn_implementation=" in message
    pipe.close()


# --- models with custom autograd Functions (regressed once) --------------------------------

def _fresh(name: str, devices: int, dtype: torch.dtype, train: bool = True,
           **overrides: Any) -> tuple[RoundPipe, torch.nn.Module]:
    model = hf.build(name, dtype, **overrides).train(train)
    eager = copy.deepcopy(model)
    return RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB)), eager


@pytest.mark.parametrize("devices", [1, 3])
def test_recurrent_gemma_matches_eager_in_float64(devices: int) -> None:
    """Its recurrent block (a custom Function inside: kept opaque) sets attributes while it
    runs; with several devices running it at once, one call read another's (a tensor
    whose graph was already freed: "backward through the graph a second time")."""
    pipe, eager = _fresh("recurrent_gemma", devices, torch.float64)
    with pipe:
        inputs, labels = hf.batch("recurrent_gemma")
        for _ in range(2):
            _compare(pipe, eager, {**inputs, "labels": labels}, None, hf.inner_loss, 1e-10)


def test_phimoe_matches_eager_and_is_device_count_invariant() -> None:
    """PhiMoE's router is a custom Function (kept opaque) and samples its experts in
    training mode: eval-mode training steps equal eager in float64 (experts looped in
    Python: eager float64 has no grouped matmul on the CPU), and training-mode steps are
    bitwise equal on 1 and 3 devices (the sampling is keyed like dropout)."""
    overrides = {"_experts_implementation": "eager"}
    # (3 devices against eager; the device counts are compared bitwise below)
    pipe, eager = _fresh("phimoe", 3, torch.float64, train=False, **overrides)
    with pipe:
        inputs, labels = hf.batch("phimoe")
        _compare(pipe, eager, {**inputs, "labels": labels}, None, hf.inner_loss, 1e-10)
    pipe, eager = _fresh("phimoe", 3, torch.float32, train=False)  # grouped-matmul experts
    with pipe:
        _compare(pipe, eager, {**inputs, "labels": labels}, None, hf.inner_loss, 1e-5)
    results = []
    for devices in (1, 3):
        pipe, _ = _fresh("phimoe", devices, torch.float64, **overrides)
        with pipe:
            inputs, labels = hf.batch("phimoe")
            loss = pipe.forward_backward(input_kwargs={**inputs, "labels": labels},
                                         loss_fn=hf.inner_loss)
            results.append((loss, [p.grad.clone() for p in pipe.optim_parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
