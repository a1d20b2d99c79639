"""Every rank issues the same collectives, whatever its local static shapes: the recorded sequences.

A program that does not mark its ragged lengths (``mark_ragged``) compiles one
static graph per rank per shape, each on its own: a rank that holds 0 rows traces
another graph than a rank that holds 4, and AOT autograd's partitioner and
inductor's passes run on each graph apart. funcoll's collectives must pair up all
the same, forward and backward: a collective that one rank issues and another
does not (or issues elsewhere in its step) is a backend abort on gloo and a hang
or garbage on NCCL.

Each case compiles a step (``fullgraph=True``) on every rank with that rank's
inputs and runs it forward and backward. The collectives each rank's graphs
issue are read from what runs: aot_eager's partitioned forward and backward
graphs, in node order; inductor's generated code, in the order of its ``call``
(after every pass, the overlap passes' moves included).
:func:`funcoll.testing.collective_mismatch` compares the ranks' sequences: the
same op and group at every position, the same shape where the op needs it, and
all_to_all splits that pair up. Three compilers: aot_eager; inductor; inductor
with its compute/communication overlap passes (sink waits, raise comms, reorder
compute), which move collectives and waits per graph.

The cases: every public op of ``_ops.CASES`` (their ragged inputs give one rank
0 rows at every world size, ``_ops.ragged_sizes``; at 3 ranks on aot_eager, and at
2 under inductor's overlap passes, the cases whose ranks hold different shapes, but
the ``compat`` functions and the wire formats, which issue their exact op's collectives; not
the even ops of ``ELSEWHERE``, one graph on every rank, compiled in test_fullgraph;
on inductor at 2 ranks, not the cases of ``FULLGRAPH_INDUCTOR``, whose generated code
test_fullgraph compares across ranks, nor those that run with the overlap passes there:
the passes reorder what plain inductor lowered, so a lowering that breaks the pairing
breaks it under them too, nor the ``compat`` functions that return their op's result
reshaped or listed (their ops compile here or there); on aot_eager at 2 ranks none: test_fullgraph
compiles every case there over the same two steps and compares the ranks' graphs),
run for two steps of which only the last rank's shape changes
(``_ops.last_rank_shifted``; on aot_eager every case, on inductor the
``INDUCTOR_CASES``, suite time): that rank alone compiles again on the second, with
a shape it sees for the first time (dynamic at 3 ranks, 0 rows at 2), and its graphs
must pair with those its peers compiled on the first (the even and padded ops take
one shape on every rank: theirs do not change); ``funcoll.moe`` dispatch and combine
in exact and static modes, with one rank routing 0 tokens on the second step, so
that it alone compiles a new graph while the others reuse theirs (the case that
failed: on that rank inductor's ``cat`` decomposition dropped the empty gradient,
and the partitioner moved combine's backward all_to_all into the forward graph); and
two independent ragged ops in one step, which nothing but the graph's order keeps in
step. These two run on aot_eager at 2 and 3 ranks, with the overlap passes at 2 and
on plain inductor at 3 (``STEP_COMPILERS``). Outputs and gradients are also compared
with the single-process reference.

With ``funcoll.set_checks(True)``, a program whose ranks do issue different
collectives (one rank drops a layer's output, so its backward skips that layer's)
raises the same ``ValueError`` on every rank, naming what each was about to issue.
(Programs whose ranks differ in what a user's code does around the ops, with the
same collectives: ``test_rank_programs.py``.)
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _ops import (
    CASES,
    CASES_BY_ID,
    STOPPED,
    Batch,
    OpCase,
    last_rank_shape_changes,
    last_rank_shifted,
    moe_step,
    reference_grads,
    reference_outputs,
    run_case,
    start_batch,
)
from test_fullgraph import _inductor_cases as fullgraph_inductor_cases  # compile_tests/, beside this file

import funcoll
from funcoll.testing import Collective, collective_mismatch, compiling, run_ranks

WORLDS = (2, 3)
COMPILERS = ("aot_eager", "inductor", "inductor-overlap")
# The cases whose backward builds its send buffers (padding, packing), each path once:
# inductor runs them at 3 ranks too (it compiles C++ kernels for each graph: suite time).
INDUCTOR_CASES = (
    "reduce_scatter-ragged-sizes-dim0",
    "all_to_all-x2x2w+1xH_rx3-uneven-heads-scatter1-gather2",
    "gather_forward_split_backward-ragged-x_nx5-dim0",
    "gather-auto-ragged-x_nx5-dim0",
    "gather-pad-ragged-x_nx5-dim0",
    "gather-shift-ragged-x_nx5-dim0",
    "all_gather_ragged-ragged-x3x_n-dim1",
    "all_to_all_v-recv-exchanged-x_nx5",
    "gather_padded-x4x5-dim0",
    "all_to_all_padded-xw3x5-dim0",
)
# Even ops whose graph is the same on every rank (one shape, no rank in the graph), so that
# every rank issues the same collectives by construction, and whose aot_eager and inductor
# runs are test_fullgraph's (against eager and the reference): not compiled here (suite time).
ELSEWHERE = (
    "all_gather-x3x5-dim0",
    "all_gather-x3x5-dim1-noncontig",
    "all_gather-untiled-x3x5-dim1",
    "all_gather-x3x5-dim0-wire-int8",
    "reduce_scatter-x2wx5-dim0",
    "reduce_scatter-x2wx5-dim0-wire-bf16",
    "all_reduce-x3x5",
)
# The cases test_fullgraph compiles on inductor at 2 ranks, one step each, and whose generated
# code's collectives it compares across ranks (test_inductor_ranks_issue_the_same_collectives):
# compiled here on inductor only where they take two steps (INDUCTOR_CASES; suite time).
FULLGRAPH_INDUCTOR = frozenset(c.id for c in fullgraph_inductor_cases()) - set(INDUCTOR_CASES)
# Dropless mode compiles as one of these (moe.Dropless runs the static graph, then exact on an overflow).
MOE_MODES = ("exact", "static")
# The MoE and pair steps: each compiler at one world at least (suite time). aot_eager at
# both; the overlap passes at 2 ranks, plain inductor at 3 (one rank routes no token at
# both). tests/test_torchtitan.py compiles torchtitan's MoE layer with funcoll's
# dispatcher on all three at 2 ranks, its collectives compared the same way.
STEP_COMPILERS = {2: ("aot_eager", "inductor-overlap"), 3: ("aot_eager", "inductor")}
TIMEOUT = 900.0


# ------------------------------------------------------------------------------- MoE
MOE_K, MOE_E_LOCAL, MOE_D = 2, 2, 4


def _moe_tokens(rank: int, world: int, first: bool = False) -> int:
    """Tokens a rank routes: the last rank none (on the first step, `first`, as many as the others)."""
    return 0 if rank == world - 1 and not first else 3 + 2 * rank


def _moe_inputs(rank: int, world: int, first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    t = _moe_tokens(rank, world, first)
    gen = torch.Generator().manual_seed(1000 * world + rank)
    x = torch.randn(t, MOE_D, generator=gen, dtype=torch.float64)
    experts = torch.arange(t).unsqueeze(1) * 3 + rank + torch.tensor([0, 1])
    return x, experts % (MOE_E_LOCAL * world)


def _moe_step(mode: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    # a capacity that drops pairs on the busiest rank: static mode's masks
    return moe_step(mode, 2 * MOE_K if mode != "exact" else None, MOE_E_LOCAL)


# Two independent ragged ops in one step: nothing orders their collectives but the graph's
# order, which inductor's overlap passes must keep the same on every rank.
def _pair_step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return funcoll.gather(x), funcoll.all_gather_ragged(x * 2)[0]


def _pair_input(rank: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 * world + rank)
    return torch.randn(_moe_tokens(rank, world), 3, generator=gen, dtype=torch.float64)


# ------------------------------------------------------------------------- rank side
def _compiled(fn: Callable[[], dict[str, Any]], graphs: list[list[Collective]]) -> dict[str, Any]:
    """Run `fn` (a compiled step, forward and backward; it compiles) and read its graphs' collectives."""
    try:
        result = fn()
    except Exception:  # noqa: BLE001 -- reported by the test, with the other ranks' errors
        return {"error": traceback.format_exc(limit=-8)}
    if "error" in result:
        return result
    return {"result": result, "graphs": list(graphs)}


