"""Tests for roundpipe.passes.layers: which layer units each model gets, and that units are
contiguous runs of the graph that only read earlier units' values."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import models
from compiled import GroupedNet, compiled
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.passes.layers import find_unit_roots

ALL_MODELS = list(models.ALL) + ["const_net", "drop_net", "grouped_net"]


def _units(name):
    return [(u.name, u.kind) for u in compiled(name).plan.units]


def test_gpt_units():
    """Embeddings are the prologue, each transformer block a unit, ln_f and the (tied)
    head the epilogue."""
    assert _units("gpt") == [
        ("wte", "prologue"), ("wpe", "prologue"),
        ("h.0", "block"), ("h.1", "block"), ("h.2", "block"), ("h.3", "block"),
        ("ln_f", "epilogue"), ("head", "epilogue"),
    ]
    units = compiled("gpt").plan.units
    # The embedding dropout (no parameters) joins the wpe unit rather than being its own.
    assert units[1].module_paths == ("wpe", "drop")
    # Each block unit holds every submodule of its block and nothing else.
    for u in units[2:6]:
        assert all(p == u.name or p.startswith(u.name + ".") for p in u.module_paths)
        assert f"{u.name}.qkv" in u.module_paths and f"{u.name}.mlp.2" in u.module_paths


def test_nested_blocks_two_levels_deep_become_units():
    """encoder.stages[i].blocks[j]: the inner blocks are the units (they hold most of each
    stage's parameters); each stage's norm becomes its own unit between them."""
    assert _units("nested") == [
        ("inp", "prologue"),
        ("encoder.stages.0.blocks.0", "block"),
        ("encoder.stages.0.blocks.1", "block"),
        ("encoder.stages.0.blocks.2", "block"),
        ("encoder.stages.0.norm", "module"),
        ("encoder.stages.1.blocks.0", "block"),
        ("encoder.stages.1.blocks.1", "block"),
        ("encoder.stages.1.norm", "epilogue"),
        ("out", "epilogue"),
    ]


def test_repeated_containers_of_repeated_containers_expand_to_the_inner_blocks():
    """groups[i][j] (ModuleList of ModuleLists): every inner block is a unit."""
    blocks = [f"groups.{i}.{j}" for i in range(2) for j in range(3)]
    assert find_unit_roots(GroupedNet()) == tuple(blocks)
    assert _units("grouped_net") == ([("inp", "prologue")] + [(b, "block") for b in blocks]
                                     + [("out", "epilogue")])


def test_mlp_units_are_top_level_children_with_activations_merged():
    """nn.Sequential of different layer types has no repeated block: one unit per
    top-level child that has parameters; each activation joins the Linear before it."""
    units = compiled("mlp").plan.units
    assert [(u.name, u.kind) for u in units] == [("0", "module"), ("2", "module"),
                                                 ("4", "module"), ("6", "module")]
    assert [u.module_paths for u in units] == [("0", "1"), ("2", "3"), ("4", "5"), ("6",)]


def test_convnet_units_merge_parameterless_children():
    """The pooling layer (no parameters) joins conv2; the F.relu calls made in the model's
    own forward (glue) join the unit before them."""
    units = compiled("convnet").plan.units
    assert [u.name for u in units] == ["stem", "conv1", "conv2", "fc"]
    assert units[2].module_paths == ("conv2", "pool")
    program = compiled("convnet").plan.program
    code = program.units[0].module.code
    assert "convolution" in code or "conv2d" in code
    assert "relu" in code  # the relu after the stem ran in ConvNet.forward, not in stem


def test_bnnet_and_branchy_units():
    assert _units("bnnet") == [("layers.0", "block"), ("layers.1", "block"),
                               ("layers.2", "block"), ("head", "epilogue")]
    assert _units("branchy") == [("short", "prologue"), ("blocks.0", "block"),
                                 ("blocks.1", "block"), ("blocks.2", "block"),
                                 ("head", "epilogue")]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


@pytest.mark.parametrize("build, expected", [
    # A repeated container as the model itself.
    (lambda: nn.Sequential(_Block(), _Block(), _Block()), ("0", "1", "2")),
    # Mixed types: not a repeated container, no unit roots (units come from children).
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), ()),
    # One child is not "repeated".
    (lambda: nn.ModuleDict({"blocks": nn.ModuleList([_Block()])}), ()),
    # Parameter-less children (activations) do not make a repeated container.
    (lambda: nn.ModuleDict({"acts": nn.ModuleList([nn.ReLU(), nn.ReLU()])}), ()),
    # Repeated children found below ordinary modules, with their full paths.
    (lambda: nn.ModuleDict({"enc": nn.ModuleDict({"layers": nn.ModuleList(
        [_Block(), _Block()])}), "head": nn.Linear(4, 2)}), ("enc.layers.0", "enc.layers.1")),
    # Two separate repeated containers.
    (lambda: nn.ModuleDict({"a": nn.ModuleList([_Block(), _Block()]),
                            "b": nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])}),
     ("a.0", "a.1", "b.0", "b.1")),
    # Sequential of Sequentials of identical blocks: the inner blocks.
    (lambda: nn.Sequential(nn.Sequential(_Block(), _Block()), nn.Sequential(_Block(), _Block())),
     ("0.0", "0.1", "1.0", "1.1")),
])
def test_find_unit_roots(build, expected):
    assert find_unit_roots(build()) == expected


def test_find_unit_roots_on_zoo_models():
    assert find_unit_roots(models.GPT()) == ("h.0", "h.1", "h.2", "h.3")
    assert find_unit_roots(models.BNNet()) == ("layers.0", "layers.1", "layers.2")
    assert find_unit_roots(models.ConvNet()) == ()
    # A stage whose blocks cover too little of its parameters stays one unit.
    stage_heavy = models.Nested()
    for stage in stage_heavy.encoder.stages:
        stage.norm = nn.Linear(16, 16 * 40)  # dwarfs the blocks' parameters
    assert find_unit_roots(stage_heavy) == ("encoder.stages.0", "encoder.stages.1")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_every_node_in_exactly_one_contiguous_unit(name):
    """Every computing node belongs to one unit; units are contiguous, non-empty runs in
    graph order, so a node only reads state, user inputs or values of its own or an
    earlier unit."""
    c = compiled(name)
    graph = c.traced.graph_module.graph
    computing = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    assert set(c.layers.node_unit) == {n.name for n in computing}
    order = [c.layers.node_unit[n.name] for n in computing]
    assert order == sorted(order), "units are not contiguous in graph order"
    assert sorted(set(order)) == list(range(len(c.layers.units)))
    for unit in c.layers.units:
        assert unit.num_nodes == order.count(unit.index)
    for node in computing:
        for arg in node.all_input_nodes:
            if arg.op != "placeholder":
                assert c.layers.node_unit[arg.name] <= c.layers.node_unit[node.name]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_unit_programs_read_only_earlier_values(name):
    """The unit programs' explicit signatures agree: every input of unit i is a user input
    or an output of a unit before i; every state name is a state slot."""
    program = compiled(name).plan.program
    available = {n for n in program.inputs.names if n is not None}
    state = {s.name for s in program.state}
    for unit in program.units:
        assert set(unit.inputs) <= available, (unit.name, set(unit.inputs) - available)
        assert set(unit.state) <= state
        assert not set(unit.outputs) & available  # nothing is produced twice
        available |= set(unit.outputs)
    for ref in program.outputs:
        assert ref.value is None or ref.value in available


class _Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent: export fails, torch.fx keeps the block opaque
            return self.fc(x)
        return -self.fc(x)


class _WritesAcrossUnits(nn.Module):
    """h is made by blocks.0 and written in place (torch-level ``add_``) after blocks.1."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Opaque() for _ in range(3)])

    def forward(self, x):
        h = self.blocks[0](x)
        h.add_(self.blocks[1](x))
        return self.blocks[2](h)


def test_torch_level_inplace_write_stays_with_its_definition():
    """The torch.fx fallback's graphs are torch-level (``call_method add_``, no schema): the
    write joins the unit that made ``h``, and training equals eager on 3 devices."""
    torch.manual_seed(0)
    model, x = _WritesAcrossUnits(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=1))
    loss = pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum())
    assert pipe.plan.program.trace_method == "fx"
    assert [u.name for u in pipe.plan.units] == ["blocks.0", "blocks.2"]
    ref = eager(x).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for p, q in zip(pipe.optim_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    pipe.close()


def test_experts_in_a_module_list_are_not_units_the_layers_are():
    """Experts hold most of each layer's parameters (so they look like nested blocks),
    but they do not feed one another: the layers are the units."""
    import copy

    import reference
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from roundpipe.compiler import analyze

    torch.manual_seed(0)
    model = models.SoftMoE(d=16, layers=3, in_features=8).double()
    x = torch.randn(6, 8, dtype=torch.float64)
    assert find_unit_roots(model)[0] == "layers.0.experts.0"  # the module tree alone
    analysis = analyze(model, (x,))
    assert [u.name for u in analysis.units] == ["inp", "layers.0", "layers.1", "layers.2",
                                                "out"]
    y = torch.randn(6, 2, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=torch.nn.functional.mse_loss)
    ref = reference.eager_forward_backward(eager, (x,), {}, y, torch.nn.functional.mse_loss, 2)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=0)
    for p, q in zip(pipe.optim_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    pipe.close()


class _Step(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.tanh(self.lin(x)))


class _SharedLayer(nn.Module):
    """ALBERT's shape: one layer (in a one-element ModuleList) applied several times in a
    row, glue between the applications, a separate module between two such loops."""

    def __init__(self, d: int = 8, times: int = 4) -> None:
        super().__init__()
        self.times = times
        self.embed = nn.Linear(d, d)
        self.groups = nn.ModuleList([_Step(d)])
        self.mid = nn.Linear(d, d)
        self.other = _Step(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for _ in range(self.times):
            x = self.groups[0](x) * 0.9  # glue between applications
        x = self.mid(x)
        for _ in range(2):
            x = self.other(x)
        return self.head(x)


def _shared_layer_run(devices: int):
    torch.manual_seed(0)
    model = _SharedLayer().double()
    x = torch.randn(12, 8, dtype=torch.float64)
    y = torch.randn(12, 3, dtype=torch.float64)
    loss_fn = lambda o, t: ((o - t) ** 2).sum()  # noqa: E731
    ref = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    return pipe, ref, loss, (x, y, loss_fn)


def test_a_layer_applied_several_times_in_a_row_is_a_unit_per_application():
    pipe, _, _, _ = _shared_layer_run(2)
    names = [(u.name, u.kind) for u in pipe.plan.units]
    assert names == [("embed", "prologue"),
                     ("groups.0", "block"), ("groups.0#2", "block"),
                     ("groups.0#3", "block"), ("groups.0#4", "block"),
                     ("mid", "module"), ("other", "block"), ("other#2", "block"),
                     ("head", "epilogue")]
    # the plan can cut between applications: the shared weights go with every stage
    # that applies them
    stages_with_groups = [s for s in pipe.plan.stages
                          if any(pipe.plan.units[i].name.startswith("groups.0")
                                 for i in range(*s.units))]
    assert len({s.units for s in stages_with_groups}) >= 2
    pipe.close()


def _assert_matches_eager(pipe, ref, loss, x, y, loss_fn, num_mb):
    import reference
    expected = reference.eager_forward_backward(ref, (x,), {}, y, loss_fn, num_mb)
    assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    got = dict(pipe.model.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name].grad, p.grad, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("devices", [1, 3])
def test_a_layer_applied_several_times_trains_like_eager(devices):
    pipe, ref, loss, (x, y, loss_fn) = _shared_layer_run(devices)
    _assert_matches_eager(pipe, ref, loss, x, y, loss_fn, 3)
    pipe.close()


def test_applications_split_identically_on_any_device_count():
    grads = []
    for devices in (1, 2, 4):
        pipe, _, loss, _ = _shared_layer_run(devices)
        grads.append((loss, {n: p.grad.clone() for n, p in pipe.model.named_parameters()}))
        pipe.close()
    for loss, g in grads[1:]:
        assert torch.equal(loss, grads[0][0])
        assert all(torch.equal(g[n], grads[0][1][n]) for n in g)


def test_a_module_called_in_separate_places_is_not_a_repeated_block():
    """Two calls with another parameterised module between them are weight sharing, not a
    loop: the units keep their old kinds (the tied-module case)."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.mid = nn.Linear(8, 8)

        def forward(self, x):
            return self.shared(self.mid(self.shared(x)))

    pipe = RoundPipe(Tied(), devices=["cpu"])
    pipe.forward_backward(input_args=(torch.randn(4, 8),), label=torch.randn(4, 8),
                          loss_fn=lambda o, t: ((o - t) ** 2).mean())
    assert [(u.name, u.kind) for u in pipe.plan.units] == [
        ("shared", "module"), ("mid", "module"), ("shared#2", "module")]
    pipe.close()


def test_a_long_loop_gets_at_most_sixteen_units_of_consecutive_applications():
    """A recurrent cell over 40 steps: units of 3 applications (ceil(40 / 16)), so the
    host work per microbatch stays bounded; trains like eager."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.GRUCell(4, 8)
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            h = torch.zeros(x.shape[0], 8, dtype=x.dtype)
            for t in range(40):
                h = self.cell(x[:, t], h)
            return self.out(h)

    torch.manual_seed(0)
    model = Recurrent().double()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 40, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    loss_fn = lambda o, t: ((o - t) ** 2).sum()  # noqa: E731
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    cells = [u for u in pipe.plan.units if u.name.startswith("cell")]
    assert len(cells) == 14 and cells[0].name == "cell" and cells[-1].name == "cell#14"
    _assert_matches_eager(pipe, ref, loss, x, y, loss_fn, 2)
    pipe.close()


def test_a_block_of_a_module_list_looped_many_times_is_capped_too():
    """The cap holds for unit roots as well: blocks[1] applied 40 times in a row."""

    class Looped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([_Step(8), _Step(8)])
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            x = self.blocks[0](self.inp(x))
            for _ in range(40):
                x = self.blocks[1](x)
            return self.out(x)

    pipe = RoundPipe(Looped(), devices=["cpu"])
    pipe.forward_backward(input_args=(torch.randn(4, 4),), label=torch.randn(4, 2),
                          loss_fn=lambda o, t: ((o - t) ** 2).mean())
    looped = [u.name for u in pipe.plan.units if u.name.startswith("blocks.1")]
    assert looped[0] == "blocks.1" and looped[-1] == "blocks.1#14" and len(looped) == 14
    pipe.close()
