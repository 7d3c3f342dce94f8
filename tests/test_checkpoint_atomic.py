"""A checkpoint save killed at any moment leaves the previous checkpoint loadable, whole:
never a truncated file, never a mix of two saves; the next save removes the killed
save's temporary file.  (``bench/checkpoint_crash.py`` runs the same with 20 kills.)"""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest

from roundpipe.checkpoint.atomic import write_atomically
from roundpipe.runtime.offload import MANIFEST, OffloadStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import checkpoint_crash as crash  # noqa: E402

WIDTH = 1024  # 16 MiB checkpoints: a save takes long enough to be killed mid-write


def _kill_during_saves(forkserver, path: str, start: int, rng: random.Random,
                       max_delay_s: float = 0.6) -> tuple[int, int]:
    """bench/checkpoint_crash.py's ``kill_during_saves`` with the saving process forked
    from the session's fork server (tests/forkserver.py) rather than a new interpreter
    (3 s of CPU each to import torch and roundpipe): the same child code, the same random
    delay after it is ready, SIGKILL.  Returns (last generation reported saved,
    generation on disk)."""
    child = forkserver.start(code=crash._CHILD, args=[path, str(start), str(WIDTH), "0"],
                             cwd=ROOT, timeout=120)
    deadline = time.monotonic() + 120
    try:
        while True:  # its stdout is a file (made by the child): "ready" once it can save
            if os.path.exists(child._out):
                with open(child._out) as f:
                    if f.readline().strip() == "ready":
                        break
            if time.monotonic() > deadline:
                raise AssertionError("the saving process did not start")
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, max_delay_s))
    finally:
        child.kill()
    result = child.wait()
    assert result.returncode == -signal.SIGKILL, result.output[-3000:]
    saved = [int(line) for line in result.stdout.split() if line.strip().isdigit()]
    return (saved[-1] if saved else start - 1), crash.generation_on_disk(path, WIDTH)


def test_a_save_killed_at_random_moments_leaves_a_whole_checkpoint(tmp_path, forkserver):
    rng = random.Random(0)
    path = str(tmp_path / "ck.pt")
    crash.save_generation(path, WIDTH, 0)
    start = 1
    for _ in range(3):  # (bench/checkpoint_crash.py kills more)
        reported, on_disk = _kill_during_saves(forkserver, path, start, rng)
        # The last completed save, or the one whose rename landed just before the kill.
        assert on_disk in (reported, reported + 1), (reported, on_disk)
        start = on_disk + 1
    # A completed save clears the temporaries that the killed saves left behind.
    crash.save_generation(path, WIDTH, start)
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]
    assert crash.generation_on_disk(path, WIDTH) == start


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "data.bin")
    write_atomically(path, lambda f: f.write(b"old"))

    def fail(f):
        f.write(b"partial")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, fail)
    with open(path, "rb") as f:
        assert f.read() == b"old"
    assert os.listdir(tmp_path) == ["data.bin"]


def test_a_temporary_of_a_live_writer_is_kept(tmp_path):
    """Another process still writing to the same target keeps its temporary file."""
    path = str(tmp_path / "data.bin")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        theirs = tmp_path / f".data.bin.tmp-{live.pid}-0123abcd"
        theirs.write_bytes(b"x")
        dead = tmp_path / ".data.bin.tmp-999999999-0123abcd"  # no such process
        dead.write_bytes(b"x")
        write_atomically(path, lambda f: f.write(b"new"))
        assert theirs.exists() and not dead.exists()
    finally:
        live.kill()
        live.wait()


def _record_fsyncs(monkeypatch, target):
    """Every ``os.fsync``: ("file", the path it flushed) or ("dir", its path, whether
    ``target`` already held its new content: the rename was flushed)."""
    calls = []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            calls.append(("dir", path, os.path.exists(target)))
        else:
            calls.append(("file", path))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def _checkpoint_write(path):
    write_atomically(path, lambda f: f.write(b"new"))


def _offload_commit(path):
    store = OffloadStore(os.path.dirname(path))  # its manifest: what a resume reads
    try:
        store.commit()
    finally:
        store.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
@pytest.mark.parametrize("write, name", [(_checkpoint_write, "ck.pt"),
                                         (_offload_commit, MANIFEST)])
def test_a_write_is_flushed_to_disk_file_first_then_its_directory(tmp_path, monkeypatch,
                                                                   write, name):
    """Durability, not only atomicity: the new file's data is fsynced before the rename
    (else a power loss can leave the new name on an empty file), and the directory after
    it (else the rename itself can be lost).  Checkpoints and the disk tier's manifest
    share the code (runtime/atomic_file.py)."""
    folder = tmp_path / "d"
    folder.mkdir()
    target = str(folder / name)
    calls = _record_fsyncs(monkeypatch, target)
    write(target)
    assert [c[0] for c in calls] == ["file", "dir"], calls
    flushed = calls[0][1]
    assert os.path.dirname(flushed) == str(folder)
    assert os.path.basename(flushed).startswith(f".{name}.tmp-")  # before the rename
    assert calls[1] == ("dir", str(folder), True)
    assert os.path.isfile(target) and not os.path.exists(flushed)