def _one_case(rank: int, world: int, key: str) -> dict[str, Any]:
    compiler, case_id = key.split("|", 1)
    torch._dynamo.reset()
    with compiling(compiler) as (backend, graphs):
        if case_id.startswith("moe-"):
            step = torch.compile(_moe_step(case_id.removeprefix("moe-")), fullgraph=True, backend=backend)

            def moe() -> dict[str, Any]:
                # A first step where every rank routes tokens, then one where the last rank routes
                # none: that rank alone compiles a new graph (a shape it sees for the first
                # time), the others run the graphs they compiled first, as in a training loop.
                for first in (True, False):
                    x, idx = _moe_inputs(rank, world, first)
                    x.requires_grad_()
                    y = step(x, idx)
                    (y * 1.5).sum().backward()
                return {"outputs": [y.detach()], "grads": [x.grad]}

            run = _compiled(moe, graphs)
            if "graphs" in run:  # the graphs the second step ran: each rank's last forward and backward
                run["graphs"] = run["graphs"][-2:]
            return {"run": run}
        if case_id == "pair":
            pair = torch.compile(_pair_step, fullgraph=True, backend=backend)

            def both() -> dict[str, Any]:
                x = _pair_input(rank, world).requires_grad_()
                a, b = pair(x)
                (a.sum() + 3 * b.sum()).backward()
                return {"outputs": [a.detach(), b.detach()], "grads": [x.grad]}

            return {"run": _compiled(both, graphs)}
        case = CASES_BY_ID[case_id]
        fn = torch.compile(case.call, fullgraph=True, backend=backend)

        def two_steps() -> dict[str, Any]:
            # A first step in which the last rank holds another length: on the second it alone
            # sees a new static shape and compiles again (at 3 ranks with that dim dynamic, at 2
            # with 0 rows, a size dynamo keeps static); the others run what they compiled first.
            with last_rank_shifted():
                first = run_case(case, rank, world, fn)
            return first if "error" in first else run_case(case, rank, world, fn)

        def one_step() -> dict[str, Any]:
            return run_case(case, rank, world, fn)

        run = _compiled(two_steps if _two_steps(compiler, case_id) else one_step, graphs)
        if "graphs" in run:  # the graphs the second step ran: each rank's last forward (and backward)
            run["compiled"] = len(run["graphs"])
            run["graphs"] = run["graphs"][-_phases(case) :]
        return {"run": run}


