"""``print(pipe.stats())``: the last call's counters as a table, one row per device.

The dataclasses keep every number (``pipe.stats().devices[0].uploaded``, the timeline);
the table is what a person reads: transfers, peaks and busy time per device, and a
summary line.  Its size grows with the device count only, not with the jobs or the
parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabulate import tabulate

if TYPE_CHECKING:  # pragma: no cover
    from .executor import RunStats


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render(stats: RunStats) -> str:
    jobs: dict[str, list[float]] = {}
    for job in stats.timeline:
        jobs.setdefault(job.device, []).append(job.end_s - job.start_s)
    measured = any(d.peak_allocated_bytes is not None for d in stats.devices)
    headers = ["device", "jobs", "busy", "uploaded", "(weights)", "downloaded", "(grads)",
               "peak resident"] + (["peak allocated"] if measured else [])
    rows = []
    for d in stats.devices:
        busy = sum(jobs.get(d.name, ()))
        row = [d.name, len(jobs.get(d.name, ())),
               f"{busy:.3f} s ({busy / stats.wall_s:.0%})" if stats.wall_s > 0 else "-",
               fmt_bytes(d.bytes_uploaded), fmt_bytes(d.uploaded.get("weights", 0)),
               fmt_bytes(d.bytes_downloaded), fmt_bytes(d.downloaded.get("grads", 0)),
               fmt_bytes(d.peak_resident_bytes)]
        if measured:
            row.append(fmt_bytes(d.peak_allocated_bytes))
        rows.append(row)
    lines = [tabulate(rows, headers=headers, disable_numparse=True)]
    lines.append(
        f"last call: {stats.wall_s:.3f} s, {len(stats.timeline)} jobs on "
        f"{len(stats.devices)} device(s); uploaded {fmt_bytes(stats.bytes_uploaded)}, "
        f"downloaded {fmt_bytes(stats.bytes_downloaded)} (parameter gradients "
        f"{fmt_bytes(stats.grad_bytes_downloaded)})")
    if stats.stage_peak_bytes:
        stage, peak = max(stats.stage_peak_bytes.items(), key=lambda kv: kv[1])
        lines.append(f"largest stage peak (measured): {fmt_bytes(peak)} (stage {stage}); "
                     "all: .stage_peak_bytes")
    dp = stats.data_parallel
    if dp is not None:
        lines.append(f"data parallel: rank {dp.rank} of {dp.world_size}, {dp.reduction} of "
                     f"{fmt_bytes(dp.bytes_reduced)} in {len(dp.buckets)} bucket(s), "
                     f"{dp.exposed_s:.3f} s not hidden under the backward")
    lines.append("(fields: .devices, .timeline, ...; pipe.timeline(path) writes the jobs "
                 "as a trace)")
    return "\n".join(lines)
