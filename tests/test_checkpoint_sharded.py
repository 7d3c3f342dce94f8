"""Sharded (torch.distributed.checkpoint) and asynchronous checkpoints: bitwise resume onto
another device count, the async capture equal to a synchronous save, atomic directory
swaps, and refusal of forged files.  (2 -> 1 replicas: tests/test_data_parallel.py.)"""

from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch

import models
from roundpipe import (CheckpointError, GradScaler, RoundPipe, RoundPipeRunConfig,
                       load_checkpoint, save_checkpoint)
from roundpipe.checkpoint import sharded as checkpoint_sharded


def _setup(devices: int):
    # Tests whose device count does not matter train on 2: a 1-device pipe's first call
    # costs about twice the CPU of a 2-device one's (~2 s against ~0.9 s, this model).
    model, _, _ = models.gpt(dropout=0.1, layers=3)
    pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float32, seed=11,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    scaler = GradScaler(pipe, init_scale=2.0**4, growth_interval=2)
    opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
    return pipe, opt, scaler


def _train(pipe, opt, scaler, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 64, (4, 8), generator=g)
        labels = torch.randint(0, 64, (4, 8), generator=g)
        pipe.forward_backward(input_args=(idx,), label=labels,
                              loss_fn=lambda o, y: scaler.scale(models.lm_loss(o, y)))
        pipe.step(lambda: scaler.step(opt), is_async=True)


def _final(pipe, opt):
    pipe.synchronize()
    out = {n: p.detach().clone() for n, p in pipe.optim_named_parameters()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _assert_bitwise(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.fixture(scope="module")
def straight():
    """Five uninterrupted steps, on 2 devices: the resumes (from 1 device to 3, on 2)
    must equal it bit for bit, whatever the device counts."""
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(5))
    out = _final(pipe, opt)
    pipe.close()
    return out


def test_a_sharded_checkpoint_from_1_device_resumes_on_3_bit_exactly(tmp_path, straight):
    pipe, opt, scaler = _setup(1)
    _train(pipe, opt, scaler, range(3))
    save_checkpoint(tmp_path / "ck", pipe, opt, scaler, extra={"step": 3}, sharded=True)
    pipe.close()
    assert os.path.isfile(tmp_path / "ck" / ".metadata")
    pipe, opt, scaler = _setup(3)
    assert load_checkpoint(tmp_path / "ck", pipe, opt, scaler) == {"step": 3}
    _train(pipe, opt, scaler, range(3, 5))
    _assert_bitwise(_final(pipe, opt), straight)
    pipe.close()


def test_an_async_save_captures_the_step_boundary_while_training_goes_on(tmp_path,
                                                                        straight):
    """Capped snapshot: part copied at once, the rest while the optimizer is held; the
    run goes on meanwhile and the checkpoint still resumes bit for bit."""
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(3))
    future = save_checkpoint(tmp_path / "ck", pipe, opt, scaler, extra={"step": 3},
                             sharded=True, asynchronous=True, max_snapshot_bytes=64 * 1024)
    _train(pipe, opt, scaler, range(3, 5))  # overlaps the write
    future.result(timeout=120)
    buffers = sum(b.numel() * b.element_size() for b in pipe.model.buffers())
    assert future.held_bytes > 0 and future.snapshot_bytes <= 64 * 1024 + buffers
    _assert_bitwise(_final(pipe, opt), straight)
    pipe.close()
    pipe, opt, scaler = _setup(2)
    assert load_checkpoint(tmp_path / "ck", pipe, opt, scaler) == {"step": 3}
    _train(pipe, opt, scaler, range(3, 5))
    _assert_bitwise(_final(pipe, opt), straight)
    pipe.close()


