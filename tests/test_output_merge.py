"""``pipe(x)`` returns what eager ``model(x)`` returns on the whole batch, for every output,
or raises a MergeError naming the output and the ``merge_output`` choices.

Outputs computed sample by sample are concatenated; outputs that mix samples (means,
sums, sizes, a Hugging Face model's mean loss over the tokens it does not ignore) are
recomputed once on the whole batch from the per-sample values they depend on
(``passes/output_merge.py``).  They used to be added (``x.mean()`` doubled, HF losses
``num_microbatch`` times too large) or taken from the first microbatch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_models as hf
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import MergeError, TraceError


class Reductions(nn.Module):
    """The issue's model: a per-sample output, a mean over the batch, a mean over
    everything and the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> Any:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x, x.mean(0), x.mean(), x.shape[0]


@dataclasses.dataclass
class Out:
    value: torch.Tensor
    total: torch.Tensor


torch.utils._pytree.register_dataclass(Out)

REDUCTIONS: dict[str, Callable[[torch.Tensor], Any]] = {
    "sum": lambda h: h.sum(),
    "mean": lambda h: h.mean(),
    "mean0": lambda h: h.mean(0),
    "sum0_keepdim": lambda h: h.sum(0, keepdim=True),
    "max0": lambda h: h.amax(0),
    "std": lambda h: h.std(),
    "logsumexp0": lambda h: torch.logsumexp(h, 0),
    "size": lambda h: h.shape[0] * 2,
    "numel": lambda h: torch.tensor(h.numel(), dtype=h.dtype),
    "normalized": lambda h: h / h.norm(),
    "centered": lambda h: h - h.mean(0, keepdim=True),
    "time_major": lambda h: h.t(),
    "flattened": lambda h: h.reshape(-1),
    "dict": lambda h: {"per_sample": h * 2, "mean": h.mean()},
    "dataclass": lambda h: Out(h, h.sum()),
    "gram": lambda h: h.t() @ h,
}


class Reducing(nn.Module):
    """Two blocks (two stages on two devices), then the output under test: each case
    traces its own model, and a third block only made every trace longer."""

    def __init__(self, reduce: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> Any:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.reduce(x)


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _check(model: nn.Module, x: torch.Tensor, devices: int, num_mb: int) -> None:
    eager = copy.deepcopy(model)
    with RoundPipe(model, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=num_mb)) as pipe:
        out = pipe(x)
        ref = eager(x)
        got, want = torch.utils._pytree.tree_flatten(out), torch.utils._pytree.tree_flatten(ref)
        assert got[1] == want[1]
        for a, b in zip(got[0], want[0]):
            if isinstance(b, torch.Tensor):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            else:
                assert a == b
        # gradients through every floating output equal eager's
        if not any(o.requires_grad for o in _floats(ref)):
            return
        sum(o.sum() * (i + 1) for i, o in enumerate(_floats(out))).backward()
        sum(o.sum() * (i + 1) for i, o in enumerate(_floats(ref))).backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("devices, num_mb, batch", [(1, 3, 6), (2, 3, 7), (3, 4, 9)])
def test_batch_reduced_outputs_equal_eager(devices: int, num_mb: int, batch: int) -> None:
    torch.manual_seed(0)
    _check(Reductions().double(), torch.randn(batch, 4, dtype=torch.double), devices, num_mb)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_every_kind_of_output_equals_eager(name: str) -> None:
    torch.manual_seed(0)
    _check(Reducing(REDUCTIONS[name]).double(), torch.randn(7, 4, dtype=torch.double), 2, 3)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("devices", [1, 3])
