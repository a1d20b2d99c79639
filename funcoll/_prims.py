"""The differentiable primitives: each an autograd.Function around ``_c10d_functional`` ops.

Every public op is a composition of differentiable aten ops (narrow, cat, movedim,
pad) and the primitives below, so its backward is assembled by autograd from the
primitives' adjoints:

===================  ==================================================
primitive            backward (its adjoint)
===================  ==================================================
``all_gather0``      ``reduce_scatter0`` (sum) of the gradient
``reduce_scatter0``  ``all_gather0`` of the gradient (sum; avg divides)
``all_reduce``       ``all_reduce`` (sum) of the gradient (JAX ``psum``)
``all_to_all_rows``  ``all_to_all_rows`` with send and receive splits swapped
``broadcast``        sum of the gradients onto ``src``, zeros elsewhere
``all_gather_v``     ``reduce_scatter_v`` of the gradient
``reduce_scatter_v`` ``all_gather_v`` of the gradient
===================  ==================================================

``gather_rows`` and ``gather_pieces`` run a ragged all-gather with the strategy
``_strategy.py`` chooses, from these primitives and the row moves of
``_rows.py`` (pad before a padded all_gather, cut after it).

All of them work on dim 0 of contiguous tensors; the public ops move the user's
dim to the front and back. The forward of each runs with grad disabled, so only
funcoll's own backward is ever used, whatever autograd the installed torch
registers on the ``_c10d_functional`` ops. Nothing here stores a ProcessGroup on
a ctx: only the group name, size and rank, which are plain Python values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ._checks import IntLike
from ._rows import cut_padding, pad_rows
from ._strategy import all_equal, common_rows, resolve, sym_max

_F = torch.ops._c10d_functional

# (min, max, sum) of a ragged gather's per-rank sizes; see gather_rows.
Stats = tuple[IntLike, IntLike, IntLike]


def _wait(t: Tensor) -> Tensor:
    return _F.wait_tensor(t)


def _payload(x: Tensor) -> Tensor:
    """`x` as a collective's input: contiguous, and a node of its own when it is empty.

    Compilers merge equal nodes (AOT autograd's CSE), collectives included: two
    collectives on the same input with the same arguments become one. On a rank
    whose tensor is empty by its static shape (a Ulysses rank with no head, a rank
    with no rows to send), the gradients feeding several collectives can all be
    the same constant empty tensor, so that rank would issue fewer collectives than
    the others and the step would hang. An empty tensor's values are never read, so
    each collective's input gets a fresh ``torch.empty`` added to it: ``aten.empty``
    is never merged, so neither is the add nor the collective, and the add keeps
    the input's place in the graph (an input that no longer depended on the
    gradient would let the partitioner hoist a backward collective into the
    forward on that rank alone).
    """
    if torch.compiler.is_compiling() and statically_known_true(x.numel() == 0):
        return x + torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return x.contiguous()


def _ctx_ints(sizes: Sequence[IntLike]) -> list[IntLike]:
    # Dynamo (2.13) fails with "Argument ... does not belong to this Graph" when a
    # SymInt that is a graph input is stored on an autograd ctx as is; `s + 0` is a
    # fresh SymInt of the same value that it handles. Plain ints pass through.
    return [s + 0 if isinstance(s, torch.SymInt) else int(s) for s in sizes]


# --------------------------------------------------------------------------- all_gather0
def _all_gather0_impl(x: Tensor, name: str, size: int) -> Tensor:
    return _wait(_F.all_gather_into_tensor(_payload(x), size, name))


class _AllGather0(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, name: str, size: int) -> Tensor:
        ctx.name, ctx.size = name, size
        return _all_gather0_impl(x, name, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return reduce_scatter0(grad, "sum", ctx.name, ctx.size), None, None


def all_gather0(x: Tensor, name: str, size: int) -> Tensor:
    """Concatenate every rank's `x` along dim 0: ``(n, *R) -> (size * n, *R)``."""
    return _AllGather0.apply(x, name, size)


# ----------------------------------------------------------------------- reduce_scatter0
def _avg_as_sum(op: str, size: int, run: Any) -> Tensor:
    """Run a reducing collective; avg runs as sum / size (not every backend has avg)."""
    y = _wait(run("sum" if op == "avg" else op))
    return y / size if op == "avg" else y


def _reduce_scatter0_impl(x: Tensor, op: str, name: str, size: int) -> Tensor:
    return _avg_as_sum(op, size, lambda o: _F.reduce_scatter_tensor(_payload(x), o, size, name))


