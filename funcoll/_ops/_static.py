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
import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .._base._checks import IntLike, check_dim, check_sizes
from .._base._config import checks_enabled
from .._base._group import Group, GroupLike
from .._collective import _prims
from .._collective._header import (
    DIM,
    DTYPE,
    DTYPES,
    GRAD,
    MAX_DIMS,
    NDIM,
    SHAPE,
    SIZE,
    TAIL,
    WIDTH,
    Header,
    after_read,
    header_row,
    same_op,
)
from .._collective._rows import from_rows, ints_on, pack, to_rows
from ._entry import Refusal, entry
from ._spec import A2A, AG, RS, STATIC, fixed, spec

__all__ = ["all_to_all_padded", "gather_padded"]


def _counts_tensor(
    opname: str, arg: str, value: object, count: int, bound: int | torch.SymInt, device: torch.device,
    per_rank: bool,
) -> Tensor:  # fmt: skip
    """`value` (`count` row counts, each in ``[0, bound]``) as an int64 tensor of shape (count,) on `device`.

    `value` is an integer tensor of `count` elements, or ints: a sequence of `count`
    of them when `per_rank`, else one. A tensor's range is checked on the device,
    after the header exchange; ints are range-checked here, before any communication.
    """
    checked = check_sizes(
        opname, arg, value, count if per_rank else None, bound=bound, bound_text=spec(opname).limit
    )
    if isinstance(checked, Tensor):
        # From another device (a CPU tensor for a CUDA x) the copy is queued, not waited for.
        return checked.reshape(count).to(device=device, dtype=torch.int64, non_blocking=True)
    ints = checked
    if not per_rank:
        return torch.full((1,), ints[0], dtype=torch.int64, device=device)  # a fill: no copy from the host
    return ints_on(device, ints)  # queued, not waited for


@functools.lru_cache(maxsize=256)
def _facts_on(device: torch.device, facts: tuple[int, ...]) -> Tensor:
    """The header's constant part on `device`, copied there once per distinct shape.

    A fresh ``torch.tensor(..., device=cuda)`` per call would copy from the host and
    wait for the device each time, and a copy from the host cannot be captured in a
    CUDA graph; after the first call with a shape, this is a cached tensor, so the
    op issues device work only. The copy itself is queued without waiting.
    """
    return torch.tensor(facts, dtype=torch.int64).to(device, non_blocking=True)


def _header(opname: str, x: Tensor, d: int, counts: Tensor, world: int) -> Tensor:
    """This rank's header row, in the layout every op's has (:mod:`funcoll._collective._header`).

    The common columns (the op, ndim, dtype, dim, the bound at `dim` in SIZE, the
    shape), then the tail: this rank's `counts`, then zeros. Every rank's row has
    ``WIDTH + TAIL * world`` ints, whatever the op, so a rank that calls another op
    at the same point is named, not a backend abort.
    """
    facts = tuple(header_row(opname.removeprefix("funcoll."), x, d))
    if torch.compiler.is_compiling():
        on_device = torch.tensor(facts, dtype=torch.int64, device=x.device)  # a constant of the graph
    else:
        on_device = _facts_on(x.device, facts)
    return torch.cat([on_device, counts, counts.new_zeros(TAIL * world - counts.shape[0])])


def _facts(table: Tensor) -> Tensor:
    """What every rank's row must agree on: the common columns but GRAD (requires_grad may differ)."""
    return torch.cat([table[:, :GRAD], table[:, GRAD + 1 : WIDTH]], 1)


def _check_table(opname: str, table: Tensor, n: int, bound: IntLike, x: Tensor, d: int) -> None:
    """Every rank's header row agrees and its `n` counts lie in ``[0, bound]``: a device-side assert.

    Every rank checks the same table, so either every rank fails or none does;
    nothing is read on the host.
    """
    lengths = table[:, WIDTH : WIDTH + n]
    facts = _facts(table)
    agree = (facts == facts[:1]).all() & (lengths >= 0).all() & (lengths <= bound).all()
    torch._assert_async(
        agree,
        f"{opname}: every rank's row counts must lie in [0, {spec(opname).limit}], and every rank's x must have the "
        f"same shape and dtype (this rank: {x.dtype}, {x.dim()}-d, dim={d})",
    )


