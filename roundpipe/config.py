"""``RoundPipeRunConfig``: per-model and per-call runtime settings.

Precedence, as in the seeds: a value given per call wins over the model-level value, which
wins over the built-in default.  Every field defaults to ``None`` meaning "not set here".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from .errors import ConfigError, UnknownConfigFieldError, unknown_options_message

RecomputeGrain = Literal["stage", "layer"]
_GRAINS = ("stage", "layer")

#: A split spec is a callable ``(args, kwargs, num_microbatch) -> list[(args, kwargs)]`` or
#: a pytree matching the inputs whose leaves are the dimension to split (``int``) or
#: ``None`` (replicate).  A merge spec is a callable ``(list_of_outputs) -> output`` or a
#: pytree matching the outputs whose leaves are a dimension (``int``, concatenate),
#: ``"sum"``, ``"stack"`` or ``None`` (take the first microbatch's value).
SplitSpec = Any
MergeSpec = Any


@dataclass(frozen=True, init=False)
class RoundPipeRunConfig:
    """Runtime settings of a :class:`~roundpipe.RoundPipe` call.

    Attributes:
        num_microbatch: microbatches per call.  Default: number of devices + 1, the fewest
            that keep every device busy.  Fix it to make results independent of the device
            count.
        recompute_grain: ``"stage"`` (recompute a whole backward stage, then run its
            backward) or ``"layer"`` (recompute and backward one layer unit at a time: less
            memory, more activation uploads).
        output_device: where merged outputs are placed.  Default: the CPU.
        preserve_rng_state: reproduce random ops (dropout) exactly in recompute.  roundpipe
            keys random streams by (call, layer unit, microbatch), so this is cheap; setting
            it to False draws from the device's default generator instead (faster, but
            recompute then differs from the forward pass).
        split_input: how inputs are split into microbatches (see ``SplitSpec``).  Default:
            tensors whose first dimension equals the batch size are split along it, the
            rest is replicated.
        split_label: the same for ``label``.
        merge_output: how per-microbatch outputs are merged (see ``MergeSpec``).  Default:
            tensors with a batch dimension are concatenated, 0-dim floating tensors are
            summed, anything else is taken from the first microbatch.
        requires_grad: whether :meth:`RoundPipe.forward` records for ``backward()``.
            Default: ``torch.is_grad_enabled()``.
        memory_fraction: share of the smallest device's free memory the plan may use
            for a job at its peak together with the weights prefetched for the next job
            (``StagePlan.device_memory_bytes``).  Default: 0.9.  It is the only margin:
            the estimate it is compared with is the job's own, not padded.  Ignored when ``RoundPipe(memory_cap=...)`` is given or the
            devices have no known capacity (virtual CPU devices without one).
    """

    num_microbatch: int | None
    recompute_grain: RecomputeGrain | None
    output_device: torch.device | str | None
    preserve_rng_state: bool | None
    split_input: SplitSpec | Callable[..., Any] | None
    split_label: SplitSpec | Callable[..., Any] | None
    merge_output: MergeSpec | Callable[..., Any] | None
    requires_grad: bool | None
    memory_fraction: float | None

    def __init__(
        self,
        num_microbatch: int | None = None,
        recompute_grain: RecomputeGrain | None = None,
        output_device: torch.device | str | None = None,
        preserve_rng_state: bool | None = None,
        split_input: SplitSpec | None = None,
        split_label: SplitSpec | None = None,
        merge_output: MergeSpec | None = None,
        requires_grad: bool | None = None,
        memory_fraction: float | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise UnknownConfigFieldError(unknown_options_message(
                "RoundPipeRunConfig", unknown,
                [f.name for f in dataclasses.fields(RoundPipeRunConfig)]))
        if num_microbatch is not None:
            if isinstance(num_microbatch, bool) or not isinstance(num_microbatch, int):
                raise ConfigError(
                    f"num_microbatch must be a positive int, got {num_microbatch!r} "
                    f"({type(num_microbatch).__name__})"
                )
            if num_microbatch < 1:
                raise ConfigError(
                    f"num_microbatch must be >= 1, got {num_microbatch}; use at least the "
                    "number of devices + 1 to keep every device busy"
                )
        if recompute_grain is not None and recompute_grain not in _GRAINS:
            raise ConfigError(
                f"recompute_grain must be 'stage' or 'layer', got {recompute_grain!r}"
            )
        if output_device is not None:
            try:
                output_device = torch.device(output_device)
            except (RuntimeError, TypeError) as e:
                raise ConfigError(f"output_device {output_device!r} is not a device: {e}") from None
        if memory_fraction is not None and (
                isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float))
                or not 0.0 < memory_fraction <= 1.0):
            raise ConfigError(
                f"memory_fraction must be a number in (0, 1], got {memory_fraction!r}")
        for name, value in (("preserve_rng_state", preserve_rng_state),
                            ("requires_grad", requires_grad)):
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name} must be True, False or None, got {value!r}")
        values = dict(
            num_microbatch=num_microbatch,
            recompute_grain=recompute_grain,
            output_device=output_device,
            preserve_rng_state=preserve_rng_state,
            split_input=split_input,
            split_label=split_label,
            merge_output=merge_output,
            requires_grad=requires_grad,
            memory_fraction=memory_fraction,
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def overridden_by(self, other: RoundPipeRunConfig | None) -> RoundPipeRunConfig:
        """Return a config whose set fields come from ``other`` where it sets them."""
        if other is None:
            return self
        if not isinstance(other, RoundPipeRunConfig):
            raise ConfigError(
                f"run_config must be a RoundPipeRunConfig, got {type(other).__name__}"
            )
        merged = {
            f.name: (getattr(other, f.name) if getattr(other, f.name) is not None
                     else getattr(self, f.name))
            for f in dataclasses.fields(self)
        }
        return RoundPipeRunConfig(**merged)

    def resolve(self, num_devices: int) -> ResolvedRunConfig:
        """Fill unset fields with the built-in defaults."""
        return ResolvedRunConfig(
            num_microbatch=self.num_microbatch if self.num_microbatch is not None
            else num_devices + 1,
            recompute_grain=self.recompute_grain or "stage",
            output_device=torch.device(self.output_device) if self.output_device is not None
            else torch.device("cpu"),
            preserve_rng_state=True if self.preserve_rng_state is None
            else self.preserve_rng_state,
            split_input=self.split_input,
            split_label=self.split_label,
            merge_output=self.merge_output,
            requires_grad=self.requires_grad,
            memory_fraction=0.9 if self.memory_fraction is None else float(self.memory_fraction),
        )


@dataclass(frozen=True)
class ResolvedRunConfig:
    """A run config with every default filled in (what a call actually uses)."""

    num_microbatch: int
    recompute_grain: RecomputeGrain
    output_device: torch.device
    preserve_rng_state: bool
    split_input: Any
    split_label: Any
    merge_output: Any
    requires_grad: bool | None
    memory_fraction: float
