"""Eager funcoll ops return before their data arrives; the wait happens at first use.

On a gloo group with torch's two worker threads a result is also waited before
funcoll's next collective is issued, so that one is in flight at a time
(``funcoll._collective._async.defers`` says why), which is checked first; an op on a
one-thread gloo group defers as on NCCL. Then each case calls a public op on 2 and 3 gloo
ranks, on the default group and again with ``FUNCOLL_GLOO_DEFER=1`` (no waits
between collectives), and reads
c10d's work registry (``funcoll.testing.in_flight()``) right after the call: an op
whose result reaches the caller unchanged or through views returns with its data collective still
registered (issued, not waited), so the caller's work until the first read
overlaps with it. Ops that must copy what arrives (a pad cut, a reduction of the
pieces, a layout change) return waited: the table says which. The result is
then read and compared with a single-process reference, and nothing is left in
flight afterwards. The even ops at dim 0 return the collective's output itself,
with no view op on the pending result (each goes through its Python dispatch).
A dropped result is waited when it is freed (nothing is left
registered), and ``funcoll.wait`` keeps the autograd history.

Ordering is what is checked, never time: benchmarks/bench_overlap.py measures how
much of the communication a step hides.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import funcoll
from funcoll import moe
from funcoll._collective._async import Pending
from funcoll.testing import gloo_worker_threads, in_flight, run_ranks, settled

WORLDS = (2, 3)
MODES = (False, True)  # FUNCOLL_GLOO_DEFER unset (one collective in flight at a time), set
COLS = 3


def _x(rank: int, rows: int) -> Tensor:
    return torch.arange(float(rows * COLS)).view(rows, COLS) + 100 * rank


def _even(world: int) -> list[Tensor]:
    return [_x(r, 2 * world) for r in range(world)]


def _ragged(world: int) -> list[Tensor]:
    return [_x(r, r + 1) for r in range(world)]


def _sizes(world: int) -> list[int]:
    return [r + 1 for r in range(world)]


def _reduce_scatter_ref(xs: list[Tensor], rank: int) -> Tensor:
    return torch.stack(xs).sum(0).chunk(len(xs))[rank]


def _a2a_ref(xs: list[Tensor], rank: int) -> Tensor:
    return torch.cat([x.chunk(len(xs))[rank] for x in xs])


# name -> (this rank's call, the single-process reference of its result, deferred)
CASES: dict[str, tuple[Callable[[int, int], Any], Callable[[int, int], Tensor], bool]] = {
    "all_gather": (lambda r, w: funcoll.all_gather(_even(w)[r]), lambda r, w: torch.cat(_even(w)), True),
    "all_gather-dim1": (lambda r, w: funcoll.all_gather(_even(w)[r], dim=1),
                        lambda r, w: torch.cat(_even(w), 1), False),  # the blocks interleave along dim 1: a copy
    "reduce_scatter": (lambda r, w: funcoll.reduce_scatter(_even(w)[r]),
                       lambda r, w: _reduce_scatter_ref(_even(w), r), True),
    "reduce_scatter-avg": (lambda r, w: funcoll.reduce_scatter(_even(w)[r], op="avg"),
                           lambda r, w: _reduce_scatter_ref(_even(w), r) / w, False),  # divides what arrives
    "all_reduce": (lambda r, w: funcoll.all_reduce(_even(w)[r]), lambda r, w: torch.stack(_even(w)).sum(0), True),
    "all_to_all": (lambda r, w: funcoll.all_to_all(_even(w)[r], None, 0, 0),
                   lambda r, w: _a2a_ref(_even(w), r), True),
    "broadcast": (lambda r, w: funcoll.broadcast(_even(w)[r], 1), lambda r, w: _even(w)[1], True),
    "ppermute": (lambda r, w: funcoll.ppermute(_even(w)[r], [(i, (i + 1) % w) for i in range(w)]),
                 lambda r, w: _even(w)[(r - 1) % w], True),
    "gather-exchanged": (lambda r, w: funcoll.gather(_ragged(w)[r]), lambda r, w: torch.cat(_ragged(w)), True),
    "gather-sizes": (lambda r, w: funcoll.gather(_ragged(w)[r], sizes=_sizes(w)),
                     lambda r, w: torch.cat(_ragged(w)), True),
    "gather-shift": (lambda r, w: funcoll.gather(_ragged(w)[r], sizes=_sizes(w), strategy="shift"),
                     lambda r, w: torch.cat(_ragged(w)), False),  # the pieces are concatenated
    "gather-pad": (lambda r, w: funcoll.gather(_ragged(w)[r], sizes=_sizes(w), strategy="pad"),
                   lambda r, w: torch.cat(_ragged(w)), False),  # the padding is cut
    "all_to_all_v": (lambda r, w: funcoll.all_to_all_v(_even(w)[r], [2] * w)[0],
                     lambda r, w: _a2a_ref(_even(w), r), True),
    "scatter": (lambda r, w: funcoll.scatter(_even(w)[r], 0),
                lambda r, w: _even(w)[0].tensor_split(w)[r], True),  # src's length exchanged, then one all_to_all
    "gather_forward_split_backward": (
        lambda r, w: funcoll.gather_forward_split_backward(_ragged(w)[r], None, 0, sizes=_sizes(w)),
        lambda r, w: torch.cat(_ragged(w)), True),
}  # fmt: skip


# Ops whose result is the collective's output itself: no view op on the pending result,
# each of which would go through its Python dispatch (moe's static mode calls the
# dim-0 all_to_all four times a step).
AS_ARRIVED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def _moe(rank: int, world: int) -> dict[str, Any]:
    """Dispatch then combine, exact mode: each lays its rows out (a copy) after computing where they go.

    Dispatch issues the rows' all_to_all, computes the expert layout from the
    counts while they travel, then copies them into it: it returns waited.
    """
    tokens = _x(rank, 4).double()
    idx = (torch.arange(8).view(4, 2) + rank) % (2 * world)
    recv, handle = moe.dispatch(tokens, idx, 2 * world)
    after_dispatch = in_flight()
    out = moe.combine(recv * 2, handle, torch.full((4, 2), 0.5, dtype=torch.float64))
    return {"after_dispatch": after_dispatch, "out": out.clone(), "tokens": tokens, "left": in_flight()}


def _body(rank: int, world: int) -> dict[str, Any]:
    got: dict[str, Any] = {}
    # gloo's default group (two worker threads): an op returns with its collective in
    # flight, and funcoll's next collective waits for it before it is issued.
    a = funcoll.all_gather(_even(world)[rank])
    first = in_flight()
    b = funcoll.all_gather(_even(world)[rank] * 2)
    got["gloo_default"] = {
        "types": [type(a).__name__, type(b).__name__],
        "first": first,
        "second": in_flight(),  # b's only: a was waited before b was issued
        "a_waited": a.ticket.done,
        "a": a.clone(),
        "b": b.clone(),
        "left": in_flight(),
    }
    # A gloo group with one worker thread runs its collectives in order, one at a time: it defers.
    with gloo_worker_threads(1):
        one_thread = dist.new_group(list(range(world)))
    y = funcoll.all_gather(_even(world)[rank], group=one_thread)
    issued = in_flight()  # before anything reads y
    got["gloo_one_thread"] = {
        "type": type(y).__name__,
        "in_flight": issued,
        "y": y.clone(),
        "left": in_flight(),
    }
    # Every case on the default group, then as NCCL runs it: deferred to the first use only.
    for defer_env in MODES:
        if defer_env:
            os.environ["FUNCOLL_GLOO_DEFER"] = "1"  # this rank's process only
        for name, (call, _, _) in CASES.items():
            y = call(rank, world)
            pending = in_flight()  # before anything reads y
            got[(defer_env, name)] = {
                "pending": pending,
                "type": type(y).__name__,
                # the collective's own output, no view of it taken (each a Python dispatch)
                # (or, on a call the default leaves unchecked, the fingerprinted collective's
                # result tensor, made beside its output: no view of the pending result either)
                "as_arrived": isinstance(y, Pending)
                and (y.elem is y.ticket.output or (y.ticket.sent is not None and y.elem is y.ticket.result)),
                "y": y.clone(),
                "left": in_flight(),
            }  # clone reads y
    got["moe"] = _moe(rank, world)

    # Ops on a pending result: views (with flat arguments, with a tuple out) stay pending
    # on the same collective; a read (flat arguments, a list of tensors) waits once.
    y = funcoll.all_gather(_even(world)[rank])
    views = {"view": y.view(-1), "permute": y.permute(1, 0), "split": torch.split(y, 2)}
    ops: dict[str, Any] = {
        "view_types": sorted({type(v).__name__ for v in [views["view"], views["permute"], *views["split"]]}),
        "pending_after_views": in_flight(),
    }
    ops["sum"] = views["permute"].sum([1])  # the first read: waits
    ops["pending_after_read"] = in_flight()
    ops["cat"] = torch.cat([views["split"][-1], _x(rank, 1), views["split"][0]])
    ops["mul"] = torch.mul(views["view"], 2)
    got["ops"] = ops

    # An input written in place while its collective is in flight: the backend may read the
    # written values, so the read of the result raises, naming the op (unchecked calls send
    # `x` itself; all_reduce's functional op copies it at the issue, so writing it is safe).
    written: dict[str, Any] = {}
    with funcoll.set_checks(False):
        for name, call in WRITTEN.items():
            x = _even(world)[rank].clone()
            y = call(x)
            x.add_(1)
            try:
                written[name] = ("read", y.clone())
            except ValueError as e:
                written[name] = ("raised", str(e))
            x = _even(world)[rank].clone()
            y = call(x)
            first = y.clone()  # read first, then written: no error, the values sent
            x.add_(1)
            written[f"{name}, read first"] = ("read", first)
    got["written"] = written

    # A result nobody reads is waited when it is freed: nothing stays registered.
    funcoll.all_gather(_even(world)[rank])
    got["dropped"] = in_flight()

    # funcoll.wait: the values, plain, with the autograd history kept.
    x = _x(rank, 2).requires_grad_()
    y = funcoll.all_gather(x)
    waited = funcoll.wait({"y": y})["y"]
    (waited * (rank + 1)).sum().backward()
    # x.grad is the backward's reduce_scatter, itself pending until read: settled reads it
    got["wait"] = {"type": type(waited).__name__, **settled({"grad": x.grad})}
    return got


# Ops whose collective reads the input while in flight, and all_reduce, whose functional op copies it.
WRITTEN: dict[str, Callable[[Tensor], Tensor]] = {
    "all_gather": lambda x: funcoll.all_gather(x),
    "all_to_all": lambda x: funcoll.all_to_all(x, None, 0, 0),
    "reduce_scatter": lambda x: funcoll.reduce_scatter(x),
    "gather pad": lambda x: funcoll.gather(x, 0, strategy="pad"),
    "all_reduce": lambda x: funcoll.all_reduce(x),
}


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, Any]]]:
    return {w: run_ranks(_body, w, timeout=120) for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("defer_env", MODES, ids=["gloo default", "FUNCOLL_GLOO_DEFER=1"])
@pytest.mark.parametrize("name", list(CASES))
def test_result_arrives_at_first_use(
    results: dict[int, list[dict[str, Any]]], world: int, defer_env: bool, name: str
) -> None:
    _, reference, deferred = CASES[name]
    for rank, got in enumerate(results[world]):
        r = got[(defer_env, name)]
        torch.testing.assert_close(r["y"], reference(rank, world), msg=lambda m, k=rank: f"rank {k}: {m}")
        assert r["left"] == 0, f"rank {rank}: {r['left']} collectives left in flight after the read"
        if deferred:
            assert r["pending"] >= 1 and r["type"] == "Pending", (rank, r["pending"], r["type"])
        else:
            assert r["pending"] == 0, f"rank {rank}: {r['pending']} in flight, expected a waited result"
        if name in AS_ARRIVED:
            assert r["as_arrived"], f"rank {rank}: {name} returned a view of its collective's output"


@pytest.mark.parametrize("world", WORLDS)
def test_gloo_default_keeps_one_collective_in_flight(
    results: dict[int, list[dict[str, Any]]], world: int
) -> None:
    for rank, got in enumerate(results[world]):
        g = got["gloo_default"]
        assert g["types"] == ["Pending", "Pending"], (rank, g["types"])
        assert (g["first"], g["second"], g["a_waited"], g["left"]) == (1, 1, True, 0), (rank, g)
        torch.testing.assert_close(g["a"], torch.cat(_even(world)))
        torch.testing.assert_close(g["b"], torch.cat(_even(world)) * 2)


@pytest.mark.parametrize("world", WORLDS)
def test_gloo_group_with_one_worker_thread_defers(
    results: dict[int, list[dict[str, Any]]], world: int
) -> None:
    for rank, got in enumerate(results[world]):
        g = got["gloo_one_thread"]
        assert (g["type"], g["left"]) == ("Pending", 0) and g["in_flight"] >= 1, (rank, g)
        torch.testing.assert_close(g["y"], torch.cat(_even(world)))


@pytest.mark.parametrize("world", WORLDS)
def test_moe_layout_copies_what_arrived(results: dict[int, list[dict[str, Any]]], world: int) -> None:
    for rank, got in enumerate(results[world]):
        m = got["moe"]
        assert m["after_dispatch"] == 0, f"rank {rank}: dispatch left {m['after_dispatch']} in flight"
        # combine(2 * dispatch(t)) with weight 0.5 on each of the top-2 copies: 0.5 * 2t + 0.5 * 2t
        torch.testing.assert_close(m["out"], 2 * m["tokens"])
        assert m["left"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_dropped_result_is_waited_and_wait_keeps_the_gradient(
    results: dict[int, list[dict[str, Any]]], world: int
) -> None:
    for rank, got in enumerate(results[world]):
        assert got["dropped"] == 0, f"rank {rank}: a dropped result stayed registered"
        w = got["wait"]
        assert w["type"] == "Tensor" and w["in_flight"] == 0, w
        # d/dx_r of sum_k (k + 1) * sum(gather(x)) = sum over ranks of (k + 1)
        want = torch.full((2, COLS), float(sum(k + 1 for k in range(world))))
        torch.testing.assert_close(w["grad"], want)


@pytest.mark.parametrize("world", WORLDS)
def test_ops_on_a_result_keep_views_pending_and_read_the_values(
    results: dict[int, list[dict[str, Any]]], world: int
) -> None:
    full = torch.cat(_even(world))
    for rank, got in enumerate(results[world]):
        ops = got["ops"]
        assert ops["view_types"] == ["Pending"], ops["view_types"]
        assert ops["pending_after_views"] >= 1, f"rank {rank}: a view waited"
        assert ops["pending_after_read"] == 0, f"rank {rank}: the read did not wait"
        torch.testing.assert_close(ops["sum"], full.sum(0))
        torch.testing.assert_close(ops["cat"], torch.cat([full[-2:], _x(rank, 1), full[:2]]))
        torch.testing.assert_close(ops["mul"], full.reshape(-1) * 2)


@pytest.mark.parametrize("world", WORLDS)
def test_input_written_in_flight_raises_at_the_read(
    results: dict[int, list[dict[str, Any]]], world: int
) -> None:
    """Writing an op's input before its result is read raises there (the data sent may hold the new
    values, silently, as with torch's own functional collectives); read first, the values are the
    single-process reference's; all_reduce's copy makes the write safe."""
    xs = _even(world)
    want = {
        "all_gather": lambda r: torch.cat(xs),
        "all_to_all": lambda r: _a2a_ref(xs, r),
        "reduce_scatter": lambda r: _reduce_scatter_ref(xs, r),
        "gather pad": lambda r: torch.cat(xs),
        "all_reduce": lambda r: sum(xs),
    }
    for rank, got in enumerate(results[world]):
        for name, ref in want.items():
            kind, value = got["written"][name]
            if name == "all_reduce":
                assert kind == "read", f"rank {rank} {name}: {value}"
                torch.testing.assert_close(value, ref(rank))
            else:
                assert kind == "raised", f"rank {rank} {name}: read {value}"
                op = "gather" if name == "gather pad" else name
                assert value.startswith(f"funcoll.{op}: its input was written in place while its "), value
            kind, value = got["written"][f"{name}, read first"]
            assert kind == "read", f"rank {rank} {name}, read first: {value}"
            torch.testing.assert_close(value, ref(rank))