def _phases(case: OpCase) -> int:
    """Graphs a step of `case` compiles: a forward, and a backward where an input needs a gradient."""
    return 1 if case.grad == "none" else 2


def _two_steps(compiler: str, case_id: str) -> bool:
    """Whether a case runs ``two_steps``: every case on aot_eager, ``INDUCTOR_CASES`` on inductor.

    Inductor compiles C++ kernels for each graph, and the last rank's second compile
    holds its peers at their next collective: the cases whose backward builds its send
    buffers take the second step there, each path once (suite time).
    """
    return compiler == "aot_eager" or case_id in INDUCTOR_CASES


def _shapes_differ(case: OpCase, world: int) -> bool:
    """Whether some rank's inputs have another shape than another's, on either step."""
    shapes = {tuple(tuple(t.shape) for t in case.inputs(r, world)) for r in range(world)}
    return len(shapes) > 1 or last_rank_shape_changes(case, world)


def _overlap_case(cid: str, differ: list[str]) -> bool:
    """Whether `cid` compiles with inductor's overlap passes (at 2 ranks): ranks of different shapes.

    The passes move collectives and waits within each graph; ranks that compile one
    graph (one shape, ``differ`` false) move them alike. A ``compat`` function calls the
    funcoll op of its own case, and a wire format changes a payload's dtype, not which
    collectives run (the ``-wire-`` cases): both run on aot_eager and plain inductor
    (suite time).
    """
    return cid in differ and not cid.startswith("compat.") and "-wire-" not in cid


def _thin_compat(cid: str) -> bool:
    """A ``compat`` function that returns what its funcoll op returns (reshaped or listed).

    Inductor lowers the op's graph, which the op's own case compiles on inductor: these
    run on aot_eager (test_fullgraph) and not on inductor (suite time). The
    ``all_gather_into_tensor`` ones write into an ``out=`` buffer, which inductor
    lowers its own way: they compile here.
    """
    return cid.startswith("compat.") and not cid.startswith("compat.all_gather_into_tensor")


