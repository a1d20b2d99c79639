"""The MoE layer of docs/moe.md: tests/test_moe.py runs it on 2 ranks and checks it against `reference`."""

from __future__ import annotations

import torch

# --8<-- [start:layer]
import funcoll
from funcoll import moe

H, E_LOCAL, K = 8, 2, 2  # hidden size, experts per rank, choices per token


def moe_layer(x: torch.Tensor, router: torch.Tensor, experts: torch.Tensor, mode: str) -> torch.Tensor:
    """Top-2 routing, dispatch, this rank's experts (one matmul each), combine."""
    world = funcoll.axis_size()
    weights, idx = torch.softmax(x @ router, dim=-1).topk(K, dim=-1)  # (T, k) each
    capacity = 8 if mode == "static" else None  # rows per destination rank, the same on every rank
    recv, handle = moe.dispatch(x, idx, world * E_LOCAL, mode=mode, capacity=capacity, align=4)
    y = torch.zeros_like(recv)
    for e in range(E_LOCAL):  # a grouped GEMM would take recv, handle.offsets and handle.counts
        lo = handle.offsets[e]
        rows = slice(lo, lo + handle.counts[e])  # tensors as bounds: eager only (a host read each)
        y[rows] = recv[rows] @ experts[e]
    return moe.combine(y, handle, weights)


def step(rank: int, world: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's output and the gradient of its experts' weights."""
    x, router, experts = problem(rank, world)
    mine = experts[rank * E_LOCAL : (rank + 1) * E_LOCAL].clone().requires_grad_()
    out = moe_layer(x, router, mine, mode)
    out.square().sum().backward()
    return out.detach(), mine.grad


# --8<-- [end:layer]


def problem(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens (3 + rank of them), the router and every expert's weights."""
    g = torch.Generator().manual_seed(5)
    router = torch.randn(H, world * E_LOCAL, generator=g, dtype=torch.float64)
    experts = torch.randn(world * E_LOCAL, H, H, generator=g, dtype=torch.float64)
    tokens = [torch.randn(3 + r, H, generator=g, dtype=torch.float64) for r in range(world)]
    return tokens[rank], router, experts


def reference(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's `step` result, computed in one process holding every token and expert."""
    xs, router, experts = zip(*(problem(r, world) for r in range(world)), strict=True)
    w = experts[0].clone().requires_grad_()
    outs = []
    for x in xs:
        weights, idx = torch.softmax(x @ router[0], dim=-1).topk(K, dim=-1)
        outs.append(torch.einsum("th,tkhg,tk->tg", x, w[idx], weights))
    sum(o.square().sum() for o in outs).backward()
    assert w.grad is not None
    return [(o.detach(), w.grad[r * E_LOCAL : (r + 1) * E_LOCAL]) for r, o in enumerate(outs)]
