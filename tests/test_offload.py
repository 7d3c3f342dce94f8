"""The disk tier (``RoundPipe(..., offload_dir=PATH)``): masters and roundpipe.optim's
state in files, staged unit by unit during a step.  Checked bitwise against the same run
in host memory, for failed and killed steps, checkpoints and the accounting."""

from __future__ import annotations

import copy
import os
import signal
import textwrap

import pytest
import torch

import models
import roundpipe.optim
from roundpipe import (ConfigError, OptimizerError, RoundPipe, RoundPipeRunConfig,
                       StepError, load_checkpoint, save_checkpoint)
from roundpipe import OffloadError
from roundpipe.runtime.offload import ALIGN, READ_AHEAD, RESIDENT_BYTES, read_committed

STEPS = 3


def _model():
    model, args, kwargs = models.mlp(batch=8)
    return model.to(torch.bfloat16), tuple(a.to(torch.bfloat16) for a in args), kwargs


def _dropout_model():
    """An MLP with dropout: its masks are keyed by the pipe's seed and call count."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(),
        torch.nn.Linear(32, 32), torch.nn.Dropout(0.3), torch.nn.Tanh(),
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model.to(torch.bfloat16), (torch.randn(8, 16).to(torch.bfloat16),), {}


def _loss(out, _label):
    return out.float().square().mean()


def _opt(pipe, name, state_dtype):
    if name == "AdamW":
        return roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2, weight_decay=0.1,
                                     state_dtype=state_dtype)
    return roundpipe.optim.SGD(pipe.optim_parameters(), lr=1e-2, momentum=0.9,
                               state_dtype=state_dtype)


def _train(model, args, kwargs, devices, name, state_dtype, offload_dir=None, steps=STEPS,
           on_pipe=None, by_unit=False, **options):
    pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32,
                     offload_dir=offload_dir,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2), **options)
    opt = _opt(pipe, name, state_dtype)
    if on_pipe is not None:
        on_pipe(pipe, opt)
    for _ in range(steps):
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        # pipe.step(opt): updated and published unit by unit, overlapping the next call
        pipe.step(opt if by_unit else lambda: (opt.step(), opt.zero_grad()))
    return pipe, opt


def _snapshot(pipe, opt):
    """Weights, masters (state_dict) and optimizer state, as plain tensors."""
    pipe.synchronize()  # pipe.step(opt) may still be updating the last units
    weights = {n: p.detach().clone() for n, p in pipe.model.named_parameters()}
    masters = {k: v.clone() for k, v in pipe.state_dict().items()}
    state = opt.state_dict()["state"]
    return weights, masters, {i: {k: v.clone() for k, v in s.items()}
                              for i, s in state.items()}


def _assert_equal(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], dict):
                _assert_equal([x[k]], [y[k]])
            else:
                assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("name, state_dtype, devices, by_unit", [
    ("AdamW", None, 1, False), ("AdamW", None, 3, True), ("AdamW", torch.bfloat16, 3, False),
    ("SGD", None, 1, True), ("SGD", torch.bfloat16, 3, False)])
def test_steps_with_the_disk_tier_equal_the_run_in_memory_bitwise(
        tmp_path, name, state_dtype, devices, by_unit):
    """Three steps (a step_fn, or pipe.step(opt) which publishes unit by unit): weights,
    masters and optimizer state equal the run in memory bit for bit, the files hold
    them, and at most four units (the window's read-ahead) were staged at once."""
    model, args, kwargs = _model()
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, kwargs, devices, name,
                               state_dtype, by_unit=by_unit)
    pipe, opt = _train(model, args, kwargs, devices, name, state_dtype,
                       offload_dir=tmp_path / "tier", by_unit=by_unit)
    try:
        if by_unit:
            assert pipe.step_overlap(opt) == "per unit"
        store = pipe._state.offload
        units = [u for u in pipe._state.publish_groups
                 if any(n in pipe._state.masters() for n in u)]
        # staged tensors live in pooled buffers padded to 4 KiB (the files' regions)
        size = [sum(-(-store.tensor(k).numel() * store.tensor(k).element_size() // ALIGN)
                    * ALIGN for k in store.group_keys(u)
                    if store.tensor(k).numel() * store.tensor(k).element_size()
                    > RESIDENT_BYTES) for u in units]
        assert len(units) >= 4
        window = max(sum(size[max(0, k - 1):k + 2 + READ_AHEAD - 1])
                     for k in range(len(size)))
        # (tests/test_offload_staging.py checks the window on a model with more units)
        assert 0 < store.peak_staged_bytes <= window <= sum(size)
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref_pipe, ref_opt))
        # Between steps neither masters nor moments are in memory.
        assert all(m.untyped_storage().nbytes() == 0 for m in pipe.optim_parameters()
                   if m.numel() * m.element_size() > RESIDENT_BYTES)
        assert all(v.untyped_storage().nbytes() == 0 for s in opt.state.values()
                   for v in s.values() if v.numel() * v.element_size() > RESIDENT_BYTES)
        # The committed files hold the same values.
        step, files = read_committed(tmp_path / "tier")
        assert step == STEPS
        ref_masters = dict(ref_pipe.optim_named_parameters())
        for n, m in ref_masters.items():
            assert torch.equal(files[f"master/{n}"], m.detach()), n
    finally:
        pipe.close()
        ref_pipe.close()


def _fail_update(pipe, opt):
    """The update raises after the first group's parameters were written in memory."""
    real = opt._update_group
    calls = []

    def update(group, pairs):
        real(group, pairs)
        if len(calls) == 0 and pipe._steps == 1:  # the second step
            calls.append(1)
            raise RuntimeError("injected: the update failed")
    opt._update_group = update


def _fail_store(point):
    def on_pipe(pipe, opt):
        store = pipe._state.offload
        seen = []

        def fault(what, arg):
            if what == point and store.step == 1:
                seen.append(arg)
                if len(seen) == (3 if what == "write" else 1):
                    raise OSError(28, "injected: No space left on device")
        store.fault = fault
    return on_pipe


