"""``forward_backward(..., step=opt)``: the step consumes each unit's gradients as they
land during the backward.  It must be bitwise ``forward_backward`` followed by
``pipe.step(opt)`` (weights, masters, optimizer state, losses) on any device count, with
and without the disk tier; hold a window of units' gradients, not the model's; fall back
to the plain order where it cannot be exact; and change nothing, or refuse calls until a
load, when it fails."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
from hypothesis import given, settings, strategies as st
import torch
import torch.nn as nn
import torch.nn.functional as F

import roundpipe.optim
from roundpipe import RoundPipe, RoundPipeRunConfig, StepError
from roundpipe.runtime.offload import RESIDENT_BYTES


def _model(width: int = 8, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(depth))).to(torch.bfloat16)


def _data(steps: int = 3, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, width, generator=g).to(torch.bfloat16),
             torch.randn(6, width, generator=g).to(torch.bfloat16)) for _ in range(steps)]


def _loss(o, t):
    return F.mse_loss(o.float(), t.float())


def _adamw(ps):
    return roundpipe.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def _run(model: nn.Module, devices: int, landing: bool, *, make_opt=_adamw,
         offload_dir=None, steps: int = 2, width: int = 8):
    losses = []
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                   offload_dir=offload_dir,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = make_opt(pipe.optim_parameters())
        peaks = []
        for x, y in _data(steps, width):
            if landing:
                losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                    loss_fn=_loss, step=opt))
                assert pipe.landing_step(opt) == "as gradients land"
            else:
                losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                    loss_fn=_loss))
                pipe.step(opt)
            peaks.append(pipe.host_memory().landing_peak)
        pipe.synchronize()
        state = {k: {n: v.clone() for n, v in s.items()}
                 for k, s in opt.state_dict()["state"].items()}
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        masters = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        grads = [p.grad for p in pipe.optim_parameters()]
        memory = pipe.host_memory(opt)
    return dict(losses=losses, weights=weights, masters=masters, state=state,
                grads=grads, peaks=peaks, memory=memory)


def _equal(a, b) -> None:
    assert len(a["losses"]) == len(b["losses"])
    assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
    for key in ("weights", "masters"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for n in a["state"][k]:
            assert torch.equal(a["state"][k][n], b["state"][k][n]), (k, n)


def _sgd(ps):
    return roundpipe.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01)


def _adamw_bf16(ps):
    return roundpipe.optim.AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16)


@functools.cache
def _default_run(devices: int, landing: bool, make_opt):
    return _run(_model(), devices, landing, make_opt=make_opt)


def _default(devices: int, landing: bool, make_opt=_adamw):
    """``_run`` of the default model without the disk tier, computed once per arguments
    in this process (several tests compare with the same runs); a copy for each caller."""
    return copy.deepcopy(_default_run(devices, landing, make_opt))


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("make_opt", [_adamw, _sgd, _adamw_bf16],
                         ids=["adamw", "sgd", "adamw-bf16-state"])
def test_stepping_as_gradients_land_is_bitwise_the_plain_step(devices, make_opt) -> None:
    plain = _default(devices, landing=False, make_opt=make_opt)
    landed = _default(devices, landing=True, make_opt=make_opt)
    _equal(plain, landed)
    assert all(g is None for g in landed["grads"])  # consumed, as step's zero_grad


def test_it_is_invariant_to_the_device_count() -> None:
    _equal(_default(1, landing=True), _default(3, landing=True))


@pytest.mark.parametrize("devices, make_opt", [(1, _adamw), (3, _adamw), (3, _sgd),
                                               (3, _adamw_bf16)],
                         ids=["adamw-1", "adamw-3", "sgd-3", "adamw-bf16-state-3"])
def test_with_the_disk_tier_it_is_bitwise_the_in_memory_plain_step(devices, make_opt,
                                                                    tmp_path) -> None:
    base = _model()
    plain = _default(1, landing=False, make_opt=make_opt)
    tiered = _run(copy.deepcopy(base), devices, landing=True, make_opt=make_opt,
                  offload_dir=str(tmp_path / "tier"))
    _equal(plain, tiered)
    # the masters stay in their files (but those small enough to stay resident)
    masters = sum(p.numel() for p in base.parameters())
    assert tiered["memory"].masters <= 2 * len(list(base.parameters())) * RESIDENT_BYTES
    assert tiered["memory"].disk_masters >= 4 * masters


def test_the_landed_gradients_are_a_window_of_units_not_the_model() -> None:
    base = _model(width=64, depth=12)
    plain = _run(copy.deepcopy(base), 2, landing=False, steps=2, width=64)
    landed = _run(copy.deepcopy(base), 2, landing=True, steps=2, width=64)
    whole = sum(p.numel() * 2 for p in base.parameters())
    assert plain["peaks"][-1] >= whole
    # every unit is 64*64+64 bf16; at most a few units' buffers at once
    unit = (64 * 64 + 64) * 2
    assert max(landed["peaks"]) <= 4 * unit < whole / 2, (landed["peaks"], whole)
    assert landed["memory"].landing <= 2 * unit
    assert plain["memory"].landing >= whole


def _snapshot(pipe, opt):
    return dict(weights={k: v.clone() for k, v in pipe.model.state_dict().items()},
                masters={k: v.detach().clone() for k, v in pipe.state_dict().items()},
                state={k: {n: v.clone() for n, v in s.items()}
                       for k, s in opt.state_dict()["state"].items()},
                losses=[])


def _plain_steps(model, devices: int, batches):
    """The snapshot after forward_backward then pipe.step per batch (no landing step)."""
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        for xi, yi in batches:
            pipe.forward_backward(input_args=(xi,), label=yi, loss_fn=_loss)
            pipe.step(opt)
        pipe.synchronize()
        return _snapshot(pipe, opt)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 8)
        self.out.weight = self.inp.weight  # read by two units

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def _fallback_cases():
    def torch_opt(pipe):
        return torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2), None

    def subset(pipe):  # the last master is not stepped: its gradient must stay held
        return roundpipe.optim.AdamW(pipe.optim_parameters()[:-1], lr=1e-2), None

    def step_hook(pipe):
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        opt.register_step_pre_hook(lambda o, a, k: None)
        return opt, None

    def accumulated(pipe):  # a gradient held from an earlier call: the step needs the sum
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        return opt, "accumulate"

    return [("torch", _model, torch_opt, "steps all its parameters at once"),
            ("subset", _model, subset, "does not step the master"),
            ("step hook", _model, step_hook, "step hooks"),
            ("accumulate", _model, accumulated, "from an earlier call"),
            ("tied", lambda: _Tied().to(torch.bfloat16),
             lambda pipe: (roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2), None),
             "read by several units")]


@pytest.mark.parametrize("case", _fallback_cases(), ids=lambda c: c[0])
def test_what_cannot_step_as_gradients_land_runs_the_plain_order_with_a_reason(
        case, caplog) -> None:
    _, make_model, make_opt, reason = case
    base = make_model()
    results = []
    for landing in (False, True):
        model = copy.deepcopy(base)
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt, extra = make_opt(pipe)
            losses = []
            for x, y in _data(2):
                if extra == "accumulate":
                    pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
                with caplog.at_level(logging.WARNING, logger="roundpipe"):
                    if landing:
                        losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                            loss_fn=_loss, step=opt))
                    else:
                        losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                            loss_fn=_loss))
                        pipe.step(opt)
            pipe.synchronize()
            snap = _snapshot(pipe, opt)
            snap["losses"] = losses
            snap["grads"] = [p.grad for p in pipe.optim_parameters()]
            if landing:
                if extra != "accumulate":  # (between calls nothing is held)
                    assert reason in pipe.landing_step(opt)
        results.append(snap)
    _equal(*results)
    for a, b in zip(*(r["grads"] for r in results)):  # what stays held stays held
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert any(reason in r.getMessage() for r in caplog.records), caplog.text


def test_a_failing_loss_in_a_later_microbatch_changes_nothing() -> None:
    (x, y), (x2, y2) = _data(2)
    # what both cases must end as: the plain order over the two good calls
    plain = _plain_steps(_model(), 3, ((x, y), (x2, y2)))
    for bad in ("raise", "nan"):
        with RoundPipe(_model(), devices=["cpu"] * 3, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt = _adamw(pipe.optim_parameters())
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, step=opt)
            before = _snapshot(pipe, opt)
            seen = []

            def failing(o, t):
                seen.append(1)
                if len(seen) == 3:  # the last microbatch: earlier ones ran their backward
                    if bad == "raise":
                        raise ValueError("bad batch")
                    return _loss(o, t) * float("nan")
                return _loss(o, t)
            with pytest.raises(Exception, match="bad batch|nothing was committed"):
                pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=failing,
                                      step=opt)
            _equal(before, _snapshot(pipe, opt))
            # and the pipe goes on as if the failed call had not been made
            pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)
            _equal(_snapshot(pipe, opt), plain)


def test_a_failure_after_a_unit_was_updated_refuses_calls_until_a_load() -> None:
    with RoundPipe(_model(), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        (x, y), (x2, y2) = _data(2)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, step=opt)
        checkpoint = (copy.deepcopy(pipe.state_dict()), copy.deepcopy(opt.state_dict()))
        before = _snapshot(pipe, opt)
        real, count = opt.step_landed, []

        def third_unit_fails(*args, **kwargs):
            count.append(1)
            if len(count) == 3:
                raise RuntimeError("injected")
            return real(*args, **kwargs)
        opt.step_landed = third_unit_fails
        with pytest.raises(StepError, match="part-way"):
            pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)
        del opt.step_landed
        with pytest.raises(StepError, match="Load a checkpoint"):
            pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)
        with pytest.raises(StepError, match="Load a checkpoint"):
            pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss)
        pipe.load_state_dict(checkpoint[0])
        opt.load_state_dict(checkpoint[1])
        pipe.synchronize()
        _equal(before, _snapshot(pipe, opt))
        pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)


def test_a_disk_read_failing_before_or_after_the_first_unit(tmp_path) -> None:
    base = _model()
    (x, y), (x2, y2) = _data(2)
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   offload_dir=str(tmp_path / "a"),
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, step=opt)
        before = _snapshot(pipe, opt)
        store = pipe._state.offload
        reads = []

        def fault(at):
            def f(what, key):
                if what == "read":
                    reads.append(key)
                    if len(reads) == at:
                        raise OSError("injected read error")
            return f
        store.fault = fault(1)  # the first unit's read: nothing was updated
        with pytest.raises(StepError, match="before it updated anything.*injected read"):
            pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)
        store.fault = None
        _equal(before, _snapshot(pipe, opt))
        pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)
        after = _snapshot(pipe, opt)
        reads.clear()

        def after_two_units(what, key):  # a read once two units were updated
            schedule = pipe._state.landed.unit_schedule
            if what == "read" and schedule is not None and schedule.finished >= 2:
                raise OSError("injected read error")
        store.fault = after_two_units  # refused until a load
        with pytest.raises(StepError, match="part-way"):
            pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)
        store.fault = None
        with pytest.raises(StepError, match="Load a checkpoint"):
            pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=_loss, step=opt)
    _equal(after, _plain_steps(copy.deepcopy(base), 2, ((x, y), (x2, y2))))


def test_a_disk_tier_stepped_as_gradients_land_resumes_bitwise(tmp_path) -> None:
    base = _model()
    data = _data(3)
    tier = str(tmp_path / "tier")
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 3, optim_dtype=torch.float32,
                   offload_dir=tier,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        for x, y in data[:2]:
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, step=opt)
    model = copy.deepcopy(base)
    with RoundPipe(model, devices=["cpu"] * 3, optim_dtype=torch.float32,
                   offload_dir=tier, offload_resume=True,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        x, y = data[2]
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, step=opt)
        resumed = _snapshot(pipe, opt)
        resumed["losses"] = [loss]
    with RoundPipe(copy.deepcopy(base), devices=["cpu"], optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        for x, y in data:
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
            pipe.step(opt)
        pipe.synchronize()
        plain = _snapshot(pipe, opt)
        plain["losses"] = [loss]
    _equal(plain, resumed)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(depth=st.integers(2, 5), devices=st.integers(1, 3), microbatches=st.integers(1, 3),
       frozen=st.lists(st.booleans(), min_size=5, max_size=5), sgd=st.booleans())
def test_property_any_depth_devices_microbatches_and_frozen_layers(
        depth, devices, microbatches, frozen, sgd) -> None:
    """Frozen layers (units with no gradient, a frozen prefix the backward never
    reaches), any microbatch count and device count: bitwise the plain order."""
    frozen = frozen[:depth]
    if all(frozen):
        frozen[-1] = False
    base = _model(depth=depth)
    for layer, off in zip(base, frozen):
        layer.requires_grad_(not off)
    results = []
    for landing in (False, True):
        model = copy.deepcopy(base)
        with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=microbatches)
                       ) as pipe:
            opt = (_sgd if sgd else _adamw)(pipe.optim_parameters())
            losses = []
            for x, y in _data(2):
                if landing:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=_loss, step=opt))
                    assert pipe.landing_step(opt) == "as gradients land"
                else:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=_loss))
                    pipe.step(opt)
            pipe.synchronize()
            snap = _snapshot(pipe, opt)
            snap["losses"] = losses
        results.append(snap)
    _equal(*results)


def test_after_an_overlapped_plain_step_the_next_call_steps_as_gradients_land() -> None:
    """A plain ``pipe.step(opt)`` still in flight holds the last call's gradients until
    its zero_grad: the next ``step=`` call waits for it rather than falling back."""
    base = _model()
    data = _data(3)
    results = []
    for landing in (False, True):
        with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt = _adamw(pipe.optim_parameters())
            losses = []
            for i, (x, y) in enumerate(data):
                if landing and i > 0:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=_loss, step=opt))
                    # the plain call's kept buffers are freed as its units are
                    # updated: the second such call starts without them
                    if i == 2:
                        assert pipe._landing.peak_bytes < sum(
                            p.numel() * 2 for p in base.parameters())
                else:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=_loss))
                    pipe.step(opt)  # overlapped with the next call
            pipe.synchronize()
            snap = _snapshot(pipe, opt)
            snap["losses"] = losses
        results.append(snap)
    _equal(*results)


def test_buffers_dropped_from_the_pool_are_freed_during_the_call() -> None:
    """Units of different shapes cannot reuse each other's buffers: those the pool
    drops must be freed at once, not kept alive by the call until it returns."""
    import gc
    import weakref

    torch.manual_seed(0)
    widths = [8, 10, 12, 14, 16, 18, 20, 22]
    model = nn.Sequential(*(nn.Sequential(nn.Linear(a, b), nn.Tanh())
                            for a, b in zip(widths, widths[1:]))).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    y = torch.randn(6, 22, generator=g).to(torch.bfloat16)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        landing = pipe._landing
        dropped: list = []
        alive_at_the_end: list[int] = []
        real_disown, real_recycle = landing._disown, landing.recycle

        def disown(t):
            dropped.append(weakref.ref(t))
            real_disown(t)

        def recycle(keys):
            real_recycle(keys)
            if keys and min(uid for uid, _ in keys) == 0:  # the last unit updated
                gc.collect()
                alive_at_the_end.append(sum(r() is not None for r in dropped))
        landing._disown, landing.recycle = disown, recycle
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, step=opt)
        assert pipe.landing_step(opt) == "as gradients land"
    assert len(dropped) >= 4  # shapes differ: the pool drops
    # (the last two units' buffers are the pool's, one was just dropped by the caller)
    assert alive_at_the_end and alive_at_the_end[0] <= 1, (alive_at_the_end, len(dropped))


def test_parameter_hooks_run_per_microbatch_on_the_device_and_step_as_gradients_land(
        ) -> None:
    """A hook on a parameter one unit reads runs on each microbatch's gradient on the
    device, before it lands: it does not stop the landing step, and the result is the
    plain order's bitwise."""
    base = _model()
    results = []
    for landing in (False, True):
        model = copy.deepcopy(base)
        model[2][0].weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt = _adamw(pipe.optim_parameters())
            losses = []
            for x, y in _data(2):
                if landing:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=_loss, step=opt))
                    assert pipe.landing_step(opt) == "as gradients land"
                else:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=_loss))
                    pipe.step(opt)
            pipe.synchronize()
            snap = _snapshot(pipe, opt)
            snap["losses"] = losses
        results.append(snap)
    _equal(*results)


