"""Argument checks shared by every op: one place, one wording.

Every message starts with the op's public name and names the argument in
backticks, then shows the bad value and what was expected.
"""

from __future__ import annotations

import torch
from torch import Tensor

IntLike = int | torch.SymInt

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
STRATEGIES = ("auto", "pad", "a2a")


def check_tensor(op: str, name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
    return x


def local_input(op: str, x: object, group: object) -> tuple[Tensor, object]:
    """Check `x`; a DTensor becomes its local shard, and its 1-D mesh the default group.

    funcoll ops act on what each rank holds (as JAX's ``shard_map`` bodies do), so a
    DTensor contributes ``x.to_local()``, which is differentiable. With ``group=None``
    the DTensor's mesh is the group when it is 1-D; a 2-D mesh needs an explicit
    ``group=(mesh, mesh_dim)``.
    """
    x = check_tensor(op, "x", x)
    if type(x).__name__ == "DTensor":  # no import of DTensor unless one is passed
        mesh = x.device_mesh
        if group is None:
            if mesh.ndim != 1:
                raise ValueError(
                    f"{op}: `x` is a DTensor on a {mesh.ndim}-D mesh; pass group=(mesh, mesh_dim) "
                    f"to pick the mesh dim to communicate over"
                )
            group = mesh
        x = x.to_local()
    return x, group


def check_dim(op: str, x: Tensor, dim: object, name: str = "dim", extra: int = 0) -> int:
    """Normalise a (possibly negative) tensor dim of `x`; `extra` allows one past the end."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}: `{name}` must be an int, got {type(dim).__name__}")
    ndim = x.dim() + extra
    if ndim == 0:
        raise ValueError(f"{op}: `{name}`={dim} needs a tensor with at least one dim, got a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: `{name}`={dim} is out of range for a {x.dim()}-d tensor of shape {tuple(x.shape)}"
        )
    return dim % ndim


def check_reduce_op(op: str, reduce_op: object) -> str:
    if not isinstance(reduce_op, str) or reduce_op.lower() not in REDUCE_OPS:
        raise ValueError(f"{op}: `op`={reduce_op!r} is not one of {REDUCE_OPS}")
    return reduce_op.lower()


def check_rank(op: str, name: str, value: object, size: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{op}: `{name}` must be an int rank, got {type(value).__name__}")
    if not 0 <= value < size:
        raise ValueError(f"{op}: `{name}`={value} is not a rank of a group of size {size}")
    return value


def tensor_split_sizes(n: IntLike, parts: int) -> list[IntLike]:
    """Sizes of ``torch.tensor_split(t, parts)`` along a dim of length `n`: first ranks get one more.

    Branch-free (``ceil((n - i) / parts)``), so a SymInt `n` adds no guard.
    Example: ``tensor_split_sizes(7, 3) == [3, 2, 2]``.
    """
    return [(n - i + parts - 1) // parts for i in range(parts)]


def is_float(x: Tensor) -> bool:
    return x.dtype.is_floating_point or x.dtype.is_complex


def fresh(x: Tensor) -> Tensor:
    """A new contiguous copy: what an op returns when it has nothing to communicate."""
    return x.clone(memory_format=torch.contiguous_format)


def wire_op(op: str, dtype: torch.dtype) -> str:
    """The reduction to run on the wire: bool travels as uint8, where or is max and and is min."""
    if dtype == torch.bool:
        return {"sum": "max", "product": "min"}.get(op, op)
    return op


def wire(x: Tensor) -> Tensor:
    """The tensor as it travels: bool as uint8 (not every backend carries bool)."""
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def unwire(y: Tensor, dtype: torch.dtype) -> Tensor:
    return y.view(torch.bool) if dtype == torch.bool else y
