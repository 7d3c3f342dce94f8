"""Streaming behaviour that runs on every machine: exact transfer accounting against the
plan, double-buffered weights, same-device handoff, device memory capacity and the
out-of-memory path, memory_fraction, autocast in worker threads, and GradScaler."""

from __future__ import annotations

import copy
import functools
import itertools
import re
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
import reference
from roundpipe import (ConfigError, GradScaler, PartitionError, RoundPipe,
                       RoundPipeRunConfig, StageError)
from roundpipe.runtime.devices import VirtualCPUDevice
from roundpipe.runtime.job_runner import JobRunner

NUM_MB = 4


def _gpt_pipe(devices: int, **kw):
    model, (idx,), kwargs = models.gpt(batch=8)
    labels = torch.randint(0, 64, idx.shape)
    pipe = RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB), **kw)
    args = dict(input_args=(idx,), input_kwargs=kwargs, label=labels, loss_fn=models.lm_loss)
    return pipe, args


@pytest.mark.parametrize("devices", [2, 3])
def test_upload_volume_equals_the_plan(devices):
    """Weights: each job uploads its stage's state once.  Activations: each job uploads
    its stage's inputs once per microbatch (the trace was one microbatch, so the plan's
    per-microbatch bytes are exact)."""
    pipe, args = _gpt_pipe(devices)
    pipe.forward_backward(**args)
    plan, stats = pipe.plan, pipe.stats()
    uploaded = {c: sum(d.uploaded[c] for d in stats.devices) for c in ("weights", "activations")}
    assert uploaded["weights"] == sum(s.param_bytes for s in plan.stages)
    assert uploaded["activations"] == NUM_MB * sum(s.act_in_bytes for s in plan.stages)
    labels = args["label"]
    assert sum(d.uploaded["labels"] for d in stats.devices) == labels.numel() * 8
    # what each device uploaded is what its jobs needed
    for d, counters in enumerate(stats.devices):
        jobs = [s for s in plan.stages if s.index % devices == d]
        assert counters.uploaded["weights"] == sum(s.param_bytes for s in jobs)
    pipe.close()


def test_one_device_hands_values_over_without_the_host_round_trip():
    pipe, args = _gpt_pipe(1)
    pipe.forward_backward(**args)
    plan, stats = pipe.plan, pipe.stats()
    weights = sum(d.uploaded["weights"] for d in stats.devices)
    acts = sum(d.uploaded["activations"] for d in stats.devices)
    assert weights == sum(s.param_bytes for s in plan.stages)
    # the fused stage takes the last forward stage's outputs on the device
    fused = plan.fused_stage
    last_fwd = plan.stages[fused.index - 1]
    handed = NUM_MB * sum(v.nbytes for v in _crossing_values(pipe, last_fwd, fused))
    assert handed > 0
    assert acts == NUM_MB * sum(s.act_in_bytes for s in plan.stages) - handed
    pipe.close()


def _crossing_values(pipe, producer, consumer):
    report = pipe._current.analysis.report
    return [v for v in report.values.values()
            if producer.units[0] <= v.def_unit < producer.units[1]
            and any(consumer.units[0] <= u < consumer.units[1] for u in v.use_units)]


@pytest.mark.parametrize("devices", [1, 2])
def test_at_most_two_stages_of_weights_are_resident_and_the_next_one_is_prefetched(devices):
    pipe, args = _gpt_pipe(devices)
    pipe.forward_backward(**args)
    plan, stats = pipe.plan, pipe.stats()
    for d, counters in enumerate(stats.devices):
        sizes = sorted((s.param_bytes for s in plan.stages if s.index % devices == d),
                       reverse=True)
        assert counters.peak_weight_bytes <= sum(sizes[:2])
    # Double buffering: job k's weights were requested while job k - D (the previous job
    # on its device) was running, before job k itself started.
    timeline = {r.job: r for r in stats.timeline}
    assert len(timeline) == len(plan.stages) > devices
    for k in range(devices, len(plan.stages)):
        record, previous = timeline[k], timeline[k - devices]
        assert previous.start_s <= record.weights_requested_s <= previous.end_s
        assert record.weights_requested_s <= record.start_s
    pipe.close()


# --- memory capacity and budget ---------------------------------------------------------

