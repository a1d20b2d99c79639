"""funcoll.set_checks: the even ops check across ranks, and every rank raises the same ValueError.

Unchecked, ranks that pass different shapes to an even op make gloo abort the
process ("Received data size doesn't match expected size") or NCCL hang. With
checks on, each case below makes the last rank disagree with the others in one
thing, and every rank must raise a ``ValueError`` that names the op and what
differs; ranks that agree get the single-process reference. All cases of one world
run in one ``run_ranks`` call: a checked mismatch raises on every rank at the same
point, so the ranks stay in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _inputs import once_per_world

import funcoll

WORLDS = (2, 3)
TIMEOUT_S = 120.0


def _last(rank: int, world: int) -> bool:
    return rank == world - 1


def _z(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# case id -> (the call on (rank, world), fragments every rank's message must hold)
MISMATCHES: dict[str, tuple[Callable[[int, int], Any], list[str]]] = {
    "all_gather-shape": (
        lambda r, w: funcoll.all_gather(_z(2 + _last(r, w), 3)),
        ["funcoll.all_gather:", "the shape of `x` (", "shape (2, 3)", "shape (3, 3)"],
    ),
    "all_gather-dim": (lambda r, w: funcoll.all_gather(_z(2, 2), dim=int(_last(r, w))), ["`dim`"]),
    "all_gather_into_tensor-dtype": (
        lambda r, w: funcoll.all_gather_into_tensor(
            _z(3, dtype=torch.float64 if _last(r, w) else torch.float32)
        ),
        ["funcoll.all_gather_into_tensor:", "`x`.dtype", "float64"],
    ),
    "reduce_scatter-length": (
        lambda r, w: funcoll.reduce_scatter(_z(w * (1 + _last(r, w)), 2)),
        ["funcoll.reduce_scatter:", "x.shape[dim]"],
    ),
    "reduce_scatter-op": (
        lambda r, w: funcoll.reduce_scatter(_z(w, 2), op="max" if _last(r, w) else "sum"),
        ["`op`", "'max'", "'sum'"],
    ),
    "reduce_scatter-ragged-sizes-disagree": (  # unchecked: one all_to_all, no header
        lambda r, w: funcoll.reduce_scatter(
            _z(w + 1, 2), sizes=[2] + [1] * (w - 1) if _last(r, w) else [1] * (w - 1) + [2]
        ),
        ["funcoll.reduce_scatter:", "ranks disagree on `sizes`"],
    ),
    "all_reduce-ndim": (
        lambda r, w: funcoll.all_reduce(_z(3, 1) if _last(r, w) else _z(3)),
        ["funcoll.all_reduce:", "`x`.ndim"],
    ),
    "all_reduce-requires-grad": (
        lambda r, w: funcoll.all_reduce(_z(3).requires_grad_(_last(r, w))),
        ["requires grad on ranks"],
    ),
    "all_to_all-uneven-heads-no-gather_sizes": (
        lambda r, w: funcoll.all_to_all(_z(2, w, 1 + _last(r, w), 3), None, 1, 2),
        ["funcoll.all_to_all:", "gather_dim 2", "pass the same `gather_sizes`"],
    ),
    "all_to_all-gather_sizes-disagree": (
        lambda r, w: funcoll.all_to_all(
            _z(2, w, r + 1), None, 1, 2, gather_sizes=[i + 1 + (_last(r, w) and i == 0) for i in range(w)]
        ),
        ["funcoll.all_to_all:", "gather_dim 2"],
    ),
    "all_to_all-scatter_sizes-disagree": (
        lambda r, w: funcoll.all_to_all(
            _z(w, 2), None, 0, 1, scatter_sizes=[w] + [0] * (w - 1) if _last(r, w) else [1] * w
        ),
        ["funcoll.all_to_all:", "`scatter_sizes`"],
    ),
    "ppermute-perm": (
        lambda r, w: funcoll.ppermute(_z(3), [(0, 1)] if _last(r, w) else [(1, 0)]),
        ["funcoll.ppermute:", "`perm`", "[(0, 1)]", "[(1, 0)]"],
    ),
    "broadcast-src": (
        lambda r, w: funcoll.broadcast(_z(3), src=int(_last(r, w))),
        ["funcoll.broadcast:", "`src`"],
    ),
    "split_forward_gather_backward-grad_scale": (
        lambda r, w: funcoll.split_forward_gather_backward(_z(4), None, 0, "up" if _last(r, w) else None),
        ["funcoll.split_forward_gather_backward:", "`grad_scale`", "'up'", "None"],
    ),
    "different-ops": (
        lambda r, w: funcoll.broadcast(_z(3)) if _last(r, w) else funcoll.all_reduce(_z(3)),
        ["different ops", "rank 0: all_reduce", "broadcast"],
    ),
    "even-and-ragged-op": (
        lambda r, w: funcoll.gather(_z(1 + r, 3)) if _last(r, w) else funcoll.all_gather(_z(2, 3)),
        ["different ops", "gather"],
    ),
}


def _agreeing(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Ops whose ranks agree, checked: results against references computed by the parent."""
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    heads = funcoll.split_sizes(world + 1, world)
    return {
        "all_gather": funcoll.all_gather(x),
        "all_reduce": funcoll.all_reduce(x),
        "reduce_scatter": funcoll.reduce_scatter(torch.arange(2.0 * world) + rank),
        "ppermute": funcoll.ppermute(x, [(i, (i + 1) % world) for i in range(world)]),
        "all_to_all-heads": funcoll.all_to_all(
            torch.full((1, world, heads[rank]), float(rank)), None, 1, 2, gather_sizes=heads
        ),
    }


