"""Multi-rank correctness of the even collectives (funcoll/_ops/_even.py) on real gloo ranks.

Every rank rebuilds its input from a seed keyed by (case, rank), so the parent process
can rebuild every rank's input and compute the global result in one process with plain
torch ops (cat, stack, sum, tensor_split). One ``run_ranks`` call per world size runs
every case; the tests below then check one entry each.

Gradients: every rank r computes ``loss_r = (y_r * w_r).sum()`` with its own seeded
weight ``w_r`` and calls backward; ``x_r.grad`` must equal d(sum_r loss_r)/d x_r, which
the parent gets from torch.autograd on the single-process reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _inputs import once_per_world, seeded
from torch import Tensor

import funcoll
from funcoll.testing import run_ranks

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 120.0

F32, F64, BF16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool
DTYPE_NAMES = {F32: "f32", F64: "f64", BF16: "bf16", I64: "i64", BOOL: "bool"}


# ------------------------------------------------------------------------------ inputs
@dataclass
class Case:
    """One call ``getattr(funcoll, op)(x, **kwargs)`` on every rank."""

    id: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kwargs: dict[str, Any] = field(default_factory=dict)
    grad: bool = False
    transposed: bool = False  # x is a non-contiguous transpose of its last two dims


def make_input(case: Case, rank: int) -> tuple[Tensor, Tensor]:
    """``(leaf, x)``: `x` has ``case.shape``; with ``transposed`` it is a non-contiguous view of `leaf`."""
    shape = list(case.shape)
    if case.transposed:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    leaf = seeded(shape, case.dtype, case.id, "x", rank).requires_grad_(case.grad)
    x = leaf.transpose(-1, -2) if case.transposed else leaf
    return leaf, x


def weight(case: Case, rank: int, shape: Sequence[int]) -> Tensor:
    return seeded(shape, F64, case.id, "w", rank)


def shape_id(shape: Sequence[int]) -> str:
    return "x" + "x".join(map(str, shape)) if shape else "scalar"


def case(fn: str, shape: tuple[int, ...], dtype: torch.dtype, /, *, grad: bool = False,
         transposed: bool = False, label: str = "", **kwargs: Any) -> Case:  # fmt: skip
    """A Case whose id reads as what it tests, e.g. ``all_gather-x5x7-dim1-tiledTrue-f64-T-grad``
    (``T``: non-contiguous input)."""
    args = "-".join(f"{k}{v}" for k, v in kwargs.items() if k != "perm")
    parts = [
        fn,
        shape_id(shape),
        args,
        label,
        DTYPE_NAMES[dtype],
        "T" if transposed else "",
        "grad" if grad else "",
    ]
    return Case("-".join(p for p in parts if p), fn, shape, dtype, kwargs, grad, transposed)


def ring(world: int, step: int) -> list[tuple[int, int]]:
    return [(i, (i + step) % world) for i in range(world)]


def even_cases(world: int) -> list[Case]:
    """Every case of the main batch; shapes that must divide by world scale with it."""
    w = world
    cases = [
        # all_gather, tiled
        case("all_gather", (5, 7), F32, dim=0, tiled=True),
        case("all_gather", (5, 7), BF16, dim=1, tiled=True),
        case("all_gather", (5, 7), I64, dim=-1, tiled=True, transposed=True),
        case("all_gather", (7, 5), BOOL, dim=0, tiled=True),
        case("all_gather", (2, 5, 7), F32, dim=-2, tiled=True),
        case("all_gather", (2, 5, 7), F64, dim=-2, tiled=True, grad=True),
        case("all_gather", (5, 7), F64, dim=1, tiled=True, grad=True, transposed=True),
        case("all_gather", (7,), F64, dim=0, tiled=True, grad=True),
        case("all_gather", (0, 5), F32, dim=0, tiled=True),
        case("all_gather", (5, 0), F32, dim=-1, tiled=False),
        # all_gather, stacked: the new rank axis goes at `dim`
        case("all_gather", (5, 7), F32, dim=0, tiled=False),
        case("all_gather", (5, 7), I64, dim=-1, tiled=False),
        case("all_gather", (5, 7), BF16, dim=2, tiled=False, transposed=True),
        case("all_gather", (5, 7), BOOL, dim=1, tiled=False),
        case("all_gather", (2, 5, 7), F64, dim=1, tiled=False, grad=True),
        case("all_gather", (5, 7), F64, dim=-3, tiled=False, grad=True, transposed=True),
        # all_gather_into_tensor
        case("all_gather_into_tensor", (5, 7), F32),
        case("all_gather_into_tensor", (5, 7), BF16, transposed=True),
        case("all_gather_into_tensor", (3, 5), I64),
        case("all_gather_into_tensor", (3, 5), F64, grad=True),
        # reduce_scatter, tiled: the scattered dim is 3 * world
        case("reduce_scatter", (3 * w, 5), F32, dim=0, op="sum"),
        case("reduce_scatter", (3 * w, 5), I64, dim=0, op="sum"),
        case("reduce_scatter", (5, 3 * w), F32, dim=-1, op="avg"),
        case("reduce_scatter", (5, 3 * w), BF16, dim=1, op="avg"),
        case("reduce_scatter", (3 * w, 7), I64, dim=0, op="max", transposed=True),
        case("reduce_scatter", (2, 3 * w, 7), BF16, dim=1, op="min"),
        case("reduce_scatter", (7, 3 * w), F32, dim=-1, op="product"),
        case("reduce_scatter", (7, 3 * w), I64, dim=1, op="product", transposed=True),
        case("reduce_scatter", (3 * w, 5), BOOL, dim=0, op="sum"),
        case("reduce_scatter", (5, 3 * w), BOOL, dim=-1, op="product"),
        case("reduce_scatter", (3 * w, 5), F64, dim=0, op="sum", grad=True),
        case("reduce_scatter", (5, 3 * w), F64, dim=-1, op="sum", grad=True, transposed=True),
        case("reduce_scatter", (2, 3 * w, 7), F64, dim=1, op="avg", grad=True),
        # reduce_scatter, tiled=False: x.shape[dim] == world and the dim is removed
        case("reduce_scatter", (w, 5), F32, dim=0, op="sum", tiled=False),
        case("reduce_scatter", (5, 7, w), I64, dim=-1, op="max", tiled=False),
        case("reduce_scatter", (5, w, 7), F64, dim=1, op="sum", tiled=False, grad=True),
        case("reduce_scatter", (5, w), F64, dim=-1, op="avg", tiled=False, grad=True, transposed=True),
        # all_reduce
        case("all_reduce", (5, 7), F32, op="sum"),
        case("all_reduce", (5, 7), I64, op="sum", transposed=True),
        case("all_reduce", (5, 7), F32, op="avg"),
        case("all_reduce", (7,), BF16, op="max"),
        case("all_reduce", (5, 7), I64, op="min"),
        case("all_reduce", (5, 7), BF16, op="product", transposed=True),
        case("all_reduce", (3, 5), F64, op="product"),
        case("all_reduce", (0, 5), F32, op="sum"),
        case("all_reduce", (5, 7), BOOL, op="sum"),
        case("all_reduce", (5, 7), BOOL, op="product", transposed=True),
        case("all_reduce", (7,), BOOL, op="max"),
        case("all_reduce", (7,), BOOL, op="min"),
        case("all_reduce", (5, 7), F64, op="sum", grad=True, transposed=True),
        case("all_reduce", (2, 5, 7), F64, op="avg", grad=True),
        case("all_reduce", (), F64, op="sum", grad=True),
        # all_to_all: uneven scatter dims follow torch.tensor_split
        case("all_to_all", (2, 5, 3 * w, 3), F32, scatter_dim=2, gather_dim=1),
        case("all_to_all", (5, 7), F32, scatter_dim=1, gather_dim=0),
        case("all_to_all", (7, 5), I64, scatter_dim=0, gather_dim=0),
        case("all_to_all", (5, 7), BF16, scatter_dim=-1, gather_dim=-2, transposed=True),
        case("all_to_all", (5, 7, 2), F32, scatter_dim=1, gather_dim=1),
        case("all_to_all", (7, 5), BOOL, scatter_dim=0, gather_dim=1),
        case("all_to_all", (3, 7), F64, scatter_dim=1, gather_dim=0, grad=True),
        case("all_to_all", (7, 5), F64, scatter_dim=0, gather_dim=1, grad=True, transposed=True),
        case("all_to_all", (5, 2 * w), F64, scatter_dim=-1, gather_dim=0, grad=True),
        case("all_to_all", (2, 5), F64, scatter_dim=0, gather_dim=1, grad=True),  # pieces of 0 rows (w 3, 4)
        case("all_to_all", (2, 5), F64, scatter_dim=0, gather_dim=0, grad=True),
        case("all_to_all", (7, 5), F64, scatter_dim=-2, gather_dim=-2, grad=True),
        # ppermute with full permutations (partial ones: partial_perm_cases)
        case("ppermute", (5, 7), F32, perm=ring(w, 1), label="ring+1"),
        case("ppermute", (5, 7), I64, perm=ring(w, -1), label="ring-1", transposed=True),
        case("ppermute", (7,), BF16, perm=[(i, w - 1 - i) for i in range(w)], label="reverse"),
        case("ppermute", (5, 7), F64, perm=ring(w, 1), label="ring+1", grad=True, transposed=True),
        case("ppermute", (3, 5), F64, perm=[(i, w - 1 - i) for i in range(w)], label="reverse", grad=True),
        case("ppermute", (), F64, perm=ring(w, 1), label="ring+1", grad=True),
        # broadcast
        case("broadcast", (5, 7), F32, src=0),
        case("broadcast", (5, 7), I64, src=w - 1),
        case("broadcast", (5, 7), BF16, src=w // 2, transposed=True),
        case("broadcast", (5, 7), F64, src=0, grad=True),
        case("broadcast", (7, 5), F64, src=w - 1, grad=True, transposed=True),
        case("broadcast", (), F64, src=w - 1, grad=True),
        # reduce: dst gets the reduction, the other ranks zeros
        case("reduce", (5, 7), F32, dst=0, op="sum"),
        case("reduce", (5, 7), I64, dst=w - 1, op="max", transposed=True),
        case("reduce", (7, 5), BF16, dst=w // 2, op="min"),
        case("reduce", (5, 7), BOOL, dst=w - 1, op="sum"),
        case("reduce", (3, 5), I64, dst=0, op="product"),
        case("reduce", (5, 7), F64, dst=w - 1, op="sum", grad=True, transposed=True),
        case("reduce", (3, 5), F64, dst=0, op="avg", grad=True),
        case("reduce", (0, 5), F64, dst=w - 1, op="sum", grad=True),
        case("reduce", (), F64, dst=w // 2, op="sum", grad=True),
    ] + (partial_perm_cases(w) if w > 1 else [])
    assert len({c.id for c in cases}) == len(cases), "case ids must be unique"
    return cases


def scalar_gather_cases() -> list[Case]:
    """all_gather of 0-d tensors: stacking gives shape (world,)."""
    return [
        case("all_gather_into_tensor", (), F64, grad=True),
        case("all_gather", (), F32, dim=0, tiled=False),
        case("all_gather", (), F64, dim=-1, tiled=False, grad=True),
    ]


def scalar_gather_body(rank: int, world: int) -> dict[str, Any]:
    return {c.id: run_case(c, rank) for c in scalar_gather_cases()}


def partial_perm_cases(world: int) -> list[Case]:
    """ppermute where some ranks send or receive nothing: they get zeros and a zero gradient (world >= 2)."""
    w = world
    chain = [(i, i + 1) for i in range(w - 1)]  # rank 0 receives nothing, rank w-1 sends nothing
    return [
        case("ppermute", (5, 7), F32, perm=chain, label="chain"),
        case("ppermute", (5, 7), I64, perm=[(0, w - 1)], label="0to-1"),
        case("ppermute", (5, 7), F64, perm=chain, label="chain", grad=True),
        case("ppermute", (3, 5), F64, perm=[(w - 1, 0)], label="-1to0", grad=True, transposed=True),
        case("ppermute", (3,), F64, perm=[], label="empty", grad=True),
    ]


# ------------------------------------------------------------------- in-rank bad input
@dataclass
class BadCall:
    """A call that must raise before communicating; only the last rank makes it."""

    id: str
    call: Callable[[int], object]  # world -> the call's result
    exc: type[Exception]
    op: str
    fragment: str  # text the message must contain (the argument, in backticks where named)


X57 = seeded((5, 7), F32, "bad")


def bad_calls_in_ranks(world: int) -> list[BadCall]:
    w = world
    calls = [
        BadCall("all_gather-dim2", lambda w: funcoll.all_gather(X57, 2), ValueError, "all_gather", "`dim`=2"),
        BadCall(
            "all_to_all-scatter_dim-3",
            lambda w: funcoll.all_to_all(X57, None, -3, 0),
            ValueError,
            "all_to_all",
            "`scatter_dim`=-3",
        ),
        BadCall(
            "all_reduce-op-mean",
            lambda w: funcoll.all_reduce(X57, op="mean"),
            ValueError,
            "all_reduce",
            "`op`='mean'",
        ),
        BadCall(
            "reduce_scatter-tiledF-x5x7",
            lambda w: funcoll.reduce_scatter(X57, 0, tiled=False),
            ValueError,
            "reduce_scatter",
            "tiled=False",
        ),
        BadCall(
            "ppermute-perm-dst-w",
            lambda w: funcoll.ppermute(X57, [(0, w)]),
            ValueError,
            "ppermute",
            f"`perm`={w}",
        ),
        BadCall(
            "ppermute-perm-str", lambda w: funcoll.ppermute(X57, "ring"), TypeError, "ppermute", "`perm`"
        ),
        BadCall(
            "broadcast-src-w", lambda w: funcoll.broadcast(X57, w), ValueError, "broadcast", f"`src`={w}"
        ),
        BadCall(
            "broadcast-src-neg", lambda w: funcoll.broadcast(X57, -1), ValueError, "broadcast", "`src`=-1"
        ),
        BadCall("reduce-dst-w", lambda w: funcoll.reduce(X57, w), ValueError, "reduce", f"`dst`={w}"),
        BadCall(
            "reduce-op-mean", lambda w: funcoll.reduce(X57, 0, "mean"), ValueError, "reduce", "`op`='mean'"
        ),
        BadCall(
            "reduce-avg-int",
            lambda w: funcoll.reduce(X57.long(), 0, "avg"),
            ValueError,
            "reduce",
            "`op`='avg' needs a floating dtype",
        ),
    ]
    if w > 1:
        calls += [
            BadCall("reduce_scatter-x(3w+1)x5-dim0",
                    lambda w: funcoll.reduce_scatter(seeded((3 * w + 1, 5), F32, "bad"), 0),
                    ValueError, "reduce_scatter", f"x.shape[0]={3 * w + 1} does not divide"),
            BadCall("reduce_scatter-x5x(3w+1)-dim-1-avg",
                    lambda w: funcoll.reduce_scatter(seeded((5, 3 * w + 1), F32, "bad"), -1, op="avg"),
                    ValueError, "reduce_scatter", f"x.shape[1]={3 * w + 1} does not divide"),
            BadCall("ppermute-perm-dup-dst",
                    lambda w: funcoll.ppermute(X57, [(0, 0), (1, 0)]), ValueError, "ppermute", "`perm`"),
        ]  # fmt: skip
    return calls


# --------------------------------------------------------------------------- rank body
def run_case(c: Case, rank: int) -> dict[str, Any]:
    leaf, x = make_input(c, rank)
    y = getattr(funcoll, c.op)(x, **c.kwargs)
    out: dict[str, Any] = {
        "y": y.detach(),
        "contiguous": y.is_contiguous(),
        # Empty tensors all have data_ptr 0; only non-empty ones can alias.
        "aliases_x": x.numel() > 0
        and funcoll.wait(y).untyped_storage().data_ptr() == x.untyped_storage().data_ptr(),
    }
    if c.grad:
        (y * weight(c, rank, y.shape)).sum().backward()
        out["grad"] = leaf.grad
    return out


def bad_call_outcome(b: BadCall, world: int) -> tuple[str, str]:
    try:
        b.call(world)
    except Exception as e:  # noqa: BLE001 (recorded; the parent checks the type and the message)
        return type(e).__name__, str(e)
    return "no error", ""


NO_GRAD_OPS = [
    ("all_reduce", "max"),
    ("all_reduce", "product"),
    ("reduce_scatter", "min"),
    ("reduce_scatter", "max"),
    ("reduce", "max"),
    ("reduce", "product"),
]


def no_grad_outcome(fn: str, op: str, rank: int, world: int) -> tuple[str, str]:
    """Backward through an op without a gradient: every rank must raise the same error."""
    x = seeded((2 * world, 3), F64, "no-grad", fn, op, rank).requires_grad_(True)
    y = funcoll.reduce(x, world - 1, op=op) if fn == "reduce" else getattr(funcoll, fn)(x, op=op)
    try:
        y.sum().backward()
    except Exception as e:  # noqa: BLE001 (recorded; the parent checks the type and the message)
        return type(e).__name__, str(e)
    return "no error", ""


def even_body(rank: int, world: int) -> dict[str, Any]:
    # The last rank alone makes the bad calls first: had any of them sent something, the
    # collectives of the batch below would be mismatched across ranks and fail.
    errors = (
        {b.id: bad_call_outcome(b, world) for b in bad_calls_in_ranks(world)} if rank == world - 1 else {}
    )
    results = {c.id: run_case(c, rank) for c in even_cases(world)}
    no_grad = {(fn, op): no_grad_outcome(fn, op, rank, world) for fn, op in NO_GRAD_OPS} if world > 1 else {}
    # All ranks are still in step: one more collective checks it.
    check = funcoll.all_reduce(torch.ones(1))
    return {"results": results, "errors": errors, "no_grad": no_grad, "final_all_reduce": check}


even_batch = once_per_world(
    even_body, TIMEOUT_S, worlds=WORLDS
)  # the batch on `world` ranks, run once per session


# --------------------------------------------------------------------------- reference
def reduce_over_ranks(stacked: Tensor, op: str, world: int) -> Tensor:
    """Reduce the rank axis (dim 0) of `stacked` in one process."""
    if stacked.dtype == BOOL:  # torch's bool sum and product: logical or and and
        return stacked.any(0) if op in ("sum", "max") else stacked.all(0)
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / world
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    assert op == "product"
    return stacked.prod(0)


def reference(c: Case, xs: list[Tensor]) -> list[Tensor]:
    """Every rank's output, from every rank's input, computed in one process."""
    w, k = len(xs), c.kwargs
    if c.op == "all_gather":
        full = torch.cat(xs, k["dim"]) if k["tiled"] else torch.stack(xs, k["dim"])
        return [full] * w
    if c.op == "all_gather_into_tensor":
        return [torch.stack(xs, 0)] * w
    if c.op == "reduce_scatter":
        total = reduce_over_ranks(torch.stack(xs), k["op"], w)
        if k.get("tiled", True):
            return list(torch.tensor_split(total, w, k["dim"]))
        return [total.select(k["dim"], r) for r in range(w)]
    if c.op == "all_reduce":
        return [reduce_over_ranks(torch.stack(xs), k["op"], w)] * w
    if c.op == "all_to_all":
        pieces = [torch.tensor_split(x, w, k["scatter_dim"]) for x in xs]
        return [torch.cat([pieces[i][r] for i in range(w)], k["gather_dim"]) for r in range(w)]
    if c.op == "ppermute":
        src_of = {dst: src for src, dst in k["perm"]}
        return [xs[src_of[r]] if r in src_of else torch.zeros_like(xs[r]) for r in range(w)]
    if c.op == "reduce":
        total = reduce_over_ranks(torch.stack(xs), k["op"], w)
        return [total if r == k["dst"] else torch.zeros_like(total) for r in range(w)]
    assert c.op == "broadcast"
    return [xs[k["src"]]] * w


def reference_grads(c: Case, world: int) -> list[Tensor]:
    """d(sum_r (y_r * w_r).sum()) / d leaf_r for every rank, by autograd in one process."""
    leaves, xs = zip(*(make_input(c, r) for r in range(world)), strict=False)
    ys = reference(c, list(xs))
    loss = sum((y * weight(c, r, y.shape)).sum() for r, y in enumerate(ys))
    if not loss.requires_grad:  # no output depends on any input (ppermute with an empty perm)
        return [torch.zeros_like(leaf) for leaf in leaves]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(grads, leaves, strict=False)]


def check_forward(c: Case, world: int, results: list[dict[str, Any]]) -> None:
    xs = [make_input(c, r)[1].detach() for r in range(world)]
    expected = reference(c, xs)
    for r in range(world):
        got = results[r]
        # Integer-valued inputs make every non-float64 result exact; float64 sums may round differently.
        exact = {} if c.dtype == F64 else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(got["y"], expected[r], **exact, msg=lambda m, r=r: f"rank {r}: {m}")
        assert not got["aliases_x"], f"rank {r}: the result shares memory with x"


def check_grads(c: Case, world: int, results: list[dict[str, Any]]) -> None:
    expected = reference_grads(c, world)
    for r in range(world):
        got = results[r]["grad"]
        assert got is not None, f"rank {r}: x.grad is None"
        torch.testing.assert_close(got, expected[r], msg=lambda m, r=r: f"rank {r}: {m}")


# ------------------------------------------------------------------------------- tests
FORWARD = [pytest.param(w, c, id=f"w{w}-{c.id}") for w in WORLDS for c in even_cases(w)]
GRADS = [p for p in FORWARD if p.values[1].grad]
IN_RANK_ERRORS = [pytest.param(w, b, id=f"w{w}-{b.id}") for w in WORLDS for b in bad_calls_in_ranks(w)]


@pytest.mark.parametrize("world, c", FORWARD)
def test_forward(world: int, c: Case) -> None:
    results = even_batch(world)
    check_forward(c, world, [res["results"][c.id] for res in results])


@pytest.mark.parametrize("world, c", FORWARD)
def test_result_is_contiguous(world: int, c: Case) -> None:
    """A new contiguous tensor, whatever the input's strides (a single rank included)."""
    for r, res in enumerate(even_batch(world)):
        assert res["results"][c.id]["contiguous"], f"rank {r}: the result is not contiguous"


