"""The end-to-end test of the compiler (issue 2): composing the generated stage programs in
order on one device reproduces the original model exactly, for every zoo model, in float32
and float64, at the example's shapes and at other batch sizes / sequence lengths.  Also:
the generated code is readable, random ops are rewritten to keyed streams, and device
constants follow the executing device.

Equality is exact (``torch.equal``) in both dtypes: the stage programs run the same ATen
ops in the same order as the eager model, only split into functions, so nothing may change
a single bit.
"""

from __future__ import annotations

import pytest
import torch

import models
from compiled import (EXTRA, assert_same_structure_and_values, compiled,
                      eager_and_staged, run_stages)
from roundpipe.ops.rng import RngKey

DTYPES = [torch.float32, torch.float64]
ALL_MODELS = list(models.ALL) + ["const_net", "grouped_net"]


def _inputs(name: str, dtype: torch.dtype, batch: int, seq: int):
    """Fresh inputs of another size (the model itself comes from the cached compile)."""
    if name == "gpt":
        _, args, kwargs = models.gpt(batch=batch, seq=seq)
    else:
        factory = models.ALL.get(name) or EXTRA[name]
        _, args, kwargs = factory(batch=batch)
    _, args, kwargs = models.to_dtype(torch.nn.Identity(), args, kwargs, dtype)
    return args, kwargs


def _other_sizes(name: str) -> list[tuple[int, int]]:
    """(batch, seq) pairs that differ from the example (GPT: batch 4, seq 8).  BatchNorm in
    training mode cannot normalise a batch of 1 (eager raises too), so bnnet uses 3 and 5."""
    if name == "bnnet":
        return [(3, 0), (5, 0)]
    return [(1, 5), (3, 11)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_composed_stages_reproduce_the_model(name, dtype):
    c = compiled(name, dtype)
    expected, got, eager_model, staged_model = eager_and_staged(c, c.args, c.kwargs)
    assert_same_structure_and_values(expected, got)
    # Buffers the call updated in place (BatchNorm running stats) match as well.
    for (fqn, e), g in zip(eager_model.named_buffers(), staged_model.buffers()):
        assert torch.equal(e, g), fqn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_composed_stages_run_at_other_shapes(name, dtype):
    """One trace serves other batch sizes and sequence lengths (dynamic shapes)."""
    c = compiled(name, dtype)
    example_leading = c.args[0].shape[0]
    for batch, seq in _other_sizes(name):
        assert batch != example_leading
        args, kwargs = _inputs(name, dtype, batch, seq)
        expected, got, _, _ = eager_and_staged(c, args, kwargs)
        assert_same_structure_and_values(expected, got)
        assert next(iter(torch.utils._pytree.tree_leaves(got))).shape[0] == batch


def test_stage_modules_cover_every_unit_in_order():
    """The forward stages followed by the fused stage are the units 0..n-1 in order; the
    composition above therefore ran every unit exactly once."""
    for name in ALL_MODELS:
        plan = compiled(name).plan
        ranges = [s.units for s in plan.stages if s.kind != "bwd"]
        covered = [u for a, b in ranges for u in range(a, b)]
        assert covered == list(range(len(plan.units))), name
        for spec, module in zip(plan.stages, plan.stage_modules):
            calls = [n.target for n in module.graph.nodes if n.op == "call_module"]
            assert calls == [f"units.unit_{u}" for u in range(*spec.units)]


def test_dropout_in_eval_mode_is_the_identity():
    """A model with real dropout (p = 0.5), compiled in eval mode, matches eager eval."""
    c = compiled("drop_net", eval_mode=True)
    expected, got, _, _ = eager_and_staged(c, c.args, c.kwargs)
    assert_same_structure_and_values(expected, got)


def test_dropout_masks_are_keyed_by_microbatch_and_unit():
    """In training mode the masks come from the key: the same key gives the same output
    (forward and recompute agree), another microbatch or call gives another mask, and the
    masks of different units differ."""
    c = compiled("drop_net")
    x = torch.ones(4, 16)

    def run(key):
        with torch.no_grad():
            return run_stages(c.plan, c.model, (x,), {}, key=key)

    torch.manual_seed(1)
    first = run(RngKey(0, 0, 0))
    torch.manual_seed(2)  # the global generator plays no part
    assert torch.equal(run(RngKey(0, 0, 0)), first)
    assert not torch.equal(run(RngKey(0, 0, 1)), first)
    assert not torch.equal(run(RngKey(0, 1, 0)), first)
    assert not torch.equal(run(RngKey(1, 0, 0)), first)
    codes = [u.module.code for u in c.plan.program.units[:3]]
    for i, code in enumerate(codes):
        # unit index i and ordinal 0 are passed to the keyed dropout
        assert f"_rng, {i}, 0)" in code


def test_stage_code_is_readable():
    plan = compiled("gpt").plan
    for i, stage in enumerate(plan.stages):
        code = plan.stage_code(i)
        assert f"# stage {i} ({stage.kind})" in code
        assert f"class Stage{i}(torch.nn.Module):" in code
        assert code.count("def forward") == 1 + (stage.units[1] - stage.units[0])
        for u in range(*stage.units):
            assert f"# unit {u}: {plan.units[u].name}" in code
        assert "generated by roundpipe passes: trace -> layers" in code
    with pytest.raises(IndexError, match="the plan has"):
        plan.stage_code(len(plan.stages))


def test_random_ops_are_rewritten_to_keyed_streams():
    """GPT with dropout > 0: every dropout becomes roundpipe's keyed dropout, none is left
    drawing from the global generator."""
    plan = compiled("gpt", dropout=0.1).plan
    units = {u.name: u for u in plan.program.units}
    for name in ("wpe", "h.0", "h.1", "h.2", "h.3"):
        code = units[name].module.code
        assert "roundpipe_ops_rng" in code, name
        assert "aten.dropout" not in code and "native_dropout" not in code
        assert units[name].needs_rng
    # The embedding dropout sits in the wpe unit; each block has two dropouts.
    assert units["wpe"].module.code.count("roundpipe_ops_rng_dropout") == 1
    assert units["h.0"].module.code.count("roundpipe_ops_rng_dropout") == 2
    assert not units["ln_f"].needs_rng and not units["head"].needs_rng
    assert "roundpipe_ops_rng" in plan.stage_code(0)


def test_device_constants_read_the_device_argument():
    """GPT's ``torch.arange(T, device=idx.device)`` was traced on the CPU; the program must
    create it on whichever device runs it, not on the trace device."""
    program = compiled("gpt").plan.program
    arange_units = [u for u in program.units if "aten.arange" in u.module.code]
    assert arange_units, "the GPT's position ids are created by aten.arange"
    for unit in arange_units:
        line = next(l for l in unit.module.code.splitlines() if "aten.arange" in l)
        assert "device = _device" in line
        assert unit.needs_device
    for unit in program.units:
        assert "device(type='cpu')" not in unit.module.code
        assert "_assert_tensor_metadata" not in unit.module.code
