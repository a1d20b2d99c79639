"""The size exchange of the ragged ops, which doubles as a check that ranks agree.

Every ragged op starts with one small ``all_gather`` of a fixed-width int64 header
per rank. It carries what the op needs (this rank's length along the ragged dim,
and for all_to_all_v the send sizes) and what lets every rank check the others: the
op, ndim, dtype, dim, the rest of the shape, whether `x` requires grad, and the
op's other arguments. The exchange is a collective every rank joins anyway, so the
check costs no extra round trip, and ranks that disagree all raise the same
``ValueError`` instead of a backend abort, garbage or a hang.

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
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import _prims
from ._checks import REDUCE_OPS, STRATEGIES
from ._config import checks_enabled
from ._group import Group
from ._prims import Stats

IntLike = int | torch.SymInt

OPS = (
    "gather",
    "all_gather_ragged",
    "all_gather_list",
    "all_to_all_v",
    "reduce_scatter",
    "gather_forward_split_backward",
    # the even ops, which exchange a header only with funcoll.set_checks(True)
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "ppermute",
    "broadcast",
    "split_forward_gather_backward",
)
# Ops whose header is a check only: the host ints they read are just this rank's
# ndim, which the caller ties to x.dim() so that a compiled graph keeps the check.
CHECK_ONLY = OPS[6:]
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


def _dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def _shape_columns(x: Tensor, dim: int) -> list:
    shape = [0 if i == dim else s for i, s in enumerate(x.shape)]
    if len(shape) > MAX_DIMS:  # fold the tail into the last column: a mismatch still shows
        tail = 0
        for s in shape[MAX_DIMS - 1 :]:
            tail = (tail * 1_000_003 + int(s)) % (1 << 61)
        shape = [*shape[: MAX_DIMS - 1], tail]
    return shape + [0] * (MAX_DIMS - len(shape))


def exchange(
    opname: str,
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
    d = -1 if dim is None else dim
    row = [
        OPS.index(opname), x.dim() if ndim is None else ndim, _dtype_code(x.dtype), d, int(x.requires_grad),
        0 if dim is None else x.shape[dim], args[0], args[1], *_shape_columns(x, d),
    ]  # fmt: skip
    header = torch.tensor(row, dtype=torch.int64, device=x.device)
    if sizes is None:
        tail = header.new_zeros(TAIL * g.size)
    else:
        tail = sizes.to(device=x.device, dtype=torch.int64).reshape(-1)
        tail = torch.cat([tail, tail.new_zeros(TAIL * g.size - tail.shape[0])])
    header = torch.cat([header, tail])
    table = _prims._all_gather0_impl(header, g.name, g.size).view(g.size, -1)
    return table, host_ints(table, opname, g.rank)


def host_ints(t: Tensor, opname: str = "", rank: int = 0) -> list[IntLike]:
    """The ints a ragged call needs on the host, from a gathered header table or a sizes tensor.

    With an `opname`, `t` is the gathered header table: it is checked (raising on
    every rank if they disagree) and reduced to the sizes the op needs. Without,
    `t` is a 1-d int tensor of sizes, returned as is.

    Eager: Python ints, read with one host sync. Compiled: unbacked SymInts.
    The custom op ``funcoll::host_ints`` returns one zero-width tensor per int, of
    shape ``(int, 0)``, and its fake gives each a fresh unbacked size; the sizes
    are read off the shapes, so no scalar read (and no sync of its own) enters the graph.
    """
    if not torch.compiler.is_compiling():
        return _read(t, opname, rank)
    ints = [c.shape[0] for c in torch.ops.funcoll.host_ints(t, opname, rank)]
    for n in ints:
        torch._check(n >= 0)
    return ints


def _read(t: Tensor, opname: str, rank: int) -> list[int]:
    values = t.tolist()  # device-to-host sync (none for a CPU tensor): the one per ragged call
    if not opname:
        return values
    _check_rows(opname, values, rank)
    world = len(values)
    if opname in CHECK_ONLY:
        return [values[rank][NDIM]]
    if opname == "all_to_all_v":
        return values[rank][WIDTH : WIDTH + world] + [r[WIDTH + rank] for r in values]
    sizes = values[rank][WIDTH : WIDTH + world] if opname == "reduce_scatter" else [r[SIZE] for r in values]
    return [*sizes, min(sizes), max(sizes), sum(sizes)]


def _n_ints(opname: str, world: int) -> int:
    """How many ints `_read` returns for `opname` at `world` ranks."""
    if not opname:
        return world
    if opname in CHECK_ONLY:
        return 1
    return 2 * world if opname == "all_to_all_v" else world + 3


def split_stats(ints: list[IntLike], world: int) -> tuple[list[IntLike], Stats]:
    """Host ints of a ragged gather or reduce_scatter as (sizes, (min, max, sum of sizes))."""
    sizes, (lo, hi, total) = ints[:world], ints[world:]
    if torch.compiler.is_compiling():  # fresh unbacked symbols: say how they relate
        torch._check(lo <= hi)
        torch._check(hi <= total)
    return sizes, (lo, hi, total)


@torch.library.custom_op("funcoll::host_ints", mutates_args=())
def _host_ints_op(t: Tensor, opname: str, rank: int) -> list[Tensor]:
    return [torch.empty((n, 0), dtype=torch.uint8) for n in _read(t, opname, rank)]


@_host_ints_op.register_fake
def _host_ints_fake(t: Tensor, opname: str, rank: int) -> list[Tensor]:
    ctx = torch.library.get_ctx()
    n = _n_ints(opname, t.shape[0])
    return [torch.empty((ctx.new_dynamic_size(), 0), dtype=torch.uint8, device="cpu") for _ in range(n)]


def _describe(row: list[int]) -> str:
    ndim = row[NDIM]
    shape = [row[SHAPE + i] if i != row[DIM] else row[SIZE] for i in range(min(ndim, MAX_DIMS))]
    dtype = DTYPES[row[DTYPE]] if row[DTYPE] < len(DTYPES) else "other dtype"
    return f"shape {tuple(shape)} {dtype}".replace("torch.", "")


_ARG_NAMES: dict[str, tuple[str | None, str | None]] = {
    "gather": ("dst", "strategy"),
    "all_gather_ragged": (None, "strategy"),
    "all_gather_list": (None, "strategy"),
    "gather_forward_split_backward": (None, "strategy"),
    "reduce_scatter": ("op", "sizes"),
    "all_gather": ("dim", "tiled"),
    "all_reduce": ("op", None),
    "all_to_all": ("scatter_dim", None),
    "broadcast": ("src", None),
    "split_forward_gather_backward": ("dim", "grad_scale"),
}
GRAD_SCALES = (None, "up", "down")


def _arg_names(opname: str) -> tuple[str | None, str | None]:
    """What ARG0 and ARG1 carry for each op."""
    return _ARG_NAMES.get(opname, (None, None))


def _arg_value(name: str, code: int) -> object:
    if name == "dst":
        return None if code < 0 else code
    if name == "strategy":
        return repr(STRATEGIES[code]) if 0 <= code < len(STRATEGIES) else code
    if name == "op":
        return repr(REDUCE_OPS[code]) if 0 <= code < len(REDUCE_OPS) else code
    if name == "sizes":
        return "given" if code else "None"
    if name == "tiled":
        return bool(code)
    if name == "grad_scale":
        return repr(GRAD_SCALES[code]) if 0 <= code < len(GRAD_SCALES) else code
    return code


def _perm_pairs(dsts: list[int]) -> list[tuple[int, int]]:
    """ppermute's tail (the destination of every rank, -1 for none) as (src, dst) pairs."""
    return [(i, d) for i, d in enumerate(dsts) if d >= 0]


