"""With masters, a write through ``p.data`` (its own version counter) is found by value
(``ModelState.edited_weights``), but only for weights whose ``.data`` was taken since
roundpipe last wrote them, or whose earlier ``.data`` alias is still alive
(``roundpipe.runtime.data_reads``): comparing every weight with its master at every step
costs several times the step (~5 ns an element against ~1 ns for the whole update)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import roundpipe.runtime.host_state as host_state
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.runtime import data_reads

NMB = 2


def _model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
                                     for _ in range(3)]).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randn(4, 6, generator=g, dtype=torch.float64))


def _eager_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    for xm, ym in zip(x.chunk(NMB), y.chunk(NMB)):
        F.mse_loss(model(xm), ym).backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The weights compared by value, in order."""
    seen: list[torch.Tensor] = []
    original = host_state._same_bits

    def counting(param: torch.Tensor, master: torch.Tensor) -> bool:
        seen.append(param)
        return original(param, master)

    monkeypatch.setattr(host_state, "_same_bits", counting)
    return seen


def test_steps_without_data_reads_compare_no_weight(compared: list[torch.Tensor]) -> None:
    model = _model()
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        pipe.step(opt)
        pipe.synchronize()
    assert compared == []
    # one weight's .data read: that weight alone is compared at the next step
    norm = model[1][0].weight.data.norm()
    assert norm > 0
    x, y = _batch(3)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    pipe.step(opt)
    assert [id(p) for p in compared] == [id(model[1][0].weight)]
    pipe.close()


def test_a_data_alias_kept_from_before_is_still_watched(compared: list[torch.Tensor]) -> None:
    """``w = p.data`` taken once, before training, and written after later steps (a
    clipping helper holding its aliases): the write reaches the master as in eager."""
    ref, tst = _model(), _model()
    pipe = RoundPipe(tst, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    ref_alias = [p.data for p in ref.parameters()]
    tst_alias = [p.data for p in tst.parameters()]  # taken before any step
    ro = torch.optim.SGD(ref.parameters(), lr=0.5)
    to = torch.optim.SGD(pipe.optim_parameters(), lr=0.5)
    for step in range(3):
        _eager_step(ref, ro, step)
        x, y = _batch(step)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        pipe.step(to)
        pipe.synchronize()
        for a in (*ref_alias, *tst_alias):
            a.clamp_(-0.1, 0.1)
    pipe.synchronize()
    for (name, p), q in zip(ref.named_parameters(), tst.parameters()):
        assert torch.equal(p, q), name
    for name, master in pipe.optim_named_parameters():
        assert torch.equal(master, ref.get_parameter(name)), name
    assert compared  # the live aliases' weights were compared
    pipe.close()


def test_the_watch_is_torchs_own_data() -> None:
    """Reading and assigning ``.data`` behaves as torch's descriptor does."""
    data_reads.watch()
    p = torch.nn.Parameter(torch.randn(3))
    alias = p.data
    assert type(alias) is torch.Tensor and not alias.requires_grad
    assert alias.data_ptr() == p.data_ptr()
    alias.add_(1.0)
    assert torch.equal(p.detach(), alias)
    new = torch.zeros(3)
    p.data = new
    assert p.data_ptr() == new.data_ptr() and isinstance(p, torch.nn.Parameter)
    tick = data_reads.now()
    del alias
    assert not data_reads.taken_since(p, tick)
    _ = p.data.sum()  # a read after the tick, its alias dead
    assert data_reads.taken_since(p, tick)
