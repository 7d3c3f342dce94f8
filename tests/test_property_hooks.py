"""The claim, held by a property test: whatever hook a user registers, of whatever kind, on
whatever module or parameter of the model, two training steps through
``pipe.forward_backward`` + ``pipe.step`` equal eager PyTorch's per-microbatch loop (losses,
weights, buffers, and every call a backward hook saw), bitwise alike on 1 and 3 devices;
or the first call raises a ``RoundPipeError`` before anything ran (weights, buffers and the
hooks' records untouched).  Nothing in between: a hook is never dropped or run a different
number of times.

Hook kinds: a tensor hook registered inside a forward (on a block's activation, or in the
model's own forward), a tensor hook on a parameter, a post-accumulate-grad hook on a
parameter, a module full backward hook, a forward pre-hook that scales the input, and a
forward hook that writes a buffer.  Hooks that return a value are not linear in the
gradient (a clamp), so applying them to a sum of microbatches instead of to each
contribution shows.  ``ROUNDPIPE_PROPERTY_EXAMPLES`` sets how many cases are drawn.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe import RoundPipe, RoundPipeError, RoundPipeRunConfig

WIDTH, BATCH, NUM_MB, STEPS = 6, 6, 2, 2
EXAMPLES = int(os.environ.get("ROUNDPIPE_PROPERTY_EXAMPLES", "6"))
KINDS = ("forward_tensor_hook", "param_tensor_hook", "post_accumulate_hook",
         "full_backward_hook", "forward_pre_hook", "forward_hook_buffer_write")


def _clamp(g: torch.Tensor) -> torch.Tensor:
    # Not linear in g: clamping each microbatch's contribution differs from clamping a sum.
    return g.clamp(-0.02, 0.02)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("seen", torch.zeros(WIDTH))
        self.activation_hook: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.activation_hook is not None and h.requires_grad:
            h.register_hook(self.activation_hook)
        return h + x


class Net(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("seen", torch.zeros(WIDTH))
        self.activation_hook: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.activation_hook is not None and x.requires_grad:
            x.register_hook(self.activation_hook)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _install(model: Net, kind: str, where: str, record: list) -> None:
    """Registers one hook of ``kind`` at ``where`` (a module path, '' for the model, or a
    parameter name); ``record`` collects what backward hooks saw, in call order."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    if kind == "forward_tensor_hook":
        def seen(g: torch.Tensor) -> torch.Tensor:
            record.append(("activation", g.detach().clone()))
            return _clamp(g)
        modules[where].activation_hook = seen
    elif kind == "param_tensor_hook":
        def on_grad(g: torch.Tensor, name: str = where) -> torch.Tensor:
            record.append((name, g.detach().clone()))
            return _clamp(g)
        params[where].register_hook(on_grad)
    elif kind == "post_accumulate_hook":
        def after(p: torch.Tensor, name: str = where) -> None:
            record.append((name, p.grad.detach().clone()))
        params[where].register_post_accumulate_grad_hook(after)
    elif kind == "full_backward_hook":
        def backward_hook(module: nn.Module, grad_in: tuple, grad_out: tuple) -> Any:
            record.append(("grad_out", grad_out[0].detach().clone()))
            return tuple(None if g is None else _clamp(g) for g in grad_in)
        modules[where].register_full_backward_hook(backward_hook)
    elif kind == "forward_pre_hook":
        modules[where].register_forward_pre_hook(lambda m, args: (args[0] * 1.5,))
    elif kind == "forward_hook_buffer_write":
        def write(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            with torch.no_grad():
                module.seen.mul_(0.5).add_(out.detach().mean((0, 1)))
        modules[where].register_forward_hook(write)
    else:  # pragma: no cover - the strategy draws from KINDS
        raise ValueError(kind)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in (*model.named_parameters(),
                                                *model.named_buffers())}


