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

Around a collective in a wire format (:class:`funcoll.Wire` with a scale per block),
two more, each one launch where :func:`~funcoll._base._quant.encode` and
:func:`~funcoll._base._quant.decode` are a dozen:

- :func:`encode_rows`: each row's block maxima, scales and 8-bit codes, laid out as
  the bytes the collective moves (scales, codes, zero padding);
- :func:`decode_rows`: those bytes back to values in the input's dtype.

They give the bytes and the values of the torch ops bit for bit: the rounding to a
format's grid is done in float32 arithmetic (a power-of-two scaling and a
round-half-even add), and a code is assembled from the rounded value's bits, so
neither depends on a conversion instruction (float8 has none before sm_89) nor on
the interpreter's own float8 and bfloat16 conversions (which truncate).

The row kernels copy rows as raw words (8, 4, 2 or 1 bytes, the widest that divides a
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

from .._base._quant import SCALE_BYTES, SCALED, Wire
from .._base._sym import prod
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


# --------------------------------------------------------------- wire formats
# A scaled format's kind (a constexpr of the kernels) and, for float8, its mantissa
# bits, smallest normal exponent and bias.
_KIND = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_FLOAT8 = {0: (0, 0, 0), 1: (3, -6, 7), 2: (2, -14, 15)}
# The decoded values' dtypes, by how a float32 is rounded to them: not at all
# (float32, float64), to bfloat16, to float16.
_OUT = {torch.float32: 0, torch.float64: 0, torch.bfloat16: 1, torch.float16: 2}
CHUNK = 256  # values per step of a program's loop over its block


@triton.jit
def _bits(v):
    return v.to(tl.int32, bitcast=True)


@triton.jit
def _pow2(e):
    """``2.0**e`` as float32, for an int32 `e` in the normal range."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rint(t):
    """`t` to the nearest integer, ties to even (``|t| < 2**22``): float32's own rounding of an add."""
    return (t + 12582912.0) - 12582912.0


@triton.jit
def _on_grid(a, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """``a >= 0`` rounded to the nearest value of `MBITS` mantissa bits and exponents from
    `EMIN` (subnormals below), ties to even; inf and NaN as they are."""
    e = tl.maximum(((_bits(a) >> 23) & 255) - 127, EMIN)
    return _rint(a * _pow2(MBITS - e)) * _pow2(e - MBITS)


@triton.jit
def _round_out(v, OUT: tl.constexpr):
    """A float32 rounded to the output dtype's values (ties to even), so that the store is exact."""
    if OUT == 1:  # bfloat16: the top 16 bits of a float32
        b = _bits(v)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        v = tl.where(v == v, r, v)
    elif OUT == 2:  # float16
        a = _on_grid(tl.abs(v), 10, -14)
        v = tl.where(v < 0, -a, a)
    return v


@triton.jit
def _code(
    q, KIND: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, STEP: tl.constexpr
):
    """Clamped float32 values as their codes' bytes (int32 in [0, 256))."""
    if KIND == 0:
        code = _rint(q).to(tl.int32) & 255
    else:
        a = _on_grid(tl.abs(q), MBITS, EMIN)
        e = ((_bits(a) >> 23) & 255) - 127
        normal = ((e + BIAS) << MBITS) | ((_bits(a) >> (23 - MBITS)) & ((1 << MBITS) - 1))
        # A subnormal: an exact count of the smallest step (div_rn: CUDA's own fp32 division is approximate).
        sub = tl.minimum(tl.math.div_rn(a, STEP), 1 << MBITS).to(tl.int32)
        code = tl.where(e >= EMIN, normal, sub) | (((_bits(q) >> 31) & 1) << 7)
    return code


@triton.jit
def _value(
    c, KIND: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, STEP: tl.constexpr
):
    """Codes' bytes (int32 in [0, 256)) as the float32 values they stand for."""
    if KIND == 0:
        v = c.to(tl.int8).to(tl.float32)
    else:
        mag = c & 127
        e = mag >> MBITS
        m = mag & ((1 << MBITS) - 1)
        normal = (((e - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
        a = tl.where(e == 0, m.to(tl.float32) * STEP, normal)
        if KIND == 1:  # e4m3fn: S.1111.111 is NaN, there is no inf
            a = tl.where(mag == 127, float("nan"), a)
        else:  # e5m2: the top exponent is inf (no mantissa) or NaN
            a = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), a)
        v = tl.where(c >= 128, -a, a)
    return v


@triton.jit
def _this_block(nsub, last, width, nb):
    """This program's block: its line (``row * nsub + sub``), block b of the line, the row, the
    sub-line, the block's first value in the line and its length (the last block may be partial)."""
    pid = tl.program_id(0).to(tl.int64)
    line = pid // nb
    b = pid - line * nb
    row = line // nsub
    start = b * width
    return line, b, row, line - row * nsub, start, tl.minimum(width, last - start)


@triton.jit
def _encode_kernel(
    src, scales, codes, nsub, last, width, nb, row_floats, row_bytes, code_start, fmax,
    KIND: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, STEP: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One block of one line (``row, sub``) of the output: its scale, its codes, and after the
    row's last block the row's zero padding."""
    line, b, row, s, start, span = _this_block(nsub, last, width, nb)
    offs = tl.arange(0, CHUNK)
    src_line = src + line * last + start
    amax = tl.zeros((CHUNK,), tl.float32)
    bad = tl.zeros((CHUNK,), tl.int32)
    for c in range(0, span, CHUNK):
        m = c + offs < span
        a = tl.abs(tl.load(src_line + c + offs, mask=m, other=0).to(tl.float32))
        bad += (~(a <= 3.4028234663852886e38) & m).to(tl.int32)  # inf or NaN
        amax = tl.maximum(amax, a)
    amax_b = tl.max(amax, 0)
    scale = tl.where(tl.sum(bad, 0) > 0, float("nan"), tl.math.div_rn(amax_b, fmax))
    divisor = tl.where((scale == 0) | (scale != scale), 1.0, scale)
    tl.store(scales + row * row_floats + s * nb + b, scale)
    dst_line = codes + row * row_bytes + code_start + s * last + start
    for c in range(0, span, CHUNK):
        m = c + offs < span
        v = tl.load(src_line + c + offs, mask=m, other=0).to(tl.float32)
        # Clamped (float8 has no inf); a NaN as 0: its block's NaN scale decodes it as NaN.
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, divisor), -fmax), fmax)
        q = tl.where(v == v, q, 0.0)
        tl.store(dst_line + c + offs, _code(q, KIND, MBITS, EMIN, BIAS, STEP).to(tl.uint8), mask=m)
    end = code_start + nsub * last  # the row's padding to a multiple of 4 bytes
    limit = tl.where((s == nsub - 1) & (b == nb - 1), row_bytes, 0)  # written by the row's last block
    pad = (end + offs < limit) & (offs < 4)
    tl.store(codes + row * row_bytes + end + offs, tl.zeros((CHUNK,), tl.uint8), mask=pad)


@triton.jit
def _decode_kernel(
    scales, codes, dst, nsub, last, width, nb, row_floats, row_bytes, code_start,
    KIND: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, STEP: tl.constexpr, OUT: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """One block of one line of the output: its codes times its scale."""
    line, b, row, s, start, span = _this_block(nsub, last, width, nb)
    offs = tl.arange(0, CHUNK)
    scale = tl.load(scales + row * row_floats + s * nb + b)
    src_line = codes + row * row_bytes + code_start + s * last + start
    for c in range(0, span, CHUNK):
        m = c + offs < span
        code = tl.load(src_line + c + offs, mask=m, other=0).to(tl.int32)
        v = _round_out(_value(code, KIND, MBITS, EMIN, BIAS, STEP) * scale, OUT)
        tl.store(dst + line * last + start + c + offs, v, mask=m)


def _lines(shape: tuple[int, ...], wire: Wire) -> tuple[int, int, int, int]:
    """A row of `shape` as (lines, line length, block width, blocks a line), as encode lays it out."""
    shape = shape or (1,)  # a 0-d row: one block of one value
    last = shape[-1]
    width = last if wire.block is None else wire.block
    return prod(shape[:-1]), last, width, (-(-last // width) if width else 0)


def _format_meta(wire: Wire, width: int) -> dict[str, int]:
    """The kernels' constexprs for `wire`: its kind, float8's bits, and the loop's step (at least the 4 padding bytes)."""
    kind = _KIND[wire.dtype]
    mbits, emin, bias = _FLOAT8[kind]
    chunk = max(4, min(CHUNK, triton.next_power_of_2(width)))
    step = 2.0 ** (emin - mbits)  # float8's smallest subnormal
    return {"KIND": kind, "MBITS": mbits, "EMIN": emin, "BIAS": bias, "STEP": step, "CHUNK": chunk}


def encode_rows(x: Tensor, wire: Wire, lead: int = 0) -> Tensor:
    """:func:`~funcoll._base._quant.encode` in one launch: ``(*L, *R) -> (*L, B)`` uint8, `L` the first `lead` dims."""
    x = wait(x)
    outer, row = tuple(x.shape[:lead]), tuple(x.shape[lead:])
    rows, nbytes = prod(outer), wire.nbytes(row)
    out = x.new_empty((rows, nbytes), dtype=torch.uint8)
    nsub, last, width, nb = _lines(row, wire)
    if rows and nbytes and nsub and nb:
        src = x.contiguous().reshape(-1)
        code_start = SCALE_BYTES * nsub * nb
        _encode_kernel[(rows * nsub * nb,)](
            src, out.view(torch.float32), out, nsub, last, width, nb, nbytes // 4, nbytes,
            code_start, SCALED[wire.dtype], **_format_meta(wire, width),
        )  # fmt: skip
    return out.reshape(*outer, nbytes)


def decode_rows(b: Tensor, wire: Wire, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """:func:`~funcoll._base._quant.decode` in one launch: ``(*L, B)`` uint8 -> ``(*L, *shape)`` in `dtype`."""
    b = wait(b)
    outer = tuple(b.shape[:-1])
    out = b.new_empty((*outer, *shape), dtype=dtype)
    nsub, last, width, nb = _lines(tuple(shape), wire)
    rows = prod(outer)
    if rows and nsub and nb:
        flat = b.reshape(rows, b.shape[-1]).contiguous()
        nbytes = flat.shape[1]
        _decode_kernel[(rows * nsub * nb,)](
            flat.view(torch.float32), flat, out, nsub, last, width, nb, nbytes // 4, nbytes,
            SCALE_BYTES * nsub * nb, OUT=_OUT[dtype], **_format_meta(wire, width),
        )  # fmt: skip
    return out


def takes_wire(wire: Wire, dtype: torch.dtype) -> bool:
    """Whether :func:`encode_rows` and :func:`decode_rows` serve `wire` for data of `dtype`."""
    return wire.dtype in _KIND and dtype in _OUT
