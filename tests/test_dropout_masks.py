"""Dropout masks are fresh where eager's would be: different between the microbatches of
a call, between two dropout layers, between calls and between training steps, under
both front ends (``RoundPipe``: ``pipe(x)`` and ``forward_backward``; and
``torch.compile(backend="roundpipe")``).  The masks are read off the outputs and
compared with each other, not with roundpipe's own earlier run; the same seed and call
give the same masks, and forward and backward use the one mask eager would need to
give these outputs and gradients.

Issue 33: a backend that reused its first call's dropout keys for every call (two
training steps drew the same masks) passed the suite, whose dropout tests only compared
roundpipe with itself.

Every sample is the same row, so masks are the only thing telling samples apart: the
mask of sample k in microbatch i is compared with that of sample k in microbatch j.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb

WIDTH, MB_ROWS, MICROBATCHES, P = 64, 2, 3, 0.25
BATCH = MB_ROWS * MICROBATCHES


class DropUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(P)

    def forward(self, h):
        return self.drop(self.lin(h))


class TwoDropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = DropUnit()
        self.b = DropUnit()

    def forward(self, x):
        h = self.a(x)
        return torch.stack([h, self.b(h)], dim=1)  # (batch, unit, width)


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _model():
    torch.manual_seed(0)
    model = TwoDropouts().train()
    x = torch.randn(1, WIDTH).expand(BATCH, WIDTH).clone()  # every sample the same
    return model, x


def _masks(out: torch.Tensor) -> torch.Tensor:
    """(batch, unit, width) bool: which elements each unit kept (a linear layer's
    output is never exactly 0, so a 0 is a dropped element)."""
    return out.detach() != 0


def _replay(model: TwoDropouts, x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Eager with the given masks in place of the dropout layers."""
    h = model.a.lin(x) * masks[:, 0] / (1 - P)
    return torch.stack([h, model.b.lin(h) * masks[:, 1] / (1 - P)], dim=1)


def _check_fresh(calls: list[torch.Tensor]) -> None:
    """Masks of every call of ``calls`` ((batch, unit, width) each) are fresh draws."""
    for masks in calls:
        kept = masks.double().mean().item()
        assert abs(kept - (1 - P)) < 0.1, f"{kept:.2f} of the elements kept, p={P}"
        # the two units draw different masks for the same sample
        assert all(not torch.equal(m[0], m[1]) for m in masks), "units share a mask"
        mbs = masks.reshape(MICROBATCHES, MB_ROWS, 2, WIDTH)
        for i, j in itertools.combinations(range(MICROBATCHES), 2):
            for k in range(MB_ROWS):  # sample k of microbatch i and of microbatch j
                assert not torch.equal(mbs[i, k], mbs[j, k]), \
                    f"microbatches {i} and {j} drew the same mask"
    for (i, a), (j, b) in itertools.combinations(enumerate(calls), 2):
        for k in range(BATCH):
            assert not torch.equal(a[k], b[k]), f"calls {i} and {j} drew the same mask"


def _check_exact(model, x, out, weight) -> None:
    """``out`` and the gradients of (out * weight).sum() are eager's with out's masks:
    the forward and the backward (recompute included) drew the same mask."""
    masks = _masks(out)
    eager = copy.deepcopy(model)
    for p in eager.parameters():
        p.grad = None
    want = _replay(eager, x, masks)
    torch.testing.assert_close(out.detach(), want.detach(), rtol=1e-10, atol=1e-10)
    (out * weight).sum().backward()
    (want * weight).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)


def _pipe(model, devices=2, seed=None, grain="stage"):
    return RoundPipe(model, devices=["cpu"] * devices, seed=seed,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES,
                                                         recompute_grain=grain))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_pipe_call_masks_are_fresh_and_exact(grain):
    model, x = _model()
    weight = torch.randn(BATCH, 2, WIDTH)
    calls = []
    with _pipe(model, grain=grain) as pipe:
        for _ in range(3):
            for p in model.parameters():
                p.grad = None
            out = pipe(x)
            _check_exact(model, x, out, weight)
            calls.append(_masks(out))
    _check_fresh(calls)


def test_forward_backward_masks_are_fresh_between_microbatches_and_steps():
    model, x = _model()
    seen: list[torch.Tensor] = []

    def loss_fn(out, label):
        seen.append(out.detach())
        return (out * label).sum()

    calls = []
    with _pipe(model) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
        for _ in range(3):
            seen.clear()
            pipe.forward_backward(input_args=(x,), label=torch.ones(BATCH, 2, WIDTH),
                                  loss_fn=loss_fn)
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            assert len(seen) == MICROBATCHES
            calls.append(_masks(torch.cat(seen)))
    _check_fresh(calls)


