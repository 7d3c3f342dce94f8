"""Tests for roundpipe.passes.trace: every zoo model traces with the expected method, state
slots are explicit and deduplicated, inputs/outputs keep their structure, failures explain
themselves."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import models
import reference
from compiled import compiled
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import ModelError, TraceError
from roundpipe.passes.trace import trace

EXPORTABLE = [name for name in models.ALL if name != "data_dependent"]


def _source_line(func, needle: str) -> int:
    """Line number (in its file) of the first source line of ``func`` containing ``needle``."""
    lines, start = inspect.getsourcelines(func)
    for offset, line in enumerate(lines):
        if needle in line:
            return start + offset
    raise AssertionError(f"{needle!r} not in {func.__qualname__}")


def _run_traced_graph(traced, model, args, kwargs):
    """Run the flat traced graph: state placeholders get ``model``'s tensors (by the slot's
    fully-qualified name), user placeholders the flattened call; ``out_spec`` rebuilds the
    output structure."""
    gm = traced.graph_module
    state = {s.name: s for s in traced.state}
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user = [n.name for n in nodes if n.name not in state]
    if traced.inputs.kind == "pytree":
        leaves, spec = pytree.tree_flatten((args, kwargs))
        assert spec == traced.inputs.spec
    else:  # torch.fx: one placeholder per forward parameter
        leaves = list(args)
    by_name = dict(zip(user, leaves))

    def value(name):
        if name not in state:
            return by_name[name]
        spec = state[name]
        if spec.kind == "parameter":
            return model.get_parameter(spec.fqn)
        if spec.kind == "buffer":
            return model.get_buffer(spec.fqn)
        return traced.constants[name]

    flat = gm(*[value(n.name) for n in nodes])
    assert len(flat) == len(traced.outputs)
    return pytree.tree_unflatten(list(flat), traced.out_spec)


@pytest.mark.parametrize("name", EXPORTABLE)
def test_zoo_model_traces_with_export(name):
    """Every model but data_dependent goes through torch.export, with nothing to note, and
    the flat graph computes what the model computes."""
    c = compiled(name)
    assert c.traced.method in ("export", "export-static")
    assert c.plan.program.trace_method == c.traced.method
    assert c.traced.notes == ()
    # Eager and graph each run on their own copy: BatchNorm updates its running stats.
    eager, graph = copy.deepcopy(c.model), copy.deepcopy(c.model)
    with torch.no_grad():
        expected = eager(*c.args, **c.kwargs)
        got = _run_traced_graph(c.traced, graph, c.args, c.kwargs)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    got_leaves, got_spec = pytree.tree_flatten(got)
    assert got_spec == exp_spec
    for e, g in zip(exp_leaves, got_leaves):
        assert torch.equal(e, g)
    for (fqn, e), g in zip(eager.named_buffers(), graph.buffers()):
        assert torch.equal(e, g), fqn


def test_exported_inputs_are_dynamic():
    """Batch and sequence dims of the GPT's inputs are left dynamic, so one trace serves
    every batch size (None: microbatches of one included) and every sequence length from
    2 (export traces sizes 0 and 1 apart, so length 1 gets a program of its own)."""
    static = compiled("gpt").traced.inputs.static
    assert static == (("tensor", torch.int64, (None, (2, None))),
                      ("tensor", torch.float32, (None, (2, None))))


def test_data_dependent_falls_back_to_fx_with_notes():
    """Data-dependent control flow inside the blocks defeats torch.export; the torch.fx
    fallback keeps the blocks opaque, and the notes say why export was not used, naming
    the source line."""
    c = compiled("data_dependent")
    assert c.traced.method == "fx"
    assert c.plan.notes == c.traced.notes
    line = _source_line(models.Gate.forward, "if x.sum() > 0")
    # (a guard on data, not on a dimension: a static export would fail the same, and is
    # not tried)
    assert len(c.traced.notes) == 1
    assert c.traced.notes[0].startswith("export failed:")
    for note in c.traced.notes:
        assert f"models.py:{line}" in note
        assert "x.sum() > 0" in note
    # The graph still computes the model, whichever branch each gate takes, at a batch
    # size other than the example's.
    torch.manual_seed(3)
    for x in (torch.randn(5, 8), -torch.randn(5, 8).abs(), torch.randn(5, 8).abs()):
        with torch.no_grad():
            assert torch.equal(_run_traced_graph(c.traced, c.model, (x,), {}), c.model(x))


def test_untraceable_model_names_the_line_and_what_was_tried():
    model, args, kwargs = models.untraceable()
    line = _source_line(models.Untraceable.forward, "if y.sum() > 0")
    with pytest.raises(TraceError) as info:
        trace(model, args, kwargs)
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)  # the builtin type callers catch
    assert "Untraceable" in message
    assert f"models.py:{line}" in message
    assert "if y.sum() > 0" in message
    for method in ("export:", "fx:"):
        assert f"  - {method}" in message
    assert "export-static:" not in message  # fails alike (a guard on data): not tried
    assert "make the failing line traceable" in message  # the way out


def test_model_without_parameters_is_rejected():
    with pytest.raises(ModelError, match="no parameters") as info:
        trace(models.NoParams(), (torch.randn(2, 3),))
    assert isinstance(info.value, ValueError)


def test_tied_weights_share_one_state_slot():
    """GPT ties head.weight to wte.weight: one parameter slot, the other name an alias,
    read by both the wte and the head units; the slot holds the model's own tensor."""
    c = compiled("gpt")
    state = c.plan.program.state
    tied = [s for s in state if "wte.weight" in (s.fqn, *s.aliases)]
    assert len(tied) == 1
    slot = tied[0]
    assert slot.fqn == "wte.weight" and slot.aliases == ("head.weight",)
    assert not any(s.fqn == "head.weight" for s in state)
    names = [u.name for u in c.plan.units]
    assert slot.units == (names.index("wte"), names.index("head"))
    assert c.traced.state_tensors[slot.name] is c.model.wte.weight
    # One slot per distinct tensor: parameters() already deduplicates tied ones.
    distinct = len(list(c.model.parameters())) + len(list(c.model.buffers()))
    assert len(state) == distinct
    assert slot.nbytes == c.model.wte.weight.numel() * 4


