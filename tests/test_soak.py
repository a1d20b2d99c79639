"""A short soak: a few hundred random collectives, eager and compiled, on 2, 3 and 4 ranks.

Each world size runs ONE ``run_ranks`` call of :func:`_cases.soak_rank`: the ranks draw the
same random sequence of cases (any public op, the ragged ones included: ``gather`` with every
strategy and with ``dst``, ``all_gather_list``, ``all_gather_ragged``, ``reduce_scatter`` with
``sizes=``, ``all_to_all_v``, and the even, static, region, DTensor, ``funcoll.moe`` and
``funcoll.lax`` ops of ``tests/test_properties.py``), sizes 0 included, random dims, dtypes
and layouts. About a quarter go through a compiled step (``torch.compile(fullgraph=True)``, aot_eager here, the
ragged dim marked with ``funcoll.mark_ragged``, float64 with gradients); each world compiles
three of the eight steps of ``_cases.COMPILED``, so all eight compile somewhere and the
compile time stays bounded.

Every result and float64 gradient is checked on the rank against the single-process
reference (computed there from every rank's input, never with funcoll), and no collective may
be left unwaited after a case (``funcoll.testing.in_flight()``) nor at the end. Each rank reads
its RSS after the warm-up (every compiled step called twice) and at the end: growth must stay
under 5%. Warnings are recorded on every rank: any Python warning that mentions funcoll, c10d,
gloo or torch.distributed fails, and so does any line the rank writes to its stderr (where
C++ code warns). Each rank compiles at most one graph per compiled step (``_cases.graph_bound``:
one more where a step's first call is empty on an inner marked dim, dynamo's documented
case). The figures appear in pytest's "funcoll" section.
``benchmarks/soak.py --long`` is the long version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _cases import COMPILED, SOAK_OPS, SoakPlan, graph_bound, soak_rank
from _inputs import rerun_once_on_abort

import funcoll
from funcoll.testing import run_ranks

WORLDS = (2, 3, 4)
COUNT = 250  # random collectives per world size
_NAMES = tuple(COMPILED)
PLANS = {
    w: SoakPlan(
        world=w,
        count=COUNT,
        seed=2024,
        compiled=_NAMES[3 * i : 3 * i + 3],
        backend="aot_eager",
        checks=w == 3,
    )
    for i, w in enumerate(WORLDS)
}
RSS_GROWTH_MAX = 0.05
TIMEOUT = 300.0

_RESULTS: dict[int, list[dict[str, Any]] | BaseException] = {}


def soak(world: int) -> list[dict[str, Any]]:
    """The world's soak, run once per session (a failure is cached and re-raised)."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = rerun_once_on_abort(
                lambda: run_ranks(soak_rank, world, PLANS[world], timeout=TIMEOUT)
            )
        except BaseException as e:  # noqa: BLE001 -- every test of this world reports it
            _RESULTS[world] = e
    got = _RESULTS[world]
    if isinstance(got, BaseException):
        raise RuntimeError(f"the world-{world} soak failed") from got
    return got


IDS = [f"w{w}" for w in WORLDS]


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_soak_matches_reference(world: int) -> None:
    for r, res in enumerate(soak(world)):
        assert res["collectives"] == COUNT, f"rank {r} ran {res['collectives']} of {COUNT}"
        assert res["n_failures"] == 0, f"rank {r}: {res['n_failures']} mismatches; the first:\n" + (
            "\n\n".join(res["failures"])
        )


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_soak_rss_growth(world: int) -> None:
    for r, res in enumerate(soak(world)):
        growth = res["rss_end"] / res["rss_start"] - 1
        assert growth < RSS_GROWTH_MAX, (
            f"rank {r}: RSS grew {100 * growth:.1f}% ({res['rss_start'] >> 20} -> {res['rss_end'] >> 20} MiB) "
            f"over {res['collectives']} collectives after the warm-up"
        )


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_soak_no_warnings(world: int) -> None:
    for r, res in enumerate(soak(world)):
        assert not res["warnings"], f"rank {r}: funcoll/c10d warnings:\n" + "\n".join(res["warnings"])
        assert not res["stderr"], f"rank {r} wrote to stderr:\n" + "\n".join(res["stderr"][:20])


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_soak_leaves_no_collective_in_flight(world: int) -> None:
    for r, res in enumerate(soak(world)):
        assert res["in_flight"] == 0, f"rank {r}: {res['in_flight']} collectives left unwaited at the end"


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_soak_compiles_one_graph_per_step(world: int, report: Callable[[str], None]) -> None:
    graphs = [res["graphs"] for res in soak(world)]
    bounds = [graph_bound(PLANS[world], r) for r in range(world)]
    report(f"test_soak w{world}: graphs per rank {graphs} (bound {bounds}) for {len(PLANS[world].compiled)} "
           f"compiled steps; RSS growth after warm-up "
           + ", ".join(f"{100 * (res['rss_end'] / res['rss_start'] - 1):+.1f}%" for res in soak(world)))  # fmt: skip
    for r, (n, bound) in enumerate(zip(graphs, bounds, strict=True)):
        assert 0 < n <= bound, f"rank {r} compiled {n} graphs for {bound} (steps {PLANS[world].compiled})"


def test_soak_covers_every_op(report: Callable[[str], None]) -> None:
    """Every op was drawn (eager) somewhere, and every compiled step ran; the counts show in the report."""
    seen: dict[str, int] = {}
    for w in WORLDS:
        for op, n in soak(w)[0]["counts"].items():
            seen[op] = seen.get(op, 0) + n
    report(f"test_soak: {sum(seen.values())} collectives on worlds {WORLDS}: {dict(sorted(seen.items()))}")
    assert set(SOAK_OPS) <= set(seen), f"never drawn: {sorted(set(SOAK_OPS) - set(seen))}"
    compiled = {f"{c.op}[compiled]" for c in COMPILED.values()}
    assert compiled <= set(seen), f"never compiled: {sorted(compiled - set(seen))}"


# ----------------------------------------------------------------------------- fixed bugs
def _ragged_reduce_scatter_small_ints(rank: int, world: int) -> list[tuple[torch.dtype, list[int]]]:
    out = []
    for dtype in (torch.int32, torch.int8, torch.uint8):  # gloo has no int16
        x = torch.tensor([1, 2, 3, 4], dtype=dtype)
        for op in ("sum", "product"):
            y = funcoll.reduce_scatter(x, 0, op=op, sizes=[3, 1])
            out.append((y.dtype, y.tolist()))
    return out


def test_ragged_reduce_scatter_keeps_small_integer_dtypes() -> None:
    """The ragged reduce_scatter reduced with Tensor.sum/prod, which promote small integers to int64."""
    # Both ranks hold [1, 2, 3, 4]: the sum is 2x, the product x**2; rank 0 keeps 3 rows, rank 1 one.
    want = {0: ([2, 4, 6], [1, 4, 9]), 1: ([8], [16])}
    for r, got in enumerate(run_ranks(_ragged_reduce_scatter_small_ints, 2, timeout=60)):
        for i, dtype in enumerate((torch.int32, torch.int8, torch.uint8)):
            for j, op in enumerate(("sum", "product")):
                assert got[2 * i + j] == (dtype, want[r][j]), f"rank {r}, {dtype}, {op}: {got[2 * i + j]}"