@pytest.mark.parametrize("where", ["update", "write", "commit"])
def test_a_failed_step_changes_nothing_a_resume_reads(tmp_path, where):
    """Step 2 fails (in the update, in the middle of the write-back, or just before the
    manifest is replaced); after zero_grad the run goes on as if it had never been
    taken: two more steps equal two steps in memory, files included."""
    model, args, kwargs = _model()
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None,
                               steps=2)
    on_pipe = ((lambda pipe, opt: _fail_update(pipe, opt)) if where == "update"
               else _fail_store(where))
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "t",
                       steps=1, on_pipe=on_pipe)
    try:
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        with pytest.raises(StepError, match="injected"):
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        step, files = read_committed(tmp_path / "t")
        assert step == 1
        opt.zero_grad()
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref_pipe, ref_opt))
        stats = pipe.offload_stats()  # nothing staged: only the pool's kept buffers
        assert pipe._state.offload.staged_keys() == []
        assert stats.staged_bytes == stats.pooled_bytes <= stats.peak_staged_bytes
    finally:
        pipe.close()
        ref_pipe.close()


_KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import test_offload as t
    model, args, kwargs = t._model()

    def on_pipe(pipe, opt):
        store = pipe._state.offload
        seen = []

        def fault(what, arg):
            if what == "write" and store.step == 2:
                seen.append(arg)
                if len(seen) == 5:  # some of step 3's writes are issued, some not
                    os.kill(os.getpid(), signal.SIGKILL)
        store.fault = fault

    t._train(model, args, kwargs, 1, "AdamW", None, offload_dir={path!r}, steps=3,
             on_pipe=on_pipe)
    print("not killed")
""")


def test_a_kill_during_the_write_back_leaves_the_last_whole_step(forkserver, tmp_path):
    """A process killed (SIGKILL) in the middle of step 3's write-back leaves files that
    hold step 2 exactly: the masters and moments of two steps in memory."""
    path = str(tmp_path / "t")
    script = _KILLED.format(tests=os.path.dirname(__file__), path=path)
    # a fresh process (forked: tests/forkserver.py) that SIGKILLs itself
    proc = forkserver.run(code=script, cwd=os.path.dirname(os.path.dirname(__file__)),
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.output
    step, files = read_committed(path)
    assert step == 2
    model, args, kwargs = _model()
    ref_pipe, ref_opt = _train(model, args, kwargs, 1, "AdamW", None, steps=2)
    try:
        n_state = 0
        for name, master in ref_pipe.optim_named_parameters():
            assert torch.equal(files[f"master/{name}"], master.detach()), name
            for key, value in ref_opt.state[master].items():
                assert torch.equal(files[f"state/{name}/{key}"], value), (name, key)
                n_state += 1
        assert n_state == 3 * len(ref_pipe.optim_parameters())
    finally:
        ref_pipe.close()


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoints_with_the_disk_tier_resume_bitwise(tmp_path, sharded):
    """Save after two steps with the tier, load into a new pipe with a new tier, one more
    step: equal to three steps in memory (and the checkpoint loads into a pipe without
    the tier alike)."""
    model, args, kwargs = _model()
    fresh = copy.deepcopy(model)
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None,
                               steps=3)
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "a",
                       steps=2)
    path = tmp_path / ("ckpt" if sharded else "ckpt.pt")
    if sharded:
        path.mkdir()
    save_checkpoint(path, pipe, opt, sharded=sharded)
    pipe.close()

    def load(p, o):
        load_checkpoint(path, p, o)
    pipe2, opt2 = _train(fresh, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "b",
                         steps=1, on_pipe=load)
    try:
        _assert_equal(_snapshot(pipe2, opt2), _snapshot(ref_pipe, ref_opt))
        step, files = read_committed(tmp_path / "b")
        for name, master in ref_pipe.optim_named_parameters():
            assert torch.equal(files[f"master/{name}"], master.detach()), name
    finally:
        pipe2.close()
        ref_pipe.close()


def test_host_memory_reports_ram_and_disk_apart(tmp_path):
    """Between steps the masters and moments take no host memory (but the few-byte
    ones kept resident), and their files two 4 KiB-aligned slots each."""
    model, args, kwargs = _model()
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "t",
                       steps=1)
    try:
        mem = pipe.host_memory(opt)

        def nbytes(t):
            return t.numel() * t.element_size()

        def slots(tensors):
            return sum(2 * -(-nbytes(t) // 4096) * 4096 for t in tensors
                       if nbytes(t) > RESIDENT_BYTES)

        def resident(tensors):
            return sum(nbytes(t) for t in tensors if nbytes(t) <= RESIDENT_BYTES)

        masters = pipe.optim_parameters()
        state = [v for s in opt.state.values() for v in s.values()]
        assert len(state) == 3 * len(masters)
        assert mem.masters == resident(masters) < sum(nbytes(m) for m in masters) / 100
        assert mem.optimizer_state == resident(state)
        assert mem.disk_masters == slots(masters) > 0
        assert mem.disk_optimizer_state == slots(state) > 0
        assert mem.disk_total == mem.disk_masters + mem.disk_optimizer_state
        assert "on disk (offload_dir)" in str(mem)
        assert os.path.getsize(tmp_path / "t" / "data.bin") == mem.disk_total
    finally:
        pipe.close()


def test_what_the_disk_tier_cannot_hold_is_refused(tmp_path):
    model, args, kwargs = _model()
    with RoundPipe(model, devices=["cpu"], optim_dtype=torch.float32,
                   offload_dir=tmp_path / "t") as pipe:
        opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        with pytest.raises(OptimizerError, match="roundpipe.optim.AdamW"):
            pipe.step(lambda: opt.step())
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        with pytest.raises(ConfigError, match="predict_weights=False"):
            pipe.step(lambda: opt.step(), is_async=True)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))  # a whole step commits
    with pytest.raises(OffloadError, match="step 1 of another run"):
        RoundPipe(model, devices=["cpu"], optim_dtype=torch.float32,
                  offload_dir=tmp_path / "t")


@pytest.mark.parametrize("state_dtype, expected", [(None, 24.0), (torch.bfloat16, 16.0)])
def test_the_host_step_estimate_gives_the_disk_time(tmp_path, state_dtype, expected):
    """AdamW with the tier reads and writes each master (4 B) and moment (4 or 2 B) once
    per step; the estimate divides that by the disk bandwidth measured under the
    directory, and the plan's host-step line says so."""
    model, args, kwargs = _model()
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", state_dtype,
                       offload_dir=tmp_path / "t", steps=1)
    try:
        est = pipe.host_step_estimate(opt)
        assert est.disk_bytes_per_param == expected
        assert est.disk_bandwidth > 0
        assert est.disk_seconds == pytest.approx(est.params * expected / est.disk_bandwidth)
        assert "disk tier: %d B/param" % expected in str(est)
        assert not os.path.exists(tmp_path / "t" / "manifest.json.tmp")
        with RoundPipe(copy.deepcopy(model), devices=["cpu"],
                       optim_dtype=torch.float32) as plain:
            plain.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                   loss_fn=_loss)
            est = plain.host_step_estimate(roundpipe.optim.AdamW(plain.optim_parameters()))
            assert est.disk_seconds == 0 and "disk tier" not in str(est)
    finally:
        pipe.close()


