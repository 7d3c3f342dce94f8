"""Prototype of issue 18's lifetime-based memory estimate: replay each stage's job on fake
tensors under the device-memory ledger, and hold it against the measured peaks.

Run ``python bench/memory_replay.py``.

For each case of ``bench/device_memory.py`` (the example GPT and a small Llama, 1 and 4
virtual devices, 1 and 4 microbatches) it trains one step with ``measure_memory=True``,
then, for every stage, replays one microbatch of its job the way ``runtime/job_runner.py``
runs it, on fake tensors (nothing allocated) inside a ``StorageLedger``:

* forward jobs: the stage's inputs uploaded, its units run under ``no_grad``, every unit
  output kept until the microbatch ends (the runner publishes them then);
* fused and backward jobs: every unit run as its own autograd graph (leaves for the values
  gradients flow through), then the backward unit by unit in reverse order (the fused job
  first runs a loss over the model's outputs); from the second microbatch on, the
  parameters already hold an accumulated gradient, so a fresh one lands next to it.

The estimate is the stage's weights + the replay's peak, plus: the accumulated gradients
(more than one microbatch), the next microbatch's inputs (uploaded while this one
computes), and on one device the outputs a forward job hands to the next job for its
earlier microbatches (the next job runs only after it).  The ratios to the measured
``RunStats.stage_peak_bytes`` are printed next to today's ``StageSpec.memory_bytes``.

This is a bench, not the estimator: it reads the executor's private state (the first
microbatch's inputs, the values gradients flow through) and replays at the traced
microbatch's shapes.  The estimator belongs in ``passes/`` (fake values from the cost
pass; the ledger moved to a module both layers may import).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import device_memory as cases

from roundpipe.runtime import executor as executor_module
from roundpipe.runtime.device_memory import StorageLedger

BAND = (0.95, 1.15)


def capture_first_microbatch() -> dict[str, Any]:
    """Wrap Executor._run to keep the executor, the first microbatch's host inputs and
    its random-op key of the last call."""
    captured: dict[str, Any] = {}
    run = executor_module.Executor._run

    def wrapped(self: Any, jobs: Any, call: Any) -> Any:
        captured.update(executor=self, inputs=dict(call.store[0]), key=call.keys[0])
        return run(self, jobs, call)
    executor_module.Executor._run = wrapped  # type: ignore[method-assign]
    return captured


def on_fake_thread(fake: FakeTensorMode, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread of its own (the ledger watches one thread) under ``fake``."""
    out: list[Any] = []

    def work() -> None:
        with fake:
            out.append(fn())
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return out[0]


def extras(unit: Any, key: Any) -> list[Any]:
    return ([torch.device("cpu")] if unit.needs_device else []) + \
        ([key] if unit.needs_rng else [])


def every_value(ex: Any, inputs: dict[str, Any], key: Any, fake: FakeTensorMode
                ) -> dict[str, Any]:
    """Every program value of one microbatch, as fake tensors."""
    host = ex.host.tensors

    def run() -> dict[str, Any]:
        values = dict(inputs)
        with torch.no_grad():
            for unit in ex.units:
                outs = unit.module(*[values[v] for v in unit.inputs],
                                   *[host[s] for s in unit.state], *extras(unit, key))
                values.update(zip(unit.outputs, outs))
        return values
    return on_fake_thread(fake, run)


