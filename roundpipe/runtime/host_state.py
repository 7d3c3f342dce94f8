"""Model state in host memory: weights, master weights, gradients, and the fences between
the optimizer thread and uploads.

Roles of the tensors:

* *model weights*: the model's own parameters, in the model's dtype.  Uploads read them.
* *masters*: with ``optim_dtype`` set, one copy per trainable parameter in that dtype; the
  optimizer updates them and gradients land in their ``.grad``.  With ``optim_dtype=None``
  the masters are the model's parameters themselves.
* *publishing* copies masters into model weights one layer unit at a time; a version fence
  per parameter makes every upload wait until the parameter holds the version it expects,
  so no upload reads a weight the optimizer thread is halfway through writing.

:class:`ModelState` is shared by every program compiled for a model (masters and fences
are keyed by parameter name); :class:`HostState` maps one program's state slots onto it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import threading
import time
import weakref
from typing import Iterable, Mapping, Protocol, Sequence

import torch

from ..errors import OffloadMismatchError, StepError
from ..plan import ModelProgram, StateSpec
from . import data_reads
from .masters import (LandedGrads, Master, UnitSchedule, raw_grad, set_raw_grad,
                      tier_owner_of, tier_param)
from .offload import (OffloadError, OffloadStore, OffloadWindow, dtype_of, master_key,
                      state_key, wait)

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 0.05


_CHUNK = 1 << 22  # elements rounded at a time when the dtypes differ (8 MiB for bf16)


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _same_bits(param: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether the weight holds exactly its master rounded to the weight's dtype: a
    memcmp of the bytes (torch.equal costs several times more per element), the master
    rounded chunk by chunk into one reused buffer (a fresh ``.to()`` per parameter costs
    more than the rounding)."""
    a, b = param.detach(), master.detach()
    if a.device.type != "cpu" or not (a.is_contiguous() and b.is_contiguous()) or \
            a.is_sparse or b.is_sparse or a.shape != b.shape:
        return bool(torch.equal(a, b.to(a.dtype)))
    size = a.element_size()
    if a.dtype == b.dtype:
        nbytes = a.numel() * size
        return nbytes == 0 or _memcmp(a.data_ptr(), b.data_ptr(), nbytes) == 0
    a, b = a.reshape(-1), b.reshape(-1)
    buf = torch.empty(min(_CHUNK, a.numel()), dtype=a.dtype)
    for start in range(0, a.numel(), buf.numel()):
        n = min(buf.numel(), a.numel() - start)
        buf[:n].copy_(b[start:start + n])
        if _memcmp(buf.data_ptr(), a[start:].data_ptr(), n * size) != 0:
            return False
    return True


class WeightFences:
    """Per-parameter versions of the published weights.

    ``schedule()`` (caller thread, when a step is enqueued) raises the version later
    uploads require; ``publish(names, v)`` (optimizer thread) records that parameters
    reached version ``v``; ``wait(names, v)`` blocks an upload until they have.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._published: dict[str, int] = {}
        self._floor = 0  # version every parameter has reached
        self._target = 0
        self._failed: dict[int, str] = {}  # version -> why it will never be published
        # version -> why its publish failed, until a later publish of every parameter
        # (the disk tier: a read error while publishing; synchronize() publishes again)
        self._retry: dict[int, str] = {}
        self.events: list[tuple[str, str, int, float]] | None = None  # tests turn this on

    @property
    def target(self) -> int:
        with self._cond:
            return self._target

    def schedule(self) -> int:
        with self._cond:
            self._target += 1
            return self._target

    def record(self, what: str, name: str, version: int) -> None:
        events = self.events
        if events is not None:
            events.append((what, name, version, time.perf_counter()))

    def _version(self, name: str) -> int:
        return max(self._floor, self._published.get(name, 0))

    def publish(self, names: Iterable[str], version: int) -> None:
        with self._cond:
            for name in names:
                self._published[name] = max(self._version(name), version)
            self._cond.notify_all()

    def publish_all(self, version: int) -> None:
        with self._cond:
            self._floor = max(self._floor, version)
            self._retry = {v: why for v, why in self._retry.items() if v > version}
            self._cond.notify_all()

    def fail_publish(self, version: int, why: str) -> None:
        """The publish of ``version`` failed before opening every fence: uploads waiting
        for it raise (instead of waiting for a publish that may never come) until a
        later publish opens every fence."""
        with self._cond:
            self._retry[version] = why
            self._cond.notify_all()

    def fail(self, version: int, why: str) -> None:
        """``version`` will never be published whole (its step failed part-way): uploads
        waiting for it raise instead of waiting for ever."""
        with self._cond:
            self._failed[version] = why
            self._cond.notify_all()

    def clear_failed(self) -> None:
        with self._cond:
            self._failed.clear()

    def wait(self, names: Iterable[str], version: int,
             abort: threading.Event | None = None) -> bool:
        """Block until every parameter in ``names`` reached ``version``; False if aborted.
        Raises :class:`StepError` if that version's step failed part-way."""
        names = list(names)
        with self._cond:
            while not all(self._version(n) >= version for n in names):
                if abort is not None and abort.is_set():
                    return False
                failed = [why for v, why in (*self._failed.items(), *self._retry.items())
                          if v <= version]
                if failed:
                    raise StepError(failed[0])
                self._cond.wait(_WAIT_SLICE_S)
        return True


