"""Weight prediction for asynchronous steps (``predict_weights``, ``async_after``): the
call that overlaps step k computes with ``W_{k-1} + (W_{k-1} - W_{k-2})`` while the
masters stay exact; the first ``async_after`` steps are exact.  Checked against a
float64 reference of the update rule in plain PyTorch, bitwise on 1 and 3 devices, and
for what ``synchronize()``, a raising step, a skipped step, a checkpoint resume and
``host_memory()`` see."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from roundpipe import RoundPipe, RoundPipeRunConfig, StepError
from roundpipe.errors import ConfigError


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1)).to(dtype)


def _data(step: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(12, 6, generator=g).to(dtype),
            torch.randn(12, 1, generator=g).to(dtype))


def _make_opt(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02)


def _reference(kind: str, steps: int, async_after: int = 0, predict: bool = True):
    """The update rule in plain float64 PyTorch.  ``published``: what the calls compute
    with.  Step k starts by publishing: exact steps publish the masters; an asynchronous
    step publishes ``M + (M - P)`` (M: the masters now, P: the masters when the previous
    step started) once a previous step kept P, else M.  The last exact step before
    asynchronous ones keeps P too."""
    published = _mlp()
    masters = copy.deepcopy(published)
    opt = _make_opt(kind, masters.parameters())
    kept: list[torch.Tensor] | None = None
    losses = []
    for k in range(steps):
        x, y = _data(k)
        losses.append(reference.eager_forward_backward(published, (x,), {}, y,
                                                       F.mse_loss, 3))
        for m, p in zip(masters.parameters(), published.parameters()):
            m.grad, p.grad = p.grad, None
        exact = k < async_after
        keep = predict and (not exact or k == async_after - 1 or kept is not None)
        with torch.no_grad():
            if predict and not exact and kept is not None:
                for p, m, w in zip(published.parameters(), masters.parameters(), kept):
                    p.copy_(m + (m - w))
            else:
                for p, m in zip(published.parameters(), masters.parameters()):
                    p.copy_(m)
            if keep:
                kept = [m.detach().clone() for m in masters.parameters()]
        opt.step()
        opt.zero_grad()
        if exact:
            with torch.no_grad():
                for p, m in zip(published.parameters(), masters.parameters()):
                    p.copy_(m)
    return losses, [m.detach().clone() for m in masters.parameters()]


def _run(kind: str, steps: int, devices: int, **options):
    pipe = RoundPipe(_mlp(), devices=["cpu"] * devices, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3), **options)
    opt = _make_opt(kind, pipe.optim_parameters())
    losses = []
    for k in range(steps):
        x, y = _data(k)
        losses.append(pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss))
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    pipe.synchronize()
    weights = [p.detach().clone() for p in pipe.model.parameters()]
    masters = [m.detach().clone() for m in pipe.optim_parameters()]
    pipe.close()
    return losses, weights, masters


def _assert_matches(run, ref):
    losses, weights, masters = run
    ref_losses, ref_masters = ref
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for w, m, r in zip(weights, masters, ref_masters):
        torch.testing.assert_close(m, r, rtol=1e-10, atol=1e-12)
        assert torch.equal(w, m)  # synchronize() leaves the exact masters


def _assert_bitwise(a, b):
    for xs, ys in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_predicted_async_steps_follow_their_update_rule(kind):
    ref = _reference(kind, 5)
    one, three = _run(kind, 5, 1), _run(kind, 5, 3)
    _assert_matches(one, ref)
    _assert_bitwise(one, three)
    # The prediction is not the stale schedule, nor exact training.
    for other in (_reference(kind, 5, predict=False), _reference(kind, 5, async_after=5)):
        assert any(not torch.allclose(a, b, rtol=1e-6)
                   for a, b in zip(ref[1], other[1]))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_async_after_runs_exact_steps_then_predicted_ones(kind):
    ref = _reference(kind, 5, async_after=2)
    one, three = _run(kind, 5, 1, async_after=2), _run(kind, 5, 3, async_after=2)
    _assert_matches(one, ref)
    _assert_bitwise(one, three)
    assert any(not torch.allclose(a, b, rtol=1e-6)
               for a, b in zip(ref[1], _reference(kind, 5)[1]))


def test_prediction_off_and_async_after_with_exact_steps_only():
    _assert_matches(_run("sgd", 4, 2, predict_weights=False),
                    _reference("sgd", 4, predict=False))
    _assert_matches(_run("adamw", 3, 2, async_after=3), _reference("adamw", 3,
                                                                   async_after=3))


def test_options_are_checked():
    for bad in ({"predict_weights": 1}, {"async_after": -1}, {"async_after": 1.5},
                {"async_after": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RoundPipe(_mlp(), devices=["cpu"], **bad)


def _bf16_pipe(**options):
    pipe = RoundPipe(_mlp(torch.bfloat16), devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2), **options)
    return pipe


def _train(pipe, opt, steps, losses=None):
    for k in steps:
        x, y = _data(k, torch.bfloat16)
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        if losses is not None:
            losses.append(loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)


def test_weights_hold_the_prediction_until_synchronize_then_the_masters():
    pipe = _bf16_pipe()
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=0.02)
    _train(pipe, opt, range(3))
    published = pipe.state_dict()._metadata["roundpipe"]["published"]
    masters = dict(pipe.optim_named_parameters())
    # Before synchronize: the prediction, not the masters (nor the stale weights).
    assert any(not torch.equal(published[n], m.to(torch.bfloat16))
               for n, m in masters.items())
    pipe.synchronize()
    for n, p in pipe.model.named_parameters():
        assert torch.equal(p, masters[n].detach().to(torch.bfloat16)), n
    sd = pipe.state_dict()  # exact masters, nothing pending
    assert "published" not in sd._metadata["roundpipe"]
    assert all(torch.equal(sd[n], m) for n, m in masters.items())
    pipe.close()


def test_a_raising_step_leaves_the_masters_exact():
    pipe = _bf16_pipe()
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
    _train(pipe, opt, range(3))
    pipe.synchronize()
    before = [m.detach().clone() for m in pipe.optim_parameters()]
    x, y = _data(3, torch.bfloat16)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)

    def half_a_step():
        opt.step()  # the masters are updated, then the step fails
        raise RuntimeError("boom")

    pipe.step(half_a_step, is_async=True)  # its publish predicted the weights
    with pytest.raises(StepError, match="boom"):
        pipe.synchronize()
    # Bitwise the masters from before the step (not the predicted weights, not the
    # half-applied update); the next publish writes them into the model.
    assert all(torch.equal(m, b) for m, b in zip(pipe.optim_parameters(), before))
    pipe.synchronize()
    for p, m in zip(pipe.model.parameters(), pipe.optim_parameters()):
        assert torch.equal(p, m.detach().to(torch.bfloat16))
    opt.zero_grad()
    _train(pipe, opt, range(4, 6))  # training goes on
    pipe.synchronize()
    assert all(p.isfinite().all() for p in pipe.model.parameters())
    pipe.close()


@pytest.mark.parametrize("at", [1, 3])
def test_a_checkpoint_resume_continues_bitwise(at):
    straight = _bf16_pipe(async_after=2)
    opt = torch.optim.AdamW(straight.optim_parameters(), lr=0.02)
    losses: list[torch.Tensor] = []
    _train(straight, opt, range(at), losses)
    saved = io.BytesIO()  # a copy: a state dict's tensors are the live masters
    torch.save({"pipe": straight.state_dict(), "opt": opt.state_dict()}, saved)
    _train(straight, opt, range(at, 6), losses)
    straight.synchronize()

    resumed = _bf16_pipe(async_after=2)
    opt_r = torch.optim.AdamW(resumed.optim_parameters(), lr=0.02)
    saved.seek(0)
    checkpoint = torch.load(saved)
    resumed.load_state_dict(checkpoint["pipe"])
    opt_r.load_state_dict(checkpoint["opt"])
    tail: list[torch.Tensor] = []
    _train(resumed, opt_r, range(at, 6), tail)
    resumed.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(losses[at:], tail))
    for a, b in zip(straight.optim_parameters(), resumed.optim_parameters()):
        assert torch.equal(a, b)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    straight.close()
    resumed.close()


@pytest.mark.parametrize("predict", [True, False])
def test_host_memory_counts_the_kept_masters(predict):
    pipe = _bf16_pipe(predict_weights=predict)
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
    x, y = _data(0, torch.bfloat16)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    pipe.step(lambda: (opt.step(), opt.zero_grad()))  # exact: nothing kept
    assert pipe.host_memory().prediction == 0
    _train(pipe, opt, range(1, 3))
    mem = pipe.host_memory()
    masters = sum(m.numel() * m.element_size() for m in pipe.optim_parameters())
    assert mem.masters == masters
    assert mem.prediction == (masters if predict else 0)
    assert mem.total == sum(getattr(mem, c) for c in
                            ("weights", "masters", "prediction", "gradients",
                             "optimizer_state", "landing", "constants"))
    pipe.close()


def test_a_skipped_step_predicts_no_move():
    """A step a GradScaler skips (inf gradients) leaves the masters as they were, so the
    next step's prediction moves nothing: it publishes the masters themselves."""
    from roundpipe import GradScaler
    pipe = RoundPipe(_mlp(torch.float16), devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    scaler = GradScaler(pipe, init_scale=2.0, growth_interval=1000)
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
    names = [n for n, _ in pipe.optim_named_parameters()]
    seen = {}
    for k in range(5):
        x, y = _data(k, torch.float16)
        blow_up = float("inf") if k == 2 else 1.0
        pipe.forward_backward(input_args=(x,), label=y,
                              loss_fn=lambda o, t: scaler.scale(F.mse_loss(o, t)) * blow_up)
        pipe.step(lambda: scaler.step(opt), is_async=True)
        sd = pipe.state_dict()  # waits for the step; the masters and what calls read
        seen[k] = ({n: sd[n].clone() for n in names},
                   dict(sd._metadata["roundpipe"].get("published", {})))
    assert all(torch.equal(seen[2][0][n], seen[1][0][n]) for n in names)  # skipped
    assert not all(torch.equal(seen[3][0][n], seen[2][0][n]) for n in names)
    # Step 2 published a prediction from step 1's update; step 3 (after the skip) the
    # masters exactly; step 4 a prediction from step 3's update again.
    for k, moved in ((2, True), (3, False), (4, True)):
        exact = all(torch.equal(seen[k][1][n], seen[k - 1][0][n].to(torch.float16))
                    for n in names)
        assert exact != moved, k
    pipe.close()


def _fp64_pipe(devices, **options):
    return RoundPipe(_mlp(), devices=["cpu"] * devices, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3), **options)


