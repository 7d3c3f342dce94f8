"""``roundpipe.optim``: torch's AdamW and SGD, one pass over host memory for a pipe's
masters.  Checked against ``torch.optim`` on the same gradients, across device counts,
against eager kernels, and for what ``p.grad``, failures and checkpoints see."""

from __future__ import annotations

import copy


import pytest
import torch
import torch.nn as nn

import models
import roundpipe.optim
from roundpipe import (OptimizerError, RoundPipe, RoundPipeRunConfig, StepError,
                       load_checkpoint, save_checkpoint)
from roundpipe.optim import kernels

ADAMW = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6,
                                               weight_decay=0.0, amsgrad=True),
         dict(lr=1e-2, maximize=True)]
SGD = [dict(lr=1e-2), dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01),
       dict(lr=5e-3, momentum=0.9, nesterov=True, maximize=True)]
CASES = [("AdamW", kw) for kw in ADAMW] + [("SGD", kw) for kw in SGD]


class Branches(nn.Module):
    """Gradients that do not depend on the weights (each linear reads its own input and
    the loss is linear in the output), so two optimizers see the same gradients at every
    step, however far their weights drift apart."""

    def __init__(self, n: int = 6, width: int = 16) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        h = 0
        for i, lin in enumerate(self.lins):
            h = h + lin(x[:, i])
        return h


def _branches(dtype, n=6):
    torch.manual_seed(0)
    model = Branches(n).to(dtype)
    x = torch.randn(8, n, 16, dtype=dtype)
    weight = torch.randn(8, 16, dtype=dtype)
    return model, x, weight


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)
            ).item()


@pytest.mark.parametrize("name, kwargs", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["native", "fused"])
def test_ten_steps_equal_torch_on_the_same_gradients(name, kwargs, dtype, kernel):
    """A pipe's fp32 masters under roundpipe.optim against torch.optim on fp32 copies fed
    the same gradients: relative difference <= 1e-6 per parameter after 10 steps against
    torch's default and fused implementations, and with kernel='fused' bit for bit
    against the fused one (the kernel it runs); the model weights are the masters
    rounded to the model's dtype."""
    model, x, weight = _branches(dtype, n=3)  # a unit per device
    reference = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    ref_opt = getattr(torch.optim, name)(reference, **kwargs)
    fused = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    fused_opt = getattr(torch.optim, name)(fused, fused=True, **kwargs)
    # The gradient, computed once in the model's dtype (it does not depend on the weights).
    eager = Branches(3).to(dtype)
    eager.load_state_dict(model.state_dict())
    (eager(x) * weight).sum().backward()
    grads = [p.grad.float() for p in eager.parameters()]
    with RoundPipe(model, devices=["cpu"] * 3, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=1)) as pipe:
        opt = getattr(roundpipe.optim, name)(pipe.optim_parameters(), kernel=kernel,
                                             **kwargs)
        for _ in range(10):
            pipe.forward_backward(input_args=(x,), label=weight,
                                  loss_fn=lambda out, w: (out * w).sum())
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
            for p, q, g in zip(reference, fused, grads):
                p.grad, q.grad = g.clone(), g.clone()
            ref_opt.step()
            fused_opt.step()
        pipe.synchronize()
        for (n, m), r, f, w in zip(pipe.optim_named_parameters(), reference, fused,
                                   model.parameters()):
            assert _rel(m, r) <= 1e-6 and _rel(m, f) <= 1e-6, n
            if kernel == "fused":
                assert torch.equal(m, f), n  # the same kernel, the same gradients
            assert torch.equal(w, m.detach().to(dtype)), n
        for m, r in zip(pipe.optim_parameters(), reference):
            for key, value in ref_opt.state[r].items():
                if key != "step":
                    assert _rel(opt.state[m][key], value) <= 1e-6, key