def test_an_async_single_file_save_and_a_second_save_waits_for_the_first(tmp_path,
                                                                        monkeypatch):
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(1))
    gate = threading.Event()
    import roundpipe.checkpoint.save_load as ck
    real = ck._write_file
    monkeypatch.setattr(ck, "_write_file", lambda p, s: (gate.wait(30), real(p, s)))
    first = save_checkpoint(tmp_path / "a.pt", pipe, opt, asynchronous=True)
    assert first.snapshot_bytes > 0 and not first.done()
    threading.Timer(0.2, gate.set).start()
    save_checkpoint(tmp_path / "b.pt", pipe, opt)  # waits for the first
    assert first.done() and first.exception() is None
    a = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "b.pt", weights_only=True)["model"]
    _assert_bitwise(a, b)
    pipe.close()


def test_a_failed_sharded_save_keeps_the_old_directory(tmp_path, monkeypatch):
    pipe, opt, _ = _setup(1)
    save_checkpoint(tmp_path / "ck", pipe, opt, extra=1, sharded=True)
    from torch.distributed.checkpoint import FileSystemWriter

    def fail(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(FileSystemWriter, "write_data", fail)  # DCP wraps it: unwrapped
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "ck", pipe, opt, extra=2)  # a directory: sharded
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert load_checkpoint(tmp_path / "ck", pipe, opt) == 1
    pipe.close()


def test_a_sharded_save_never_replaces_a_directory_of_other_files(tmp_path):
    pipe, opt, _ = _setup(1)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.txt").write_text("keep me")
    # e.g. a Trainer checkpoint folder holding a one-file roundpipe.pt
    save_checkpoint(tmp_path / "run" / "roundpipe.pt", pipe, opt)
    with pytest.raises(CheckpointError, match="not a roundpipe checkpoint"):
        save_checkpoint(tmp_path / "run", pipe, opt)  # an existing directory: sharded
    assert (tmp_path / "run" / "log.txt").read_text() == "keep me"
    with pytest.raises(CheckpointError, match="holds a one-file checkpoint, load"):
        load_checkpoint(tmp_path / "run", pipe, opt)
    assert sorted(os.listdir(tmp_path)) == ["run"]
    pipe.close()