def test_plan_cap_comes_from_device_capacity_and_memory_fraction():
    pipe, args = _gpt_pipe(2, device_memory="4MiB")
    pipe.forward_backward(**args)
    # The whole fraction bounds a job with the next weights prefetched: no hidden margin.
    assert pipe.plan.memory_cap == int(4 * 2**20 * 0.9)
    assert pipe.plan.device_memory_bytes <= pipe.plan.memory_cap
    stages_default = len(pipe.plan.stages)
    # A fraction just under what that plan needs re-partitions (no new trace) into more
    # stages, and the new plan fits it.
    fraction = (pipe.plan.device_memory_bytes - 1) / (4 * 2**20)
    pipe.forward_backward(**args, run_config=RoundPipeRunConfig(memory_fraction=fraction))
    assert pipe.plan.memory_cap == int(4 * 2**20 * fraction)
    assert len(pipe.plan.stages) > stages_default
    assert pipe.plan.device_memory_bytes <= pipe.plan.memory_cap
    assert len(pipe.plans) == 1
    with pytest.raises(ConfigError, match="memory_fraction must be a number in"):
        RoundPipeRunConfig(memory_fraction=1.5)
    pipe.close()


def _sum_loss(out, _label):
    logits = out["logits"] if isinstance(out, dict) else out
    return logits.float().square().mean()


@functools.cache
def _uncapped(name):
    """What the uncapped plan needs on a device, the least any plan needs (the largest
    unit and the largest weights), and the uncapped plan's stage count: plain numbers
    from a probe pipe, computed once for both capacities below."""
    model, inputs, kwargs = getattr(models, name)(batch=8)
    probe = RoundPipe(model, devices=["cpu"] * 2,
                      model_run_config=RoundPipeRunConfig(num_microbatch=2))
    try:
        need = probe.compile(inputs, kwargs).device_memory_bytes
        memory = probe._current.analysis.report.memory
        least = (max(memory.unit_bytes(i, num_microbatch=2, num_devices=2)
                     for i in range(len(memory.program.units)))
                 + max(c.param_bytes for c in probe.plan.costs))
        return need, least, len(probe.plan.stages)
    finally:
        probe.close()


@pytest.mark.parametrize("name", ["gpt", "mlp", "bnnet"])
@pytest.mark.parametrize("tight", [False, True])
def test_a_plan_under_a_device_cap_holds_within_it_when_measured(name, tight):
    """What a device holds, measured (every storage its threads create, not only uploads),
    stays within the capacity the plan was cut for: memory_fraction is enough margin.
    ``tight``: a capacity between the least any plan needs and what the uncapped plan
    needs, so the cap decides the cuts."""
    model, inputs, kwargs = getattr(models, name)(batch=8)
    run = RoundPipeRunConfig(num_microbatch=2)
    need, least, uncapped_stages = _uncapped(name)
    assert least < need
    cap = (least + need) // 2 if tight else need
    capacity = int(cap / 0.9) + 1
    pipe = RoundPipe(model, devices=["cpu"] * 2, model_run_config=run, measure_memory=True,
                     device_memory=capacity)
    out = pipe.forward_backward(input_args=inputs, input_kwargs=kwargs, loss_fn=_sum_loss)
    assert torch.isfinite(out)
    assert pipe.plan.device_memory_bytes <= pipe.plan.memory_cap <= capacity
    assert (len(pipe.plan.stages) > uncapped_stages) == tight
    peaks = [d.peak_allocated_bytes for d in pipe.stats().devices]
    assert all(p is not None and 0 < p <= capacity for p in peaks), (peaks, capacity)
    pipe.close()


def test_a_unit_larger_than_the_budget_is_refused_at_compile_time():
    pipe, args = _gpt_pipe(2, device_memory="64KiB")
    with pytest.raises(PartitionError) as info:
        pipe.forward_backward(**args)
    text = str(info.value)
    # the estimate, the free memory it was measured against, and the only margin
    assert re.search(r"alone needs an estimated \d+ bytes .* but the device memory cap is "
                     r"\d+ bytes", text), text
    assert "memory_fraction 0.9 of the 0.1 MiB measured free on cpu:" in text
    assert "that fraction is the plan's only margin" in text
    assert "raise memory_fraction (up to 1.0)" in text
    pipe.close()


# --- autocast ---------------------------------------------------------------------------

