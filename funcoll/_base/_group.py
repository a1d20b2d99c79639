"""One canonicaliser for the `group=` argument of every funcoll op.

A group can be given as ``None`` (the default group), a ``ProcessGroup``, a 1-D
``DeviceMesh``, a ``(DeviceMesh, mesh_dim)`` pair with the mesh dim as an int or a
name, or a c10d group name string. Every op turns it into a :class:`Group`, which
carries the three facts the ops need: the c10d group name (what the
``_c10d_functional`` ops take), the group size and this process's rank in it.

When ``torch.distributed`` is not initialized, or the group has one rank, ops see
``Group.single()`` and compute the single-rank result locally without
communicating.

Everything here reads Python-level facts about process groups, which dynamo
treats as constants, so resolving a group inside a compiled region adds no graph
break and no guard on tensor data.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Group",
    "GroupLike",
    "axis_index",
    "axis_size",
    "group_of",
    "mesh_dim_index",
    "resolve_group",
    "wire_name",
]


@dataclass(frozen=True)
class Group:
    """A resolved communicator: c10d group name, size and this process's rank."""

    name: str
    size: int
    rank: int

    @staticmethod
    def single() -> Group:
        return Group(name="", size=1, rank=0)

    @property
    def is_single(self) -> bool:
        return self.size == 1


# What every op takes as `group`. A resolved Group passes as it is: the ops' entry
# resolves the group once and hands the Group on (funcoll/_ops/_entry.py).
GroupLike = dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, int | str] | str | Group | None


def _from_process_group(pg: dist.ProcessGroup) -> Group:
    return Group(name=pg.group_name, size=pg.size(), rank=pg.rank())


def _mesh_group(opname: str, mesh: DeviceMesh, mesh_dim: int | str | None) -> dist.ProcessGroup:
    if mesh_dim is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"{opname}: `group` is a {mesh.ndim}-D DeviceMesh; pass `(mesh, mesh_dim)` to pick "
                f"the mesh dim to communicate over (mesh dims: {mesh.mesh_dim_names})"
            )
        return mesh.get_group()
    return mesh.get_group(mesh_dim_index(opname, mesh, mesh_dim))


def mesh_dim_index(opname: str, mesh: DeviceMesh, mesh_dim: object) -> int:
    """The index of the mesh dim `mesh_dim` names (an int, negative allowed, or a name)."""
    if isinstance(mesh_dim, str):
        names = mesh.mesh_dim_names or ()
        if mesh_dim not in names:
            raise ValueError(f"{opname}: `group` names mesh dim {mesh_dim!r}, which is not one of {names}")
        return names.index(mesh_dim)
    if not isinstance(mesh_dim, int) or isinstance(mesh_dim, bool):
        raise TypeError(
            f"{opname}: `group` as (DeviceMesh, mesh_dim) needs an int or str mesh_dim, got "
            f"{type(mesh_dim).__name__}"
        )
    if not -mesh.ndim <= mesh_dim < mesh.ndim:
        raise ValueError(f"{opname}: `group` mesh_dim={mesh_dim} is out of range for a {mesh.ndim}-D mesh")
    return mesh_dim % mesh.ndim


def _is_process_group(group: object) -> bool:
    # One type per isinstance: under dynamo (2.13) a ProcessGroup is an opaque
    # script object, and isinstance against a tuple of types answers False for it.
    return isinstance(group, dist.ProcessGroup)


@torch.compiler.assume_constant_result
def _size_and_rank_of(group_name: str) -> tuple[int, int] | None:
    """(size, rank) of the process group called `group_name`, or None if there is none.

    c10d resolves names in C++, which dynamo cannot trace; marked as a constant
    result, this runs once when a compiled region is traced, and the name (a
    Python string) is guarded on like any constant.
    """
    try:
        pg = dist.distributed_c10d._resolve_process_group(group_name)
    except Exception:  # noqa: BLE001 -- c10d raises RuntimeError/ValueError by version
        return None
    return pg.size(), pg.rank()


class _NoTrace:
    """The key of the collectives traced outside any dynamo frame (``make_fx``)."""


_NO_TRACE = _NoTrace()
# How many collectives each trace (dynamo's TracingContext of one frame) has named.
_NAMED: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


