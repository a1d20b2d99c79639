"""Multi-rank correctness of the region ops (funcoll/_ops/_region.py) on real gloo ranks.

The region ops assume the computation after them is replicated, so their references are:

* ``split_forward_gather_backward``: every rank holds the same full `x` and keeps its
  ``torch.tensor_split`` piece r; rank r computes ``loss_r = (y_r * w_r).sum()``. Every rank's
  ``x.grad`` is ``scale * d(sum_r loss_r)/dx``: the gradient pieces gathered.
* ``gather_forward_split_backward``: rank r holds piece r of a full tensor; every rank computes
  the same ``loss = (sin(full) * W).sum()``. ``x_r.grad`` is ``scale * (slice r of dloss/dfull)``.

with ``scale`` 1 for None and 1.0, world for ``"up"`` and 1/world for ``"down"``. Both are
computed with torch.autograd in one process. One ``run_ranks`` call per world size runs
every case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _inputs import once_per_world, seeded
from torch import Tensor

import funcoll

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 120.0
SPLIT, GATHER = "split_forward_gather_backward", "gather_forward_split_backward"

F32, F64, BF16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool
DTYPE_NAMES = {F32: "f32", F64: "f64", BF16: "bf16", I64: "i64", BOOL: "bool"}
GradScale = Any  # None, 1.0, "up", "down" (and bad values in the error tests)


@dataclass
class RegionCase:
    """One region op on every rank; `shape` is the full (gathered) shape as the op sees it."""

    id: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    grad_scale: GradScale = None
    grad: bool = False
    transposed: bool = False  # x is a non-contiguous transpose of its last two dims
    sizes: tuple[int, ...] | None = None  # GATHER: each rank's length; None: torch.tensor_split pieces
    given: bool = False  # GATHER: pass the lengths as `sizes=` (nothing exchanged)


def region_case(op: str, shape: tuple[int, ...], dtype: torch.dtype, dim: int, grad_scale: GradScale = None,
                *, grad: bool = False, transposed: bool = False,
                sizes: tuple[int, ...] | None = None, given: bool = False) -> RegionCase:  # fmt: skip
    """A case whose id reads as what it tests, e.g. ``gather-x7x5-dim0-scaleup-f64-T-grad``."""
    parts = [
        op.split("_")[0],
        "x" + "x".join(map(str, shape)),
        f"dim{dim}",
        f"sizes{'-'.join(map(str, sizes))}" if sizes is not None else "",
        f"scale{grad_scale}" if grad else "",
        DTYPE_NAMES[dtype],
        "T" if transposed else "",
        "given" if given else "",
        "grad" if grad else "",
    ]
    return RegionCase(
        "-".join(p for p in parts if p), op, shape, dtype, dim, grad_scale, grad, transposed, sizes, given
    )


def ragged_sizes(world: int) -> tuple[int, ...]:
    """Per-rank lengths that are neither tensor_split's nor sorted, with a 0 from world 2 on."""
    return tuple((3 * r + 2) % 5 for r in range(world))


def region_cases(world: int) -> list[RegionCase]:
    rag = ragged_sizes(world)
    n = sum(rag)
    cases = [
        # split_forward_gather_backward: 7 and 5 over 2, 3, 4 ranks are uneven; 2 over 3 or 4 leaves empty pieces
        region_case(SPLIT, (7, 5), F32, 0),
        region_case(SPLIT, (5, 7), BF16, 1),
        region_case(SPLIT, (5, 7), I64, -1, transposed=True),
        region_case(SPLIT, (2, 5), BOOL, 0),
        region_case(SPLIT, (7, 5), F64, 0, None, grad=True),
        region_case(SPLIT, (5, 7), F64, -1, 1.0, grad=True),
        region_case(SPLIT, (2, 7, 5), F64, 1, "up", grad=True, transposed=True),
        region_case(SPLIT, (5, 7, 3), F64, -2, "down", grad=True),
        region_case(SPLIT, (2, 5), F64, 0, "up", grad=True),
        region_case(SPLIT, (5, 7), F64, 1, "down", grad=True, transposed=True),
        # gather_forward_split_backward: ranks hold tensor_split pieces, or `sizes`
        region_case(GATHER, (7, 5), F32, 0),
        region_case(GATHER, (5, 7), BF16, 1, transposed=True),
        region_case(GATHER, (5, 7), I64, -1),
        region_case(GATHER, (2, 5), BOOL, 0),
        region_case(GATHER, (n, 5), F32, 0, sizes=rag),
        region_case(GATHER, (7, 5), F64, 0, None, grad=True),
        region_case(GATHER, (5, 7), F64, -1, 1.0, grad=True, transposed=True),
        region_case(GATHER, (2, 7, 5), F64, 1, "up", grad=True),
        region_case(GATHER, (3, 5, 7), F64, -2, "down", grad=True, transposed=True),
        region_case(GATHER, (2, 5), F64, 0, "down", grad=True),
        region_case(GATHER, (3, n), F64, 1, "up", grad=True, sizes=rag),
        region_case(GATHER, (n, 3), F64, -2, None, grad=True, sizes=rag, transposed=True),
        region_case(GATHER, (n, 5), F32, 0, sizes=rag, given=True),
        region_case(GATHER, (3, n), F64, 1, "up", grad=True, sizes=rag, given=True),
    ]
    assert len({c.id for c in cases}) == len(cases), "case ids must be unique"
    return cases


