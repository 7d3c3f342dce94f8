"""Checks a call makes before it runs anything, where eager PyTorch would refuse or where
roundpipe cannot match it: ``pipe(x)``, ``forward_backward`` and the ``torch.compile``
backend against eager PyTorch in float64."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import InputError, ModelError, RoundPipe, RoundPipeRunConfig

WIDTH = 6


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class CountedHead(nn.Linear):
    """A head that counts its calls in a buffer the forward writes (and reads)."""

    def __init__(self) -> None:
        super().__init__(WIDTH, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * (1 + self.calls / 10)


class Net(nn.Module):
    """Three blocks and a counting head; the second block's weight is frozen and it reads
    a buffer the forward never writes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.blocks[1].weight.requires_grad_(False)
        self.blocks[1].register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        self.head = CountedHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i == 1:
                x = x * block.scale
        return self.head(x)


def _pipe(model: nn.Module, nmb: int, masters: bool, devices: int = 2) -> RoundPipe:
    return RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=nmb),
                     **({"optim_dtype": torch.float64} if masters else {}))


def _grads(pipe: RoundPipe) -> dict[str, torch.Tensor | None]:
    """The gradients the next optimizer step would read, by parameter name."""
    return {n: None if p.grad is None else p.grad.clone()
            for n, p in pipe.optim_named_parameters()}


def _assert_grads_equal(eager: nn.Module, grads: dict[str, torch.Tensor | None]) -> None:
    for n, p in eager.named_parameters():
        if p.grad is None:
            assert grads.get(n) is None, n
        else:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


# --- 1. pipe(x), an in-place write, backward() ---------------------------------------------

# what the write touches: (description in the error, the write)
WRITES = {
    "trainable weight": ("parameter 'blocks.0.weight'",
                         lambda m, x: m.blocks[0].weight.mul_(2)),
    "frozen weight": ("parameter 'blocks.1.weight'", lambda m, x: m.blocks[1].weight.mul_(2)),
    "head bias": ("parameter 'head.bias'", lambda m, x: m.head.bias.add_(1)),
    "unwritten buffer": ("buffer 'blocks.1.scale'", lambda m, x: m.blocks[1].scale.mul_(3)),
    "input": ("input_args[0]", lambda m, x: x.mul_(3)),
}


@pytest.mark.parametrize("what", sorted(WRITES))
@pytest.mark.parametrize("nmb,masters", [(1, False), (3, False), (3, True)])
def test_in_place_write_between_pipe_call_and_backward_is_refused(what, nmb, masters):
    """Eager autograd raises (a variable needed for gradient computation was modified);
    roundpipe's backward recomputes the forward and read the new values silently (grads
    0.056 / 0.086 off before).  Now refused before anything runs: no gradient, no
    buffer changed; a fresh forward after the write then trains exactly."""
    name, write = WRITES[what]
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, WIDTH), torch.randn(6, 2)
    xe = x.clone()
    with _pipe(model, nmb, masters) as pipe:
        loss = F.mse_loss(pipe(x), y)
        before = copy.deepcopy(model.state_dict())
        with torch.no_grad():
            write(model, x)
        changed = copy.deepcopy(model.state_dict())
        with pytest.raises(InputError, match=re.escape(name)
                           + " was modified in place between forward and backward"):
            loss.backward()
        assert all(g is None for g in _grads(pipe).values())
        for k, v in model.state_dict().items():
            assert torch.equal(v, changed[k]), k
        # the same write in eager: the forward runs again after it
        eager.load_state_dict(before)
        with torch.no_grad():
            write(eager, xe)
        F.mse_loss(eager(xe), y).backward()
        F.mse_loss(pipe(x), y).backward()
        pipe.synchronize()
        _assert_grads_equal(eager, _grads(pipe))


def test_eager_refuses_the_weight_write_too():
    """The reference the refusal follows (eager refuses where the weight was saved for
    the backward, here for its input's gradient; roundpipe's recompute reads every weight
    again, so it refuses them all)."""
    torch.manual_seed(0)
    model = Net()
    loss = model(torch.randn(6, WIDTH)).sum()
    with torch.no_grad():
        model.blocks[2].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("nmb", [1, 3])
def test_writes_the_backward_does_not_read_again_are_allowed(nmb):
    """A buffer the forward writes is stashed as it was, a write to the output or to
    another tensor is autograd's own business: the backward matches eager, and
    two calls in one loss (the second writes the counter again) still train."""
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    x1, x2 = torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    with _pipe(model, nmb, masters=False) as pipe:
        out1 = pipe(x1)
        out2 = pipe(x2)
        with torch.no_grad():
            model.head.calls.add_(5)
        (out1.square().sum() + out2.sum()).backward()
        pipe.synchronize()
        grads = _grads(pipe)
    (eager(x1).square().sum() + eager(x2).sum()).backward()
    _assert_grads_equal(eager, grads)


