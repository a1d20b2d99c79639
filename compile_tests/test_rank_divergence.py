"""Ranks that compile different graphs must still issue the same collectives.

Dynamo makes its shape decisions per process: it specializes lengths 0 and 1 into
static graphs, and marks a dim dynamic (automatic dynamic) only after that process
saw it change. With ragged inputs the ranks see different local lengths, so rank 0
may run a graph specialized to 0 rows while rank 3 runs one with a symbolic length.
funcoll's ragged ops must issue the same collective sequence in all those graphs
(the size exchange, then a fixed set of collectives), or the ranks would mismatch:
a gloo error, garbage, or a hang. ``run_ranks``' timeout turns a hang into a failure.

Each case is one compiled function per op and per ``dynamic=`` mode (None, on 3
ranks), called three times with lengths from {0, 1, 2, 7}
spread over the ranks and changed between calls, so that some ranks reuse a
graph while others compile a new one. Forward and input gradients (float64) are
compared with a single-process reference built from every rank's input, and a
check of the setup asserts that the ranks really traced graphs of different
shapes. Each (world, op) runs in its own ``run_ranks`` call.

``funcoll.moe`` dispatch and combine run too (exact mode, and static mode with a
capacity that drops nothing), on 3 ranks: each rank routes its tokens over every
rank's experts in its own pattern, and a rank with no tokens still joins every
collective of the others.

The mode ``"mixed"`` (on 2 ranks) runs the op eagerly on the even ranks and compiled on the
odd ones: a rank whose recompile limit is hit, or whose frame fell back after an
error, meets the others that way, so every choice an op makes (its strategy, the
copies it skips) must be the same in eager and compiled code.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _ops import moe_step
from torch import Tensor
from torch._dynamo.backends.registry import lookup_backend

import funcoll
from funcoll.testing import Ranks, start_ranks

TIMEOUT = 150.0
# The local lengths of each call (one row per call, one entry per rank).
LENGTHS: dict[int, list[list[int]]] = {
    2: [[1, 7], [0, 2], [7, 1]],
    3: [[0, 1, 7], [7, 0, 2], [2, 7, 1]],
}
# The `dynamic=` modes run per world. On world 3 the default (None) alone already
# mixes graphs specialized to 0 with symbolic ones within one call (the second: rank 0
# and 2 recompile symbolic, rank 1 specializes to 0), and in the third ranks 0 and 1
# reuse their symbolic graphs while rank 2 compiles one specialized to 1;
# world 2 runs "mixed" (eager and compiled ranks). dynamic=False is not among them:
# it compiles a static graph per length, which None does on every rank's first call
# and, for lengths 0 and 1, on later ones. Nor is True: it too specializes lengths 0
# and 1 (they are backed sizes) and makes the others symbolic from the first call,
# the same mix of graphs None reaches by its second call (the suite's time).
Mode = bool | str | None  # a dynamic= mode, or "mixed": even ranks eager, odd ranks compiled
DYNAMIC_MODES: dict[int, tuple[Mode, ...]] = {2: ("mixed",), 3: (None,)}
# A case that runs on 3 ranks only (moe) meets eager ranks there: no 2-rank run has it.
ONLY_AT_3_MODES: tuple[Mode, ...] = (None, "mixed")


def _prefixed(where: str) -> Callable[[str], str]:
    """An assert_close `msg` that says where the mismatch is."""
    return lambda message: f"{where}: {message}"


def _seed(*keys: int) -> int:
    seed = 29
    for k in keys:
        seed = (seed * 1_000_003 + k) % (1 << 62)
    return seed


def _send_matrix(lengths: list[int]) -> list[list[int]]:
    """all_to_all_v send sizes: rank r sends ceil(n/2) of its n rows to rank r+1, the rest to itself."""
    world = len(lengths)
    send = [[0] * world for _ in range(world)]
    for r, n in enumerate(lengths):
        send[r][(r + 1) % world] += (n + 1) // 2
        send[r][r] += n // 2
    return send


# ---------------------------------------------------------------------- the op cases
@dataclass(frozen=True)
class Case:
    """One ragged op: its compiled step, its inputs and its single-process reference."""

    name: str
    step: Callable[[Tensor, Any], Any]
    shape: Callable[[list[int], int], tuple[int, ...]]  # (lengths, rank) -> x.shape
    arg: Callable[[list[int], int], Any]  # (lengths, rank) -> the step's second argument
    reference: Callable[[list[Tensor], list[int]], list[Tensor | None]]  # -> each rank's y
    grad: bool = True
    worlds: tuple[int, ...] = tuple(LENGTHS)  # the world sizes it runs at


def _modes(world: int, case: Case) -> tuple[Mode, ...]:
    return ONLY_AT_3_MODES if case.worlds == (3,) else DYNAMIC_MODES[world]


def _no_arg(lengths: list[int], rank: int) -> None:
    return None


def _cat_everywhere(dim: int) -> Callable[[list[Tensor], list[int]], list[Tensor | None]]:
    return lambda xs, lengths: [torch.cat(xs, dim)] * len(xs)


def _gather_step(strategy: str, dim: int) -> Callable[[Tensor, Any], Tensor | None]:
    def step(x: Tensor, arg: None) -> Tensor | None:
        return funcoll.gather(x, dim, strategy=strategy)

    return step


def _gather_dst_step(x: Tensor, dst: int) -> Tensor | None:
    return funcoll.gather(x, 0, dst=dst)


def _gather_dst_reference(xs: list[Tensor], lengths: list[int]) -> list[Tensor | None]:
    dst = len(xs) - 1
    return [torch.cat(xs) if r == dst else None for r in range(len(xs))]


def _gather_given_step(x: Tensor, sizes: list[int]) -> Tensor | None:
    return funcoll.gather(x, 0, sizes=sizes)


def _all_gather_ragged_step(x: Tensor, arg: None) -> tuple[Tensor, Tensor]:
    return funcoll.all_gather_ragged(x, 0)


def _gfsb_step(x: Tensor, arg: None) -> Tensor:
    return funcoll.gather_forward_split_backward(x, None, 0)


def _gfsb_reference(xs: list[Tensor], lengths: list[int]) -> list[Tensor | None]:
    # The backward keeps this rank's slice of its own gradient: other ranks' pieces
    # enter rank r's output as constants.
    return [torch.cat([x if i == r else x.detach() for i, x in enumerate(xs)]) for r in range(len(xs))]


def _all_to_all_v_step(x: Tensor, send_sizes: Tensor) -> tuple[Tensor, Tensor]:
    return funcoll.all_to_all_v(x, send_sizes)


def _all_to_all_v_reference(xs: list[Tensor], lengths: list[int]) -> list[Tensor | None]:
    send = _send_matrix(lengths)
    world = len(xs)

    def block(i: int, r: int) -> Tensor:
        return xs[i][sum(send[i][:r]) : sum(send[i][: r + 1])]

    return [torch.cat([block(i, r) for i in range(world)]) for r in range(world)]


def _reduce_scatter_step(x: Tensor, sizes: list[int]) -> Tensor:
    return funcoll.reduce_scatter(x, 0, sizes=sizes)


def _reduce_scatter_reference(xs: list[Tensor], lengths: list[int]) -> list[Tensor | None]:
    total = sum(xs)
    offsets = [sum(lengths[:r]) for r in range(len(xs) + 1)]
    return [total[offsets[r] : offsets[r + 1]] for r in range(len(xs))]


MOE_K, MOE_E_LOCAL = 2, 2
MOE_CAPACITY = 2 * max(n for calls in LENGTHS.values() for ls in calls for n in ls)  # T * k: drops nothing


def _moe_routing(lengths: list[int], rank: int) -> Tensor:
    """(T, 2) expert ids of rank `rank`: every token a pair of distinct experts, every rank a different pattern."""
    n_experts = MOE_E_LOCAL * len(lengths)
    t = torch.arange(lengths[rank]).unsqueeze(1)
    return (3 * t + rank + torch.tensor([0, 1])) % n_experts


def _moe_step(mode: str) -> Callable[[Tensor, Any], Tensor]:
    return moe_step(mode, MOE_CAPACITY if mode == "static" else None, MOE_E_LOCAL)


def _moe_reference(xs: list[Tensor], lengths: list[int]) -> list[Tensor | None]:
    outs: list[Tensor | None] = []
    for r, x in enumerate(xs):
        scale = 1 + _moe_routing(lengths, r) % MOE_E_LOCAL  # (T, k): 1 + the local expert of each choice
        outs.append(x * (scale.to(x.dtype) * torch.tensor([0.5, 0.25], dtype=x.dtype)).sum(1, keepdim=True))
    return outs


CASES = [
    Case("gather-auto-x(n,3)-dim0", _gather_step("auto", 0), lambda ls, r: (ls[r], 3), _no_arg, _cat_everywhere(0)),
    Case("gather-pad-x(2,n)-dim-1", _gather_step("pad", -1), lambda ls, r: (2, ls[r]), _no_arg, _cat_everywhere(-1)),
    Case("gather-a2a-x(n,3)-dim0", _gather_step("a2a", 0), lambda ls, r: (ls[r], 3), _no_arg, _cat_everywhere(0)),
    Case("gather-shift-x(n,3)-dim0", _gather_step("shift", 0), lambda ls, r: (ls[r], 3), _no_arg, _cat_everywhere(0)),
    Case(
        "gather-sizes-given-x(n,3)-dim0", _gather_given_step, lambda ls, r: (ls[r], 3), lambda ls, r: list(ls),
        _cat_everywhere(0),
    ),
    Case(
        "gather-dst-last-x(n,3)-dim0", _gather_dst_step, lambda ls, r: (ls[r], 3),
        lambda ls, r: len(ls) - 1, _gather_dst_reference, grad=False,
    ),
    Case(
        "all_gather_ragged-x(n,3)-dim0", _all_gather_ragged_step, lambda ls, r: (ls[r], 3), _no_arg,
        _cat_everywhere(0),
    ),
    Case(
        "all_to_all_v-x(n,2)-send-tensor", _all_to_all_v_step, lambda ls, r: (ls[r], 2),
        lambda ls, r: torch.tensor(_send_matrix(ls)[r]), _all_to_all_v_reference,
    ),
    Case(
        "gather_forward_split_backward-x(n,3)-dim0", _gfsb_step, lambda ls, r: (ls[r], 3), _no_arg,
        _gfsb_reference,
    ),
    Case(
        "reduce_scatter-x(sum,2)-sizes-list", _reduce_scatter_step, lambda ls, r: (sum(ls), 2),
        lambda ls, r: list(ls), _reduce_scatter_reference,
    ),
    *(
        # 3 ranks only (their lengths 0, 1, 2 and 7 cover the 2-rank ones): suite time.
        Case(
            f"moe-{mode}-x(n,3)-k2", _moe_step(mode), lambda ls, r: (ls[r], 3), _moe_routing, _moe_reference,
            worlds=(3,),
        )
        for mode in ("exact", "static")
    ),
]  # fmt: skip


def _input(case_index: int, world: int, call: int, rank: int) -> Tensor:
    case = CASES[case_index]
    gen = torch.Generator().manual_seed(_seed(case_index, world, call, rank))
    return torch.randn(case.shape(LENGTHS[world][call], rank), generator=gen, dtype=torch.float64)


def _upstream(case_index: int, world: int, call: int, rank: int, shape: torch.Size) -> Tensor:
    """The weights of rank `rank`'s loss ``(y * w).sum()``."""
    gen = torch.Generator().manual_seed(_seed(case_index, world, call, rank, 1))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def _reference(case_index: int, world: int, call: int) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """(each rank's y, each rank's x.grad) for the loss summed over ranks, in one process."""
    case = CASES[case_index]
    lengths = LENGTHS[world][call]
    xs = [_input(case_index, world, call, r).requires_grad_(case.grad) for r in range(world)]
    ys = case.reference(xs, lengths)
    if not case.grad:
        return [None if y is None else y.detach() for y in ys], [None] * world
    loss = sum((y * _upstream(case_index, world, call, r, y.shape)).sum() for r, y in enumerate(ys))
    return [y.detach() for y in ys], list(torch.autograd.grad(loss, xs))