def _eager(model: Net, x: torch.Tensor, y: torch.Tensor, record: list) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        total = None
        for xs, ys in zip(x.chunk(NUM_MB), y.chunk(NUM_MB)):
            loss = _loss(model(xs), ys)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _pipe(model: Net, devices: int, grain: str, x: torch.Tensor, y: torch.Tensor
          ) -> list[torch.Tensor]:
    losses = []
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=None, seed=3,
                   model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB,
                                                       recompute_grain=grain)) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.5)
        for _ in range(STEPS):
            losses.append(pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss))
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        pipe.synchronize()
    return losses


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=what)


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, str, str, str, int]:
    depth = draw(st.integers(2, 4))
    kind = draw(st.sampled_from(KINDS))
    blocks = [f"blocks.{i}" for i in range(depth)]
    if kind in ("param_tensor_hook", "post_accumulate_hook"):
        where = draw(st.sampled_from(
            ["inp.weight", "head.bias"] + [f"{b}.lin.{w}" for b in blocks
                                           for w in ("weight", "bias")]))
    elif kind in ("forward_tensor_hook", "forward_hook_buffer_write"):
        where = draw(st.sampled_from([""] + blocks))
    else:
        where = draw(st.sampled_from(["", "inp", "head"] + blocks + [f"{b}.lin"
                                                                      for b in blocks]))
    grain = draw(st.sampled_from(["stage", "layer"]))
    return depth, kind, where, grain, draw(st.integers(0, 2**16))


def check(depth: int, kind: str, where: str, grain: str, seed: int) -> None:
    torch.manual_seed(seed)
    original = Net(depth).double()
    x = torch.randn(BATCH, 3, WIDTH, dtype=torch.double)
    y = torch.randn(BATCH, 3, WIDTH, dtype=torch.double)

    eager, eager_record = copy.deepcopy(original), []
    _install(eager, kind, where, eager_record)
    eager_losses = _eager(eager, x, y, eager_record)

    results = {}
    for devices in (1, 3):
        model, record = copy.deepcopy(original), []
        _install(model, kind, where, record)
        before = _state(model)
        try:
            losses = _pipe(model, devices, grain, x, y)
        except RoundPipeError:
            # Refused: before anything ran, so nothing changed and no hook fired.
            assert record == [], (kind, where, len(record))
            for name, t in _state(model).items():
                assert torch.equal(t, before[name]), (kind, where, name)
            results[devices] = "refused"
            continue
        assert len(record) == len(eager_record), (kind, where, len(record),
                                                  len(eager_record))
        for (tag, got), (eager_tag, want) in zip(record, eager_record):
            assert tag == eager_tag, (tag, eager_tag)
            _close(got, want, f"{kind} at {where!r}: what the hook saw ({tag})")
        for step, (got, want) in enumerate(zip(losses, eager_losses)):
            _close(got, want, f"{kind} at {where!r}: loss of step {step}")
        eager_state = _state(eager)
        for name, t in _state(model).items():
            _close(t, eager_state[name], f"{kind} at {where!r}: {name} after {STEPS} steps")
        results[devices] = (losses, _state(model), record)

    # Refused on one device count means refused on all, and the runs agree bitwise.
    assert (results[1] == "refused") == (results[3] == "refused"), (kind, where)
    if results[1] != "refused":
        for a, b in zip(results[1][0], results[3][0]):
            assert torch.equal(a, b), (kind, where, "loss differs across device counts")
        for name, t in results[1][1].items():
            assert torch.equal(t, results[3][1][name]), (kind, where, name)
        for (_, a), (_, b) in zip(results[1][2], results[3][2]):
            assert torch.equal(a, b), (kind, where, "a hook saw another gradient")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_any_hook_runs_as_eager_or_is_refused_before_running(case) -> None:
    check(*case)


@pytest.mark.parametrize("kind,where", [
    ("forward_tensor_hook", "blocks.1"), ("forward_tensor_hook", ""),
    ("param_tensor_hook", "blocks.0.lin.weight"), ("param_tensor_hook", "head.bias"),
    ("post_accumulate_hook", "blocks.1.lin.bias"), ("full_backward_hook", "blocks.0"),
    ("forward_pre_hook", "blocks.1"), ("forward_hook_buffer_write", "blocks.0")])
def test_each_hook_kind_once(kind: str, where: str) -> None:
    """Every kind once, deterministically, whatever hypothesis draws."""
    check(3, kind, where, "stage", 5)