@pytest.mark.parametrize("name, kwargs", CASES)
def test_plain_parameters_are_stepped_by_torch(name, kwargs):
    """No pipe: exactly torch's optimizer, state_dict included."""
    torch.manual_seed(1)
    a = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    ours, theirs = getattr(roundpipe.optim, name)(a, **kwargs), \
        getattr(torch.optim, name)(b, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(ours, 2, gamma=0.5)
    sched_ref = torch.optim.lr_scheduler.StepLR(theirs, 2, gamma=0.5)
    for _ in range(5):
        for p, q in zip(a, b):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step(), theirs.step(), sched.step(), sched_ref.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert str(ours.state_dict()) == str(theirs.state_dict())


@pytest.mark.parametrize("name, kwargs", CASES)
def test_bf16_moments_in_chunks_equal_torchs_fused_step_rounded(name, kwargs, monkeypatch):
    """Moments kept in bfloat16, converted chunk by chunk into scratch (chunks smaller
    than a parameter, batches that hold several small ones, a strided parameter), against
    torch's fused optimizer whose float32 moments are rounded to bfloat16 after every
    step: bit for bit."""
    monkeypatch.setattr(kernels, "CHUNK", 1000)
    state_dtype = torch.bfloat16
    torch.manual_seed(2)
    shapes = [(3001,), (7,), (40, 30), (5,), (999,)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ours.append(nn.Parameter(torch.randn(30, 20).t()))  # strided
    # The reference is contiguous: torch's fused CPU kernels pair a strided parameter's
    # elements with its (contiguous) gradient's in memory order, a wrong result (torch
    # 2.13; its single-tensor AdamW agrees with ours here).
    ref = [nn.Parameter(p.detach().contiguous().clone()) for p in ours]
    opt = getattr(roundpipe.optim, name)(ours, state_dtype=state_dtype, kernel="fused",
                                         **kwargs)
    ref_opt = getattr(torch.optim, name)(ref, fused=True, **kwargs)
    for _ in range(4):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape).to(torch.bfloat16)
            p.grad, q.grad = g.float(), g.float()
        opt.step()
        ref_opt.step()
        for state in ref_opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim():
                    v.copy_(v.to(torch.bfloat16))
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)
        for key, value in ref_opt.state[q].items():
            mine = opt.state[p][key]
            if value.dim():
                assert mine.dtype == state_dtype, key
            assert torch.equal(mine.float(), value.float()), key


@pytest.mark.parametrize("name, kwargs", CASES)
def test_landed_bf16_gradients_equal_torchs_fused_step_on_their_fp32_copies(
        name, kwargs, monkeypatch):
    """The gradient a master reads in place (bf16, in its download buffer), through the
    scratch conversion, with chunks cutting the larger parameters: bit for bit torch's
    fused optimizer on the fp32 ``.grad`` of the same calls."""
    monkeypatch.setattr(kernels, "CHUNK", 300)
    results = []
    for ours in (True, False):
        torch.manual_seed(0)
        model, args, inputs = models.gpt(layers=2)
        model = model.to(torch.bfloat16)
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
            opt = (getattr(roundpipe.optim, name)(pipe.optim_parameters(), kernel="fused",
                                                  **kwargs) if ours
                   else getattr(torch.optim, name)(pipe.optim_parameters(), fused=True,
                                                   **kwargs))
            for _ in range(3):
                pipe.forward_backward(input_args=args, input_kwargs=inputs,
                                      loss_fn=lambda out, _: out["logits"].float().pow(2).mean())
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            pipe.synchronize()
            results.append([m.detach().clone() for m in pipe.optim_parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _gpt_run(optimizer, devices=2, steps=4, read_grads=False, state_dtype=None):
    torch.manual_seed(0)
    model, args, kwargs = models.gpt(layers=2)
    model = model.to(torch.bfloat16)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        extra = {} if optimizer.__module__.startswith("torch") else \
            {"state_dtype": state_dtype}
        opt = optimizer(pipe.optim_parameters(), lr=1e-3, **extra)
        grads = []
        for _ in range(steps):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
            if read_grads:
                pipe.synchronize()
                grads.append([p.grad.clone() for p in pipe.optim_parameters()])
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        pipe.synchronize()
        return ([m.detach().clone() for m in pipe.optim_parameters()],
                [w.detach().clone() for w in model.parameters()],
                [v.clone() for s in opt.state.values() for v in s.values()], grads)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_bit_identical_across_device_counts_and_whether_grads_are_read(name):
    """Masters, weights and optimizer state are bitwise the same on 1 device with p.grad
    never read and on 3 devices with p.grad read (materialised) before each step (either
    difference alone would show)."""
    cls = getattr(roundpipe.optim, name)
    one = _gpt_run(cls, devices=1)
    read = _gpt_run(cls, devices=3, read_grads=True)
    for a, b in zip(one[:3], read[:3]):
        assert len(a) == len(b)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class _Injected(Exception):
    """The failure a test's step_fn raises on purpose (any other one fails the test)."""


def _masters_after(cls, step_fn_of, calls_per_step=1, steps=2, **kwargs):
    """bf16 GPT, fp32 masters, ``steps`` of ``calls_per_step`` calls then
    ``pipe.step(step_fn_of(opt, masters))``: the masters and p.grad afterwards.  A step
    whose step_fn raised :class:`_Injected` is retried by the next one; any other
    StepError is the test's failure."""
    torch.manual_seed(0)
    model, args, kw = models.gpt(layers=2)
    model = model.to(torch.bfloat16)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32) as pipe:
        masters = pipe.optim_parameters()
        opt = cls(masters, lr=1e-2, **kwargs)
        for _ in range(steps):
            for _ in range(calls_per_step):
                pipe.forward_backward(input_args=args, input_kwargs=kw, loss_fn=loss_fn)
            try:
                pipe.step(step_fn_of(opt, masters), is_async=False)
            except StepError as e:
                if not isinstance(e.__cause__, _Injected):
                    raise
        pipe.synchronize()
        grads = [None if m.grad is None else m.grad.clone() for m in masters]
        weights = [w.detach().clone() for w in model.parameters()]
        return [m.detach().clone() for m in masters], grads, weights


def _same_as_torch(step_fn_of, **kwargs):
    ours = _masters_after(roundpipe.optim.SGD, step_fn_of, **kwargs)
    theirs = _masters_after(torch.optim.SGD, step_fn_of, **kwargs)
    for a, b in zip(ours[0], theirs[0]):
        assert _rel(a, b) <= 1e-6
    for a, b in zip(ours[1], theirs[1]):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)
    for m, w in zip(ours[0], ours[2]):
        if w.shape == m.shape:
            assert torch.equal(w, m.to(torch.bfloat16))


