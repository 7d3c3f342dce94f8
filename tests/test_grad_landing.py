"""Gradients are converted to the masters' dtype while the backward goes on, so the commit
at the end of a call only assigns them: when it happens, what it waits for, and that the
results and failure semantics are those of the commit it replaces."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import models
from roundpipe import RoundPipe, RoundPipeRunConfig, StageError
from roundpipe.runtime.grad_landing import GradLanding

NUM_MB = 3


def _setup(devices: int = 1, layers: int = 4):
    torch.manual_seed(0)
    model, (idx,), kwargs = models.gpt(batch=6, layers=layers)
    labels = torch.randint(0, 64, idx.shape)
    # bf16 weights, fp32 masters: the conversion the commit used to do after the call
    model = model.to(torch.bfloat16)
    pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * devices,
                     optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB))
    args = dict(input_args=(idx,), input_kwargs=kwargs, label=labels, loss_fn=models.lm_loss)
    return pipe, args


class _Spy:
    """Records when each conversion was asked for and when it decided."""

    def __init__(self, monkeypatch):
        self.asked: list[float] = []
        self.first_ask = threading.Event()
        self.hosts: list[torch.Tensor] = []
        self.decided: list[tuple[float, bool]] = []
        self.futures: list = []
        original = GradLanding.convert_after
        spy = self

        def convert_after(landing, landed, host, dtype, steps=(), wanted=lambda: True,
                          key=None):
            spy.asked.append(time.perf_counter())
            spy.first_ask.set()
            spy.hosts.append(host)

            def recorded() -> bool:
                answer = wanted()
                spy.decided.append((time.perf_counter(), answer))
                return answer
            future = original(landing, landed, host, dtype, steps, recorded, key)
            spy.futures.append(future)
            return future
        monkeypatch.setattr(GradLanding, "convert_after", convert_after)


def _grads(pipe):
    return {n: p.grad.clone() for n, p in pipe.optim_named_parameters()}


def test_conversion_starts_before_the_last_microbatch_ends(monkeypatch):
    """Each unit's gradients are downloaded and converted once the last microbatch's
    backward has passed it, not when its job ends."""
    spy = _Spy(monkeypatch)
    pipe, args = _setup()
    pipe.forward_backward(**args)
    stats = pipe.stats()
    last = stats.timeline[-1]
    assert last.kind == "bwd" and len(last.microbatch_s) == NUM_MB
    start, stop = pipe.plan.stages[last.stage].units
    assert stop - start >= 2, "needs a job of several units"
    unit_of = {id(t): uid for (uid, _), kept in pipe._landing.buffers.items() for t in kept}
    asked = {}
    for t, host in zip(spy.asked, spy.hosts):
        asked.setdefault(unit_of[id(host)], []).append(t)
    last_mb_end = stats.started_at + last.microbatch_s[-1][1]
    early = [u for u in range(start + 1, stop) if u in asked and max(asked[u]) < last_mb_end]
    assert early, "the last job's gradients were converted only once it had finished"
    pipe.close()


def test_converted_gradients_become_grad_and_are_not_reused(monkeypatch):
    """The commit keeps the converted tensors; a later call writes fresh ones, so a
    gradient kept from an earlier step never changes under the caller."""
    spy = _Spy(monkeypatch)
    pipe, args = _setup()
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.0)
    pipe.forward_backward(**args)
    assert spy.decided and all(answer for _, answer in spy.decided)
    kept = {n: p.grad for n, p in pipe.optim_named_parameters()}
    values = {n: g.clone() for n, g in kept.items()}
    buffers = {t.untyped_storage().data_ptr() for kept in pipe._landing.buffers.values() for t in kept}
    assert all(g.dtype == torch.float32 for g in kept.values())
    assert not any(g.untyped_storage().data_ptr() in buffers for g in kept.values())
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
    args2 = dict(args, label=torch.randint(0, 64, args["label"].shape))
    pipe.forward_backward(**args2)
    pipe.synchronize()
    changed = 0
    for n, p in pipe.optim_named_parameters():
        assert torch.equal(kept[n], values[n])
        assert p.grad is not kept[n]
        changed += not torch.equal(p.grad, values[n])
    assert changed > 0
    pipe.close()


def test_same_gradients_as_the_commit_without_conversion():
    """Bitwise: converting early changes nothing, for a fresh .grad and when gradients
    accumulate across calls (where the download is added as before)."""
    pipe, args = _setup(devices=2)
    ref, _ = _setup(devices=2)
    ref._landing.close()  # the commit converts, as before
    for p in (pipe, ref):
        p.forward_backward(**args)
    first = _grads(pipe)
    assert all(torch.equal(first[n], g) for n, g in _grads(ref).items())
    for p in (pipe, ref):  # accumulate: no zero_grad in between
        p.forward_backward(**args)
    second = _grads(pipe)
    assert all(torch.equal(second[n], g) for n, g in _grads(ref).items())
    assert any(not torch.equal(second[n], first[n]) for n in first)
    pipe.close()
    ref.close()


def test_accumulating_across_calls_skips_the_copy(monkeypatch):
    """With a .grad to add to, a full-precision copy would only double the memory the
    commit needs: the download is added directly."""
    spy = _Spy(monkeypatch)
    pipe, args = _setup()
    pipe.forward_backward(**args)
    n_first = len(spy.decided)
    pipe.forward_backward(**args)
    assert n_first > 0 and len(spy.decided) == 2 * n_first
    assert all(answer for _, answer in spy.decided[:n_first])
    assert not any(answer for _, answer in spy.decided[n_first:])
    assert all(f.result() is not None for f in spy.futures[:n_first])
    assert all(f.result() is None for f in spy.futures[n_first:])
    pipe.close()


def test_conversions_wait_for_the_pending_step(monkeypatch):
    """The step reads the previous gradients and zero_grad frees them: converting the
    next call's gradients before it ends would hold two full sets on the host."""
    spy = _Spy(monkeypatch)
    pipe, args = _setup()
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
    pipe.forward_backward(**args)
    # (a pipe's first step is waited for until its optimizer has passed its check)
    pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    pipe.forward_backward(**args)
    step_end: list[float] = []

    def slow_step() -> None:
        # until the next call asks for its first conversion (a fixed sleep was not
        # always long enough on a loaded machine)
        spy.first_ask.wait(30)
        opt.step()
        opt.zero_grad()
        step_end.append(time.perf_counter())

    spy.first_ask.clear()
    pipe.step(slow_step, is_async=True)  # the next call overlaps it
    spy.decided.clear()
    spy.asked.clear()
    pipe.forward_backward(**args)
    assert spy.asked and min(spy.asked) < step_end[0], "the call did not overlap the step"
    assert all(t >= step_end[0] for t, _ in spy.decided)
    assert all(answer for _, answer in spy.decided)  # zero_grad freed the old gradients
    pipe.close()