class _TiedGated(nn.Module):
    """Tied embedding/head around data-dependent blocks: the torch.fx path must deduplicate
    tied weights too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([models.Gate(8) for _ in range(2)])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_tied_weights_share_one_slot_in_the_fx_fallback():
    torch.manual_seed(0)
    model = _TiedGated()
    traced = trace(model, (torch.randint(0, 10, (3, 4)),),
                   leaf_modules=("blocks.0", "blocks.1"))
    assert traced.method == "fx"
    tied = [s for s in traced.state if s.fqn in ("emb.weight", "head.weight")]
    assert [(s.fqn, s.aliases) for s in tied] == [("emb.weight", ("head.weight",))]
    assert len(traced.state) == len(list(model.parameters()))


def test_kwargs_and_dict_output_survive():
    """The GPT's attention_mask keyword reaches the graph, and the output is the model's
    dict with its keys in order."""
    c = compiled("gpt")
    sig = c.traced.inputs
    assert sig.kind == "pytree"
    args, kwargs = pytree.tree_unflatten(list(sig.names), sig.spec)
    assert args == ("idx",) and kwargs == {"attention_mask": "attention_mask"}
    rebuilt = pytree.tree_unflatten([r.value for r in c.traced.outputs], c.traced.out_spec)
    assert isinstance(rebuilt, dict) and list(rebuilt) == ["logits", "hidden"]
    with torch.no_grad():
        expected = c.model(*c.args, **c.kwargs)
        got = _run_traced_graph(c.traced, c.model, c.args, c.kwargs)
    assert list(got) == ["logits", "hidden"]
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # The mask matters: without it (all ones) the logits differ, so the graph really used it.
    ones = {"attention_mask": torch.ones_like(c.kwargs["attention_mask"])}
    with torch.no_grad():
        unmasked = _run_traced_graph(c.traced, c.model, c.args, ones)
    assert not torch.equal(unmasked["logits"], got["logits"])


def test_dataclass_output_and_constant_kwarg_survive():
    """DataclassNet returns a RegOut dataclass and takes ``scale=2.0``: the output is
    rebuilt as a RegOut, and the float keyword is recorded as a specialised constant."""
    c = compiled("dataclass_net")
    got = _run_traced_graph(c.traced, c.model, c.args, c.kwargs)
    assert isinstance(got, models.RegOut)
    expected = c.model(*c.args, **c.kwargs)
    assert torch.equal(got.pred, expected.pred) and torch.equal(got.features,
                                                                 expected.features)
    assert c.traced.inputs.static[1] == ("const", 2.0)
    assert c.traced.inputs.names[1] is None  # the graph reads no placeholder for it


def test_batchnorm_buffers_are_recorded_as_mutated():
    """In training mode BatchNorm writes its running stats in place (aten.batch_norm has
    no BUFFER_MUTATION output); each block's unit must list exactly its own BN buffers."""
    c = compiled("bnnet")
    program = c.plan.program
    by_name = program.state_by_name()
    for unit in program.units:
        mutated = {by_name[s].fqn for s in unit.mutated_state}
        if unit.name.startswith("layers."):
            bn = f"{unit.name}.1"
            assert mutated == {f"{bn}.running_mean", f"{bn}.running_var",
                               f"{bn}.num_batches_tracked"}
        else:
            assert mutated == set()
    assert {s.kind for s in program.state if "running" in s.fqn} == {"buffer"}


