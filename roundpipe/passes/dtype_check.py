"""Find, in a traced graph, an op that multiplies tensors of two floating dtypes.

Export traces ``F.linear(x_float32, weight_float64)`` without complaint (its fake kernels
do not compare dtypes), so an input of the wrong dtype used to surface only at the first
call, deep in a worker's traceback.  Models that cast their inputs themselves trace to
graphs without such an op, and pass.
"""

from __future__ import annotations

import torch
import torch.fx

_MULTIPLYING = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "convolution",
                "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                "conv_transpose3d", "_convolution", "scaled_dot_product_attention"}


def mixed_dtype_op(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The first matmul-like node whose floating tensor arguments differ in dtype."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        if schema.name.split("::")[-1] not in _MULTIPLYING:
            continue
        dtypes = {a.meta["val"].dtype for a in node.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor)
                  and a.meta["val"].is_floating_point()}
        if len(dtypes) > 1:
            return node
    return None
