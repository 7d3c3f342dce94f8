"""Pass 5, recompute: what each backward stage needs stashed from the forward pass.

A backward stage recomputes its forward from stashed values, then runs backward:

* grain ``"stage"``: the stage's inputs (values made before the stage and read in it);
  every unit's activations are alive together during the stage's backward;
* grain ``"layer"``: the inputs of every unit of the stage; each unit is recomputed just
  before its own backward and freed after it, so only one unit's activations are alive.

The fused tail is never recomputed and stashes nothing.  The result is plain data indexed
like ``plan.stages``; the runtime picks the grain per call.
"""

from __future__ import annotations

from typing import Sequence

from ..plan import ModelProgram

GRAINS = ("stage", "layer")


def plan_recompute(program: ModelProgram, stages: Sequence[tuple[str, tuple[int, int]]]
                   ) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Stash sets per grain, one entry per stage (empty for forward and fused stages).

    Args:
        program: the unit programs.
        stages: ``(kind, (start, stop))`` per stage, in execution order.
    """
    result: dict[str, tuple[tuple[str, ...], ...]] = {}
    for grain in GRAINS:
        per_stage: list[tuple[str, ...]] = []
        for kind, (start, stop) in stages:
            if kind != "bwd":
                per_stage.append(())
            elif grain == "stage":
                per_stage.append(program.range_inputs(start, stop))
            else:
                stash: list[str] = []
                for unit in program.units[start:stop]:
                    stash.extend(v for v in unit.inputs if v not in stash)
                per_stage.append(tuple(stash))
        result[grain] = tuple(per_stage)
    return result