@pytest.mark.parametrize("direct", [True, False])
def test_the_store_round_trips_odd_sizes_in_two_slots(tmp_path, direct):
    """Tensors of sizes that are no multiple of a block, one over a chunk: registered,
    staged, changed, written back into the other slot and committed, they read back
    exactly; a rollback returns to the committed slot; O_DIRECT where the file system
    takes it (a bounce buffer per I/O thread), plain pread/pwrite otherwise."""
    from roundpipe.runtime import offload
    store = offload.OffloadStore(tmp_path / "s", direct=direct)
    try:
        if direct:
            assert store._direct == hasattr(os, "O_DIRECT")  # ext4/xfs under tmp_path
        g = torch.Generator().manual_seed(0)
        tensors = {f"t{i}": torch.randn(n, generator=g).to(dtype) for i, (n, dtype) in
                   enumerate([(1000, torch.float32), (4097, torch.bfloat16),
                              ((offload.CHUNK_BYTES // 4) + 3, torch.float32)])}
        originals = {k: v.clone() for k, v in tensors.items()}
        for k, v in tensors.items():
            store.register(k, v, group=k)
            assert v.untyped_storage().nbytes() == 0
        store.commit()
        store.begin()
        offload.wait(store.stage(list(tensors)))
        for k, v in tensors.items():
            assert torch.equal(v, originals[k]), k
            v.mul_(2)
        offload.wait(store.write_back(list(tensors)))
        store.evict(list(tensors))
        store.rollback()  # back to the committed slot
        for k in tensors:
            assert torch.equal(store.read(k), originals[k]), k
        store.begin()
        offload.wait(store.stage(list(tensors)))
        for v in tensors.values():
            v.add_(1)
        offload.wait(store.write_back(list(tensors)))
        store.evict(list(tensors))
        store.commit()
        step, files = offload.read_committed(tmp_path / "s")
        assert step == 2
        for k in tensors:
            assert torch.equal(files[k], originals[k] + 1), k
            assert torch.equal(store.read(k), originals[k] + 1), k
    finally:
        store.close()


def test_asynchronous_steps_without_prediction_equal_the_run_in_memory(tmp_path):
    """is_async=True with predict_weights=False: each step publishes the last one's
    masters (read from the files) while the next call runs; bitwise as in memory."""
    model, args, kwargs = _model()
    runs = []
    for offload_dir in (None, tmp_path / "t"):
        pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * 3,
                         optim_dtype=torch.float32, predict_weights=False,
                         offload_dir=offload_dir,
                         model_run_config=RoundPipeRunConfig(num_microbatch=2))
        opt = _opt(pipe, "AdamW", None)
        for _ in range(STEPS):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        runs.append((pipe, opt, _snapshot(pipe, opt)))
    try:
        _assert_equal(runs[1][2], runs[0][2])
    finally:
        for pipe, _, _ in runs:
            pipe.close()


def test_a_read_failing_in_the_publish_leaves_nothing_staged(tmp_path):
    """A step_fn step publishes at synchronize(), reading the masters unit by unit; a
    read that fails there raises, frees what it staged, makes a call that would wait
    for those weights raise instead of hang, and the next synchronize() publishes the
    same weights as the run in memory."""
    from roundpipe import OffloadError
    model, args, kwargs = _model()
    ref_pipe, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None,
                               steps=2)
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "t",
                       steps=1)
    store = pipe._state.offload
    failed = []

    def fault(what, key):
        # in the publish after the step (no step in progress), at a later unit
        if what == "read" and not failed and store._begun is None and store.staged_bytes:
            failed.append(key)
            raise OffloadError("injected: Input/output error")
    try:
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        store.fault = fault
        with pytest.raises(OffloadError, match="injected"):
            pipe.step(lambda: (opt.step(), opt.zero_grad()))  # its publish fails
        stats = pipe.offload_stats()
        assert failed and pipe._state.offload.staged_keys() == []
        assert stats.staged_bytes == stats.pooled_bytes
        assert pipe.offload_stats().step == 2  # the step itself is committed
        with pytest.raises(StepError, match="call pipe.synchronize"):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
        pipe.synchronize()
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref_pipe, ref_opt))
    finally:
        pipe.close()
        ref_pipe.close()


def test_the_option_reaches_the_pipe_through_compile_and_the_trainers_options(tmp_path):
    """roundpipe.compile(..., offload_dir=) makes a pipe with the tier; RoundPipeTrainer's
    pipe_options hand offload_dir to RoundPipe (not to the run config)."""
    from roundpipe.hf.arguments import split_pipe_options
    model, args, kwargs = _model()
    pipe = roundpipe.compile(model, example_args=args, optim_dtype=torch.float32,
                             devices=["cpu"], offload_dir=tmp_path / "t")
    try:
        stats = pipe.offload_stats()
        assert stats is not None and stats.directory == str(tmp_path / "t")
    finally:
        pipe.close()
    pipe_kwargs, run_kwargs = split_pipe_options({"offload_dir": "/x", "num_microbatch": 2})
    assert pipe_kwargs == {"offload_dir": "/x"} and run_kwargs == {"num_microbatch": 2}


# --- loading a checkpoint into a pipe with the tier: one commit -------------------------

_KILLED_IN_LOAD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import test_offload as t
    from roundpipe import load_checkpoint
    model, args, kwargs = t._model()
    pipe, opt = t._train(model, args, kwargs, 1, "AdamW", None, offload_dir={path!r},
                         steps=1)
    store = pipe._state.offload

    def fault(what, arg):
        # the load wrote every master; its first moment is about to be written
        if what == "write" and str(arg).startswith("state/"):
            os.kill(os.getpid(), signal.SIGKILL)
    store.fault = fault
    load_checkpoint({ckpt!r}, pipe, opt)
    print("not killed")
""")


def _tier_matches(files, pipe, opt):
    """Which of masters and optimizer state in ``files`` equal ``pipe``/``opt``'s
    (bitwise): a set of True/False, one per tensor."""
    verdicts = []
    for name, master in pipe.optim_named_parameters():
        verdicts.append(torch.equal(files[f"master/{name}"], pipe._state.read_master(name)))
        for key, value in opt.state_dict()["state"][
                [n for n, _ in pipe.optim_named_parameters()].index(name)].items():
            verdicts.append(torch.equal(files[f"state/{name}/{key}"], value))
    return verdicts


def _checkpoint(tmp_path, sharded, steps=2):
    """A checkpoint of ``steps`` steps in memory (other values than one step's)."""
    model, args, kwargs = _model()
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, steps=steps)
    path = tmp_path / ("ckpt" if sharded else "ckpt.pt")
    if sharded:
        path.mkdir()
    save_checkpoint(path, pipe, opt, sharded=sharded)
    pipe.close()
    return path


