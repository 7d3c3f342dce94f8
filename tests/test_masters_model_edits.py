"""With ``optim_dtype`` masters the optimizer updates copies of the parameters on the host
and roundpipe publishes them into the model's weights; what the user writes into the model
itself must reach the masters as eager's plain model would see it.

* ``pipe.load_state_dict`` through the model's load-state-dict hooks (a pre hook renaming
  a key or converting a value, a ``_load_from_state_dict`` override, a post hook rewriting
  a weight): the masters take the value the model ends with, not the raw dict's.

Float64 model and masters against eager's per-microbatch loop over a few SGD steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import StepError

NMB = 3


class MLP(torch.nn.Module):
    def __init__(self, d: int = 6, n: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()) for _ in range(n)])
        self.head = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ScaledLinear(torch.nn.Linear):
    """Converts an old layout in its own ``_load_from_state_dict``."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        key = prefix + "w_old"
        if key in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(key) * 3.0
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(6, 6, generator=g, dtype=torch.float64),
            torch.randn(6, 6, generator=g, dtype=torch.float64))


def _eager_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    for xm, ym in zip(x.chunk(NMB), y.chunk(NMB)):
        F.mse_loss(model(xm), ym).backward()
    opt.step()
    opt.zero_grad()


def _pipe_step(pipe: RoundPipe, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    pipe.step(opt)
    pipe.synchronize()


def _assert_same(ref: torch.nn.Module, tst: torch.nn.Module) -> None:
    for (name, p), q in zip(ref.named_parameters(), tst.parameters()):
        assert torch.equal(p, q), (name, (p - q).abs().max().item())


def _model(kind: str) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MLP().double()
        if kind == "override":
            head = ScaledLinear(6, 6).double()
            head.load_state_dict(model.head.state_dict())
            model.head = head
    head = model.head

    def pre(sd, prefix, *_):
        if kind == "rename" and prefix + "old_weight" in sd:
            sd[prefix + "weight"] = sd.pop(prefix + "old_weight")
        if kind == "scale" and prefix + "weight" in sd:
            sd[prefix + "weight"] = sd[prefix + "weight"] * 0.5

    def post(module, incompatible):
        with torch.no_grad():
            module.head.weight.mul_(0.25)
            module.layers[0][0].bias.data.add_(1.0)  # a .data write, its own counter

    if kind == "post":
        model.register_load_state_dict_post_hook(post)
    elif kind != "override":
        head._register_load_state_dict_pre_hook(pre)
    return model


@pytest.mark.parametrize("kind", ["rename", "scale", "post", "override", "none"])
def test_load_state_dict_hooks_reach_masters(kind: str) -> None:
    ref, tst = _model(kind), _model(kind)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        sd = dict(MLP().double().state_dict())
    if kind == "rename":
        sd["head.old_weight"] = sd.pop("head.weight")
    if kind == "override":
        sd["head.w_old"] = sd.pop("head.weight")
    pipe = RoundPipe(tst, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    ro = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    to = torch.optim.SGD(pipe.optim_parameters(), lr=0.1, momentum=0.9)
    _eager_step(ref, ro, 0)
    _pipe_step(pipe, to, 0)
    ref.load_state_dict(copy.copy(sd))
    pipe.load_state_dict(copy.copy(sd))
    _assert_same(ref, tst)
    for name, master in pipe.optim_named_parameters():
        assert torch.equal(master, ref.get_parameter(name)), name
    for step in (1, 2):
        _eager_step(ref, ro, step)
        _pipe_step(pipe, to, step)
        _assert_same(ref, tst)
    pipe.close()


def test_load_keeps_master_precision_without_hooks() -> None:
    """A bf16 model's fp32 masters load from a state dict at full precision (the hook
    capture must not round them through the model's dtype)."""
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    pipe.optim_parameters()
    sd = {k: torch.randn(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
    pipe.load_state_dict(sd)
    for name, master in pipe.optim_named_parameters():
        assert master.dtype == torch.float32
        assert torch.equal(master, sd[name]), name
        assert torch.equal(model.get_parameter(name), sd[name].to(torch.bfloat16)), name
    pipe.close()


# --- writes to the model's own weights between steps ------------------------------------

def _edit(kind: str, model: torch.nn.Module, sd0: dict[str, torch.Tensor], step: int) -> None:
    if kind == "data_clamp":  # WGAN: the .data alias has its own version counter
        for p in model.parameters():
            p.data.clamp_(-0.2, 0.2)
    elif kind == "no_grad_clamp":
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.2, 0.2)
    elif kind == "load_state_dict" and step == 1:
        model.load_state_dict(sd0)
    elif kind == "copy":
        with torch.no_grad():
            model.head.weight.copy_(model.head.weight * 0.5)
    elif kind == "rebind_data":  # p.data = t: a new storage
        p = model.layers[1][0].weight
        p.data = p.data * -1.0
    elif kind == "one_element" and step == 0:  # a .data write of a single value
        model.layers[0][0].bias.data[2] = 7.0


EDITS = ["data_clamp", "no_grad_clamp", "load_state_dict", "copy", "rebind_data",
         "one_element"]


@pytest.mark.parametrize("synchronize", [True, False])
@pytest.mark.parametrize("kind", EDITS)
def test_weight_edits_between_steps_reach_masters(kind: str, synchronize: bool) -> None:
    ref, tst = _model("none"), _model("none")
    sd0 = copy.deepcopy(ref.state_dict())
    pipe = RoundPipe(tst, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    ro = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    to = torch.optim.SGD(pipe.optim_parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        _eager_step(ref, ro, step)
        x, y = _batch(step)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        pipe.step(to)
        if synchronize:
            pipe.synchronize()
        _edit(kind, ref, sd0, step)
        _edit(kind, tst, sd0, step)
        _assert_same(ref, tst)
    pipe.synchronize()
    _assert_same(ref, tst)
    for name, master in pipe.optim_named_parameters():  # and a checkpoint holds them
        assert torch.equal(master, ref.get_parameter(name)), name
    sd = pipe.state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(sd[name], p), name
    pipe.close()


def test_data_edit_of_bf16_weight_reaches_fp32_master() -> None:
    """The by-value detector compares the weight with its master rounded to the
    weight's dtype: an edit of one element of a bf16 weight becomes the master's value
    there, the other elements keep the master's fp32 precision."""
    torch.manual_seed(0)
    model = MLP()
    pipe = RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                     optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    x, y = torch.randn(6, 6, dtype=torch.bfloat16), torch.randn(6, 6, dtype=torch.bfloat16)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    pipe.step(opt)
    pipe.synchronize()
    masters = dict(pipe.optim_named_parameters())
    before = {n: m.detach().clone() for n, m in masters.items()}
    model.head.weight.data[0, 0] = 3.0
    pipe.synchronize()
    for name, master in masters.items():
        if name == "head.weight":
            assert master[0, 0].item() == 3.0
            assert torch.equal(master.flatten()[1:], before[name].flatten()[1:])
        else:
            assert torch.equal(master, before[name]), name
    pipe.close()


def test_edit_of_weights_a_step_behind_is_refused() -> None:
    """Asynchronous steps: the weights are a step behind the masters until the next
    publish; a write to them would be overwritten there.  The next step refuses (the
    write dropped, nothing stepped), naming the parameter; after synchronize a write
    is adopted."""
    model = _model("none")
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     async_after=0, predict_weights=False,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    x, y = _batch(0)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    pipe.step(opt, is_async=True)
    pipe.wait()
    masters = {n: m.detach().clone() for n, m in pipe.optim_named_parameters()}
    with torch.no_grad():
        model.head.weight.fill_(5.0)
    with pytest.raises(StepError, match="head.weight.*pipe.synchronize"):
        pipe.synchronize()
    for name, master in pipe.optim_named_parameters():
        assert torch.equal(master, masters[name]), name
        assert torch.equal(model.get_parameter(name), masters[name]), name
    with torch.no_grad():
        model.head.weight.fill_(5.0)
    pipe.synchronize()
    assert bool((dict(pipe.optim_named_parameters())["head.weight"] == 5.0).all())
    pipe.close()


@pytest.mark.parametrize("offload", [False, True])
def test_weight_edits_with_roundpipe_optim(kind: str = "no_grad_clamp", *, offload: bool,
                                           tmp_path) -> None:
    """roundpipe.optim's one-pass step (gradients held where they land) and the disk
    tier (masters in files: edits found by version counter, merged from the file)."""
    import roundpipe.optim
    ref, tst = _model("none"), _model("none")
    pipe = RoundPipe(tst, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     offload_dir=str(tmp_path / "tier") if offload else None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NMB))
    ro = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    to = roundpipe.optim.SGD(pipe.optim_parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        _eager_step(ref, ro, step)
        _pipe_step(pipe, to, step)
        _edit(kind, ref, {}, step)
        _edit(kind, tst, {}, step)
        _edit("copy", ref, {}, step)
        _edit("copy", tst, {}, step)
        _assert_same(ref, tst)
    pipe.synchronize()
    _assert_same(ref, tst)
    pipe.close()
