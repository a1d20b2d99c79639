"""Recompile counts of compiled steps whose ragged sizes change on every call.

A training loop calls one compiled step many times, and in ragged workloads the
local length along the ragged dim changes from step to step (0 and 1 included).
What funcoll promises:

* With ``funcoll.mark_ragged(x, dim)`` on the input, the ragged dim is an unbacked
  symbol, never specialized (not even on 0 or 1), and the other ranks' sizes come
  out of the size exchange as unbacked symbols too: one graph per rank serves all
  50 steps (``frame_count == 1``).
* Without it, dynamo's own shape policy decides: a static first trace, one graph
  with an automatic-dynamic size once the length changes, and static graphs for
  lengths 0 and 1 (dynamo specializes both). That is at most 4 graphs, and funcoll
  must add none: the count equals that of a plain torch step fed the same local
  shapes. (The other ranks' sizes never cause a recompile: they are unbacked.)

Every step's forward and ``x.grad`` are compared with a single-process reference
built from every rank's input (float64). Every op runs on 2 ranks, the ragged
gather on 3 as well. Each (world, op) runs in one
``run_ranks`` call, both modes in it; the parametrized tests read its cached
results.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _ops import SMOKE
from torch import Tensor
from torch._dynamo.testing import CompileCounterWithBackend

import funcoll
from funcoll.testing import run_ranks

STEPS = 50
MAX_SIZE = 3  # per-rank lengths are drawn from {0, 1, 2, 3}
WORLDS = (2,) if SMOKE else (2, 3)  # the release matrix: 2 ranks (_ops.SMOKE)
# The ops that also run on 3 ranks (the suite's time): the ragged gather, whose size
# exchange and strategy choice depend on the world; the others run on 2.
ODD_WORLD_OPS = ("gather",)
TIMEOUT = 180.0
# dynamo's most for a step whose input length changes: static first trace, the
# automatic-dynamic graph, and the specialized graphs for lengths 0 and 1.
DYNAMO_MAX_GRAPHS = 4

OPS = ("gather", "all_gather_ragged", "all_to_all_v", "reduce_scatter", "scatter")
# The release matrix's smoke run (_ops.SMOKE): a ragged length on dim 0, and one on the
# last dim whose first call is empty.
SMOKE_OPS = ("gather", "all_gather_ragged")
# The ragged dim of each op's input (the inputs are built by `_input`).
DIMS = {"gather": 0, "all_gather_ragged": -1, "all_to_all_v": 0, "reduce_scatter": 0, "scatter": 0}
SHAPE_IDS = {
    "gather": "x(n,3)-dim0",
    "all_gather_ragged": "x(2,n)-dim-1",
    "all_to_all_v": "x(sum(send),3)-dim0",
    "reduce_scatter": "x(sum(sizes),2)-dim0-sizes-tensor",
    "scatter": "x(n,3)-dim0-src0",
}


def _prefixed(where: str) -> Callable[[str], str]:
    """An assert_close `msg` that says where the mismatch is."""
    return lambda message: f"{where}: {message}"


def _seed(*keys: int) -> int:
    seed = 17
    for k in keys:
        seed = (seed * 1_000_003 + k) % (1 << 62)
    return seed


def _size_matrix(op: str, world: int, step: int) -> Tensor:
    """(world, world) lengths of one step, the same on every rank.

    all_to_all_v: row r holds rank r's send sizes. The other ops use row 0 as the
    per-rank sizes.
    """
    gen = torch.Generator().manual_seed(_seed(OPS.index(op), world, step))
    lengths = torch.randint(0, MAX_SIZE + 1, (world, world), generator=gen)
    # Zero out about half, so that row sums (all_to_all_v, reduce_scatter) hit 0 and 1 too.
    return lengths * torch.randint(0, 2, (world, world), generator=gen)


def _input(op: str, world: int, step: int, rank: int) -> Tensor:
    """Rank `rank`'s float64 input of one step (any process can rebuild it)."""
    m = _size_matrix(op, world, step)
    shape = {
        "gather": (int(m[0, rank]), 3),
        "all_gather_ragged": (2, int(m[0, rank])),
        "all_to_all_v": (int(m[rank].sum()), 3),
        "reduce_scatter": (int(m[0].sum()), 2),
        "scatter": (int(m[0].sum()) if rank == 0 else int(m[0, rank]), 3),  # the others' rows: unused
    }[op]
    gen = torch.Generator().manual_seed(_seed(OPS.index(op), world, step, rank, 1))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _step_arg(op: str, world: int, step: int, rank: int) -> Tensor | None:
    m = _size_matrix(op, world, step)
    if op == "all_to_all_v":
        return m[rank].clone()
    if op == "reduce_scatter":
        return m[0].clone()
    return None


