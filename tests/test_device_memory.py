"""Device memory measured (``measure_memory``): the ledger of storages on a device's
threads, ``DeviceCounters.peak_allocated_bytes`` and ``RunStats.stage_peak_bytes``, on 1
and 4 virtual devices; CUDA's allocator peak under the ``cuda`` marker."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import models
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.device_memory import StorageLedger

BIG = 1 << 18  # elements of the known tensor: 1 MiB in float32, far above the model's own


def _watched(ledger: StorageLedger, fn):
    """Run ``fn`` watched, on a thread of its own (as a device's threads are)."""
    result = []

    def work():
        with ledger.watching("job"):
            result.append(fn())
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return result[0]


def test_ledger_counts_a_storage_once_and_forgets_it_when_freed():
    ledger = StorageLedger("cpu")

    def make():
        z = torch.zeros(BIG)
        views = [z.view(-1, 8), z[::2], z.view(-1, 8).t(), z.detach(), z.unsqueeze(0)]
        z.add_(1)  # in place: nothing new
        z.mul_(2).sin_()
        return z, views
    z, views = _watched(ledger, make)
    assert ledger.live_bytes() == BIG * 4
    assert ledger.peak_bytes() == BIG * 4
    assert ledger.owner_peaks() == {"job": BIG * 4}
    del views
    assert ledger.live_bytes() == BIG * 4  # the storage is still held by z
    del z
    assert ledger.live_bytes() == 0
    assert ledger.peak_bytes() == BIG * 4


def test_ledger_leaves_out_what_it_did_not_see_made_and_host_blocks():
    ledger = StorageLedger("cpu")
    host = torch.ones(BIG)

    def work():
        seen = [host.view(-1, 2), host[1:], host.detach()]  # views of a host tensor
        with ledger.host():
            buffer = torch.empty(BIG)  # a download buffer: host memory
        out = host * 2  # a new tensor: ours
        return seen, buffer, out
    kept = _watched(ledger, work)
    assert ledger.live_bytes() == BIG * 4
    del kept
    assert ledger.live_bytes() == 0


def test_ledger_adopt_moves_bytes_between_owners():
    ledger = StorageLedger("cpu")
    t = _watched(ledger, lambda: torch.ones(1000))
    ledger.adopt(t, "next")
    assert ledger.owner_peaks() == {"job": 4000, "next": 4000}
    ledger.reset()  # a new call: what is left is nobody's
    assert ledger.owner_peaks() == {} and ledger.peak_bytes() == 4000


def test_ledger_counts_what_a_higher_order_op_returns():
    ledger = StorageLedger("cpu")
    x = torch.randn(1000)
    out = _watched(ledger, lambda: torch.cond(x.sum() > 0, lambda a: a * 2,
                                              lambda a: a * 3, (x,)))
    assert ledger.live_bytes() == 4000
    del out
    assert ledger.live_bytes() == 0


class BigInside(nn.Module):
    """A block that makes one known tensor, uses it through several views and an in-place
    op, and keeps nothing of it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(BIG, device=x.device)
        z.add_(1.0)
        grid = z.view(-1, 16)
        total = grid[::2].sum() + grid.t()[0].sum() + z[:16].sum()
        return self.lin(x) + total * 0.0


class WithBig(nn.Module):
    def __init__(self, big: bool, layers: int = 3, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [BigInside(d) if big and i == 1 else nn.Sequential(nn.Linear(d, d), nn.ReLU())
             for i in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _train_once(model: nn.Module, args: tuple, kwargs: dict, devices: int, mb: int = 2):
    pipe = RoundPipe(model, devices=["cpu"] * devices, measure_memory=True,
                     model_run_config=RoundPipeRunConfig(num_microbatch=mb))
    x = args[0]

    def loss_fn(out, label):
        out = out["logits"] if isinstance(out, dict) else out
        return out.float().pow(2).mean() + 0 * label.sum()
    pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=torch.zeros(len(x)),
                          loss_fn=loss_fn)
    stats, plan = pipe.stats(), pipe.plan
    pipe.close()
    return stats, plan


@pytest.mark.parametrize("devices", [1, 4])
def test_a_known_tensor_inside_a_stage_is_counted_exactly_once(devices):
    x = torch.randn(4, 16)
    torch.manual_seed(0)
    with_big, _ = _train_once(WithBig(big=True), (x,), {}, devices)
    torch.manual_seed(0)
    without, _ = _train_once(WithBig(big=False), (x,), {}, devices)
    # The plans differ (the known tensor makes its unit costlier), so the rest of a stage
    # is bounded by all the other model holds at once, a few KiB: counting the storage
    # once per view would add a MiB per view.
    rest = sum(without.stage_peak_bytes.values())
    assert rest < BIG
    peak = max(with_big.stage_peak_bytes.values())
    assert BIG * 4 <= peak <= BIG * 4 + rest, (peak, rest)
    device_peak = max(d.peak_allocated_bytes for d in with_big.devices)
    assert BIG * 4 <= device_peak <= BIG * 4 + sum(
        d.peak_allocated_bytes for d in without.devices)


def _gpt(d: int, batch: int = 8, seq: int = 8):
    torch.manual_seed(0)
    model = models.GPT(d=d, layers=4)
    idx = torch.randint(0, 64, (batch, seq))
    return model, (idx,), {"attention_mask": torch.ones(batch, seq)}


@pytest.mark.parametrize("devices", [1, 4])
def test_peaks_hold_the_weights_and_grow_with_the_hidden_size(devices):
    small, small_plan = _train_once(*_gpt(32), devices)
    large, large_plan = _train_once(*_gpt(64), devices)
    for stats, plan in ((small, small_plan), (large, large_plan)):
        assert set(stats.stage_peak_bytes) == {s.index for s in plan.stages}
        for spec in plan.stages:
            # a job holds at least its weights (and more: activations, gradients)
            assert stats.stage_peak_bytes[spec.index] > spec.param_bytes, spec
        for counters in stats.devices:
            # everything uploaded is allocated on the device; a device holds its jobs
            assert counters.peak_allocated_bytes >= counters.peak_resident_bytes > 0
        own = {r.stage: r.device for r in stats.timeline}
        for stage, peak in stats.stage_peak_bytes.items():
            device = next(d for d in stats.devices if d.name == own[stage])
            assert peak <= device.peak_allocated_bytes
    # The same plan shape (same devices, same units) at twice the width holds more,
    # stage by stage and device by device.
    assert len(small_plan.stages) == len(large_plan.stages)
    for stage, peak in small.stage_peak_bytes.items():
        assert large.stage_peak_bytes[stage] > 1.5 * peak, stage
    for a, b in zip(small.devices, large.devices):
        assert b.peak_allocated_bytes > 1.5 * a.peak_allocated_bytes


def test_off_by_default_reports_nothing(monkeypatch):
    monkeypatch.delenv("ROUNDPIPE_MEASURE_MEMORY", raising=False)
    model, args, kwargs = models.gpt(layers=2)
    pipe = RoundPipe(model, devices=["cpu"] * 2)
    pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=torch.zeros(4),
                          loss_fn=lambda out, label: out["logits"].pow(2).mean())
    stats = pipe.stats()
    pipe.close()
    assert stats.stage_peak_bytes == {}
    assert all(d.peak_allocated_bytes is None for d in stats.devices)


@pytest.mark.cuda
def test_cuda_peak_is_the_allocators_over_the_calls_start():  # pragma: no cover - GPU
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    resident = torch.empty(BIG, device="cuda")  # the caller's own: not the pipeline's
    model, args, kwargs = _gpt(64)
    pipe = RoundPipe(model, devices=["cuda:0"], measure_memory=True,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=torch.zeros(8),
                          loss_fn=lambda out, label: out["logits"].float().pow(2).mean())
    stats, plan = pipe.stats(), pipe.plan
    pipe.close()
    counters = stats.devices[0]
    assert counters.peak_allocated_bytes >= counters.peak_resident_bytes > 0
    assert counters.peak_allocated_bytes < torch.cuda.max_memory_allocated()
    for spec in plan.stages:
        assert stats.stage_peak_bytes[spec.index] > spec.param_bytes
        assert stats.stage_peak_bytes[spec.index] <= counters.peak_allocated_bytes
    del resident