@pytest.mark.parametrize("sharded", [False, True])
def test_a_kill_while_loading_a_checkpoint_leaves_the_state_before_it(forkserver, tmp_path,
                                                                       sharded):
    """A process killed (SIGKILL) while load_checkpoint writes into the tier, after the
    masters and before the moments, leaves the files at the step before the load, every
    tensor of it: not the checkpoint's masters beside the old moments."""
    ckpt = _checkpoint(tmp_path, sharded)
    path = str(tmp_path / "t")
    script = _KILLED_IN_LOAD.format(tests=os.path.dirname(__file__), path=path,
                                    ckpt=str(ckpt))
    # a fresh process (forked: tests/forkserver.py) that SIGKILLs itself
    proc = forkserver.run(code=script, cwd=os.path.dirname(os.path.dirname(__file__)),
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.output
    step, files = read_committed(path)
    assert step == 1
    model, args, kwargs = _model()
    one, one_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=1)
    two, two_opt = _train(model, args, kwargs, 1, "AdamW", None, steps=2)
    try:
        old, new = _tier_matches(files, one, one_opt), _tier_matches(files, two, two_opt)
        assert len(old) == 4 * len(one.optim_parameters())
        assert all(old) and not any(new), (old, new)
        # and the directory reopens to that step: one more step equals two in memory
        again, opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None,
                            steps=1, offload_dir=path, offload_resume=True)
        try:
            _assert_equal(_snapshot(again, opt), _snapshot(two, two_opt))
        finally:
            again.close()
    finally:
        one.close()
        two.close()


def test_a_load_failing_half_way_leaves_the_files_and_refuses_until_loaded(tmp_path):
    """An I/O error after the masters were written: load_checkpoint raises, the files
    still hold the step before it, calls and steps refuse (the weights in memory are the
    checkpoint's); a load that succeeds commits every tensor at once, and one more step
    equals three steps in memory."""
    ckpt = _checkpoint(tmp_path, sharded=False)
    model, args, kwargs = _model()
    ref, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=3)
    pipe, opt = _train(model, args, kwargs, 1, "AdamW", None, offload_dir=tmp_path / "t",
                       steps=1)
    store = pipe._state.offload
    commits = []

    def fault(what, arg):
        if what == "commit":
            commits.append(arg)
        if what == "write" and str(arg).startswith("state/") and not commits:
            raise OSError(5, "injected: Input/output error")
    try:
        before = read_committed(tmp_path / "t")
        store.fault = fault
        with pytest.raises(OSError, match="injected"):
            load_checkpoint(ckpt, pipe, opt)
        after = read_committed(tmp_path / "t")
        assert after[0] == before[0] == 1 and not commits
        assert all(torch.equal(after[1][k], v) for k, v in before[1].items())
        with pytest.raises(StepError, match="load_checkpoint"):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
        store.fault = None
        load_checkpoint(ckpt, pipe, opt)
        assert read_committed(tmp_path / "t")[0] == 2  # one commit for the whole load
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref, ref_opt))
    finally:
        pipe.close()
        ref.close()


# --- a new pipe resuming the directory -------------------------------------------------

@pytest.mark.parametrize("make, name, state_dtype, devices, by_unit", [
    (_model, "AdamW", None, 1, False), (_dropout_model, "AdamW", torch.bfloat16, 3, True),
    (_model, "SGD", None, 3, False)])
def test_a_new_pipe_resumes_the_directory_exactly(tmp_path, make, name, state_dtype,
                                                    devices, by_unit):
    """Two steps with the tier, the pipe closed; a new pipe over a freshly built model
    with offload_resume=True and a new optimizer takes one more step: weights, masters,
    optimizer state (and the dropout masks, keyed by the run's seed and call count)
    equal three uninterrupted steps in memory, bit for bit."""
    model, args, kwargs = make()
    fresh = copy.deepcopy(model)
    ref, ref_opt = _train(copy.deepcopy(model), args, kwargs, devices, name, state_dtype,
                          by_unit=by_unit, seed=7)
    pipe, _ = _train(model, args, kwargs, devices, name, state_dtype, steps=2,
                     offload_dir=tmp_path / "t", by_unit=by_unit, seed=7)
    pipe.close()
    assert not torch.equal(fresh[0].weight, ref.model[0].weight)
    again, opt = _train(fresh, args, kwargs, devices, name, state_dtype, steps=1,
                        offload_dir=tmp_path / "t", by_unit=by_unit, offload_resume=True)
    try:
        assert again.seed == 7 and again._steps == 3
        _assert_equal(_snapshot(again, opt), _snapshot(ref, ref_opt))
        step, files = read_committed(tmp_path / "t")
        assert step == 3
        for n, m in ref.optim_named_parameters():
            assert torch.equal(files[f"master/{n}"], m.detach()), n
    finally:
        again.close()
        ref.close()


def _resume(model, path, **options):
    return RoundPipe(model, devices=["cpu"], optim_dtype=torch.float32, offload_dir=path,
                     offload_resume=True, **options)