def test_hugging_face_loss_equals_eager(train: bool, devices: int) -> None:
    """The model's own loss is a mean over the tokens whose label is not -100: the rows
    of the batch have different counts of those, so no rule on per-microbatch losses
    gives it; it is recomputed on the whole batch."""
    model = hf.build("llama", torch.float64).train(train)
    eager = copy.deepcopy(model)
    inputs, labels = hf.batch("llama")
    labels[1, 2:] = -100  # rows ignore different numbers of tokens
    with RoundPipe(model, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        out = pipe(**inputs, labels=labels)
        ref = eager(**inputs, labels=labels)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-10, atol=1e-12)
        out.loss.backward()
        ref.loss.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
        with torch.no_grad():  # validation
            torch.testing.assert_close(pipe(**inputs, labels=labels).loss, ref.loss,
                                       rtol=1e-12, atol=0)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
                                    for _ in range(2))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_an_output_that_cannot_be_merged_exactly_is_an_error() -> None:
    """BatchNorm in training mode normalises each microbatch by its own statistics: no
    merge gives eager's whole-batch result.  The error names the output, the op and the
    ways out; asking for per-microbatch results works."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.double)
    with RoundPipe(Normed().double(), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        with pytest.raises(MergeError) as error:
            pipe(x)
        message = str(error.value)
        for part in ("the output", "batch_norm", "blocks.0", "merge_output", "num_microbatch=1"):
            assert part in message, part
        assert pipe(x, run_config=RoundPipeRunConfig(merge_output=0)).shape == (6, 1)
        assert pipe(x, run_config=RoundPipeRunConfig(num_microbatch=1)).shape == (6, 1)
        pipe.model.eval()  # running statistics: per sample again
        eager = copy.deepcopy(pipe.model)
        torch.testing.assert_close(pipe(x), eager(x), rtol=1e-12, atol=1e-12)


def test_forward_backward_outputs_keep_per_microbatch_results_where_none_is_exact() -> None:
    """forward_backward's outputs, like its loss, are per microbatch where no exact merge
    exists (BatchNorm in training), and exact where one does."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.double)
    with RoundPipe(Normed().double(), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        _, out = pipe.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.sum(),
                                       return_outputs=True)
        assert out.shape == (6, 1)
    with RoundPipe(Reductions().double(), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        eager = copy.deepcopy(pipe.model)
        _, out = pipe.forward_backward(input_args=(x,), loss_fn=lambda o, _: o[0].sum(),
                                       return_outputs=True)
        ref = eager(x)
        torch.testing.assert_close(out[2], ref[2], rtol=1e-12, atol=0)
        assert out[3] == 6


def test_plan_shows_the_last_calls_run_config() -> None:
    """pipe.plan is the plan of the most recent call, per-call overrides included."""
    torch.manual_seed(0)
    x = torch.randn(8, 4, dtype=torch.double)
    with RoundPipe(Reducing(REDUCTIONS["mean0"]).double(), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        pipe(x)
        assert pipe.plan.num_microbatch == 2
        pipe(x, run_config=RoundPipeRunConfig(num_microbatch=4))
        assert pipe.plan.num_microbatch == 4
        pipe(x)
        assert pipe.plan.num_microbatch == 2
        assert len(pipe.plans) == 1  # one program, partitioned again without tracing


def test_save_pretrained_writes_the_users_use_cache(tmp_path) -> None:
    model = hf.build("llama")
    assert model.config.use_cache is True
    with RoundPipe(model, devices=["cpu"]) as pipe:
        assert model.config.use_cache is False  # off for training
        pipe.save_pretrained(tmp_path)
        assert model.config.use_cache is False
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["use_cache"] is True


# --- never a silently different number -------------------------------------------------------

_TABLE = torch.randn(16, 4, dtype=torch.double)  # replicated, sliced to the batch size

TRICKY: dict[str, Callable[[torch.Tensor], Any]] = {
    "roll_batch": lambda h: torch.roll(h, 1, 0),
    "roll_features": lambda h: torch.roll(h, 1, 1),
    "flip_batch": lambda h: h.flip(0),
    "norm_p_dim1": lambda h: torch.norm(h, 2, 1),
    "norm_p_dim0": lambda h: torch.norm(h, 2, 0),
    "vector_norm": lambda h: torch.linalg.vector_norm(h, 2, dim=1),
    "gather_replicated_index": lambda h: torch.gather(h, 1, torch.zeros(1, 2, dtype=torch.long)),
    "gather_own_index": lambda h: torch.gather(h, 1, h.argmax(1, keepdim=True)),
    "full_batch_size": lambda h: h + torch.full((h.shape[0], 1), h.shape[0], dtype=h.dtype),
    "tril_over_batch": lambda h: torch.tril(h),
    "tril_per_sample": lambda h: torch.tril(h.unsqueeze(2) * h.unsqueeze(1)),
    "hinge_mean": lambda h: F.hinge_embedding_loss(h, torch.ones_like(h)),
    "mse_none": lambda h: F.mse_loss(h, torch.zeros_like(h), reduction="none"),
    "replicated_rows": lambda h: h * _TABLE[:h.shape[0]],
    "bmm_replicated": lambda h: torch.bmm(h.unsqueeze(1), torch.ones(h.shape[0], 4, 2,
                                                                      dtype=h.dtype)),
    "cumsum_batch": lambda h: h.cumsum(0),
    "sort_features": lambda h: h.sort(1).values,
    "topk_batch": lambda h: h.topk(2, 0).values,
    "softmax_batch": lambda h: h.softmax(0),
    "index_sample_numbers": lambda h: h[torch.arange(h.shape[0]), h.argmax(1)],
    "index_replicated_rows": lambda h: h[torch.zeros(h.shape[0], dtype=torch.long)],
    "cat_batch": lambda h: torch.cat([h, h], 0),
    "stack_batch": lambda h: torch.stack([h, h], 1),
    "expand_mean": lambda h: h.mean(0, keepdim=True).expand(h.shape),
    "var_keepdim": lambda h: h.var(1, keepdim=True),
    "scatter_topk_features": lambda h: torch.zeros_like(h).scatter(
        1, h.topk(2, 1).indices, h.topk(2, 1).values),
    "scatter_add_own_index": lambda h: h.scatter_add(1, h.argsort(1), h * 2),
    "scatter_reduce_own_index": lambda h: h.scatter_reduce(1, h.argsort(1), h, "amax"),
    "scatter_value": lambda h: h.scatter(1, h.argmax(1, keepdim=True), 5.0),
    "scatter_batch_dim": lambda h: torch.zeros_like(h).scatter(0, h.argsort(0), h),
    "scatter_batch_sized_index": lambda h: torch.zeros_like(h).scatter_add(
        1, torch.zeros(h.shape[0], 1, dtype=torch.long), h[:, :1]),
    "scatter_replicated_index": lambda h: h + torch.zeros_like(h).scatter_add(
        1, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=h.dtype)),
    "scatter_into_replicated": lambda h: torch.zeros(16, 4, dtype=h.dtype)[:h.shape[0]]
        .scatter(1, h.argsort(1), h),
    # einsum: per sample only while the batch's letter is kept, in batch operands only
    "einsum_rows": lambda h: torch.einsum("bi,ij->bj", h, _TABLE[:4]),
    "einsum_implicit": lambda h: torch.einsum("bi,ij", h, _TABLE[:4]),
    "einsum_ellipsis": lambda h: torch.einsum("...i,ij->...j", h.unsqueeze(1), _TABLE[:4]),
    "einsum_batch_moved": lambda h: torch.einsum("bi,ij->jb", h, _TABLE[:4]),
    "einsum_pairs_own_rows": lambda h: torch.einsum("bi,bj->bij", h, h.tanh()),
    "einsum_contracts_batch": lambda h: torch.einsum("bi,bj->ij", h, h),
    "einsum_crosses_samples": lambda h: torch.einsum("bi,cj->bcij", h, h),
    "einsum_implicit_sums_batch": lambda h: torch.einsum("bi,bi", h, h),
    "einsum_replicated_rows": lambda h: torch.einsum("bi,bi->bi", h, _TABLE[:h.shape[0]]),
    "cdist_rows": lambda h: torch.cdist(h, _TABLE[:5]),
    "cdist_columns": lambda h: torch.cdist(_TABLE[:5], h),
    "cdist_between_samples": lambda h: torch.cdist(h, h),
    "polar": lambda h: torch.view_as_real(torch.polar(h.abs(), h)),
    "glu_features": lambda h: F.glu(h, 1),
    "glu_batch": lambda h: F.glu(h[:6], 0),
    "rfft_features": lambda h: torch.fft.rfft(h, dim=1).abs(),
    "fft_batch": lambda h: torch.fft.fft(h, dim=0).abs(),
    "diff_features": lambda h: torch.diff(h, dim=1),
    "diff_batch": lambda h: torch.diff(h, dim=0),
    "one_hot_sized": lambda h: F.one_hot(h.argmax(1), 4).to(h.dtype),
    "one_hot_by_batch_max": lambda h: F.one_hot(h.argmax(1)).to(h.dtype),
    "repeat_features": lambda h: h.repeat(2, 1, 3)[0],
    "repeat_batch": lambda h: h.repeat(2, 1),
    "tile_features": lambda h: torch.tile(h, (1, 2)),
    "movedim": lambda h: torch.movedim(h.unsqueeze(1).expand(-1, 3, -1), 0, 2),
    "renorm_samples": lambda h: torch.renorm(h, 2, 0, 0.5),
    "renorm_features": lambda h: torch.renorm(h, 2, 1, 0.5),
    "unfold_features": lambda h: h.unfold(1, 2, 1),
    "index_fill_features": lambda h: h.index_fill(1, torch.tensor([0, 2]), -1.0),
    "index_fill_batch": lambda h: h.index_fill(0, torch.tensor([0]), -1.0),
    "normalize": lambda h: F.normalize(h, dim=1),
    "log_sigmoid": lambda h: F.logsigmoid(h),
    "bucketize": lambda h: torch.bucketize(h, _TABLE[0].sort().values).to(h.dtype),
    "aminmax_features": lambda h: torch.aminmax(h, dim=1).min,
    "max_pool_indices": lambda h: F.max_pool1d(h.unsqueeze(1), 2, return_indices=True)[1]
        .to(h.dtype),
}

# Per-sample scatters that must merge (top-k routing in mixture-of-experts layers).
MERGEABLE = {"scatter_topk_features", "scatter_add_own_index", "scatter_reduce_own_index",
             "scatter_value", "scatter_batch_sized_index", "einsum_rows", "einsum_implicit",
             "einsum_ellipsis", "einsum_batch_moved", "einsum_pairs_own_rows", "cdist_rows",
             "cdist_columns", "polar", "glu_features", "rfft_features", "diff_features",
             "one_hot_sized", "repeat_features", "tile_features",
             "movedim", "renorm_samples", "unfold_features", "index_fill_features",
             "normalize", "log_sigmoid", "bucketize", "aminmax_features", "max_pool_indices"}


@pytest.mark.parametrize("then_trainable", [False, True], ids=["last", "then_trainable"])
@pytest.mark.parametrize("name", sorted(TRICKY))
def test_an_output_equals_eager_or_the_call_refuses(name: str, then_trainable: bool) -> None:
    """Ops whose arguments are easy to misread (a dim after a ``p``, ``shifts`` before
    ``dims``, a replicated index): the output is eager's, or MergeError; never another
    number.  Followed by a trainable scale, a value that mixes samples can no longer be
    recomputed after the pipeline, so what the merge pass claims about the op itself is
    checked: a claimed per-sample value is concatenated and must equal eager's."""
    torch.manual_seed(0)
    model = (_ThenScale if then_trainable else Reducing)(TRICKY[name]).double()
    _merges_or_refuses(model, name, must_merge=name in MERGEABLE)


def _merges_or_refuses(model: nn.Module, what: str, must_merge: bool,
                       exported: bool = False) -> None:
    """pipe(x) over 3 microbatches of a batch of 7 equals eager, or raises MergeError
    (then ``must_merge`` fails the test; ``exported``: the refusal must come from the
    export's proof, not the torch.fx fallback's lack of one)."""
    eager = copy.deepcopy(model)
    x = torch.randn(7, 4, dtype=torch.double)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        try:
            with torch.no_grad():
                out = pipe(x)
        except MergeError:
            assert not exported or pipe.plan.program.trace_method == "export", what
            assert not must_merge, what
            return
        except TraceError as e:
            # the op cannot run on a microbatch at all (glu over 3 rows): said at once
            assert "cannot run the example input" in str(e), what
            assert not must_merge, what
            return
        with torch.no_grad():
            ref = eager(x)
        for a, b in zip(torch.utils._pytree.tree_leaves(out),
                        torch.utils._pytree.tree_leaves(ref)):
            assert a.shape == b.shape, what
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=what)


