"""Ragged collectives with static shapes: the lengths travel as device tensors.

The ragged ops of ``_ragged.py`` give results whose length is the sum of the
ranks' lengths, which they read on the host (one sync per call; unbacked sizes in
a compiled graph). Code that must keep every shape static (CUDA graphs, static
compiled graphs, XLA-style loops) cannot have either. The ops here take the ragged
length as a device tensor beside an input padded to a static bound, and return a
result of static shape with the lengths beside it, again on the device. Nothing is
read on the host, so there is no sync, no unbacked size and no recompile when the
lengths change; the price is that the padding travels on the wire.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import _prims
from ._checks import check_dim, local_input, unwire, wire
from ._group import GroupLike, resolve_group
from ._header import _dtype_code, _shape_columns

__all__ = ["gather_padded"]


def _length_tensor(op: str, length: object, bound: int | torch.SymInt, device: torch.device) -> Tensor:
    """`length` as a 1-element int64 tensor on `device`; a Python int is range-checked here."""
    if isinstance(length, Tensor):
        if length.dtype.is_floating_point or length.dtype.is_complex or length.dtype == torch.bool:
            raise TypeError(
                f"{op}: `length` must be an integer tensor or an int, got a {length.dtype} tensor"
            )
        if length.numel() != 1:
            raise ValueError(
                f"{op}: `length` must hold one value, got a tensor of shape {tuple(length.shape)}"
            )
        # From another device (a CPU scalar for a CUDA x) the copy is queued, not waited for.
        return length.reshape(1).to(device=device, dtype=torch.int64, non_blocking=True)
    if isinstance(length, bool) or not isinstance(length, (int, torch.SymInt)):
        raise TypeError(f"{op}: `length` must be an integer tensor or an int, got {type(length).__name__}")
    if isinstance(length, int) and isinstance(bound, int) and not 0 <= length <= bound:
        raise ValueError(f"{op}: `length`={length} is outside [0, {bound}], the bound x.shape[dim]")
    return torch.full((1,), length, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=256)
def _facts_on(device: torch.device, facts: tuple[int, ...]) -> Tensor:
    """The header's constant part on `device`, copied there once per distinct shape.

    A fresh ``torch.tensor(..., device=cuda)`` per call would copy from the host and
    wait for the device each time, and a copy from the host cannot be captured in a
    CUDA graph; after the first call with a shape, this is a cached tensor, so the
    op issues device work only. The copy itself is queued without waiting.
    """
    return torch.tensor(facts, dtype=torch.int64).to(device, non_blocking=True)


def _pack(blocks: Tensor, sizes: Tensor, bound: int | torch.SymInt) -> Tensor:
    """Move the valid rows of `blocks` (rank i's at ``[i * bound, i * bound + sizes[i])``) to the front.

    Output row k comes from the rank whose rows cover k in the packed order
    (``searchsorted`` over the running sum of `sizes`); rows past ``sum(sizes)``
    are zero. One index_select and one where, so autograd's backward is the
    inverse: the gradient's rows scattered back to the blocks, zeros on padding.
    Static shapes throughout; inductor fuses it into one kernel. In eager code on
    CUDA one Triton kernel does it (and one more its backward): ``_prims.pack_rows``.
    """
    packed = _prims.pack_rows(blocks, sizes, bound, blocks.shape[0])  # CUDA eager: one Triton launch
    if packed is not None:
        return packed
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    k = torch.arange(blocks.shape[0], device=blocks.device)
    owner = torch.searchsorted(ends, k, right=True).clamp(max=sizes.numel() - 1)
    valid = k < ends[-1]
    src = torch.where(valid, owner * bound + (k - starts[owner]), 0)
    rows = blocks.index_select(0, src)
    mask = valid.view(-1, *([1] * (blocks.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def gather_padded(
    x: Tensor, length: Tensor | int, dim: int = 0, *, group: GroupLike = None
) -> tuple[Tensor, Tensor]:
    """Ragged gather with static shapes: `x` padded to a bound, the lengths as a device tensor.

    Ragged data model: along `dim`, every rank's `x` has the same static bound
    ``B = x.shape[dim]``, of which the first ``length`` rows are its data (any
    ``0 <= length <= B``) and the rest are padding, whose values are ignored. The
    global tensor is the concatenation of every rank's data rows in rank order, as
    for :func:`funcoll.gather`. All other dims, the bound, the dtype and the ndim
    agree on every rank.

    Unlike :func:`funcoll.gather`, nothing is read on the host: the result's shape
    depends only on ``x.shape`` and the world size, so the op runs inside CUDA graphs
    and static compiled graphs, and never recompiles when the lengths change. The
    padding travels on the wire (one all_gather of ``x`` and one of a small int64
    header); pass ``length`` on ``x``'s device.

    Args:
        x: this rank's tensor, of shape ``(..., B, ...)`` with the bound at `dim`.
        length: this rank's count of data rows: an int, or an integer tensor of one
            element (on ``x``'s device, or a CPU tensor, copied without a wait).
        dim: the ragged dim (negative counts from the end).
        group: the communicator.

    Returns:
        ``(y, sizes)``. ``y`` has ``x``'s shape with ``world * B`` at `dim`: the
        global tensor in its first ``sum(sizes)`` rows, zeros after them. ``sizes``
        is an int64 tensor of shape ``(world,)`` on ``x``'s device, each rank's
        `length` (so ``torch.cumsum(sizes, 0)`` gives the ends of the ranks' rows,
        as variable-length attention kernels take them).

    Raises:
        ValueError, TypeError: bad arguments, before any communication. An int
        `length` outside ``[0, B]`` is a ValueError. A tensor `length` outside it,
        or ranks whose bound, shape or dtype differ, fail a device-side assert
        (``torch._assert_async``) after the header exchange and before the data
        moves: a RuntimeError on every rank (it does not wait for the device on
        CUDA, so it surfaces asynchronously there).

    Backward: the adjoint. Each rank puts its gradient's rows back in the padded
    layout (rank i's rows at ``[i * B, i * B + sizes[i])``, zeros on padding) and a
    ``reduce_scatter`` (sum) gives rank r the sum over ranks of its rows; the
    gradient of the padding rows of ``x`` is zero.

    Example (2 ranks, B = 3)::

        # rank 0: x = [[1], [2], [0]], length = 2   rank 1: x = [[5], [9], [9]], length = 1
        y, sizes = gather_padded(x, length)
        # both: y = [[1], [2], [5], [0], [0], [0]], sizes = [2, 1]
        # y[: sizes.sum()] is gather's result; rank 1's padding rows [9], [9] never show
    """
    op = "funcoll.gather_padded"
    x, group = local_input(op, x, group)
    d = check_dim(op, x, dim)
    bound = x.shape[d]
    mine = _length_tensor(op, length, bound, x.device)
    g = resolve_group(op, group)
    # The row every rank must agree on (ndim, dtype, dim, full shape), after this rank's length.
    facts = (x.dim(), _dtype_code(x.dtype), d, *_shape_columns(x, x.dim()))  # dim x.dim(): no column zeroed
    if torch.compiler.is_compiling():
        on_device = torch.tensor(facts, dtype=torch.int64, device=x.device)  # a constant of the graph
    else:
        on_device = _facts_on(x.device, facts)
    header = torch.cat([mine, on_device])
    table = (
        header.view(1, -1)
        if g.is_single
        else _prims._all_gather0_impl(header, g.name, g.size).view(g.size, -1)
    )
    sizes = table[:, 0]
    agree = (table[:, 1:] == table[:1, 1:]).all() & (sizes >= 0).all() & (sizes <= bound).all()
    torch._assert_async(
        agree,
        f"{op}: every rank's `length` must lie in [0, x.shape[dim]], and every rank's x must have the "
        f"same shape and dtype (this rank: {x.dtype}, {x.dim()}-d, dim={d})",
    )
    xm = wire(x).movedim(d, 0)
    blocks = xm if g.is_single else _prims.all_gather0(xm, g.name, g.size)
    y = unwire(_pack(blocks, sizes, bound), x.dtype)
    return (y if d == 0 else y.movedim(0, d).contiguous()), sizes.clone()
