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

Two ops also go through inductor, and ``FileCheck`` reads the generated code for the
collective and its wait.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any

import pytest
import torch
from _ops import (
    CASES,
    CASES_BY_ID,
    COLLECTIVE_PREFIX,
    KNOWN_BUGS,
    STOPPED,
    OpCase,
    collective_counts,
    forbidden_calls,
    run_batch,
    run_case,
    summarize_graph,
    trace_graphs,
)
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

WORLD = 2
AG, RS, AR = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"
A2A, BC, WAIT = "all_to_all_single", "broadcast", "wait_tensor"

# The collectives of each case at WORLD ranks: (forward, backward); backward None when
# no input requires grad. The ragged ops start with one header all_gather (the size
# exchange); a ragged all-gather ("auto"/"a2a") is one all_gather of the common rows
# plus one all_to_all_single of the rest, "pad" one all_gather of padded blocks.
RAGGED_GATHER = {AG: 2, A2A: 1}  # header + common rows + the rest
EXPECTED: dict[str, tuple[dict[str, int], dict[str, int] | None]] = {
    "all_gather-x3x5-dim0": ({AG: 1}, {RS: 1}),
    "all_gather-x3x5-dim1-noncontig": ({AG: 1}, {RS: 1}),
    "all_gather-untiled-x3x5-dim0": ({AG: 1}, {RS: 1}),
    "all_gather-untiled-x3x5-dim1": ({AG: 1}, {RS: 1}),
    "all_gather_into_tensor-x3x5": ({AG: 1}, {RS: 1}),
    "reduce_scatter-x2wx5-dim0": ({RS: 1}, {AG: 1}),
    "reduce_scatter-x3x2w-dim-1": ({RS: 1}, {AG: 1}),
    "reduce_scatter-ragged-sizes-dim0": ({AG: 1, A2A: 1}, {AG: 1, A2A: 1}),  # bw: ragged all-gather
    "all_reduce-x3x5": ({AR: 1}, {AR: 1}),
    "all_to_all-x2x3x2wx5-scatter2-gather1": ({A2A: 1}, {A2A: 1}),
    "all_to_all-x2w+1x3x5-uneven-scatter0-gather-1": ({A2A: 1}, {A2A: 1}),
    "ppermute-ring-x3x5": ({A2A: 1}, {A2A: 1}),
    "ppermute-first-to-last-x3x5": ({A2A: 1}, {A2A: 1}),
    "broadcast-src-last-x3x5": ({BC: 1}, {AR: 1}),
    "axis_index-axis_size-x3x5": ({}, {}),
    "split_forward_gather_backward-x2w+1x5-dim0": ({}, {AG: 1, A2A: 1}),
    "split_forward_gather_backward-x3x2w+1-dim-1-up": ({}, {AG: 1, A2A: 1}),
    "gather_forward_split_backward-ragged-x_nx5-dim0": (RAGGED_GATHER, {}),
    "gather_forward_split_backward-ragged-x3x_n-dim-1-down": (RAGGED_GATHER, {}),
    "gather-auto-ragged-x_nx5-dim0": (RAGGED_GATHER, {A2A: 1}),
    "gather-auto-ragged-x3x_n-dim-1-noncontig": (RAGGED_GATHER, {A2A: 1}),
    "gather-pad-ragged-x_nx5-dim0": ({AG: 2}, {RS: 1}),
    "gather-a2a-ragged-x_nx5-dim0": (RAGGED_GATHER, {A2A: 1}),
    "gather-dst0-ragged-x_nx5-dim0-nograd": ({AG: 1, A2A: 1}, None),
    "all_gather_list-ragged-x_nx5-dim0": (RAGGED_GATHER, {A2A: 1}),
    "all_gather_ragged-ragged-x3x_n-dim1": (RAGGED_GATHER, {A2A: 1}),
    "all_to_all_v-recv-exchanged-x_nx5": ({AG: 1, A2A: 1}, {A2A: 1}),
    "all_to_all_v-recv-given-x_nx5": ({A2A: 1}, {A2A: 1}),
    "compat.gather-ragged-x_nx5-dim0": (RAGGED_GATHER, {A2A: 1}),
    "compat.all_gather-ragged-1d": (RAGGED_GATHER, {A2A: 1}),
    "compat.all_gather_nd-ragged-x_nx2x3": (RAGGED_GATHER, {A2A: 1}),
    "compat.all_to_all-x2x3x2wx5": ({A2A: 1}, {A2A: 1}),
    "compat.split_forward_gather_backward-x2w+1x5-dim0": ({}, {AG: 1, A2A: 1}),
    "compat.gather_forward_split_backward-ragged-x_nx5-dim0": (RAGGED_GATHER, {}),
    "compat.all_gather_into_tensor-x3x5-out-allocated-inside": ({AG: 1}, {RS: 1}),
    "compat.all_gather_into_tensor-x3x5-out-buffer-input": ({AG: 1}, None),
}
INDUCTOR_CASES = ("all_gather-x3x5-dim0", "gather-auto-ragged-x_nx5-dim0")


