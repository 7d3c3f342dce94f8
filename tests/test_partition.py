"""Tests for roundpipe.passes.partition: exactness against brute force, hand-worked cases,
error messages and the round-robin step-time model."""

from __future__ import annotations

import itertools
import os
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe.errors import PartitionError
from roundpipe.passes.partition import (
    Partition,
    PipelineCuts,
    Schedule,
    max_pipeline_stages,
    min_max_partition,
    partition_pipeline,
    simulate_round_robin,
)

MiB = 2**20


# --------------------------------------------------------------------------------------
# Brute force references
# --------------------------------------------------------------------------------------


def _all_bounds(start: int, stop: int):
    """Every split of [start, stop) into contiguous non-empty parts, as bounds tuples."""
    inner = range(start + 1, stop)
    for r in range(len(inner) + 1):
        for cuts in itertools.combinations(inner, r):
            yield (start, *cuts, stop)


def _seg(values, a, b):
    return sum(values[a:b])


def _split_cost(costs, mem, cap, bounds):
    """Max part cost of a split, or None if some part breaks the memory cap."""
    worst = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        if cap is not None and _seg(mem, a, b) > cap:
            return None
        worst = max(worst, _seg(costs, a, b))
    return worst


def brute_min_max(costs, k, mem=None, cap=None):
    """Optimal bottleneck for exactly k parts, or None if infeasible."""
    n = len(costs)
    best = None
    for bounds in _all_bounds(0, n):
        if len(bounds) - 1 != k:
            continue
        c = _split_cost(costs, mem, cap, bounds)
        if c is not None and (best is None or c < best):
            best = c
    return best


def _best_by_count(costs, mem, cap, s):
    """For splits of [0, s): part count -> smallest feasible bottleneck."""
    out: dict[int, int] = {}
    for bounds in _all_bounds(0, s):
        c = _split_cost(costs, mem, cap, bounds)
        if c is None:
            continue
        cnt = len(bounds) - 1
        if cnt not in out or c < out[cnt]:
            out[cnt] = c
    return out


def brute_pipeline(fwd, bwd, tail, k, fm, bm, tm, cap, extra):
    """Optimal pipeline bottleneck for exactly k stages, or None if infeasible."""
    n = len(fwd)
    best = None
    for s in range(n):
        if cap is not None and _seg(tm, s, n) > cap:
            continue
        tcost = _seg(tail, s, n) + extra
        if s == 0:
            cand = tcost if k == 1 else None
        else:
            fb = _best_by_count(fwd, fm, cap, s)
            bb = _best_by_count(bwd, bm, cap, s)
            cand = None
            for nf, cf in fb.items():
                nb = k - 1 - nf
                if nb in bb:
                    c = max(cf, bb[nb], tcost)
                    if cand is None or c < cand:
                        cand = c
        if cand is not None and (best is None or cand < best):
            best = cand
    return best


# --------------------------------------------------------------------------------------
# Result validators
# --------------------------------------------------------------------------------------


def check_bounds(bounds, start, stop, k):
    assert len(bounds) == k + 1
    assert bounds[0] == start and bounds[-1] == stop
    assert all(a < b for a, b in zip(bounds[:-1], bounds[1:])), bounds


def check_partition(p: Partition, costs, k, mem, cap):
    check_bounds(p.bounds, 0, len(costs), k)
    assert p.parts == tuple(zip(p.bounds[:-1], p.bounds[1:]))
    assert p.num_parts == k
    got = _split_cost(costs, mem, cap, p.bounds)
    assert got is not None, "memory cap violated"
    assert got == p.bottleneck


