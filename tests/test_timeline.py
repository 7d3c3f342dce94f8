"""pipe.timeline(path) writes a Chrome/Perfetto trace of the last call."""

from __future__ import annotations

import json

import torch

import models
from roundpipe import RoundPipe, RoundPipeRunConfig


def test_timeline_has_a_track_per_device_and_a_slice_per_job_and_microbatch(tmp_path):
    model, (idx,), kw = models.gpt()
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    labels = torch.randint(0, 64, idx.shape)
    pipe.forward_backward(input_args=(idx,), input_kwargs=kw, label=labels,
                          loss_fn=models.lm_loss)
    path = pipe.timeline(tmp_path / "trace.json")
    trace = json.load(open(path))
    events = trace["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == {"cpu:0", "cpu:1"}
    jobs = [e for e in events if e.get("ph") == "X" and e["name"].startswith("stage")]
    assert len(jobs) == len(pipe.plan.stages)
    mbs = [e for e in events if e.get("ph") == "X" and e["name"].startswith("mb ")]
    assert len(mbs) == 3 * len(pipe.plan.stages)
    for job in jobs:  # microbatch slices sit inside their job's slice on the same track
        inside = [m for m in mbs if m["tid"] == job["tid"]
                  and m["args"]["stage"] == job["args"]["job"]]
        assert len(inside) == 3
        for m in inside:
            assert job["ts"] <= m["ts"] and m["ts"] + m["dur"] <= job["ts"] + job["dur"] + 1
    pipe.close()
