"""Atomic writes: readers see the old file or the new one, never a part, and a crash or
a kill mid-write leaves the previous file whole.  Temporary files of killed writes are
removed by the next write to the same name, unless their process still runs.

Checkpoints (``roundpipe/checkpoint/atomic.py`` re-exports these) and the disk tier's
manifest (``offload.py``) write through here; it imports nothing of roundpipe, so both
may use it."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from typing import Any

_WRITING: set[str] = set()  # temporary files this process is writing now


def write_atomically(path: str, write: Any) -> None:
    """``write(file)`` into a temporary file beside ``path``, flushed to disk, then
    renamed over ``path``: readers see the old file or the new one, never a part."""
    # realpath: a link to the checkpoint stays a link, its target is replaced
    directory, name = os.path.split(os.path.realpath(path))
    path = os.path.join(directory, name)
    temp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _WRITING.add(temp)
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    finally:
        _WRITING.discard(temp)
    fsync_directory(directory)  # the rename itself survives a power loss
    _remove_stale_temporaries(directory, name)


def fsync_directory(directory: str) -> None:
    """Flush a directory's entries (a rename, a new file) to disk."""
    with contextlib.suppress(OSError):  # not every platform opens directories
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Delete temporary files of earlier saves to ``name`` whose process is gone (a
    save killed mid-write); a save still running in another process keeps its file."""
    pattern = re.compile(rf"\.{re.escape(name)}\.tmp-(\d+)-[0-9a-f]{{8}}$")
    for entry in os.listdir(directory):
        match = pattern.match(entry)
        if match is None:
            continue
        pid = int(match.group(1))
        path = os.path.join(directory, entry)
        if path in _WRITING or (pid != os.getpid() and alive(pid)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