def _capture(rank: int, world: int, case_id: str) -> dict[str, Any]:
    """One rank, one case: its AOT graphs (traced, not run), or the inductor run and its code."""
    if case_id.startswith("inductor:"):
        case = CASES_BY_ID[case_id.removeprefix("inductor:")]
        torch._dynamo.reset()
        compiled = torch.compile(case.call, fullgraph=True, backend="inductor")
        try:
            result, code = run_and_get_code(lambda: run_case(case, rank, world, compiled))
            return {"run": result, "code": code}
        except Exception:  # noqa: BLE001 -- reported by the inductor tests
            return {"run": {"error": traceback.format_exc(limit=-8)}, "code": []}
        finally:
            torch._dynamo.reset()
    return {"trace": trace_graphs(CASES_BY_ID[case_id], rank, world)}


@functools.cache
def _results() -> list[dict[str, Any]]:
    ids = [c.id for c in CASES] + [f"inductor:{c}" for c in INDUCTOR_CASES]
    return run_batch(_capture, WORLD, ids, timeout=300)


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
    assert sorted(EXPECTED) == sorted(c.id for c in CASES)


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
    want_fw, want_bw = EXPECTED[case.id]
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


def _inductor_code(case_id: str) -> list[list[str]]:
    codes = []
    for rank, res in enumerate(_results()):
        got = res.get(f"inductor:{case_id}")
        if got is None:
            pytest.fail(f"rank {rank}: inductor case not run, the batch stopped: {res.get(STOPPED)}")
        if "error" in got["run"]:
            pytest.fail(f"rank {rank}: inductor run raised:\n{got['run']['error']}")
        assert len(got["code"]) == 2, f"rank {rank}: {len(got['code'])} generated modules, expected fw and bw"
        codes.append(got["code"])
    return codes


F = "torch.ops._c10d_functional."


def test_inductor_code_all_gather_waits_and_backward_reduce_scatters() -> None:
    for fw, bw in _inductor_code("all_gather-x3x5-dim0"):
        FileCheck().check(f"{F}{AG}").check(f"{F}{WAIT}").check_not(f"{F}{RS}").run(fw)
        FileCheck().check(f"{F}{RS}").check(f"{F}{WAIT}").check_not(f"{F}{AG}").run(bw)


def test_inductor_code_ragged_gather_checks_sizes_then_moves_rows() -> None:
    for fw, bw in _inductor_code("gather-auto-ragged-x_nx5-dim0"):
        (
            FileCheck()
            .check(f"{F}{AG}")  # the size header
            .check(f"{F}{WAIT}")
            .check("torch.ops.funcoll.")  # the host-sync op that reads the size table
            .check(f"{F}{AG}")  # the rows every rank has
            .check(f"{F}{A2A}")  # the rest
            .check(f"{F}{WAIT}")
            .run(fw)
        )
        FileCheck().check_count(f"{F}{A2A}.default(", 1, exactly=True).check(f"{F}{WAIT}").run(bw)


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
