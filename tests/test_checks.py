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
import funcoll.moe
import funcoll.testing
from funcoll._collective._fingerprint import AHEAD_BYTES

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
    "all_gather-wire": (
        lambda r, w: funcoll.all_gather(_z(2, 8), wire=funcoll.Wire(torch.int8) if _last(r, w) else None),
        ["funcoll.all_gather:", "`wire`", "rank 0: None", "Wire(torch.int8)"],
    ),
    "all_to_all-wire": (  # all_to_all's tail is full: its formats travel in ARG1
        lambda r, w: funcoll.all_to_all(
            _z(2, w, 8), None, 1, 0, wire=funcoll.Wire(torch.bfloat16) if r else None
        ),
        ["funcoll.all_to_all:", "`wire`, `grad_wire`", "rank 0: None, None", "Wire(torch.bfloat16)"],
    ),
    "reduce_scatter-grad_wire": (
        lambda r, w: funcoll.reduce_scatter(_z(w, 8), grad_wire=funcoll.Wire(torch.bfloat16) if r else None),
        ["funcoll.reduce_scatter:", "`grad_wire`", "rank 0: None", "Wire(torch.bfloat16)"],
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
    "even-and-static-op": (  # the static ops' header rows have every op's layout
        lambda r, w: funcoll.gather_padded(_z(2, 3), 1) if _last(r, w) else funcoll.all_gather(_z(2, 3)),
        ["different ops", "rank 0: all_gather", "gather_padded"],
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


# The default (no set_checks): the mistakes that kill a rank unchecked raise on the first call.
DEFAULT_MISTAKES: dict[str, tuple[Callable[[int, int], Any], list[str]]] = {
    "all_gather-shape": (
        lambda r, w: funcoll.all_gather(_z(2 + _last(r, w), 3)),
        ["funcoll.all_gather:", "the shape of `x` (", "shape (2, 3)", "shape (3, 3)"],
    ),
    "all_reduce-dtype": (
        lambda r, w: funcoll.all_reduce(_z(4, dtype=torch.float64 if _last(r, w) else torch.float32)),
        ["funcoll.all_reduce:", "`x`.dtype", "float64"],
    ),
    # Ulysses on a sequence of 2w + 1 (uneven S/w shards) without `gather_sizes` on the way in
    "all_to_all-uneven-sequence": (
        lambda r, w: funcoll.all_to_all(_z(1, funcoll.split_sizes(2 * w + 1, w)[r], w, 2), None, 2, 1),
        ["funcoll.all_to_all:", "length along gather_dim 1", "pass the same `gather_sizes`"],
    ),
    # an MoE layer built with a different expert count on one rank
    "moe.dispatch-num_experts": (
        lambda r, w: funcoll.moe.dispatch(
            _z(3, 4), torch.zeros(3, 1, dtype=torch.int64), w * (1 + _last(r, w))
        ),
        ["funcoll.moe.dispatch:", "`num_experts`", "rank 0: "],
    ),
    # static mode without a capacity (T * k) on ranks holding different token counts
    "moe.dispatch-static-capacity": (
        lambda r, w: funcoll.moe.dispatch(
            _z(2 + r, 4), torch.zeros(2 + r, 2, dtype=torch.int64), w, mode="static"
        ),
        ["funcoll.moe.dispatch:", "the static capacity", "rank 0: 4", "rank 1: 6"],
    ),
}


# The default's unchecked calls carry a fingerprint in their data's collective. Each mistake
# below is made on call 3 of a new group (calls 1 and 2, which agree, are checked), and
# keeps every rank's buffer large enough for what arrives (the same bytes meaning other
# things, or a broadcast into a larger buffer): unfingerprinted, gloo returned such a call's
# bytes as wrong data on some rank and went on. (A rank whose buffer is too small for a
# peer's data is aborted by gloo itself, which no test here can survive.)
def _third(call: Callable[[torch.Tensor, Any], Any], agreeing: torch.Tensor, mine: torch.Tensor) -> Any:
    g = torch.distributed.new_group(list(range(torch.distributed.get_world_size())))
    for _ in range(2):
        funcoll.wait(call(agreeing, g))
    return funcoll.wait(call(mine, g))


def _later(
    call: Callable[[torch.Tensor, Any], Any],
    rows: tuple[int, ...],
    last: tuple[int, ...],
    dtype: torch.dtype | None = None,
) -> Callable[[int, int], Any]:
    """The case: `call` of zeros shaped `rows` (times world where a 0 stands), the last rank's `last`."""

    def case(r: int, w: int) -> Any:
        def z(shape: tuple[int, ...], dt: torch.dtype = torch.float32) -> torch.Tensor:
            return _z(*(n or w for n in shape), dtype=dt)

        mine = z(last, dtype or torch.float32) if _last(r, w) else z(rows)
        return _third(call, z(rows), mine)

    return case


FINGERPRINT = ["ranks disagree on this call", "fingerprint", "funcoll.set_checks(True)"]
# Rows of 512 float32 whose all_gather sends its fingerprint ahead of the data (_fingerprint.AHEAD_BYTES).
AHEAD_ROWS = AHEAD_BYTES // (512 * 4)
LATER_MISTAKES: dict[str, tuple[Callable[[int, int], Any], list[str]]] = {
    "all_gather-shape-same-bytes": (
        _later(lambda x, g: funcoll.all_gather(x, group=g), (3, 4), (2, 6)),
        ["funcoll.all_gather:"],
    ),
    "all_gather-dtype-same-bytes": (
        _later(lambda x, g: funcoll.all_gather(x, group=g), (2, 3), (2, 3), torch.int32),
        ["funcoll.all_gather:"],
    ),
    "all_gather-ahead-shape-same-bytes": (
        _later(lambda x, g: funcoll.all_gather(x, group=g), (AHEAD_ROWS, 512), (AHEAD_ROWS // 2, 1024)),
        ["funcoll.all_gather:"],
    ),
    "all_gather-ahead-dtype-same-bytes": (
        _later(
            lambda x, g: funcoll.all_gather(x, group=g), (AHEAD_ROWS, 512), (AHEAD_ROWS, 512), torch.int32
        ),
        ["funcoll.all_gather:"],
    ),
    "all_gather_into_tensor-shape": (
        _later(lambda x, g: funcoll.all_gather_into_tensor(x, group=g), (6,), (2, 3)),
        ["funcoll.all_gather_into_tensor:"],
    ),
    "all_reduce-shape": (
        _later(lambda x, g: funcoll.all_reduce(x, group=g), (3, 4), (4, 3)),
        ["funcoll.all_reduce:"],
    ),
    "all_reduce-0d-shape": (
        _later(lambda x, g: funcoll.all_reduce(x, group=g), (), (1,)),
        ["funcoll.all_reduce:"],
    ),
    "all_reduce-op": (
        lambda r, w: _third(
            lambda x, g: funcoll.all_reduce(x, op="max" if _last(r, w) and x.dim() == 2 else "sum", group=g),
            _z(3),
            _z(1, 3),
        ),
        ["funcoll.all_reduce:"],
    ),
    "reduce_scatter-shape": (
        _later(lambda x, g: funcoll.reduce_scatter(x, group=g), (0, 6), (0, 2, 3)),
        ["funcoll.reduce_scatter:"],
    ),
    "all_to_all-shape": (
        _later(lambda x, g: funcoll.all_to_all(x, g, 0, 0), (0, 2, 3), (0, 3, 2)),
        ["funcoll.all_to_all:"],
    ),
    "ppermute-shape": (
        lambda r, w: _third(
            lambda x, g: funcoll.ppermute(x, [(i, (i + 1) % w) for i in range(w)], group=g),
            _z(3, 4),
            _z(2, 6) if _last(r, w) else _z(3, 4),
        ),
        ["funcoll.ppermute:"],
    ),
    "broadcast-shape": (
        _later(lambda x, g: funcoll.broadcast(x, 0, group=g), (2, 3), (3, 3)),
        ["funcoll.broadcast:"],
    ),
    "reduce-dtype": (
        _later(lambda x, g: funcoll.reduce(x, 0, group=g), (4,), (4,), torch.int32),
        ["funcoll.reduce:"],
    ),
}


def _big(rank: int) -> torch.Tensor:
    """A tensor whose all_gather's fingerprint goes ahead of the data: AHEAD_BYTES of float32."""
    return torch.arange(float(AHEAD_ROWS * 512)).reshape(AHEAD_ROWS, 512) + 0.5 * rank


def _unchecked_calls(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Eight agreeing calls of each op on a new group (3, 5, 6 and 7 fingerprinted), waited."""
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    ring = [(i, (i + 1) % world) for i in range(world)]
    calls: dict[str, Callable[[Any], Any]] = {
        "all_gather": lambda g: funcoll.all_gather(x, group=g),
        "all_gather-dim1-stacked": lambda g: funcoll.all_gather(x, 1, group=g, tiled=False),
        "all_gather-bf16": lambda g: funcoll.all_gather(x.bfloat16(), group=g),
        "all_gather-complex": lambda g: funcoll.all_gather(torch.complex(x, -x), group=g),
        "all_gather-no-rows": lambda g: funcoll.all_gather(x[:0], group=g),
        "all_gather-ahead": lambda g: funcoll.all_gather(_big(rank), group=g),
        "all_gather_into_tensor": lambda g: funcoll.all_gather_into_tensor(x, group=g),
        "all_reduce-sum": lambda g: funcoll.all_reduce(x, group=g),
        "all_reduce-avg": lambda g: funcoll.all_reduce(x, op="avg", group=g),
        "all_reduce-max": lambda g: funcoll.all_reduce(x, op="max", group=g),
        "all_reduce-min": lambda g: funcoll.all_reduce(x, op="min", group=g),
        "all_reduce-product": lambda g: funcoll.all_reduce(x + 1, op="product", group=g),
        "all_reduce-int64": lambda g: funcoll.all_reduce(x.long(), group=g),
        "all_reduce-bool": lambda g: funcoll.all_reduce(x.long() % 3 == 0, group=g),
        "all_reduce-0d": lambda g: funcoll.all_reduce(x.sum(), group=g),
        "reduce_scatter": lambda g: funcoll.reduce_scatter(torch.arange(2.0 * world) + rank, group=g),
        "all_to_all": lambda g: funcoll.all_to_all(
            torch.arange(2.0 * world).reshape(world, 2) + 10 * rank, g, 0, 1
        ),
        "ppermute": lambda g: funcoll.ppermute(x, ring, group=g),
        "broadcast": lambda g: funcoll.broadcast(x, world - 1, group=g),
        "reduce": lambda g: funcoll.reduce(x, 0, group=g),
    }
    out = {}
    for name, call in calls.items():
        g = torch.distributed.new_group(list(range(world)))
        out[name] = [funcoll.wait(call(g)) for _ in range(8)]
    return out


CALLS = 20  # calls 1, 2, 4, 8 and 16 are checked by default
SCHEDULE = [n for n in range(1, CALLS + 1) if n & (n - 1) == 0]


def _checked_calls(group: Any) -> list[int]:
    """The call numbers, of CALLS agreeing all_gathers on `group`, that read a header on the host."""
    read = []
    for n in range(1, CALLS + 1):
        with funcoll.testing.count_host_reads() as reads:
            funcoll.all_gather(torch.ones(2, 3), group=group)
        if reads.count:
            read.append(n)
    return read


def _raised(
    cases: dict[str, tuple[Callable[[int, int], Any], list[str]]], rank: int, world: int
) -> dict[str, Any]:
    """(exception type, message) of each case's call on this rank, ("no error", "") where none was raised."""
    out: dict[str, Any] = {}
    for cid, (call, _) in cases.items():
        try:
            call(rank, world)
            out[cid] = ("no error", "")
        except Exception as e:  # noqa: BLE001 -- the test reads what was raised
            out[cid] = (type(e).__name__, str(e))
    return out


def _default(rank: int, world: int) -> dict[str, Any]:
    out = _raised(DEFAULT_MISTAKES, rank, world)
    out.update(_raised(LATER_MISTAKES, rank, world))
    out["unchecked"] = _unchecked_calls(rank, world)
    # Ulysses both ways on that sequence, with the sizes: the global result, heads split
    s_sizes, h_sizes = funcoll.split_sizes(2 * world + 1, world), funcoll.split_sizes(world + 1, world)
    q = torch.arange(float(s_sizes[rank] * (world + 1))).reshape(1, s_sizes[rank], world + 1, 1) + 100 * rank
    o = funcoll.all_to_all(q, None, 2, 1, gather_sizes=s_sizes)
    out["ulysses"] = (o, funcoll.all_to_all(o, None, 1, 2, scatter_sizes=s_sizes, gather_sizes=h_sizes))
    out["schedule"] = _checked_calls(torch.distributed.new_group(list(range(world))))
    with funcoll.set_checks(False):
        out["off"] = _checked_calls(torch.distributed.new_group(list(range(world))))
    out["fallback"] = _fallback(rank)  # last: after it, this process checks no eager call
    return out


def _fallback(rank: int) -> tuple[list[torch.Tensor], int]:
    """Every rank runs a compiled all_gather once; then rank 0 runs it eagerly (a frame that fell
    back) while the others run it compiled: rank 0 checks none of its calls, so the ranks stay paired."""
    g = torch.distributed.new_group(list(range(torch.distributed.get_world_size())))
    compiled = torch.compile(lambda x: funcoll.all_gather(x, group=g), backend="eager", fullgraph=True)
    x = torch.full((2, 3), float(rank))
    got = [funcoll.wait(compiled(x))]
    step = (lambda x: funcoll.all_gather(x, group=g)) if rank == 0 else compiled
    with funcoll.testing.count_host_reads() as reads:
        got += [funcoll.wait(step(x)) for _ in range(3)]
    return got, reads.count


def run_body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with funcoll.set_checks(None):
        out["default"] = _default(rank, world)
    with funcoll.set_checks(True):
        out["enabled"] = funcoll.checks_enabled()
        out.update(_raised(MISMATCHES, rank, world))
        out["agreeing"] = _agreeing(rank, world)
    return out


batch = once_per_world(run_body, TIMEOUT_S, worlds=WORLDS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cid", list(MISMATCHES))
def test_mismatch_raises_the_same_value_error_on_every_rank(world: int, cid: str) -> None:
    results = batch(world)
    # each rank's message starts with the op it called (which differs in the different-ops cases)
    kinds = {(results[r][cid][0], results[r][cid][1].partition(": ")[2]) for r in range(world)}
    assert len(kinds) == 1, f"ranks raised different errors: {kinds}"
    _every_rank_raised([results[r][cid] for r in range(world)], MISMATCHES[cid][1])


def _every_rank_raised(raised: list[tuple[str, str]], fragments: list[str]) -> None:
    for r, (kind, msg) in enumerate(raised):
        assert kind == "ValueError", f"rank {r}: {kind}: {msg}"
        for fragment in fragments:
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
    with funcoll.set_checks(None):  # the default: not every call
        assert funcoll.checks_enabled() is False
    assert funcoll.checks_enabled() is before
    with pytest.raises(TypeError, match=r"funcoll.set_checks: `enabled` must be a bool or None, got int"):
        funcoll.set_checks(1)  # type: ignore[arg-type]
    assert funcoll.checks_enabled() is before


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cid", list(DEFAULT_MISTAKES))
def test_by_default_the_first_call_raises_on_every_rank(world: int, cid: str) -> None:
    """No set_checks: the mistakes that abort a rank unchecked raise funcoll's ValueError on every rank."""
    results = batch(world)
    _every_rank_raised([results[r]["default"][cid] for r in range(world)], DEFAULT_MISTAKES[cid][1])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cid", list(LATER_MISTAKES))
def test_by_default_an_unchecked_call_that_disagrees_raises_on_every_rank(world: int, cid: str) -> None:
    """Call 3 (unchecked) disagrees: its fingerprint raises funcoll's ValueError on every rank, no data returned."""
    results = batch(world)
    _every_rank_raised(
        [results[r]["default"][cid] for r in range(world)], [*LATER_MISTAKES[cid][1], *FINGERPRINT]
    )


def _unchecked_references(world: int) -> dict[str, torch.Tensor]:
    xs = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]
    return {
        "all_gather": torch.cat(xs),
        "all_gather-dim1-stacked": torch.stack(xs, 1),
        "all_gather-bf16": torch.cat([x.bfloat16() for x in xs]),
        "all_gather-complex": torch.cat([torch.complex(x, -x) for x in xs]),
        "all_gather-no-rows": torch.zeros(0, 3),
        "all_gather-ahead": torch.cat([_big(r) for r in range(world)]),
        "all_gather_into_tensor": torch.stack(xs),
        "all_reduce-sum": sum(xs),
        "all_reduce-avg": sum(xs) / world,
        "all_reduce-max": torch.stack(xs).amax(0),
        "all_reduce-min": torch.stack(xs).amin(0),
        "all_reduce-product": torch.stack([x + 1 for x in xs]).prod(0),
        "all_reduce-int64": sum(x.long() for x in xs),
        "all_reduce-bool": torch.stack([x.long() % 3 == 0 for x in xs]).any(0),
        "all_reduce-0d": torch.stack([x.sum() for x in xs]).sum(),
        "reduce_scatter": sum(torch.arange(2.0 * world) + i for i in range(world)),
        "broadcast": xs[-1],
        "reduce": sum(xs),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_by_default_unchecked_calls_that_agree_get_the_reference(world: int) -> None:
    """Calls 1-8 of every even op on a new group (3, 5, 6, 7 fingerprinted): the single-process result."""
    results = batch(world)
    refs = _unchecked_references(world)
    xs = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]
    for r in range(world):
        got = results[r]["default"]["unchecked"]
        mine = dict(refs)
        mine["reduce_scatter"] = refs["reduce_scatter"][2 * r : 2 * r + 2]
        mine["all_to_all"] = torch.stack(
            [a[r] for a in [torch.arange(2.0 * world).reshape(world, 2) + 10 * i for i in range(world)]], 0
        ).reshape(1, -1)
        mine["ppermute"] = xs[(r - 1) % world]
        mine["reduce"] = refs["reduce"] if r == 0 else torch.zeros(2, 3)
        for name, values in got.items():
            assert len(values) == 8, name
            for call, y in enumerate(values, 1):
                assert type(y) is torch.Tensor, (name, call, type(y))
                torch.testing.assert_close(
                    y, mine[name], rtol=0, atol=0, msg=f"rank {r}, {name}, call {call}"
                )


@pytest.mark.parametrize("world", WORLDS)
def test_by_default_calls_1_2_4_8_are_checked_and_off_none(world: int) -> None:
    results = batch(world)
    for r in range(world):
        assert results[r]["default"]["schedule"] == SCHEDULE, results[r]["default"]["schedule"]
        assert results[r]["default"]["off"] == [], results[r]["default"]["off"]


@pytest.mark.parametrize("world", WORLDS)
def test_ulysses_on_a_sequence_the_world_does_not_divide(world: int) -> None:
    """(B, S_r, H, D) -> (B, S, H_r, D) and back, S = 2w + 1 and H = w + 1: the global tensor, then the input."""
    results = batch(world)
    s_sizes, h_sizes = funcoll.split_sizes(2 * world + 1, world), funcoll.split_sizes(world + 1, world)
    qs = [
        torch.arange(float(s_sizes[r] * (world + 1))).reshape(1, s_sizes[r], world + 1, 1) + 100 * r
        for r in range(world)
    ]
    full = torch.cat(qs, 1)  # (1, S, H, 1)
    heads = torch.split(full, h_sizes, 2)
    for r in range(world):
        o, back = results[r]["default"]["ulysses"]
        torch.testing.assert_close(o, heads[r])
        torch.testing.assert_close(back, qs[r])


@pytest.mark.parametrize("world", WORLDS)
def test_by_default_no_eager_call_is_checked_once_compiled_code_has_run(world: int) -> None:
    """A rank that falls back to eager after compiled graphs ran meets the compiled ranks unchecked."""
    results = batch(world)
    want = torch.cat([torch.full((2, 3), float(r)) for r in range(world)])
    for r in range(world):
        got, reads = results[r]["default"]["fallback"]
        assert reads == 0, f"rank {r} read {reads} headers"
        for y in got:
            torch.testing.assert_close(y, want)