def test_p_grad_and_steps_behave_as_with_torchs_optimizer():
    """What torch's optimizer allows, with the gradient held where it landed, one after
    the other in one run of seven steps per optimizer: no zero_grad (the next call
    accumulates; p.grad read after the step), two steps on one gradient,
    zero_grad(set_to_none=False), and a retry after a step_fn that raised after
    opt.step()."""
    failed = set()  # the optimizers whose step_fn raised once already
    taken: dict[int, int] = {}

    def raise_once(opt):
        opt.step()
        if id(opt) not in failed:
            failed.add(id(opt))
            raise _Injected("after the step")
        opt.zero_grad()

    schedule = [lambda opt: opt.step(), lambda opt: opt.step(),           # never zeroed
                lambda opt: (opt.step(), opt.step(), opt.zero_grad()),
                lambda opt: (opt.step(), opt.zero_grad(set_to_none=False)),
                lambda opt: (opt.step(), opt.zero_grad(set_to_none=False)),
                raise_once, raise_once]                                 # raises, retried

    def step_fn_of(opt, ms):
        index = taken[id(opt)] = taken.get(id(opt), -1) + 1
        return lambda: schedule[index](opt)
    _same_as_torch(step_fn_of, steps=len(schedule))
    assert len(failed) == 2  # each optimizer's step_fn did raise once
    assert all(n == len(schedule) - 1 for n in taken.values())


def test_two_optimizers_over_the_same_masters_apply_the_gradient_twice():
    """As torch's: each applies the gradient it finds."""
    def run(cls):
        torch.manual_seed(0)
        model, args, kw = models.gpt(layers=1)
        model = model.to(torch.bfloat16)
        loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32) as pipe:
            a = cls(pipe.optim_parameters(), lr=1e-2)
            b = cls(pipe.optim_parameters(), lr=1e-2, momentum=0.5)
            for _ in range(2):
                pipe.forward_backward(input_args=args, input_kwargs=kw, loss_fn=loss_fn)
                pipe.step(lambda: (a.step(), b.step(), a.zero_grad()))
            pipe.synchronize()
            return [m.detach().clone() for m in pipe.optim_parameters()]
    for x, y in zip(run(roundpipe.optim.SGD), run(torch.optim.SGD)):
        assert _rel(x, y) <= 1e-6


