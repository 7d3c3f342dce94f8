"""A ``forward_backward`` call that fails changes nothing, also when ``loss_fn`` reads a
model parameter (a regularizer ``1e-2 * w.pow(2).sum()``, a learned temperature
``out / temp``).

Before, ``loss_fn``'s backward (on the fused tail's device thread) let autograd add that
part of the gradient straight into the parameter's ``.grad`` each microbatch; a later
microbatch that failed (``loss_fn`` raising, a NaN loss, a stage raising in its forward
or backward) left the earlier microbatches' share there, where the optimizer (or, with
masters, the fold at the next step) took it: the temperature's ``.grad`` read 56.67 after
a failed call.  Now the call holds that part (joined into the gradient of the last unit
reading the parameter, or, for a parameter no unit reads, committed with the call), so a
failure drops it with the call's other gradients.

The class: loss_fn raises / NaN loss / a stage's forward raises / a stage's backward
raises, each in microbatch 1 of 3, x ``optim_dtype`` masters or none x the parameter read
by ``loss_fn`` only / by a unit too x no gradient held before / gradients held from an
earlier call: every ``.grad`` (parameters and masters), weight, master and buffer is
bitwise what it was, and the next call matches eager's per-microbatch loop in float64.
Also ``step=opt``, a GradScaler, float32 against eager, and data parallelism (the
``loss_fn`` part was not all-reduced: each replica kept its own)."""

from __future__ import annotations

import os
import socket
import textwrap

import pytest
import torch
import torch.nn as nn

import roundpipe.optim
from roundpipe import GradScaler, LossError, RoundPipe, RoundPipeRunConfig, StageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 3
TOL = dict(rtol=1e-10, atol=1e-12)


class Net(nn.Module):
    """A BatchNorm (buffers the forward writes), three blocks; ``temp`` is read by no
    layer, only by loss_fn (a learned temperature)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.temp = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def make(seed: int = 0) -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return Net(), torch.randn(6, 6), torch.randn(6, 6)


def loss_for(model: Net, read: str):
    """``read="loss_only"``: loss_fn reads temp (no unit does); ``"unit"``: also the
    first block's weight (a regularizer on a parameter a unit reads)."""
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((out / model.temp - y) ** 2).sum()
        if read == "unit":
            loss = loss + 1e-2 * model.blocks[0].weight.pow(2).sum()
        return loss
    return loss_fn


def eager(model: Net, x, y, read: str) -> None:
    loss_fn = loss_for(model, read)
    for xs, ys in zip(x.chunk(MB), y.chunk(MB)):
        loss_fn(model(xs), ys).backward()


def snapshot(pipe: RoundPipe) -> dict[str, object]:
    def grad(p):
        return None if p.grad is None else p.grad.detach().clone()
    model = pipe.model
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: grad(p) for n, p in model.named_parameters()},
            "masters": [m.detach().clone() for m in pipe.optim_parameters()],
            "master_grads": [grad(m) for m in pipe.optim_parameters()],
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def assert_same(got: dict[str, object], want: dict[str, object]) -> None:
    """Bitwise equal, None where None."""
    for key in want:
        a, b = got[key], want[key]
        pairs = a.items() if isinstance(a, dict) else enumerate(a)
        for name, t in pairs:
            w = b[name]
            assert (t is None) == (w is None), f"{key}[{name}]: {t} != {w}"
            if t is not None:
                assert torch.equal(t, w), \
                    f"{key}[{name}] changed by {(t - w).abs().max().item():.3g}"


class Fail:
    """Makes microbatch 1 of the next call fail: ``how`` in loss_fn raises / nan / a
    stage's forward / a stage's backward."""

    def __init__(self, pipe: RoundPipe, how: str) -> None:
        self.pipe, self.how, self.count = pipe, how, 0
        self.unit = None

    def loss_fn(self, inner):
        if self.how not in ("loss_fn", "nan"):
            return inner

        def loss_fn(out, y):
            mb, self.count = self.count, self.count + 1
            if mb == 1 and self.how == "loss_fn":
                raise RuntimeError("loss_fn fails on microbatch 1")
            loss = inner(out, y)
            return loss * float("nan") if mb == 1 else loss
        return loss_fn

    def __enter__(self) -> Fail:
        if self.how not in ("forward", "backward"):
            return self
        plan = self.pipe.plan
        # forward: a unit of the fused job (microbatch 0's loss tail ran before it);
        # backward: the first stage's (every earlier loss backward ran before it)
        stage = plan.fused_stage if self.how == "forward" else plan.backward_stages[-1]
        self.unit = plan.program.units[stage.units[0]]
        original = self.unit.module.forward
        count = {"n": 0}

        def failing(*args):
            if torch.is_grad_enabled():  # the fused job's forward, the recompute
                mb, count["n"] = count["n"], count["n"] + 1
                if mb == 1 and self.how == "forward":
                    raise RuntimeError("a stage fails on microbatch 1")
                if mb == 1:
                    return tuple(_RaiseInBackward.apply(o) if o.requires_grad else o
                                 for o in original(*args))
            return original(*args)
        self.unit.module.forward = failing
        return self

    def __exit__(self, *exc) -> None:
        if self.unit is not None:
            del self.unit.module.forward

    @property
    def error(self) -> type[Exception]:
        return LossError if self.how == "nan" else StageError


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a stage's backward fails on microbatch 1")