# ---------------------------------------------------------------------------- rank side
def _run_case(rank: int, world: int, case_index: int, dynamic: Mode) -> dict[str, Any]:
    case = CASES[case_index]
    torch._dynamo.reset()
    signatures: list[str] = []  # the input and output shapes of each graph this rank compiled
    aot_eager = lookup_backend("aot_eager")

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        outs = [
            a.meta.get("example_value")
            for a in gm.graph.output_node().args[0]
            if isinstance(a, torch.fx.Node)
        ]
        shapes = [str(getattr(t, "shape", t)) for t in [*example_inputs, None, *outs]]
        signatures.append(" ".join(shapes))
        return aot_eager(gm, example_inputs)

    if dynamic == "mixed":
        step = case.step if rank % 2 == 0 else torch.compile(case.step, backend=backend, fullgraph=True)
    else:
        step = torch.compile(case.step, backend=backend, fullgraph=True, dynamic=dynamic)
    outputs, grads = [], []
    try:
        for call, lengths in enumerate(LENGTHS[world]):
            x = _input(case_index, world, call, rank).requires_grad_(case.grad)
            result = step(x, case.arg(lengths, rank))
            y = result[0] if isinstance(result, tuple) else result
            if case.grad:
                (y * _upstream(case_index, world, call, rank, y.shape)).sum().backward()
            outputs.append(None if y is None else y.detach())
            grads.append(x.grad)
    except Exception:  # noqa: BLE001 -- recorded: the parent reports every rank's error
        return {"error": traceback.format_exc()}
    return {"outputs": outputs, "grads": grads, "signatures": signatures}


