"""Every public op compiles into one graph, forward and backward, and computes what eager does.

For each case of ``_ops.CASES`` on 2 real gloo ranks, every rank runs the op eagerly
and under ``torch.compile(fullgraph=True, backend="aot_eager")`` with ``dynamic``
None, True and False (on 3 ranks: None), then the backward of a seeded loss. The compiled
outputs and input gradients must equal the eager ones and the single-process
reference. ``torch._dynamo.explain`` (which compiles without fullgraph, the case
where a ``.tolist()`` can break the graph) must report no graph break.

A smaller set of cases also goes through the inductor backend (CPU) on 2 ranks.

All cases of one world run in one ``run_ranks`` call (``_ops.run_batch``) and the
tests read its results; cases with a known funcoll bug run in calls of their own.
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
    KNOWN_BUGS,
    STOPPED,
    OpCase,
    has_error,
    reference_grads,
    reference_outputs,
    run_batch,
    run_case,
)

# world -> (the `dynamic` settings compiled, whether explain runs). World 3 compiles
# with the default setting only, to keep this file within its time budget: the
# three settings and explain differ in how shapes are traced, which world 2 covers.
GRID: dict[int, tuple[tuple[bool | None, ...], bool]] = {
    2: ((None, True, False), True),
    3: ((None,), False),
}
KNOWN_BUG_TIMEOUT_S = 30.0  # a known bug's batch alone: ample for one case's compiles, short if it hangs
INDUCTOR_WORLD = 2
INDUCTOR_CASES = (
    "all_gather-x3x5-dim0",
    "reduce_scatter-x2wx5-dim0",
    "all_to_all-x2x3x2wx5-scatter2-gather1",
    "gather-auto-ragged-x_nx5-dim0",
    "all_to_all_v-recv-exchanged-x_nx5",
)


def _compile_and_run(
    rank: int, world: int, case_id: str, backend: str, dynamics: tuple[bool | None, ...], explain: bool
) -> dict[Any, Any]:
    """One rank, one case: eagerly, compiled per `dynamics`, and (optionally) under explain."""
    case = CASES_BY_ID[case_id]
    res: dict[Any, Any] = {"eager": run_case(case, rank, world)}
    for d in dynamics:
        if has_error(res):
            return res  # stop at the first error: the ranks may be out of step
        torch._dynamo.reset()  # one step function recompiled per case would trip the recompile limit
        compiled = torch.compile(case.call, fullgraph=True, backend=backend, dynamic=d)
        res[("compiled", d)] = run_case(case, rank, world, compiled)
    if explain and not has_error(res):
        torch._dynamo.reset()
        try:
            res["graph_breaks"] = torch._dynamo.explain(case.call)(
                *case.inputs(rank, world)
            ).graph_break_count
        except Exception:  # noqa: BLE001 -- reported by the explain test
            res["graph_breaks"] = {"error": traceback.format_exc(limit=-8)}
    torch._dynamo.reset()
    return res


def _cases_for(world: int) -> list[OpCase]:
    return [c for c in CASES if world >= c.min_world]


@functools.cache
def _results(
    world: int, case_ids: tuple[str, ...], backend: str, dynamics: tuple, explain: bool, timeout: float = 400
) -> list[dict]:
    return run_batch(_compile_and_run, world, case_ids, backend, dynamics, explain, timeout=timeout)


def _aot_eager_results(world: int, case: OpCase) -> list[dict]:
    """The batch that holds `case`: all sound cases of the world together, a known bug alone.

    A known bug may hang its ranks until the timeout: its batch gets a short one.
    """
    if case.id in KNOWN_BUGS:
        return _results(world, (case.id,), "aot_eager", *GRID[world], timeout=KNOWN_BUG_TIMEOUT_S)
    batch = tuple(c.id for c in _cases_for(world) if c.id not in KNOWN_BUGS)
    return _results(world, batch, "aot_eager", *GRID[world])


def _inductor_results() -> list[dict]:
    return _results(INDUCTOR_WORLD, INDUCTOR_CASES, "inductor", (None,), False)


def _lookup(per_rank: dict, rank: int, case: OpCase, key: Any) -> Any:
    if case.id not in per_rank:
        pytest.fail(f"rank {rank}: not run, the batch stopped before this case: {per_rank.get(STOPPED)}")
    res = per_rank[case.id]
    if key not in res:
        errors = [f"{k}:\n{v['error']}" for k, v in res.items() if isinstance(v, dict) and "error" in v]
        pytest.fail(f"rank {rank}: {key} not run, an earlier step of this case raised: {errors}")
    return res[key]


def _check_run(got: dict, want_outputs: list, want_grads: list | None, what: str) -> None:
    if "error" in got:
        pytest.fail(f"{what} raised:\n{got['error']}")
    assert len(got["outputs"]) == len(want_outputs), f"{what}: {len(got['outputs'])} outputs"
    for k, (o, w) in enumerate(zip(got["outputs"], want_outputs, strict=True)):
        if w is None:
            assert o is None, f"{what}: output {k} should be None"
        else:
            torch.testing.assert_close(
                o, w, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{what}: output {k}: {m}"
            )
    if want_grads is None:
        return
    assert len(got["grads"]) == len(want_grads), f"{what}: {len(got['grads'])} gradients"
    for k, (g, w) in enumerate(zip(got["grads"], want_grads, strict=True)):
        assert g is not None, f"{what}: input {k} got no gradient"
        torch.testing.assert_close(
            g, w, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{what}: grad of input {k}: {m}"
        )


def _check_case(results: list[dict], case: OpCase, world: int, key: Any) -> None:
    ref_out = reference_outputs(case, world)
    ref_grads = reference_grads(case, world) if case.grad != "none" else [None] * world
    for rank, per_rank in enumerate(results):
        eager = _lookup(per_rank, rank, case, "eager")
        # eager against the reference first, so that an op bug is told apart from a compile bug
        _check_run(eager, ref_out[rank], ref_grads[rank], f"rank {rank} eager vs reference")
        got = _lookup(per_rank, rank, case, key)
        _check_run(
            got,
            eager["outputs"],
            eager["grads"] if ref_grads[rank] is not None else None,
            f"rank {rank} compiled vs eager",
        )
        _check_run(got, ref_out[rank], ref_grads[rank], f"rank {rank} compiled vs reference")


def _xfail_known(case: OpCase) -> list:
    return [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[case.id])] if case.id in KNOWN_BUGS else []


def _params() -> list:
    return [
        pytest.param(world, case, d, id=f"w{world}-{case.id}-dynamic={d}", marks=_xfail_known(case))
        for world, (dynamics, _) in GRID.items()
        for case in _cases_for(world)
        for d in dynamics
    ]


@pytest.mark.parametrize(("world", "case", "dynamic"), _params())
def test_aot_eager_fullgraph_matches_eager_and_reference(
    world: int, case: OpCase, dynamic: bool | None
) -> None:
    _check_case(_aot_eager_results(world, case), case, world, ("compiled", dynamic))


def _explain_params() -> list:
    return [
        pytest.param(world, case, id=f"w{world}-{case.id}", marks=_xfail_known(case))
        for world, (_, explain) in GRID.items()
        if explain
        for case in _cases_for(world)
    ]


@pytest.mark.parametrize(("world", "case"), _explain_params())
def test_explain_reports_no_graph_break(world: int, case: OpCase) -> None:
    for rank, per_rank in enumerate(_aot_eager_results(world, case)):
        breaks = _lookup(per_rank, rank, case, "graph_breaks")
        if isinstance(breaks, dict):
            pytest.fail(f"rank {rank}: explain raised:\n{breaks['error']}")
        assert breaks == 0, f"rank {rank}: {breaks} graph breaks"


@pytest.mark.parametrize(
    "case", [CASES_BY_ID[c] for c in INDUCTOR_CASES], ids=lambda c: f"w{INDUCTOR_WORLD}-{c.id}"
)
def test_inductor_matches_eager_and_reference(case: OpCase) -> None:
    _check_case(_inductor_results(), case, INDUCTOR_WORLD, ("compiled", None))