def _keys(world: int) -> list[str]:
    ops = [c.id for c in CASES if c.min_world <= world and c.spec_name != "axis_index"]
    # The ops whose ranks hold different shapes; the others compile one graph, the same on
    # every rank. aot_eager: these at 3 ranks but the compat and wire cases (_overlap_case;
    # at 2 every op compiles in test_fullgraph, over the same two steps, its ranks' graphs
    # compared: suite time). Inductor: every op at 2 ranks (one of them with 0 rows) but
    # test_fullgraph's (FULLGRAPH_INDUCTOR), those with the overlap passes and the thin
    # compat functions (_thin_compat); at 3 the ops whose backward builds its send
    # buffers, where a third rank adds a nonzero length. Neither: ELSEWHERE. Inductor's
    # overlap passes: these at 2 ranks (_overlap_case). The MoE and pair steps:
    # STEP_COMPILERS.
    differ = [cid for cid in ops if _shapes_differ(CASES_BY_ID[cid], world)]
    keys = [f"aot_eager|{cid}" for cid in differ if world > 2 and _overlap_case(cid, differ)]
    overlap = [cid for cid in ops if world == 2 and _overlap_case(cid, differ)]
    inductor = (
        [c for c in ops if c not in FULLGRAPH_INDUCTOR and c not in overlap and not _thin_compat(c)]
        if world == 2
        else INDUCTOR_CASES
    )
    keys += [f"inductor|{cid}" for cid in inductor if cid not in ELSEWHERE]
    keys += [f"inductor-overlap|{cid}" for cid in overlap]
    keys += [f"{comp}|moe-{mode}" for comp in STEP_COMPILERS[world] for mode in MOE_MODES]
    keys += [f"{comp}|pair" for comp in STEP_COMPILERS[world]]
    return keys


_BATCHES: dict[int, Batch] = {}


def _batch(world: int) -> list[dict[str, Any]]:
    if not _BATCHES:  # every world's batch at once, side by side (suite time)
        _BATCHES.update({w: start_batch(_one_case, w, _keys(w), timeout=TIMEOUT) for w in WORLDS})
    return _BATCHES[world].results()


