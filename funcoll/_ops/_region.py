"""Region ops: Megatron/OpenSora-style pairs whose backward is not the adjoint of a collective.

Inside a tensor- or sequence-parallel region the computation after the op is the
same on every rank, so the gradient that comes back is already complete on every
rank: gathering in the forward needs only a local split in the backward, and
splitting in the forward needs a gather in the backward. `grad_scale` rescales that
gradient ("up": times world, "down": divided by world), as OpenSora does.

Uneven dims follow ``torch.tensor_split``: along a dim of length n the first
``n % world`` ranks hold one more row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._base._checks import IntLike, check_dim, fresh, tensor_split_sizes
from .._base._dtensor import MeshAxis
from .._base._group import Group, GroupLike
from .._base._wire import unwire
from .._collective import _faults, _prims
from .._collective._header import (
    GRAD_SCALES,
    NDIM_ONLY,
    STRATEGY,
    Arg,
    Header,
    check_agreement,
    check_given_lengths,
    given_sizes,
    named,
    row_sizes,
)
from .._collective._phase import Primitive
from .._collective._rows import from_rows, to_rows
from ._entry import entry
from ._spec import HEADER, REGION, plus, rows_plan

__all__ = ["gather_forward_split_backward", "split_forward_gather_backward"]

GradScale = Literal["up", "down"] | float | None


def _check_grad_scale(opname: str, grad_scale: object) -> str | None:
    # OpenSora's split_forward_gather_backward defaults to 1.0, which its backward
    # treats as "no scaling"; accept 1.0 as None for compatibility.
    if grad_scale is None or (isinstance(grad_scale, float) and grad_scale == 1.0):
        return None
    if grad_scale in ("up", "down"):
        return grad_scale  # type: ignore[return-value]
    raise ValueError(f"{opname}: `grad_scale`={grad_scale!r} must be 'up', 'down' or None (1.0 means None)")


def _region_args(opname: str, x: Tensor, dim: int, grad_scale: GradScale) -> tuple[int, str | None]:
    """The checks both region ops make on a plain `x`, in order: dim, grad_scale."""
    return check_dim(opname, x, dim), _check_grad_scale(opname, grad_scale)


def _scaled(g: Tensor, scale: str | None, world: int) -> Tensor:
    if scale == "up":
        return g * world
    if scale == "down":
        return g / world
    return g


def _split_sizes(x: Tensor, dim: int, world: int, sizes: list[IntLike] | None) -> list[IntLike]:
    """The pieces of `x` along `dim`: tensor_split's unless given (a DTensor's: torch.chunk's); longest first."""
    return tensor_split_sizes(x.shape[dim], world) if sizes is None else sizes