def test_an_interrupt_while_the_call_waits_for_its_step_parts_nothing() -> None:
    """Ctrl-C while the call waits for the last units' update: the step ends whole on
    the optimizer thread and the call's commit (buffers, call and step counts) follows
    it there, so the pipe is as after the uninterrupted call."""
    base = _model()
    data = _data(2)
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        pipe.forward_backward(input_args=(data[0][0],), label=data[0][1], loss_fn=_loss,
                              step=opt)
        real_wait = pipe._optimizer.wait

        def interrupted() -> None:
            pipe._optimizer.wait = real_wait
            raise KeyboardInterrupt
        pipe._optimizer.wait = interrupted
        with pytest.raises(KeyboardInterrupt):
            pipe.forward_backward(input_args=(data[1][0],), label=data[1][1],
                                  loss_fn=_loss, step=opt)
        pipe.synchronize()
        landed = _snapshot(pipe, opt)
        counts = (pipe.call_number, pipe._steps)
    with RoundPipe(copy.deepcopy(base), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        for x, y in data:
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
            pipe.step(opt)
        pipe.synchronize()
        _equal(_snapshot(pipe, opt), landed)
        assert counts == (pipe.call_number, pipe._steps) == (2, 2)


@pytest.mark.parametrize("devices", [1, 3])
def test_a_loss_fn_reading_a_parameter_adds_its_gradient_in_the_same_step(devices) -> None:
    # A regularizer in loss_fn reads a model parameter: that part of its gradient joins
    # the unit's (never the parameter's .grad), and the landing step updates the unit
    # with the sum, as pipe.step does, in this step.
    def run(landing: bool):
        model = _model()
        with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt = _adamw(pipe.optim_parameters())
            weight = model[2][0].weight

            def loss(o, t):
                return _loss(o, t) + 0.01 * weight.float().pow(2).sum()
            losses, how = [], []
            for x, y in _data(3):
                if landing:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=loss, step=opt))
                    how.append(pipe.landing_step(opt))
                else:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=loss))
                    pipe.step(opt)
            pipe.synchronize()
            snap = _snapshot(pipe, opt)
            snap["losses"] = losses
            assert weight.grad is None  # the pipe's gradients are the masters'
        return snap, how

    (plain, _), (landed, how) = run(False), run(True)
    _equal(plain, landed)
    assert how == ["as gradients land"] * 3