def check_cuts(c: PipelineCuts, fwd, bwd, tail, k, fm, bm, tm, cap, extra):
    n = len(fwd)
    s = c.tail_start
    assert 0 <= s <= n - 1
    assert c.num_stages == k
    if s == 0:
        assert c.forward == () and c.backward == ()
        assert c.forward_parts == () and c.backward_parts == ()
    else:
        check_bounds(c.forward, 0, s, len(c.forward) - 1)
        check_bounds(c.backward, 0, s, len(c.backward) - 1)
        assert len(c.forward_parts) >= 1 and len(c.backward_parts) >= 1
    if cap is not None:
        assert _seg(tm, s, n) <= cap
    costs = [_seg(tail, s, n) + extra]
    if s:
        fcost = _split_cost(fwd, fm, cap, c.forward)
        bcost = _split_cost(bwd, bm, cap, c.backward)
        assert fcost is not None and bcost is not None, "memory cap violated"
        costs += [fcost, bcost]
    assert max(costs) == c.bottleneck


# --------------------------------------------------------------------------------------
# min_max_partition
# --------------------------------------------------------------------------------------


def _rand_ints(rng, n, hi):
    # Zeros are drawn often on purpose: they create ties and empty-cost parts.
    return [0 if rng.random() < 0.25 else rng.randint(0, hi) for _ in range(n)]


def test_min_max_partition_matches_brute_force():
    rng = random.Random(1234)
    infeasible = 0
    for _ in range(1500):
        n = rng.randint(1, 8)
        costs = _rand_ints(rng, n, 12)
        k = rng.randint(1, n)
        mem = cap = None
        if rng.random() < 0.6:
            mem = _rand_ints(rng, n, 10)
            cap = rng.randint(0, 30)
        want = brute_min_max(costs, k, mem, cap)
        if want is None:
            infeasible += 1
            with pytest.raises(PartitionError):
                min_max_partition(costs, k, memory=mem, memory_cap=cap)
            continue
        got = min_max_partition(costs, k, memory=mem, memory_cap=cap)
        assert got.bottleneck == want, (costs, k, mem, cap, got)
        check_partition(got, costs, k, mem, cap)
    assert infeasible > 50  # the generator really exercises the error path


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(0, 1000), min_size=1, max_size=7),
    data=st.data(),
)
def test_min_max_partition_hypothesis(costs, data):
    k = data.draw(st.integers(1, len(costs)))
    got = min_max_partition(costs, k)
    assert got.bottleneck == brute_min_max(costs, k)
    check_partition(got, costs, k, None, None)


def test_min_max_partition_hand_worked():
    # [1,2,3 | 4,5]: 6 and 9; every other 2-split has a part >= 10 or 12. The fair share is
    # ceil(15/2) = 8, but a part reaching 8 would cost 10, so the cut stays at 3.
    assert min_max_partition([1, 2, 3, 4, 5], 2) == Partition(bounds=(0, 3, 5), bottleneck=9)

    # [5,1 | 1,1,5] and [5,1,1 | 1,5] both give 7 (the two others give 8). The first is
    # |2*6 - 13| = 1 off an even split, the second |2*7 - 13| = 1: ties keep the earlier cut.
    assert min_max_partition([5, 1, 1, 1, 5], 2) == Partition(bounds=(0, 2, 5), bottleneck=7)

    # Memory [1,1,1,1,10] with cap 11: [2,5) holds 12 bytes, so the cut moves to 3 and the
    # last part holds exactly 11. Still bottleneck 7.
    got = min_max_partition([5, 1, 1, 1, 5], 2, memory=[1, 1, 1, 1, 10], memory_cap=11)
    assert got == Partition(bounds=(0, 3, 5), bottleneck=7)
    # Cap 10: unit 4 must be alone; [5,1,1,1 | 5] costs 8.
    got = min_max_partition([5, 1, 1, 1, 5], 2, memory=[1, 1, 1, 1, 10], memory_cap=10)
    assert got == Partition(bounds=(0, 4, 5), bottleneck=8)

    # One part per unit, and a single part.
    assert min_max_partition([3, 0, 7], 3) == Partition(bounds=(0, 1, 2, 3), bottleneck=7)
    assert min_max_partition([3, 0, 7], 1) == Partition(bounds=(0, 3), bottleneck=10)
    assert min_max_partition([3, 0, 7], 1).parts == ((0, 3),)

    # All-zero costs still produce non-empty parts.
    assert min_max_partition([0, 0, 0, 0], 3).bottleneck == 0
    check_partition(min_max_partition([0, 0, 0, 0], 3), [0, 0, 0, 0], 3, None, None)


