"""Time the exact partition solvers on random chains.

Run ``python bench/partition_solver.py``. Prints the median wall time of
``min_max_partition`` and ``partition_pipeline`` for a few sizes; the target is well under
50 ms for 1000 units and 64 parts.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roundpipe.passes.partition import min_max_partition, partition_pipeline  # noqa: E402
from benchutil import add_smoke_flag  # noqa: E402

REPEATS = 15
SIZES = (100, 1000)
PARTS = (8, 64)


def _median_ms(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm-up, so first-call costs do not skew the median
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_flag(parser)
    args = parser.parse_args()
    sizes, parts, repeats = ((20,), (4,), 1) if args.smoke else (SIZES, PARTS, REPEATS)
    rng = random.Random(0)
    rows = []
    for n in sizes:
        # Nanosecond-scale costs (up to ~1 ms per unit) make the binary search take its
        # full ~30-40 steps, which is the realistic worst case.
        fwd = [rng.randint(10_000, 1_000_000) for _ in range(n)]
        bwd = [3 * f + rng.randint(0, 50_000) for f in fwd]
        tail = [f + b for f, b in zip(fwd, bwd)]
        mem = [rng.randint(1, 64) * 2**20 for _ in range(n)]
        for k in parts:
            if k > n:
                continue
            # The "+mem" columns time the extra memory bisect in every probe; the cap is loose
            # enough (each side needs about k/4 stages under it) that the stage count fits.
            cap = max(max(mem), 4 * sum(mem) // k)
            mm = _median_ms(lambda: min_max_partition(fwd, k), repeats)
            mm_mem = _median_ms(lambda: min_max_partition(fwd, k, memory=mem, memory_cap=cap),
                                repeats)
            pp = _median_ms(lambda: partition_pipeline(fwd, bwd, tail, k), repeats)
            pp_mem = _median_ms(
                lambda: partition_pipeline(
                    fwd, bwd, tail, k, fwd_memory=mem, bwd_memory=mem, tail_memory=mem,
                    memory_cap=cap,
                ),
                repeats,
            )
            rows.append([n, k, f"{mm:.2f}", f"{mm_mem:.2f}", f"{pp:.2f}", f"{pp_mem:.2f}"])
    headers = [
        "units",
        "parts/stages",
        "min_max ms",
        "min_max+mem ms",
        "pipeline ms",
        "pipeline+mem ms",
    ]
    print(f"median of {repeats} runs, Python {sys.version.split()[0]}")
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