@pytest.mark.parametrize("held", [False, True], ids=["fresh", "held"])
@pytest.mark.parametrize("read", ["loss_only", "unit"])
@pytest.mark.parametrize("masters", [None, torch.float64], ids=["params", "masters"])
@pytest.mark.parametrize("how", ["loss_fn", "nan", "forward", "backward"])
def test_a_failed_call_leaves_every_gradient_weight_and_buffer_as_it_was(
        how, masters, read, held) -> None:
    model, x, y = make()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=masters,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    try:
        loss_fn = loss_for(model, read)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)  # compiles
        eager(ref, x, y, read)
        pipe.synchronize()
        if not held:
            for p in [*pipe.optim_parameters(), *model.parameters(), *ref.parameters()]:
                p.grad = None
        before = snapshot(pipe)
        with Fail(pipe, how) as fail:
            with pytest.raises(fail.error):
                pipe.forward_backward(input_args=(x,), label=y, loss_fn=fail.loss_fn(loss_fn))
        assert_same(snapshot(pipe), before)
        # the next call is the eager loop's next microbatches
        x2, y2 = torch.randn(6, 6), torch.randn(6, 6)
        pipe.forward_backward(input_args=(x2,), label=y2, loss_fn=loss_fn)
        eager(ref, x2, y2, read)
        pipe.synchronize()
        got = dict(zip((n for n, p in model.named_parameters() if p.requires_grad),
                       pipe.optim_parameters()))
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name].grad, p.grad, **TOL, msg=name)
            if masters is not None:  # the pipe's gradients land on the masters
                assert model.get_parameter(name).grad is None, name
        for name, b in ref.named_buffers():
            torch.testing.assert_close(model.get_buffer(name), b, **TOL, msg=name)
    finally:
        pipe.close()


@pytest.mark.parametrize("how", ["loss_fn", "nan"])
def test_a_failed_landing_step_leaves_no_gradient_and_the_next_step_is_exact(how) -> None:
    """forward_backward(step=opt): a failure before any unit was updated (every loss is
    in and finite first) changes nothing; loss_fn's part of the failed call does not
    reach the next step (before, it
    stayed on the parameters and the next call stepped it, after the call instead of as
    gradients landed)."""
    def run(fail: str | None):
        model, x, y = make()
        pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                         model_run_config=RoundPipeRunConfig(num_microbatch=MB))
        try:
            opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
            loss_fn = loss_for(model, "unit")
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, step=opt)
            if fail is not None:
                before = snapshot(pipe)
                with Fail(pipe, fail) as f:
                    with pytest.raises(f.error):
                        pipe.forward_backward(input_args=(x,), label=y,
                                              loss_fn=f.loss_fn(loss_fn), step=opt)
                assert_same(snapshot(pipe), before)
            assert pipe.landing_step(opt) == "as gradients land"
            pipe.forward_backward(input_args=(y,), label=x, loss_fn=loss_fn, step=opt)
            pipe.synchronize()
            return snapshot(pipe)
        finally:
            pipe.close()
    assert_same(run(how), run(None))


def test_a_failed_call_under_a_grad_scaler_changes_nothing() -> None:
    model, x, y = make()
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    try:
        scaler = GradScaler(pipe, init_scale=4.0)
        inner = loss_for(model, "unit")

        def loss_fn(out, t):
            return scaler.scale(inner(out, t))
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        before = snapshot(pipe)
        with Fail(pipe, "loss_fn") as fail:
            with pytest.raises(fail.error):
                pipe.forward_backward(input_args=(x,), label=y, loss_fn=fail.loss_fn(loss_fn))
        assert_same(snapshot(pipe), before)
        assert model.temp.grad is None and model.blocks[0].weight.grad is None
    finally:
        pipe.close()


