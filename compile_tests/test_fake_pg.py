"""Graph structure at world sizes no machine here has: 64, 256 and 1024 ranks on the fake process group.

The fake backend (``torch.testing._internal.distributed.fake_pg``) lets one process
join a group of any size; its collectives return garbage, so these tests only trace.
Each case is traced by ``_ops.trace_graphs``: an AOTAutograd backend whose
partitioner (the min-cut one aot_eager and inductor use) records the forward and
backward graphs and whose compiled forward raises instead of running. Nothing
executes, so garbage never reaches the ragged ops' size checks.

Checked per graph: which ``_c10d_functional`` collectives appear and how many (every
one with its ``wait_tensor``), that each carries the group's size (``group_size ==
W``, all_to_all_single split lists of length W) and the group's name, and that
all_gather's output holds W blocks. Each traced rank of each world size runs in a
subprocess of its own, all at once (``run_ranks`` with one child per traced rank,
``CHILDREN``, each of which then replaces its group by a fake one of W ranks).

Every op is traced forward and backward at 64, 256 or 1024 ranks (the 2 to 4 of
the other tests are real ranks). At 1024 ranks, every case that exchanges no sizes
and takes no per-rank list: the even ops and the padded ones; at 256 the ops given
a size or a pair per rank (ppermute's pairs, the ragged ops given their sizes: 256
unbacked symbols); at 64 the others, all_to_all with uneven heads among them (W
received pieces, each of its own width). An op that exchanges sizes traces
1024 unbacked sizes, and the partitioner re-evaluates their sums for every node:
30 to 90 seconds an op at 1024, a tenth of that at 256. Their graphs' structure does
not change past 64 ranks but for the ragged gather's "auto", which is one
all_to_all up to 64 ranks and pads past them: it is traced at 256.

Ranks whose local shapes differ issue the same collectives at 64 ranks too: ranks
1 and 63 (0 and 3 rows along the ragged dim; 63 is the root of the ``-last`` cases)
trace every case but the ragged gather's "shift" (one collective per rank, compared
on real ranks only), each in a child of its own, and
:func:`funcoll.testing.collective_mismatch` compares their forward graphs and their
backward graphs (test_rank_shapes does the same on real ranks, where it also pairs
all_to_all's splits, which needs every rank's graph). Rank 1's graphs are also those
whose structure is checked at 64 ranks (rank 0's at 256 and 1024).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch.distributed as dist
from _ops import (
    A2A,
    AG,
    CASES,
    CASES_BY_ID,
    COLLECTIVE_PREFIX,
    KNOWN_BUGS,
    RS,
    WAIT,
    OpCase,
    collective_counts,
    expected_collectives,
    trace_graphs,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from funcoll.testing import collective_mismatch, group_of, run_ranks

# The cases marked `at_scale` in _ops.CASES: one or two per op and argument set.
_ALL = tuple(c.id for c in CASES if c.at_scale)
# world -> {case id: trace the backward too}
_AUTO = "gather-auto-ragged-x_nx5-dim0"
# The uneven heads split what arrives into 1024 pieces of different widths.
_HEADS = "all_to_all-x2x2w+1xH_rx3-uneven-heads-scatter1-gather2"
_AT_1024 = tuple(c for c in _ALL if not CASES_BY_ID[c].exchanges_sizes and c != _HEADS)
# The ops given per-rank sizes or pairs (a list of W entries, each its own symbol or
# constant) trace at 256: at 1024 they took 5 to 10 s each (suite time).
_PER_RANK = (
    "ppermute-ring-x3x5",
    "all_to_all_v-recv-given-x_nx5",
    "reduce_scatter-ragged-sizes-dim0",
    "scatter-given-x3x_n-dim-1",
)
PLAN: dict[int, dict[str, bool]] = {
    64: {c: True for c in _ALL if c not in _AT_1024},  # the rest trace at 256 and 1024
    256: {_AUTO: True, **dict.fromkeys(_PER_RANK, True)},  # past 64 ranks, "auto" pads
    1024: {c: True for c in _AT_1024 if c not in _PER_RANK},
}


# ------------------------------------------------------ ranks with other local shapes
# Two ranks of 64 with 0 and 3 rows along the ragged dim (_ops.ragged_sizes), each
# tracing on its own: their graphs must issue the same collectives (op, group, the sizes
# the graph knows), forward and backward, as the 2 to 3 real ranks of test_rank_shapes do.
# What all_to_all's splits pair with needs every rank's graph: the real ranks check it.
SHAPE_WORLD = 64
# Rank 0 (1 row, the root of the src0/dst0 cases) meets the others on 2 and 3 real ranks
# there. The first of these traces PLAN[64] for the structure tests too (suite time).
SHAPE_RANKS = (1, 63)
# Traced by the first shape rank only (for the structure tests): "shift" issues a
# collective per rank, 16 s a shape rank at 64 (suite time), and its ranks with 0 and 3
# rows are compared on 2 and 3 real ranks in test_rank_shapes.
_FIRST_SHAPE_RANK_ONLY = ("gather-shift-ragged-x_nx5-dim0",)
# What each run_ranks child traces: (world, rank); the shape ranks first, then PLAN's other worlds.
CHILDREN = (*((SHAPE_WORLD, r) for r in SHAPE_RANKS), *((w, 0) for w in PLAN if w != SHAPE_WORLD))


def _trace_on_fake_group(child: int, world: int) -> dict:
    """In run_ranks child `child`: swap its group for a fake one as ``CHILDREN[child]`` and trace.

    A shape rank traces every ``at_scale`` case, forward and backward; the others
    their world's plan.
    """
    fake_world, fake_rank = CHILDREN[child]
    plan = dict.fromkeys(_ALL, True) if fake_world == SHAPE_WORLD else PLAN[fake_world]
    if fake_world == SHAPE_WORLD and fake_rank != SHAPE_RANKS[0]:
        plan = {c: bw for c, bw in plan.items() if c not in _FIRST_SHAPE_RANK_ONLY}
    plan = {c: bw for c, bw in plan.items() if c not in KNOWN_BUGS}
    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=fake_rank, world_size=fake_world)
    try:
        group_name = dist.group.WORLD.group_name
        return {
            "group_name": group_name,
            **{
                cid: trace_graphs(CASES_BY_ID[cid], fake_rank, fake_world, backward)
                for cid, backward in plan.items()
            },
        }
    finally:
        dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)  # for run_ranks to destroy


@functools.cache
def _all_traces() -> list[dict[str, Any]]:
    # One child per (world, rank) of CHILDREN, all at once: each traces on its own, so they
    # share the machine's cores (the two shape ranks of 64, the longest, beside the others).
    return run_ranks(_trace_on_fake_group, len(CHILDREN), backend="fake", timeout=600)


def _traces(fake_world: int) -> dict[str, Any]:
    """What rank 0 of a fake group of `fake_world` traced; at 64, rank 1 (the first shape rank)."""
    rank = SHAPE_RANKS[0] if fake_world == SHAPE_WORLD else 0
    return _all_traces()[CHILDREN.index((fake_world, rank))]


def _params() -> list:
    return [
        pytest.param(world, CASES_BY_ID[cid], backward, id=f"w{world}-{cid}-{'fw+bw' if backward else 'fw'}")
        for world, plan in PLAN.items()
        for cid, backward in plan.items()
        if cid not in KNOWN_BUGS
    ]


def _check_args(call: dict[str, Any], world: int, group_name: str) -> str:
    """Check a collective's arguments; return the group name it runs under."""
    op, args = call["op"].split(".")[-1], call["args"]
    if op == AG:
        assert args[1] == world, f"{op} args {args[1:]}"
    elif op == RS:
        assert args[2] == world, f"{op} args {args[2:]}"
    elif op == A2A:
        assert len(args[1]) == world and len(args[2]) == world, (
            f"{op} split lists of {len(args[1])}, {len(args[2])}"
        )
    assert group_of(args[-1]) == group_name and args[-1] != group_name, f"{op} group {args[-1]}"
    return args[-1]


