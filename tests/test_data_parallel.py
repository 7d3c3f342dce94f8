"""Data parallelism across processes (torch.distributed, gloo, one machine).

Two replica processes (tests/dp_worker.py, started with the variables torchrun sets), each
with two virtual CPU devices and half of every batch, against one process with four
virtual devices and the whole batch.

Which decomposition is bitwise identical, and why.  On a device, a (parameter, unit)
gradient accumulates over the job's microbatches in order: with microbatches 0..3 in one
process it is ((g0 + g1) + g2) + g3.  Two replicas with two microbatches each produce
(g0 + g1) and (g2 + g3), and the all-reduce adds those: (g0 + g1) + (g2 + g3), which
rounds differently.  With ONE microbatch per replica and two replicas, the all-reduce
computes g0 + g1 (or g1 + g0: addition is commutative in IEEE arithmetic), exactly what
one process computes for two microbatches; the fold across units is the same code in
both.  So replicas x 1 microbatch == one process x 2 microbatches, bit for bit, and 2 x 2
== 1 x 4 only to rounding.  Averaging divides by 2, which is exact, so "mean" equals one
process whose loss is halved (a power-of-two scale commutes with every rounding step of
backward).  Dropout matches too: replica r numbers its microbatches after those of the
replicas before it, so it draws the masks of the same global microbatches.
"""

from __future__ import annotations

import os
import socket
import sys
from functools import cache
from typing import Any

import pytest
import torch

import dp_worker
from forkserver import ChildTimeout

import roundpipe
from roundpipe import DataParallelConfig, RoundPipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dp_worker.py")
WORLD = 2
LAUNCH_TIMEOUT_S = 240  # a hung launch fails the test instead of the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Launch:
    """Both replicas of one scenario group, started at once (forked from the session's
    fork server, tests/forkserver.py: fresh processes); ``results()`` waits."""

    def __init__(self, forkserver, group: str, workdir: str) -> None:
        self.group = group
        self.paths = [os.path.join(workdir, f"{group}.{r}.pt") for r in range(WORLD)]
        port = _free_port()
        self.children = []
        for rank in range(WORLD):
            # What torchrun sets for each process; init_distributed() reads them.
            renv = {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            self.children.append(forkserver.start(
                WORKER, [group, self.paths[rank]], env=renv, cwd=ROOT,
                timeout=LAUNCH_TIMEOUT_S, merge_stderr=True))
        self._results: list[dict[str, Any]] | None = None

    def results(self) -> list[dict[str, Any]]:
        if self._results is None:
            try:
                done = [child.wait() for child in self.children]  # one deadline each
            except ChildTimeout as e:
                for child in self.children:
                    child.kill()
                pytest.fail(f"the {self.group} replicas did not finish within "
                            f"{LAUNCH_TIMEOUT_S} s (a hang): {e}")
            for rank, result in enumerate(done):
                assert result.returncode == 0, \
                    f"rank {rank} exited {result.returncode}:\n{result.stdout[-3000:]}"
            self._results = [torch.load(p, weights_only=False) for p in self.paths]
        return self._results

    def scenario(self, name: str) -> list[dict[str, Any]]:
        per_rank = [r[name] for r in self.results()]
        for rank, r in enumerate(per_rank):
            assert "crash" not in r, f"rank {rank} crashed in {name}:\n{r['crash']}"
        return per_rank


@pytest.fixture(scope="module")
def launches(tmp_path_factory, forkserver) -> dict[str, _Launch]:
    # Both groups start now and run while the references are computed in this process.
    workdir = str(tmp_path_factory.mktemp("data_parallel"))
    return {g: _Launch(forkserver, g, workdir) for g in dp_worker.GROUPS}


def _assert_states_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         exact: bool) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), \
                f"{name}: max diff {(got[name] - want[name]).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _assert_replicas_identical(per_rank: list[dict[str, Any]]) -> None:
    _assert_states_equal(per_rank[1]["state"], per_rank[0]["state"], exact=True)


