"""Errors of the ragged collectives: ranks that disagree, and bad arguments.

Ranks that disagree on anything but the ragged length (the rest of the shape, ndim, dtype,
dim, dst, strategy, which op they call, all_to_all_v send sizes that do not add up) must ALL
raise a ValueError that names the op and shows each rank's value, instead of hanging or
aborting in the backend, and leave no collective unwaited (``funcoll.testing.in_flight()``). Every rank catches the exception inside the rank function and
returns (type name, message), so the parent checks every rank raised. Bad arguments must be
refused locally, before any communication: only rank 0 makes those calls while the other
ranks wait at the next collective, so a call that communicated first would desync the run.

One run_ranks call per world size holds every case; the last rank is the one that differs.
"""

from __future__ import annotations

import faulthandler
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

import funcoll
from funcoll.testing import in_flight, run_ranks

WORLDS = (2, 3)
TIMEOUT = 90.0


def rows(rank: int, n: int, *trailing: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """n rows of rank-stamped values: ``shape (n, *trailing)``."""
    return torch.full((n, *trailing), float(rank)).to(dtype)


def attempt(fn: Callable[..., Any], *args: Any) -> tuple[str, str]:
    """(exception type name, message) of ``fn(*args)``, or ("returned", repr of the result)."""
    try:
        return "returned", repr(fn(*args))
    except Exception as e:  # noqa: BLE001 -- recorded for the parent to check on every rank
        return type(e).__name__, str(e)


# ------------------------------------------------------------------------- cross-rank mismatches
@dataclass(frozen=True)
class Mismatch:
    """A call where the last rank (``odd``) disagrees with the others."""

    call: Callable[[int, int, bool], Any]  # (rank, world, odd) -> result
    fragments: Callable[[int], list[str]]  # (world) -> what every rank's message must contain
    ops: tuple[str, str]  # the op of the other ranks, the op of the odd rank


def _a2a(x: Tensor, send: list[int] | Tensor, dim: int = 0) -> Any:
    return funcoll.all_to_all_v(x, send, dim=dim)


MISMATCHES: dict[str, Mismatch] = {
    "gather-trailing-shape": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, r + 1, 7 if odd else 5)),
        lambda w: [
            "the shape of `x`",
            "rank 0: shape (1, 5) float32",
            f"rank {w - 1}: shape ({w}, 7) float32",
        ],
        ("gather", "gather"),
    ),
    "gather-trailing-shape-dim-1": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, 3 if odd else 2, r + 1), dim=-1),
        lambda w: [
            "the shape of `x`",
            "rank 0: shape (2, 1) float32",
            f"rank {w - 1}: shape (3, {w}) float32",
        ],
        ("gather", "gather"),
    ),
    "gather-ndim": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, r + 1, 5, *((1,) if odd else ()))),
        lambda w: ["`x`.ndim", "rank 0: 2", f"rank {w - 1}: 3"],
        ("gather", "gather"),
    ),
    "gather-dtype": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, r + 1, 5, dtype=torch.float64 if odd else torch.float32)),
        lambda w: ["dtype", "rank 0: float32", f"rank {w - 1}: float64"],
        ("gather", "gather"),
    ),
    "gather-dim": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, 3, 3), dim=1 if odd else 0),
        lambda w: ["the ragged `dim`", "rank 0: 0", f"rank {w - 1}: 1"],
        ("gather", "gather"),
    ),
    "gather-dst": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, r + 1, 5), dst=1 if odd else 0),
        lambda w: ["dst", "rank 0: 0", f"rank {w - 1}: 1"],
        ("gather", "gather"),
    ),
    "gather-dst-vs-none": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, r + 1, 5), dst=0 if odd else None),
        lambda w: ["dst", "rank 0", f"rank {w - 1}"],
        ("gather", "gather"),
    ),
    "gather-strategy": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, r + 1, 5), strategy="pad" if odd else "auto"),
        lambda w: ["strategy", "rank 0", f"rank {w - 1}"],
        ("gather", "gather"),
    ),
    "gather-vs-all_gather_ragged": Mismatch(
        lambda r, w, odd: (funcoll.all_gather_ragged if odd else funcoll.gather)(rows(r, r + 1, 5)),
        lambda w: ["different ragged ops", "rank 0: gather", f"rank {w - 1}: all_gather_ragged"],
        ("gather", "all_gather_ragged"),
    ),
    "all_gather_ragged-vs-all_gather_list": Mismatch(
        lambda r, w, odd: (funcoll.all_gather_list if odd else funcoll.all_gather_ragged)(rows(r, r + 1, 5)),
        lambda w: ["different ragged ops", "rank 0: all_gather_ragged", f"rank {w - 1}: all_gather_list"],
        ("all_gather_ragged", "all_gather_list"),
    ),
    "all_gather_list-trailing-shape-3d": Mismatch(
        lambda r, w, odd: funcoll.all_gather_list(rows(r, 2, r + 1, 4 if odd else 3), dim=1),
        lambda w: [
            "the shape of `x`",
            "rank 0: shape (2, 1, 3) float32",
            f"rank {w - 1}: shape (2, {w}, 4) float32",
        ],
        ("all_gather_list", "all_gather_list"),
    ),
    "all_gather_ragged-dtype-bool": Mismatch(
        lambda r, w, odd: funcoll.all_gather_ragged(rows(r, r, 2, dtype=torch.bool if odd else torch.int64)),
        lambda w: ["dtype", "rank 0: int64", f"rank {w - 1}: bool"],
        ("all_gather_ragged", "all_gather_ragged"),
    ),
    "gather-sizes-disagree": Mismatch(  # the last rank passes another list: every rank raises
        lambda r, w, odd: funcoll.gather(
            rows(r, r + 1, 5), sizes=[n + 1 for n in range(w)][:: -1 if odd else 1]
        ),
        lambda w: ["ranks disagree on `sizes`", f"rank 0: {list(range(1, w + 1))}"],
        ("gather", "gather"),
    ),
    "gather-sizes-wrong": Mismatch(  # every rank passes the same list, the last rank's entry is off
        lambda r, w, odd: funcoll.gather(rows(r, r + 2 if odd else r + 1, 5), sizes=list(range(1, w + 1))),
        lambda w: [f"`sizes`={list(range(1, w + 1))}", "but the ranks hold"],
        ("gather", "gather"),
    ),
    "gather-sizes-given-on-some": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, r + 1, 5), sizes=None if odd else list(range(1, w + 1))),
        lambda w: ["`sizes` was given on ranks", f"but not on ranks [{w - 1}]"],
        ("gather", "gather"),
    ),
    "all_to_all_v-trailing-shape": Mismatch(
        lambda r, w, odd: _a2a(rows(r, w, 7 if odd else 5), [1] * w),
        lambda w: [
            "the shape of `x`",
            f"rank 0: shape ({w}, 5) float32",
            f"rank {w - 1}: shape ({w}, 7) float32",
        ],
        ("all_to_all_v", "all_to_all_v"),
    ),
    "all_to_all_v-dtype": Mismatch(
        lambda r, w, odd: _a2a(rows(r, w, 5, dtype=torch.bfloat16 if odd else torch.float32), [1] * w),
        lambda w: ["dtype", "rank 0: float32", f"rank {w - 1}: bfloat16"],
        ("all_to_all_v", "all_to_all_v"),
    ),
    "all_to_all_v-dim": Mismatch(
        lambda r, w, odd: _a2a(rows(r, w, w), [1] * w, dim=1 if odd else 0),
        lambda w: ["the ragged `dim`", "rank 0: 0", f"rank {w - 1}: 1"],
        ("all_to_all_v", "all_to_all_v"),
    ),
    "all_to_all_v-send-sizes-sum-tensor": Mismatch(
        lambda r, w, odd: _a2a(rows(r, w, 5), torch.tensor([2 if odd else 1] + [1] * (w - 1))),
        lambda w: [f"rank {w - 1} has `send_sizes`=[2, {', '.join(['1'] * (w - 1))}]", f"x.shape[dim]={w}"],
        ("all_to_all_v", "all_to_all_v"),
    ),
    "all_to_all_v-send-sizes-negative-tensor": Mismatch(
        lambda r, w, odd: _a2a(rows(r, w, 5), torch.tensor([w + 1, -1] + [0] * (w - 2) if odd else [1] * w)),
        lambda w: [f"rank {w - 1} has `send_sizes`=[{w + 1}, -1", "non-negative"],
        ("all_to_all_v", "all_to_all_v"),
    ),
    "scatter-src": Mismatch(
        lambda r, w, odd: funcoll.scatter(rows(r, 3, 5), 1 if odd else 0),
        lambda w: ["`src`", "rank 0: 0", f"rank {w - 1}: 1"],
        ("scatter", "scatter"),
    ),
    "scatter-trailing-shape": Mismatch(  # the length along dim may differ, the rest may not
        lambda r, w, odd: funcoll.scatter(rows(r, r, 7 if odd else 5), 0),
        lambda w: [
            "the shape of `x` apart from `dim`",
            "rank 0: shape (0, 5)",
            f"rank {w - 1}: shape ({w - 1}, 7)",
        ],
        ("scatter", "scatter"),
    ),
    "scatter-sizes-disagree": Mismatch(
        lambda r, w, odd: funcoll.scatter(rows(r, w, 5), 0, sizes=[w] + [0] * (w - 1) if odd else [1] * w),
        lambda w: ["ranks disagree on `sizes`", f"rank 0: {[1] * w}"],
        ("scatter", "scatter"),
    ),
    "scatter-sizes-sum": Mismatch(  # the same list on every rank; src's length is another
        lambda r, w, odd: funcoll.scatter(rows(r, w + 1 if r == 0 else 9, 5), 0, sizes=[1] * w),
        lambda w: [f"`sizes`={[1] * w} sums to {w}, but rank 0's x.shape[0]={w + 1}"],
        ("scatter", "scatter"),
    ),
    "scatter-sizes-given-on-some": Mismatch(
        lambda r, w, odd: funcoll.scatter(rows(r, w, 5), 0, sizes=None if odd else [1] * w),
        lambda w: ["`sizes`", "rank 0: given", f"rank {w - 1}: None"],
        ("scatter", "scatter"),
    ),
    "scatter-vs-gather": Mismatch(
        lambda r, w, odd: funcoll.gather(rows(r, 1, 5)) if odd else funcoll.scatter(rows(r, 1, 5), 0),
        lambda w: ["different ragged ops", "rank 0: scatter", f"rank {w - 1}: gather"],
        ("scatter", "gather"),
    ),
}


