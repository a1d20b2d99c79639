"""docs/migrate/torch-nn-functional.md: torch.distributed.nn.functional (before) and funcoll (after).

Each pair is two functions of ``(rank, world)`` returning the same values and
gradients on every rank; tests/test_site.py runs them on 2 gloo ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnf

import funcoll


def _x(rank: int, n: int = 3) -> torch.Tensor:
    return (torch.arange(float(n)) + 10 * rank).requires_grad_()


# --8<-- [start:all_gather_before]
def all_gather_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank)
    y = torch.cat(dnf.all_gather(x))  # a tuple of world tensors, equal shapes only
    (y * torch.arange(1.0, 1.0 + y.numel())).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:all_gather_before]


# --8<-- [start:all_gather_after]
def all_gather_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank)
    y = funcoll.all_gather(x)  # concatenated (tiled=False stacks); ragged lengths: funcoll.gather(x)
    (y * torch.arange(1.0, 1.0 + y.numel())).sum().backward()  # backward: reduce_scatter (sum)
    return y.detach(), x.grad


# --8<-- [end:all_gather_after]


# --8<-- [start:all_reduce_before]
def all_reduce_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank)
    y = dnf.all_reduce(x)
    (y * (rank + 1)).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:all_reduce_before]


# --8<-- [start:all_reduce_after]
def all_reduce_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank)
    y = funcoll.all_reduce(x)  # op="sum" | "avg" | "max" | ...; backward: all_reduce (sum), as JAX's psum
    (y * (rank + 1)).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:all_reduce_after]


# --8<-- [start:reduce_scatter_before]
def reduce_scatter_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank, 2 * world)
    out = torch.empty(2)
    y = dnf.reduce_scatter(out, list(x.split(2)))  # an output buffer and a list of inputs
    (y * y).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:reduce_scatter_before]


# --8<-- [start:reduce_scatter_after]
def reduce_scatter_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank, 2 * world)
    y = funcoll.reduce_scatter(x)  # a new tensor; uneven slices: sizes=[...]; backward: all_gather
    (y * y).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:reduce_scatter_after]


# --8<-- [start:all_to_all_v_before]
def all_to_all_v_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    send_sizes = [1, 2] if rank == 0 else [3, 0]
    x = _x(rank, sum(send_sizes))
    # The receive sizes must be known first: exchange them yourself.
    recv_sizes = torch.empty(world, dtype=torch.long)
    dist.all_to_all_single(recv_sizes, torch.tensor(send_sizes))
    recv_sizes = recv_sizes.tolist()  # a host sync (on GPU)
    y = dnf.all_to_all_single(x.new_empty(sum(recv_sizes)), x, recv_sizes, send_sizes)
    (y * y).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:all_to_all_v_before]


# --8<-- [start:all_to_all_v_after]
def all_to_all_v_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    send_sizes = [1, 2] if rank == 0 else [3, 0]
    x = _x(rank, sum(send_sizes))
    y, _recv_sizes = funcoll.all_to_all_v(x, send_sizes)  # exchanges the sizes itself (or pass recv_sizes)
    (y * y).sum().backward()  # backward: all_to_all_v with the sizes swapped
    return y.detach(), x.grad


# --8<-- [end:all_to_all_v_after]


# --8<-- [start:broadcast_before]
def broadcast_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank)
    y = dnf.broadcast(x, src=0)
    (y * (rank + 1)).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:broadcast_before]


# --8<-- [start:broadcast_after]
def broadcast_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(rank)
    y = funcoll.broadcast(x, src=0)  # backward: the gradients summed onto src
    (y * (rank + 1)).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:broadcast_after]


PAIRS = {
    "all_gather": (all_gather_before, all_gather_after),
    "all_reduce": (all_reduce_before, all_reduce_after),
    "reduce_scatter": (reduce_scatter_before, reduce_scatter_after),
    "all_to_all_v": (all_to_all_v_before, all_to_all_v_after),
    "broadcast": (broadcast_before, broadcast_after),
}