@pytest.mark.parametrize(("world", "case", "backward"), _params())
def test_trace_structure_at_world(world: int, case: OpCase, backward: bool) -> None:
    traced = _traces(world)
    got = traced[case.id]
    if "error" in got:
        pytest.fail(got["error"])
    want_fw, want_bw = expected_collectives(case.id, world)
    kinds = [("forward", got["graphs"]["fw"], want_fw)]
    if backward and case.grad != "none":
        kinds.append(("backward", got["graphs"]["bw"], want_bw))
    for kind, calls, want in kinds:
        counts = collective_counts(calls)
        waits = counts.pop(WAIT, 0)
        assert counts == want, f"{kind}: collectives {counts}, expected {want}"
        assert waits == sum(counts.values()), f"{kind}: {waits} waits for {counts}"
        names = [
            _check_args(call, world, traced["group_name"])
            for call in calls
            if call["op"].startswith(COLLECTIVE_PREFIX) and not call["op"].endswith(WAIT)
        ]
        assert len(set(names)) == len(names), (
            f"{kind}: collectives share a name, so a compiler may merge them: {names}"
        )


def test_all_gather_output_holds_one_block_per_rank() -> None:
    for world in (w for w, plan in PLAN.items() if "all_gather-x3x5-dim0" in plan):
        got = _traces(world)["all_gather-x3x5-dim0"]
        if "error" in got:
            pytest.fail(got["error"])
        gathers = [c for c in got["graphs"]["fw"] if c["op"].endswith(AG)]
        # x is (3, 5): the gathered tensor is (3 * world, 5), read off the traced node
        assert [c["out_shape"] for c in gathers] == [[3 * world, 5]], f"world {world}"


@functools.cache
def _rank_traces() -> list[dict[str, Any]]:
    """Each shape rank's traces: ``{case id: error or [forward, backward] collectives}``."""
    return [
        {cid: t.get("error") or t["collectives"] for cid, t in traces.items() if cid != "group_name"}
        for traces in _all_traces()[: len(SHAPE_RANKS)]
    ]


@pytest.mark.parametrize("cid", [c for c in _ALL if c not in KNOWN_BUGS and c not in _FIRST_SHAPE_RANK_ONLY])
def test_ranks_with_other_shapes_issue_the_same_collectives_at_64(cid: str) -> None:
    got = [traces[cid] for traces in _rank_traces()]
    errors = [f"rank {r}:\n{g}" for r, g in zip(SHAPE_RANKS, got, strict=True) if isinstance(g, str)]
    assert not errors, "\n".join(errors)
    assert [len(g) for g in got] == [len(got[0])] * len(got), "the ranks trace different numbers of graphs"
    assert any(got[0]), "no collective traced"
    for phase, name in enumerate(("forward", "backward")[: len(got[0])]):
        seqs = [[dataclasses.replace(c, send=None, recv=None) for c in g[phase]] for g in got]
        mismatch = collective_mismatch(seqs)
        assert mismatch is None, f"{name} (ranks {SHAPE_RANKS} of {SHAPE_WORLD}, as ranks 0, 1): {mismatch}"