def _rank_body(rank: int, world: int, case_index: int) -> dict[Mode, dict[str, Any]]:
    out = {}
    for dynamic in _modes(world, CASES[case_index]):
        # "mixed" with checks off: the eager ranks stand for ranks whose frame fell back to
        # eager, which ran compiled graphs first and so check none of their eager calls by
        # default either (funcoll._base._config.check_due; tests/test_checks.py runs that).
        with funcoll.set_checks(False if dynamic == "mixed" else None):
            out[dynamic] = _run_case(rank, world, case_index, dynamic)
    return out


_RESULTS: dict[tuple[int, int], list[dict[Mode, dict[str, Any]]] | BaseException] = {}
_STARTED: dict[tuple[int, int], Ranks] = {}
AHEAD = 1  # runs started beside the one a test waits for (suite time: a rank waiting in a collective leaves a core)


def _start(key: tuple[int, int]) -> None:
    if key not in _RESULTS and key not in _STARTED:
        _STARTED[key] = start_ranks(_rank_body, key[0], key[1], timeout=TIMEOUT)


def _results(world: int, case_index: int) -> list[dict[Mode, dict[str, Any]]]:
    """One run_ranks call per (world, case), shared by its tests (a failure is cached too).

    A case of its own: when a compile fails on some ranks only, the others are left
    inside a collective, and in a shared run every later case would fail with it. The
    next :data:`AHEAD` (world, case) runs start beside it, in the tests' order.
    """
    key = (world, case_index)
    order = list(dict.fromkeys((w, i) for w, i, _ in (p.values for p in _params())))
    at = order.index(key) if key in order else len(order)
    for k in [key, *order[at + 1 : at + 1 + AHEAD]]:
        _start(k)
    if key not in _RESULTS:
        try:
            _RESULTS[key] = _STARTED.pop(key).results()
        except BaseException as e:  # noqa: BLE001 -- a hang or a crash: every test of this case reports it
            _RESULTS[key] = e
    got = _RESULTS[key]
    if isinstance(got, BaseException):
        raise RuntimeError(f"run_ranks on world {world}, case {CASES[case_index].name} failed") from got
    return got


