"""``dispatch`` and ``combine``: the argument checks, the counts' exchange and the row moves of each mode."""

from __future__ import annotations

import torch
from torch import Tensor

from .._base._checks import IntLike
from .._base._config import checks_enabled
from .._base._group import Group, GroupLike, resolve_group
from .._base._quant import Wire
from .._collective import _prims
from .._collective._async import wait
from .._collective._header import (
    NDIM_ONLY,
    WIDTH,
    Arg,
    Header,
    check_agreement,
    disagree,
    host_ints,
    named,
    same_wire,
    wire_tail,
)
from .._collective._quantized import all_to_all_rows_wire_p
from .._ops._entry import Refusal, entry
from ._autograd import Gather, take, weighted_sum
from ._dropless import Dropless
from ._handle import MoEHandle
from ._layout import (
    block_layout,
    count,
    drops,
    eager_rows,
    exact_sizes,
    exclusive,
    expert_layout,
    inverse,
    is_int,
    rank_in_dest,
    same_sizes,
)

MODES = ("exact", "static", "dropless")


def _check_dispatch_args(
    opname: str,
    x: object,
    topk_idx: object,
    num_experts: object,
    world: int,
    mode: object,
    capacity: object,
    align: object,
    counts: object = None,
    topk_weights: object = None,
) -> tuple[Tensor, Tensor]:
    """Every argument check of :func:`dispatch` after its entry's, before any communication."""
    assert isinstance(x, Tensor) and isinstance(topk_idx, Tensor)  # the entry checked them
    if x.dim() != 2:
        raise ValueError(f"{opname}: `x` must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    if topk_idx.dim() != 2:
        raise ValueError(f"{opname}: `topk_idx` must be 2-D (tokens, k), got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise TypeError(f"{opname}: `topk_idx` must hold integer expert ids, got dtype {topk_idx.dtype}")
    if topk_idx.shape[1] == 0:
        raise ValueError(
            f"{opname}: `topk_idx` has shape {tuple(topk_idx.shape)}: each token needs k >= 1 choices"
        )
    if not same_sizes(
        x.shape[:1], topk_idx.shape[:1], f"{opname}: `topk_idx` must have one row per token of `x`"
    ):
        raise ValueError(
            f"{opname}: `topk_idx` has {topk_idx.shape[0]} rows but `x` has {x.shape[0]} tokens: one row per token"
        )
    if not is_int(num_experts):
        raise TypeError(f"{opname}: `num_experts` must be an int, got {type(num_experts).__name__}")
    if num_experts <= 0 or num_experts % world:  # type: ignore[operator]
        raise ValueError(
            f"{opname}: `num_experts`={num_experts} must be a positive multiple of the group's {world} ranks "
            f"(each rank owns num_experts // world experts)"
        )
    if mode not in MODES:
        raise ValueError(f"{opname}: `mode`={mode!r} is not one of {MODES} or a funcoll.moe.Dropless policy")
    if mode == "dropless":
        if capacity is None:
            raise ValueError(
                f"{opname}: `capacity`=None: mode='dropless' needs the capacity its static path tries first"
            )
        if torch.compiler.is_compiling():
            raise ValueError(
                f"{opname}: `mode`='dropless' cannot be compiled: it picks static or exact mode on a host "
                f"read, which one graph cannot branch on; compile mode='exact' (dropless, one host read, "
                f"one graph for every routing), or run a funcoll.moe.Dropless policy around the compiled forward"
            )
    if capacity is not None:
        if not is_int(capacity):
            raise TypeError(f"{opname}: `capacity` must be an int or None, got {type(capacity).__name__}")
        if capacity < 0:  # type: ignore[operator]
            raise ValueError(f"{opname}: `capacity`={capacity} must be >= 0 (rows per destination rank)")
        if mode == "exact":
            raise ValueError(
                f"{opname}: `capacity`={capacity} is for mode='static' or 'dropless'; mode='exact' drops nothing"
            )
    if not is_int(align):
        raise TypeError(f"{opname}: `align` must be an int, got {type(align).__name__}")
    if align < 1:  # type: ignore[operator]
        raise ValueError(f"{opname}: `align`={align} must be >= 1")
    if isinstance(counts, Tensor):  # the entry checked that it is one, if given
        if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise TypeError(f"{opname}: `counts` must hold integer pair counts, got dtype {counts.dtype}")
        if tuple(counts.shape) != (num_experts,):
            raise ValueError(
                f"{opname}: `counts` has shape {tuple(counts.shape)}, expected (num_experts,) = ({num_experts},): "
                f"this rank's (token, choice) pairs routed to each expert"
            )
    if isinstance(topk_weights, Tensor):
        if not same_sizes(
            topk_weights.shape, topk_idx.shape, f"{opname}: `topk_weights` must have `topk_idx`'s shape"
        ):
            raise ValueError(
                f"{opname}: `topk_weights` has shape {tuple(topk_weights.shape)}, expected `topk_idx`'s "
                f"{tuple(topk_idx.shape)}: one weight per (token, choice)"
            )
    return x, topk_idx


# The rows' formats on the wire, (this direction's, the gradient's): `wire` and `grad_wire`.
Formats = tuple[Wire | None, Wire | None]


Layout = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # source, counts, offsets, ends, back_index


def _dropless_table(
    expert: Tensor,
    given: Tensor | None,
    capacity: int,
    num_experts: int,
    align: int,
    g: Group,
) -> tuple[Tensor, Tensor, Tensor, IntLike, IntLike, tuple[Tensor, list[IntLike]]]:
    """Dropless mode's counts exchange and its one host read, before the path is chosen.

    Static if no rank of the group routes more pairs to one rank than the group's
    largest `capacity` (then nothing drops), exact otherwise. One all_gather of every
    rank's per-expert counts and capacity gives every rank the whole table: its own
    received counts (the column block of its experts), and the group's need and
    capacity, the same on every rank, so every rank takes the same path with the
    same capacity (ranks whose capacities differ, from different token counts,
    agree on the largest).

    Returns this rank's per-expert counts, the pairs by expert, the rows sent to
    each rank, the group's need and capacity, and (received counts, exact mode's ints).
    """
    world, e_local = g.size, num_experts // g.size
    given = count(expert, num_experts) if given is None else given  # counted once: both paths reuse it
    # The capacity is filled in on the device: a tensor made from the host int would
    # be a copy the host waits for on CUDA, a second sync beside the one below.
    row = torch.cat([given, torch.full_like(given[:1], capacity)])
    # The primitive: every rank's row has E + 1 ints by construction (no check to repeat).
    table = row.unsqueeze(0) if g.is_single else _prims.all_gather_p(row, g.name, g.size).view(g.size, -1)
    # While the table travels: the pairs by expert (token-major within one), the order
    # both paths send them in. The static path is taken only when nothing drops, so
    # it sends every pair, as exact mode does.
    order = torch.sort(expert, stable=True).indices
    # The table is read at once (the need, then the layout): waited here, so that its
    # small ops run on a plain tensor, not each through a pending result's dispatch.
    table = wait(table)
    recv_counts = table[:, g.rank * e_local : (g.rank + 1) * e_local]  # (world, E_local): by source
    sends = table[:, :num_experts].reshape(world, world, e_local).sum(2)  # rows rank s routes to rank d
    per_dest = sends[g.rank]
    # Device-to-host sync, the one of a dropless dispatch (eager only: the path taken
    # depends on it): the group's need and capacity, then exact mode's 2 * world + 1
    # ints, so that an overflow reads nothing more.
    agreed = (sends.max().view(1), table[:, num_experts].max().view(1))
    ints = host_ints(exact_sizes(per_dest, sends[:, g.rank], recv_counts, align, head=agreed))
    return given, order, per_dest, ints[0], ints[1], (recv_counts, ints[2:])


def _kept(
    expert: Tensor, given: Tensor | None, cap: int, e_local: int, world: int, dropless: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Static mode: whether each pair is sent, and the pairs bound to each rank; (None, None): every pair is.

    Static mode proper drops the pairs past `cap` for one destination, unless none can
    (see `drops`): then every pair is sent as on dropless's static path, with no drop order.
    """
    if not drops(cap, expert.shape[0], dropless=dropless):
        return None, None
    dest = expert // e_local  # each pair's destination rank
    # pairs bound to each rank, before the capacity
    wanted = count(dest, world) if given is None else given.view(world, e_local).sum(1)
    return rank_in_dest(dest, world, wanted) <= cap, wanted


def _static_send(
    x: Tensor, order: Tensor, keep: Tensor | None, sent: Tensor, cap: int, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Static mode's send buffer: one block of ``cap + 1`` rows per rank, and the indices combine reads back.

    Block d holds the kept pairs bound to rank d, by expert, then zero rows; on the
    wire each block has one row more than `cap`, never data, so the last row of every
    received block is a zero row that empty layout rows read. In `order` the kept
    pairs come first, by expert (so by destination): slot i of block d holds pair
    ``order[first[d] + i]`` if ``i < sent[d]``. Returns the rows, each pair's slot
    (``row_of``), each slot's token (``send_index``) and pair, and which slots are free.
    """
    world, tokens, n_pairs, device = sent.shape[0], x.shape[0], order.shape[0], x.device
    block = cap + 1
    first = exclusive(sent)
    i = torch.arange(block, device=device)
    free = (i >= sent.unsqueeze(1)).view(-1)  # (world * block,): the slot holds no pair
    at = (first.unsqueeze(1) + i).view(-1)  # a free slot: some later pair, or past them
    if eager_rows(n_pairs):  # a free slot reads any pair, then holds none (T * k)
        pair_of_slot = order.index_select(0, at.clamp_(max=n_pairs - 1)).masked_fill_(free, n_pairs)
    else:  # `order` may have no pair to read: T * k read from one more entry
        pair_of_slot = torch.cat([order, order.new_full((1,), n_pairs)]).index_select(
            0, at.masked_fill_(free, n_pairs)
        )
    # Combine gets the blocks back as sent. A dropped pair reads row `cap`, the spare
    # row of block 0 (zeros, which combine weights by zero; no kept pair's slot is a
    # spare row); with none dropped, every pair's entry is written.
    if keep is None:
        row_of = torch.empty(n_pairs + 1, dtype=torch.int64, device=device)
    else:
        row_of = torch.full((n_pairs + 1,), cap, dtype=torch.int64, device=device)
    row_of = row_of.scatter_(0, pair_of_slot, torch.arange(world * block, device=device))[:n_pairs]
    send_index = pair_of_slot // k  # an empty slot: T, past x's rows
    # An empty slot reads any row of x, and each block's spare row is zeroed (x is
    # not copied with a zero row), unless x has no row to read.
    spare: bool | int = block if eager_rows(tokens) else True
    # Its backward sums each token's slots (one bag of k): a gather, not a scatter
    # into zeros. A dropped pair's is the spare row of block 0, whose gradient is
    # zero (the layout's backward zeroes the spare rows).
    if x.dtype.is_floating_point:
        send_rows = Gather.apply(x, send_index, spare, row_of.view(tokens, k), None)
    else:
        send_rows = take(x, send_index, spare)
    return send_rows, row_of, send_index, pair_of_slot, free


def _exact_sizes(
    recv_counts: Tensor, per_dest: Tensor, ints: list[IntLike] | None, align: int, world: int
) -> tuple[list[IntLike], list[IntLike], IntLike]:
    """Exact mode's host ints: (rows sent to each rank, rows received from each, the layout's rows).

    `ints`: exact mode's host ints when dropless read them already, else None.
    """
    if ints is None:
        # Device-to-host sync, the one of an exact dispatch: the uneven all-to-all takes its splits as
        # host ints. One read of 2 * world + 1 ints: the rows sent to and received from each rank,
        # and the layout's rows. Each is read as it is used, not summed on the host from per-expert
        # counts: compiled, each is then an unbacked symbol of its own, and the backward, which
        # takes the split sizes as inputs, binds them (inductor 2.14 cannot bind a sum of symbols).
        ints = host_ints(exact_sizes(per_dest, recv_counts.sum(1), recv_counts, align))
    return ints[:world], ints[world : 2 * world], ints[2 * world]


def _exact_layout(
    recv: Tensor, recv_counts: Tensor, recv_sizes: list[IntLike], rows: IntLike, align: int
) -> tuple[Tensor, Layout]:
    """Exact mode's received rows laid out by expert: (out, layout)."""
    n_in = sum(recv_sizes)
    torch._check(rows >= n_in)
    source, dest_of, counts, offsets, ends = expert_layout(recv_counts, n_in, rows, align)
    back_index = dest_of  # every received row is data: no index past the rows of y
    # The backward gathers each received row's gradient from its layout row.
    out = Gather.apply(recv, source, align > 1, back_index, None)
    return out, (source, counts, offsets, ends, back_index)


def _static_layout(
    recv: Tensor, recv_counts: Tensor, cap: int, e_local: int, align: int
) -> tuple[Tensor, Layout, dict[str, object]]:
    """Static mode's received blocks laid out by expert: (out, layout, handle extras)."""
    world = recv_counts.shape[0]
    block = cap + 1
    rows = -(-(world * cap + e_local * (align - 1)) // align) * align
    source, dest_of, counts, offsets, ends = block_layout(recv_counts, block, rows, align)
    # The rows combine sends back, as the blocks came: block row q carries its layout
    # row, if it holds data; otherwise an index past y's rows, which combine's gather
    # clamps (any row of y; each block's spare row zeros), or, if y has none, reads
    # as a zero row (index 0). Combine reads back only the slots that carry a pair
    # and the spare row of block 0.
    back_index = dest_of if rows > 0 else dest_of.clamp(max=0)
    # The backward gathers each received row's gradient from its layout row. A block row
    # that holds no data gets the last layout row's, unread by its sender, except the
    # spare rows, zero: a dropped pair's names its sender's spare row.
    if rows == 0:  # no layout row (capacity 0): nothing to gather
        out = take(recv, source, spare=False)
    else:
        out = Gather.apply(recv, source, False, back_index, block)
    return out, (source, counts, offsets, ends, back_index), {"_recv_table": recv_counts}


def _expert_ids(
    opname: str, topk_idx: Tensor, counts: Tensor | None, num_experts: int, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """Each pair's expert id (pair f = t * k + j) and the caller's counts, checked on the device."""
    expert = topk_idx.to(device=device, dtype=torch.int64).reshape(-1)
    torch._assert_async(  # floor division gives 0 exactly for the ids in [0, E): one pass, not two compares
        (expert // num_experts == 0).all(),
        f"{opname}: `topk_idx` holds an expert id outside [0, num_experts) = [0, {num_experts})",
    )
    given = None if counts is None else counts.to(device=device, dtype=torch.int64)  # the caller's
    if given is not None and checks_enabled():  # the caller's counts route the data: wrong ones misroute it
        torch._assert_async(
            (given == count(expert, num_experts)).all(),
            f"{opname}: `counts` are not the counts of `topk_idx`'s expert ids",
        )
    return expert, given


def _route(
    x: Tensor,
    expert: Tensor,
    given: Tensor | None,
    k: int,
    num_experts: int,
    mode: str,
    capacity: int | None,
    align: int,
    g: Group,
    group: GroupLike,
    topk_weights: Tensor | None,
    formats: Formats,
) -> tuple[Tensor, MoEHandle]:
    """Dispatch's steps in the order they are issued: dropless's table, the counts
    exchange, the send side laid out while the counts travel, the rows' exchange
    (``recv``) and its handle (`group` as the caller passed it, `topk_weights` kept
    for combine)."""
    world = g.size
    e_local = num_experts // world
    tokens = x.shape[0]
    n_pairs = expert.shape[0]
    known: tuple[Tensor, list[IntLike]] | None = None  # dropless: the counts exchanged and the ints read
    group_needed = None
    order = None  # the pairs in the order they are sent: by expert, so by destination rank
    if mode == "dropless":
        given, order, per_dest, group_needed, capacity, known = _dropless_table(
            expert, given, capacity, num_experts, align, g
        )
        mode = "static" if group_needed <= capacity else "exact"
    keep = wanted = None  # static mode: whether each pair is sent (None: every pair is), and to where
    if mode == "static":
        cap = n_pairs if capacity is None else capacity
        keep, wanted = _kept(expert, given, cap, e_local, world, dropless=known is not None)
    if keep is None:
        per_expert = count(expert, num_experts) if given is None else given
    else:
        per_expert = count(expert, num_experts, keep.to(torch.int64))
    if known is None:
        # Every rank's per-expert counts for this rank's experts: (world, E_local), one row per
        # source. Issued before the send side is laid out, which runs while they travel.
        one = [1] * world  # row r: the counts of rank r's experts
        recv_counts = all_to_all_rows_wire_p(per_expert.view(world, e_local), one, one, g.name, None, None)
    else:  # dropless: exchanged already (static mode's path: every pair fits)
        recv_counts = known[0]
    if order is None:  # by expert, the dropped pairs (key E) after the kept ones
        order = torch.sort(
            expert if keep is None else torch.where(keep, expert, num_experts), stable=True
        ).indices
    if mode == "exact":
        row_of = inverse(order)
        send_index = order // k
        send_rows = Gather.apply(x, send_index, False, row_of.view(tokens, k), None)
    if keep is None and known is None:  # every pair is sent (dropless summed them beside its table)
        per_dest = per_expert.view(world, e_local).sum(1)  # the rows sent to each rank
    if mode == "static":
        sent = per_dest if keep is None else wanted.clamp(max=cap)
        send_rows, row_of, send_index, pair_of_slot, free = _static_send(x, order, keep, sent, cap, k)
        if keep is not None:  # the pairs bound to each rank before the capacity, which needed counts
            per_dest = wanted
    # Read at once by the layout's small ops (and exact mode's host read): waited here,
    # so that they run on a plain tensor, not each through a pending result's dispatch.
    recv_counts = wait(recv_counts)
    if mode == "exact":
        ints = None if known is None else known[1]  # dropless, overflowed: read with the need
        send_sizes, recv_sizes, rows = _exact_sizes(recv_counts, per_dest, ints, align, world)
    else:  # the blocks: the counts are known from the counts exchange, so nothing else travels
        send_sizes = recv_sizes = [cap + 1] * world
    # The primitive, not all_to_all_v: the sizes are host ints already (that op would also
    # build a recv_sizes tensor from them, a blocking host-to-device copy on CUDA), and the
    # rows' shapes agree on every rank by construction (nothing to check again).
    recv = all_to_all_rows_wire_p(send_rows, recv_sizes, send_sizes, g.name, *formats)
    if mode == "exact":
        out, layout = _exact_layout(recv, recv_counts, recv_sizes, rows, align)
        extra: dict[str, object] = {"send_sizes": send_sizes, "recv_sizes": recv_sizes}
    else:
        out, layout, extra = _static_layout(recv, recv_counts, cap, e_local, align)
        extra.update(_keep=keep, _free=free)
    source, counts, offsets, ends, back_index = layout
    handle = MoEHandle(
        mode=mode, tokens=tokens, topk=k, num_experts=num_experts, capacity=None if mode == "exact" else cap,
        align=align, group=group, counts=counts, offsets=offsets, ends=ends,
        topk_weights=topk_weights,
        send_index=send_index, recv_source=source, back_index=back_index, row_of=row_of,
        send_pairs=order if mode == "exact" else pair_of_slot,
        group_needed=group_needed, _per_dest=per_dest, **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    return out, handle


def _same_capacity(opname: str, rows: list[list[int]]) -> None:
    """Static mode: every rank's blocks have its capacity's rows, so the capacities agree (tail column 0)."""
    disagree(
        opname,
        rows,
        "the static capacity (`capacity`, or T * k when None, which needs the same T tokens on every rank)",
        lambda r: r[WIDTH],
        lambda r: r[WIDTH],
    )


# What every rank's call must agree on (a checked call's header; `x`'s token count may differ):
# x's dtype and hidden size, these, the static capacity and the formats; a policy's run
# counts as its mode.
_DISPATCH_HEADER = Header(
    args=(Arg("num_experts"), Arg("mode", named(MODES))),
    reads=NDIM_ONLY,
    varying_dim="the token count `x`.shape[0]",
    checks=(_same_capacity, same_wire),
    check_only=True,
)


@entry(
    "moe.dispatch",
    header=_DISPATCH_HEADER,
    tensors=("x", "topk_idx"),
    optional=("counts", "topk_weights"),
    refuse=Refusal("its rows go to the ranks of their experts"),
    resolve=False,  # the handle keeps `group` as passed (combine resolves it once more)
)
def dispatch(
    x: Tensor,
    topk_idx: Tensor,
    num_experts: int,
    *,
    group: GroupLike = None,
    mode: str | Dropless = "exact",
    capacity: int | None = None,
    align: int = 1,
    counts: Tensor | None = None,
    topk_weights: Tensor | None = None,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> tuple[Tensor, MoEHandle]:
    """Send each token's k routed copies to the ranks of their experts, grouped by local expert.

    Args:
        x: ``(T, H)`` this rank's tokens (any ``T >= 0``, the same ``H`` and dtype on every rank).
        topk_idx: ``(T, k)`` integer expert ids in ``[0, num_experts)``: token t's
            choice j goes to expert ``topk_idx[t, j]`` on rank ``topk_idx[t, j] // E_local``.
        num_experts: ``E``, a positive multiple of the group's size; rank r owns
            experts ``[r * E_local, (r + 1) * E_local)`` with ``E_local = E // world``.
        group: the communicator.
        mode: ``"exact"`` (sizes read on the host once, nothing dropped),
            ``"static"`` (static shapes, no host read, a capacity per destination),
            ``"dropless"`` (eager: static with the group's largest `capacity` if it
            drops nothing on any rank, else exact; one host read), or a
            :class:`Dropless` policy (static with the policy's capacity inside
            ``policy.run``, which reads one overflow flag per step and runs an
            overflowed step again in exact mode).
        capacity: static mode: rows each rank may send to each rank (``C``); the
            first ``C`` pairs in token-major order are kept, the rest dropped and
            counted in ``handle.dropped``. None: ``T * k``, dropless (every rank
            must then hold the same ``T``). Dropless mode: the capacity of its
            static path (required). Must be None in exact mode.
        align: each local expert's block in ``recv`` starts at a multiple of it
            and is padded with zero rows to one.
        counts: ``(E,)`` integer, this rank's pairs routed to each expert, if the
            caller has counted them already (torchtitan's router does): dispatch
            then counts nothing itself. They must be ``topk_idx``'s counts; under
            ``funcoll.set_checks(True)`` dispatch checks that they are.
        topk_weights: ``(T, k)`` the router's weights, if the caller has them at
            dispatch: kept in the handle for :func:`combine`, which then needs none.
        wire: the format the token rows travel in (docs/wire.md), each row encoded
            on its own with block scales along H: ``funcoll.Wire(torch.float8_e4m3fn,
            block=128)`` is DeepEP's FP8 dispatch. None (default): exact. The
            counts always travel exactly.
        grad_wire: the format of the backward's rows, the gradient going back to
            the tokens (None: exact; DeepEP's is ``Wire(torch.bfloat16)``).

    Returns:
        ``(recv, handle)``. ``recv`` is ``(R, H)``: local expert 0's rows, then
        expert 1's, ...; within an expert, rows from rank 0 first, each source's
        rows in its token order. ``handle.counts`` (int64 ``(E_local,)`` on ``x``'s
        device) holds each expert's true row count, ``handle.offsets`` where its
        block starts and ``handle.ends`` (int32) where it ends, the ``offs`` of a
        grouped GEMM; rows outside the blocks are zero. Exact mode: ``R`` is the sum
        of the counts, each rounded up to `align` (a data-dependent size: an
        unbacked SymInt when compiled). Static mode: ``R = world * C + E_local *
        (align - 1)`` rounded up to `align`, a static size. Dropless mode: static
        mode's ``recv`` and handle if ``handle.group_needed <= handle.capacity``
        (then ``handle.mode == "static"`` and nothing was dropped; the capacity is
        the group's largest), exact mode's otherwise.

    Host syncs: exact mode reads ``2 * world + 1`` ints on the host once (the rows
    sent to and received from each rank, which an uneven all-to-all takes as host
    ints, and ``R``); static mode reads nothing; dropless mode reads ``2 * world +
    3`` once (the group's need and capacity, then exact mode's ints), after the
    counts' all_gather.

    Backward: combine's data movement without the weights: the gradient rows of
    ``recv`` go back to their source rank (``all_to_all_v`` with the sizes swapped,
    or the even ``all_to_all`` of the blocks) and each token's gradient
    is the sum over its k copies (the adjoint of the row gather); padding and
    dropped pairs give zero.

    Example (2 ranks, E = 4, so E_local = 2, k = 1)::

        # rank 0: x = [[1], [2], [3]], topk_idx = [[3], [0], [2]]
        # rank 1: x = [[4], [5]],      topk_idx = [[1], [0]]
        recv, handle = dispatch(x, topk_idx, 4)
        # rank 0: recv = [[2], [5], [4]]   handle.counts = [2, 1]   (expert 0: 2 from rank 0, 5 from rank 1)
        # rank 1: recv = [[3], [1]]        handle.counts = [1, 1]   (expert 2: 3; expert 3: 1)
        recv, handle = dispatch(x, topk_idx, 4, align=2)
        # rank 0: recv = [[2], [5], [4], [0]]   handle.offsets = [0, 2]   handle.ends = [2, 4]
        recv, handle = dispatch(x, topk_idx, 4, mode="dropless", capacity=2)
        # both: handle.group_needed = 2 (each rank sends 2 pairs to the other) <= 2: static mode
        # rank 0: recv = [[2], [5], [4], [0]]   rank 1: recv = [[3], [1], [0], [0]]
        # with capacity=1: exact mode, the first call's recv on each rank
    """
    opname = "funcoll.moe.dispatch"
    policy = mode if isinstance(mode, Dropless) else None
    if policy is not None:
        mode, capacity = policy._mode(opname, capacity)
    g = resolve_group(opname, group)  # once: what dispatch issues runs on `g`
    x, topk_idx = _check_dispatch_args(
        opname, x, topk_idx, num_experts, g.size, mode, capacity, align, counts, topk_weights
    )
    # Sampled by default (funcoll.set_checks): ranks whose calls disagree raise, not abort.
    static = (x.shape[0] * topk_idx.shape[1] if capacity is None else capacity) if mode == "static" else 0
    tail = wire_tail(g.size, [static] + [0] * (g.size - 1), wire, grad_wire)
    x = check_agreement("moe.dispatch", x, g, 0, (num_experts, MODES.index(mode)), tail)
    expert, given = _expert_ids(opname, topk_idx, counts, num_experts, x.device)
    out, handle = _route(
        x, expert, given, topk_idx.shape[1], num_experts, mode, capacity, align, g, group, topk_weights,
        (wire, grad_wire),
    )  # fmt: skip
    if policy is not None and mode == "static":
        policy._record(handle.needed)
    return out, handle


@entry(
    "moe.combine",
    tensors=("y",),
    optional=("topk_weights",),
    refuse=Refusal("its rows are in the layout of dispatch's plain `recv`"),
    resolve=False,  # the group is the handle's
)
def combine(
    y: Tensor,
    handle: MoEHandle,
    topk_weights: Tensor | None = None,
    *,
    wire: Wire | None = None,
    grad_wire: Wire | None = None,
) -> Tensor:
    """Bring the experts' outputs back to their tokens and sum each token's k of them, weighted.

    Args:
        y: ``(R, H')`` the experts' outputs in the layout of :func:`dispatch`'s ``recv``
            (rows outside the experts' blocks are ignored).
        handle: what dispatch returned with ``recv``.
        topk_weights: ``(T, k)`` the router's weights, on ``y``'s device; None:
            those given to dispatch (``handle.topk_weights``).
        wire: the format the expert outputs travel back in (docs/wire.md), each row
            on its own; DeepEP combines in ``funcoll.Wire(torch.bfloat16)``. The
            weighted sum runs after decoding, in ``y``'s dtype. None (default): exact.
        grad_wire: the format of the backward's rows, the output's gradient going to
            the experts (None: exact).

    Returns:
        ``(T, H')``: ``out[t] = sum_j topk_weights[t, j] * y_row(t, j)``, where
        ``y_row(t, j)`` is the row dispatch made of token t's choice j (zero for a
        pair dropped in static mode), in this rank's token order.

    Host syncs: none (exact mode reuses the host sizes in `handle`).

    Backward: dispatch's data movement: each token's gradient, scaled by each of
    its k weights, goes to its expert's rank and row (``all_to_all_v`` with the
    sizes swapped, or the even ``all_to_all`` of the blocks); the gradient of ``topk_weights[t, j]``
    is the dot product of the output's gradient with ``y_row(t, j)``.

    Example (2 ranks, continuing :func:`dispatch`'s, the experts the identity)::

        # rank 0: topk_weights = [[0.5], [1.0], [2.0]]   rank 1: topk_weights = [[1.0], [1.0]]
        combine(recv, handle, topk_weights)
        # rank 0: [[0.5], [2.0], [6.0]]   rank 1: [[4.0], [5.0]]
    """
    opname = "funcoll.moe.combine"
    if not isinstance(handle, MoEHandle):
        raise TypeError(
            f"{opname}: `handle` must be the MoEHandle dispatch returned, got {type(handle).__name__}"
        )
    if topk_weights is None:
        if handle.topk_weights is None:
            raise TypeError(
                f"{opname}: `topk_weights` is None and dispatch was given none: pass the router's weights "
                f"to dispatch or to combine"
            )
        topk_weights = handle.topk_weights
    if y.dim() != 2:
        raise ValueError(f"{opname}: `y` must be 2-D (rows, hidden), got shape {tuple(y.shape)}")
    rows = handle.recv_source.shape[0]
    if not same_sizes(y.shape[:1], (rows,), f"{opname}: `y` must have as many rows as dispatch's `recv`"):
        raise ValueError(
            f"{opname}: `y` has {y.shape[0]} rows but dispatch's `recv` had {rows}: the same layout"
        )
    want = (handle.tokens, handle.topk)
    if not same_sizes(
        topk_weights.shape, want, f"{opname}: `topk_weights` must have shape (T, k) of dispatch's `x`"
    ):
        raise ValueError(
            f"{opname}: `topk_weights` has shape {tuple(topk_weights.shape)}, expected (T, k) = {want}"
        )
    # Every index is a row of y, and every index of row_of a row of what comes back
    # (static mode: the rows after the data are zero), except when y has no rows.
    # The backward gathers each layout row's gradient from the row that carried it
    # back; layout rows that hold no data (padding, empty capacity) get none. Static
    # mode: they read the last block's spare row, whose gradient is zero (its sender's
    # spare slot carries no pair, and the weighted sum's backward gives such a slot
    # zero, exactly), so the gather needs no mask.
    if handle.mode == "exact" and handle.align > 1:  # padding to `align`: index n_back
        data = handle.recv_source < handle.back_index.shape[0]
    else:
        data = None
    # Static mode: every block's spare row is zero (a dropped pair reads block 0's),
    # and its other empty rows any row of y; if y has no row, every row reads a zero row.
    block = None if handle.capacity is None else handle.capacity + 1  # a block's rows
    if block is None:
        spare: bool | int = False
    else:
        spare = block if rows > 0 else True
    back = Gather.apply(y, handle.back_index, spare, handle.recv_source, data)
    g = resolve_group(opname, handle.group)
    if handle.mode == "exact":
        assert handle.send_sizes is not None and handle.recv_sizes is not None
        recv, send = handle.send_sizes, handle.recv_sizes  # back the way the rows came
    else:  # the blocks go back to their senders as they came, one even all_to_all
        recv = send = [block] * g.size  # type: ignore[list-item]
    # The primitive: the sizes are host ints already (no recv_sizes tensor to build, which
    # on CUDA is a blocking host-to-device copy), and the shapes agree by construction.
    returned = all_to_all_rows_wire_p(back, recv, send, g.name, wire, grad_wire)
    row_of = handle.row_of.view(handle.tokens, handle.topk)
    n_pairs = handle.tokens * handle.topk
    skip: int | None = None
    zero: Tensor | int | None = None
    if block is not None:  # static mode (in exact mode every returned row carries a pair)
        # A dropped pair's row_of is the spare row of block 0 (zeros), which no kept
        # pair's is; weighted by zero, where a pair may have dropped.
        dropless = handle.group_needed is not None
        skip = handle.capacity if drops(handle.capacity, n_pairs, dropless) else None
        # Which returned rows' gradients are zero: the spare rows alone (the last of each
        # block) where a pair's gradient can stand in for the other empty slots', else
        # every slot that carries no pair.
        zero = block if eager_rows(n_pairs) else handle.send_data
    return weighted_sum(returned, row_of, topk_weights, skip, handle.send_pairs, zero)