def test_a_save_killed_between_the_renames_still_loads_and_is_cleaned_up(tmp_path):
    pipe, opt, _ = _setup(1)
    save_checkpoint(tmp_path / "ck", pipe, opt, extra=1, sharded=True)
    # What a kill after moving the old directory aside leaves (the pid is not alive).
    os.rename(tmp_path / "ck", tmp_path / ".ck.old-999999999-0123abcd")
    assert load_checkpoint(tmp_path / "ck", pipe, opt) == 1
    save_checkpoint(tmp_path / "ck", pipe, opt, extra=2, sharded=True)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert load_checkpoint(tmp_path / "ck", pipe, opt) == 2
    pipe.close()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_forged_dcp_metadata_or_bytes_items_are_refused_not_run(tmp_path):
    pipe, opt, _ = _setup(1)
    save_checkpoint(tmp_path / "ck", pipe, opt, sharded=True)
    marker = tmp_path / "owned"
    with open(tmp_path / "ck" / ".metadata", "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(CheckpointError, match="refuses to unpickle"):
        load_checkpoint(tmp_path / "ck", pipe, opt)
    assert not marker.exists()
    # Metadata that points at a file outside the directory.
    save_checkpoint(tmp_path / "ck", pipe, opt, sharded=True)
    import torch.distributed.checkpoint as dcp
    from roundpipe.checkpoint.safe_dcp import SafeFileSystemReader
    metadata = SafeFileSystemReader(str(tmp_path / "ck")).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    with open(tmp_path / "ck" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match="outside its directory"):
        load_checkpoint(tmp_path / "ck", pipe, opt)
    # A byte item would be read with torch.load(weights_only=False): refused.
    dcp.save({"model.lm_head.bias": {"x": _Payload(marker)}},
             checkpoint_id=str(tmp_path / "bytes"), no_dist=True)
    with pytest.raises(CheckpointError, match="lacks the tensor"):
        checkpoint_sharded.read_tensors(str(tmp_path / "bytes"), ["model.lm_head.bias"])
    # Past that check, DCP's own planner would unpickle a byte item: ours refuses.
    from torch.distributed.checkpoint.api import CheckpointException

    from roundpipe.checkpoint.safe_dcp import TensorOnlyLoadPlanner
    with pytest.raises(CheckpointException) as info:
        dcp.load({"model.lm_head.bias.x": torch.zeros(1)},
                 storage_reader=SafeFileSystemReader(str(tmp_path / "bytes")),
                 planner=TensorOnlyLoadPlanner(), no_dist=True)
    errors = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert any(isinstance(e, CheckpointError) and "pickled bytes" in str(e) for e in errors)
    assert not marker.exists()
    pipe.close()


def test_a_capped_async_save_is_right_when_dcp_resolves_tensors_ahead(tmp_path,
                                                                      monkeypatch):
    """With CUDA available DCP resolves tensors ahead of writing them (its overlapping
    loader): a staging buffer must not be reused while a view of it waits to be written.
    Forced here on a CPU host, as on a GPU host; the extra and the optimizer's
    hyper-parameters are those at the save, not changed later."""
    import torch.distributed.checkpoint.filesystem as fs
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(2))
    pipe.synchronize()
    want = {k: v.clone() for k, v in
            checkpoint_sharded.collect(pipe, opt, scaler, None, None).tensors.items()}
    loaders = []
    real_loader = fs._OverlappingCpuLoader
    monkeypatch.setattr(fs, "_OverlappingCpuLoader",
                        lambda *a, **k: loaders.append(1) or real_loader(*a, **k))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fs, "_get_available_device_type", lambda: "cpu")
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
    extra = {"step": 2, "seen": [1, 2], "t": torch.zeros(2)}
    future = save_checkpoint(tmp_path / "ck", pipe, opt, scaler, extra=extra, sharded=True,
                             asynchronous=True, max_snapshot_bytes=0)
    extra["step"] = 3
    extra["seen"].append(3)
    extra["t"].add_(1)
    opt.param_groups[0]["lr"] = 0.5
    future.result(timeout=60)
    monkeypatch.undo()
    assert loaders and future.held_bytes > 0
    got = checkpoint_sharded.read_tensors(str(tmp_path / "ck"), list(want))
    _assert_bitwise(got, want)
    meta = checkpoint_sharded.read_meta(str(tmp_path / "ck"))
    assert meta["extra"]["step"] == 2 and meta["extra"]["seen"] == [1, 2]
    assert torch.equal(meta["extra"]["t"], torch.zeros(2))
    assert meta["optimizer"]["param_groups"][0]["lr"] == 1e-2
    pipe.close()


def test_optimizer_state_loads_by_name_whatever_the_parameter_order(tmp_path):
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(2))
    save_checkpoint(tmp_path / "ck", pipe, opt, sharded=True)
    pipe.synchronize()
    want = {n: {k: v.clone() for k, v in opt.state[p].items()}
            for n, p in pipe.optim_named_parameters()}
    pipe.close()
    pipe, _, _ = _setup(1)
    opt = torch.optim.AdamW(list(reversed(pipe.optim_parameters())), lr=1e-2)
    load_checkpoint(tmp_path / "ck", pipe, opt)
    for n, p in pipe.optim_named_parameters():
        _assert_bitwise(opt.state[p], want[n])
    pipe.close()


