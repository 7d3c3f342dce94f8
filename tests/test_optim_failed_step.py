"""A step that fails after roundpipe.optim allocated its state, in torch's step on the
parameters it leaves to torch (their own state allocation ran out of host memory, say),
must leave the optimizer as before: the buffers it made are dropped, so the retried step
is a first step (SGD's buffer = the gradient, not momentum * 0 + (1 - dampening) * grad,
0.05 off before)."""

from __future__ import annotations

import pytest
import torch

from roundpipe.optim import SGD, AdamW


@pytest.mark.parametrize("cls, kwargs, ref_cls", [
    (SGD, dict(lr=0.1, momentum=0.9, dampening=0.5), torch.optim.SGD),
    (AdamW, dict(lr=0.1), torch.optim.AdamW),
])
def test_a_step_failing_in_torchs_step_keeps_no_state_and_retries_as_the_first(
        cls, kwargs, ref_cls) -> None:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))  # roundpipe's kernel
    c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex128))  # torch's step
    ref_a, ref_c = (torch.nn.Parameter(t.detach().clone()) for t in (a, c))
    opt = cls([a, c], state_dtype=torch.float64, **kwargs)
    ref = ref_cls([ref_a, ref_c], **kwargs)
    torch_step = opt._torch_step_without

    def fails_once(mine):
        opt._torch_step_without = torch_step
        raise MemoryError("torch's step could not allocate its state")

    opt._torch_step_without = fails_once
    for p in (a, c, ref_a, ref_c):
        p.grad = torch.ones_like(p)
    with pytest.raises(MemoryError):
        opt.step()
    assert opt.state_dict()["state"] == {}
    for _ in range(3):
        opt.step()
        ref.step()
    torch.testing.assert_close(a, ref_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c, ref_c, rtol=1e-12, atol=1e-12)


def test_sgd_without_momentum_keeps_no_empty_state_entries() -> None:
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = SGD([p], lr=0.1, state_dtype=torch.float64)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_dict()["state"] == {}  # as torch.optim.SGD's


def test_a_step_fn_raising_before_any_write_leaves_fp32_masters_bitwise() -> None:
    """The masters of a bf16 model are fp32: a step_fn that raises before the optimizer
    wrote anything must leave them exactly as they were (they were reset from the bf16
    weights, losing their low bits), and one that raises after writing must still put
    the written ones back."""
    import torch.nn.functional as F
    from roundpipe import RoundPipe, StepError
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                  for _ in range(3))).to(torch.bfloat16)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32) as pipe:
        opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
        x = torch.randn(6, 8).to(torch.bfloat16)

        def fb():
            pipe.forward_backward(input_args=(x,), label=x,
                                  loss_fn=lambda o, t: F.mse_loss(o.float(), t.float()))
        for _ in range(2):
            fb()
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
        masters = dict(pipe.optim_named_parameters())
        # the check can fail: the masters hold more than their bf16 rounding
        assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())
        before = {n: m.detach().clone() for n, m in masters.items()}
        fb()

        def raise_first():
            raise RuntimeError("before the optimizer")
        with pytest.raises(StepError):
            pipe.step(raise_first)
        for n, m in masters.items():
            assert torch.equal(m, before[n]), n

        def raise_after():
            opt.step()
            raise RuntimeError("after the optimizer")
        with pytest.raises(StepError):
            pipe.step(raise_after)
        for n, m in masters.items():  # written: back to the published weights
            assert torch.equal(m, model.get_parameter(n).float()), n
