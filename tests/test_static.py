"""Multi-rank tests of the static-shape ragged gather (``funcoll.gather_padded``) on real gloo ranks.

Rank r holds a seeded tensor padded to a bound B along the ragged dim, of which the first
``lengths[r]`` rows are data. The reference, computed in the parent in one process: the
data rows of every rank concatenated in rank order, then zeros up to ``world * B`` rows,
and the lengths as an int64 tensor. For float64 cases every rank computes
``loss_r = (y * w_r).sum()`` and backpropagates; the reference gradient is torch.autograd
of ``sum_r loss_r`` through the single-process reference (zero on padding rows).

Every case of one world size runs in one ``run_ranks`` call; the error cases run in
another, each rank recording what it raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _inputs import once_per_world, seeded
from torch import Tensor

import funcoll
from funcoll.testing import run_ranks

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 120.0
F32, F64, BF16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool


@dataclass(frozen=True)
class Case:
    id: str
    shape: tuple[int, ...]  # the entry at `dim` is the bound B
    dim: int
    dtype: torch.dtype
    lengths: str  # "seeded" | "zero" | "full" | "zero-on-0"
    length_as: str = "tensor"  # "tensor" (0-d int64) | "int" | "int32-1d"
    transposed: bool = False  # x is a non-contiguous transpose of its last two dims
    grad: bool = False

    def length(self, rank: int, world: int) -> int:
        bound = self.shape[self.dim]
        if self.lengths == "zero":
            return 0
        if self.lengths == "full":
            return bound
        n = (3 * rank + 2 + len(self.id)) % (bound + 1)
        return 0 if self.lengths == "zero-on-0" and rank == 0 else n


def cases() -> list[Case]:
    raw = [
        Case("1d-b5-f32", (5,), 0, F32, "seeded"),
        Case("x4x3-dim0-f64-grad", (4, 3), 0, F64, "seeded", grad=True),
        Case("x3x6-dim-1-f64-T-grad", (3, 6), -1, F64, "seeded", transposed=True, grad=True),
        Case("x2x3x5-dim1-f64-int-grad", (2, 3, 5), 1, F64, "zero-on-0", length_as="int", grad=True),
        Case("x2x3x4x5-dim2-bf16", (2, 3, 4, 5), 2, BF16, "seeded", length_as="int32-1d"),
        Case("x3x5-dim0-i64-zero", (3, 5), 0, I64, "zero"),
        Case("x5x3-dim-2-bool-T", (5, 3), -2, BOOL, "seeded", transposed=True),
        Case("x4x7-dim0-f64-full-grad", (4, 7), 0, F64, "full", grad=True),
        Case("x2x0-dim0-f32-empty-rows", (2, 0), 0, F32, "seeded"),
        Case("x0x5-dim0-f32-bound0", (0, 5), 0, F32, "zero"),
    ]
    assert len({c.id for c in raw}) == len(raw)
    return raw


def make_input(c: Case, rank: int) -> tuple[Tensor, Tensor]:
    """``(leaf, x)``; with `transposed`, x is a non-contiguous view of the leaf."""
    shape = list(c.shape)
    if c.transposed:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    leaf = seeded(shape, c.dtype, c.id, rank).requires_grad_(c.grad)
    return leaf, (leaf.transpose(-1, -2) if c.transposed else leaf)


def length_arg(c: Case, n: int) -> object:
    if c.length_as == "int":
        return n
    if c.length_as == "int32-1d":
        return torch.tensor([n], dtype=torch.int32)
    return torch.tensor(n)


def weight(c: Case, rank: int, shape: torch.Size) -> Tensor:
    return seeded(shape, F64, c.id, "w", rank)


def reference(c: Case, world: int) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    """(y, sizes, grads) computed in one process from every rank's input."""
    leaves, xs = zip(*(make_input(c, r) for r in range(world)), strict=True)
    lengths = [c.length(r, world) for r in range(world)]
    d = c.dim % len(c.shape)
    data = torch.cat([x.narrow(d, 0, n) for x, n in zip(xs, lengths, strict=True)], d)
    pad = list(data.shape)
    pad[d] = world * c.shape[d] - data.shape[d]
    y = torch.cat([data, data.new_zeros(pad)], d)
    grads: list[Tensor | None] = [None] * world
    if c.grad:
        sum((y * weight(c, r, y.shape)).sum() for r in range(world)).backward()
        grads = [leaf.grad for leaf in leaves]
    return y.detach(), torch.tensor(lengths, dtype=torch.int64), grads