class _SplitForwardGatherBackward(Primitive):
    @staticmethod
    def forward(
        x: Tensor,
        dim: int,
        scale: str | None,
        group_name: str,
        world: int,
        rank: int,
        sizes: list[IntLike] | None,
    ) -> Tensor:
        sizes = _split_sizes(x, dim, world, sizes)
        start = sum(sizes[:rank])
        return fresh(x.narrow(dim, start, sizes[rank]))  # a copy even when the piece is contiguous

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        x, ctx.dim, ctx.scale, ctx.group_name, ctx.world, ctx.rank, sizes = inputs
        ctx.sizes = _prims.ctx_ints(_split_sizes(x, ctx.dim, ctx.world, sizes))
        ctx.total = _prims.ctx_ints([x.shape[ctx.dim]])[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        gm = to_rows(_scaled(grad, ctx.scale, ctx.world), ctx.dim)
        # the first pieces are the longest, and they add up to the input
        stats = (ctx.sizes[-1], ctx.sizes[0], ctx.total)
        full = _prims.gather_rows(gm, ctx.sizes, "auto", ctx.group_name, ctx.world, ctx.rank, stats)
        return from_rows(full, grad.dtype, ctx.dim), None, None, None, None, None, None


class _GatherForwardSplitBackward(Primitive):
    @staticmethod
    def forward(
        x: Tensor,
        dim: int,
        sizes: list[IntLike],
        stats: _prims.Stats,
        scale: str | None,
        group_name: str,
        world: int,
        rank: int,
        strategy: str,
    ) -> Tensor:
        xm = to_rows(x, dim)
        y = unwire(_prims.gather_rows(xm, sizes, strategy, group_name, world, rank, stats), x.dtype)
        if dim != 0:
            moved = y.movedim(0, dim)
            # Compiled, the result is a new tensor even when `moved` is contiguous already (then
            # .contiguous() returns `moved` itself, as it does when the leading dims have size 1, a
            # batch of 1). torch 2.11's dynamo makes every tensor the forward creates an extra output
            # of the traced forward (2.12 drops those that alias an output); with `moved` both the
            # output and an extra one, AOT autograd routes the incoming gradient to the extra output
            # and this backward gets zeros: compiled input gradients of 0 on 2.11. Inductor drops
            # the clone where the layout already matches; eager keeps .contiguous() (no copy).
            y = fresh(moved) if torch.compiler.is_compiling() else moved.contiguous()
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.dim, sizes, _, ctx.scale, _, ctx.world, rank, _ = inputs
        ctx.start = _prims.ctx_ints([sum(sizes[:rank])])[0]
        ctx.len = _prims.ctx_ints([sizes[rank]])[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        piece = grad.narrow(ctx.dim, ctx.start, ctx.len)
        return _scaled(piece, ctx.scale, ctx.world).contiguous(), *[None] * 8


def _split_forward_gather_backward_dtensor(ax: MeshAxis, dim: int, grad_scale: GradScale) -> Tensor:
    """``Replicate() -> Shard(dim)``, in DTensor's chunk layout."""
    d, scale = ax.dim(dim), _check_grad_scale(ax.opname, grad_scale)
    ax.expect(Replicate(), "Replicate()")
    ax.expect_unsharded_elsewhere(d, "dim")
    local = ax.local()
    if ax.world == 1:
        return ax.wrap(fresh(local), Shard(d))
    y = _SplitForwardGatherBackward.apply(local, d, scale, ax.name, ax.world, ax.rank, ax.sizes(d))
    return ax.wrap(y, Shard(d))


@entry(
    "split_forward_gather_backward",
    REGION,
    header=Header(args=(Arg("dim"), Arg("grad_scale", named(GRAD_SCALES))), reads=NDIM_ONLY, check_only=True),
    # backward: a ragged all-gather, its sizes known
    collectives=lambda world, variant: ({}, rows_plan(world)[0]),
    placements=("Replicate()", "Shard(dim)"),
    dtensor=_split_forward_gather_backward_dtensor,
)
def split_forward_gather_backward(
    x: Tensor, group: GroupLike, dim: int, grad_scale: GradScale = None
) -> Tensor:
    """Keep this rank's piece of `x` along `dim`; the backward gathers the gradient.

    Args:
        x: the full tensor, the same on every rank.
        group: the communicator (OpenSora's ``process_group``).
        dim: the dim to split, with ``torch.tensor_split`` semantics when it does not
            divide by world (the first ``n % world`` ranks get one more).
        grad_scale: ``"up"`` multiplies the backward gradient by world, ``"down"``
            divides it, None (or 1.0) leaves it.

    Returns:
        A new tensor: this rank's piece, ``x.shape`` with ``shape[dim]`` the piece length.

    Backward: a (ragged) ``all_gather`` of the gradient along `dim`, scaled.

    DTensor `x`: ``Replicate() -> Shard(dim)`` in DTensor's chunk layout
    (docs/dtensor.md).

    Example (2 ranks)::

        # both: x = [1, 2, 3]
        split_forward_gather_backward(x, None, 0)   # rank 0: [1, 2]   rank 1: [3]
        # backward with grad 1. on every rank: x.grad = [1., 1., 1.]
    """
    g = cast(Group, group)
    d, scale = _region_args("funcoll.split_forward_gather_backward", x, dim, grad_scale)
    x = check_agreement("split_forward_gather_backward", x, g, args=(d, GRAD_SCALES.index(scale)))
    if g.is_single:
        return fresh(x)
    return _SplitForwardGatherBackward.apply(x, d, scale, g.name, g.size, g.rank, None)


def _gather_forward_split_backward_dtensor(
    ax: MeshAxis, dim: int, grad_scale: GradScale, sizes: Sequence[int] | Tensor | None
) -> Tensor:
    """``Shard(dim) -> Replicate()``, the lengths known from the global shape (`sizes` is not read)."""
    return gather_shards(ax, ax.dim(dim), scale=_check_grad_scale(ax.opname, grad_scale))


@entry(
    "gather_forward_split_backward",
    REGION,
    header=Header(args=(None, STRATEGY), checks=(check_given_lengths,)),
    # backward: this rank's piece, no collective
    collectives=lambda world, variant: (plus(HEADER, rows_plan(world)[0]), {}),
    placements=("Shard(dim)", "Replicate()"),
    dtensor=_gather_forward_split_backward_dtensor,
)
def gather_forward_split_backward(
    x: Tensor,
    group: GroupLike,
    dim: int,
    grad_scale: GradScale = None,
    *,
    sizes: Sequence[int] | Tensor | None = None,
) -> Tensor:
    """Gather every rank's piece along `dim`; the backward keeps this rank's piece of the gradient.

    Args:
        x: this rank's piece; lengths along `dim` may differ between ranks (the
            ragged data model of :func:`funcoll.gather`), all other dims agree.
        group: the communicator.
        dim: the dim to concatenate along, in rank order.
        grad_scale: ``"up"``, ``"down"`` or None (1.0 means None), as in
            :func:`split_forward_gather_backward`.
        sizes: every rank's length along `dim` (world ints, or an int tensor), when
            the caller knows them (``funcoll.split_sizes(n, world)`` after a
            split): nothing is exchanged, as in :func:`funcoll.gather`.

    Returns:
        A new tensor: the concatenation of the ranks' pieces along `dim`.

    Backward: the slice of the gradient at this rank's rows, scaled; no communication.

    DTensor `x`: ``Shard(dim) -> Replicate()`` (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [1, 2]   rank 1: x = [3]
        gather_forward_split_backward(x, None, 0)   # both: [1, 2, 3]
        # backward with grad [10., 20., 30.]: rank 0 x.grad = [10., 20.], rank 1 [30.]
    """
    opname, g = "funcoll.gather_forward_split_backward", cast(Group, group)
    d, scale = _region_args(opname, x, dim, grad_scale)
    given = given_sizes(opname, x, d, sizes, g)
    if g.is_single:
        return fresh(x)
    sizes, stats, _ = row_sizes("gather_forward_split_backward", x, d, g, (0, 0), sizes=given)
    return _GatherForwardSplitBackward.apply(x, d, sizes, stats, scale, g.name, g.size, g.rank, "auto")


def gather_shards(ax: MeshAxis, dim: int, strategy: str = "auto", scale: str | None = None) -> DTensor:
    """A DTensor ``Shard(dim) -> Replicate()`` on `ax`'s mesh dim (all_gather, gather, this op).

    The forward gathers the shards, whose lengths (``torch.chunk``'s) every rank
    knows, so nothing is exchanged; the backward keeps this rank's piece of the
    replicated gradient: the gradient of one global value, not summed over ranks.
    ``"auto"`` pads: the shards are full but for one, then empty ones, so one
    all_gather of ``ceil(n / world)`` rows each moves little padding, and every
    rank's collective has the same shape (no rank-dependent empty payload).
    """
    strategy = "pad" if strategy == "auto" else strategy
    ax.expect_shard(dim)
    local = ax.local(dim)
    if ax.world == 1:
        return ax.wrap(fresh(local), Replicate())
    sizes = ax.sizes(dim)
    stats = (sizes[-1], sizes[0], ax.x.shape[dim])  # chunk lengths never grow along the ranks
    y = _GatherForwardSplitBackward.apply(
        local, dim, sizes, stats, scale, ax.name, ax.world, ax.rank, strategy
    )
    return ax.wrap(y, Replicate())
