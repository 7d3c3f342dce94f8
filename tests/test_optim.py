"""``roundpipe.optim``: torch's fused AdamW / SGD that, over a pipe's masters, publish
each weight in the same pass as its update.  Results must be bitwise those of torch's
fused optimizer, on plain parameters and through a pipe (asynchronous and synchronous
steps, 1 and 3 devices, chunked parameters), and the publish must really be fused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import models
import roundpipe.optim as ro
from roundpipe import RoundPipe, RoundPipeRunConfig, StepError
from roundpipe.runtime import host_state

TORCH = {
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw),
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, fused=True, **kw),
}
OURS = {"adamw": ro.AdamW, "sgd": ro.SGD}
HYPER = {
    "adamw": [dict(lr=1e-2), dict(lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1,
                                  amsgrad=True), dict(lr=1e-2, maximize=True)],
    "sgd": [dict(lr=1e-2), dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
            dict(lr=1e-2, momentum=0.9, dampening=0.5, maximize=True)],
}
CASES = [(k, i) for k in HYPER for i in range(3)]


@pytest.mark.parametrize("kind, case", CASES)
def test_plain_parameters_step_like_torch(kind, case):
    """Without a pipe they are torch's optimizers: 10 steps bitwise, two param groups, an
    LR scheduler, and state dicts that load into torch's optimizer and back."""
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(37, 5)), nn.Parameter(torch.randn(300))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    hyper = HYPER[kind][case]
    theirs = TORCH[kind]([{"params": a[:1]}, {"params": a[1:], "lr": 0.05}], **hyper)
    ours = OURS[kind]([{"params": b[:1]}, {"params": b[1:], "lr": 0.05}], **hyper)
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
             for o in (theirs, ours)]
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        theirs.step()
        ours.step()
        for s in sched:
            s.step()
        for p, q in zip(a, b):
            assert torch.equal(p, q), step
    groups = lambda: [{"params": b[:1]}, {"params": b[1:]}]  # noqa: E731
    again = TORCH[kind](groups(), **hyper)
    again.load_state_dict(ours.state_dict())
    back = OURS[kind](groups(), **hyper)
    back.load_state_dict(again.state_dict())
    assert str(back.state_dict()) == str(ours.state_dict())


def _train(make_opt, devices: int, sync: bool, steps: int = 5):
    torch.manual_seed(0)
    model, args, kwargs = models.gpt(layers=3)
    model = model.to(torch.bfloat16)
    losses = []
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        opt = make_opt(pipe.optim_parameters())
        for _ in range(steps):
            losses.append(pipe.forward_backward(
                input_args=args, input_kwargs=kwargs,
                loss_fn=lambda out, _: out["logits"].float().pow(2).mean()))
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=not sync)
        pipe.state_dict()  # waits for the last step without publishing it
        weights_before_sync = [p.detach().clone() for p in model.parameters()]
        pipe.synchronize()
        return (losses, weights_before_sync, [m.detach().clone()
                                               for m in pipe.optim_parameters()],
                opt.state_dict())


@pytest.mark.parametrize("kind, case", [("adamw", 1), ("sgd", 1)])
@pytest.mark.parametrize("devices, sync", [(1, False), (3, False), (3, True)])
def test_through_a_pipe_bitwise_like_torch_with_the_publish_fused(kind, case, devices, sync,
                                                                   monkeypatch):
    """Losses, the weights the calls used, the masters and the optimizer state equal a
    run with torch's fused optimizer; parameters span several chunks; the publish ran
    inside the update for every asynchronous step."""
    hyper = HYPER[kind][case]
    want = _train(lambda ps: TORCH[kind](ps, **hyper), devices, sync)
    fused = []
    original = host_state.ModelState.publish_in_step

    def spy(self, version, update):
        fused.append(version)
        return original(self, version, update)
    monkeypatch.setattr(host_state.ModelState, "publish_in_step", spy)
    monkeypatch.setattr(ro, "CHUNK", 96)  # the embedding (64 x 32) spans 22 chunks
    got = _train(lambda ps: OURS[kind](ps, **hyper), devices, sync)
    for w, g in zip(want[0], got[0]):
        assert torch.equal(w, g)
    for part in (1, 2):
        for w, g in zip(want[part], got[part]):
            assert torch.equal(w, g)
    assert str(want[3]) == str(got[3])
    # Asynchronous: every step but the first (nothing to publish then) fuses; synchronous
    # steps publish after the update, at synchronize(), as a pass of its own (not fused).
    assert len(fused) == (0 if sync else 4)


def test_another_optimizer_changing_the_masters_is_an_error_not_a_skewed_schedule():
    """With a roundpipe.optim optimizer bound, a torch optimizer stepping the same
    masters would change them before their publish; that is refused, and the weights
    and masters agree afterwards."""
    model, args, kwargs = models.gpt(layers=2)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64) as pipe:
        ours = ro.AdamW(pipe.optim_parameters(), lr=1e-2)  # bound, not used
        other = torch.optim.SGD(pipe.optim_parameters(), lr=1e-2)
        loss_fn = lambda out, _: out["logits"].pow(2).mean()  # noqa: E731
        for _ in range(2):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
            pipe.step(lambda: (other.step(), other.zero_grad()))
        with pytest.raises(StepError, match="roundpipe.optim optimizer bound"):
            pipe.synchronize()
        for (name, m), p in zip(pipe.optim_named_parameters(), model.parameters()):
            assert torch.equal(m.to(p.dtype), p), name
        del ours


def test_a_failing_step_leaves_weights_and_masters_as_with_torch():
    """A step_fn that raises after the update: the same state as torch's optimizer gives
    (weights as before the step, masters reset to them), and the next steps agree."""
    def run(make_opt):
        torch.manual_seed(0)
        model, args, kwargs = models.gpt(layers=2)
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64) as pipe:
            opt = make_opt(pipe.optim_parameters())
            loss_fn = lambda out, _: out["logits"].pow(2).mean()  # noqa: E731

            def failing():
                opt.step()
                raise RuntimeError("boom")
            for step in range(4):
                pipe.forward_backward(input_args=args, input_kwargs=kwargs,
                                      loss_fn=loss_fn)
                pipe.step(failing if step == 1 else lambda: (opt.step(), opt.zero_grad()))
                if step == 1:
                    with pytest.raises(StepError, match="boom"):
                        pipe.synchronize()
                    opt.zero_grad()
            pipe.synchronize()
            return [p.detach().clone() for p in model.parameters()]
    want = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    got = run(lambda ps: ro.AdamW(ps, lr=1e-2))
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_parameters_of_no_pipe_or_of_a_frozen_part():
    """A pipe without masters (the optimizer writes the weights directly) and a pipe with
    frozen parameters step like torch."""
    def run(make_opt, optim_dtype):
        torch.manual_seed(0)
        model, args, kwargs = models.gpt(layers=2)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith("h.0."))
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=optim_dtype) as pipe:
            opt = make_opt(pipe.optim_parameters())
            for _ in range(3):
                pipe.forward_backward(input_args=args, input_kwargs=kwargs,
                                      loss_fn=lambda out, _: out["logits"].pow(2).mean())
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            pipe.synchronize()
            return [p.detach().clone() for p in model.parameters()]
    for dtype in (None, torch.float64):
        want = run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), dtype)
        got = run(lambda ps: ro.SGD(ps, lr=0.1, momentum=0.9), dtype)
        for w, g in zip(want, got):
            assert torch.equal(w, g)