def test_a_master_written_through_data_after_the_step_is_published():
    """Weight clipping through .data after opt.step() (no version bump) reaches the
    model weights."""
    model, args, kwargs = models.gpt(layers=1)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    with RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-1)
        masters = pipe.optim_parameters()

        def step_then_clip():
            opt.step()
            opt.zero_grad()
            for m in masters:
                m.data.clamp_(-0.01, 0.01)
        for _ in range(2):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
            pipe.step(step_then_clip)
        pipe.synchronize()
        for m, w in zip(masters, model.parameters()):
            assert torch.equal(w, m.detach().to(torch.bfloat16))
            assert w.abs().max() <= 0.01


def test_the_optimizer_copies_pickles_and_outlives_its_pipe():
    import copy
    import pickle
    model, args, kwargs = models.gpt(layers=1)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    pipe = RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                     optim_dtype=torch.float32)
    opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-3, state_dtype=torch.bfloat16)
    pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
    pipe.synchronize()
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other.state_dtype == torch.bfloat16
        p = nn.Parameter(torch.randn(4))
        p.grad = torch.randn(4)
        other.add_param_group({"params": [p]})
        other.step()
    pipe.close()
    opt.zero_grad()  # after close: no pending step to wait for


def test_accumulated_gradients_equal_torchs_path():
    """Two calls before a step: the held low-precision gradient and the next are folded
    in float32, as torch's path folds them."""
    results = []
    for cls in (torch.optim.SGD, roundpipe.optim.SGD):
        torch.manual_seed(0)
        model, args, kwargs = models.gpt(layers=2)
        model = model.to(torch.bfloat16)
        loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32) as pipe:
            opt = cls(pipe.optim_parameters(), lr=1e-2)
            for _ in range(2):
                for _ in range(2):
                    pipe.forward_backward(input_args=args, input_kwargs=kwargs,
                                          loss_fn=loss_fn)
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            pipe.synchronize()
            results.append([m.detach().clone() for m in pipe.optim_parameters()])
    for a, b in zip(*results):
        assert _rel(a, b) <= 1e-6


def test_host_bytes_per_parameter_meet_the_goal():
    """bf16 model, fp32 masters: AdamW holds at most 16 B/param beyond the weights (no
    fp32 .grad but the tied embedding's), and at most 12 with bf16 moments; torch's
    AdamW holds 18."""
    per_param = {}
    for key, cls, state_dtype in [("torch", torch.optim.AdamW, None),
                                  ("ours", roundpipe.optim.AdamW, None),
                                  ("ours-bf16", roundpipe.optim.AdamW, torch.bfloat16)]:
        model, args, kwargs = models.gpt(layers=2)
        model = model.to(torch.bfloat16)
        loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
            extra = {"state_dtype": state_dtype} if state_dtype else {}
            opt = cls(pipe.optim_parameters(), lr=1e-3, **extra)
            for _ in range(3):
                pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
            mem = pipe.host_memory(opt)
            tied = 4 * model.wte.weight.numel()
            if key != "torch":  # only the tied embedding, summed from two units, in fp32
                assert mem.gradients == tied
                per_param[key] = (mem.total - mem.weights - tied) / mem.trainable_params
            else:
                per_param[key] = (mem.total - mem.weights) / mem.trainable_params
    assert per_param["torch"] >= 17.9  # masters 4, .grad 4, moments 8, landing 2
    assert per_param["ours"] <= 16.1
    assert per_param["ours-bf16"] <= 12.1


def _slow_steps(landing_buffers, monkeypatch):
    """Two asynchronous AdamW steps whose step_fn waits until a gradient of the next call
    meets a buffer the step holds, and then until that landing has chosen its buffer (or,
    if it waits for the step, for two seconds)."""
    import threading
    from roundpipe.runtime import grad_landing
    model, args, kwargs = models.gpt(layers=2)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    landing, landed = threading.Event(), threading.Event()
    original = grad_landing.GradLanding.buffer_for

    def buffer_for(self, key, steps=(), like=None):
        meets_held = bool(self.buffers.get(key)) and self._free(key) is None
        if meets_held:
            landing.set()
        try:
            return original(self, key, steps, like=like)
        finally:
            if meets_held:
                landed.set()

    monkeypatch.setattr(grad_landing.GradLanding, "buffer_for", buffer_for)

    def step():
        # Hold the buffers until the landing has chosen one (a second set), or for two
        # seconds if it waits for this step (one set): however fast the update is.  (With
        # two sets the last call finds a free one and meets no held buffer.)
        if landing.wait(5.0):
            landed.wait(30.0 if landing_buffers == 2 else 2.0)
        opt.step()
        opt.zero_grad()

    with RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   landing_buffers=landing_buffers,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
        # A pipe's first step is waited for until its optimizer has passed its check
        # (runtime/optimizer_check.py): one exact step first, so the slow ones overlap.
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        for _ in range(2):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
            landing.clear()
            landed.clear()
            pipe.step(step, is_async=True)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        pipe.synchronize()
        kept = [len(k) for k in pipe._landing.buffers.values()]
        return ([m.detach().clone() for m in pipe.optim_parameters()], kept,
                pipe._landing.wait_seconds)