def test_a_failed_conversion_fails_the_call_and_commits_nothing(monkeypatch):
    pipe, args = _setup()
    pipe.forward_backward(**args)
    before = _grads(pipe)
    original = GradLanding.convert_after
    calls = {"n": 0}

    def failing(landing, landed, host, dtype, steps=(), wanted=lambda: True, key=None):
        calls["n"] += 1
        if calls["n"] == 2:
            def boom() -> bool:
                raise MemoryError("host out of memory (injected)")
            return original(landing, landed, host, dtype, steps, boom, key)
        return original(landing, landed, host, dtype, steps, wanted, key)

    for p in pipe.optim_parameters():
        p.grad = None
    monkeypatch.setattr(GradLanding, "convert_after", failing)
    with pytest.raises((MemoryError, StageError), match="injected"):
        pipe.forward_backward(**args)
    assert all(p.grad is None for p in pipe.optim_parameters())
    monkeypatch.setattr(GradLanding, "convert_after", original)
    pipe.forward_backward(**args)
    assert all(torch.equal(before[n], g) for n, g in _grads(pipe).items())
    pipe.close()


def test_a_step_that_calls_the_pipe_does_not_wait_for_itself():
    """Inside a step_fn the pending step is the running one; its conversions must not
    wait for it (that would deadlock)."""
    pipe, args = _setup()
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
    pipe.forward_backward(**args)
    seen: list[torch.Tensor] = []

    def step_calling_the_pipe() -> None:
        opt.step()
        opt.zero_grad()
        seen.append(pipe.forward_backward(**args))

    done = threading.Event()
    pipe.step(step_calling_the_pipe)
    threading.Thread(target=lambda: (pipe.synchronize(), done.set()), daemon=True).start()
    assert done.wait(60), "the step and its call's conversions waited for each other"
    assert len(seen) == 1 and torch.isfinite(seen[0])
    pipe.close()