def _errors(per_rank: list[dict[str, Any]]) -> str:
    """Every rank's error: the root cause is often on another rank than the first to fail."""
    return "\n".join(f"rank {rank}:\n{res['error']}" for rank, res in enumerate(per_rank) if "error" in res)


# -------------------------------------------------------------------------------- tests
# (world, case name prefix) -> reason for a known failure (none open)
KNOWN_BUGS: dict[tuple[int, str], str] = {}


def _params() -> list[Any]:
    params = []
    for world in LENGTHS:
        for i, case in enumerate(CASES):
            if world not in case.worlds:
                continue
            reasons = [
                r for (w, prefix), r in KNOWN_BUGS.items() if w == world and case.name.startswith(prefix)
            ]
            marks = [pytest.mark.xfail(strict=True, reason=reasons[0])] if reasons else []
            for dynamic in _modes(world, case):
                params.append(
                    pytest.param(world, i, dynamic, marks=marks, id=f"w{world}-{case.name}-dynamic={dynamic}")
                )
    return params


@pytest.mark.parametrize("world, case_index, dynamic", _params())
def test_divergent_graphs_match_reference(world: int, case_index: int, dynamic: Mode) -> None:
    per_rank = [r[dynamic] for r in _results(world, case_index)]
    assert not _errors(per_rank), _errors(per_rank)
    for call, lengths in enumerate(LENGTHS[world]):
        ref_outputs, ref_grads = _reference(case_index, world, call)
        for rank, res in enumerate(per_rank):
            where = f"call {call}, lengths {lengths}, rank {rank}"
            if ref_outputs[rank] is None:
                assert res["outputs"][call] is None, where
            else:
                torch.testing.assert_close(res["outputs"][call], ref_outputs[rank], msg=_prefixed(where))
            if ref_grads[rank] is not None:
                torch.testing.assert_close(res["grads"][call], ref_grads[rank], msg=_prefixed(where))


@pytest.mark.parametrize(
    "world, dynamic",
    [
        pytest.param(w, d, id=f"w{w}-dynamic={d}")
        for w, modes in DYNAMIC_MODES.items()
        for d in modes
        if d != "mixed"  # its even ranks compile nothing
    ],
)
def test_ranks_really_compiled_different_graphs(world: int, dynamic: Mode) -> None:
    """A check of the setup: in every case some ranks traced graphs with different shapes."""
    for i, case in enumerate(CASES):
        if world not in case.worlds:
            continue
        per_rank = [r[dynamic] for r in _results(world, i)]
        if any("error" in res for res in per_rank):
            continue  # reported by test_divergent_graphs_match_reference
        first_graphs = {res["signatures"][0] for res in per_rank}
        assert len(first_graphs) > 1, (case.name, first_graphs)