def test_a_directory_of_another_model_or_optimizer_is_refused(tmp_path):
    """The manifest records what the directory belongs to; a resume with another model
    (shapes, dtypes, trainable set, frozen values, master dtype), another optimizer
    (class, state dtype, hyperparameters), another dropout seed, or without taking the
    optimizer state is refused, naming what differs, and changes nothing: the directory
    then resumes into the right pipe."""
    from roundpipe import OffloadMismatchError
    model, args, kwargs = _model()
    model[0].bias.requires_grad_(False)  # a frozen parameter: its values are checked
    path = tmp_path / "t"
    pipe, _ = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=1,
                     offload_dir=path, seed=3)
    pipe.close()
    before = read_committed(path)

    wider = copy.deepcopy(model)
    wider[6] = torch.nn.Linear(32, 5).to(torch.bfloat16)
    with pytest.raises(OffloadMismatchError,
                       match=r"'6.weight' bfloat16 \[4, 32\] trainable there, bfloat16 \[5"):
        _resume(wider, path)
    unfrozen = copy.deepcopy(model)
    unfrozen[0].bias.requires_grad_(True)
    with pytest.raises(OffloadMismatchError,
                       match=r"'0.bias' bfloat16 \[32\] frozen there, bfloat16 \[32\] trainable"):
        _resume(unfrozen, path)
    other_values = copy.deepcopy(model)
    with torch.no_grad():
        other_values[0].bias.add_(1)
    with pytest.raises(OffloadMismatchError, match="frozen parameters or buffers.*'0.bias'"):
        _resume(other_values, path)
    with pytest.raises(OffloadMismatchError, match="optim_dtype"):
        RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float64,
                  offload_dir=path, offload_resume=True)
    with pytest.raises(OffloadMismatchError, match="seed=4"):
        _resume(copy.deepcopy(model), path, seed=4)
    for make, match in [
            (lambda p: roundpipe.optim.SGD(p.optim_parameters(), lr=1e-2), "SGD"),
            (lambda p: roundpipe.optim.AdamW(p.optim_parameters(), lr=1e-2), "0.01"),
            (lambda p: _opt(p, "AdamW", torch.bfloat16), "bfloat16")]:
        with _resume(copy.deepcopy(model), path) as p:
            with pytest.raises(OffloadMismatchError, match=match) as refused:
                make(p)
            kept = refused.tb  # (a caller's traceback keeps the optimizer alive)
            # the refused optimizer is not bound (a commit would record it)
            assert kept is not None and not list(p._state.landed.optimizers)
            assert not any(p._state.landed.bound(n) for n, _ in p.optim_named_parameters())
    with _resume(copy.deepcopy(model), path) as p:  # no optimizer took the state
        p.forward_backward(input_args=args, input_kwargs=kwargs, label=None, loss_fn=_loss)
        opt = torch.optim.SGD(p.optim_parameters(), lr=1e-2)
        with pytest.raises(OffloadMismatchError, match="no optimizer of this pipe took"):
            p.step(lambda: opt.step())
    after = read_committed(path)
    assert after[0] == before[0] == 1
    assert all(torch.equal(after[1][k], v) for k, v in before[1].items())
    # the right model and optimizer resume it (another learning rate is no mismatch)
    with _resume(copy.deepcopy(model), path) as p:
        opt = roundpipe.optim.AdamW(p.optim_parameters(), lr=5e-3, weight_decay=0.1)
        assert p.seed == 3 and len(opt.state) == len(p.optim_parameters())


def test_a_fresh_pipe_never_takes_or_overwrites_a_directory_silently(tmp_path):
    """Without offload_resume a directory with committed state is refused, saying how
    to resume it; offload_resume=True on a directory without state is refused; "auto"
    starts afresh there and resumes once there is state."""
    model, args, kwargs = _model()
    path = tmp_path / "t"
    with pytest.raises(OffloadError, match="holds no committed state"):
        _resume(copy.deepcopy(model), path)
    pipe, _ = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=1,
                     offload_dir=path, offload_resume="auto")
    assert pipe._steps == 1
    pipe.close()
    with pytest.raises(OffloadError, match="offload_resume=True"):
        RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float32,
                  offload_dir=path)
    assert read_committed(path)[0] == 1
    pipe, _ = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=1,
                     offload_dir=path, offload_resume="auto")
    try:
        assert pipe._steps == 2 and read_committed(path)[0] == 2
    finally:
        pipe.close()
    with pytest.raises(ConfigError, match="offload_resume"):
        RoundPipe(model, devices=["cpu"], optim_dtype=torch.float32, offload_resume=True)


# --- stochastic rounding (no masters): the bf16 moments in the tier ----------------------

def _sr_opt(pipe, name):
    if name == "AdamW":
        return roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2, weight_decay=0.1,
                                     stochastic_rounding=True, seed=5)
    return roundpipe.optim.SGD(pipe.optim_parameters(), lr=1e-2, momentum=0.9,
                               stochastic_rounding=True, seed=5)


def _sr_train(model, args, kwargs, devices, name, offload_dir=None, steps=STEPS,
              on_pipe=None):
    pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=None,
                     offload_dir=offload_dir,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = _sr_opt(pipe, name)
    if on_pipe is not None:
        on_pipe(pipe, opt)
    for _ in range(steps):
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
    return pipe, opt


def test_stochastic_rounding_with_offload_resume_auto_starts_afresh(tmp_path):
    """Without masters the files cannot resume a run (the weights were in memory), so
    offload_resume=True is refused; "auto" on a directory without committed state starts
    afresh as "auto" says (it was refused as if it were True), and is refused once the
    directory holds a run's state."""
    model, args, kwargs = _model()
    path = tmp_path / "t"
    with pytest.raises(ConfigError, match="offload_resume continues a run"):
        RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=None,
                  offload_dir=path, offload_resume=True)
    pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2, optim_dtype=None,
                     offload_dir=path, offload_resume="auto",
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    try:
        opt = _sr_opt(pipe, "AdamW")
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        pipe.synchronize()
        assert read_committed(path)[0] == 1
    finally:
        pipe.close()
    with pytest.raises(ConfigError, match="offload_resume continues a run"):
        RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=None,
                  offload_dir=path, offload_resume="auto")