def _check_rows(opname: str, rows: list[list[int]], rank: int) -> None:
    op = f"funcoll.{opname}"
    world = len(rows)

    def disagree(what: str, key: Callable[[list[int]], object], show: Callable[[list[int]], object]) -> None:
        if len({key(r) for r in rows}) > 1:
            detail = ", ".join(f"rank {i}: {show(r)}" for i, r in enumerate(rows))
            raise ValueError(f"{op}: ranks disagree on {what} ({detail})")

    if len({r[OP] for r in rows}) > 1:
        names = ", ".join(f"rank {i}: {OPS[r[OP]] if r[OP] < len(OPS) else '?'}" for i, r in enumerate(rows))
        kind = "ragged ops" if all(OPS[r[OP]] not in CHECK_ONLY for r in rows if r[OP] < len(OPS)) else "ops"
        raise ValueError(f"{op}: ranks called different {kind} at the same point ({names})")
    # the dim whose length may differ: a ragged op's `dim`, all_to_all's gather_dim, none for the rest
    dim_name = {"all_to_all": "`gather_dim`"}.get(opname, "the ragged `dim`")
    disagree("`x`.ndim", lambda r: r[NDIM], lambda r: f"{r[NDIM]} ({_describe(r)})")
    disagree(dim_name, lambda r: r[DIM], lambda r: f"{r[DIM]} ({_describe(r)})")
    disagree("`x`.dtype", lambda r: r[DTYPE], lambda r: _describe(r).split()[-1] + f" ({_describe(r)})")
    rest = "" if rows[0][DIM] < 0 else f" apart from {dim_name}"
    disagree(f"the shape of `x`{rest}", lambda r: tuple(r[SHAPE:WIDTH]), _describe)
    for col, name in zip((ARG0, ARG1), _arg_names(opname), strict=False):
        if name is not None:
            disagree(f"`{name}`", lambda r, c=col: r[c], lambda r, c=col, n=name: _arg_value(n, r[c]))
    if len({r[GRAD] for r in rows}) > 1:
        on = [i for i, r in enumerate(rows) if r[GRAD]]
        off = [i for i, r in enumerate(rows) if not r[GRAD]]
        raise ValueError(
            f"{op}: `x` requires grad on ranks {on} but not on ranks {off}; the backward is a "
            f"collective that every rank must join, so all ranks or none must require grad"
        )
    tails = [r[WIDTH : WIDTH + world] for r in rows]
    if opname == "all_to_all_v":
        for i, (r, send) in enumerate(zip(rows, tails, strict=False)):
            if any(s < 0 for s in send) or sum(send) != r[SIZE]:
                raise ValueError(
                    f"{op}: rank {i} has `send_sizes`={send}, which must be {world} non-negative "
                    f"ints summing to x.shape[dim]={r[SIZE]}"
                )
    if opname == "ppermute":
        if len({tuple(t) for t in tails}) > 1:
            detail = ", ".join(f"rank {i}: {_perm_pairs(t)}" for i, t in enumerate(tails))
            raise ValueError(f"{op}: ranks disagree on `perm` ({detail})")
    if opname == "all_to_all":
        gd = rows[0][DIM]
        scatter = [r[WIDTH + world : WIDTH + 2 * world] for r in rows]
        if len({tuple(t) for t in scatter}) > 1:
            detail = ", ".join(f"rank {i}: {t}" for i, t in enumerate(scatter))
            raise ValueError(
                f"{op}: ranks disagree on how the scatter dim is split (`scatter_sizes`: {detail})"
            )
        if len({tuple(t) for t in tails}) > 1:
            detail = ", ".join(f"rank {i}: {t}" for i, t in enumerate(tails))
            raise ValueError(
                f"{op}: ranks disagree on every rank's length along gather_dim {gd} ({detail}); "
                f"when x.shape[gather_dim] differs between ranks, pass the same `gather_sizes` on every rank"
            )
        for i, r in enumerate(rows):
            if r[SIZE] != tails[0][i]:
                raise ValueError(
                    f"{op}: rank {i} has x.shape[{gd}]={r[SIZE]}, but the ranks expect {tails[0][i]} "
                    f"there (`gather_sizes` or, without it, every rank's own length)"
                )
    if opname == "reduce_scatter":
        if not rows[0][ARG1]:  # the even op: its sizes follow from x.shape[dim]
            disagree("x.shape[dim]", lambda r: r[SIZE], _describe)
        if len({tuple(t) for t in tails}) > 1:
            detail = ", ".join(f"rank {i}: {t}" for i, t in enumerate(tails))
            raise ValueError(f"{op}: ranks disagree on `sizes` ({detail})")
        disagree("x.shape[dim]", lambda r: r[SIZE], _describe)
        if any(n < 0 for n in tails[0]) or sum(tails[0]) != rows[0][SIZE]:
            raise ValueError(
                f"{op}: `sizes`={tails[0]} must be {world} non-negative ints summing to "
                f"x.shape[dim]={rows[0][SIZE]}"
            )


