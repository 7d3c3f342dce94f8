"""Module forward hooks: what the traced program carries (a changed output or input, a
buffer written in place, ``requires_grad`` switched on) trains as eager does; a hook that
keeps a tensor of the call for later (an activation stored in a list, a dict or on the
module) is refused before anything runs, since it would run once on tracing's fake tensors
and never on a real call."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from roundpipe import ModelError, RoundPipe, RoundPipeRunConfig


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    m[1].register_buffer("seen", torch.zeros(4))
    return m.double()


def _pipe(model: nn.Module, devices: int = 2) -> RoundPipe:
    return RoundPipe(model, devices=["cpu"] * devices, optim_dtype=None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))


STORE: dict[str, Callable] = {
    "append_output": lambda keep: lambda m, args, out: keep.append(out),
    "append_detached": lambda keep: lambda m, args, out: keep.append(out.detach()),
    "store_statistic": lambda keep: lambda m, args, out: keep.append(out.pow(2).mean()),
    "dict_of_outputs": lambda keep: lambda m, args, out: keep.__setitem__(0, out),
    "on_the_module": lambda keep: lambda m, args, out: setattr(m, "last", out.detach()),
}


@pytest.mark.parametrize("how", sorted(STORE))
@pytest.mark.parametrize("where", ["0", "1.1", ""])
def test_a_hook_that_keeps_an_activation_is_refused_before_running(how: str,
                                                                    where: str) -> None:
    # Before: the hook ran once while tracing (keeping a FakeTensor) and never again.
    model = _model()
    keep: list = [] if how != "dict_of_outputs" else {}  # type: ignore[assignment]
    hooked = model.get_submodule(where)
    handle = hooked.register_forward_hook(STORE[how](keep))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 4, dtype=torch.double)
    with pytest.raises(ModelError) as e, _pipe(model) as pipe:
        pipe.forward_backward(input_args=(x,), label=x, loss_fn=F.mse_loss)
    message = str(e.value)
    assert "forward hook" in message and "test_forward_hooks.py" in message
    assert (f"module '{where}'" if where else "the model itself") in message
    assert "Return what you need from forward" in message
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the user's hook is back in place, unwrapped
    assert hooked._forward_hooks[handle.id] is not None
    assert not hasattr(hooked._forward_hooks[handle.id], "__wrapped__")


def test_a_pre_hook_and_a_global_hook_that_keep_inputs_are_refused() -> None:
    model, keep = _model(), []
    model[2].register_forward_pre_hook(lambda m, args: keep.append(args[0]))
    with pytest.raises(ModelError, match="forward pre-hook .* on module '2'"), \
            _pipe(model) as pipe:
        pipe(torch.randn(4, 4, dtype=torch.double))
    model = _model()
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: keep.append(out) if isinstance(m, nn.Tanh) else None)
    try:
        with pytest.raises(ModelError, match="on a global module"), _pipe(model) as pipe:
            pipe(torch.randn(4, 4, dtype=torch.double))
    finally:
        handle.remove()


CARRIED: dict[str, Callable] = {
    # what the program carries: tensor work on the call's values and state
    "scaled_output": lambda m: m[1].register_forward_hook(lambda mod, a, out: out * 1.5),
    "scaled_input": lambda m: m[2].register_forward_pre_hook(lambda mod, a: (a[0] - 0.1,)),
    "buffer_write": lambda m: m[1].register_forward_hook(
        lambda mod, a, out: (mod.seen.mul_(0.5).add_(out.detach().mean(0)), None)[1]),
    # transformers' output recorders: inactive unless a collector is set (returns None)
    "inactive": lambda m: m[1].register_forward_hook(lambda mod, a, out: None),
    # enable_input_require_grads (transformers, PEFT)
    "requires_grad": lambda m: m[0].register_forward_hook(
        lambda mod, a, out: out.requires_grad_(True)),
    # on the model itself (export's call of the model packs its inputs: these hooks
    # were handed the packed tuple, and the changed input or output was dropped)
    "root_pre_hook": lambda m: m.register_forward_pre_hook(lambda mod, a: (a[0] * 2,)),
    "root_pre_hook_kwargs": lambda m: m.register_forward_pre_hook(
        lambda mod, a, kw: ((a[0] - 0.3,), kw), with_kwargs=True),
    "root_hook_kwargs": lambda m: m.register_forward_hook(
        lambda mod, a, kw, out: out * a[0].mean(), with_kwargs=True),
}


@pytest.mark.parametrize("how", sorted(CARRIED))
@pytest.mark.parametrize("devices", [1, 3])
def test_hooks_whose_work_is_traced_train_as_eager(how: str, devices: int) -> None:
    model = _model()
    CARRIED[how](model)
    x, y = torch.randn(4, 4, dtype=torch.double), torch.randn(4, 4, dtype=torch.double)
    eager = copy.deepcopy(model)
    want = [reference.eager_forward_backward(eager, (x,), {}, y, F.mse_loss, 2)
            for _ in range(2)]
    with _pipe(model, devices) as pipe:
        got = [pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
               for _ in range(2)]
        grads = {n: p.grad.clone() for n, p in pipe.optim_named_parameters()}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for n, p in eager.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-14, msg=n)
    for n, b in eager.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[n], b, rtol=1e-12,
                                   atol=1e-14, msg=n)


class _Branching(nn.Module):
    """Data-dependent Python: export fails inside it, and torch.fx could trace the model
    with the layer units kept opaque."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 1.5
        return torch.tanh(self.lin(x))


class _BranchingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Branching() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_hook_on_the_model_is_not_dropped_by_the_fx_fallback() -> None:
    """torch.fx traces the class's forward, without the hooks on the model: it is no longer
    used for such a model (export keeps the failing blocks opaque instead)."""
    torch.manual_seed(0)
    model = _BranchingNet().double()
    model.register_forward_pre_hook(lambda mod, a: (a[0] * 2,))
    x, y = torch.randn(4, 4, dtype=torch.double), torch.randn(4, 4, dtype=torch.double)
    eager = copy.deepcopy(model)
    want = reference.eager_forward_backward(eager, (x,), {}, y, F.mse_loss, 2)
    with _pipe(model) as pipe:
        got = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        grads = {n: p.grad.clone() for n, p in pipe.optim_named_parameters()}
        assert pipe.plan.program.trace_method == "export-leaves"
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for n, p in eager.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-14, msg=n)


def test_global_hooks_that_change_the_model_s_input_train_as_eager() -> None:
    """A global pre-hook changing the model's own input saw export's packed call at the
    model, and its change was dropped (loss 3e-3 off); it now runs on the call's inputs.
    A global hook on submodules still runs where they are called."""
    model = _model()
    eager = copy.deepcopy(model)
    roots = (model, eager)
    handles = [
        nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: (a[0] * 2,) if any(m is r for r in roots) else None),
        nn.modules.module.register_module_forward_hook(
            lambda m, a, out: out * 0.9 if isinstance(m, nn.Tanh) else None)]
    try:
        x, y = torch.randn(4, 4, dtype=torch.double), torch.randn(4, 4, dtype=torch.double)
        want = reference.eager_forward_backward(eager, (x,), {}, y, F.mse_loss, 2)
        with _pipe(model) as pipe:
            got = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
            grads = {n: p.grad.clone() for n, p in pipe.optim_named_parameters()}
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for n, p in eager.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-12, atol=1e-14, msg=n)