def test_min_max_partition_balances_beyond_bottleneck():
    # Bottleneck 100 comes from the big unit; plain greedy would pack [1]*9 into one part
    # and leave two near-empty ones. Equal-share cuts spread the small units.
    costs = [100] + [1] * 9
    got = min_max_partition(costs, 4)
    assert got.bottleneck == 100
    small = [b - a for a, b in got.parts[1:]]
    assert max(small) - min(small) <= 1


def test_min_max_partition_accepts_any_integer_like():
    class Ns:
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    assert min_max_partition([Ns(2), Ns(2)], 2).bottleneck == 2
    assert min_max_partition((4, 1, 1), 2).bounds == (0, 1, 3)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(costs=[1, 2, 3], num_parts=0), ["num_parts = 0", "at least 1"]),
        (dict(costs=[1, 2, 3], num_parts=5), ["num_parts = 5", "only 3 units", "at most 3"]),
        (dict(costs=[], num_parts=1), ["empty"]),
        (dict(costs=[1, 2, -1], num_parts=1), ["costs[2] = -1", "negative"]),
        (dict(costs=[1, 2.5], num_parts=1), ["costs[1] = 2.5", "integer"]),
        (dict(costs=[1, 2], num_parts=1.0), ["num_parts", "integer"]),
        (
            dict(costs=[1, 2, 3], num_parts=1, memory=[1, 2], memory_cap=9),
            ["memory has 2 entries", "costs has 3"],
        ),
        (
            dict(costs=[1, 2, 3], num_parts=2, memory=[1, 1, -4], memory_cap=9),
            ["memory[2] = -4"],
        ),
        (dict(costs=[1, 2], num_parts=1, memory_cap=9), ["memory_cap = 9", "without memory"]),
        (
            dict(costs=[1, 2], num_parts=1, memory=[1, 1], memory_cap=-1),
            ["memory_cap = -1"],
        ),
        (
            dict(costs=[1, 1, 1], num_parts=2, memory=[MiB, 812 * MiB, MiB],
                 memory_cap=512 * MiB),
            ["unit 1 alone", "812.0 MiB", "512.0 MiB", "raise the cap or split the unit"],
        ),
        (
            # Each unit fits, but 3 units of 6 bytes under a cap of 10 need 3 parts.
            dict(costs=[1, 1, 1], num_parts=2, memory=[6, 6, 6], memory_cap=10),
            ["at least 3 parts", "num_parts = 2", "raise num_parts to 3"],
        ),
    ],
)
def test_min_max_partition_errors(kwargs, fragments):
    costs = kwargs.pop("costs")
    k = kwargs.pop("num_parts")
    with pytest.raises(PartitionError) as info:
        min_max_partition(costs, k, **kwargs)
    assert isinstance(info.value, ValueError)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))


# --------------------------------------------------------------------------------------
# partition_pipeline
# --------------------------------------------------------------------------------------


def _random_pipeline_case(rng):
    n = rng.randint(1, 6)
    fwd = _rand_ints(rng, n, 6)
    # Backward recomputes the forward, so it is usually about 3x, but not always.
    bwd = [3 * f + rng.randint(0, 3) if rng.random() < 0.7 else rng.randint(0, 20) for f in fwd]
    tail = [f + b for f, b in zip(fwd, bwd)] if rng.random() < 0.7 else _rand_ints(rng, n, 20)
    k = rng.randint(1, 2 * n - 1)
    if k == 2:
        k = rng.choice([1, 3]) if n > 1 else 1
    fm = bm = tm = cap = None
    if rng.random() < 0.6:
        fm = _rand_ints(rng, n, 6)
        bm = _rand_ints(rng, n, 8)
        tm = _rand_ints(rng, n, 8)
        cap = rng.randint(0, 25)
    extra = rng.choice([0, 0, rng.randint(0, 10)])
    return fwd, bwd, tail, k, fm, bm, tm, cap, extra