def _moe_reference(mode: str, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's (y, x.grad): its tokens scaled by the experts' 1 + e and the weights, dropped pairs zero."""
    capacity = 2 * MOE_K if mode == "static" else None
    sent = [[0] * world for _ in range(world)]
    out = []
    for r in range(world):
        x, idx = _moe_inputs(r, world)
        keep = torch.ones(idx.shape, dtype=torch.bool)
        if capacity is not None:  # static mode keeps each destination's first `capacity` pairs in token order
            for t in range(idx.shape[0]):
                for j in range(MOE_K):
                    dest = int(idx[t, j]) // MOE_E_LOCAL
                    keep[t, j] = sent[r][dest] < capacity
                    sent[r][dest] += 1
        scale = (1 + idx % MOE_E_LOCAL).to(x.dtype) * torch.tensor([0.5, 0.25], dtype=x.dtype) * keep
        factor = scale.sum(1, keepdim=True)
        out.append((x * factor, (1.5 * factor).expand_as(x)))
    return out


# -------------------------------------------------------------------------------- tests
def _params() -> list[Any]:
    return [
        pytest.param(world, key, id=f"w{world}-{key.replace('|', '-')}")
        for world in WORLDS
        for key in _keys(world)
    ]


@pytest.mark.parametrize(("world", "key"), _params())
def test_ranks_issue_the_same_collectives(world: int, key: str) -> None:
    per_rank = _batch(world)
    if any(key not in r for r in per_rank):
        pytest.fail(f"the batch stopped before {key}: {per_rank[0].get(STOPPED)}")
    runs = [r[key]["run"] for r in per_rank]
    errors = [f"rank {r}:\n{run['error']}" for r, run in enumerate(runs) if "error" in run]
    assert not errors, "\n".join(errors)
    # One forward and one backward graph on every rank (fullgraph), each checked apart: a
    # backward collective that one rank issues in its forward would pair with whatever
    # collective its peers issue next (another layer's forward), not with their backward's.
    case_id = key.split("|", 1)[1]
    op_case = CASES_BY_ID.get(case_id)
    phases = ("forward", "backward")[: 2 if op_case is None else _phases(op_case)]
    assert [len(run["graphs"]) for run in runs] == [len(phases)] * world, [len(run["graphs"]) for run in runs]
    two = op_case is not None and _two_steps(key.split("|", 1)[0], case_id)
    if two and last_rank_shape_changes(op_case, world):  # it compiled on both steps
        assert runs[-1]["compiled"] == 2 * len(phases), (
            f"the last rank compiled {runs[-1]['compiled']} graphs"
        )
    for phase, name in enumerate(phases):
        mismatch = collective_mismatch([run["graphs"][phase] for run in runs])
        assert mismatch is None, f"{name}: {mismatch}"
    assert any(runs[0]["graphs"]), "no collective recorded"
    if case_id.startswith("moe-"):
        for r, ((y, g), run) in enumerate(zip(_moe_reference(case_id[4:], world), runs, strict=True)):
            torch.testing.assert_close(run["result"]["outputs"][0], y, msg=lambda m, r=r: f"rank {r} y: {m}")
            torch.testing.assert_close(
                run["result"]["grads"][0], g, msg=lambda m, r=r: f"rank {r} x.grad: {m}"
            )
        return
    if case_id == "pair":  # each rank gets every rank's rows; the loss sums both outputs (1 and 3 * 2)
        xs = [_pair_input(r, world) for r in range(world)]
        for r, run in enumerate(runs):
            a, b = run["result"]["outputs"]
            torch.testing.assert_close(a, torch.cat(xs), msg=lambda m, r=r: f"rank {r} gather: {m}")
            torch.testing.assert_close(b, 2 * torch.cat(xs), msg=lambda m, r=r: f"rank {r} ragged: {m}")
            want = torch.full_like(xs[r], 7.0 * world)  # every rank's loss reads this rank's rows
            torch.testing.assert_close(
                run["result"]["grads"][0], want, msg=lambda m, r=r: f"rank {r} grad: {m}"
            )
        return
    case = CASES_BY_ID[case_id]
    outs = reference_outputs(case, world)
    grads = reference_grads(case, world) if case.grad != "none" else None
    for r, run in enumerate(runs):
        got = run["result"]
        for i, want in enumerate(outs[r]):
            if want is not None and got["outputs"][i] is not None:
                torch.testing.assert_close(
                    got["outputs"][i], want, msg=lambda m, r=r, i=i: f"rank {r} out {i}: {m}"
                )
        if grads is not None:
            for i, want in enumerate(grads[r]):
                torch.testing.assert_close(
                    got["grads"][i], want, msg=lambda m, r=r, i=i: f"rank {r} grad {i}: {m}"
                )


# ------------------------------------------------------------------- checks: an error
def _checked_mismatch(rank: int, world: int) -> str:
    funcoll.set_checks(True)
    layer = _moe_step("static")

    def step(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        y = layer(x, idx)
        return (x * 2).sum() if rank == 1 else y.sum()  # rank 1 drops the layer's output

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    x, idx = _moe_inputs(rank, world)
    x.requires_grad_()
    try:
        for _ in range(2):  # rank 1 runs no backward collective: it meets rank 0's with its next step
            compiled(x, idx).backward()
    except ValueError as e:
        return str(e)
    return "no error"


def test_the_ops_left_out_hold_one_shape_and_compile_every_way_in_test_fullgraph() -> None:
    from test_fullgraph import _every_way  # compile_tests/, beside this file

    for cid in ELSEWHERE:
        case = CASES_BY_ID[cid]
        assert not _shapes_differ(case, 2) and _every_way(case), cid


def test_checks_turn_a_mismatch_into_the_same_error_on_every_rank() -> None:
    """A program whose ranks issue different collectives: rank 1 drops a layer's output.

    Its backward then skips that layer's collectives, in eager code as in compiled.
    Without checks the ranks pair different collectives: gloo aborts or hangs (NCCL:
    hangs or garbage). With checks every rank raises the same ValueError.
    """
    errors = run_ranks(_checked_mismatch, 2, timeout=300.0, pg_timeout=120.0)
    assert errors[0].startswith("funcoll: ranks issue different collectives at the same point (rank 0: "), (
        errors[0]
    )
    assert "rank 1: " in errors[0], errors[0]
    assert errors[1] == errors[0], errors