# ------------------------------------------------------- calls that look different but agree
AGREEMENTS: dict[str, Callable[[int, int, bool], Any]] = {
    # dim=1 and dim=-1 name the same dim of a 2-d tensor
    "gather-dim-1-vs-dim--1": lambda r, w, odd: funcoll.gather(rows(r, 2, r + 1), dim=-1 if odd else 1),
    # sizes as a list on some ranks and as a tensor on others
    "all_to_all_v-list-vs-tensor": lambda r, w, odd: _a2a(
        rows(r, w, 3), torch.ones(w, dtype=torch.int64) if odd else [1] * w
    )[0],
}


def agreement_expected(name: str, world: int) -> Tensor:
    if name == "gather-dim-1-vs-dim--1":
        return torch.cat([rows(r, 2, r + 1) for r in range(world)], 1)
    return torch.cat([rows(r, 1, 3) for r in range(world)])  # one row from every rank


# ------------------------------------------------------------------- local argument errors
@dataclass(frozen=True)
class Local:
    """A bad call that must be refused before any communication."""

    call: Callable[[int], Any]  # (world) -> result
    op: str
    fragments: list[str]  # beyond the op prefix; the first names the argument
    kind: str = "ValueError"
    worlds: tuple[int, ...] = field(default=(1, 2, 3))


