"""Hypothesis property tests of every public op that ``tests/test_ragged.py`` does not draw.

Drawn per world size (1 to 4 ranks), per op (``tests/_cases.py`` holds the drawers and the
references):

* ``all_gather`` (tiled or stacked, any dim, negative too, 0-d inputs) and
  ``all_gather_into_tensor``;
* ``reduce_scatter`` (even, tiled or not, every reduce op) and ``all_reduce`` (every op), in
  float64/32/16, bfloat16, int64, int32, bool and complex64 (sum), on small integers so the
  reductions are exact in every dtype;
* ``all_to_all``: any scatter/gather dims (equal ones too), even, ``tensor_split``-uneven or
  ``scatter_sizes``-uneven scatter, and per-rank ``gather_sizes``;
* ``ppermute`` with random permutations, partial ones included (some ranks receive zeros),
  and ``broadcast`` from any src;
* ``reduce`` onto any dst with every reduce op (zeros on the other ranks; the gradient of
  sum and avg is dst's, broadcast), and ``scatter`` from any src of random ragged pieces
  along any dim, the sizes given as a list or a tensor or left to ``split_sizes`` (the other
  ranks' lengths along `dim`, 0 included, unused);
* ``gather_padded`` (length as an int or a tensor) and ``all_to_all_padded`` (sizes as a list
  or a tensor), padding rows filled with random values that must never show;
* ``split_forward_gather_backward`` / ``gather_forward_split_backward`` with every
  `grad_scale` (None, "up", "down", 1.0) and `sizes` given or exchanged;
* ``from_ragged`` of ragged pieces into a DTensor, then ``to_ragged`` to other per-rank lengths;
* DTensor inputs on a 1-D mesh of every op that takes one (Shard/Partial/Replicate in, the
  placement the op's table gives out, uneven torch.chunk shards and empty ones included);
* ``funcoll.moe.dispatch`` then ``combine``, exact, static (a capacity of 0 to 4, or None)
  and dropless mode (a capacity of 0 to 4: static or exact), T of 0 to 4 tokens per rank, random routing, k of 1 or 2, 1 to 3 experts per rank,
  `align` 1 or 2, each expert scaling its rows: ``recv``, counts, offsets, dropped and the
  combined output, and the float64 gradients of the tokens and of the router weights (one
  input holds both, side by side);
* ``funcoll.lax`` over a 1-D mesh axis (``with funcoll.lax.mesh(m):``): ``psum``,
  ``all_gather`` (stacked or tiled, any axis), ``psum_scatter`` (tiled or not) and
  ``ppermute``, with JAX's semantics and transposes.

Shapes are random per rank, sizes 0 included; dtypes and layouts (contiguous, every other
element of the last dim, transposed) are drawn too. Every result, and every float64 gradient of
a seeded weighted loss, is compared with a reference computed in this process from every rank's
input, never with funcoll: ``torch.cat`` / ``torch.stack`` and a reduction / ``tensor_split`` /
a permutation of the inputs, and ``torch.autograd`` on that reference for the gradients (the
sum of all ranks' losses for adjoint backwards; the documented region-op and DTensor semantics
otherwise; see ``tests/_cases.py``). Data movement must match bitwise.

Cases are drawn with hypothesis in this process (``derandomize=True``, no database, no
deadline), then all cases of one world size run in ONE ``run_ranks`` call (a module-scoped
fixture); each test checks one (world, op) and prints the case that failed. No collective may
be left unwaited after a case (``funcoll.testing.in_flight()``). How many examples ran, per op
and world, shows in the "funcoll" section at the end of pytest's output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _cases import PROPERTY_OPS, Case, HypothesisDraw, check_all, draw_case, run_batch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from funcoll.testing import Ranks, start_ranks

WORLDS = (1, 2, 3, 4)
EXAMPLES = {1: 15, 2: 45, 3: 45, 4: 45}  # examples drawn per op and world size (the suite's time)
MIN_EXAMPLES = 1800  # the whole module, after duplicates are dropped
TIMEOUT = 180.0


def hypothesis_cases(op: str, world: int, n: int) -> list[Case]:
    """Draw `n` cases of `op` with hypothesis in this process (duplicates dropped), to run in one batch."""
    drawn: dict[Case, None] = {}

    @settings(
        max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(data=st.data())
    def collect(data: st.DataObject) -> None:
        drawn.setdefault(draw_case(op, world, HypothesisDraw(data.draw)), None)

    collect()
    return list(drawn)


class Batches:
    """Every drawn case of one world size, run on its ranks in one run_ranks call (cached).

    The first call starts every world's batch, side by side (``start_ranks``): ranks
    that wait in a collective leave a core to another world's (suite time).
    """

    def __init__(self) -> None:
        self._done: dict[int, dict[str, list[tuple[Case, list[dict[str, Any]]]]]] = {}
        self._started: dict[int, tuple[dict[str, list[Case]], Ranks]] = {}

    def cases(self, world: int) -> dict[str, list[Case]]:
        return {op: hypothesis_cases(op, world, EXAMPLES[world]) for op in PROPERTY_OPS}

    def _start(self, world: int) -> tuple[dict[str, list[Case]], Ranks]:
        by_op = self.cases(world)
        flat = [c for cases in by_op.values() for c in cases]
        return by_op, start_ranks(run_batch, world, flat, timeout=TIMEOUT)

    def results(self, world: int) -> dict[str, list[tuple[Case, list[dict[str, Any]]]]]:
        if not self._done and not self._started:
            self._started = {w: self._start(w) for w in WORLDS}
        if world not in self._done:
            by_op, handle = self._started.pop(world, None) or self._start(world)
            per_rank = handle.results()
            it: Iterator[int] = iter(range(sum(len(cases) for cases in by_op.values())))
            self._done[world] = {
                op: [(c, [ranks[i] for ranks in per_rank]) for c, i in zip(cases, it, strict=False)]
                for op, cases in by_op.items()
            }
        return self._done[world]


@pytest.fixture(scope="module")
def batches() -> Batches:
    return Batches()


PARAMS = [pytest.param(w, op, id=f"w{w}-{op}") for w in WORLDS for op in PROPERTY_OPS]


@pytest.mark.parametrize("world, op", PARAMS)
def test_matches_single_process_reference(batches: Batches, world: int, op: str) -> None:
    """Every drawn case of `op` on `world` ranks: outputs and float64 gradients equal the reference."""
    drawn = batches.results(world)[op]
    assert drawn, f"hypothesis drew no {op} case for world {world}"
    failures = []
    for case, ranks in drawn:
        try:
            check_all(case, ranks)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, (
        f"{len(failures)} of {len(drawn)} {op} cases differ from the reference; the first:\n"
        + ("\n\n".join(failures[:3]))
    )


def test_example_count(batches: Batches, report: Callable[[str], None]) -> None:
    """How many examples ran, per op and world (in the report); every op drew several in every world."""
    counts = {w: {op: len(cases) for op, cases in batches.results(w).items()} for w in WORLDS}
    total = sum(sum(c.values()) for c in counts.values())
    report(f"test_properties: {total} examples ({len(PROPERTY_OPS)} ops x worlds {WORLDS})")
    for op in PROPERTY_OPS:
        report(f"  {op:32s} " + "  ".join(f"w{w}={counts[w][op]:3d}" for w in WORLDS))
    for w in WORLDS:
        for op, n in counts[w].items():
            assert n >= EXAMPLES[w] // 2, f"only {n} distinct {op} examples on world {w}"
    assert total >= MIN_EXAMPLES, f"only {total} examples"
