"""Adversarial review of the overlapped exact step (pipe.step(opt)): each test shows a
bug found in e499e07/88d093e."""

from __future__ import annotations

import copy
import threading
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


def _data(steps: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g))
            for _ in range(steps)]


def _pipe(model, devices=2):
    return RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))


def _fb(pipe, x, y):
    return pipe.forward_backward(
        input_args=(x.to(torch.bfloat16),), label=y.to(torch.bfloat16),
        loss_fn=lambda o, t: F.mse_loss(o.float(), t.float()))


def _within(fn, seconds=30.0, pipe=None):
    """fn() on a thread; its result, or raise if it did not return in time (a hang).
    ``pipe``: on a hang its fences are opened afterwards, so that closing it ends."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if pipe is not None:  # unblock the stuck uploads so the test can close the pipe
            fences = pipe._state.fences
            fences.publish_all(fences.target)
            t.join(seconds)
        raise AssertionError(f"hung for {seconds} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_call_after_a_step_that_failed_while_preparing_does_not_hang(
        tmp_path, overlap, offload) -> None:
    """pipe.step(opt) fails while allocating state (raises StepError, 'changes nothing');
    the user catches it and runs the next call without another step: it must run (as
    after a failing plain exact step), not wait for ever for the failed step's fence
    version, which step_by_unit scheduled and _run_by_unit never publishes."""
    base = _model().to(torch.bfloat16)
    kw = dict(offload_dir=str(tmp_path / "tier")) if offload else {}
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3), **kw) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]
        _fb(pipe, x, y)
        real = opt._allocate_state

        def no_memory(work):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        opt._allocate_state = no_memory
        with pytest.raises(StepError):
            if overlap:
                pipe.step(opt)
            else:
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
        opt._allocate_state = real
        _within(lambda: _fb(pipe, x, y), pipe=pipe)


def _fail_on_second_unit(monkeypatch, delay=0.0):
    """_update_group raises on its second call (after unit 0 was updated and published)."""
    real = roundpipe.optim.AdamW._update_group
    calls = []

    def flaky(self, group, pairs):
        calls.append(1)
        if delay:
            time.sleep(delay)
        if len(calls) == 2:
            raise RuntimeError("boom in unit 1")
        return real(self, group, pairs)
    monkeypatch.setattr(roundpipe.optim.AdamW, "_update_group", flaky)
    return calls


def test_a_step_failing_part_way_is_not_reported_as_changing_nothing(monkeypatch) -> None:
    """A failure after unit 0 was updated and published leaves the weights mixing two
    steps (runtime/optimizer.py says so in the fence's message), but when the step has
    already failed by the time the next call starts, the next call reports the generic
    'the model weights are unchanged since the last successful step and the masters
    were reset to them; fix step_fn and call step() again': false on both counts."""
    base = _model().to(torch.bfloat16)
    with _pipe(copy.deepcopy(base)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]
        _fb(pipe, x, y)
        before = {k: v.clone() for k, v in pipe.model.state_dict().items()}
        _fail_on_second_unit(monkeypatch)
        pipe.step(opt)  # prepared: returns; the update fails in unit 1
        future = pipe._optimizer._pending[-1]
        _within(lambda: future.exception(), pipe=pipe)  # the step has failed now
        with pytest.raises(StepError) as info:
            _within(lambda: _fb(pipe, x, y), pipe=pipe)
        after = pipe.model.state_dict()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert changed, "unit 0 was published with the new weights"
        message = str(info.value)
        assert "unchanged" not in message and "reset" not in message, message


def test_after_a_part_way_failure_and_a_reload_later_steps_do_not_raise_the_old_failure(
        monkeypatch) -> None:
    """After a step failed part-way the message says 'load a checkpoint'; once loaded,
    a later overlapped step's next call must not raise the old step's failure (the
    fences keep every failed version for ever, and wait() raises for any failed version
    below the one it waits for whenever it has to wait)."""
    base = _model().to(torch.bfloat16)
    with _pipe(copy.deepcopy(base)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]
        _fb(pipe, x, y)
        pipe.step(opt)
        _fb(pipe, x, y)
        saved_pipe = copy.deepcopy(pipe.state_dict())
        saved_opt = copy.deepcopy(opt.state_dict())
        calls = _fail_on_second_unit(monkeypatch)
        pipe.step(opt)
        with pytest.raises(StepError):
            _within(lambda: (pipe.synchronize(), _fb(pipe, x, y)), pipe=pipe)
        # recover as told: load the checkpoint
        pipe.load_state_dict(saved_pipe)
        opt.load_state_dict(saved_opt)
        _fb(pipe, x, y)
        # a slow (but healthy) update: the next call has to wait for some unit
        assert len(calls) >= 2
        monkeypatch.undo()
        _slow_updates(monkeypatch)  # healthy but slow: the next call waits for a unit
        pipe.step(opt)
        _within(lambda: _fb(pipe, x, y), pipe=pipe)  # raises the old failure


def _slow_updates(monkeypatch, delay=0.05):
    real = roundpipe.optim.AdamW._update_group

    def slow(self, group, pairs):
        time.sleep(delay)
        return real(self, group, pairs)
    monkeypatch.setattr(roundpipe.optim.AdamW, "_update_group", slow)


def _state_of(sd):
    return {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_the_optimizer_state_read_right_after_an_exact_step_is_that_steps(
        monkeypatch, overlap) -> None:
    """After an exact pipe.step(...) returns, opt.state_dict() (torch.save(opt.state_dict())
    at the end of an epoch, as with any torch loop) must hold the step's state: with
    pipe.step(opt) it is read while the step still updates units, a torn state (some
    units' moments and step counts from step k, others from k + 1)."""
    base = _model().to(torch.bfloat16)
    with _pipe(copy.deepcopy(base)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        for x, y in _data(2):
            _fb(pipe, x, y)
            pipe.step(opt)
        _fb(pipe, *_data(3)[2])
        _slow_updates(monkeypatch)
        if overlap:
            pipe.step(opt)
        else:
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        read = _state_of(opt.state_dict())  # as torch.save(opt.state_dict(), f) reads it
        pipe.synchronize()
        final = _state_of(opt.state_dict())
    torn = [(i, k) for i in final for k in final[i] if not torch.equal(read[i][k], final[i][k])]
    assert not torn, torn


def test_loading_optimizer_state_right_after_pipe_step_does_not_mix_into_the_step(
        monkeypatch) -> None:
    """opt.load_state_dict(saved) right after pipe.step(opt) (a resume, or rolling back
    a bad step) replaces opt.state while the overlapped step is still updating: the
    remaining units step with the loaded moments and the loaded state is then advanced
    for those units only.  After synchronize, the optimizer must hold exactly what was
    loaded (as with the plain exact step, which finished before step() returned)."""
    base = _model().to(torch.bfloat16)
    with _pipe(copy.deepcopy(base)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]
        _fb(pipe, x, y)
        pipe.step(opt)
        saved = copy.deepcopy(opt.state_dict())
        _fb(pipe, x, y)
        _slow_updates(monkeypatch)
        pipe.step(opt)
        opt.load_state_dict(copy.deepcopy(saved))
        pipe.synchronize()
        got = _state_of(opt.state_dict())
    want = _state_of(saved)
    changed = [(i, k) for i in want for k in want[i] if not torch.equal(want[i][k], got[i][k])]
    assert not changed, changed


def _train(model, overlap, make_opt, monkeypatch=None, steps=3, schedule=True,
           devices=2, slow=False):
    losses = []
    with _pipe(model, devices) as pipe:
        opt = make_opt(pipe.optim_parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) \
            if schedule else None
        if slow:
            _slow_updates(monkeypatch, 0.02)
        for x, y in _data(steps):
            losses.append(_fb(pipe, x, y))
            if overlap:
                assert pipe.step_overlap(opt) == "per unit"
                pipe.step(opt)
            else:
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            if sched is not None:
                sched.step()  # right after step(): must change the next step only
        pipe.synchronize()
        masters = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    return losses, masters


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])), (a[0], b[0])
    diff = [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]
    assert not diff, diff


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_a_tensor_lr_changed_by_a_scheduler_right_after_step_changes_only_the_next_step(
        monkeypatch, tensor_lr) -> None:
    """frozen_groups copies each group dict, but a tensor lr (torch.optim accepts one)
    stays shared, and torch's LR schedulers write it in place (fill_): the scheduler's
    step right after pipe.step(opt) changes the lr of the units not yet updated."""
    def make(ps):
        lr = torch.tensor(1e-2) if tensor_lr else 1e-2
        return roundpipe.optim.AdamW(ps, lr=lr, weight_decay=0.1)
    base = _model().to(torch.bfloat16)
    plain = _train(copy.deepcopy(base), False, make)
    _same(plain, _train(copy.deepcopy(base), True, make, monkeypatch, slow=True))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_parameter_frozen_after_its_gradient_landed_is_published_by_the_step(
        overlap) -> None:
    """As in eager PyTorch, a parameter frozen (requires_grad_(False)) after the backward
    keeps its gradient and the step updates it.  The plain exact step publishes every
    master; publishing_schedule builds its units from parameters that require grad
    now, so pipe.step(opt) updates the master but never copies it into the weight,
    while it opens the fence: later calls compute with the stale weight, and even
    after synchronize() the weight differs from its master."""
    model = _model().to(torch.bfloat16)
    with _pipe(model) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]
        _fb(pipe, x, y)
        before = model[1][0].weight.detach().clone()
        model[1][0].weight.requires_grad_(False)
        if overlap:
            pipe.step(opt)
        else:
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        pipe.synchronize()
        master = pipe._state.masters()["1.0.weight"].detach()
        assert not torch.equal(master.to(torch.bfloat16), before)  # the step updated it
        assert torch.equal(model[1][0].weight.detach(), master.to(torch.bfloat16))