_ARG = {"gather_padded": "length", "all_to_all_padded": "send_sizes"}  # the counts' argument


def _describe_row(row: list[int]) -> str:
    """A header row's facts (ndim, dtype, dim, shape) as ``2-d float32 (4, 3), dim 0``."""
    ndim, code, d = row[NDIM], row[DTYPE], row[DIM]
    dtype = str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else "other dtype"
    shape = [row[SIZE] if i == d else row[SHAPE + i] for i in range(min(ndim, MAX_DIMS))]
    return f"{ndim}-d {dtype} {tuple(shape)}, dim {d}"


def _check_on_host(opname: str, rows: list[list[int]], n: int, bound: int) -> None:
    """Raise funcoll's ValueError, the same on every rank, if the gathered header `rows` break the contract."""
    same_op(f"funcoll.{opname}", rows)
    facts = [row[:GRAD] + row[GRAD + 1 : WIDTH] for row in rows]
    if any(f != facts[0] for f in facts):
        each = "; ".join(f"rank {r}: {_describe_row(row)}" for r, row in enumerate(rows))
        raise ValueError(
            f"funcoll.{opname}: ranks disagree on `x` ({each}): every rank must pass the same "
            f"shape, dtype and dim"
        )
    for r, row in enumerate(rows):
        counts = row[WIDTH : WIDTH + n]
        if any(c < 0 or c > bound for c in counts):
            shown = counts[0] if n == 1 else counts
            raise ValueError(
                f"funcoll.{opname}: rank {r}'s `{_ARG[opname]}` {shown} is outside [0, {bound}] = "
                f"[0, {spec(opname).limit}]"
            )


@torch.library.custom_op("funcoll::check_counts", mutates_args=())
def _check_counts_op(table: Tensor, opname: str, n: int, bound: int) -> Tensor:
    rows = table.tolist()  # device-to-host sync: the price of funcoll.set_checks(True) on these ops
    _check_on_host(opname, rows, n, bound)
    return torch.empty((len(rows), 0), dtype=torch.uint8)


torch.fx.node.has_side_effect(torch.ops.funcoll.check_counts.default)  # the check: never dead code


@_check_counts_op.register_fake
def _check_counts_fake(table: Tensor, opname: str, n: int, bound: int) -> Tensor:
    # An unbacked length, world at run time: the data the check releases depends on it.
    return torch.empty((torch.library.get_ctx().new_dynamic_size(), 0), dtype=torch.uint8)


def _exchange(
    opname: str, x: Tensor, d: int, counts: Tensor, bound: IntLike, g: Group
) -> tuple[Tensor, IntLike | None]:
    """All-gather every rank's header on its own, and check it, before any data moves.

    Returns the ``(world, WIDTH + TAIL * world)`` int64 table on ``x.device``, its
    tail's first ``len(counts)`` columns every rank's counts (see :func:`_header`), and a zero
    that the check's host read returns (None with checks off), to release the
    data with (:func:`funcoll._collective._header.after_read`). With checks on the table is
    read on the host and a broken contract raises funcoll's ``ValueError`` on
    every rank, in eager and compiled code alike; with checks off (one rank, or
    empty rows) it is a device-side assert.
    """
    header = _header(opname, x, d, counts, g.size)
    table = (
        header.view(1, -1)
        if g.is_single
        else _prims.all_gather_impl(
            header,
            g.name,
            g.size,
            "the counts exchange",
            defer=not checks_enabled(),  # checked: read next
        ).view(g.size, -1)
    )
    if checks_enabled():
        checked = torch.ops.funcoll.check_counts(
            table, opname.removeprefix("funcoll."), counts.numel(), bound
        )
        # No torch._check that this is 0: the compiler would fold it, and the data
        # would no longer depend on the read.
        return table, checked.shape[0] - g.size
    _check_table(opname, table, counts.numel(), bound, x, d)
    return table, None