def _negative(world: int, total: int) -> list[int]:
    """`world` sizes summing to `total`, one of them negative."""
    return [-1] if world == 1 else [-1, *([0] * (world - 2)), total + 1]


LOCALS: dict[str, Local] = {
    "gather-dim-2-of-2d": Local(
        lambda w: funcoll.gather(rows(0, 2, 3), dim=2), "gather", ["`dim`=2", "out of range"]
    ),
    "gather-dim--3-of-2d": Local(lambda w: funcoll.gather(rows(0, 2, 3), dim=-3), "gather", ["`dim`=-3"]),
    "gather-dim-1-of-0d": Local(lambda w: funcoll.gather(torch.tensor(1.0), 1), "gather", ["`dim`=1", "0-d"]),
    "gather-dim-not-int": Local(
        lambda w: funcoll.gather(rows(0, 2, 3), dim=0.0), "gather", ["`dim`"], "TypeError"
    ),
    "gather-x-not-a-tensor": Local(lambda w: funcoll.gather([1.0, 2.0]), "gather", ["`x`"], "TypeError"),
    "gather-strategy": Local(
        lambda w: funcoll.gather(rows(0, 2, 3), strategy="ring"), "gather", ["`strategy`='ring'"]
    ),
    "gather-dst-world": Local(
        lambda w: funcoll.gather(rows(0, 2, 3), dst=w), "gather", ["`dst`=", "not a rank"]
    ),
    "gather-dst--1": Local(lambda w: funcoll.gather(rows(0, 2, 3), dst=-1), "gather", ["`dst`=-1"]),
    "all_gather_list-dim-5": Local(
        lambda w: funcoll.all_gather_list(rows(0, 2, 3), dim=5), "all_gather_list", ["`dim`=5"]
    ),
    "all_gather_ragged-dim--4-of-3d": Local(
        lambda w: funcoll.all_gather_ragged(rows(0, 2, 3, 1), dim=-4), "all_gather_ragged", ["`dim`=-4"]
    ),
    "all_to_all_v-dim-2-of-2d": Local(
        lambda w: _a2a(rows(0, w, 3), [1] * w, dim=2), "all_to_all_v", ["`dim`=2"]
    ),
    "all_to_all_v-send-sizes-length-list": Local(
        lambda w: _a2a(rows(0, w + 1, 3), [1] * (w + 1)),
        "all_to_all_v",
        ["`send_sizes`", "ints, one per rank"],
    ),
    "all_to_all_v-send-sizes-length-tensor": Local(
        lambda w: _a2a(rows(0, w + 1, 3), torch.ones(w + 1, dtype=torch.int64)),
        "all_to_all_v",
        ["`send_sizes`", "shape"],
    ),
    "all_to_all_v-send-sizes-float-tensor": Local(
        lambda w: _a2a(rows(0, w, 3), torch.ones(w)), "all_to_all_v", ["`send_sizes`", "int"], "TypeError"
    ),
    "all_to_all_v-send-sizes-negative-list": Local(
        lambda w: _a2a(rows(0, w, 3), _negative(w, w)), "all_to_all_v", ["`send_sizes`", "negative"]
    ),
    "all_to_all_v-send-sizes-sum-list": Local(
        lambda w: _a2a(rows(0, w + 1, 3), [1] * w), "all_to_all_v", ["`send_sizes`", "sums to", "x.shape[0]"]
    ),
    "all_to_all_v-send-sizes-sum-dim-1": Local(
        lambda w: _a2a(rows(0, 3, w + 2), [1] * w, dim=-1),
        "all_to_all_v",
        ["`send_sizes`", "sums to", "x.shape[1]"],
    ),
    "all_to_all_v-send-sizes-sum-recv-given": Local(
        lambda w: funcoll.all_to_all_v(rows(0, w + 1, 3), [1] * w, [1] * w),
        "all_to_all_v",
        ["`send_sizes`", "sums to"],
    ),
    "all_to_all_v-recv-sizes-negative": Local(
        lambda w: funcoll.all_to_all_v(rows(0, w, 3), [1] * w, _negative(w, w)),
        "all_to_all_v",
        ["`recv_sizes`", "negative"],
    ),
    "all_to_all_v-recv-sizes-length": Local(
        lambda w: funcoll.all_to_all_v(rows(0, w, 3), [1] * w, [1] * (w + 1)),
        "all_to_all_v",
        ["`recv_sizes`"],
    ),
    "reduce_scatter-sizes-sum": Local(
        lambda w: funcoll.reduce_scatter(rows(0, 5, 3), sizes=[2] * w),
        "reduce_scatter",
        ["`sizes`", "sums to", "x.shape[0]=5"],
    ),
    "reduce_scatter-sizes-sum-tensor-dim-1": Local(
        lambda w: funcoll.reduce_scatter(rows(0, 3, 5), -1, sizes=torch.full((w,), 2)),
        "reduce_scatter",
        ["`sizes`", "x.shape[1]=5"],
    ),
    "reduce_scatter-sizes-length": Local(
        lambda w: funcoll.reduce_scatter(rows(0, 5, 3), sizes=[5] + [0] * w),
        "reduce_scatter",
        ["`sizes`", "one per rank"],
    ),
    "reduce_scatter-sizes-negative": Local(
        lambda w: funcoll.reduce_scatter(rows(0, 5, 3), sizes=_negative(w, 5)),
        "reduce_scatter",
        ["`sizes`", "negative"],
    ),
    "reduce_scatter-sizes-not-ints": Local(
        lambda w: funcoll.reduce_scatter(rows(0, 5, 3), sizes="5"), "reduce_scatter", ["`sizes`"], "TypeError"
    ),
    "reduce_scatter-dim-2-of-2d": Local(
        lambda w: funcoll.reduce_scatter(rows(0, 5, 3), 2, sizes=[5] + [0] * (w - 1)),
        "reduce_scatter",
        ["`dim`=2"],
    ),
    "scatter-src-world": Local(
        lambda w: funcoll.scatter(rows(0, 2, 3), w), "scatter", ["`src`=", "not a rank"]
    ),
    "scatter-src-float": Local(
        lambda w: funcoll.scatter(rows(0, 2, 3), 0.0), "scatter", ["`src`"], "TypeError"
    ),
    "scatter-dim-2-of-2d": Local(lambda w: funcoll.scatter(rows(0, 2, 3), 0, dim=2), "scatter", ["`dim`=2"]),
    "scatter-x-not-a-tensor": Local(lambda w: funcoll.scatter([1.0], 0), "scatter", ["`x`"], "TypeError"),
    "scatter-sizes-length": Local(
        lambda w: funcoll.scatter(rows(0, 2, 3), 0, sizes=[1] * (w + 1)),
        "scatter",
        ["`sizes`", "one per rank"],
    ),
    "scatter-sizes-negative": Local(
        lambda w: funcoll.scatter(rows(0, 2, 3), 0, sizes=_negative(w, 2)), "scatter", ["`sizes`", "negative"]
    ),
    "scatter-sizes-sum-w1": Local(  # with more ranks and checks on, the header carries this check
        lambda w: funcoll.scatter(rows(0, 2, 3), 0, sizes=[3]),
        "scatter",
        ["`sizes`=[3] sums to 3, but rank 0's x.shape[0]=2"],
        worlds=(1,),
    ),
    "reduce_scatter-op": Local(
        lambda w: funcoll.reduce_scatter(rows(0, 5, 3), sizes=[5] + [0] * (w - 1), op="mean"),
        "reduce_scatter",
        ["`op`='mean'"],
    ),
}


