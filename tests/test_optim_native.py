"""roundpipe.optim's native kernels (native.py, native_kernels.c): against torch's
optimizers on the same gradients, independent of how the work is cut over threads, and
the fallback to torch's fused kernels where they cannot be built."""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import shutil
import signal
import time
import threading

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import roundpipe.optim
from roundpipe import OptimizerError
from roundpipe.optim import native

LIB = native.library()
needs_lib = pytest.mark.skipif(LIB is None, reason=f"no native kernels: "
                               f"{native.unavailable_reason()}")


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)
            ).item()


def _operands(sizes, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(grad_dtype) for n in sizes] for _ in range(3)]
    return params, grads


def _torch_steps(name, params, grads, scales, kwargs):
    """torch's single-tensor optimizer on fp32 copies of the gradients, each multiplied
    by the factors in turn (as a clipped or unscaled ``.grad``)."""
    ref = [nn.Parameter(p.clone()) for p in params]
    opt = getattr(torch.optim, name)(ref, foreach=False, **kwargs)
    for step_grads in grads:
        for p, g in zip(ref, step_grads):
            p.grad = g.float().clone()
            for f in scales:
                p.grad.mul_(torch.tensor(f, dtype=torch.float32))
        opt.step()
    return ref, opt


def _native_steps(name, params, grads, scales, kwargs, state_dtype=torch.float32,
                  round_states=False):
    """The same steps through native.adamw / native.sgd directly; ``round_states``: keep
    float32 states but round them to bfloat16 after every step."""
    params = [p.clone() for p in params]
    n_states = 0 if name == "SGD" and not kwargs.get("momentum") else \
        1 if name == "SGD" else 3 if kwargs.get("amsgrad") else 2
    states = [[torch.zeros_like(p, dtype=state_dtype) for _ in range(n_states)]
              for p in params]
    factors = tuple(scales) + (1.0,) * (2 - len(scales))
    for step, step_grads in enumerate(grads, start=1):
        work = [native.Work(p, g, s, factors) for p, g, s in zip(params, step_grads, states)]
        if name == "AdamW":
            hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                         amsgrad=False, maximize=False) | kwargs
            b1, b2 = hyper.pop("betas")
            native.adamw(LIB, work, [float(step)] * len(work), beta1=b1, beta2=b2, **hyper)
        else:
            hyper = dict(lr=1e-2, momentum=0.0, dampening=0.0, weight_decay=0.0,
                         nesterov=False, maximize=False) | kwargs
            native.sgd(LIB, work, first=step == 1, **hyper)
        if round_states:
            for s in states:
                for t in s:
                    t.copy_(t.to(torch.bfloat16))
    return params, states


ADAMW = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-4, 3e-3, 0.1]),
    "betas": st.tuples(st.sampled_from([0.0, 0.5, 0.8, 0.9]),
                       st.sampled_from([0.95, 0.999])),
    "eps": st.sampled_from([1e-8, 1e-6]),
    "weight_decay": st.sampled_from([0.0, 0.1]),
    "amsgrad": st.booleans(), "maximize": st.booleans()})
SGD = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 0.1]),
    "momentum": st.sampled_from([0.0, 0.9]),
    "dampening": st.sampled_from([0.0, 0.2]),
    "weight_decay": st.sampled_from([0.0, 0.01]),
    "maximize": st.booleans()})


@needs_lib
@settings(max_examples=40, deadline=None)
@given(case=st.one_of(st.tuples(st.just("AdamW"), ADAMW), st.tuples(st.just("SGD"), SGD)),
       sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
       grad_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       scales=st.sampled_from([(), (0.5,), (0.37, 1024.0)]),
       nesterov=st.booleans(), seed=st.integers(0, 2**16))