def test_a_step_between_call_and_backward_is_refused():
    """With masters, a step publishes the masters into the weights: the pending backward
    would recompute with them (eager: optimizer.step() then backward() raises)."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(6, WIDTH)
    with _pipe(model, 3, masters=True) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        pipe(x).sum().backward()
        loss = pipe(x).sum()
        pipe.step(opt, is_async=False)
        with pytest.raises(InputError, match="parameter 'blocks.0.weight' was modified"):
            loss.backward()


# --- 3. a forward that switches a module's training flag ------------------------------------

class ModeScaled(nn.Module):
    """Doubles its input in training mode: a wrong flag is a wrong output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (2.0 if self.training else 1.0)


class Switching(nn.Module):
    """Blocks around a mode-dependent module whose flag the forward sets (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.mid = ModeScaled()
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "flip":  # read, then set to the other value: alternates per call
            self.mid.train(not self.mid.training)
        elif self.how == "follow":  # read, then set to the value it has
            self.mid.train(self.mid.training)
        elif self.how == "always_eval":  # set from nowhere: the same at every call
            self.mid.eval()
        x = torch.tanh(self.blocks[0](x))
        if self.how == "around":  # switched on for one use, then back
            self.mid.train()
            x = self.mid(x)
            self.mid.eval()
        else:
            x = self.mid(x)
        for block in self.blocks[1:]:
            x = torch.tanh(block(x))
        return self.head(x)


@pytest.mark.parametrize("front", ["forward_backward", "call"])
@pytest.mark.parametrize("training", [True, False])
def test_a_forward_flipping_a_training_flag_is_refused(front, training):
    """``self.mid.train(not self.mid.training)``: eager alternates the mode at every call
    (per microbatch in forward_backward's loop); the traced program kept one mode (loss
    0.085 off, silently).  Refused like the other Python state, flag put back."""
    torch.manual_seed(0)
    model = Switching("flip").train(training)
    x, y = torch.randn(6, WIDTH), torch.randn(6, 2)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        name = f"mid.training ({training} -> {not training})"
        with pytest.raises(ModelError, match=re.escape(name) + ".*Switch the mode outside "
                                                               "the forward"):
            if front == "call":
                pipe(x)
            else:
                pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        assert model.mid.training is training
        assert all(p.grad is None for p in pipe.optim_parameters())


@pytest.mark.parametrize("front", ["forward_backward", "call"])
@pytest.mark.parametrize("how,training", [("follow", True), ("follow", False),
                                          ("around", False), ("always_eval", True)])
def test_a_forward_setting_a_flag_the_same_at_every_call_trains_exactly(front, how,
                                                                        training):
    """Setting the flag it has, switching it for one use and back, or setting it from
    nowhere (the same at every call, as a lazy initialisation) is what eager does at
    every call: two SGD steps equal eager (per-microbatch loop for forward_backward),
    and the flag ends as eager's."""
    torch.manual_seed(0)
    model = Switching(how).train(training)
    eager = copy.deepcopy(model)
    eopt = torch.optim.SGD(eager.parameters(), lr=0.1)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        for step in range(2):
            x, y = torch.randn(6, WIDTH), torch.randn(6, 2)
            if front == "call":
                F.mse_loss(eager(x), y).backward()
                loss = F.mse_loss(pipe(x), y)
                loss.backward()
            else:
                for xm, ym in zip(x.chunk(3), y.chunk(3)):
                    F.mse_loss(eager(xm), ym).backward()
                pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
            pipe.synchronize()
            _assert_grads_equal(eager, _grads(pipe))
            eopt.step()
            eopt.zero_grad()
            pipe.step(opt, is_async=False)
            opt.zero_grad()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert [m.training for m in model.modules()] == [m.training for m in eager.modules()]


# --- 4. pipe(x) under torch.inference_mode() ---------------------------------------------------