@cache
def _reference(*args: Any, **kwargs: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return dp_worker.reference(*args, **kwargs)


def reference(*args: Any, **kwargs: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """dp_worker.reference, computed once per set of arguments in this process (two tests
    compare with the same run); each caller gets its own copies."""
    losses, state = _reference(*args, **kwargs)
    return [l.clone() for l in losses], {k: v.clone() for k, v in state.items()}


def test_summed_gradients_equal_one_process_bit_for_bit_sgd(launches):
    want_losses, want = reference("sgd", num_microbatch=2)  # = 2 replicas x 1 microbatch
    per_rank = launches["replicas"].scenario("sgd_sum")
    for r in per_rank:
        _assert_states_equal(r["state"], want, exact=True)  # dropout and tied weights too
        assert [float(l) for l in r["losses"]] == [float(l) for l in want_losses]
        assert r["buckets"] > 3  # small buckets: several all-reduces per call
        # Overlap: the fused job's buckets (the last units) were on the wire while the
        # backward job of the first units still ran; buckets go out last unit first.
        assert r["early"] >= 1
        highest = [hi for _, hi in r["units"]]
        assert highest == sorted(highest, reverse=True)
    assert [r["info"].rank for r in per_rank] == [0, 1]
    assert all(r["info"].world_size == 2 for r in per_rank)


def test_averaged_gradients_equal_one_process_to_fp32_tolerance_adamw(launches):
    # 2 replicas x 2 microbatches against one process x 4 with the loss halved (the mean).
    want_losses, want = reference("adamw", num_microbatch=4, loss_scale=0.5)
    per_rank = launches["replicas"].scenario("adamw_mean")
    _assert_replicas_identical(per_rank)
    _assert_states_equal(per_rank[0]["state"], want, exact=False)
    torch.testing.assert_close(torch.stack(per_rank[0]["losses"]), torch.stack(want_losses),
                               rtol=1e-6, atol=1e-6)


def test_asynchronous_steps_equal_one_process_bit_for_bit(launches):
    want_losses, want = reference("adamw", num_microbatch=2, loss_scale=0.5, is_async=True)
    per_rank = launches["replicas"].scenario("adamw_async")
    for r in per_rank:
        _assert_states_equal(r["state"], want, exact=True)
        assert [float(l) for l in r["losses"]] == [float(l) for l in want_losses]


def test_zero_sharded_optimizer_and_a_checkpoint_saved_by_one_replica(launches):
    """ZeroRedundancyOptimizer stepping through pipe.step (asynchronous), a checkpoint
    written by rank 0 after two steps and loaded by both replicas: the third step lands
    exactly where three uninterrupted steps of one process do."""
    want_losses, want = reference("adamw", num_microbatch=2, loss_scale=0.5, is_async=True)
    per_rank = launches["replicas"].scenario("zero_checkpoint")
    for r in per_rank:
        _assert_states_equal(r["state"], want, exact=True)
        assert float(r["losses"][-1]) == float(want_losses[-1])
    # Each replica holds about half of AdamW's two moments.
    model = dp_worker.build_model()
    full = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(0.3 * full < r["state_bytes"] < 0.7 * full for r in per_rank)
    assert sum(r["state_bytes"] for r in per_rank) == pytest.approx(full, rel=0.01)


def test_a_sharded_checkpoint_of_2_replicas_resumes_in_1_process_bit_exactly(launches):
    """Two replicas (ZeRO, 1 microbatch each) save asynchronously, each its own shard of
    the optimizer state; one process with 2 microbatches loads it and trains on, bit for
    bit as the replicas did (and as one process would have from the start)."""
    want_losses, want = reference("adamw", num_microbatch=2, is_async=True)
    per_rank = launches["replicas"].scenario("sharded_checkpoint")
    for r in per_rank:
        _assert_states_equal(r["state"], want, exact=True)
    assert all(r["held"] > 0 for r in per_rank)  # the capped capture's late copies ran
    # Each replica wrote one data file: its optimizer shard (and half the model).
    assert [f for f in per_rank[0]["files"] if f.endswith(".distcp")] == [
        "__0_0.distcp", "__1_0.distcp"]
    pipe = RoundPipe(dp_worker.build_model(), devices=["cpu"] * 4, seed=0,
                     data_parallel=False,
                     model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=2))
    opt = dp_worker.make_optimizer("adamw", pipe.optim_parameters())
    assert roundpipe.load_checkpoint(per_rank[0]["path"], pipe, opt) == {"step": 2}
    losses = dp_worker.train(pipe, opt, [2], 0, 1, dp_worker.models.lm_loss, is_async=True)
    assert float(losses[-1]) == float(want_losses[-1])
    _assert_states_equal(dp_worker.state(pipe), want, exact=True)
    pipe.close()


def test_a_failing_replica_makes_every_replica_raise_and_none_commit(launches):
    # Rank 1's loss_fn raises in step 2 of 3; both go on with step 3.
    _, want = reference("sgd", num_microbatch=2, steps=(0, 2))
    per_rank = launches["replicas"].scenario("replica_failure")
    (kind0, msg0, ranks0), (_, elapsed0, _) = per_rank[0]["errors"]
    (kind1, msg1, _), _ = per_rank[1]["errors"]
    assert kind0 == "ReplicaError" and ranks0 == (1,)
    assert "replica 1" in msg0 and "injected failure in loss_fn" in msg0
    assert "No replica committed" in msg0
    assert float(elapsed0) < 10  # told at once, not after the 30 s timeout
    assert kind1 == "StageError" and "injected failure in loss_fn" in msg1
    assert "no replica committed this call" in msg1  # the note on the failing replica
    for r in per_rank:  # the failed call left no trace on either replica
        _assert_states_equal(r["state"], want, exact=True)


def test_a_sharded_save_failing_on_rank_0_raises_on_every_replica_at_once(launches):
    r0, r1 = launches["replicas"].scenario("failed_save")
    assert r0["error"][0] == "OSError" and "No space left" in r0["error"][1]
    assert r1["error"][0] == "CheckpointError", r1["error"]
    assert "replica 0 failed" in r1["error"][1] and "No space left" in r1["error"][1]
    assert r1["elapsed"] < 10  # not after the group's 20 s timeout
    assert not r0["existed"] and not r1["existed"]
    assert [f for f in r0["files"] if "failed_save.ckpt" in f] == ["failed_save.ckpt"]


def test_a_data_parallel_subgroup_saves_without_the_other_processes(launches):
    """The data-parallel group is rank 0 alone in a world of 2: ZeRO's optimizer group and
    the sharded save's group are made among its members (before: a barrier over the world
    that waited for rank 1 until the timeout), and the checkpoint loads in one process."""
    r0, r1 = launches["replicas"].scenario("subgroup_save")
    assert r0["elapsed"] < 15, r0["elapsed"]  # the group's timeout is 20 s
    assert "state" not in r1
    pipe = RoundPipe(dp_worker.build_model(), devices=["cpu"] * 2, seed=0,
                     data_parallel=False,
                     model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=2))
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2, eps=1e-3)
    assert roundpipe.load_checkpoint(r0["path"], pipe, opt) == {"step": 2}
    _assert_states_equal(dp_worker.state(pipe), r0["state"], exact=True)
    pipe.close()