def test_native_steps_equal_torchs_on_the_same_gradients(case, sizes, grad_dtype, scales,
                                                          nesterov, seed):
    """Three steps of the native kernel against torch's single-tensor optimizer fed the
    same gradients: relative difference <= 1e-6 per parameter and per state."""
    name, kwargs = case
    if name == "SGD" and nesterov and kwargs["momentum"] and not kwargs["dampening"]:
        kwargs = kwargs | {"nesterov": True}
    params, grads = _operands(sizes, grad_dtype, seed)
    ref, ref_opt = _torch_steps(name, params, grads, scales, kwargs)
    ours, states = _native_steps(name, params, grads, scales, kwargs)
    keys = {"AdamW": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
            "SGD": ["momentum_buffer"]}[name]
    for p, r, s in zip(ours, ref, states):
        assert _rel(p, r) <= 1e-6
        for key, mine in zip(keys, s):
            assert _rel(mine, ref_opt.state[r][key]) <= 1e-6, key


@needs_lib
@pytest.mark.parametrize("name, kwargs", [("AdamW", {}), ("AdamW", {"amsgrad": True}),
                                          ("SGD", {"momentum": 0.9, "nesterov": True})])
def test_bfloat16_state_is_the_float32_update_rounded(name, kwargs):
    """States kept in bfloat16 give bit for bit what float32 states rounded to bfloat16
    after every step give: the update is computed in float32 and only stored rounded
    (round to nearest even, as torch's conversion)."""
    params, grads = _operands([1000, 77, 4099], torch.bfloat16, seed=3)
    a, sa = _native_steps(name, params, grads, (), kwargs, state_dtype=torch.bfloat16)
    b, sb = _native_steps(name, params, grads, (), kwargs, round_states=True)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    for x, y in zip(sa, sb):
        for s, t in zip(x, y):
            assert s.dtype == torch.bfloat16 and torch.equal(s.float(), t)


@needs_lib
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_results_do_not_depend_on_threads_or_where_the_work_is_cut(name, monkeypatch):
    """1, 2 and 5 threads, cuts at any element (no minimum per thread): the same bits,
    so device-count invariance and bitwise resume hold with the native kernels too."""
    monkeypatch.setattr(native, "_MIN_PER_THREAD", 1)
    params, grads = _operands([1, 333, 4097, 10_001], torch.bfloat16, seed=5)
    kwargs = {"momentum": 0.9} if name == "SGD" else {"weight_decay": 0.1}
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            results.append(_native_steps(name, params, grads, (0.5,), kwargs))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for p, q in zip(results[0][0], other[0]):
            assert torch.equal(p, q)
        for x, y in zip(results[0][1], other[1]):
            assert all(torch.equal(s, t) for s, t in zip(x, y))


@needs_lib
def test_the_library_is_called_without_the_gil():
    """ctypes releases the GIL only for a CDLL's functions (a PyDLL keeps it): the update
    must not starve the threads that launch the GPU's kernels (docs/benchmarks.md)."""
    assert isinstance(LIB, ctypes.CDLL) and not isinstance(LIB, ctypes.PyDLL)
    assert LIB._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI == 0


def test_without_a_compiler_auto_falls_back_and_native_is_refused(monkeypatch, tmp_path,
                                                                   caplog):
    """No C compiler: the library is None with the reason, logged once as a warning;
    kernel='auto' then steps through torch's fused kernels (bit for bit
    torch.optim.AdamW(fused=True)), kernel='native' is refused, a misspelt kernel too."""
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_failure", "")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ROUNDPIPE_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="roundpipe.optim.native"):
        assert native.library() is None
        assert native.library() is None
    assert "no-such-cc" in native.unavailable_reason()
    assert sum("native kernels unavailable" in r.message for r in caplog.records) == 1
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(7, 5))]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = roundpipe.optim.AdamW(ours, lr=1e-2, state_dtype=torch.bfloat16)
    assert opt.kernel == "auto"
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for _ in range(3):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        for state in ref_opt.state.values():
            for v in state.values():
                if v.dim():
                    v.copy_(v.to(torch.bfloat16))
    assert all(torch.equal(p, q) for p, q in zip(ours, ref))
    with pytest.raises(OptimizerError, match="no-such-cc"):
        roundpipe.optim.SGD(ours, lr=1e-2, kernel="native")
    with pytest.raises(OptimizerError, match="'auto', 'native', 'fused'"):
        roundpipe.optim.AdamW(ours, kernel="c++")


