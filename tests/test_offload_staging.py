"""The disk tier's staging pool (runtime/offload.py's StagingPool): staged masters and
state live in reused, page-aligned buffers that O_DIRECT reads and writes in place."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe.runtime import offload
from roundpipe.runtime.offload import ALIGN, StagingPool

from test_offload import _assert_equal, _model, _snapshot, _train


def test_buffers_are_reused_across_steps_and_the_steps_stay_bitwise(tmp_path, monkeypatch):
    """Four steps (pipe.step(opt), unit by unit): after the first step no staging
    buffer is made any more (the pool hands back the same ones), staged tensors live in
    page-aligned pool memory, the kept buffers never exceed the window's peak and are
    reported as host memory, and the result equals the run in memory bit for bit."""
    model, args, kwargs = _model()
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None,
                               steps=4, by_unit=True)
    made = []
    real_take = StagingPool.take

    def take(self, nbytes):
        kept = {b.data_ptr() for b in self.buffers()}
        buffer = real_take(self, nbytes)
        if buffer.data_ptr() not in kept:
            made.append((pipe_steps(), buffer.numel()))
        assert buffer.data_ptr() % ALIGN == 0 and buffer.numel() % ALIGN == 0
        assert buffer.numel() >= nbytes
        return buffer
    monkeypatch.setattr(StagingPool, "take", take)
    pipes = []

    def pipe_steps():
        return pipes[0]._state.offload.step if pipes else 0

    in_pool = []

    def on_pipe(pipe, opt):
        pipes.append(pipe)
        store = pipe._state.offload
        real_before = store.stage

        def stage(keys):
            futures = real_before(keys)
            for key in keys:
                t = store.tensor(key)
                if t is not None and store._entries[key].buffer is not None:
                    # the tensor itself (the object the optimizer keys) is in the buffer
                    in_pool.append(t.untyped_storage().data_ptr()
                                   == store._entries[key].buffer.data_ptr())
            return futures
        store.stage = stage

    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "t",
                       steps=4, on_pipe=on_pipe, by_unit=True)
    try:
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref_pipe, ref_opt))
        store = pipe._state.offload
        assert made and all(step == 0 for step, _ in made), made  # only in step 1
        assert in_pool and all(in_pool)
        stats = pipe.offload_stats()
        assert store.staged_keys() == [] and store.staging.in_use == 0
        assert 0 < stats.pooled_bytes == stats.staged_bytes <= stats.peak_staged_bytes
        assert stats.pooled_bytes <= store.staging.high_water
        mem = pipe.host_memory(opt)
        assert mem.staging == stats.pooled_bytes
        assert mem.total - mem.weights >= mem.staging
        assert all(m.untyped_storage().nbytes() == 0 for m in pipe.optim_parameters()
                   if m.numel() * m.element_size() > offload.RESIDENT_BYTES)
    finally:
        pipe.close()
        ref_pipe.close()
    assert pipe._state.offload.staging.kept == 0  # close() frees the kept buffers


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), min_size=1,
                max_size=30))
def test_the_pool_never_holds_more_than_its_peak_in_use(ops):
    """Any sequence of takes and gives (sizes unaligned, several lengths): buffers in
    use never share memory, each is aligned with room for its padded length, and the
    pool (in use plus kept) never holds more than the most it had in use at once."""
    pool = StagingPool()
    held: list[torch.Tensor] = []
    peak_in_use = 0
    for give, n in ops:
        if give and held:
            pool.give(held.pop(n % len(held)))
        else:
            b = pool.take(n)
            assert b.data_ptr() % ALIGN == 0 and b.numel() == -(-n // ALIGN) * ALIGN
            held.append(b)
        in_use = sum(b.numel() for b in held)
        peak_in_use = max(peak_in_use, in_use)
        assert pool.in_use == in_use
        assert pool.nbytes <= peak_in_use
        starts = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in held)
        assert all(a[1] <= b[0] for a, b in zip(starts, starts[1:]))
    pool.clear()
    assert pool.kept == 0 and pool.buffers() == []


def test_direct_io_of_staged_tensors_needs_no_bounce_copy(tmp_path, monkeypatch):
    """With O_DIRECT, staging reads straight into the pooled buffer and the write-back
    writes straight from it (the 4 KiB-padded tail included): the per-thread bounce
    buffer is never touched, and odd sizes round-trip exactly."""
    store = offload.OffloadStore(tmp_path / "s")
    if not store._direct:
        store.close()
        pytest.skip(reason="the file system under tmp_path refuses O_DIRECT")
    try:
        g = torch.Generator().manual_seed(1)
        tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in
                   enumerate([17, 1024, 1025, offload.CHUNK_BYTES // 4 + 5])}
        originals = {k: v.clone() for k, v in tensors.items()}
        for k, v in tensors.items():
            store.register(k, v, group=k)  # from the caller's memory: bounce allowed
        store.commit()

        def no_bounce():
            raise AssertionError("the bounce buffer was used")
        monkeypatch.setattr(offload, "_bounce", no_bounce)
        for step in range(2):  # twice: the second step reuses the buffers
            store.begin()
            offload.wait(store.stage(list(tensors)))
            for k, v in tensors.items():
                assert torch.equal(v, originals[k] * 2 ** step), k
                v.mul_(2)
            offload.wait(store.write_back(list(tensors)))
            store.evict(list(tensors))
            store.commit()
        step, files = offload.read_committed(tmp_path / "s")
        for k in tensors:
            assert torch.equal(files[k], originals[k] * 4), k
    finally:
        store.close()


def test_a_failed_step_hands_every_buffer_back(tmp_path):
    """A step that fails after its first unit was staged and written: the rollback
    returns every pooled buffer (nothing in use, no tensor left in one), and the next
    steps still equal the run in memory."""
    from roundpipe import StepError
    from test_offload import _fail_update, _loss
    model, args, kwargs = _model()
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None,
                               steps=2, by_unit=False)
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "t",
                       steps=1, on_pipe=_fail_update)
    try:
        store = pipe._state.offload
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        with pytest.raises(StepError, match="injected"):
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        assert store.staging.in_use == 0 and store.staged_keys() == []
        kept = {b.data_ptr() for b in store.staging.buffers()}
        assert kept
        tensors = [store.tensor(k) for k in store.keys()]
        assert not any(t.untyped_storage().data_ptr() in kept for t in tensors)
        opt.zero_grad()
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref_pipe, ref_opt))
    finally:
        pipe.close()
        ref_pipe.close()
    assert os.path.exists(tmp_path / "t" / "manifest.json")


@pytest.mark.parametrize("ahead", [1, 2])
def test_the_window_stages_its_read_ahead_and_no_more(tmp_path, monkeypatch, ahead):
    """Eight units, pipe.step(opt): with ``ahead`` units read ahead, at most ``ahead +
    2`` consecutive units are staged at once (the one updated, the one writing back, the
    ones read ahead), and more than ``ahead + 1`` were (the read-ahead happened); the
    steps equal the run in memory bit for bit."""
    import torch.nn as nn
    monkeypatch.setattr(offload, "READ_AHEAD", ahead)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(24, 24) for _ in range(8)]).to(torch.bfloat16)
    args = (torch.randn(8, 24).to(torch.bfloat16),)
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, {}, 1, "AdamW", None, steps=2,
                               by_unit=True)
    pipe, opt = _train(model, args, {}, 1, "AdamW", None, offload_dir=tmp_path / "t",
                       steps=2, by_unit=True)
    try:
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref_pipe, ref_opt))
        store = pipe._state.offload
        units = [u for u in pipe._state.publish_groups
                 if any(n in pipe._state.masters() for n in u)]
        assert len(units) == 8
        size = [sum(store.staging.buffer_length(store.tensor(k).numel()
                                                * store.tensor(k).element_size())
                    for k in store.group_keys(u)
                    if store.tensor(k).numel() * store.tensor(k).element_size()
                    > offload.RESIDENT_BYTES) for u in units]

        def window(n):
            return max(sum(size[k:k + n]) for k in range(len(size)))
        assert window(ahead + 1) < store.peak_staged_bytes <= window(ahead + 2)
    finally:
        pipe.close()
        ref_pipe.close()