def test_a_replica_that_stops_answering_gives_a_clear_error_within_the_timeout(launches):
    r0 = launches["replicas"].scenario("hung_replica")[0]
    timeout = r0["timeout"]
    assert r0["error"] is not None and r0["error"][0] == "DataParallelError", r0["error"]
    assert "rank 0 of 2" in r0["error"][1] and "timeout" in r0["error"][1]
    assert "restart" in r0["error"][1]
    assert timeout * 0.5 < r0["elapsed"] < timeout + 8
    kind, message = r0["second"]
    assert kind == "DataParallelError" and "failed earlier" in message
    assert r0["second_elapsed"] < 1.0


def test_a_replica_whose_process_dies_is_noticed_at_once(launches):
    r0 = launches["replicas"].scenario("dead_replica")[0]
    assert r0["error"] is not None and r0["error"][0] == "DataParallelError", r0["error"]
    assert "restart" in r0["error"][1]
    assert r0["elapsed"] < 30  # the connection closed: no need to wait for the 60 s timeout


def test_loss_backward_through_pipe_forward_reduces_like_forward_backward(launches):
    want = dp_worker.reference_autograd()
    per_rank = launches["replicas"].scenario("autograd_backward")
    for r in per_rank:
        _assert_states_equal(r["state"], want, exact=True)
        assert r["buckets"] > 3


