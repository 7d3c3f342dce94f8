from __future__ import annotations

import functools
import gc
import os
import sys
import warnings
import weakref

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py

# A test process holds torch, transformers, sympy's caches and every module's compiled
# programs; Python's default full collection (after 10 middle ones) re-scans that heap
# about every 70K allocations, and tracing allocates millions: 8-10% of a compile-heavy
# file's CPU time went to full collections.  One every 100 middle collections instead
# (young ones unchanged; cyclic garbage still goes, later): tests/test_output_merge.py +
# test_runtime_exact.py, GC 8.4 s -> 3.6-6.4 s, user CPU 90.8 s -> 80.8-84.5 s (2026-11-27).
# Tests that need garbage gone call gc.collect() themselves.
gc.set_threshold(700, 10, 100)


# Objects alive when a test file starts (torch, transformers, the earlier files' caches)
# are frozen out of the collector after one collection: a full collection then scans only
# what the file itself made.  A worker holds ~1M such objects after a few files, and the
# library collects once per trace whose forward hooks kept tensors (passes/forward_hooks.py):
# test_forward_hooks.py after test_output_merge.py + test_hf_models.py in one process took
# 38.5 s, 31.5 s of it in collections; 7.9 s with this (2026-11-27).  Garbage in cycles
# among frozen objects is never collected: what outlives a file is rare, and it is small.
_frozen_at = [None]


def pytest_runtest_setup(item):
    if item.path != _frozen_at[0]:
        _frozen_at[0] = item.path
        gc.collect()
        gc.freeze()


# Files with the longest tests (child processes, module fixtures of 10-30 s) run first:
# with --dist worksteal the end of the run is then short tests that idle workers take
# over, not one worker finishing a 30 s launch alone.  Order within a file is kept.
_LONG_FIRST = ("test_data_parallel.py", "test_backend.py", "test_bench_smoke.py",
               "test_example.py", "test_hf_trainer.py", "test_property_invariance.py",
               "test_compile_units.py", "test_faults.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Pipes shared by the tests of one module (closed by that module); every other pipe a
# test creates is closed after it, so a failed assertion cannot leak worker threads.
# Closing waits for a pending step: a RoundPipeError from it (a step the test made fail
# on purpose and did not wait for) is shown as a warning in the summary; any other
# error is a bug in closing and fails the test's teardown.
SHARED_PIPES: "weakref.WeakSet" = weakref.WeakSet()


class LeftOpenWarning(UserWarning):
    """A pipe a test left open failed to close with a RoundPipeError."""


@pytest.fixture(autouse=True)
def _close_pipes_after_each_test():
    from roundpipe import RoundPipe, RoundPipeError

    created: weakref.WeakSet = weakref.WeakSet()
    original = RoundPipe.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.add(self)

    RoundPipe.__init__ = init
    try:
        yield
    finally:
        RoundPipe.__init__ = original
        for pipe in list(created):
            if pipe not in SHARED_PIPES:
                try:
                    pipe.close()  # stops the threads even when it raises
                except RoundPipeError as e:
                    warnings.warn(f"closing a pipe the test left open raised "
                                  f"{type(e).__name__}: {e}", LeftOpenWarning, stacklevel=1)


@pytest.fixture(scope="session")
def forkserver():
    """Fresh Python children, forked from one process that imported torch and roundpipe
    once (tests/forkserver.py); one per pytest process, started on first use."""
    from forkserver import ForkServer

    server = ForkServer()
    yield server
    server.close()


@pytest.fixture
def traces(monkeypatch):
    """How many times roundpipe traced a model (calls of ``roundpipe.api.analyze``)."""
    import roundpipe.api as rp_api

    count = [0]
    analyze = rp_api.analyze

    def counting(*args, **kwargs):
        count[0] += 1
        return analyze(*args, **kwargs)

    monkeypatch.setattr(rp_api, "analyze", counting)
    return count