def test_partition_pipeline_matches_brute_force():
    rng = random.Random(99)
    infeasible = feasible = 0
    for _ in range(1200):
        fwd, bwd, tail, k, fm, bm, tm, cap, extra = _random_pipeline_case(rng)
        want = brute_pipeline(fwd, bwd, tail, k, fm, bm, tm, cap, extra)
        call = dict(fwd_memory=fm, bwd_memory=bm, tail_memory=tm, memory_cap=cap,
                    tail_extra=extra)
        if want is None:
            infeasible += 1
            with pytest.raises(PartitionError):
                partition_pipeline(fwd, bwd, tail, k, **call)
            continue
        feasible += 1
        got = partition_pipeline(fwd, bwd, tail, k, **call)
        assert got.bottleneck == want, (fwd, bwd, tail, k, fm, bm, tm, cap, extra, got)
        check_cuts(got, fwd, bwd, tail, k, fm, bm, tm, cap, extra)
    assert infeasible > 50 and feasible > 500


def test_partition_pipeline_n8_brute_force():
    # A few of the largest cases (n = 8) to cover deeper forward/backward splits.
    rng = random.Random(7)
    for _ in range(25):
        n = 8
        fwd = _rand_ints(rng, n, 9)
        bwd = [3 * f for f in fwd]
        tail = [4 * f for f in fwd]
        k = rng.choice([1, 3, 4, 5, 8, 11, 15])
        fm, bm, tm = _rand_ints(rng, n, 5), _rand_ints(rng, n, 5), _rand_ints(rng, n, 5)
        cap = rng.choice([None, rng.randint(5, 20)])
        want = brute_pipeline(fwd, bwd, tail, k, fm, bm, tm, cap, 0)
        call = dict(fwd_memory=fm, bwd_memory=bm, tail_memory=tm, memory_cap=cap)
        if want is None:
            with pytest.raises(PartitionError):
                partition_pipeline(fwd, bwd, tail, k, **call)
        else:
            got = partition_pipeline(fwd, bwd, tail, k, **call)
            assert got.bottleneck == want
            check_cuts(got, fwd, bwd, tail, k, fm, bm, tm, cap, 0)