def _async_then_exact(overlap):
    losses = []
    with _pipe(_model().to(torch.bfloat16)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)

        def fn():
            opt.step()
            opt.zero_grad()

        def exact():
            pipe.step(opt) if overlap else pipe.step(fn)
        d = _data(5)
        losses.append(_fb(pipe, *d[0]))
        exact()
        losses.append(_fb(pipe, *d[1]))
        pipe._optimizer.submit(lambda: time.sleep(0.5))  # the optimizer thread is busy
        pipe.step(fn, is_async=True)
        exact()
        for x, y in d[2:4]:
            losses.append(_fb(pipe, x, y))
            pipe.step(fn, is_async=True)
        losses.append(_fb(pipe, *d[4]))
        pipe.synchronize()
        masters = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    return losses, masters


def test_pipe_step_opt_right_after_the_first_async_step_keeps_the_prediction_exact(
        ) -> None:
    """step() decides to overlap before it waits for older steps: right after the first
    asynchronous step (weight prediction on), whose publish keeps the masters for the
    prediction only once it runs on the optimizer thread, previous_masters() is still
    empty, so pipe.step(opt) walks the units, and its per-unit publish does not refresh
    the kept masters as every other step's publish does: the next asynchronous step
    predicts from stale masters.  The optimizer thread is held here the way an
    asynchronous checkpoint holds it (pipe._optimizer.submit) to make the race
    deterministic."""
    _same(_async_then_exact(False), _async_then_exact(True))


