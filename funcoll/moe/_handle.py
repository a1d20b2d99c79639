"""The handle of one dispatch: what combine needs to bring its rows back (:class:`MoEHandle`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._base._group import GroupLike


@dataclass(frozen=True)
class MoEHandle:
    """What :func:`combine` needs to undo a :func:`dispatch`: returned by it, read by combine.

    Attributes:
        mode: ``"exact"`` or ``"static"``.
        tokens: ``T``, this rank's token count.
        topk: ``k``, the choices per token.
        num_experts: ``E``, over every rank.
        capacity: rows per (source, destination) block in static mode; None in exact mode.
        align: each expert's block in ``recv`` is padded to a multiple of it.
        group: the communicator, as passed to dispatch.
        counts: int64 ``(E_local,)`` on ``x``'s device: the rows each local expert received.
        offsets: int64 ``(E_local,)``: where each local expert's block starts in ``recv``.
        ends: int32 ``(E_local,)``: where each local expert's block ends in ``recv``
            (the cumulative sum of the padded blocks), the ``offs`` a grouped GEMM
            takes (``torch._grouped_mm(recv, w, offs=handle.ends)``).
        dropped: int64 0-d: this rank's (token, choice) pairs dropped for capacity (0 in exact mode).
        needed: int64 0-d: the capacity this rank needed to drop nothing, the most
            pairs it routed to one rank (static mode: compare with `capacity`).
        send_index: per row sent, the token it is (a padding slot of static mode:
            ``T``, past x's rows: it sends zeros compiled and any row of x eager,
            except each block's last, always zeros).
        recv_source: per row of ``recv``, the received row it holds (outside the
            experts' blocks: a zero row).
        back_index: per row combine sends back, the row of ``y`` it carries (static
            mode: past y's rows for a row that carries none, which sends any row of y,
            except each block's last, always zeros).
        row_of: per (token, choice) pair, token-major, the returned row holding its
            output (dropped: row `capacity`, the spare row of block 0, always zeros,
            which combine weights by zero).
        send_pairs: per row sent, the (token, choice) pair ``t * k + j`` it carries
            (static mode: ``T * k`` for a slot that carries none).
        send_data: static mode: bool, per row sent, whether it carries a pair; None
            in exact mode, where every row does.
        send_sizes: exact mode: rows sent to each rank, host ints.
        recv_sizes: exact mode: rows received from each rank, host ints.
        recv_counts: static mode: int64 ``(world,)`` rows received from each rank, on the device.
        kept: static mode: bool ``(T * k,)``, token-major: whether the pair was sent (not dropped).
        topk_weights: the router's ``(T, k)`` weights if dispatch was given them, for combine.
        group_needed: ``mode="dropless"``: the most pairs any rank of the group routed
            to one rank, read on the host (the same on every rank); None otherwise. The
            dispatch ran static mode if it was ``<=`` the group's largest capacity
            (then ``capacity`` is that one), exact mode otherwise.

    ``dropped``, ``needed``, ``send_data``, ``recv_counts`` and ``kept`` are computed
    when read (a small op or two each, every read): dispatch itself runs none of them,
    so a layer that never reads them (torchtitan's) does not pay for them. They are
    read-only properties, which a compiled graph traces where they are read.
    """

    mode: str
    tokens: int
    topk: int
    num_experts: int
    capacity: int | None
    align: int
    group: GroupLike
    counts: Tensor
    offsets: Tensor
    ends: Tensor
    send_index: Tensor
    recv_source: Tensor
    back_index: Tensor
    row_of: Tensor
    send_pairs: Tensor
    _per_dest: Tensor  # (world,): the pairs this rank routed to each rank, for `needed`
    send_sizes: list[int] | None = None
    recv_sizes: list[int] | None = None
    topk_weights: Tensor | None = None
    group_needed: int | None = None
    # What the properties below are computed from, when they are read: a dispatcher
    # that never reads them (torchtitan's) runs none of their ops. Static mode's own
    # are None in exact mode.
    _keep: Tensor | None = None  # static: (T * k,) whether each pair was sent; None: every one
    _free: Tensor | None = None  # static: per row sent, whether it carries no pair
    _recv_table: Tensor | None = None  # static: (world, E_local) rows received, by source and expert

    @property
    def dropped(self) -> Tensor:
        if self._keep is None:
            return self.counts.new_zeros(())
        return self._keep.shape[0] - self._keep.sum()

    @property
    def needed(self) -> Tensor:
        return self._per_dest.max()

    @property
    def send_data(self) -> Tensor | None:
        return None if self._free is None else ~self._free

    @property
    def recv_counts(self) -> Tensor | None:
        return None if self._recv_table is None else self._recv_table.sum(1)

    @property
    def kept(self) -> Tensor | None:
        if self.mode == "exact" or self._keep is not None:
            return self._keep
        return self.counts.new_ones(self.tokens * self.topk, dtype=torch.bool)