def test_partition_pipeline_hand_worked():
    fwd, bwd, tail = [1, 1, 1, 1], [3, 3, 3, 3], [4, 4, 4, 4]

    # 3 stages = 1 forward + tail + 1 backward. Tail start s costs (fwd s, tail 4(4-s),
    # bwd 3s): s=1 -> max(1,12,3)=12, s=2 -> max(2,8,6)=8, s=3 -> max(3,4,9)=9. Best s=2.
    got = partition_pipeline(fwd, bwd, tail, 3)
    assert got == PipelineCuts(tail_start=2, forward=(0, 2), backward=(0, 2), bottleneck=8)
    assert got.num_stages == 3
    assert got.forward_parts == ((0, 2),) and got.backward_parts == ((0, 2),)

    # 5 stages: s=3 gives tail 4; 1 forward stage (3) and 3 one-unit backward stages (3
    # each) reach 4. Nothing reaches 3, because the tail alone is at least 4.
    got = partition_pipeline(fwd, bwd, tail, 5)
    assert got == PipelineCuts(tail_start=3, forward=(0, 3), backward=(0, 1, 2, 3),
                               bottleneck=4)
    assert got.backward_parts == ((0, 1), (1, 2), (2, 3))

    # tail_extra = 2 moves the best tail: s=2 -> max(2,10,6)=10, s=3 -> max(3,6,9)=9.
    got = partition_pipeline(fwd, bwd, tail, 3, tail_extra=2)
    assert got == PipelineCuts(tail_start=3, forward=(0, 3), backward=(0, 3), bottleneck=9)

    # One stage: the whole model is the tail.
    got = partition_pipeline(fwd, bwd, tail, 1, tail_extra=5)
    assert got == PipelineCuts(tail_start=0, forward=(), backward=(), bottleneck=21)
    assert got.num_stages == 1 and got.forward_parts == ()

    # Memory: tail 5 B/unit, backward 4 B/unit, forward 1 B/unit, cap 7. The tail can hold
    # one unit only (s=3) and backward units cannot pair (8 > 7), so 3 backward stages,
    # 1 forward stage (3 B): 5 stages, costs fwd 3, tail 4, bwd 3,3,3 -> 4.
    mem = dict(fwd_memory=[1] * 4, bwd_memory=[4] * 4, tail_memory=[5] * 4, memory_cap=7)
    got = partition_pipeline(fwd, bwd, tail, 5, **mem)
    assert got == PipelineCuts(tail_start=3, forward=(0, 3), backward=(0, 1, 2, 3),
                               bottleneck=4)
    # The same cap with a looser tail memory lets s=2 win at 3 stages (as without memory).
    got = partition_pipeline(fwd, bwd, tail, 3, fwd_memory=[1] * 4, bwd_memory=[4] * 4,
                             tail_memory=[5] * 4, memory_cap=10)
    assert got == PipelineCuts(tail_start=2, forward=(0, 2), backward=(0, 2), bottleneck=8)


def test_partition_pipeline_max_stages():
    assert max_pipeline_stages(1) == 1
    assert max_pipeline_stages(6) == 11
    got = partition_pipeline([1] * 6, [3] * 6, [4] * 6, 11)
    assert got.tail_start == 5
    assert got.forward == got.backward == (0, 1, 2, 3, 4, 5)
    assert got.bottleneck == 4
    # A single unit can only be a one-stage pipeline.
    assert partition_pipeline([2], [6], [8], 1).bottleneck == 8


def test_partition_pipeline_shares_side_stages_by_work():
    # Backward is 3x forward; with 9 side stages and plenty of units, backward gets more.
    n = 40
    got = partition_pipeline([10] * n, [30] * n, [40] * n, 10)
    assert len(got.backward_parts) > len(got.forward_parts)
    assert got.num_stages == 10


@pytest.mark.parametrize(
    ("args", "kwargs", "fragments"),
    [
        (([1, 2], [3, 6], [4, 8], 0), {}, ["num_stages = 0", "at least 1"]),
        (([1, 2, 3], [3, 6, 9], [4, 8, 12], 6), {}, ["num_stages = 6", "2n - 1 = 5"]),
        (([1, 2, 3], [3, 6, 9], [4, 8, 12], 2), {}, ["num_stages = 2", "use 1 or 3"]),
        (([], [], [], 1), {}, ["empty"]),
        (([1, 2], [3], [4, 8], 3), {}, ["bwd has 1 entries", "fwd has 2"]),
        (([1, 2], [3, 6], [4, 8, 1], 3), {}, ["tail has 3 entries"]),
        (([1, -2], [3, 6], [4, 8], 3), {}, ["fwd[1] = -2"]),
        (([1, 2], [3, 6], [4, 8], 3), dict(tail_extra=-1), ["tail_extra = -1"]),
        (([1, 2], [3, 6], [4, 8], 3), dict(memory_cap=5), ["memory_cap = 5", "without"]),
        (
            ([1, 2], [3, 6], [4, 8], 3),
            dict(tail_memory=[1], memory_cap=5),
            ["tail_memory has 1 entries", "fwd has 2"],
        ),
        (
            ([1, 2, 3], [3, 6, 9], [4, 8, 12], 3),
            dict(tail_memory=[1, 1, 700 * MiB], memory_cap=512 * MiB),
            ["unit 2 is always in the tail", "700.0 MiB", "512.0 MiB", "split the unit"],
        ),
        (
            ([1, 2, 3], [3, 6, 9], [4, 8, 12], 1),
            dict(tail_memory=[4, 4, 4], memory_cap=10),
            ["num_stages = 1", "all 3 units", "12 bytes", "10 bytes", "num_stages >= 3"],
        ),
        (
            # The tail fits from s=1 (4+4 <= 10) but 5 stages need s >= 2; unit 0's
            # backward (11 B) exceeds the cap and cannot join the tail.
            ([1, 2, 3], [3, 6, 9], [4, 8, 12], 5),
            dict(bwd_memory=[11, 1, 1], tail_memory=[4, 4, 4], memory_cap=10),
            ["unit 0 needs 11 bytes", "backward stage", "5 stages need at least 2 units"],
        ),
        (
            # Same cap 7 example as the hand-worked case, but only 3 stages allowed: the
            # tail starts at 3 at the earliest and the backward side then needs 3 stages.
            ([1] * 4, [3] * 4, [4] * 4, 3),
            dict(fwd_memory=[1] * 4, bwd_memory=[4] * 4, tail_memory=[5] * 4, memory_cap=7),
            ["num_stages = 3 is too few", "only from s = 3", "1 forward and 3 backward",
             "at least 5 stages"],
        ),
    ],
)
def test_partition_pipeline_errors(args, kwargs, fragments):
    with pytest.raises(PartitionError) as info:
        partition_pipeline(*args, **kwargs)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))