class _ThenScale(nn.Module):
    """The op under test, then a trainable scale."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner = Reducing(op)
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.double))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


class ThenLinear(nn.Module):
    """The op under test before trainable weights: it runs in the microbatches, not in
    the output tail on the merged batch."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner = Reducing(op)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


@pytest.mark.parametrize("name", sorted(n for n in TRICKY if n.startswith("scatter")))
def test_a_per_sample_op_before_weights_merges_exactly(name: str) -> None:
    torch.manual_seed(0)
    model = ThenLinear(TRICKY[name]).double()
    eager = copy.deepcopy(model)
    x = torch.randn(7, 4, dtype=torch.double)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        if name not in MERGEABLE:
            with pytest.raises(MergeError, match="scatters across the batch|mix of samples"):
                pipe(x)
            return
        out = pipe(x)
        out.pow(2).sum().backward()
        eager(x).pow(2).sum().backward()
        torch.testing.assert_close(out, eager(x), rtol=1e-12, atol=1e-12)
        for (n, g), p in zip(pipe.optim_named_parameters(), eager.parameters()):
            torch.testing.assert_close(g.grad, p.grad, rtol=1e-10, atol=1e-12, msg=n)


class _Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_outputs_through_an_opaque_module_need_merge_output() -> None:
    """A leaf module's Python is not in the graph: nothing proves it keeps samples apart
    (it could normalise over the batch), so pipe(x) asks rather than guesses."""
    torch.manual_seed(0)
    model = nn.Sequential(_Leaf(), _Leaf(), nn.Linear(4, 1)).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.double)
    with RoundPipe(model, devices=["cpu"] * 2, leaf_modules=[_Leaf],
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        with pytest.raises(MergeError, match="_Leaf at 0 runs as Python"):
            pipe(x)
        torch.testing.assert_close(pipe(x, run_config=RoundPipeRunConfig(merge_output=0)),
                                   eager(x), rtol=1e-12, atol=1e-12)


class _Mixer(nn.Module):
    """Ends in a matmul with its own weight: the output's batch dimension is found from
    that weight's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.centers = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(x), -1) @ self.centers


def test_ops_on_the_weights_of_a_repeated_blocks_copies_merge_by_their_shapes() -> None:
    """A repeated block is traced once and copied; its copies' weights became
    placeholders without a recorded shape, which the merge pass read as 0-dim: pipe(x)
    concatenated the last block's output along the wrong dimension ((2, 24) for eager's
    (6, 8)).  Every state placeholder now records its shape."""
    from roundpipe.passes.trace import trace
    torch.manual_seed(0)
    model = nn.Sequential(*(_Mixer() for _ in range(3))).double()
    x = torch.randn(6, 8, dtype=torch.double)
    traced = trace(model, (x,))
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder" and node.name in {s.name for s in traced.state}:
            assert tuple(node.meta["val"].shape) == tuple(
                traced.state_tensors[node.name].shape), node.name
    for devices, num_mb in ((1, 3), (2, 3)):
        _check(copy.deepcopy(model), x, devices, num_mb)



class _Einsum(nn.Module):
    def __init__(self, perm: list[int], equation: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.double))
        self.perm, self.equation = perm, equation
        sizes = {"i": 2, "j": 2, "k": 3}  # the replicated operand's letters
        self.register_buffer("rep", torch.randn([sizes[c] for c in
                                                 equation.split(",")[1].split("-")[0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)).reshape(x.shape[0], 2, 2).permute(self.perm)
        return torch.einsum(self.equation, h, self.rep) * self.scale


EQUATIONS = dict(perm=st.permutations([0, 1, 2]), rep=st.permutations("ijk"),
                 rep_len=st.integers(1, 3), out=st.permutations("bijk"),
                 out_len=st.integers(0, 4))


def einsum_equation(perm, rep, rep_len, out, out_len) -> tuple[str, str]:
    """An equation over a batch operand (``b`` at ``perm``'s place) and a replicated one
    (``rep_len`` of ``rep``'s letters), and its output term."""
    batch_term = "".join("bij"[p] for p in perm)
    rep_term = "".join(rep[:rep_len])
    used = set(batch_term) | set(rep_term)
    out_term = "".join(c for c in out[:out_len] if c in used)
    return f"{batch_term},{rep_term}->{out_term}", out_term


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(**EQUATIONS)
def test_einsum_merges_exactly_when_each_sample_keeps_its_own_letter(perm, rep, rep_len,
                                                                      out, out_len):
    """Random equations over a batch operand (the batch's letter b anywhere) and a
    replicated one: pipe(x) equals eager and merges whenever b is kept in the output;
    otherwise it refuses."""
    equation, out_term = einsum_equation(perm, rep, rep_len, out, out_len)
    torch.manual_seed(0)
    _merges_or_refuses(_Einsum(list(perm), equation).double(), equation,
                       must_merge="b" in out_term, exported=True)


class _FirstRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h[:3] + h[:3, :].tanh()  # at a microbatch of 2, [:3] is no slice at all


def test_a_tail_traced_for_a_fixed_microbatch_size_is_refused_not_run_on_the_batch() -> None:
    """The output mixes samples, so it is recomputed on the whole batch; but the trace at a
    microbatch of 2 fixed the batch at 2 and dropped one slice as a no-op.  That program
    failed on the batch of 6 with a size mismatch deep in the tail; it is now a MergeError
    naming the guard, and one microbatch is exact."""
    torch.manual_seed(0)
    model = _FirstRows().double()
    x = torch.randn(6, 4, dtype=torch.double)
    with RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        with pytest.raises(MergeError, match=r"fixed at 2 .*whole batch has 6"):
            pipe(x)
    with RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=1)) as pipe:
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-12, atol=1e-12)