@pytest.mark.parametrize("name, devices", [("AdamW", 1), ("AdamW", 3), ("SGD", 3)])
def test_stochastic_rounding_keeps_its_moments_in_the_tier_bitwise(tmp_path, name,
                                                                    devices):
    """A bf16 model without masters, stochastically rounded updates: with offload_dir the
    bf16 moments live in the files (none in memory between steps, at most four units
    staged), the weights stay in memory, and three steps equal the run in memory on one
    device bit for bit; host_memory() shows the moments on disk."""
    model, args, kwargs = _model()
    ref, ref_opt = _sr_train(copy.deepcopy(model), args, kwargs, 1, name)
    pipe, opt = _sr_train(model, args, kwargs, devices, name, offload_dir=tmp_path / "t")
    try:
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref, ref_opt))
        state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        assert len(state) == (2 if name == "AdamW" else 1) * len(pipe.optim_parameters())
        assert all(v.dtype == torch.bfloat16 for v in state)
        big = [v for v in state if v.numel() * v.element_size() > RESIDENT_BYTES]
        assert big and all(v.untyped_storage().nbytes() == 0 for v in big)
        assert all(p.untyped_storage().nbytes() > 0 for p in pipe.optim_parameters())
        # staged in 4 KiB-padded pool buffers; four units (the read-ahead window) are
        # this model's all (tests/test_offload_staging.py checks the window on eight)
        total = sum(-(-v.numel() * v.element_size() // ALIGN) * ALIGN for v in big)
        assert 0 < pipe.offload_stats().peak_staged_bytes <= total
        mem = pipe.host_memory(opt)
        small = [v for s in opt.state.values() for v in s.values()
                 if v.numel() * v.element_size() <= RESIDENT_BYTES]
        assert mem.masters == 0 and mem.disk_masters == 0
        assert mem.optimizer_state == sum(v.numel() * v.element_size() for v in small)
        assert mem.disk_optimizer_state == sum(
            2 * -(-v.numel() * v.element_size() // 4096) * 4096 for v in big)
        step, files = read_committed(tmp_path / "t")
        assert step == STEPS
        names = {id(p): n for n, p in ref.optim_named_parameters()}
        for p, s in ref_opt.state.items():
            for key, value in s.items():
                assert torch.equal(files[f"state/{names[id(p)]}/{key}"], value), key
    finally:
        pipe.close()
        ref.close()


def test_stochastic_rounding_with_the_tier_checkpoints_and_fails_safely(tmp_path):
    """A checkpoint saved after two steps with the tier loads into a new pipe with a new
    tier, and one more step equals three in memory. A step whose first read fails
    changes nothing (the run goes on as in memory); one that fails after a unit's
    weights were written refuses calls until a checkpoint is loaded."""
    model, args, kwargs = _model()
    ref, ref_opt = _sr_train(copy.deepcopy(model), args, kwargs, 1, "AdamW")
    fresh = copy.deepcopy(model)
    pipe, opt = _sr_train(copy.deepcopy(model), args, kwargs, 1, "AdamW", steps=2,
                          offload_dir=tmp_path / "a")
    save_checkpoint(tmp_path / "ck.pt", pipe, opt)
    pipe.close()
    pipe, opt = _sr_train(fresh, args, kwargs, 3, "AdamW", steps=1,
                          offload_dir=tmp_path / "b",
                          on_pipe=lambda p, o: load_checkpoint(tmp_path / "ck.pt", p, o))
    try:
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref, ref_opt))
    finally:
        pipe.close()
        ref.close()

    ref, ref_opt = _sr_train(copy.deepcopy(model), args, kwargs, 1, "AdamW", steps=2)
    pipe, opt = _sr_train(copy.deepcopy(model), args, kwargs, 1, "AdamW", steps=1,
                          offload_dir=tmp_path / "c")
    store = pipe._state.offload
    reads = []

    def fault(at):
        def inject(what, key):
            if what == "read" and store._begun is not None:
                reads.append(key)
                if len(reads) == at:
                    raise OSError(5, "injected: Input/output error")
        return inject
    try:
        # two reads per unit (the weight's moments): the 1st read is unit 0's, the 3rd
        # unit 1's read ahead before unit 0 is updated; the first after unit 0 was
        # updated is unit READ_AHEAD + 1's first (the 7th: units 1 and 2 are read ahead
        # before unit 0's update)
        for at in (1, 3):
            reads.clear()
            store.fault = fault(at)
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
            with pytest.raises(StepError, match="injected"):
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
            store.fault = None
            assert read_committed(tmp_path / "c")[0] == 1 and store.staged_keys() == []
            assert store.staged_bytes == store.staging.kept  # buffers kept, none in use
            opt.zero_grad()
        # nothing of these failures stayed: a step now equals two steps in memory
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref, ref_opt))
        assert read_committed(tmp_path / "c")[0] == 2
        reads.clear()
        # after a unit was updated: refused until a load
        store.fault = fault(2 * (READ_AHEAD + 1) + 1)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        with pytest.raises(StepError, match="injected"):
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        store.fault = None
        assert read_committed(tmp_path / "c")[0] == 2 and store.staged_keys() == []
        assert store.staged_bytes == store.staging.kept
        with pytest.raises(StepError, match="load_checkpoint"):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
        load_checkpoint(tmp_path / "ck.pt", pipe, opt)  # two steps: as the reference
        assert read_committed(tmp_path / "c")[0] == 3  # the load, one commit
        _assert_equal(_snapshot(pipe, opt), _snapshot(ref, ref_opt))
    finally:
        pipe.close()
        ref.close()


def test_what_the_tier_cannot_hold_without_masters_is_refused(tmp_path):
    """Without masters the files hold only stochastically rounded (or state_dtype)
    updates' state: torch's implementation and torch optimizers are refused before
    anything runs, and so is resuming (the weights are not in the files)."""
    model, args, kwargs = _model()
    with RoundPipe(copy.deepcopy(model), devices=["cpu"],
                   offload_dir=tmp_path / "t") as pipe:
        with pytest.raises(OptimizerError, match="stochastic_rounding=True"):
            roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-2)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        weights = [p.detach().clone() for p in pipe.optim_parameters()]
        with pytest.raises(OptimizerError, match="roundpipe.optim"):
            pipe.step(lambda: opt.step())
        assert all(torch.equal(w, p) for w, p in zip(weights, pipe.optim_parameters()))
    with pytest.raises(ConfigError, match="checkpoint"):  # ("auto": tested above)
        RoundPipe(model, devices=["cpu"], offload_dir=tmp_path / "t",
                  offload_resume=True)


@pytest.mark.parametrize("name, expected", [("AdamW", 8.0), ("SGD", 4.0)])
def test_the_host_step_estimate_gives_the_disk_time_of_the_moments(tmp_path, name,
                                                                     expected):
    """Without masters the tier reads and writes only the bf16 moments: AdamW's two
    (2 x 2 x 2 B), SGD's momentum (2 x 2 B) per parameter and step."""
    model, args, kwargs = _model()
    pipe, opt = _sr_train(model, args, kwargs, 1, name, offload_dir=tmp_path / "t",
                          steps=1)
    try:
        est = pipe.host_step_estimate(opt)
        assert est.disk_bytes_per_param == expected
        assert "disk tier: %d B/param" % expected in str(est)
    finally:
        pipe.close()


def test_resuming_after_an_asynchronous_step_says_it_does_not_lag(tmp_path, caplog):
    """After is_async=True steps the next call would use the weights one step behind;
    the tier does not keep them, so the resumed pipe publishes the committed masters and
    warns that it does not continue that run bit for bit; its masters are the run's."""
    model, args, kwargs = _model()
    for is_async in (False, True):
        path = tmp_path / str(is_async)
        pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float32,
                         predict_weights=False, offload_dir=path)
        opt = _opt(pipe, "AdamW", None)
        for _ in range(2):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        pipe.synchronize()
        masters = {n: m.clone() for n, m in pipe.state_dict().items()}
        pipe.close()
        caplog.clear()
        with RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float32,
                       predict_weights=False, offload_dir=path, offload_resume=True) as p:
            _assert_equal([p.state_dict()], [masters])
        assert ("asynchronously" in caplog.text) == is_async


