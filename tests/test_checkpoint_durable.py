"""Atomic saves are durable: every file a save leaves is flushed to disk (``os.fsync`` of
that very file, before its rename), and the directory that holds it is flushed after
the rename, so a power loss after the save returned cannot lose or empty the checkpoint.

Issue 33: removing a checkpoint file's fsync passed the whole suite (the tests killed
saves mid-write, which checks atomicity, not durability).  Here every ``os.fsync`` is
recorded under a monkeypatch: what it flushed (a regular file or a directory, by device
and inode) and, for a directory, which entries it held at that moment.  Paths: the
single-file save, the sharded save, both asynchronous, and the safetensors export
(one file and several shards)."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.nn as nn

import roundpipe
from roundpipe import RoundPipe, save_checkpoint

# A flushed directory's path is read from /proc/self/fd (Linux, where CI runs).
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


class _Fsyncs:
    def __init__(self, monkeypatch):
        self.files: set[tuple[int, int]] = set()
        self.dirs: list[tuple[tuple[int, int], dict[str, int]]] = []
        real = os.fsync

        def fsync(fd):
            st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
            ident = (st.st_dev, st.st_ino)
            if stat.S_ISDIR(st.st_mode):
                path = os.readlink(f"/proc/self/fd/{fd}")
                self.dirs.append((ident, {e: os.lstat(os.path.join(path, e)).st_ino
                                          for e in os.listdir(path)}))
            elif stat.S_ISREG(st.st_mode):
                self.files.add(ident)
            return real(fd)
        monkeypatch.setattr(os, "fsync", fsync)

    def check_file(self, path: str) -> None:
        """``path`` was flushed, and its directory after it had ``path`` in place."""
        st = os.stat(path)
        assert (st.st_dev, st.st_ino) in self.files, f"{path} was never fsynced"
        self.check_entry(path)

    def check_entry(self, path: str) -> None:
        directory, name = os.path.split(path)
        d = os.stat(directory)
        ino = os.lstat(path).st_ino
        assert any(ident == (d.st_dev, d.st_ino) and seen.get(name) == ino
                   for ident, seen in self.dirs), \
            f"{directory} was not fsynced after {name} was renamed into it"

    def check_tree(self, root: str) -> None:
        """Every file under ``root``, and every directory entry on the way."""
        files = 0
        for directory, _, names in os.walk(root):
            for name in names:
                self.check_file(os.path.join(directory, name))
                files += 1
        assert files
        self.check_entry(root)


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    p = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32)
    p.forward_backward(input_args=(x,), label=torch.randn(4, 2),
                       loss_fn=torch.nn.functional.mse_loss)
    p.synchronize()
    yield p
    p.close()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_single_file_save_fsyncs_the_file_and_its_directory(pipe, tmp_path, monkeypatch,
                                                            asynchronous):
    path = str(tmp_path / "ck.pt")
    opt = torch.optim.AdamW(pipe.optim_parameters())
    for _ in range(2):  # a fresh file, then one replacing it
        fsyncs = _Fsyncs(monkeypatch)
        saved = save_checkpoint(path, pipe, opt, asynchronous=asynchronous)
        if asynchronous:
            saved.result()
        fsyncs.check_file(path)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_sharded_save_fsyncs_every_file_and_directory(pipe, tmp_path, monkeypatch,
                                                      asynchronous):
    path = str(tmp_path / "ck")
    opt = torch.optim.AdamW(pipe.optim_parameters())
    for _ in range(2):  # a fresh directory, then one swapped in for it
        fsyncs = _Fsyncs(monkeypatch)
        saved = save_checkpoint(path, pipe, opt, sharded=True, asynchronous=asynchronous)
        if asynchronous:
            saved.result()
        fsyncs.check_tree(path)


@pytest.mark.parametrize("max_shard_size", ["5GB", 40])
def test_safetensors_export_fsyncs_every_shard_and_the_directory(pipe, tmp_path,
                                                                monkeypatch, max_shard_size):
    checkpoint = str(tmp_path / "ck.pt")
    save_checkpoint(checkpoint, pipe)
    out = str(tmp_path / "out")
    fsyncs = _Fsyncs(monkeypatch)
    written = roundpipe.export_weights(checkpoint, out, max_shard_size=max_shard_size)
    assert len(written) == (1 if max_shard_size == "5GB" else 4)  # 3 shards, an index
    for path in written:
        fsyncs.check_file(path)
