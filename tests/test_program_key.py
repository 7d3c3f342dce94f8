"""What a compiled program is keyed on besides its inputs' dtypes and shapes, and what it
holds: each case here used to run the first call's program (or tensors) silently after
the model changed between calls, where eager runs the model as it is now.

* A registered parameter or buffer rebound (``m.buf = t``, ``m.head.weight =
  nn.Parameter(...)``, ``load_state_dict(sd, assign=True)``, a submodule replaced): the
  programs held the old tensors (losses 0.48 / 0.013 / 0.12 off in float64), and
  gradients landed in the old parameter after a submodule was replaced.
* Values read other than plain module attributes: a config object's field
  (``self.config.scale``), a dict, list or tuple attribute, a module-level global; a
  submodule's ``forward`` monkeypatched or its class swapped (0.151 / 0.003 off).
* Modes and flags: a branch on ``torch.is_inference_mode_enabled()`` (no_grad and
  inference_mode calls shared a program: 0.254 off), on an input's ``requires_grad`` or
  ``is_contiguous()``, on a parameter's ``requires_grad`` after ``requires_grad_(False)``
  (0.151 / 0.453 / 1e-3 off)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import ModelError

W = 4


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        self.head = nn.Linear(W, 2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x) * self.scale


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, W, generator=g), torch.randn(6, 2, generator=g)


def _rebind(m: Net, how: str, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    if how == "buffer":
        m.scale = torch.randn(2, generator=g)
    elif how == "parameter":
        m.head.weight = nn.Parameter(torch.randn(2, W, generator=g))
    elif how == "assign_load":
        sd = {k: torch.randn(v.shape, generator=g) for k, v in m.state_dict().items()}
        m.load_state_dict(sd, assign=True)
    else:  # a submodule with parameters replaced
        torch.manual_seed(100 + step)
        m.blocks[1] = nn.Linear(W, W)


_HOWS = ["buffer", "parameter", "assign_load", "submodule"]


@pytest.mark.parametrize("how", _HOWS)
def test_forward_backward_uses_rebound_state(how, caplog):
    """Over 3 SGD steps with a rebinding before steps 1 and 2, against eager's
    per-microbatch loop; each side makes its optimizer again after a rebinding (the old
    one holds the old parameter, in eager too).  2 and 1 devices bitwise."""
    torch.manual_seed(0)
    eager = Net()
    models = [copy.deepcopy(eager), copy.deepcopy(eager)]
    pipes = [RoundPipe(m, devices=["cpu"] * d,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3))
             for m, d in zip(models, (2, 1))]
    with caplog.at_level(logging.WARNING, logger="roundpipe.api"):
        for step in range(3):
            if step:
                for m in models + [eager]:
                    _rebind(m, how, step)
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models + [eager]]
            x, y = _batch(step)
            losses = [p.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
                      for p in pipes]
            want = sum(F.mse_loss(eager(a), b) for a, b in zip(x.chunk(3), y.chunk(3)))
            want.backward()
            torch.testing.assert_close(losses[0], want.detach(), rtol=0, atol=1e-10,
                                       msg=f"step {step}")
            assert torch.equal(losses[0], losses[1]), step
            for (n, p), q in zip(models[0].named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10,
                                           msg=f"{n} step {step}")
            for p, opt in zip(pipes, opts):
                p.step(opt)
                p.synchronize()
                opt.zero_grad()
            opts[-1].step()
            opts[-1].zero_grad()
    for p in pipes:
        p.close()
    for (n, a), b, c in zip(models[0].named_parameters(), eager.parameters(),
                            models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=n)
        assert torch.equal(a, c), n
    if how != "submodule":  # (the module key says that one: logged at INFO)
        assert "rebound to another tensor" in caplog.text


@pytest.mark.parametrize("how", ["buffer", "parameter", "assign_load"])
def test_pipe_call_uses_rebound_state(how, traces):
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    for step in range(3):
        if step:
            _rebind(model, how, step)
            _rebind(eager, how, step)
        x, _ = _batch(step)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-10,
                                       msg=f"step {step}")
    assert traces[0] == 3
    with torch.no_grad():  # nothing rebound: the program is kept
        pipe(x)
    assert traces[0] == 3
    pipe.close()


@pytest.mark.parametrize("how", ["parameter", "assign_load", "submodule"])
def test_rebound_parameter_with_masters_is_refused(how):
    """With optim_dtype the optimizer steps masters copied from the old parameter:
    refused before anything runs, naming the parameter and the ways out.  A buffer
    (no master) is taken."""
    torch.manual_seed(0)
    model = Net()
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x, y = _batch(0)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    _rebind(model, how, 1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    grads = [m.grad.clone() for m in pipe.optim_parameters()]
    name = {"parameter": "head.weight", "assign_load": "blocks.0.weight",
            "submodule": "blocks.1.weight"}[how]
    with pytest.raises(ModelError, match=rf"{name}.*not the object this RoundPipe "
                       r"holds.*pipe.load_state_dict"):
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    with pytest.raises(ModelError, match="not the object this RoundPipe holds"):
        with torch.no_grad():
            pipe(x)
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n
    for g, m in zip(grads, pipe.optim_parameters()):
        assert torch.equal(g, m.grad)
    pipe.close()


def test_rebound_buffer_with_masters_is_taken():
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    for step in range(2):
        if step:
            _rebind(model, "buffer", step)
            _rebind(eager, "buffer", step)
        x, _ = _batch(step)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-10)
    pipe.close()


# --- values read other than plain attributes ----------------------------------------------

GLOBAL_SCALE = 1.0
GLOBAL_TABLE = {"shift": 0.0}


class Cfg:  # transformers' PretrainedConfig pattern: a plain object
    def __init__(self) -> None:
        self.scale = 1.0
        self.act = "tanh"


@dataclasses.dataclass
class DataCfg:
    gains: tuple = (1.0, 1.0)
    nested: dict = dataclasses.field(default_factory=lambda: {"bias": [0.0]})


class Layer(nn.Module):
    def __init__(self, config: Cfg, dcfg: DataCfg) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.config = config  # shared by every layer
        self.dcfg = dcfg
        self.table = {"scale": 1.0}
        self.scales = [1.0, 1.0]

    def forward(self, x):
        h = self.lin(x) * self.config.scale * self.table["scale"] * self.scales[1]
        h = torch.tanh(h) if self.config.act == "tanh" else torch.sigmoid(h)
        return h * self.dcfg.gains[1] + self.dcfg.nested["bias"][0]


class ConfigNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config, self.dcfg = Cfg(), DataCfg()
        self.layers = nn.ModuleList(Layer(self.config, self.dcfg) for _ in range(3))
        self.head = nn.Linear(W, 2)
        self.offsets = (0.0,)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * GLOBAL_SCALE + GLOBAL_TABLE["shift"] + self.offsets[0]


def _edit(models, what: str, step: int) -> None:
    global GLOBAL_SCALE
    for m in models:
        if what == "config_field":
            m.config.scale = 1.0 + step
        elif what == "config_str":
            m.config.act = "sigmoid" if step % 2 else "tanh"
        elif what == "dataclass_nested":
            m.dcfg.nested["bias"][0] = 0.25 * step
        elif what == "dataclass_tuple":
            m.dcfg.gains = (1.0, 1.0 + step)
        elif what == "dict_in_place":
            m.layers[1].table["scale"] = 1.0 - 0.25 * step
        elif what == "list_in_place":
            m.layers[2].scales[1] = 1.0 + 0.5 * step
        elif what == "tuple_rebound":
            m.offsets = (0.5 * step,)
    if what == "global":
        GLOBAL_SCALE = 1.0 + step
    elif what == "global_dict":
        GLOBAL_TABLE["shift"] = 0.125 * step


_EDITS = ["config_field", "config_str", "dataclass_nested", "dataclass_tuple",
          "dict_in_place", "list_in_place", "tuple_rebound", "global", "global_dict"]


@pytest.fixture
def _globals_back():
    global GLOBAL_SCALE
    yield
    GLOBAL_SCALE = 1.0
    GLOBAL_TABLE["shift"] = 0.0


@pytest.mark.usefixtures("_globals_back")
@pytest.mark.parametrize("what", _EDITS)
def test_forward_backward_follows_read_objects(what, traces, caplog):
    """4 SGD steps with the value changed before steps 1 and 2, against eager's
    per-microbatch loop; 2 and 1 devices bitwise (for two kinds: the suite's time); one
    trace per change, none when nothing changed."""
    torch.manual_seed(0)
    eager = ConfigNet()
    counts = (2, 1) if what in ("config_field", "global_dict") else (2,)
    models = [copy.deepcopy(eager) for _ in counts]
    pipes = [RoundPipe(m, devices=["cpu"] * d,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3))
             for m, d in zip(models, counts)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models + [eager]]
    with caplog.at_level(logging.WARNING, logger="roundpipe.api"):
        for step in range(4):
            if step in (1, 2):
                _edit(models + [eager], what, step)
            x, y = _batch(step)
            losses = [p.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
                      for p in pipes]
            want = sum(F.mse_loss(eager(a), b) for a, b in zip(x.chunk(3), y.chunk(3)))
            want.backward()
            torch.testing.assert_close(losses[0], want.detach(), rtol=0, atol=1e-10,
                                       msg=f"step {step}")
            assert torch.equal(losses[0], losses[-1]), step
            for p, opt in zip(pipes, opts):
                p.step(opt)
                p.synchronize()
            opts[-1].step()
            for opt in opts:
                opt.zero_grad()
    # each pipe: the first call and two changes (config_str's second change goes back to
    # the first call's value, whose program is kept)
    assert traces[0] == len(pipes) * (2 if what == "config_str" else 3)
    assert "changed since the call that traced" in caplog.text
    for p in pipes:
        p.close()


@pytest.mark.usefixtures("_globals_back")
@pytest.mark.parametrize("what", ["config_field", "dataclass_nested", "list_in_place",
                                  "global_dict"])
def test_pipe_call_follows_read_objects(what):
    torch.manual_seed(0)
    model = ConfigNet()
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    for step in range(3):
        _edit([model, eager], what, step)
        x, _ = _batch(step)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-10,
                                       msg=f"step {step}")
    pipe.close()


class ListGains(Net):
    def __init__(self) -> None:
        super().__init__()
        self.gains = [torch.linspace(0.5, 1.5, 2)]  # a tensor in a list attribute

    def forward(self, x):
        return super().forward(x) * self.gains[0]


def test_tensor_in_a_list_attribute_rebound(traces):
    torch.manual_seed(0)
    model = ListGains()
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x, _ = _batch(0)
    for step in range(3):
        if step:
            model.gains[0] = torch.full((2,), 1.0 + step)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-10,
                                       msg=f"step {step}")
    assert traces[0] == 3
    pipe.close()


class Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("how", ["instance_forward", "class_swap", "class_forward"])
def test_forward_replaced_between_calls(how, traces):
    """A submodule's forward set on the instance (a monkeypatch), its class swapped, or
    its class's forward replaced: the next call runs the new code, as eager."""
    class Own(nn.Linear):  # a class of the test's own, so that patching it is contained
        pass

    torch.manual_seed(0)
    model = Net()
    model.blocks[1].__class__ = Own
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x, y = _batch(0)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-10)
    for m in (model, eager):
        lin = m.blocks[1]
        if how == "instance_forward":
            lin.forward = types.MethodType(
                lambda self, x: F.linear(x, self.weight, self.bias) * 3, lin)
        elif how == "class_swap":
            lin.__class__ = Doubled
    if how == "class_forward":
        Own.forward = lambda self, x: F.linear(x, self.weight, self.bias) * 0.5
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-10)
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    want = sum(F.mse_loss(eager(a), b) for a, b in zip(x.chunk(3), y.chunk(3)))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=1e-10)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=n)
    assert traces[0] == 3  # no_grad before and after, then training
    pipe.close()