def _train64(pipe, opt, steps, losses):
    for k in steps:
        x, y = _data(k)
        losses.append(pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss))
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("at", [1, 3])
@pytest.mark.parametrize("devices", [(1, 1), (3, 3), (1, 3)])
def test_save_checkpoint_resumes_the_predicted_schedule_bitwise(tmp_path, devices, at,
                                                                sharded):
    """A predicted asynchronous run with ``async_after=2`` saved inside its exact
    warm-up (at=1) or after it (at=3), loaded into a fresh pipe (the same device count,
    or another) and continued equals the run that never stopped, bit for bit: the
    weights the calls use, the losses, the masters and the optimizer state."""
    from roundpipe import load_checkpoint, save_checkpoint
    straight = _fp64_pipe(devices[0], async_after=2)
    opt = torch.optim.AdamW(straight.optim_parameters(), lr=0.02)
    losses: list[torch.Tensor] = []
    _train64(straight, opt, range(at), losses)
    path = tmp_path / "ckpt"
    if sharded:
        path.mkdir()
    save_checkpoint(path, straight, opt)
    _train64(straight, opt, range(at, 6), losses)
    straight.synchronize()

    resumed = _fp64_pipe(devices[1], async_after=2)
    opt_r = torch.optim.AdamW(resumed.optim_parameters(), lr=0.02)
    load_checkpoint(path, resumed, opt_r)
    tail: list[torch.Tensor] = []
    _train64(resumed, opt_r, range(at, 6), tail)
    resumed.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(losses[at:], tail, strict=True))
    for a, b in zip(straight.optim_parameters(), resumed.optim_parameters()):
        assert torch.equal(a, b)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), opt_r.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    straight.close()
    resumed.close()


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("change, at", [({"predict_weights": False}, 3),
                                        ({"predict_weights": False}, 1),
                                        ({"async_after": 4}, 3),
                                        ({"async_after": 0}, 1)])
