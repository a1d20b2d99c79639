"""Row moves around a padded collective: pad before it, pack (cut the padding out) after it.

A padded all_gather hands back ``world`` blocks of ``bound`` rows, of which rank
i's first ``sizes[i]`` are data. Packing moves those rows to the front, in rank
order; padding is the inverse on one rank's rows. Nothing here communicates.

:func:`pack_reference` is the one torch implementation of the pack, and the
oracle the Triton kernels are tested against. In eager code on CUDA (see
:func:`row_kernels`) each move is one Triton kernel launch instead
(``_kernels.py``), with the inverse move as its backward; a compiled graph keeps
the torch ops, which inductor fuses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .._base._checks import IntLike
from .._base._wire import unwire, wire
from ._phase import Primitive


def row_kernels(t: Tensor) -> ModuleType | None:
    """``funcoll._collective._kernels`` when eager code should move `t`'s rows with its Triton kernels.

    On CUDA tensors, when triton imports, unless ``FUNCOLL_TRITON=0``.
    ``FUNCOLL_TRITON=1`` takes CPU tensors too, under ``TRITON_INTERPRET=1``: how
    the tests run the kernels on a machine without a GPU. A compiled graph keeps
    the torch ops (inductor fuses them). The setting is read at every call.
    """
    mode = os.environ.get("FUNCOLL_TRITON", "auto")
    if mode == "0" or torch.compiler.is_compiling() or not (t.is_cuda or mode == "1"):
        return None
    try:
        from . import _kernels  # triton is optional: imported only when the kernels would run
    except ImportError:  # no triton: the torch ops do the same
        return None
    return _kernels


class _PadRows(Primitive):
    @staticmethod
    def forward(x: Tensor, n_out: int, kernels: ModuleType) -> Tensor:
        return kernels.pad_rows(x, n_out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.n = inputs[0].shape[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad.narrow(0, 0, ctx.n), None, None


class _PackRows(Primitive):
    @staticmethod
    def forward(blocks: Tensor, sizes: Tensor, bound: int, n_out: int, kernels: ModuleType) -> Tensor:
        return kernels.pack_rows(blocks, sizes, bound, n_out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, sizes, ctx.bound, _, ctx.kernels = inputs
        ctx.save_for_backward(sizes)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (sizes,) = ctx.saved_tensors
        return ctx.kernels.unpack_rows(grad, sizes, ctx.bound), None, None, None, None


def pad_rows(x: Tensor, n_out: IntLike) -> Tensor:
    """`x` followed by zero rows up to `n_out`: ``(n, *R) -> (n_out, *R)``; one launch on CUDA."""
    kernels = row_kernels(x)
    if kernels is not None:
        return _PadRows.apply(x, n_out, kernels)
    torch._check(n_out - x.shape[0] >= 0)
    return zero_rows_after(x, n_out - x.shape[0])


def zero_rows_after(x: Tensor, n: IntLike) -> Tensor:
    """`x` followed by `n` zero rows: ``(m, *R) -> (m + n, *R)`` (a copy).

    A constant pad, not ``torch.cat([x, zeros])``: inductor's decomposition of
    ``cat`` drops an operand whose static size is 0, so on a rank whose `x` is
    empty by its static shape (no tokens, no rows to send) the result would be
    a constant of the graph. In a backward, `x` is the gradient: the collective
    that sends the result would then not depend on the gradient, and AOT
    autograd's partitioner moves it into the forward graph, on that rank alone.
    ``constant_pad_nd`` keeps `x` in the graph on every rank
    (compile_tests/test_rank_shapes.py).
    """
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, n))


def pack_reference(
    blocks: Tensor, sizes: Tensor, bound: IntLike, n_out: IntLike, *, exact: bool = False,
    zero_row: IntLike | None = None,
) -> Tensor:  # fmt: skip
    """Rank i's ``sizes[i]`` rows at ``i * bound`` of `blocks`, packed in rank order, then zero rows to `n_out`.

    Output row k comes from the rank whose rows cover k in the packed order
    (``searchsorted`` over the running sum of `sizes`); rows past ``sum(sizes)``
    are zero. One index_select (and a masked fill), with the index computed on
    the device: the graph is the same size whatever the world size, and autograd's
    backward is the inverse move (the gradient's rows scattered back to the
    blocks, zeros on the padding). `exact` says ``n_out == sum(sizes)``: no row is
    padding, so no fill. `zero_row` is the index of a row of `blocks` that holds
    zeros: the padding rows are copied from it, in the same pass, instead of
    filled after it (their gradient goes to that row).
    """
    src = _sources(sizes, bound, n_out, blocks.device)
    if exact:
        return blocks.index_select(0, src)
    valid = torch.arange(n_out, device=blocks.device) < sizes.sum()
    if zero_row is not None:
        return blocks.index_select(0, torch.where(valid, src, zero_row))
    rows = blocks.index_select(0, torch.where(valid, src, 0))
    # In place on the fresh rows (index_select's backward needs only the index): one
    # pass fewer over the result than a where.
    return rows.masked_fill_(~valid.view(-1, *([1] * (blocks.dim() - 1))), 0)


def pack(
    blocks: Tensor, sizes: Tensor, bound: IntLike, n_out: IntLike, *, exact: bool = False,
    zero_row: IntLike | None = None,
) -> Tensor:  # fmt: skip
    """:func:`pack_reference`, as one Triton launch (and one for its backward) in eager CUDA code."""
    kernels = row_kernels(blocks)
    if kernels is not None:
        return _PackRows.apply(blocks, sizes, bound, n_out, kernels)
    return pack_reference(blocks, sizes, bound, n_out, exact=exact, zero_row=zero_row)


def _sources(sizes: Tensor, bound: IntLike, n_out: IntLike, device: torch.device) -> Tensor:
    """The row of the blocks that each of the `n_out` packed rows comes from (rows past the data: clamped, any)."""
    ends = torch.cumsum(sizes, 0)
    k = torch.arange(n_out, device=device)
    owner = torch.searchsorted(ends, k, right=True).clamp(max=sizes.numel() - 1)
    return owner * bound + (k - (ends - sizes)[owner])


class _Cut(Primitive):
    """The exact pack in a compiled graph, whose backward reads the block length off a saved tensor.

    Autograd's own backward of the pack (an index_add into zeros of the blocks'
    shape) keeps ``world * bound`` as a size saved from the forward; inductor 2.15
    then generates a backward that allocates ``(world * u, ...)`` without defining
    the unbacked ``u`` (a NameError when it runs). Here the backward takes the
    bound from the shape of an empty ``(bound, 0)`` tensor saved for it, an input
    of the backward graph whose size inductor binds. The same values either way.
    """

    @staticmethod
    def forward(blocks: Tensor, sizes: Tensor, bound: IntLike, n_out: IntLike) -> Tensor:
        return pack_reference(blocks, sizes, bound, n_out, exact=True)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        blocks, sizes, bound, _ = inputs
        ctx.save_for_backward(sizes, blocks.new_empty((bound, 0)))  # no bytes: its shape holds the bound

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        sizes, marker = ctx.saved_tensors
        bound = marker.shape[0]
        src = _sources(sizes, bound, grad.shape[0], grad.device)
        blocks = grad.new_zeros((sizes.numel() * bound, *grad.shape[1:]))
        return blocks.index_copy(0, src, grad), None, None, None


def cut_padding(blocks: Tensor, sizes: list[IntLike], longest: IntLike, total: IntLike) -> Tensor:
    """Rows ``[i * longest, i * longest + sizes[i])`` of `blocks` for every rank i, in order.

    The sizes are host ints (SymInts in a compiled graph), whose sum is `total`:
    they go to the device as a tensor and :func:`pack` does the rest (:class:`_Cut`
    in a compiled graph).
    """
    on_device = ints_on(blocks.device, sizes)
    if torch.compiler.is_compiling():
        return _Cut.apply(blocks, on_device, longest, total)
    return pack(blocks, on_device, longest, total, exact=True)


def ints_on(device: torch.device, ints: Sequence[IntLike]) -> Tensor:
    """Host ints (SymInts in a compiled graph) as an int64 tensor on `device`, without waiting for it.

    In eager code the tensor is built on the host and copied with ``non_blocking``:
    from pageable memory the copy is staged at once, where ``torch.tensor(...,
    device=cuda)`` would wait for the device's queue. A compiled graph builds it
    on the device.
    """
    if torch.compiler.is_compiling():
        return torch.tensor(ints, dtype=torch.int64, device=device)
    return torch.tensor(ints, dtype=torch.int64).to(device, non_blocking=True)


def to_rows(x: Tensor, dim: int) -> Tensor:
    """`x` as a collective moves it along `dim`: in its wire dtype, `dim` first (a view, no copy)."""
    return wire(x).movedim(dim, 0)


def from_rows(y: Tensor, dtype: torch.dtype, dim: int) -> Tensor:
    """A result in :func:`to_rows`' layout back in `dtype`, its rows along `dim`.

    Contiguous, so that a user's in-place op or ``.view`` works; with `dim` 0 the
    collective's own output, uncopied.
    """
    y = unwire(y, dtype)
    return y if dim == 0 else y.movedim(0, dim).contiguous()
