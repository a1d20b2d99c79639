"""Collectives whose data travels in a wire format (:class:`funcoll.Wire`), each direction in its own.

Every rank's tensor travels as the bytes :func:`~funcoll._base._quant.encode` makes of
it, codes and block scales together, in the one collective the exact op issues, and
is decoded to the input's dtype where it lands. A reduction never runs on codes: the
reduce-scatter is an all_to_all of every rank's quantized pieces, each decoded and
then reduced in the input's dtype (ZeRO++'s qgZ), never summed in 8 bits.

In eager code on CUDA (see :func:`~funcoll._collective._rows.row_kernels`) the
encoding and the decoding are one Triton launch each (``_kernels.encode_rows`` and
``decode_rows``), the same bytes and values as the torch ops, which a compiled
graph keeps (inductor fuses them with the producer and the consumer).

The backward is the adjoint in the format the caller chose for the gradient (None:
the exact collective). The forward's rounding counts as the identity
(straight-through): the gradient of a decoded value is passed to its input as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._base._checks import IntLike
from .._base._quant import Wire, decode, encode
from .._base._sym import Stats
from . import _faults
from ._phase import Primitive
from ._prims import (
    all_gather_impl,
    all_to_all_impl,
    all_to_all_p,
    ctx_ints,
    differentiable,
    gather_rows,
    reduce_scatter_impl,
    reduce_scatter_v_p,
    scale_for_op,
)
from ._rows import row_kernels

# How the pieces a rank receives are reduced once decoded; avg is sum / world.
_REDUCE = {
    "sum": lambda t: t.sum(0),
    "avg": lambda t: t.sum(0) / t.shape[0],
    "max": lambda t: t.amax(0),
    "min": lambda t: t.amin(0),
    "product": lambda t: t.prod(0),
}


def _encode(x: Tensor, wire: Wire, lead: int = 0) -> Tensor:
    """:func:`~funcoll._base._quant.encode`; one Triton launch in eager CUDA code."""
    kernels = row_kernels(x)
    if kernels is not None and kernels.takes_wire(wire, x.dtype):
        return kernels.encode_rows(x, wire, lead)
    return encode(x, wire, lead)


def _decode(b: Tensor, wire: Wire, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """:func:`~funcoll._base._quant.decode`; one Triton launch in eager CUDA code."""
    kernels = row_kernels(b)
    if kernels is not None and kernels.takes_wire(wire, dtype):
        return kernels.decode_rows(b, wire, tuple(shape), dtype)
    return decode(b, wire, shape, dtype)


def _own(y: Tensor) -> Tensor:
    """A decoded result as a tensor of its own in a compiled graph (inductor writes it in the decoding kernel).

    Dynamo 2.11 drops the gradient of an autograd.Function whose forward returns a
    view of a tensor made inside it (decode's last reshape); eager autograd keeps it.
    """
    return y.clone() if torch.compiler.is_compiling() else y


def _gather(x: Tensor, wire: Wire | None, group_name: str, world: int) -> Tensor:
    """``(*S) -> (world, *S)``: every rank's `x`, sent as `wire`'s bytes (None: as is) in one all_gather."""
    if wire is None:
        return all_gather_impl(x.reshape(1, -1), group_name, world).view(world, *x.shape)
    got = all_gather_impl(_encode(x, wire), group_name, world)  # (world * B,)
    return _own(_decode(got.view(world, -1), wire, x.shape, x.dtype))


def _scatter_reduce(x: Tensor, wire: Wire | None, reduce_op: str, group_name: str, world: int) -> Tensor:
    """``(world, *S) -> (*S)``: piece j of every rank to rank j in one collective, reduced in x's dtype.

    `wire` None: the exact reduce_scatter. Else one all_to_all of the encoded pieces,
    each decoded, then reduced.
    """
    if wire is None:
        return reduce_scatter_impl(x.reshape(world, -1), reduce_op, group_name, world).view(x.shape[1:])
    sent = _encode(x, wire, lead=1)  # (world, B): each piece with its own scales
    nbytes = sent.shape[1]
    got = all_to_all_impl(sent.reshape(-1), [nbytes] * world, [nbytes] * world, group_name)
    return _REDUCE[reduce_op](_decode(got.view(world, -1), wire, x.shape[1:], x.dtype))


class _AllGather(Primitive):
    @staticmethod
    def forward(x: Tensor, wire: Wire | None, grad_wire: Wire | None, group_name: str, world: int) -> Tensor:
        return _gather(x, wire, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, _, ctx.grad_wire, ctx.group_name, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = reduce_scatter_wire_p(grad, "sum", ctx.group_name, ctx.world, ctx.grad_wire, None)
        return g, None, None, None, None


class _ReduceScatter(Primitive):
    @staticmethod
    def forward(
        x: Tensor,
        wire: Wire | None,
        grad_wire: Wire | None,
        reduce_op: str,
        group_name: str,
        world: int,
    ) -> Tensor:
        return _scatter_reduce(x, wire, reduce_op, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, _, ctx.grad_wire, ctx.reduce_op, ctx.group_name, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad = differentiable("reduce_scatter", ctx.reduce_op, grad)
        g = all_gather_wire_p(grad, ctx.group_name, ctx.world, ctx.grad_wire, None)
        return scale_for_op(ctx.reduce_op, g, ctx.world), None, None, None, None, None


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


def _rows(x: Tensor, wire: Wire | None, recv: list[IntLike], send: list[IntLike], group_name: str) -> Tensor:
    """``(n, *R) -> (m, *R)``: ``send[j]`` rows to rank j, ``recv[i]`` from rank i, each row encoded on its own."""
    if wire is None:
        return all_to_all_impl(x, recv, send, group_name)
    got = all_to_all_impl(_encode(x, wire, lead=1), recv, send, group_name)  # (m, B): a row's bytes
    return _own(_decode(got, wire, x.shape[1:], x.dtype))


class _AllToAllRows(Primitive):
    @staticmethod
    def forward(
        x: Tensor,
        wire: Wire | None,
        grad_wire: Wire | None,
        recv: list[IntLike],
        send: list[IntLike],
        group_name: str,
    ) -> Tensor:
        return _rows(x, wire, recv, send, group_name)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, _, ctx.grad_wire, recv, send, ctx.group_name = inputs
        ctx.recv, ctx.send = ctx_ints(recv), ctx_ints(send)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = all_to_all_rows_wire_p(grad, ctx.send, ctx.recv, ctx.group_name, ctx.grad_wire, None)
        return g, None, None, None, None, None


def all_to_all_rows_wire_p(
    x: Tensor,
    recv: Sequence[IntLike],
    send: Sequence[IntLike],
    group_name: str,
    wire: Wire | None,
    grad_wire: Wire | None,
) -> Tensor:
    """Send ``send[j]`` rows of `x` to rank j, receive ``recv[i]`` from rank i, each row in `wire` (None: exact).

    A row's blocks run along its last dim; its scales travel with its codes, so the
    splits count rows as the exact all_to_all's do. The backward: the same with the
    splits swapped, in `grad_wire`. Both None: the exact primitive. One rank (one
    split): `x` itself, as the exact op would give it.
    """
    if len(send) == 1:
        return x
    torch._check(sum(send) == x.shape[0])
    if wire is None and grad_wire is None:
        return all_to_all_p(x, list(recv), list(send), group_name)
    return _AllToAllRows.apply(x, wire, grad_wire, list(recv), list(send), group_name)


class _GatherRows(Primitive):
    """The ragged all-gather of rows (a strategy of funcoll.gather) in `wire`; its adjoint in `grad_wire`."""

    @staticmethod
    def forward(
        x: Tensor,
        wire: Wire | None,
        grad_wire: Wire | None,
        sizes: list[IntLike],
        strategy: str,
        group_name: str,
        world: int,
        rank: int,
        stats: Stats | None,
    ) -> Tensor:
        if wire is None:  # exact rows (only the gradient is quantized)
            return _own(gather_rows(x, sizes, strategy, group_name, world, rank, stats))
        got = gather_rows(_encode(x, wire, lead=1), sizes, strategy, group_name, world, rank, stats)
        return _own(_decode(got, wire, x.shape[1:], x.dtype))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, _, ctx.grad_wire, sizes, _, ctx.group_name, ctx.world, ctx.rank, stats = inputs
        ctx.sizes, ctx.stats = ctx_ints(sizes), None if stats is None else tuple(ctx_ints(stats))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = scatter_rows_wire_p(
            grad, ctx.sizes, ctx.group_name, ctx.world, ctx.rank, ctx.stats, ctx.grad_wire
        )
        return g, *[None] * 8


class _ScatterRows(Primitive):
    """The ragged reduce-scatter (sum) of rows in `wire`: one all_to_all of the encoded rows, summed decoded."""

    @staticmethod
    def forward(
        x: Tensor,
        wire: Wire,
        sizes: list[IntLike],
        group_name: str,
        world: int,
        rank: int,
        stats: Stats | None,
    ) -> Tensor:
        mine = sizes[rank]
        got = all_to_all_impl(_encode(x, wire, lead=1), [mine] * world, list(sizes), group_name)
        # reshape, not Tensor.unflatten: under a torch function mode (torch.set_default_device)
        # dynamo inlines unflatten's Python wrapper, whose super() call it cannot trace.
        return _decode(got, wire, x.shape[1:], x.dtype).reshape(world, mine, *x.shape[1:]).sum(0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, _, sizes, ctx.group_name, ctx.world, ctx.rank, stats = inputs
        ctx.sizes, ctx.stats = ctx_ints(sizes), None if stats is None else tuple(ctx_ints(stats))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = gather_rows(grad, ctx.sizes, "auto", ctx.group_name, ctx.world, ctx.rank, ctx.stats)
        return g, *[None] * 6


def gather_rows_wire_p(
    x: Tensor,
    sizes: Sequence[IntLike],
    strategy: str,
    group_name: str,
    world: int,
    rank: int,
    stats: Stats | None,
    wire: Wire | None,
    grad_wire: Wire | None,
) -> Tensor:
    """Ragged all-gather of dim 0, each row in `wire` (its bytes travel by the strategy's collectives; None: exact).

    ``(sizes[rank], *R) -> (sum(sizes), *R)``; the backward is the ragged
    reduce-scatter of the gradient's rows, in `grad_wire` (None: exact). Both None:
    the exact primitive.
    """
    if wire is None and grad_wire is None:
        return gather_rows(x, sizes, strategy, group_name, world, rank, stats)
    return _GatherRows.apply(x, wire, grad_wire, list(sizes), strategy, group_name, world, rank, stats)


def scatter_rows_wire_p(
    x: Tensor,
    sizes: Sequence[IntLike],
    group_name: str,
    world: int,
    rank: int,
    stats: Stats | None,
    wire: Wire | None,
) -> Tensor:
    """Ragged reduce-scatter (sum) of dim 0, ``(sum(sizes), *R) -> (sizes[rank], *R)``, in `wire` (None: exact)."""
    if wire is None:
        return reduce_scatter_v_p(x, sizes, "sum", group_name, world, rank, stats)
    return _ScatterRows.apply(x, wire, list(sizes), group_name, world, rank, stats)