def test_memory_of_dropped_gradients_is_refilled_not_reallocated():
    """Once zero_grad dropped the last call's gradients and nothing else holds them, the
    next call converts into the same memory (fresh memory is page-faulted in: 5-7 times
    slower); a gradient the caller kept, or a view of one, is never written."""
    pipe, args = _setup()
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.0)
    pipe.forward_backward(**args)
    first = {n: p.grad.data_ptr() for n, p in pipe.optim_named_parameters()}
    names = list(first)
    kept_name, viewed_name = names[0], names[1]
    kept = dict(pipe.optim_named_parameters())[kept_name].grad
    viewed = dict(pipe.optim_named_parameters())[viewed_name].grad.view(-1)
    kept_value, viewed_value = kept.clone(), viewed.clone()
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
    args2 = dict(args, label=torch.randint(0, 64, args["label"].shape))
    pipe.forward_backward(**args2)
    pipe.synchronize()
    second = {n: p.grad.data_ptr() for n, p in pipe.optim_named_parameters()}
    reused = [n for n in names if second[n] == first[n]]
    assert set(names) - set(reused) == {kept_name, viewed_name}
    assert torch.equal(kept, kept_value) and torch.equal(viewed, viewed_value)
    pipe.close()


def test_what_is_kept_between_calls_is_at_most_one_gradient_set():
    """Only parameters read by one unit are converted early (a tied or shared parameter's
    contributions are summed into a new tensor by the commit anyway), and a parameter no
    longer trained drops what was kept for it."""
    pipe, args = _setup(devices=2)
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.0)
    pipe.forward_backward(**args)
    pipe.synchronize()
    program = pipe.plan.program
    readers = {}
    for unit in program.units:
        for slot in unit.state:
            readers[slot] = readers.get(slot, 0) + 1
    shared = {s for s, n in readers.items() if n > 1}
    assert shared, "the GPT's tied embedding is read by two units"
    kept = dict(pipe._landing._spare)
    assert kept and not any(slot in shared for _, slot in kept)
    one_set = sum(p.numel() * 4 for p in pipe.optim_parameters())
    assert sum(t.numel() * t.element_size() for t in kept.values()) <= one_set
    # freeze one parameter: what was kept for it goes with the next call
    frozen = next(iter(kept))[1]
    fqn = program.state_by_name()[frozen].fqn
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
    pipe.synchronize()
    pipe.model.get_parameter(fqn).requires_grad_(False)
    pipe.forward_backward(**args)
    pipe.synchronize()
    pipe._landing._pool.submit(lambda: None).result()  # pruning runs on that thread
    assert any(slot == frozen for _, slot in kept)
    assert pipe._landing._spare and not any(slot == frozen for _, slot in pipe._landing._spare)
    pipe.close()


def test_auto_landing_reads_a_containers_memory_limit(tmp_path, monkeypatch):
    """Inside a container /proc/meminfo shows the whole machine: "auto" must compare
    with the cgroup's limit and headroom where they are smaller."""
    from roundpipe.runtime import grad_landing
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{8 * 2**30}\n")
    usage.write_text(f"{7 * 2**30}\n")
    monkeypatch.setattr(grad_landing, "_CGROUP_FILES", ((str(limit), str(usage)),))
    monkeypatch.setattr(grad_landing, "_MEMORY_CACHE", [0.0, None])
    total, available = grad_landing._host_memory()
    assert (total, available) == (8 * 2**30, 2**30)
    assert grad_landing._affordable(2**20)          # 1023 MiB left of 8 GiB: > 10%
    monkeypatch.setattr(grad_landing, "_MEMORY_CACHE", [0.0, None])
    assert not grad_landing._affordable(300 * 2**20)  # 724 MiB left: < 10%
    limit.write_text("max\n")  # no limit: the machine's figures
    monkeypatch.setattr(grad_landing, "_MEMORY_CACHE", [0.0, None])
    assert grad_landing._host_memory()[0] != 8 * 2**30