def test_caller_autocast_is_honoured_in_worker_threads():
    model, args, kwargs, label, loss_fn = reference.case("mlp", torch.float32)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    pipe.forward_backward(input_args=args, label=label, loss_fn=loss_fn)  # compile outside
    for p in pipe.optim_parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(*args, run_config=RoundPipeRunConfig(requires_grad=False))
        loss = pipe.forward_backward(input_args=args, label=label, loss_fn=loss_fn)
        ref_out = eager(*args)
        ref = reference.eager_forward_backward(eager, args, {}, label, loss_fn, 2)
    assert out.dtype == torch.bfloat16 == ref_out.dtype
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for p, q in zip(pipe.optim_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)
    pipe.close()


# --- GradScaler -----------------------------------------------------------------------------

def _scaled_run(use_scaler: bool, is_async: bool, inf_at: int | None = None, steps: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1))
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    scaler = GradScaler(pipe, init_scale=2.0**10, growth_interval=2) if use_scaler else None
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
    losses, scales = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)

        def loss_fn(out, label, step=step):
            loss = F.mse_loss(out, label)
            if step == inf_at:
                loss = loss * float("inf")
            return scaler.scale(loss) if scaler else loss

        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        losses.append(scaler.unscale_loss(loss) if scaler else loss)
        scales.append(scaler.get_scale() if scaler else 1.0)
        if scaler:
            pipe.step(lambda: scaler.step(opt), is_async=is_async)
        else:
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
    pipe.synchronize()
    weights = [p.detach().clone() for p in pipe.model.parameters()]
    pipe.close()
    return losses, weights, scales, scaler


@pytest.mark.parametrize("is_async", [False, True])
def test_grad_scaler_with_power_of_two_scales_is_exact(is_async):
    """Scaling by powers of two is exact in floating point, so training with the scaler
    (whose scale also grows during the run) equals training without it, bit for bit."""
    l0, w0, _, _ = _scaled_run(False, is_async)
    l1, w1, scales, scaler = _scaled_run(True, is_async)
    assert len(set(scales)) > 1  # the scale grew
    for a, b in zip(l0, l1):
        assert torch.equal(a, b)
    for a, b in zip(w0, w1):
        assert torch.equal(a, b)
    assert scaler.skipped_steps == 0


@pytest.mark.parametrize("is_async", [False, True])
def test_grad_scaler_skips_steps_with_inf_and_backs_off(is_async):
    _, w_ok, _, _ = _scaled_run(True, is_async, steps=2)
    _, w_inf, scales, scaler = _scaled_run(True, is_async, inf_at=2, steps=3)
    assert scaler.skipped_steps == 1
    for a, b in zip(w_ok, w_inf):  # the third step (inf) changed nothing
        assert torch.equal(a, b)
    # The scale the inf call used is halved.  (Asynchronously that call ran before the
    # growth computed by the previous step became visible: 1024; synchronously: 2048.)
    assert scales[2] == (2.0**10 if is_async else 2.0**11)
    assert scaler.state_dict()["scale"] == scales[2] * 0.5


def test_fp16_model_trains_with_grad_scaler():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 1)).half()
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    scaler = GradScaler(pipe, init_scale=2.0**14)
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=0.01)
    x = torch.randn(16, 8).half()
    y = x.float().sum(dim=1, keepdim=True).half() * 0.1
    losses = []
    for _ in range(30):
        loss = pipe.forward_backward(
            input_args=(x,), label=y,
            loss_fn=lambda out, t: scaler.scale(F.mse_loss(out.float(), t.float())))
        losses.append(scaler.unscale_loss(loss).item())
        pipe.step(lambda: scaler.step(opt))
    pipe.synchronize()
    assert all(p.dtype == torch.float16 for p in pipe.model.parameters())
    assert all(torch.isfinite(p).all() for p in pipe.model.parameters())
    assert losses[-1] < 0.5 * losses[0]
    pipe.close()


def test_layer_grain_uploads_a_value_read_by_several_units_once():
    pipe, args = _gpt_pipe(2)
    pipe.forward_backward(**args, run_config=RoundPipeRunConfig(recompute_grain="layer"))
    plan, stats = pipe.plan, pipe.stats()
    report = pipe._current.analysis.report
    acts = sum(d.uploaded["activations"] for d in stats.devices)
    expected = NUM_MB * sum(
        s.act_in_bytes if s.kind != "bwd" else
        sum(report.values[v].nbytes for v in plan.stash["layer"][s.index] if v in report.values)
        for s in plan.stages)
    assert acts == expected
    pipe.close()


