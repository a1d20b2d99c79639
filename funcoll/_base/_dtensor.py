"""DTensor in, DTensor out: the placement each op takes and gives on one mesh dim.

A ``DTensor`` names its mesh; a funcoll op acts on one dim of that mesh: the one
`group` names (``(mesh, mesh_dim)``, a 1-D submesh, or the ProcessGroup or group
name of one of the mesh's dims), or the only dim of a 1-D mesh when `group` is
None. The op runs on the local shard, leaves the other mesh dims' placements as
they are, and returns a DTensor on the same mesh with the same global shape,
whose placement on the acted dim is what the collective makes of the data:

=================================  ======================  ======================
op                                 takes (on the mesh dim)  gives
=================================  ======================  ======================
all_gather, gather,                ``Shard(dim)``          ``Replicate()``
all_gather_ragged
reduce_scatter                     ``Partial(op)``         ``Shard(dim)``
all_reduce                         ``Partial(op)``         ``Replicate()``
all_to_all                         ``Shard(gather_dim)``   ``Shard(scatter_dim)``
broadcast                          ``Replicate()``         ``Replicate()``
ppermute                           ``Shard(d)``, even      ``Shard(d)``
split_forward_gather_backward      ``Replicate()``         ``Shard(dim)``
gather_forward_split_backward      ``Shard(dim)``          ``Replicate()``
=================================  ======================  ======================

Any other placement there is a ``ValueError`` naming the op, the mesh dim and the
placement, raised before communicating. Ops whose result no placement describes
(a list per rank, a padded buffer, rows sent to arbitrary ranks, a stack of the
ranks' shards) refuse a DTensor and say to pass ``x.to_local()``.

Uneven shards: DTensor lays a dim of length n over w ranks as ``torch.chunk``
does: ``ceil(n / w)`` rows per rank until they run out, so 7 rows over 4 ranks are
2, 2, 2, 1 and 5 rows are 2, 2, 1, 0 (:func:`chunk_sizes`). Every rank knows
these lengths from the global shape, so nothing is exchanged for them.

Gradients follow DTensor: a DTensor's gradient is the gradient of the one global
tensor it stands for. A ``Replicate()`` result is one value held on every rank,
so its gradient is not summed over ranks: all_gather's backward keeps this
rank's piece of the gradient (no communication), and the backward of all_reduce
(``Partial`` -> ``Replicate``) and broadcast passes the gradient through. On
plain tensors funcoll keeps JAX's convention, where each rank's loss is its own
and they add up (docs/dtensor.md, Gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ._checks import IntLike, check_dim, check_equal
from ._group import GroupLike, resolve_group
from ._sym import max_of, min_of

__all__ = [
    "MeshAxis",
    "chunk_sizes",
    "dtensor_input",
    "is_dtensor",
    "is_placement",
    "moves",
    "refuse_dtensor",
]


def is_dtensor(x: object) -> bool:
    return isinstance(x, DTensor)


def chunk_sizes(n: IntLike, world: int) -> list[IntLike]:
    """Every rank's length when DTensor shards a dim of length `n` over `world` ranks.

    ``torch.chunk`` layout: ``ceil(n / world)`` each until the rows run out.
    Branch-free, so a SymInt `n` adds no guard.
    Example: ``chunk_sizes(7, 4) == [2, 2, 2, 1]``, ``chunk_sizes(5, 4) == [2, 2, 1, 0]``.
    """
    step = (n + world - 1) // world
    return [min_of(max_of(n - i * step, 0), step) for i in range(world)]


def _overlap(a0: IntLike, a1: IntLike, b0: IntLike, b1: IntLike) -> IntLike:
    """The length of ``[a0, a1) & [b0, b1)``."""
    return max_of(min_of(a1, b1) - max_of(a0, b0), 0)


def _offsets(sizes: Sequence[IntLike]) -> list[IntLike]:
    out: list[IntLike] = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def moves(src: Sequence[IntLike], dst: Sequence[IntLike], rank: int) -> tuple[list[IntLike], list[IntLike]]:
    """(send, recv) of `rank` when global rows laid out as `src` lengths per rank move to `dst`.

    Row k sits on the rank whose interval holds k in either layout; rank i sends
    rank j the overlap of its `src` interval with j's `dst` interval. Example: src
    [3, 1], dst [2, 2]: rank 0 sends [2, 1], receives [2, 0]; rank 1 sends [0, 1],
    receives [1, 1].
    """
    so, do = _offsets(src), _offsets(dst)
    send = [_overlap(so[rank], so[rank + 1], do[j], do[j + 1]) for j in range(len(dst))]
    recv = [_overlap(so[i], so[i + 1], do[rank], do[rank + 1]) for i in range(len(src))]
    return send, recv


def contiguous_strides(shape: Sequence[IntLike]) -> tuple[IntLike, ...]:
    strides: list[IntLike] = []
    step: IntLike = 1
    for s in reversed(shape):
        strides.append(step)
        step = step * s
    return tuple(reversed(strides))


def is_placement(p: object, cls: type[Placement]) -> bool:
    """`p` is a `cls` itself, not a subclass of it (``_StridedShard`` is a ``Shard`` funcoll does not take).

    By the class's name, not ``type(p) is cls``: dynamo before torch 2.13 gives a
    placement made inside the compiled region a type that is not `cls` (on 2.11 and 2.12,
    ``type(Shard(1)) is Shard`` is False there, and its name is still "Shard").
    """
    return isinstance(p, cls) and type(p).__name__ == cls.__name__


def show(p: Placement) -> str:
    """A placement as users write it: ``Shard(1)``, ``Partial('sum')``, ``Replicate()``."""
    if is_placement(p, Shard):
        return f"Shard({p.dim})"
    if is_placement(p, Partial):
        return f"Partial({p.reduce_op!r})"
    if is_placement(p, Replicate):
        return "Replicate()"
    return repr(p)


@dataclass(frozen=True)
class MeshAxis:
    """A DTensor argument and the mesh dim an op acts on."""

    opname: str
    x: DTensor
    mesh_dim: int
    name: str  # the c10d group name of the mesh dim
    world: int
    rank: int

    @property
    def mesh(self) -> DeviceMesh:
        return self.x.device_mesh

    @property
    def group(self) -> tuple[DeviceMesh, int]:
        return (self.mesh, self.mesh_dim)

    @property
    def placement(self) -> Placement:
        return self.x.placements[self.mesh_dim]

    def sizes(self, dim: int) -> list[IntLike]:
        """Every rank's length along tensor dim `dim` when this mesh dim shards it."""
        return chunk_sizes(self.x.shape[dim], self.world)

    def where(self) -> str:
        names = self.mesh.mesh_dim_names
        named = f" ({names[self.mesh_dim]!r})" if names else ""
        return f"mesh dim {self.mesh_dim}{named}"

    def refuse(self, wants: str, hint: str = "") -> ValueError:
        return ValueError(
            f"{self.opname}: `x` is {show(self.placement)} on {self.where()}, but the op takes {wants} there"
            + (f"; {hint}" if hint else "")
        )

    def dim(self, dim: object, arg: str = "dim") -> int:
        return check_dim(self.opname, self.x, dim, arg)

    def expect_shard(self, dim: int, arg: str = "dim") -> None:
        """`x` is ``Shard(dim)`` here, and no other mesh dim shards that tensor dim."""
        if not (is_placement(self.placement, Shard) and self.placement.dim == dim):
            raise self.refuse(f"Shard({dim}) (`{arg}`={dim})")
        self.expect_unsharded_elsewhere(dim, arg)

    def expect_unsharded_elsewhere(self, dim: int, arg: str) -> None:
        for i, p in enumerate(self.x.placements):
            if i != self.mesh_dim and isinstance(p, Shard) and p.dim == dim:
                raise ValueError(
                    f"{self.opname}: `x` is also sharded along tensor dim {dim} (`{arg}`) on mesh dim {i} "
                    f"({show(p)}); funcoll acts on a tensor dim that one mesh dim shards. "
                    f"Redistribute that mesh dim first"
                )

    def expect(self, placement: Placement, wants: str) -> None:
        if self.placement != placement or not is_placement(self.placement, type(placement)):
            raise self.refuse(wants)

    def expect_partial(self, reduce_op: str) -> None:
        p = self.placement
        if not is_placement(p, Partial):
            raise self.refuse(f"Partial({reduce_op!r}) (`op`={reduce_op!r})")
        if p.reduce_op != reduce_op:
            raise ValueError(
                f"{self.opname}: `x` is {show(p)} on {self.where()} but `op`={reduce_op!r}; "
                f"pass op={p.reduce_op!r}"
            )

    def local(self, shard_dim: int | None = None) -> Tensor:
        """The local shard (differentiable); when `shard_dim` is sharded here, its length is checked."""
        local = self.x.to_local()
        if shard_dim is not None:
            want, have = self.sizes(shard_dim)[self.rank], local.shape[shard_dim]
            check_equal(
                want,
                have,
                f"{self.opname}: rank {self.rank}'s local shard is not torch.chunk's piece of dim {shard_dim}",
                lambda: (
                    f"{self.opname}: `x` is {show(self.placement)} of a global shape {tuple(self.x.shape)}, "
                    f"so rank {self.rank} of {self.where()} should hold {want} along dim {shard_dim}, but it holds "
                    f"{have} (a DTensor built from uneven local shards)"
                ),
            )
        return local

    def wrap(self, local: Tensor, placement: Placement) -> DTensor:
        """`local` as this rank's shard of a DTensor of x's global shape, `placement` on the mesh dim."""
        placements = list(self.x.placements)
        placements[self.mesh_dim] = placement
        shape = self.x.shape
        return DTensor.from_local(
            local.contiguous(),
            self.mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=contiguous_strides(shape),
        )