class _ReduceScatter0(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, op: str, name: str, size: int) -> Tensor:
        ctx.op, ctx.name, ctx.size = op, name, size
        return _reduce_scatter0_impl(x, op, name, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = all_gather0(grad, ctx.name, ctx.size)
        return _scale_for_op("reduce_scatter", ctx.op, g, ctx.size), None, None, None


def reduce_scatter0(x: Tensor, op: str, name: str, size: int) -> Tensor:
    """Reduce over ranks, keep this rank's 1/size of dim 0: ``(size * n, *R) -> (n, *R)``."""
    return _ReduceScatter0.apply(x, op, name, size)


def _scale_for_op(opname: str, op: str, g: Tensor, size: int) -> Tensor:
    if op == "sum":
        return g
    if op == "avg":
        return g / size
    raise NotImplementedError(
        f"funcoll.{opname}: no gradient for op={op!r}; only 'sum' and 'avg' are differentiable"
    )


# ---------------------------------------------------------------------------- all_reduce
def _all_reduce_impl(x: Tensor, op: str, name: str, size: int) -> Tensor:
    return _avg_as_sum(op, size, lambda o: _F.all_reduce(_payload(x), o, name))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, op: str, name: str, size: int) -> Tensor:
        ctx.op, ctx.name, ctx.size = op, name, size
        return _all_reduce_impl(x, op, name, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = all_reduce(grad, "sum", ctx.name, ctx.size)
        return _scale_for_op("all_reduce", ctx.op, g, ctx.size), None, None, None


def all_reduce(x: Tensor, op: str, name: str, size: int) -> Tensor:
    return _AllReduce.apply(x, op, name, size)


# ----------------------------------------------------------------------- all_to_all_rows
class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, recv: list[IntLike], send: list[IntLike], name: str) -> Tensor:
        ctx.recv, ctx.send, ctx.name = _ctx_ints(recv), _ctx_ints(send), name
        return _wait(_F.all_to_all_single(_payload(x), recv, send, name))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return all_to_all_rows(grad, ctx.send, ctx.recv, ctx.name), None, None, None


def all_to_all_rows(x: Tensor, recv: Sequence[IntLike], send: Sequence[IntLike], name: str) -> Tensor:
    """Send ``send[j]`` rows of `x` (in order) to rank j; receive ``recv[i]`` rows from rank i."""
    return _AllToAllRows.apply(x, list(recv), list(send), name)


# ----------------------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, src: int, name: str, size: int, rank: int) -> Tensor:
        ctx.src, ctx.name, ctx.size, ctx.rank = src, name, size, rank
        return _wait(_F.broadcast(_payload(x), src, name))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        total = all_reduce(grad, "sum", ctx.name, ctx.size)
        g = total if ctx.rank == ctx.src else torch.zeros_like(total)
        return g, None, None, None, None


def broadcast(x: Tensor, src: int, name: str, size: int, rank: int) -> Tensor:
    return _Broadcast.apply(x, src, name, size, rank)


# ------------------------------------------------------------------ ragged gather/scatter
def _all_gather_v_impl(
    x: Tensor, sizes: list[IntLike], common: IntLike, name: str, size: int, rank: int
) -> Tensor:
    """Ragged all-gather along dim 0 without padding.

    The first `common` rows of every rank (``common <= min(sizes)``) travel in one
    all_gather; the rest of each rank's rows in ``size - 1`` all_to_all_singles,
    the k-th of which sends them to rank ``rank + k`` (a shift by k). Each shift's
    input is the rows themselves, so nothing is copied to be sent: one
    all_to_all_single sending the rows to every rank at once would need them
    repeated ``size - 1`` times in its input. Every rank issues the same
    collectives whatever the sizes, and each one's input is this rank's own rows,
    so no compiler pass can treat a collective as independent of the data on some
    ranks and move it (the min-cut partitioner hoists tangent-independent nodes of
    a backward into the forward, which would reorder one rank's collectives
    against another's).
    """
    block = _wait(_F.all_gather_into_tensor(_payload(x.narrow(0, 0, common)), size, name))
    extras = [n - common for n in sizes]
    mine = x.narrow(0, common, extras[rank]).contiguous()
    received: dict[int, Tensor] = {}
    for k in range(1, size):
        to, frm = (rank + k) % size, (rank - k) % size
        # `[0] * size` then one store: dynamo traces that in O(1) bytecode steps, a
        # comprehension in O(size), which is O(size**2) over the shifts.
        send = [0] * size
        send[to] = extras[rank]
        recv = [0] * size
        recv[frm] = extras[frm]
        received[frm] = _wait(_F.all_to_all_single(_payload(mine), recv, send, name))
    if not torch.compiler.is_compiling() and all(e == 0 for e in extras):
        return block  # eager, every row came in the all_gather: it already is the result
    pieces = []
    for i in range(size):
        pieces.append(block.narrow(0, i * common, common))
        pieces.append(mine if i == rank else received[i])
    return torch.cat(pieces, 0)


def _reduce_scatter_v_impl(
    x: Tensor, sizes: list[IntLike], op: str, name: str, size: int, rank: int
) -> Tensor:
    """Ragged reduce-scatter along dim 0: rank i gets the reduction of rows [off_i, off_i + sizes[i]).

    One all_to_all_single moves exactly those rows to their owner (no padding), who
    reduces the `size` pieces locally.
    """
    mine = sizes[rank]
    got = _wait(_F.all_to_all_single(_payload(x), [mine] * size, list(sizes), name))
    stacked = got.view(size, mine, *x.shape[1:])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / size
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    return stacked.prod(0)


