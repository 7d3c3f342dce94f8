"""``roundpipe.GradScaler`` made the way ``torch.amp.GradScaler`` is (the scale first, or
a device, or nothing) binds to the pipe it is first used with, and torch.amp's training
loop runs unchanged but for names: the results are the same as with the pipe passed
first."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import hf_models as hf
import roundpipe
from roundpipe import ConfigError, RoundPipe, RoundPipeRunConfig

STEPS = 3


def _loop_forward(make_scaler: Callable[[RoundPipe], roundpipe.GradScaler]) -> list:
    """The reference's loop: pipe(x), scaler.scale(loss).backward(), step, update."""
    model = hf.build("llama", torch.float16, seed=0)
    inputs, labels = hf.batch("llama")
    losses = []
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        scaler = make_scaler(pipe)
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
        for _ in range(STEPS):
            out = pipe(**inputs)
            logits = out.logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
            scaler.scale(loss).backward()
            pipe.step(lambda: (scaler.step(opt), opt.zero_grad(), None)[-1])
            scaler.update()
            losses.append(loss.detach())
        pipe.synchronize()
        return losses + [p.detach().clone() for p in pipe.optim_parameters()]


def _loop_forward_backward(make_scaler: Callable[[RoundPipe], roundpipe.GradScaler]) -> list:
    model = hf.build("llama", torch.float16, seed=0)
    inputs, labels = hf.batch("llama")
    losses = []
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        scaler = make_scaler(pipe)
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
        for _ in range(STEPS):
            loss = pipe.forward_backward(input_kwargs={**inputs, "labels": labels},
                                         loss_fn=lambda out, _: scaler.scale(out.loss))
            pipe.step(lambda: (scaler.step(opt), opt.zero_grad(), None)[-1])
            scaler.update()
            losses.append(loss.detach())
        pipe.synchronize()
        return losses + [p.detach().clone() for p in pipe.optim_parameters()]


@pytest.mark.parametrize("loop, spelling", [
    (_loop_forward, lambda: roundpipe.GradScaler(8192.0)),
    (_loop_forward_backward, lambda: roundpipe.GradScaler("cuda", init_scale=8192.0))],
    ids=["forward-scale_first", "forward_backward-device_first"])
def test_torch_amp_style_scaler_equals_the_pipe_first_one(loop, spelling) -> None:
    """A scaler made without the pipe binds to it in loss_fn and steps alike, bitwise."""
    bound = loop(lambda pipe: roundpipe.GradScaler(pipe, 8192.0))
    lazy = loop(lambda pipe: spelling())
    assert all(torch.equal(a, b) for a, b in zip(lazy, bound))
    assert all(torch.isfinite(x).all() for x in bound)


def test_torch_amp_spellings_make_the_same_unbound_scaler() -> None:
    made = [roundpipe.GradScaler(8192.0), roundpipe.GradScaler("cuda", init_scale=8192.0),
            roundpipe.GradScaler(init_scale=8192.0), roundpipe.GradScaler(device="cuda",
                                                                           init_scale=8192.0)]
    fields = [(s.get_scale(), s.growth_factor, s.backoff_factor, s.growth_interval,
               s.enabled, s._pipe) for s in made]
    assert fields == [(8192.0, 2.0, 0.5, 2000, True, None)] * len(made)


def test_a_wrong_first_argument_is_a_clear_error() -> None:
    for wrong in ([1], torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1),
                  torch.nn.Linear(2, 2)):
        with pytest.raises(ConfigError, match="first argument is the RoundPipe"):
            roundpipe.GradScaler(wrong)


def test_step_outside_a_pipe_says_where_to_call_it() -> None:
    scaler = roundpipe.GradScaler(1024.0)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)
    import threading
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_catch(lambda: scaler.step(opt))))
    thread.start()
    thread.join()
    assert isinstance(errors[0], ConfigError) and "pipe.step(lambda" in str(errors[0])


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None
