"""Leaf modules: code torch.export cannot trace runs as plain Python inside an exported
graph, found automatically or named with ``leaf_modules``; and the trace pass's handling
of failed attempts (dimension marks, ``forward(*args, **kwargs)``, error messages)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import models
import reference
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import ConfigError, ModelError, TraceError
from roundpipe.passes.trace import trace


def _line(func, needle: str) -> int:
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if needle in line)


def _train_and_compare(leaf_modules=None, devices: int = 2) -> RoundPipe:
    model, args, kwargs = models.routed()
    model = model.double()
    args = tuple(a.double() for a in args)
    label = torch.randn(args[0].shape[0], 2, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * devices, leaf_modules=leaf_modules,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = pipe.forward_backward(input_args=args, label=label, loss_fn=reference.mse_first)
    ref = reference.eager_forward_backward(eager, args, kwargs, label, reference.mse_first, 3)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    return pipe


def test_block_export_cannot_trace_becomes_a_leaf_by_itself():
    """export fails inside Router and torch.fx at the top-level shape test: every Router is
    kept opaque, the rest exported, and training equals eager.  The failure is a guard on
    a data-dependent value (``unique``), which a static export (or one without shared
    blocks) fails the same way, so neither is tried: two exports in all."""
    exports = []
    original = torch.export.export

    def counting(*args, **kwargs):
        exports.append(1)
        return original(*args, **kwargs)
    torch.export.export = counting
    try:
        pipe = _train_and_compare()
    finally:
        torch.export.export = original
    plan = pipe.plan
    assert plan.program.trace_method == "export-leaves"
    line = _line(models.Router.forward, "for e in choice.unique()")
    assert [n.split(":")[0] for n in plan.notes] == [
        "export failed", "fx failed", "kept opaque (run eagerly, static shapes)"]
    assert len(exports) == 2  # (five before: shared and not, dynamic and static; leaves)
    assert f"models.py:{line}" in plan.notes[0]
    assert plan.notes[-1].endswith("Router at blocks.0 and 2 more")
    assert [u.name for u in plan.units if u.kind == "block"] == ["blocks.0", "blocks.1",
                                                                "blocks.2"]
    pipe.close()


@pytest.mark.parametrize("leaves", [[models.Router], ["blocks.0", "blocks.1", "blocks.2"]])
def test_leaf_modules_named_by_the_user_skip_the_failing_attempts(leaves):
    pipe = _train_and_compare(leaf_modules=leaves, devices=3)
    assert pipe.plan.program.trace_method == "export-leaves"
    assert pipe.plan.notes == ("kept opaque (run eagerly, static shapes): Router at "
                               "blocks.0 and 2 more",)
    pipe.close()


def test_experts_inside_an_opaque_block_are_not_units():
    """MoENet's experts (a ModuleList holding most of each layer's parameters) would be the
    units by the nested-repeat rule; once export makes their ListMoE block opaque they run
    inside one call, so the layers are the units again, and training equals eager."""
    model, args, kwargs = models.moenet()
    model, args = model.double(), tuple(a.double() for a in args)
    label = torch.randn(args[0].shape[0], 2, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = pipe.forward_backward(input_args=args, label=label, loss_fn=reference.mse_first)
    ref = reference.eager_forward_backward(eager, args, kwargs, label, reference.mse_first, 3)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for p, q in zip(pipe.optim_parameters(), eager.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    plan = pipe.plan
    assert plan.notes[-1].endswith("ListMoE at layers.0.moe and 2 more")
    assert [(u.name, u.kind) for u in plan.units] == [
        ("layers.0", "block"), ("layers.1", "block"), ("layers.2", "block"),
        ("head", "epilogue")]
    pipe.close()


def test_leaf_modules_must_name_submodules():
    model, _, _ = models.routed()
    with pytest.raises(ConfigError, match="'blocks.7' is not a submodule path"):
        RoundPipe(model, devices=["cpu"], leaf_modules=["blocks.7"])
    with pytest.raises(ConfigError, match="no submodule of type Gate"):
        RoundPipe(model, devices=["cpu"], leaf_modules=[models.Gate])


def test_failed_export_leaves_no_dimension_marks_on_the_inputs():
    """A failed dynamic export marks the example tensors' dimensions as dynamic; left there,
    the next (static) attempt traced dynamic shapes."""
    model, args, kwargs = models.routed()
    traced = trace(model, args, kwargs)
    assert traced.method == "export-leaves"
    assert not any(a.startswith("_dynamo") for a in vars(args[0]))
    assert all(isinstance(d, int) for d in traced.inputs.static[0][2])  # really static


def test_forward_with_var_args_exports_with_dynamic_shapes():
    """``forward(*args, **kwargs)`` (PEFT's PeftModel): torch 2.13's export cannot match
    dynamic shapes to that signature unless roundpipe packs the call itself."""
    model, args, kwargs = models.varargs()
    traced = trace(model, args, kwargs)
    assert traced.method == "export" and traced.notes == ()
    assert traced.inputs.names == ("arg0", "attention_mask")
    # Dynamic: any size, or any from export's floor of 2 (not fixed to the example's).
    assert all(d is None or d == (2, None) for d in traced.inputs.static[0][2])


def test_untraceable_top_level_code_names_class_line_and_ways_out():
    model, args, kwargs = models.untraceable()
    with pytest.raises(TraceError) as info:
        trace(model, args, kwargs)
    message = str(info.value)
    line = _line(models.Untraceable.forward, "if y.sum() > 0")
    assert message.startswith("could not trace Untraceable;")
    assert f"models.py:{line} in forward: if y.sum() > 0" in message
    assert "runs in Untraceable.forward itself" in message
    assert "leaf_modules=" in message and "experts_implementation=" in message


def test_tracing_puts_back_instance_forwards():
    """Export patches the root's and the leaves' ``forward`` for a while; a forward the
    instance already had (hooks of other libraries set one) must survive."""
    model, args, kwargs = models.routed()
    root_forward = model.forward.__func__.__get__(model)
    block_forward = model.blocks[1].forward.__func__.__get__(model.blocks[1])
    model.forward = root_forward
    model.blocks[1].forward = block_forward
    traced = trace(model, args, kwargs, opaque_modules=[models.Router])
    assert traced.method == "export-leaves"
    assert model.__dict__["forward"] is root_forward
    assert model.blocks[1].__dict__["forward"] is block_forward
    assert "forward" not in model.blocks[0].__dict__


class _Masked(torch.nn.Module):
    """A leaf whose forward reads a plain tensor attribute (neither parameter nor buffer);
    it notes where that tensor lives each time it runs."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.mask = torch.linspace(0.5, 1.5, d)
        self.seen: list[int] = []

    def forward(self, x):
        if not isinstance(self.mask, FakeTensor):  # the cost pass runs it on fakes
            self.seen.append(self.mask.data_ptr())
        return torch.relu(self.lin(x)) * self.mask


class _GatedMasked(_Masked):
    def forward(self, x):
        y = super().forward(x)
        return y if y.sum() > 0 else -y  # data-dependent: the torch.fx fallback


class _MaskedNet(torch.nn.Module):
    def __init__(self, block: type = _Masked, d: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([block(d) for _ in range(3)])
        self.head = torch.nn.Linear(d, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("block, leaves, method", [(_Masked, [_Masked], "export-leaves"),
                                                   (_GatedMasked, None, "fx")])
def test_a_leaf_reads_its_plain_tensor_attributes_from_the_device(block, leaves, method):
    """An opaque module's tensor attributes travel with its state: it runs on the device's
    copy (on a GPU the host tensor would be on the wrong device), and training equals
    eager; for export's leaf modules and the torch.fx fallback's opaque layers alike."""
    torch.manual_seed(0)
    model = _MaskedNet(block).double()
    for b in model.blocks:
        b.mask = b.mask.double()
    x = torch.randn(6, 8, dtype=torch.float64)
    label = torch.randn(6, 2, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2, leaf_modules=leaves,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = pipe.forward_backward(input_args=(x,), label=label, loss_fn=reference.mse_first)
    assert pipe.plan.program.trace_method == method
    ref = reference.eager_forward_backward(eager, (x,), {}, label, reference.mse_first, 3)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    for block in model.blocks:  # compiling ran the leaf on the host tensor; training not
        block.seen.clear()
    pipe.forward_backward(input_args=(x,), label=label, loss_fn=reference.mse_first)
    for block in model.blocks:
        assert block.seen and block.mask.data_ptr() not in block.seen
    pipe.close()


# --- custom autograd.Functions, data-dependent flags, calls into child modules ------------

class _STE(torch.autograd.Function):
    """Straight-through rounding: its backward is not the derivative of its forward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class _STEBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + _STE.apply(torch.tanh(self.lin(x)))


class _KwargsNet(torch.nn.Module):
    """``forward(x, **kwargs)``: no torch.fx fallback, as in Hugging Face models."""

    def __init__(self, block: type, n: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([block() for _ in range(n)])
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, **kwargs):
        for b in self.blocks:
            x = b(x, **kwargs)
        return self.head(x)


def _matches_eager(model, args, kwargs, label) -> RoundPipe:
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = pipe.forward_backward(input_args=args, input_kwargs=kwargs, label=label,
                                 loss_fn=reference.mse_first)
    ref = reference.eager_forward_backward(eager, args, kwargs, label, reference.mse_first, 2)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
    return pipe


def test_a_custom_autograd_function_keeps_its_own_backward():
    """Export writes a Function's forward out as plain ops; differentiating those would
    give the rounding's zero gradient instead of the straight-through one.  The module
    calling it is kept opaque, so autograd calls the Function's backward."""
    torch.manual_seed(0)
    model = _KwargsNet(_STEBlock).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = _matches_eager(model, (x,), {}, torch.randn(6, 2, dtype=torch.float64))
    assert pipe.plan.program.trace_method == "export-leaves"
    assert "CustomBackwardFunction" in pipe.plan.notes[0] and "_STE" in pipe.plan.notes[0]
    assert pipe.plan.notes[-1].endswith("_STEBlock at blocks.0 and 2 more")
    pipe.close()


class _NoGradFunctionBlock(_STEBlock):
    def forward(self, x):
        with torch.no_grad():
            scale = _STE.apply(x.abs().mean())  # needs no gradient: traced as plain ops
        return x + torch.tanh(self.lin(x)) * scale


def test_a_custom_function_that_needs_no_gradient_is_exported():
    torch.manual_seed(0)
    model = _KwargsNet(_NoGradFunctionBlock).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = _matches_eager(model, (x,), {}, torch.randn(6, 2, dtype=torch.float64))
    assert pipe.plan.program.trace_method == "export" and pipe.plan.notes == ()
    pipe.close()


class _FlagAttn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, wide):
        if wide:  # data-dependent: export fails in here, so this module is kept opaque
            return torch.relu(self.lin(x))
        return torch.tanh(self.lin(x))


class _FlagBlock(torch.nn.Module):
    """Longformer's pattern: a flag computed from the data outside the opaque module."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _FlagAttn()

    def forward(self, x, mask):
        wide = (mask > 1).any().item()
        return x + self.attn(x, wide)


def test_a_data_dependent_flag_reaches_an_opaque_module_as_a_value():
    """The flag is an unbacked symbol while tracing; it reaches the opaque call through
    the graph (a constant would have been baked in, or not compile), so microbatches with
    different flags take different branches, as in eager."""
    torch.manual_seed(0)
    model = _KwargsNet(_FlagBlock).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[4, 1] = 2  # only the second microbatch takes the wide branch
    pipe = _matches_eager(model, (x,), {"mask": mask}, torch.randn(6, 2, dtype=torch.float64))
    assert pipe.plan.program.trace_method == "export-leaves"
    assert pipe.plan.notes[-1].endswith("_FlagAttn at blocks.0.attn and 2 more")
    pipe.close()


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = torch.nn.Linear(8, 4)

    def forward(self, x):
        # SwitchTransformers' router does this; export cannot swap a module's parameters
        self.classifier = self.classifier.to(x.dtype)
        return self.classifier(x).softmax(-1)


class _RoutedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = _Router()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x) * self.router(x)[..., :1]


def test_the_module_whose_forward_fails_is_kept_opaque_not_the_child_it_calls():
    """The failure is inside Linear._apply, but the code that made it is the router's
    forward: the router is kept opaque (keeping every Linear opaque would fail again).
    Rebinding its parameters on fake tensors may also fail in the plan's memory replay
    (FakeTensor parameters are swapped, which a live weak reference or a second use of the
    tensor forbids, so it depends on the process): the call trains either way, and
    test_a_stage_that_does_not_replay_falls_back_to_summed_costs pins the fallback."""
    torch.manual_seed(0)
    model = _KwargsNet(_RoutedBlock, n=2).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = _matches_eager(model, (x,), {}, torch.randn(6, 2, dtype=torch.float64))
    assert pipe.plan.program.trace_method == "export-leaves"
    notes = pipe.plan.notes
    assert any(n.endswith("_Router at blocks.0.router and 1 more") for n in notes), notes
    pipe.close()


def test_a_stage_that_does_not_replay_falls_back_to_summed_costs(monkeypatch):
    """A stage job that ran once on fake tensors but fails when replayed for a candidate
    cut must not fail the call: the plan is made from summed unit costs, says so in its
    notes, and trains as eager does."""
    from roundpipe.passes import memory

    def fails(self, kind, units, *args, **kwargs):
        raise RuntimeError(f"no replay of {kind} {units}")

    monkeypatch.setattr(memory.MemoryModel, "_stage_bytes", fails)
    torch.manual_seed(0)
    model = _KwargsNet(_RoutedBlock, n=2).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = _matches_eager(model, (x,), {}, torch.randn(6, 2, dtype=torch.float64))
    notes = pipe.plan.notes
    fallback = [n for n in notes if n.startswith("stage memory from summed unit costs")]
    assert len(fallback) == 1 and "does not replay on fake tensors (RuntimeError: no replay" \
        in fallback[0], notes
    pipe.close()


class _TopLevelSTE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x, **kwargs):
        return self.b(_STE.apply(self.a(x)))


def test_a_custom_function_in_the_top_level_forward_is_refused_with_the_way_out():
    with pytest.raises(TraceError) as info:
        RoundPipe(_TopLevelSTE(), devices=["cpu"]).compile((torch.randn(4, 8),))
    text = str(info.value)
    assert "_STE is a torch.autograd.Function with a backward of its own" in text
    assert "call the autograd.Function from a submodule's forward" in text


def test_a_custom_function_compiled_under_no_grad_keeps_its_backward_in_training():
    """The first call under torch.no_grad() makes the program training reuses: the
    Function must be refused there too."""
    torch.manual_seed(0)
    model = _KwargsNet(_STEBlock).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    label = torch.randn(6, 2, dtype=torch.float64)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with torch.no_grad():  # (a leaf's outputs: merged as asked, nothing proves them)
        pipe(x, run_config=RoundPipeRunConfig(merge_output=0))
    loss = pipe.forward_backward(input_args=(x,), label=label, loss_fn=reference.mse_first)
    ref = reference.eager_forward_backward(eager, (x,), {}, label, reference.mse_first, 2)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
    pipe.close()


class _ReentrantCheckpointBlock(_STEBlock):
    def forward(self, x):
        inner = lambda y: torch.tanh(self.lin(y))  # noqa: E731
        return x + torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=True)


class _StemNet(_KwargsNet):
    """A stem first, so the blocks' inputs require grad (reentrant checkpointing gives no
    gradient at all when none of its inputs does, in eager too)."""

    def __init__(self, block: type) -> None:
        super().__init__(block)
        self.stem = torch.nn.Linear(8, 8)

    def forward(self, x, **kwargs):
        return super().forward(self.stem(x), **kwargs)


def test_reentrant_checkpoint_inside_a_block_keeps_its_gradients():
    """Reentrant checkpointing runs its forward under no_grad: exported as plain ops, the
    parameters inside got no gradient at all."""
    torch.manual_seed(0)
    model = _StemNet(_ReentrantCheckpointBlock).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = _matches_eager(model, (x,), {}, torch.randn(6, 2, dtype=torch.float64))
    assert pipe.plan.program.trace_method == "export-leaves"
    pipe.close()


class _STEWrap(torch.nn.Module):
    """Not a layer unit: torch.fx traced through it (not kept opaque)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((8,), 0.7))

    def forward(self, x):
        return _STE.apply(x * self.scale)


class _PlainSTENet(torch.nn.Module):
    """A plain ``forward(x)``, which torch.fx can trace when export fails."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_PlainBlock() for _ in range(2)])
        self.ste = _STEWrap()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        x = self.ste(self.blocks[0](x))
        return self.head(self.blocks[1](x))


class _PlainTopLevel(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = torch.nn.ModuleList([_PlainBlock() for _ in range(3)])
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        x = self.blocks[0](x)
        for b in self.blocks[1:]:
            x = (torch.utils.checkpoint.checkpoint(b, x, use_reentrant=True)
                 if self.reentrant else _STE.apply(b(x)))
        return self.head(x)


def test_a_custom_function_is_not_traced_through_by_the_fx_fallback():
    """Export refused the Function, then the torch.fx fallback (tried before keeping the
    calling module opaque) ran its forward on proxies and recorded plain ops: the
    straight-through gradient became the rounding's (0.7-scaled parameters' gradients
    off by 100%), silently.  fx now refuses it too, so the module is kept opaque."""
    torch.manual_seed(0)
    model = _PlainSTENet().double()
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = _matches_eager(model, (x,), {}, torch.randn(6, 2, dtype=torch.float64))
    assert pipe.plan.program.trace_method == "export-leaves"
    pipe.close()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_custom_function_in_a_plain_top_level_forward_is_refused(reentrant):
    """The same in the model's own forward, where nothing can be kept opaque: before,
    fx recorded the Function's forward (reentrant checkpointing's, under no_grad: no
    parameter got any gradient); now refused before anything runs."""
    x = torch.randn(6, 8, dtype=torch.float64)
    with pytest.raises(TraceError) as info:
        RoundPipe(_PlainTopLevel(reentrant).double(), devices=["cpu"]).compile((x,))
    name = "CheckpointFunction" if reentrant else "_STE"
    assert f"{name} is a torch.autograd.Function with a backward of its own" in str(info.value)
    assert "call the autograd.Function from a submodule's forward" in str(info.value)


class _ScaleAttn(_FlagAttn):
    def forward(self, x, scale):
        if scale > 1.2:  # data-dependent on a float
            return torch.relu(self.lin(x)) * scale
        return torch.tanh(self.lin(x)) * scale


class _ScaleBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _ScaleAttn()

    def forward(self, x, mask):
        return x + self.attn(x, mask.double().mean().item())


def test_a_data_dependent_float_reaches_an_opaque_module_as_a_value():
    torch.manual_seed(0)
    model = _KwargsNet(_ScaleBlock).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[3:] = 2  # the microbatches see scales 1 and 2: both branches
    pipe = _matches_eager(model, (x,), {"mask": mask}, torch.randn(6, 2, dtype=torch.float64))
    assert pipe.plan.program.trace_method == "export-leaves"
    # only the module that branches is opaque; the float reached it through the graph
    assert pipe.plan.notes[-1].endswith("_ScaleAttn at blocks.0.attn and 2 more")
    pipe.close()


# --- concurrent calls of one opaque module ----------------------------------------------------

class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.body(x))))


def test_leaf_modules_run_concurrently_never_touch_the_model():
    """Four devices run the same opaque module at once (functional_call used to swap the
    shared module's parameters in place: the model ended up holding device copies, and
    gradients went missing silently)."""
    torch.manual_seed(0)
    model = _Body().double()
    eager = copy.deepcopy(model)
    originals = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    x = torch.randn(32, 16, dtype=torch.double)
    y = torch.randn(32, 1, dtype=torch.double)
    with RoundPipe(model, devices=["cpu"] * 4, leaf_modules=["body", "norm"], optim_dtype=None,
                   model_run_config=RoundPipeRunConfig(num_microbatch=8)) as pipe:
        for call in range(50):
            for p in pipe.optim_parameters():
                p.grad = None
            eager.zero_grad()
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
            ref = reference.eager_forward_backward(eager, (x,), {}, y, F.mse_loss, 8)
            assert dict(model.named_parameters()) == originals, call
            assert all(a is b for a, b in zip(model.parameters(), originals.values()))
            assert dict(model.named_buffers()) == buffers, call
            assert len(pipe.optim_parameters()) == len(originals), call
            torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
            for name, p in eager.named_parameters():
                got = originals[name].grad
                assert got is not None, (call, name)
                torch.testing.assert_close(got, p.grad, rtol=1e-10, atol=1e-12,
                                           msg=f"call {call}: {name}")
            for name, b in eager.named_buffers():  # BatchNorm's running stats, committed
                torch.testing.assert_close(buffers[name], b, rtol=1e-10, atol=1e-12)


class _PlainBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _HookedNet(_KwargsNet):
    def __init__(self) -> None:
        super().__init__(_PlainBlock)
        # Scales the gradient leaving blocks.1 towards blocks.0 (and the input).
        self.blocks[1].register_full_backward_hook(lambda m, gin, gout: (gin[0] * 5,))
        self.blocks[2].register_full_backward_pre_hook(lambda m, gout: (gout[0] * -2,))


@pytest.mark.parametrize("devices", [1, 3])
def test_module_backward_hooks_act_on_the_gradients_as_in_eager(devices: int) -> None:
    """The exported graph has no module backward hooks: they were dropped silently, and
    blocks.0 got a gradient 5 times too small.  Modules with such hooks are kept opaque,
    so their own call runs and the hooks fire."""
    torch.manual_seed(0)
    model = _HookedNet().double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    label = torch.randn(6, 2, dtype=torch.float64)
    pipe = RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = pipe.forward_backward(input_args=(x,), label=label, loss_fn=reference.mse_first)
    ref = reference.eager_forward_backward(eager, (x,), {}, label, reference.mse_first, 3)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
    assert pipe.plan.program.trace_method == "export-leaves"
    pipe.close()


def test_a_module_backward_hook_on_the_model_itself_is_refused() -> None:
    model = _KwargsNet(_PlainBlock)
    model.register_full_backward_hook(lambda m, gin, gout: None)
    pipe = RoundPipe(model, devices=["cpu"])
    with pytest.raises(ModelError, match="itself has a module backward hook"):
        pipe.compile((torch.randn(4, 8),), {})
    pipe.close()