def _upstream(op: str, world: int, step: int, rank: int, shape: torch.Size) -> Tensor:
    """The weights of rank `rank`'s loss ``(y * w).sum()``."""
    gen = torch.Generator().manual_seed(_seed(OPS.index(op), world, step, rank, 2))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


# ------------------------------------------------------------------ the compiled steps
def _gather_step(x: Tensor, arg: Tensor | None) -> Tensor:
    return funcoll.gather(x, dim=0)


def _all_gather_ragged_step(x: Tensor, arg: Tensor | None) -> tuple[Tensor, Tensor]:
    return funcoll.all_gather_ragged(x, dim=-1)


def _all_to_all_v_step(x: Tensor, send_sizes: Tensor) -> tuple[Tensor, Tensor]:
    return funcoll.all_to_all_v(x, send_sizes)


def _reduce_scatter_step(x: Tensor, sizes: Tensor) -> Tensor:
    return funcoll.reduce_scatter(x, 0, sizes=sizes)


def _scatter_step(x: Tensor, arg: Tensor | None) -> Tensor:
    return funcoll.scatter(x, 0)  # rank 0's length exchanged, split as split_sizes


STEP_FNS: dict[str, Callable[..., Any]] = {
    "gather": _gather_step,
    "all_gather_ragged": _all_gather_ragged_step,
    "all_to_all_v": _all_to_all_v_step,
    "reduce_scatter": _reduce_scatter_step,
    "scatter": _scatter_step,
}


# ------------------------------------------------------------- single-process reference
def _reference_outputs(op: str, world: int, step: int, xs: list[Tensor]) -> list[Tensor]:
    """Every rank's output of one step, computed from all ranks' inputs in one process."""
    m = _size_matrix(op, world, step)
    if op in ("gather", "all_gather_ragged"):
        return [torch.cat(xs, DIMS[op])] * world
    if op == "scatter":
        return list(torch.tensor_split(xs[0], world))
    if op == "all_to_all_v":
        offsets = torch.cat([torch.zeros(world, 1, dtype=m.dtype), m.cumsum(1)], 1)
        return [
            torch.cat([xs[i][int(offsets[i, r]) : int(offsets[i, r + 1])] for i in range(world)])
            for r in range(world)
        ]
    offsets = [0, *m[0].cumsum(0).tolist()]
    total = sum(xs)
    return [total[offsets[r] : offsets[r + 1]] for r in range(world)]


def _reference(op: str, world: int, step: int) -> tuple[list[Tensor], list[Tensor]]:
    """(outputs, input grads) per rank for the loss summed over ranks."""
    xs = [_input(op, world, step, r).requires_grad_() for r in range(world)]
    ys = _reference_outputs(op, world, step, xs)
    loss = sum((y * _upstream(op, world, step, r, y.shape)).sum() for r, y in enumerate(ys))
    grads = torch.autograd.grad(loss, xs, allow_unused=True)  # scatter: only rank 0's input is used
    return [y.detach() for y in ys], [
        torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs, strict=True)
    ]


def _local_lengths(op: str, world: int, rank: int) -> list[int]:
    return [_input(op, world, s, rank).shape[DIMS[op]] for s in range(STEPS)]