# The header travels in the data's collective as rows of the integer dtype of the
# data's element size, bit-cast to the data's dtype for the trip (see
# ``_prims.with_rows``). Each int64 of the header becomes 8 / itemsize pieces of
# itemsize bytes, by arithmetic on int64, so that no view between element sizes
# enters a compiled graph (inductor drops the copy such a view needs).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fused(xm: Tensor, g: Group) -> torch.dtype | None:
    """The integer dtype a header travels in beside `xm`'s rows, or None: a collective of its own.

    Its own collective with checks on (so that ranks whose shapes differ fail the
    check before the data moves), on one rank, for rows of no elements and for
    16-byte elements. Each condition is the same on every rank whose `x` agrees
    with the others, and the same in eager and compiled code.
    """
    if g.is_single or checks_enabled() or math.prod(xm.shape[1:]) == 0:
        return None
    return _INT_OF_SIZE.get(xm.element_size())


def _header_rows(header: Tensor, dtype: torch.dtype, row_shape: Sequence[IntLike]) -> Tensor:
    """The int64 `header` as rows of `row_shape` in the integer `dtype`, zero-padded: ``(k, *row_shape)``.

    The last of the k rows is all zeros whatever the header, which a zero of every
    dtype bit-casts to: :func:`_move` returns its place as the row the padding is
    copied from.
    """
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    if bits == 64:
        pieces = header
    else:
        shifts = torch.arange(0, 64, bits, dtype=torch.int64, device=header.device)
        pieces = (header.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # in [0, 2 ** bits)
        if dtype != torch.uint8:  # into the signed range, where the cast is exact
            pieces = pieces - (pieces >= (1 << (bits - 1))).to(torch.int64) * (1 << bits)
        pieces = pieces.to(dtype).reshape(-1)
    row = math.prod(row_shape)
    n = pieces.shape[0]
    # The last row all zeros: the pack copies padding from it. A row as wide as the header
    # (every real hidden size) holds it: for a symbolic row that is a guard on its range,
    # not its value, so one graph serves every such width and the blocks' sizes stay free
    # of the ceiling division, which costs seconds of symbolic reasoning in each of their views.
    k = 2 if guard_or_false(row >= n) else -(-n // row) + 1
    return torch.cat([pieces, pieces.new_zeros(k * row - n)]).view(k, *row_shape)


def _move(
    opname: str, x: Tensor, d: int, xm: Tensor, counts: Tensor, bound: IntLike, g: Group,
    plain: Callable[[Tensor], Tensor], with_rows: Callable[[Tensor, Tensor], Tensor],
) -> tuple[Tensor, IntLike, Tensor, IntLike | None]:  # fmt: skip
    """Move `xm`'s blocks and the counts header, check the header: (blocks, block stride, table, zero row).

    `plain` moves the blocks alone, after the header went on its own; `with_rows`
    moves them with the header's rows after each block, in one collective (see
    :func:`_fused`). Each rank's block in the result is `bound` data rows, then
    the header's rows when they came along: the stride. The table is every
    rank's header, checked on the device. The zero row is the index of a row of
    the blocks that holds zeros (the header's last), or None when the header did
    not come along.
    """
    twin = _fused(xm, g)
    if twin is None:  # the header first, on its own
        table, zero = _exchange(opname, x, d, counts, bound, g)
        if zero is not None:  # checked: the data travels after the check
            xm = after_read(xm, zero)
        return (xm if g.is_single else plain(xm)), bound, table, None
    header = _header(opname, x, d, counts, g.size)
    extra = _header_rows(header, twin, xm.shape[1:])
    blocks = with_rows(xm, extra)
    table = _read_header(_tails(blocks, twin, g.size, bound, extra.shape[0]), header.shape[0])
    _check_table(opname, table, counts.numel(), bound, x, d)
    stride = bound + extra.shape[0]
    return blocks, stride, table, stride - 1


def _tails(blocks: Tensor, dtype: torch.dtype, world: int, n: IntLike, k: int) -> Tensor:
    """The k header rows after each rank's `n` data rows of `blocks`, bit-cast back: ``(world, k, *R)``."""
    return blocks.detach().view(dtype).view(world, n + k, *blocks.shape[1:]).narrow(1, n, k)


def _read_header(rows: Tensor, length: int) -> Tensor:
    """:func:`_header_rows` back: ``(world, k, *R)`` rows -> the ``(world, length)`` int64 table."""
    bits = 8 * rows.element_size()
    per = 64 // bits
    pieces = rows.reshape(rows.shape[0], -1).narrow(1, 0, length * per).to(torch.int64)
    if per == 1:
        return pieces
    pieces = (pieces & ((1 << bits) - 1)).view(rows.shape[0], length, per)
    top = pieces[..., -1]
    value = (top - (top >= (1 << (bits - 1))).to(torch.int64) * (1 << bits)) * (1 << (bits * (per - 1)))
    for i in range(per - 1):
        value = value + pieces[..., i] * (1 << (bits * i))
    return value


_PADDED = "its result is padded to a static length"
# The header's tail carries the counts (`length`, or `send_sizes`), read and checked on the
# device by the op itself: nothing of it is read on the host unless checks are on.
_COUNTS = "the padded `dim`"


@entry(
    "gather_padded",
    STATIC,
    header=Header(varying_dim=_COUNTS),
    limit="x.shape[dim]",
    collectives=fixed({AG: 1}, {RS: 1}),  # the padded rows, the counts header's rows after them
    refuse=Refusal(_PADDED, "funcoll.all_gather(x, dim)"),
)
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
    padding travels on the wire, in one all_gather of ``x`` that also carries a
    small int64 header (every rank's length and shape) in a few rows after each
    rank's block; pass ``length`` on ``x``'s device.

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
        `length` outside ``[0, B]`` is a ValueError. A tensor `length` outside it
        fails a device-side assert (``torch._assert_async``) on every rank after
        the all_gather, before any row is read: a RuntimeError (it does not wait
        for the device on CUDA, so it surfaces asynchronously there). Ranks whose
        bound, shape or dtype differ send blocks of different sizes, which the
        backend refuses as for the even ops. With ``funcoll.set_checks(True)``
        the header travels first, on its own, and is read on the host (one
        device-to-host sync): every rank raises the same ``ValueError`` naming
        the rank and the value at fault, before any data moves, in compiled code
        as in eager (docs/errors.md).

    Backward: the adjoint. Each rank puts its gradient's rows back in the padded
    layout (rank i's rows at ``[i * B, i * B + sizes[i])``, zeros on padding) and a
    ``reduce_scatter`` (sum) gives rank r the sum over ranks of its rows; the
    gradient of the padding rows of ``x`` is zero.

    A DTensor `x` is refused: a padded buffer has no placement (docs/dtensor.md).

    Example (2 ranks, B = 3)::

        # rank 0: x = [[1], [2], [0]], length = 2   rank 1: x = [[5], [9], [9]], length = 1
        y, sizes = gather_padded(x, length)
        # both: y = [[1], [2], [5], [0], [0], [0]], sizes = [2, 1]
        y[: sizes.sum()]   # both: [[1], [2], [5]]   (gather's result; rank 1's padding rows never show)
    """
    opname, g = "funcoll.gather_padded", cast(Group, group)
    d = check_dim(opname, x, dim)
    bound = x.shape[d]
    mine = _counts_tensor(opname, "length", length, 1, bound, x.device, per_rank=False)
    xm = to_rows(x, d)
    blocks, stride, table, zero_row = _move(
        opname, x, d, xm, mine, bound, g,
        lambda t: _prims.all_gather_p(t, g.name, g.size),
        lambda t, extra: _prims.all_gather_blocks_p(t, extra, g.name, g.size),
    )  # fmt: skip
    sizes = table[:, WIDTH]  # the tail: every rank's length
    return from_rows(
        pack(blocks, sizes, stride, g.size * bound, zero_row=zero_row), x.dtype, d
    ), sizes.clone()


@entry(
    "all_to_all_padded",
    STATIC,
    header=Header(varying_dim=_COUNTS),
    limit="x.shape[dim] // world",
    collectives=fixed({A2A: 1}, {A2A: 1}),  # the blocks, the counts header's rows after each
    refuse=Refusal(_PADDED, "funcoll.all_to_all"),
)
def all_to_all_padded(
    x: Tensor, send_sizes: Tensor | Sequence[int], dim: int = 0, *, group: GroupLike = None
) -> tuple[Tensor, Tensor]:
    """Uneven all-to-all with static shapes: one block of capacity ``C`` per rank, the sizes on the device.

    Ragged data model: along `dim`, ``x`` holds ``world`` blocks of ``C = x.shape[dim]
    // world`` rows, the same ``C`` on every rank (MoE code calls it the capacity).
    Block j goes to rank j, and its first ``send_sizes[j]`` rows (any ``0 <= n <= C``)
    are data; the rest are padding, whose values are ignored. Rank r receives
    rank i's ``send_sizes[r]`` data rows for every i, in rank order, as from
    :func:`funcoll.all_to_all_v`. All other dims, ``C``, the dtype and the ndim
    agree on every rank.

    Unlike :func:`funcoll.all_to_all_v`, nothing is read on the host: the result's
    shape is ``x``'s, so the op runs inside CUDA graphs and static compiled graphs,
    and never recompiles when the sizes change. The padding travels on the wire,
    in one all_to_all of ``x`` whose every block also carries its sender's small
    int64 header (``16 + 2 * world`` ints, every op's header layout) in a few rows after it; pass `send_sizes`
    as a tensor on ``x``'s device.

    Args:
        x: this rank's tensor, of shape ``(..., world * C, ...)`` with the blocks at `dim`.
        send_sizes: how many data rows each block holds: an integer tensor of
            ``world`` elements (on ``x``'s device, or a CPU tensor, copied without a
            wait), or ``world`` ints.
        dim: the dim of the blocks (negative counts from the end).
        group: the communicator.

    Returns:
        ``(y, recv_sizes)``. ``y`` has ``x``'s shape: the rows received from every
        rank, in rank order, in its first ``sum(recv_sizes)`` rows along `dim`, zeros
        after them. ``recv_sizes`` is an int64 tensor of shape ``(world,)`` on
        ``x``'s device: how many rows came from each rank.

    Raises:
        ValueError, TypeError: bad arguments, before any communication: a
        ``x.shape[dim]`` that ``world`` does not divide, a `send_sizes` of the wrong
        length or type, an int outside ``[0, C]``. A tensor entry outside it
        fails a device-side assert (``torch._assert_async``) on every rank after
        the all_to_all, before any row is read (asynchronously on CUDA). Ranks
        whose ``C``, shape or dtype differ, and checked mode
        (``funcoll.set_checks(True)``: a ``ValueError`` from a host read instead
        of the assert): as for :func:`gather_padded`.

    Backward: the adjoint. Each rank puts its gradient's rows back in one block of
    ``C`` rows per source rank (zeros on padding) and an all_to_all returns every
    block to its sender; the gradient of the padding rows of ``x`` is zero.

    A DTensor `x` is refused: a padded buffer has no placement (docs/dtensor.md).

    Example (2 ranks, C = 2)::

        # rank 0: x = [[1], [2], [3], [0]], send_sizes = [2, 1]
        # rank 1: x = [[4], [9], [5], [6]], send_sizes = [1, 2]
        y, recv_sizes = all_to_all_padded(x, send_sizes)
        # rank 0: y = [[1], [2], [4], [0]], recv_sizes = [2, 1]
        # rank 1: y = [[3], [5], [6], [0]], recv_sizes = [1, 2]
    """
    opname, g = "funcoll.all_to_all_padded", cast(Group, group)
    d = check_dim(opname, x, dim)
    rows = x.shape[d]
    if isinstance(rows, int) and rows % g.size:
        raise ValueError(
            f"{opname}: `x` has {rows} rows along dim {d}, which {g.size} ranks do not divide into blocks "
            f"of one capacity"
        )
    torch._check(rows % g.size == 0)
    cap = rows // g.size
    send = _counts_tensor(opname, "send_sizes", send_sizes, g.size, cap, x.device, per_rank=True)
    xm = to_rows(x, d)
    split = [cap] * g.size
    blocks, stride, table, zero_row = _move(
        opname, x, d, xm, send, cap, g,
        lambda t: _prims.all_to_all_p(t, split, split, g.name),
        lambda t, extra: _prims.all_to_all_blocks_p(t, extra, g.name, g.size),
    )  # fmt: skip
    recv_sizes = table[:, WIDTH + g.rank]  # the tail: rank i's count for this rank
    y = pack(blocks, recv_sizes, stride, g.size * cap, zero_row=zero_row)
    return from_rows(y, x.dtype, d), recv_sizes.clone()
