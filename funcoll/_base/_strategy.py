"""How a ragged all-gather moves its rows: the strategies and the choice between them.

``funcoll.gather`` (and every op built on the ragged all-gather) takes a
`strategy`:

- ``"a2a"``: one all_to_all_single that sends every rank's rows to every rank.
  Exactly the rows travel (no padding) and the result is the collective's
  output as it comes, but the input is the rows repeated ``world`` times (a
  local copy of ``world * sizes[rank]`` rows). One collective after the size
  exchange: the floor for sizes that must be exchanged.
- ``"pad"``: pad every rank's rows to ``max(sizes)``, one all_gather, cut the
  padding out (``_rows.cut_padding``). One collective too, but the padding
  travels; with equal sizes it is the even all_gather itself (no copies).
- ``"shift"``: the rows every rank has (``min(sizes)``) in one all_gather, the
  rest in ``world - 1`` shifted all_to_all_singles, the k-th sending this rank's
  rows to rank ``rank + k``: no padding and no copy to send, but ``world``
  collectives, whose latencies add up on small messages.
- ``"auto"``: ``"a2a"`` up to :data:`AUTO_A2A_MAX_WORLD` ranks, ``"pad"`` past it.

Every choice here is static: it depends on the strategy argument and the world
size alone, never on the sizes, so every rank, eager or compiled, issues the same
collectives (eager code may skip local copies that equal sizes make needless,
never a collective). A choice by message size would need the sizes, which a
compiled graph holds as unbacked symbols it cannot branch on. The primitives
that carry the strategies out are ``_prims.gather_rows`` and
``_prims.gather_pieces``; docs/benchmarks.md has their measured costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import IntLike
from ._sym import min_of

STRATEGIES = ("auto", "pad", "a2a", "shift")  # a header carries the index: append only

# Past this many ranks "auto" pads. The all_to_all of "a2a" returns a length that
# a compiled graph holds as the sum of `world` unbacked sizes, which the
# partitioner re-evaluates for every node of the backward (over a minute at 1024
# ranks, against seconds for the padded layout, whose length is one symbol read
# off the size table); its input is also `world` copies of the rows. A static
# choice, from the world size alone, so every rank makes the same one.
AUTO_A2A_MAX_WORLD = 64


def resolve(strategy: str, size: int) -> str:
    """The strategy that runs at `size` ranks: "auto" is "a2a", or "pad" past AUTO_A2A_MAX_WORLD ranks."""
    if strategy == "auto":
        return "a2a" if size <= AUTO_A2A_MAX_WORLD else "pad"
    return strategy


def common_rows(sizes: Sequence[IntLike], smallest: IntLike | None) -> IntLike:
    """How many of every rank's first rows go in the all_gather of ``"shift"``: ``min(sizes)``.

    `smallest` is that minimum when the caller read it off the size table.
    """
    return min_of(*sizes) if smallest is None else smallest


def all_equal(sizes: Sequence[IntLike]) -> bool:
    """Every rank has the same length, known in eager code: the local copies can be skipped.

    Only ever True in eager mode, where sizes are ints; in a compiled graph they
    are unbacked SymInts and the general path runs. Either way the collectives
    issued are the same: only local copies are skipped.
    """
    return not torch.compiler.is_compiling() and len(set(sizes)) == 1