@pytest.mark.parametrize("world, c", GRADS)
def test_grad(world: int, c: Case) -> None:
    results = even_batch(world)
    check_grads(c, world, [res["results"][c.id] for res in results])


@pytest.mark.parametrize("world, bad", IN_RANK_ERRORS)
def test_bad_input_in_ranks(world: int, bad: BadCall) -> None:
    results = even_batch(world)
    kind, message = results[world - 1]["errors"][bad.id]
    assert kind == bad.exc.__name__, message
    assert message.startswith(f"funcoll.{bad.op}: "), message
    assert bad.fragment in message, message


@pytest.mark.parametrize(
    "world, fn, op",
    [pytest.param(w, fn, op, id=f"w{w}-{fn}-{op}") for w in WORLDS[1:] for fn, op in NO_GRAD_OPS],
)
def test_backward_of_op_without_gradient(world: int, fn: str, op: str) -> None:
    """max/min/product have no gradient: backward raises NotImplementedError on every rank."""
    for r, res in enumerate(even_batch(world)):
        kind, message = res["no_grad"][(fn, op)]
        assert kind == "NotImplementedError", f"rank {r}: {kind}: {message}"
        assert message.startswith(f"funcoll.{fn}: no gradient for op={op!r}"), f"rank {r}: {message}"