def test_a_resume_into_another_schedule_is_refused(tmp_path, change, at, sharded):
    """A checkpoint records ``predict_weights`` and ``async_after``: loading it into a
    pipe whose settings would make the rest of the run differ from the saved one's is
    refused before anything is loaded, naming the setting and the way out."""
    from roundpipe import CheckpointError, load_checkpoint, save_checkpoint
    pipe = _fp64_pipe(1, async_after=2)
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=0.02)
    _train64(pipe, opt, range(at), [])
    path = tmp_path / "ckpt"
    if sharded:
        path.mkdir()
    save_checkpoint(path, pipe, opt)
    pipe.close()
    other = _fp64_pipe(1, **{"async_after": 2, **change})
    opt_o = torch.optim.AdamW(other.optim_parameters(), lr=0.02)
    before = [m.clone() for m in other.optim_parameters()]
    name = next(iter(change))
    with pytest.raises(CheckpointError, match=name) as info:
        load_checkpoint(path, other, opt_o)
    assert "Nothing was loaded" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, other.optim_parameters()))
    assert not opt_o.state
    # The way out the message names: the saved setting for the load, then a change on
    # purpose.
    setattr(other, name, not change[name] if name == "predict_weights" else 2)
    load_checkpoint(path, other, opt_o)
    setattr(other, name, change[name])
    _train64(other, opt_o, range(at, at + 2), [])
    other.close()


def test_async_after_already_passed_on_both_sides_is_not_a_different_schedule(tmp_path):
    """After ``max(async_after)`` steps both settings run asynchronous steps only: the
    load is accepted and continues as the saved run would have."""
    from roundpipe import load_checkpoint, save_checkpoint
    pipe = _fp64_pipe(1, async_after=2)
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=0.02)
    losses: list[torch.Tensor] = []
    _train64(pipe, opt, range(3), losses)
    save_checkpoint(tmp_path / "ckpt", pipe, opt)
    _train64(pipe, opt, range(3, 5), losses)
    other = _fp64_pipe(1, async_after=3)
    opt_o = torch.optim.AdamW(other.optim_parameters(), lr=0.02)
    load_checkpoint(tmp_path / "ckpt", other, opt_o)
    tail: list[torch.Tensor] = []
    _train64(other, opt_o, range(3, 5), tail)
    assert all(torch.equal(a, b) for a, b in zip(losses[3:], tail, strict=True))
    pipe.close()
    other.close()
