"""Ragged collectives: every rank may hold a different length along one dim.

The ragged data model: along `dim`, rank i holds ``sizes[i]`` rows (any ``>= 0``);
every other dim, the dtype and the ndim agree on all ranks. The global tensor is
the concatenation of the ranks' tensors along `dim` in rank order, so rank i's rows
sit at ``[sizes[0] + ... + sizes[i-1], ... + sizes[i])``. funcoll exchanges
`sizes` itself (one small all_gather that also checks the ranks agree, see
``_header.py``); nothing is padded on the wire unless ``strategy="pad"`` asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from .._base._checks import (
    REDUCE_OPS,
    IntLike,
    check_dim,
    check_rank,
    check_sizes,
    check_total,
    fresh,
    tensor_split_sizes,
)
from .._base._config import checks_enabled
from .._base._dtensor import MeshAxis
from .._base._group import Group, GroupLike
from .._base._quant import Wire
from .._base._strategy import STRATEGIES
from .._base._sym import max_of, min_of
from .._base._wire import unwire, wire_op
from .._collective import _prims
from .._collective._header import (
    ARG0,
    ARG1,
    DIM,
    DST,
    SIZE,
    SIZES_GIVEN,
    STRATEGY,
    WIDTH,
    Arg,
    Header,
    Reader,
    check_agreement,
    check_given_lengths,
    exchange,
    given_sizes,
    host_sizes,
    row_sizes,
    same_tails,
    same_wire,
    tails,
    wire_tail,
)
from .._collective._quantized import all_to_all_rows_wire_p, gather_rows_wire_p
from .._collective._rows import from_rows, ints_on, to_rows
from ._entry import Refusal, entry
from ._region import gather_shards
from ._spec import A2A, HEADER, RAGGED, Plan, plus, rows_plan

__all__ = ["all_gather_list", "all_gather_ragged", "all_to_all_v", "gather", "scatter"]


def _check_strategy(opname: str, strategy: object) -> int:
    if strategy not in STRATEGIES:
        raise ValueError(f"{opname}: `strategy`={strategy!r} is not one of {STRATEGIES}")
    return STRATEGIES.index(strategy)  # type: ignore[arg-type]


def as_rows(opname: str, x: Tensor, dim: object) -> tuple[Tensor, int, int | None]:
    """(x, dim, ndim): a 0-d `x` as one row along dim 0, with ndim 0 for the header.

    A per-rank scalar (a loss, a count) is gathered as a stack: ``(world,)``.
    """
    if x.dim() > 0:
        return x, check_dim(opname, x, dim), None
    if isinstance(dim, int) and not isinstance(dim, bool) and dim not in (0, -1):
        raise ValueError(
            f"{opname}: `dim`={dim} is out of range for a 0-d tensor, gathered as one row (dim 0 or -1)"
        )
    check_dim(opname, x.reshape(1), dim)  # a dim that is no int
    return x.reshape(1), 0, 0


def ragged_all_gather(
    key: str,
    x: Tensor,
    dim: int,
    g: Group,
    strategy: str = "auto",
    ndim: int | None = None,
    sizes: list[IntLike] | None = None,
    formats: tuple[Wire | None, Wire | None] = (None, None),
) -> tuple[Tensor, Tensor | None]:
    """The sizes (exchanged, or given by :func:`given_sizes`), then the gather: (result, header table or None).

    `formats`: the rows' wire formats, (this way, the gradient's).
    """
    sz, stats, table = row_sizes(key, x, dim, g, (-1, STRATEGIES.index(strategy)), ndim, sizes, formats)
    xm = to_rows(x, dim)
    y = gather_rows_wire_p(xm, sz, strategy, g.name, g.size, g.rank, stats, *formats)
    return from_rows(y, x.dtype, dim), table


def _gather_dtensor(
    ax: MeshAxis,
    dim: int,
    dst: int | None,
    strategy: str,
    sizes: Sequence[int] | Tensor | None,
) -> Tensor:
    """``Shard(dim) -> Replicate()``, the lengths known from the global shape (`sizes` is not read);
    a `dst` is refused before this."""
    _check_strategy(ax.opname, strategy)
    return gather_shards(ax, ax.dim(dim), strategy)


def _sized_a2a_plan(world: int, variant: str) -> Plan:
    """scatter and all_to_all_v: the sizes in a header, then one all_to_all (backward: one back);
    variant "given": the sizes were passed (`sizes`, `recv_sizes`), nothing exchanged."""
    return ({A2A: 1} if variant == "given" else plus(HEADER, {A2A: 1})), {A2A: 1}


def _ragged_gather_plan(world: int, variant: str) -> Plan:
    """gather, all_gather_list, all_gather_ragged: the header, then the rows; variant: the strategy, "dst" or "given"."""
    if variant == "dst":  # one all_to_all to dst; no backward (inputs may not require grad)
        return plus(HEADER, {A2A: 1}), None
    if variant == "given":  # `sizes` passed in: no header
        return rows_plan(world)
    fw, bw = rows_plan(world, variant or "auto")
    return plus(HEADER, fw), bw


# A ragged gather's header: every rank's length along `dim` (then their min, max and sum).
_GATHER_HEADER = Header(args=(None, STRATEGY), checks=(check_given_lengths, same_wire))


@entry(
    "gather",
    RAGGED,
    header=Header(args=(DST, STRATEGY), checks=(check_given_lengths, same_wire)),
    collectives=_ragged_gather_plan,
    placements=("Shard(dim), dst=None", "Replicate()"),
    dtensor=_gather_dtensor,
    refuse=Refusal("with a `dst` its result is on one rank", "dst=None", when=lambda a: a["dst"] is not None),
)
def gather(
    x: Tensor,
    dim: int = 0,
    dst: int | None = None,
    *,
    group: GroupLike = None,
    strategy: str = "auto",
    sizes: Sequence[int] | Tensor | None = None,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> Tensor | None:
    """Concatenate every rank's `x` along `dim`, where each rank may hold a different length.

    Ragged data model: rank i holds ``sizes[i]`` rows along `dim` (0 allowed); all
    other dims, the dtype and the ndim agree on every rank, or every rank raises a
    ``ValueError`` naming the ranks and their shapes. funcoll exchanges the sizes.

    Args:
        x: this rank's tensor, of shape ``(..., sizes[rank], ...)`` with the ragged
            length at `dim`.
        dim: the ragged dim (negative counts from the end).
        dst: None: every rank gets the result. A rank k: only rank k does; the data
            goes to k alone, and the other ranks get None.
        group: the communicator.
        strategy: how the rows travel when ``dst`` is None, each one collective
            after the size exchange unless said otherwise. ``"auto"`` (default)
            is ``"a2a"`` (``"pad"`` above 64 ranks, where a compiled ``"a2a"``
            traces slowly): one all_to_all_single sends this rank's rows to every
            rank; no padding travels, and the input is the rows repeated world
            times (a local copy). ``"pad"`` pads to ``max(sizes)``, all_gathers
            and cuts the padding off: the even all_gather itself when sizes are
            equal, but skewed sizes send the padding. ``"shift"`` sends the first
            ``min(sizes)`` rows of every rank in one all_gather and the rest in
            ``world - 1`` all_to_all_singles, the k-th to rank ``rank + k``: no
            padding and no copy to send, but world collectives, and the result
            is assembled from the pieces after they arrive, a copy that no
            overlapped work hides (for large messages that nothing overlaps,
            where the copy costs more than the latencies). Each issues the same
            collectives whatever the sizes, in eager and compiled code alike
            (docs/benchmarks.md has their costs).
        sizes: every rank's length along `dim` (world ints, or an int tensor), when
            the caller knows them: a sequence-parallel step whose layers gather the
            same lengths, lengths a data loader or an earlier exchange gave. Nothing
            is exchanged, so the call is one collective fewer (a tensor's values are
            read on the host: a device-to-host sync for a GPU tensor). None: funcoll
            exchanges them.
        wire: the format the rows travel in (docs/wire.md), each row (a slice along
            `dim`) encoded on its own with block scales along its last dim, by the
            strategy's collectives (with a `dst`, by its all_to_all). None
            (default): exact. A floating `x` only.
        grad_wire: the format of the backward's ragged reduce-scatter (None: exact).

    Returns:
        ``x.shape`` with ``shape[dim] = sum(sizes)``, ranks in order (a new tensor),
        or None on ranks other than `dst`. A 0-d `x` (a per-rank scalar: a loss, a
        count) counts as one row: the result is their stack, of shape ``(world,)``.

    Backward (``dst=None``): a ragged ``reduce_scatter`` (sum) of the gradient: rank
    i gets the sum over ranks of rows ``[off_i, off_i + sizes[i])``. With a `dst`
    the ranks other than `dst` get None and so could never join the backward
    scatter; an `x` that requires grad is refused (on every rank) with a ValueError.

    DTensor `x` (``dst=None``): ``Shard(dim) -> Replicate()``, the lengths read off
    its global shape (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [[1, 2], [3, 4]]   rank 1: x = [[5, 6]]
        gather(x)            # both: [[1, 2], [3, 4], [5, 6]]
        gather(x, dst=1)     # rank 0: None   rank 1: [[1, 2], [3, 4], [5, 6]]
        # rank 0: x = tensor(0.5)        rank 1: x = tensor(2.0)
        gather(x)            # both: [0.5, 2.0]
        # rank 0: x of shape (2, 1), rank 1: (1, 2): ValueError on both (dim 1 differs)
    """
    opname, g = "funcoll.gather", cast(Group, group)
    x, d, ndim = as_rows(opname, x, dim)
    strat = _check_strategy(opname, strategy)
    if dst is not None:
        check_rank(opname, "dst", dst, g.size)
    # Raised after the exchange, which checks that requires_grad agrees: then every rank raises.
    grad_to_dst = dst is not None and x.requires_grad and torch.is_grad_enabled()
    sizes = given_sizes(opname, x, d, sizes, g)
    if g.is_single:
        if grad_to_dst:
            raise _grad_to_dst(opname, dst)
        return fresh(x)
    if dst is None:
        return ragged_all_gather("gather", x, d, g, strategy, ndim, sizes, (wire, grad_wire))[0]
    sz, _, _ = row_sizes("gather", x, d, g, (dst, strat), ndim, sizes, (wire, grad_wire))
    if grad_to_dst:
        raise _grad_to_dst(opname, dst)
    xm = to_rows(x, d)
    n = sz[g.rank]
    torch._check(xm.shape[0] == n)
    send = [n if j == dst else 0 for j in range(g.size)]
    recv = list(sz) if g.rank == dst else [0] * g.size
    if wire is None:
        got = _prims.all_to_all_p(xm, recv, send, g.name)
    else:  # no gradient flows with a dst: the refusal above
        got = all_to_all_rows_wire_p(xm, recv, send, g.name, wire, None)
    if g.rank != dst:
        return None
    return from_rows(got, x.dtype, d)


def _grad_to_dst(opname: str, dst: int) -> ValueError:
    """gather's refusal of an `x` that requires grad with a `dst`."""
    return ValueError(
        f"{opname}: `dst`={dst} cannot carry gradients: ranks other than dst get None and could "
        f"never join the backward scatter. Use dst=None, or pass x.detach()"
    )


def _scatter_sizes_agree(opname: str, rows: list[list[int]]) -> None:
    """scatter's `sizes`, when given (ARG1): the same on every rank, summing to `src`'s length."""
    if not rows[0][ARG1]:
        return
    same_tails(opname, rows, "ranks disagree on `sizes` ({detail})")
    sizes, src = tails(rows)[0], rows[0][ARG0]
    check_total(opname, "sizes", sizes, rows[src][SIZE], f"rank {src}'s x.shape[{rows[0][DIM]}]")


@entry(
    "scatter",
    RAGGED,
    header=Header(
        args=(Arg("src"), SIZES_GIVEN),
        # `src`'s length split as tensor_split does, each piece read on its own: compiled, each is
        # then an unbacked symbol of its own, which the backward binds from its inputs (inductor
        # 2.14 and 2.15 cannot bind an expression of one, such as `(u0 + 1) // 2`).
        reads=Reader(
            lambda rows, rank: tensor_split_sizes(rows[rows[0][ARG0]][SIZE], len(rows)), lambda w: w
        ),
        varying_dim="`dim`",
        checks=(_scatter_sizes_agree,),
    ),
    collectives=_sized_a2a_plan,
    refuse=Refusal("its input is one rank's tensor", "funcoll.split_forward_gather_backward"),
)
def scatter(
    x: Tensor,
    src: int,
    sizes: Sequence[int] | Tensor | None = None,
    dim: int = 0,
    *,
    group: GroupLike = None,
) -> Tensor:
    """Split rank `src`'s `x` along `dim` and give rank i its i-th piece (``torch.distributed.scatter``).

    The ragged data model, the other way round from :func:`gather`: rank i gets
    ``sizes[i]`` rows (any ``>= 0``), the rows ``[sizes[0] + ... + sizes[i-1],
    ... + sizes[i])`` of `src`'s `x`.

    Args:
        x: on `src`, the tensor to split. On the other ranks, a tensor of the same
            dtype, ndim and shape apart from `dim`, whose values and length along
            `dim` are not used (an empty ``x.narrow(dim, 0, 0)`` will do).
        src: the rank (in `group`) whose `x` is split.
        sizes: every rank's length, the same on every rank (a list of world ints
            or an int64 tensor), summing to `src`'s ``x.shape[dim]``. None:
            ``funcoll.split_sizes(n, world)`` of `src`'s length `n` (the first ranks
            one row longer, as ``torch.tensor_split``), which the other ranks learn
            from one small all_gather that also checks that the ranks agree.
        dim: the dim to split.
        group: the communicator.

    Returns:
        A new tensor: `x`'s shape with ``sizes[rank]`` rows along `dim`, holding
        this rank's piece of `src`'s `x`.

    Backward: the gather of the pieces' gradients onto `src`, in rank order: `src`'s
    `x` gets their concatenation, the other ranks' `x` zeros (their values were
    never used). Every rank joins it, so `x` requires grad on all ranks or none.

    Compiled, the lengths are unbacked SymInts when exchanged or passed as a tensor;
    ``funcoll.mark_ragged(x, dim)`` keeps a changing length of `src`'s `x` from
    recompiling (docs/compile.md).

    A DTensor `x` is refused: its input is one rank's tensor, which no placement
    describes; ``split_forward_gather_backward`` splits a ``Replicate()`` one.

    Example (2 ranks)::

        # rank 0: x = [[1., 2.], [3., 4.], [5., 6.]]   rank 1: x = torch.empty(0, 2)
        scatter(x, src=0)            # rank 0: [[1., 2.], [3., 4.]]   rank 1: [[5., 6.]]
        scatter(x, 0, sizes=[1, 2])  # rank 0: [[1., 2.]]   rank 1: [[3., 4.], [5., 6.]]
    """
    opname, g = "funcoll.scatter", cast(Group, group)
    d = check_dim(opname, x, dim)
    check_rank(opname, "src", src, g.size)
    given = None if sizes is None else host_sizes(opname, "sizes", sizes, g.size)
    checked = checks_enabled() and not g.is_single
    if given is not None and g.rank == src and not checked:  # with checks, every rank checks it (the header)
        check_total(opname, "sizes", given, x.shape[d], f"rank {src}'s x.shape[{d}]")
    if g.is_single:
        return fresh(x)
    if given is None or checked:
        # the list travels for every rank to check (a tensor as given: its entries may be unbacked)
        tail = sizes if isinstance(sizes, Tensor) else None if given is None else torch.tensor(list(given))
        _, ints = exchange("scatter", x, d, g, args=(src, int(given is not None)), sizes=tail)
    sz = given if given is not None else ints  # exchanged: `src`'s length, split (scatter's Header)
    xm = to_rows(x, d)
    if g.rank == src:
        torch._check(xm.shape[0] == sum(sz))
        send = list(sz)
    else:  # nothing of this rank's x travels: its gradient is zeros
        xm, send = xm[:0], [0] * g.size
    recv = [sz[g.rank] if j == src else 0 for j in range(g.size)]
    return from_rows(_prims.all_to_all_p(xm, recv, send, g.name), x.dtype, d)


@entry(
    "all_gather_list",
    RAGGED,
    header=_GATHER_HEADER,
    collectives=_ragged_gather_plan,
    refuse=Refusal("its result is a list of the ranks' tensors", "funcoll.all_gather(x, dim)"),
)
def all_gather_list(
    x: Tensor,
    dim: int = 0,
    *,
    group: GroupLike = None,
    strategy: str = "auto",
    sizes: Sequence[int] | Tensor | None = None,
) -> list[Tensor]:
    """Gather every rank's `x` (ragged along `dim`) as a list with one tensor per rank.

    Args:
        x: this rank's tensor; the ragged data model of :func:`gather`.
        dim: the ragged dim.
        group: the communicator.
        strategy: how the rows travel, as in :func:`gather`. With ``"pad"`` each
            piece is a view of its rank's block of the padded all_gather.
        sizes: every rank's length along `dim`, when the caller knows them: nothing
            is exchanged (as in :func:`gather`).

    Returns:
        ``[x_0, x_1, ...]``: rank i's tensor at index i, as views into one gathered
        buffer (the form of the widely copied ``all_gather_nd`` recipe). A 0-d `x`
        gives every rank's scalar.

    Backward: a ragged ``reduce_scatter`` (sum): rank i gets the sum over ranks of
    the gradients of element i.

    A DTensor `x` is refused: a list per rank has no placement (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [1.5, 2.3]      rank 1: x = [5.3]
        all_gather_list(x)            # both: [tensor([1.5, 2.3]), tensor([5.3])]
    """
    opname, g, x0 = "funcoll.all_gather_list", cast(Group, group), x
    x, d, ndim = as_rows(opname, x, dim)
    strat = _check_strategy(opname, strategy)
    sizes = given_sizes(opname, x, d, sizes, g)
    if g.is_single:
        return [fresh(x0)]
    sz, stats, _ = row_sizes("all_gather_list", x, d, g, (-1, strat), ndim, sizes)
    pieces = _prims.gather_pieces(to_rows(x, d), sz, strategy, g.name, g.size, g.rank, stats)
    pieces = [unwire(p, x.dtype).movedim(0, d) for p in pieces]
    return pieces if ndim is None else [p.reshape(()) for p in pieces]


def _all_gather_ragged_dtensor(
    ax: MeshAxis, dim: int, strategy: str, sizes: Sequence[int] | Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Shard(dim) -> Replicate()``, and the shards' lengths (`sizes` is not read)."""
    _check_strategy(ax.opname, strategy)
    d = ax.dim(dim)
    y = gather_shards(ax, d, strategy)
    return y, ints_on(y.device, ax.sizes(d))


@entry(
    "all_gather_ragged",
    RAGGED,
    header=_GATHER_HEADER,
    collectives=_ragged_gather_plan,
    placements=("Shard(dim)", "Replicate()"),
    dtensor=_all_gather_ragged_dtensor,
)
def all_gather_ragged(
    x: Tensor,
    dim: int = 0,
    *,
    group: GroupLike = None,
    strategy: str = "auto",
    sizes: Sequence[int] | Tensor | None = None,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> tuple[Tensor, Tensor]:
    """Gather every rank's `x` (ragged along `dim`) and the per-rank sizes.

    Args:
        x: this rank's tensor; the ragged data model of :func:`gather`.
        dim: the ragged dim.
        group: the communicator.
        strategy: how the rows travel, as in :func:`gather`.
        sizes: every rank's length along `dim`, when the caller knows them: nothing
            is exchanged (as in :func:`gather`), and they are returned.
        wire: the format the rows travel in, as in :func:`gather` (docs/wire.md).
        grad_wire: the format of the backward's ragged reduce-scatter (None: exact).

    Returns:
        ``(y, sizes)``: `y` is the concatenation along `dim` in rank order, `sizes` an
        int64 tensor of shape ``(world,)`` on ``x.device`` with each rank's length;
        ``sizes.cumsum(0)`` gives the offsets. A 0-d `x` counts as one row: `y` is
        the ``(world,)`` stack of every rank's scalar.

    Backward: a ragged ``reduce_scatter`` (sum) of the gradient of `y`.

    DTensor `x`: ``Shard(dim) -> Replicate()``; `sizes` are its shards' lengths
    (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [[1, 2], [3, 4]]   rank 1: x = [[5, 6]]
        all_gather_ragged(x)   # both: ([[1, 2], [3, 4], [5, 6]], tensor([2, 1]))
    """
    opname, g = "funcoll.all_gather_ragged", cast(Group, group)
    x, d, ndim = as_rows(opname, x, dim)
    _check_strategy(opname, strategy)
    given = given_sizes(opname, x, d, sizes, g)
    if g.is_single:
        return fresh(x), ints_on(x.device, [x.shape[d]])
    y, table = ragged_all_gather("all_gather_ragged", x, d, g, strategy, ndim, given, (wire, grad_wire))
    if table is not None:
        return y, table[:, SIZE].clone()
    as_given = sizes if isinstance(sizes, Tensor) else torch.tensor(given, dtype=torch.int64)
    return y, as_given.to(device=x.device, dtype=torch.int64).reshape(-1).clone()


def _check_total(opname: str, arg: str, sizes: list[IntLike], x: Tensor, dim: int) -> None:
    check_total(opname, arg, sizes, x.shape[dim], f"x.shape[{dim}]")


def reduce_scatter_v(
    opname: str, x: Tensor, dim: int, sizes: Sequence[int] | Tensor, reduce_op: str, g: Group
) -> Tensor:
    """The ragged form of :func:`funcoll.reduce_scatter` (its `sizes` argument): one all_to_all.

    Every rank passes the same `sizes` (that is what they mean), so nothing has to
    be exchanged: the list is checked here against this rank's ``x``, before any
    communication (a tensor is read on the host first: a device-to-host sync for a
    GPU tensor, since the sizes shape the output). With
    ``funcoll.set_checks(True)`` the sizes also travel in a header, so that ranks
    whose `sizes`, shapes or ops differ all raise instead of reducing the wrong rows.
    """
    given = host_sizes(opname, "sizes", sizes, g.size)
    _check_total(opname, "sizes", given, x, dim)
    if g.is_single:
        return fresh(x)
    x = check_agreement("reduce_scatter", x, g, dim, (REDUCE_OPS.index(reduce_op), 1), given)
    stats = (min_of(*given), max_of(*given), x.shape[dim])
    xm, wop = to_rows(x, dim), wire_op(reduce_op, x.dtype)
    return from_rows(_prims.reduce_scatter_v_p(xm, given, wop, g.name, g.size, g.rank, stats), x.dtype, dim)


def _send_sizes_sum(opname: str, rows: list[list[int]]) -> None:
    for i, (r, send) in enumerate(zip(rows, tails(rows), strict=True)):
        if any(s < 0 for s in send) or sum(send) != r[SIZE]:
            raise ValueError(
                f"{opname}: rank {i} has `send_sizes`={send}, which must be {len(rows)} non-negative "
                f"ints summing to x.shape[dim]={r[SIZE]}"
            )


@entry(
    "all_to_all_v",
    RAGGED,
    header=Header(
        # this rank's send sizes, then what every rank sends it
        reads=Reader(
            lambda rows, rank: rows[rank][WIDTH : WIDTH + len(rows)] + [r[WIDTH + rank] for r in rows],
            lambda w: 2 * w,
        ),
        checks=(_send_sizes_sum, same_wire),
    ),
    collectives=_sized_a2a_plan,
    refuse=Refusal("it sends any rows to any rank", "funcoll.all_to_all or funcoll.to_ragged"),
)
def all_to_all_v(
    x: Tensor,
    send_sizes: Sequence[int] | Tensor,
    recv_sizes: Sequence[int] | Tensor | None = None,
    *,
    dim: int = 0,
    group: GroupLike = None,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> tuple[Tensor, Tensor]:
    """Uneven all-to-all along `dim` (MoE dispatch): rank r sends ``send_sizes[j]`` rows to rank j.

    Ragged data model: `x` holds ``sum(send_sizes)`` rows along `dim`, laid out as
    the block for rank 0, then rank 1, ...; the result holds ``sum(recv_sizes)`` rows,
    the block from rank 0 first. ``recv_sizes[i]`` on rank r equals
    ``send_sizes[r]`` on rank i.

    Args:
        x: this rank's rows; all dims but `dim`, and the dtype, agree on every rank.
        send_sizes: world ints (a list, or an int tensor on any device).
        recv_sizes: world ints, or None to have funcoll exchange the send sizes first
            (one small all_gather that also checks the ranks agree on shapes).
        dim: the dim the rows are counted along.
        group: the communicator.
        wire: the format the rows travel in (docs/wire.md), each row encoded on its
            own with its block scales along its last dim (``x``'s last dim, or the
            one before it for ``dim=-1``), so the sizes still count rows:
            ``funcoll.Wire(torch.float8_e4m3fn, block=128)`` is DeepEP's FP8
            dispatch. None (default): exact. A floating `x` only.
        grad_wire: the format of the backward's all_to_all_v (None: exact).

    Returns:
        ``(y, recv_sizes)``: `y` the received rows (a new tensor), `recv_sizes` an int64
        tensor of shape ``(world,)`` on ``x.device``, given or exchanged. The pair is
        returned either way so the result type never depends on the arguments.

    Backward: ``all_to_all_v`` of the gradient with send and receive sizes swapped,
    in `grad_wire`; the forward's rounding in `wire` counts as the identity.

    A DTensor `x` is refused: rows sent to any rank have no placement; see
    :func:`funcoll.to_ragged` (docs/dtensor.md).

    Example (2 ranks)::

        # rank 0: x = [1, 2, 3], send_sizes = [1, 2]
        # rank 1: x = [4, 5],    send_sizes = [2, 0]
        all_to_all_v(x, send_sizes)
        # rank 0: ([1, 4, 5], tensor([1, 2]))   rank 1: ([2, 3], tensor([2, 0]))
    """
    opname, g = "funcoll.all_to_all_v", cast(Group, group)
    d = check_dim(opname, x, dim)
    xm = to_rows(x, d)
    if recv_sizes is None:
        if isinstance(send_sizes, Tensor):
            send_t = check_sizes(opname, "send_sizes", send_sizes, g.size)
        else:
            sz = host_sizes(opname, "send_sizes", send_sizes, g.size)
            _check_total(opname, "send_sizes", sz, x, d)
            send_t = torch.tensor(sz, dtype=torch.int64)
        if g.is_single:
            _check_total(opname, "send_sizes", host_sizes(opname, "send_sizes", send_t, 1), x, d)
            return fresh(x), fresh(send_t.to(device=x.device, dtype=torch.int64))
        tail = wire_tail(g.size, [0] * g.size, wire, grad_wire)  # the formats' code after the send sizes
        if tail is not None:
            send_t = torch.cat([send_t.to(torch.int64), send_t.new_tensor(tail[g.size :], dtype=torch.int64)])
        table, ints = exchange("all_to_all_v", x, d, g, sizes=send_t)
        send, recv = ints[: g.size], ints[g.size :]
        recv_t = table[:, WIDTH + g.rank].clone()
    else:
        both = _host_sizes_pair(opname, send_sizes, recv_sizes, g.size)
        send, recv = both[: g.size], both[g.size :]
        _check_total(opname, "send_sizes", send, x, d)
        if isinstance(recv_sizes, Tensor):
            recv_t = fresh(recv_sizes.to(device=x.device, dtype=torch.int64))
        else:
            recv_t = ints_on(x.device, recv)  # no wait for the device
        if g.is_single:
            if torch.compiler.is_compiling():
                torch._check(recv[0] == send[0])
            elif recv != send:
                raise ValueError(f"{opname}: on one rank `recv_sizes`={recv} must equal `send_sizes`={send}")
            return fresh(x), recv_t
    return from_rows(all_to_all_rows_wire_p(xm, recv, send, g.name, wire, grad_wire), x.dtype, d), recv_t


def _host_sizes_pair(
    opname: str, send: Sequence[int] | Tensor, recv: Sequence[int] | Tensor, world: int
) -> list[int]:
    if isinstance(send, Tensor) and isinstance(recv, Tensor):
        check_sizes(opname, "send_sizes", send, world)
        check_sizes(opname, "recv_sizes", recv, world)
        both = torch.cat([send.reshape(-1), recv.to(send.device).reshape(-1)])
        return host_sizes(opname, "send_sizes/recv_sizes", both, 2 * world)  # one sync for both
    return host_sizes(opname, "send_sizes", send, world) + host_sizes(opname, "recv_sizes", recv, world)
