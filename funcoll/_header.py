"""The size exchange of the ragged ops, which doubles as a check that ranks agree.

Every ragged op starts with one small ``all_gather`` of a fixed-width int64 header
per rank. It carries what the op needs (this rank's length along the ragged dim,
and for all_to_all_v the send sizes) and what lets every rank check the others: the
op, ndim, dtype, dim, the rest of the shape, whether `x` requires grad, and the
op's other arguments. The exchange is a collective every rank joins anyway, so the
check costs no extra round trip, and ranks that disagree all raise the same
``ValueError`` instead of a backend abort, garbage or a hang.

Reading the table on the host is the single device-to-host sync of a ragged call.
It happens inside the custom op ``funcoll::check_header`` so that it is one opaque
step in a compiled graph (its fake returns an int64 CPU tensor of the right
length), and turning that CPU tensor into the sizes that shape the output is
then host-to-host, not a second sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import _prims
from ._checks import REDUCE_OPS, STRATEGIES
from ._group import Group

OPS = ("gather", "all_gather_ragged", "all_gather_list", "all_to_all_v", "reduce_scatter", "gather_forward_split_backward")
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
MAX_DIMS = 8
# Column layout of one rank's row.
OP, NDIM, DTYPE, DIM, GRAD, SIZE, ARG0, ARG1 = range(8)
SHAPE = 8  # MAX_DIMS columns: the shape with the ragged dim set to 0
WIDTH = SHAPE + MAX_DIMS


def _dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def _shape_columns(x: Tensor, dim: int) -> list:
    shape = [0 if i == dim else s for i, s in enumerate(x.shape)]
    if len(shape) > MAX_DIMS:  # fold the tail into the last column: a mismatch still shows
        tail = 0
        for s in shape[MAX_DIMS - 1 :]:
            tail = (tail * 1_000_003 + int(s)) % (1 << 61)
        shape = shape[: MAX_DIMS - 1] + [tail]
    return shape + [0] * (MAX_DIMS - len(shape))


def exchange(
    opname: str,
    x: Tensor,
    dim: int,
    g: Group,
    args: tuple[int, int] = (0, 0),
    sizes: Tensor | None = None,
) -> tuple[Tensor, list]:
    """All-gather the headers, check them, and return (table on x.device, host ints).

    Every row is ``WIDTH + world`` ints whatever the op, so ranks that call
    different ragged ops still exchange matching headers and get a clear error.
    The last `world` columns carry `sizes` (all_to_all_v's send sizes, the ragged
    reduce_scatter's slice sizes) or zeros. The host ints returned are the sizes
    along `dim` of every rank; for all_to_all_v this rank's send sizes followed by
    its receive sizes; for reduce_scatter the (checked) slice sizes. They are Python
    ints in eager mode and unbacked SymInts in a compiled graph.
    """
    row = [
        OPS.index(opname), x.dim(), _dtype_code(x.dtype), dim, int(x.requires_grad),
        x.shape[dim], args[0], args[1], *_shape_columns(x, dim),
    ]  # fmt: skip
    header = torch.tensor(row, dtype=torch.int64, device=x.device)
    if sizes is None:
        tail = header.new_zeros(g.size)
    else:
        tail = sizes.to(device=x.device, dtype=torch.int64).reshape(-1)
    header = torch.cat([header, tail])
    table = _prims._all_gather0_impl(header, g.name, g.size).view(g.size, -1)
    host = torch.ops.funcoll.check_header(table, opname, g.rank)
    # Under dynamo the conversion below yields unbacked SymInts; the patch allows that
    # without a global config change (fullgraph=True enables it anyway).
    with _capture_scalars():
        ints = host.tolist()  # no device sync: `host` is a CPU tensor (the sync was in check_header)
    for n in ints:
        torch._check(n >= 0)
    return table, ints


def _capture_scalars():  # type: ignore[no-untyped-def]
    patch = getattr(torch._dynamo, "patch_dynamo_config", None)
    if patch is None:  # torch without traceable config patches: fullgraph=True still captures
        import contextlib

        return contextlib.nullcontext()
    return patch(capture_scalar_outputs=True)


def _describe(row: list[int]) -> str:
    ndim = row[NDIM]
    shape = [row[SHAPE + i] if i != row[DIM] else row[SIZE] for i in range(min(ndim, MAX_DIMS))]
    dtype = DTYPES[row[DTYPE]] if row[DTYPE] < len(DTYPES) else "other dtype"
    return f"shape {tuple(shape)} {dtype}".replace("torch.", "")


def _arg_names(opname: str) -> tuple[str | None, str | None]:
    """What ARG0 and ARG1 carry for each op."""
    if opname == "gather":
        return "dst", "strategy"
    if opname in ("all_gather_ragged", "all_gather_list", "gather_forward_split_backward"):
        return None, "strategy"
    if opname == "reduce_scatter":
        return "op", None
    return None, None


def _arg_value(name: str, code: int) -> object:
    if name == "dst":
        return None if code < 0 else code
    if name == "strategy":
        return repr(STRATEGIES[code]) if 0 <= code < len(STRATEGIES) else code
    return repr(REDUCE_OPS[code]) if 0 <= code < len(REDUCE_OPS) else code


def _check_rows(opname: str, rows: list[list[int]], rank: int) -> None:
    op = f"funcoll.{opname}"
    world = len(rows)

    def disagree(what: str, key: Callable[[list[int]], object], show: Callable[[list[int]], object]) -> None:
        if len({key(r) for r in rows}) > 1:
            detail = ", ".join(f"rank {i}: {show(r)}" for i, r in enumerate(rows))
            raise ValueError(f"{op}: ranks disagree on {what} ({detail})")

    if len({r[OP] for r in rows}) > 1:
        names = ", ".join(f"rank {i}: {OPS[r[OP]] if r[OP] < len(OPS) else '?'}" for i, r in enumerate(rows))
        raise ValueError(f"{op}: ranks called different ragged ops at the same point ({names})")
    disagree("`x`.ndim", lambda r: r[NDIM], lambda r: f"{r[NDIM]} ({_describe(r)})")
    disagree("the ragged `dim`", lambda r: r[DIM], lambda r: f"{r[DIM]} ({_describe(r)})")
    disagree("`x`.dtype", lambda r: r[DTYPE], lambda r: _describe(r).split()[-1] + f" ({_describe(r)})")
    disagree("the shape of `x` apart from the ragged dim", lambda r: tuple(r[SHAPE:WIDTH]), _describe)
    for col, name in zip((ARG0, ARG1), _arg_names(opname)):
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
        for i, (r, send) in enumerate(zip(rows, tails)):
            if any(s < 0 for s in send) or sum(send) != r[SIZE]:
                raise ValueError(
                    f"{op}: rank {i} has `send_sizes`={send}, which must be {world} non-negative "
                    f"ints summing to x.shape[dim]={r[SIZE]}"
                )
    if opname == "reduce_scatter":
        if len({tuple(t) for t in tails}) > 1:
            detail = ", ".join(f"rank {i}: {t}" for i, t in enumerate(tails))
            raise ValueError(f"{op}: ranks disagree on `sizes` ({detail})")
        disagree("x.shape[dim]", lambda r: r[SIZE], _describe)
        if any(n < 0 for n in tails[0]) or sum(tails[0]) != rows[0][SIZE]:
            raise ValueError(
                f"{op}: `sizes`={tails[0]} must be {world} non-negative ints summing to "
                f"x.shape[dim]={rows[0][SIZE]}"
            )


@torch.library.custom_op("funcoll::check_header", mutates_args=())
def check_header(table: Tensor, opname: str, rank: int) -> Tensor:
    """Check the gathered headers; return this rank's sizes as an int64 CPU tensor."""
    rows = table.tolist()  # device-to-host sync: the one per ragged call; sizes shape the output
    _check_rows(opname, rows, rank)
    world = len(rows)
    if opname == "all_to_all_v":
        send = rows[rank][WIDTH : WIDTH + world]
        recv = [r[WIDTH + rank] for r in rows]
        return torch.tensor(send + recv, dtype=torch.int64)
    if opname == "reduce_scatter":
        return torch.tensor(rows[rank][WIDTH : WIDTH + world], dtype=torch.int64)
    return torch.tensor([r[SIZE] for r in rows], dtype=torch.int64)


@check_header.register_fake
def _check_header_fake(table: Tensor, opname: str, rank: int) -> Tensor:
    n = table.shape[0] * (2 if opname == "all_to_all_v" else 1)
    return torch.empty(n, dtype=torch.int64, device="cpu")