def _plain(value: object) -> object:
    """A hyperparameter as JSON data (a tensor's values, a tuple as a list)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class ModelState:
    """Masters, fences and gradient commits for one model (shared across its programs)."""

    def __init__(self, model: torch.nn.Module, optim_dtype: torch.dtype | None,
                 offload_dir: str | None = None, offload_resume: bool | str = False
                 ) -> None:
        self.model = model
        self.optim_dtype = optim_dtype
        self.fences = WeightFences()
        self._masters: dict[str, torch.nn.Parameter] = {}
        self._dirty = False  # masters hold updates not yet published to the model weights
        # Weight prediction (asynchronous steps): the masters as they were when the last
        # step started (W_{k-2} while the masters hold W_{k-1}), kept once a step asks;
        # _history: they are the start of the step that made the masters, so the masters
        # minus them is that step's update; _predicted: the model weights hold a
        # prediction, not the masters.
        self._previous: dict[str, torch.Tensor] = {}
        self._history = False
        self._predicted = False
        self._lock = threading.Lock()
        # Why the masters, optimizer state and weights mix two steps (a step that failed
        # part-way after publishing some units): every call and step refuses until
        # state is loaded.
        self.mixed: str | None = None
        self._params = dict(model.named_parameters())
        # name -> (data_ptr, version counter, data_reads tick) of each mastered weight as
        # roundpipe last wrote or checked it: a write the user makes through the
        # parameter moves the counter, a `.data = t` the pointer, and a write through
        # `p.data` can only follow a `.data` read after the tick (see adopt_edits)
        self._seen: dict[str, tuple[int, int, int]] = {}
        # Publish order: groups of parameter names, one per layer unit of the program in
        # use (set by HostState), so the first units' fences open first.
        self.publish_groups: list[tuple[str, ...]] = [tuple(self._params)]
        self.registered: list[object] = []  # storages page-locked in place (pin "register")
        # Gradients kept in the model's dtype for masters a one-pass optimizer binds
        # (runtime/masters.py).
        self.landed = LandedGrads()
        # The disk tier (offload_dir): masters and bound optimizers' state in files,
        # staged while a step updates them (runtime/offload.py).
        self.offload: OffloadStore | None = None
        self._window: OffloadWindow | None = None  # the disk tier's step in progress
        self._held_written = 0  # bytes the files had taken when a held load began
        # and the version counters of the model's parameters and buffers then (a load
        # that failed before writing into the files may have changed them)
        self._held_versions: dict[str, int] = {}
        # What the manifest records of the pipe (dropout streams, step count): set by
        # the pipe for each step as it is enqueued (by fence version) and at loads.
        self.counters: dict[str, object] = {}
        self.step_counters: dict[int, dict[str, object]] = {}
        self._digests: dict[str, tuple[int, int, str]] = {}  # name -> (ptr, version, hex)
        self._resume_checked: set[str] = set()  # masters whose optimizer was checked
        # optimizer -> {master: its fingerprint as the optimizer was made}: what the
        # manifest records, since schedulers (OneCycleLR, CyclicLR) add and change group
        # keys (max_lr, betas, momentum) after it was made, and a resume compares a
        # freshly made optimizer with it
        self._made_as: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if offload_dir is not None:
            self.offload = OffloadStore(offload_dir, resume=offload_resume)
            self.landed.offload = self.offload
            self.landed.absorb = self._absorb_loaded
            self.landed.resume = self.resume_optimizer
            self.offload.meta["model"] = self._model_fingerprint()
            self.offload.before_commit = self._before_commit
            if not self.has_masters:  # the optimizer updates the weights: its state only
                for name, param in self._params.items():
                    tier_param(self.landed, param, name)
            if self.offload.resumed is not None:
                try:
                    self._resume_masters()
                except BaseException:
                    self.offload.close()
                    raise

    @property
    def has_masters(self) -> bool:
        return self.optim_dtype is not None

    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` the optimizer should update, in ``named_parameters()`` order.

        Frozen parameters (``requires_grad=False``) get no master and are not listed.
        """
        return [(name, self.master(name)) for name, p in self.model.named_parameters()
                if p.requires_grad]

    def master(self, name: str) -> torch.Tensor:
        param = self._params[name]
        if not self.has_masters:
            return param
        with self._lock:
            master = self._masters.get(name)
            if master is None:
                master = Master(param.detach().to(self.optim_dtype, copy=True),
                                requires_grad=True)
                self.landed.adopt(master, name)
                if self.offload is not None:  # to the file; its memory is freed
                    self.offload.register(master_key(name), master, group=name)
                self._masters[name] = master
                self._note(name)
        return master

    def _note(self, name: str) -> None:
        param = self._params[name]
        data_reads.watch()
        self._seen[name] = (param.data_ptr(), param._version, data_reads.now())

    def note_weights(self) -> None:
        """Roundpipe itself wrote the model's weights (a publish, a load): what the
        user writes from now on is an edit."""
        for name in self._masters:
            self._note(name)

    def edited_weights(self, *, by_value: bool) -> list[str]:
        """Mastered parameters the user wrote since roundpipe last published or checked
        them: through the parameter (``torch.no_grad(): p.clamp_()``, ``p.copy_()``,
        ``model.load_state_dict``: its version counter moved), by rebinding its data
        (``p.data = t``: its pointer moved), or, with ``by_value`` (the weights hold the
        masters: nothing unpublished, no prediction, masters in memory), through
        ``p.data`` in place, whose alias has a version counter of its own: the weight no
        longer equals its master rounded to the model's dtype.  Only weights whose
        ``.data`` was taken since are compared (:mod:`.data_reads`): comparing all of
        them costs several times the step."""
        edited = []
        for name, master in self._masters.items():
            param = self._params[name]
            seen = self._seen.get(name)
            if seen is None or seen[:2] != (param.data_ptr(), param._version):
                edited.append(name)
            elif by_value and data_reads.taken_since(param, seen[2]) \
                    and not _same_bits(param, master):
                edited.append(name)
        return edited

    def adopt_edits(self) -> None:
        """Before a step, a publish or a checkpoint (optimizer thread): make the masters of
        the weights the user wrote since the last publish what the user wrote, as eager's
        optimizer steps from the edited weight (a WGAN clamp, a ``model.load_state_dict``,
        an EMA swap).  Where the masters hold a step not yet published (or the weights a
        prediction), the user wrote weights a step old that the publish replaces: the
        write cannot be applied as eager would, so it is dropped (the masters are
        published over it) and :class:`StepError` says so, naming the parameters."""
        if not self.has_masters or not self._masters:
            return
        by_value = self.offload is None and not self.dirty
        edited = self.edited_weights(by_value=by_value)
        if not edited:
            return
        if self.dirty:
            self.publish(self.fences.schedule())
            names = ", ".join(edited[:4]) + (" ..." if len(edited) > 4 else "")
            raise StepError(
                f"the model's parameter(s) {names} were written while the weights were a "
                "step behind the masters (the last pipe.step was not published yet): "
                "that write would be lost at the publish, so it was dropped and nothing "
                "ran. Call pipe.synchronize() after pipe.step() and before writing the "
                "model's parameters (the weights are then current), or write the masters "
                "(pipe.optim_named_parameters()) inside the step function")
        log.debug("adopting user writes to %s into their masters", edited)
        with torch.no_grad():
            for name in edited:
                # element by element: where the weight still holds its master rounded
                # to the model's dtype, the master keeps its own precision
                value = self._params[name].detach()
                master = (self._masters[name].detach() if self.offload is None
                          else self.offload.read(master_key(name)))
                merged = torch.where(value != master.to(value.dtype),
                                     value.to(master.dtype), master)
                if self.offload is not None:
                    self.offload.assign(master_key(name), merged)
                else:
                    master.copy_(merged)
                self._note(name)
            # a kept start of the last step (weight prediction) would turn the edit
            # into part of the next prediction's update: the edit starts anew
            for name in edited:
                kept = self._previous.get(name)
                if kept is not None:
                    kept.copy_(self._masters[name])
        if self.offload is not None:
            self.offload.commit()

    def masters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self._masters)

    def rebound(self) -> list[str]:
        """Names of the model's parameters that are other objects (or gone, or new)
        than those this state holds: a parameter rebound after the pipe was made
        (``m.weight = nn.Parameter(...)``, ``load_state_dict(sd, assign=True)``, a
        submodule replaced)."""
        now = dict(self.model.named_parameters())
        return [n for n in dict.fromkeys([*self._params, *now])
                if self._params.get(n) is not now.get(n)]

    def take_parameters(self) -> None:
        """Hold the model's parameters as they are now (without masters: they are what
        the optimizer updates and where gradients land; the old objects keep their
        ``.grad``, as in eager).  The caller refuses this where masters or the disk
        tier already hold the old ones."""
        self._params = dict(self.model.named_parameters())

    def mark_dirty(self) -> None:
        self._dirty = True

    @property
    def dirty(self) -> bool:
        """Whether the model weights differ from the masters: the masters hold a step not
        published yet, or the weights hold a prediction."""
        return self._dirty or self._predicted

    def publish(self, version: int, *, at_step: bool = False, predict: bool = False,
                record: bool = False) -> None:
        """Copy masters into the model weights group by group, opening their fences.

        ``at_step``: the publish that starts a step (the masters hold the last step's
        result).  ``predict``: publish ``M + (M - P)`` instead of the masters ``M``, where
        ``P`` are the masters at the last step's start (a weight prediction for the
        call that overlaps this step; without such a ``P`` the masters are published).
        ``record``: keep ``P`` for the next step even when not predicting (an exact step
        before asynchronous ones).  Once kept, ``P`` is refreshed at every step.
        """
        with self._lock:
            keep = self.has_masters and at_step and (
                predict or record or bool(self._previous))
            extrapolate = keep and predict and self._history
            if not (self.has_masters and (self.dirty or extrapolate or keep)):
                self.fences.publish_all(version)
                return
            write = self.dirty or extrapolate
            done: set[str] = set()
            with torch.no_grad():
                for group in self.publish_groups + [tuple(self._masters)]:
                    group = tuple(n for n in group if n not in done)
                    if not group:
                        continue
                    try:
                        staged = self._stage_for_publish(group, write)
                    except BaseException as e:
                        self.fences.fail_publish(version, (
                            f"reading the masters from offload_dir to publish them failed "
                            f"({type(e).__name__}: {e}); the weights of the last step are "
                            "not all published: call pipe.synchronize() to publish them "
                            "again"))
                        raise
                    for name in group:
                        self.fences.record("publish_begin", name, version)
                        master = self._masters.get(name)
                        if master is not None:
                            self._publish_one(name, master, write, keep, extrapolate)
                        self.fences.record("publish_end", name, version)
                    if staged:
                        self.offload.evict(staged)  # type: ignore[union-attr]
                    done.update(group)
                    self.fences.publish(group, version)
            self._dirty = False
            self._predicted = extrapolate
            self._history = self._history or keep
            if write:
                self.note_weights()
            self.fences.publish_all(version)

    def publishing_schedule(self, version: int,
                            groups: Sequence[tuple[str, ...]] | None = None
                            ) -> UnitSchedule:
        """A step that publishes as it goes (an exact step the next call overlaps): after
        the optimizer updated unit ``k``'s masters, ``after_unit(k)`` copies them into the
        model weights and opens the unit's fences at ``version``, so the next call's first
        jobs wait only for their own units.  The caller made sure nothing older is
        unpublished (``dirty`` is False) and no weight prediction is kept.  ``groups``:
        the parameter names of each unit in the order they are updated (default: every
        parameter no unit reads, then the upload order).  Those no unit reads have no
        fence the next call waits for (only ``loss_fn`` reads them, after the units'
        forward): published first, they are new before the first unit's fence opens."""
        if groups is None:
            read = {n for group in self.publish_groups for n in group}
            groups, seen = [], set()
            for group in [tuple(n for n in self._params if n not in read)] + \
                    self.publish_groups:
                group = tuple(n for n in group if n not in seen)
                seen.update(group)
                if group:
                    groups.append(group)
        groups = [tuple(g) for g in groups]
        # every name with a master (a parameter frozen after its gradient landed is
        # still stepped, as eager steps it)
        units = [tuple(n for n in g if n in self._masters) for g in groups]

        def after_unit(k: int) -> None:
            with self._lock, torch.no_grad():
                for name in units[k]:
                    self.fences.record("publish_begin", name, version)
                    master = self._masters.get(name)
                    if master is not None:
                        self._params[name].copy_(master)
                        self._note(name)
                    self.fences.record("publish_end", name, version)
            self.fences.publish(groups[k], version)

        return UnitSchedule(self.landed, units, after_unit=after_unit)

    def _stage_for_publish(self, group: tuple[str, ...], write: bool) -> list[str]:
        """With the disk tier, read the group's masters in to copy them to the weights."""
        if self.offload is None or not write:
            return []
        keys = [master_key(n) for n in group if n in self._masters]
        try:
            wait(self.offload.stage(keys))
        except BaseException:  # a failed read leaves nothing staged
            self.offload.evict(keys)
            raise
        return keys

    def _publish_one(self, name: str, master: torch.Tensor, write: bool, keep: bool,
                     extrapolate: bool) -> None:
        param = self._params[name]
        previous = self._previous.get(name) if keep else None
        if keep and previous is None:  # first kept step (or a master made since)
            self._previous[name] = master.detach().clone()
            keep = extrapolate = False
        if extrapolate:
            # M + (M - P) computed in the masters' dtype and cast on the store, written
            # straight into the weight (lerp with weight 2), then P := M: the publish
            # reads P and writes it once more, no temporary.
            torch.lerp(previous, master, 2.0, out=param)
        elif write:
            param.copy_(master)
        if keep:
            previous.copy_(master)

    # --- the disk tier's step -------------------------------------------------------------
    def _tier(self) -> OffloadStore:
        if self.offload is None:  # only the tier's own paths call this
            raise OffloadError("internal: a disk-tier step on a pipe without offload_dir")
        return self.offload

    def offload_begin(self, schedule: UnitSchedule | None = None) -> UnitSchedule:
        """A step starts: mark what a failure rolls back to, and set the unit schedule
        along which a bound optimizer's update stages the masters and state (wrapping
        ``schedule``'s callbacks, a publishing one, where given)."""
        store = self._tier()
        store.begin()
        # what the store holds state for: the masters, or without them (stochastic
        # rounding) the parameters the optimizer updates in place
        tiered = self._masters if self.has_masters else self._params
        if schedule is None:
            done: set[str] = set()
            units = []
            for group in self.publish_groups + [tuple(tiered)]:
                unit = tuple(n for n in group if n in tiered and n not in done)
                done.update(unit)
                if unit:
                    units.append(unit)
            schedule = UnitSchedule(self.landed, units)
        else:  # every master in some unit: none is updated unstaged
            covered = {n for u in schedule.units for n in u}
            rest = tuple(n for n in tiered if n not in covered)
            if rest:
                schedule = UnitSchedule(self.landed, schedule.units + (rest,),
                                        schedule._before, schedule._after)
        window = OffloadWindow(store, schedule.units)
        before, after = schedule._before, schedule._after

        def before_unit(k: int) -> None:
            try:
                window.before_unit(k)
            except BaseException:
                if k == 0:  # nothing was updated or published yet
                    staged.started = False
                raise
            if before is not None:
                before(k)

        def after_unit(k: int) -> None:
            if after is not None and k < len(schedule.units):
                after(k)  # e.g. publish the staged masters into the weights
            window.after_unit(k)

        self._window = window
        staged = UnitSchedule(self.landed, schedule.units, before_unit, after_unit)
        self.landed.unit_schedule = staged
        return staged

    def stage_new_state(self, created: Sequence[tuple[torch.Tensor, str]]) -> None:
        """With the disk tier: stage the optimizer state just made (zeros in their files)
        for the unit being updated, which the step's window did not know of."""
        if self.offload is None or not created:
            return
        keys = [state_key(owner[1], key) for p, key in created
                if (owner := tier_owner_of(p)) is not None and owner[0] is self.landed]
        wait(self.offload.stage(keys))

    def offload_finish(self, version: int | None = None) -> None:
        """A step ended whole: its writes finish, state the optimizers made goes to the
        files, and the manifest names the new slots (step k + 1 is committed), with the
        pipe's counters as they were when step ``version`` was enqueued."""
        store = self._tier()
        if version is not None and version in self.step_counters:
            self.counters = self.step_counters.pop(version)
            for v in [v for v in self.step_counters if v < version]:
                del self.step_counters[v]  # steps that failed
        window, self._window = self._window, None
        if window is not None:
            window.finish()
        self.absorb_optimizer_state()
        staged = store.staged_keys()
        wait(store.write_back(staged))
        store.evict(staged)
        store.commit()
        # (only now: until the commit, a failure must see that units were updated)
        self.landed.unit_schedule = None

    def absorb_optimizer_state(self, optimizers: Iterable[object] | None = None) -> None:
        """Put every state tensor the bound optimizers keep for this pipe's masters into
        the files (ones made since the last step, or replaced by a load); the small ones
        (step counts) stay resident."""
        store = self._tier()
        for opt in list(self.landed.optimizers if optimizers is None else optimizers):
            for p, state in list(opt.state.items()):  # type: ignore[attr-defined]
                owner = tier_owner_of(p)
                if owner is None or owner[0] is not self.landed:
                    continue
                for key, value in list(state.items()):
                    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                        continue
                    skey = state_key(owner[1], key)
                    if store.tensor(skey) is value:
                        continue
                    storage = value.untyped_storage()
                    if (not value.is_contiguous() or value.storage_offset() != 0
                            or storage.nbytes() != value.numel() * value.element_size()
                            or not storage.resizable()):
                        # a view, or a loaded tensor in a shared or mapped storage: it
                        # needs a storage of its own to be freed and staged
                        value = state[key] = value.clone(
                            memory_format=torch.contiguous_format)
                    store.register(skey, value, group=owner[1])

    def _absorb_loaded(self, optimizer: object) -> None:
        """An optimizer's state was loaded: into the files, committed."""
        store = self._tier()
        self.absorb_optimizer_state([optimizer])
        store.commit()

    # --- the disk tier's record of what it belongs to, and resuming from it ---------------
    def _model_fingerprint(self) -> dict[str, object]:
        model = self.model
        persistent = set(model.state_dict(keep_vars=True))
        return {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "optim_dtype": str(self.optim_dtype).replace("torch.", ""),
            "parameters": [[n, list(p.shape), str(p.dtype).replace("torch.", ""),
                            p.requires_grad] for n, p in self._params.items()],
            "buffers": [[n, list(b.shape), str(b.dtype).replace("torch.", "")]
                        for n, b in model.named_buffers() if n in persistent],
        }

    def _value_digests(self) -> dict[str, str]:
        """A digest of each frozen parameter and persistent buffer (the tier does not
        hold them: a resume takes them from the model it is given, which must hold the
        run's).  Cached while a tensor's memory and version counter stay the same."""
        persistent = set(self.model.state_dict(keep_vars=True))
        tensors = [(n, p) for n, p in self._params.items() if not p.requires_grad] + [
            (n, b) for n, b in self.model.named_buffers() if n in persistent]
        out = {}
        for name, t in tensors:
            t = t.detach()
            key = (t.data_ptr(), t._version)
            cached = self._digests.get(name)
            if cached is None or cached[:2] != key:
                flat = t.contiguous().reshape(-1).view(torch.uint8)
                h = hashlib.blake2b(digest_size=16)
                if flat.numel():
                    h.update((ctypes.c_char * flat.numel()).from_address(flat.data_ptr()))
                cached = self._digests[name] = (*key, h.hexdigest())
            out[name] = cached[2]
        return out

    def _optimizer_fingerprints(self, optimizers: Iterable[object] | None = None
                                ) -> dict[str, object]:
        """For each master a bound optimizer steps: its class, state dtype and the
        hyperparameters of its group (the learning rate apart: schedulers change it), as
        they were when the optimizer was made (where :meth:`resume_optimizer` saw it)."""
        out: dict[str, object] = {}
        for opt in list(self.landed.optimizers if optimizers is None else optimizers):
            made_as = self._made_as.get(opt, {})
            for group in opt.param_groups:  # type: ignore[attr-defined]
                hyper = {k: _plain(v) for k, v in sorted(group.items())
                         if k not in ("params", "lr", "initial_lr")}
                fingerprint = {
                    "class": f"{type(opt).__module__}.{type(opt).__qualname__}",
                    "state_dtype": str(opt.__dict__.get(
                        "_state_dtype_given", getattr(opt, "state_dtype", None))),
                    "hyperparameters": hyper}
                for p in group["params"]:
                    owner = tier_owner_of(p)
                    if owner is not None and owner[0] is self.landed:
                        out[owner[1]] = made_as.get(owner[1], fingerprint)
        return json.loads(json.dumps(out, default=repr))

    def _before_commit(self) -> None:
        store = self._tier()
        store.meta["pipe"] = dict(self.counters)
        fingerprints = self._optimizer_fingerprints()
        if store.resumed is not None:  # the run's, for the state no optimizer took yet
            recorded = store.resumed["meta"].get("optimizers") or {}
            for key in store.resumed_keys("state/"):
                name = key[len("state/"):].rsplit("/", 1)[0]
                if name in recorded:
                    fingerprints.setdefault(name, recorded[name])
        store.meta["optimizers"] = fingerprints
        store.meta["values"] = self._value_digests()

    def _mismatch(self, what: str) -> OffloadMismatchError:
        return OffloadMismatchError(
            f"offload_dir {self._tier().directory!r} holds the state of step "
            f"{self.offload.step} of a run with another {what}. Nothing was resumed: "
            "resume it with the model (and optimizer) it was written for, or pass another "
            "offload_dir (or remove this one) to start afresh")

    def _resume_masters(self) -> None:
        """Check that the resumed directory belongs to this model, then adopt its
        masters and publish them into the model's weights (as after a synchronize)."""
        store = self._tier()
        if store.resumed is None:
            raise OffloadError("internal: adopting a directory that was not resumed")
        meta = store.resumed["meta"]
        theirs, mine = meta.get("model") or {}, store.meta["model"]
        for field in ("class", "optim_dtype"):
            if theirs.get(field) != mine[field]:
                raise self._mismatch(f"model: its {field} was {theirs.get(field)!r}, this "
                                     f"pipe's is {mine[field]!r}")
        for field in ("parameters", "buffers"):
            a = {e[0]: e[1:] for e in theirs.get(field, [])}
            b = {e[0]: e[1:] for e in mine[field]}  # type: ignore[union-attr]
            def describe(entry: list | None) -> str:
                if entry is None:
                    return "absent"
                return f"{entry[1]} {entry[0]}" + (
                    "" if len(entry) < 3 else " trainable" if entry[2] else " frozen")
            differ = [f"{n!r} {describe(a.get(n))} there, {describe(b.get(n))} here"
                      for n in list(b) + [n for n in a if n not in b] if a.get(n) != b.get(n)]
            if differ:
                raise self._mismatch(
                    f"model: {len(differ)} of its {field} differ ("
                    + "; ".join(differ[:3]) + ("; ..." if len(differ) > 3 else "") + ")")
        recorded, now = meta.get("values", {}), self._value_digests()
        differ = sorted(n for n in set(recorded) | set(now) if recorded.get(n) != now.get(n))
        if differ:
            raise self._mismatch(
                f"model's frozen parameters or buffers: {len(differ)} hold other values "
                f"than the run's at its last step ({', '.join(map(repr, differ[:4]))}"
                + (", ..." if len(differ) > 4 else "") + "); the tier keeps only the "
                "trainable parameters' masters and their optimizer state, so a resume takes "
                "the rest from the model it is given: build it as the run did (the same "
                "pretrained weights), or resume from a checkpoint (save_checkpoint), which "
                "holds buffers a training changes (batch-norm statistics)")
        with torch.no_grad():
            for name, param in self._params.items():
                if not param.requires_grad:
                    continue
                master = Master(torch.empty(param.shape, dtype=self.optim_dtype),
                                requires_grad=True)
                if not store.adopt(master_key(name), master, group=name):
                    raise self._mismatch(f"set of masters: it has none for {name!r}")
                self.landed.adopt(master, name)
                self._masters[name] = master
                key = [master_key(name)]
                try:
                    wait(store.stage(key))
                    param.copy_(master)
                    self._note(name)
                finally:
                    store.evict(key)
        self.counters = dict(meta.get("pipe") or {})

    def resume_optimizer(self, optimizer: object) -> None:
        """A ``roundpipe.optim`` optimizer bound this pipe's masters: with a resumed
        directory, check it is the run's (class, state dtype, hyperparameters but the
        learning rate) and give it the state the directory holds for them.  Without
        one, note its fingerprint as made, for the manifests."""
        store = self.offload
        mine = self._optimizer_fingerprints([optimizer])
        made_as = self._made_as.setdefault(optimizer, {})
        for name, fingerprint in mine.items():
            made_as.setdefault(name, fingerprint)
        if store is None or store.resumed is None:
            return
        recorded = store.resumed["meta"].get("optimizers") or {}
        fresh = [n for n in mine if n not in self._resume_checked]
        for name in fresh:
            if recorded and recorded.get(name) != mine[name]:
                theirs = recorded.get(name)
                raise self._mismatch(
                    f"optimizer for {name!r}: the run's was "
                    + (f"{theirs}" if theirs else "none (it did not step it)")
                    + f", this one is {mine[name]} (the learning rate is not compared)")
        state = optimizer.state  # type: ignore[attr-defined]
        for group in optimizer.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                owner = tier_owner_of(p)
                if owner is None or owner[0] is not self.landed or owner[1] not in fresh:
                    continue
                name = owner[1]
                for skey in store.resumed_keys(f"state/{name}/"):
                    key = skey[len(f"state/{name}/"):]
                    if key in state[p]:  # set already (a load): that value wins
                        continue
                    info = store.resumed["entries"][skey]
                    value = torch.empty(info["shape"], dtype=dtype_of(info["dtype"]))
                    store.adopt(skey, value, group=name)
                    state[p][key] = value
        self._resume_checked.update(fresh)

    def unresumed(self) -> list[str]:
        """Optimizer state the resumed directory holds that no optimizer took yet (a
        step now would drop it from the files)."""
        if self.offload is None or self.offload.resumed is None:
            return []
        return self.offload.resumed_keys("state/")

    def hold_commits(self) -> None:
        """A load of several parts starts (the model's state, then the optimizer's):
        with the disk tier, its writes go to the slots the manifest does not name and
        are committed once, at :meth:`release_commits`, so a crash between the parts
        leaves the files at the state before the load, never a mix."""
        if self.offload is not None:
            self._held_written = self.offload.bytes_written
            self._held_versions = self._model_versions()
            self.offload.hold()

    def release_commits(self, ok: bool) -> None:
        """End :meth:`hold_commits`: ``ok``, the load is committed in one manifest
        switch; else (or if that commit fails) the files keep the state from before it
        and, once the load wrote into them or into the model's parameters and buffers
        (their version counters moved), every call and step refuses until state
        is loaded again (the weights in memory may be the loaded ones)."""
        store = self.offload
        if store is None:
            return
        if not ok:
            self._fail_load(None)
            return
        try:
            store.release()
        except BaseException as e:
            self._fail_load(e)
            raise

    def _model_versions(self) -> dict[str, int]:
        return {n: t._version for n, t in self.model.state_dict(keep_vars=True).items()
                if isinstance(t, torch.Tensor)}

    def _fail_load(self, error: BaseException | None) -> None:
        store = self._tier()
        store.release_without_commit()
        self.offload_rollback()
        if (store.bytes_written != self._held_written
                or self._model_versions() != self._held_versions):
            why = ("loading state into a pipe with the disk tier (offload_dir) failed "
                   "part-way" + (f" ({type(error).__name__}: {error})" if error else "")
                   + ": its files keep the state from before the load, but the weights "
                   "in memory may be the loaded ones. Load the checkpoint again "
                   "(load_checkpoint) before the next call or step")
            log.error("roundpipe: %s", why)
            self.mixed = why

    def offload_rollback(self) -> None:
        """A step failed: drop what it staged and wrote, point every tensor back at the
        slot it was in when the step began, and drop optimizer state it made."""
        store = self._tier()
        self.landed.unit_schedule = None
        window, self._window = self._window, None
        if window is not None:
            window.drain()
        store.rollback()
        for opt in list(self.landed.optimizers):
            for p, state in list(opt.state.items()):  # type: ignore[attr-defined]
                owner = tier_owner_of(p)
                if owner is None or owner[0] is not self.landed:
                    continue
                for key in [k for k, v in state.items() if isinstance(v, torch.Tensor)
                            and not store.has(state_key(owner[1], k))]:
                    del state[key]
                if not state:
                    del opt.state[p]  # type: ignore[attr-defined]

    def fail_unmastered_step(self, error: BaseException) -> None:
        """A step of a pipe with the disk tier and no masters failed: the files keep the
        last whole step's optimizer state; if some unit was already updated (its
        weights written in place), every call and step refuses until state is loaded."""
        schedule = self.landed.unit_schedule  # started: a unit's update may have begun
        started = schedule is not None and schedule.started
        self.offload_rollback()
        if started:
            why = (f"a step failed part-way ({type(error).__name__}: {error}) after some "
                   "weights were updated in place (no masters, optim_dtype=None): the "
                   "weights and the optimizer state in offload_dir mix two steps. Load a "
                   "checkpoint (load_checkpoint) to go on")
            log.error("roundpipe: %s", why)
            self.mixed = why

    def master_versions(self) -> dict[str, int]:
        """Each master's version counter (in-place writes bump it), for
        :meth:`restore_masters`."""
        return {name: master._version for name, master in self._masters.items()}

    def restore_masters(self, versions: Mapping[str, int] | None = None) -> None:
        """After a failed step: make the masters what they were when it started (the
        masters kept at its start where it kept them, else the published weights).  The
        weights are left alone (the next call may be reading them); where they hold a
        prediction, the next publish writes the masters.  ``versions``: the masters'
        version counters when the step started; a master the step did not write keeps
        its value (the published weight is only its rounding to the model's dtype)."""
        if self.offload is not None:
            self.offload_rollback()
            self._dirty = False
            return
        with self._lock, torch.no_grad():
            for name, master in self._masters.items():
                kept = self._previous.get(name) if self._history else None
                if kept is None and versions is not None and \
                        versions.get(name) == master._version:
                    continue  # not written by the failed step: exact as it is
                master.copy_(self._params[name] if kept is None else kept)
            self._dirty = False

    def previous_masters(self) -> dict[str, torch.Tensor]:
        """The masters kept from the last step's start (weight prediction), by name."""
        return dict(self._previous) if self._history else {}

    def all_previous(self) -> list[torch.Tensor]:
        """Every kept tensor, for host-memory accounting."""
        return list(self._previous.values())

    def load_previous(self, values: Mapping[str, torch.Tensor] | None) -> None:
        """Set the kept masters from a checkpoint (None: no history)."""
        with torch.no_grad():
            if not values:
                self._history = False
                return
            if self.offload is not None:
                raise OffloadError(
                    "this state holds the masters kept for the weight prediction of "
                    "asynchronous steps, a second copy of the masters in host memory, "
                    "which the disk tier (offload_dir) does not keep; load it into a pipe "
                    "without offload_dir, or save it after an exact step")
            for name, value in values.items():
                if name in self._masters or (self.has_masters and name in self._params):
                    master = self.master(name)
                    kept = self._previous.get(name)
                    if kept is None:
                        kept = self._previous[name] = torch.empty_like(master.detach())
                    kept.copy_(value)
            self._history = True

    def load_masters(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set masters from ``values`` exactly (their weights follow at the next publish);
        clears a step's part-way failure (``mixed``)."""
        self.mixed = None
        self.fences.clear_failed()
        with torch.no_grad():
            for name, value in values.items():
                if name in self._params and self._params[name].requires_grad and \
                        self.has_masters:
                    master = self.master(name)
                    if self.offload is not None:
                        self.offload.assign(master_key(name), value)
                    else:
                        master.copy_(value)
        if self.offload is not None:
            self.offload.commit()
        self._dirty = True

    def read_master(self, name: str) -> torch.Tensor:
        """A master's value: the tensor itself, or with the disk tier a copy read from
        its file (the masters are not in memory between steps)."""
        master = self.master(name)
        if self.offload is None:
            return master.detach()
        return self.offload.read(master_key(name))

    def outside_grads(self) -> dict[str, torch.Tensor]:
        """Gradients autograd accumulated on the model's own parameters while they have
        masters: a use of the parameter outside the pipe (the pipe's gradients land on
        the masters, where the optimizer reads them)."""
        if not self.has_masters:
            return {}
        return {name: grad for name, param in self._params.items()
                if param.requires_grad and (grad := param.grad) is not None}

    def fold_outside_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add ``grads`` (from :meth:`outside_grads`) to their masters' ``.grad`` and
        clear them on the parameters: the optimizer sees the sum, as eager's would."""
        with torch.no_grad():
            for name, grad in grads.items():
                master = self.master(name)
                total = master.grad  # a gradient held where it landed is converted
                add = grad.to(master.dtype)
                if total is None:
                    set_raw_grad(master, add.clone() if add is grad else add)
                else:
                    total += add
                self._params[name].grad = None

    def take_outside_grads(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The outside gradients of ``names`` (see :meth:`outside_grads`), cleared on the
        parameters: a step taken as gradients land adds them to its own."""
        if not self.has_masters:
            return {}
        taken = {}
        for name in names:
            param = self._params.get(name)
            if param is not None and param.requires_grad and param.grad is not None:
                taken[name], param.grad = param.grad, None
        return taken

    def drop_outside_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        for name in grads:
            self._params[name].grad = None

    def commit_grads(self, grads: Mapping[str, Sequence[tuple[int, torch.Tensor]]],
                     owned: frozenset[str] = frozenset(),
                     holdable: frozenset[str] = frozenset(),
                     norms: Mapping[str, torch.Tensor] | None = None) -> None:
        """Add per-unit gradients to the masters' ``.grad`` (keyed by parameter name).

        Contributions are folded in descending unit order (the order backward produces
        them), so the result does not depend on how units were grouped into stages or on
        the device count.  ``owned``: the names whose tensors are fresh, in the masters'
        dtype, and may become ``.grad`` as they are; the others are reused buffers.
        ``holdable``: names whose one contribution is a download buffer no later download
        reuses while it is held: a master a one-pass optimizer binds keeps it as is.
        ``norms``: the 2-norms the devices measured of such contributions.
        """
        landed = self.landed
        norms = norms or {}
        if landed.norms_requested:  # the step that asked is done: calls from now on
            landed.wants_norms = True
        with torch.no_grad():
            for name, contributions in grads.items():
                master = self.master(name)
                current = raw_grad(master)
                pending = landed.take(name, master.dtype)
                if (name in holdable and current is None and pending is None
                        and len(contributions) == 1 and self.has_masters
                        and landed.bound(name)):
                    landed.hold(name, contributions[0][1], norms.get(name))
                    continue
                total = fold_unit_grads(
                    contributions, master.dtype,
                    fresh=current is None and pending is None and name not in owned)
                if pending is not None:  # the previous call's (held in low precision)
                    total = pending + total
                if current is None:
                    set_raw_grad(master, total)
                else:
                    current += total


def fold_unit_grads(contributions: Sequence[tuple[int, torch.Tensor]],
                    dtype: torch.dtype | None = None, *, fresh: bool = True) -> torch.Tensor:
    """Sum per-unit gradient contributions ``(unit index, gradient)`` in descending unit
    order (the order backward produces them), so the sum does not depend on how units
    were grouped into stages or on the device count.  ``fresh``: the result never
    aliases a contribution (the executor's download buffers are reused by its next
    call)."""
    ordered = sorted(contributions, key=lambda c: -c[0])
    first = ordered[0][1]
    total = first.to(first.dtype if dtype is None else dtype, copy=fresh)
    for _, g in ordered[1:]:
        total = total + (g if dtype is None else g.to(dtype))
    return total


class HostView(Protocol):
    """What an :class:`~roundpipe.runtime.executor.Executor` reads of the host state of
    its program.  :class:`HostState` implements it over a ``RoundPipe``'s model state;
    the ``torch.compile`` backend over the tensors Dynamo passes to each call."""

    specs: Mapping[str, StateSpec]      # state slot -> what it is
    fences: WeightFences                # uploads wait on them for published weights
    tensors: Mapping[str, torch.Tensor]  # state slot -> host tensor

    def trainable(self, slot: str) -> bool:
        """Whether a slot is a parameter that requires grad."""

    def param_names(self, slots: Iterable[str]) -> list[str]:
        """The parameter names (fences' keys) of the parameter slots among ``slots``."""

    def grad_dtype(self, slot: str) -> torch.dtype:
        """The dtype a slot's gradient is committed in."""

    def master_of(self, slot: str) -> torch.Tensor | None:
        """The master a parameter slot's gradient lands on, where it is another tensor
        than the parameter and exists already (None otherwise)."""

    def has_no_grad(self, slot: str) -> bool:
        """Whether nothing holds a gradient of the slot yet (a converted gradient may
        then be handed over instead of added)."""

    def wants_grad_norms(self) -> bool:
        """Whether the devices should measure the 2-norm of each gradient that lands in
        place (something clips or unscales held gradients)."""

    def lands_in_place(self, slot: str) -> bool:
        """Whether the slot's gradient, if it has one contribution, may stay in its
        download buffer (a one-pass optimizer reads it there): no conversion then, and
        the buffer is not reused while held."""


class HostState:
    """One program's view of the model state: state slot -> host tensor (a
    :class:`HostView`)."""

    def __init__(self, model_state: ModelState, program: ModelProgram) -> None:
        self.shared = model_state
        self.fences = model_state.fences
        self.specs = program.state_by_name()
        model = model_state.model
        self.tensors: dict[str, torch.Tensor] = {}
        for spec in program.state:
            if spec.kind == "constant":
                self.tensors[spec.name] = program.constants[spec.name]
            elif spec.kind == "parameter":
                self.tensors[spec.name] = model.get_parameter(spec.fqn)
            else:
                self.tensors[spec.name] = model.get_buffer(spec.fqn)
        model_state.publish_groups = [
            tuple(self.specs[s].fqn for s in u.state if self.specs[s].kind == "parameter")
            for u in program.units]

    def trainable(self, slot: str) -> bool:
        return self.specs[slot].kind == "parameter" and self.tensors[slot].requires_grad

    def param_names(self, slots: Iterable[str]) -> list[str]:
        return [self.specs[s].fqn for s in slots if self.specs[s].kind == "parameter"]

    def grad_dtype(self, slot: str) -> torch.dtype:
        return self.shared.master(self.specs[slot].fqn).dtype  # gradients land on masters

    def master_of(self, slot: str) -> torch.Tensor | None:
        if not self.shared.has_masters or self.specs[slot].kind != "parameter":
            return None
        return self.shared.masters().get(self.specs[slot].fqn)

    def has_no_grad(self, slot: str) -> bool:
        name = self.specs[slot].fqn
        return raw_grad(self.shared.master(name)) is None and \
            not self.shared.landed.has_landed(name)

    def lands_in_place(self, slot: str) -> bool:
        return self.shared.has_masters and self.shared.landed.bound(self.specs[slot].fqn)

    def wants_grad_norms(self) -> bool:
        return self.shared.landed.wants_norms

    def commit(self, param_grads: Mapping[str, Sequence[tuple[int, torch.Tensor]]],
               buffers: Mapping[str, torch.Tensor],
               grads_owned: frozenset[str] = frozenset(),
               grads_holdable: frozenset[str] = frozenset(),
               grad_norms: Mapping[str, torch.Tensor] | None = None) -> None:
        """Commit a successful call: gradients into the masters, buffer updates."""
        fqn = {s: self.specs[s].fqn for s in param_grads}
        self.shared.commit_grads({fqn[s]: g for s, g in param_grads.items()},
                                 owned=frozenset(fqn[s] for s in grads_owned if s in fqn),
                                 holdable=frozenset(fqn[s] for s in grads_holdable
                                                    if s in fqn),
                                 norms={fqn[s]: n for s, n in (grad_norms or {}).items()
                                        if s in fqn})
        with torch.no_grad():
            for slot, value in buffers.items():
                self.tensors[slot].copy_(value)
