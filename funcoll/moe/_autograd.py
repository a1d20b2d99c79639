"""Row moves with their adjoints: the gather through an inverse map, and the weighted sum over the k choices.

Autograd's own backward of ``index_select`` (a zero fill and a scatter-add) is
replaced by a gather through the inverse map (:class:`Gather`), and combine's
weighted sum has a backward that pads with ``zero_rows_after`` (never ``cat``: see
docs/compile.md, "Ranks whose collectives differ").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._collective._phase import Primitive
from .._collective._rows import zero_rows_after


def take(t: Tensor, index: Tensor, spare: bool | int | torch.SymInt | torch.SymBool) -> Tensor:
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
        t = with_zero_row(t)
    return t.index_select(0, index)


def with_zero_row(t: Tensor) -> Tensor:
    """`t` with one zero row after its rows (a copy; kept in the graph when `t` is empty)."""
    return zero_rows_after(t, 1)


class Gather(Primitive):
    """A row gather of dispatch or combine whose backward is a gather too, not a scatter into zeros.

    Forward: ``take(t, index, spare)``. Every row a move reads is read by at most
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
      the gradient's rows gets any row (``take(grad, back, b)``).

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
        t: Tensor,
        index: Tensor,
        spare: bool | int,
        back: Tensor,
        valid: Tensor | int | None,
    ) -> Tensor:
        return take(t, index, spare)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:  # type: ignore[override]
        _, _, _, back, valid = inputs
        ctx.masked = isinstance(valid, Tensor)
        ctx.block = None if ctx.masked else valid
        ctx.save_for_backward(back, valid if ctx.masked else back)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        back, valid = ctx.saved_tensors
        if back.dim() == 2:
            out = sum_bags(grad, back)
        elif ctx.masked:
            out = take_valid(grad, back, valid)
        elif ctx.block is None:  # every row of t is data
            out = grad.index_select(0, back)
        else:  # (the caller gives a block only where grad has a row: `eager_rows`)
            out = take(grad, back, ctx.block)
        return out, None, None, None, None


# Bags of rows, summed. On the CPU one embedding_bag, 2-4x faster than a gather, a
# mask and a sum there (torch 2.13, T = 1024-4096 tokens, D = 256-2048). On CUDA
# embedding_bag's kernel took 1.2 ms for static mode's 40961 bags of one row or
# none of 2048 bf16 features on an H200 (torch 2.11), about 15x what the gather and
# the mask take to move the same bytes: 47% of the GPU time of a static training step
# of torchtitan's MoE layer with per-feature-scale experts at 16384 tokens. Elsewhere
# than the CPU the bags are gathered. (A compiled graph takes the same path, by the
# tensors' device.)
def by_gather(t: Tensor) -> bool:
    """Whether bags of `t`'s rows are gathered, masked and summed rather than one embedding_bag."""
    return t.device.type != "cpu"


def sum_bags(t: Tensor, bags: Tensor) -> Tensor:
    """``out[i] = sum_j t[bags[i, j]]``: ``(n, k) -> (n, *R)``.

    No entry is skipped (no ``padding_idx``): with one, the CPU's embedding_bag leaves
    its fast kernel, 1.35-1.55x the time on one thread and 2.4-2.8x on two (torch
    2.13, 1024-4096 bags of 2, 256-1024 features). A caller whose entry adds
    nothing names a zero row.
    """
    if not by_gather(t):
        return torch.nn.functional.embedding_bag(bags, t, mode="sum")
    n, k = bags.shape
    return t.index_select(0, bags.reshape(-1)).view(n, k, *t.shape[1:]).sum(1)


def take_valid(t: Tensor, index: Tensor, valid: Tensor) -> Tensor:
    """``out[i] = t[index[i]]`` where ``valid[i]``, zero elsewhere (whatever an invalid `index` entry holds).

    `t` has a row wherever some entry is valid (embedding_bag's path: at least one row).
    """
    n = index.shape[0]
    if by_gather(t):
        # An invalid entry reads the zero row after t's rows: t may have none.
        return take(t, torch.where(valid, index, t.shape[0]), spare=True)
    # Bags of one row or none: the valid entries packed in order, then the others
    # (index 0), which fall in one more bag, cut off. (A bag ends where the next
    # begins, and the last one at the end of the indices, whatever the offsets say.)
    ends = torch.cumsum(valid, 0)
    offsets = torch.cat([ends.new_zeros(1), ends])
    packed = index.new_zeros(n + 1).scatter_(0, torch.where(valid, ends - 1, n), index)[:n]
    return torch.nn.functional.embedding_bag(packed, t, offsets, mode="sum")[:n]