def mesh_dim_of(opname: str, mesh: DeviceMesh, group: GroupLike) -> int:
    """The dim of `mesh` that `group` names (any group form), or the only one when `group` is None."""
    if group is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"{opname}: `x` is a DTensor on a {mesh.ndim}-D mesh; pass group=(mesh, mesh_dim) to pick "
                f"the mesh dim to act on (mesh dims: {mesh.mesh_dim_names})"
            )
        return 0
    name = resolve_group(opname, group).name
    for i in range(mesh.ndim):
        if mesh.get_group(i).group_name == name:
            return i
    raise ValueError(
        f"{opname}: `group`={group!r} is not a dim of the DTensor's mesh {mesh!r}; pass group=(mesh, mesh_dim) "
        f"with the DTensor's own mesh"
    )


def dtensor_input(opname: str, x: object, group: GroupLike) -> MeshAxis | None:
    """A :class:`MeshAxis` when `x` is a DTensor, None for a plain tensor."""
    if not is_dtensor(x):
        return None
    mesh = x.device_mesh  # type: ignore[attr-defined]
    m = mesh_dim_of(opname, mesh, group)
    g = resolve_group(opname, (mesh, m))
    return MeshAxis(opname, x, m, g.name, g.size, g.rank)  # type: ignore[arg-type]


def refuse_dtensor(opname: str, x: object, why: str, instead: str = "", arg: str = "x") -> None:
    """Ops whose result no DTensor placement describes take plain tensors only."""
    if is_dtensor(x):
        raise ValueError(
            f"{opname}: `{arg}` is a DTensor, but {why}, which no DTensor placement describes; pass "
            f"{arg}.to_local() for the per-rank op on plain tensors"
            + (f", or use {instead}" if instead else "")
        )