def test_grad_scaler_survives_a_step_that_was_refused():
    """A refused step (step_fn not callable) must not leave a scale behind for the next
    step to unscale with."""
    l0, w0, _, _ = _scaled_run(True, True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1))
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    scaler = GradScaler(pipe, init_scale=2.0**10, growth_interval=2)
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
    with pytest.raises(Exception):
        pipe.step(None)  # refused before it is enqueued
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        pipe.forward_backward(input_args=(x,), label=y,
                              loss_fn=lambda o, t: scaler.scale(F.mse_loss(o, t)))
        pipe.step(lambda: scaler.step(opt), is_async=True)  # as _scaled_run(..., True)
    pipe.synchronize()
    for a, b in zip(pipe.model.parameters(), w0):
        assert torch.equal(a, b)
    pipe.close()


# --- downloads land asynchronously ----------------------------------------------------------

def _late_downloads(monkeypatch, delay_s: float, fail_on: int | None = None):
    """Every virtual download copies ``delay_s`` late on its device's waiter thread (the
    host tensor stays unfilled until then); the ``fail_on``-th one raises instead."""
    fill = VirtualCPUDevice._fill
    count = itertools.count()

    def late(self, out, tensor):
        n = next(count)
        time.sleep(delay_s)
        if n == fail_on:
            with self._lock:
                self._download_errors.append(RuntimeError("copy engine fault"))
            return
        fill(self, out, tensor)
    monkeypatch.setattr(VirtualCPUDevice, "_fill", late)


def _train_bnnet_and_gpt(devices: int):
    """Losses, outputs, gradients and updated buffers of one training call per model, and
    the outputs and input gradients of forward() + backward()."""
    results = []
    for name in ("gpt", "bnnet"):
        model, args, kwargs, label, loss_fn = reference.case(name, torch.float64)
        pipe = RoundPipe(model, devices=["cpu"] * devices,
                         model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB))
        loss, out = pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=label,
                                          loss_fn=loss_fn, return_outputs=True)
        grads = [p.grad.clone() for p in pipe.optim_parameters()]
        buffers = [b.clone() for b in pipe.model.buffers()]
        x = args[0].clone()
        x.requires_grad_(x.is_floating_point())
        # BatchNorm in training mode: per-microbatch statistics, asked for explicitly
        y = pipe(x, *args[1:], **kwargs, run_config=RoundPipeRunConfig(merge_output=0))
        reference.first_float(y).sum().backward()
        results.append((loss, pytree_leaves(out), grads, buffers, pytree_leaves(y), x.grad))
        pipe.close()
    return results


def pytree_leaves(value):
    return [t.detach().clone() for t in torch.utils._pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor)]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@functools.cache
def _prompt_results():
    """Prompt copies' results, on 1 device (they are bitwise those of any device count):
    computed once for both device counts below; each test takes a copy."""
    return _train_bnnet_and_gpt(1)


@pytest.mark.parametrize("devices", [1, 3])
def test_host_reads_wait_for_downloads_that_land_late(monkeypatch, devices):
    """A download returns an unfilled host tensor that its device's waiter thread fills
    later; with every copy delayed, any reader that did not wait for it (the next job,
    the backward stash, losses, gradients, buffers, outputs) would read garbage.  The
    results stay bitwise those of prompt copies."""
    prompt = copy.deepcopy(_prompt_results())
    _late_downloads(monkeypatch, 0.002)
    assert _same(_train_bnnet_and_gpt(devices), prompt)


def test_the_controller_does_not_wait_for_a_microbatchs_downloads():
    """The next microbatch starts while the last one's downloads are still copying: the
    fused job's downloads (its loss, its outputs), landing only once its microbatch 1 has
    begun, do not stall it."""
    started = threading.Event()
    timed_out = []
    fill = VirtualCPUDevice._fill
    run = JobRunner.run_microbatch

    def fill_after_next_start(self, out, tensor):
        if not started.wait(timeout=10):
            timed_out.append(True)
        fill(self, out, tensor)

    def run_and_signal(self, mb, next_ready):
        if self.job.kind == "fused" and mb >= 1:
            started.set()
        return run(self, mb, next_ready)

    pipe, args = _gpt_pipe(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VirtualCPUDevice, "_fill", fill_after_next_start)
        mp.setattr(JobRunner, "run_microbatch", run_and_signal)
        pipe.forward_backward(**args)
    assert started.is_set() and not timed_out
    pipe.close()


