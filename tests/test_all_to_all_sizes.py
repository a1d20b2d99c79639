"""all_to_all with per-rank sizes (funcoll/_ops/_even.py), and per-rank scalars gathered as a stack.

Ulysses attention with a head count the world does not divide, both ways, and any
split of the scatter dim: rank i holds ``gather_sizes[i]`` along the gather dim,
and the scatter dim splits as ``scatter_sizes`` (or ``torch.tensor_split``) says.
The reference splits every rank's input in one process with ``torch.split`` and
concatenates rank r's pieces with ``torch.cat``; gradients (float64) come from
torch.autograd on the sum of every rank's loss. The 0-d cases gather each rank's
scalar; their reference is ``torch.stack``. One ``run_ranks`` call per world.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _inputs import once_per_world, seeded
from torch import Tensor

import funcoll

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 120.0
F64, F32, BF16, I64, BOOL = torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.bool


def tsplit(n: int, world: int) -> list[int]:
    """torch.tensor_split's piece lengths, computed by torch itself."""
    return [p.numel() for p in torch.tensor_split(torch.arange(n), world)]


@dataclass(frozen=True)
class A2ACase:
    """Rank r's x: `shape` with ``gather_sizes[r]`` at `gather_dim`; scatter as `scatter` says."""

    id: str
    shape: tuple[int, ...]
    scatter_dim: int
    gather_dim: int
    heads: str  # the gather dim: "even" (shape's value everywhere) or "split:N" (tensor_split of N)
    scatter: str = "default"  # "default" (tensor_split) or "skew" (everything past one row to the last rank)
    dtype: torch.dtype = F64

    def gather_sizes(self, world: int) -> list[int] | None:
        if self.heads == "even":
            return None
        return tsplit(int(self.heads.split(":")[1]), world)

    def width(self, rank: int, world: int) -> int:
        sizes = self.gather_sizes(world)
        return self.shape[self.gather_dim] if sizes is None else sizes[rank]

    def scatter_sizes(self, world: int) -> list[int] | None:
        if self.scatter == "default":
            return None
        n = self.shape[self.scatter_dim]
        return [min(n, 1)] + [0] * (world - 2) + [n - min(n, 1)] if world > 1 else [n]

    def pieces(self, world: int) -> list[int]:
        return self.scatter_sizes(world) or tsplit(self.shape[self.scatter_dim], world)

    def input(self, rank: int, world: int) -> Tensor:
        shape = list(self.shape)
        shape[self.gather_dim] = self.width(rank, world)
        return seeded(shape, self.dtype, self.id, world, rank)


CASES = [
    # Ulysses: (B, S, H_r, D) -> (B, S_r, H, D) with H not divisible, and the way there
    A2ACase("back-x2x7xH5x3-s1-g2", (2, 7, 0, 3), 1, 2, "split:5"),
    A2ACase("back-x2x7xH1x3-s1-g2", (2, 7, 0, 3), 1, 2, "split:1"),  # ranks with no head
    A2ACase("there-x2xS7x5x3-s2-g1", (2, 0, 5, 3), 2, 1, "split:7"),  # uneven sequence shards
    A2ACase("back-x3x4xH6x2-s-3-g-2", (3, 4, 0, 2), -3, -2, "split:6"),
    A2ACase("back-x5xH7-s0-g1-skew", (5, 0), 0, 1, "split:7", scatter="skew"),
    A2ACase("x6x4-s0-g1-skew", (6, 4), 0, 1, "even", scatter="skew"),
    A2ACase("back-x2x5xH3-s1-g2-f32", (2, 5, 0), 1, 2, "split:3", dtype=F32),
    A2ACase("back-x2x5xH3-s1-g2-bf16", (2, 5, 0), 1, 2, "split:3", dtype=BF16),
    A2ACase("back-x2x5xH3-s1-g2-i64", (2, 5, 0), 1, 2, "split:3", dtype=I64),
    A2ACase("back-x2x5xH3-s1-g2-bool", (2, 5, 0), 1, 2, "split:3", dtype=BOOL),
]
SCALAR_OPS = ("gather", "all_gather_ragged", "all_gather_list", "all_gather", "gather-dst-last")


def reference(case: A2ACase, xs: Sequence[Tensor], world: int) -> list[Tensor]:
    pieces = [torch.split(x, case.pieces(world), case.scatter_dim) for x in xs]
    return [torch.cat([pieces[i][r] for i in range(world)], case.gather_dim) for r in range(world)]


def _loss_weight(case_id: str, rank: int, like: Tensor) -> Tensor:
    return seeded(like.shape, F64, "w", case_id, rank)