# --------------------------------------------------------------------------------- rank side
def run_errors(rank: int, world: int) -> dict[str, Any]:
    odd = rank == world - 1
    out: dict[str, Any] = {"mismatch": {}, "in_flight": {}, "agree": {}, "local": {}}
    for name, m in MISMATCHES.items():
        out["mismatch"][name] = attempt(m.call, rank, world, odd)
        out["in_flight"][name] = in_flight()  # the error came after the size exchange
    for name, call in AGREEMENTS.items():
        try:
            out["agree"][name] = call(rank, world, odd)
        except Exception as e:  # noqa: BLE001 -- recorded: the parent reports it
            out["agree"][name] = f"{type(e).__name__}: {e}"
    if rank == 0:  # the others go straight on to the next collective
        for name, local in LOCALS.items():
            out["local"][name] = attempt(local.call, world)
    out["after"] = funcoll.gather(rows(rank, rank + 1))  # the group still works, in step
    return out


class Batches:
    def __init__(self) -> None:
        self._done: dict[int, list[dict[str, Any]]] = {}

    def get(self, world: int) -> list[dict[str, Any]]:
        if world not in self._done:
            self._done[world] = run_ranks(run_errors, world, timeout=TIMEOUT)
        return self._done[world]


@pytest.fixture(scope="module")
def batches() -> Batches:
    return Batches()


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "world,name", [pytest.param(w, n, id=f"w{w}-{n}") for w in WORLDS for n in MISMATCHES]
)
def test_mismatch_raises_on_every_rank(batches: Batches, world: int, name: str) -> None:
    m = MISMATCHES[name]
    for rank, res in enumerate(batches.get(world)):
        kind, msg = res["mismatch"][name]
        assert kind == "ValueError", f"rank {rank}: expected a ValueError, got {kind}: {msg}"
        op = m.ops[rank == world - 1]
        assert msg.startswith(f"funcoll.{op}:"), f"rank {rank}: {msg}"
        for fragment in m.fragments(world):
            assert fragment in msg, f"rank {rank}: {fragment!r} not in {msg!r}"
        left = res["in_flight"][name]
        assert left == 0, f"rank {rank}: {left} collectives left unwaited after the error"


