"""A checkpoint save killed at any moment leaves the previous checkpoint loadable, whole:
never a truncated file, never a mix of two saves; the next save removes the killed
save's temporary file.  (``bench/checkpoint_crash.py`` runs the same with 20 kills.)"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from roundpipe.checkpoint.atomic import write_atomically

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import checkpoint_crash as crash  # noqa: E402

WIDTH = 1024  # 16 MiB checkpoints: a save takes long enough to be killed mid-write


def test_a_save_killed_at_random_moments_leaves_a_whole_checkpoint(tmp_path):
    rng = random.Random(0)
    path = str(tmp_path / "ck.pt")
    crash.save_generation(path, WIDTH, 0)
    start = 1
    for _ in range(5):
        reported, on_disk, _ = crash.kill_during_saves(path, start, WIDTH, rng)
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
