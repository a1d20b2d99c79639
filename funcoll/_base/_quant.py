"""Wire formats: a tensor as the bytes a quantized collective moves, and back.

A :class:`Wire` names the format. A scaled format (float8, int8) stores each block of
`block` values along the last dim as 8-bit codes and one float32 scale, the block's
absolute maximum over the format's largest code, so that the largest value of every
block is represented; the scales travel in the same bytes as the codes. A 16-bit float
format (bfloat16, float16) is a plain cast and has no scale.

:func:`encode` makes one flat uint8 tensor of a tensor, scales then codes (padded to a
multiple of 4 bytes, so that every rank's scales can be viewed as float32), and
:func:`decode` the tensor back in a given dtype. Both are plain torch ops: compiled,
they fuse with whatever produces the input and consumes the output.

Non-finite values: a scaled block that holds an inf or a NaN decodes as all NaN (an
8-bit code cannot carry them, and the NaN keeps the failure visible, as in the
exact op, where it reaches the loss); a 16-bit format carries them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import IntLike
from ._sym import prod

__all__ = ["Wire"]

# The formats with a scale per block, and the largest code of each.
SCALED = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.int8: 127.0,
}
_CASTS = (torch.bfloat16, torch.float16)
# What decode's rounding error is bounded by, per format: a relative part (half a unit in
# the last place of the code, as a fraction of the value) and an absolute part in units of
# the block's scale (an int8 code's half step; a float8 subnormal's half step).
ROUNDING: dict[torch.dtype, tuple[float, float]] = {
    torch.float8_e4m3fn: (2.0**-4, 2.0**-10),
    torch.float8_e5m2: (2.0**-3, 2.0**-17),
    torch.int8: (0.0, 0.5),
    torch.bfloat16: (2.0**-8, 0.0),
    torch.float16: (2.0**-11, 2.0**-25),
}
SCALE_BYTES = 4  # each block's scale travels as float32
MAX_BLOCK = 1 << 26  # a block's size fits its header code (wire_code) in 31 bits


@dataclass(frozen=True, repr=False)
class Wire:
    """How a collective's data travels: its dtype on the wire and, for an 8-bit format, the block of one scale.

    ``Wire(torch.float8_e4m3fn, block=128)``: 1 byte a value plus one float32 scale per
    128 values along the last dim (DeepEP's FP8 dispatch). ``Wire(torch.int8,
    block=256)``: int8 codes with block scales (ZeRO++'s weight gathers).
    ``Wire(torch.bfloat16)``: a cast, no scale (half the bytes of float32).
    ``block=None`` with an 8-bit format: one scale for the whole last dim.

    The result of the collective is decoded back to the input's dtype. Rounding per
    value is within ``ROUNDING[dtype]``: ``|error| <= rel * |x| + abs * scale``, where
    ``scale`` is the block's absolute maximum over the format's largest code
    (docs/wire.md).
    """

    dtype: torch.dtype
    block: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in SCALED and self.dtype not in _CASTS:
            raise ValueError(
                f"funcoll.Wire: `dtype`={self.dtype} is not a wire format; use one of {[*SCALED, *_CASTS]}"
            )
        if self.block is not None:
            if (
                isinstance(self.block, bool)
                or not isinstance(self.block, int)
                or not 0 < self.block <= MAX_BLOCK
            ):
                raise ValueError(f"funcoll.Wire: `block`={self.block!r} must be an int in [1, 2**26] or None")
            if self.dtype in _CASTS:
                raise ValueError(
                    f"funcoll.Wire: `block`={self.block} is for the 8-bit formats; {self.dtype} is a cast with no scale"
                )

    def __repr__(self) -> str:
        return show_code(wire_code(self))

    @property
    def scaled(self) -> bool:
        """Whether the format carries a scale per block (the 8-bit formats)."""
        return self.dtype in SCALED

    def nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """The bytes :func:`encode` makes of a tensor of `shape`."""
        numel = prod(shape)
        if not self.scaled:
            return numel * torch.empty((), dtype=self.dtype).element_size()
        return _round4(_blocks(shape, self.block) * SCALE_BYTES + numel)


def _round4(n: int) -> int:
    """Bytes up to a multiple of 4: each rank's scales then start where a float32 may be viewed."""
    return -(-n // 4) * 4


def _blocks(shape: torch.Size | tuple[int, ...], block: int | None) -> int:
    """How many scales a tensor of `shape` has: blocks along its last dim, the last one partial."""
    if len(shape) == 0:
        return 1
    rows = prod(shape[:-1])
    last = shape[-1]
    width = last if block is None else block
    return rows * (-(-last // width) if width else 0)


def _per_value(scale: Tensor, width: int, last: int) -> Tensor:
    """``(..., nb, 1)`` block scales as ``(..., last)``: each value's block's scale (the last block partial).

    An index per value, not ``expand(...).reshape(...)[..., :last]``: inductor 2.13
    (CPU) reads that view of a reduction's result wrongly past the first full blocks.
    """
    block_of = torch.arange(last, device=scale.device) // max(width, 1)
    return scale.squeeze(-1)[..., block_of]


def _as_bytes(t: Tensor, outer: Sequence[IntLike], per: IntLike) -> Tensor:
    """`t`'s `per` values for each of `outer` as bytes: ``(*outer, per * itemsize)`` uint8.

    Flat first: a view between element sizes needs a last stride of 1, which a moved
    dim may lack even where ``is_contiguous()`` holds (a dim of length 1 with another
    stride: all_to_all's rows of a scatter dim).
    """
    return t.reshape(-1).view(torch.uint8).reshape(*outer, per * t.element_size())


def encode(x: Tensor, wire: Wire, lead: int = 0) -> Tensor:
    """`x` in `wire`'s format as uint8 bytes: (scaled formats) its float32 scales, then its codes.

    The first `lead` dims stay (a batch of tensors, each of ``x.shape[lead:]``, encoded
    on its own): the result is ``(*x.shape[:lead], wire.nbytes(x.shape[lead:]))``.
    """
    outer = x.shape[:lead]
    per = prod(x.shape[lead:])  # values in each of the `lead` items (explicit: there may be no item)
    if not wire.scaled:
        return _as_bytes(x.to(wire.dtype), outer, per)
    t = x.reshape(*outer, 1) if x.dim() == lead else x  # a 0-d tensor: one block of one value
    last = t.shape[-1]
    width = last if wire.block is None else wire.block
    nb = -(-last // width) if width else 0
    whole = width > 0 and last % width == 0  # no partial block: values and scales broadcast as blocks
    v = t.float() if whole else torch.nn.functional.pad(t.float(), (0, nb * width - last))
    v = v.reshape(*t.shape[:-1], nb, width)
    # The blocks' absolute maxima (inf and NaN propagate). Not linalg.vector_norm(inf), one
    # pass eager: its meta refuses a tensor with no element (a rank with no rows), compiled.
    amax = v.abs().amax(-1, keepdim=True) if width else v.new_zeros(*v.shape[:-1], 1)
    fmax = SCALED[wire.dtype]
    # A block with an inf or a NaN: a NaN scale, so that it decodes as all NaN; an all-zero
    # block: scale 0, codes 0 (divided by 1).
    scale = torch.where(torch.isfinite(amax), amax / fmax, torch.nan)
    divisor = torch.where(scale == 0, 1.0, scale).nan_to_num(1.0)
    q = v / divisor if whole else t.float() / _per_value(divisor, width, last)
    q = q.clamp_(-fmax, fmax)  # float8 has no inf: past its largest code a cast gives NaN
    if wire.dtype == torch.int8:
        q = q.round_()
    codes = _as_bytes(q.to(wire.dtype), outer, per)
    scales = _as_bytes(scale, outer, prod(t.shape[lead:-1]) * nb)
    used = scales.shape[-1] + codes.shape[-1]
    pad = codes.new_zeros(*outer, _round4(used) - used)
    return torch.cat([scales, codes, pad], -1)


def decode(b: Tensor, wire: Wire, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """The tensor that :func:`encode` made the bytes `b` of: ``(*b.shape[:-1], *shape)`` in `dtype`.

    Each of `b`'s rows (all dims but the last) holds one tensor of `shape`.
    """
    outer = tuple(b.shape[:-1])
    if not wire.scaled:
        return b.view(wire.dtype).reshape((*outer, *shape)).to(dtype)
    t_shape = (1,) if len(shape) == 0 else tuple(shape)
    last = t_shape[-1]
    width = last if wire.block is None else wire.block
    nb = -(-last // width) if width else 0
    numel = prod(t_shape)
    if numel == 0:  # no bytes: nothing to view as float32
        return b.new_zeros(*outer, *shape, dtype=dtype)
    n_scales = SCALE_BYTES * _blocks(t_shape, wire.block)
    scale = b[..., :n_scales].view(torch.float32).reshape(*outer, *t_shape[:-1], nb, 1)
    codes = b[..., n_scales : n_scales + numel].view(wire.dtype).reshape(*outer, *t_shape)
    codes = codes if wire.dtype == torch.int8 else codes.float()  # int8 * float32 promotes in one pass
    if last % width == 0:  # whole blocks: each block times its scale
        out = (codes.reshape(*outer, *t_shape[:-1], nb, width) * scale).reshape(*outer, *t_shape)
    else:
        out = codes * _per_value(scale, width, last)
    return out.reshape(*outer, *shape).to(dtype) if outer or shape else out.reshape(()).to(dtype)


# A format's code in a header: 0 for None, else its dtype's place (from 1) plus 8 * its block.
_DTYPES = (*SCALED, *_CASTS)


def wire_code(wire: Wire | None) -> int:
    """`wire` as one int (0: None), for the cross-rank check's header."""
    if wire is None:
        return 0
    return 1 + _DTYPES.index(wire.dtype) + 8 * (wire.block or 0)


def pair_code(wire: Wire | None, grad_wire: Wire | None) -> int:
    """Both formats of a call as one int64, for the cross-rank check's header."""
    return (wire_code(wire) << 31) | wire_code(grad_wire)


def show_pair(code: int) -> str:
    """A :func:`pair_code` as ``wire, grad_wire``."""
    return f"{show_code(code >> 31)}, {show_code(code & ((1 << 31) - 1))}"


def show_code(code: int) -> str:
    """A :func:`wire_code` as the Wire it stands for, for an error message."""
    if code == 0:
        return "None"
    dtype, block = _DTYPES[(code - 1) % 8], (code - 1) // 8
    return f"Wire({dtype}{f', block={block}' if block else ''})"


def check_wire(opname: str, x: Tensor, wire: object, grad_wire: object) -> None:
    """`wire` and `grad_wire` are Wires or None, and a format is asked only of a floating `x`."""
    if wire is None and grad_wire is None:  # the exact op, most calls: a compiled caller traces less
        return
    for arg, value in (("wire", wire), ("grad_wire", grad_wire)):
        if value is not None and not isinstance(value, Wire):
            raise TypeError(
                f"{opname}: `{arg}` must be a funcoll.Wire or None, got {type(value).__name__} {value!r}"
            )
        if value is not None and not x.dtype.is_floating_point:
            raise TypeError(
                f"{opname}: `{arg}`={value} quantizes floating data; `x` has dtype {x.dtype} (pass {arg}=None)"
            )


def exact_for_dtensor(opname: str, wire: Wire | None, grad_wire: Wire | None) -> None:
    """A DTensor `x` travels exactly: its rules move the shards as they are."""
    if wire is not None or grad_wire is not None:
        raise ValueError(
            f"{opname}: `wire`={wire!r}, `grad_wire`={grad_wire!r}: a DTensor `x` travels exactly; "
            f"pass x.to_local() for a quantized collective of the local shards"
        )
