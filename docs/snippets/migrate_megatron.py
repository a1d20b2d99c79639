"""docs/migrate/megatron.md: Megatron's mappings (before) and funcoll (after); tests/test_site.py runs each pair.

"before" re-implements, in a few lines each, what the functions of
megatron/core/tensor_parallel/mappings.py (NVIDIA/Megatron-LM, read at commit
00caa53af309) compute forward and backward, with the input's device where
Megatron allocates on ``torch.cuda.current_device()``, so that it runs on gloo.
Megatron's uneven paths (``output_split_sizes``/``input_split_sizes`` of the
first-dim gather and reduce-scatter) call ``dist.all_gather``/``dist.reduce_scatter``
with lists of different sizes, which only NCCL accepts; for those the "before"
here is the single-process result they compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import funcoll


# --8<-- [start:megatron]
def _gather_along_first_dim(input_, group, output_split_sizes=None):
    world_size = group.size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    if output_split_sizes is None:
        dim_size[0] = dim_size[0] * world_size
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
    else:  # uneven: a list all_gather of different sizes (NCCL only)
        dim_size[0] = sum(output_split_sizes)
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        dist.all_gather(list(torch.split(output, output_split_sizes, dim=0)), input_, group=group)
    return output


def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None):
    world_size = group.size()
    if world_size == 1:
        return input_
    if input_split_sizes is None:
        dim_size = list(input_.size())
        dim_size[0] = dim_size[0] // world_size
        output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        dist.reduce_scatter_tensor(output, input_.contiguous(), group=group)
    else:  # uneven: a list reduce_scatter of different sizes (NCCL only)
        input_tensor_list = list(torch.split(input_, input_split_sizes, dim=0))
        output = torch.empty_like(input_tensor_list[group.rank()])
        dist.reduce_scatter(output, input_tensor_list, group=group)
    return output


def _split_along_first_dim(input_, group):
    local = input_.size(0) // group.size()
    return input_[group.rank() * local : (group.rank() + 1) * local].contiguous()


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad=True, output_split_sizes=None):
        ctx.tensor_parallel_output_grad, ctx.group = tensor_parallel_output_grad, group
        ctx.output_split_sizes = output_split_sizes
        return _gather_along_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:  # the computation after the gather is tensor-parallel
            return (
                _reduce_scatter_along_first_dim(grad_output, ctx.group, ctx.output_split_sizes),
                None,
                None,
                None,
            )
        return _split_along_first_dim(grad_output, ctx.group), None, None, None  # it is replicated


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, input_split_sizes=None):
        ctx.group, ctx.input_split_sizes = group, input_split_sizes
        return _reduce_scatter_along_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group, ctx.input_split_sizes), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = (
            group,
            output_split_sizes,
            input_split_sizes,
        )
        input = input.contiguous()
        if output_split_sizes is None:
            output = torch.empty_like(input)
        else:
            output = input.new_empty(size=[sum(output_split_sizes), *input.size()[1:]])
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, *grad_output):
        return (
            None,
            _AllToAll.apply(ctx.group, *grad_output, ctx.input_split_sizes, ctx.output_split_sizes),
            None,
            None,
        )


def gather_from_sequence_parallel_region(
    input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None
):
    return _GatherFromSequenceParallelRegion.apply(
        input_, group, tensor_parallel_output_grad, output_split_sizes
    )


def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None):
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, input_split_sizes)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


# --8<-- [end:megatron]


def _tokens(rank: int, n: int = 2) -> torch.Tensor:
    """This rank's (n, 3) sequence shard; the same global tensor on every rank."""
    return (torch.arange(n * 3.0).reshape(n, 3) + 100 * rank).requires_grad_()


def _loss(y: torch.Tensor, rank: int) -> torch.Tensor:
    return (y * y).sum() * (rank + 1)  # different on every rank: a tensor-parallel computation after the op


# --8<-- [start:gather_before]
def gather_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _tokens(rank)
    y = gather_from_sequence_parallel_region(x, group=dist.group.WORLD)  # backward: reduce-scatter
    _loss(y, rank).backward()
    return y.detach(), x.grad


# --8<-- [end:gather_before]


# --8<-- [start:gather_after]
def gather_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _tokens(rank)
    y = funcoll.all_gather(x, 0, group=dist.group.WORLD)  # the adjoint: reduce_scatter of the gradient
    _loss(y, rank).backward()
    return y.detach(), x.grad


# --8<-- [end:gather_after]


# --8<-- [start:gather_replicated_before]
def gather_replicated_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _tokens(rank)
    y = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=dist.group.WORLD)
    (y * y).sum().backward()  # the same loss on every rank: the gradient is complete, keep this rank's part
    return y.detach(), x.grad


