"""``RoundPipe.host_memory()``: the bytes roundpipe holds on the host, by category, each
storage once, checked against the tensors themselves."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import models
from roundpipe import ConfigError, HostMemory, RoundPipe, RoundPipeRunConfig


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def _train(pipe, args, kwargs, steps, opt):
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    for _ in range(steps):
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
    pipe.synchronize()
    pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)


@pytest.mark.parametrize("optim_dtype", [torch.float32, None])
def test_categories_match_the_tensors(optim_dtype):
    """bf16 weights, fp32 masters (or none), AdamW: each category is exactly the bytes of
    its tensors; the tied embedding counts once."""
    model, args, kwargs = models.gpt()
    model = model.to(torch.bfloat16 if optim_dtype is not None else torch.float32)
    params = list(model.parameters())  # tied head/embedding: listed once
    n = sum(p.numel() for p in params)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=optim_dtype,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
        _train(pipe, args, kwargs, 2, opt)
        mem = pipe.host_memory(opt)
        assert isinstance(mem, HostMemory)
        assert mem.trainable_params == n
        assert mem.weights == _nbytes(params + list(model.buffers()))
        grads = [p.grad for p in pipe.optim_parameters()]
        moments = [v for s in opt.state.values() for v in s.values()]
        if optim_dtype is None:
            assert mem.masters == 0  # the parameters are the masters
            assert mem.gradients == 4 * n
        else:
            assert mem.masters == 4 * n
            assert mem.gradients == _nbytes(grads) == 4 * n
        assert mem.optimizer_state == _nbytes(moments)
        assert mem.optimizer_state >= 8 * n  # two fp32 moments (+ step counts)
        # What the landing holds that no .grad does: at least one download buffer per
        # parameter in the model's dtype (the landing keeps one per unit that reads it).
        elt = params[0].element_size()
        assert mem.landing >= elt * n
        assert mem.total == sum(getattr(mem, c) for c in
                                ("weights", "masters", "gradients", "optimizer_state",
                                 "landing", "constants"))
        assert mem.bytes_per_param() == pytest.approx((mem.total - mem.weights) / n)
        assert [d.name for d in mem.devices] == ["cpu:0", "cpu:1"]
        assert all(d.resident_bytes == 0 and d.peak_bytes_last_call > 0 for d in mem.devices)
        text = str(mem)
        assert "optimizer_state" in text and "B/trainable param" in text


def test_frozen_parameters_get_no_master_gradient_or_state():
    model, args, kwargs = models.gpt()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("h.0."))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1, momentum=0.9)
        _train(pipe, args, kwargs, 1, opt)
        mem = pipe.host_memory(opt)
        assert mem.trainable_params == trainable
        assert mem.masters == mem.gradients == 8 * trainable
        assert mem.optimizer_state == 8 * trainable  # one fp64 momentum buffer


def test_without_an_optimizer_its_state_is_not_counted_and_categories_are_checked():
    model, args, kwargs = models.gpt()
    with RoundPipe(model, devices=["cpu"]) as pipe:
        mem = pipe.host_memory()
        assert mem.optimizer_state == 0 and mem.gradients == 0 and mem.landing == 0
        assert mem.devices[0].peak_bytes_last_call == 0  # nothing ran yet
        with pytest.raises(ConfigError, match="no category 'moments'"):
            mem.bytes_per_param("moments")


def test_a_storage_shared_by_two_categories_counts_once():
    """An optimizer whose state aliases a master (or a gradient) adds nothing."""
    lin = nn.Linear(64, 64)
    with RoundPipe(nn.Sequential(lin), devices=["cpu"]) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        opt.state[lin.weight]["alias"] = lin.weight.detach()[:3]
        opt.state[lin.bias]["own"] = torch.zeros(10)
        mem = pipe.host_memory(opt)
        assert mem.optimizer_state == 40
        assert mem.weights == (64 * 64 + 64) * 4


def test_host_memory_inside_a_step_fn_does_not_hang():
    """A step_fn that reports memory while the next call waits for that step."""
    import threading

    model, args, kwargs = models.gpt()
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        seen = []
        loss_fn = lambda out, _: out["logits"].pow(2).mean()  # noqa: E731
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)

        def run():
            pipe.step(lambda: (seen.append(pipe.host_memory(opt)), opt.step(),
                               opt.zero_grad()))
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
            pipe.synchronize()
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "host_memory() inside a step_fn hung"
        assert seen and seen[0].gradients == 4 * seen[0].trainable_params