def _padded_blocks(
    x: Tensor, sizes: list[IntLike], stats: Stats | None, name: str, size: int
) -> tuple[Tensor, IntLike]:
    """All-gather `x` padded to ``max(sizes)`` rows: (the ``size * max`` rows, max)."""
    longest = sym_max(sizes) if stats is None else stats[1]
    return all_gather0(pad_rows(x, longest), name, size), longest


def gather_rows(
    x: Tensor,
    sizes: Sequence[IntLike],
    strategy: str,
    name: str,
    size: int,
    rank: int,
    stats: Stats | None = None,
) -> Tensor:
    """Ragged all-gather of dim 0 (``sizes[rank]`` rows here) with a strategy of funcoll.gather.

    ``"pad"``: pad to ``max(sizes)``, all_gather0, cut (differentiable through
    all_gather0's adjoint and the pad/cut). ``"auto"``/``"a2a"``: all_gather_v with
    the common prefix ``min(sizes)`` (or 0) in the all_gather.

    `stats` is ``(min(sizes), max(sizes), sum(sizes))`` when the caller has them
    (the size exchange reads them off the header table with the sizes): in a
    compiled graph they are then three plain symbols rather than expressions over
    every rank's length, whose tracing and partitioning cost grows faster than
    the world size.
    """
    sizes = list(sizes)
    torch._check(x.shape[0] == sizes[rank])
    strategy = resolve(strategy, size)
    if strategy == "pad":
        if all_equal(sizes):  # nothing to pad and nothing to cut
            return all_gather0(x, name, size)
        blocks, longest = _padded_blocks(x, sizes, stats, name, size)
        total = sum(sizes) if stats is None else stats[2]
        return cut_padding(blocks, sizes, longest, total)
    common = common_rows(strategy, sizes, None if stats is None else stats[0])
    for n in sizes:
        torch._check(n - common >= 0)
    return all_gather_v(x, sizes, common, name, size, rank, stats)


def gather_pieces(
    x: Tensor,
    sizes: Sequence[IntLike],
    strategy: str,
    name: str,
    size: int,
    rank: int,
    stats: Stats | None = None,
) -> list[Tensor]:
    """:func:`gather_rows` as one tensor per rank: views into what the collectives return.

    The padded layout hands out each rank's block of the all_gather as it is
    (rank i's rows start at ``i * max(sizes)``), so no piece's offset is a sum over
    the ranks before it: those sums make a trace quadratic in the world size.
    """
    sizes = list(sizes)
    if resolve(strategy, size) != "pad" or all_equal(sizes):
        return list(torch.split(gather_rows(x, sizes, strategy, name, size, rank, stats), sizes))
    torch._check(x.shape[0] == sizes[rank])
    blocks, longest = _padded_blocks(x, sizes, stats, name, size)
    for n in sizes:
        torch._check(longest - n >= 0)
    return [blocks.narrow(0, i * longest, n) for i, n in enumerate(sizes)]


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        sizes: list[IntLike],
        common: IntLike,
        name: str,
        size: int,
        rank: int,
        stats: Stats | None,
    ) -> Tensor:
        ctx.sizes, ctx.name, ctx.size, ctx.rank = _ctx_ints(sizes), name, size, rank
        ctx.stats = None if stats is None else tuple(_ctx_ints(stats))
        return _all_gather_v_impl(x, sizes, common, name, size, rank)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = reduce_scatter_v(grad, ctx.sizes, "sum", ctx.name, ctx.size, ctx.rank, ctx.stats)
        return g, None, None, None, None, None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        sizes: list[IntLike],
        op: str,
        name: str,
        size: int,
        rank: int,
        stats: Stats | None,
    ) -> Tensor:
        ctx.sizes, ctx.op, ctx.name, ctx.size, ctx.rank = _ctx_ints(sizes), op, name, size, rank
        ctx.stats = None if stats is None else tuple(_ctx_ints(stats))
        return _reduce_scatter_v_impl(x, sizes, op, name, size, rank)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = gather_rows(grad, ctx.sizes, "auto", ctx.name, ctx.size, ctx.rank, ctx.stats)
        return _scale_for_op("reduce_scatter", ctx.op, g, ctx.size), None, None, None, None, None, None


def all_gather_v(
    x: Tensor,
    sizes: Sequence[IntLike],
    common: IntLike,
    name: str,
    size: int,
    rank: int,
    stats: Stats | None = None,
) -> Tensor:
    """Ragged all-gather along dim 0: ``(sizes[rank], *R) -> (sum(sizes), *R)``.

    `stats` (``(min, max, sum)`` of `sizes`, or None) only serves the backward's gather.
    """
    return _AllGatherV.apply(x, list(sizes), common, name, size, rank, stats)


def reduce_scatter_v(
    x: Tensor,
    sizes: Sequence[IntLike],
    op: str,
    name: str,
    size: int,
    rank: int,
    stats: Stats | None = None,
) -> Tensor:
    """Ragged reduce-scatter along dim 0: ``(sum(sizes), *R) -> (sizes[rank], *R)``.

    `stats` (``(min, max, sum)`` of `sizes`, or None) only serves the backward's gather.
    """
    return _ReduceScatterV.apply(x, list(sizes), op, name, size, rank, stats)