@pytest.mark.parametrize(
    "world,name", [pytest.param(w, n, id=f"w{w}-{n}") for w in WORLDS for n in AGREEMENTS]
)
def test_equivalent_arguments_agree(batches: Batches, world: int, name: str) -> None:
    for rank, res in enumerate(batches.get(world)):
        got = res["agree"][name]
        assert isinstance(got, Tensor), f"rank {rank}: {got}"
        torch.testing.assert_close(got, agreement_expected(name, world), rtol=0, atol=0)


@pytest.mark.parametrize(
    "world,name",
    [pytest.param(w, n, id=f"w{w}-{n}") for w in WORLDS for n in LOCALS if w in LOCALS[n].worlds],
)
def test_local_error_before_communication(batches: Batches, world: int, name: str) -> None:
    """Only rank 0 makes the bad call; had it communicated, the ranks would fall out of step."""
    check_local(LOCALS[name], batches.get(world)[0]["local"][name])


@pytest.mark.parametrize("name", [n for n in LOCALS if 1 in LOCALS[n].worlds])
def test_local_error_uninitialized(name: str) -> None:
    assert not torch.distributed.is_initialized()
    check_local(LOCALS[name], attempt(LOCALS[name].call, 1))


def check_local(local: Local, got: tuple[str, str]) -> None:
    kind, msg = got
    assert kind == local.kind, f"expected {local.kind}, got {kind}: {msg}"
    assert msg.startswith(f"funcoll.{local.op}: {local.fragments[0]}"), msg
    for fragment in local.fragments[1:]:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


