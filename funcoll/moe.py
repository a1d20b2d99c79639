"""Mixture-of-experts token dispatch and combine: dropless, differentiable, one compiled graph.

``dispatch`` sends every (token, choice) pair of a top-k router to the rank that
owns its expert and lays the rows out as a grouped GEMM takes them; ``combine``
brings the experts' outputs back and sums each token's k outputs weighted by its
router weights. Both are compositions of funcoll collectives whose backwards
exist (``all_to_all``, ``all_to_all_v``'s primitive) and of local row
moves (``index_select``, a weighted sum over the k choices), so autograd gives
the adjoints: the backward of dispatch moves gradients the way combine moves
outputs (unweighted), and the backward of combine moves them the way dispatch
moves tokens. The row moves' backward is a gather through the inverse map
(:class:`_Gather`), not autograd's zero fill and scatter-add.

Layout. ``E = num_experts`` experts split evenly over the group's ``world``
ranks: rank r owns the ``E_local = E // world`` experts ``[r * E_local, (r + 1) *
E_local)``, local expert e being global expert ``r * E_local + e``. Token t's
choice j (``topk_idx[t, j]``) is one row. The rows a rank receives are grouped by
local expert (expert-major), then by source rank, then in the source's token
order (t, then j), each expert's block padded with zero rows to a multiple of
`align`: expert e's rows sit at ``[offsets[e], offsets[e] + counts[e])``.

Modes, and where each reads the device on the host:

- ``"exact"``: the per-expert counts travel in one small even ``all_to_all``,
  are read on the host once (the one device-to-host sync per dispatch: an
  uneven all-to-all takes its splits as host ints), and the rows move by
  ``all_to_all_v``'s differentiable primitive with both size lists given (no
  size exchange, and no sizes tensor built from host ints). Nothing is padded
  on the wire and nothing is dropped. ``combine`` reads nothing on the host: it
  reuses the host sizes kept in the handle. Compiled, the sizes are unbacked
  SymInts and the graph is the same for every routing.
- ``"static"``: every (source, destination) pair sends a block of `capacity`
  rows in one even ``all_to_all`` (the counts are known from the counts'
  exchange, so no header travels); nothing is read on the host and every shape is
  static. A rank's rows beyond `capacity` for one destination are dropped: the
  first `capacity` of them in token-major order (t, then j) are kept, and the
  dropped count is returned on the device in ``handle.dropped``. A dropped
  pair contributes zero to its token's combined output. ``capacity=None`` is
  the dropless bound ``T * k`` (every rank must then hold the same ``T``): each
  rank's receive buffer is ``world * T * k`` rows of ``H``. (On the wire each
  block has one spare row more, never data.)
- ``"dropless"`` (with a `capacity`, eager only): static mode's layout when it
  drops nothing, exact mode's otherwise, decided per dispatch. The counts travel
  in one ``all_gather`` (every rank's per-expert counts and capacity, in place of
  the other modes' ``all_to_all``), so every rank knows the most pairs any rank
  routes to one rank and the group's largest capacity; one host read of them
  (with exact mode's ints, so that an overflow reads nothing more) tells every
  rank alike which path to take, before any row moves.
  Nothing outside the dispatch runs again: this is the dropless mode for a layer
  that cannot wrap its step (a framework's token dispatcher). One host read per
  dispatch, as exact mode; a compiled graph cannot branch on it, so compiling it
  raises (compile ``"exact"``).
- a :class:`Dropless` policy (``mode=policy``): dropless without a host read per
  layer. Inside ``policy.run(forward, ...)`` every dispatch is static with the
  policy's capacity and records, on the device, the capacity it needed; after
  the forward one ``all_reduce`` (max) of that over the group and one host read
  of the result (the step's one sync) tell every rank alike whether any
  dispatch of any rank overflowed. If one did, the forward runs again with every
  dispatch in exact mode (that step's results are exact), and the capacity
  grows to the next power of two that fits, so later steps fit again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from . import _even, _prims
from ._async import wait
from ._checks import IntLike, check_tensor
from ._config import checks_enabled
from ._faults import public_op
from ._group import Group, GroupLike, resolve_group
from ._header import host_ints
from ._rows import zero_rows_after

__all__ = ["MODES", "Dropless", "MoEHandle", "combine", "dispatch"]

MODES = ("exact", "static", "dropless")


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _drops(capacity: int, n_pairs: int | torch.SymInt, dropless: bool) -> bool:
    """Whether a static dispatch of `n_pairs` pairs may drop some at `capacity` (known on the host).

    None drops on dropless's static path (taken only when every pair fits), nor with
    ``capacity >= T * k``: one rank cannot send more pairs to one rank than it has
    (the dropless bound, or one rank's capacity factor over 1). Eager only: compiled,
    ``T`` may be a symbol (a guard on it, or none possible if it is unbacked), and
    inductor fuses the drop order's small ops. Either answer gives the same values:
    this only skips work that drops nothing.
    """
    if dropless:
        return False
    return torch.compiler.is_compiling() or not (_is_int(n_pairs) and capacity >= n_pairs)


def _eager_rows(n: int | torch.SymInt) -> bool:
    """Whether `n` (a row count) is a positive plain int, in eager code.

    Static mode's blocks skip a copy of a tensor with a zero row after its rows when
    the tensor has a row to read in its place (`_take`'s blocks). Compiled, a count may
    be a symbol (unbacked after a ragged op: no guard on it is possible), and inductor
    fuses the copy into the gather, so compiled code keeps the copy.
    """
    return not torch.compiler.is_compiling() and _is_int(n) and n > 0


_R = TypeVar("_R")


class Dropless:
    """Dropless dispatch with static shapes while the routing fits, and one host read per step.

    Pass the policy as every dispatch's `mode` and run the forward through
    :meth:`run`. Inside it, each ``dispatch(..., mode=policy)`` is a static
    dispatch with ``policy.capacity`` rows per (source, destination) block (no
    host read, static shapes: the compiled graph of the steady state) and keeps,
    on the device, the largest capacity any of them needed (``handle.needed``).
    After the forward, :meth:`run` takes the maximum over the group (one
    ``all_reduce`` of one int64) and reads it on the host: the step's one
    device-to-host sync, whatever the number of MoE layers. Every rank reads the
    same value, so every rank takes the same path:

    - it fits (``needed <= capacity``): nothing was dropped; the forward's result
      is returned.
    - it overflowed: the forward runs again with every dispatch in exact mode (one
      host read per dispatch on that step only), its result is returned, and with
      `grow` the capacity becomes the smallest power of two ``>= needed``, so that
      the steps after it fit again (a compiled forward compiles once per capacity
      it meets: at most ``log2(T * k)`` times, plus once for exact mode).

    The forward must be one that may run twice: it returns what the step needs
    (a loss, outputs) and leaves the optimizer step to the caller. The random
    number generators (CPU, and the current CUDA device's) are restored before it
    runs again, so dropout draws the same masks. With `state`, the buffers of
    those modules (a load-balancing counter, batch norm's running statistics)
    are copied before the forward and put back before it runs again, so that an
    overflowed step updates them once, as a step that fit does; the copy costs
    one clone of those buffers per step. Side effects outside them (a Python
    counter, a cache written elsewhere) happen twice on an overflowed step.
    ``policy.replays`` counts the steps that ran twice, ``policy.needed`` is the
    last step's agreed need.

    Inside one module: a model whose step's forward is not the caller's to wrap
    (a framework's MoE layer) can run the policy around the layer's own dispatch,
    experts and combine, ``policy.run(self._routed, x, ...)`` in its forward; only
    that part runs again after an overflow, and the policy reads the host once per
    layer instead of once per step. Eager only: the read is a graph break. Where
    not even the layer's experts can be wrapped (a framework's token dispatcher),
    :func:`dispatch`'s ``mode="dropless"`` decides per dispatch and redoes only the
    dispatch: nothing reruns.

    Args:
        capacity: the static capacity to start with (rows per block, the same on
            every rank), e.g. ``ceil(1.25 * T * k / world)``.
        group: the group whose ranks agree on the overflow: every rank that runs
            the forward (default: the default group).
        grow: grow the capacity after an overflow (default True).
        state: a module, or modules, whose buffers the forward updates: restored
            before a replay (default: none).

    Example (2 ranks)::

        policy = Dropless(capacity=2)
        def forward(x, idx, w):
            recv, handle = dispatch(x, idx, 4, mode=policy)
            return combine(recv, handle, w)
        # rank 0: x = [[1.], [2.], [3.]], idx = [[0], [1], [0]]: 3 pairs to rank 0
        # rank 1: x = [[4.]], idx = [[2]], w = ones
        out = policy.run(forward, x, idx, w)   # rank 0: [[1.], [2.], [3.]]   rank 1: [[4.]]
        policy.replays, policy.capacity        # both: (1, 4): rank 0 needed 3 > 2
    """

    def __init__(
        self,
        capacity: int,
        *,
        group: GroupLike = None,
        grow: bool = True,
        state: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
    ) -> None:
        if not _is_int(capacity):
            raise TypeError(f"funcoll.moe.Dropless: `capacity` must be an int, got {type(capacity).__name__}")
        if capacity < 0:
            raise ValueError(f"funcoll.moe.Dropless: `capacity`={capacity} must be >= 0 (rows per block)")
        resolve_group("funcoll.moe.Dropless", group)  # a bad group is refused here, not after a forward
        modules = [state] if isinstance(state, torch.nn.Module) else list(state or ())
        for m in modules:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(
                    f"funcoll.moe.Dropless: `state` must be a torch.nn.Module or modules, got {type(m).__name__}"
                )
        self.state = modules
        self.capacity = capacity
        self.group = group
        self.grow = bool(grow)
        self.replays = 0
        self.needed: int | None = None
        self._active = False  # inside run()
        self._exact = False  # the second run of an overflowed step
        self._need: Tensor | None = None  # the largest need of this run's dispatches, on the device

    def __repr__(self) -> str:
        return f"Dropless(capacity={self.capacity}, grow={self.grow}, replays={self.replays})"

    def run(self, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """``fn(*args, **kwargs)`` with every ``dispatch(..., mode=self)`` in it dropless (see the class)."""
        opname = "funcoll.moe.Dropless.run"
        if self._active:
            raise RuntimeError(f"{opname}: already running: a policy's forward cannot run it again inside")
        rng = _rng_state()
        buffers = [b for m in self.state for b in m.buffers()]
        saved = [b.detach().clone() for b in buffers]  # what a replay puts back
        self._active, self._need = True, None
        try:
            out = fn(*args, **kwargs)
            need = self._need
        finally:
            self._active, self._need = False, None
        if need is None:
            raise ValueError(f"{opname}: `fn` made no dispatch with mode=this policy: nothing to check")
        agreed = _even.all_reduce(need, group=self.group, op="max")
        # Every rank learns whether any dispatch of any rank overflowed.
        self.needed = int(agreed.item())  # device-to-host sync: the one of a step
        if self.needed <= self.capacity:
            return out
        del out  # the dropped forward's graph goes before the exact one is built
        self.replays += 1
        if self.grow:
            self.capacity = 1 << (self.needed - 1).bit_length()
        _set_rng_state(rng)
        with torch.no_grad():
            for b, old in zip(buffers, saved, strict=True):
                b.copy_(old)
        self._active, self._exact = True, True
        try:
            return fn(*args, **kwargs)
        finally:
            self._active, self._exact = False, False

    def _mode(self, capacity: object) -> tuple[str, int | None]:
        """The mode and capacity a dispatch with ``mode=self`` runs with."""
        opname = "funcoll.moe.dispatch"
        if not self._active:
            raise ValueError(
                f"{opname}: `mode`={self!r} dispatches inside policy.run(forward, ...), which checks the "
                f"overflow after the forward; called outside it"
            )
        if capacity is not None:
            raise ValueError(f"{opname}: `capacity`={capacity} is the policy's own with mode=Dropless")
        return ("exact", None) if self._exact else ("static", self.capacity)

    def _record(self, needed: Tensor) -> None:
        self._need = needed if self._need is None else torch.maximum(self._need, needed)


def _rng_state() -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _check_dispatch_args(
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
    """Every argument check of :func:`dispatch`, before any communication."""
    opname = "funcoll.moe.dispatch"
    x = check_tensor(opname, "x", x)
    topk_idx = check_tensor(opname, "topk_idx", topk_idx)
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
    if isinstance(x.shape[0], int) and isinstance(topk_idx.shape[0], int) and x.shape[0] != topk_idx.shape[0]:
        raise ValueError(
            f"{opname}: `topk_idx` has {topk_idx.shape[0]} rows but `x` has {x.shape[0]} tokens: one row per token"
        )
    torch._check(x.shape[0] == topk_idx.shape[0])
    if not _is_int(num_experts):
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
        if not _is_int(capacity):
            raise TypeError(f"{opname}: `capacity` must be an int or None, got {type(capacity).__name__}")
        if capacity < 0:  # type: ignore[operator]
            raise ValueError(f"{opname}: `capacity`={capacity} must be >= 0 (rows per destination rank)")
        if mode == "exact":
            raise ValueError(
                f"{opname}: `capacity`={capacity} is for mode='static' or 'dropless'; mode='exact' drops nothing"
            )
    if not _is_int(align):
        raise TypeError(f"{opname}: `align` must be an int, got {type(align).__name__}")
    if align < 1:  # type: ignore[operator]
        raise ValueError(f"{opname}: `align`={align} must be >= 1")
    if counts is not None:
        counts = check_tensor(opname, "counts", counts)
        if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise TypeError(f"{opname}: `counts` must hold integer pair counts, got dtype {counts.dtype}")
        if tuple(counts.shape) != (num_experts,):
            raise ValueError(
                f"{opname}: `counts` has shape {tuple(counts.shape)}, expected (num_experts,) = ({num_experts},): "
                f"this rank's (token, choice) pairs routed to each expert"
            )
    if topk_weights is not None:
        topk_weights = check_tensor(opname, "topk_weights", topk_weights)
        if tuple(topk_weights.shape) != tuple(topk_idx.shape) and all(
            isinstance(n, int) for n in (*topk_weights.shape, *topk_idx.shape)
        ):
            raise ValueError(
                f"{opname}: `topk_weights` has shape {tuple(topk_weights.shape)}, expected `topk_idx`'s "
                f"{tuple(topk_idx.shape)}: one weight per (token, choice)"
            )
    return x, topk_idx


def _count(index: Tensor, n: int, weight: Tensor | None = None) -> Tensor:
    """How many entries of `index` (int64) equal each of ``0 .. n-1``, without a host sync.

    ``torch.bincount`` reads its input's max on the host; a scatter-add does not.
    `weight` (0/1 int64) counts only some entries.
    """
    ones = torch.ones_like(index) if weight is None else weight
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(0, index, ones)


# Static mode's drop order counts each pair's rank within its destination with a
# running count per destination, (pairs, world) entries, up to this many in eager
# code; a sort by destination above it and compiled (O(pairs) memory, one more sort:
# several kernels on CUDA). Compiled, the pairs may be an unbacked symbol, on which
# no guard is possible, and the graph is the same for every count.
_RUNNING_COUNT_LIMIT = 1 << 21


def _rank_in_dest(dest: Tensor, world: int, wanted: Tensor) -> Tensor:
    """Each pair's rank among this rank's pairs bound to its destination, token-major: 1 for the first.

    `dest` ``(n,)`` each pair's destination rank, `wanted` ``(world,)`` the pairs
    bound to each (`dest`'s counts).
    """
    n = dest.shape[0]
    if not torch.compiler.is_compiling() and _is_int(n) and n * world <= _RUNNING_COUNT_LIMIT:
        hits = dest.unsqueeze(1) == torch.arange(world, device=dest.device)  # (n, world) one-hot
        return hits.cumsum(0).gather(1, dest.unsqueeze(1)).view(-1)
    by_dest = torch.sort(dest, stable=True)  # token-major within each destination
    ranks = torch.arange(1, n + 1, device=dest.device) - _exclusive(wanted)[by_dest.values]
    return torch.empty_like(ranks).scatter_(0, by_dest.indices, ranks)


def _exclusive(t: Tensor, dim: int = 0) -> Tensor:
    return torch.cumsum(t, dim) - t


def _inverse(perm: Tensor) -> Tensor:
    """The inverse permutation: ``_inverse(p)[p[i]] == i``."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=perm.device))


def _take(t: Tensor, index: Tensor, spare: bool | int | torch.SymInt | torch.SymBool) -> Tensor:
    """The rows `index` of `t`, where an index ``len(t)`` marks a row that is not data.

    - `spare` False: every index is a row of `t`: one ``index_select``.
    - `spare` True: index ``len(t)`` reads a zero row: `t` is first copied with one
      zero row after its rows, so that empty slots, padding and dropped pairs read
      zeros without a mask.
    - `spare` an int ``b`` (static mode's blocks of ``b`` rows; `t` has a row): index
      ``len(t)`` reads `t`'s last row, and the last row of every ``b`` rows of the
      result is zero. Those are the blocks' spare rows, the only rows that are not
      data which anything reads (a receiver's empty layout rows read its last
      block's); the other empty slots travel unread. No copy of `t`: a clamp of the
      index and a fill of one row a block.
    """
    if isinstance(spare, (int, torch.SymInt)) and not isinstance(spare, bool):  # blocks of `spare` rows
        out = t.index_select(0, index.clamp(max=t.shape[0] - 1))
        out.view(-1, spare, *t.shape[1:]).select(1, spare - 1).zero_()
        return out
    if spare:  # (a SymBool guards here, compiled)
        t = _with_zero_row(t)
    return t.index_select(0, index)


def _with_zero_row(t: Tensor) -> Tensor:
    """`t` with one zero row after its rows (a copy; kept in the graph when `t` is empty)."""
    return zero_rows_after(t, 1)


class _Gather(torch.autograd.Function):
    """A row gather of dispatch or combine whose backward is a gather too, not a scatter into zeros.

    Forward: ``_take(t, index, spare)``. Every row a move reads is read by at most
    `k` output rows and, where the move is a partial permutation (each data row of
    `t` read once), autograd's adjoint, a zero fill of ``t``'s size and a
    scatter-add, is a gather through the inverse map. The backward is that gather,
    one pass that writes each gradient row once:

    - `back` ``(len(t), k)``: row i's gradient is the sum of the gradient rows
      ``back[i]`` (a token's k copies; a dropped pair names a spare row, whose
      gradient is zero);
    - `back` ``(len(t),)`` with `valid` None: row i's gradient is gradient row ``back[i]``;
    - `back` ``(len(t),)`` with `valid` a mask: the same where ``valid[i]``, zero elsewhere;
    - `back` ``(len(t),)`` with `valid` an int ``b`` (static mode's blocks): the same,
      except that the last row of every ``b`` is zero and a row whose `back` is past
      the gradient's rows gets any row (``_take(grad, back, b)``).

    The caller guarantees the inverse: every output row that reads a data row of
    `t` is listed for it in `back`. A row of `t` that is not data (a zero row of
    the wire: an empty slot, a spare row) gets zero where `valid` says so. With
    `valid` None it gets the gradient row `back` names, which the caller makes zero
    (combine's empty layout rows name the spare row, whose gradient is exactly zero)
    or leaves unread. So the gradient of the op's inputs is autograd's, bit for bit
    up to the order of each row's sum.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        t: Tensor,
        index: Tensor,
        spare: bool | int,
        back: Tensor,
        valid: Tensor | int | None,
    ) -> Tensor:
        ctx.masked = isinstance(valid, Tensor)
        ctx.block = None if ctx.masked else valid
        ctx.save_for_backward(back, valid if ctx.masked else back)
        return _take(t, index, spare)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        back, valid = ctx.saved_tensors
        if back.dim() == 2:
            out = _sum_bags(grad, back)
        elif ctx.masked:
            out = _take_valid(grad, back, valid)
        elif ctx.block is None:  # every row of t is data
            out = grad.index_select(0, back)
        else:  # (the caller gives a block only where grad has a row: `_eager_rows`)
            out = _take(grad, back, ctx.block)
        return out, None, None, None, None


# Bags of rows, summed. On the CPU one embedding_bag, 2-4x faster than a gather, a
# mask and a sum there (torch 2.13, T = 1024-4096 tokens, D = 256-2048). On CUDA
# embedding_bag's kernel took 1.2 ms for static mode's 40961 bags of one row or
# none of 2048 bf16 features on an H200 (torch 2.11), about 15x what the gather and
# the mask take to move the same bytes: 47% of the GPU time of a static training step
# of torchtitan's MoE layer with per-feature-scale experts at 16384 tokens. Elsewhere
# than the CPU the bags are gathered. (A compiled graph takes the same path, by the
# tensors' device.)
def _by_gather(t: Tensor) -> bool:
    """Whether bags of `t`'s rows are gathered, masked and summed rather than one embedding_bag."""
    return t.device.type != "cpu"


def _sum_bags(t: Tensor, bags: Tensor) -> Tensor:
    """``out[i] = sum_j t[bags[i, j]]``: ``(n, k) -> (n, *R)``.

    No entry is skipped (no ``padding_idx``): with one, the CPU's embedding_bag leaves
    its fast kernel, 1.35-1.55x the time on one thread and 2.4-2.8x on two (torch
    2.13, 1024-4096 bags of 2, 256-1024 features). A caller whose entry adds
    nothing names a zero row.
    """
    if not _by_gather(t):
        return torch.nn.functional.embedding_bag(bags, t, mode="sum")
    n, k = bags.shape
    return t.index_select(0, bags.reshape(-1)).view(n, k, *t.shape[1:]).sum(1)


def _take_valid(t: Tensor, index: Tensor, valid: Tensor) -> Tensor:
    """``out[i] = t[index[i]]`` where ``valid[i]``, zero elsewhere (whatever an invalid `index` entry holds).

    `t` has a row wherever some entry is valid (embedding_bag's path: at least one row).
    """
    n = index.shape[0]
    if _by_gather(t):
        # An invalid entry reads the zero row after t's rows: t may have none.
        return _take(t, torch.where(valid, index, t.shape[0]), spare=True)
    # Bags of one row or none: the valid entries packed in order, then the others
    # (index 0), which fall in one more bag, cut off. (A bag ends where the next
    # begins, and the last one at the end of the indices, whatever the offsets say.)
    ends = torch.cumsum(valid, 0)
    offsets = torch.cat([ends.new_zeros(1), ends])
    packed = index.new_zeros(n + 1).scatter_(0, torch.where(valid, ends - 1, n), index)[:n]
    return torch.nn.functional.embedding_bag(packed, t, offsets, mode="sum")[:n]


def _exchange_rows(rows: Tensor, recv: list[IntLike], send: list[IntLike], g: Group) -> Tensor:
    """Send ``send[j]`` of `rows` to rank j, receive ``recv[i]`` from rank i: all_to_all_v's move.

    The sizes are host ints already, so this is ``all_to_all_v(rows, send, recv)``'s
    primitive (its backward: the same with the sizes swapped) without the
    ``recv_sizes`` tensor that op also returns: on CUDA, building that tensor from
    host ints is a blocking host-to-device copy, which combine must not pay.
    """
    if g.is_single:
        return rows
    torch._check(sum(send) == rows.shape[0])
    return _prims.all_to_all_p(rows, recv, send, g.name)


def _exchange_blocks(t: Tensor, group: GroupLike, g: Group) -> Tensor:
    """Block j of `t`'s rows to rank j, block i from rank i: the even all_to_all of dim 0.

    One rank: `t` itself. Dispatch and combine pass only their own intermediates,
    which need not be copied into a new tensor, as the public op does (one copy of
    the send buffer each way in a one-rank group).
    """
    return t if g.is_single else _even.all_to_all(t, group, 0, 0)


def _padded(counts: Tensor, align: int) -> Tensor:
    """Each count rounded up to a multiple of `align`: an expert's block in the layout."""
    return counts if align == 1 else (counts + (align - 1)) // align * align


def _expert_blocks(recv_counts: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each local expert's row count, where its block starts, where it ends (int32, a grouped GEMM's offs).

    `recv_counts` ``(world, E_local)``: rows received from each source for each local
    expert. Each block is the expert's rows rounded up to a multiple of `align`.
    """
    counts = recv_counts.sum(0)
    padded = _padded(counts, align)
    ends = torch.cumsum(padded, 0)
    return counts, ends - padded, ends.to(torch.int32)


def _run_starts(recv_counts: Tensor, offsets: Tensor, run_ends: Tensor) -> Tensor:
    """``(world, E_local)``: the layout row of run (s, e)'s first row, less where the run starts on the wire.

    Run (s, e), source s's rows for local expert e, goes to its expert's block
    (`offsets`) after the rows for e from earlier sources; on the wire it starts
    where the runs before it in its source's rows end (`run_ends`, a cumulative sum
    over them, minus its own length). A row's layout row is this plus its place
    on the wire. (``offsets + (cumsum(recv_counts, 0) - recv_counts) - (run_ends -
    recv_counts)``, the two ``recv_counts`` cancelled.)
    """
    return (offsets - run_ends) + torch.cumsum(recv_counts, 0)


def _expert_layout(
    recv_counts: Tensor, n_in: int | torch.SymInt, rows: int | torch.SymInt, align: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Exact mode's expert-major layout of the received rows: (recv_source, dest, counts, offsets, ends).

    `recv_counts` ``(world, E_local)``: rows received from each source for each local
    expert. The `n_in` received rows arrive source-major, then by local expert:
    row i is in run ``b = source * E_local + e``, and goes to
    ``offsets[e] + (rows from earlier sources for e) + (its place in its run)``.
    Returns, for each of the `rows` layout rows, the received row it holds (`n_in`
    for a padding row to `align`: a zero row after the received rows), for each
    received row its layout row, and :func:`_expert_blocks`.
    """
    counts, offsets, ends = _expert_blocks(recv_counts, align)
    flat = recv_counts.reshape(-1)
    run_ends = torch.cumsum(flat, 0)
    i = torch.arange(n_in, device=recv_counts.device)
    run = torch.searchsorted(run_ends, i, right=True)  # every received row is data: in a run
    start = _run_starts(recv_counts, offsets, run_ends.view(recv_counts.shape)).reshape(-1)
    dest = start[run] + i
    source = torch.full((rows,), n_in, dtype=torch.int64, device=i.device).scatter_(0, dest, i)
    return source, dest, counts, offsets, ends


def _block_layout(
    recv_counts: Tensor, block: int, rows: int, align: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Static mode's expert-major layout of the received blocks: (recv_source, dest, counts, offsets, ends).

    Block s holds source s's rows for local expert 0, then expert 1, ..., then zero
    rows, `block` rows in all (its last always zero). Computed over the
    ``(world, block)`` grid of block rows: row i of block s is in run
    ``searchsorted(cumsum(recv_counts[s]), i)`` (``E_local``: past the data). Returns,
    for each of the `rows` layout rows, the block row it holds (``world * block - 1``,
    the last block's zero row, if none), for each block row its layout row (``rows +
    i`` for row i of a block if it holds no data: past the layout), and
    :func:`_expert_blocks`.
    """
    world = recv_counts.shape[0]
    device = recv_counts.device
    counts, offsets, ends = _expert_blocks(recv_counts, align)
    run_ends = torch.cumsum(recv_counts, 1)
    n_in = world * block
    q = torch.arange(n_in, device=device)  # the block rows, block-major
    i = torch.remainder(q, block).view(world, block)  # each one's place in its block
    run = torch.searchsorted(run_ends, i, right=True)
    # The rows past the data (run E_local) start at `rows`: one more column, so that one
    # gather places every row, with no mask.
    start = torch.nn.functional.pad(_run_starts(recv_counts, offsets, run_ends), (0, 1), value=rows)
    dest = (start.gather(1, run) + i).view(-1)
    source = torch.full((rows + block,), n_in - 1, dtype=torch.int64, device=device)
    source = source.scatter_(0, dest, q)[:rows]
    return source, dest, counts, offsets, ends


def _exact_sizes(
    per_dest: Tensor, recv_sizes: Tensor, recv_counts: Tensor, align: int, head: tuple[Tensor, ...] = ()
) -> Tensor:
    """What exact mode reads on the host, after `head`.

    The rows sent to each rank, the rows received from each, and the layout's rows.
    """
    return torch.cat([*head, per_dest, recv_sizes, _padded(recv_counts.sum(0), align).sum(0, True)])


@public_op("moe.dispatch")
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
        mode, capacity = policy._mode(capacity)
    g = resolve_group(opname, group)
    x, topk_idx = _check_dispatch_args(
        x, topk_idx, num_experts, g.size, mode, capacity, align, counts, topk_weights
    )
    world = g.size
    e_local = num_experts // world
    tokens, k = x.shape[0], topk_idx.shape[1]
    device = x.device
    expert = topk_idx.to(device=device, dtype=torch.int64).reshape(-1)  # pair f = t * k + j
    torch._assert_async(  # floor division gives 0 exactly for the ids in [0, E): one pass, not two compares
        (expert // num_experts == 0).all(),
        f"{opname}: `topk_idx` holds an expert id outside [0, num_experts) = [0, {num_experts})",
    )
    given = None if counts is None else counts.to(device=device, dtype=torch.int64)  # the caller's
    if given is not None and checks_enabled():  # the caller's counts route the data: wrong ones misroute it
        torch._assert_async(
            (given == _count(expert, num_experts)).all(),
            f"{opname}: `counts` are not the counts of `topk_idx`'s expert ids",
        )
    n_pairs = expert.shape[0]
    known: tuple[Tensor, list[int]] | None = None  # dropless: the counts exchanged and the ints read
    group_needed = None
    order = None  # the pairs in the order they are sent: by expert, so by destination rank
    if mode == "dropless":
        # Static if no rank of the group routes more pairs to one rank than the group's
        # largest `capacity` (then nothing drops), exact otherwise. One all_gather of every
        # rank's per-expert counts and capacity gives every rank the whole table: its own
        # received counts (the column block of its experts), and the group's need and
        # capacity, the same on every rank, so every rank takes the same path with the
        # same capacity (ranks whose capacities differ, from different token counts,
        # agree on the largest).
        given = _count(expert, num_experts) if given is None else given  # counted once: both paths reuse it
        # The capacity is filled in on the device: a tensor made from the host int would
        # be a copy the host waits for on CUDA, a second sync beside the one below.
        row = torch.cat([given, torch.full_like(given[:1], capacity)])
        table = row.unsqueeze(0) if g.is_single else _even.all_gather(row, group=group, tiled=False)
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
        ints = host_ints(_exact_sizes(per_dest, sends[:, g.rank], recv_counts, align, head=agreed))
        group_needed, capacity = ints[0], ints[1]
        mode = "static" if group_needed <= capacity else "exact"
        known = (recv_counts, ints[2:])
    keep = None  # static mode: whether each pair is sent (not dropped); None: every pair is
    if mode == "static":
        cap = n_pairs if capacity is None else capacity
        # Static mode proper drops the pairs past `cap` for one destination, unless none can
        # (see `_drops`): then every pair is sent as on dropless's static path, with no drop order.
        if _drops(cap, n_pairs, dropless=known is not None):
            dest = expert // e_local  # each pair's destination rank
            # pairs bound to each rank, before the capacity
            wanted = _count(dest, world) if given is None else given.view(world, e_local).sum(1)
            keep = _rank_in_dest(dest, world, wanted) <= cap
    if keep is None:
        per_expert = _count(expert, num_experts) if given is None else given
    else:
        per_expert = _count(expert, num_experts, keep.to(torch.int64))
    if known is None:
        # Every rank's per-expert counts for this rank's experts: (world, E_local), one row per
        # source. Issued before the send side is laid out, which runs while they travel.
        recv_counts = _exchange_blocks(per_expert.view(world, e_local), group, g)
    else:  # dropless: exchanged already (static mode's path: every pair fits)
        recv_counts = known[0]
    if order is None:  # by expert, the dropped pairs (key E) after the kept ones
        order = torch.sort(
            expert if keep is None else torch.where(keep, expert, num_experts), stable=True
        ).indices
    if mode == "exact":
        row_of = _inverse(order)
        send_index = order // k
        send_rows = _Gather.apply(x, send_index, False, row_of.view(tokens, k), None)
    if keep is None and known is None:  # every pair is sent (dropless summed them beside its table)
        per_dest = per_expert.view(world, e_local).sum(1)  # the rows sent to each rank
    if mode == "static":
        # Block d of the send buffer holds the kept pairs bound to rank d, by expert,
        # then zero rows; on the wire each block has one row more than `cap`, never
        # data, so the last row of every received block is a zero row that empty
        # layout rows read. In `order` the kept pairs come first, by expert (so by
        # destination): slot i of block d holds pair order[first[d] + i] if i < sent[d].
        block = cap + 1
        sent = per_dest if keep is None else wanted.clamp(max=cap)
        first = _exclusive(sent)
        i = torch.arange(block, device=device)
        free = (i >= sent.unsqueeze(1)).view(-1)  # (world * block,): the slot holds no pair
        at = (first.unsqueeze(1) + i).view(-1)  # a free slot: some later pair, or past them
        if _eager_rows(n_pairs):  # a free slot reads any pair, then holds none (T * k)
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
        spare: bool | int = block if _eager_rows(tokens) else True
        # Its backward sums each token's slots (one bag of k): a gather, not a scatter
        # into zeros. A dropped pair's is the spare row of block 0, whose gradient is
        # zero (the layout's backward zeroes the spare rows).
        if x.dtype.is_floating_point:
            send_rows = _Gather.apply(x, send_index, spare, row_of.view(tokens, k), None)
        else:
            send_rows = _take(x, send_index, spare)
        if keep is not None:  # the pairs bound to each rank before the capacity, which needed counts
            per_dest = wanted
    # Read at once by the layout's small ops (and exact mode's host read): waited here,
    # so that they run on a plain tensor, not each through a pending result's dispatch.
    recv_counts = wait(recv_counts)
    if mode == "exact":
        # Device-to-host sync, the one of an exact dispatch: the uneven all-to-all takes its splits as
        # host ints. One read of 2 * world + 1 ints: the rows sent to and received from each rank,
        # and the layout's rows. Each is read as it is used, not summed on the host from per-expert
        # counts: compiled, each is then an unbacked symbol of its own, and the backward, which
        # takes the split sizes as inputs, binds them (inductor 2.14 cannot bind a sum of symbols).
        if known is None:
            ints = host_ints(_exact_sizes(per_dest, recv_counts.sum(1), recv_counts, align))
        else:  # dropless, overflowed: read with the need
            ints = known[1]
        send_sizes, recv_sizes, rows = ints[:world], ints[world : 2 * world], ints[2 * world]
        n_in = sum(recv_sizes)
        torch._check(rows >= n_in)
        recv = _exchange_rows(send_rows, recv_sizes, send_sizes, g)
        source, dest_of, counts, offsets, ends = _expert_layout(recv_counts, n_in, rows, align)
        back_index = dest_of  # every received row is data: no index past the rows of y
        extra: dict[str, object] = {"send_sizes": send_sizes, "recv_sizes": recv_sizes}
    else:
        n_in = world * block  # block s from source s: its kept pairs by expert, then zero rows
        rows = -(-(world * cap + e_local * (align - 1)) // align) * align
        # One even all_to_all of the blocks: the counts are known from the counts exchange,
        # so nothing else travels (no header, no pack; the blocks stay where they land).
        recv = _exchange_blocks(send_rows, group, g)
        source, dest_of, counts, offsets, ends = _block_layout(recv_counts, block, rows, align)
        # The rows combine sends back, as the blocks came: block row q carries its layout
        # row, if it holds data; otherwise an index past y's rows, which combine's gather
        # clamps (any row of y; each block's spare row zeros), or, if y has none, reads
        # as a zero row (index 0). Combine reads back only the slots that carry a pair
        # and the spare row of block 0.
        back_index = dest_of if rows > 0 else dest_of.clamp(max=0)
        extra = {"_keep": keep, "_free": free, "_recv_table": recv_counts}
    # The backward gathers each received row's gradient from its layout row. A block row
    # that holds no data (static mode) gets the last layout row's, unread by its sender,
    # except the spare rows, zero: a dropped pair's names its sender's spare row.
    if mode == "static" and rows == 0:  # no layout row (capacity 0): nothing to gather
        out = _take(recv, source, spare=False)
    else:
        blocks = block if mode == "static" else None
        out = _Gather.apply(recv, source, mode == "exact" and align > 1, back_index, blocks)
    handle = MoEHandle(
        mode=mode, tokens=tokens, topk=k, num_experts=num_experts, capacity=None if mode == "exact" else cap,
        align=align, group=group, counts=counts, offsets=offsets, ends=ends,
        topk_weights=topk_weights,
        send_index=send_index, recv_source=source, back_index=back_index, row_of=row_of,
        send_pairs=order if mode == "exact" else pair_of_slot,
        group_needed=group_needed, _per_dest=per_dest, **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    if policy is not None and mode == "static":
        policy._record(handle.needed)
    return out, handle


@public_op("moe.combine")
def combine(y: Tensor, handle: MoEHandle, topk_weights: Tensor | None = None) -> Tensor:
    """Bring the experts' outputs back to their tokens and sum each token's k of them, weighted.

    Args:
        y: ``(R, H')`` the experts' outputs in the layout of :func:`dispatch`'s ``recv``
            (rows outside the experts' blocks are ignored).
        handle: what dispatch returned with ``recv``.
        topk_weights: ``(T, k)`` the router's weights, on ``y``'s device; None:
            those given to dispatch (``handle.topk_weights``).

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
    y = check_tensor(opname, "y", y)
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
    topk_weights = check_tensor(opname, "topk_weights", topk_weights)
    if y.dim() != 2:
        raise ValueError(f"{opname}: `y` must be 2-D (rows, hidden), got shape {tuple(y.shape)}")
    rows = handle.recv_source.shape[0]
    if isinstance(y.shape[0], int) and isinstance(rows, int) and y.shape[0] != rows:
        raise ValueError(
            f"{opname}: `y` has {y.shape[0]} rows but dispatch's `recv` had {rows}: the same layout"
        )
    torch._check(y.shape[0] == rows)
    want = (handle.tokens, handle.topk)
    if tuple(topk_weights.shape) != want and all(isinstance(n, int) for n in topk_weights.shape):
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
    back = _Gather.apply(y, handle.back_index, spare, handle.recv_source, data)
    if handle.mode == "exact":
        assert handle.send_sizes is not None and handle.recv_sizes is not None
        g = resolve_group(opname, handle.group)
        returned = _exchange_rows(back, handle.send_sizes, handle.recv_sizes, g)
    else:  # the blocks go back to their senders as they came, one even all_to_all
        returned = _exchange_blocks(back, handle.group, resolve_group(opname, handle.group))
    row_of = handle.row_of.view(handle.tokens, handle.topk)
    n_pairs = handle.tokens * handle.topk
    skip: int | None = None
    zero: Tensor | int | None = None
    if block is not None:  # static mode (in exact mode every returned row carries a pair)
        # A dropped pair's row_of is the spare row of block 0 (zeros), which no kept
        # pair's is; weighted by zero, where a pair may have dropped.
        dropless = handle.group_needed is not None
        skip = handle.capacity if _drops(handle.capacity, n_pairs, dropless) else None
        # Which returned rows' gradients are zero: the spare rows alone (the last of each
        # block) where a pair's gradient can stand in for the other empty slots', else
        # every slot that carries no pair.
        zero = block if _eager_rows(n_pairs) else handle.send_data
    return _weighted_sum(returned, row_of, topk_weights, skip, handle.send_pairs, zero)


class _WeightedSum(torch.autograd.Function):
    """``out[t] = sum_j weights[t, j] * rows[row_of[t, j]]``, whose backward gathers.

    Forward: one ``embedding_bag`` (sum, per-sample weights), as autograd's. Backward:
    the weights' gradient is the same op's (``_embedding_bag_per_sample_weights_backward``,
    a dot product per entry); the rows' gradient, ``weights[t, j] * grad[t]`` at row
    ``row_of[t, j]`` and zero at the rows no entry reads, is a gather through the
    inverse map, the pair each row carries (`pairs`: dispatch's ``send_pairs``), where
    autograd's adjoint is a zero fill of ``rows``' size and a scatter-add. Static mode
    (`zero` as in :class:`_Gather`'s `valid`) gives exactly zero to the rows that carry
    no pair (a mask), or to the spare rows, the last of each block (an int, the block's
    rows), and then any pair's gradient to the other slots that carry none: no one
    reads them.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: Tensor,
        row_of: Tensor,
        weights: Tensor,
        skip: int | None,
        pairs: Tensor,
        zero: Tensor | int | None,
    ) -> Tensor:
        tokens, k = row_of.shape
        flat = row_of.reshape(-1)
        bags = torch.arange(0, tokens * k, k, device=row_of.device)
        # No padding_idx (-1): with one, the CPU's kernel leaves its fast path (`_sum_bags`).
        out, offset2bag, _, _ = torch.ops.aten._embedding_bag(
            rows, flat, bags, False, 0, False, weights.reshape(-1), False, -1
        )
        # The weights' gradient skips the entries equal to `skip` (their weights are a
        # `where`'s zeros, whose gradient is zero): no dot product for a dropped pair.
        ctx.k, ctx.pad = k, -1 if skip is None else skip
        ctx.masked, ctx.block = isinstance(zero, Tensor), zero if not isinstance(zero, Tensor) else None
        ctx.save_for_backward(rows, flat, bags, offset2bag, weights, pairs)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        rows, flat, bags, offset2bag, weights, pairs = ctx.saved_tensors
        d_rows = d_weights = None
        if ctx.needs_input_grad[0]:
            g, w, p = grad, weights.reshape(-1), pairs
            # Row i carries pair pairs[i]: token pairs[i] // k's gradient times its weight.
            # Static mode: a slot that carries none (pair T * k) reads a zero row and a zero
            # weight (a mask), or the last pair's, with the spare rows zeroed after (a
            # block). Either gives exactly zero where combine's backward relies on it (a
            # receiver's empty layout rows read the spare rows).
            if ctx.masked:
                g, w = _with_zero_row(g), _with_zero_row(w)
            elif ctx.block is not None:
                p = pairs.clamp(max=w.shape[0] - 1)
            d_rows = torch.nn.functional.embedding_bag(
                (p // ctx.k).view(-1, 1), g, mode="sum", per_sample_weights=w[p].view(-1, 1)
            )
            if ctx.block is not None:
                d_rows.view(-1, ctx.block, g.shape[1]).select(1, ctx.block - 1).zero_()
        if ctx.needs_input_grad[2]:
            d_weights = torch.ops.aten._embedding_bag_per_sample_weights_backward(
                grad, rows, flat, bags, offset2bag, 0, ctx.pad
            ).view(weights.shape)
        return d_rows, None, d_weights, None, None, None


def _rows_of_pairs(rows: Tensor, row_of: Tensor, pairs: Tensor, zero: Tensor | int | None) -> Tensor:
    """``rows[row_of.reshape(-1)]``, whose backward gathers through the pair each row carries.

    Autograd's backward of the ``index_select`` is a zero fill of ``rows``' size and an
    ``index_add_`` (0.56 ms of a 6.5 ms step of torchtitan's layer at 16384 tokens on
    an H200). Every row is read by at most one pair, so its gradient is that pair's
    (`pairs`: dispatch's ``send_pairs``; static mode's `zero` as in
    :class:`_WeightedSum`). A dropped pair reads a spare row, which no kept pair has
    and which gets zero: the caller weights such entries by zero.
    """
    return _Gather.apply(rows, row_of.reshape(-1), False, pairs, zero)


def _weighted_sum(
    rows: Tensor,
    row_of: Tensor,
    weights: Tensor,
    skip: int | None,
    pairs: Tensor,
    zero: Tensor | int | None,
) -> Tensor:
    """``out[t] = sum_j weights[t, j] * rows[row_of[t, j]]``, over the j with ``row_of[t, j] != skip``.

    One ``embedding_bag`` (sum, per-sample weights): it reads the rows it sums and
    writes ``(T, H)``, with no ``(T, k, H)`` gather in between. Its backward is
    :class:`_WeightedSum`'s gather through the pair each row carries (`pairs`:
    dispatch's ``send_pairs``; `zero`: static mode's rows that carry none). Entries
    equal to `skip` (a dropped pair's: the spare row of block 0, zeros) are weighted
    by zero, so that they add exactly nothing, whatever the weight, and get no
    gradient. Not embedding_bag's ``padding_idx``: the CPU's kernel leaves its fast
    path for one (`_sum_bags`).

    That is the CPU's path (`_by_gather`). Dtypes it does not take (complex,
    integer) gather, mask and sum, and so does every device but the CPU: CUDA's
    embedding_bag kernels are slow for these bags (see `_by_gather`), and CUDA has no
    bfloat16 kernel for the weights' gradient
    (``_embedding_bag_per_sample_weights_backward_cuda`` raised NotImplementedError on
    torch 2.11, H100). The ``(T, k, H)`` gather is then kept for the backward, as a
    dispatcher that weights its rows that way keeps it, and the rows' gradient
    gathers through the pair each row carries (`_rows_of_pairs`).
    """
    w = weights.to(rows.dtype)
    if skip is not None:
        w = torch.where(row_of == skip, 0, w)
    if rows.dtype.is_floating_point and not _by_gather(rows):
        return _WeightedSum.apply(rows, row_of, w, skip, pairs, zero)
    per_pair = _rows_of_pairs(rows, row_of, pairs, zero).view(*row_of.shape, rows.shape[1])
    return (per_pair * w.unsqueeze(-1)).sum(1)
