"""Ragged data into and out of DTensor: :func:`from_ragged` and its inverse :func:`to_ragged`.

A DTensor shards a dim as ``torch.chunk`` does, so per-rank batches of arbitrary
lengths (variable-length sequences, the tokens a rank kept) have no DTensor form.
``from_ragged`` lays them out in DTensor's chunk layout, keeping the global row
order (rank 0's rows first): every row keeps its global index, and only the rows
whose owner changes travel, in one ``all_to_all_single``. ``to_ragged`` moves them
back to any per-rank lengths. Each is the other's backward.

Example (2 ranks, 3 + 1 rows, chunk layout 2 + 2)::

    rank 0 holds rows [a, b, c], rank 1 holds [d]
    from_ragged:  rank 0 keeps [a, b], sends [c] to rank 1, which then holds [c, d]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .._base._checks import IntLike, check_dim, check_equal, check_total, fresh
from .._base._dtensor import MeshAxis, chunk_sizes, contiguous_strides, is_placement, moves, show
from .._base._group import Group, mesh_dim_index, resolve_group
from .._collective import _prims
from .._collective._header import (
    NDIM_ONLY,
    SIZE,
    Header,
    Reader,
    check_agreement,
    check_same_sizes,
    exchange,
    host_sizes,
)
from .._collective._rows import from_rows, to_rows
from ._entry import Refusal, entry
from ._spec import A2A, DTENSOR, HEADER, fixed, plus

__all__ = ["from_ragged", "to_ragged"]

MeshLike = DeviceMesh | tuple[DeviceMesh, int | str]


def _move(x: Tensor, dim: int, send: list[IntLike], recv: list[IntLike], g: Group) -> Tensor:
    return from_rows(_prims.all_to_all_p(to_rows(x, dim), recv, send, g.name), x.dtype, dim)


def _given_sizes(
    opname: str, x: Tensor, d: int, sizes: Sequence[int] | Tensor, g: Group
) -> tuple[Tensor, list[IntLike]]:
    """from_ragged's `sizes`: world host ints whose entry for this rank is its x.shape[d], and `x` to send.

    `x` is the one :func:`check_agreement` returns: under checks, in a compiled
    graph, one that no pass sends before the check.
    """
    sizes = host_sizes(opname, "sizes", sizes, g.size)
    n, mine = x.shape[d], sizes[g.rank]
    check_equal(
        mine,
        n,
        f"{opname}: `sizes`[{g.rank}] is not this rank's x.shape[{d}]",
        lambda: f"{opname}: `sizes`={list(sizes)} says rank {g.rank} holds {mine}, but its x.shape[{d}]={n}",
    )
    x = check_agreement("from_ragged", x, g, d, sizes=sizes)
    return x, list(sizes)


def _mesh_dim(opname: str, group: object) -> tuple[DeviceMesh, int]:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{opname}: `group` is a {group.ndim}-D DeviceMesh; pass (mesh, mesh_dim) to pick the mesh "
                f"dim whose ranks hold the ragged pieces (mesh dims: {group.mesh_dim_names})"
            )
        return group, 0
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0], mesh_dim_index(opname, group[0], group[1])
    raise TypeError(
        f"{opname}: `group` must be a DeviceMesh or (DeviceMesh, mesh_dim): the result is a DTensor on "
        f"that mesh; got {type(group).__name__}"
    )


def _placements(
    opname: str, mesh: DeviceMesh, m: int, dim: int, placements: Sequence[Placement] | None
) -> list[Placement]:
    if placements is None:
        out: list[Placement] = [Replicate()] * mesh.ndim
        out[m] = Shard(dim)
        return out
    out = list(placements)
    if len(out) != mesh.ndim:
        raise ValueError(f"{opname}: `placements` has {len(out)} entries for a {mesh.ndim}-D mesh")
    if not (is_placement(out[m], Shard) and out[m].dim == dim):
        raise ValueError(
            f"{opname}: `placements`[{m}] is {show(out[m])}, but the ragged pieces become Shard({dim}) on "
            f"mesh dim {m} (`dim`={dim})"
        )
    for i, p in enumerate(out):
        if i != m and isinstance(p, Shard) and p.dim == dim:
            raise ValueError(
                f"{opname}: `placements`[{i}]={show(p)} shards the ragged dim {dim} on a second mesh dim; "
                f"only mesh dim {m} may shard it"
            )
    return out


def _refuse_a_dtensor(opname: str, arg: str, x: object) -> None:
    raise TypeError(f"{opname}: `{arg}` is a DTensor already; from_ragged takes each rank's plain piece")


def _chunk_moves(rows: list[list[int]], rank: int) -> list[int]:
    """from_ragged's host ints: the sizes, their sum, then this rank's send and receive splits."""
    sizes = [r[SIZE] for r in rows]
    send, recv = moves(sizes, chunk_sizes(sum(sizes), len(rows)), rank)
    return [*sizes, sum(sizes), *send, *recv]


@entry(
    "from_ragged",
    DTENSOR,
    header=Header(reads=Reader(_chunk_moves, lambda w: 3 * w + 1), checks=(check_same_sizes,)),
    # the sizes, then the rows that move
    collectives=fixed(plus(HEADER, {A2A: 1}), {A2A: 1}),
    placements=("a plain ragged piece", "Shard(dim)"),
    refuse=Refusal(raises=_refuse_a_dtensor),
    resolve=False,  # `group` is a mesh dim, read with the placements
)
def from_ragged(
    x: Tensor,
    dim: int = 0,
    *,
    group: MeshLike,
    placements: Sequence[Placement] | None = None,
    sizes: Sequence[int] | Tensor | None = None,
) -> tuple[DTensor, list[IntLike]]:
    """Turn every rank's ragged piece into a ``Shard(dim)`` DTensor in DTensor's own layout.

    Ragged data model: along `dim` rank i holds ``sizes[i]`` rows (any ``>= 0``),
    the other dims and the dtype agree; the global tensor is the pieces
    concatenated in rank order. The result is that global tensor sharded as
    ``torch.chunk`` shards it (``ceil(n / world)`` rows per rank until they run
    out), the rows in the same global order. Only the rows that change owner
    move: one small all_gather of the sizes, then one ``all_to_all_single``.

    Args:
        x: this rank's piece, a plain tensor.
        dim: the ragged dim.
        group: the mesh dim the pieces are spread over: a 1-D ``DeviceMesh`` or
            ``(mesh, mesh_dim)`` (the dim as an int or a name).
        placements: the result's placement on every mesh dim, ``Shard(dim)`` on the
            ragged one; None puts ``Replicate()`` on the others. A ``Shard(k)`` on
            another mesh dim scales dim k's global length by that dim's size, as
            ``DTensor.from_local`` does. Every group along the other mesh dims must
            hold the same total along `dim`.
        sizes: every rank's length along `dim` (world ints, the same on every rank),
            when the caller knows them (a data loader that saw every rank's batch):
            nothing is exchanged, and in a compiled graph the global shape is made
            of these ints (or the SymInts they are) rather than of unbacked sizes
            read from an exchange. None: funcoll exchanges them.

    Returns:
        ``(y, sizes)``: `y` a DTensor of global shape ``x.shape`` with
        ``shape[dim] = sum(sizes)``; `sizes` every rank's length (host ints;
        unbacked SymInts in a compiled graph), what :func:`to_ragged` takes to
        give the pieces back.

    Backward: :func:`to_ragged` of the gradient to `sizes`: the rows go back to
    the ranks they came from.

    In the example `mesh` is a 1-D DeviceMesh of both ranks; `y` is ``Shard(0)`` of
    ``[[1], [2], [3], [4]]``, of which each rank's local shard is shown.

    Example (2 ranks)::

        # rank 0: x = [[1], [2], [3]]    rank 1: x = [[4]]
        y, sizes = from_ragged(x, group=mesh)
        # rank 0: y = [[1], [2]], sizes = [3, 1]    rank 1: y = [[3], [4]], sizes = [3, 1]
        to_ragged(y, sizes)
        # rank 0: [[1], [2], [3]]    rank 1: [[4]]
    """
    opname = "funcoll.from_ragged"
    d = check_dim(opname, x, dim)
    mesh, m = _mesh_dim(opname, group)
    places = _placements(opname, mesh, m, d, placements)
    g = resolve_group(opname, (mesh, m))
    if sizes is not None:
        x, sizes = _given_sizes(opname, x, d, sizes, g)
        total = sum(sizes)
        send, recv = moves(sizes, chunk_sizes(total, g.size), g.rank)
    elif g.is_single:
        sizes, total, send, recv = [x.shape[d]], x.shape[d], [x.shape[d]], [x.shape[d]]
    else:
        # The host computes every split of the move, so that in a compiled graph each
        # is an unbacked size of its own (not a nest of min/max over the exchanged
        # sizes, which DTensor's shape code cannot reason about).
        _, ints = exchange("from_ragged", x, d, g)
        w = g.size
        sizes, total, send, recv = ints[:w], ints[w], ints[w + 1 : 2 * w + 1], ints[2 * w + 1 :]
        torch._check(sum(send) == x.shape[d])
    local = fresh(x) if g.is_single else _move(x, d, send, recv, g)
    shape = list(x.shape)
    shape[d] = total
    for i, p in enumerate(places):
        if i != m and isinstance(p, Shard):
            shape[p.dim] = shape[p.dim] * mesh.size(i)
    y = DTensor.from_local(
        local, mesh, places, run_check=False, shape=torch.Size(shape), stride=contiguous_strides(shape)
    )
    return y, sizes


def _to_ragged_dtensor(ax: MeshAxis, sizes: Sequence[int] | Tensor) -> Tensor:
    """``Shard(d)`` -> this rank's ``sizes[rank]`` rows, a plain tensor."""
    opname = ax.opname
    p = ax.placement
    if not is_placement(p, Shard):
        raise ax.refuse("Shard(d), the dim whose rows are handed out")
    d = p.dim
    ax.expect_unsharded_elsewhere(d, "the Shard dim")
    sz = host_sizes(opname, "sizes", sizes, ax.world)
    check_total(opname, "sizes", sz, ax.x.shape[d], f"x.shape[{d}]")
    local = ax.local(d)
    g = Group(ax.name, ax.world, ax.rank)
    local = check_agreement("to_ragged", local, g, d, sizes=sz)
    if g.is_single:
        return fresh(local)
    send, recv = moves(ax.sizes(d), sz, g.rank)
    return _move(local, d, send, recv, g)