@pytest.mark.parametrize("world", WORLDS, ids=[f"w{w}" for w in WORLDS])
def test_group_in_step_after_errors(batches: Batches, world: int) -> None:
    expected = torch.cat([rows(r, r + 1) for r in range(world)])
    for _rank, res in enumerate(batches.get(world)):
        torch.testing.assert_close(res["after"], expected, rtol=0, atol=0)


# --------------------------------------------------------------------------------- known bugs
def gather_vs_all_to_all_v(rank: int, world: int) -> dict[str, tuple[str, str]]:
    faulthandler.disable()  # a gloo abort here is the known bug; keep pytest's stack dump out of the log
    x = rows(rank, world, 5)
    return {
        "gather-vs-all_to_all_v": attempt(funcoll.gather, x) if rank == 0 else attempt(_a2a, x, [1] * world),
        "all_to_all_v-vs-all_gather_ragged": (
            attempt(_a2a, x, [1] * world) if rank == 0 else attempt(funcoll.all_gather_ragged, x)
        ),
    }


def test_all_to_all_v_vs_other_ragged_op_raises_on_every_rank() -> None:
    for rank, res in enumerate(run_ranks(gather_vs_all_to_all_v, 2, timeout=30)):
        for name, (kind, msg) in res.items():
            assert kind == "ValueError" and "different ragged ops" in msg, (
                f"rank {rank} {name}: {kind}: {msg}"
            )


def reduce_scatter_sizes_disagree(rank: int, world: int) -> tuple[str, str]:
    return attempt(lambda: funcoll.reduce_scatter(torch.arange(4.0), sizes=[3, 1] if rank == 0 else [2, 2]))


def test_reduce_scatter_sizes_disagree_raises_on_every_rank() -> None:
    for rank, (kind, msg) in enumerate(run_ranks(reduce_scatter_sizes_disagree, 2, timeout=30)):
        assert kind == "ValueError", f"rank {rank}: {kind}: {msg}"
        assert msg.startswith("funcoll.reduce_scatter:") and "`sizes`" in msg, msg
