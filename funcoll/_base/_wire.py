"""How tensors travel: the dtype on the wire and the reduction that runs there.

Not every backend carries bool, so a bool tensor travels as its uint8 view, and a
reduction over bools runs as the uint8 reduction that means the same (or is
max, and is min). Every op wraps its data in :func:`wire` before a collective
and takes it back with :func:`unwire` (an op that moves rows along a dim takes
both steps with ``_collective._rows.to_rows`` and ``from_rows``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def wire_op(reduce_op: str, dtype: torch.dtype) -> str:
    """The reduction to run on the wire: bool travels as uint8, where or is max and and is min."""
    if dtype == torch.bool:
        return {"sum": "max", "product": "min"}.get(reduce_op, reduce_op)
    return reduce_op


def wire(x: Tensor) -> Tensor:
    """The tensor as it travels: bool as uint8 (not every backend carries bool)."""
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def unwire(y: Tensor, dtype: torch.dtype) -> Tensor:
    """A collective's result back in the input's `dtype` (the inverse of :func:`wire`)."""
    return y.view(torch.bool) if dtype == torch.bool else y
