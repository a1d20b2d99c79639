"""docs/migrate/seeds.md: the widely copied helpers (before) and funcoll (after); tests/test_site.py runs each pair.

Each pair is two functions of ``(rank, world)`` that return the same thing on
every rank; the test runs them on 2 gloo ranks and compares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import funcoll
import funcoll.compat


def _rows(rank: int) -> torch.Tensor:
    """Rank r holds r + 2 rows of 3: a ragged dim 0."""
    return torch.arange(3.0 * (rank + 2)).reshape(rank + 2, 3) + 100 * rank


# --8<-- [start:gather_before]
def gather(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The seed recipe: exchange the lengths, pad to the longest, all_gather, cut, concatenate."""
    world_size = dist.get_world_size()
    size = torch.tensor([tensor.shape[dim]], dtype=torch.long, device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    sizes = [s.item() for s in sizes]  # one host sync per rank
    padded_shape = list(tensor.shape)
    padded_shape[dim] = max(sizes)
    padded = torch.zeros(padded_shape, dtype=tensor.dtype, device=tensor.device)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)  # in place, into Python lists: no gradient, no torch.compile
    return torch.cat([g.narrow(dim, 0, n) for g, n in zip(gathered, sizes, strict=True)], dim=dim)


def gather_before(rank: int, world: int) -> torch.Tensor:
    return gather(_rows(rank))


# --8<-- [end:gather_before]


# --8<-- [start:gather_after]
def gather_after(rank: int, world: int) -> torch.Tensor:
    return funcoll.compat.gather(_rows(rank))  # the same signature; or funcoll.gather(x, dim)


# --8<-- [end:gather_after]


# --8<-- [start:all_gather_before]
def all_gather(q: torch.Tensor, ws: int, device: torch.device) -> list[torch.Tensor]:
    """The seed: 1-D tensors of different lengths, gathered into a list."""
    local_size = torch.tensor(q.size(), device=device)
    all_sizes = [torch.zeros_like(local_size) for _ in range(ws)]
    dist.all_gather(all_sizes, local_size)
    max_size = max(all_sizes)
    size_diff = max_size.item() - local_size.item()
    if size_diff:
        q = torch.cat((q, torch.zeros(size_diff, device=device, dtype=q.dtype)))
    all_qs_padded = [torch.zeros_like(q) for _ in range(ws)]
    dist.all_gather(all_qs_padded, q)
    return [q[:size] for q, size in zip(all_qs_padded, all_sizes, strict=True)]


def all_gather_before(rank: int, world: int) -> list[torch.Tensor]:
    q = torch.tensor([1.5, 2.3]) if rank == 0 else torch.tensor([5.3])
    return all_gather(q, world, q.device)


# --8<-- [end:all_gather_before]


# --8<-- [start:all_gather_after]
def all_gather_after(rank: int, world: int) -> list[torch.Tensor]:
    q = torch.tensor([1.5, 2.3]) if rank == 0 else torch.tensor([5.3])
    return funcoll.compat.all_gather(q, world, q.device)  # or funcoll.all_gather_list(q)


# --8<-- [end:all_gather_after]


# --8<-- [start:all_to_all_before]
class _AllToAll(torch.autograd.Function):
    """OpenSora's all_to_all: in-place collectives into lists, the group stored on ctx; even splits only."""

    @staticmethod
    def forward(ctx, input_, process_group, scatter_dim, gather_dim):
        ctx.process_group, ctx.scatter_dim, ctx.gather_dim = process_group, scatter_dim, gather_dim
        ctx.world_size = dist.get_world_size(process_group)
        return _all_to_all(input_, ctx.world_size, process_group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad_output):
        grad = _all_to_all(grad_output, ctx.world_size, ctx.process_group, ctx.gather_dim, ctx.scatter_dim)
        return grad, None, None, None


def _all_to_all(input_, world_size, group, scatter_dim, gather_dim):
    input_list = [t.contiguous() for t in torch.tensor_split(input_, world_size, scatter_dim)]
    output_list = [torch.empty_like(input_list[0]) for _ in range(world_size)]
    dist.all_to_all(output_list, input_list, group=group)
    return torch.cat(output_list, dim=gather_dim).contiguous()


def all_to_all_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.arange(2.0 * 3 * 4 * 2).reshape(2, 3, 4, 2) + 1000 * rank).requires_grad_()  # (B, S/w, H, D)
    y = _AllToAll.apply(x, dist.group.WORLD, 2, 1)  # (B, S, H/w, D)
    (y * y).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:all_to_all_before]


# --8<-- [start:all_to_all_after]
def all_to_all_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.arange(2.0 * 3 * 4 * 2).reshape(2, 3, 4, 2) + 1000 * rank).requires_grad_()
    y = funcoll.compat.all_to_all(x, dist.group.WORLD, 2, 1)  # also: H not divisible by world
    (y * y).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:all_to_all_after]


# --8<-- [start:into_tensor_before]
def into_tensor_before(rank: int, world: int) -> torch.Tensor:
    out = torch.empty(world * 2)
    dist.all_gather_into_tensor(out, torch.tensor([rank] * 2, dtype=torch.float32))
    return out


# --8<-- [end:into_tensor_before]


# --8<-- [start:into_tensor_after]
def into_tensor_after(rank: int, world: int) -> torch.Tensor:
    out = torch.empty(world * 2)
    funcoll.compat.all_gather_into_tensor(out, torch.tensor([rank] * 2, dtype=torch.float32))
    return out  # written in place, as torch's; funcoll.all_gather_into_tensor(x) returns a new tensor


# --8<-- [end:into_tensor_after]


PAIRS = {
    "gather": (gather_before, gather_after),
    "all_gather": (all_gather_before, all_gather_after),
    "all_to_all": (all_to_all_before, all_to_all_after),
    "all_gather_into_tensor": (into_tensor_before, into_tensor_after),
}