class _Scaled(nn.Module):
    """A parameter only the loss reads (as CLIP's logit_scale): it is in no unit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                      for _ in range(4)))
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("devices,tier", [(1, False), (3, False), (3, True)],
                         ids=["1", "3", "3-disk"])
def test_a_parameter_only_the_loss_fn_reads_is_stepped_in_the_same_step(
        devices, tier, tmp_path) -> None:
    def run(landing: bool):
        model = _Scaled().to(torch.bfloat16)
        with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                       offload_dir=str(tmp_path / f"tier{landing}") if tier else None,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt = _adamw(pipe.optim_parameters())

            def loss(o, t):
                return _loss(o * model.scale, t)
            losses, how = [], []
            for x, y in _data(3):
                if landing:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=loss, step=opt))
                    how.append(pipe.landing_step(opt))
                else:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=loss))
                    pipe.step(opt)
            pipe.synchronize()
            snap = _snapshot(pipe, opt)
            snap["losses"] = losses
            assert model.scale.grad is None
        return snap, how

    (plain, _), (landed, how) = run(False), run(True)
    _equal(plain, landed)
    assert how == ["as gradients land"] * 3


def test_after_an_asynchronous_step_the_call_computes_with_the_weights_before_it(
        caplog) -> None:
    """After pipe.step(opt, is_async=True) without weight prediction, forward_backward
    computes with the weights from before that step (one step stale); so must
    forward_backward(step=opt), which is that call then pipe.step(opt)."""
    base = _model()
    results = []
    for landing in (False, True):
        model = copy.deepcopy(base)
        with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                       predict_weights=False,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            opt = _adamw(pipe.optim_parameters())
            data = _data(3)
            losses = [pipe.forward_backward(input_args=(data[0][0],), label=data[0][1],
                                            loss_fn=_loss)]
            pipe.step(opt, is_async=True)
            for x, y in data[1:]:
                if landing:
                    with caplog.at_level(logging.WARNING, logger="roundpipe"):
                        losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                            loss_fn=_loss, step=opt))
                else:
                    losses.append(pipe.forward_backward(input_args=(x,), label=y,
                                                        loss_fn=_loss))
                    pipe.step(opt)
            pipe.synchronize()
            snap = _snapshot(pipe, opt)
            snap["losses"] = losses
            if landing:  # the step after the stale call is exact: the next one lands
                assert pipe.landing_step(opt) == "as gradients land"
        results.append(snap)
    _equal(*results)
    assert any("asynchronous step" in r.getMessage() for r in caplog.records), caplog.text


def test_an_interrupt_right_after_the_backward_does_not_leave_the_step_waiting(
        monkeypatch) -> None:
    """The step waits for the call's end (to take what outside uses left on parameters
    no unit reads): an interrupt between the backward's end and the call telling the step
    must still tell it, or the optimizer thread waits forever."""
    import threading
    import roundpipe.api as api
    with RoundPipe(_model(), devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = _adamw(pipe.optim_parameters())
        (x, y), = _data(1)
        real = api.sum_losses
        steps = []
        init = api.LandingStep.__init__

        def recorded(self, *args, **kwargs):
            init(self, *args, **kwargs)
            steps.append(self)
        monkeypatch.setattr(api.LandingStep, "__init__", recorded)

        def interrupted(losses):
            monkeypatch.setattr(api, "sum_losses", real)
            raise KeyboardInterrupt
        monkeypatch.setattr(api, "sum_losses", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, step=opt)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (pipe.wait(), done.set()), daemon=True)
        waiter.start()
        waited = done.wait(20)
        if not waited:
            steps[0].end(False)  # release it, so the pipe closes
        assert waited, "the step still waits for the call's end"