class WeightedSum(Primitive):
    """``out[t] = sum_j weights[t, j] * rows[row_of[t, j]]``, whose backward gathers.

    Forward: one ``embedding_bag`` (sum, per-sample weights), as autograd's. Backward:
    the weights' gradient is the same op's (``_embedding_bag_per_sample_weights_backward``,
    a dot product per entry); the rows' gradient, ``weights[t, j] * grad[t]`` at row
    ``row_of[t, j]`` and zero at the rows no entry reads, is a gather through the
    inverse map, the pair each row carries (`pairs`: dispatch's ``send_pairs``), where
    autograd's adjoint is a zero fill of ``rows``' size and a scatter-add. Static mode
    (`zero` as in :class:`Gather`'s `valid`) gives exactly zero to the rows that carry
    no pair (a mask), or to the spare rows, the last of each block (an int, the block's
    rows), and then any pair's gradient to the other slots that carry none: no one
    reads them.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        rows: Tensor,
        row_of: Tensor,
        weights: Tensor,
        skip: int | None,
        pairs: Tensor,
        zero: Tensor | int | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        tokens, k = row_of.shape
        bags = torch.arange(0, tokens * k, k, device=row_of.device)
        # No padding_idx (-1): with one, the CPU's kernel leaves its fast path (`sum_bags`).
        out, offset2bag, _, _ = torch.ops.aten._embedding_bag(
            rows, row_of.reshape(-1), bags, False, 0, False, weights.reshape(-1), False, -1
        )
        # The bags and embedding_bag's map of entries to bags are the weights' gradient's
        # too: outputs, not differentiable, that `weighted_sum` drops (a forward has no ctx
        # to keep them on, and offset2bag is the kernel's own).
        return out, bags, offset2bag

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:  # type: ignore[override]
        rows, row_of, weights, skip, pairs, zero = inputs
        _, bags, offset2bag = output
        ctx.mark_non_differentiable(bags, offset2bag)
        if not torch.compiler.is_compiling():
            # Their gradients (always zero) stay None, not zeros of their shape made for a
            # backward that ignores them. (Dynamo refuses this call; a compiled backward
            # has no input for an output that needs no gradient.)
            ctx.set_materialize_grads(False)
        # The weights' gradient skips the entries equal to `skip` (their weights are a
        # `where`'s zeros, whose gradient is zero): no dot product for a dropped pair.
        ctx.k, ctx.pad = row_of.shape[1], -1 if skip is None else skip
        ctx.masked, ctx.block = isinstance(zero, Tensor), zero if not isinstance(zero, Tensor) else None
        # (row_of.reshape(-1) is the forward's view again: `combine` passes a contiguous row_of.)
        ctx.save_for_backward(rows, row_of.reshape(-1), bags, offset2bag, weights, pairs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
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
                g, w = with_zero_row(g), with_zero_row(w)
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


def rows_of_pairs(rows: Tensor, row_of: Tensor, pairs: Tensor, zero: Tensor | int | None) -> Tensor:
    """``rows[row_of.reshape(-1)]``, whose backward gathers through the pair each row carries.

    Autograd's backward of the ``index_select`` is a zero fill of ``rows``' size and an
    ``index_add_`` (0.56 ms of a 6.5 ms step of torchtitan's layer at 16384 tokens on
    an H200). Every row is read by at most one pair, so its gradient is that pair's
    (`pairs`: dispatch's ``send_pairs``; static mode's `zero` as in
    :class:`WeightedSum`). A dropped pair reads a spare row, which no kept pair has
    and which gets zero: the caller weights such entries by zero.
    """
    return Gather.apply(rows, row_of.reshape(-1), False, pairs, zero)


def weighted_sum(
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
    :class:`WeightedSum`'s gather through the pair each row carries (`pairs`:
    dispatch's ``send_pairs``; `zero`: static mode's rows that carry none). Entries
    equal to `skip` (a dropped pair's: the spare row of block 0, zeros) are weighted
    by zero, so that they add exactly nothing, whatever the weight, and get no
    gradient. Not embedding_bag's ``padding_idx``: the CPU's kernel leaves its fast
    path for one (`sum_bags`).

    That is the CPU's path (`by_gather`). Dtypes it does not take (complex,
    integer) gather, mask and sum, and so does every device but the CPU: CUDA's
    embedding_bag kernels are slow for these bags (see `by_gather`), and CUDA has no
    bfloat16 kernel for the weights' gradient
    (``_embedding_bag_per_sample_weights_backward_cuda`` raised NotImplementedError on
    torch 2.11, H100). The ``(T, k, H)`` gather is then kept for the backward, as a
    dispatcher that weights its rows that way keeps it, and the rows' gradient
    gathers through the pair each row carries (`rows_of_pairs`).
    """
    w = weights.to(rows.dtype)
    if skip is not None:
        w = torch.where(row_of == skip, 0, w)
    if rows.dtype.is_floating_point and not by_gather(rows):
        return WeightedSum.apply(rows, row_of, w, skip, pairs, zero)[0]
    per_pair = rows_of_pairs(rows, row_of, pairs, zero).view(*row_of.shape, rows.shape[1])
    return (per_pair * w.unsqueeze(-1)).sum(1)