# --- modes and flags ---------------------------------------------------------------------

class Branches(nn.Module):
    """Branches on what the key now holds: an input's requires_grad and layout, a
    parameter's requires_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(W, W)
        self.rest = nn.ModuleList(nn.Linear(W, W) for _ in range(2))
        self.head = nn.Linear(W, 2)

    def forward(self, x):
        h = self.first(x)
        if h.requires_grad:  # the first layer's parameters (or x) require grad
            h = h * 1.5
        if x.requires_grad:
            h = h - 0.25
        if not x.is_contiguous():
            h = h * 0.75
        for layer in self.rest:
            h = torch.tanh(layer(h))
        return self.head(h)


class InferenceBranch(Net):
    def forward(self, x):
        y = super().forward(x)
        return y * 0.5 if torch.is_inference_mode_enabled() else y


@pytest.mark.parametrize("order", [("no_grad", "inference", "no_grad"),
                                   ("inference", "no_grad", "inference"),
                                   ("grad", "inference", "grad")])
def test_inference_mode_branch(order, traces):
    torch.manual_seed(0)
    model = InferenceBranch()
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=1))
    x, _ = _batch(0)
    modes = {"no_grad": torch.no_grad, "inference": torch.inference_mode,
             "grad": torch.enable_grad}
    for mode in order:
        with modes[mode]():
            out, want = pipe(x), model(x)
        torch.testing.assert_close(out.detach(), want.detach(), rtol=0, atol=1e-10,
                                   msg=mode)
    assert traces[0] == 2  # the third call reuses the first's program
    pipe.close()


def test_a_model_that_does_not_ask_shares_its_program_across_inference_mode(traces):
    torch.manual_seed(0)
    model = Net()
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=1))
    x, _ = _batch(0)
    for ctx in (torch.no_grad, torch.inference_mode, torch.no_grad):
        with ctx():
            torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-10)
    assert traces[0] == 1
    pipe.close()


def _eager_loop(model, x, y, n):
    return sum(F.mse_loss(model(a), b) for a, b in zip(x.tensor_split(n), y.tensor_split(n)))


@pytest.mark.parametrize("nmb", [1, 3])
def test_parameter_requires_grad_between_calls(nmb, traces):
    """The first layer frozen before step 1, unfrozen before step 2, over 3 SGD steps
    against eager's per-microbatch loop; step 3 (frozen again) reuses step 1's program."""
    torch.manual_seed(0)
    eager = Branches()
    models = [copy.deepcopy(eager), copy.deepcopy(eager)]
    pipes = [RoundPipe(m, devices=["cpu"] * d,
                       model_run_config=RoundPipeRunConfig(num_microbatch=nmb))
             for m, d in zip(models, (2, 1))]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models + [eager]]
    for step in range(4):
        for m in models + [eager]:
            m.first.requires_grad_(step % 2 == 0)
        x, y = _batch(step)
        losses = [p.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
                  for p in pipes]
        want = _eager_loop(eager, x, y, nmb)
        want.backward()
        torch.testing.assert_close(losses[0], want.detach(), rtol=0, atol=1e-10,
                                   msg=f"step {step}")
        assert torch.equal(losses[0], losses[1]), step
        for (n, p), q in zip(models[0].named_parameters(), eager.parameters()):
            if q.grad is None:
                assert p.grad is None, n
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=n)
        for p, opt in zip(pipes, opts):
            p.step(opt)
            p.synchronize()
        opts[-1].step()
        for opt in opts:
            opt.zero_grad()
    assert traces[0] == 2 * 2
    for p in pipes:
        p.close()


@pytest.mark.parametrize("front", ["fb", "call"])
def test_input_requires_grad_and_layout(front, traces):
    """An input that requires grad, then one that does not; a contiguous input, then a
    transposed one of the same shape: each traces its own program, exact as eager."""
    torch.manual_seed(0)
    model = Branches()
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=1))
    cases = [(True, True), (False, True), (False, False), (True, True)]
    for step, (rg, contiguous) in enumerate(cases):
        x, y = _batch(step)
        if not contiguous:
            x = x.t().contiguous().t()
        x.requires_grad_(rg)
        if front == "fb":
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
            want = F.mse_loss(model(x), y).detach()
            torch.testing.assert_close(loss, want, rtol=0, atol=1e-10, msg=str(step))
        else:
            with torch.no_grad():
                torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-10,
                                           msg=str(step))
    assert traces[0] == 3  # the last case is the first's
    model.zero_grad()
    pipe.close()


# --- objects the forward itself changes while traced: its state, not the program's key ------

_CALL_LOG: list[int] = []  # a module-level list the forward appends to


class Logging(Net):
    """A forward appending to a list attribute and to a global list (a log), reading a
    memo dict it fills: the trace changes their content, and so does the user after."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, ...]] = []
        self.memo: dict[int, float] = {}

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        _CALL_LOG.append(x.shape[0])
        if x.shape[-1] not in self.memo:
            self.memo[x.shape[-1]] = 0.5
        return super().forward(x) * self.memo[x.shape[-1]]


def test_objects_the_forward_changes_are_not_keyed(traces, caplog):
    """A log the forward appends to, cleared by the user between steps, traced again at
    every call (a trace of the whole model each step, and a warning each time) when the
    list's content was part of the key; the forward's change is now warned about once,
    at the trace, and the program kept."""
    torch.manual_seed(0)
    model = Logging()
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        for step in range(3):
            x, y = _batch(step)
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
            ref = sum(F.mse_loss(eager(xm), ym) for xm, ym in zip(x.chunk(3), y.chunk(3)))
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=0)
            model.seen.clear()
            _CALL_LOG.clear()
    assert traces[0] == 1
    # (export puts the attribute list back itself; the global list it leaves changed:
    # said once, at the trace)
    changed = [r.getMessage() for r in caplog.records if "changed the content" in r.getMessage()]
    assert len(changed) == 1 and "_CALL_LOG" in changed[0]
    assert not any("tracing again" in r.getMessage() for r in caplog.records)
    # a read object the forward does not change is still keyed
    model.memo[W] = 2.0
    eager.memo[W] = 2.0
    with torch.no_grad():
        x, _ = _batch(9)
        torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-10)
    pipe.close()
