"""Every public op compiles into one graph, forward and backward, and computes what eager does.

For each case of ``_ops.CASES`` on 2 real gloo ranks, every rank runs the op eagerly
and under ``torch.compile(fullgraph=True, backend="aot_eager")`` with ``dynamic``
None (and True for the cases of :func:`_every_way`, but the ops that exchange sizes,
which inductor compiles with True), then the backward of a seeded
loss. The compiled outputs and input gradients must equal the eager ones and the
single-process reference. ``dynamic=False`` is not run: on a first call it traces
what ``None`` traces (static sizes, ``mark_dynamic``/``mark_unbacked`` honoured by
both). ``torch._dynamo.explain`` (which compiles without fullgraph, the case where
a ``.tolist()`` can break the graph) must report no graph break for every op that
reads exchanged sizes on the host; for the others a fullgraph compile is already
the proof.

With ``dynamic=None`` each case runs two steps, of which only the last rank's shape
changes (:func:`_recorded_steps`): on the second that rank alone compiles again, a
shape it sees for the first time, while its peers run what they compiled first. What
each rank compiled (AOT autograd's partitioned forward and backward graphs, as the
min-cut partitioner of aot_eager and inductor splits them) is recorded, and:

- the ranks' collectives pair up, forward and backward apart
  (:func:`funcoll.testing.collective_mismatch`: the same op and group at every
  position, the same shape, all_to_all splits that pair up): a rank whose graph
  holds other collectives, or the same in another order, deadlocks or corrupts data;
- the forward holds the op's ``_c10d_functional`` collectives and the backward their
  adjoints (all_gather <-> reduce_scatter_tensor, all_to_all_single <->
  all_to_all_single, broadcast -> all_reduce, the ragged gather ->
  all_to_all_single), as its spec declares them, each followed by a
  ``wait_tensor``, and no graph holds an in-place or ``out=`` collective or a
  ``torch.distributed`` call;
- an op that exchanges sizes holds funcoll's host-sync custom op (the one step that
  reads the size table) in its forward, and no other op holds one.

test_rank_shapes runs the same two steps at 3 ranks and on inductor.

The cases of :func:`_every_way` also go through the inductor backend (CPU here) on
2 ranks, with ``dynamic=None``, and ``True`` too for the ops that exchange sizes (the
others' symbolic shapes run on aot_eager): its results must match too, and the code inductor
generates (``run_and_get_code``) must call each collective the graph tests expect
(``_ops.EXPECTED_AT_2``), forward and backward, each followed by its
``wait_tensor``; ``FileCheck`` checks the order of the ragged gather's steps; and
the collectives each rank's code issues must pair with its peers' (test_rank_shapes
reads them the same way from the cases it compiles on inductor, and leaves these here).
The release matrix's smoke run (``_ops.SMOKE``) compiles every case on aot_eager
and one case per argument set (``at_scale``) on inductor. The ``at_scale`` cases
also compile on the "eager" backend (dynamo alone), whose gradients are the traced
autograd.Functions' own.

All cases of one world run in one ``run_ranks`` call (``_ops.run_batch``) and the
tests read its results; cases with a known funcoll bug run in calls of their own.
"""

from __future__ import annotations

import functools
import re
import traceback
from typing import Any

import pytest
import torch
from _ops import (
    A2A,
    AG,
    AR,
    CASES,
    CASES_BY_ID,
    EXPECTED_AT_2,
    KNOWN_BUGS,
    SMOKE,
    STOPPED,
    WAIT,
    OpCase,
    collective_counts,
    forbidden_calls,
    has_error,
    last_rank_shape_changes,
    last_rank_shifted,
    recording_backend,
    reference_grads,
    reference_outputs,
    run_batch,
    run_case,
    summarize_graph,
)
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from funcoll.testing import Collective, code_collectives, collective_mismatch

# world -> (the `dynamic` settings compiled, whether explain runs). One world, for the
# suite's time: an odd world size compiles in test_rank_shapes (the ops whose ranks hold
# different shapes at 3 ranks on aot_eager, the ragged ones on inductor too, where the
# "shift" gather's two all_to_all_singles must keep their order on every rank: two steps,
# values against the reference), in test_recompiles (every ragged op at 3 ranks) and
# test_training (a sequence-parallel loop on 3 ranks); every op's values at 1 to 4 ranks
# are the eager tests' (tests/test_properties.py).
GRID: dict[int, tuple[tuple[bool | None, ...], bool]] = {
    2: ((None, True), True),
}
if SMOKE:  # the release matrix: every case, fewer variants (_ops.SMOKE)
    GRID = {2: ((None,), False)}