def test_after_a_part_way_failure_no_call_runs_on_the_mixed_weights_until_a_load(
        monkeypatch) -> None:
    """'A failure after the first unit poisons that fence version so no call mixes two
    steps': only while that version is the one waited for.  pipe.synchronize() (or any
    publish: pipe.step(fn), a plain step) raises the failure once, then schedules and
    publishes a new version over every fence, and the next call runs silently on unit
    0's new weights with the other units' old ones (and the masters and optimizer state
    as mixed), though nothing was loaded."""
    with _pipe(_model().to(torch.bfloat16)) as pipe:
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        x, y = _data(1)[0]
        _fb(pipe, x, y)
        _fail_on_second_unit(monkeypatch)
        pipe.step(opt)
        with pytest.raises(StepError):
            pipe.synchronize()
        monkeypatch.undo()
        with pytest.raises(StepError, match="mix two steps"):
            pipe.synchronize()  # publishing now would hand the mix to every call
        with pytest.raises(StepError, match="mix two steps"):
            _within(lambda: _fb(pipe, x, y), pipe=pipe)
        with pytest.raises(StepError, match="mix two steps"):
            pipe.step(opt)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_param_group_added_right_after_step_keeps_its_gradient(monkeypatch,
                                                                  overlap) -> None:
    """The optimizer covers the first blocks; after a step the user adds the rest as a
    new group (progressive unfreezing), whose masters hold gradients (never zeroed:
    they were in no optimizer).  The plain step zeroed its own groups before step()
    returned; pipe.step(opt)'s zero_grad() runs later on the optimizer thread over the
    live param_groups and also drops the new group's gradients, so the next step does
    not update them as eager (and the plain exact step) would."""
    with _pipe(_model().to(torch.bfloat16)) as pipe:
        named = pipe.optim_named_parameters()
        first = [p for n, p in named if int(n.split(".")[0]) < 2]
        rest = [p for n, p in named if int(n.split(".")[0]) >= 2]
        opt = roundpipe.optim.AdamW(first, lr=1e-2)
        x, y = _data(1)[0]
        _fb(pipe, x, y)
        _slow_updates(monkeypatch)
        if overlap:
            pipe.step(opt)
        else:
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        opt.add_param_group({"params": rest})
        pipe.synchronize()
        before = rest[0].detach().clone()
        pipe.step(lambda: (opt.step(), opt.zero_grad()))  # steps the new group too
        assert not torch.equal(rest[0].detach(), before), "the new group's gradient was lost"