# ------------------------------------------------------------------------------ inputs
def to_leaf(t: Tensor, c: RegionCase) -> tuple[Tensor, Tensor]:
    """``(leaf, x)`` with x == t; with ``transposed`` x is a non-contiguous view of the leaf."""
    leaf = (t.transpose(-1, -2) if c.transposed else t).contiguous().clone().requires_grad_(c.grad)
    return leaf, (leaf.transpose(-1, -2) if c.transposed else leaf)


def full_tensor(c: RegionCase) -> Tensor:
    """The full tensor of `c`, the same on every rank."""
    return seeded(c.shape, c.dtype, c.id, "full")


def pieces(c: RegionCase, t: Tensor, world: int) -> tuple[Tensor, ...]:
    if c.sizes is not None:
        return torch.split(t, list(c.sizes), c.dim)
    return torch.tensor_split(t, world, c.dim)


def make_input(c: RegionCase, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """``(leaf, x)`` of rank `rank`: the full tensor (split) or its piece (gather)."""
    full = full_tensor(c)
    return to_leaf(full if c.op == SPLIT else pieces(c, full, world)[rank], c)


def weight(c: RegionCase, rank: int | None, shape: Sequence[int]) -> Tensor:
    return seeded(shape, F64, c.id, "w", rank)


def downstream_loss(c: RegionCase, y: Tensor, rank: int) -> Tensor:
    """What rank `rank` computes after the op: its own loss after a split, the replicated one after a gather."""
    if c.op == SPLIT:
        return (y * weight(c, rank, y.shape)).sum()
    return (torch.sin(y) * weight(c, None, y.shape)).sum()


def scale_factor(grad_scale: GradScale, world: int) -> float:
    return {None: 1.0, 1.0: 1.0, "up": float(world), "down": 1.0 / world}[grad_scale]


# --------------------------------------------------------------------------- rank body
@dataclass
class BadCall:
    id: str
    call: Callable[[], object]
    exc: type[Exception]
    op: str
    fragment: str


X57 = seeded((5, 7), F32, "bad")


def bad_calls() -> list[BadCall]:
    calls = []
    for op in (SPLIT, GATHER):
        fn = getattr(funcoll, op)
        short = op.split("_")[0]
        calls += [
            BadCall(f"{short}-scale-sideways", lambda fn=fn: fn(X57, None, 0, "sideways"), ValueError, op,
                    "`grad_scale`='sideways'"),
            BadCall(f"{short}-scale-UP", lambda fn=fn: fn(X57, None, 0, "UP"), ValueError, op, "`grad_scale`='UP'"),
            BadCall(f"{short}-scale-2.0", lambda fn=fn: fn(X57, None, 0, 2.0), ValueError, op, "`grad_scale`=2.0"),
            BadCall(f"{short}-scale-0.5", lambda fn=fn: fn(X57, None, 1, 0.5), ValueError, op, "`grad_scale`=0.5"),
            BadCall(f"{short}-x5x7-dim2", lambda fn=fn: fn(X57, None, 2), ValueError, op, "`dim`=2"),
            BadCall(f"{short}-x5x7-dim-3", lambda fn=fn: fn(X57, None, -3), ValueError, op, "`dim`=-3"),
            BadCall(f"{short}-list-x", lambda fn=fn: fn([1.0], None, 0), TypeError, op, "`x`"),
        ]  # fmt: skip
    return calls


def bad_call_outcome(b: BadCall) -> tuple[str, str]:
    try:
        b.call()
    except Exception as e:  # noqa: BLE001 (recorded; the parent checks the type and the message)
        return type(e).__name__, str(e)
    return "no error", ""


def run_case(c: RegionCase, rank: int, world: int) -> dict[str, Any]:
    leaf, x = make_input(c, rank, world)
    given = {"sizes": list(c.sizes)} if c.given else {}  # pieces(): the lengths every rank holds
    y = getattr(funcoll, c.op)(x, None, c.dim, c.grad_scale, **given)
    out: dict[str, Any] = {
        "y": y.detach(),
        "contiguous": y.is_contiguous(),
        # Empty tensors all have data_ptr 0; only non-empty ones can alias.
        "aliases_x": x.numel() > 0
        and funcoll.wait(y).untyped_storage().data_ptr() == x.untyped_storage().data_ptr(),
    }
    if c.grad:
        downstream_loss(c, y, rank).backward()
        out["grad"] = leaf.grad
    return out


def region_body(rank: int, world: int) -> dict[str, Any]:
    # The last rank alone makes the bad calls first: had one of them communicated, the
    # batch below would be out of step across ranks and fail.
    errors = {b.id: bad_call_outcome(b) for b in bad_calls()} if rank == world - 1 else {}
    results = {c.id: run_case(c, rank, world) for c in region_cases(world)}
    return {"results": results, "errors": errors}


region_batch = once_per_world(
    region_body, TIMEOUT_S, worlds=WORLDS
)  # the batch on `world` ranks, run once per session


# --------------------------------------------------------------------------- reference
def reference_forward(c: RegionCase, world: int) -> list[Tensor]:
    full = full_tensor(c)
    return list(pieces(c, full, world)) if c.op == SPLIT else [full] * world


def reference_grads(c: RegionCase, world: int) -> list[Tensor]:
    """Every rank's expected ``leaf.grad``, by torch.autograd in one process."""
    factor = scale_factor(c.grad_scale, world)
    if c.op == SPLIT:
        leaf, x = make_input(c, 0, world)  # the same full tensor on every rank
        ys = torch.tensor_split(x, world, c.dim)
        loss = sum(downstream_loss(c, y, r) for r, y in enumerate(ys))
        (g,) = torch.autograd.grad(loss, [leaf])
        return [g * factor] * world
    leaves, xs = zip(*(make_input(c, r, world) for r in range(world)), strict=False)
    loss = downstream_loss(c, torch.cat(xs, c.dim), 0)  # replicated: one loss of the full tensor
    grads = torch.autograd.grad(loss, leaves)
    return [g * factor for g in grads]


# ------------------------------------------------------------------------------- tests
FORWARD = [pytest.param(w, c, id=f"w{w}-{c.id}") for w in WORLDS for c in region_cases(w)]
GRADS = [pytest.param(w, c, id=f"w{w}-{c.id}") for w in WORLDS for c in region_cases(w) if c.grad]
IN_RANK_ERRORS = [pytest.param(w, b, id=f"w{w}-{b.id}") for w in WORLDS for b in bad_calls()]


@pytest.mark.parametrize("world, c", FORWARD)
def test_forward(world: int, c: RegionCase) -> None:
    results = region_batch(world)
    expected = reference_forward(c, world)
    for r in range(world):
        got = results[r]["results"][c.id]["y"]
        torch.testing.assert_close(got, expected[r], rtol=0, atol=0, msg=lambda m, r=r: f"rank {r}: {m}")


@pytest.mark.parametrize("world, c", FORWARD)
def test_result_is_contiguous(world: int, c: RegionCase) -> None:
    for r, res in enumerate(region_batch(world)):
        assert res["results"][c.id]["contiguous"], f"rank {r}: the result is not contiguous"


NEW_TENSOR = [pytest.param(w, c, id=f"w{w}-{c.id}") for w in WORLDS for c in region_cases(w)]


@pytest.mark.parametrize("world, c", NEW_TENSOR)
def test_result_does_not_alias_input(world: int, c: RegionCase) -> None:
    for r, res in enumerate(region_batch(world)):
        assert not res["results"][c.id]["aliases_x"], f"rank {r}: the result shares memory with x"


@pytest.mark.parametrize("world, c", GRADS)
def test_grad(world: int, c: RegionCase) -> None:
    results = region_batch(world)
    expected = reference_grads(c, world)
    for r in range(world):
        got = results[r]["results"][c.id]["grad"]
        assert got is not None, f"rank {r}: x.grad is None"
        torch.testing.assert_close(got, expected[r], msg=lambda m, r=r: f"rank {r}: {m}")


@pytest.mark.parametrize("world, bad", IN_RANK_ERRORS)
def test_bad_input_in_ranks(world: int, bad: BadCall) -> None:
    kind, message = region_batch(world)[world - 1]["errors"][bad.id]
    assert kind == bad.exc.__name__, message
    assert message.startswith(f"funcoll.{bad.op}: "), message
    assert bad.fragment in message, message


@pytest.mark.parametrize("bad", [pytest.param(b, id=b.id) for b in bad_calls()])
def test_bad_input_single_process(bad: BadCall) -> None:
    assert not dist.is_initialized()
    with pytest.raises(bad.exc) as info:
        bad.call()
    message = str(info.value)
    assert type(info.value) is bad.exc, message
    assert message.startswith(f"funcoll.{bad.op}: "), message
    assert bad.fragment in message, message
