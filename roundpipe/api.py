"""The user-facing API: :func:`compile` and :class:`RoundPipe`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import operator
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from .backprop import (GradRequest, attach_backward, recompute_reads,
                       refuse_hooks_split_by_microbatches,
                       refuse_unjoinable_splits)
from .loss import mark_loss_fn_error, returned_loss, sum_losses
from .input_grads import GradRoots, grad_roots, reached_parameters, send_grads
from . import current
from .compiler import PlanOptions, analyze, estimate_again, make_plan
from .config import ResolvedRunConfig, RoundPipeRunConfig
from .dtype_diagnosis import diagnose_dtypes, dtype_mismatch
from .errors import (CheckpointError, ConfigError, GradModeError, InputError,
                     InputGradientError, ModelError, PartitionError,
                     OffloadMismatchError, OptimizerError, ParameterHookError,
                     RoundPipeError, StepError,
                     TraceError, UnknownConfigFieldError, unknown_options_message)
from .merged_outputs import merge_plan, merged_outputs, output_columns, tail_values
from .passes.cost import CostReport, DeviceModel, with_measured_times
from .passes.leaves import resolve_leaf_modules
from .passes.dtype_check import mixed_dtype_op
from .passes.trace import (describe_tensors, refuse_lazy_parameters,
                           refuse_unrunnable_example)
from . import host_step
from .plan import HostStepEstimate, InputSignature, StagePlan
from .program_key import (changed_globals, changed_objects, global_reads, object_attributes,
                          objects_before, same_globals, same_objects)
from .programs import CompiledProgram, plan_key, stage_layout, tracing_autocast
from .runtime.call import autocast_state, memory_budget, microbatch_keys
from .runtime.devices import Device, VirtualCPUDevice, parse_bytes, resolve_devices
from .runtime.pinning import PIN_MODES, pin_host_state, unpin
from .runtime.executor import Executor, RunResult, RunStats
from .runtime.grad_landing import LANDING_BUFFERS, GradLanding
from .runtime.grad_norm import clip_grad_norm_
from .runtime import optimizer_check
from .runtime.masters import raw_grad
from .runtime.host_memory import DeviceCopies, HostMemory, host_memory
from .runtime.offload import OffloadStats, disk_bandwidth
from .runtime.host_state import HostState, ModelState
from .runtime.microbatch import (batch_size_of, check_on_cpu, merged_value, split_inputs,
                                 split_label)
from .runtime.data_parallel import DataParallel, DataParallelConfig, DataParallelInfo
from .runtime.optimizer import OptimizerWorker
from .runtime.landing_step import LandingStep
from .runtime import offload, param_hooks
from .ops.rng import RngKey
from .runtime.signature import flat_leaves, flatten_inputs, leading_size, matches

log = logging.getLogger(__name__)



def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaNs and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.is_sparse or b.is_sparse:
        return False
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() \
        and a.storage_offset() == b.storage_offset() and a.shape == b.shape


_MAX_PROGRAMS = 16  # programs a pipe keeps (shapes, modes, attribute values)
_MAX_SHAPES = 8  # cost reports (with their plans) a program keeps, by microbatch shapes
_PLAIN = (bool, int, float, str, type(None))  # attribute values a program's key holds


def _cost_example(sig: InputSignature, mbs: list[tuple[tuple[Any, ...], dict[str, Any]]]
                  ) -> tuple[tuple, list[Any]]:
    """What a call's costs are estimated on: its largest microbatch (its shapes, and its
    flat inputs).  A microbatch of 1 sample too: the program runs on it, though it was
    traced on the whole batch (export would specialise a batch of 1), whose costs scaled
    to a microbatch overestimate a loss or backward stage's memory by 1.3x (a GPT)."""
    def elements(mb: tuple[tuple[Any, ...], dict[str, Any]]) -> int:
        return sum(t.numel() for t in pytree.tree_leaves(mb) if isinstance(t, torch.Tensor))

    flat = flat_leaves(sig, *max(mbs, key=elements)) or []
    return _shapes("microbatch", flat), flat


def _covering(estimated: Iterable[tuple], shapes: tuple) -> tuple | None:
    """The smallest estimated microbatch shapes that dominate ``shapes`` (same ranks,
    every dimension at least as large) with at most twice its input elements, if any.
    A program's intermediates are sized by products of its input dimensions (attention's
    scores quadratic in the sequence length too), so a dominating shape's costs do not
    underestimate this call's; the element ratio only bounds how much they overestimate
    (about 2x in activation-sized terms, up to 4x in a term quadratic in a halved
    dimension)."""
    if shapes[0] != "microbatch":
        return None

    def elements(s: tuple) -> int:
        return sum(math.prod(d) for d in s[1:] if d is not None)

    need, best = elements(shapes), None
    for cand in estimated:
        if cand[0] != "microbatch" or len(cand) != len(shapes) or not all(
                (a is None and b is None) or (a is not None and b is not None
                                              and len(a) == len(b)
                                              and all(x <= y for x, y in zip(a, b)))
                for a, b in zip(shapes[1:], cand[1:])):
            continue
        size = elements(cand)
        if size <= 2 * need and (best is None or size < best[0]):
            best = (size, cand)
    return None if best is None else best[1]


def _shapes(tag: Any, flat: Sequence[Any]) -> tuple:
    return (tag,) + tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None
                          for x in flat)