# --------------------------------------------------------------------------- rank side
def _plain_dynamo_graphs(shapes: list[torch.Size], dim: int) -> int:
    """Graphs dynamo compiles for a collective-free step fed the same local shapes."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    step = torch.compile(lambda x: x.movedim(dim, 0) * 2, backend=counter, fullgraph=True)
    for shape in shapes:
        step(torch.zeros(shape, requires_grad=True))
    return counter.frame_count


def _run_op(rank: int, world: int, op: str, mark: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(STEP_FNS[op], backend=counter, fullgraph=True)
    outputs, grads, sizes, shapes = [], [], [], []
    try:
        for s in range(STEPS):
            x = _input(op, world, s, rank).requires_grad_()
            shapes.append(x.shape)
            arg = funcoll.mark_ragged(x, DIMS[op]) if mark else x
            result = step(arg, _step_arg(op, world, s, rank))
            y, got_sizes = result if isinstance(result, tuple) else (result, None)
            (y * _upstream(op, world, s, rank, y.shape)).sum().backward()
            outputs.append(y.detach())
            grads.append(x.grad)
            sizes.append(got_sizes)
    except Exception:  # noqa: BLE001 -- recorded: the parent reports every rank's error
        return {"error": traceback.format_exc()}
    plain = None if mark else _plain_dynamo_graphs(shapes, DIMS[op])
    return {
        "graphs": counter.frame_count,
        "plain_graphs": plain,
        "outputs": outputs,
        "grads": grads,
        "sizes": sizes,
    }


def _rank_body(rank: int, world: int, op: str) -> dict[bool, dict[str, Any]]:
    return {mark: _run_op(rank, world, op, mark) for mark in (True, False)}


_RESULTS: dict[tuple[int, str], list[dict[bool, dict[str, Any]]] | BaseException] = {}


def _results(world: int, op: str) -> list[dict[bool, dict[str, Any]]]:
    """One run_ranks call per (world, op), shared by its tests (a failure is cached too).

    An op of its own: without mark_ragged the ranks compile different graphs, and
    when a compile fails on some ranks only, the others are left inside a
    collective; in a shared run every later op would fail with it.
    """
    key = (world, op)
    if key not in _RESULTS:
        try:
            _RESULTS[key] = run_ranks(_rank_body, world, op, timeout=TIMEOUT)
        except BaseException as e:  # noqa: BLE001 -- a hang or a crash: every test of this op reports it
            _RESULTS[key] = e
    got = _RESULTS[key]
    if isinstance(got, BaseException):
        raise RuntimeError(f"run_ranks on world {world}, op {op} failed") from got
    return got


# -------------------------------------------------------------------------------- tests
def _check_values(op: str, world: int, per_rank: list[dict[str, Any]]) -> None:
    for s in range(STEPS):
        ref_outputs, ref_grads = _reference(op, world, s)
        m = _size_matrix(op, world, s)
        for rank, res in enumerate(per_rank):
            where = f"rank {rank}, step {s}"
            torch.testing.assert_close(res["outputs"][s], ref_outputs[rank], msg=_prefixed(where))
            torch.testing.assert_close(res["grads"][s], ref_grads[rank], msg=_prefixed(where))
            if op == "all_gather_ragged":
                assert res["sizes"][s].tolist() == m[0].tolist(), where
            if op == "all_to_all_v":
                assert res["sizes"][s].tolist() == m[:, rank].tolist(), where


def _case_params(known_bugs: dict[str, str] | None = None) -> list[Any]:
    """(world, op) params; ops in `known_bugs` are marked xfail(strict=True) with its reason."""
    params = []
    for world in WORLDS:
        for op in (SMOKE_OPS if SMOKE else OPS) if world == 2 else ODD_WORLD_OPS:
            reason = (known_bugs or {}).get(op)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(world, op, marks=marks, id=f"w{world}-{op}-{SHAPE_IDS[op]}"))
    return params


@pytest.mark.parametrize("world, op", _case_params())
def test_sizes_cover_zero_one_and_more(world: int, op: str) -> None:
    """The drawn lengths exercise dynamo's 0/1 specialization on every rank (a check of the data)."""
    for rank in range(world):
        lengths = set(_local_lengths(op, world, rank))
        assert {0, 1} <= lengths and max(lengths) >= 2, (rank, sorted(lengths))


