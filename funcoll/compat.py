"""Drop-in replacements for widely copied collective helpers, with their exact signatures.

Switch by changing an import; the results are the same, with adjoint gradients
and ragged sizes without padding on the wire. Every drop-in compiles with
``fullgraph=True`` (``compile_tests/``). What the originals do there, measured on
torch 2.13 with gloo:

- ``gather``, ``all_gather``, ``all_gather_nd``: do not compile (the sizes reach
  the host through a sync per rank, and in-place ``dist.all_gather`` fills Python
  lists).
- OpenSora's ``all_to_all`` and the split/gather pair: do not compile (an
  ``autograd.Function`` that stores the ProcessGroup and calls in-place
  collectives into lists); they also need even splits, which the drop-ins do not.
- ``all_gather_into_tensor``: the drop-in keeps torch's signature and writes into
  ``output_tensor`` as torch's does, with the functional all_gather underneath
  and its gradient.

Projects whose even all_to_all helpers already compile (DeepSpeed's Ulysses,
yunchang, Megatron's mappings) gain the uneven cases (``gather_sizes``, ragged
sequence shards) and one group canonicaliser, not compilation.

``all_gather_nd`` returns the per-rank list, like the recipe it replaces. A
widely copied variant of the same name returns ``torch.cat`` of that list: that
is :func:`funcoll.gather` (or ``torch.cat(all_gather_nd(t))``).

============================================  =========================================
original                                      here
============================================  =========================================
ragged ``gather(tensor, dim=0, dst=None)``    :func:`gather` (funcoll.gather)
``all_gather(q, ws, device)`` (1-D, list)     :func:`all_gather` (all_gather_list)
``all_gather_nd(tensor)``                     :func:`all_gather_nd` (all_gather_list)
OpenSora ``all_to_all(input_, pg, 2, 1)``     :func:`all_to_all`
OpenSora ``split_forward_gather_backward``    :func:`split_forward_gather_backward`
OpenSora ``gather_forward_split_backward``    :func:`gather_forward_split_backward`
torch's in-place ``all_gather_into_tensor``   :func:`all_gather_into_tensor`
============================================  =========================================
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._base._group import GroupLike, resolve_group
from ._collective._faults import public_op
from ._ops import _even, _ragged, _region

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_nd",
    "all_to_all",
    "gather",
    "gather_forward_split_backward",
    "split_forward_gather_backward",
]


@public_op("compat.gather")
def gather(tensor: Tensor, dim: int = 0, dst: int | None = None) -> Tensor | None:
    """Ragged gather along `dim` to every rank (``dst=None``) or to rank `dst` alone.

    As the original: without an initialized process group, or on one rank, returns
    `tensor` itself. Otherwise :func:`funcoll.gather` on the default group: the
    concatenation in rank order, and None on ranks other than `dst`.

    Example (2 ranks)::

        # rank 0: [1, 2, 3]   rank 1: [4]
        gather(t)          # both: [1, 2, 3, 4]
        gather(t, dst=0)   # rank 0: [1, 2, 3, 4]   rank 1: None
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    return _ragged.gather(tensor, dim, dst)


@public_op("compat.all_gather")
def all_gather(q: Tensor, ws: int, device: torch.device | str | None) -> list[Tensor]:
    """Gather tensors of different lengths along dim 0 into a list, one per rank.

    `ws` must be the world size (checked); `device` is accepted for compatibility
    and unused: funcoll keeps the size exchange on ``q.device``.

    Example (2 ranks)::

        # rank 0: q = [1.5, 2.3]   rank 1: q = [5.3]
        all_gather(q, 2, q.device)   # both: [tensor([1.5, 2.3]), tensor([5.3])]
    """
    world = resolve_group("funcoll.compat.all_gather", None).size
    if ws != world:
        raise ValueError(f"funcoll.compat.all_gather: `ws`={ws} but the world size is {world}")
    return _ragged.all_gather_list(q, 0)


@public_op("compat.all_gather_nd")
def all_gather_nd(tensor: Tensor) -> list[Tensor]:
    """Gather tensors of different lengths along dim 0 (any number of other dims) into a list.

    Returns the per-rank list, as the recipe it replaces; for the variant that
    returns the concatenation use :func:`funcoll.gather`.

    Example (2 ranks)::

        # rank 0: t = [[1, 2, 3], [4, 5, 6]]   rank 1: t = [[7, 8, 9]]
        all_gather_nd(t)   # both: [tensor([[1, 2, 3], [4, 5, 6]]), tensor([[7, 8, 9]])]
    """
    return _ragged.all_gather_list(tensor, 0)


@public_op("compat.all_to_all")
def all_to_all(input_: Tensor, process_group: GroupLike, scatter_dim: int = 2, gather_dim: int = 1) -> Tensor:
    """OpenSora's ``all_to_all``: :func:`funcoll.all_to_all` with its argument names."""
    return _even.all_to_all(input_, process_group, scatter_dim, gather_dim)


@public_op("compat.split_forward_gather_backward")
def split_forward_gather_backward(
    input_: Tensor, process_group: GroupLike, dim: int, grad_scale: _region.GradScale = 1.0
) -> Tensor:
    """OpenSora's ``split_forward_gather_backward`` (its default ``grad_scale=1.0`` means no scaling)."""
    return _region.split_forward_gather_backward(input_, process_group, dim, grad_scale)


@public_op("compat.gather_forward_split_backward")
def gather_forward_split_backward(
    input_: Tensor, process_group: GroupLike, dim: int, grad_scale: _region.GradScale = None
) -> Tensor:
    """OpenSora's ``gather_forward_split_backward``."""
    return _region.gather_forward_split_backward(input_, process_group, dim, grad_scale)


class _Completed:
    """What ``async_op=True`` returns: the work already finished (funcoll waits in the op)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@public_op("compat.all_gather_into_tensor")
def all_gather_into_tensor(
    output_tensor: Tensor, input_tensor: Tensor, group: GroupLike = None, async_op: bool = False
) -> _Completed | None:
    """``torch.distributed.all_gather_into_tensor``: gather every rank's input into `output_tensor`.

    `output_tensor` is either the concatenation ``(world * n, ...)`` or the stack
    ``(world, n, ...)``, as torch accepts; it is written in place. Returns None, or
    with ``async_op=True`` an object whose ``wait()`` returns at once (the gather is
    complete when this returns).

    Example (2 ranks)::

        # rank r: inp = [float(r), float(r)]; out = torch.empty(2, 2)
        all_gather_into_tensor(out, inp)   # both: out == [[0., 0.], [1., 1.]]
    """
    opname = "funcoll.compat.all_gather_into_tensor"
    g = resolve_group(opname, group)
    if output_tensor.numel() != g.size * input_tensor.numel():
        raise ValueError(
            f"{opname}: `output_tensor` has {output_tensor.numel()} elements, expected world ({g.size}) "
            f"x input ({input_tensor.numel()})"
        )
    if output_tensor.dtype != input_tensor.dtype:
        raise TypeError(
            f"{opname}: `output_tensor` is {output_tensor.dtype} but `input_tensor` is {input_tensor.dtype}"
        )
    result = _even.all_gather_into_tensor(input_tensor, group=group)
    output_tensor.copy_(result.view(output_tensor.shape))
    return _Completed() if async_op else None