def run_body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with funcoll.set_checks(True):
        out["enabled"] = funcoll.checks_enabled()
        for cid, (call, _) in MISMATCHES.items():
            try:
                call(rank, world)
                out[cid] = ("no error", "")
            except Exception as e:  # noqa: BLE001 -- the test reads what was raised
                out[cid] = (type(e).__name__, str(e))
        out["agreeing"] = _agreeing(rank, world)
    return out


batch = once_per_world(run_body, TIMEOUT_S)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cid", list(MISMATCHES))
def test_mismatch_raises_the_same_value_error_on_every_rank(world: int, cid: str) -> None:
    results = batch(world)
    # each rank's message starts with the op it called (which differs in the different-ops cases)
    kinds = {(results[r][cid][0], results[r][cid][1].partition(": ")[2]) for r in range(world)}
    assert len(kinds) == 1, f"ranks raised different errors: {kinds}"
    for r in range(world):
        kind, msg = results[r][cid]
        assert kind == "ValueError", f"rank {r}: {kind}: {msg}"
        for fragment in MISMATCHES[cid][1]:
            assert fragment in msg, f"rank {r}: {fragment!r} not in {msg!r}"


@pytest.mark.parametrize("world", WORLDS)
def test_agreeing_ranks_get_the_reference(world: int) -> None:
    results = batch(world)
    xs = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]
    heads = [p.numel() for p in torch.tensor_split(torch.arange(world + 1), world)]
    for r in range(world):
        got = results[r]["agreeing"]
        torch.testing.assert_close(got["all_gather"], torch.cat(xs))
        torch.testing.assert_close(got["all_reduce"], sum(xs))
        rs = sum(torch.arange(2.0 * world) + i for i in range(world))
        torch.testing.assert_close(got["reduce_scatter"], rs[2 * r : 2 * r + 2])
        torch.testing.assert_close(got["ppermute"], xs[(r - 1) % world])
        a2a = torch.cat([torch.full((1, 1, heads[i]), float(i)) for i in range(world)], 2)
        torch.testing.assert_close(got["all_to_all-heads"], a2a)
        assert results[r]["enabled"] is True


def test_set_checks_restores_and_rejects_non_bools() -> None:
    before = funcoll.checks_enabled()
    with funcoll.set_checks(not before):
        assert funcoll.checks_enabled() is (not before)
    assert funcoll.checks_enabled() is before
    with pytest.raises(TypeError, match=r"funcoll.set_checks: `enabled` must be a bool, got int"):
        funcoll.set_checks(1)  # type: ignore[arg-type]
    assert funcoll.checks_enabled() is before
