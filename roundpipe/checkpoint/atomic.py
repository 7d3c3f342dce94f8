"""Atomic writes for checkpoints: readers see the old file or the new one, never a part,
and a crash or a kill mid-write leaves the previous file whole.  The code lives in
``roundpipe/runtime/atomic_file.py``, which the disk tier's manifest shares."""

from __future__ import annotations

from ..runtime.atomic_file import alive, fsync_directory, write_atomically

__all__ = ["alive", "fsync_directory", "write_atomically"]