@torch.compiler.assume_constant_result
def wire_name(group_name: str) -> str:
    """The group name the next collective of the graph being traced runs under: one of its own.

    Compilers merge equal nodes, collectives included (AOT autograd's CSE on the
    joint graph): two collectives on one input with equal arguments become one.
    Whether two collectives are equal can differ between ranks: on a rank whose
    tensor is empty by its static shape (a Ulysses rank with no head, a rank
    with no rows to send) the gradients feeding several collectives can all be
    one constant empty tensor, while on the others they differ. One rank would
    then issue fewer collectives than another, and the step would hang.

    So the k-th collective a trace issues on a group runs under the name
    ``f"{group_name}:funcoll{k}"``, which this registers in c10d's group registry
    for the same ``ProcessGroup``: no two collectives of a graph are equal, on any
    rank, and the payload goes in as it is (no copy, no kernel between its
    producer and the collective). It runs at trace time only (a constant of the
    trace: dynamo neither guards on it nor records it), and eager code never
    calls it.

    What it costs: c10d's registry holds one name per collective of the largest
    graph traced, each holding a reference to the group (which
    ``destroy_process_group`` still shuts down). Inductor's bucketing merges only
    collectives with one group name, so it leaves funcoll's apart, and its
    overlap scheduler sees each as a group of its own. A graph compiled before
    ``destroy_process_group()`` cannot run after it (recompile:
    ``torch._dynamo.reset()``), and an exported graph runs only where funcoll
    traced it. Names are counted per dynamo frame, so retracing a frame gives
    the same names, which keeps compiled-code caches hitting.
    """
    trace = torch._guards.TracingContext.try_get()
    key = _NO_TRACE if trace is None else trace
    k = _NAMED.get(key, 0)
    _NAMED[key] = k + 1
    alias = f"{group_name}:funcoll{k}"
    c10d = torch._C._distributed_c10d
    pg = c10d._resolve_process_group(group_name)
    try:
        known = c10d._resolve_process_group(alias)
    except Exception:  # noqa: BLE001 -- c10d raises RuntimeError/ValueError by version
        known = None
    if known is not pg:  # not yet named, or named for a group since destroyed
        if known is not None:
            c10d._unregister_process_group(alias)
        c10d._register_process_group(alias, pg)
    return alias


@torch.compiler.assume_constant_result
def size_of(name: str) -> int:
    """The size of the c10d group called `name` (a constant of a trace)."""
    return torch._C._distributed_c10d._resolve_process_group(name).size()


@torch.compiler.assume_constant_result
def rank_of(name: str) -> int:
    """This process's rank in the c10d group called `name` (a constant of a trace)."""
    return torch._C._distributed_c10d._resolve_process_group(name).rank()


def group_of(name: str) -> str:
    """The group name that `name` stands for: `name`, or the group of a :func:`wire_name`."""
    group, sep, k = name.rpartition(":funcoll")
    return group if sep and k.isdigit() else name


def resolve_group(opname: str, group: GroupLike) -> Group:
    """Canonicalise `group` for the op called `opname` (its public name, for error messages).

    Every form resolves inside a compiled region too, with no graph break: the
    group is a constant of the trace, so the graph holds its name as a string.
    """
    if isinstance(group, Group):
        return group
    if isinstance(group, DeviceMesh):
        return _from_process_group(_mesh_group(opname, group, None))
    if isinstance(group, tuple):
        if len(group) != 2 or not isinstance(group[0], DeviceMesh):
            raise TypeError(f"{opname}: `group` as a tuple must be (DeviceMesh, mesh_dim), got {group!r}")
        return _from_process_group(_mesh_group(opname, group[0], group[1]))
    is_pg = _is_process_group(group)
    if group is not None and not is_pg and not isinstance(group, str):
        if dist.is_available() and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"{opname}: this rank is not a member of `group` (new_group returned "
                f"GroupMember.NON_GROUP_MEMBER here); only the group's ranks may call the op"
            )
        raise TypeError(
            f"{opname}: `group` must be None, a ProcessGroup, a DeviceMesh, (DeviceMesh, mesh_dim) or a "
            f"group name, got {type(group).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        if group is None:
            return Group.single()
        raise ValueError(f"{opname}: `group`={group!r} was given but torch.distributed is not initialized")
    if group is None:
        return _from_process_group(dist.group.WORLD)
    if is_pg:
        return _from_process_group(group)  # type: ignore[arg-type]
    size_rank = _size_and_rank_of(group)
    if size_rank is None:
        raise ValueError(f"{opname}: `group`={group!r} is not the name of a known process group")
    return Group(name=group, size=size_rank[0], rank=size_rank[1])


def axis_index(group: GroupLike = None) -> int:
    """This process's index along the axis that `group` spans (JAX ``axis_index``).

    Returns a Python int: a rank is fixed for the life of a process, so inside a
    compiled region it is a constant of the graph, not a tensor. Without an
    initialized process group it is 0.

    Example: on 2 ranks, ``axis_index()`` is 0 on rank 0 and 1 on rank 1.
    """
    return resolve_group("funcoll.axis_index", group).rank


def axis_size(group: GroupLike = None) -> int:
    """The number of processes along the axis that `group` spans (JAX ``axis_size``).

    A Python int, constant inside compiled regions; 1 without an initialized process
    group.

    Example: on 2 ranks, ``axis_size()`` is 2 on both.
    """
    return resolve_group("funcoll.axis_size", group).size