def test_one_landing_set_waits_for_the_step_and_changes_no_result(monkeypatch):
    """landing_buffers=1: a gradient whose buffer the pending step still holds waits for
    the step instead of landing into a second buffer, so the host keeps one set; with 2
    (or "auto" with memory to spare) a second set is allocated.  The results are the same
    bits."""
    one, kept_one, waited = _slow_steps(1, monkeypatch)
    assert kept_one and max(kept_one) == 1 and waited > 0
    two, kept_two, waited_two = _slow_steps(2, monkeypatch)
    assert max(kept_two) == 2 and waited_two == 0
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    # "auto" follows the host's available memory
    from roundpipe.runtime import grad_landing
    monkeypatch.setattr(grad_landing, "_affordable", lambda nbytes: False)
    auto, kept_auto, _ = _slow_steps("auto", monkeypatch)
    assert max(kept_auto) == 1
    for a, b in zip(one, auto):
        assert torch.equal(a, b)
    with pytest.raises(roundpipe.ConfigError, match="landing_buffers"):
        RoundPipe(nn.Linear(2, 2), landing_buffers=3)


def test_a_step_outside_step_fn_or_with_bad_settings_changes_nothing():
    model, args, kwargs = models.gpt(layers=1)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    with RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        pipe.synchronize()
        with pytest.raises(OptimizerError, match="step_fn"):
            opt.step()
        before = [m.detach().clone() for m in pipe.optim_parameters()]
        weights = [w.detach().clone() for w in model.parameters()]
        opt.param_groups[0]["lr"] = float("nan")
        with pytest.raises(StepError, match="lr must be"):
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)

        def closure_raises():
            raise ValueError("closure failed")
        opt.param_groups[0]["lr"] = 1e-3
        with pytest.raises(StepError, match="closure failed"):
            pipe.step(lambda: opt.step(closure_raises), is_async=False)
        assert all(torch.equal(a, b) for a, b in zip(before, pipe.optim_parameters()))
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        assert opt.state == {} or all(not s for s in opt.state.values())
        # the gradient survived the failed steps and the next one uses it
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        assert not all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_a_master_written_after_the_step_is_what_gets_published():
    """The staged weight is the step's; a write to the master after it (in the same
    step_fn) must win, not be dropped."""
    model, args, kwargs = models.gpt(layers=1)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    with RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        opt = roundpipe.optim.SGD(pipe.optim_parameters(), lr=1e-2)
        masters = pipe.optim_parameters()

        def step_then_scale():
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                masters[0].mul_(0.5)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        pipe.step(step_then_scale)
        pipe.synchronize()
        for m, w in zip(masters, model.parameters()):
            assert torch.equal(w, m.detach().to(torch.bfloat16))


def test_checkpoint_with_staged_weights_resumes_bit_exact(tmp_path):
    """Saved while an async step's weights are staged (not yet published): a fresh pipe
    that loads it continues exactly as the straight run."""
    def run(steps, save_at=None, load=None):
        torch.manual_seed(0)
        model, _, _ = models.gpt(layers=2)
        pipe = RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                         optim_dtype=torch.float32, seed=3)
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        first = load_checkpoint(load, pipe, opt)["step"] if load else 0
        for step in range(first, steps):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 64, (4, 8), generator=g)
            pipe.forward_backward(input_args=(idx,), label=idx,
                                  loss_fn=lambda o, y: models.lm_loss(o, y))
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
            if save_at == step + 1:
                save_checkpoint(tmp_path / "c.pt", pipe, opt, extra={"step": step + 1})
                pipe.close()
                return None
        pipe.synchronize()
        out = [m.detach().clone() for m in pipe.optim_parameters()] + \
            [w.detach().clone() for w in pipe.model.parameters()]
        pipe.close()
        return out

    straight = run(5)
    run(5, save_at=2)
    resumed = run(5, load=tmp_path / "c.pt")
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_binding_is_released_with_the_optimizer():
    """A pipe whose one-pass optimizer is gone lands gradients as before (fp32 .grad)."""
    model, args, kwargs = models.gpt(layers=1)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    with RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        tied = 4 * model.wte.weight.numel()  # folded from two units: fp32 .grad anyway
        assert pipe.host_memory().gradients == tied
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        pipe.synchronize()
        del opt
        import gc
        gc.collect()
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        mem = pipe.host_memory()
        assert mem.gradients == 4 * mem.trainable_params


