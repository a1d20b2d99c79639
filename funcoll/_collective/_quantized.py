"""Collectives whose data travels in a wire format (:class:`funcoll.Wire`), each direction in its own.

Every rank's tensor travels as the bytes :func:`~funcoll._base._quant.encode` makes of
it, codes and block scales together, in the one collective the exact op issues, and
is decoded to the input's dtype where it lands. A reduction never runs on codes: the
reduce-scatter is an all_to_all of every rank's quantized pieces, each decoded and
then reduced in the input's dtype (ZeRO++'s qgZ), never summed in 8 bits.

The backward is the adjoint in the format the caller chose for the gradient (None:
the exact collective). The forward's rounding counts as the identity
(straight-through): the gradient of a decoded value is passed to its input as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._base._quant import Wire, decode, encode
from . import _faults
from ._prims import all_gather_impl, all_to_all_impl, reduce_scatter_impl, scale_for_op

# How the pieces a rank receives are reduced once decoded; avg is sum / world.
_REDUCE = {
    "sum": lambda t: t.sum(0),
    "avg": lambda t: t.sum(0) / t.shape[0],
    "max": lambda t: t.amax(0),
    "min": lambda t: t.amin(0),
    "product": lambda t: t.prod(0),
}


def _gather(x: Tensor, wire: Wire | None, group_name: str, world: int) -> Tensor:
    """``(*S) -> (world, *S)``: every rank's `x`, sent as `wire`'s bytes (None: as is) in one all_gather."""
    if wire is None:
        return all_gather_impl(x.reshape(1, -1), group_name, world).view(world, *x.shape)
    got = all_gather_impl(encode(x, wire), group_name, world)  # (world * B,)
    return decode(got.view(world, -1), wire, x.shape, x.dtype)


def _scatter_reduce(x: Tensor, wire: Wire | None, reduce_op: str, group_name: str, world: int) -> Tensor:
    """``(world, *S) -> (*S)``: piece j of every rank to rank j in one collective, reduced in x's dtype.

    `wire` None: the exact reduce_scatter. Else one all_to_all of the encoded pieces,
    each decoded, then reduced.
    """
    if wire is None:
        return reduce_scatter_impl(x.reshape(world, -1), reduce_op, group_name, world).view(x.shape[1:])
    sent = encode(x, wire, lead=1)  # (world, B): each piece with its own scales
    nbytes = sent.shape[1]
    got = all_to_all_impl(sent.reshape(-1), [nbytes] * world, [nbytes] * world, group_name)
    return _REDUCE[reduce_op](decode(got.view(world, -1), wire, x.shape[1:], x.dtype))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, wire: Wire | None, grad_wire: Wire | None, group_name: str, world: int
    ) -> Tensor:
        _faults.remember(ctx)
        ctx.grad_wire, ctx.group_name, ctx.world = grad_wire, group_name, world
        return _gather(x, wire, group_name, world)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = reduce_scatter_wire_p(grad, "sum", ctx.group_name, ctx.world, ctx.grad_wire, None)
        return g, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        wire: Wire | None,
        grad_wire: Wire | None,
        reduce_op: str,
        group_name: str,
        world: int,
    ) -> Tensor:
        _faults.remember(ctx)
        ctx.grad_wire, ctx.reduce_op, ctx.group_name, ctx.world = grad_wire, reduce_op, group_name, world
        return _scatter_reduce(x, wire, reduce_op, group_name, world)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = all_gather_wire_p(grad, ctx.group_name, ctx.world, ctx.grad_wire, None)
        return scale_for_op("reduce_scatter", ctx.reduce_op, g, ctx.world), None, None, None, None, None


def all_gather_wire_p(
    x: Tensor, group_name: str, world: int, wire: Wire | None, grad_wire: Wire | None
) -> Tensor:
    """``(*S) -> (world, *S)``: `x` in `wire` (None: exact); the gradient's reduce-scatter in `grad_wire`."""
    return _AllGather.apply(x, wire, grad_wire, group_name, world)


def reduce_scatter_wire_p(
    x: Tensor, reduce_op: str, group_name: str, world: int, wire: Wire | None, grad_wire: Wire | None
) -> Tensor:
    """``(world, *S) -> (*S)``: the pieces in `wire` (None: exact); the gradient's all_gather in `grad_wire`."""
    return _ReduceScatter.apply(x, wire, grad_wire, reduce_op, group_name, world)