class Evaluated(nn.Module):
    """Blocks with a batch norm (eval: running statistics), a call counter the forward
    writes, and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.norm = nn.BatchNorm1d(WIDTH)
        self.head = CountedHead()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = torch.tanh(block(x)) * scale
        x = self.norm(x)
        return {"out": self.head(x), "hidden": x}


@pytest.mark.parametrize("nmb", [1, 3])
@pytest.mark.parametrize("first", ["inference_mode", "no_grad", "grad"])
def test_pipe_call_under_inference_mode_equals_eager(nmb, first):
    """The first call in inference mode used to be refused (MergeError) for any model
    with more than one microbatch: export fails under the caller's inference mode and the
    fx fallback proves no merge.  Now traced with the mode off (grad off), run under the
    caller's: outputs and the counter equal eager's, inputs made in inference mode
    (inference tensors) included, whichever mode the model was called in first."""
    torch.manual_seed(0)
    model = Evaluated().eval()
    model.norm.running_mean.uniform_(-0.5, 0.5)
    eager = copy.deepcopy(model)
    x, scale = torch.randn(9, WIDTH), torch.rand(WIDTH) + 0.5  # (9: scale is not split)
    with _pipe(model, nmb, masters=False) as pipe:
        if first == "no_grad":
            with torch.no_grad():
                pipe(x, scale)
                eager(x, scale)
        elif first == "grad":
            pipe(x, scale)["out"].sum().backward()
            eager(x, scale)["out"].sum().backward()
        for made_inside in (False, True):
            with torch.inference_mode():
                xi = torch.randn(9, WIDTH) if made_inside else x
                got, want = pipe(xi, scale), eager(xi, scale)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
        assert torch.equal(model.head.calls, eager.head.calls)
        # and afterwards grad mode still trains
        pipe(x, scale)["out"].sum().backward()
        pipe.synchronize()
        eager(x, scale)["out"].sum().backward()
        _assert_grads_equal(eager, _grads(pipe))



def test_an_input_made_in_inference_mode_trains_in_grad_mode():
    """pipe(x) records for backward with an inference tensor as input: its version
    counter, which the check of writes between the call and backward reads, does not
    exist (torch's RuntimeError came out after the forward had run).  It is left out (it
    cannot be written outside inference mode), and the gradients are eager's on a clone
    (eager itself refuses to save an inference tensor for backward)."""
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    with torch.inference_mode():
        x = torch.randn(6, WIDTH)
    with _pipe(model, 3, masters=False) as pipe:
        pipe(x).square().sum().backward()
        pipe.synchronize()
        grads = _grads(pipe)
    eager(x.clone()).square().sum().backward()
    _assert_grads_equal(eager, grads)

# --- 5. a batch smaller than num_microbatch --------------------------------------------------

@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("masters", [False, True])
def test_pipe_call_on_a_batch_smaller_than_num_microbatch_equals_eager(masters, devices):
    """An epoch's last batch (fewer samples than num_microbatch) was refused by pipe(x)
    (InputError), where the backend runs min(num_microbatch, batch) microbatches.  pipe(x)
    means the whole batch's result, proven split-invariant, so it now does the same:
    outputs, gradients and the head's call counter equal eager on the whole batch, for
    every such size, between full batches, in grad mode and under no_grad."""
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    with _pipe(model, 4, masters, devices) as pipe:
        for batch in (8, 3, 1, 2, 8):
            x = torch.randn(batch, WIDTH)
            with torch.no_grad():
                torch.testing.assert_close(pipe(x), eager(x), rtol=1e-10, atol=1e-12)
            out, want = pipe(x), eager(x)
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
            out.square().sum().backward()
            want.square().sum().backward()
            pipe.synchronize()
            _assert_grads_equal(eager, _grads(pipe))
            assert torch.equal(model.head.calls, eager.head.calls)
            assert pipe.plan.num_microbatch == min(batch, 4)


@pytest.mark.parametrize("batch", [1, 3])
def test_forward_backward_on_a_batch_smaller_than_num_microbatch_is_refused(batch):
    """forward_backward's result is eager's loop over num_microbatch microbatches (loss
    summed, reduction='mean' divides by it): not run as fewer, refused with the way out
    before anything runs; that way out then equals eager's loop over the samples."""
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    x, y = torch.randn(batch, WIDTH), torch.randn(batch, 2)
    with _pipe(model, 4, masters=False) as pipe:
        with pytest.raises(InputError, match=f"the batch has {batch} samples but "
                           r"num_microbatch=4: forward_backward is eager's loop.*"
                           rf"RoundPipeRunConfig\(num_microbatch={batch}\)"):
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        assert all(g is None for g in _grads(pipe).values())
        assert model.head.calls.item() == 0
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss,
                                     run_config=RoundPipeRunConfig(num_microbatch=batch))
        pipe.synchronize()
        grads = _grads(pipe)
    want = sum(F.mse_loss(eager(x[i:i + 1]), y[i:i + 1]) for i in range(batch))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    _assert_grads_equal(eager, grads)


# --- 6. the backend and an embedding's max_norm renorm ----------------------------------------