def _two_calls(pipe, args, between=None):
    pipe.forward_backward(**args)
    pipe.step(lambda: None)
    pipe.synchronize()
    if between is not None:
        between()
    for p in pipe.optim_parameters():
        p.grad = None
    loss = pipe.forward_backward(**args)
    return loss, [p.grad.clone() for p in pipe.optim_parameters()]


@functools.cache
def _two_calls_expected():
    """Two calls on a fresh pipe, on 1 device (bitwise those of any device count):
    computed once for both device counts below; each test takes a copy."""
    pipe, args = _gpt_pipe(1)
    try:
        return _two_calls(pipe, args)
    finally:
        pipe.close()


@pytest.mark.parametrize("devices", [1, 3])
def test_a_download_that_fails_fails_the_call_and_commits_nothing(monkeypatch, devices):
    expected = copy.deepcopy(_two_calls_expected())
    pipe, args = _gpt_pipe(devices)

    def failing_call():
        grads = [p.grad.clone() for p in pipe.optim_parameters()]
        weights = [p.detach().clone() for p in pipe.model.parameters()]
        with monkeypatch.context() as mp:
            _late_downloads(mp, 0.0, fail_on=5)
            with pytest.raises(StageError, match="copy engine fault"):
                pipe.forward_backward(**args)
        assert _same([p.grad for p in pipe.optim_parameters()], grads)
        assert _same([p.detach() for p in pipe.model.parameters()], weights)

    # the failed call left nothing behind: the next one is the call that would have run
    assert _same(_two_calls(pipe, args, between=failing_call), expected)
    pipe.close()


def test_unit_times_are_read_from_device_marks_when_the_call_ends(monkeypatch):
    """Per-unit times come from marks in each device's compute (events on CUDA, where the
    controller runs ahead of the GPU), read once the call has ended."""
    calls = []

    def one_second(self, start, end):
        calls.append(threading.current_thread().name)
        return 1.0

    monkeypatch.setattr(VirtualCPUDevice, "seconds_between", one_second)
    pipe, args = _gpt_pipe(2)
    pipe.forward_backward(**args)
    stats, plan = pipe.stats(), pipe.plan
    fwd_units = [u for s in plan.stages if s.kind == "fwd" for u in range(*s.units)]
    assert fwd_units and all(stats.unit_fwd_s[u] == NUM_MB for u in fwd_units)
    # the fused and stage-grain backward ranges split their time over their units
    bwd_units = [u for s in plan.stages if s.kind != "fwd" for u in range(*s.units)]
    assert sum(stats.unit_bwd_s[u] for u in bwd_units) == pytest.approx(
        NUM_MB * sum(1 for s in plan.stages if s.kind != "fwd"))
    assert calls and all(name == threading.current_thread().name for name in calls)
    pipe.close()


def test_an_error_in_the_gradient_hand_over_hook_fails_the_call(monkeypatch):
    """The per-unit hand-over (data parallel's hook) runs on the download waiter as a
    done-callback, whose errors concurrent.futures would only log: the job raises it."""
    from roundpipe.runtime.executor import Executor
    train = Executor.train
    calls = []

    def hook(start, stop, staged):
        calls.append((start, stop))
        if stop - start == 1:  # a per-unit hand-over, not a job's final one
            raise RuntimeError("reducer refused the gradients")

    def train_with_hook(self, *args, **kwargs):
        kwargs["on_grads"] = hook
        return train(self, *args, **kwargs)

    pipe, args = _gpt_pipe(2)
    pipe.forward_backward(**args)
    grads = [p.grad.clone() for p in pipe.optim_parameters()]
    monkeypatch.setattr(Executor, "train", train_with_hook)
    with pytest.raises(StageError, match="reducer refused the gradients"):
        pipe.forward_backward(**args)
    assert calls
    assert _same([p.grad for p in pipe.optim_parameters()], grads)  # nothing committed
    pipe.close()
