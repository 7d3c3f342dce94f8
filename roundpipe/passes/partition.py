"""Exact partitioning of a chain of units into pipeline stages, and a step-time model.

Everything here is pure Python over integer costs (for example nanoseconds) and integer
memory sizes (bytes), so it can be tested and benchmarked without torch.

* :func:`min_max_partition` cuts ``n`` units into exactly ``k`` contiguous parts so the most
  expensive part is as cheap as possible, under an optional per-part memory cap.
* :func:`partition_pipeline` chooses the forward stages, the fused tail stage (forward + loss +
  backward of the last units) and the backward stages of a training step so that the most
  expensive stage is as cheap as possible.
* :func:`simulate_round_robin` estimates the step time of jobs dispatched round-robin to
  devices, microbatch by microbatch, optionally with double-buffered weight uploads.

Both solvers are exact: they binary-search the integer bottleneck ``B`` and test each
candidate with a greedy probe (the fewest parts whose cost stays ``<= B`` and memory stays
``<= cap``), which is optimal on a chain because extending a part as far as possible never
hurts the parts after it.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from roundpipe.errors import PartitionError

__all__ = [
    "Partition",
    "PipelineCuts",
    "Schedule",
    "max_pipeline_stages",
    "min_max_partition",
    "partition_pipeline",
    "simulate_round_robin",
]


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


def _bounds_to_parts(bounds: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class Partition:
    """A split of units ``0..n-1`` into contiguous, non-empty parts.

    Attributes:
        bounds: ``(0, b1, ..., n)``, strictly increasing; part ``p`` is
            ``range(bounds[p], bounds[p + 1])``.
        bottleneck: the largest part cost.
    """

    bounds: tuple[int, ...]
    bottleneck: int

    @property
    def parts(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of every part, in order."""
        return _bounds_to_parts(self.bounds)

    @property
    def num_parts(self) -> int:
        """Number of parts."""
        return len(self.bounds) - 1