def test_batchnorm_in_eval_mode_mutates_nothing():
    model, args, kwargs = models.bnnet()
    model.eval()
    traced = trace(model, args, kwargs)
    gm = traced.graph_module
    assert not any(n.meta.get("roundpipe.mutates") for n in gm.graph.nodes)


def test_constants_become_constant_slots():
    """A plain tensor attribute and a tensor literal are 'constant' slots whose values are
    kept with the program."""
    c = compiled("const_net")
    constants = [s for s in c.plan.program.state if s.kind == "constant"]
    assert len(constants) == 2
    assert set(c.plan.program.constants) == {s.name for s in constants}
    offset = next(s for s in constants if s.fqn == "offset")
    assert torch.equal(c.plan.program.constants[offset.name], c.model.offset)


class _CountingGated(torch.nn.Module):
    """Data-dependent control flow (only the torch.fx fallback traces it) and a top-level
    in-place buffer update that must reach the model like in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([models.Gate(8) for _ in range(2)])
        self.head = torch.nn.Linear(8, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_fx_fallback_keeps_top_level_buffer_updates():
    torch.manual_seed(0)
    model = _CountingGated()
    eager = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    for _ in range(2):
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=torch.nn.functional.mse_loss)
        reference.eager_forward_backward(eager, (x,), {}, y, torch.nn.functional.mse_loss, 3)
    assert pipe.plan.program.trace_method == "fx"
    assert int(model.calls) == int(eager.calls) == 6
    pipe.close()


class _ShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = self.fc(x)
        return x * 2 if x.shape[1] > 4 else x + 100  # export guards on T > 4


class _ShapeBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([_ShapeBranch() for _ in range(3)])

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x


def test_a_guarded_dynamic_dimension_recompiles_outside_its_range():
    """Export traced the branch for T > 4 only: a call with T = 3 must not reuse that
    program (it would silently take the wrong branch) but compile its own."""
    import roundpipe
    torch.manual_seed(0)
    model = _ShapeBranches().double()
    pipe = roundpipe.compile(model, (torch.randn(4, 8, 8, dtype=torch.float64),),
                             devices=["cpu"] * 2)
    try:
        assert pipe.plan.program.inputs.static == (("tensor", torch.float64,
                                                    (None, (5, None), 8)),)
        for seq in (8, 3, 12):
            x = torch.randn(4, seq, 8, dtype=torch.float64)
            with torch.no_grad():
                torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
    finally:
        pipe.close()


class _LengthOneBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if x.shape[1] > 1:  # coincides with export's own floor of 2: no range recorded
            h = h - h.mean(1, keepdim=True)
        return self.b(torch.tanh(h))


def test_length_one_is_not_run_on_a_program_traced_for_longer_inputs():
    import roundpipe
    torch.manual_seed(0)
    model = _LengthOneBranch().double()
    pipe = roundpipe.compile(model, (torch.randn(6, 8, 8, dtype=torch.float64),),
                             devices=["cpu"] * 2)
    try:
        for seq in (8, 1):
            x = torch.randn(6, seq, 8, dtype=torch.float64)
            with torch.no_grad():
                torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
    finally:
        pipe.close()


class _BatchBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h * 2 if x.shape[0] > 2 else h  # bounds the batch (microbatch) size


def test_microbatches_outside_the_traced_range_get_a_clear_error():
    import roundpipe
    from roundpipe.errors import InputError
    torch.manual_seed(0)
    model = _BatchBranch().double()
    pipe = roundpipe.compile(model, (torch.randn(9, 8, dtype=torch.float64),),
                             devices=["cpu"] * 2,
                             model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=3))
    try:
        x = torch.randn(9, 8, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
            with pytest.raises(InputError, match=r"microbatch 1 of 3, with tensor shapes "
                                                 r"\[\(2, 8\)\]"):
                pipe(torch.randn(7, 8, dtype=torch.float64))
    finally:
        pipe.close()


class _PatchNet(nn.Module):
    """An image model: patches, then a token mixer whose shapes follow the image size."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 2)

    def forward(self, pixels, tokens):
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # (B, H*W/16, 8)
        for b in self.blocks:
            x = x + torch.relu(b(x))
        return self.head(x.mean(1)) + tokens.float().mean(-1, keepdim=True)


