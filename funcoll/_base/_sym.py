"""min and max of ints and SymInts, branch-free where the values are symbolic, on every torch release.

``torch.sym_min`` / ``torch.sym_max`` on two SymInts give a SymInt and add no
guard; on two plain ints, dynamo before torch 2.12 refuses them ("torch.* op
returned non-Tensor", a graph break), and a static shape is a plain int there.
Under dynamo a SymInt passes ``isinstance(., int)`` and the builtin ``min`` of one
becomes ``torch.sym_min`` in the graph; outside dynamo (eager, or AOT tracing a
backward) a SymInt is a ``torch.SymInt`` and takes ``torch.sym_min`` directly,
as the builtin would guard on it. So both helpers pick by type, and each path
adds no guard:

>>> min_of(3, 5, 4)
3
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from ._checks import IntLike

# (min, max, sum) of a ragged gather's per-rank sizes (_prims.gather_rows).
Stats = tuple[IntLike, IntLike, IntLike]

__all__ = ["Stats", "max_of", "min_of", "prod"]


def _min2(a: IntLike, b: IntLike) -> IntLike:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return torch.sym_min(a, b)
    return min(a, b)


def _max2(a: IntLike, b: IntLike) -> IntLike:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return torch.sym_max(a, b)
    return max(a, b)


def min_of(*values: IntLike) -> IntLike:
    """The smallest of `values` (one at least), an int or a SymInt, with no guard."""
    return functools.reduce(_min2, values)


def max_of(*values: IntLike) -> IntLike:
    """The largest of `values` (one at least), an int or a SymInt, with no guard."""
    return functools.reduce(_max2, values)


def prod(values: Iterable[IntLike]) -> IntLike:
    """The product of `values`, ints or SymInts (a plain loop: dynamo traces it, unlike math.prod over a generator)."""
    out: IntLike = 1
    for v in values:
        out = out * v
    return out