def test_a_build_lands_whole_in_the_cache(monkeypatch, tmp_path):
    """The library is built into the cache directory under a name that covers the source,
    the flags and the CPU, and loaded from there the next time."""
    if native.library() is None:
        pytest.skip(reason=f"no C compiler: {native.unavailable_reason()}")
    monkeypatch.setenv("ROUNDPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    native._build()
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("optim-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    native._build()
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name]
    assert built[0].stat().st_mtime_ns == stamp


def test_the_kernel_setting_survives_pickling():
    opt = roundpipe.optim.AdamW([nn.Parameter(torch.randn(3))], kernel="fused")
    assert pickle.loads(pickle.dumps(opt)).kernel == "fused"
    opt.load_state_dict(opt.state_dict())
    assert opt.kernel == "fused"


@needs_lib
@pytest.mark.parametrize("name, kwargs, second", [
    # m = 0.9 m + 0.1 g and buf = 0.9 buf + 0.8 d nearly cancel on the second step
    ("AdamW", {"weight_decay": 0.0}, -0.9000001),
    ("SGD", {"lr": 0.01, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01,
             "maximize": True}, -1.1259),
    ("SGD", {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
     -0.9123457)])
def test_nearly_cancelling_updates_round_as_torchs(name, kwargs, second):
    """Where a moment nearly cancels, a different rounding is a large relative error:
    the kernels fuse multiply-adds where torch's kernels do (lerp, addcmul, add with
    alpha), so the moments stay within 1e-6 of torch's even then."""
    params = [torch.tensor([0.75]), torch.linspace(-1, 1, 1000)]
    grads = [[torch.tensor([1.0]), torch.linspace(1, -1, 1000)],
             [torch.tensor([second]), torch.linspace(-0.9, 0.9, 1000)]]
    ref, ref_opt = _torch_steps(name, params, grads, (), kwargs)
    ours, states = _native_steps(name, params, grads, (), kwargs)
    keys = {"AdamW": ["exp_avg", "exp_avg_sq"], "SGD": ["momentum_buffer"]}[name]
    for p, r, s in zip(ours, ref, states):
        assert _rel(p, r) <= 1e-6
        for key, mine in zip(keys, s):
            assert _rel(mine, ref_opt.state[r][key]) <= 1e-6, key


def test_a_pool_grown_by_another_step_still_runs_this_ones_shares(monkeypatch):
    """Two optimizers stepping at once from two threads: the second needs more threads and
    replaces the pool just as the first has taken it.  The first step's shares must still
    all run (not 'cannot schedule new futures after shutdown', with a half-written update
    and workers still writing after the step raised)."""
    class HookedLock:
        def __init__(self):
            self.inner, self.hook = threading.Lock(), None

        def __enter__(self):
            self.inner.acquire()

        def __exit__(self, *exc):
            self.inner.release()
            hook, self.hook = self.hook, None
            if hook is not None:
                hook()

    lock = HookedLock()
    monkeypatch.setattr(native, "_lock", lock)
    monkeypatch.setattr(native, "_pool", None)
    monkeypatch.setattr(native, "_pool_size", 0)
    monkeypatch.setattr(native, "_MIN_PER_THREAD", 1)
    done, other = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        lock.hook = lambda: native._run([(lambda a, b: other.append((a, b)), 4)])
        native._run([(lambda a, b: done.append((a, b)), 2)])
    finally:
        torch.set_num_threads(threads)
        if native._pool is not None:
            native._pool.shutdown(wait=True)
    assert sorted(done) == [(0, 1), (1, 2)]
    assert sorted(other) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_an_interrupted_build_is_tried_again(monkeypatch):
    """Ctrl-C during the first build (seconds, at the first optimizer's construction) is
    not 'cannot be built': the next optimizer builds it, rather than falling back to the
    slow kernels for good with no reason given."""
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_failure", "")
    real = native._build

    def interrupted():
        monkeypatch.setattr(native, "_build", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(native, "_build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        native.library()
    if shutil.which("cc") or shutil.which("gcc") or os.environ.get("CC"):
        assert native.library() is not None, native.unavailable_reason()
    else:
        assert native.library() is None and native.unavailable_reason()


def _compiler():
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or native.library() is None:
        pytest.skip(reason=f"no C compiler: {native.unavailable_reason()}")
    return cc


def test_cc_may_carry_arguments(monkeypatch, tmp_path):
    """CC='ccache gcc' (a command and its arguments, as make reads CC) builds."""
    monkeypatch.setenv("CC", f"env {_compiler()}")
    monkeypatch.setenv("ROUNDPIPE_CACHE_DIR", str(tmp_path))
    assert native._build() is not None


def test_a_corrupt_cached_library_is_rebuilt(monkeypatch, tmp_path):
    """A truncated library in the cache (a full disk, a copied home directory) is built
    again, not a reason to fall back for good."""
    monkeypatch.setenv("CC", _compiler())
    monkeypatch.setenv("ROUNDPIPE_CACHE_DIR", str(tmp_path / "first"))
    native._build()
    name = next((tmp_path / "first").iterdir()).name
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / name).write_bytes(b"\x7fELF truncated")
    monkeypatch.setenv("ROUNDPIPE_CACHE_DIR", str(tmp_path / "second"))
    lib = native._build()
    assert lib is not None and (tmp_path / "second" / name).stat().st_size > 1000


def test_an_unwritable_cache_directory_builds_elsewhere(monkeypatch, tmp_path):
    """A read-only home (no ~/.cache) still gets the native kernels, built privately."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CC", _compiler())
    monkeypatch.setenv("ROUNDPIPE_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path))  # not left in /tmp
    assert native._build() is not None
    assert [p.name.startswith("roundpipe-optim-") for p in tmp_path.iterdir()
            if p.is_dir()] == [True]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_steps(monkeypatch):
    """A process forked after a step (multiprocessing's default start on Linux) has none of
    the pool's threads: its step must not wait forever for them."""
    monkeypatch.setattr(native, "_MIN_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native._run([(lambda a, b: None, 4)])
        pid = os.fork()
        if pid == 0:  # the child: exit 0 once the step returns
            try:
                done = []
                native._run([(lambda a, b: done.append(b - a), 4)])
                os._exit(0 if sum(done) == 4 else 1)
            finally:
                os._exit(2)
        for _ in range(200):
            waited, status = os.waitpid(pid, os.WNOHANG)
            if waited:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's step did not return in 20 s")
    finally:
        torch.set_num_threads(threads)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@needs_lib
def test_a_nan_in_the_running_maximum_stays_as_torchs_maximum_keeps_it():
    """AMSGrad: a NaN already in max_exp_avg_sq propagates (torch.maximum), whichever
    side of the comparison it is on."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(40))]
    ref = [nn.Parameter(ours[0].detach().clone())]
    opt = roundpipe.optim.AdamW(ours, lr=1e-2, amsgrad=True, state_dtype=torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True, foreach=False)
    for step in range(2):
        g = torch.randn(40).to(torch.bfloat16).float()
        ours[0].grad, ref[0].grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        if step == 0:
            for o in (opt, ref_opt):
                state = next(iter(o.state.values()))
                state["max_exp_avg_sq"][3] = float("nan")
                state["exp_avg_sq"][7] = float("nan")
    assert torch.isnan(ours[0][3]) and torch.isnan(ref[0][3])
    assert torch.equal(torch.isnan(ours[0]), torch.isnan(ref[0]))


def test_capturable_is_refused_before_anything_is_written():
    p = nn.Parameter(torch.randn(5))
    opt = roundpipe.optim.AdamW([p], lr=1e-2, capturable=True, state_dtype=torch.bfloat16)
    p.grad = torch.randn(5)
    before = p.detach().clone()
    with pytest.raises(OptimizerError, match="capturable"):
        opt.step()
    assert torch.equal(p, before) and not opt.state