def test_the_same_seed_and_call_give_the_same_masks_on_any_device_count():
    runs = {}
    for devices, seed in ((1, 7), (3, 7), (2, 8)):
        model, x = _model()
        with torch.no_grad(), _pipe(model, devices=devices, seed=seed) as pipe:
            runs[devices, seed] = [_masks(pipe(x)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(runs[1, 7], runs[3, 7]))
    assert not any(torch.equal(a, b) for a, b in zip(runs[1, 7], runs[2, 8]))


def test_backend_masks_are_fresh_between_microbatches_calls_and_steps():
    model, x = _model()
    weight = torch.randn(BATCH, 2, WIDTH)
    backend = rb.RoundPipeBackend(devices=["cpu"] * 2, num_microbatch=MICROBATCHES)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    calls = []
    for _ in range(3):  # training steps: forward, backward, optimizer step
        opt.zero_grad(set_to_none=True)
        out = compiled(x)
        assert max(j.microbatches for j in backend.stats().timeline) == MICROBATCHES
        _check_exact(model, x, out, weight)
        calls.append(_masks(out))
        opt.step()
    with torch.no_grad():  # and calls without a backward
        calls += [_masks(compiled(x)) for _ in range(2)]
    _check_fresh(calls)


def test_backend_same_seed_gives_the_same_masks():
    runs = []
    for seed in (7, 7, 8):
        model, x = _model()
        backend = rb.RoundPipeBackend(devices=["cpu"] * 2, num_microbatch=MICROBATCHES,
                                      seed=seed)
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            runs.append([_masks(compiled(x)) for _ in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not any(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))


@pytest.mark.parametrize("op", ["dropout", "native_dropout"])
def test_keyed_ops_scale_and_key_like_aten(op):
    """The keyed replacements of ``aten.dropout`` and ``aten.native_dropout`` (which
    graphs hold depends on how they were traced) keep 1-p of the elements scaled by
    1/(1-p), as aten's own ops do, and draw by key: the same key the same mask, another
    microbatch, call or unit another."""
    from roundpipe.ops import rng

    x = torch.rand(BATCH, WIDTH) + 0.5  # never 0

    def draw(key, unit=0):
        out = getattr(rng, op)(x, P, True, key, unit, 0)
        if op == "native_dropout":
            out, mask = out
            assert torch.equal(mask, out != 0)
        return out

    key = rng.RngKey(seed=3, call=1, microbatch=0)
    out = draw(key)
    keep = out != 0
    assert abs(keep.double().mean().item() - (1 - P)) < 0.1
    torch.testing.assert_close(out, x * keep / (1 - P), rtol=0, atol=1e-12)
    aten = torch.ops.aten.native_dropout.default(x, P, True)[0]
    torch.testing.assert_close(aten, x * (aten != 0) / (1 - P), rtol=0, atol=1e-12)
    assert torch.equal(draw(key), out)
    for other in (rng.RngKey(3, 1, 1), rng.RngKey(3, 2, 0), rng.RngKey(4, 1, 0)):
        assert not torch.equal(draw(other) != 0, keep)
    assert not torch.equal(draw(key, unit=1) != 0, keep)


def test_a_resumed_run_draws_the_masks_the_uninterrupted_run_draws(tmp_path):
    """The call number is saved with the checkpoint: after a resume the next step draws
    the masks the uninterrupted run draws at that step, not those of step 1 again."""
    from roundpipe import load_checkpoint, save_checkpoint

    def run(pipe, opt):
        seen = []

        def loss_fn(out, label):
            seen.append(out.detach())
            return (out * label).sum()
        pipe.forward_backward(input_args=(x,), label=torch.ones(BATCH, 2, WIDTH),
                              loss_fn=loss_fn)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        return _masks(torch.cat(seen))

    model, x = _model()
    fresh = copy.deepcopy(model)
    path = str(tmp_path / "ck.pt")
    with _pipe(model, seed=5) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
        first = [run(pipe, opt) for _ in range(2)]
        save_checkpoint(path, pipe, opt)
        third = run(pipe, opt)
    with _pipe(fresh, seed=6) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
        load_checkpoint(path, pipe, opt)
        resumed = run(pipe, opt)
    assert torch.equal(resumed, third)
    assert not any(torch.equal(resumed, m) for m in first)