def test_input_gradients_are_each_replicas_own_and_a_pipe_parameter_is_refused(launches):
    """As with DDP, a replica's input gradient is that of its own loss (eager's
    per-microbatch loop on its shard); an input computed from the pipe's own parameter
    is refused on every replica, which then go on in step."""
    per_rank = launches["replicas"].scenario("input_grads")
    model, table, ids, label = dp_worker.input_grads_data()
    for rank, r in enumerate(per_rank):
        emb = table.clone().requires_grad_()
        mine, y = dp_worker.shard(ids, rank, 2), dp_worker.shard(label, rank, 2)
        x = emb[mine] * 2
        for xb, yb in zip(x.tensor_split(2), y.tensor_split(2)):
            torch.nn.functional.mse_loss(model(xb), yb).backward(retain_graph=True)
        torch.testing.assert_close(r["table_grad"], emb.grad, rtol=1e-10, atol=1e-10)
        assert "reaches the parameter '0.weight'" in r["refused"]
        assert "data parallelism" in r["refused"]
    _assert_replicas_identical(per_rank)


def test_batchnorm_statistics_are_rank_zeros_on_every_replica(launches):
    per_rank = launches["replicas"].scenario("batchnorm_buffers")
    _assert_replicas_identical(per_rank)
    sd = per_rank[0]["state"]
    assert int(sd["layers.0.1.num_batches_tracked"]) == 2 * 2  # 2 calls x 2 microbatches
    assert sd["layers.0.1.running_mean"].abs().sum() > 0


# --- in this process: no process group --------------------------------------------------

def test_without_a_process_group_the_same_script_runs_as_one_replica(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert roundpipe.distributed.init_distributed() == (0, 1)
    torch.manual_seed(0)
    pipe = RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                     devices=["cpu"], data_parallel=True)
    assert pipe.data_parallel is None
    opt = roundpipe.distributed.zero_optimizer(pipe, torch.optim.SGD, lr=0.1)
    assert type(opt) is torch.optim.SGD  # a plain optimizer when there is one replica
    loss = pipe.forward_backward(torch.randn(4, 4), label=torch.randn(4, 2),
                                 loss_fn=torch.nn.functional.mse_loss)
    assert loss.item() > 0 and pipe.stats().data_parallel is None
    with pytest.raises(roundpipe.ConfigError, match="data-parallel RoundPipe"):
        roundpipe.distributed.check_replicas(pipe)
    pipe.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"reduction": "avg"}, "reduction must be one of"),
    ({"bucket_bytes": 0}, "bucket_bytes must be a positive size"),
    ({"bucket_bytes": "lots"}, "cannot read 'lots' as a size"),
    ({"reduce_dtype": torch.int32}, "reduce_dtype must be a floating"),
    ({"timeout_s": 0}, "timeout_s must be a positive"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(roundpipe.ConfigError, match=match):
        DataParallelConfig(**kwargs)


def test_data_parallel_argument_is_checked():
    with pytest.raises(roundpipe.ConfigError, match="data_parallel must be None, True, False"):
        RoundPipe(torch.nn.Linear(2, 2), devices=["cpu"], data_parallel="yes")


@pytest.mark.slow
def test_the_example_under_torchrun_and_its_checkpoint_resumes_in_one_process(tmp_path,
                                                                             forkserver):
    """The real launcher: torchrun, two replicas, sharded AdamW; the checkpoint rank 0
    wrote (ZeRO state consolidated) loads into one process with a plain AdamW."""
    ckpt = tmp_path / "dp.ckpt"
    # torchrun's own process is forked from the session's fork server (torch imported
    # once; tests/forkserver.py), as ``python -m torch.distributed.run ARGS``; it starts
    # the two replicas as fresh interpreters itself.
    result = forkserver.run(
        code="from torch.distributed.run import main; main()",
        args=["--standalone", "--nproc_per_node", "2",
              os.path.join(ROOT, "examples", "train_data_parallel.py"), "--devices", "2",
              "--steps", "2", "--seq-len", "16", "--zero", "--checkpoint", str(ckpt)],
        cwd=ROOT, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "2 replica(s) x 2 device(s): 2 steps" in result.stdout
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from train_gpt import GPT, make_text
    finally:
        sys.path.pop(0)
    chars = sorted(set(make_text(4000)))
    pipe = RoundPipe(GPT(len(chars), d=128), devices=["cpu"], optim_dtype=torch.float32)
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=3e-3)
    roundpipe.load_checkpoint(ckpt, pipe, opt)
    assert len(opt.state) == len(pipe.optim_parameters())  # every shard came back
    assert all(int(s["step"]) == 2 for s in opt.state.values())
    pipe.close()