KNOWN_BUG_TIMEOUT_S = 30.0  # a known bug's batch alone: ample for one case's compiles, short if it hangs
INDUCTOR_WORLD = 2
INDUCTOR_DYNAMICS: tuple[bool | None, ...] = (None,) if SMOKE else (None, True)


def _every_way(case: OpCase) -> bool:
    """Whether `case` also compiles with ``dynamic=True`` (:func:`_aot_dynamics`), and on inductor.

    The ``at_scale`` cases (one or two per op and argument set) and those with a
    non-contiguous input (its strides reach the collective's layout): the suite's
    time. Every case compiles with ``dynamic=None`` on aot_eager, and symbolic
    sizes of every ragged op run in test_recompiles and test_rank_divergence.
    """
    return case.at_scale or not all(t.is_contiguous() for t in case.inputs(0, INDUCTOR_WORLD))


def _aot_dynamics(world: int, case: OpCase) -> tuple[bool | None, ...]:
    """``dynamic=None``; and ``True`` for the cases of :func:`_every_way` that inductor does not run so.

    An op that exchanges sizes compiles with ``dynamic=True`` on inductor
    (:func:`_inductor_dynamics`), whose AOT graphs are aot_eager's, lowered: the same
    values checked once there (suite time).
    """
    dynamics = GRID[world][0]
    if not _every_way(case) or (case.exchanges_sizes and True in _inductor_dynamics(case)):
        return tuple(d for d in dynamics if d is None)
    return dynamics


def _inductor_dynamics(case: OpCase) -> tuple[bool | None, ...]:
    """dynamic=True on inductor for the ops that exchange sizes only: the suite's time."""
    return INDUCTOR_DYNAMICS if case.exchanges_sizes else (None,)


def _compile_and_run(
    rank: int, world: int, case_id: str, backend: str, dynamics: tuple[bool | None, ...], explain: bool
) -> dict[Any, Any]:
    """One rank, one case: eagerly, compiled per `dynamics`, and (optionally) under explain."""
    case = CASES_BY_ID[case_id]
    res: dict[Any, Any] = {"eager": run_case(case, rank, world)}
    for d in dynamics:
        if d not in (_inductor_dynamics(case) if backend == "inductor" else _aot_dynamics(world, case)):
            continue
        if has_error(res):
            return res  # stop at the first error: the ranks may be out of step
        torch._dynamo.reset()  # one step function recompiled per case would trip the recompile limit
        if backend == "aot_eager" and d is None:  # compiles on its own recording backend
            res[("compiled", d)], res["graphs"] = _recorded_steps(case, rank, world)
            continue
        compiled = torch.compile(case.call, fullgraph=True, backend=backend, dynamic=d)
        if backend == "inductor":  # keep the generated code too
            try:
                res[("compiled", d)], res[("code", d)] = run_and_get_code(
                    lambda c=compiled: run_case(case, rank, world, c)
                )
            except Exception:  # noqa: BLE001 -- a failure to compile is reported by the tests
                res[("compiled", d)] = {"error": traceback.format_exc(limit=-8)}
        else:
            with torch.device("cpu"):  # as _recorded_steps runs
                res[("compiled", d)] = run_case(case, rank, world, compiled)
    if explain and case.exchanges_sizes and not has_error(res):
        torch._dynamo.reset()
        try:
            res["graph_breaks"] = torch._dynamo.explain(case.call)(
                *case.inputs(rank, world)
            ).graph_break_count
        except Exception:  # noqa: BLE001 -- reported by the explain test
            res["graph_breaks"] = {"error": traceback.format_exc(limit=-8)}
    torch._dynamo.reset()
    return res


