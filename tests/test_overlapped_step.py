"""The exact step the next call overlaps: ``pipe.step(opt)`` with a ``roundpipe.optim``
optimizer updates and publishes the masters unit by unit, so the next call waits only for
the units it uploads.  It must be bitwise the plain exact step (``pipe.step(fn)``, which
the next call waits for whole), on any device count, with clipping, and change nothing
when it fails."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import roundpipe.optim
from roundpipe import RoundPipe, RoundPipeRunConfig, StepError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)))


def _data(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g))
            for _ in range(steps)]


def _run(model: nn.Module, devices: int, overlap: bool, *, clip: float | None = None,
         make_opt=None, schedule: bool = False, events: bool = False):
    make_opt = make_opt or (lambda ps: roundpipe.optim.AdamW(ps, lr=1e-2,
                                                              weight_decay=0.1))
    losses = []
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = make_opt(pipe.optim_parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) \
            if schedule else None
        if events:
            pipe._state.fences.events = []
        for x, y in _data():
            losses.append(pipe.forward_backward(
                input_args=(x.to(torch.bfloat16),), label=y.to(torch.bfloat16),
                loss_fn=lambda o, t: F.mse_loss(o.float(), t.float())))
            if clip is not None:
                pipe.clip_grad_norm_(clip)
            if overlap:
                assert pipe.step_overlap(opt) == "per unit"
                pipe.step(opt)
            else:
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            if sched is not None:
                sched.step()  # right after step(): must change the next step only
        pipe.synchronize()
        state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        masters = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        fence_events = list(pipe._state.fences.events or [])
    return losses, weights, masters, state, fence_events


def _equal(a, b) -> None:
    la, wa, ma, sa, _ = a
    lb, wb, mb, sb, _ = b
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    for d1, d2 in ((wa, wb), (ma, mb), (sa, sb)):
        assert d1.keys() == d2.keys()
        for k in d1:
            assert torch.equal(d1[k], d2[k]), k


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_overlapped_exact_step_is_bitwise_the_plain_exact_step(devices, clip) -> None:
    base = _model().to(torch.bfloat16)
    plain = _run(copy.deepcopy(base), devices, overlap=False, clip=clip)
    overlapped = _run(copy.deepcopy(base), devices, overlap=True, clip=clip)
    _equal(plain, overlapped)
    # the run trains: the weights moved
    assert not torch.equal(plain[1]["0.0.weight"], base.state_dict()["0.0.weight"])


def test_overlapped_step_is_invariant_to_the_device_count() -> None:
    base = _model().to(torch.bfloat16)
    _equal(_run(copy.deepcopy(base), 1, overlap=True),
           _run(copy.deepcopy(base), 3, overlap=True))


def test_a_scheduler_stepping_after_step_changes_only_the_next_step() -> None:
    base = _model().to(torch.bfloat16)
    _equal(_run(copy.deepcopy(base), 2, overlap=False, schedule=True),
           _run(copy.deepcopy(base), 2, overlap=True, schedule=True))


def test_sgd_with_momentum_overlaps_bitwise() -> None:
    def make(ps):
        return roundpipe.optim.SGD(ps, lr=0.1, momentum=0.9)
    base = _model().to(torch.bfloat16)
    _equal(_run(copy.deepcopy(base), 2, overlap=False, make_opt=make),
           _run(copy.deepcopy(base), 2, overlap=True, make_opt=make))


def test_units_are_published_in_upload_order_and_the_next_call_reads_new_weights() -> None:
    """Each unit's weights are published before the next call uploads them, in forward
    order, and not all at once at the end (the overlap)."""
    base = _model().to(torch.bfloat16)
    *_, events = _run(copy.deepcopy(base), 2, overlap=True, events=True)
    publishes = [(name, v) for what, name, v, _ in events if what == "publish_end"]
    times = {(what, name, v): t for what, name, v, t in events}
    versions = sorted({v for _, v in publishes})
    assert len(versions) >= 3
    for v in versions[:-1]:  # the last step's publish has no next call
        names = [n for n, ver in publishes if ver == v]
        blocks = [int(n.split(".")[0]) for n in names]
        assert blocks == sorted(blocks), names  # forward (upload) order
        for name in names:
            up = times.get(("upload", name, v))
            assert up is not None and up >= times[("publish_end", name, v)], name


def test_torch_optimizers_and_opaque_step_fns_are_not_overlapped_and_stay_exact() -> None:
    base = _model().to(torch.bfloat16)
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        assert pipe.step_overlap(opt).startswith("whole update: AdamW steps all")
        mine = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        assert pipe.step_overlap(mine) == "per unit"
        handle = mine.register_step_post_hook(lambda *a: None)
        assert "hooks" in pipe.step_overlap(mine)
        handle.remove()
        mine.step = lambda *a, **k: None  # replaced on the instance: never bypassed
        assert "replaced on the instance" in pipe.step_overlap(mine)
        del mine.step

        class Custom(roundpipe.optim.AdamW):
            def step(self, closure=None):
                return super().step(closure)
        assert "overrides step()" in pipe.step_overlap(
            Custom(pipe.optim_parameters(), lr=1e-2))
        assert pipe.step_overlap(mine) == "per unit"
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=None) as pipe:
        assert "no separate masters" in pipe.step_overlap(
            roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2))
    # pipe.step(torch optimizer) is exact: equal to the step_fn form
    plain = _run(copy.deepcopy(base), 2, overlap=False,
                 make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        losses = []
        for x, y in _data():
            losses.append(pipe.forward_backward(
                input_args=(x.to(torch.bfloat16),), label=y.to(torch.bfloat16),
                loss_fn=lambda o, t: F.mse_loss(o.float(), t.float())))
            pipe.step(opt)
        assert all(torch.equal(a, b) for a, b in zip(losses, plain[0]))


def test_a_failing_overlapped_step_raises_at_step_and_changes_nothing() -> None:
    base = _model().to(torch.bfloat16)
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]

        def fb():
            return pipe.forward_backward(
                input_args=(x.to(torch.bfloat16),), label=y.to(torch.bfloat16),
                loss_fn=lambda o, t: F.mse_loss(o.float(), t.float()))
        fb()
        pipe.step(opt)
        fb()
        before_w = {k: v.clone() for k, v in pipe.model.state_dict().items()}
        before_m = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        before_s = copy.deepcopy(opt.state_dict())
        # the host runs out of memory while the step allocates its state
        real = opt._allocate_state

        def no_memory(work):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        opt._allocate_state = no_memory
        with pytest.raises(StepError, match="allocate memory"):
            pipe.step(opt)
        opt._allocate_state = real
        after_w = pipe.model.state_dict()
        assert all(torch.equal(before_w[k], after_w[k]) for k in before_w)
        after_m = pipe.state_dict()
        assert all(torch.equal(before_m[k], after_m[k]) for k in before_m)
        after_s = opt.state_dict()["state"]
        for i, st in before_s["state"].items():
            for key, value in st.items():
                assert torch.equal(value, after_s[i][key])
        # and the next step works
        pipe.step(opt)
        fb()


def test_the_plan_says_which_exact_step_applies() -> None:
    with RoundPipe(_model().to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        x, y = _data(1)[0]
        pipe.forward_backward(input_args=(x.to(torch.bfloat16),),
                              label=y.to(torch.bfloat16),
                              loss_fn=lambda o, t: F.mse_loss(o.float(), t.float()))
        mine = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        est = pipe.host_step_estimate(mine)
        stages = pipe.plan.stages
        weights = sum(s.param_bytes for s in stages if s.kind in ("fwd", "fused"))
        assert est.exact_step == "per unit"
        assert est.exposed_share == pytest.approx(stages[0].param_bytes / weights)
        assert 0 < est.exposed_share < 1
        assert "per unit with pipe.step(opt)" in str(pipe.plan)
        torch_est = pipe.host_step_estimate(torch.optim.SGD(pipe.optim_parameters(), lr=1))
        assert torch_est.exact_step.startswith("whole update: SGD")
        assert torch_est.exposed_share == 1.0


def test_the_next_call_measures_the_time_it_waited_for_a_publishing_step(monkeypatch) -> None:
    """pipe.stats().weights_wait_s: the time the call's jobs stood still for weights a
    step had not published yet; zero without a step in flight."""
    import time
    real = roundpipe.optim.AdamW._update_group

    def slow(self, group, pairs):
        time.sleep(0.05)
        return real(self, group, pairs)
    with RoundPipe(_model().to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]

        def fb():
            pipe.forward_backward(input_args=(x.to(torch.bfloat16),),
                                  label=y.to(torch.bfloat16),
                                  loss_fn=lambda o, t: F.mse_loss(o.float(), t.float()))
            return pipe.stats().weights_wait_s
        fb()
        pipe.step(lambda: (opt.step(), opt.zero_grad()))  # waited for whole
        assert fb() < 0.01  # nothing in flight: at most lock noise
        monkeypatch.setattr(roundpipe.optim.AdamW, "_update_group", slow)
        pipe.step(opt)  # five units of 50 ms, the first job waits for its own
        waited = fb()
        assert 0.04 <= waited <= 5.0


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_taken_while_the_overlapped_step_runs_resumes_bitwise(
        tmp_path, sharded) -> None:
    """save_checkpoint right after pipe.step(opt) (the step may still be updating) saves
    the step's result; a fresh pipe loaded from it continues bitwise as the run would."""
    from roundpipe import load_checkpoint, save_checkpoint
    base = _model().to(torch.bfloat16)
    data = _data(5)

    def fb(pipe, x, y):
        return pipe.forward_backward(
            input_args=(x.to(torch.bfloat16),), label=y.to(torch.bfloat16),
            loss_fn=lambda o, t: F.mse_loss(o.float(), t.float()))

    def make(model, devices):
        return RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                         model_run_config=RoundPipeRunConfig(num_microbatch=3))

    path = tmp_path / ("ckpt" if sharded else "ckpt.pt")
    with make(copy.deepcopy(base), 1) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        losses = []
        for i, (x, y) in enumerate(data):
            losses.append(fb(pipe, x, y))
            pipe.step(opt)
            if i == 2:
                save_checkpoint(path, pipe, opt, sharded=sharded)
        pipe.synchronize()
        want = {k: v.clone() for k, v in pipe.state_dict().items()}
    with make(copy.deepcopy(base), 3) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        load_checkpoint(path, pipe, opt)
        resumed = []
        for x, y in data[3:]:
            resumed.append(fb(pipe, x, y))
            pipe.step(opt)
        pipe.synchronize()
        got = pipe.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(losses[3:], resumed))
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_parameter_only_the_loss_fn_reads_is_published_before_the_next_call_reads_it(
        ) -> None:
    """A parameter no unit reads (a learned temperature only ``loss_fn`` uses) has no
    fence the next call waits for: its update must be published before the units' (whose
    fences the call waits for before its loss), or the next loss reads it stale."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = _model()
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.layers(x)

    def run(overlap: bool):
        model = Scaled()
        with RoundPipe(model, devices=["cpu"] * 3, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
            fences = pipe._state.fences
            record = fences.record

            def slow_record(event, name, version):  # the temperature is published late
                if event == "publish_begin" and name == "scale":
                    time.sleep(0.3)
                return record(event, name, version)
            fences.record = slow_record
            losses = []
            for x, y in _data(3):
                losses.append(pipe.forward_backward(
                    input_args=(x,), label=y,
                    loss_fn=lambda o, t: F.mse_loss(o * model.scale, t)))
                pipe.step(opt)
                if not overlap:
                    pipe.synchronize()
                else:
                    assert pipe.step_overlap(opt) == "per unit"
            pipe.synchronize()
        return losses

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
