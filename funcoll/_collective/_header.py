"""The size exchange of the ragged ops, which doubles as a check that ranks agree.

Every ragged op starts with one small ``all_gather`` of a fixed-width int64 header
per rank. It carries what the op needs (this rank's length along the ragged dim,
and for all_to_all_v the send sizes) and what lets every rank check the others: the
op, ndim, dtype, dim, the rest of the shape, whether `x` requires grad, and the
op's other arguments. The exchange is a collective every rank joins anyway, so the
check costs no extra round trip, and ranks that disagree all raise the same
``ValueError`` instead of a backend abort, garbage or a hang. The even ops send the
same row when they check (``check_only``), and the static ops (``_ops/_static.py``)
send it beside their data, their counts in its tail, checked on the device.

Reading the table on the host is the single device-to-host sync of a ragged call.
In eager code that sync is one list conversion; in a compiled graph it happens inside the
custom op ``funcoll::host_ints``, whose outputs carry the ints as the lengths of
zero-width tensors, so the sizes become unbacked SymInts (see ``host_ints``).

A dynamo frame may create unbacked sizes from an op's output shape only with
``torch._dynamo.config.capture_dynamic_output_shape_ops`` on (``fullgraph=True``
turns it on for its frame), and dynamo reads the setting when a frame starts,
so it cannot be switched on around the op. funcoll turns it on when it is
imported, unless the environment says ``FUNCOLL_DYNAMO_CONFIG=0``: without it, a
ragged op in a frame compiled without ``fullgraph=True`` breaks the graph at its
size exchange. docs/compile.md says what else this changes.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._base._checks import REDUCE_OPS, IntLike, check_equal, check_sizes
from .._base._config import check_due, checks_enabled, fingerprints
from .._base._group import Group, group_of, rank_of, size_of
from .._base._quant import Wire, pair_code, show_pair
from .._base._strategy import STRATEGIES
from .._base._sym import Stats, max_of, min_of
from . import _issue
from ._faults import OP_NAMES, mark_unchecked, op_code
from ._rows import ints_on

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
MAX_DIMS = 8
# Column layout of one rank's row.
OP, NDIM, DTYPE, DIM, GRAD, SIZE, ARG0, ARG1 = range(8)
SHAPE = 8  # MAX_DIMS columns: the shape with the ragged dim set to 0
WIDTH = SHAPE + MAX_DIMS
TAIL = 2  # then TAIL * world columns: per-rank sizes (see exchange)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def shape_columns(x: Tensor, dim: int) -> list:
    shape = [0 if i == dim else s for i, s in enumerate(x.shape)]
    if len(shape) > MAX_DIMS:  # fold the tail into the last column: a mismatch still shows
        tail = 0
        for s in shape[MAX_DIMS - 1 :]:
            tail = (tail * 1_000_003 + int(s)) % (1 << 61)
        shape = [*shape[: MAX_DIMS - 1], tail]
    return shape + [0] * (MAX_DIMS - len(shape))


def header_row(
    key: str, x: Tensor, dim: int | None, args: tuple[int, int] = (0, 0), ndim: int | None = None
) -> list:
    """This rank's common columns (OP to the shape), WIDTH ints: how every op's header row starts.

    `key`: the op's registered name. `dim`: the dim whose length SIZE carries and
    whose shape column is 0; None: none (SIZE 0, every shape column filled). `args`:
    ARG0 and ARG1. `ndim`: as :func:`exchange`'s.
    """
    d = -1 if dim is None else dim
    return [
        CODES[key], x.dim() if ndim is None else ndim, dtype_code(x.dtype), d, int(x.requires_grad),
        0 if dim is None else x.shape[dim], args[0], args[1], *shape_columns(x, d),
    ]  # fmt: skip


def exchange(
    key: str,
    x: Tensor,
    dim: int | None,
    g: Group,
    args: tuple[int, int] = (0, 0),
    sizes: Tensor | None = None,
    ndim: int | None = None,
) -> tuple[Tensor, list]:
    """All-gather the headers, check them, and return (table on x.device, host ints).

    Every row is ``WIDTH + 2 * world`` ints whatever the op, so ranks that call
    different ops still exchange matching headers and get a clear error. The
    last ``2 * world`` columns carry `sizes` (all_to_all_v's send sizes, the
    ragged reduce_scatter's slice sizes, all_to_all's gather then scatter sizes,
    ppermute's destination of every rank), then zeros. The host ints returned are the sizes
    along `dim` of every rank; for all_to_all_v this rank's send sizes followed by
    its receive sizes; for reduce_scatter the (checked) slice sizes. Except for
    all_to_all_v, three more follow: the min, max and sum of those sizes (see
    ``split_stats``), read off the table with them. They are Python ints in eager
    mode and unbacked SymInts in a compiled graph. With `dim` None every dim of
    `x` must agree (an even op's check): SIZE is 0 and the host ints are
    ``[x.dim()]`` as this rank's header row holds it. `ndim` is what the
    caller passed when it differs from ``x.dim()`` (a 0-d tensor gathered as one row).
    """
    header = ints_on(x.device, header_row(key, x, dim, args, ndim))
    if sizes is None:
        tail = header.new_zeros(TAIL * g.size)
    else:
        tail = sizes.to(device=x.device, dtype=torch.int64).reshape(-1)
        tail = torch.cat([tail, tail.new_zeros(TAIL * g.size - tail.shape[0])])
    step = "the cross-rank check" if HEADERS[key].check_only else "the size exchange"
    return _gather_rows(torch.cat([header, tail]), key, g, step)


def _gather_rows(header: Tensor, key: str, g: Group, step: str) -> tuple[Tensor, list]:
    """All-gather one header row per rank, check the table, and return it with the host ints."""
    # The host reads the table next (host_ints): wait now, not at that first use.
    table = _issue.gather_rows(header, g.name, g.size, step).view(g.size, -1)
    return table, host_ints(table, key, g.rank)


def host_ints(t: Tensor, key: str = "", rank: int = 0) -> list[IntLike]:
    """The ints a ragged call needs on the host, from a gathered header table or a sizes tensor.

    With a `key` (the op's name in ``HEADERS``), `t` is the gathered header table: it is checked (raising on
    every rank if they disagree) and reduced to the sizes the op needs. Without,
    `t` is a 1-d int tensor of sizes, returned as is.

    Eager: Python ints, read with one host sync. Compiled: unbacked SymInts.
    The custom op ``funcoll::host_ints`` returns one zero-width tensor per int, of
    shape ``(int, 0)``, and its fake gives each a fresh unbacked size; the sizes
    are read off the shapes, so no scalar read (and no sync of its own) enters the graph.
    """
    if not torch.compiler.is_compiling():
        return _read(t, key, rank)
    ints = [c.shape[0] for c in torch.ops.funcoll.host_ints(t, key, rank)]
    for n in ints:
        torch._check(n >= 0)
    return ints


def _read(t: Tensor, key: str, rank: int) -> list[int]:
    values = t.tolist()  # device-to-host sync (none for a CPU tensor): the one per ragged call
    if not key:
        return values
    _check_rows(key, values, rank)
    return HEADERS[key].reads.read(values, rank)


def _n_ints(key: str, world: int) -> int:
    """How many ints `_read` returns for the op `key` at `world` ranks."""
    return world if not key else HEADERS[key].reads.count(world)


def split_stats(ints: list[IntLike], world: int) -> tuple[list[IntLike], Stats]:
    """Host ints of a ragged gather or reduce_scatter as (sizes, (min, max, sum of sizes))."""
    sizes, (lo, hi, total) = ints[:world], ints[world:]
    if torch.compiler.is_compiling():  # fresh unbacked symbols: say how they relate
        torch._check(lo <= hi)
        torch._check(hi <= total)
    return sizes, (lo, hi, total)


@torch.library.custom_op("funcoll::host_ints", mutates_args=())
def _host_ints_op(t: Tensor, key: str, rank: int) -> list[Tensor]:
    return [torch.empty((n, 0), dtype=torch.uint8) for n in _read(t, key, rank)]


# The read is the check: never dead code, even where nothing reads its outputs (torch
# 2.11 dropped an even op's check when only a runtime assert used its ints).
torch.fx.node.has_side_effect(torch.ops.funcoll.host_ints.default)


@_host_ints_op.register_fake
def _host_ints_fake(t: Tensor, key: str, rank: int) -> list[Tensor]:
    ctx = torch.library.get_ctx()
    n = _n_ints(key, t.shape[0])
    return [torch.empty((ctx.new_dynamic_size(), 0), dtype=torch.uint8, device="cpu") for _ in range(n)]


def describe(row: list[int]) -> str:
    ndim = row[NDIM]
    shape = [row[SHAPE + i] if i != row[DIM] else row[SIZE] for i in range(min(ndim, MAX_DIMS))]
    dtype = DTYPES[row[DTYPE]] if row[DTYPE] < len(DTYPES) else "other dtype"
    return f"shape {tuple(shape)} {dtype}".replace("torch.", "")


def disagree(opname: str, rows: list[list[int]], what: str, key: Callable[[list[int]], object],
              show: Callable[[list[int]], object]) -> None:  # fmt: skip
    """Raise on every rank if the ranks' rows differ in `key`, showing each rank's `show`."""
    if len({key(r) for r in rows}) > 1:
        detail = ", ".join(f"rank {i}: {show(r)}" for i, r in enumerate(rows))
        raise ValueError(f"{opname}: ranks disagree on {what} ({detail})")


def same_op(opname: str, rows: list[list[int]]) -> None:
    """Raise on every rank if the ranks' rows come from different ops (the OP column)."""
    if len({r[OP] for r in rows}) > 1:
        called = [_BY_CODE.get(r[OP]) for r in rows]
        names = ", ".join(f"rank {i}: {h.name if h else '?'}" for i, h in enumerate(called))
        kind = "ragged ops" if all(h is None or not h.check_only for h in called) else "ops"
        raise ValueError(f"{opname}: ranks called different {kind} at the same point ({names})")


def _check_rows(key: str, rows: list[list[int]], rank: int) -> None:
    opname = f"funcoll.{key}"
    spec = HEADERS[key]
    if any(r[OP] == CODES["collective"] for r in rows):
        _check_collectives(rows)
        return
    same_op(opname, rows)
    dim_name = spec.varying_dim
    disagree(opname, rows, "`x`.ndim", lambda r: r[NDIM], lambda r: f"{r[NDIM]} ({describe(r)})")
    disagree(opname, rows, dim_name, lambda r: r[DIM], lambda r: f"{r[DIM]} ({describe(r)})")
    disagree(
        opname,
        rows,
        "`x`.dtype",
        lambda r: r[DTYPE],
        lambda r: describe(r).split()[-1] + f" ({describe(r)})",
    )
    rest = "" if rows[0][DIM] < 0 else f" apart from {dim_name}"
    disagree(opname, rows, f"the shape of `x`{rest}", lambda r: tuple(r[SHAPE:WIDTH]), describe)
    for col, arg in zip((ARG0, ARG1), spec.args, strict=True):
        if arg is not None:
            disagree(
                opname, rows, f"`{arg.name}`", lambda r, c=col: r[c], lambda r, c=col, a=arg: a.show(r[c])
            )
    if len({r[GRAD] for r in rows}) > 1:
        on = [i for i, r in enumerate(rows) if r[GRAD]]
        off = [i for i, r in enumerate(rows) if not r[GRAD]]
        raise ValueError(
            f"{opname}: `x` requires grad on ranks {on} but not on ranks {off}; the backward is a "
            f"collective that every rank must join, so all ranks or none must require grad"
        )
    for check in spec.checks:
        check(opname, rows)


# ------------------------------------------------------------ what each op's header says
@dataclass(frozen=True)
class Arg:
    """An op argument that travels in the ARG0 or ARG1 column: its name and how to show a code."""

    name: str
    show: Callable[[int], object] = lambda code: code


def named(values: tuple) -> Callable[[int], object]:
    return lambda code: repr(values[code]) if 0 <= code < len(values) else code


GRAD_SCALES = (None, "up", "down")
DST = Arg("dst", lambda code: None if code < 0 else code)
STRATEGY = Arg("strategy", named(STRATEGIES))
REDUCE_OP = Arg("op", named(REDUCE_OPS))
SIZES_GIVEN = Arg("sizes", lambda c: "given" if c else "None")  # whether `sizes` was passed


@dataclass(frozen=True)
class Reader:
    """Which host ints a call reads off the gathered table, and how many (`count(world)`)."""

    read: Callable[[list[list[int]], int], list[int]]
    count: Callable[[int], int]


def with_stats(sizes: list[int]) -> list[int]:
    """`sizes`, then their min, max and sum (see split_stats)."""
    return [*sizes, min(sizes), max(sizes), sum(sizes)]


LENGTHS = Reader(lambda rows, rank: with_stats([r[SIZE] for r in rows]), lambda w: w + 3)
NDIM_ONLY = Reader(lambda rows, rank: [rows[rank][NDIM]], lambda w: 1)  # an even op's check


def tails(rows: list[list[int]], first: int = 0) -> list[list[int]]:
    """Every rank's `first`-th block of `world` tail columns."""
    world = len(rows)
    return [r[WIDTH + first * world : WIDTH + (first + 1) * world] for r in rows]


def same_tails(opname: str, rows: list[list[int]], message: str, first: int = 0,
               show: Callable[[list[int]], object] = lambda t: t) -> None:  # fmt: skip
    """Raise on every rank unless the ranks' `first`-th tail blocks agree; `message` formats {detail} and {dim}."""
    blocks = tails(rows, first)
    if len({tuple(t) for t in blocks}) > 1:
        detail = ", ".join(f"rank {i}: {show(t)}" for i, t in enumerate(blocks))
        raise ValueError(f"{opname}: {message.format(detail=detail, dim=rows[0][DIM])}")


def check_given_lengths(opname: str, rows: list[list[int]]) -> None:
    """A ragged gather called with `sizes`: the tail holds the list, then a 1 ("given")."""
    world = len(rows)
    given = [r[WIDTH + world] for r in rows]
    if not any(given):
        return
    if not all(given):
        on, off = [i for i, f in enumerate(given) if f], [i for i, f in enumerate(given) if not f]
        raise ValueError(f"{opname}: `sizes` was given on ranks {on} but not on ranks {off}")
    same_tails(opname, rows, "ranks disagree on `sizes` ({detail})")
    lengths = [r[SIZE] for r in rows]
    if tails(rows)[0] != lengths:
        raise ValueError(
            f"{opname}: `sizes`={tails(rows)[0]}, but the ranks hold {lengths} along dim {rows[0][DIM]}"
        )


def check_same_sizes(opname: str, rows: list[list[int]]) -> None:
    """Every rank passed the same `sizes` (the first tail block)."""
    same_tails(opname, rows, "ranks disagree on `sizes` ({detail})")


@dataclass(frozen=True)
class Header:
    """What one op's header carries beyond the common columns, and how it is read and checked.

    An op declares its header in its definition (``@entry(..., header=Header(...))``),
    which registers it under the op's name (:func:`register_header`). `args`: what
    ARG0 and ARG1 carry (None: nothing). `reads`: the host ints the call gets back.
    `varying_dim`: what the dim whose length may differ between ranks is called in
    errors. `checks`: what the op checks across ranks beyond the common columns (its
    tail of per-rank sizes). `check_only`: an even op, which exchanges a header only
    with ``funcoll.set_checks(True)``.
    """

    args: tuple[Arg | None, Arg | None] = (None, None)
    reads: Reader = LENGTHS
    varying_dim: str = "the ragged `dim`"
    checks: tuple[Callable[[str, list[list[int]]], None], ...] = ()
    check_only: bool = False
    name: str = ""


# Every registered header by name, and by the code its rows carry in the OP column.
HEADERS: dict[str, Header] = {}
CODES: dict[str, int] = {}
_BY_CODE: dict[int, Header] = {}


def register_header(name: str, header: Header) -> Header:
    """Register the header of op `name`; its code is the CRC-32 of the name.

    The code is the same on every rank whatever order the modules were imported in,
    and stays when ops are added or removed.
    """
    code = zlib.crc32(name.encode())
    if name in HEADERS or code in _BY_CODE:
        raise ValueError(
            f"funcoll: a second header for {name!r} (or a CRC-32 clash with {_BY_CODE[code].name!r})"
        )
    header = replace(header, name=name)
    HEADERS[name], CODES[name], _BY_CODE[code] = header, code, header
    return header


# Not an op's: the row every data collective sends under checks (check_collective).
register_header("collective", Header(reads=NDIM_ONLY, check_only=True))


# ----------------------------------------------------- every collective, under checks
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def _group_code(group_name: str) -> int:
    """A group name as an int every rank computes alike: the number c10d names it by, else a CRC."""
    name = group_of(group_name)
    return int(name) if name.isdigit() and len(name) < 18 else -1 - zlib.crc32(name.encode())


def _show_group(code: int) -> str:
    return f"group {str(code)!r}" if code >= 0 else f"the group whose name has CRC-32 {-1 - code}"


def _show_collective(row: list[int]) -> str:
    """What a header row says a rank is about to issue, for the error."""
    if row[OP] != CODES["collective"]:
        name = _BY_CODE[row[OP]].name if row[OP] in _BY_CODE else "?"
        return f"the header exchange of funcoll.{name}"
    kind = COLLECTIVES[row[SIZE]] if 0 <= row[SIZE] < len(COLLECTIVES) else "?"
    op = f"funcoll.{OP_NAMES[row[ARG1]]}" if 0 <= row[ARG1] < len(OP_NAMES) else "funcoll"
    shape = [("*" if i == row[DIM] else row[SHAPE + i]) for i in range(min(row[NDIM], MAX_DIMS))]
    dtype = DTYPES[row[DTYPE]] if row[DTYPE] < len(DTYPES) else "other dtype"
    shown = f"{kind} of {dtype} {tuple(shape)}".replace("torch.", "").replace("'*'", "*")
    if row[DIM] == 0:  # an all_to_all: the rows it sends to and receives from each rank
        world = (len(row) - WIDTH) // 2
        shown += f" sending {row[WIDTH : WIDTH + world]} receiving {row[WIDTH + world :]}"
    at = f", collective {row[GRAD]} of its compiled graph" if row[GRAD] >= 0 else ""
    return f"{shown} on {_show_group(row[ARG0])} in {op}{at}"


def _check_collectives(rows: list[list[int]]) -> None:
    """Raise on every rank unless every rank's next collective is the same one (rows of check_collective)."""
    # Which collective of its graph each is (GRAD's column: -1 in eager code, which any
    # position matches), then all but the op that issues it (ARG1: only shown).
    positions = {r[GRAD] for r in rows} - {-1}
    same = (
        len(positions) <= 1
        and len({(*r[:GRAD], *r[GRAD + 1 : ARG1], *r[ARG1 + 1 : WIDTH]) for r in rows}) == 1
    )
    if same and rows[0][DIM] == 0:  # all_to_all: what rank i receives from j is what j sends to i
        world = len(rows)
        same = all(
            rows[i][WIDTH + world + j] == rows[j][WIDTH + i] for i in range(world) for j in range(world)
        )
    if not same:
        detail = "; ".join(f"rank {i}: {_show_collective(r)}" for i, r in enumerate(rows))
        raise ValueError(
            f"funcoll: ranks issue different collectives at the same point ({detail}). Each would pair "
            f"with another rank's different one: a backend abort, a hang or garbage without this check. "
            f"A compiled step whose graphs differ between ranks is the usual cause (docs/errors.md)"
        )


def check_collective(
    collective: str, group_name: str, x: Tensor, splits: tuple[Sequence[IntLike], Sequence[IntLike]] | None
) -> Tensor:
    """With checks on: exchange what this rank's next collective is; raise on every rank if they differ.

    Every rank sends one header row (the same width as the ops' headers, so that
    it pairs with whatever the others issue): the collective, its group, the op
    issuing it, the payload's dtype and shape, and an all_to_all's send and
    receive splits. Returns `x`, made to depend on the check's read in a compiled
    graph (:func:`after_read`), so that no pass issues the collective before it.
    In a compiled graph the header comes after `x` (``funcoll::after``), so that
    it stays beside its collective: in the backward graph when `x` is a gradient,
    and in the same order on every rank.
    """
    name = group_of(group_name)
    g = Group(name=name, size=size_of(name), rank=rank_of(name))
    if g.is_single:
        return x
    a2a = collective == "all_to_all"
    group, _, k = group_name.rpartition(":funcoll")  # a compiled graph's k-th collective (wire_name)
    position = int(k) if group and k.isdigit() else -1
    row = [
        CODES["collective"], x.dim(), dtype_code(x.dtype), 0 if a2a else -1, position,
        COLLECTIVES.index(collective), _group_code(group_name), op_code(), *shape_columns(x, 0 if a2a else -1),
    ]  # fmt: skip
    tail = [*splits[0], *splits[1]] if a2a and splits is not None else [0] * (TAIL * g.size)
    header = ints_on(x.device, [*row, *tail])
    if torch.compiler.is_compiling():  # after x: where x goes (a backward's graph), the header goes
        header = torch.ops.funcoll.after(header, x)
    table = _issue.gather_rows(header, g.name, g.size, "the collective check").view(g.size, -1)
    if not torch.compiler.is_compiling():
        _read(table, "collective", g.rank)  # a device-to-host sync (none for a CPU tensor): the check's read
        return x
    return after_read(x, torch.ops.funcoll.check_table(table, "collective", g.rank))


# `header`, computed after `x`: an opaque op, so that no compiler pass separates a header
# from the payload it describes (a constant header is free to move: inductor's overlap
# passes raised the headers of independent collectives in an order that differed between
# ranks, and AOT autograd's partitioner may put a constant in another graph). It copies
# the header's few ints and reads nothing of `x`.
@torch.library.custom_op("funcoll::after", mutates_args=())
def _after(header: Tensor, x: Tensor) -> Tensor:
    return header.clone()


@_after.register_fake
def _after_fake(header: Tensor, x: Tensor) -> Tensor:
    return torch.empty_like(header)


# A compiled graph's read of a collective's check. Unlike host_ints it returns no sizes
# (an autograd.Function's forward may not create unbacked ones), but a zero on the table's
# device, computed after the check, which the collective's payload then depends on.
@torch.library.custom_op("funcoll::check_table", mutates_args=())
def _check_table(t: Tensor, key: str, rank: int) -> Tensor:
    _read(t, key, rank)  # a device-to-host sync (none for a CPU tensor): the check's read; raises
    return t.new_zeros(())


torch.fx.node.has_side_effect(torch.ops.funcoll.check_table.default)


@_check_table.register_fake
def _check_table_fake(t: Tensor, key: str, rank: int) -> Tensor:
    return t.new_empty(())


def check_agreement(
    key: str,
    x: Tensor,
    g: Group,
    dim: int | None = None,
    args: tuple[int, int] = (0, 0),
    sizes: Sequence[IntLike] | None = None,
) -> Tensor:
    """On a checked call (:func:`~funcoll._base._config.check_due`): exchange a header, raise on every rank if the ranks disagree.

    For the even ops, before their data moves. `dim` is a dim whose length may
    differ between ranks (all_to_all's gather dim), None when every dim must
    agree; `args` the op's arguments that must agree, `sizes` what the op expects
    every rank's length along `dim` to be. Costs one small all_gather and one
    device-to-host read; does nothing on an unchecked call or on one rank.

    Returns `x`, for the op to send. In a compiled graph that is `x` minus a
    number the check's read returns, zero at run time (the read raised otherwise)
    and unknown to the compiler, so exactly `x` (:func:`after_read`): the data
    collective then depends on the read, and no pass issues it before
    the check has run (inductor's overlap passes raise collectives as far as
    their inputs allow, and torch 2.11 orders the graph so even without them).
    It costs one pass over the payload, fused into the op that produces it where
    there is one.
    """
    if g.is_single:
        return x
    if not check_due(key, g.name):
        if fingerprints() and not torch.compiler.is_compiling():
            # Its data collectives carry a fingerprint of what the header would compare
            # (_fingerprint): the op, its arguments, x's dtype and shape (but along `dim`),
            # `sizes` (all_to_all's hold this rank's pieces: its data's fingerprints cover them).
            shape = tuple("*" if i == dim else int(n) for i, n in enumerate(x.shape))
            same = None if key == "all_to_all" or sizes is None else [int(s) for s in sizes]
            shown = f"{key} of {x.dtype} {tuple(x.shape)}".replace("torch.", "")
            mark_unchecked(repr((key, args, str(x.dtype), shape, same)), shown)
        return x
    tail = None if sizes is None else torch.tensor(list(sizes), dtype=torch.int64)
    _, ints = exchange(key, x, dim, g, args, tail)
    if not torch.compiler.is_compiling():
        return x
    # A check-only op reads back x.dim(); the even reduce_scatter, whose header is
    # the ragged one's, its first slice size. No torch._check that they are equal:
    # the compiler would fold the difference to 0, and the data would no longer
    # depend on the read.
    first = x.dim() if HEADERS[key].check_only else next(iter(sizes or [0]))
    return after_read(x, ints[0] - first)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Dtypes whose `x - 0` is exactly `x` (signed zeros and NaNs kept) and differentiable.
_SUBTRACTS = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
}  # fmt: skip


def after_read(x: Tensor, zero: IntLike | Tensor) -> Tensor:
    """`x`, computed from `zero`, a host read's 0 (an int, or a 0-d int64 tensor), exactly and with its gradient.

    Eager (`zero` a Python int) it is `x` itself. In a compiled graph the result
    depends on the read, so no pass moves a collective that sends it above the
    read: ``x - zero``, exact for these dtypes (signed zeros and NaNs kept) and
    the identity for autograd; other dtypes (bool, float8), which have no
    gradient, subtract on their bits as integers.
    """
    if not torch.compiler.is_compiling():
        return x
    if x.dtype in _SUBTRACTS:
        return x - zero
    return (x.view(_BITS[x.element_size()]) - zero).view(x.dtype)


def _allow_unbacked_output_sizes() -> None:
    # See the module docstring: dynamo reads this when a frame starts, so it has to
    # be on before any compiled frame that may call a ragged op.
    if os.environ.get("FUNCOLL_DYNAMO_CONFIG", "1") != "0":
        torch._dynamo.config.capture_dynamic_output_shape_ops = True


_allow_unbacked_output_sizes()


def host_sizes(opname: str, arg: str, sizes: Sequence[int] | Tensor, world: int) -> list[IntLike]:
    """`sizes` (checked by ``check_sizes``) as world host ints; from a tensor, unbacked SymInts in a graph."""
    sizes = check_sizes(opname, arg, sizes, world)
    if not isinstance(sizes, Tensor):
        return sizes
    values = host_ints(
        sizes.reshape(-1)
    )  # a device-to-host sync for a device tensor: the sizes shape the output
    if torch.compiler.is_compiling():  # unbacked SymInts: host_ints checked n >= 0 at run time
        return values
    return check_sizes(opname, arg, values, world)  # the values: a negative one is a ValueError


def given_sizes(
    opname: str, x: Tensor, dim: int, sizes: Sequence[int] | Tensor | None, g: Group
) -> list[IntLike] | None:
    """The `sizes` a caller passed to a ragged gather, as world host ints (None stays None).

    Checked before any communication: the list (``check_sizes``), and, unless
    ``funcoll.set_checks(True)`` sends it in the header for every rank to check
    (:func:`row_sizes`), this rank's own entry against its length. A tensor is read
    here once (a device-to-host sync for a GPU tensor: the sizes shape the output).
    """
    if sizes is None:
        return None
    sz = host_sizes(opname, "sizes", sizes, g.size)
    if torch.compiler.is_compiling() and not isinstance(sizes, Tensor):
        # A list's ints are constants of the graph (backed symbols once dynamo makes them
        # dynamic): asserting this rank's equal to x's length would replace x's symbol
        # by it, a length `mark_ragged` made unbacked by a constant, which inductor fails
        # to lower (torch 2.13: a reshape to `[3*s38]` in the a2a's repeat, a size
        # mismatch in a matmul's backward) and which recompiles the graph for every
        # list. So this rank's entry is x's own length; a list that says otherwise
        # is not caught in a compiled graph unless checks are on (docs/compile.md).
        return [*sz[: g.rank], x.shape[dim], *sz[g.rank + 1 :]]
    if g.is_single or not checks_enabled():
        mine, n = sz[g.rank], x.shape[dim]
        check_equal(
            mine,
            n,
            f"{opname}: `sizes`[{g.rank}] is not this rank's x.shape[{dim}]",
            lambda: (
                f"{opname}: `sizes`={list(sz)} says rank {g.rank} holds {mine}, but its x.shape[{dim}]={n}"
            ),
        )
    return list(sz)


def row_sizes(
    key: str,
    x: Tensor,
    dim: int,
    g: Group,
    args: tuple[int, int],
    ndim: int | None = None,
    sizes: list[IntLike] | None = None,
    formats: tuple[Wire | None, Wire | None] = (None, None),
) -> tuple[list[IntLike], Stats, Tensor | None]:
    """Every rank's length along `dim`, their (min, max, sum), and the exchanged header table.

    The lengths are exchanged, or `sizes` (from :func:`given_sizes`), which replace
    the header exchange: one collective fewer, and no table (None). With
    ``funcoll.set_checks(True)`` the header still travels and carries the given
    list, so that ranks whose lists or lengths disagree all raise. `formats`: the
    wire formats the rows travel in, whose code the header carries (:func:`wire_tail`).
    """
    if sizes is None:
        tail = wire_tail(g.size, [], *formats)
        codes = None if tail is None else torch.tensor(tail, dtype=torch.int64)
        table, ints = exchange(key, x, dim, g, args=args, sizes=codes, ndim=ndim)
        return (*split_stats(ints, g.size), table)
    if checks_enabled():
        flagged = [*(int(n) for n in sizes), 1]  # the list, then "given"
        tail = wire_tail(g.size, flagged, *formats) or flagged
        exchange(key, x, dim, g, args=args, sizes=torch.tensor(tail, dtype=torch.int64), ndim=ndim)
    stats = (min_of(*sizes), max_of(*sizes), sum(sizes))
    return sizes, stats, None


# ------------------------------------------------------ the wire formats' agreement
def same_wire(opname: str, rows: list[list[int]], col: int = -1) -> None:
    """A quantizing op's formats (:func:`wire_tail`'s last tail column, or `col`): the same on every rank."""
    disagree(opname, rows, "`wire`, `grad_wire`", lambda r: r[col], lambda r: show_pair(r[col]))


def wire_tail(
    world: int, sizes: Sequence[IntLike], wire: Wire | None, grad_wire: Wire | None
) -> list[IntLike] | None:
    """A checked call's header tail: the op's `sizes` and zeros, then both formats' code in the last column.

    No op's own tail reaches the last column but all_to_all's, whose formats travel in
    ARG1 instead.
    None when both formats are exact and the op has no sizes: the tail then stays zeros.
    """
    if wire is None and grad_wire is None:
        return list(sizes) or None
    return [*sizes, *[0] * (TAIL * world - 1 - len(sizes)), pair_code(wire, grad_wire)]
