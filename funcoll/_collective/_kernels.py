"""Triton kernels for the copies around a ragged collective: one launch each.

A ragged all_gather that pads moves rows between two layouts of the same ranks'
rows. In the *padded* layout rank i's ``sizes[i]`` rows sit at ``i * bound``, each
block ``bound`` rows long; in the *packed* layout they sit at the running sum of
the sizes before i. Written with torch ops, each move is several launches (a
cumsum, an arange, a repeat_interleave or searchsorted, an index_select, a
masked fill); each kernel here is one, and reads the sizes from the device, so
nothing waits for the host.

- :func:`pad_rows`: ``x`` (n rows) -> ``m >= n`` rows, zeros after ``n``
  (before the all_gather);
- :func:`pack_rows`: padded -> packed, ``n_out`` rows, zeros past ``sum(sizes)``
  (after the all_gather; also the adjoint of :func:`unpack_rows`);
- :func:`unpack_rows`: packed -> padded, zeros on the padding (the adjoint of
  :func:`pack_rows`, for the backward).

The kernels copy rows as raw words (8, 4, 2 or 1 bytes, the widest that divides a
row), so every dtype takes the same path and zero bytes are zero in every dtype.
They serve eager code on CUDA (``funcoll._collective._rows.row_kernels`` says when); a compiled
graph keeps the torch ops, which inductor fuses into kernels of its own. On a machine without a GPU the
tests run them on CPU tensors with ``TRITON_INTERPRET=1``, which must be set before
this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._async import wait

ROWS = 16  # rows per program


@triton.jit
def _copy_rows(src, dst, src_row, dst_row, valid, n_dst, row_words, BLOCK: tl.constexpr):
    """Copy words ``[pid1 * BLOCK, ...)`` of rows `src_row` to rows `dst_row`; zeros where not `valid`."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = (dst_row < n_dst)[:, None] & (cols < row_words)[None, :]
    vals = tl.load(src + src_row[:, None] * row_words + cols[None, :], mask=valid[:, None] & keep, other=0)
    tl.store(dst + dst_row[:, None] * row_words + cols[None, :], vals, mask=keep)


@triton.jit
def _rows_and_sizes(sizes, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, ROWS: tl.constexpr):
    """This program's ROWS row indices (int64), the rank indices and the sizes (0 past WORLD)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    w = tl.arange(0, WORLD_P2)
    return rows, w, tl.load(sizes + w, mask=w < WORLD, other=0).to(tl.int64)


@triton.jit
def _pad_kernel(src, dst, n_dst, row_words, n_src, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    _copy_rows(src, dst, rows, rows, rows < n_src, n_dst, row_words, BLOCK)


@triton.jit
def _pack_kernel(
    src, dst, n_dst, row_words, sizes, bound,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    k, _, s = _rows_and_sizes(sizes, WORLD, WORLD_P2, ROWS)  # k: rows of the packed layout
    before = tl.cumsum(s, 0)[None, :] <= k[:, None]  # ranks whose rows all come before row k
    owner = tl.sum(before.to(tl.int64), 1)
    start = tl.sum(tl.where(before, s[None, :], 0), 1)  # where the owner's rows begin
    _copy_rows(src, dst, owner * bound + (k - start), k, k < tl.sum(s, 0), n_dst, row_words, BLOCK)


@triton.jit
def _unpack_kernel(
    src, dst, n_dst, row_words, sizes, bound,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    j, w, s = _rows_and_sizes(sizes, WORLD, WORLD_P2, ROWS)  # j: rows of the padded layout
    rank = j // bound
    r = j - rank * bound
    n_rank = tl.sum(tl.where(w[None, :] == rank[:, None], s[None, :], 0), 1)
    start = tl.sum(tl.where(w[None, :] < rank[:, None], s[None, :], 0), 1)
    _copy_rows(src, dst, start + r, j, r < n_rank, n_dst, row_words, BLOCK)


def _words(*ts: Tensor) -> list[Tensor]:
    """Contiguous row tensors as ``(rows, words)`` views of one int type: the widest that
    divides a row and the alignment of every one of them (bool and every other dtype alike)."""
    raws = []
    for t in ts:
        flat = t.reshape(t.shape[0], t.shape[1:].numel())
        flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
        raws.append(
            flat.view(torch.uint8) if flat.shape[1] else flat.new_empty((t.shape[0], 0), dtype=torch.uint8)
        )
    if any(r.numel() == 0 for r in raws):
        return raws  # an empty side has no alignment to read: bytes (no launch if dst is the empty one)
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if all(r.shape[1] % size == 0 and r.data_ptr() % size == 0 for r in raws):
            return [r.view(dtype) for r in raws]
    return raws


def _launch(kernel: triton.JITFunction, src: Tensor, dst: Tensor, *args: object, **meta: int) -> None:
    """Run `kernel` over `dst`'s rows: ``kernel(src, dst, n_dst, row_words, *args)``.

    A kernel reads its tensors' memory without torch's dispatch, so an input
    that a collective is still filling (an eager result, funcoll._collective._async) is
    waited for first: on CUDA that makes the launching stream wait, not the host.
    """
    src, args = wait((src, args))
    s, d = _words(src.contiguous(), dst)
    n_dst, row_words = d.shape
    if n_dst == 0 or row_words == 0:
        return
    block = min(1024, triton.next_power_of_2(row_words))
    grid = (triton.cdiv(n_dst, ROWS), triton.cdiv(row_words, block))
    kernel[grid](s, d, n_dst, row_words, *args, ROWS=ROWS, BLOCK=block, **meta)


def _world_meta(sizes: Tensor) -> dict[str, int]:
    world = sizes.numel()
    return {"WORLD": world, "WORLD_P2": triton.next_power_of_2(max(world, 1))}


def pad_rows(x: Tensor, n_out: int) -> Tensor:
    """``x`` (n rows) followed by ``n_out - n`` zero rows: ``(n, *R) -> (n_out, *R)``."""
    out = x.new_empty((n_out, *x.shape[1:]))
    _launch(_pad_kernel, x, out, x.shape[0])
    return out


def pack_rows(blocks: Tensor, sizes: Tensor, bound: int, n_out: int) -> Tensor:
    """Padded -> packed: ``(world * bound, *R) -> (n_out, *R)``, zeros past ``sum(sizes)``.

    `sizes` is an int tensor of shape ``(world,)`` on `blocks`' device (any strides); `n_out` is at
    least ``sum(sizes)`` (rows past ``n_out`` are dropped, so ``n_out = sum(sizes)``
    is the ragged gather's cut).
    """
    out = blocks.new_empty((n_out, *blocks.shape[1:]))
    _launch(_pack_kernel, blocks, out, sizes.contiguous(), bound, **_world_meta(sizes))
    return out


def unpack_rows(packed: Tensor, sizes: Tensor, bound: int) -> Tensor:
    """Packed -> padded: ``(n, *R) -> (world * bound, *R)``, zeros on the padding; n >= sum(sizes)."""
    out = packed.new_empty((sizes.numel() * bound, *packed.shape[1:]))
    if bound:
        _launch(_unpack_kernel, packed, out, sizes.contiguous(), bound, **_world_meta(sizes))
    return out