@pytest.mark.parametrize("how", ["loss_fn", "backward"])
def test_float32_gradients_around_a_failed_call_match_eager(how) -> None:
    """Two calls with a failed one between them against eager's two calls, in float32:
    the join changes where loss_fn's part is added (inside the unit's backward, as
    eager's one backward adds it), within 1e-6 of eager."""
    torch.set_default_dtype(torch.float32)
    model, x, y = make(3)
    ref = Net()
    ref.load_state_dict(model.state_dict())
    pipe = RoundPipe(model, devices=["cpu"] * 3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    try:
        loss_fn = loss_for(model, "unit")
        for call in range(2):
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            eager(ref, x, y, "unit")
            if call == 0:
                with Fail(pipe, how) as fail:
                    with pytest.raises(fail.error):
                        pipe.forward_backward(input_args=(y,), label=x,
                                              loss_fn=fail.loss_fn(loss_fn))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)
    finally:
        pipe.close()


# --- data parallel ---------------------------------------------------------------------------

_WORKER = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [{root!r}, {tests!r}]
    import roundpipe
    from roundpipe import DataParallelConfig, RoundPipe, RoundPipeRunConfig
    import test_loss_fn_param_failure as t
    torch.set_default_dtype(torch.float64)
    rank = int(sys.argv[1])
    model, x, y = t.make()
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype={masters},
                     data_parallel=DataParallelConfig(reduction="sum"),
                     model_run_config=RoundPipeRunConfig(num_microbatch=1))
    loss_fn = t.loss_for(model, "unit")
    pipe.forward_backward(input_args=(x[3 * rank:3 * rank + 3],),
                          label=y[3 * rank:3 * rank + 3], loss_fn=loss_fn)
    pipe.synchronize()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    torch.save({{n: m.grad for n, m in zip(names, pipe.optim_parameters())}}, sys.argv[2])
    pipe.close()
""")


@pytest.mark.parametrize("masters", [None, torch.float64], ids=["params", "masters"])
def test_data_parallel_reduces_loss_fn_part_like_the_rest(masters, forkserver,
                                                          tmp_path) -> None:
    """Two replicas with one microbatch each (summed) are bitwise one process with two
    microbatches (tests/test_data_parallel.py says why); before, the loss_fn part of a
    parameter's gradient stayed on each replica's own parameter, not reduced."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=ROOT, tests=os.path.join(ROOT, "tests"),
                                     masters=repr(masters)))
    children = []  # both ranks at once, fresh processes (forked: tests/forkserver.py)
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        children.append(forkserver.start(str(script), [str(rank), str(tmp_path / f"{rank}.pt")],
                                         env=env, cwd=ROOT, merge_stderr=True))
    try:
        for child in children:
            result = child.wait()
            assert result.returncode == 0, result.stdout[-3000:]
    finally:
        for child in children:  # a rank that failed or hung leaves its peer waiting
            child.kill()
    replicas = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]

    model, x, y = make()
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=masters, data_parallel=False,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    try:
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_for(model, "unit"))
        pipe.synchronize()
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        want = dict(zip(names, (m.grad for m in pipe.optim_parameters())))
    finally:
        pipe.close()
    for got in replicas:
        for name in names:
            assert torch.equal(got[name], want[name]), \
                f"{name}: off by {(got[name] - want[name]).abs().max().item():.3g}"


def test_a_tensor_of_loss_fn_own_still_gets_its_gradient_from_autograd() -> None:
    """A parameter outside the model (a criterion's own weight) that loss_fn reads with a
    model parameter: autograd accumulates its gradient during the call, as in eager
    (roundpipe holds only the pipe's parameters' part)."""
    model, x, y = make()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    own = nn.Parameter(torch.tensor(0.7))
    own_ref = nn.Parameter(torch.tensor(0.7))

    def loss_with(m: Net, w: nn.Parameter):
        inner = loss_for(m, "unit")
        return lambda out, t: inner(out, t) * w
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    try:
        for _ in range(2):
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_with(model, own))
            for xs, ys in zip(x.chunk(MB), y.chunk(MB)):
                loss_with(ref, own_ref)(ref(xs), ys).backward()
        torch.testing.assert_close(own.grad, own_ref.grad, **TOL)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    finally:
        pipe.close()