@pytest.mark.parametrize("world", WORLDS, ids=[f"w{w}" for w in WORLDS])
def test_ranks_stay_in_step_after_bad_calls(world: int) -> None:
    """The last rank's bad calls sent nothing: a final all_reduce still sums world ones."""
    for res in even_batch(world):
        torch.testing.assert_close(res["final_all_reduce"], torch.full((1,), float(world)))


@pytest.mark.parametrize("world", (2,), ids=["w2"])
def test_all_gather_scalar(world: int) -> None:
    results = run_ranks(scalar_gather_body, world, timeout=60.0)
    for c in scalar_gather_cases():
        per_rank = [res[c.id] for res in results]
        check_forward(c, world, per_rank)
        if c.grad:
            check_grads(c, world, per_rank)


@pytest.mark.parametrize("c", [pytest.param(c, id=f"w1-{c.id}") for c in scalar_gather_cases()])
def test_all_gather_scalar_single_rank(c: Case) -> None:
    """Without torch.distributed: the same cases on one rank, where the stack has shape (1,)."""
    per_rank = [run_case(c, 0)]
    check_forward(c, 1, per_rank)
    if c.grad:
        check_grads(c, 1, per_rank)


# ------------------------------------------------------- bad input, single process, no dist
X = seeded((5, 7), F32, "single")
XI = seeded((5, 7), I64, "single")

