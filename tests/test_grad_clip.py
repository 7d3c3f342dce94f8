"""Clipping and loss-scale unscaling of gradients held where they landed
(``roundpipe.optim``): ``pipe.clip_grad_norm_`` and ``roundpipe.GradScaler`` give what
torch's functions give on float32 ``.grad`` tensors, without making those tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_models as hf
import models
import roundpipe
import roundpipe.optim
from roundpipe import NonFiniteGradientError, RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.masters import owner_of, raw_grad

MAX_NORM = 0.05  # below the gradients' norm, so every step clips


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)
            ).item()


def _loss(out, _):
    return out["logits"].float().pow(2).mean()


def _train(ours: bool, devices: int = 2, steps: int = 3, read_grads: bool = False,
           is_async: bool = False, dtype=torch.bfloat16, master=torch.float32,
           kernel: str = "fused"):
    """bf16 GPT, fp32 masters, exact steps, every step clipped: roundpipe.optim.AdamW with
    pipe.clip_grad_norm_, or torch's fused AdamW with torch's clip_grad_norm_.  Against
    torch, ours runs torch's fused kernel too: the model's gradients depend on its bf16
    weights, so a last-bit difference in a master (the native kernel's, within 1e-6)
    can round a weight the other way and grow over the steps."""
    model, args, kwargs = models.gpt(layers=2)
    norms, fp32_grads, measured, grads = [], [], [], []
    with RoundPipe(model.to(dtype), devices=["cpu"] * devices, optim_dtype=master,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        params = pipe.optim_parameters()
        if ours:
            opt = roundpipe.optim.AdamW(params, lr=1e-2, weight_decay=0.1, kernel=kernel)
        else:
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)

        def step():
            if ours:
                landed = owner_of(params[0])[0]
                measured.append(sum(landed.norm(owner_of(p)[1]) is not None for p in params))
                norms.append(pipe.clip_grad_norm_(MAX_NORM))
                fp32_grads.append(sum(raw_grad(p) is not None for p in params))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
            if read_grads:
                grads.append([p.grad.clone() for p in params])
            opt.step()
            opt.zero_grad()

        for _ in range(steps):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=_loss)
            pipe.step(step, is_async=is_async)
        pipe.synchronize()
        tied = 1  # the tied embedding: two units add to it, in an fp32 .grad
        return dict(masters=[p.detach().clone() for p in params], norms=norms,
                    fp32_grads=fp32_grads, tied=tied, measured=measured, grads=grads)


def test_clip_equals_torch_and_makes_no_fp32_grads():
    ours, ref = _train(True), _train(False)
    assert all(n > MAX_NORM for n in ref["norms"])  # every step clipped
    for a, b in zip(ours["norms"], ref["norms"]):
        assert _rel(a, b) <= 1e-6
    for a, b in zip(ours["masters"], ref["masters"]):
        assert _rel(a, b) <= 1e-6
    # Only the tied embedding has a float32 .grad; the rest stays where it landed.
    assert ours["fp32_grads"] == [ours["tied"]] * 3
    # The commit after the first clipping step turns the devices' norms on: the call
    # after that one measures them, whatever the timing.
    assert ours["measured"][:2] == [0, 0] and ours["measured"][2] > 0


def test_clip_of_float64_gradients_measured_on_the_devices():
    """Device norms of float64 gradients keep float64 (a float32 accumulation was
    refused by torch, and failed every call after the first clip)."""
    ours = _train(True, steps=4, dtype=torch.float64, master=torch.float64)
    ref = _train(False, steps=4, dtype=torch.float64, master=torch.float64)
    assert ours["measured"][-1] > 0
    for a, b in zip(ours["norms"], ref["norms"]):
        assert _rel(a, b) <= 1e-10
    for a, b in zip(ours["masters"], ref["masters"]):
        assert _rel(a, b) <= 1e-10


def test_clipped_p_grad_and_device_counts():
    """p.grad read after pipe.clip_grad_norm_ is the clipped gradient; the result does
    not depend on the device count (bit for bit)."""
    ours = _train(True, devices=1, read_grads=True)
    ref = _train(False, devices=1, read_grads=True)
    for ga, gb in zip(ours["grads"], ref["grads"]):
        for a, b in zip(ga, gb):
            assert _rel(a, b) <= 1e-6
    for is_async in (False, True):  # asynchronous: whichever way the step and call race
        three = _train(True, devices=3, steps=4, is_async=is_async, kernel="auto")
        one = _train(True, devices=1, steps=4, is_async=is_async, kernel="auto")
        for a, b in zip(one["masters"], three["masters"]):
            assert torch.equal(a, b)


def test_nonfinite_norm_raises_when_asked_and_changes_nothing():
    model, args, kwargs = models.gpt(layers=1)
    with RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        # a finite loss (0) whose gradient is NaN: d sqrt(x)/dx at 0 is inf, times 0
        pipe.forward_backward(input_args=args, input_kwargs=kwargs,
                              loss_fn=lambda out, _: (out["logits"].float().pow(2).sum()
                                                      * 0).sqrt())
        before = [p.detach().clone() for p in pipe.optim_parameters()]
        with pytest.raises(NonFiniteGradientError, match="error_if_nonfinite=False"):
            pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
        pipe.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(before, pipe.optim_parameters()))
        del opt


def _scaled(ours: bool, init_scale: float, clip: bool = False):
    """fp16 Llama, fp32 masters, GradScaler at ``init_scale`` (large enough that the first
    steps overflow and are skipped), AdamW."""
    model = hf.build("llama", torch.float16, seed=0)
    inputs, labels = hf.batch("llama")
    fp32_grads = []
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        params = pipe.optim_parameters()
        scaler = roundpipe.GradScaler(pipe, init_scale, growth_interval=2)
        opt = (roundpipe.optim.AdamW(params, lr=1e-3) if ours
               else torch.optim.AdamW(params, lr=1e-3, fused=True))

        def step():
            if clip:  # torch.amp's recipe: unscale, clip, step
                scaler.unscale_(opt)
                if ours:
                    pipe.clip_grad_norm_(MAX_NORM)
                else:
                    torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            scaler.step(opt, zero_grad=False)
            fp32_grads.append(sum(raw_grad(p) is not None for p in params))
            opt.zero_grad()

        for _ in range(5):
            pipe.forward_backward(
                input_kwargs=inputs, label=labels,
                loss_fn=lambda out, y: scaler.scale(F.cross_entropy(
                    out.logits[:, :-1].float().reshape(-1, out.logits.shape[-1]),
                    y[:, 1:].reshape(-1), ignore_index=-100)))
            pipe.step(step, is_async=False)
        pipe.synchronize()
        return [p.detach().clone() for p in params], scaler.skipped_steps, fp32_grads


def test_grad_scaler_unscales_held_gradients_like_torch():
    ours, skipped, fp32_grads = _scaled(True, 2.0**19)
    ref, skipped_ref, _ = _scaled(False, 2.0**19)
    assert skipped == skipped_ref and 0 < skipped < 5
    assert fp32_grads == [0] * 5  # no gradient was converted to check or unscale it
    for a, b in zip(ours, ref):
        assert _rel(a, b) <= 1e-6


def test_grad_scaler_unscale_then_clip_like_torch():
    ours, skipped, fp32_grads = _scaled(True, 2.0**19, clip=True)
    ref, skipped_ref, _ = _scaled(False, 2.0**19, clip=True)
    assert skipped == skipped_ref and 0 < skipped < 5
    assert fp32_grads == [0] * 5
    for a, b in zip(ours, ref):
        assert _rel(a, b) <= 1e-6


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_clip_scales_down_only_like_torch(factor):
    """A max_norm above the gradients' norm leaves them as they are, one below scales
    them to it: the same norm and gradients as torch's clip_grad_norm_ (float64).  The
    cases above clip every step, so clipping that also scaled small gradients up went
    unseen (bench/mutants.py clip-scales-up)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    eager = copy.deepcopy(model)
    F.mse_loss(eager(x), y).backward()
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in eager.parameters()]))
    max_norm = factor * total.item()
    want_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=1)) as pipe:
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        pipe.synchronize()
        norm = pipe.clip_grad_norm_(max_norm)
        grads = [p.grad.clone() for p in pipe.optim_parameters()]
    torch.testing.assert_close(norm, want_norm, rtol=1e-10, atol=0)
    for g, p in zip(grads, eager.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
