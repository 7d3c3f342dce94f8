"""The pure job planner (``runtime/jobs.py``): which stages a call runs and what each job
reads, publishes and hands to the next, with no threads."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import models
from roundpipe.compiler import compile_model
from roundpipe.runtime.jobs import Job, plan_jobs, stage_jobs


@functools.lru_cache(maxsize=None)
def _chain_plan():
    """Four Linear+activation blocks cut into fwd [0, 2), fused [2, 4), bwd [0, 2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    plan = compile_model(model, (torch.randn(8, 16),), num_devices=2, num_microbatch=2)
    assert [(s.kind, s.units) for s in plan.stages] == [
        ("fwd", (0, 2)), ("fused", (2, 4)), ("bwd", (0, 2))]
    values = [(u.inputs, u.outputs) for u in plan.program.units]
    assert values == [(("input_1",), ("relu",)), (("relu",), ("tanh",)),
                      (("tanh",), ("relu_1",)), (("relu_1",), ("linear_3",))]
    return plan


def _wiring(jobs):
    return [(j.kind, j.start, j.stop, set(j.reads), set(j.publishes), set(j.handoff))
            for j in jobs]


def test_training_on_two_devices_publishes_what_the_next_device_reads():
    jobs = plan_jobs(_chain_plan(), "train", "stage", num_devices=2)
    assert _wiring(jobs) == [
        ("fwd", 0, 2, {"input_1"}, {"tanh"}, set()),
        ("fused", 2, 4, {"tanh"}, set(), set()),
        ("bwd", 0, 2, {"input_1"}, set(), set()),  # recomputes from the stashed input
    ]


def test_training_on_one_device_hands_values_over_without_a_host_copy():
    jobs = plan_jobs(_chain_plan(), "train", "stage", num_devices=1)
    assert _wiring(jobs)[0] == ("fwd", 0, 2, {"input_1"}, set(), {"tanh"})


def test_layer_grain_backward_reads_every_units_input():
    jobs = plan_jobs(_chain_plan(), "train", "layer", num_devices=2)
    assert set(jobs[2].reads) == {"input_1", "relu"}
    # so the forward job publishes relu, which the stage grain recomputes instead
    assert jobs[0].publishes == {"relu", "tanh"}


def test_a_recorded_forward_keeps_what_its_backward_reads():
    plan = _chain_plan()
    fwd = plan_jobs(plan, "forward", "stage", num_devices=2, want_outputs=True,
                    stash_for_backward=True)
    assert _wiring(fwd) == [
        ("fwd", 0, 2, {"input_1"}, {"tanh"}, set()),
        # the tail runs as a forward stage; its inputs and the output reach the host
        ("fwd", 2, 4, {"tanh"}, {"relu_1", "linear_3"}, set()),
    ]
    bwd = plan_jobs(plan, "backward", "stage", num_devices=2)
    assert [(j.kind, j.start, j.stop, set(j.reads)) for j in bwd] == [
        ("bwd", 2, 4, {"tanh"}), ("bwd", 0, 2, {"input_1"})]


def test_a_backward_job_that_no_gradient_reaches_is_skipped():
    plan = _chain_plan()
    frozen_first = frozenset({"p_2_weight", "p_2_bias", "p_4_weight", "p_4_bias",
                              "p_6_weight", "p_6_bias", "relu_1", "tanh", "linear_3"})
    jobs = plan_jobs(plan, "train", "stage", num_devices=2, carries=frozen_first)
    # units 0-1 read input_1, relu, p_0_*, p_2_*: p_2 carries, so job 2 still runs
    assert not jobs[2].skip
    nothing = plan_jobs(plan, "train", "stage", num_devices=2, carries=frozenset())
    assert nothing[2].skip and not any(j.skip for j in nothing[:2])


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        stage_jobs(_chain_plan(), "eval")


def test_jobs_are_frozen():
    (job, *_) = plan_jobs(_chain_plan(), "train", "stage", num_devices=2)
    assert isinstance(job, Job)
    with pytest.raises(AttributeError):
        job.reads = ()  # type: ignore[misc]


@functools.lru_cache(maxsize=None)
def _zoo_plan(name: str, devices: int):
    model, args, kwargs = models.ALL[name]()
    return compile_model(model, args, kwargs, num_devices=devices)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "mlp", "nested", "bnnet", "branchy"])
def test_every_value_a_job_reads_is_there_when_it_runs(name, devices, grain):
    """The invariant the threaded runner relies on: a job reads a call input, a value an
    earlier job published to the host, or one the previous job handed over on the same
    device; the outputs reach the host; a backward reads only what its forward kept."""
    plan = _zoo_plan(name, devices)
    inputs = {n for n in plan.program.inputs.names if n is not None}
    outputs = {o.value for o in plan.program.outputs if o.value is not None}

    def check(jobs, available):
        available = set(available)
        for k, job in enumerate(jobs):
            handed = jobs[k - 1].handoff if k else frozenset()
            missing = set(job.reads) - available - handed
            assert not missing, (job, missing)
            if job.handoff:
                assert devices == 1, job  # only consecutive jobs on one device hand over
            available |= job.publishes
        return available

    check(plan_jobs(plan, "train", grain, num_devices=devices), inputs)
    kept = check(plan_jobs(plan, "forward", grain, num_devices=devices, want_outputs=True,
                           stash_for_backward=True), inputs)
    assert outputs <= kept
    check(plan_jobs(plan, "backward", grain, num_devices=devices), kept)
    # Every stage runs exactly once per training call, in plan order.
    train = plan_jobs(plan, "train", grain, num_devices=devices)
    assert [j.stage for j in train] == list(range(len(plan.stages)))
