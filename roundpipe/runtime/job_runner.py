"""The per-job unit runner: what one job does on its device's thread, microbatch by
microbatch (upload the stage's state, run its units forward, fused or backward, hand
values over, download gradients), for :class:`~roundpipe.runtime.executor.Executor`,
which wires the jobs (:mod:`.jobs`) and schedules them on the devices' threads."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..errors import LossError
from ..plan import UnitProgram
from ..ops import modes
from .devices import Device, Transfer, dense
from . import param_hooks
from .jobs import Job

if TYPE_CHECKING:  # pragma: no cover
    from .call_state import CallState
    from .executor import Executor

log = logging.getLogger(__name__)


class JobRunner:
    """The work of one job on one device (runs on the device's controller thread)."""

    def __init__(self, ex: Executor, job: Job, device: Device, call: CallState) -> None:
        self.ex = ex
        self.job = job
        self.device = device
        self.call = call
        self.units = ex.units[job.start:job.stop]
        self.state: dict[str, torch.Tensor] = {}
        self.param_leaves: dict[tuple[int, str], torch.Tensor] = {}
        self.produced_here = {v for u in self.units for v in u.outputs}
        self.weights: Transfer | None = None
        self.held: dict[int, list[Transfer]] = {}      # uploads per microbatch
        self.prefetched: dict[int, dict[str, Transfer]] = {}
        self.handed: set[tuple[int, str]] = set()  # (unit, slot) gradients already staged
        self.hand_over_errors: list[BaseException] = []
        self.units_by_index = {u.index: u for u in self.units}
        self.skip = job.skip
        self.versions: dict[str, int] = {}  # buffer slot -> version when uploaded
        self.fresh: dict[str, torch.Tensor] = {}  # call.fresh_state slot -> its first value

    # --- state -------------------------------------------------------------------------
    def setup(self) -> None:
        call, ex = self.call, self.ex
        # Double buffering: the next job on this device loads while this one computes.
        nxt = self.job.index + len(ex.devices)
        if nxt < len(call.jobs):
            ex.start_load(call, call.jobs[nxt])
        if self.skip:
            return  # nothing here carries a gradient (frozen layers)
        if self.job.index not in call.weights:
            ex.start_load(call, self.job)
        self.weights = call.weights.pop(self.job.index)
        waited = time.perf_counter()
        self.state = dict(self.weights.result())
        fence = call.fence_waits.get(self.job.index)
        if fence is not None:
            # The part of this wait the optimizer's publish caused, once the job's first
            # inputs were there (before, it waited for them anyway: no stall).
            index = self.job.index
            inputs = waited if index == 0 else call.done_at.get((index - 1, 0))
            if inputs is not None:
                start = max(waited, fence[0], inputs)
                end = min(time.perf_counter(), fence[1])
                if end > start:
                    call.weight_stalls.append((start, end))
        # In-place writes bump a tensor's version: finish() commits any buffer the
        # programs wrote that the trace did not show (an opaque module's own code).
        self.versions = {slot: t._version for slot, t in self.state.items()
                         if ex.host.specs[slot].kind == "buffer"}
        self.fresh = {slot: self.state[slot].clone() for slot in call.fresh_state
                      if slot in self.state}
        if self.job.kind == "fwd":
            # A unit computes with the same autograd-visible inputs wherever it runs: some
            # kernels branch on requires_grad even under no_grad (CPU aten.lstm), and a
            # unit moves between forward, fused and recomputing jobs as the device count
            # moves the stage boundaries.  (Under no_grad the flags build no graph.)
            for slot, t in self.state.items():
                if slot in call.carries and ex.host.trainable(slot):
                    t.requires_grad_(True)
        if self.job.kind in ("fused", "bwd"):
            users: dict[str, int] = {}
            for unit in self.units:
                for s in unit.state:
                    users[s] = users.get(s, 0) + 1
            hooks = call.hooks.on_device
            for unit in self.units:
                for s in unit.state:
                    if s in call.carries and ex.host.trainable(s):
                        base = self.state[s]
                        # A parameter read by several units gets one leaf per unit, so its
                        # gradient is accumulated per unit (device-count invariant).
                        leaf = base if users[s] == 1 and s not in hooks else base.detach()
                        leaf.requires_grad_(True)
                        # The user's tensor hooks on the parameter: each microbatch's
                        # backward calls them on its gradient before it accumulates.
                        for hook in hooks.get(s, ()):
                            leaf.register_hook(hook)
                        self.param_leaves[(unit.index, s)] = leaf

    def _state_args(self, unit: UnitProgram) -> list[torch.Tensor]:
        return [self.param_leaves.get((unit.index, s), self.state[s]) for s in unit.state]

    def release(self) -> None:
        """Give back everything this job uploaded (also after a failure)."""
        for transfers in self.prefetched.values():
            for t in transfers.values():
                t.release()
        self.prefetched.clear()
        for mb in list(self.held):
            self._release_microbatch(mb)
        if self.weights is not None:
            self.weights.release()
            self.weights = None
        self.state.clear()
        self.fresh.clear()
        self.param_leaves.clear()

    def _release_microbatch(self, mb: int) -> None:
        for t in self.held.pop(mb, []):
            t.release()

    def _stage_grads(self, unit: int | None = None) -> list[tuple[str, int, torch.Tensor]]:
        """Download the parameter gradients not staged yet (only ``unit``'s, if given)."""
        landing = self.ex.landing
        staged: list[tuple[str, int, torch.Tensor]] = []
        leaves = (self.param_leaves.items() if unit is None else
                  (((unit, slot), self.param_leaves[(unit, slot)])
                   for slot in self.units_by_index[unit].state
                   if (unit, slot) in self.param_leaves))
        in_place: set[str] = set()
        norms: dict[str, torch.Tensor] = {}
        for (uid, slot), leaf in leaves:
            if leaf.grad is None or (uid, slot) in self.handed:
                continue
            out = landing.buffer_for((uid, slot), self.call.steps, like=leaf.grad)
            host = self.device.download(leaf.grad, "grads", out=out)
            landing.keep((uid, slot), host)
            self.handed.add((uid, slot))
            staged.append((slot, uid, host))
            if self.call.on_grads is None and self.ex.readers[slot] == 1 and \
                    slot not in self.call.hooks.at_commit and \
                    self.ex.host.lands_in_place(slot):
                in_place.add(slot)
                norm = _grad_norm(leaf.grad) if self.call.measure_norms else None
                if norm is not None:  # clipping and unscaling then read no gradient
                    norms[slot] = self.device.download(norm, "grads")
        converted = {}
        # A parameter read by several units (tied weights, a shared layer) is summed by
        # the commit into a new tensor anyway: converting each contribution first would
        # only hold more full-precision copies.
        single = [(slot, uid, g) for slot, uid, g in staged
                  if self.ex.readers[slot] == 1 and slot not in in_place
                  and slot not in self.call.hooks.at_commit]
        if single and self._converts():
            landed = self.device.after_downloads()
            with self.device.memory.host():  # the masters' dtype: made on first use
                converted = {(slot, uid): self.ex.landing.convert_after(
                    landed, g, self.ex.grad_dtype(slot), self.call.steps,
                    functools.partial(self.ex.host.has_no_grad, slot), key=(uid, slot))
                    for slot, uid, g in single}
        # A step consuming gradients as they land (admit) frees or reuses each buffer
        # once its unit is updated: the call keeps only their shapes (for its stats).
        landing = self.call.admit is not None
        with self.call.lock:
            for slot, uid, g in staged:
                self.call.param_grads.setdefault(slot, []).append(
                    (uid, torch.empty_like(g, device="meta") if landing else g))
            self.call.converted.update(converted)
            self.call.in_place.update(in_place)
            self.call.grad_norms.update(norms)
        return staged

    def _converts(self) -> bool:
        # Data parallel reduces the downloads themselves; its commit reads the reduction.
        return self.call.on_grads is None and self.ex.landing.converts

    def _hand_over(self, unit: UnitProgram, mb: int) -> None:
        """Once the last microbatch's backward has passed ``unit``, its parameter
        gradients are final: download them now, so their conversion to the masters' dtype
        (or, with an ``on_grads`` hook, their all-reduce) overlaps the backward of the
        earlier units."""
        call = self.call
        if mb != call.num_mb - 1:
            return
        if call.on_grads is None:
            if self._converts():
                self._stage_grads(unit.index)
            return
        if call.admit is not None:  # a step consuming gradients as they land
            call.admit(unit.index, call.abort)
        staged = self._stage_grads(unit.index)
        hook, start = call.on_grads, unit.index

        def hand_over(landed: Future) -> None:
            # The hook reads the gradients on the host, so it runs on the download
            # waiter once they have landed; this thread goes on with the backward.
            # An error is kept for finish(): a done-callback's would only be logged.
            if not landed.cancelled() and landed.exception() is None:
                try:
                    hook(start, start + 1, staged)
                except BaseException as e:  # noqa: BLE001 - raised by finish()
                    self.hand_over_errors.append(e)
        self.device.after_downloads().add_done_callback(hand_over)

    def finish(self) -> None:
        """After the last microbatch: download gradients and updated buffers."""
        call = self.call
        staged_grads = self._stage_grads()
        staged_buffers: dict[str, torch.Tensor] = {}
        if self.job.kind in ("fwd", "fused"):  # forward work updates buffers
            mutated = {s for u in self.units for s in u.mutated_state}
            mutated.update(slot for v, slot in self.ex.buffer_update.items()
                           if v in self.produced_here)
            unseen = sorted(slot for slot, version in self.versions.items()
                            if slot not in mutated and self.state[slot]._version != version)
            if unseen:
                _warn_unseen_writes(self.ex, unseen)
                mutated.update(unseen)
            for slot in mutated:
                staged_buffers[slot] = self.device.download(self.state[slot], "buffers")
        self.device.wait_downloads()  # the hand-over callbacks have run by now
        if self.hand_over_errors:
            raise self.hand_over_errors[0]
        if self.job.kind == "fused" and not call.nonfinite_loss_ok:
            with self.device.memory.host():  # the losses are host tensors
                self._check_losses()
        with call.lock:
            call.buffers.update(staged_buffers)
        if call.on_grads is not None and self.job.kind in ("fused", "bwd"):
            with self.device.memory.host():  # the hook works on the host's copies
                if self.job.kind == "fused":
                    self._hand_over_loss_only()
                call.on_grads(self.job.start, self.job.stop, staged_grads)

    def _hand_over_loss_only(self) -> None:
        """The gradients loss_fn gave parameters no unit reads go to ``on_grads`` as
        those of unit ``len(units)`` (the data-parallel layout's, the landing step's
        last): each summed over the microbatches in order, in its dtype, as a unit's
        device sums them."""
        staged = []
        n = len(self.ex.units)
        with self.call.lock:
            held = {s: sorted(g, key=lambda c: c[0]) for s, g in self.call.loss_only.items()}
        with torch.no_grad():
            for slot, grads in held.items():
                total = torch.empty_like(self.ex.host.tensors[slot])
                total.copy_(grads[0][1])
                for _, g in grads[1:]:
                    total += g
                staged.append((slot, n, total))
        self.call.on_grads(n, n + 1, staged)  # type: ignore[misc]

    # --- values --------------------------------------------------------------------------
    def _upload(self, mb: int, value: torch.Tensor, category: str) -> torch.Tensor:
        transfer = self.device.upload_async(value, category)
        self.held.setdefault(mb, []).append(transfer)
        return transfer.result()

    def prefetch(self, mb: int) -> None:
        """Start uploading microbatch ``mb``'s host inputs (its producers have finished)."""
        if self.skip or mb >= self.call.num_mb or mb in self.prefetched:
            return
        store, handoff = self.call.store[mb], self.call.handoff
        pending: dict[str, Transfer] = {}
        for name in self.job.reads:
            value = store.get(name)
            if isinstance(value, torch.Tensor) and (mb, name) not in handoff:
                pending[name] = self.device.upload_async(value, "activations")
        self.prefetched[mb] = pending

    def _host_value(self, mb: int, name: str, cache: dict[str, Any]) -> Any:
        if name in cache:
            return cache[name]
        handed = self.call.handoff.pop((mb, name), None)
        if handed is not None:
            value = handed
            if isinstance(value, torch.Tensor):  # held by this job from now on
                self.device.memory.adopt(value, self.job.index)
        elif name in self.prefetched.get(mb, {}):
            transfer = self.prefetched[mb].pop(name)
            self.held.setdefault(mb, []).append(transfer)
            value = transfer.result()
        else:
            try:
                value = self.call.store[mb][name]
            except KeyError:
                raise RuntimeError(f"value {name!r} was not produced before it was needed; "
                                   "the plan is inconsistent") from None
            if isinstance(value, torch.Tensor):
                value = self._upload(mb, value, "activations")
        cache[name] = value
        return value

    def _publish(self, mb: int, values: dict[str, Any]) -> None:
        store = self.call.store[mb]
        for name in self.job.publishes:
            value = values[name]
            store[name] = (self.device.download(value) if isinstance(value, torch.Tensor)
                           else value)
        for name in self.job.handoff:
            value = values[name]
            self.call.handoff[(mb, name)] = (value.detach() if isinstance(value, torch.Tensor)
                                             else value)

    def _autocast(self) -> Any:
        ac = self.call.autocast
        if ac is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=ac[0], dtype=ac[1])

    def _call_unit(self, unit: UnitProgram, args: list[Any], mb: int) -> tuple[Any, ...]:
        extra: list[Any] = []
        if unit.needs_device:
            extra.append(self.device.torch_device)
        if unit.needs_rng:
            extra.append(self.call.keys[mb])
        run = self.ex.runnable(unit, self.device.torch_device)
        if unit.index in self.ex.with_regions:
            with self._autocast(), modes.left_on_error(self.ex.region_device_types):
                outs = run(*args, *self._state_args(unit), *extra)
        else:
            with self._autocast():
                outs = run(*args, *self._state_args(unit), *extra)
        # Every value leaves its unit with the layout a transfer would give it, whether or
        # not a stage boundary follows (see devices.dense).
        return tuple(dense(o) if isinstance(o, torch.Tensor) else o for o in outs)

    def _apply_buffer_updates(self, unit: UnitProgram, values: dict[str, Any]) -> None:
        # Reassigned buffers: the next microbatch of this job reads the new value.
        for v in unit.outputs:
            slot = self.ex.buffer_update.get(v)
            if slot is not None:
                self.state[slot] = values[v]

    # --- microbatches --------------------------------------------------------------------
    def run_microbatch(self, mb: int, next_ready: bool) -> None:
        """Run microbatch ``mb``, then start uploading microbatch ``mb + 1``'s inputs if
        they are on the host (``next_ready``: they were when ``mb`` began; they are
        checked again now).

        The next inputs upload once this microbatch's values are freed, not before it
        computes: whether they are on the host by then depends on how far the producing
        job (on another device) runs ahead, so uploading them then made a job's peak one
        microbatch's inputs more or not by thread timing, and the plan had to budget
        them on top of the working set (``passes/memory.py``).  On a GPU the copy still
        runs beside this microbatch's kernels, which the controller has only queued; and
        readiness is checked a microbatch later, so the upload is early more often.
        """
        if self.skip:
            return
        self.prefetch(mb)
        if mb > 0:  # each microbatch makes the call's one write from the same start
            for slot, first in self.fresh.items():
                self.state[slot] = first.clone()
        if self.job.kind == "fwd":
            self._forward(mb)
        elif self.job.kind == "fused":
            self._fused(mb)
        elif self.call.grain == "layer":
            self._backward_layers(mb)
        else:
            self._backward_stage(mb)
        self._release_microbatch(mb)
        if next_ready or self.ex.ready(self.call, self.job, mb + 1):
            self.prefetch(mb + 1)

    def _forward(self, mb: int) -> None:
        values: dict[str, Any] = {}
        with torch.no_grad():
            for unit in self.units:
                t = self.device.mark()
                # inputs flagged as the fused and recomputing jobs flag them (see setup)
                args = [self._leaf(values[v] if v in values
                                   else self._host_value(mb, v, values), v)
                        for v in unit.inputs]
                outs = self._call_unit(unit, args, mb)
                values.update(zip(unit.outputs, outs))
                self._apply_buffer_updates(unit, values)
                self._time(self.call.unit_fwd_s, unit.index, t)
        self._publish(mb, values)

    def _leaf(self, value: Any, name: str) -> Any:
        if (isinstance(value, torch.Tensor) and name in self.call.carries
                and (value.is_floating_point() or value.is_complex())):
            return value.detach().requires_grad_(True)
        return value.detach() if isinstance(value, torch.Tensor) else value

    def _forward_unit_grad(self, unit: UnitProgram, mb: int, values: dict[str, Any],
                           uploaded: dict[str, Any], leaves: dict[tuple[int, str], Any],
                           from_host_only: bool = False) -> None:
        """Run one unit as its own autograd graph; its inputs become fresh leaves."""
        args = []
        for v in unit.inputs:
            base = (values[v] if v in values and not from_host_only
                    else self._host_value(mb, v, uploaded))
            leaf = self._leaf(base, v)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaves[(unit.index, v)] = leaf
            args.append(leaf)
        with torch.enable_grad():
            outs = self._call_unit(unit, args, mb)
        values.update(zip(unit.outputs, outs))

    def _backward_unit(self, unit: UnitProgram, mb: int, values: dict[str, Any],
                       acc: dict[str, torch.Tensor], leaves: dict[tuple[int, str], Any]
                       ) -> None:
        tensors, grads = [], []
        for v in unit.outputs:
            out = values.get(v)
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                continue
            g = acc.pop(v, None)
            if g is None:
                g = self._host_grad(mb, v)
            if g is not None:
                tensors.append(out)
                grads.append(g)
        self._join_loss_grads(unit, mb, tensors, grads)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for v in unit.inputs:
            leaf = leaves.pop((unit.index, v), None)
            if leaf is not None and leaf.grad is not None:
                self._add_grad(mb, v, leaf.grad, acc)
        self._download_microbatch_grads(unit, mb)
        self._hand_over(unit, mb)

    def _join_loss_grads(self, unit: UnitProgram, mb: int, tensors: list[torch.Tensor],
                         grads: list[torch.Tensor]) -> None:
        """loss_fn's part of a parameter's microbatch gradient flows into this unit's
        leaf of it through an identity view, in the same backward as the unit's own part:
        autograd sums both (before the leaf's hooks run, param_hooks.LossReads), as
        eager's one backward does, and the sum goes where the unit's gradients go."""
        joins = self.call.loss_joins
        if not self.call.loss_grads:
            return
        for slot in unit.state:
            if joins.get(slot) != unit.index:
                continue
            with self.call.lock:
                part = self.call.loss_grads.pop((mb, slot), None)
            if part is None:
                continue
            leaf = self.param_leaves.get((unit.index, slot))
            if leaf is None:  # every trainable parameter a unit reads carries a gradient
                raise RuntimeError(f"no gradient leaf for {slot!r} in unit {unit.index}; "
                                   "the plan is inconsistent")
            with torch.enable_grad():
                tensors.append(leaf.view_as(leaf))
            # made by this job's loss tail on this device, or downloaded by it (_hold_loss_grads)
            grads.append(part if self.job.kind == "fused" else self._upload(mb, part, "grads"))

    def _download_microbatch_grads(self, unit: UnitProgram, mb: int) -> None:
        """The gradients whose hooks need each microbatch's (HookPlan.per_microbatch) go
        to the host now, and the leaf starts the next microbatch from none."""
        per_mb = self.call.hooks.per_microbatch
        if not per_mb:
            return
        for slot in unit.state:
            leaf = self.param_leaves.get((unit.index, slot))
            if slot in per_mb and leaf is not None and leaf.grad is not None:
                host = self.device.download(leaf.grad, "grads")
                leaf.grad = None
                with self.call.lock:
                    self.call.mb_grads.setdefault(slot, []).append((mb, unit.index, host))

    def _host_grad(self, mb: int, name: str) -> Any:
        g = self.call.grads[mb].get(name)
        return None if g is None else self._upload(mb, g, "grads")

    def _add_grad(self, mb: int, name: str, g: torch.Tensor, acc: dict[str, torch.Tensor]
                  ) -> None:
        """Fold one reader's gradient into ``name``'s running sum (descending readers)."""
        if name in acc:
            acc[name] = acc[name] + g
            return
        earlier = self._host_grad(mb, name)
        acc[name] = g if earlier is None else earlier + g

    def _flush_grads(self, mb: int, acc: dict[str, torch.Tensor]) -> None:
        """Send running sums of values made by earlier jobs (or inputs) to the host."""
        store = self.call.grads[mb]
        for name, g in acc.items():
            if name not in self.produced_here:
                store[name] = self.device.download(g, "grads")

    def _backward_stage(self, mb: int) -> None:
        values: dict[str, Any] = {}
        uploaded: dict[str, Any] = {}
        leaves: dict[tuple[int, str], Any] = {}
        t = self.device.mark()
        for unit in self.units:  # recompute the whole stage, keeping every unit's graph
            self._forward_unit_grad(unit, mb, values, uploaded, leaves)
        acc: dict[str, torch.Tensor] = {}
        for unit in reversed(self.units):
            self._backward_unit(unit, mb, values, acc, leaves)
        self._flush_grads(mb, acc)
        self._time_range(self.call.unit_bwd_s, t)

    def _backward_layers(self, mb: int) -> None:
        acc: dict[str, torch.Tensor] = {}
        uploaded: dict[str, Any] = {}  # a value several units read is uploaded once
        for unit in reversed(self.units):  # recompute one unit, run its backward, free it
            t = self.device.mark()
            values: dict[str, Any] = {}
            leaves: dict[tuple[int, str], Any] = {}
            self._forward_unit_grad(unit, mb, values, uploaded, leaves, from_host_only=True)
            self._backward_unit(unit, mb, values, acc, leaves)
            self._time(self.call.unit_bwd_s, unit.index, t)
        self._flush_grads(mb, acc)

    def _fused(self, mb: int) -> None:
        call = self.call
        values: dict[str, Any] = {}
        uploaded: dict[str, Any] = {}
        leaves: dict[tuple[int, str], Any] = {}
        t = self.device.mark()
        for unit in self.units:
            self._forward_unit_grad(unit, mb, values, uploaded, leaves)
            self._apply_buffer_updates(unit, values)
        # The loss reads the model outputs through leaves of their own, so their gradients
        # enter each value's running sum first (the loss is the last reader).
        flat: list[Any] = []
        out_leaves: list[tuple[str, torch.Tensor]] = []
        for ref in self.ex.program.outputs:
            if ref.value is None:
                flat.append(ref.constant)
                continue
            base = (values[ref.value] if ref.value in values
                    else self._host_value(mb, ref.value, uploaded))
            leaf = self._leaf(base, ref.value)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                out_leaves.append((ref.value, leaf))
            flat.append(leaf)
        output = pytree.tree_unflatten(flat, self.ex.program.out_spec)
        label, label_leaves = self._label(mb)
        joins = call.hooks.loss_joins
        reads = param_hooks.LossReads({s: self.ex.host.tensors[s] for s in joins}) \
            if joins else contextlib.nullcontext()
        with torch.enable_grad(), self._autocast(), reads:
            loss = call.loss_fn(output, label)  # type: ignore[misc]
        _check_loss(loss, mb)
        aliases = list(reads.aliases.items()) if joins else []
        # (slot, a parameter or its master) loss_fn's graph reaches
        read: list[tuple[str, torch.Tensor]] = []
        others: list[torch.Tensor] = []      # leaves that are not the pipe's (autograd's)
        if loss.requires_grad and call.loss_params:
            ours = {id(leaf) for _, leaf in (*out_leaves, *label_leaves, *aliases)}
            for leaf in param_hooks.loss_leaves(loss):
                slot, tensor = call.loss_params.get(id(leaf), (None, None))
                if tensor is leaf:
                    read.append((slot, leaf))  # type: ignore[arg-type]
                elif id(leaf) not in ours:
                    others.append(leaf)
            if joins:  # before loss_fn's backward runs any hook (a master has none)
                param_hooks.refuse_hooked_loss_reads(
                    {s: leaf for s, leaf in read if leaf is self.ex.host.tensors[s]},
                    {s: self.ex.host.specs[s].fqn for s in joins})
            if read:  # the leaves torch.autograd.grad will take, named for the message
                param_hooks.refuse_leaf_multi_grad_hooks(
                    [("the model output loss_fn gets", leaf) for _, leaf in out_leaves]
                    + [("the label", leaf) for _, leaf in label_leaves]
                    + [(f"parameter {self.ex.host.specs[s].fqn!r}", leaf) for s, leaf in read]
                    + [("a tensor of loss_fn's own", leaf) for leaf in others])
        if mb == call.num_mb - 1 and call.on_losses is not None:
            self._losses_in(loss, mb)
        acc: dict[str, torch.Tensor] = {}
        if loss.requires_grad:
            held: list[tuple[str, torch.Tensor | None]]
            labels: list[tuple[int, torch.Tensor | None]]
            if not read:  # loss_fn read no parameter of the pipe (or only hooked ones)
                loss.backward()
                for name, leaf in out_leaves:
                    if leaf.grad is not None:
                        self._add_grad(mb, name, leaf.grad, acc)
                held = [(s, a.grad) for s, a in aliases]
                labels = [(i, leaf.grad) for i, leaf in label_leaves]
            else:
                # loss_fn read parameters: their part of the gradient is held by the call
                # (joined into the unit reading them, or committed at the end), never
                # accumulated on .grad now, so a call that fails later changes nothing.
                # One pass over loss_fn's graph, as eager's backward: a hook on an
                # intermediate runs once (a second pass for loss_fn's own leaves ran it
                # twice); those leaves' gradients are then added as autograd adds them.
                inputs = ([leaf for _, leaf in out_leaves] + [leaf for _, leaf in label_leaves]
                          + [a for _, a in aliases] + [leaf for _, leaf in read] + others)
                got = list(torch.autograd.grad(loss, inputs, allow_unused=True))
                if others:  # tensors of loss_fn's own (not the pipe's)
                    param_hooks.accumulate_as_autograd(others, got[len(got) - len(others):])
                # on the output and label leaves, as loss.backward() leaves it (what
                # out.retain_grad() in loss_fn reads, as in eager)
                for (_, leaf), g in zip([*out_leaves, *label_leaves], got):
                    leaf.grad = g
                for (name, _), g in zip(out_leaves, got):
                    if g is not None:
                        self._add_grad(mb, name, g, acc)
                got = got[len(out_leaves):]
                labels = [(i, g) for (i, _), g in zip(label_leaves, got)]
                got = got[len(label_leaves):]
                held = list(zip([s for s, _ in aliases] + [s for s, _ in read], got))
            self._hold_loss_grads(mb, held)
            if call.label_grads is not None:
                call.label_grads[mb].update(
                    (i, self.device.download(g, "grads")) for i, g in labels if g is not None)
        for unit in reversed(self.units):
            self._backward_unit(unit, mb, values, acc, leaves)
        self._flush_grads(mb, acc)
        # Checked once the job's downloads have landed (``finish``), not here: reading
        # the loss now would make this thread wait for the GPU every microbatch.
        call.losses[mb] = self.device.download(loss.detach(), "losses")
        self._publish(mb, values)
        self._time_range(self.call.unit_bwd_s, t)

    def _hold_loss_grads(self, mb: int, held: list[tuple[str, torch.Tensor | None]]) -> None:
        """Keep loss_fn's part of each parameter's microbatch gradient for the unit that
        joins it, or for the commit.  What leaves this job goes through the host, as
        every gradient crossing jobs does (the joining job uploads it once this
        microbatch's downloads have landed): another job's loader copying this device's
        tensor would not wait for the compute stream still writing it."""
        joins = self.call.loss_joins
        parts: dict[str, torch.Tensor] = {}
        for slot, g in held:
            if g is None:
                continue
            # a master's part (in its dtype) goes the parameter's way, in its dtype
            g = g.to(self.ex.host.tensors[slot].dtype)
            parts[slot] = g if slot not in parts else parts[slot] + g
        kept = []
        for slot, g in parts.items():
            here = slot in joins and self.job.start <= joins[slot] < self.job.stop
            kept.append((slot, g if here else self.device.download(g, "grads")))
        with self.call.lock:
            for slot, g in kept:
                if slot in joins:
                    self.call.loss_grads[(mb, slot)] = g
                else:
                    self.call.loss_only.setdefault(slot, []).append((mb, g))

    def _label(self, mb: int) -> tuple[Any, list[tuple[int, torch.Tensor]]]:
        """Microbatch ``mb``'s label on the device, and (flat index, leaf) of its leaves
        whose host tensor requires grad, when the call returns their gradients: fresh
        leaves of the uploaded copies (uploads are detached), so ``loss_fn``'s backward
        stops there and the caller sends their gradients into its own graph."""
        leaves, spec = pytree.tree_flatten(self.call.labels[mb])
        wanted = self.call.label_grads is not None
        marked: list[tuple[int, torch.Tensor]] = []
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                continue
            leaves[i] = self._upload(mb, x, "labels")
            if wanted and x.requires_grad and (x.is_floating_point() or x.is_complex()):
                leaves[i] = leaves[i].detach().requires_grad_(True)
                marked.append((i, leaves[i]))
        return pytree.tree_unflatten(leaves, spec), marked

    def _losses_in(self, loss: torch.Tensor, mb: int) -> None:
        """The last microbatch's loss is computed, before its backward: check every loss
        now and tell the step that consumes gradients as they land that it may begin
        (the gradients of this job's units land during its backward)."""
        self.call.losses[mb] = self.device.download(loss.detach(), "losses")
        self.device.wait_downloads()
        if not self.call.nonfinite_loss_ok:
            with self.device.memory.host():
                self._check_losses()
        self.call.on_losses()  # type: ignore[misc]

    def _check_losses(self) -> None:
        for mb, loss in enumerate(self.call.losses):
            if loss is not None and not bool(torch.isfinite(loss).all()):
                error = LossError(
                    f"loss_fn returned {loss.item()}; nothing was committed. Check the inputs "
                    "and the learning rate, or, for fp16 training, use roundpipe.GradScaler, "
                    "which skips such steps and lowers the scale")
                error._roundpipe_microbatch = mb  # type: ignore[attr-defined]
                raise error

    # --- timing --------------------------------------------------------------------------
    def _time(self, table: dict[int, float], unit: int, start: Any) -> None:
        self._record_time(table, {unit: 1.0}, start)

    def _time_range(self, table: dict[int, float], start: Any) -> None:
        """Split a stage-level time over its units in proportion to their estimates."""
        costs = self.ex.plan.costs[self.job.start:self.job.stop]
        total = sum(c.fwd_time_s for c in costs) or 1.0
        self._record_time(table, {u.index: c.fwd_time_s / total
                                  for u, c in zip(self.units, costs)}, start)

    def _record_time(self, table: dict[int, float], shares: dict[int, float], start: Any
                     ) -> None:
        # Read when the call ends: on CUDA the marks are events on the compute stream, and
        # reading them now would wait for the GPU.
        with self.call.lock:
            self.call.timings.append((table, shares, self.device, start, self.device.mark()))