@dataclass(frozen=True)
class PipelineCuts:
    """Stages of one training step over units ``0..n-1``.

    The step runs the forward stages over ``[0, tail_start)`` in order, then one fused tail
    stage over ``[tail_start, n)`` (forward, loss and backward), then the backward stages over
    ``[0, tail_start)`` in reverse order.

    Attributes:
        tail_start: first unit of the tail stage (``0`` when the tail is the whole model).
        forward: bounds of the forward stages over ``[0, tail_start)``, ascending, e.g.
            ``(0, 3, 5)``; ``()`` when ``tail_start == 0``.
        backward: bounds of the backward stages over ``[0, tail_start)``, ascending like
            ``forward`` (the executor runs these parts last-to-first); ``()`` when
            ``tail_start == 0``.
        bottleneck: the largest stage cost (forward, tail or backward).
    """

    tail_start: int
    forward: tuple[int, ...]
    backward: tuple[int, ...]
    bottleneck: int

    @property
    def forward_parts(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of every forward stage, in execution order."""
        return _bounds_to_parts(self.forward)

    @property
    def backward_parts(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of every backward stage, ascending (executed last-to-first)."""
        return _bounds_to_parts(self.backward)

    @property
    def num_stages(self) -> int:
        """Forward stages + the tail stage + backward stages."""
        return len(self.forward_parts) + 1 + len(self.backward_parts)


@dataclass(frozen=True)
class Schedule:
    """Outcome of :func:`simulate_round_robin`.

    Attributes:
        makespan: time at which the last microbatch of the last job finishes (seconds).
        job_start: start time of each job's first microbatch.
        job_end: finish time of each job's last microbatch.
        device_busy: compute seconds spent on each device.
    """

    makespan: float
    job_start: tuple[float, ...]
    job_end: tuple[float, ...]
    device_busy: tuple[float, ...]

    @property
    def busy_fraction(self) -> float:
        """Mean over devices of ``busy / makespan`` (``0.0`` for an empty schedule)."""
        if self.makespan <= 0.0 or not self.device_busy:
            return 0.0
        return sum(b / self.makespan for b in self.device_busy) / len(self.device_busy)


# --------------------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------------------


def _as_count(value: object, name: str) -> int:
    """Return ``value`` as a Python int, rejecting floats and other non-integers."""
    if isinstance(value, bool):
        raise PartitionError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise PartitionError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


def _as_int_list(values: Sequence[int], name: str, unit: str) -> list[int]:
    """Copy ``values`` into a list of non-negative Python ints."""
    out: list[int] = []
    for i, v in enumerate(values):
        try:
            x = operator.index(v)
        except TypeError:
            raise PartitionError(
                f"{name}[{i}] = {v!r} is not an integer; {name} must be non-negative integers "
                f"({unit}), so round them before partitioning"
            ) from None
        if x < 0:
            raise PartitionError(
                f"{name}[{i}] = {x} is negative; {name} must be non-negative integers ({unit})"
            )
        out.append(x)
    return out


def _prefix(values: list[int]) -> list[int]:
    """``out[i] = sum(values[:i])``; non-decreasing because values are non-negative."""
    out = [0] * (len(values) + 1)
    acc = 0
    for i, v in enumerate(values):
        acc += v
        out[i + 1] = acc
    return out


def _check_memory(
    memory: Sequence[int] | None, n: int, name: str, owner: str
) -> list[int] | None:
    if memory is None:
        return None
    mem = _as_int_list(memory, name, "bytes")
    if len(mem) != n:
        raise PartitionError(
            f"{name} has {len(mem)} entries but {owner} has {n}; give one memory size per unit"
        )
    return mem


def _check_cap(memory_cap: int | None) -> int | None:
    if memory_cap is None:
        return None
    cap = _as_count(memory_cap, "memory_cap")
    if cap < 0:
        raise PartitionError(f"memory_cap = {cap} is negative; pass a size in bytes or None")
    return cap


def _mib(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"


# --------------------------------------------------------------------------------------
# Chain solver shared by both partitioners
# --------------------------------------------------------------------------------------
#
# A "line" is a chain [0, stop) described by prefix sums: P (cost) and optionally Q (memory,
# with cap). Working on prefixes lets the pipeline solver reuse one set of arrays for every
# candidate tail start.


def _reach(P: list[int], Q: list[int] | None, cap: int, i: int, stop: int, bound: int) -> int:
    """Furthest ``j`` in ``(i, stop]`` with ``cost[i:j] <= bound`` and ``mem[i:j] <= cap``.

    Returns ``i`` when unit ``i`` alone does not fit.
    """
    j = bisect_right(P, P[i] + bound, i + 1, stop + 1) - 1
    if Q is not None:
        jm = bisect_right(Q, Q[i] + cap, i + 1, stop + 1) - 1
        if jm < j:
            j = jm
    return j


def _greedy_count(
    P: list[int], Q: list[int] | None, cap: int, stop: int, bound: int, limit: int
) -> int:
    """Fewest parts covering ``[0, stop)`` under ``bound`` / ``cap``; ``limit + 1`` if more.

    Stopping at ``limit`` keeps each probe O(limit log n) instead of O(n log n).
    """
    i = 0
    count = 0
    while i < stop:
        if count >= limit:
            return limit + 1
        j = _reach(P, Q, cap, i, stop, bound)
        if j == i:
            return limit + 1
        count += 1
        i = j
    return count


def _build_parts(
    P: list[int], Q: list[int] | None, cap: int, stop: int, k: int, bound: int
) -> tuple[int, ...]:
    """Exactly ``k`` parts over ``[0, stop)``, each within ``bound`` / ``cap``.

    Requires the greedy count at ``bound`` to be ``<= k <= stop``. Plain greedy would pack the
    early parts full and leave the late ones light; instead each cut aims at an equal share of
    the remaining cost, restricted to the cuts after which the rest is still feasible.
    """
    # need[i]: fewest parts for the suffix [i, stop); non-increasing in i (a shorter suffix
    # never needs more parts), stored negated so bisect can search it.
    neg_need = [0] * (stop + 1)
    for i in range(stop - 1, -1, -1):
        j = _reach(P, Q, cap, i, stop, bound)
        # j > i is guaranteed because every unit fits alone once a feasible bound is known.
        neg_need[i] = neg_need[j] - 1
    bounds = [0]
    i = 0
    for r in range(k, 0, -1):
        # Cut j must leave a suffix that r-1 parts can cover (need[j] <= r-1) and that has at
        # least r-1 units, and the part [i, j) itself must fit.
        lo = bisect_left(neg_need, -(r - 1), i + 1, stop + 1)
        hi = min(_reach(P, Q, cap, i, stop, bound), stop - (r - 1))
        rem = P[stop] - P[i]
        # First j whose part cost reaches the fair share rem / r, compared in integers.
        j0 = bisect_left(P, P[i] + -(-rem // r), lo, hi + 1)
        best = -1
        best_err = -1
        for c in (j0 - 1, j0):
            c = min(max(c, lo), hi)
            err = abs((P[c] - P[i]) * r - rem)
            if best < 0 or err < best_err:
                best, best_err = c, err
        bounds.append(best)
        i = best
    return tuple(bounds)


def _max_part_cost(P: list[int], bounds: Sequence[int]) -> int:
    return max((P[b] - P[a] for a, b in zip(bounds[:-1], bounds[1:])), default=0)


def _solve_line(
    P: list[int], Q: list[int] | None, cap: int, stop: int, k: int
) -> tuple[tuple[int, ...], int]:
    """Optimal ``k``-part split of ``[0, stop)``; the caller has checked it is feasible."""
    largest_unit = max(P[i + 1] - P[i] for i in range(stop))
    # Any split has a part holding the largest unit and a part holding >= the average.
    lo = max(largest_unit, -(-P[stop] // k))
    hi = max(lo, P[stop])
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy_count(P, Q, cap, stop, mid, k) <= k:
            hi = mid
        else:
            lo = mid + 1
    bounds = _build_parts(P, Q, cap, stop, k, lo)
    return bounds, _max_part_cost(P, bounds)


# --------------------------------------------------------------------------------------
# min_max_partition
# --------------------------------------------------------------------------------------


def min_max_partition(
    costs: Sequence[int],
    num_parts: int,
    *,
    memory: Sequence[int] | None = None,
    memory_cap: int | None = None,
) -> Partition:
    """Split units into exactly ``num_parts`` contiguous parts minimising the largest cost.

    Args:
        costs: non-negative integer cost of each unit (for example nanoseconds).
        num_parts: number of parts, ``1 <= num_parts <= len(costs)``.
        memory: non-negative integer bytes of each unit; required with ``memory_cap``.
        memory_cap: largest total memory a part may hold, or ``None`` for no limit.

    Returns:
        The optimal :class:`Partition`; among optimal splits, cuts aim at equal shares of
        the cost so that parts are balanced beyond the bottleneck.

    Raises:
        PartitionError: on malformed input, or when no split satisfies the memory cap.
    """
    cost = _as_int_list(costs, "costs", "e.g. nanoseconds")
    n = len(cost)
    k = _as_count(num_parts, "num_parts")
    if n == 0:
        raise PartitionError("costs is empty; there are no units to partition")
    if k < 1:
        raise PartitionError(f"num_parts = {k}; ask for at least 1 part")
    if k > n:
        raise PartitionError(
            f"num_parts = {k} but there are only {n} units and parts must be non-empty; "
            f"ask for at most {n} parts or split the units further"
        )
    mem = _check_memory(memory, n, "memory", "costs")
    cap = _check_cap(memory_cap)
    if cap is not None and mem is None:
        raise PartitionError(
            f"memory_cap = {cap} was given without memory; pass memory= with one size per unit"
        )

    P = _prefix(cost)
    Q: list[int] | None = None
    cap_value = 0
    if cap is not None and mem is not None:
        for i, m in enumerate(mem):
            if m > cap:
                raise PartitionError(
                    f"unit {i} alone needs {_mib(m)} but the memory cap is {_mib(cap)}; "
                    "raise the cap or split the unit"
                )
        Q = _prefix(mem)
        cap_value = cap
        # With the cost limit lifted only memory constrains the split.
        needed = _greedy_count(P, Q, cap_value, n, P[n], n)
        if needed > k:
            raise PartitionError(
                f"the memory cap of {_mib(cap)} needs at least {needed} parts to hold "
                f"{_mib(Q[n])} of units, but num_parts = {k}; raise num_parts to {needed} "
                "or raise the cap"
            )
    bounds, bottleneck = _solve_line(P, Q, cap_value, n, k)
    return Partition(bounds=bounds, bottleneck=bottleneck)


# --------------------------------------------------------------------------------------
# partition_pipeline
# --------------------------------------------------------------------------------------


def max_pipeline_stages(n: int) -> int:
    """Most stages a pipeline over ``n`` units can have: ``2n - 1``.

    That is ``n - 1`` single-unit forward stages, a one-unit tail and ``n - 1`` backward
    stages.

    Raises:
        PartitionError: if ``n < 1``.
    """
    n = _as_count(n, "n")
    if n < 1:
        raise PartitionError(f"n = {n}; a pipeline needs at least 1 unit")
    return 2 * n - 1


def _min_tail_start(prefix: list[int], extra: int, bound: int) -> int:
    """Smallest ``s`` with ``prefix[n] - prefix[s] + extra <= bound`` (``n + 1`` if none)."""
    n = len(prefix) - 1
    return bisect_left(prefix, prefix[n] + extra - bound)


def partition_pipeline(
    fwd: Sequence[int],
    bwd: Sequence[int],
    tail: Sequence[int],
    num_stages: int,
    *,
    fwd_memory: Sequence[int] | None = None,
    bwd_memory: Sequence[int] | None = None,
    tail_memory: Sequence[int] | None = None,
    memory_cap: int | None = None,
    tail_extra: int = 0,
) -> PipelineCuts:
    """Choose forward, tail and backward stages minimising the most expensive stage.

    A forward stage ``[i, j)`` costs ``sum(fwd[i:j])``; the tail ``[s, n)`` costs
    ``sum(tail[s:n]) + tail_extra``; a backward stage ``[i, j)`` costs ``sum(bwd[i:j])``
    (backward stages recompute their forward, so ``bwd`` is typically about ``3 * fwd``).
    Forward and backward cuts are chosen independently.

    Args:
        fwd: forward cost of each unit.
        bwd: backward cost of each unit (including recomputation).
        tail: cost of each unit when run in the fused tail stage.
        num_stages: exact total number of stages: ``1`` (everything in the tail) or
            ``3 .. 2n - 1``.
        fwd_memory: bytes each unit needs in a forward stage (zero if omitted).
        bwd_memory: bytes each unit needs in a backward stage (zero if omitted).
        tail_memory: bytes each unit needs in the tail stage (zero if omitted).
        memory_cap: largest total memory of any stage, or ``None`` for no limit.
        tail_extra: fixed cost added to the tail (for example the loss).

    Returns:
        The optimal :class:`PipelineCuts`. Among optimal answers the tail is the largest
        one that fits, the extra stages are shared between the forward and backward sides
        in proportion to their work, and each side is itself split optimally.

    Raises:
        PartitionError: on malformed input, or when no choice meets the stage count and the
            memory cap.
    """
    f_cost = _as_int_list(fwd, "fwd", "e.g. nanoseconds")
    n = len(f_cost)
    if n == 0:
        raise PartitionError("fwd is empty; there are no units to partition")
    b_cost = _as_int_list(bwd, "bwd", "e.g. nanoseconds")
    t_cost = _as_int_list(tail, "tail", "e.g. nanoseconds")
    for name, seq in (("bwd", b_cost), ("tail", t_cost)):
        if len(seq) != n:
            raise PartitionError(
                f"{name} has {len(seq)} entries but fwd has {n}; give one cost per unit"
            )
    k = _as_count(num_stages, "num_stages")
    extra = _as_count(tail_extra, "tail_extra")
    if extra < 0:
        raise PartitionError(f"tail_extra = {extra} is negative; it must be a cost >= 0")
    f_mem = _check_memory(fwd_memory, n, "fwd_memory", "fwd")
    b_mem = _check_memory(bwd_memory, n, "bwd_memory", "fwd")
    t_mem = _check_memory(tail_memory, n, "tail_memory", "fwd")
    cap = _check_cap(memory_cap)
    if cap is not None and f_mem is None and b_mem is None and t_mem is None:
        raise PartitionError(
            f"memory_cap = {cap} was given without fwd_memory, bwd_memory or tail_memory; "
            "pass the per-unit memory sizes"
        )

    most = 2 * n - 1
    if k < 1:
        raise PartitionError(f"num_stages = {k}; ask for at least 1 stage")
    if k > most:
        raise PartitionError(
            f"num_stages = {k} but {n} units allow at most 2n - 1 = {most} stages "
            f"({n - 1} forward, 1 tail, {n - 1} backward); lower num_stages to {most}"
        )
    if k == 2:
        raise PartitionError(
            "num_stages = 2 is impossible: a pipeline is either 1 stage (the whole model in "
            "the tail) or at least 3 (forward, tail, backward); use 1 or 3"
        )

    F, Bk, T = _prefix(f_cost), _prefix(b_cost), _prefix(t_cost)
    FM: list[int] | None = None
    BM: list[int] | None = None
    TM: list[int] | None = None
    cap_value = 0
    s_mem = 0  # earliest tail start the tail's memory allows
    if cap is not None:
        cap_value = cap
        zeros = [0] * n
        FM = _prefix(f_mem if f_mem is not None else zeros)
        BM = _prefix(b_mem if b_mem is not None else zeros)
        TM = _prefix(t_mem if t_mem is not None else zeros)
        last_tail = TM[n] - TM[n - 1]
        if last_tail > cap:
            raise PartitionError(
                f"unit {n - 1} is always in the tail stage and alone needs {_mib(last_tail)} "
                f"there, but the memory cap is {_mib(cap)}; raise the cap or split the unit"
            )
        s_mem = _min_tail_start(TM, 0, cap)

    if k == 1:
        if s_mem > 0 and TM is not None:
            raise PartitionError(
                f"num_stages = 1 puts all {n} units in the tail stage, which needs "
                f"{_mib(TM[n])}, but the memory cap is {_mib(cap_value)}; use num_stages >= 3 "
                "or raise the cap"
            )
        return PipelineCuts(tail_start=0, forward=(), backward=(), bottleneck=T[n] + extra)

    min_side = k // 2  # f + b = k - 1 with f, b <= s needs s >= ceil((k - 1) / 2)

    def probe(bound: int) -> tuple[int, int, int] | None:
        """``(s, gf, gb)`` for the largest tail fitting ``bound``, or None if infeasible.

        The smallest admissible s is the best choice: the greedy counts only grow with s,
        while the upper limit of 2s + 1 stages is already met by the lower bound on s.
        """
        s = max(_min_tail_start(T, extra, bound), s_mem, min_side)
        if s > n - 1:
            return None
        gf = _greedy_count(F, FM, cap_value, s, bound, k - 2)
        if gf > k - 2:
            return None
        gb = _greedy_count(Bk, BM, cap_value, s, bound, k - 1 - gf)
        if gf + gb > k - 1:
            return None
        return s, gf, gb

    # The last unit always sits in the tail, so the tail alone bounds B from below; at the
    # upper bound every cost limit is slack and only memory and the count can fail.
    lo = T[n] - T[n - 1] + extra
    hi = max(F[n], Bk[n], T[n] + extra, lo)
    if probe(hi) is None:
        raise _diagnose_pipeline(n, k, cap_value, s_mem, min_side, F, Bk, FM, BM, TM)
    while lo < hi:
        mid = (lo + hi) // 2
        if probe(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    found = probe(lo)
    if found is None:  # pragma: no cover - monotone search always ends on a feasible bound
        raise PartitionError(f"internal error: bottleneck {lo} stopped being feasible")
    s, gf, gb = found

    # Split the k - 1 side stages: proportional to each side's work, within what is feasible
    # (each side needs its greedy count and can hold at most one stage per unit).
    b_lo = max(gb, k - 1 - s)
    b_hi = min(s, k - 1 - gf)
    work = F[s] + Bk[s]
    ideal = ((k - 1) * Bk[s] * 2 + work) // (2 * work) if work else (k - 1) // 2
    nb = min(max(ideal, b_lo), b_hi)
    nf = k - 1 - nb
    fwd_bounds, fwd_bn = _solve_line(F, FM, cap_value, s, nf)
    bwd_bounds, bwd_bn = _solve_line(Bk, BM, cap_value, s, nb)
    tail_cost = T[n] - T[s] + extra
    return PipelineCuts(
        tail_start=s,
        forward=fwd_bounds,
        backward=bwd_bounds,
        bottleneck=max(fwd_bn, bwd_bn, tail_cost),
    )


def _diagnose_pipeline(
    n: int,
    k: int,
    cap: int,
    s_mem: int,
    min_side: int,
    F: list[int],
    Bk: list[int],
    FM: list[int] | None,
    BM: list[int] | None,
    TM: list[int] | None,
) -> PartitionError:
    """Explain why no pipeline with ``k`` stages fits the memory cap."""
    if FM is None or BM is None or TM is None:  # pragma: no cover - counts were checked
        return PartitionError(f"no pipeline of {k} stages over {n} units exists")
    s = max(s_mem, min_side)
    why = (
        f"the tail [s, {n}) fits the cap only from s = {s_mem}"
        if s == s_mem
        else f"{k} stages need at least {min_side} units outside the tail"
    )
    for i in range(s):
        for side, M in (("forward", FM), ("backward", BM)):
            need = M[i + 1] - M[i]
            if need > cap:
                return PartitionError(
                    f"unit {i} needs {_mib(need)} in its {side} stage but the memory cap is "
                    f"{_mib(cap)}, and it cannot move into the tail because {why}; "
                    "raise the cap or split the unit"
                )
    gf = _greedy_count(F, FM, cap, s, F[s], s)
    gb = _greedy_count(Bk, BM, cap, s, Bk[s], s)
    return PartitionError(
        f"num_stages = {k} is too few for the memory cap of {_mib(cap)}: {why}, and covering "
        f"units [0, {s}) within the cap takes at least {gf} forward and {gb} backward stages, "
        f"so at least {gf + gb + 1} stages; raise num_stages or the cap"
    )


# --------------------------------------------------------------------------------------
# simulate_round_robin
# --------------------------------------------------------------------------------------


def _as_seconds(values: Sequence[float], name: str) -> list[float]:
    out: list[float] = []
    for i, v in enumerate(values):
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise PartitionError(f"{name}[{i}] = {v!r} is not a number of seconds") from None
        if not math.isfinite(x) or x < 0.0:
            raise PartitionError(
                f"{name}[{i}] = {x} is not a finite non-negative number of seconds"
            )
        out.append(x)
    return out


def simulate_round_robin(
    job_costs: Sequence[float],
    num_microbatches: int,
    num_devices: int,
    *,
    upload_times: Sequence[float] | None = None,
) -> Schedule:
    """Simulate jobs dispatched round-robin to devices and return the resulting timeline.

    Job ``j`` runs on device ``j % D`` and processes microbatches ``0..M-1`` in order, each
    taking ``job_costs[j]`` seconds. Microbatch ``i`` of job ``j`` starts once microbatch
    ``i`` of job ``j - 1`` is done (data), microbatch ``i - 1`` of job ``j`` is done, and job
    ``j - D`` (the device's previous job) is completely done. With ``upload_times``, job
    ``j``'s weights upload on its device after the device's previous upload finished and after
    job ``j - 2D`` finished (double buffering: two stages resident at most), and job ``j``
    cannot start computing before its upload finished.

    Args:
        job_costs: seconds per microbatch of each job, in execution order.
        num_microbatches: microbatches per job, ``M >= 1``.
        num_devices: devices used round-robin, ``D >= 1``.
        upload_times: seconds to upload each job's weights, or ``None`` to ignore uploads.

    Returns:
        The :class:`Schedule`.

    Raises:
        PartitionError: on malformed input.
    """
    cost = _as_seconds(job_costs, "job_costs")
    m = _as_count(num_microbatches, "num_microbatches")
    d = _as_count(num_devices, "num_devices")
    if m < 1:
        raise PartitionError(f"num_microbatches = {m}; it must be at least 1")
    if d < 1:
        raise PartitionError(f"num_devices = {d}; it must be at least 1")
    uploads: list[float] | None = None
    if upload_times is not None:
        uploads = _as_seconds(upload_times, "upload_times")
        if len(uploads) != len(cost):
            raise PartitionError(
                f"upload_times has {len(uploads)} entries but job_costs has {len(cost)}; "
                "give one upload time per job"
            )

    num_jobs = len(cost)
    job_start = [0.0] * num_jobs
    job_end = [0.0] * num_jobs
    upload_end = [0.0] * num_jobs
    busy = [0.0] * d
    prev_done = [0.0] * m  # finish time of each microbatch in the previous job
    for j in range(num_jobs):
        ready = job_end[j - d] if j >= d else 0.0
        if uploads is not None:
            up_start = max(
                upload_end[j - d] if j >= d else 0.0,
                job_end[j - 2 * d] if j >= 2 * d else 0.0,
            )
            upload_end[j] = up_start + uploads[j]
            ready = max(ready, upload_end[j])
        t = ready
        done = [0.0] * m
        for i in range(m):
            start = max(t, prev_done[i]) if j > 0 else t
            if i == 0:
                job_start[j] = start
            t = start + cost[j]
            done[i] = t
        job_end[j] = t
        busy[j % d] += cost[j] * m
        prev_done = done
    makespan = max(job_end, default=0.0)
    return Schedule(
        makespan=makespan,
        job_start=tuple(job_start),
        job_end=tuple(job_end),
        device_busy=tuple(busy),
    )