def test_stochastic_rounding_failing_at_the_commit_refuses_until_loaded(tmp_path):
    """Without masters the weights are updated in place; a step whose every unit was
    updated but whose commit fails leaves the files at the step before it beside the new
    weights, so calls refuse until a checkpoint is loaded (the step's unit schedule was
    cleared before the commit, so the failure read as one before any update)."""
    model, args, kwargs = _model()
    pipe, opt = _sr_train(copy.deepcopy(model), args, kwargs, 1, "AdamW", steps=1,
                          offload_dir=tmp_path / "t")
    save_checkpoint(tmp_path / "ck.pt", pipe, opt)
    store = pipe._state.offload

    def fault(what, arg):
        if what == "commit":
            raise OSError(5, "injected: Input/output error")
    try:
        weights = [p.detach().clone() for p in pipe.optim_parameters()]
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
        store.fault = fault
        with pytest.raises(StepError, match="injected"):
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        store.fault = None
        assert read_committed(tmp_path / "t")[0] == 1
        assert not any(torch.equal(w, p) for w, p in zip(weights, pipe.optim_parameters()))
        with pytest.raises(StepError, match="load_checkpoint"):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
        load_checkpoint(tmp_path / "ck.pt", pipe, opt)
        assert all(torch.equal(w, p) for w, p in zip(weights, pipe.optim_parameters()))
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
    finally:
        pipe.close()


@pytest.mark.parametrize("masters", [True, False])
def test_a_load_failing_before_its_first_write_still_refuses_until_loaded(tmp_path,
                                                                          masters):
    """load_checkpoint sets the model's weights before it writes anything into the tier;
    an I/O error at the tier's first write (the first master's, or without masters the
    first moment's) leaves the files at the step before the load beside the
    checkpoint's weights: calls refuse until a load succeeds (the failed load was taken
    for one that changed nothing: the files' byte counter had not moved)."""
    model, args, kwargs = _model()
    if masters:
        ckpt = _checkpoint(tmp_path, sharded=False)
        pipe, opt = _train(model, args, kwargs, 1, "AdamW", None,
                           offload_dir=tmp_path / "t", steps=1)
    else:
        ref, ref_opt = _sr_train(copy.deepcopy(model), args, kwargs, 1, "AdamW", steps=2)
        ckpt = tmp_path / "ck.pt"
        save_checkpoint(ckpt, ref, ref_opt)
        ref.close()
        pipe, opt = _sr_train(model, args, kwargs, 1, "AdamW", steps=1,
                              offload_dir=tmp_path / "t")
    store = pipe._state.offload

    def fault(what, arg):
        if what == "write":
            raise OSError(5, "injected: Input/output error")
    try:
        pipe.synchronize()
        weights = {n: p.detach().clone() for n, p in pipe.model.named_parameters()}
        before = read_committed(tmp_path / "t")
        store.fault = fault
        with pytest.raises(OSError, match="injected"):
            load_checkpoint(ckpt, pipe, opt)
        store.fault = None
        after = read_committed(tmp_path / "t")
        assert after[0] == before[0] == 1
        assert all(torch.equal(after[1][k], v) for k, v in before[1].items())
        assert not any(torch.equal(weights[n], p) for n, p in pipe.model.named_parameters())
        with pytest.raises(StepError, match="load_checkpoint"):
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
        load_checkpoint(ckpt, pipe, opt)
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                              loss_fn=_loss)
    finally:
        pipe.close()


def test_two_pipes_on_one_directory_are_refused_in_any_process(tmp_path):
    """A directory is locked while a pipe has it open: a second pipe on it (resuming it,
    or fresh on one whose first step is not committed yet, which truncated data.bin) is
    refused, in this process or another, and the files stay as they were; a process
    forked meanwhile (a DataLoader worker) does not keep the lock once the pipe closes.
    Before, both pipes wrote into the same slots and committed manifests naming each
    other's bytes."""
    import warnings
    from roundpipe.runtime.offload import OffloadStore
    model, args, kwargs = _model()
    path, fresh = tmp_path / "t", tmp_path / "fresh"
    pipe, _ = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=1,
                     offload_dir=path)
    first = RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float32,
                      offload_dir=fresh)
    try:
        before = read_committed(path)
        with pytest.raises(OffloadError, match="in use by another pipe"):
            _resume(copy.deepcopy(model), path)
        with pytest.raises(OffloadError, match="in use by another pipe"):
            RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float32,
                      offload_dir=fresh, offload_resume="auto")
        after = read_committed(path)
        assert after[0] == before[0] == 1
        assert all(torch.equal(after[1][k], v) for k, v in before[1].items())
        verdict_r, verdict_w = os.pipe()
        go_r, go_w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork of threads
            child = os.fork()
        if child == 0:  # another process: refused too, then waits to be told to end
            try:
                OffloadStore(path, resume=True).close()
                verdict = b"taken"
            except OffloadError as e:
                verdict = b"refused" if "in use" in str(e) else b"other"
            except BaseException:
                verdict = b"other"
            os.write(verdict_w, verdict)
            os.read(go_r, 1)
            os._exit(0)
        try:
            assert os.read(verdict_r, 16) == b"refused"
            pipe.close()
            with _resume(copy.deepcopy(model), path) as again:  # the child is alive
                assert again._steps == 1
        finally:
            os.write(go_w, b"x")
            os.waitpid(child, 0)
            for fd in (verdict_r, verdict_w, go_r, go_w):
                os.close(fd)
    finally:
        pipe.close()
        first.close()


def test_a_pipe_dropped_without_close_frees_its_directory_once_collected(tmp_path):
    """The directory's lock goes with the store: a pipe dropped without close() (a
    notebook cell run again) does not keep the directory locked for the rest of the
    process once it is collected."""
    import gc
    import weakref
    model, args, kwargs = _model()
    pipe, opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=1,
                       offload_dir=tmp_path / "t")
    store = weakref.ref(pipe._state.offload)
    del pipe, opt
    gc.collect()
    assert store() is None
    with _resume(copy.deepcopy(model), tmp_path / "t") as again:
        assert again._steps == 1