SINGLE_PROCESS_ERRORS = [
    pytest.param(lambda: funcoll.all_gather([1.0]), TypeError, "all_gather", "`x`", id="all_gather-list-x"),
    pytest.param(lambda: funcoll.all_gather(X, 2), ValueError, "all_gather", "`dim`=2", id="all_gather-x5x7-dim2"),
    pytest.param(lambda: funcoll.all_gather(X, -3), ValueError, "all_gather", "`dim`=-3",
                 id="all_gather-x5x7-dim-3"),
    pytest.param(lambda: funcoll.all_gather(X, 3, tiled=False), ValueError, "all_gather", "`dim`=3",
                 id="all_gather-x5x7-dim3-untiled"),
    pytest.param(lambda: funcoll.all_gather(X, 0.0), TypeError, "all_gather", "`dim`", id="all_gather-float-dim"),
    pytest.param(lambda: funcoll.all_gather(torch.tensor(1.0), 1), ValueError, "all_gather", "`dim`=1",
                 id="all_gather-0d-dim1"),
    pytest.param(lambda: funcoll.all_gather_into_tensor("x"), TypeError, "all_gather_into_tensor", "`x`",
                 id="all_gather_into_tensor-str-x"),
    pytest.param(lambda: funcoll.reduce_scatter(X, 2), ValueError, "reduce_scatter", "`dim`=2",
                 id="reduce_scatter-x5x7-dim2"),
    pytest.param(lambda: funcoll.reduce_scatter(X, op="mean"), ValueError, "reduce_scatter", "`op`='mean'",
                 id="reduce_scatter-op-mean"),
    pytest.param(lambda: funcoll.reduce_scatter(X, op=None), ValueError, "reduce_scatter", "`op`=None",
                 id="reduce_scatter-op-None"),
    pytest.param(lambda: funcoll.reduce_scatter(XI, op="avg"), ValueError, "reduce_scatter", "`op`='avg'",
                 id="reduce_scatter-i64-avg"),
    pytest.param(lambda: funcoll.reduce_scatter(X, 1, tiled=False), ValueError, "reduce_scatter",
                 "tiled=False", id="reduce_scatter-x5x7-dim1-untiled"),
    pytest.param(lambda: funcoll.reduce_scatter(X, 0, tiled=False, sizes=[5]), ValueError, "reduce_scatter",
                 "`sizes` is for tiled=True", id="reduce_scatter-untiled-with-sizes"),
    pytest.param(lambda: funcoll.all_reduce(X, op="xor"), ValueError, "all_reduce", "`op`='xor'",
                 id="all_reduce-op-xor"),
    pytest.param(lambda: funcoll.all_reduce(XI, op="avg"), ValueError, "all_reduce", "`op`='avg'",
                 id="all_reduce-i64-avg"),
    pytest.param(lambda: funcoll.all_to_all(X, None, 2, 0), ValueError, "all_to_all", "`scatter_dim`=2",
                 id="all_to_all-x5x7-scatter_dim2"),
    pytest.param(lambda: funcoll.all_to_all(X, None, 0, -3), ValueError, "all_to_all", "`gather_dim`=-3",
                 id="all_to_all-x5x7-gather_dim-3"),
    pytest.param(lambda: funcoll.all_to_all(X, None, "0", 1), TypeError, "all_to_all", "`scatter_dim`",
                 id="all_to_all-str-scatter_dim"),
    pytest.param(lambda: funcoll.ppermute(X, {0: 0}), TypeError, "ppermute", "`perm`", id="ppermute-dict-perm"),
    pytest.param(lambda: funcoll.ppermute(X, [(0, 0, 0)]), ValueError, "ppermute", "`perm`",
                 id="ppermute-triple"),
    pytest.param(lambda: funcoll.ppermute(X, [(0, 1)]), ValueError, "ppermute", "`perm`=1",
                 id="ppermute-dst-out-of-group"),
    pytest.param(lambda: funcoll.ppermute(X, [(0.0, 0)]), TypeError, "ppermute", "`perm`",
                 id="ppermute-float-src"),
    pytest.param(lambda: funcoll.broadcast(X, 1), ValueError, "broadcast", "`src`=1", id="broadcast-src1-w1"),
    pytest.param(lambda: funcoll.broadcast(X, "0"), TypeError, "broadcast", "`src`", id="broadcast-str-src"),
    pytest.param(lambda: funcoll.reduce(X, 1), ValueError, "reduce", "`dst`=1", id="reduce-dst1-w1"),
    pytest.param(lambda: funcoll.reduce(X, None), TypeError, "reduce", "`dst`", id="reduce-none-dst"),
    pytest.param(lambda: funcoll.reduce([1.0], 0), TypeError, "reduce", "`x`", id="reduce-list-x"),
]  # fmt: skip


@pytest.mark.parametrize("call, exc, op, fragment", SINGLE_PROCESS_ERRORS)
def test_bad_input_single_process(
    call: Callable[[], object], exc: type[Exception], op: str, fragment: str
) -> None:
    assert not dist.is_initialized()
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert type(info.value) is exc, message
    assert message.startswith(f"funcoll.{op}: "), message
    assert fragment in message, message