def _recorded_steps(case: OpCase, rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``case.call`` on aot_eager, ``dynamic=None``, for two steps; its result and what it compiled.

    On the first step the last rank holds another length (``_ops.last_rank_shifted``):
    on the second it alone compiles again, a shape it sees for the first time (0
    rows at 2 ranks, which dynamo keeps static), while its peers run what they
    compiled first, as in a training loop. The result is the second step's. What it
    compiled is read from the graphs the second step ran (``recording_backend``:
    summarized calls, ``"fw"`` and ``"bw"``, and each one's collectives) and how
    many times dynamo compiled.

    Under a default device, as code written for ``torch.set_default_device("cuda")``
    runs: a torch function mode, under which dynamo inlines the Python of some Tensor
    methods (Tensor.unflatten's super() call it cannot trace). Inductor's batch runs
    without one.
    """
    calls: dict[str, Any] = {}
    collectives: list[list[Collective]] = []
    compiles: list[int] = []
    aot = recording_backend(calls, collectives=collectives)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiles.append(len(compiles))
        return aot(gm, example_inputs)

    compiled = torch.compile(case.call, fullgraph=True, backend=backend)
    with torch.device("cpu"):
        with last_rank_shifted():
            first = run_case(case, rank, world, compiled)
        result = first if "error" in first else run_case(case, rank, world, compiled)
    return result, {"calls": dict(calls), "collectives": list(collectives), "compiles": len(compiles)}


def _cases_for(world: int) -> list[OpCase]:
    return [c for c in CASES if world >= c.min_world]


def _inductor_cases() -> list[OpCase]:
    """The cases of :func:`_every_way`; in the release matrix's smoke run, the ``at_scale`` ones."""
    return [c for c in _cases_for(INDUCTOR_WORLD) if (c.at_scale if SMOKE else _every_way(c))]


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


def _inductor_results(case: OpCase) -> list[dict]:
    """Like :func:`_aot_eager_results`, compiled by inductor, with its code."""
    if case.id in KNOWN_BUGS:
        return _results(INDUCTOR_WORLD, (case.id,), "inductor", INDUCTOR_DYNAMICS, False, KNOWN_BUG_TIMEOUT_S)
    batch = tuple(c.id for c in _inductor_cases() if c.id not in KNOWN_BUGS)
    return _results(INDUCTOR_WORLD, batch, "inductor", INDUCTOR_DYNAMICS, False, timeout=900)


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
    assert got["in_flight"] == 0, f"{what}: {got['in_flight']} collectives left unwaited"
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
        for world in GRID
        for case in _cases_for(world)
        for d in _aot_dynamics(world, case)
    ]


@pytest.mark.parametrize(("world", "case", "dynamic"), _params())
def test_aot_eager_fullgraph_matches_eager_and_reference(
    world: int, case: OpCase, dynamic: bool | None
) -> None:
    _check_case(_aot_eager_results(world, case), case, world, ("compiled", dynamic))


def _aot_eager_graphs(case: OpCase) -> list[dict[str, Any]]:
    """Every rank's record of what its aot_eager step compiled (:func:`_recorded_steps`)."""
    per_rank = []
    for rank, results in enumerate(_aot_eager_results(2, case)):
        got = _lookup(results, rank, case, ("compiled", None))
        if "error" in got:
            pytest.fail(f"rank {rank}: the aot_eager run raised:\n{got['error']}")
        per_rank.append(_lookup(results, rank, case, "graphs"))
    return per_rank


def _graph_params() -> list:
    return [pytest.param(case, id=f"w2-{case.id}", marks=_xfail_known(case)) for case in _cases_for(2)]


@pytest.mark.parametrize("case", _graph_params())
def test_aot_eager_ranks_issue_the_same_collectives(case: OpCase) -> None:
    """The forward graphs' collectives pair up across ranks, and so do the backward graphs'.

    Each phase apart: a backward collective that one rank issues in its forward would
    pair with whatever collective its peers issue next (another layer's forward), not
    with their backward's. The same op and group at every position, the same shape
    where the op needs it, all_to_all splits that pair up
    (:func:`funcoll.testing.collective_mismatch`); read from the graphs the second
    step ran, on which the last rank alone compiled again.
    """
    per_rank = _aot_eager_graphs(case)
    phases = [len(g["collectives"]) for g in per_rank]
    assert phases == [1 if case.grad == "none" else 2] * len(per_rank), f"graphs per rank: {phases}"
    if last_rank_shape_changes(case, 2):
        assert per_rank[-1]["compiles"] == 2, f"the last rank compiled {per_rank[-1]['compiles']} times"
    for phase, name in enumerate(("forward", "backward")[: phases[0]]):
        mismatch = collective_mismatch([g["collectives"][phase] for g in per_rank])
        assert mismatch is None, f"{name}: {mismatch}"


def test_every_case_has_an_expectation() -> None:
    assert sorted(EXPECTED_AT_2) == sorted(c.id for c in CASES)


@pytest.mark.parametrize("case", _graph_params())
def test_graphs_hold_the_collectives_and_their_adjoints(case: OpCase) -> None:
    """The forward holds the op's collectives, the backward their adjoints, each waited on.

    As the op's spec declares them (``_ops.EXPECTED_AT_2``): all_gather <->
    reduce_scatter_tensor, all_to_all_single <-> all_to_all_single, broadcast ->
    all_reduce, the ragged gather -> all_to_all_single. No graph may hold an
    in-place or ``out=`` collective, nor a ``torch.distributed`` call.
    """
    want_fw, want_bw = EXPECTED_AT_2[case.id]
    for rank, graphs in enumerate(g["calls"] for g in _aot_eager_graphs(case)):
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


@pytest.mark.parametrize("case", _graph_params())
def test_host_sync_op_is_in_the_forward_iff_the_op_exchanges_sizes(case: OpCase) -> None:
    """An op that exchanges sizes reads the size table on the host once, in its forward; no other op does."""
    for rank, graphs in enumerate(g["calls"] for g in _aot_eager_graphs(case)):
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


def _explain_params() -> list:
    return [
        pytest.param(world, case, id=f"w{world}-{case.id}", marks=_xfail_known(case))
        for world, (_, explain) in GRID.items()
        if explain
        for case in _cases_for(world)
        if case.exchanges_sizes
    ]


@pytest.mark.parametrize(("world", "case"), _explain_params())
def test_explain_reports_no_graph_break(world: int, case: OpCase) -> None:
    for rank, per_rank in enumerate(_aot_eager_results(world, case)):
        breaks = _lookup(per_rank, rank, case, "graph_breaks")
        if isinstance(breaks, dict):
            pytest.fail(f"rank {rank}: explain raised:\n{breaks['error']}")
        assert breaks == 0, f"rank {rank}: {breaks} graph breaks"


def _inductor_params() -> list:
    return [
        pytest.param(case, d, id=f"w{INDUCTOR_WORLD}-{case.id}-dynamic={d}", marks=_xfail_known(case))
        for case in _inductor_cases()
        for d in _inductor_dynamics(case)
    ]


@pytest.mark.parametrize(("case", "dynamic"), _inductor_params())
def test_inductor_matches_eager_and_reference(case: OpCase, dynamic: bool | None) -> None:
    _check_case(_inductor_results(case), case, INDUCTOR_WORLD, ("compiled", dynamic))


def _eager_backend_params() -> list:
    return [
        pytest.param(case, id=f"w2-{case.id}", marks=_xfail_known(case))
        for case in _cases_for(2)
        if case.at_scale
    ]


@pytest.mark.parametrize("case", _eager_backend_params())
def test_eager_backend_matches_eager_and_reference(case: OpCase) -> None:
    """backend="eager" (dynamo alone, autograd as in eager code): the debugging backend.

    Its gradients come from the traced autograd.Functions themselves, not from AOT
    autograd: on torch 2.11 they were zero for every primitive until ``_issue.run``
    returned a view of ``wait_tensor``'s result (``_issue.ALIAS_WAIT``).
    """
    if case.id in KNOWN_BUGS:
        results = _results(2, (case.id,), "eager", (None,), False, timeout=KNOWN_BUG_TIMEOUT_S)
    else:
        batch = tuple(c.id for c in _cases_for(2) if c.at_scale and c.id not in KNOWN_BUGS)
        results = _results(2, batch, "eager", (None,), False)
    _check_case(results, case, 2, ("compiled", None))


# A collective called in inductor's code: ``torch.ops._c10d_functional.<op>.default(``.
# Inductor re-inplaces some (``all_reduce_``, ``broadcast_``) and may write into an
# ``_out`` buffer: both count as the functional op they replace.
_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\(")


def _code_collectives(code: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for op in _CALL.findall(line):
            op = op.removesuffix("_out").removesuffix("_")
            counts[op] = counts.get(op, 0) + 1
    return counts


def _inductor_code(case: OpCase, dynamic: bool | None) -> list[list[str]]:
    """Every rank's generated modules (forward, then backward) for `case`."""
    codes = []
    for rank, per_rank in enumerate(_inductor_results(case)):
        got = _lookup(per_rank, rank, case, ("compiled", dynamic))
        if "error" in got:
            pytest.fail(f"rank {rank}: the inductor run raised:\n{got['error']}")
        codes.append(per_rank[case.id][("code", dynamic)])
    return codes


@pytest.mark.parametrize(("case", "dynamic"), _inductor_params())
def test_inductor_code_calls_each_collective_and_waits(case: OpCase, dynamic: bool | None) -> None:
    want_fw, want_bw = EXPECTED_AT_2[case.id]
    for rank, modules in enumerate(_inductor_code(case, dynamic)):
        wants = [want_fw] if want_bw is None else [want_fw, want_bw]
        # A backward with no collective may need no generated module (inductor 2.15 writes none
        # for axis_index's): every module the case needs must be there, and no other.
        needed = len(wants) if wants[-1] else len(wants) - 1
        assert needed <= len(modules) <= len(wants), f"rank {rank}: {len(modules)} generated modules"
        for kind, code, want in zip(("forward", "backward"), modules, wants, strict=False):
            counts = _code_collectives(code)
            waits = counts.pop(WAIT, 0)
            assert counts == want, f"rank {rank} {kind}: collectives {counts}, expected {want}"
            assert waits == sum(counts.values()), f"rank {rank} {kind}: {waits} waits for {counts}"


@pytest.mark.parametrize(("case", "dynamic"), _inductor_params())
def test_inductor_ranks_issue_the_same_collectives(case: OpCase, dynamic: bool | None) -> None:
    """Each rank's generated code issues collectives that pair with its peers', forward and backward.

    Read from the code inductor wrote (:func:`funcoll.testing.code_collectives`): the
    same op, group and shape at every position, all_to_all splits that pair up.
    test_rank_shapes checks the same on the cases it compiles; these it leaves to
    this batch (suite time: one inductor compile each).
    """
    per_rank = [[code_collectives(code) for code in modules] for modules in _inductor_code(case, dynamic)]
    assert len({len(m) for m in per_rank}) == 1, f"generated modules per rank: {[len(m) for m in per_rank]}"
    for phase, name in enumerate(("forward", "backward")[: len(per_rank[0])]):
        mismatch = collective_mismatch([m[phase] for m in per_rank])
        assert mismatch is None, f"{name}: {mismatch}"


F = "torch.ops._c10d_functional."


@pytest.mark.parametrize("dynamic", INDUCTOR_DYNAMICS)
def test_inductor_code_ragged_gather_checks_sizes_then_moves_rows(dynamic: bool | None) -> None:
    for fw, bw in _inductor_code(CASES_BY_ID["gather-auto-ragged-x_nx5-dim0"], dynamic):
        (
            FileCheck()
            .check(f"{F}{AG}")  # the size header
            .check(f"{F}{WAIT}")
            .check("torch.ops.funcoll.")  # the host-sync op that reads the size table
            .check(f"{F}{A2A}")  # every rank's rows to every rank, in one all_to_all
            .check_not(f"{F}{AG}")
            .check(f"{F}{WAIT}")
            .run(fw)
        )
        FileCheck().check_count(f"{F}{A2A}.default(", 1, exactly=True).check(f"{F}{WAIT}").run(bw)


def test_code_collectives_reads_calls_and_not_comments() -> None:
    code = (
        "    # Original ATen: [_c10d_functional.all_reduce]\n"
        "    torch.ops._c10d_functional.all_reduce_.default(buf0, 'sum', '0')\n"
        "    assert_size_stride(buf1, (2, 3), (3, 1), 'torch.ops._c10d_functional.all_gather_into_tensor.default')\n"
        "    buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf2, 2, '0')\n"
        "    torch.ops._c10d_functional.wait_tensor.default(buf0)\n"
    )
    assert _code_collectives(code) == {AR: 1, AG: 1, WAIT: 1}