def check_agreement(
    opname: str,
    x: Tensor,
    g: Group,
    dim: int | None = None,
    args: tuple[int, int] = (0, 0),
    sizes: Sequence[IntLike] | None = None,
) -> None:
    """With ``funcoll.set_checks(True)``: exchange a header, raise on every rank if the ranks disagree.

    For the even ops, before their data moves. `dim` is a dim whose length may
    differ between ranks (all_to_all's gather dim), None when every dim must
    agree; `args` the op's arguments that must agree, `sizes` what the op expects
    every rank's length along `dim` to be. Costs one small all_gather and one
    device-to-host read; does nothing with checks off or on one rank.
    """
    if not checks_enabled() or g.is_single:
        return
    tail = None if sizes is None else torch.tensor(list(sizes), dtype=torch.int64)
    _, ints = exchange(opname, x, dim, g, args, tail)
    # In a compiled graph the read is an op whose outputs nothing else uses. 2.13's
    # aot_eager and inductor keep it anyway (compile_tests/test_checked_ops.py);
    # the runtime assert ties it to the trace so that no dead-code pass can drop the
    # check. A check-only op reads back x.dim(); the even reduce_scatter, whose
    # header is the ragged one's, its first slice size.
    first = x.dim() if opname in CHECK_ONLY else next(iter(sizes or [0]))
    torch._check(ints[0] == first)


def _allow_unbacked_output_sizes() -> None:
    # See the module docstring: dynamo reads this when a frame starts, so it has to
    # be on before any compiled frame that may call a ragged op.
    if os.environ.get("FUNCOLL_DYNAMO_CONFIG", "1") != "0":
        torch._dynamo.config.capture_dynamic_output_shape_ops = True


_allow_unbacked_output_sizes()