def _rank_results(world: int, op: str, mark: bool) -> list[dict[str, Any]]:
    per_rank = [r[mark] for r in _results(world, op)]
    errors = "\n".join(f"rank {rank}:\n{res['error']}" for rank, res in enumerate(per_rank) if "error" in res)
    assert not errors, errors  # every rank's: the root cause may be on another rank than the first
    return per_rank


# Rank 0's first length in these steps is 0 (the x(2,n) input of all_gather_ragged).
MARK_RAGGED_FIRST_EMPTY = (
    "dynamo limitation (documented in mark_ragged): when the first call's input is empty on a "
    "dim that is not the outermost, dynamo traces stride(0) of the (2, 0) input as the constant "
    "0 rather than as the unbacked size, so the first non-empty call compiles a second graph"
)


@pytest.mark.parametrize("world, op", _case_params({"all_gather_ragged": MARK_RAGGED_FIRST_EMPTY}))
def test_mark_ragged_compiles_once(world: int, op: str) -> None:
    for rank, res in enumerate(_rank_results(world, op, mark=True)):
        assert res["graphs"] == 1, f"rank {rank} compiled {res['graphs']} graphs over {STEPS} steps"


def test_mark_ragged_empty_inner_dim_after_the_first_call_adds_no_graph() -> None:
    # Single process, no collective: what mark_ragged's view of an empty tensor buys.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda x: (x * 2).sum(0), backend=counter, fullgraph=True)
    for n in (2, 0, 3, 1, 0, 5, 0):
        x = torch.randn(2, n).requires_grad_()
        step(funcoll.mark_ragged(x, 1)).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((2, n), 2.0))
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("returned", [pytest.param(True, id="returned"), pytest.param(False, id="in-place")])
def test_mark_ragged_in_place_or_returned_compiles_once(returned: bool) -> None:
    # Users know mark_dynamic / mark_unbacked, which mark in place and whose return
    # value they drop: an empty inner dim must cost no second graph either way.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda x: (x * 2).sum(0), backend=counter, fullgraph=True)
    for n in (2, 0, 3, 0, 1):
        leaf = torch.randn(2, n).requires_grad_()
        x = leaf.exp()  # an activation, which exp saved for its backward
        if returned:
            x = funcoll.mark_ragged(x, 1)
        else:
            assert funcoll.mark_ragged(x, 1) is x
        step(x).sum().backward()
        torch.testing.assert_close(leaf.grad, 2 * leaf.detach().exp())  # through exp's saved output
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "inside", [pytest.param(True, id="in-inference-mode"), pytest.param(False, id="after")]
)
def test_mark_ragged_empty_inference_tensor_compiles_once(inside: bool) -> None:
    # A tensor made under torch.inference_mode() has no version counter to keep while
    # mark_ragged fixes an empty tensor's strides; marking it once raised a RuntimeError.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda x: (x * 2).sum(0), backend=counter, fullgraph=True)
    for n in (2, 0, 3, 0, 1):
        with torch.inference_mode():
            x = torch.randn(2, n)
        assert x.is_inference()
        with torch.inference_mode(inside):
            got = step(funcoll.mark_ragged(x, 1))
        assert x.stride() == (n, 1), x.stride()
        torch.testing.assert_close(got, 2 * x[0] + 2 * x[1])
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("world, op", _case_params())
def test_without_mark_ragged_recompiles_only_as_dynamo_does(world: int, op: str) -> None:
    for rank, res in enumerate(_rank_results(world, op, mark=False)):
        assert res["graphs"] <= DYNAMO_MAX_GRAPHS, f"rank {rank} compiled {res['graphs']} graphs"
        assert res["graphs"] == res["plain_graphs"], (
            f"rank {rank}: {res['graphs']} graphs, a collective-free step with the same shapes "
            f"compiles {res['plain_graphs']}"
        )


@pytest.mark.parametrize("mark", [pytest.param(True, id="mark_ragged"), pytest.param(False, id="unmarked")])
@pytest.mark.parametrize("world, op", _case_params())
def test_every_step_matches_reference(world: int, op: str, mark: bool) -> None:
    _check_values(op, world, _rank_results(world, op, mark))