def _refuse_small_batch(cfg: ResolvedRunConfig, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> None:
    """``forward_backward`` on a batch of fewer samples than ``num_microbatch``: its
    result is defined as eager's loop over ``num_microbatch`` microbatches, so it is not
    run as fewer (``pipe(x)``, whose result is the whole batch's, is)."""
    if cfg.num_microbatch <= 1 or cfg.split_input is not None:
        return
    try:
        batch = batch_size_of(args, kwargs)
    except InputError:
        return  # (split_inputs says why)
    if batch < cfg.num_microbatch:
        raise InputError(
            f"the batch has {batch} samples but num_microbatch={cfg.num_microbatch}: "
            "forward_backward is eager's loop over num_microbatch microbatches of at least "
            "one sample each (its loss is their sum; reduction='mean' divides by "
            "num_microbatch), so a smaller batch is not split into fewer. Nothing was run. "
            "For such a batch (an epoch's last), pass run_config=RoundPipeRunConfig("
            f"num_microbatch={max(batch, 1)}) (one microbatch per sample, as "
            "RoundPipeTrainer does), or drop it")


def _held_state(model: torch.nn.Module) -> tuple[list, list, list]:
    """(tables, names, tensors) of every parameter and buffer of ``model``'s modules: the
    tables are the modules' own ``_parameters``/``_buffers`` dicts, so that a rebinding
    shows as ``table.get(name) is not tensor``."""
    tables: list[dict] = []
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    tables.append(table)
                    names.append(name)
                    tensors.append(t)
    return tables, names, tensors


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _requires_grad(held: tuple[list, list, list] | None) -> bytes:
    """The ``requires_grad`` of every parameter and buffer (``_held_state``): part of a
    program's key, since the model's code may branch on it (``if h.requires_grad``) and
    the program holds the side it took; a parameter frozen or unfrozen between calls
    (``requires_grad_(False)``) traces again, once per set of flags (about 40 ns a
    tensor)."""
    return b"" if held is None else bytes(map(_REQUIRES_GRAD, held[2]))


def _input_layout(mb: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[tuple[bool, bool], ...]:
    """``requires_grad`` and ``is_contiguous()`` of each tensor of a microbatch's inputs:
    part of a program's key beside the dtypes and shapes (``matches``), as the model's
    code may branch on either (``if x.requires_grad``, ``if x.is_contiguous()``)."""
    return tuple((t.requires_grad, t.is_contiguous()) for t in pytree.tree_leaves(mb)
                 if isinstance(t, torch.Tensor))


def _same_attributes(attributes: tuple[tuple[torch.nn.Module, str, Any], ...]) -> bool:
    """Whether the plain attributes a program read while traced still hold its values."""
    return all(_same_value(getattr(m, name, None), value) for m, name, value in attributes)


def _same_value(now: Any, value: Any) -> bool:
    return type(now) is type(value) and (now == value or (now != now and value != value))


def _changed_attributes(model: torch.nn.Module,
                        attributes: tuple[tuple[torch.nn.Module, str, Any], ...],
                        tensors: tuple[tuple[torch.nn.Module, str, torch.Tensor, Any], ...]
                        ) -> Iterator[tuple[str, bool]]:
    """What changed, and whether it is a tensor."""
    paths = {id(m): p for p, m in model.named_modules()}

    def where(m: torch.nn.Module, name: str) -> str:
        path = paths.get(id(m), "?")
        return f"{path + '.' if path else ''}{name}"

    for m, name, value in attributes:
        now = getattr(m, name, None)
        if not _same_value(now, value):
            yield f"{where(m, name)} ({value!r} -> {now!r})", False
    for m, name, tensor, version in tensors:
        if m.__dict__.get(name) is not tensor:
            yield f"{where(m, name)} (rebound to another tensor)", True
        elif version is not None and tensor._version != version:
            yield f"{where(m, name)} (a tensor, written in place)", True


# A plain tensor attribute (in a module's __dict__: not a parameter or buffer) the traced
# code read is a constant of the program: a constant slot uploaded at every call, or
# values Python read while tracing (self.t.tolist(), a branch on self.t.sum()) baked into
# the graph, which no later upload can change.  So the program is keyed on the object and
# on its version counter, taken after tracing (a forward that builds its cache while
# traced keeps that object: the program never runs the forward's Python again), and a
# rebinding or an in-place write traces again, as a changed plain value does.  Refreshing
# the slot with the new tensor instead would save the trace but is exact only where no
# value was baked, which nothing here can tell.  A tensor sharing memory with a parameter
# or buffer (a view of one, an alias such as transformers' original_inv_freq) is keyed on
# identity alone: optimizer steps and buffer writes move its version at every call (an
# inference tensor has no version to key on either).
_TensorKey = tuple  # (module, attribute, the object it held, its version or None)


def _tensor_attributes(reads: Iterable[tuple[torch.nn.Module, str]], model: torch.nn.Module
                       ) -> tuple[_TensorKey, ...]:
    keyed = [(m, name) for m, name in reads if isinstance(m.__dict__.get(name), torch.Tensor)
             and not isinstance(m.__dict__[name], torch.nn.Parameter)]
    if not keyed:
        return ()
    state = _state_storages(model)
    return tuple(_tensor_key(m, name, state) for m, name in keyed)


def _state_storages(model: torch.nn.Module) -> set[int]:
    return {_storage(t) for t in itertools.chain(model.parameters(), model.buffers())}


def _tensor_key(m: torch.nn.Module, name: str, state: set[int]) -> _TensorKey:
    value = m.__dict__.get(name)
    shared = not isinstance(value, torch.Tensor) or _storage(value) in state
    return m, name, value, None if shared else _tensor_version(value)


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr() or -id(tensor)  # (empty: no memory)
    except (RuntimeError, NotImplementedError):  # a fake or meta tensor
        return -id(tensor)


def _same_tensors(tensors: tuple[_TensorKey, ...]) -> bool:
    """Whether the tensor attributes a program read are the same objects, unwritten."""
    for m, name, tensor, version in tensors:
        if m.__dict__.get(name) is not tensor or (
                version is not None and tensor._version != version):
            return False
    return True


def _refresh_tensor_keys(programs: list[CompiledProgram], current: dict[tuple[int, int], bool],
                         model: torch.nn.Module) -> None:
    """After a trace: the tensor attributes that ``current`` says were up to date for a
    program before it and are not now were changed by the trace itself.  Tracing runs the
    model's forward for real (before the torch.fx fallback, to record opaque modules):
    the attributes it builds are bound again (each program holds the value its own
    forward built, which eager builds at every call), and the tensors it writes are put
    back with ``copy_`` (a new version, the same values).  Without this, programs of two
    shapes or grad modes would trace again in turn."""
    state: set[int] | None = None
    for e in programs:
        if not e.tensors or _same_tensors(e.tensors):
            continue
        if state is None:
            state = _state_storages(model)
        e.tensors = tuple(_tensor_key(k[0], k[1], state)
                          if current[(id(e), i)] and not _same_tensors((k,)) else k
                          for i, k in enumerate(e.tensors))


def _tensor_version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


class RoundPipe:
    """Train or run ``model`` with dispatch pipeline parallelism.

    All model state stays in host memory; every device is a stateless worker to which
    stage weights are streamed round-robin.  Compilation happens on the first call (or
    eagerly through :func:`compile`).

    Args:
        model: any ``nn.Module`` with its parameters on the CPU.
        optim_dtype: dtype of the master weights the optimizer updates (e.g.
            ``torch.float32`` for a bf16 model).  ``None``: the optimizer updates the model
            parameters themselves.
        model_run_config: defaults for every call (see :class:`RoundPipeRunConfig`).
        devices: ``None`` (every visible CUDA device, else one CPU device; the environment
            variable ``ROUNDPIPE_DEVICES=cpu,cpu`` overrides), or a list such as
            ``["cpu"] * 4`` (virtual CPU devices) or ``["cuda:0", "cuda:1"]``.  A GPU
            named twice (``["cuda:0"] * 2``) gives two logical devices on it, each with its
            own threads and streams and half its free memory: the multi-device schedule
            on one GPU, for testing (no faster than one device).
        memory_cap: bytes the plan may use on a device: a job at its peak together with
            the weights prefetched for the next job (``StagePlan.device_memory_bytes``
            stays within it).  Default: ``memory_fraction`` of the smallest device's free
            memory, measured once; unlimited for virtual CPU devices without a capacity.
        device_memory: capacity of each virtual CPU device (e.g. ``"64MiB"``; default
            ``ROUNDPIPE_VIRTUAL_MEMORY``, else unlimited).  Uploads beyond it raise
            :class:`~roundpipe.OutOfMemoryError`, as a GPU would.
        pin_memory: how host state is made copyable at full speed on CUDA: ``"alloc"``
            (copy into page-locked memory; the CUDA host allocator may round sizes up),
            ``"register"`` (page-lock the existing memory in place) or ``"off"``.  No effect
            without CUDA devices.
        num_stages: exact number of stages (default: devices + 1, more if memory demands).
        seed: base seed of the keyed dropout streams (default ``torch.initial_seed()``).
        leaf_modules: submodules (paths such as ``"model.layers.0.mlp"``, or classes) that
            tracing keeps opaque: they run as plain Python, with their state still streamed.
            Use it for code ``torch.export`` cannot trace; roundpipe also does this by
            itself for the class of a module that export fails inside.
        data_parallel: train as one replica of several processes (one per machine,
            ``torchrun``), each given its shard of the batch; gradients are all-reduced
            across them before they are committed (``docs/scaling.md``).  ``None``: on
            when a ``torch.distributed`` process group of more than one rank is
            initialised; ``True`` or a :class:`~roundpipe.DataParallelConfig`: on (the
            group is initialised from ``torchrun``'s variables if needed); ``False``: off.
        share_blocks: trace each distinct repeated block once and copy its graph into the
            others, which makes compiling a deep model several times faster.  Blocks of one
            class with equal attributes and parameter layouts are taken to compute the
            same; pass ``False`` for a model whose blocks branch on something else (module
            identity, global state), so that every block is traced on its own.
        compile_units: run each layer unit's program through ``torch.compile`` (``True``:
            the default backend, inductor; a string: that backend), so a unit launches a
            few fused kernels instead of one per op: for GPUs the host cannot keep busy
            with small microbatches.  Keyed random ops (dropout) run uncompiled between
            a unit's compiled pieces, with the same masks.  Each unit compiles on its
            first call on each device.
        landing_buffers: with a ``roundpipe.optim`` optimizer a gradient stays in the
            buffer it was downloaded into until ``zero_grad()``.  When the next call's
            gradient lands while the asynchronous step still reads the last one, ``2``
            lands it into a second buffer (kept for later calls: one more set of
            gradients in the model's dtype, 2 bytes per bf16 parameter), ``1`` makes
            that download wait for the step (the device waits too, so the step's tail
            no longer overlaps the backward).  ``"auto"`` (default): 2 while the host
            keeps 10% of its memory available after the allocation, else 1.
        measure_memory: measure the tensors each device holds during a call:
            ``pipe.stats().stage_peak_bytes`` per stage, and
            ``DeviceCounters.peak_allocated_bytes`` on virtual CPU devices (CUDA devices
            always report their allocator's peak).  It watches every op on the devices'
            threads, which slows small ops (see ``docs/architecture.md``).  Default:
            ``ROUNDPIPE_MEASURE_MEMORY=1`` in the environment, else off.
        predict_weights: with ``step(fn, is_async=True)`` and ``optim_dtype``, the call
            that overlaps step ``k`` computes with the prediction
            ``W_{k-1} + (W_{k-1} - W_{k-2})`` of the step's result instead of the stale
            ``W_{k-1}`` (the masters and the
            optimizer state stay exact; one more host copy of the masters, counted in
            ``host_memory().prediction``).  Default ``True``; ``False``: the plain
            one-step-stale schedule.  No effect on exact steps.
        async_after: run the first ``async_after`` steps exact even when asked for
            ``is_async=True`` (an exact warm start, where the weights move fastest),
            then asynchronous ones; the last exact step keeps its masters, so the first
            asynchronous one already predicts.  Default 0.
        offload_dir: the disk tier: the masters (``optim_dtype``) and the state of a bound
            ``roundpipe.optim`` optimizer live in files under this directory (created;
            a run's state there is refused unless ``offload_resume``), and host memory
            keeps the model's weights plus the few layer units a step is updating.
            Each step reads and
            writes them unit by unit and commits the files atomically, so a crash
            leaves the last whole step readable (``docs/guide.md``, "The disk tier").
            With ``optim_dtype`` the masters and their optimizer state are there
            (asynchronous steps then run without weight prediction); without it
            (bfloat16 training with ``stochastic_rounding=True``) the optimizer state
            only, the weights staying in host memory.
        offload_resume: what to do with an ``offload_dir`` that holds a run's committed
            state.  ``False`` (default): refuse it (:class:`OffloadError`), never
            overwrite it.  ``True``: continue that run (it must hold one): the masters,
            the optimizer state and the dropout streams' counters come from the files,
            the model's trainable weights are published from the masters, and the
            directory must belong to this model (names, shapes, dtypes, which are
            trainable, the values of frozen parameters and buffers) and to the
            ``roundpipe.optim`` optimizer(s) then made over ``pipe.optim_parameters()``
            (class, state dtype, hyperparameters but the learning rate), else
            :class:`OffloadMismatchError`.  ``"auto"``: resume when the directory holds
            state, start afresh when it holds none.

    A model with a ``config.use_cache`` flag (Hugging Face models) gets ``use_cache =
    False``: key/value caches serve generation and only cost memory in training.
    Attributes roundpipe does not define are looked up on the model (``pipe.config``,
    ``pipe.save_pretrained(...)``).  The model's methods first synchronize, so they see
    every step taken (and the next call uses those weights too, as after
    :meth:`synchronize`); ``train``, ``eval`` and ``requires_grad_`` only wait for a
    pending step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        optim_dtype: torch.dtype | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        devices: Sequence[str | torch.device] | None = None,
        memory_cap: int | str | None = None,
        device_memory: int | str | None = None,
        pin_memory: str = "alloc",
        num_stages: int | None = None,
        seed: int | None = None,
        device_model: DeviceModel | None = None,
        leaf_modules: Sequence[str | type] | None = None,
        data_parallel: bool | DataParallelConfig | None = None,
        share_blocks: bool = True,
        compile_units: bool | str = False,
        landing_buffers: int | str = "auto",
        measure_memory: bool | None = None,
        predict_weights: bool = True,
        async_after: int = 0,
        offload_dir: str | os.PathLike[str] | None = None,
        offload_resume: bool | str = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise UnknownConfigFieldError(unknown_options_message(
                "RoundPipe", unknown, inspect.signature(RoundPipe.__init__).parameters))
        if not isinstance(model, torch.nn.Module):
            raise ModelError(f"RoundPipe wraps an nn.Module, got {type(model).__name__}")
        refuse_lazy_parameters(model)  # (masters, host state need their shapes)
        off_cpu = [(n, t.device) for n, t in list(model.named_parameters())
                   + list(model.named_buffers()) if t.device.type != "cpu"]
        if off_cpu:
            name, dev = off_cpu[0]
            raise ModelError(
                f"{len(off_cpu)} parameter(s)/buffer(s) are not on the CPU (first: {name} on "
                f"{dev}); roundpipe keeps the model in host memory and streams it to the "
                "devices: build or move the model to the CPU (model.cpu()) first")
        if model_run_config is not None and not isinstance(model_run_config,
                                                           RoundPipeRunConfig):
            raise ConfigError("model_run_config must be a RoundPipeRunConfig, got "
                              f"{type(model_run_config).__name__}")
        if optim_dtype is not None and not (isinstance(optim_dtype, torch.dtype)
                                            and optim_dtype.is_floating_point):
            raise ConfigError(f"optim_dtype must be a floating torch.dtype or None, got "
                              f"{optim_dtype!r}")
        self.leaf_modules = resolve_leaf_modules(model, leaf_modules or ())
        if not isinstance(share_blocks, bool):
            raise ConfigError(f"share_blocks must be True or False, got {share_blocks!r}")
        self.share_blocks = share_blocks
        self.compile_units = _unit_backend(compile_units)
        self._found_leaves: tuple[str, ...] = ()  # leaves the last trace had to add
        self._cache_configs = _disable_cache(model)
        object.__setattr__(self, "model", model)
        self.model_run_config = model_run_config or RoundPipeRunConfig()
        if measure_memory is not None and not isinstance(measure_memory, bool):
            raise ConfigError(f"measure_memory must be True, False or None, got "
                              f"{measure_memory!r}")
        self.devices: list[Device] = resolve_devices(devices, device_memory, measure_memory)
        self.memory_cap = parse_bytes(memory_cap)
        if pin_memory not in PIN_MODES:
            raise ConfigError(f"pin_memory must be one of {PIN_MODES}, got {pin_memory!r}")
        self.pin_memory = pin_memory
        if landing_buffers not in LANDING_BUFFERS or isinstance(landing_buffers, bool):
            raise ConfigError(f"landing_buffers must be one of {LANDING_BUFFERS}, got "
                              f"{landing_buffers!r}")
        self.num_stages = num_stages
        self.seed = torch.initial_seed() if seed is None else int(seed)
        if not isinstance(predict_weights, bool):
            raise ConfigError(f"predict_weights must be True or False, got "
                              f"{predict_weights!r}")
        if isinstance(async_after, bool) or not isinstance(async_after, int) \
                or async_after < 0:
            raise ConfigError(f"async_after must be an int >= 0 (the number of exact "
                              f"steps before asynchronous ones), got {async_after!r}")
        self.predict_weights = predict_weights
        self.async_after = async_after
        self._steps = 0  # steps taken (async_after counts them; saved in checkpoints)
        # Masters that existed at the first pipe.step(opt), and the optimizers stepped
        # since: a master made later (a parameter unfrozen) is in no optimizer built before.
        self._first_masters: frozenset[str] | None = None
        self._step_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._dp = DataParallel.create(data_parallel)
        if self._dp is not None:  # replicas start from rank 0's weights and dropout seed
            self.seed = self._dp.broadcast_initial_state(model, self.seed)
        self.device_model = device_model or DeviceModel.for_device(self.devices[0].torch_device)
        if offload_dir is not None:
            if not isinstance(offload_dir, (str, os.PathLike)):
                raise ConfigError(f"offload_dir must be a directory path, got "
                                  f"{offload_dir!r}")
            if optim_dtype is None and offload_resume == "auto" and not os.path.exists(
                    os.path.join(offload_dir, offload.MANIFEST)):
                offload_resume = False  # nothing to resume: "auto" starts afresh
            if optim_dtype is None and offload_resume:
                raise ConfigError(
                    "offload_resume continues a run from offload_dir, but without "
                    "optim_dtype (stochastic rounding) the files hold only the optimizer "
                    "state: the weights it was computed with lived in host memory and are "
                    "gone. Resume such a run from a checkpoint (save_checkpoint / "
                    "load_checkpoint), or train with optim_dtype=torch.float32")
            offload_dir = os.fspath(offload_dir)
        if offload_resume not in (False, True, "auto"):
            raise ConfigError(f"offload_resume must be False, True or 'auto', got "
                              f"{offload_resume!r}")
        if offload_resume and offload_dir is None:
            raise ConfigError("offload_resume resumes the disk tier's directory: pass "
                              "offload_dir too")
        self._state = ModelState(model, optim_dtype, offload_dir, offload_resume)
        if self._state.has_masters:
            optimizer_check.watch_outside_steps(self._state)
        self._optimizer = OptimizerWorker(self._state)
        self._compiled: list[CompiledProgram] = []
        # Gradient download buffers, shared by every program's executor (see Executor).
        self._landing = GradLanding(steps=self._optimizer.pending_steps,
                                    busy=self._state.landed.busy, sets=landing_buffers)
        self._state.landed.serial = self._optimizer.run
        self._state.landed.on_step_thread = lambda: self._optimizer.on_worker
        self._current: CompiledProgram | None = None
        # The model's parameters and buffers as the programs hold them (_check_rebound).
        self._held: tuple[list, list, list] | None = None
        self._calls = 0
        self._loading = 0  # depth of pipe.loading() blocks
        self._stats: RunStats | None = None
        self._lock = threading.RLock()
        self._closed = False
        # default device cap by memory_fraction, with where it came from
        self._caps: dict[float, tuple[int | None, str]] = {}
        self._nonfinite_loss_ok = False  # a GradScaler skips steps with inf/NaN instead
        self._step_hooks: list[Callable[[int], None]] = []  # step(version) being enqueued
        self._sync_hooks: list[Callable[[], None]] = []  # run after synchronize()
        # (graph task, entry, result, hooks) of pipe(x) backwards whose commit waits for
        # the end of their backward pass (hooked parameters with masters: _defer_commit)
        self._deferred: list[tuple[int, Any, RunResult, Any]] = []
        self._pass_task: int | None = None  # the backward pass _end_of_pass is queued for
        if self._state.offload is not None:
            try:
                self._resume_counters(seed)
            except BaseException:
                self.close()
                raise

    # --- compilation ---------------------------------------------------------------------
    def compile(self, example_args: tuple[Any, ...] = (),
                example_kwargs: dict[str, Any] | None = None) -> StagePlan:
        """Compile for inputs like ``example_args``/``example_kwargs`` (a whole batch)."""
        if not isinstance(example_args, tuple):
            example_args = (example_args,)
        cfg = self._config(None)
        with diagnose_dtypes(self.model, example_args, dict(example_kwargs or {}), call=False):
            mbs = split_inputs(example_args, dict(example_kwargs or {}), cfg.num_microbatch,
                               cfg.split_input)
            entry = self._compiled_for(mbs, example_args, dict(example_kwargs or {}), cfg)
        # An input of another dtype than the weights traces fine and fails at the first
        # call: say so now, while the example is at hand.
        traced = entry.analysis.traced
        hint = dtype_mismatch(self.model, example_args, dict(example_kwargs or {}))
        mixed = mixed_dtype_op(traced.graph_module.graph) if traced is not None else None
        if hint is not None and mixed is not None:
            where = mixed.meta.get("roundpipe.module_path")
            raise InputError(f"{hint}; {mixed.target} in "
                             + (f"module {where!r}" if where else "the model")
                             + " would multiply tensors of two dtypes")
        return entry.plan

    @property
    def plan(self) -> StagePlan:
        """The stage plan of the most recent call (or of :meth:`compile`).  Its costs and
        memory figures are of the microbatch shapes it was estimated on: the call's own, or
        estimated shapes that dominate them with at most twice their input elements (see
        ``_use_cap``), whose figures are then an upper bound for the call."""
        if self._current is None:
            raise RoundPipeError(
                "the model has not been compiled yet: call forward()/forward_backward() "
                "once, or use roundpipe.compile(model, example_args=...)")
        entry = self._current
        plan = entry.plan
        if not (any(s.kind == "fused" for s in plan.stages) and self._state.named_masters()):
            return plan
        bound = next(iter(self._state.landed.optimizers), None)
        key = (id(plan), id(bound))
        if entry.shown is None or entry.shown[0] != key:
            entry.shown = (key, dataclasses.replace(
                plan, host_step=self.host_step_estimate(bound)))
        return entry.shown[1]

    def host_step_estimate(self, optimizer: torch.optim.Optimizer | None = None
                           ) -> HostStepEstimate:
        """The host's share of an asynchronous training step (landing, optimizer update,
        publish, with the weight prediction where ``predict_weights``),
        estimated from the bytes it moves per parameter and the host's memory bandwidth
        (measured once per process), beside the plan's device time per step.
        ``optimizer``: the one ``step_fn`` runs (default: a ``roundpipe.optim``
        optimizer bound to this pipe, else torch's AdamW is assumed).  ``pipe.plan``
        shows it in its summary."""
        if self._current is None:
            raise RoundPipeError("the model has not been compiled yet: call "
                                 "forward_backward() once, or roundpipe.compile(...)")
        if optimizer is None:
            optimizer = next(iter(self._state.landed.optimizers), None)
        named = self._state.named_masters()
        params = sum(m.numel() for _, m in named)
        model = self.model.get_parameter(named[0][0]) if named else None
        model_bytes = model.element_size() if model is not None else 4
        master_bytes = (named[0][1].element_size() if named and self._state.has_masters
                        else None)
        store = self._state.offload
        estimate = host_step.estimate(optimizer, params, model_bytes, master_bytes,
                                      self._current.plan.est_step_time_s,
                                      predict=self.predict_weights,
                                      disk_bandwidth=(disk_bandwidth(store.directory)
                                                      if store is not None else None))
        how = (self.step_overlap(optimizer) if optimizer is not None else
               "whole update: torch's AdamW (assumed) steps all its parameters at once")
        stages = self._current.plan.stages
        weights = sum(s.param_bytes for s in stages if s.kind in ("fwd", "fused"))
        share = stages[0].param_bytes / weights if how == "per unit" and weights else 1.0
        return dataclasses.replace(estimate, exact_step=how, exposed_share=share)

    @property
    def plans(self) -> tuple[StagePlan, ...]:
        """Every plan compiled for this model (one per input signature / mode)."""
        return tuple(c.plan for c in self._compiled)

    def _model_key(self) -> tuple[tuple[bool, ...], tuple]:
        """What a program was traced against besides its inputs and the autocast and
        grad modes: every module's training flag, and the module tree (each module's
        identity) with the forward and backward hooks registered on its modules and
        globally.  A submodule replaced (``model.act = nn.ReLU()``) or a hook added or
        removed after a call used to keep the old program silently; a new key traces
        again, as eager would run the new code.  So do each module's class (``m.__class__
        = Other``), its class's ``forward`` and a ``forward`` set on the instance (a
        monkeypatch).  One walk at every call (``modules()`` builds a path per module:
        twice its time on a 1,100-module model); a module without hooks or its own
        ``forward`` adds its id alone."""
        g = torch.nn.modules.module
        key: list[Any] = [tuple(g._global_forward_pre_hooks), tuple(g._global_forward_hooks),
                          tuple(g._global_backward_pre_hooks), tuple(g._global_backward_hooks)]
        training: list[bool] = []
        kinds: list[type] = []
        seen: set[int] = set()
        stack = [self.model]
        pop, push, add, flag, append, kind = (stack.pop, stack.extend, seen.add,
                                              training.append, key.append, kinds.append)
        while stack:  # modules() order
            m = pop()
            i = id(m)
            if i in seen:
                continue
            add(i)
            flag(m.training)
            kind(m.__class__)
            d = m.__dict__  # (Module.__init__ puts these there; attributes cost 2x)
            a, b, c, e = (d["_forward_pre_hooks"], d["_forward_hooks"],
                          d["_backward_pre_hooks"], d["_backward_hooks"])
            append((i, tuple(a), tuple(b), tuple(c), tuple(e), d.get("forward"))
                   if a or b or c or e or "forward" in d else i)
            children = d["_modules"]
            if children:
                push(reversed([x for x in children.values() if x is not None]))
        append(tuple(kinds))
        append(tuple([getattr(k, "forward", None) for k in dict.fromkeys(kinds)]))
        return tuple(training), tuple(key)

    def _check_rebound(self) -> None:
        """Programs hold the model's parameters and buffers by object (their host state,
        and without masters the tensors gradients land in and the optimizer updates), so
        one rebound since (``m.buf = t``, ``m.weight = nn.Parameter(...)``,
        ``load_state_dict(sd, assign=True)``) used to keep the old tensor silently.  One
        pass over them at every call; a change drops the programs (the next traces on
        the model as it is now), or is refused where masters or the disk tier hold the
        old parameter's state (``_take_parameters``)."""
        held = self._held
        if held is None or all(map(operator.is_, map(dict.get, held[0], held[1]), held[2])):
            return
        paths = {id(t): p for p, m in self.model.named_modules()
                 for t in (m._parameters, m._buffers)}
        changed = [f"{paths[id(t)] + '.' if paths.get(id(t)) else ''}{n}"
                   for t, n, v in zip(*held) if t.get(n) is not v]
        self._take_parameters()
        if self._compiled:
            log.warning("roundpipe: %s of %s rebound to another tensor since the call that "
                        "traced it: tracing again (its programs held the old tensor; new "
                        "values written in place, with torch.no_grad(): t.copy_(new), need "
                        "no trace)", ", ".join(changed[:3])
                        + (f" (and {len(changed) - 3} more)" if changed[3:] else ""),
                        type(self.model).__name__)
            self._compiled = []
        self._held = None

    def _take_parameters(self) -> None:
        """Hold the model's parameters as they are now, before a trace: rebound, or a
        submodule replaced (the module key traces again, and gradients used to land in
        the old parameters)."""
        state = self._state
        names = state.rebound()
        if not names:
            return
        if state.has_masters or state.offload is not None:
            why = ("optim_dtype, the optimizer steps masters copied from the old tensor"
                   if state.has_masters else
                   "offload_dir, the disk tier holds the old tensor's optimizer state")
            raise ModelError(
                f"parameter {names[0]!r}{f' (and {len(names) - 1} more)' if names[1:] else ''}"
                f" of {type(self.model).__name__} is not the object this RoundPipe holds "
                "(rebound: m.weight = nn.Parameter(...), load_state_dict(sd, assign=True), "
                "a submodule with parameters replaced; or added or removed since the pipe "
                f"was made); with {why}, which the model as it is now cannot take over "
                "exactly. "
                "Put the original parameter back and load new values with "
                "pipe.load_state_dict(...), or make a new RoundPipe over the model as it "
                "is now")
        state.take_parameters()

    def _compiled_for(self, mbs: list[tuple[tuple[Any, ...], dict[str, Any]]],
                      full_args: tuple[Any, ...], full_kwargs: dict[str, Any],
                      cfg: ResolvedRunConfig, grad: bool = True) -> CompiledProgram:
        self._check_rebound()
        training, modules = self._model_key()
        autocast = self._autocast()
        cap = self._memory_cap(cfg)
        inference = torch.is_inference_mode_enabled()
        flags = _requires_grad(self._held)
        layout = _input_layout(mbs[0])
        for entry in self._compiled:
            if entry.training == training and entry.modules == modules \
                    and entry.autocast == autocast and entry.grad == grad \
                    and entry.flags == flags and entry.layout == layout \
                    and entry.inference in (None, inference) \
                    and _same_attributes(entry.attributes) \
                    and (not entry.tensors or _same_tensors(entry.tensors)) \
                    and (not entry.objects or same_objects(entry.objects)) \
                    and (not entry.globals or same_globals(entry.globals)) and all(
                    matches(entry.plan.program.inputs, a, k) for a, k in mbs):
                self._use_cap(entry, cap, cfg, mbs, full_args, full_kwargs)
                self._current = entry
                return entry
        changed = next((c for e in self._compiled if e.modules == modules
                        for c in _changed_attributes(self.model, e.attributes, e.tensors)),
                       None)
        if changed is None:
            paths = {id(m): p for p, m in self.model.named_modules()}
            changed = next(((c, False) for e in self._compiled if e.modules == modules
                            for c in [*changed_objects(e.objects, paths),
                                      *changed_globals(e.globals)]), None)
        if changed is not None:
            log.warning("roundpipe: %s changed since the call that traced %s: tracing "
                        "again (its value is a constant of the program; a value that "
                        "changes every call is better passed to forward as a tensor%s)",
                        changed[0], type(self.model).__name__,
                        ", or kept in a buffer written in place (register_buffer(name, "
                        "tensor, persistent=False), then .copy_(new)), which every call "
                        "reads" if changed[1] else "")
        # Programs of a module tree or hooks that changed since are not run again (a
        # hook's id never comes back), nor are those of a tensor written in place since
        # (its version counter never goes back): dropped, so that adding hooks or
        # writing a tensor attribute per step does not pile programs up; so is the
        # oldest beyond _MAX_PROGRAMS (attribute values).
        self._compiled = [e for e in self._compiled if e.modules == modules and all(
            v is None or t._version == v for _, _, t, v in e.tensors)]
        self._take_parameters()
        del self._compiled[:max(0, len(self._compiled) + 1 - _MAX_PROGRAMS)]
        current = {(id(e), i): _same_tensors((k,)) for e in self._compiled
                   for i, k in enumerate(e.tensors)}  # (see _refresh_tensor_keys)
        # Trace one microbatch when it has at least 2 samples (a batch of 1 would be
        # specialised by export); otherwise the whole batch, costs scaled per microbatch.
        first_args, first_kwargs = mbs[0]
        per_mb = leading_size(first_args, first_kwargs) >= 2
        example = (first_args, first_kwargs) if per_mb else (full_args, full_kwargs)
        if self._compiled:
            log.info("roundpipe: recompiling %s for a new input signature, mode, module, hook "
                     "or attribute value",
                     type(self.model).__name__)
        # (what the traced forward changes itself is its state: not keyed)
        before, globals_before = objects_before(self.model), global_reads(self.model)
        with tracing_autocast(self.devices[0].torch_device.type, autocast):
            try:
                analysis = analyze(self.model, example[0], example[1],
                                   cost_scale=1.0 if per_mb else 1.0 / cfg.num_microbatch,
                                   device_model=self.device_model,
                                   leaf_modules=self.leaf_modules + self._found_leaves,
                                   share_blocks=self.share_blocks, grad=grad,
                                   inference=inference)
            except TraceError as e:
                if getattr(e, "example_error", None) is None or not per_mb:
                    raise
                # The model cannot run one microbatch: say it of the batch the user passed.
                refuse_unrunnable_example(self.model, full_args, full_kwargs,
                                          rebind_attributes="always")  # (refused anyway)
                raise TraceError(
                    f"{e} (a microbatch of the {len(mbs)} the batch is split into; the "
                    f"whole batch, {describe_tensors(full_args, full_kwargs)}, runs: use "
                    "num_microbatch=1 or a model that runs on fewer samples)") from None
        # A recompile (new shapes, eval mode) goes straight to the leaves this one needed.
        self._found_leaves = analysis.leaves
        plan = make_plan(analysis.program, analysis.units, analysis.report,
                         self._plan_options(cfg, cap), notes=analysis.notes)
        for i, (a, k) in enumerate(mbs):
            if not matches(plan.program.inputs, a, k):
                shapes = [tuple(t.shape) for t in pytree.tree_leaves((a, k))
                          if isinstance(t, torch.Tensor)]
                raise InputError(
                    f"the program traced for this call fixes or bounds some input dimensions "
                    f"(plan.program.inputs.static: {plan.program.inputs.static}: ints are "
                    "fixed, (low, high) are the sizes export's guards allow, None is any); "
                    f"microbatch {i} of {len(mbs)}, with tensor shapes {shapes}, falls outside "
                    "them, and one call runs one program. Use a batch size or num_microbatch "
                    "for which every microbatch has the same shapes (a batch divisible by "
                    "num_microbatch), or make the model's shapes dynamic")
        host = HostState(self._state, plan.program)
        if self.devices[0].kind == "cuda":  # pragma: no cover - GPU
            pin_host_state(self._state, host, self.pin_memory)
        executor = Executor(plan, host, self.devices, self._landing, self.compile_units)
        reads = tuple((self.model.get_submodule(p), name) for p, name in (
            analysis.traced.attribute_reads if analysis.traced is not None else ()))
        attributes = tuple((m, name, value) for m, name, value in (
            (m, name, getattr(m, name, None)) for m, name in reads)
            if type(value) in _PLAIN)  # (an opaque module's recording run may set a tensor)
        entry = CompiledProgram(plan, host, executor, training, analysis, autocast, grad=grad,
                                modules=modules, attributes=attributes)
        # The costs describe the example traced: the first microbatch, or the whole batch
        # (a new call of its shapes and microbatch count would be estimated as it was).
        traced_example = analysis.traced.example_inputs if analysis.traced else ()
        shapes = _shapes("microbatch" if per_mb else ("batch", cfg.num_microbatch),
                         traced_example)
        entry.costs[shapes] = analysis.report
        entry.shapes = shapes
        entry.executors[stage_layout(plan)] = executor
        entry.by_cap[(shapes, cap, cfg.num_microbatch, cfg.recompute_grain)] = (plan, executor)
        self._use_cap(entry, cap, cfg, mbs, full_args, full_kwargs)  # a larger later one
        entry.tensors = _tensor_attributes(reads, self.model)  # (as compiling left them)
        entry.objects = object_attributes(reads, before)
        entry.globals = global_reads(self.model, globals_before)
        _refresh_tensor_keys(self._compiled, current, self.model)
        self._held = _held_state(self.model)  # (as tracing left them)
        entry.flags, entry.layout = _requires_grad(self._held), layout
        entry.inference = inference if analysis.traced is not None \
            and analysis.traced.reads_inference_mode else None
        self._compiled.append(entry)
        self._current = entry
        return entry

    def _plan_options(self, cfg: ResolvedRunConfig, cap: int | None) -> PlanOptions:
        default, origin = self._cap_and_origin(cfg)
        return PlanOptions(num_devices=len(self.devices), num_microbatch=cfg.num_microbatch,
                           device_model=self.device_model, memory_cap=cap,
                           memory_cap_origin=origin if cap == default else "",
                           num_stages=self.num_stages, recompute_grain=cfg.recompute_grain)

    def _memory_cap(self, cfg: ResolvedRunConfig) -> int | None:
        """Device cap (a job and the next job's prefetched weights): explicit, else the
        fraction of the smallest free memory, read once per fraction (free memory drifts
        as allocators cache; a cap that moved every call would re-partition every
        call)."""
        return self._cap_and_origin(cfg)[0]

    def _cap_and_origin(self, cfg: ResolvedRunConfig) -> tuple[int | None, str]:
        if self.memory_cap is not None:
            return self.memory_cap, ""
        if cfg.memory_fraction not in self._caps:
            self._caps[cfg.memory_fraction] = memory_budget(self.devices, cfg.memory_fraction)
        return self._caps[cfg.memory_fraction]

    def _use_cap(self, entry: CompiledProgram, cap: int | None, cfg: ResolvedRunConfig,
                 mbs: list[tuple[tuple[Any, ...], dict[str, Any]]],
                 full_args: tuple[Any, ...], full_kwargs: dict[str, Any]) -> None:
        """Make ``entry.plan`` the plan for this call's microbatch shapes, memory cap,
        microbatch count and recompute grain (``pipe.plan`` is the most recent call's,
        per-call overrides included), partitioning again without tracing where none exists
        yet.  Costs and stage memory are estimated per microbatch shapes: a call whose
        microbatches have other shapes than the example traced (another batch size,
        sequence length or num_microbatch) gets them estimated again on fake tensors of its
        own, instead of a plan whose memory figures, and the cap check, describe another
        call's activations; unless estimated shapes cover it (``_covering``: every
        dimension at least as large, at most twice the input elements), whose plan it
        reuses: an estimate costs 0.3-1.6 s on a small model and 8-30 s on a deep one, and
        a ragged run (padding per batch) would pay it on nearly every call."""
        shapes, example = _cost_example(entry.plan.program.inputs, mbs)
        cover = _covering(entry.costs, shapes) if shapes not in entry.costs else None
        if cover is not None:  # the plan of a shape estimated that covers it
            try:
                return self._select_plan(entry, cover, example, cap, cfg)
            except PartitionError:
                # The cover's activations do not fit the cap; this call's own may (more
                # microbatches is the advice for exactly that): estimated on its own.
                pass
        self._select_plan(entry, shapes, example, cap, cfg)

    def _select_plan(self, entry: CompiledProgram, shapes: tuple, example: list[Any],
                     cap: int | None, cfg: ResolvedRunConfig) -> None:
        """Make the plan of costs ``shapes`` (estimated on ``example`` if not yet) the
        entry's; nothing changes if partitioning under the cap fails."""
        key = (shapes, cap, cfg.num_microbatch, cfg.recompute_grain)
        if entry.shapes == shapes and plan_key(entry.plan, cfg.recompute_grain) == key[1:]:
            return
        if key not in entry.by_cap:
            report = entry.costs.get(shapes)
            if report is None:
                report = self._estimate_again(entry, shapes, example)
            a = entry.analysis
            plan = make_plan(a.program, a.units, report, self._plan_options(cfg, cap),
                             notes=a.notes)
            layout = stage_layout(plan)
            executor = entry.executors.get(layout)
            if executor is None:  # the stage boundaries of no plan before
                executor = entry.executors[layout] = Executor(
                    plan, entry.host, self.devices, self._landing, self.compile_units)
            entry.by_cap[key] = (plan, executor)
        plan, executor = entry.by_cap[key]
        executor.plan = plan  # the same stages; its out-of-memory advice quotes this plan
        entry.plan, entry.executor, entry.shapes = plan, executor, shapes
        entry.costs.move_to_end(shapes)
        entry.analysis = dataclasses.replace(entry.analysis, report=entry.costs[shapes])

    def _estimate_again(self, entry: CompiledProgram, shapes: tuple, example: list[Any]
                        ) -> CostReport:
        """The costs of ``entry``'s program on a microbatch of ``shapes`` (kept for the
        next call of these shapes; the least recently used beyond ``_MAX_SHAPES`` are
        dropped with their plans, and the executors no plan left uses)."""
        started = time.perf_counter()
        with tracing_autocast(self.devices[0].torch_device.type, entry.autocast):
            report = estimate_again(entry.analysis, example, device_model=self.device_model)
        if report is None:  # pragma: no cover - programs of pipes keep their graph
            report = entry.analysis.report
        entry.costs[shapes] = report
        while len(entry.costs) > _MAX_SHAPES:
            old, _ = entry.costs.popitem(last=False)
            entry.by_cap = {k: v for k, v in entry.by_cap.items() if k[0] != old}
            used = {stage_layout(p) for p, _ in entry.by_cap.values()}
            used.add(stage_layout(entry.plan))
            entry.executors = {k: e for k, e in entry.executors.items() if k in used}
        log.info("roundpipe: costs of %s estimated again for microbatch shapes %s in %.3f s",
                 type(self.model).__name__, shapes, time.perf_counter() - started)
        return report

    # --- for GradScaler (a documented internal interface) ---------------------------------
    def attach_step_observer(self, *, on_step_enqueued: Callable[[int], None],
                             on_synchronized: Callable[[], None],
                             nonfinite_loss_ok: bool) -> None:
        """Observe this pipe's steps: ``on_step_enqueued(version)`` as each ``step`` is
        queued, ``on_synchronized()`` after each ``synchronize``.  ``nonfinite_loss_ok``:
        an inf/NaN loss skips its step instead of raising (what a loss scaler needs)."""
        self._nonfinite_loss_ok = nonfinite_loss_ok
        self._step_hooks.append(on_step_enqueued)
        self._sync_hooks.append(on_synchronized)

    @property
    def running_step(self) -> int | None:
        """The version of the step whose ``step_fn`` runs on the calling thread (None on
        any other thread, and outside a step)."""
        return self._optimizer.current_version

    @property
    def call_number(self) -> int:
        """The number of the next call (each ``forward_backward`` and each forward,
        ``pipe(x)``, counts one; the backward of a forward belongs to it): with
        :attr:`seed` it keys every random op of the call (dropout masks), whatever the
        devices.  Setting it back replays a call's masks exactly
        (a finite-difference check, an evaluation that must see the same masks);
        :meth:`state_dict` saves it."""
        return self._calls

    @call_number.setter
    def call_number(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"call_number must be an int >= 0, got {value!r}")
        with self._lock:
            self._optimizer.wait()  # a commit in flight counts its call first
            self._calls = value

    def replan(self, *, use_measured: bool = True, **options: Any) -> StagePlan:
        """Recompute the partition of the current program (no retrace), from the per-unit
        times measured by the last call when ``use_measured``.  ``options`` may set
        ``memory_cap`` and ``num_stages``."""
        entry = self._current
        if entry is None:
            return self.plan  # raises the "not compiled" error
        plan = entry.plan
        report = entry.analysis.report
        if use_measured and self._stats is not None:
            m = max(1, plan.num_microbatch)
            fwd = {u: t / m for u, t in self._stats.unit_fwd_s.items()}
            bwd = {u: max(0.0, t / m - fwd.get(u, 0.0)) for u, t in
                   self._stats.unit_bwd_s.items()}
            report = dataclasses.replace(report,
                                         units=with_measured_times(report.units, fwd, bwd))
        unknown = set(options) - {"memory_cap", "num_stages"}
        if unknown:
            raise ConfigError(f"replan() takes memory_cap and num_stages, not "
                              f"{', '.join(sorted(unknown))}")
        # The options stay in force for later calls and later compiles.
        if "memory_cap" in options:
            self.memory_cap = parse_bytes(options["memory_cap"])
        if "num_stages" in options:
            self.num_stages = options["num_stages"]
        new = make_plan(plan.program, plan.units, report, PlanOptions(
            num_devices=len(self.devices), num_microbatch=plan.num_microbatch,
            device_model=self.device_model,
            memory_cap=self.memory_cap if "memory_cap" in options else plan.memory_cap,
            num_stages=self.num_stages, recompute_grain=plan_key(plan, "stage")[2]),
            notes=plan.notes)
        entry.plan = new
        entry.executor = Executor(new, entry.host, self.devices, self._landing,
                                  self.compile_units)
        entry.by_cap = {(entry.shapes, *plan_key(new, "stage")): (entry.plan, entry.executor)}
        entry.executors = {stage_layout(new): entry.executor}
        return self.plan if self._current is entry else new

    # --- calls ---------------------------------------------------------------------------
    def resolve_run_config(self, run_config: RoundPipeRunConfig | None = None
                           ) -> ResolvedRunConfig:
        """The run configuration a call given ``run_config`` would use: the pipe's
        ``model_run_config`` overridden by ``run_config``, every default filled in (a frozen
        :class:`roundpipe.config.ResolvedRunConfig`).  Nothing runs; for integrations that
        fit a call to the pipe (e.g. a last batch smaller than ``num_microbatch``)."""
        return self.model_run_config.overridden_by(run_config).resolve(len(self.devices))

    _config = resolve_run_config  # the name the calls below use

    def _autocast(self) -> tuple[str, torch.dtype] | None:
        return autocast_state(self.devices)

    def _keys(self, cfg: ResolvedRunConfig) -> list[RngKey | None]:
        # A replica's microbatches are numbered after those of the replicas before it, so
        # its dropout masks are those one process would draw on the whole global batch.
        first = self._dp.rank * cfg.num_microbatch if self._dp is not None else 0
        return microbatch_keys(self.seed, self._calls, cfg.num_microbatch,
                               enabled=cfg.preserve_rng_state, first=first)

    def _check_open(self) -> None:
        if self._closed:
            raise RoundPipeError("this RoundPipe was closed; create a new one")

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 cfg: ResolvedRunConfig, grad: bool = True
                 ) -> tuple[CompiledProgram, list[dict[str, Any]], list[tuple[tuple, dict]]]:
        self._check_open()
        check_on_cpu((args, kwargs), "input")
        mbs = split_inputs(args, kwargs, cfg.num_microbatch, cfg.split_input)
        entry = self._compiled_for(mbs, args, kwargs, cfg, grad)
        flat = [flatten_inputs(entry.plan.program.inputs, a, k) for a, k in mbs]
        return entry, flat, mbs

    def forward_backward(
        self,
        input_args: tuple[Any, ...] | Any = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        run_config: RoundPipeRunConfig | None = None,
        return_outputs: bool = False,
        reduction: str = "sum",
        step: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Forward, loss and backward over all microbatches; gradients accumulate into the
        masters' ``.grad`` (``optim_parameters()``).

        ``step=opt``: this call is a whole training step, exactly ``forward_backward(...)``
        followed by ``pipe.step(opt)`` (weights, masters, optimizer state and losses
        bitwise), but with a ``roundpipe.optim`` optimizer over every master each unit
        is updated and published as soon as its gradients have landed, during the
        backward, and their buffers are reused by the next units: the host holds a
        window of units' gradients, not the whole model's (``docs/guide.md``, "Stepping
        as gradients land").  Where that cannot be exact (``pipe.landing_step(opt)``
        says why) the call runs the plain order, with the reason logged.  Nothing may
        read the gradients between the backward and the step (clipping, a GradScaler),
        and there is no accumulation over calls: the gradients are gone when it returns.

        ``loss_fn(output_mb, label_mb)`` runs on the device right after the last stage.
        Returns the sum of the microbatch losses on the CPU (and the merged outputs when
        ``return_outputs``).  ``reduction="mean"``: each microbatch's loss is divided by
        ``num_microbatch`` before its backward (the gradients of the mean, as gradient
        accumulation takes them) and the mean is returned.  The backward has run when
        this returns: the loss is a plain value, and ``loss.backward()`` says so.

        Data parallel: the inputs are this replica's shard; the returned loss is the one
        the committed (all-reduced) gradient belongs to, unless
        ``DataParallelConfig.global_loss=False``; outputs are this replica's.
        """
        if loss_fn is None or not callable(loss_fn):
            raise ConfigError("forward_backward needs a callable loss_fn(output, label)")
        if reduction not in ("sum", "mean"):
            raise ConfigError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        current.called(self)
        user_loss_fn = loss_fn
        divisor: list[int] = []  # num_microbatch, for reduction="mean"

        def loss_fn(output: Any, label: Any) -> torch.Tensor:  # runs on the devices' threads
            with current.running(self):
                try:
                    loss = user_loss_fn(output, label)
                except Exception as e:  # the user's code, not a stage of the model
                    if not isinstance(e, RoundPipeError):
                        mark_loss_fn_error(e, label_given=label is not None)
                    raise
            if divisor and isinstance(loss, torch.Tensor):
                loss = loss / divisor[0]
            return loss
        if not torch.is_grad_enabled():
            # Eager's loop raises at loss.backward() there; running it anyway trained on
            # a validation batch (gradients accumulated for the next step) with the
            # program traced for no_grad calls (Python branches on grad mode taken for
            # inference).
            mode = ("torch.inference_mode()" if torch.is_inference_mode_enabled()
                    else "torch.no_grad()")
            raise GradModeError(
                f"forward_backward was called under {mode}, where autograd records "
                "nothing and eager's loss.backward() raises; it would have accumulated "
                "gradients from this batch into the next step. For a loss without "
                "gradients (validation), call loss_fn(pipe(x), label) under "
                f"{mode}; to train, call forward_backward outside it")
        if step is not None and not isinstance(step, torch.optim.Optimizer):
            raise ConfigError(f"forward_backward(step=...) takes the optimizer to step, got "
                              f"{type(step).__name__}")
        if not isinstance(input_args, tuple):
            input_args = (input_args,)
        input_kwargs = dict(input_kwargs or {})
        grad_enabled = torch.is_grad_enabled()
        if step is not None:
            self._refuse_unresumed()
            self._refuse_late_masters(step)  # (a landing step never reaches self.step)
        with self._lock, diagnose_dtypes(self.model, input_args, input_kwargs), \
                self._replica_call() as dp_call:
            cfg = self._config(run_config)
            _refuse_small_batch(cfg, input_args, input_kwargs)
            if reduction == "mean":
                divisor.append(cfg.num_microbatch)
            self._optimizer.raise_if_failed()
            self._landing.reset_peak()
            check_on_cpu(label, "label")
            entry, flat, mbs = self._prepare(input_args, input_kwargs, cfg)
            plan = merge_plan(entry, input_args, input_kwargs, mbs, cfg,
                              strict=False) if return_outputs else None
            batch = batch_size_of(input_args, input_kwargs) if cfg.split_input is None else -1
            labels = split_label(label, cfg.num_microbatch, batch, cfg.split_label)
            # what requires grad among the inputs and label gets its gradient, as eager's
            # backward gives it (under no_grad eager records no graph into them)
            roots = grad_roots(flat, labels, (input_args, input_kwargs, label)) \
                if grad_enabled else None
            reached = self._reached_by_inputs(roots)  # refuses what it cannot make exact
            # eager's reference is the per-microbatch loop: one backward per microbatch
            hooks = self._hooks(entry, per_microbatch=True)
            on_grads = dp_call.bind(entry.host, entry.plan.program.units) if dp_call else None
            landing = None
            if step is not None:
                blocker = self._landing_blocker(step, entry, hooks, reached)
                if blocker is None:
                    landing = self._landing_step(step, entry)
                else:
                    self._log_landing_fallback(blocker)
            fence_version = self._state.fences.target if landing is None else landing[1]
            try:
                result = entry.executor.train(
                    flat, labels, loss_fn, grain=cfg.recompute_grain,
                    want_outputs=return_outputs, keys=self._keys(cfg),
                    fence_version=fence_version, autocast=self._autocast(),
                    nonfinite_loss_ok=self._nonfinite_loss_ok,
                    on_grads=landing[0].on_grads if landing else on_grads,
                    keep=tail_values(plan), hooks=hooks,
                    on_losses=landing[0].on_losses if landing else None,
                    admit=landing[0].admit if landing else None,
                    input_grads=bool(roots))
                if landing is not None:
                    # (inside the try: the step waits for the call's end, whatever ends it)
                    landing[0].end(True)
            except BaseException:
                if landing is not None:
                    landing[0].end(False)  # (no-op once it ended)
                    self._landing_failed()
                raise
            loss = sum_losses(result.losses)
            if landing is not None:
                self._commit_landed(landing[0], entry, result)
            else:
                if dp_call is not None:
                    # A failed step here must fail the call on every replica, before any
                    # commits.
                    self._optimizer.wait()
                    loss = dp_call.complete(result, loss)
                self._finish(entry, result, hooks=hooks)
            if dp_call is not None:
                self._sync_replica_buffers(entry)
            if roots:  # once the pipe's own gradients are committed, before any step
                self._send_input_grads(roots, result, reached)
            loss = returned_loss(loss)
            if step is not None and landing is None:
                self.step(step)  # the plain order: forward_backward, then step
            if return_outputs:
                return loss, merged_outputs(entry, result, mbs, cfg, plan)
            return loss

    def _reached_by_inputs(self, roots: GradRoots | None) -> dict[str, str]:
        """The trainable parameters of this pipe's model (or their masters) that the
        graphs of a call's inputs and label reach (name -> the input's name): their
        gradient through the input is added after the call, where the optimizer reads
        it (:meth:`_send_input_grads`).  Refuses, before anything runs, where that
        cannot be exact."""
        if not roots:
            return {}
        targets = {id(p): n for n, p in self.model.named_parameters() if p.requires_grad}
        masters = self._state.masters()
        targets.update({id(m): n for n, m in masters.items()})
        reached = reached_parameters(roots, targets)
        if not reached:
            return {}
        name, who = next(iter(reached.items()))
        if self._dp is not None:
            raise InputGradientError(
                f"the graph of {who} reaches the parameter {name!r} of the model this pipe "
                "runs; with data parallelism the pipe all-reduces that parameter's gradient "
                "across replicas, and the part through the input would be added on this "
                "replica alone (the replicas would step apart). Nothing was run. Compute "
                f"{who} inside the model (its gradient is then all-reduced), or pass it "
                "detached")
        for name, who in reached.items():
            tensors = [self.model.get_parameter(name)] + (
                [masters[name]] if name in masters else [])
            if any(param_hooks.tensor_hooks(t) or param_hooks.post_accumulate_hooks(t)
                   for t in tensors):
                raise InputGradientError(
                    f"the graph of {who} reaches the parameter {name!r}, which has hooks; "
                    "eager's per-microbatch loop runs them on each microbatch's gradient "
                    "summed over both uses, where roundpipe adds the part through the "
                    "input after the call (autograd would run them on it apart). Nothing "
                    f"was run. Compute {who} inside the model, pass it detached, or "
                    "remove the hooks")
        return reached

    def _send_input_grads(self, roots: GradRoots, result: RunResult,
                          reached: dict[str, str]) -> None:
        """Send the call's input and label gradients into the caller's graph: one
        backward on this thread (input_grads.py).  Where that graph reaches this model's
        parameters, autograd accumulates into their ``.grad`` (without masters: what the
        optimizer reads) or, with masters, into the model's parameter, added to the
        master's gradient here (and a master's gradient held where it landed becomes its
        ``.grad`` first, so that autograd adds to it)."""
        state = self._state
        if reached and state.has_masters:
            masters = state.masters()
            self._optimizer.run(lambda: [masters[n].grad for n in reached if n in masters])
        send_grads(roots, result.input_grads, result.label_grads)
        if reached and state.has_masters:
            self._optimizer.run(lambda: state.fold_outside_grads(state.outside_grads()))

    def _refuse_unresumed(self) -> None:
        unresumed = self._state.unresumed()
        if unresumed:
            raise OffloadMismatchError(
                f"offload_dir {self._state.offload.directory!r} holds optimizer state "
                f"that no optimizer of this pipe took ({len(unresumed)} tensors, e.g. "
                f"{unresumed[0]!r}); a step now would drop it. Nothing was run: create "
                "the run's roundpipe.optim optimizer(s) over pipe.optim_parameters() "
                "before stepping")

    def landing_step(self, optimizer: torch.optim.Optimizer) -> str:
        """How ``forward_backward(..., step=optimizer)`` steps: ``"as gradients land"``
        (each unit updated during the backward, a window of units' gradients held) or
        ``"after the call: <why>"`` (the plain order, every gradient held until the
        step).  Before the first call it cannot see the model's units and hooks."""
        blocker = self._landing_blocker(optimizer, self._current, None)
        return "as gradients land" if blocker is None else f"after the call: {blocker}"

    def _landing_blocker(self, optimizer: torch.optim.Optimizer,
                         entry: CompiledProgram | None,
                         hooks: param_hooks.HookPlan | None,
                         reached: dict[str, str] | None = None) -> str | None:
        """Why ``forward_backward(step=optimizer)`` cannot update units as their
        gradients land, exactly (None: it can).  ``reached``: the call's parameters its
        inputs' or label's graphs reach (:meth:`_reached_by_inputs`)."""
        state = self._state
        if self._dp is not None:
            return "data parallel all-reduces each unit's gradients before any step"
        if reached:
            name, who = next(iter(reached.items()))
            return (f"the graph of {who} reaches the parameter {name!r}: that part of its "
                    "gradient is sent into the inputs once the call's backward ended, "
                    "after its unit's update")
        if self._nonfinite_loss_ok:
            return "a GradScaler unscales and checks every gradient before the step"
        if self._optimizer.on_worker:
            return "called from inside a step_fn"
        blocker = self._overlap_blocker(optimizer, record=False)
        if blocker is not None:
            return blocker
        if self._optimizer.pending_steps():
            # a step in flight still reads (and then drops) the last call's gradients
            self._optimizer.wait()
        if state.dirty:
            # an asynchronous step's result is kept from the weights until the next step
            # starts: the plain call computes with the weights from before it
            return ("an asynchronous step's update is not yet in the weights: this call "
                    "computes with the weights from before it, and steps after it")
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, m in state.named_masters() if id(m) not in stepped]
        if missing:
            return (f"the optimizer does not step the master {missing[0]!r}, whose "
                    "gradient would then stay held")
        held = [n for n, m in state.named_masters()
                if raw_grad(m) is not None or state.landed.has_landed(n)]
        if held:
            return (f"{held[0]!r} holds a gradient from an earlier call (accumulation): "
                    "the step needs the sum")
        outside = state.outside_grads()
        if outside:
            return (f"{next(iter(outside))!r} has a gradient from a use outside the pipe, "
                    "added at the step")
        if entry is None:
            return None
        if hooks is not None and hooks.at_commit:
            slot = sorted(hooks.at_commit)[0]
            return (f"parameter hooks on {entry.host.specs[slot].fqn!r} run on its "
                    "gradient summed at the commit")
        program, specs = entry.plan.program, entry.host.specs
        readers = collections.Counter(specs[s].fqn for u in program.units for s in u.state
                                      if entry.host.trainable(s))
        shared = sorted(n for n, c in readers.items() if c > 1)
        if shared:
            return (f"parameter {shared[0]!r} is read by several units (tied or shared): "
                    "its gradient is their sum, final only at the commit")
        return None

    def _log_landing_fallback(self, blocker: str) -> None:
        seen = self.__dict__.setdefault("_landing_reasons", set())
        if blocker not in seen:
            seen.add(blocker)
            log.warning("roundpipe: forward_backward(step=...) steps after the call, with "
                        "every gradient held until then: %s", blocker)

    def _landing_step(self, optimizer: torch.optim.Optimizer, entry: CompiledProgram
                      ) -> tuple[LandingStep, int]:
        """Prepare and enqueue the step of a call that consumes its gradients as they
        land; returns it and the fence version the call's uploads wait for (the one
        before the step's)."""
        groups = optimizer.frozen_groups()  # raises on bad hyperparameters: nothing ran
        if self._optimizer.pending_steps() or self._state.dirty:
            self._optimizer.synchronize()  # an older step first, whole
        program, specs = entry.plan.program, entry.host.specs
        masters = dict(self._state.named_masters())
        units = [{s: specs[s].fqn for s in u.state
                  if entry.host.trainable(s) and specs[s].fqn in masters}
                 for u in program.units]
        publish = [tuple(dict.fromkeys(specs[s].fqn for s in u.state
                                       if specs[s].kind == "parameter"))
                   for u in program.units]
        read = {s for u in program.units for s in u.state}
        loss_only = {s: spec.fqn for s, spec in specs.items()
                     if s not in read and entry.host.trainable(s) and spec.fqn in masters}
        landing = LandingStep(optimizer, groups, masters, units, publish, self._landing,
                              self._state.take_outside_grads, loss_only)
        before = self._state.fences.target
        calls, self._calls = self._calls, self._calls + 1  # as counted when step() runs
        counters = self._counters(steps=self._steps + 1)
        self._calls = calls

        def on_enqueue(version: int) -> None:
            if self._state.offload is not None:
                self._state.step_counters[version] = counters
            for hook in self._step_hooks:
                hook(version)

        self._optimizer.step_landing(landing, on_enqueue=on_enqueue)
        return landing, before

    def _commit_landed(self, landing: LandingStep, entry: CompiledProgram,
                       result: RunResult) -> None:
        """The call of a landing step succeeded: once the step has ended whole, commit
        the call's buffer updates and count the call and the step, on the optimizer
        thread right after the step (an interrupt of the caller cannot part them); a
        failed step commits nothing and raises here (StepError)."""
        def commit() -> None:
            if landing.future is None or landing.future.exception() is not None:
                return  # the step failed: the call changed nothing, or the pipe is mixed
            entry.host.commit({}, result.buffers)
            self._stats = result.stats
            self._calls += 1
            self._steps += 1

        done = self._optimizer.submit(commit)
        self._optimizer.wait()  # the step's failure is the call's
        done.result()

    def _landing_failed(self) -> None:
        """The call of a landing step failed: wait for the step to stop; it changed
        nothing, or the pipe refuses calls until a load (reported with the next call)."""
        try:
            self._optimizer.wait()
        except StepError:
            pass  # the mixed state is kept (ModelState.mixed); the call's error is raised

    @contextlib.contextmanager
    def _replica_call(self) -> Iterator[Any]:
        """The data-parallel side of a call (None without data parallelism).  A failure
        anywhere in the call is announced to the other replicas, so none of them commits
        and none waits for this one (a no-op once the replicas have agreed)."""
        if self._dp is None:
            yield None
            return
        call = self._dp.begin()
        try:
            yield call
        except BaseException as e:
            call.fail(e)
            raise

    def _sync_replica_buffers(self, entry: CompiledProgram) -> None:
        program = entry.plan.program
        self._dp.sync_buffers(entry.host, program.units,  # type: ignore[union-attr]
                              program.buffer_updates)

    @property
    def data_parallel(self) -> DataParallelInfo | None:
        """This replica's rank, the number of replicas and the settings; None when the
        pipe is not data-parallel."""
        return self._dp.info if self._dp is not None else None

    def _hooks(self, entry: CompiledProgram, *, per_microbatch: bool) -> param_hooks.HookPlan:
        """Where this call runs the hooks on the parameters, read now (runtime/
        param_hooks.py); refuses, before anything runs, hooks it cannot run exactly."""
        return param_hooks.plan_hooks(entry.host, entry.plan.program,
                                      per_microbatch=per_microbatch,
                                      data_parallel=self._dp is not None)

    def _finish(self, entry: CompiledProgram, result: RunResult, *, count_call: bool = True,
                hooks: param_hooks.HookPlan = param_hooks.NO_HOOKS) -> None:
        """Commit a successful call: gradients and buffer updates into host state."""
        # Gradients may only land once the optimizer has finished reading them.
        self._optimizer.wait()

        def commit() -> None:
            grads, hooked = result.param_grads, []
            if hooks.at_commit:  # tensor hooks first: an error in one commits nothing
                grads, hooked = param_hooks.run_tensor_hooks(entry.host, hooks, grads,
                                                             result.mb_grads)
            # loss_fn's gradients of parameters no unit reads, held by the call
            held = param_hooks.held_loss_grads(entry.host, result.loss_grads) \
                if result.loss_grads else []
            entry.host.commit(grads, result.buffers, result.grads_owned,
                              result.grads_holdable, result.grad_norms)
            self._stats = result.stats
            if count_call:  # a backward belongs to the forward call that was counted
                self._calls += 1
            param_hooks.accumulate(entry.host, hooked + held, len(result.losses))

        # On the optimizer thread: an interrupt of the caller cannot tear the commit.
        self._optimizer.run(commit)

    def forward(self, *args: Any, run_config: RoundPipeRunConfig | None = None,
                **kwargs: Any) -> Any:
        """Pipelined forward; outputs are merged on ``output_device`` (CPU by default).

        When grad is enabled (or ``requires_grad=True`` in the run config), calling
        ``backward()`` on the result runs a pipelined backward with recompute and fills
        the same gradients as :meth:`forward_backward`.
        """
        current.called(self)
        with self._lock, diagnose_dtypes(self.model, tuple(args), dict(kwargs)):
            cfg = self._fit_to_batch(self._config(run_config), tuple(args), dict(kwargs))
            self._optimizer.raise_if_failed()
            record = cfg.requires_grad if cfg.requires_grad is not None \
                else torch.is_grad_enabled()
            entry, flat, mbs = self._prepare(tuple(args), dict(kwargs), cfg, record)
            if record:  # refused now rather than at backward(), where they are read again
                self._hooks(entry, per_microbatch=False)
            if record and len(mbs) > 1:
                refuse_hooks_split_by_microbatches(self.model, entry.plan.program, len(mbs))
            if record and cfg.split_input is not None:
                refuse_unjoinable_splits(entry.plan.program, (tuple(args), dict(kwargs)),
                                         mbs)
            if record and callable(cfg.merge_output):
                raise ConfigError(
                    "a callable merge_output cannot be differentiated through; use a merge "
                    "spec, forward_backward(), or run forward() under torch.no_grad()")
            plan = merge_plan(entry, tuple(args), dict(kwargs), mbs, cfg)
            keys = self._keys(cfg)
            version = self._state.fences.target
            result = entry.executor.forward(flat, record=record, grain=cfg.recompute_grain,
                                            keys=keys, fence_version=version,
                                            autocast=self._autocast(),
                                            keep=tail_values(plan),
                                            fresh_state=frozenset(plan.per_call_state)
                                            if plan is not None else frozenset())
            self._finish(entry, result)
            if not record:
                return merged_outputs(entry, result, mbs, cfg, plan)
            columns, build = output_columns(entry, result, mbs, cfg, plan)
            merged = [merged_value(c, cfg.output_device) for c in columns]
            # requires_grad=True records even under torch.no_grad(), as asked.
            program = entry.plan.program
            params = [(spec.name, entry.host.tensors[spec.name]) for spec in program.state
                      if spec.kind == "parameter"]
            reread = recompute_reads(program, entry.host.tensors, (tuple(args), dict(kwargs)))
            with torch.enable_grad():
                return attach_backward(
                    self._backward_runner(entry, result, cfg, keys), program, params,
                    (tuple(args), dict(kwargs)), mbs, columns, merged, build,
                    masters=self._state.has_masters, reread=reread)

    __call__ = forward

    def _fit_to_batch(self, cfg: ResolvedRunConfig, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> ResolvedRunConfig:
        """``pipe(x)`` on a batch of fewer samples than ``num_microbatch`` (an epoch's last
        batch) runs one microbatch per sample, as the backend runs ``min(num_microbatch,
        batch)``: its result is eager's on the whole batch whatever the split (the merge is
        proven split-invariant).  Not with ``split_input`` (the callable says how many)
        nor under data parallelism (replicas number their microbatches alike)."""
        if cfg.num_microbatch <= 1 or cfg.split_input is not None or self._dp is not None:
            return cfg
        try:
            batch = batch_size_of(args, kwargs)
        except InputError:
            return cfg  # (split_inputs says why)
        if 0 < batch < cfg.num_microbatch:
            log.debug("roundpipe: a batch of %d samples runs as %d microbatches, not %d",
                      batch, batch, cfg.num_microbatch)
            return dataclasses.replace(cfg, num_microbatch=batch)
        return cfg

    def _backward_runner(self, entry: CompiledProgram, forward: RunResult, cfg: ResolvedRunConfig,
                         keys: list[RngKey | None]
                         ) -> Callable[[list[dict[str, torch.Tensor]], GradRequest], RunResult]:
        """What ``loss.backward()`` through this forward runs: the backward jobs from the
        forward's stash, then the gradients the request commits committed to the masters
        (all-reduced first across data-parallel replicas).  The result's
        ``param_grads`` are those left uncommitted (``torch.autograd.grad`` returns
        them)."""
        version = self._state.fences.target
        autocast = self._autocast()
        stash = [forward.stash]  # emptied by the backward: it frees the activations
        # The stages that recorded the stash: a later call of other shapes or another
        # num_microbatch may have made another plan the program's current one.
        executor = entry.executor

        def run_backward(output_grads: list[dict[str, torch.Tensor]],
                         request: GradRequest) -> RunResult:
            if stash[0] is None:  # (PipelinedFunction refuses a second backward before this)
                raise RoundPipeError("internal: a pipelined call's backward ran twice")
            self._check_open()
            with self._lock, self._replica_call() as dp_call:
                # eager's reference is one backward of the whole batch: hooks run once
                hooks = self._hooks(entry, per_microbatch=False)
                on_grads = (dp_call.bind(entry.host, entry.plan.program.units)
                            if dp_call else None)
                # Replicas reduce every trainable parameter's gradient in one layout, so
                # a data-parallel backward computes them all and commits the asked ones.
                result = executor.backward(
                    stash[0], output_grads, grain=cfg.recompute_grain, keys=keys,
                    fence_version=version, autocast=autocast, on_grads=on_grads,
                    hooks=hooks, only=request.only if dp_call is None else None)
                param_hooks.refuse_unreached(entry.host, request.handed, result.param_grads)
                self._optimizer.wait()
                if dp_call is not None:  # all-reduced across replicas before anything commits
                    dp_call.complete(result, None)
                commit, grads = request.commit, result.param_grads
                if commit is not None:
                    result = dataclasses.replace(result, param_grads={
                        s: g for s, g in grads.items() if s in commit})
                if self._state.has_masters:
                    self._queue_end_of_pass()
                if hooks.at_commit and self._state.has_masters:
                    self._defer_commit(entry, result, hooks)
                else:
                    self._finish(entry, result, count_call=False, hooks=hooks)
                if dp_call is not None:
                    self._sync_replica_buffers(entry)
            stash[0] = None
            return dataclasses.replace(result, param_grads={
                s: g for s, g in grads.items() if commit is not None and s not in commit})
        return run_backward

    def _queue_end_of_pass(self) -> None:
        """Once per backward pass through ``pipe(x)`` with masters: run
        :meth:`_end_of_pass` when the pass ends (autograd's ``queue_callback``)."""
        task = torch._C._current_graph_task_id()
        if self._pass_task != task:
            self._pass_task = task
            # deferred by a pass that failed before its end: it commits nothing
            self._deferred = [d for d in self._deferred if d[0] == task]
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)

    def _defer_commit(self, entry: CompiledProgram, result: RunResult,
                      hooks: param_hooks.HookPlan) -> None:
        """With masters, the hooks of a parameter reached through ``pipe(x)`` run once
        per backward pass on its gradient summed over every pipelined call that pass
        reaches (two ``pipe(x)`` calls in one loss: eager's one hook call).  So the
        commits of such a pass wait for its end and then run together; an error in a
        hook commits nothing of the pass."""
        # the download buffers are reused by the next call's backward in this pass
        grads = {s: [(u, g.clone()) for u, g in gs] for s, gs in result.param_grads.items()}
        result = dataclasses.replace(result, param_grads=grads,
                                     grads_owned=frozenset(grads), grads_holdable=frozenset())
        self._deferred.append((self._pass_task, entry, result, hooks))

    def _end_of_pass(self) -> None:
        """The end of a backward pass through ``pipe(x)`` with masters: the deferred
        commits (hooks once on the summed gradients), and the gradients autograd left
        on the model's own parameters (a use outside the pipe) added to their masters,
        where the optimizer reads them (they were silently dropped before)."""
        with self._lock:
            calls, self._deferred, self._pass_task = self._deferred, [], None
            self._optimizer.wait()

            def commit() -> None:
                outside = self._state.outside_grads()
                hooked_outside = [n for n in outside if param_hooks.tensor_hooks(
                    self.model.get_parameter(n))]
                if hooked_outside:
                    self._state.drop_outside_grads(outside)
                    raise ParameterHookError(
                        f"parameter {hooked_outside[0]!r} has tensor hooks and was used "
                        "both inside the pipe and outside it in one backward: autograd ran "
                        "its hooks on the outside part alone, where eager runs them once "
                        "on the sum. Nothing of this backward was committed. Use the "
                        "parameter only inside the model the pipe runs, or remove the "
                        "hooks")
                if calls:
                    rests, hooked = param_hooks.run_merged_tensor_hooks(
                        [(entry.host, hooks, result.param_grads)
                         for _, entry, result, hooks in calls])
                    for (_, entry, result, _), rest in zip(calls, rests):
                        entry.host.commit(rest, result.buffers, result.grads_owned,
                                          frozenset(), result.grad_norms)
                        self._stats = result.stats
                    param_hooks.accumulate(calls[0][1].host, hooked, 1)
                self._state.fold_outside_grads(outside)

            self._optimizer.run(commit)

    # --- optimizer -----------------------------------------------------------------------
    def step(self, step_fn: Callable[[], Any] | torch.optim.Optimizer,
             is_async: bool = False) -> None:
        """Run ``step_fn`` (e.g. ``lambda: (opt.step(), opt.zero_grad())``) on the CPU
        optimizer thread; or hand the optimizer itself, ``pipe.step(opt)``, which runs
        ``opt.step()`` then ``opt.zero_grad()``.

        By default (``is_async=False``) the step is exact: the next call computes with
        the updated weights, so training equals eager PyTorch's.  ``pipe.step(opt)``
        with a ``roundpipe.optim`` optimizer over this pipe's masters overlaps the exact
        step with the next call: it updates the masters unit by unit in the order the
        next call uploads them and publishes each unit as it is done, so the next call
        waits only for the units it needs (about 1/S of the update with S stages;
        ``pipe.step_overlap(opt)`` says whether it applies and why not).  The
        hyperparameters are the optimizer's when ``step`` is called (a scheduler
        stepping afterwards changes the next step), and what can fail (gradients,
        state allocation) runs before ``step`` returns, so a failing step raises here
        and changes nothing.  A ``step_fn`` is opaque (it may write the masters after
        the optimizer's step), so ``step`` waits for it whole.

        With ``is_async=True`` the next call overlaps the step and so cannot use its
        result: it computes with the predicted weights ``W_{k-1} + (W_{k-1} - W_{k-2})``
        (``predict_weights``, the default), or with the weights from before the step
        (one step old) when prediction is off.
        Either way each gradient is taken at inexact weights (``docs/guide.md`` gives the
        cost in convergence); the masters, the optimizer state, checkpoints and the
        weights after :meth:`synchronize` are exact.  The first ``async_after`` steps
        are exact whatever ``is_async`` says.  Without ``optim_dtype`` (no separate
        masters) the next call waits for the step either way.
        """
        # what the disk tier's manifest records with this step (dropout streams, steps)
        counters = self._counters(steps=self._steps + 1)

        def on_enqueue(version: int) -> None:
            if self._state.offload is not None:
                self._state.step_counters[version] = counters
            for hook in self._step_hooks:
                hook(version)

        optimizer = step_fn if isinstance(step_fn, torch.optim.Optimizer) else None
        if optimizer is not None:
            def step_fn() -> None:
                optimizer.step()
                optimizer.zero_grad()
        if not callable(step_fn):
            raise StepError(f"step_fn must be callable (or a torch optimizer), got "
                            f"{type(step_fn).__name__}")

        def for_this_pipe() -> Any:  # a GradScaler made without its pipe finds it
            with current.running(self):
                return step_fn()

        current.called(self)
        self._refuse_unresumed()
        if optimizer is not None:
            self._refuse_late_masters(optimizer)
        if (is_async and self.predict_weights and self._state.offload is not None
                and self._state.has_masters and self._steps + 1 >= self.async_after):
            raise ConfigError(
                "step(is_async=True) predicts the weights from a second copy of the "
                "masters kept in host memory, which the disk tier (offload_dir) does not "
                "hold: pass RoundPipe(..., predict_weights=False) for one-step-stale "
                "asynchronous steps, or step with is_async=False. Nothing was run")
        warm = is_async and self._steps < self.async_after
        # The last exact warm-up step keeps its starting masters: the first
        # asynchronous step then predicts from its update.
        record = warm and self.predict_weights and self._steps == self.async_after - 1
        is_async = is_async and not warm
        counters["lagging"] = bool(is_async and self._state.has_masters)
        groups = None
        if optimizer is not None and not is_async and \
                self._overlap_blocker(optimizer, record, history=False) is None:
            # an older step in flight may still keep prediction history when it runs
            self._optimizer.wait()
        if optimizer is not None and not is_async and \
                self._overlap_blocker(optimizer, record) is None:
            try:
                groups = optimizer.frozen_groups()
            except RoundPipeError:  # bad hyperparameters: the plain path reports them
                groups = None
        if groups is not None:
            if self._optimizer.pending_steps() or self._state.dirty:
                self._optimizer.synchronize()  # an older step first, whole
            self._optimizer.step_by_unit(optimizer, groups, on_enqueue=on_enqueue)
            self._steps += 1
            return
        self._optimizer.step(for_this_pipe, is_async=is_async, on_enqueue=on_enqueue,
                             predict=self.predict_weights, record=record)
        self._steps += 1
        if not is_async:
            for hook in self._sync_hooks:
                hook()

    def _refuse_late_masters(self, optimizer: torch.optim.Optimizer) -> None:
        """A parameter made trainable after the first step (``requires_grad_(True)`` on a
        frozen one) gets its master then, so no optimizer built before holds it: its
        gradients would land and never be applied, where eager's optimizer over
        ``model.parameters()`` steps it.  Refused before the step, unless an optimizer
        stepped through this pipe holds it (``add_param_group``)."""
        if not self._state.has_masters:
            return
        named = self._state.named_masters()
        self._step_optimizers.add(optimizer)
        if self._first_masters is None:
            self._first_masters = frozenset(n for n, _ in named)
            return
        held = {id(p) for o in self._step_optimizers for g in o.param_groups
                for p in g["params"]}
        missing = [n for n, m in named if n not in self._first_masters and id(m) not in held]
        if missing:
            raise OptimizerError(
                f"{missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                   else "")
                + " became trainable after the first step, so its master (optim_dtype) was "
                "made then and is in no optimizer: its gradients would never be applied "
                "(eager's optimizer over model.parameters() would step it). Add it before "
                "stepping: opt.add_param_group({'params': [dict(pipe.optim_named_"
                f"parameters())[{missing[0]!r}]]}}). Nothing was stepped")

    def step_overlap(self, optimizer: torch.optim.Optimizer) -> str:
        """How an exact ``pipe.step(optimizer)`` runs: ``"per unit"`` (overlapped with
        the next call, about 1/S of the update exposed) or why the whole update is
        exposed (the next call waits for all of it)."""
        blocker = self._overlap_blocker(optimizer, record=False)
        return "per unit" if blocker is None else f"whole update: {blocker}"

    def _overlap_blocker(self, optimizer: torch.optim.Optimizer, record: bool,
                         history: bool = True) -> str | None:
        """Why an exact ``pipe.step(optimizer)`` cannot publish unit by unit (None: it
        can); ``history=False``: without asking whether weight prediction keeps history
        (an older step in flight may still start it)."""
        if not self._state.has_masters:
            return ("no separate masters (optim_dtype=None): the optimizer writes the "
                    "weights the next call reads")
        if not hasattr(optimizer, "step_frozen"):
            return (f"{type(optimizer).__name__} steps all its parameters at once; "
                    "roundpipe.optim's optimizers update unit by unit")
        if record or (history and self._state.previous_masters()):
            return "weight prediction keeps each step's starting masters (async steps)"
        if self._sync_hooks:
            return "a GradScaler is attached to this pipe (use a step_fn with it)"
        if optimizer_check.has_user_step_hooks(optimizer):
            return "the optimizer has step hooks, which run around its whole step"
        return optimizer.unit_step_blocker(self._state.landed)

    def synchronize(self) -> None:
        """Wait for the optimizer; afterwards ``.grad`` and the weights are consistent and
        the model's weights equal the masters."""
        self._optimizer.synchronize()
        for hook in self._sync_hooks:
            hook()

    def wait(self) -> None:
        """Wait for the steps in flight without publishing them: the optimizer's state
        (and the masters) are then those after the last ``step``, while the model's
        weights may still be one step old (:meth:`synchronize` also publishes them).
        Raises :class:`StepError` for a step that failed; a no-op inside a ``step_fn``.
        For integrations that read or replace the optimizer's state between steps."""
        self._optimizer.wait()

    @property
    def has_masters(self) -> bool:
        """Whether the pipe keeps separate master copies of the trainable weights
        (``optim_dtype`` given): the optimizer then updates the masters and an
        asynchronous step can overlap the next call; without masters it updates the
        model's own weights and the next call waits for the step."""
        return self._state.has_masters

    # --- seams for the checkpoint package (docs/guide.md "Seams for integrations") -------
    def enqueue_on_optimizer_thread(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` on the optimizer thread without waiting for it; returns its
        future.  Every step enqueued later runs after ``fn`` returns, so ``fn`` can hold
        the steps while other code reads state they change (an asynchronous checkpoint
        copying the masters).  ``fn`` must not wait for a later step: it would wait for
        itself."""
        return self._optimizer.submit(fn)

    def new_gloo_group(self) -> Any:
        """A new gloo process group over this pipe's data-parallel replicas, apart from
        the groups training runs its collectives on (an asynchronous checkpoint's
        collectives run beside training); None when the pipe is not data-parallel.
        Collective: every replica calls it, in the same order."""
        return self._dp.new_gloo_group() if self._dp is not None else None

    def read_offloaded_state(self, name: str, key: str,
                             value: torch.Tensor) -> torch.Tensor | None:
        """With the disk tier, entry ``key`` of the optimizer state of the master
        ``name`` as a new tensor, read once from its file, when ``value`` is the tier's
        tensor for that entry (whose memory is freed between steps); None otherwise (a
        tensor in memory: read ``value`` itself).  Call it with no step in flight
        (:meth:`wait`)."""
        store = self._state.offload
        if store is None:
            return None
        skey = offload.state_key(name, key)
        return store.read(skey) if store.tensor(skey) is value else None

    def _counters(self, steps: int | None = None) -> dict[str, Any]:
        """What the disk tier's manifest records of the pipe for an exact resume (as
        :meth:`state_dict`'s metadata does for a checkpoint)."""
        return {"calls": self._calls, "seed": self.seed,
                "steps": self._steps if steps is None else steps,
                "predict_weights": self.predict_weights, "async_after": self.async_after}

    def _resume_counters(self, seed: int | None) -> None:
        """With the disk tier: a resumed directory's counters become the pipe's (the
        dropout streams go on where the run was), a fresh one records the pipe's."""
        state = self._state
        if state.offload is None or state.offload.resumed is None:
            state.counters = self._counters()
            return
        saved = dict(state.counters)
        if seed is not None and "seed" in saved and int(saved["seed"]) != int(seed):
            raise OffloadMismatchError(
                f"offload_dir {state.offload.directory!r} holds a run whose dropout seed "
                f"was {saved['seed']}, this pipe was given seed={seed}: its dropout masks "
                f"would differ. Nothing was resumed: pass seed={saved['seed']} (or none, "
                "to take the run's), or another offload_dir to start afresh")
        schedule: dict[str, Any] = collections.OrderedDict()
        schedule._metadata = {"roundpipe": saved}  # type: ignore[attr-defined]
        self._check_schedule(schedule)
        self.seed = int(saved.get("seed", self.seed))
        self._calls = int(saved.get("calls", 0))
        self._steps = int(saved.get("steps", 0))
        log.info("roundpipe: resumed the disk tier %s at its step %d (%d steps, %d calls)",
                 state.offload.directory, state.offload.step, self._steps, self._calls)
        if saved.get("lagging"):
            log.warning(
                "roundpipe: the run in %s took its last step asynchronously, so its next "
                "call would have used the weights of the step before; the resumed pipe "
                "publishes the committed masters (as pipe.synchronize() does), so it does "
                "not continue that run bit for bit from here (a checkpoint keeps the "
                "lagging weights)", state.offload.directory)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """A load of several parts, committed as one (``load_checkpoint`` uses it)::

            with pipe.loading():
                pipe.load_state_dict(model_state)
                optimizer.load_state_dict(optimizer_state)

        With the disk tier (``offload_dir``) the masters and optimizer state written
        inside go to the slots the manifest does not name, and the manifest is replaced
        once, at the end: a crash anywhere inside leaves the files at the state from
        before, never the loaded masters beside the old moments.  An error inside rolls
        the files back; if the load had written into them or into the model's weights,
        every call and step then
        refuses until state is loaded again.  Without the tier it only waits for the
        steps in flight."""
        self._optimizer.wait()
        state = self._state
        if state.offload is None or self._loading:  # (inside one already)
            yield
            return
        self._optimizer.run(state.hold_commits)
        self._loading += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            self._loading -= 1

            def release() -> None:
                state.counters = self._counters()  # as loaded
                state.release_commits(ok)
            self._optimizer.run(release)

    def optim_parameters(self) -> list[torch.Tensor]:
        """The tensors an optimizer should update: fp32 (``optim_dtype``) masters of the
        trainable parameters, or the model's own parameters when ``optim_dtype`` is None."""
        return [t for _, t in self._state.named_masters()]

    def optim_named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return self._state.named_masters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(pipe.optim_parameters(), ...)``, without the
        host passes: a gradient held where it landed (``roundpipe.optim``) is not
        converted to a float32 ``.grad``; its norm is measured on the device that made it
        (2-norms, from the call after the first clip on) and the clip factor is applied
        inside the optimizer's update.  Call it in ``step_fn``, before ``opt.step()``;
        elsewhere it runs on the optimizer thread after the pending step.  Returns the
        total norm before clipping, as torch's function does."""
        def clip() -> torch.Tensor:
            # a backward outside the pipe left gradients on the model's parameters
            self._state.fold_outside_grads(self._state.outside_grads())
            return clip_grad_norm_(self.optim_parameters(), max_norm, norm_type,
                                   error_if_nonfinite)
        return clip() if self._optimizer.on_worker else self._optimizer.run(clip)

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The model's state dict, with parameters taken from the masters where they
        exist (fp32 masters of a bf16 model are saved exactly); loadable into the plain
        model too (values are cast on load).

        Waits for a pending step but does not publish it, so taking a checkpoint does not
        change the run.  What an exact resume also needs travels in the state dict's
        ``_metadata["roundpipe"]`` (kept by ``torch.save`` and ignored by plain models):
        the call counter and seed of the dropout streams, the step count,
        ``predict_weights`` and ``async_after`` (a load checks them), while the
        asynchronous schedule has the weights differ from the masters, those weights, and
        the masters kept for the weight prediction.  Raises :class:`StepError` while a
        step or load that failed part-way left the state mixed (until a load).
        """
        self._optimizer.wait()
        if self._state.has_masters and self._state.mixed is None:
            # the user's writes to the model's weights since the last publish: saved
            self._optimizer.run(self._state.adopt_edits)
        if self._state.mixed is not None:  # (calls and steps refuse it too)
            raise StepError(f"{self._state.mixed}. A checkpoint now would save that mix: "
                            "nothing was saved")
        sd = self.model.state_dict()
        meta: dict[str, Any] = {"version": 1, "calls": self._calls, "seed": self.seed,
                                "steps": self._steps,
                                "predict_weights": self.predict_weights,
                                "async_after": self.async_after}
        if self._state.has_masters:
            masters = self._state.masters()
            canonical = {id(p): n for n, p in self.model.named_parameters()}
            if self._state.dirty:
                meta["published"] = {n: self.model.get_parameter(n).detach().clone()
                                     for n in masters}
            previous = self._state.previous_masters()
            if previous:  # live, as the masters are: only a step changes them
                meta["previous"] = {n: t.detach() for n, t in previous.items()}
            read: dict[str, torch.Tensor] = {}  # with the disk tier: read once
            for name, param in self.model.named_parameters(remove_duplicate=False):
                key = canonical[id(param)]
                held = sd.get(name)
                if not (isinstance(held, torch.Tensor) and _same_storage(held, param)):
                    continue  # a state-dict hook renamed or replaced it: its value stands
                if key in masters:
                    if key not in read:
                        read[key] = self._state.read_master(key)
                    sd[name] = read[key]
        metadata = getattr(sd, "_metadata", None)
        if metadata is None:
            metadata = sd._metadata = {}  # type: ignore[attr-defined]
        metadata["roundpipe"] = meta
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load a state dict from :meth:`state_dict` (or a plain model's) bit-exactly,
        the asynchronous schedule included (see :meth:`state_dict`).  A state dict saved
        by a pipe whose ``predict_weights`` or ``async_after`` would run the remaining
        steps differently from this pipe's is refused (:class:`CheckpointError`) before
        anything is loaded."""
        self._check_schedule(state_dict)
        with self.loading():  # the disk tier: one commit, with the loaded counters
            return self._load_state_dict(state_dict, strict)

    def _load_state_dict(self, state_dict: dict[str, Any], strict: bool) -> Any:
        def load() -> Any:
            result, values = self._load_into_model(state_dict, strict)
            self._state.load_masters(values)
            meta = (getattr(state_dict, "_metadata", None) or {}).get("roundpipe") or {}
            self._calls = int(meta.get("calls", self._calls))
            self.seed = int(meta.get("seed", self.seed))
            self._steps = int(meta.get("steps", self._steps))
            self._state.load_previous(meta.get("previous"))
            published = meta.get("published")
            if published and self._state.has_masters:
                # The weights differed from the masters (one step behind, or
                # predicted): restore exactly that.
                with torch.no_grad():
                    for name, value in published.items():
                        self.model.get_parameter(name).copy_(value)
                self._state.note_weights()
                self._state.mark_dirty()
            else:
                self._optimizer.publish_now()
            return result

        # On the optimizer thread: an interrupt cannot leave weights half loaded or
        # fences half open.
        return self._optimizer.run(load)

    def _load_into_model(self, state_dict: dict[str, Any], strict: bool
                         ) -> tuple[Any, dict[str, torch.Tensor]]:
        """``model.load_state_dict`` with the value each parameter ends with, for its
        master: the model's load-state-dict pre hooks, ``_load_from_state_dict``
        overrides and post hooks may rename, convert or rewrite values, so the raw
        ``state_dict[name]`` is not what eager's model holds.  Each parameter's value is
        read as its module's loader copies it (a pre hook of ours, registered after the
        user's, so it sees their result) and kept at its full precision where the
        parameter holds exactly that value cast to its dtype; where the parameter holds
        something else (a post hook or an override rewrote it) its own value is taken."""
        if not self._state.has_masters:
            return self.model.load_state_dict(state_dict, strict=strict), {}
        params = {id(p): p for p in self.model.parameters()}
        loaded: dict[int, torch.Tensor] = {}  # last value the loader saw, per parameter

        def capture(own: list[tuple[str, torch.Tensor]], sd: dict[str, Any], prefix: str,
                    *_: Any) -> None:
            for name, param in own:
                value = sd.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    loaded[id(param)] = value
                else:
                    loaded.pop(id(param), None)

        handles = []
        try:
            for module in self.model.modules():
                own = list(module.named_parameters(recurse=False))
                if own:
                    handles.append(module._register_load_state_dict_pre_hook(
                        functools.partial(capture, own)))
            versions = {k: p._version for k, p in params.items()}
            result = self.model.load_state_dict(state_dict, strict=strict)
        finally:
            for handle in handles:
                handle.remove()
        values: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            value = loaded.get(id(param))
            if value is not None and _bitwise_equal(value.detach().to(param.dtype), param):
                values[name] = value.detach()  # at the precision it was given
            elif value is not None or param._version != versions[id(param)]:
                values[name] = param.detach()  # rewritten after the copy
        return result, values

    def _check_schedule(self, state_dict: dict[str, Any]) -> None:
        """Refuse a resume whose remaining steps would follow another schedule than the
        saved run's: the weights the calls use would differ, silently."""
        meta = (getattr(state_dict, "_metadata", None) or {}).get("roundpipe") or {}
        if "predict_weights" not in meta or not self._state.has_masters:
            return  # saved before the settings were recorded; no masters: no schedule
        steps = int(meta.get("steps", 0))
        saved = {"predict_weights": bool(meta["predict_weights"]),
                 "async_after": int(meta["async_after"])}
        differs = [name for name, value in saved.items() if value != getattr(self, name)]
        if "async_after" in differs and steps >= max(saved["async_after"],
                                                     self.async_after):
            differs.remove("async_after")  # both past their exact warm-up: the same
        if not differs:
            return
        settings = ", ".join(f"{n}={saved[n]!r} (this pipe: {getattr(self, n)!r})"
                             for n in differs)
        raise CheckpointError(
            f"the state dict was saved after {steps} steps by a pipe with {settings}: "
            "this pipe would take the remaining asynchronous steps at other weights than "
            "the saved run. Nothing was loaded: construct the pipe with "
            + ", ".join(f"{n}={saved[n]!r}" for n in differs)
            + "; to change the schedule on purpose, set the attribute to the saved value, "
            "load, then set it to the new one (e.g. pipe." + differs[0] + " = ...)")

    def save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> Any:
        """Save the model's weights (every step taken) for inference or fine-tuning.

        A model with its own ``save_pretrained`` (Hugging Face, PEFT) is given the call,
        with the user's ``use_cache`` in its config.  Any other module's state dict is
        written as sharded safetensors with an index, as ``transformers`` lays them out
        (``max_shard_size="5GB"``; needs the ``safetensors`` package, in the ``hf``
        extra).  Returns what the model's method returns, else the files written.
        """
        if hasattr(self.model, "save_pretrained"):
            return self.__getattr__("save_pretrained")(save_directory, **kwargs)
        from .checkpoint.export import save_pretrained
        return save_pretrained(self, save_directory, **kwargs)

    def host_memory(self, optimizer: torch.optim.Optimizer | None = None) -> HostMemory:
        """The bytes roundpipe holds in host memory, by category, each storage counted
        once: the model's weights, masters, gradients, ``optimizer``'s state (pass the
        optimizer you step with), gradient landing buffers and trace constants, plus the
        virtual CPU devices' own copies apart.  ``print(pipe.host_memory(opt))`` shows a
        table with bytes per trainable parameter; see ``docs/guide.md`` for what each
        configuration costs.  It waits for a step in progress."""
        state = self._state

        def collect() -> HostMemory:  # on the optimizer thread: no step is mid-way
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            named = state.named_masters()
            constants = [t for entry in self._compiled
                         for t in entry.plan.program.constants.values()
                         if isinstance(t, torch.Tensor)]
            devices = [DeviceCopies(d.name, d.resident_bytes(),
                                    d.counters().peak_resident_bytes)
                       for d in self.devices if isinstance(d, VirtualCPUDevice)]
            store = state.offload
            return host_memory(
                list(self.model.parameters()) + list(self.model.buffers()),
                [m for _, m in named] if state.has_masters else [],
                state.all_previous(),
                [raw_grad(m) for _, m in named], optimizer, self._landing.tensors(), constants,
                sum(p.numel() for p in trainable), devices,
                disk_masters=store.disk_bytes("master/") if store is not None else 0,
                disk_optimizer_state=(store.disk_bytes("state/") if store is not None
                                      else 0),
                staging=store.staging.buffers() if store is not None else (),
                landing_peak=self._landing.peak_bytes)

        # Not under the call lock: a step_fn may call this while the caller waits for it.
        return self._optimizer.run(collect)

    def offload_stats(self) -> OffloadStats | None:
        """The disk tier's counters (``offload_dir``): the committed step, the bytes
        staged now and at most, the bytes read and written; None without the tier."""
        store = self._state.offload
        return None if store is None else store.stats()

    def stats(self) -> RunStats:
        """Transfers, peak residency per device and the job timeline of the last call."""
        if self._stats is None:
            raise RoundPipeError("no call has run yet, so there are no stats")
        return self._stats

    def timeline(self, path: str | os.PathLike[str]) -> str:
        """Write the last call's job timeline to ``path`` as Chrome/Perfetto trace JSON
        (one track per device, a slice per job and per microbatch); returns the path."""
        from .runtime.timeline import write_chrome_trace
        return write_chrome_trace(self.stats(), path)

    def close(self) -> None:
        """Wait for pending work and stop the worker threads."""
        if self._closed:
            return
        try:
            self._optimizer.wait()
        finally:
            self._closed = True
            self._optimizer.close()
            self._landing.close()
            for device in self.devices:
                device.close()
            unpin(self._state)
            optimizer_check.unwatch_outside_steps(self._state)
            if self._state.offload is not None:
                self._state.offload.close()

    def __enter__(self) -> RoundPipe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Attribute access falls through to the wrapped model (pipe.config, ...).
        if name == "model" or name.startswith("__") or "model" not in self.__dict__:
            raise AttributeError(name)
        value = getattr(self.__dict__["model"], name)
        if inspect.ismethod(value):
            # pipe.save_pretrained(...) and the like must see every step taken: they
            # synchronize (so the next call, too, uses the current weights).  Mode
            # switches only flip flags: they wait for a pending step and change nothing.
            @functools.wraps(value)
            def forwarded(*args: Any, **kwargs: Any) -> Any:
                if name in _FLAG_METHODS:
                    self._optimizer.wait()
                else:
                    self.synchronize()
                if name in _SAVING_METHODS:
                    with _users_config(self.__dict__.get("_cache_configs", ())):
                        return value(*args, **kwargs)
                return value(*args, **kwargs)
            return forwarded
        return value

    def __repr__(self) -> str:
        return (f"RoundPipe({type(self.model).__name__}, devices="
                f"{[d.name for d in self.devices]})")


# Model methods that only flip flags: forwarded without publishing pending steps.
_FLAG_METHODS = frozenset({"train", "eval", "requires_grad_"})
# Methods that write the model's config out: they see the user's use_cache.
_SAVING_METHODS = frozenset({"save_pretrained", "push_to_hub"})


def _unit_backend(compile_units: bool | str) -> str | None:
    """The torch.compile backend for unit programs, or None (run them as traced)."""
    if compile_units is False:
        return None
    if compile_units is True:
        return "inductor"
    if isinstance(compile_units, str):
        from torch._dynamo import list_backends
        known = set(list_backends(exclude_tags=())) | {"inductor"}
        if compile_units not in known:
            raise ConfigError(f"compile_units={compile_units!r} is not a torch.compile backend "
                              f"(known: {', '.join(sorted(known))}); pass True for inductor")
        return compile_units
    raise ConfigError(f"compile_units must be True, False or a torch.compile backend name, "
                      f"got {compile_units!r}")


def compile(  # noqa: A001 - the documented name
    model: torch.nn.Module,
    example_args: tuple[Any, ...] | Any = (),
    example_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> RoundPipe:
    """Compile ``model`` for inputs like the example (a whole batch) and return a
    :class:`RoundPipe` whose ``.plan`` is ready.  ``options`` are :class:`RoundPipe`'s."""
    pipe = RoundPipe(model, **options)
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    try:
        pipe.compile(example_args, example_kwargs)
    except BaseException:
        pipe.close()  # its threads, and its offload_dir's lock, go with the error
        raise
    return pipe


# --- helpers -------------------------------------------------------------------------------

def _disable_cache(model: torch.nn.Module) -> list[Any]:
    """Turn off key/value caches (``config.use_cache``, as Hugging Face models have it):
    they serve generation, and in training they only cost memory and add outputs.
    Submodules may hold configs of their own (T5's decoder copies the model's).  Returns
    the configs changed (they had ``use_cache=True``)."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if getattr(c, "use_cache", False) is True}
    for config in configs.values():
        config.use_cache = False
    if configs:
        log.info("roundpipe: set config.use_cache = False in %d config(s) of %s for training "
                 "(set it back to True to generate with a cache)", len(configs),
                 type(model).__name__)
    return list(configs.values())


@contextlib.contextmanager
def _users_config(configs: Sequence[Any]) -> Iterator[None]:
    """While saving, the configs say ``use_cache`` as the user had them (True where
    roundpipe turned it off), so a saved model generates with its cache when loaded."""
    switched = [c for c in configs if getattr(c, "use_cache", None) is False]
    for config in switched:
        config.use_cache = True
    try:
        yield
    finally:
        for config in switched:
            config.use_cache = False