@pytest.mark.parametrize("read", ["unit", "loss_only"])
def test_loss_fn_part_crosses_jobs_through_the_host(read, monkeypatch) -> None:
    """loss_fn's part of a parameter's gradient leaves the fused job as every gradient
    crossing jobs does: downloaded there and uploaded by the job that joins it (or kept
    on the host for the commit), never a device tensor of the fused job uploaded by
    another job's loader. On a GPU such an upload copies on the loader's stream, which
    does not wait for the compute stream still writing the gradient (and the caching
    allocator may reuse its block): a silently wrong gradient. On the virtual CPU
    devices the ledgers of measure_memory tell a device's tensors apart. Before, the
    first block's weight (read last by the first stage, a backward job on another
    device) was uploaded from the fused device's own tensor."""
    from roundpipe.runtime.devices import VirtualCPUDevice
    model, x, y = make()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    pipe = RoundPipe(model, devices=["cpu"] * 3, measure_memory=True,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    ledgers = [d.memory for d in pipe.devices]
    from_devices: list[tuple[int, ...]] = []
    copy_in = VirtualCPUDevice._copy_in

    def checked(self, tensor, category, stream):
        key = tensor.untyped_storage()._cdata
        if any(key in ledger._storages for ledger in ledgers):
            from_devices.append(tuple(tensor.shape))
        return copy_in(self, tensor, category, stream)
    monkeypatch.setattr(VirtualCPUDevice, "_copy_in", checked)
    try:
        loss_fn = loss_for(model, read)
        for _ in range(2):
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            eager(ref, x, y, read)
        assert pipe.plan.fused_stage.units[0] > 0  # the first block is in another job
        assert from_devices == []
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    finally:
        pipe.close()


@pytest.mark.parametrize("fail", [None, "loss_fn", "backward"])
def test_loss_fn_reading_the_masters_is_held_like_the_parameters(fail) -> None:
    """A loss_fn that reads the masters (``pipe.optim_named_parameters()``, the tensors
    the optimizer steps) instead of the model's parameters: their part is the
    parameter's (joined into its unit's gradient, or held for the commit), so a failed
    call leaves the masters' ``.grad`` as it was and a successful one equals eager's
    loop reading the parameters (float64 masters: the same values). Before, autograd
    wrote that part straight into the masters' ``.grad`` during the call: 2.04 left on
    temp's master after a call failing in microbatch 1 (and under data parallelism each
    replica would keep its own part, unreduced)."""
    model, x, y = make()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    pipe = RoundPipe(model, devices=["cpu"] * 3, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    try:
        masters = dict(pipe.optim_named_parameters())

        def loss_fn(out, t):
            return (((out / masters["temp"] - t) ** 2).sum()
                    + 1e-2 * masters["blocks.0.weight"].pow(2).sum())
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        eager(ref, x, y, "unit")
        pipe.synchronize()
        if fail is not None:
            before = snapshot(pipe)
            with Fail(pipe, fail) as f:
                with pytest.raises(f.error):
                    pipe.forward_backward(input_args=(y,), label=x, loss_fn=f.loss_fn(loss_fn))
            assert_same(snapshot(pipe), before)
        pipe.forward_backward(input_args=(y,), label=x, loss_fn=loss_fn)
        eager(ref, y, x, "unit")
        pipe.synchronize()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(masters[name].grad, p.grad, **TOL, msg=name)
    finally:
        pipe.close()


@pytest.mark.parametrize("reads_directly", [False, True])
def test_reentrant_checkpoint_in_loss_fn_is_refused_with_nothing_changed(reads_directly) -> None:
    """A loss_fn that runs ``torch.utils.checkpoint(..., use_reentrant=True)`` over code
    reading a model parameter (a chunked head over a tied weight): the checkpoint's
    backward runs a backward of its own inside, which writes the parameter's part
    straight into its ``.grad``, out of sight of the fused tail's walk (a later failure
    keeps it; data parallelism does not reduce it), and it cannot run under
    ``torch.autograd.grad`` at all (the path taken once loss_fn also reads a parameter
    directly). Refused with LossError before that backward, nothing changed; with
    ``use_reentrant=False`` the same loss_fn trains as eager. Before, the first case ran
    with that part on ``.grad`` during the call and the second failed with torch's
    RuntimeError about ``.grad()`` inside a StageError."""
    from torch.utils.checkpoint import checkpoint
    model, x, y = make()
    ref = Net()
    ref.load_state_dict(model.state_dict())

    def loss_with(m: Net, reentrant: bool):
        def head(h, t):
            return ((h @ m.blocks[0].weight.T - t) ** 2).sum()

        def loss_fn(out, t):
            loss = checkpoint(head, out, t, use_reentrant=reentrant)
            if reads_directly:
                loss = loss + m.temp ** 2
            return loss
        return loss_fn
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    try:
        before = snapshot(pipe)
        with pytest.raises(LossError, match="use_reentrant=False"):
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_with(model, True))
        assert_same(snapshot(pipe), before)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_with(model, False))
        inner = loss_with(ref, False)
        for xs, ys in zip(x.chunk(MB), y.chunk(MB)):
            inner(ref(xs), ys).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    finally:
        pipe.close()
