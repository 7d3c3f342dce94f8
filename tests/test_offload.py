"""The disk tier (``RoundPipe(..., offload_dir=PATH)``): masters and roundpipe.optim's
state in files, staged unit by unit during a step.  Checked bitwise against the same run
in host memory, for failed and killed steps, checkpoints and the accounting."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import models
import roundpipe.optim
from roundpipe import (ConfigError, OptimizerError, RoundPipe, RoundPipeRunConfig,
                       StepError, load_checkpoint, save_checkpoint)
from roundpipe.runtime.offload import RESIDENT_BYTES, OffloadError, read_committed

STEPS = 3


def _model():
    model, args, kwargs = models.gpt(layers=3, batch=4, seq=8)
    return model.to(torch.bfloat16), args, kwargs


def _loss(out, _label):
    return out["logits"].float().square().mean()


def _opt(pipe, name, state_dtype):
    if name == "AdamW":
        return roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2, weight_decay=0.1,
                                     state_dtype=state_dtype)
    return roundpipe.optim.SGD(pipe.optim_parameters(), lr=1e-2, momentum=0.9,
                               state_dtype=state_dtype)


def _train(model, args, kwargs, devices, name, state_dtype, offload_dir=None, steps=STEPS,
           on_pipe=None):
    pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                     offload_dir=offload_dir,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = _opt(pipe, name, state_dtype)
    if on_pipe is not None:
        on_pipe(pipe, opt)
    for _ in range(steps):
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
    return pipe, opt


def _snapshot(pipe, opt):
    """Weights, masters (state_dict) and optimizer state, as plain tensors."""
    weights = {n: p.detach().clone() for n, p in pipe.model.named_parameters()}
    masters = {k: v.clone() for k, v in pipe.state_dict().items()}
    state = opt.state_dict()["state"]
    return weights, masters, {i: {k: v.clone() for k, v in s.items()}
                              for i, s in state.items()}


def _assert_equal(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], dict):
                _assert_equal([x[k]], [y[k]])
            else:
                assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("name, state_dtype, devices", [
    ("AdamW", None, 1), ("AdamW", None, 3), ("AdamW", torch.bfloat16, 3), ("SGD", None, 1),
    ("SGD", torch.bfloat16, 3)])
def test_steps_with_the_disk_tier_equal_the_run_in_memory_bitwise(
        tmp_path, name, state_dtype, devices):
    model, args, kwargs = _model()
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, kwargs, devices, name,
                               state_dtype)
    pipe, opt = _train(model, args, kwargs, devices, name, state_dtype,
                       offload_dir=tmp_path / "tier")
    try:
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref_pipe, ref_opt))
        # Between steps neither masters nor moments are in memory.
        assert all(m.untyped_storage().nbytes() == 0 for m in pipe.optim_parameters())
        assert all(v.untyped_storage().nbytes() == 0 for s in opt.state.values()
                   for v in s.values() if v.numel() * v.element_size() > RESIDENT_BYTES)
        # The committed files hold the same values.
        step, files = read_committed(tmp_path / "tier")
        assert step == STEPS
        ref_masters = dict(ref_pipe.optim_named_parameters())
        for n, m in ref_masters.items():
            assert torch.equal(files[f"master/{n}"], m.detach()), n
    finally:
        pipe.close()
        ref_pipe.close()
