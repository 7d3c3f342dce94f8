"""The lifetime-based stage memory estimate (``passes/memory.py``) against the device
memory measured on virtual devices (``measure_memory``): every stage's
``StageSpec.memory_bytes`` / ``RunStats.stage_peak_bytes`` must lie in [0.95, 1.07], at
both recompute grains, 1 and 4 microbatches, 1 and 4 devices.  Measured on 2026-11-26
(the byte counts do not depend on the machine's load): 0.959 (T5's loss stage) to 1.059
(the GPT's loss stage), most forward and backward stages 1.000.  The band was [0.95,
1.15] (issue 18); with it, an estimate 2.5% high on every stage passed (issue 33).
Each (model, devices) is one pipe whose calls take the (microbatches, grain) pairs in
turn: each call is planned and estimated for its own microbatch (0578030), and the
ratios are those of a fresh pipe per pair."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import models
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.passes.cost import DeviceModel
from roundpipe.passes.memory import MemoryModel

BAND = (0.95, 1.07)


def _ce(out, labels):
    logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _gpt():
    torch.manual_seed(0)
    model = models.GPT(vocab=128, d=64, layers=4, max_len=32)
    return model, (torch.randint(0, 128, (8, 32)),), {}, torch.randint(0, 128, (8, 32))


def _hf_lm(name, **overrides):
    # 2 layers: the same jobs (3 on 1 device, 5 on 4) and ratios as with 4 (measured
    # 2026-11-27: BERT's lowest 0.974, Llama's and Qwen3-MoE's as before), in less time
    def case():
        hf = pytest.importorskip("hf_models")
        model = hf.build(name, num_hidden_layers=2, hidden_size=64, **overrides)
        ids = torch.randint(1, hf.VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
        return model, (), {"input_ids": ids}, ids
    return case


def _vit():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=32, patch_size=4, hidden_size=64,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=128, num_labels=10)
    model = transformers.ViTForImageClassification(cfg).train()
    return model, (torch.randn(8, 3, 32, 32),), {}, torch.randint(0, 10, (8,))


def _t5():  # encoder-decoder: the decoder reads the encoder's output in every block
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (8, 32), generator=g)
    labels = torch.randint(1, 128, (8, 16), generator=g)
    return model, (), {"input_ids": ids, "labels": labels}, labels


def _resnet():  # BatchNorm: running statistics are written by the forward
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64],
                                    depths=[1, 1, 1], num_labels=10)
    model = transformers.ResNetForImageClassification(cfg).train()
    return model, (torch.randn(8, 3, 32, 32),), {}, torch.randint(0, 10, (8,))


CASES = {"gpt": _gpt, "llama": _hf_lm("llama"), "bert": _hf_lm("bert"), "t5": _t5,
         "qwen3_moe": _hf_lm("qwen3_moe"), "vit": _vit, "resnet": _resnet}

# Every model on half of the 2 x 2 x 2 grid of (devices, microbatches, grain), the two
# halves taken by turns (each model sees both values of every factor, and every pair of
# factors' values); the GPT, whose loss stage comes nearest the band's top, on all eight.
# ROUNDPIPE_FULL_MATRIX=1 runs every model on all eight (about twice the time).
_HALVES = ([(1, 1, "stage"), (1, 4, "layer"), (4, 1, "layer"), (4, 4, "stage")],
           [(1, 1, "layer"), (1, 4, "stage"), (4, 1, "stage"), (4, 4, "layer")])
_FULL = os.environ.get("ROUNDPIPE_FULL_MATRIX") == "1"
# One pipe per (model, devices) runs its (microbatches, grain) pairs in turn: both are run
# options, planned from the one trace (most of the time), and each call's peaks are its own.
MATRIX = [(m, d, tuple((mb, g) for dd, mb, g in half if dd == d))
          for i, m in enumerate(CASES)
          for half in [_HALVES[0] + _HALVES[1] if _FULL or m == "gpt" else _HALVES[i % 2]]
          for d in (1, 4)]


def _ratios(name, devices, runs):
    """Per (microbatches, grain) in ``runs``: (stage, kind, estimate, measured peak)."""
    model, args, kwargs, labels = CASES[name]()
    pipe = RoundPipe(model, devices=["cpu"] * devices, measure_memory=True)
    try:
        result = {}
        for microbatches, grain in runs:
            cfg = RoundPipeRunConfig(num_microbatch=microbatches, recompute_grain=grain)
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=labels,
                                  loss_fn=_ce, run_config=cfg)
            pipe.synchronize()
            plan, peaks = pipe.plan, pipe.stats().stage_peak_bytes
            assert plan.num_microbatch == microbatches
            assert plan.costs and isinstance(pipe._current.analysis.report.memory,
                                             MemoryModel)
            result[(microbatches, grain)] = [(s.index, s.kind, s.memory_bytes, peaks[s.index])
                                             for s in plan.stages]
        return result
    finally:
        pipe.close()


@pytest.mark.parametrize("name, devices, runs", MATRIX,
                         ids=[f"{m}-{d}" for m, d, _ in MATRIX])
def test_stage_estimate_is_within_band_of_measured_peak(name, devices, runs):
    outside = []
    for (microbatches, grain), rows in _ratios(name, devices, runs).items():
        table = ", ".join(f"{i} {kind} {est / peak:.3f}" for i, kind, est, peak in rows)
        print(f"{name} devices={devices} mb={microbatches} grain={grain}: {table}")
        outside += [(microbatches, grain, i, kind, round(est / peak, 3))
                    for i, kind, est, peak in rows if not BAND[0] <= est / peak <= BAND[1]]
    assert not outside, f"estimate/measured outside {BAND}: {outside}"


def test_cuda_device_model_rounds_each_tensor_to_512_bytes():
    model, args, kwargs = models.gpt(layers=2, batch=6)
    plans = {}
    for block in (1, 512):
        device_model = DeviceModel("x", 5e10, 1e10, 1e10, 4e-6, block_bytes=block)
        plans[block] = RoundPipe(model, devices=["cpu"] * 2, device_model=device_model,
                                 ).compile(args, kwargs)
    for small, rounded in zip(plans[1].stages, plans[512].stages):
        # every tensor of this tiny GPT is a few hundred bytes: rounding adds a lot
        assert rounded.memory_bytes > small.memory_bytes


@pytest.mark.parametrize("devices, microbatches", [(1, 4), (4, 4)])
def test_device_memory_bounds_the_measured_device_peak(devices, microbatches):
    """``plan.device_memory_bytes`` (a job at its peak and the weights prefetched for the
    next, together: what the memory budget is checked against) against the most bytes a
    device held during a call, prefetched weights included.  On one device the largest
    job and the prefetch share the device and the bound is met (measured: 1.001
    of it); on four it is an upper bound (0.66 of it)."""
    torch.manual_seed(0)
    model = models.GPT(vocab=128, d=64, layers=4, max_len=32)
    x = torch.randint(0, 128, (8, 32))
    pipe = RoundPipe(model, devices=["cpu"] * devices, measure_memory=True,
                     model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))
    try:
        pipe.forward_backward(input_args=(x,), label=x, loss_fn=models.lm_loss)
        pipe.synchronize()
        bound = pipe.plan.device_memory_bytes
        ratios = [d.peak_allocated_bytes / bound for d in pipe.stats().devices]
    finally:
        pipe.close()
    assert max(ratios) <= 1.01, ratios
    if devices == 1:
        assert max(ratios) >= 0.93, ratios