class Renormed(nn.Module):
    """An embedding (or bag) with max_norm: its forward renormalises the looked-up rows
    of the weight in place."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.emb = (nn.EmbeddingBag(11, WIDTH, max_norm=1.0, mode="mean") if bag
                    else nn.Embedding(11, WIDTH, max_norm=1.0))
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) if self.bag else self.emb(ids).mean(1)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@pytest.mark.parametrize("nmb", [1, 3])
@pytest.mark.parametrize("bag", [False, True])
def test_backend_keeps_an_embeddings_max_norm_renorm(bag, nmb, caplog):
    """Dynamo's graph calls F.embedding, not the in-place renorm inside it, so the
    backend's check for parameter writes missed it and the renorm was dropped (weight
    2.23 off after the forward).  Now seen as a parameter write: that graph runs eagerly
    (exact), with a warning naming the op; weights and gradients equal eager over 2 SGD
    steps."""
    from roundpipe import backend as rb
    torch.manual_seed(0)
    model = Renormed(bag)
    with torch.no_grad():
        model.emb.weight.mul_(3)  # rows over max_norm
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rb.RoundPipeBackend(devices=["cpu"] * 2,
                                                                num_microbatch=nmb))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eopt = torch.optim.SGD(eager.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="roundpipe"):
        for step in range(2):
            ids = torch.randint(0, 11, (6, 4), generator=torch.Generator().manual_seed(step))
            compiled(ids).square().sum().backward()
            eager(ids).square().sum().backward()
            for (n, p), q in zip(eager.named_parameters(), model.parameters()):
                torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12, msg=n)
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=n)
            opt.step()
            eopt.step()
            opt.zero_grad()
            eopt.zero_grad()
    assert "embedding" in caplog.text and "writes to a parameter in place" in caplog.text


# --- 7. the backend and a sparse embedding gradient -------------------------------------------

class SparseLookup(nn.Module):
    def __init__(self, bag: bool, frozen: bool) -> None:
        super().__init__()
        self.bag = bag
        self.emb = (nn.EmbeddingBag(11, WIDTH, mode="sum", sparse=True) if bag
                    else nn.Embedding(11, WIDTH, sparse=True))
        self.emb.weight.requires_grad_(not frozen)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) if self.bag else self.emb(ids).sum(1)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@pytest.mark.parametrize("bag", [False, True])
def test_backend_refuses_a_sparse_embedding_gradient_before_the_forward(bag):
    """Through the backend the sparse gradient failed inside the backward (torch's copy_
    error wrapped in StageError), after the forward had run; now refused at the call,
    before anything runs (ModelError, as pipe(x) and forward_backward refuse it), naming
    the parameter and the way out.  A frozen sparse embedding still trains the rest
    exactly."""
    from roundpipe import backend as rb
    ids = torch.randint(0, 11, (6, 4), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = SparseLookup(bag, frozen=False)
    before = copy.deepcopy(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rb.RoundPipeBackend(devices=["cpu"] * 2,
                                                                num_microbatch=3))
    with pytest.raises(ModelError, match=r"parameter emb\.weight with sparse=True.*"
                                         "use sparse=False"):
        compiled(ids)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k

    torch.manual_seed(0)
    model = SparseLookup(bag, frozen=True)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=rb.RoundPipeBackend(devices=["cpu"] * 2,
                                                                num_microbatch=3))
    compiled(ids).square().sum().backward()
    eager(ids).square().sum().backward()
    for (n, p), q in zip(eager.named_parameters(), model.parameters()):
        if p.grad is None:
            assert q.grad is None, n
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=n)


# --- 8. lazy modules ---------------------------------------------------------------------------

class Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.LazyLinear(WIDTH) for _ in range(2)])
        self.head = nn.LazyLinear(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_a_lazy_module_is_refused_with_the_way_out_which_then_trains_exactly():
    """nn.LazyLinear failed with torch's bare ValueError (an uninitialised parameter's
    numel, in the layers pass); now a ModelError at RoundPipe(...) names the parameter and
    says to run one eager forward first, after which the pipe trains as eager does."""
    from roundpipe import compile as rp_compile
    torch.manual_seed(0)
    model = Lazy()
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with pytest.raises(ModelError, match=r"blocks\.0\.weight is not initialised yet "
                                         r"\(LazyLinear.*Run one eager forward"):
        RoundPipe(model, devices=["cpu"] * 2)
    with pytest.raises(ModelError, match="Run one eager forward"):
        rp_compile(model, example_args=(x,))
    with torch.no_grad():
        model(x[:2])  # materialised
    eager = copy.deepcopy(model)
    with _pipe(model, 3, masters=True) as pipe:
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        pipe.synchronize()
        grads = _grads(pipe)
    for xm, ym in zip(x.chunk(3), y.chunk(3)):
        F.mse_loss(eager(xm), ym).backward()
    _assert_grads_equal(eager, grads)
