"""``print(pipe.stats())`` is a table whose size follows the device count, not the repr of
every counter (about 3,000 characters for a 4-layer model on 2 devices)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.data_parallel import DataParallelStats
from roundpipe.runtime.devices import DeviceCounters
from roundpipe.runtime.executor import JobRecord, RunStats
from roundpipe.runtime.stats_table import fmt_bytes


@pytest.mark.parametrize("devices, layers", [(1, 3), (4, 12)])
def test_printed_stats_are_a_table_of_one_row_per_device(devices, layers, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    x = torch.randn(8, 16)
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=4)) as pipe:
        pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum())
        stats = pipe.stats()
        print(stats)
    out = capsys.readouterr().out
    lines = out.rstrip("\n").split("\n")
    assert len(lines) == 2 + devices + 2, out  # header, rule, a row per device, 2 more
    assert max(map(len, lines)) <= 120, out
    assert lines[0].split()[:4] == ["device", "jobs", "busy", "uploaded"]
    for d, line in zip(stats.devices, lines[2:]):
        assert line.startswith(d.name)
        jobs = sum(1 for j in stats.timeline if j.device == d.name)
        assert line.split()[1] == str(jobs)
        for n in (d.bytes_uploaded, d.uploaded["weights"], d.bytes_downloaded,
                  d.peak_resident_bytes):
            assert fmt_bytes(n) in line, (n, line)
    assert f"{len(stats.timeline)} jobs on {devices} device(s)" in out
    assert fmt_bytes(stats.grad_bytes_downloaded) in out
    assert repr(stats).startswith("RunStats(devices=(DeviceCounters(")  # fields kept


def test_measured_peaks_and_data_parallel_get_a_line_each():
    counters = DeviceCounters("cuda:0", 3 * 2**30, 5 * 2**20, {"weights": 2**30},
                              {"grads": 2**20}, 2**31, 2**30, peak_allocated_bytes=7 * 2**29)
    job = JobRecord(0, 0, "fused", "0-3", "cuda:0", 0.0, 0.5, 2)
    dp = DataParallelStats(rank=1, world_size=2, reduction="all_reduce", buckets=(),
                           grads_ready_s=0.4, reduced_s=0.45, finished_s=0.5)
    text = str(RunStats((counters,), (job,), {}, {}, 1.0, grad_bytes={"w": 2048},
                        data_parallel=dp, stage_peak_bytes={0: 2**20, 1: 3 * 2**20}))
    lines = text.split("\n")
    assert "peak allocated" in lines[0] and "3.50 GiB" in lines[2]
    assert "0.500 s (50%)" in lines[2] and "3.00 GiB" in lines[2]
    assert "largest stage peak (measured): 3.00 MiB (stage 1)" in text
    assert "data parallel: rank 1 of 2, all_reduce of 0 B in 0 bucket(s), 0.050 s" in text
    assert len(lines) == 7