def test_image_sizes_stay_static_while_batch_and_sequence_stay_dynamic():
    """Symbolic image sizes make export of window-attention models ~50x slower (Swin: 63 s
    against 1.8 s), so past the batch, floating inputs of 4 or more dims are static; token
    inputs keep their sequence length dynamic."""
    torch.manual_seed(0)
    traced = trace(_PatchNet(), (torch.randn(4, 3, 16, 16), torch.randint(0, 9, (4, 5))))
    assert traced.method == "export"
    assert traced.inputs.static == (("tensor", torch.float32, (None, 3, 16, 16)),
                                    ("tensor", torch.int64, (None, (2, None))))


def test_an_image_of_another_size_gets_a_program_of_its_own():
    torch.manual_seed(0)
    model = _PatchNet().double()
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    for size in (16, 24):
        pixels = torch.randn(4, 3, size, size, dtype=torch.float64)
        tokens = torch.randint(0, 9, (4, 5))
        label = torch.randn(4, 2, dtype=torch.float64)
        for p in pipe.optim_parameters():
            p.grad = None
        eager.zero_grad()
        loss = pipe.forward_backward(input_args=(pixels, tokens), label=label,
                                     loss_fn=reference.mse_first)
        ref = reference.eager_forward_backward(eager, (pixels, tokens), {}, label,
                                               reference.mse_first, 2)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
        for p, q in zip(pipe.optim_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    assert len(pipe._compiled) == 2
    # the two programs download gradients into the same host buffers: a new shape does
    # not hold another model's worth of them
    held = {id(t): t.numel() * t.element_size()
            for e in pipe._compiled for kept in e.executor.landing.buffers.values()
            for t in kept}
    assert sum(held.values()) == sum(p.numel() * p.element_size()
                                     for p in model.parameters())
    pipe.close()


class _MaskedText(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, ids, mask):  # mask: (B, 1, T, T), additive
        x = self.emb(ids)
        for b in self.blocks:
            scores = x @ x.transpose(1, 2) + mask[:, 0]
            x = x + torch.tanh(b(scores.softmax(-1) @ x))
        return x.mean(1)


def test_a_4d_float_mask_beside_token_ids_keeps_the_sequence_length_dynamic():
    """Only image-like sizes no other input shares are static: a (B, 1, T, T) mask's T is
    the token ids' T, so one program serves every sequence length."""
    torch.manual_seed(0)
    traced = trace(_MaskedText(), (torch.randint(0, 16, (4, 6)), torch.zeros(4, 1, 6, 6)))
    assert traced.inputs.static == (("tensor", torch.int64, (None, (2, None))),
                                    ("tensor", torch.float32, (None, 1, (2, None), (2, None))))