# --------------------------------------------------------------------------- rank bodies
def _run_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in cases():
        leaf, x = make_input(c, rank)
        y, sizes = funcoll.gather_padded(x, length_arg(c, c.length(rank, world)), c.dim)
        res: dict[str, Any] = {"y": y.detach(), "sizes": sizes}
        if c.grad:
            (y * weight(c, rank, y.shape)).sum().backward()
            res["grad"] = leaf.grad
        out[c.id] = res
    return out


_batch = once_per_world(_run_cases, TIMEOUT_S)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("c", cases(), ids=lambda c: c.id)
def test_gather_padded_matches_reference(c: Case, world: int) -> None:
    y_ref, sizes_ref, grads_ref = reference(c, world)
    for rank, results in enumerate(_batch(world)):
        res = results[c.id]
        assert res["y"].dtype == c.dtype and res["y"].shape == y_ref.shape, (rank, res["y"].shape)
        torch.testing.assert_close(res["y"], y_ref, rtol=0, atol=0, msg=f"rank {rank}")
        assert res["sizes"].dtype == torch.int64
        torch.testing.assert_close(res["sizes"], sizes_ref, msg=f"rank {rank} sizes")
        if c.grad:
            torch.testing.assert_close(
                res["grad"], grads_ref[rank], rtol=1e-12, atol=1e-12, msg=f"rank {rank}"
            )


def test_gather_padded_example_from_the_docstring() -> None:
    def body(rank: int, world: int) -> tuple[list, list]:
        x = torch.tensor([[1.0], [2.0], [0.0]]) if rank == 0 else torch.tensor([[5.0], [9.0], [9.0]])
        y, sizes = funcoll.gather_padded(x, torch.tensor(2 if rank == 0 else 1))
        return y.tolist(), sizes.tolist()

    for y, sizes in run_ranks(body, 2, timeout=TIMEOUT_S):
        assert y == [[1.0], [2.0], [5.0], [0.0], [0.0], [0.0]] and sizes == [2, 1]


# ----------------------------------------------------------------------------- errors
X = torch.zeros(4, 3)


@pytest.mark.parametrize(
    "length, exc, fragment",
    [
        pytest.param(2.0, TypeError, "got float", id="float"),
        pytest.param(True, TypeError, "got bool", id="bool"),
        pytest.param("2", TypeError, "got str", id="str"),
        pytest.param(torch.tensor(2.0), TypeError, "torch.float32 tensor", id="float-tensor"),
        pytest.param(torch.tensor(True), TypeError, "torch.bool tensor", id="bool-tensor"),
        pytest.param(torch.tensor([1, 2]), ValueError, "shape (2,)", id="two-values"),
        pytest.param(5, ValueError, "`length`=5 is outside [0, 4]", id="int-above-bound"),
        pytest.param(-1, ValueError, "`length`=-1 is outside [0, 4]", id="int-negative"),
    ],
)
def test_bad_length_raises_before_communicating(length: object, exc: type[Exception], fragment: str) -> None:
    # No process group exists here: the check must come before anything would communicate.
    with pytest.raises(exc, match=r"funcoll\.gather_padded: `length`") as info:
        funcoll.gather_padded(X, length)
    assert fragment in str(info.value)


def test_bad_dim_and_x_raise() -> None:
    with pytest.raises(ValueError, match=r"funcoll.gather_padded: `dim`=2 is out of range"):
        funcoll.gather_padded(X, 1, 2)
    with pytest.raises(TypeError, match=r"funcoll.gather_padded: `x` must be a torch.Tensor, got list"):
        funcoll.gather_padded([1.0], 1)


def _disagreeing(rank: int, world: int, kind: str) -> str:
    """Rank 1 breaks the contract in one way; every rank records what it raised."""
    x, n = torch.zeros(4, 3), torch.tensor(1)
    if rank == 1:
        if kind == "length-above-bound":
            n = torch.tensor(5)
        elif kind == "length-negative":
            n = torch.tensor(-2)
        elif kind == "bound":
            x = torch.zeros(5, 3)
        elif kind == "dtype":
            x = torch.zeros(4, 3, dtype=torch.float64)
    try:
        funcoll.gather_padded(x, n)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind", ["length-above-bound", "length-negative", "bound", "dtype"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_all_raise(world: int, kind: str) -> None:
    for rank, msg in enumerate(run_ranks(_disagreeing, world, kind, timeout=TIMEOUT_S)):
        assert "funcoll.gather_padded: every rank's `length` must lie in [0, x.shape[dim]]" in msg, (
            rank,
            msg,
        )