def test_max_pipeline_stages_rejects_empty():
    with pytest.raises(PartitionError, match="n = 0"):
        max_pipeline_stages(0)


def test_module_is_pure_python():
    import roundpipe.passes.partition as mod

    source = open(mod.__file__, encoding="utf-8").read()
    for banned in ("import torch", "from torch", "networkx"):
        assert banned not in source
    assert "print(" not in source
    # Its imports are the standard library and roundpipe.errors, which imports only the
    # standard library.
    import ast

    def imported(path):
        tree = ast.parse(open(path, encoding="utf-8").read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add((node.module or "").split(".")[0] if node.level == 0 else "."
                          + (node.module or ""))
        return names

    assert imported(mod.__file__) <= set(sys.stdlib_module_names) | {"__future__", "roundpipe"}
    errors_file = os.path.join(os.path.dirname(os.path.dirname(mod.__file__)), "errors.py")
    assert imported(errors_file) <= set(sys.stdlib_module_names) | {"__future__"}


# --------------------------------------------------------------------------------------
# simulate_round_robin
# --------------------------------------------------------------------------------------


def test_simulate_single_device_is_serial():
    # One device runs everything back to back: 2 microbatches * (1 + 2 + 3) = 12.
    sched = simulate_round_robin([1.0, 2.0, 3.0], 2, 1)
    assert sched == Schedule(makespan=12.0, job_start=(0.0, 2.0, 6.0),
                             job_end=(2.0, 6.0, 12.0), device_busy=(12.0,))
    assert sched.busy_fraction == pytest.approx(1.0)


@pytest.mark.parametrize(("a", "b", "m"), [(1.0, 2.0, 3), (2.0, 1.0, 4), (1.5, 1.5, 1)])
def test_simulate_two_stage_pipeline_fill(a, b, m):
    # Classic two-stage pipeline: the fill is a + b, then the slower stage paces the rest.
    sched = simulate_round_robin([a, b], m, 2)
    assert sched.makespan == pytest.approx(a + b + (m - 1) * max(a, b))
    assert sched.device_busy == pytest.approx((a * m, b * m))
    assert sched.job_start == pytest.approx((0.0, a))


def test_simulate_round_robin_hand_worked():
    # 3 jobs of cost 1, 2 microbatches, 2 devices. Job 0 (dev 0): mbs end 1, 2. Job 1
    # (dev 1): mb0 1-2, mb1 2-3. Job 2 (dev 0, waits for job 0 = 2): mb0 max(2, 2)=2-3,
    # mb1 max(3, 3)=3-4.
    sched = simulate_round_robin([1, 1, 1], 2, 2)
    assert sched.job_start == (0.0, 1.0, 2.0)
    assert sched.job_end == (2.0, 3.0, 4.0)
    assert sched.device_busy == (4.0, 2.0)
    assert sched.busy_fraction == pytest.approx((4 / 4 + 2 / 4) / 2)


def test_simulate_uploads_delay_first_microbatch():
    # Upload of job 0 takes 5: compute 5-6. Job 1 uploads 5-6 (after the previous upload),
    # computes 6-7.
    sched = simulate_round_robin([1, 1], 1, 1, upload_times=[5, 1])
    assert sched.job_start == (5.0, 6.0)
    assert sched.makespan == 7.0


def test_simulate_uploads_double_buffering():
    # One device, jobs [4, 1, 1], uploads [1, 1, 3]. Job 0: upload 0-1, compute 1-5.
    # Job 1: upload 1-2, compute 5-6. Job 2's upload must wait for job 0 (two back) to
    # finish: 5-8, compute 8-9. Without that rule it would upload 2-5 and end at 7.
    sched = simulate_round_robin([4, 1, 1], 1, 1, upload_times=[1, 1, 3])
    assert sched.job_start == (1.0, 5.0, 8.0)
    assert sched.job_end == (5.0, 6.0, 9.0)
    assert sched.makespan == 9.0


def test_simulate_empty_and_zero():
    sched = simulate_round_robin([], 3, 2)
    assert sched.makespan == 0.0 and sched.busy_fraction == 0.0
    assert sched.device_busy == (0.0, 0.0)
    assert simulate_round_robin([0.0, 0.0], 2, 2).busy_fraction == 0.0


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        (([1.0], 0, 1), {}, "num_microbatches = 0"),
        (([1.0], 1, 0), {}, "num_devices = 0"),
        (([1.0, -1.0], 1, 1), {}, "job_costs[1] = -1.0"),
        (([1.0, float("nan")], 1, 1), {}, "job_costs[1] = nan"),
        (([1.0], 1, 1), dict(upload_times=[1.0, 2.0]), "upload_times has 2 entries"),
        (([1.0], 1.5, 1), {}, "num_microbatches must be an integer"),
    ],
)
def test_simulate_errors(args, kwargs, fragment):
    with pytest.raises(PartitionError) as info:
        simulate_round_robin(*args, **kwargs)
    assert fragment in str(info.value)


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=12),
    m=st.integers(1, 6),
    d=st.integers(1, 5),
    with_uploads=st.booleans(),
    data=st.data(),
)
def test_simulate_properties(costs, m, d, with_uploads, data):
    uploads = None
    if with_uploads:
        uploads = data.draw(st.lists(st.floats(0.0, 5.0), min_size=len(costs),
                                     max_size=len(costs)))
    sched = simulate_round_robin(costs, m, d, upload_times=uploads)
    total = sum(costs) * m
    eps = 1e-9 * (1 + total)
    assert sched.makespan >= total / d - eps
    assert sched.makespan >= max(sched.device_busy) - eps
    # The chain of microbatch 0 through every job, plus the last job's remaining ones.
    assert sched.makespan >= sum(costs) + (m - 1) * costs[-1] - eps
    assert sum(sched.device_busy) == pytest.approx(total)
    assert 0.0 <= sched.busy_fraction <= 1.0 + 1e-9
    for j in range(len(costs)):
        assert sched.job_end[j] >= sched.job_start[j] + m * costs[j] - eps
        if j >= d:
            assert sched.job_start[j] >= sched.job_end[j - d] - eps
        if j >= 1:
            # Data dependency: microbatch 0 of job j after microbatch 0 of job j - 1.
            assert sched.job_start[j] >= sched.job_start[j - 1] + costs[j - 1] - eps
        if uploads is not None:
            assert sched.job_start[j] >= uploads[j] - eps