@entry(
    "to_ragged",
    DTENSOR,
    header=Header(reads=NDIM_ONLY, varying_dim="the Shard dim", checks=(check_same_sizes,), check_only=True),
    collectives=fixed({A2A: 1}, {A2A: 1}),
    placements=("Shard(d)", "a plain ragged piece"),
    dtensor=_to_ragged_dtensor,
    resolve=False,  # a plain `x` is refused in the body
)
def to_ragged(x: DTensor, sizes: Sequence[int] | Tensor, *, group: MeshLike | None = None) -> Tensor:
    """Give every rank ``sizes[rank]`` rows of a ``Shard(d)`` DTensor, in global order: from_ragged's inverse.

    Args:
        x: a DTensor sharded ``Shard(d)`` on the mesh dim `group` names (the only
            one of a 1-D mesh when None); d is the dim the rows are counted along.
        sizes: world ints (a list, or an int tensor), the same on every rank,
            summing to ``x.shape[d]``: rank i gets global rows
            ``[sizes[0] + ... + sizes[i-1], ... + sizes[i])``. From a tensor on a
            GPU, reading them is a device-to-host sync; pass the list
            :func:`from_ragged` returned to avoid it.
        group: the mesh dim, as for every op (``(mesh, mesh_dim)``).

    Returns:
        This rank's rows, a plain tensor of ``x.shape`` with ``shape[d] = sizes[rank]``.

    Backward: :func:`from_ragged` of the gradient: the rows go back to their
    place in DTensor's layout.

    In the example `mesh` is a 1-D DeviceMesh of both ranks; `y` is ``Shard(0)`` of
    ``[[1], [2], [3], [4]]``.

    Example (2 ranks)::

        # rank 0: x = [[1], [2], [3]]    rank 1: x = [[4]]
        y, sizes = from_ragged(x, group=mesh)
        to_ragged(y, [1, 3])
        # rank 0: [[1]]    rank 1: [[2], [3], [4]]
    """
    opname = "funcoll.to_ragged"
    raise TypeError(f"{opname}: `x` must be a DTensor (from funcoll.from_ragged or any sharded op)")
