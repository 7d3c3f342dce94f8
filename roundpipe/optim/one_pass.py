"""What ``roundpipe.optim``'s optimizers share: binding a pipe's masters, and one step
that updates them in one pass over host memory.

For each parameter the optimizer handles itself (a pipe's master, or any CPU parameter
when ``state_dtype`` is set) a step reads the gradient where it landed (in the model's
dtype, in the download buffer, unless something materialised ``p.grad``) and updates
master and moments in one pass: roundpipe's compiled loop (native.py), or torch's fused
kernels through a cache-sized conversion (kernels.py).  Every other parameter is stepped by
torch's own implementation, so plain parameters behave exactly as with ``torch.optim``.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable

import torch

from ..errors import HostOutOfMemoryError, OptimizerError
from ..runtime.masters import (LandedGrads, UnitSchedule, owner_of, raw_grad,
                               set_raw_grad, tier_owner_of)
from . import kernels, native, stochastic

#: the update kernels an optimizer may be asked for (native.py, kernels.py)
KERNELS = ("auto", "native", "fused")
#: the param-group options of stochastic rounding, and their defaults
SR_OPTIONS = {"stochastic_rounding": False, "seed": 0}


def _unwrapped_step(cls: type) -> Callable[..., Any]:
    """``cls.step`` without the profiling hook torch patches onto it (ours runs the
    hooks once already)."""
    step = cls.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def _unbind(bindings: list[tuple[LandedGrads, str]]) -> None:
    for landed, name in bindings:
        landed.unbind(name)


class OnePass:
    """Mixin for a ``torch.optim`` subclass; the subclass implements :meth:`_update`."""

    _torch_base: type[torch.optim.Optimizer]
    state_dtype: torch.dtype | None
    #: read by host_step.py's estimate (the core does not import roundpipe.optim): a step
    #: reads the landed gradients in its own pass, its moments are ``state_dtype``
    reads_landed_grads = True

    def _init_one_pass(self, state_dtype: torch.dtype | None, kernel: str = "auto",
                       resume: bool = True) -> None:
        if kernel not in KERNELS:
            raise OptimizerError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, "
                                 f"got {kernel!r}")
        if kernel == "native" and native.library() is None:
            raise OptimizerError(
                f"kernel='native': roundpipe.optim's native kernels could not be built "
                f"({native.unavailable_reason()}); install a C compiler (or set CC), or "
                "use kernel='auto', which falls back to torch's fused kernels")
        self.kernel = kernel
        if state_dtype is not None and (not isinstance(state_dtype, torch.dtype)
                                        or not state_dtype.is_floating_point):
            raise OptimizerError(f"state_dtype must be a floating dtype such as "
                                 f"torch.bfloat16 (or None for float32), got {state_dtype!r}")
        self.state_dtype = None if state_dtype == torch.float32 else state_dtype
        # As given: stochastically rounded bf16 parameters keep float32 moments only when
        # asked for by name (their default is the parameter's dtype, bf16).
        self._state_dtype_given = state_dtype
        given = self.__dict__.get("_sr_defaults", {})
        self._check_stochastic_rounding({"params": [], **given})
        if given.get("stochastic_rounding"):
            # only then: without it the state_dict stays torch's, key for key
            self.defaults.update(given)  # type: ignore[attr-defined]
        for group in self.param_groups:  # type: ignore[attr-defined]
            self._check_stochastic_rounding(group)
        if not hasattr(self, "_bindings"):
            self._bindings = []
        if not getattr(self, "_unbinds", False):  # once: a second would unbind twice
            weakref.finalize(self, _unbind, self._bindings)
            self._unbinds = True
        for group in self.param_groups:  # type: ignore[attr-defined]
            self._check_tiered(group)
        if resume:
            self._resume_from_tier()

    def _check_tiered(self, group: dict[str, Any]) -> None:
        """A pipe's disk tier without masters holds the state this class's own kernels
        make (stochastic rounding, or a ``state_dtype``); torch's implementation, which
        steps the rest, would keep its state in host memory and find none staged."""
        for i, p in enumerate(group["params"]):
            owner = tier_owner_of(p)
            if owner is None or owner_of(p) is not None or self._handles_in(group, p):
                continue
            raise OptimizerError(
                f"{type(self).__name__}: {owner[1]!r} ({p.dtype}) is a parameter of a pipe "
                "with the disk tier (offload_dir) and no masters (optim_dtype=None), where "
                "the files hold the state of stochastically rounded updates, but its group "
                "is stepped by torch's implementation, whose state would stay in host "
                "memory and be updated whole. Pass stochastic_rounding=True (bfloat16 "
                "parameters), or build the pipe with optim_dtype=torch.float32 (masters), "
                "or drop offload_dir")

    def _resume_from_tier(self) -> None:
        """A pipe resumed from its disk tier (``offload_resume``) checks this optimizer
        against the run's and gives it the state the directory holds."""
        try:
            for landed in self._landed_bindings():
                if landed.resume is not None:
                    landed.resume(self)
        except BaseException:
            # refused: this optimizer is no longer bound (a later commit must not record
            # it, nor its failed construction hold the pipe's masters)
            for landed, _ in self._bindings + self.__dict__.get("_tiered", []):
                landed.optimizers.discard(self)
            _unbind(self._bindings)
            self._bindings.clear()
            self.__dict__.get("_tiered", []).clear()
            raise

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            # The options go into a group (and its state_dict) only where it rounds.
            given = self.__dict__.get("_sr_defaults", {})
            defaults = getattr(self, "defaults", {})
            default = {k: defaults.get(k, given.get(k, v)) for k, v in SR_OPTIONS.items()}
            if param_group.get("stochastic_rounding", default["stochastic_rounding"]):
                for key, value in default.items():
                    param_group.setdefault(key, value)
        super().add_param_group(param_group)  # type: ignore[misc]
        if not hasattr(self, "_bindings"):  # torch's __init__ adds the first groups
            self._bindings = []
        if not hasattr(self, "_tiered"):  # parameters of a disk tier without masters
            self._tiered: list[tuple[LandedGrads, str]] = []
        group = self.param_groups[-1]  # type: ignore[attr-defined]
        if hasattr(self, "state_dtype"):  # a group added after construction
            self._check_stochastic_rounding(group)
            resume = True
        else:
            resume = False
        for p in group["params"]:
            owner = owner_of(p)
            if owner is None:
                tiered = tier_owner_of(p)
                if tiered is not None:
                    tiered[0].optimizers.add(self)
                    self._tiered.append(tiered)
                continue
            if group.get("differentiable") or group.get("capturable"):
                raise OptimizerError(
                    "differentiable=True and capturable=True do not apply to a pipe's "
                    "masters (host tensors updated outside autograd); leave them False")
            owner[0].bind(owner[1])
            owner[0].optimizers.add(self)
            self._bindings.append(owner)
        if resume:
            self._check_tiered(group)
            self._resume_from_tier()

    #: parameter dtypes the fused kernel is right for (torch's own step takes the rest)
    _fused_dtypes: frozenset[torch.dtype] = frozenset(
        {torch.float32, torch.float64, torch.bfloat16, torch.float16})

    def _handles(self, p: torch.Tensor) -> bool:
        """Whether this class's own kernel steps ``p`` (else torch's implementation)."""
        if p.dtype not in self._fused_dtypes:  # complex ones, say
            return False
        return owner_of(p) is not None or (self.state_dtype is not None
                                           and p.device.type == "cpu")

    def _handles_in(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        """:meth:`_handles`, and every parameter of a stochastically rounded group (those
        that cannot be rounded are refused by its check, not left to torch)."""
        return bool(group.get("stochastic_rounding")) or self._handles(p)

    def _check_stochastic_rounding(self, group: dict[str, Any]) -> None:
        """Refuse, before anything runs, what stochastic rounding cannot do exactly (see
        :class:`roundpipe.optim.AdamW`)."""
        sr, seed = group.get("stochastic_rounding", False), group.get("seed", 0)
        name = type(self).__name__
        if not isinstance(sr, bool):
            raise OptimizerError(f"{name}: stochastic_rounding must be True or False, "
                                 f"got {sr!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise OptimizerError(f"{name}: seed must be an int in [0, 2**64) (it keys the "
                                 f"random bits of stochastic rounding), got {seed!r}")
        if not sr:
            return
        given = self.__dict__.get("_state_dtype_given")
        if given not in (None, torch.float32, torch.bfloat16):
            raise OptimizerError(
                f"{name}(stochastic_rounding=True) keeps its moments in bfloat16 (the "
                f"default) or float32; state_dtype={given} is not supported: pass "
                "state_dtype=torch.bfloat16, torch.float32 or None")
        groups = self.param_groups  # type: ignore[attr-defined]
        g = next((k for k, other in enumerate(groups) if other is group), len(groups))
        for i, p in enumerate(group["params"]):
            where = f"parameter {i} of param group {g} (shape {tuple(p.shape)}, {p.dtype})"
            owner = owner_of(p)
            if owner is not None:
                raise OptimizerError(
                    f"{name}(stochastic_rounding=True) was given a pipe's master copy "
                    f"({owner[1]!r}): with masters (optim_dtype) the update is already "
                    "kept in full precision and the weights are rounded from it, so "
                    "stochastic rounding has nothing to do. Either drop "
                    "stochastic_rounding, or build the pipe with optim_dtype=None and a "
                    "bfloat16 model so the optimizer updates its weights directly (6 bytes "
                    "per parameter with bfloat16 moments)")
            if p.dtype != torch.bfloat16:
                why = ("a float32 parameter holds the float32 update exactly, there is "
                       "nothing to round" if p.dtype == torch.float32 else
                       "only rounding to bfloat16 is implemented")
                raise OptimizerError(
                    f"{name}(stochastic_rounding=True) got {where}: {why}. Use "
                    "stochastic_rounding only on bfloat16 parameters (model.bfloat16()), "
                    "or put the others in a param group with stochastic_rounding=False")
            if p.device.type != "cpu":
                raise OptimizerError(
                    f"{name}(stochastic_rounding=True) got {where} on {p.device}: the "
                    "rounding kernels run on the host; keep the parameters on the CPU "
                    "(a RoundPipe does) or use torch.optim for device parameters")

    def _landed_bindings(self) -> list[LandedGrads]:
        bindings = self._bindings + self.__dict__.get("_tiered", [])
        return list({id(b[0]): b[0] for b in bindings}.values())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups  # type: ignore[attr-defined]
        for g in groups:
            if any(self._handles_in(g, p) for p in g["params"]):
                self._check_group(g)
        self._step_groups(groups, torch_rest=True)
        return loss

    def frozen_groups(self) -> list[dict[str, Any]]:
        """The param groups as they are now (copies, checked), for :meth:`step_frozen`
        later on another thread: a learning-rate scheduler stepping meanwhile changes
        the next step, not this one."""
        def frozen(value: Any) -> Any:  # a tensor lr is written in place by schedulers
            if isinstance(value, torch.Tensor):
                return value.detach().clone()
            if isinstance(value, tuple):
                return tuple(frozen(v) for v in value)
            return value
        groups = [{k: (list(v) if k == "params" else frozen(v)) for k, v in g.items()}
                  for g in self.param_groups]  # type: ignore[attr-defined]
        for g in groups:
            self._check_group(g)
        # what torch's step() wrapper records for a learning-rate scheduler (which warns
        # when it steps before the optimizer did)
        self._opt_called = True  # type: ignore[attr-defined]
        return groups

    def unit_step_blocker(self, landed: LandedGrads) -> str | None:
        """Why :meth:`step_frozen` cannot step this optimizer unit by unit for the pipe
        whose masters ``landed`` binds (None: it can): every parameter must be one of
        that pipe's masters, updated by this class's own kernel, and ``step`` must be
        this class's own (a step replaced on the instance, or overridden by a subclass,
        would be bypassed)."""
        own = vars(self).get("step")
        # a learning-rate scheduler wraps step() on the instance only to record that it
        # ran (_opt_called, which frozen_groups sets): that wrapper is not bypassed
        if own is not None and not (getattr(own, "_wrapped_by_lr_sched", False) and
                                    getattr(own, "__wrapped__", None) is type(self).step):
            return "its step() is replaced on the instance, and would be bypassed"
        if _unwrapped_step(type(self)) is not _unwrapped_step(OnePass):
            return f"{type(self).__name__} overrides step(), which would be bypassed"
        for g in self.param_groups:  # type: ignore[attr-defined]
            for p in g["params"]:
                owner = owner_of(p)
                if owner is None or owner[0] is not landed:
                    return (f"it also updates a tensor of shape {tuple(p.shape)} that is "
                            "not one of this pipe's masters")
                if not self._handles(p):
                    return f"{owner[1]} ({p.dtype}) is stepped by torch's implementation"
        return None

    @torch.no_grad()
    def step_frozen(self, groups: list[dict[str, Any]],
                    on_prepared: Callable[[], None] | None = None) -> None:
        """One step with ``groups`` (from :meth:`frozen_groups`), walking the bound
        pipe's unit schedule.  ``on_prepared()`` runs once every gradient was found and
        every buffer allocated, before anything is written: after it, only the
        arithmetic of the update remains."""
        self._step_groups(groups, torch_rest=False, on_prepared=on_prepared)

    def _step_groups(self, groups: list[dict[str, Any]], *, torch_rest: bool,
                     on_prepared: Callable[[], None] | None = None) -> None:
        mine = [[p for p in g["params"] if self._handles_in(g, p)] for g in groups]
        landed = self._landed_bindings()
        for binding in landed:
            if not binding.on_step_thread():
                raise OptimizerError(
                    f"{type(self).__name__}.step() updates a pipe's masters only inside "
                    "the pipe's step_fn, where their weights are published afterwards: "
                    "pipe.step(lambda: (opt.step(), opt.zero_grad()))")
        schedules = [b.unit_schedule for b in landed if b.unit_schedule is not None]
        # Every gradient is found and checked before anything is written.
        scales: dict[int, tuple[torch.Tensor, ...]] = {}
        work = [[(p, grad) for p in params
                 if (grad := self._grad_of(p, scales)) is not None] for params in mine]
        rest = (lambda: self._torch_step_without(mine)) if torch_rest else None
        self._step_work(groups, work, scales, rest, schedules[0] if schedules else None,
                        on_prepared)

    @torch.no_grad()
    def step_landed(self, groups: list[dict[str, Any]], grads: dict[int, torch.Tensor],
                    stage: Callable[[list[tuple[torch.Tensor, str]]], None] | None = None
                    ) -> None:
        """One unit's share of a step whose gradients are consumed as they land
        (``pipe.forward_backward(..., step=opt)``): update the parameters of ``groups``
        (from :meth:`frozen_groups`) whose ``id`` is in ``grads``, reading those
        gradients, with the same elementwise kernels as :meth:`step` (so the result is
        bitwise that of a whole step).  Their state is allocated first; ``stage(created)``
        then gets the ``(param, key)`` made (the disk tier stages them)."""
        work = [[(p, grads[id(p)]) for p in g["params"]
                 if id(p) in grads and self._handles_in(g, p)] for g in groups]
        for pairs in work:
            for p, grad in pairs:
                if grad.shape != p.shape:
                    raise OptimizerError(f"{type(self).__name__} got a gradient of shape "
                                         f"{tuple(grad.shape)} for a parameter of shape "
                                         f"{tuple(p.shape)}")
        known = {id(p) for p in self.state}  # type: ignore[attr-defined]
        created = self._allocate_state(list(zip(groups, work)))
        try:
            if stage is not None:
                stage(created)
        except BaseException:
            self._drop_state(created, known)
            raise
        self._fresh = frozenset((id(p), key) for p, key in created)
        self._scales = {}
        try:
            for g, pairs in zip(groups, work):
                if pairs:
                    self._update_and_mark(g, pairs)
        finally:
            self._scales, self._fresh = {}, frozenset()

    @torch.no_grad()
    def step_pairs(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                   group: int = 0) -> None:
        """One step of ``param_groups[group]`` over the given ``(parameter, gradient)``
        pairs, as :meth:`step` runs it after finding the gradients: state allocated
        first, then the one-pass update reading each gradient as it is (e.g. a bf16 one
        for a float32 parameter, as a pipe's landed gradient).  No pipe, no closure, no
        other group.  A documented internal entry point: bench/optimizer.py times the
        update kernels with it (docs/guide.md, "Seams for integrations")."""
        groups = self.param_groups  # type: ignore[attr-defined]
        self._check_group(groups[group])
        self._step_work(groups, [list(pairs) if k == group else []
                                 for k in range(len(groups))], {})

    def _step_work(self, groups: list[dict[str, Any]],
                   work: list[list[tuple[torch.Tensor, torch.Tensor]]],
                   scales: dict[int, tuple[torch.Tensor, ...]],
                   before_update: Callable[[], None] | None = None,
                   schedule: UnitSchedule | None = None,
                   on_prepared: Callable[[], None] | None = None) -> None:
        # Every buffer is allocated before anything is written: running out of host
        # memory in a later group must not leave earlier groups stepped.
        known = {id(p) for p in self.state}  # type: ignore[attr-defined]
        created = self._allocate_state(list(zip(groups, work)))
        try:  # torch's step on the other parameters (it allocates their state too)
            if before_update is not None:
                before_update()
            if on_prepared is not None:
                on_prepared()
        except BaseException:
            # none of this class's parameters was written: the next step starts the
            # buffers made here afresh (SGD's first step copies the gradient)
            self._drop_state(created, known)
            raise
        self._fresh = frozenset((id(p), key) for p, key in created)
        self._scales = scales
        try:
            if schedule is None:
                for g, pairs in zip(groups, work):
                    if pairs:
                        self._update_and_mark(g, pairs)
                return
            # Unit by unit, in the order the next call uploads them; what is no master
            # of the schedule's pipe first.  Each element is updated by the same
            # elementwise kernel as in one pass, so the result is bitwise the same.
            index, n = schedule.index(), len(schedule.units)
            split: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = [
                [[] for _ in work] for _ in range(n + 1)]
            for gi, pairs in enumerate(work):
                for p, grad in pairs:
                    owner = tier_owner_of(p)
                    k = (index.get(owner[1], n) if owner is not None
                         and owner[0] is schedule.landed else n)
                    split[k][gi].append((p, grad))
            for g, pairs in zip(groups, split[n]):
                if pairs:
                    self._update_and_mark(g, pairs)
            for k in range(n):
                schedule.before_unit(k)
                for g, pairs in zip(groups, split[k]):
                    if pairs:
                        self._update_and_mark(g, pairs)
                schedule.after_unit(k)
        finally:
            self._scales, self._fresh = {}, frozenset()

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state tensors (each shaped as its parameter) a step of ``group`` keeps."""
        raise NotImplementedError

    def _allocate_state(self, work: list[tuple[dict[str, Any],
                                                list[tuple[torch.Tensor, torch.Tensor]]]]
                        ) -> list[tuple[torch.Tensor, str]]:
        """Allocate every state tensor this step needs that does not exist yet (and the
        conversion buffers), and return the ``(param, key)`` of those created.  If an
        allocation fails, the ones made are dropped again and the optimizer is as before."""
        created: list[tuple[torch.Tensor, str]] = []
        known = {id(p) for p in self.state}  # type: ignore[attr-defined]
        try:
            for group, pairs in work:
                keys = self._state_keys(group)
                for p, _ in (pairs if keys else ()):  # no empty entries (as torch)
                    state = self.state[p]  # type: ignore[attr-defined]
                    for key in keys:
                        if state.get(key) is None:
                            state[key] = self._moment(p, key, group)
                            created.append((p, key))
            # Conversion buffers for what torch's fused kernels will update: everything
            # without the native loop, else the parameters it does not take (not float32).
            fused_all = self.kernel == "fused" or native.library() is None
            n_slots = 1 + max((len(self._state_keys(g)) for g, pairs in work if pairs),
                              default=0)
            # (Stochastically rounded groups convert nothing through scratch.)
            for dtype in {p.dtype for g, pairs in work for p, _ in pairs
                          if (fused_all or p.dtype != torch.float32)
                          and not g.get("stochastic_rounding")}:
                for slot in range(n_slots):
                    self._scratch().get(slot, dtype, kernels.CHUNK)
        except BaseException as e:
            self._drop_state(created, known)
            if isinstance(e, MemoryError) or (isinstance(e, RuntimeError)
                                              and "alloc" in str(e).lower()):
                raise self._out_of_memory(work, e) from e
            raise
        return created

    def _drop_state(self, created: list[tuple[torch.Tensor, str]], known: set[int]) -> None:
        """Drop the state ``_allocate_state`` made, and the entries it left empty."""
        for p, key in created:
            self.state[p].pop(key, None)  # type: ignore[attr-defined]
        for p in [p for p, state in self.state.items()  # type: ignore[attr-defined]
                  if id(p) not in known and not state]:
            del self.state[p]  # type: ignore[attr-defined]

    def _out_of_memory(self, work: list[tuple[dict[str, Any],
                                               list[tuple[torch.Tensor, torch.Tensor]]]],
                       error: BaseException) -> HostOutOfMemoryError:
        needed = count = 0
        for group, pairs in work:
            keys = self._state_keys(group)
            for p, _ in pairs:
                state = self.state.get(p, {})  # type: ignore[attr-defined]
                missing = sum(state.get(k) is None for k in keys)
                if missing:
                    count += p.numel()
                    needed += missing * p.numel() * (self.state_dtype or p.dtype).itemsize
        dtype = str(self.state_dtype or "the parameters' dtype").replace("torch.", "")
        advice = ([] if self.state_dtype is not None else
                  ["state_dtype=torch.bfloat16 (half the bytes)"]) + [
            "RoundPipe(..., landing_buffers=1) (fewer gradient buffers)",
            "train fewer parameters (LoRA) or with SGD"]
        return HostOutOfMemoryError(
            f"{type(self).__name__} could not allocate its state on the host: "
            f"{needed / 2**30:.2f} GiB of {dtype} for {count:,} parameters "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
            f"Nothing was updated and no state was kept. pipe.host_memory() shows what the "
            f"host holds; to need less: {'; '.join(advice)}")

    def _scale_of(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The factors ``p``'s gradient (held where it landed) is multiplied by."""
        return self.__dict__.get("_scales", {}).get(id(p), ())

    def _torch_step_without(self, mine: list[list[torch.Tensor]]) -> None:
        """Torch's own step on every parameter this class does not handle."""
        groups = self.param_groups  # type: ignore[attr-defined]
        kept = [g["params"] for g in groups]
        rest = [[p for p in g["params"] if not any(p is q for q in m)]
                for g, m in zip(groups, mine)]
        if not any(p.grad is not None for r in rest for p in r):
            return
        try:
            for g, r in zip(groups, rest):
                g["params"] = r
            with torch.enable_grad():  # torch's step sets the grad mode it wants
                _unwrapped_step(self._torch_base)(self)
        finally:
            for g, k in zip(groups, kept):
                g["params"] = k

    def _grad_of(self, p: torch.Tensor, scales: dict[int, tuple[torch.Tensor, ...]]
                  ) -> torch.Tensor | None:
        """The gradient a step reads: held where it landed (a master's, in the model's
        dtype; its factors go to ``scales``) or ``.grad``.  It stays held, as a ``.grad``
        would, until zero_grad."""
        owner = owner_of(p)
        buffer, factors = (owner[0].peek_with_factors(owner[1]) if owner is not None
                           else (None, ()))
        if buffer is not None and factors:
            scales[id(p)] = factors
        grad = buffer if buffer is not None else raw_grad(p)
        if grad is not None and (grad.is_sparse or grad.shape != p.shape):
            raise OptimizerError(f"{type(self).__name__} got a gradient of shape "
                                 f"{tuple(grad.shape)} (sparse={grad.is_sparse}) for a "
                                 f"parameter of shape {tuple(p.shape)}")
        return grad

    def _update_and_mark(self, group: dict[str, Any],
                         pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`_update_group`, then each parameter's version counter bumped as an
        in-place write bumps it (the native loop writes through pointers): a failed
        pipe step restores exactly the masters some update wrote."""
        self._update_group(group, pairs)
        for p, _ in pairs:
            torch.autograd.graph.increment_version(p)

    def _update_group(self, group: dict[str, Any],
                      pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Update every ``(parameter, gradient)`` of ``group`` (kernels.run_chunked)."""
        raise NotImplementedError

    def _split_native(self, items: list[kernels.Item]) -> tuple[
            Any, list[tuple[kernels.Item, native.Work]], list[kernels.Item]]:
        """The native library and the items it takes (with their operands), and the rest
        (for torch's fused kernels)."""
        lib = None if self.kernel == "fused" else native.library()
        if lib is None:
            return None, [], list(items)
        mine, rest = [], []
        for item in items:
            if native.accepts(item.param, item.grad, item.states, len(item.scale)):
                scale = [float(f) for f in item.scale] + [1.0] * (2 - len(item.scale))
                mine.append((item, native.Work(item.param.detach(), item.grad.detach(),
                                               [s.detach() for s in item.states],
                                               (scale[0], scale[1]))))
            else:
                rest.append(item)
        return lib, mine, rest

    def _scratch(self) -> kernels.Scratch:
        scratch = self.__dict__.get("_scratch_buffers")
        if scratch is None:
            scratch = self.__dict__["_scratch_buffers"] = kernels.Scratch()
        return scratch

    def _check_group(self, group: dict[str, Any]) -> None:
        """Hyperparameters checked before anything is written (a raising step changes
        nothing)."""
        lr = float(group["lr"])
        if not math.isfinite(lr) or lr < 0:
            raise OptimizerError(f"lr must be a finite number >= 0, got {group['lr']!r}")
        if group.get("differentiable") or group.get("capturable"):
            raise OptimizerError("differentiable=True and capturable=True are not supported "
                                 "by roundpipe.optim's kernels (host tensors updated outside "
                                 "autograd and CUDA graphs); use torch.optim for them")
        self._check_stochastic_rounding(group)  # parameters may have changed dtype since

    def _is_fresh(self, p: torch.Tensor, key: str) -> bool:
        """Whether ``p``'s state ``key`` was created by the step in progress."""
        return (id(p), key) in self.__dict__.get("_fresh", ())

    def _moment_dtype(self, p: torch.Tensor, group: dict[str, Any]) -> torch.dtype:
        if group.get("stochastic_rounding") and self.__dict__.get(
                "_state_dtype_given") == torch.float32:
            return torch.float32
        return self.state_dtype or p.dtype

    def _moment(self, p: torch.Tensor, key: str | None = None,
                group: dict[str, Any] | None = None) -> torch.Tensor:
        dtype = self._moment_dtype(p, group or {})
        owner = tier_owner_of(p)
        store = owner[0].offload if owner is not None else None
        if store is None or key is None:
            return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        # The disk tier: the moment starts as zeros in its file, staged when its unit
        # is updated (its memory is never touched here).
        t = torch.empty_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        store.register(f"state/{owner[1]}/{key}", t, group=owner[1], zeros=True)
        return t

    def _stochastic_items(self, group: dict[str, Any], items: list[kernels.Item],
                          maximize: bool) -> list[stochastic.Item]:
        """``items`` (of a stochastically rounded group) with their step counts and their
        places in the parameter order (which key the random bits)."""
        index = {id(p): i for i, p in enumerate(
            p for g in self.param_groups for p in g["params"])}  # type: ignore[attr-defined]
        out = []
        for item in items:
            # At most two factors (clipping, unscaling), and only a master's landed
            # gradient has any: these parameters are never masters.
            scale = [float(f) for f in item.scale] + [1.0] * (2 - len(item.scale))
            if maximize:
                scale[0] = -scale[0]
            step = item.step if item.step is not None else advance_step(
                self.state[item.param])  # type: ignore[attr-defined]
            out.append(stochastic.Item(item.param.detach(), item.grad.detach(),
                                       [s.detach() for s in item.states], int(step.item()),
                                       index[id(item.param)], (scale[0], scale[1])))
        return out

    def _run_stochastic(self, items: list[stochastic.Item],
                        native_fn: Callable[..., None], torch_fn: Callable[..., None],
                        **kwargs: Any) -> None:
        """Update ``items`` with the native kernels where they take them, else in torch
        operations (bit for bit the same), then mark the parameters written."""
        lib = None if self.kernel == "fused" else native.library()
        mine = [i for i in items if lib is not None and native.accepts_sr(
            i.param, i.grad, i.states, 2)]
        rest = [i for i in items if not any(i is m for m in mine)]
        if mine:
            native_fn(lib, mine, **kwargs)
        if rest:
            torch_fn(rest, chunk=stochastic.CHUNK, **kwargs)
        for item in items:  # as torch's in-place step would (autograd's saved tensors)
            torch.autograd.graph.increment_version(item.param)

    def zero_grad(self, set_to_none: bool = True,
                  groups: list[dict[str, Any]] | None = None) -> None:
        """As torch's; for a pipe's masters it also drops gradients still held where they
        landed, after any step in progress (so no step loses the gradient it reads).
        ``groups``: those (e.g. :meth:`frozen_groups`) instead of ``param_groups``."""
        def zero() -> None:
            for group in (self.param_groups if groups is None  # type: ignore[attr-defined]
                          else groups):
                for p in group["params"]:
                    owner = owner_of(p)
                    held = owner is not None and owner[0].discard(owner[1])
                    grad = raw_grad(p)
                    if grad is None:
                        if held and not set_to_none:  # torch keeps a zero gradient
                            set_raw_grad(p, torch.zeros_like(p))
                        continue
                    if set_to_none:
                        set_raw_grad(p, None)
                    else:
                        if grad.grad_fn is not None:
                            grad.detach_()
                        else:
                            grad.requires_grad_(False)
                        grad.zero_()
        landed = self._landed_bindings()
        if landed and not landed[0].on_step_thread():
            try:
                landed[0].serial(zero)
                return
            except RuntimeError:  # the pipe was closed: no step can be pending
                pass
        zero()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state["state_dtype"] = self.__dict__.get("_state_dtype_given", self.state_dtype)
        state["kernel"] = self.kernel
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        # load_state_dict calls this too, with torch's keys only: keep the setting then.
        state_dtype = state.pop("state_dtype", self.__dict__.get(
            "_state_dtype_given", getattr(self, "state_dtype", None)))
        kernel = state.pop("kernel", getattr(self, "kernel", "auto"))
        super().__setstate__(state)  # type: ignore[misc]
        self._init_one_pass(state_dtype, "auto" if kernel == "native" and
                            native.library() is None else kernel, resume=False)
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                owner = owner_of(p)
                if owner is not None and not any(
                        b[0] is owner[0] and b[1] == owner[1] for b in self._bindings):
                    owner[0].bind(owner[1])
                    owner[0].optimizers.add(self)
                    self._bindings.append(owner)

    def _behind_step(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after the bound pipe's step in flight (on its optimizer thread):
        what reads or replaces the state must not meet a step half-way."""
        landed = self._landed_bindings()
        if landed and not landed[0].on_step_thread():
            try:
                return landed[0].serial(fn)
            except RuntimeError:  # the pipe was closed: no step can be pending
                pass
        return fn()

    def state_dict(self) -> dict[str, Any]:
        """As torch's, after the bound pipe's step in flight; with a pipe's disk tier
        (``offload_dir``) the state tensors of its masters are read from their files
        into new tensors (they are not in memory between steps)."""
        return self._behind_step(self._state_dict_now)

    def _state_dict_now(self) -> dict[str, Any]:
        sd = super().state_dict()  # type: ignore[misc]
        index: dict[int, int] = {}
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                index.setdefault(id(p), len(index))  # torch's numbering
        for p, state in self.state.items():  # type: ignore[attr-defined]
            owner = tier_owner_of(p)
            store = owner[0].offload if owner is not None else None
            if store is None or id(p) not in index:
                continue
            entry = sd["state"][index[id(p)]] = dict(sd["state"][index[id(p)]])
            for key, value in state.items():
                skey = f"state/{owner[1]}/{key}"
                if isinstance(value, torch.Tensor) and store.tensor(skey) is value:
                    entry[key] = store.read(skey)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, after the bound pipe's step in flight (which must not step the
        loaded state)."""
        self._behind_step(lambda: self._load_state_dict_now(state_dict))

    def _load_state_dict_now(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        groups = self.param_groups  # type: ignore[attr-defined]
        for group in groups:  # a state_dict saved without the options: this optimizer's
            for key in SR_OPTIONS:
                if key in self.defaults:  # type: ignore[attr-defined]
                    group.setdefault(key, self.defaults[key])  # type: ignore[attr-defined]
            self._check_stochastic_rounding(group)
        group_of = {id(p): g for g in groups for p in g["params"]}
        # torch casts state to the parameter's dtype; moments kept in state_dtype stay so.
        for p, state in self.state.items():  # type: ignore[attr-defined]
            group = group_of.get(id(p), {})
            if self._handles_in(group, p):
                for key, value in list(state.items()):
                    if key != "step" and isinstance(value, torch.Tensor) and \
                            value.is_floating_point():
                        state[key] = value.to(self._moment_dtype(p, group)).contiguous()
        for landed in self._landed_bindings():  # the disk tier: the loaded state to files
            if landed.absorb is not None:
                landed.absorb(self)


def advance_step(state: dict[str, Any]) -> torch.Tensor:
    """Advance the step count, kept as torch keeps it (a float32 tensor), and return it
    (the fused kernels read it)."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["step"] += 1
    return state["step"]