def run_body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        x = case.input(rank, world)
        if case.dtype == F64:
            x.requires_grad_(True)
        y = funcoll.all_to_all(
            x,
            None,
            case.scatter_dim,
            case.gather_dim,
            scatter_sizes=case.scatter_sizes(world),
            gather_sizes=case.gather_sizes(world),
        )
        if case.dtype == F64:
            (y * _loss_weight(case.id, rank, y)).sum().backward()
        out[case.id] = (y.detach(), None if x.grad is None else x.grad)
    for op in SCALAR_OPS:
        x = torch.tensor(1.5 * rank - 0.25, dtype=F64, requires_grad=op != "gather-dst-last")
        if op == "gather":
            y = funcoll.gather(x)
        elif op == "all_gather_ragged":
            y, sizes = funcoll.all_gather_ragged(x)
            out["scalar-sizes"] = sizes
        elif op == "all_gather_list":
            y = torch.stack(funcoll.all_gather_list(x))
        elif op == "all_gather":
            y = funcoll.all_gather(x)
        else:
            y = funcoll.gather(x, dst=world - 1)
            out[op] = (None if y is None else y.clone(), None)
            continue
        (y * _loss_weight(op, rank, y)).sum().backward()
        out[op] = (y.detach(), x.grad)
    return out


batch = once_per_world(run_body, TIMEOUT_S, worlds=WORLDS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_all_to_all_with_sizes_matches_reference(world: int, case: A2ACase) -> None:
    xs = [case.input(r, world).detach().requires_grad_(case.dtype == F64) for r in range(world)]
    want = reference(case, xs, world)
    results = batch(world)
    for r in range(world):
        torch.testing.assert_close(results[r][case.id][0], want[r].detach(), rtol=0, atol=0)
    if case.dtype == F64:
        total = sum((want[r] * _loss_weight(case.id, r, want[r])).sum() for r in range(world))
        grads = torch.autograd.grad(total, xs)
        for r in range(world):
            torch.testing.assert_close(results[r][case.id][1], grads[r], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", SCALAR_OPS)
def test_scalars_gather_as_a_stack(world: int, op: str) -> None:
    xs = [torch.tensor(1.5 * r - 0.25, dtype=F64, requires_grad=True) for r in range(world)]
    stacked = torch.stack(xs)
    results = batch(world)
    if op == "gather-dst-last":
        for r in range(world):
            got = results[r][op][0]
            if r == world - 1:
                torch.testing.assert_close(got, stacked.detach())
            else:
                assert got is None
        return
    total = sum((stacked * _loss_weight(op, r, stacked)).sum() for r in range(world))
    grads = torch.autograd.grad(total, xs)
    for r in range(world):
        y, grad = results[r][op]
        assert y.shape == (world,)
        torch.testing.assert_close(y, stacked.detach())
        torch.testing.assert_close(grad, grads[r], rtol=1e-12, atol=1e-12)
        if op == "all_gather_ragged":
            assert results[r]["scalar-sizes"].tolist() == [1] * world


@pytest.mark.parametrize(
    ("total", "world", "want"), [(7, 3, [3, 2, 2]), (1, 2, [1, 0]), (0, 3, [0, 0, 0]), (8, 4, [2, 2, 2, 2])]
)
def test_split_sizes_is_tensor_split(total: int, world: int, want: list[int]) -> None:
    assert funcoll.split_sizes(total, world) == want == tsplit(total, world)


X = torch.zeros(2, 6, 3)


@pytest.mark.parametrize(
    ("call", "exc", "fragment"),
    [
        (lambda: funcoll.split_sizes(-1, 2), ValueError, "`total`=-1"),
        (lambda: funcoll.split_sizes(3, 0), ValueError, "`world`=0"),
        (lambda: funcoll.split_sizes(3.0, 2), TypeError, "`total`"),
        (lambda: funcoll.all_to_all(X, None, 1, 2, gather_sizes=[3, 1]), ValueError, "`gather_sizes`=[3, 1]"),
        (lambda: funcoll.all_to_all(X, None, 1, 2, gather_sizes=[2]), ValueError, "x.shape[2]=3"),
        (lambda: funcoll.all_to_all(X, None, 1, 2, scatter_sizes=[5]), ValueError, "`scatter_sizes`=[5]"),
        (lambda: funcoll.all_to_all(X, None, 1, 2, scatter_sizes=[-1]), ValueError, "negative"),
        (lambda: funcoll.all_to_all(X, None, 1, 2, scatter_sizes=6), TypeError, "`scatter_sizes`"),
        (lambda: funcoll.all_to_all(X, None, 1, 2, gather_sizes=[3.0]), TypeError, "`gather_sizes`[0]"),
    ],
    ids=["split-neg", "split-world0", "split-float", "gather-sum", "gather-len", "scatter-sum", "scatter-neg",
         "scatter-int", "gather-float"],
)  # fmt: skip
def test_bad_sizes_raise_before_communicating(call: Any, exc: type[Exception], fragment: str) -> None:
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value) and str(info.value).startswith("funcoll."), str(info.value)