def _warn_unseen_writes(ex: Executor, slots: list[str]) -> None:
    names = [ex.host.specs[s].fqn for s in slots]
    key = tuple(names)
    if key in _WARNED:
        return
    _WARNED.add(key)
    log.warning(
        "roundpipe: the forward wrote buffer(s) %s in place although the trace did not show "
        "it (code roundpipe runs opaquely, e.g. a leaf module in eval mode); the writes are "
        "committed, but if another layer reads or writes the same buffer its updates may "
        "depend on where the stages fall", ", ".join(names))


_WARNED: set[tuple[str, ...]] = set()


def _check_loss(loss: Any, mb: int) -> None:
    # (the microbatch is named by the error's prefix: "stage 1 (...) at microbatch 0")
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"loss_fn returned a {type(loss).__name__}; it must return a scalar "
                        "tensor")
    if loss.numel() != 1 or loss.dim() > 1:
        raise LossError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must be a scalar "
            "(reduce it, e.g. with .mean() or .sum())"
        )


def _grad_norm(grad: torch.Tensor) -> torch.Tensor | None:
    """The 2-norm of a parameter gradient, on its device: a half-precision one
    accumulated in float32 without a float32 copy of it, any other real one in its own
    dtype; None for a complex one (the host computes it)."""
    if grad.dtype in (torch.float16, torch.bfloat16):
        return torch._foreach_norm([grad], 2, dtype=torch.float32)[0]
    if grad.is_floating_point():
        return torch.linalg.vector_norm(grad)
    return None