def test_settings_that_do_not_apply_are_refused():
    with RoundPipe(models.gpt(layers=1)[0], devices=["cpu"], optim_dtype=torch.float32) \
            as pipe:
        with pytest.raises(OptimizerError, match="differentiable"):
            roundpipe.optim.AdamW(pipe.optim_parameters(), differentiable=True)
        with pytest.raises(OptimizerError, match="state_dtype"):
            roundpipe.optim.SGD(pipe.optim_parameters(), state_dtype=torch.int8)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_low_precision_parameters_under_sgd_equal_torchs_step(momentum):
    """torch's fused CPU SGD skips vector blocks of bf16 parameters (2.11-2.13): they take
    torch's single-tensor step, plain or as a pipe's bf16 masters."""
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(300).to(torch.bfloat16))]
    b = [nn.Parameter(a[0].detach().clone())]
    ours = roundpipe.optim.SGD(a, lr=0.1, momentum=momentum, state_dtype=torch.bfloat16)
    theirs = torch.optim.SGD(b, lr=0.1, momentum=momentum, foreach=False)
    for _ in range(3):
        g = torch.randn(300).to(torch.bfloat16)
        a[0].grad, b[0].grad = g.clone(), g.clone()
        ours.step(), theirs.step()
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], a[0].detach() * 0 + 1)
    masters = []
    for optimizer in (roundpipe.optim.SGD, torch.optim.SGD):
        model, x, weight = _branches(torch.bfloat16)
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.bfloat16,
                       model_run_config=RoundPipeRunConfig(num_microbatch=1)) as pipe:
            opt = optimizer(pipe.optim_parameters(), lr=0.1, momentum=momentum)
            for _ in range(3):
                pipe.forward_backward(input_args=(x,), label=weight,
                                      loss_fn=lambda out, w: (out * w).sum())
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            pipe.synchronize()
            masters.append([m.detach().clone() for m in pipe.optim_parameters()])
    assert all(torch.equal(m, r) for m, r in zip(*masters))
    start = _branches(torch.bfloat16)[0]
    assert not all(torch.equal(m, p) for m, p in zip(masters[0], start.parameters()))


def test_load_state_dict_keeps_state_dtype_and_bindings():
    q = nn.Parameter(torch.randn(10))
    opt = roundpipe.optim.AdamW([q], state_dtype=torch.bfloat16)
    q.grad = torch.randn(10)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert opt.state_dtype == torch.bfloat16
    assert opt.state[q]["exp_avg"].dtype == torch.bfloat16
    with RoundPipe(models.gpt(layers=1)[0], devices=["cpu"], optim_dtype=torch.float32) \
            as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters())
        bound = len(opt._bindings)
        opt.load_state_dict(opt.state_dict())
        assert len(opt._bindings) == bound


def test_complex_parameters_are_stepped_by_torch():
    torch.manual_seed(0)
    c = nn.Parameter(torch.randn(8, dtype=torch.complex64))
    d = nn.Parameter(c.detach().clone())
    ours = roundpipe.optim.AdamW([c], state_dtype=torch.bfloat16)
    theirs = torch.optim.AdamW([d])
    for _ in range(2):
        g = torch.randn(8, dtype=torch.complex64)
        c.grad, d.grad = g.clone(), g.clone()
        ours.step(), theirs.step()
    assert torch.equal(c, d)


