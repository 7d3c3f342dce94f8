"""The job timeline of a call as a Chrome / Perfetto trace (open in ui.perfetto.dev or
chrome://tracing), and as rows for a Gantt chart."""

from __future__ import annotations

import json
import os
from typing import Any

from .executor import RunStats

_COLORS = {"fwd": "thread_state_running", "fused": "thread_state_iowait",
           "bwd": "thread_state_runnable"}


def chrome_trace(stats: RunStats) -> dict[str, Any]:
    """One track per device; a slice per job with one nested slice per microbatch."""
    devices = [d.name for d in stats.devices]
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "roundpipe"}}]
    for tid, name in enumerate(devices):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid,
                       "args": {"sort_index": tid}})
    for record in stats.timeline:
        tid = devices.index(record.device)
        events.append({
            "ph": "X", "name": f"stage {record.stage} {record.kind}", "pid": 0, "tid": tid,
            "ts": record.start_s * 1e6, "dur": (record.end_s - record.start_s) * 1e6,
            "cname": _COLORS.get(record.kind, "generic_work"),
            "args": {"job": record.job, "units": record.units,
                     "microbatches": record.microbatches,
                     "weights_requested_s": record.weights_requested_s},
        })
        for mb, (start, end) in enumerate(record.microbatch_s):
            events.append({"ph": "X", "name": f"mb {mb}", "pid": 0, "tid": tid,
                           "ts": start * 1e6, "dur": (end - start) * 1e6,
                           "args": {"stage": record.stage, "microbatch": mb}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(stats: RunStats, path: str | os.PathLike[str]) -> str:
    """Write :func:`chrome_trace` to ``path`` (only there) and return the path."""
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(stats), f)
    return path
