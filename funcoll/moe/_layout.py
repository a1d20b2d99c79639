"""The layout's index math: pure functions of the routing, no collective and no autograd.

Counts per destination and per expert, each pair's place among its destination's
pairs (the drop order), each expert's block in the receive buffer, and the host
sizes of exact mode's exchange; with the small predicates the modes share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .._base._checks import IntLike


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def same_sizes(a: Sequence[IntLike], b: Sequence[IntLike], traced: str) -> bool:
    """Whether two shapes are equal: False only where they are known to differ.

    Ints and the sizes dynamo can read (static, or dynamic with a hint) are compared
    now, so that the caller raises its own error. Sizes it cannot read (unbacked:
    ``mark_ragged`` inputs, exchanged lengths) count as equal here, and the graph
    asserts their equality at run time, saying `traced` (constants only, as for
    :func:`funcoll._base._checks.check_equal`): comparing them with ``!=`` would fail the trace with
    dynamo's data-dependent guard error instead.
    """
    if len(a) != len(b):
        return False
    if any(guard_or_false(p != q) for p, q in zip(a, b, strict=True)):
        return False
    if torch.compiler.is_compiling() or any(isinstance(n, torch.SymInt) for n in (*a, *b)):
        for p, q in zip(a, b, strict=True):
            torch._check(p == q, lambda traced=traced: traced)
    return True


def drops(capacity: int, n_pairs: int | torch.SymInt, dropless: bool) -> bool:
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
    return torch.compiler.is_compiling() or not (is_int(n_pairs) and capacity >= n_pairs)


def eager_rows(n: int | torch.SymInt) -> bool:
    """Whether `n` (a row count) is a positive plain int, in eager code.

    Static mode's blocks skip a copy of a tensor with a zero row after its rows when
    the tensor has a row to read in its place (`take`'s blocks). Compiled, a count may
    be a symbol (unbacked after a ragged op: no guard on it is possible), and inductor
    fuses the copy into the gather, so compiled code keeps the copy.
    """
    return not torch.compiler.is_compiling() and is_int(n) and n > 0


def count(index: Tensor, n: int, weight: Tensor | None = None) -> Tensor:
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
RUNNING_COUNT_LIMIT = 1 << 21


def rank_in_dest(dest: Tensor, world: int, wanted: Tensor) -> Tensor:
    """Each pair's rank among this rank's pairs bound to its destination, token-major: 1 for the first.

    `dest` ``(n,)`` each pair's destination rank, `wanted` ``(world,)`` the pairs
    bound to each (`dest`'s counts).
    """
    n = dest.shape[0]
    if not torch.compiler.is_compiling() and is_int(n) and n * world <= RUNNING_COUNT_LIMIT:
        hits = dest.unsqueeze(1) == torch.arange(world, device=dest.device)  # (n, world) one-hot
        return hits.cumsum(0).gather(1, dest.unsqueeze(1)).view(-1)
    by_dest = torch.sort(dest, stable=True)  # token-major within each destination
    ranks = torch.arange(1, n + 1, device=dest.device) - exclusive(wanted)[by_dest.values]
    return torch.empty_like(ranks).scatter_(0, by_dest.indices, ranks)


def exclusive(t: Tensor, dim: int = 0) -> Tensor:
    return torch.cumsum(t, dim) - t


def inverse(perm: Tensor) -> Tensor:
    """The inverse permutation: ``inverse(p)[p[i]] == i``."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=perm.device))


def round_up(counts: Tensor, align: int) -> Tensor:
    """Each count rounded up to a multiple of `align`: an expert's block in the layout."""
    return counts if align == 1 else (counts + (align - 1)) // align * align


def expert_blocks(recv_counts: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each local expert's row count, where its block starts, where it ends (int32, a grouped GEMM's offs).

    `recv_counts` ``(world, E_local)``: rows received from each source for each local
    expert. Each block is the expert's rows rounded up to a multiple of `align`.
    """
    counts = recv_counts.sum(0)
    padded = round_up(counts, align)
    ends = torch.cumsum(padded, 0)
    return counts, ends - padded, ends.to(torch.int32)


def run_starts(recv_counts: Tensor, offsets: Tensor, run_ends: Tensor) -> Tensor:
    """``(world, E_local)``: the layout row of run (s, e)'s first row, less where the run starts on the wire.

    Run (s, e), source s's rows for local expert e, goes to its expert's block
    (`offsets`) after the rows for e from earlier sources; on the wire it starts
    where the runs before it in its source's rows end (`run_ends`, a cumulative sum
    over them, minus its own length). A row's layout row is this plus its place
    on the wire. (``offsets + (cumsum(recv_counts, 0) - recv_counts) - (run_ends -
    recv_counts)``, the two ``recv_counts`` cancelled.)
    """
    return (offsets - run_ends) + torch.cumsum(recv_counts, 0)


def expert_layout(
    recv_counts: Tensor, n_in: int | torch.SymInt, rows: int | torch.SymInt, align: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Exact mode's expert-major layout of the received rows: (recv_source, dest, counts, offsets, ends).

    `recv_counts` ``(world, E_local)``: rows received from each source for each local
    expert. The `n_in` received rows arrive source-major, then by local expert:
    row i is in run ``b = source * E_local + e``, and goes to
    ``offsets[e] + (rows from earlier sources for e) + (its place in its run)``.
    Returns, for each of the `rows` layout rows, the received row it holds (`n_in`
    for a padding row to `align`: a zero row after the received rows), for each
    received row its layout row, and :func:`expert_blocks`.
    """
    counts, offsets, ends = expert_blocks(recv_counts, align)
    flat = recv_counts.reshape(-1)
    run_ends = torch.cumsum(flat, 0)
    i = torch.arange(n_in, device=recv_counts.device)
    run = torch.searchsorted(run_ends, i, right=True)  # every received row is data: in a run
    start = run_starts(recv_counts, offsets, run_ends.view(recv_counts.shape)).reshape(-1)
    dest = start[run] + i
    source = torch.full((rows,), n_in, dtype=torch.int64, device=i.device).scatter_(0, dest, i)
    return source, dest, counts, offsets, ends


def block_layout(
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
    :func:`expert_blocks`.
    """
    world = recv_counts.shape[0]
    device = recv_counts.device
    counts, offsets, ends = expert_blocks(recv_counts, align)
    run_ends = torch.cumsum(recv_counts, 1)
    n_in = world * block
    q = torch.arange(n_in, device=device)  # the block rows, block-major
    i = torch.remainder(q, block).view(world, block)  # each one's place in its block
    run = torch.searchsorted(run_ends, i, right=True)
    # The rows past the data (run E_local) start at `rows`: one more column, so that one
    # gather places every row, with no mask.
    start = torch.nn.functional.pad(run_starts(recv_counts, offsets, run_ends), (0, 1), value=rows)
    dest = (start.gather(1, run) + i).view(-1)
    source = torch.full((rows + block,), n_in - 1, dtype=torch.int64, device=device)
    source = source.scatter_(0, dest, q)[:rows]
    return source, dest, counts, offsets, ends


def exact_sizes(
    per_dest: Tensor, recv_sizes: Tensor, recv_counts: Tensor, align: int, head: tuple[Tensor, ...] = ()
) -> Tensor:
    """What exact mode reads on the host, after `head`.

    The rows sent to each rank, the rows received from each, and the layout's rows.
    """
    return torch.cat([*head, per_dest, recv_sizes, round_up(recv_counts.sum(0), align).sum(0, True)])