def test_a_failed_roundpipe_compile_leaves_its_directory_free(tmp_path):
    """roundpipe.compile(..., offload_dir=) whose tracing fails closes the pipe it made:
    with the error (and its traceback, which holds that pipe) kept, as a notebook keeps
    the last one, a new pipe opens the directory (before, the pipe was left open, its
    threads running and the directory locked)."""
    model, args, kwargs = _model()
    with pytest.raises(Exception) as failed:
        roundpipe.compile(copy.deepcopy(model),
                          example_args=(torch.randn(8, 3).to(torch.bfloat16),),
                          optim_dtype=torch.float32, devices=["cpu"],
                          offload_dir=tmp_path / "t")
    assert failed.tb is not None
    with RoundPipe(copy.deepcopy(model), devices=["cpu"], optim_dtype=torch.float32,
                   offload_dir=tmp_path / "t") as pipe:
        assert pipe.offload_stats() is not None


def test_a_run_whose_scheduler_changes_group_keys_resumes(tmp_path):
    """OneCycleLR adds keys to the optimizer's groups (max_lr, min_lr, base/max_momentum)
    and sets AdamW's betas when it is made, after the optimizer: the manifest records the
    optimizer as it was made, so a resume, which checks the new optimizer when it is
    made (before its scheduler), takes it, and one more step equals three uninterrupted
    ones bitwise; other betas are still refused (before, every such run was refused as
    'another optimizer')."""
    from roundpipe import OffloadMismatchError
    model, args, kwargs = _model()
    fresh = copy.deepcopy(model)

    def scheduler(pipe, opt):
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    ref, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None,
                          on_pipe=scheduler)
    pipe, _ = _train(model, args, kwargs, 1, "AdamW", None, steps=2, on_pipe=scheduler,
                     offload_dir=tmp_path / "t")
    pipe.close()
    with _resume(copy.deepcopy(fresh), tmp_path / "t") as p:
        with pytest.raises(OffloadMismatchError, match="betas"):
            roundpipe.optim.AdamW(p.optim_parameters(), lr=1e-2, weight_decay=0.1,
                                  betas=(0.8, 0.999))
    again, opt = _train(fresh, args, kwargs, 1, "AdamW", None, steps=1, on_pipe=scheduler,
                        offload_dir=tmp_path / "t", offload_resume=True)
    try:
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"] != (
            0.9, 0.999)
        _assert_equal(_snapshot(again, opt), _snapshot(ref, ref_opt))
    finally:
        again.close()
        ref.close()


def test_a_load_after_a_resume_keeps_the_optimizer_state_no_optimizer_took_yet(tmp_path):
    """A resumed pipe into which the model's state is loaded (pipe.load_state_dict, or
    load_checkpoint without an optimizer) before any optimizer took the directory's
    moments commits them as they were, and the run's optimizer fingerprints with them:
    the pipe closed (or killed) then, a resume still hands them over and one more step
    equals three uninterrupted ones bitwise (before, the load's manifest named only the
    masters: the moments were lost and any optimizer was taken, starting from zeros)."""
    from roundpipe import OffloadMismatchError
    model, args, kwargs = _model()
    ref, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None)
    pipe, _ = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=2,
                     offload_dir=tmp_path / "t")
    masters = pipe.state_dict()
    pipe.close()
    before = read_committed(tmp_path / "t")
    with _resume(copy.deepcopy(model), tmp_path / "t") as p:
        p.load_state_dict(masters)
    after = read_committed(tmp_path / "t")
    assert after[0] == before[0] + 1 and after[1].keys() == before[1].keys()
    assert all(torch.equal(after[1][k], v) for k, v in before[1].items())
    with _resume(copy.deepcopy(model), tmp_path / "t") as p:
        with pytest.raises(OffloadMismatchError, match="SGD"):
            roundpipe.optim.SGD(p.optim_parameters(), lr=1e-2)
    again, opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None, steps=1,
                        offload_dir=tmp_path / "t", offload_resume=True)
    try:
        _assert_equal(_snapshot(again, opt), _snapshot(ref, ref_opt))
    finally:
        again.close()
        ref.close()


@pytest.mark.parametrize("how", ["stochastic rounding step", "load"])
def test_a_mixed_state_is_not_saved(tmp_path, how):
    """Once the tier's state is marked mixed (a step without masters failing after it
    updated weights in place; a load failing part-way) calls and steps refuse, and so
    does save_checkpoint, which saved the new weights beside the files' old moments (or
    the loaded weights beside the old masters) without a word; after a load it saves."""
    model, args, kwargs = _model()
    if how == "load":
        ckpt = _checkpoint(tmp_path, sharded=False)
        pipe, opt = _train(model, args, kwargs, 1, "AdamW", None,
                           offload_dir=tmp_path / "t", steps=1)
    else:
        pipe, opt = _sr_train(model, args, kwargs, 1, "AdamW", steps=1,
                              offload_dir=tmp_path / "t")
        ckpt = tmp_path / "ck.pt"
        save_checkpoint(ckpt, pipe, opt)
    store = pipe._state.offload

    def fault(what, arg):
        if what == ("write" if how == "load" else "commit"):
            raise OSError(5, "injected: Input/output error")
    try:
        if how == "load":
            store.fault = fault
            with pytest.raises(OSError, match="injected"):
                load_checkpoint(ckpt, pipe, opt)
        else:
            pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=None,
                                  loss_fn=_loss)
            store.fault = fault
            with pytest.raises(StepError, match="injected"):
                pipe.step(lambda: (opt.step(), opt.zero_grad()))
        store.fault = None
        for sharded in (False, True):
            path = tmp_path / ("mixed" if sharded else "mixed.pt")
            with pytest.raises(StepError, match="nothing was saved"):
                save_checkpoint(path, pipe, opt, sharded=sharded)
            assert not path.exists() or not any(path.iterdir())
        load_checkpoint(ckpt, pipe, opt)
        save_checkpoint(tmp_path / "after.pt", pipe, opt)
    finally:
        pipe.close()


def test_a_directory_resumes_on_another_device_count_bitwise(tmp_path):
    """Nothing in the directory depends on the devices: two steps on one device, resumed
    on three, one more step equals three uninterrupted steps on one device bit for bit
    (as device-count invariance has it for a run in memory)."""
    model, args, kwargs = _model()
    fresh = copy.deepcopy(model)
    ref, ref_opt = _train(copy.deepcopy(model), args, kwargs, 1, "AdamW", None)
    pipe, _ = _train(model, args, kwargs, 1, "AdamW", None, steps=2,
                     offload_dir=tmp_path / "t")
    pipe.close()
    again, opt = _train(fresh, args, kwargs, 3, "AdamW", None, steps=1, by_unit=True,
                        offload_dir=tmp_path / "t", offload_resume=True)
    try:
        _assert_equal(_snapshot(again, opt), _snapshot(ref, ref_opt))
    finally:
        again.close()
        ref.close()