def test_an_interrupt_during_a_sharded_save_stays_an_interrupt(tmp_path, monkeypatch):
    """DCP wraps every failure in its CheckpointException: Ctrl-C must still be one."""
    pipe, opt, _ = _setup(1)
    save_checkpoint(tmp_path / "ck", pipe, opt, extra=1, sharded=True)
    from torch.distributed.checkpoint import FileSystemWriter

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(FileSystemWriter, "write_data", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "ck", pipe, opt, extra=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert load_checkpoint(tmp_path / "ck", pipe, opt) == 1
    pipe.close()


def test_an_async_save_in_flight_cannot_be_cancelled(tmp_path, monkeypatch):
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(1))
    gate = threading.Event()
    import roundpipe.checkpoint.save_load as ck
    real = ck._write_file
    monkeypatch.setattr(ck, "_write_file", lambda p, s: (gate.wait(30), real(p, s)))
    future = save_checkpoint(tmp_path / "a.pt", pipe, opt, asynchronous=True)
    assert future.running() and not future.cancel()  # the write goes on: not cancelled
    gate.set()
    assert future.result(timeout=30) is None and not future.cancelled()
    assert load_checkpoint(tmp_path / "a.pt", pipe, opt) is None
    pipe.close()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_save_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path, sharded):
    pipe, opt, _ = _setup(1)
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "ck"
    save_checkpoint(target, pipe, opt, extra=1, sharded=sharded)
    link = tmp_path / "latest"
    link.symlink_to(target, target_is_directory=sharded)
    save_checkpoint(link, pipe, opt, extra=2, sharded=sharded)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert sorted(os.listdir(tmp_path)) == ["latest", "store"]
    assert sorted(os.listdir(tmp_path / "store")) == ["ck"]
    assert load_checkpoint(target, pipe, opt) == 2
    pipe.close()


@pytest.mark.parametrize("sharded", [False, True])
def test_an_optimizer_with_other_groups_is_refused_before_anything_loads(tmp_path,
                                                                         sharded):
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(1))
    save_checkpoint(tmp_path / "ck", pipe, opt, sharded=sharded)
    _train(pipe, opt, scaler, range(1, 2))
    pipe.synchronize()
    weights = {n: p.detach().clone() for n, p in pipe.optim_named_parameters()}
    params = list(pipe.optim_parameters())
    other = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    with pytest.raises(CheckpointError, match="parameter group"):
        load_checkpoint(tmp_path / "ck", pipe, other)
    pipe.synchronize()
    _assert_bitwise({n: p.detach() for n, p in pipe.optim_named_parameters()}, weights)
    pipe.close()


def test_a_tied_weight_is_written_once_and_loads_under_both_names(tmp_path, monkeypatch):
    """GPT's head shares the embedding's tensor: the directory holds it once (as
    torch.save and the safetensors export do), a fresh pipe loads it tied and equal, and
    a directory written before (both names, format 1) still loads."""
    from torch.distributed.checkpoint import FileSystemReader
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(2))
    save_checkpoint(tmp_path / "ck", pipe, opt, scaler, sharded=True)
    want = _final(pipe, opt)
    pipe.close()
    stored = FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    model_keys = {k for k in stored if k.startswith("model.")}
    assert ("model.wte.weight" in model_keys) != ("model.head.weight" in model_keys)
    meta = checkpoint_sharded.read_meta(str(tmp_path / "ck"))
    assert set(meta["model_aliases"].items()) <= {("head.weight", "wte.weight"),
                                                   ("wte.weight", "head.weight")}
    assert meta["model_aliases"]

    # what format 1 wrote: every name, no aliases
    real = checkpoint_sharded.collect

    def collect_v1(*args, **kwargs):
        c = real(*args, **kwargs)
        sd = args[0].state_dict()
        for dup, first in c.meta.pop("model_aliases").items():
            c.tensors["model." + dup] = sd[dup].detach()
        c.meta["format"] = "roundpipe-sharded-1"
        return c
    pipe, opt, scaler = _setup(2)
    _train(pipe, opt, scaler, range(2))
    monkeypatch.setattr(checkpoint_sharded, "collect", collect_v1)
    save_checkpoint(tmp_path / "v1", pipe, opt, scaler, sharded=True)
    monkeypatch.undo()
    pipe.close()
    assert {"model.wte.weight", "model.head.weight"} <= set(
        FileSystemReader(str(tmp_path / "v1")).read_metadata().state_dict_metadata)
    for path in ("ck", "v1"):
        pipe, opt, scaler = _setup(3)
        load_checkpoint(tmp_path / path, pipe, opt, scaler)
        assert pipe.model.head.weight is pipe.model.wte.weight
        _assert_bitwise(_final(pipe, opt), want)
        pipe.close()