def _fail_allocations_after(monkeypatch, n_ok):
    """Make the n_ok+1-th state allocation fail as torch's CPU allocator does."""
    from roundpipe.optim import one_pass
    real, calls = one_pass.OnePass._moment, []

    def moment(self, p, *rest):
        calls.append(p)
        if len(calls) > n_ok:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                               "can't allocate memory: you tried to allocate 4096 bytes.")
        return real(self, p, *rest)
    monkeypatch.setattr(one_pass.OnePass, "_moment", moment)
    return lambda: monkeypatch.setattr(one_pass.OnePass, "_moment", real)


def _state_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for key, v in a["state"][k].items():
            assert torch.equal(v, b["state"][k][key]), (k, key)


@pytest.mark.parametrize("name, kwargs", [
    ("AdamW", dict(lr=1e-2, amsgrad=True)),
    ("SGD", dict(lr=1e-2, momentum=0.9, dampening=0.5))])  # a fresh buffer != a zero one
@pytest.mark.parametrize("kernel", ["native", "fused"])
def test_running_out_of_host_memory_for_state_changes_nothing(name, kwargs, kernel,
                                                              monkeypatch):
    """The state of every group is allocated before any group is updated: an allocation
    that fails in the second group raises HostOutOfMemoryError (bytes, way out) and leaves
    parameters and optimizer state as they were, so a retry equals a run that never
    failed, on the first step and after a group was added."""
    from roundpipe import HostOutOfMemoryError
    cls = getattr(roundpipe.optim, name)

    def run(fail_at):
        model, x, weight = _branches(torch.float32)
        lins = list(model.lins)
        groups = [{"params": [p for m in lins[:3] for p in m.parameters()]},
                  {"params": [p for m in lins[3:5] for p in m.parameters()], "lr": 3e-3}]
        opt = cls(groups, state_dtype=torch.bfloat16, kernel=kernel, **kwargs)
        n_keys = 3 if name == "AdamW" else 1
        for step in range(3):
            if step == 2:  # a group added later: only its state is new
                opt.add_param_group({"params": list(lins[5].parameters())})
            opt.zero_grad()
            (model(x * (step + 1)) * weight).sum().backward()
            if step == fail_at:
                # step 0: the first group's 6 parameters and one tensor of the second
                # get their state; step 2: the new group's first parameter
                restore = _fail_allocations_after(monkeypatch, n_keys * 6 + 1
                                                  if step == 0 else n_keys)
                before_p = [p.detach().clone() for p in model.parameters()]
                before_s = copy.deepcopy(opt.state_dict())
                with pytest.raises(HostOutOfMemoryError, match=r"GiB of bfloat16 for "
                                   r"[\d,]+ parameters.*Nothing was updated") as e:
                    opt.step()
                assert "state_dtype" not in str(e.value).split("to need less")[1]
                restore()
                assert all(torch.equal(a, b) for a, b in zip(before_p, model.parameters()))
                _state_equal(opt.state_dict(), before_s)
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()

    clean_p, clean_s = run(None)
    for fail_at in (0, 2):
        params, state = run(fail_at)
        assert all(torch.equal(a, b) for a, b in zip(clean_p, params)), fail_at
        _state_equal(state, clean_s)


def test_a_pipe_step_that_runs_out_of_host_memory_for_state_can_be_retried(monkeypatch):
    """Through pipe.step: StepError caused by HostOutOfMemoryError, masters, weights and
    optimizer state unchanged, and the retried step equals one that never failed."""
    from roundpipe import HostOutOfMemoryError
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731

    def run(fail):
        torch.manual_seed(0)
        model, args, kw = models.gpt(layers=2)
        model = model.to(torch.bfloat16)
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32) as pipe:
            masters = list(pipe.optim_parameters())
            opt = roundpipe.optim.AdamW([{"params": masters[:4]}, {"params": masters[4:],
                                                                   "weight_decay": 0.0}],
                                        lr=1e-2)
            pipe.forward_backward(input_args=args, input_kwargs=kw, loss_fn=loss_fn)
            if fail:
                restore = _fail_allocations_after(monkeypatch, 2 * 4 + 1)
                weights = [w.detach().clone() for w in model.parameters()]
                with pytest.raises(StepError, match="HostOutOfMemoryError") as e:
                    pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
                assert isinstance(e.value.__cause__, HostOutOfMemoryError)
                restore()
                assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
                assert all(torch.equal(m, w.float()) for m, w in zip(masters,
                                                                     model.parameters()))
                assert opt.state_dict()["state"] == {}
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            pipe.synchronize()
            return [m.detach().clone() for m in masters]
    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
