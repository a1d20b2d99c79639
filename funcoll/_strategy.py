"""How a ragged all-gather moves its rows: the strategies and the choice between them.

``funcoll.gather`` (and every op built on the ragged all-gather) takes a
`strategy`:

- ``"pad"``: pad every rank's rows to ``max(sizes)``, one all_gather, cut the
  padding out (``_rows.cut_padding``). Two collectives (with the size exchange),
  but the padding travels.
- ``"a2a"``: no padding; every rank's rows reach the others in ``world - 1``
  shifted all_to_all_singles.
- ``"auto"``: the rows every rank has (``min(sizes)``) in one all_gather, the
  rest as ``"a2a"`` does; past :data:`AUTO_SHIFTS_MAX_WORLD` ranks, ``"pad"``.

Every choice here depends only on what every rank holds identically (the
strategy argument, the world size, the exchanged sizes), so every rank issues the
same collectives. The primitives that carry them out are ``_prims.gather_rows``
and ``_prims.gather_pieces``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ._checks import IntLike

STRATEGIES = ("auto", "pad", "a2a")

# "auto" sends what does not fit the common all_gather with world - 1 shifted
# all_to_all_singles: no copies, but a number of collectives, and so of latencies,
# that grows with the world. Past this many ranks "auto" pads instead (one
# all_gather). The number is a static choice (so every rank makes the same one),
# set from this reasoning, not from a measurement: the machine funcoll is tested
# on runs at most 4 ranks.
AUTO_SHIFTS_MAX_WORLD = 8


def resolve(strategy: str, size: int) -> str:
    """The strategy that runs: "auto" pads past AUTO_SHIFTS_MAX_WORLD ranks."""
    return "pad" if strategy == "auto" and size > AUTO_SHIFTS_MAX_WORLD else strategy


def common_rows(strategy: str, sizes: Sequence[IntLike], smallest: IntLike | None) -> IntLike:
    """How many of every rank's first rows go in the all_gather of a shifted strategy.

    ``"a2a"``: none. ``"auto"``: ``min(sizes)`` (`smallest` when the caller read it
    off the size table).
    """
    if strategy == "a2a":
        return 0
    return sym_min(sizes) if smallest is None else smallest


def sym_min(sizes: Sequence[IntLike]) -> IntLike:
    return functools.reduce(torch.sym_min, sizes)


def sym_max(sizes: Sequence[IntLike]) -> IntLike:
    return functools.reduce(torch.sym_max, sizes)


def all_equal(sizes: Sequence[IntLike]) -> bool:
    """Every rank has the same length, known in eager code: the local copies can be skipped.

    Only ever True in eager mode, where sizes are ints; in a compiled graph they
    are unbacked SymInts and the general path runs. Either way the collectives
    issued are the same: only local copies are skipped.
    """
    return not torch.compiler.is_compiling() and len(set(sizes)) == 1
