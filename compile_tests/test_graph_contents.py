"""What the compiled graphs hold: functional collectives, each one waited on, and the adjoint in the backward.

On 2 real gloo ranks every case of ``_ops.CASES`` is traced (``_ops.trace_graphs``:
the AOT forward and backward graphs as the min-cut partitioner of aot_eager and
inductor splits them, recorded and never run, so a bad graph cannot hang the run).
Every rank's graphs must issue the same collectives in the same order. The forward must
hold the op's ``_c10d_functional`` collectives, the backward the adjoint collective
(all_gather <-> reduce_scatter_tensor, all_to_all_single <-> all_to_all_single,
broadcast -> all_reduce, the ragged gather -> all_to_all_single), every collective
must be followed by a ``wait_tensor``, and no graph may hold an in-place or ``out=``
collective or a ``torch.distributed`` call. Ops that exchange sizes must hold
funcoll's host-sync custom op (the one step that reads the size table) in the
forward, and no other op may hold one.

What inductor generates for each case is checked in ``test_fullgraph.py``, next to
the inductor runs.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _ops import (
    CASES,
    CASES_BY_ID,
    COLLECTIVE_PREFIX,
    EXPECTED_AT_2,
    KNOWN_BUGS,
    STOPPED,
    WAIT,
    OpCase,
    collective_counts,
    forbidden_calls,
    run_batch,
    summarize_graph,
    trace_graphs,
)

WORLD = 2


def _capture(rank: int, world: int, case_id: str) -> dict[str, Any]:
    """One rank, one case: its AOT graphs, traced and never run."""
    return {"trace": trace_graphs(CASES_BY_ID[case_id], rank, world)}


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_batch(_capture, WORLD, [c.id for c in CASES], timeout=300)


def _graphs_of(case: OpCase) -> list[dict[str, Any]]:
    per_rank = []
    for rank, res in enumerate(_results()):
        if case.id not in res:
            pytest.fail(f"rank {rank}: not traced, the batch stopped before this case: {res.get(STOPPED)}")
        trace = res[case.id]["trace"]
        if "error" in trace:
            pytest.fail(f"rank {rank}: the trace raised:\n{trace['error']}")
        per_rank.append(trace["graphs"])
    return per_rank


def _params() -> list:
    return [
        pytest.param(
            case,
            id=f"w{WORLD}-{case.id}",
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[case.id])]
            if case.id in KNOWN_BUGS
            else [],
        )
        for case in CASES
    ]


def test_every_case_has_an_expectation() -> None:
    assert sorted(EXPECTED_AT_2) == sorted(c.id for c in CASES)


@pytest.mark.parametrize("case", _params())
def test_every_rank_issues_the_same_collectives(case: OpCase) -> None:
    # A rank whose graph holds other collectives, or the same in another order, than
    # another rank's deadlocks or corrupts data at run time.
    per_rank = _graphs_of(case)
    for kind in ("fw", "bw"):
        sequences = [
            [c["op"] for c in g.get(kind, []) if c["op"].startswith(COLLECTIVE_PREFIX)] for g in per_rank
        ]
        assert all(seq == sequences[0] for seq in sequences), f"{kind}: {sequences}"


@pytest.mark.parametrize("case", _params())
def test_graphs_hold_the_collectives_and_their_adjoints(case: OpCase) -> None:
    want_fw, want_bw = EXPECTED_AT_2[case.id]
    for rank, graphs in enumerate(_graphs_of(case)):
        assert ("bw" in graphs) == (want_bw is not None), f"rank {rank}: graphs {sorted(graphs)}"
        pairs = [("forward", graphs["fw"], want_fw)]
        if want_bw is not None:
            pairs.append(("backward", graphs["bw"], want_bw))
        for kind, calls, want in pairs:
            counts = collective_counts(calls)
            waits = counts.pop(WAIT, 0)
            assert counts == want, f"rank {rank} {kind}: collectives {counts}, expected {want}"
            assert waits == sum(counts.values()), f"rank {rank} {kind}: {waits} waits for {counts}"
            assert forbidden_calls(calls) == [], f"rank {rank} {kind}: in-place or torch.distributed calls"


def _funcoll_ops(calls: list[dict[str, Any]]) -> list[str]:
    return [call["op"] for call in calls if call["op"].startswith("funcoll.")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{WORLD}-{c.id}")
def test_host_sync_op_is_in_the_forward_iff_the_op_exchanges_sizes(case: OpCase) -> None:
    for rank, graphs in enumerate(_graphs_of(case)):
        fw_ops = _funcoll_ops(graphs["fw"])
        if case.exchanges_sizes:
            assert len(fw_ops) == 1, f"rank {rank}: funcoll custom ops in the forward: {fw_ops}"
        else:
            assert fw_ops == [], f"rank {rank}: an op without a size exchange holds {fw_ops}"
        assert _funcoll_ops(graphs.get("bw", [])) == [], (
            f"rank {rank}: the backward reads sizes on the host again"
        )


def test_forbidden_calls_flags_in_place_collectives_and_torch_distributed() -> None:
    # The graph checks above pass only if forbidden_calls can fire: show it what it must catch.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))  # allowed
    graph.call_function(torch.ops._c10d_functional.all_reduce_.default, (x, "sum", "0"))
    graph.call_function(
        torch.ops._c10d_functional.all_gather_into_tensor_out.default, (x, 2, "0"), {"out": x}
    )
    graph.call_function(torch.ops.c10d.allreduce_.default, (x,))
    graph.call_function(torch.distributed.all_reduce, (x,))
    assert forbidden_calls(summarize_graph(graph)) == [
        "_c10d_functional.all_reduce_",
        "_c10d_functional.all_gather_into_tensor_out",
        "c10d.allreduce_",
        "torch.distributed.distributed_c10d.all_reduce",
    ]
