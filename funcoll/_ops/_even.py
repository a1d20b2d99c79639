"""Collectives whose shapes agree on every rank: the JAX-style core of funcoll."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._base._checks import (
    REDUCE_OPS,
    IntLike,
    check_dim,
    check_equal,
    check_rank,
    check_reduce_op,
    check_sizes,
    check_total,
    fresh,
    tensor_split_sizes,
)
from .._base._dtensor import MeshAxis, is_placement
from .._base._group import Group, GroupLike
from .._base._quant import Wire, pair_code
from .._base._sym import prod
from .._base._wire import unwire, wire, wire_op
from .._collective import _prims
from .._collective._faults import public_op
from .._collective._header import (
    ARG1,
    DIM,
    DST,
    NDIM_ONLY,
    REDUCE_OP,
    SIZE,
    SIZES_GIVEN,
    WIDTH,
    Arg,
    Header,
    Reader,
    check_agreement,
    describe,
    disagree,
    same_tails,
    same_wire,
    tails,
    wire_tail,
    with_stats,
)
from .._collective._quantized import all_gather_wire_p, all_to_all_rows_wire_p, reduce_scatter_wire_p
from .._collective._rows import from_rows, to_rows
from ._entry import Refusal, entry
from ._ragged import reduce_scatter_v
from ._region import gather_shards
from ._spec import A2A, AG, AR, BC, EVEN, RS, Plan, fixed, rows_plan

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "ppermute",
    "reduce",
    "reduce_scatter",
    "split_sizes",
]


def _merge_rank_axis(z: Tensor, dim: int) -> Tensor:
    """``(world, *shape) -> shape`` with ``shape[dim]`` multiplied by world, rank-major."""
    world = z.shape[0]
    moved = z.movedim(0, dim)  # (..., world, shape[dim], ...)
    out_shape = list(z.shape[1:])
    out_shape[dim] = world * out_shape[dim]
    return moved.reshape(out_shape)


def _all_gather_dtensor(ax: MeshAxis, dim: int, tiled: bool) -> Tensor:
    """``Shard(dim) -> Replicate()`` (``tiled=False`` is refused before this)."""
    return gather_shards(ax, ax.dim(dim))


_STACKS = "its result stacks the ranks' tensors along a new dim", "funcoll.all_gather(x, dim)"
_TILED = (Arg("dim"), Arg("tiled", bool))
_GATHER, _SCATTER, _A2A = fixed({AG: 1}, {RS: 1}), fixed({RS: 1}, {AG: 1}), fixed({A2A: 1}, {A2A: 1})


@entry(
    "all_gather",
    EVEN,
    header=Header(args=_TILED, reads=NDIM_ONLY, checks=(same_wire,), check_only=True),
    collectives=_GATHER,
    placements=("Shard(dim)", "Replicate()"),
    dtensor=_all_gather_dtensor,
    refuse=Refusal(*_STACKS, when=lambda a: not a["tiled"]),
)
def all_gather(
    x: Tensor,
    dim: int = 0,
    *,
    group: GroupLike = None,
    tiled: bool = True,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> Tensor:
    """Gather `x` from every rank of `group` (JAX ``all_gather``).

    Args:
        x: this rank's tensor; every rank passes the same shape and dtype (for
            per-rank sizes along `dim` use :func:`funcoll.gather`).
        dim: with ``tiled=True`` the dim to concatenate along; with ``tiled=False``
            where the new rank axis goes (``-1`` puts it last).
        group: the communicator: None, a ProcessGroup, a 1-D DeviceMesh,
            ``(mesh, mesh_dim)`` or a group name (docs/index.md, Groups).
        tiled: concatenate (True) or stack a new axis of size world (False).
        wire: the format `x` travels in (docs/wire.md): ``funcoll.Wire(torch.int8,
            block=256)`` sends int8 codes and one float32 scale per 256 values of the
            last dim, in the same all_gather; the result is decoded to ``x.dtype``.
            None (default): exact. A floating `x` only; a group of one moves nothing
            and is exact.
        grad_wire: the format of the backward's reduce-scatter (None: exact).

    Returns:
        ``tiled=True``: ``x.shape`` with ``shape[dim] * world``, the ranks' tensors in
        rank order. ``tiled=False``: ``x.shape`` with a new axis of size world at `dim`.
        A 0-d `x` (a per-rank scalar: a loss, a count) is stacked either way:
        shape ``(world,)``. A new, contiguous tensor.

    Backward: ``reduce_scatter`` (sum) of the gradient along the same dim: each rank
    gets the sum over ranks of the gradient slice that came from it; in `grad_wire`
    when given. The forward's rounding in `wire` counts as the identity
    (straight-through).

    DTensor `x`: ``Shard(dim) -> Replicate()`` on the mesh dim `group` names, and
    the backward keeps this rank's piece of the gradient (docs/dtensor.md); exact
    only (a `wire` is refused).

    Example (2 ranks)::

        # rank 0: x = [[1, 2]]        rank 1: x = [[3, 4]]
        all_gather(x)                 # both: [[1, 2], [3, 4]]
        all_gather(x, dim=1)          # both: [[1, 2, 3, 4]]
        all_gather(x, tiled=False)    # both: [[[1, 2]], [[3, 4]]], shape (2, 1, 2)
        # rank 0: x = tensor(0.5)     rank 1: x = tensor(1.5)
        all_gather(x)                 # both: [0.5, 1.5]
        # rank 0: x = [[1., 2.]]      rank 1: x = [[3., 4.]]
        all_gather(x, wire=Wire(torch.bfloat16))  # both: [[1., 2.], [3., 4.]]
    """
    return _all_gather("funcoll.all_gather", x, dim, cast(Group, group), tiled, wire, grad_wire)


def _all_gather(
    opname: str,
    x: Tensor,
    dim: int,
    g: Group,
    tiled: bool,
    wire_as: Wire | None = None,
    grad_wire: Wire | None = None,
    *,
    invariant: bool = False,
) -> Tensor:
    tiled = tiled and x.dim() > 0  # a 0-d x has no dim to concatenate: its values are stacked
    d = check_dim(opname, x, dim, extra=0 if tiled else 1)
    tail = wire_tail(g.size, [], wire_as, grad_wire)
    x = check_agreement(opname.removeprefix("funcoll."), x, g, args=(d, int(tiled)), sizes=tail)
    if g.is_single:
        return fresh(x) if tiled else fresh(x.unsqueeze(d))
    if wire_as is not None or grad_wire is not None:
        stacked = all_gather_wire_p(x, g.name, g.size, wire_as, grad_wire)  # (world, *x.shape)
    else:
        # A 0-d x travels as one element (the backends want at least one dim).
        rows = wire(x).reshape(1) if x.dim() == 0 else wire(x)
        gathered = unwire(
            _prims.all_gather_invariant_p(rows, g.name, g.size, g.rank)
            if invariant
            else _prims.all_gather_p(rows, g.name, g.size),
            x.dtype,
        )
        if tiled and d == 0:  # as it arrives: no view of an eager pending result (each a Python dispatch)
            return gathered
        stacked = gathered.view(g.size, *x.shape)
    if not tiled:
        return from_rows(stacked, x.dtype, d)
    return _merge_rank_axis(stacked, d)


@public_op("all_gather")
def all_gather_invariant(x: Tensor, dim: int, group: Group, tiled: bool) -> Tensor:
    """:func:`all_gather` whose backward keeps this rank's slice of the gradient, with no collective.

    ``funcoll.lax.all_gather(..., to="invarying")``: JAX's invariant all-gather, whose
    transpose is a slice (every rank's cotangent of an invariant result is the whole
    one), where :func:`all_gather`'s is a reduce_scatter. Megatron's
    ``gather_from_tensor_model_parallel_region`` for equal pieces
    (:func:`funcoll.gather_forward_split_backward` takes ragged ones). Failures name
    ``all_gather``, the collective it issues. `group` is resolved by the caller.
    """
    return _all_gather("funcoll.all_gather", x, dim, group, tiled, invariant=True)


@entry(
    "all_gather_into_tensor",
    EVEN,
    header=Header(args=_TILED, reads=NDIM_ONLY, check_only=True),
    collectives=_GATHER,
    refuse=Refusal(*_STACKS),
)
def all_gather_into_tensor(x: Tensor, *, group: GroupLike = None) -> Tensor:
    """The functional form of ``torch.distributed.all_gather_into_tensor``.

    Args:
        x: this rank's tensor, the same shape and dtype on every rank.
        group: the communicator.

    Returns:
        A new tensor of shape ``(world, *x.shape)``: row i is rank i's `x`
        (``all_gather(x, tiled=False)``).

    Backward: ``reduce_scatter`` (sum): rank i gets the sum over ranks of row i of
    the gradient.

    A DTensor `x` is refused: no placement describes the stack (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [0., 0.]        rank 1: x = [1., 1.]
        all_gather_into_tensor(x)     # both: [[0., 0.], [1., 1.]]
    """
    return _all_gather("funcoll.all_gather_into_tensor", x, 0, cast(Group, group), False)


def _reduce_scatter_dtensor(
    ax: MeshAxis,
    dim: int,
    op: str,
    tiled: bool,
    sizes: Sequence[int] | Tensor | None,
) -> Tensor:
    """``Partial(op) -> Shard(dim)``, in DTensor's chunk layout."""
    opname = ax.opname
    d = ax.dim(dim)
    reduce_op = check_reduce_op(opname, op, ax.x)
    if sizes is not None or not tiled:
        raise ValueError(
            f"{opname}: `x` is a DTensor, whose Shard({d}) has torch.chunk's lengths; `sizes` and "
            f"tiled=False are for plain tensors (got sizes={sizes!r}, tiled={tiled})"
        )
    ax.expect_partial(reduce_op)
    ax.expect_unsharded_elsewhere(d, "dim")
    local = ax.local()
    if ax.world == 1:
        return ax.wrap(fresh(local), Shard(d))
    sz, xm, wop = ax.sizes(d), wire(local).movedim(d, 0), wire_op(reduce_op, local.dtype)
    if _static_equal(sz):
        y = _prims.reduce_scatter_p(xm, wop, ax.name, ax.world)
    else:
        stats = (sz[-1], sz[0], local.shape[d])
        y = _prims.reduce_scatter_v_p(xm, sz, wop, ax.name, ax.world, ax.rank, stats)
    return ax.wrap(unwire(y, local.dtype).movedim(0, d), Shard(d))


def _slices_agree(opname: str, rows: list[list[int]]) -> None:
    """reduce_scatter's header check: every rank's `sizes` (or, without them, x.shape[dim]) agree."""
    if not rows[0][ARG1]:  # the even op: its sizes follow from x.shape[dim]
        disagree(opname, rows, "x.shape[dim]", lambda r: r[SIZE], describe)
    same_tails(opname, rows, "ranks disagree on `sizes` ({detail})")
    disagree(opname, rows, "x.shape[dim]", lambda r: r[SIZE], describe)
    sizes = tails(rows)[0]
    if any(n < 0 for n in sizes) or sum(sizes) != rows[0][SIZE]:
        raise ValueError(
            f"{opname}: `sizes`={sizes} must be {len(rows)} non-negative ints summing to x.shape[dim]={rows[0][SIZE]}"
        )


def _reduce_scatter_plan(world: int, variant: str) -> Plan:
    if variant == "sizes":  # the ragged one: one all_to_all; backward a ragged all-gather
        return {A2A: 1}, rows_plan(world)[0]
    if variant == "wire":  # quantized pieces: one all_to_all, each rank sums what it receives
        return {A2A: 1}, {AG: 1}
    return {RS: 1}, {AG: 1}


@entry(
    "reduce_scatter",
    EVEN,
    header=Header(
        args=(REDUCE_OP, SIZES_GIVEN),
        # this rank's slice sizes, then their min, max and sum
        reads=Reader(lambda rows, rank: with_stats(rows[rank][WIDTH : WIDTH + len(rows)]), lambda w: w + 3),
        checks=(_slices_agree, same_wire),
    ),
    collectives=_reduce_scatter_plan,
    placements=("Partial(op)", "Shard(dim)"),
    dtensor=_reduce_scatter_dtensor,
)
def reduce_scatter(
    x: Tensor,
    dim: int = 0,
    *,
    group: GroupLike = None,
    op: str = "sum",
    tiled: bool = True,
    sizes: Sequence[int] | Tensor | None = None,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> Tensor:
    """Reduce `x` over ranks and keep this rank's slice of `dim` (JAX ``psum_scatter``).

    Args:
        x: the same shape and dtype on every rank.
        dim: the dim to scatter.
        group: the communicator.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"product"`` (avg is computed
            as sum / world, so it works on every backend; floating dtypes only).
            On bool tensors sum is the logical or and product the logical and.
        tiled: with True `dim` is split into world equal slices and rank i keeps
            slice i; with False ``x.shape[dim]`` must equal world and that dim is removed.
        sizes: per-rank slice lengths along `dim` (world ints summing to
            ``x.shape[dim]``) for a ragged reduce-scatter: rank i receives the reduced
            rows ``[sizes[0] + ... + sizes[i-1], ... + sizes[i])``: one all_to_all,
            the same `sizes` on every rank (``funcoll.set_checks(True)`` checks
            that they are; a tensor is read on the host, a device-to-host sync for
            a GPU tensor). None means equal slices, and then ``x.shape[dim]`` must
            divide by world.
        wire: the format the slices travel in (docs/wire.md), with equal slices
            (no `sizes`): every rank's slices go by one all_to_all, each with its
            own block scales, and each rank decodes the slices it receives to
            ``x.dtype`` and reduces them there, never in the wire's 8 bits
            (ZeRO++'s qgZ). None (default): the exact reduce_scatter. A floating
            `x` only; a group of one moves nothing and is exact.
        grad_wire: the format of the backward's all_gather (None: exact).

    Returns:
        A new tensor: ``x.shape`` with ``shape[dim]`` divided by world (or
        ``sizes[rank]``), or without `dim` when ``tiled=False``.

    Backward (``sum``): ``all_gather`` of the gradient along `dim` (ragged when
    `sizes` is given; in `grad_wire` when given); ``avg`` divides that by world; the
    other ops have no gradient. The forward's rounding in `wire` counts as the
    identity (straight-through).

    DTensor `x`: ``Partial(op) -> Shard(dim)`` in DTensor's chunk layout, with neither
    `sizes` nor ``tiled=False`` (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [1, 2, 3, 4]    rank 1: x = [10, 20, 30, 40]
        reduce_scatter(x)             # rank 0: [11, 22]      rank 1: [33, 44]
        reduce_scatter(x, sizes=[3, 1])  # rank 0: [11, 22, 33]  rank 1: [44]
        # rank 0: x = [1., 2., 3., 4.]    rank 1: x = [10., 20., 30., 40.]
        reduce_scatter(x, wire=Wire(torch.bfloat16))  # rank 0: [11., 22.]   rank 1: [33., 44.]
    """
    opname, g = "funcoll.reduce_scatter", cast(Group, group)
    d = check_dim(opname, x, dim)
    reduce_op = check_reduce_op(opname, op, x)
    if sizes is not None:
        if not tiled:
            raise ValueError(f"{opname}: `sizes` is for tiled=True; got tiled=False with sizes={sizes!r}")
        if wire is not None or grad_wire is not None:
            raise ValueError(
                f"{opname}: `wire`={wire!r}, `grad_wire`={grad_wire!r} are for equal slices; got "
                f"sizes={sizes!r} (pass wire=None and grad_wire=None for a ragged reduce-scatter)"
            )
        return reduce_scatter_v(opname, x, d, sizes, reduce_op, g)
    if not tiled and x.shape[d] != g.size:
        raise ValueError(
            f"{opname}: tiled=False needs x.shape[{d}] == world ({g.size}), got shape {tuple(x.shape)}"
        )
    if x.shape[d] % g.size != 0:
        raise ValueError(
            f"{opname}: x.shape[{d}]={x.shape[d]} does not divide by the group size {g.size}; "
            f"pass `sizes` for a ragged reduce-scatter"
        )
    n = x.shape[d] // g.size
    tail = wire_tail(g.size, [n] * g.size, wire, grad_wire)
    x = check_agreement("reduce_scatter", x, g, d, (REDUCE_OPS.index(reduce_op), 0), tail)
    if g.is_single:
        y = fresh(x)
    elif wire is not None or grad_wire is not None:  # (world, ..., n, ...) -> this rank's (..., n, ...)
        # reshape (a view: one dim split), not Tensor.unflatten, which dynamo cannot trace
        # under a torch function mode such as torch.set_default_device's
        pieces = x.reshape(*x.shape[:d], g.size, n, *x.shape[d + 1 :]).movedim(d, 0)
        y = reduce_scatter_wire_p(pieces, reduce_op, g.name, g.size, wire, grad_wire)
    else:
        # dim 0: as it arrives, no view of an eager pending result
        y = from_rows(
            _prims.reduce_scatter_p(to_rows(x, d), wire_op(reduce_op, x.dtype), g.name, g.size), x.dtype, d
        )
    return y.squeeze(d) if not tiled else y


def _all_reduce_dtensor(ax: MeshAxis, op: str) -> Tensor:
    """``Partial(op) -> Replicate()``; the gradient of the one value passes through."""
    reduce_op = check_reduce_op(ax.opname, op, ax.x)
    ax.expect_partial(reduce_op)
    local = ax.local()
    if ax.world == 1:
        return ax.wrap(fresh(local), Replicate())
    wop = wire_op(reduce_op, local.dtype)
    y = unwire(_prims.replicate_p(wire(local), wop, 0, ax.name, ax.world), local.dtype)
    return ax.wrap(y, Replicate())


@entry(
    "all_reduce",
    EVEN,
    header=Header(args=(REDUCE_OP, None), reads=NDIM_ONLY, check_only=True),
    collectives=fixed({AR: 1}, {AR: 1}),
    placements=("Partial(op)", "Replicate()"),
    dtensor=_all_reduce_dtensor,
)
def all_reduce(x: Tensor, *, group: GroupLike = None, op: str = "sum") -> Tensor:
    """Reduce `x` over the ranks of `group`; every rank gets the result (JAX ``psum``).

    Args:
        x: the same shape and dtype on every rank.
        group: the communicator.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"product"``; on bool
            tensors sum is the logical or and product the logical and.

    Returns:
        A new tensor of ``x.shape``.

    Backward (``sum``): ``all_reduce`` (sum) of the gradient, JAX's convention: the
    gradient of a replicated loss summed over ranks. ``avg`` divides by world; the
    other ops have no gradient. Megatron's identity-backward pairs (identity forward
    with all_reduce backward, and the reverse) are what the region ops give
    (docs/index.md, Region ops).

    DTensor `x`: ``Partial(op) -> Replicate()``, the gradient passed through
    (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [1., 2.]        rank 1: x = [3., 4.]
        all_reduce(x)                 # both: [4., 6.]
        all_reduce(x, op="max")       # both: [3., 4.]
    """
    return _all_reduce(x, cast(Group, group), op, _prims.all_reduce_p)


def _all_reduce(x: Tensor, g: Group, op: str, prim: Callable[[Tensor, str, str, int], Tensor]) -> Tensor:
    reduce_op = check_reduce_op("funcoll.all_reduce", op, x)
    x = check_agreement("all_reduce", x, g, args=(REDUCE_OPS.index(reduce_op), 0))
    if g.is_single:
        return fresh(x)
    return unwire(prim(wire(x), wire_op(reduce_op, x.dtype), g.name, g.size), x.dtype)


@public_op("all_reduce")
def all_reduce_invariant(x: Tensor, group: Group, op: str) -> Tensor:
    """:func:`all_reduce` whose backward has no collective: ``funcoll.lax.psum`` in the typed mode.

    ``shard_map(check_vma=True)`` types the result invariant, so its gradient is the
    same on every rank already and JAX's transpose (``pvary``) moves nothing, where
    :func:`all_reduce`'s backward sums it again. `group` is resolved by the caller.
    """
    return _all_reduce(x, group, op, _prims.psum_invariant_p)


def split_sizes(total: int, world: int) -> list[int]:
    """The lengths ``torch.tensor_split`` gives `world` pieces of a dim of length `total`.

    The first ``total % world`` pieces are one longer: how funcoll splits a dim
    that does not divide (:func:`all_to_all`'s scatter dim, the region ops), and
    what every rank knows without communicating, so it can serve as
    ``gather_sizes`` when the ranks' lengths came from such a split (Ulysses
    attention with a head count the world size does not divide).

    Example::

        split_sizes(7, 3)   # [3, 2, 2]
        split_sizes(1, 2)   # [1, 0]
    """
    opname = "funcoll.split_sizes"
    for arg, v in (("total", total), ("world", world)):
        if not isinstance(v, (int, torch.SymInt)) or isinstance(v, bool):
            raise TypeError(f"{opname}: `{arg}` must be an int, got {type(v).__name__}")
    if not isinstance(total, torch.SymInt) and total < 0:
        raise ValueError(f"{opname}: `total`={total} must be >= 0")
    if world < 1:
        raise ValueError(f"{opname}: `world`={world} must be >= 1")
    return tensor_split_sizes(total, world)


def _all_to_all_dtensor(
    ax: MeshAxis,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[int] | None,
    gather_sizes: Sequence[int] | None,
) -> Tensor:
    """``Shard(gather_dim) -> Shard(scatter_dim)``, both in DTensor's chunk layout."""
    opname = ax.opname
    s, gd = ax.dim(scatter_dim, "scatter_dim"), ax.dim(gather_dim, "gather_dim")
    if scatter_sizes is not None or gather_sizes is not None:
        raise ValueError(
            f"{opname}: `x` is a DTensor, whose shards have torch.chunk's lengths, known from its "
            f"global shape; `scatter_sizes` and `gather_sizes` are for plain tensors"
        )
    if s == gd:
        raise ValueError(
            f"{opname}: scatter_dim == gather_dim == {s} interleaves the ranks' pieces, which no "
            f"DTensor placement describes; pass x.to_local() for the op on plain tensors"
        )
    ax.expect_shard(gd, "gather_dim")
    ax.expect_unsharded_elsewhere(s, "scatter_dim")
    y = all_to_all(ax.local(gd), ax.group, s, gd, scatter_sizes=ax.sizes(s), gather_sizes=ax.sizes(gd))
    return ax.wrap(y, Shard(s))


def _all_to_all_args(
    opname: str,
    x: Tensor,
    g: Group,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[int] | None,
    gather_sizes: Sequence[int] | None,
) -> tuple[int, int, list[IntLike], list[IntLike] | None]:
    """all_to_all's own checks on this rank: (scatter dim, gather dim, the pieces it sends, `gather_sizes`)."""
    s = check_dim(opname, x, scatter_dim, "scatter_dim")
    gd = check_dim(opname, x, gather_dim, "gather_dim")
    if scatter_sizes is None:
        pieces = tensor_split_sizes(x.shape[s], g.size)
    else:
        pieces = check_sizes(opname, "scatter_sizes", scatter_sizes, g.size, tensors=False)
        check_total(opname, "scatter_sizes", pieces, x.shape[s], f"x.shape[{s}]")
    widths = (
        None
        if gather_sizes is None
        else check_sizes(opname, "gather_sizes", gather_sizes, g.size, tensors=False)
    )
    if widths is not None:
        w, n = widths[g.rank], x.shape[gd]
        check_equal(
            w,
            n,
            f"{opname}: rank {g.rank}'s x.shape[{gd}] is not its `gather_sizes` entry",
            lambda: (
                f"{opname}: `gather_sizes`={widths} says rank {g.rank} holds {w} along gather_dim {gd}, "
                f"but its x.shape[{gd}]={n}"
            ),
        )
        if s == gd and not _static_equal(widths):
            raise ValueError(
                f"{opname}: `gather_sizes`={widths} differ with scatter_dim == gather_dim; an uneven "
                f"all-to-all along one dim is funcoll.all_to_all_v"
            )
    return s, gd, pieces, widths


def _widths_agree(opname: str, rows: list[list[int]]) -> None:
    """all_to_all's header check: the ranks agree on the scatter split and on every rank's gather_dim length."""
    same_tails(
        opname, rows, "ranks disagree on how the scatter dim is split (`scatter_sizes`: {detail})", first=1
    )
    same_tails(
        opname, rows, "ranks disagree on every rank's length along gather_dim {dim} ({detail}); when "
        "x.shape[gather_dim] differs between ranks, pass the same `gather_sizes` on every rank",
    )  # fmt: skip
    expected = tails(rows)[0]
    for i, r in enumerate(rows):
        if r[SIZE] != expected[i]:
            raise ValueError(
                f"{opname}: rank {i} has x.shape[{r[DIM]}]={r[SIZE]}, but the ranks expect {expected[i]} "
                f"there (`gather_sizes` or, without it, every rank's own length)"
            )


def _same_wire(opname: str, rows: list[list[int]]) -> None:
    same_wire(opname, rows, ARG1)


@entry(
    "all_to_all",
    EVEN,
    header=Header(
        args=(Arg("scatter_dim"), None),  # ARG1: the formats' code (the tail is full)
        reads=NDIM_ONLY,
        varying_dim="`gather_dim`",
        checks=(_widths_agree, _same_wire),
        check_only=True,
    ),
    collectives=_A2A,
    placements=("Shard(gather_dim)", "Shard(scatter_dim)"),
    dtensor=_all_to_all_dtensor,
)
def all_to_all(
    x: Tensor,
    group: GroupLike = None,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    *,
    scatter_sizes: Sequence[int] | None = None,
    gather_sizes: Sequence[int] | None = None,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> Tensor:
    """Split `x` along `scatter_dim`, send piece i to rank i, concatenate what arrives along `gather_dim`.

    Argument order and defaults follow OpenSora's ``all_to_all`` (sequence-parallel
    attention: ``(B, S/w, H, D) -> (B, S, H/w, D)``).

    Uneven dims: the scatter dim is split with ``torch.tensor_split`` semantics
    (the first ``n % world`` ranks get one more), or as `scatter_sizes` says. The
    gather dim may differ between ranks when every rank passes `gather_sizes`:
    rank i holds ``gather_sizes[i]`` along it. Both lists are the same on every
    rank and known without communicating, so nothing is exchanged. Ulysses
    attention goes both ways with a sequence length S and H heads that world
    need not divide (rank r holds ``S_r = split_sizes(S, w)[r]`` positions and
    gets ``H_r = split_sizes(H, w)[r]`` heads)::

        s_sizes, h_sizes = split_sizes(S, w), split_sizes(H, w)
        o = all_to_all(q, g, 2, 1, gather_sizes=s_sizes)  # (B, S_r, H, D) -> (B, S, H_r, D)
        q = all_to_all(o, g, 1, 2, scatter_sizes=s_sizes, gather_sizes=h_sizes)  # and back

    Without `gather_sizes` on the way in, ranks holding different S_r pair
    mismatched buffers (a backend abort, or funcoll's ValueError under checks).

    Args:
        x: every dim but `gather_dim` the same on every rank, and the dtype.
        group: the communicator.
        scatter_dim: the dim split into world pieces; piece j goes to rank j.
        gather_dim: the dim the received pieces are concatenated along, in rank order.
        scatter_sizes: world ints summing to ``x.shape[scatter_dim]``, the same on
            every rank; None splits as ``torch.tensor_split`` does (:func:`split_sizes`).
        gather_sizes: world ints, the same on every rank: rank i's
            ``x.shape[gather_dim]``; None when it is the same on every rank.
        wire: the format the pieces travel in (docs/wire.md), with block scales
            along the last dim that is not `scatter_dim` (the head dim D of
            Ulysses' ``(B, S, H, D)``): ``funcoll.Wire(torch.bfloat16)`` halves
            float32's bytes. None (default): exact. With `gather_sizes` that
            differ, `gather_dim` must not be that blocks' dim.
        grad_wire: the format of the backward's pieces (None: exact).

    Returns:
        A new tensor: ``x.shape`` with ``shape[scatter_dim]`` replaced by this rank's
        piece length and ``shape[gather_dim]`` by the sum of every rank's length
        (world times it when they are equal).

    Backward: ``all_to_all`` of the gradient with the two dims swapped, each with
    its sizes: pieces of `gather_dim` go back to the rank they came from and are
    concatenated along `scatter_dim`, in `grad_wire`. The forward's rounding counts
    as the identity (straight-through).

    Ranks whose shapes disagree make the backend abort or hang; with
    ``funcoll.set_checks(True)`` every rank raises a ``ValueError`` instead. A
    rank whose ``x.shape[gather_dim]`` is not ``gather_sizes[rank]`` raises before
    communicating.

    DTensor `x`: ``Shard(gather_dim) -> Shard(scatter_dim)``, both in DTensor's chunk
    layout, without `scatter_sizes`/`gather_sizes` (docs/dtensor.md).

    Example (2 ranks, scatter_dim=1, gather_dim=0)::

        # rank 0: x = [[1, 2]]        rank 1: x = [[3, 4]]
        all_to_all(x, None, 1, 0)     # rank 0: [[1], [3]]    rank 1: [[2], [4]]
        # 3 heads on 2 ranks, back from heads to sequence (scatter_dim=0, gather_dim=1):
        # rank 0: x = [[1, 2], [5, 6]]  rank 1: x = [[3], [7]]   (gather_sizes=[2, 1])
        all_to_all(x, None, 0, 1, gather_sizes=[2, 1])  # rank 0: [[1, 2, 3]]  rank 1: [[5, 6, 7]]
        # a sequence of 3 on 2 ranks, to heads (scatter_dim=1, gather_dim=0):
        # rank 0: x = [[1, 2], [3, 4]]  rank 1: x = [[5, 6]]   (gather_sizes=[2, 1])
        all_to_all(x, None, 1, 0, gather_sizes=[2, 1])  # rank 0: [[1], [3], [5]]  rank 1: [[2], [4], [6]]
        # rank 0: x = [[1., 2.]]      rank 1: x = [[3., 4.]]
        all_to_all(x, None, 1, 0, wire=Wire(torch.bfloat16))  # rank 0: [[1.], [3.]]  rank 1: [[2.], [4.]]
    """
    opname, g = "funcoll.all_to_all", cast(Group, group)
    s, gd, pieces, widths = _all_to_all_args(
        opname, x, g, scatter_dim, gather_dim, scatter_sizes, gather_sizes
    )
    even = widths is None or _static_equal(widths)  # every rank's rows have one shape
    if not even:
        _check_blocks_dim(opname, x, s, gd, widths, wire, grad_wire)
    expected = widths if widths is not None else [x.shape[gd]] * g.size
    x = check_agreement("all_to_all", x, g, gd, (s, pair_code(wire, grad_wire)), [*expected, *pieces])
    if g.is_single:
        return fresh(x)
    mine = pieces[g.rank]
    xm = to_rows(x, s)  # (S, *R)
    if even:  # each row in the formats, with its own scales (None: the exact primitive)
        z = all_to_all_rows_wire_p(xm, [mine] * g.size, pieces, g.name, wire, grad_wire)  # (world * mine, *R)
        if s == 0 and gd == 0:  # as it arrives: no view of an eager pending result (each a Python dispatch)
            return unwire(z, x.dtype)
        z = z.view(g.size, mine, *xm.shape[1:]).movedim(1, s + 1)  # (world, *x.shape with S -> mine)
        return unwire(_merge_rank_axis(z, gd).contiguous(), x.dtype)
    assert widths is not None
    return unwire(_uneven_rows(xm, g, s, gd, pieces, widths, wire, grad_wire), x.dtype)


def _check_blocks_dim(
    opname: str, x: Tensor, s: int, gd: int, widths: object, wire: Wire | None, grad_wire: Wire | None
) -> None:
    """A format's blocks run along the last dim (the one before, when it is `s`): not the uneven gather dim."""
    if (wire is not None or grad_wire is not None) and gd == (
        x.dim() - 2 if s == x.dim() - 1 else x.dim() - 1
    ):
        raise ValueError(
            f"{opname}: `gather_sizes`={widths} differ along gather_dim {gd}, the dim along which "
            f"`wire`={wire!r}, `grad_wire`={grad_wire!r} put their blocks: every rank's blocks must "
            f"be cut alike (gather along another dim, or pass both as None)"
        )


def _uneven_rows(
    xm: Tensor,
    g: Group,
    s: int,
    gd: int,
    pieces: list[IntLike],
    widths: Sequence[IntLike],
    wire: Wire | None,
    grad_wire: Wire | None,
) -> Tensor:
    """all_to_all of `xm`'s rows (the scatter dim first) whose shapes differ between ranks along `gd`."""
    mine = pieces[g.rank]
    gm = gd + 1 if gd < s else gd  # the gather dim in xm's layout
    rows_of = [[*xm.shape[1:gm], w, *xm.shape[gm + 1 :]] for w in widths]  # rank i's row shape
    if wire is not None or grad_wire is not None:  # as rows of the last dim, which every rank's share
        last = xm.shape[-1]
        recv = [mine * prod(r[:-1]) for r in rows_of]
        got = all_to_all_rows_wire_p(
            xm.reshape(-1, last), recv, [p * prod(xm.shape[1:-1]) for p in pieces], g.name, wire, grad_wire
        )
    else:  # flat, each piece as its elements
        row = prod(xm.shape[1:])  # elements per row
        recv = [mine * prod(r) for r in rows_of]
        got = _prims.all_to_all_p(xm.reshape(-1), recv, [p * row for p in pieces], g.name)
    blocks = [b.view(mine, *r) for b, r in zip(torch.split(got, recv), rows_of, strict=True)]
    return torch.cat(blocks, gm).movedim(0, s).contiguous()


def _static_equal(sizes: Sequence[IntLike]) -> bool:
    """All equal, known without a guard (SymInts that may differ take the general path).

    Not ``len(set(sizes))``: under dynamo a SymInt passes ``isinstance(n, int)``, and
    hashing it into a set guards on its value (a data-dependent error when unbacked).
    """
    return all(statically_known_true(n == sizes[0]) for n in sizes)


def _check_perm(opname: str, perm: object, size: int) -> list[tuple[int, int]]:
    if not isinstance(perm, (list, tuple)):
        raise TypeError(f"{opname}: `perm` must be a list of (src, dst) pairs, got {type(perm).__name__}")
    pairs = []
    for p in perm:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ValueError(f"{opname}: `perm` entries must be (src, dst) pairs, got {p!r}")
        pairs.append((check_rank(opname, "perm", p[0], size), check_rank(opname, "perm", p[1], size)))
    srcs, dsts = [p[0] for p in pairs], [p[1] for p in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"{opname}: `perm`={perm!r} sends from or to some rank twice")
    return pairs


def _ppermute_dtensor(ax: MeshAxis, perm: Sequence[tuple[int, int]]) -> Tensor:
    """``Shard(d) -> Shard(d)``: whole shards move, so they must be equal."""
    p = ax.placement
    if not is_placement(p, Shard):
        raise ax.refuse("Shard(d) with equal shards (ppermute moves whole shards between ranks)")
    ax.expect_unsharded_elsewhere(p.dim, "the Shard dim")
    n = ax.x.shape[p.dim]
    check_equal(
        n % ax.world,
        0,
        f"{ax.opname}: shards of unequal length",
        lambda: str(
            ax.refuse(
                f"Shard({p.dim}) with equal shards, and x.shape[{p.dim}]={n} does not divide by {ax.world}"
            )
        ),
    )
    return ax.wrap(ppermute(ax.local(p.dim), perm, group=ax.group), p)


def _perm_agrees(opname: str, rows: list[list[int]]) -> None:
    # the tail holds every rank's destination, -1 for none: shown as (src, dst) pairs
    pairs = lambda t: [(i, d) for i, d in enumerate(t) if d >= 0]  # noqa: E731
    same_tails(opname, rows, "ranks disagree on `perm` ({detail})", show=pairs)


@entry(
    "ppermute",
    EVEN,
    header=Header(reads=NDIM_ONLY, checks=(_perm_agrees,), check_only=True),
    collectives=_A2A,
    placements=("Shard(d), equal shards", "Shard(d)"),
    dtensor=_ppermute_dtensor,
)
def ppermute(x: Tensor, perm: Sequence[tuple[int, int]], *, group: GroupLike = None) -> Tensor:
    """Send `x` along the (src, dst) pairs of `perm` (JAX ``ppermute``).

    Args:
        x: the same shape and dtype on every rank.
        perm: (src, dst) rank pairs; no rank appears twice as a source or twice as a
            destination. A ring shift on world w is ``[(i, (i + 1) % w) for i in range(w)]``.
        group: the communicator.

    Returns:
        A new tensor of ``x.shape``: what rank ``src`` sent, where ``(src, rank)`` is in
        `perm`; zeros on ranks that receive nothing.

    Backward: ``ppermute`` of the gradient with the inverse permutation (every pair
    reversed); ranks that sent nothing get a zero gradient.

    DTensor `x`: ``Shard(d)`` with equal shards, kept (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [1., 1.]        rank 1: x = [2., 2.]
        ppermute(x, [(0, 1)])         # rank 0: [0., 0.]      rank 1: [1., 1.]
        ppermute(x, [(0, 1), (1, 0)]) # rank 0: [2., 2.]      rank 1: [1., 1.]
    """
    g = cast(Group, group)
    pairs = _check_perm("funcoll.ppermute", perm, g.size)
    dsts = [-1] * g.size  # the destination of every rank, -1 for none: what the check compares
    for src_rank, dst_rank in pairs:
        dsts[src_rank] = dst_rank
    x = check_agreement("ppermute", x, g, sizes=dsts)
    if g.is_single:
        return fresh(x) if pairs else torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    dst = {s: d for s, d in pairs}.get(g.rank)
    src = {d: s for s, d in pairs}.get(g.rank)
    flat = wire(x).reshape(-1)
    n = flat.shape[0]
    # A rank that receives nothing sends x to itself and zeroes what comes back, so
    # that its backward all_to_all still takes the incoming gradient as input. With
    # an empty, gradient-independent input there, AOTAutograd's partitioner moved
    # that rank's backward collective into its forward graph, out of step with the
    # other ranks (a hang under torch.compile).
    to_self = src is None
    send = [n if j == dst or (to_self and j == g.rank) else 0 for j in range(g.size)]
    recv = [n if i == src or (to_self and i == g.rank) else 0 for i in range(g.size)]
    payload = [flat] * ((dst is not None) + to_self)
    got = _prims.all_to_all_p(torch.cat(payload) if payload else flat[:0], recv, send, g.name)
    if to_self:  # zeros, NaN-safe, and still tied to the incoming gradient in the backward
        got = got.masked_fill(torch.ones((), dtype=torch.bool, device=got.device), 0)
    return unwire(got.view(x.shape), x.dtype)


def _broadcast_dtensor(ax: MeshAxis, src: int) -> Tensor:
    """``Replicate() -> Replicate()``; the gradient of the one value passes through."""
    check_rank(ax.opname, "src", src, ax.world)
    ax.expect(Replicate(), "Replicate()")
    local = ax.local()
    if ax.world == 1:
        return ax.wrap(fresh(local), Replicate())
    y = unwire(_prims.replicate_p(wire(local), None, src, ax.name, ax.world), local.dtype)
    return ax.wrap(y, Replicate())


@entry(
    "broadcast",
    EVEN,
    header=Header(args=(Arg("src"), None), reads=NDIM_ONLY, check_only=True),
    collectives=fixed({BC: 1}, {AR: 1}),
    placements=("Replicate()", "Replicate()"),
    dtensor=_broadcast_dtensor,
)
def broadcast(x: Tensor, src: int = 0, *, group: GroupLike = None) -> Tensor:
    """Every rank gets rank `src`'s `x`.

    Args:
        x: the same shape and dtype on every rank; only rank `src`'s values are used.
        src: the rank (in `group`) whose tensor is sent.
        group: the communicator.

    Returns:
        A new tensor of ``x.shape`` holding `src`'s values.

    Backward: the gradients of all ranks are summed onto `src`; the other ranks'
    inputs get zeros (their values were never used).

    DTensor `x`: ``Replicate() -> Replicate()``, the gradient passed through
    (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [1., 2.]        rank 1: x = [0., 0.]
        broadcast(x, src=0)           # both: [1., 2.]
    """
    g = cast(Group, group)
    check_rank("funcoll.broadcast", "src", src, g.size)
    x = check_agreement("broadcast", x, g, args=(src, 0))
    if g.is_single:
        return fresh(x)
    return unwire(_prims.broadcast_p(wire(x), src, g.name, g.size, g.rank), x.dtype)


@entry(
    "reduce",
    EVEN,
    header=Header(args=(REDUCE_OP, DST), reads=NDIM_ONLY, check_only=True),
    collectives=fixed({AR: 1}, {BC: 1}),
    refuse=Refusal("its result is on one rank", "funcoll.all_reduce(x)"),
)
def reduce(x: Tensor, dst: int, op: str = "sum", *, group: GroupLike = None) -> Tensor:
    """Reduce `x` over the ranks of `group` onto rank `dst` (``torch.distributed.reduce``, as a function).

    Args:
        x: the same shape and dtype on every rank.
        dst: the rank (in `group`) that gets the reduction.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"product"``, as in
            :func:`all_reduce`.
        group: the communicator.

    Returns:
        A new tensor of ``x.shape`` and dtype: on `dst` the reduction of every
        rank's `x`, on the other ranks zeros. Every rank holds a result, so every
        rank can add it to its loss and join the backward.

    Backward (``sum``): the broadcast of `dst`'s gradient: every rank's `x` gets
    the gradient that `dst`'s result received (the other ranks' results are
    constant zeros). ``avg`` divides by world; the other ops have no gradient.
    This is :func:`broadcast`'s adjoint, and :func:`broadcast`'s backward is this
    op.

    Cost: one ``all_reduce`` (c10d's functional collectives have no reduce); the
    ranks other than `dst` drop its result, and in eager code wait for it when
    they drop it.

    A DTensor `x` is refused: a result held on one rank has no placement
    (docs/dtensor.md); ``all_reduce`` takes ``Partial(op)``.

    Example (2 ranks)::

        # rank 0: x = [1., 2.]        rank 1: x = [3., 4.]
        reduce(x, dst=1)              # rank 0: [0., 0.]   rank 1: [4., 6.]
        reduce(x, 0, op="max")        # rank 0: [3., 4.]   rank 1: [0., 0.]
    """
    opname, g = "funcoll.reduce", cast(Group, group)
    reduce_op = check_reduce_op(opname, op, x)
    check_rank(opname, "dst", dst, g.size)
    x = check_agreement("reduce", x, g, args=(REDUCE_OPS.index(reduce_op), dst))
    if g.is_single:
        return fresh(x)
    wop = wire_op(reduce_op, x.dtype)
    return unwire(_prims.reduce_p(wire(x), wop, dst, g.name, g.size, g.rank), x.dtype)