def replay_job(ex: Any, spec: Any, values: dict[str, Any], key: Any, carries: frozenset,
               accumulated: bool, fake: FakeTensorMode) -> int:
    """Peak bytes of one microbatch of ``spec``'s job beyond its weights (and beyond the
    accumulated gradients when ``accumulated``)."""
    units = ex.units[spec.units[0]:spec.units[1]]
    host = ex.host.tensors
    ledger = StorageLedger("cpu")

    def run() -> None:
        state = {}
        for slot in {s for u in units for s in u.state}:
            weight = torch.empty_like(host[slot])  # uploaded before: counted apart
            if spec.kind != "fwd" and ex.host.trainable(slot):
                weight.requires_grad_(True)
                if accumulated:
                    weight.grad = torch.zeros_like(weight)
            state[slot] = weight
        with ledger.watching(spec.index):
            vals = {v: values[v].clone() if isinstance(values[v], torch.Tensor)
                    else values[v] for v in ex.program.range_inputs(*spec.units)}
            if spec.kind == "fwd":
                with torch.no_grad():
                    for u in units:
                        vals.update(zip(u.outputs, u.module(
                            *[vals[v] for v in u.inputs], *[state[s] for s in u.state],
                            *extras(u, key))))
                return
            leaves: dict[tuple[int, str], torch.Tensor] = {}
            for u in units:
                args = []
                for v in u.inputs:
                    x = vals[v]
                    if isinstance(x, torch.Tensor) and v in carries and x.is_floating_point():
                        x = leaves[(u.index, v)] = x.detach().requires_grad_(True)
                    args.append(x)
                with torch.enable_grad():
                    vals.update(zip(u.outputs, u.module(
                        *args, *[state[s] for s in u.state], *extras(u, key))))
            if spec.kind == "fused":
                outs = [vals[o.value] for o in ex.program.outputs
                        if o.value in vals and isinstance(vals[o.value], torch.Tensor)
                        and vals[o.value].requires_grad]
                with torch.enable_grad():
                    sum(o.float().sum() for o in outs).backward()
            acc: dict[str, torch.Tensor] = {}
            for u in reversed(units):
                tensors, grads = [], []
                for v in u.outputs:
                    out = vals.get(v)
                    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                        g = acc.pop(v, None)
                        if g is None and spec.kind == "bwd":
                            g = torch.ones_like(out)  # uploaded from the host
                        if g is not None:
                            tensors.append(out)
                            grads.append(g)
                if tensors:
                    torch.autograd.backward(tensors, grads)
                for v in u.inputs:
                    leaf = leaves.pop((u.index, v), None)
                    if leaf is not None and leaf.grad is not None:
                        acc[v] = acc[v] + leaf.grad if v in acc else leaf.grad
    on_fake_thread(fake, run)
    return ledger.peak_bytes()


def nbytes(values: dict[str, Any], names: Any) -> int:
    return sum(values[v].numel() * values[v].element_size() for v in names
               if isinstance(values.get(v), torch.Tensor))


def main() -> None:
    captured = capture_first_microbatch()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    print(f"{'model':6} {'dev':>3} {'mb':>3}  stage: today -> replayed (estimate / measured)")
    outside = 0
    for name, case in (("gpt", cases.gpt_case), ("llama", cases.llama_case)):
        for devices, mb in ((1, 1), (1, 4), (4, 1), (4, 4)):
            pipe, args, labels = cases.pipe_for(case, devices, mb, True)
            cases.step(pipe, args, labels)
            stats, plan = pipe.stats(), pipe.plan
            ex, key = captured["executor"], captured["key"]
            values = every_value(ex, captured["inputs"], key, fake)
            carries = ex._carries(frozenset())
            row = []
            for spec in plan.stages:
                peak = replay_job(ex, spec, values, key, carries, mb > 1, fake)
                est = spec.param_bytes + peak
                if mb > 1:
                    if spec.kind != "fwd":
                        est += sum(plan.costs[i].trainable_bytes for i in range(*spec.units))
                    est += nbytes(values, ex.program.range_inputs(*spec.units))
                    if devices == 1 and spec.kind == "fwd":
                        est += (mb - 1) * spec.act_out_bytes
                ratio = est / stats.stage_peak_bytes[spec.index]
                outside += not BAND[0] <= ratio <= BAND[1]
                row.append(f"{spec.index} {spec.kind} "
                           f"{spec.memory_bytes / stats.stage_peak_bytes[spec.index]:.2f}"
                           f" -> {ratio:.2f}")
            print(f"{name:6} {devices:>3} {mb:>3}  " + ", ".join(row))
            pipe.close()
    print(f"{outside} stage(s) outside {list(BAND)}")


if __name__ == "__main__":
    main()