# --8<-- [end:gather_replicated_before]


# --8<-- [start:gather_replicated_after]
def gather_replicated_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _tokens(rank)
    y = funcoll.gather_forward_split_backward(x, dist.group.WORLD, 0)  # backward: this rank's piece
    (y * y).sum().backward()
    return y.detach(), x.grad


# --8<-- [end:gather_replicated_after]


# --8<-- [start:reduce_scatter_before]
def reduce_scatter_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _tokens(rank, 2 * world)  # a partial sum over the ranks of the whole sequence
    y = reduce_scatter_to_sequence_parallel_region(x, group=dist.group.WORLD)  # backward: all-gather
    _loss(y, rank).backward()
    return y.detach(), x.grad


# --8<-- [end:reduce_scatter_before]


# --8<-- [start:reduce_scatter_after]
def reduce_scatter_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _tokens(rank, 2 * world)
    y = funcoll.reduce_scatter(x, 0, group=dist.group.WORLD)  # the adjoint: all_gather of the gradient
    _loss(y, rank).backward()
    return y.detach(), x.grad


# --8<-- [end:reduce_scatter_after]


# --8<-- [start:all_to_all_before]
def all_to_all_before(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_split_sizes = [1, 2] if rank == 0 else [3, 1]  # tokens this rank sends to each expert rank
    output_split_sizes = (
        [1, 3] if rank == 0 else [2, 1]
    )  # ... and receives: Megatron's dispatcher exchanges them
    x = _tokens(rank, sum(input_split_sizes))
    y = all_to_all(dist.group.WORLD, x, output_split_sizes, input_split_sizes)
    _loss(y, rank).backward()
    return y.detach(), x.grad


# --8<-- [end:all_to_all_before]


# --8<-- [start:all_to_all_after]
def all_to_all_after(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_split_sizes = [1, 2] if rank == 0 else [3, 1]
    x = _tokens(rank, sum(input_split_sizes))
    # recv_sizes may be passed as well (then nothing is exchanged); here funcoll exchanges them
    y, _recv_sizes = funcoll.all_to_all_v(x, input_split_sizes, group=dist.group.WORLD)
    _loss(y, rank).backward()
    return y.detach(), x.grad


# --8<-- [end:all_to_all_after]


def _uneven(rank: int) -> tuple[list[int], torch.Tensor]:
    sizes = [3, 1]  # every rank's sequence length: a data loader that saw the whole batch
    return sizes, torch.arange(sizes[rank] * 2.0).reshape(sizes[rank], 2) + 10 * rank


def uneven_gather_before(rank: int, world: int) -> torch.Tensor:
    """What ``_gather_along_first_dim(x, group, output_split_sizes=sizes)`` computes (NCCL only)."""
    return torch.cat([_uneven(r)[1] for r in range(world)])


# --8<-- [start:uneven_gather_after]
def uneven_gather_after(rank: int, world: int) -> torch.Tensor:
    sizes, x = _uneven(rank)
    # _gather_along_first_dim(x, group, output_split_sizes=sizes), on any backend; nothing exchanged
    return funcoll.gather(x, 0, sizes=sizes, group=dist.group.WORLD)


# --8<-- [end:uneven_gather_after]


def uneven_reduce_scatter_before(rank: int, world: int) -> torch.Tensor:
    """What ``_reduce_scatter_along_first_dim(x, group, input_split_sizes=sizes)`` computes (NCCL only)."""
    full = sum(torch.arange(8.0).reshape(4, 2) * (r + 1) for r in range(world))
    return full.split([3, 1])[rank]


# --8<-- [start:uneven_reduce_scatter_after]
def uneven_reduce_scatter_after(rank: int, world: int) -> torch.Tensor:
    x = torch.arange(8.0).reshape(4, 2) * (rank + 1)  # rows 0-2 for rank 0, row 3 for rank 1
    return funcoll.reduce_scatter(x, 0, sizes=[3, 1], group=dist.group.WORLD)


# --8<-- [end:uneven_reduce_scatter_after]


PAIRS = {
    "gather_from_sequence_parallel_region": (gather_before, gather_after),
    "gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)": (
        gather_replicated_before,
        gather_replicated_after,
    ),
    "reduce_scatter_to_sequence_parallel_region": (reduce_scatter_before, reduce_scatter_after),
    "all_to_all": (all_to_all_before, all_to_all_after),
    "_gather_along_first_dim(output_split_sizes)": (uneven_gather_before, uneven_gather_after),
    "_reduce_scatter_along_first_dim(input_split_sizes)": (
        uneven_reduce_scatter_before,
        uneven_reduce_scatter_after,
    ),
}
