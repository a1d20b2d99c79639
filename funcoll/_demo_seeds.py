"""The demo's seed-style helpers: sequence parallelism written the way the widely copied helpers do it.

Retyped in the style of the seeds that :mod:`funcoll.compat` replaces (the ragged
``gather`` that pads to the longest rank, ``all_gather_nd``, OpenSora's
``_AllToAll`` and ``_GatherForwardSplitBackward``), extended the way a user of
those seeds would extend them to ragged sequence shards and a head count the
world does not divide:

- every call exchanges the sizes itself: an in-place ``dist.all_gather`` into a
  Python list of one-element tensors, then ``.item()`` on each (a device-to-host
  sync per rank, per call);
- ragged rows and uneven heads are padded with zeros to the largest rank, moved
  by an even ``dist.all_gather`` / ``dist.all_to_all`` of Python lists, and cut
  again;
- the autograd wrappers are ``torch.autograd.Function`` classes that keep the
  ProcessGroup and the sizes on ``ctx``.

None of this compiles with ``fullgraph=True`` (the ``.item()`` calls and the
in-place collectives into lists), so the demo runs it eagerly. It is not part of
funcoll and is not imported by it; the demo compares it with funcoll's ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "exchange_sizes",
    "gather",
    "gather_forward_split_backward",
    "heads_to_seq",
    "list_all_to_all_route",
    "seq_to_heads",
]


def _gather_sizes(n: int, device: torch.device, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's length, as the seeds get it: all_gather of one-element tensors into a list."""
    world_size = dist.get_world_size(group)
    local_size = torch.tensor([n], dtype=torch.long, device=device)
    all_sizes = [torch.zeros_like(local_size) for _ in range(world_size)]
    dist.all_gather(all_sizes, local_size, group=group)  # in place, as the seeds do: the baseline
    return [int(size.item()) for size in all_sizes]  # host sync per rank: the seeds' way to read sizes


def _head_counts(heads: int, world_size: int) -> list[int]:
    """How many heads each rank owns: ``torch.tensor_split`` semantics (the first ``heads % w`` get one more)."""
    return [len(chunk) for chunk in torch.tensor_split(torch.arange(heads), world_size)]


# Whether the backend runs ``dist.all_to_all`` of lists: gloo gained it after torch 2.11
# (2.10 and 2.11 raise "Backend gloo does not support alltoall"). Learned on the first call.
_LIST_ALL_TO_ALL: dict[str, bool] = {}


def list_all_to_all_route(group: Any = None) -> str:
    """How the seed-style ``_all_to_all`` moves its pieces on this backend (for the demo's summary)."""
    backend = str(dist.get_backend(group))
    if _LIST_ALL_TO_ALL.get(backend, True):
        return "dist.all_to_all of lists"
    return f"dist.all_to_all_single (torch {torch.__version__}'s {backend} lacks the list form)"


def _all_to_all(input_: Tensor, world_size: int, group: Any, scatter_dim: int, gather_dim: int) -> Tensor:
    """OpenSora's ``_all_to_all``: even pieces, ``dist.all_to_all`` of Python lists.

    Where the backend has no list all_to_all (gloo before torch 2.12), the pieces travel
    in one in-place ``dist.all_to_all_single`` of their stack instead: the same
    exchange, one collective, and the same eager semantics. The backend refuses the
    list form on every rank alike, before any communication, so every rank takes the
    same route.
    """
    input_list = [t.contiguous() for t in torch.tensor_split(input_, world_size, scatter_dim)]
    output_list = [torch.empty_like(input_list[0]) for _ in range(world_size)]
    backend = str(dist.get_backend(group))
    if _LIST_ALL_TO_ALL.get(backend, True):
        try:
            dist.all_to_all(output_list, input_list, group=group)  # in place, as the seeds do: the baseline
            _LIST_ALL_TO_ALL[backend] = True
        except RuntimeError as e:
            if "does not support alltoall" not in str(e):
                raise
            _LIST_ALL_TO_ALL[backend] = False
    if not _LIST_ALL_TO_ALL[backend]:
        out = torch.empty((world_size, *input_list[0].shape), dtype=input_.dtype, device=input_.device)
        dist.all_to_all_single(out, torch.stack(input_list), group=group)  # in place: the closest equivalent
        output_list = list(out.unbind(0))
    return torch.cat(output_list, dim=gather_dim).contiguous()


def _pad_gather(input_: Tensor, sizes: list[int], group: Any) -> Tensor:
    """The seed ``gather`` (all_gather mode): pad to the longest rank, all_gather a list, cut, concatenate."""
    world_size = len(sizes)
    max_size = max(sizes)
    padded = torch.zeros((max_size, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    padded[: input_.shape[0]] = input_
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)  # in place, as the seeds do: the baseline
    return torch.cat([t[:n] for t, n in zip(gathered, sizes, strict=True)], dim=0)


def gather(tensor: Tensor, group: Any = None) -> Tensor:
    """The seed ragged ``gather`` along dim 0 to every rank (no autograd): exchange sizes, pad, gather, cut."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    sizes = _gather_sizes(tensor.shape[0], tensor.device, group)
    return _pad_gather(tensor, sizes, group)


def _seq_to_heads(input_: Tensor, sizes: list[int], heads: int, group: Any) -> Tensor:
    """``(n_r, H, D)`` sequence-sharded -> ``(N, H_r, D)`` head-sharded, padded to even pieces."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    counts = _head_counts(heads, world_size)
    max_n, max_h = max(sizes), max(counts)
    padded = input_.new_zeros(max_n, world_size * max_h, input_.shape[2])
    for j, piece in enumerate(torch.split(input_, counts, dim=1)):
        padded[: input_.shape[0], j * max_h : j * max_h + counts[j]] = piece
    output = _all_to_all(padded, world_size, group, scatter_dim=1, gather_dim=0)  # (w * max_n, max_h, D)
    pieces = [output[j * max_n : j * max_n + n, : counts[rank]] for j, n in enumerate(sizes)]
    return torch.cat(pieces, dim=0)


def _heads_to_seq(input_: Tensor, sizes: list[int], heads: int, group: Any) -> Tensor:
    """``(N, H_r, D)`` head-sharded -> ``(n_r, H, D)`` sequence-sharded, padded to even pieces."""
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    counts = _head_counts(heads, world_size)
    max_n, max_h = max(sizes), max(counts)
    padded = input_.new_zeros(world_size * max_n, max_h, input_.shape[2])
    for j, piece in enumerate(torch.split(input_, sizes, dim=0)):
        padded[j * max_n : j * max_n + sizes[j], : counts[rank]] = piece
    output = _all_to_all(padded, world_size, group, scatter_dim=0, gather_dim=1)  # (max_n, w * max_h, D)
    pieces = [output[: sizes[rank], j * max_h : j * max_h + h] for j, h in enumerate(counts)]
    return torch.cat(pieces, dim=1)


class _SeqToHeads(torch.autograd.Function):
    """Ulysses all-to-all, sequence -> heads, for ragged sequence shards and any head count.

    Args:
        input_: (n_r, H, D) this rank's tokens
        sizes: every rank's sequence length
        process_group: communication group
        heads: H
    """

    @staticmethod
    def forward(input_: Tensor, sizes: list[int], process_group: Any, heads: int) -> Tensor:
        return _seq_to_heads(input_, sizes, heads, process_group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, sizes, process_group, heads = inputs
        ctx.process_group = process_group
        ctx.heads = heads
        ctx.sizes = sizes

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None, None]:
        grad_input = _heads_to_seq(grad_output, ctx.sizes, ctx.heads, ctx.process_group)
        return grad_input, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    """Ulysses all-to-all, heads -> sequence: the inverse of :class:`_SeqToHeads`.

    Args:
        input_: (N, H_r, D) every token, this rank's heads
        sizes: every rank's sequence length (the seeds carry them from the forward all-to-all)
        process_group: communication group
        heads: H
    """

    @staticmethod
    def forward(input_: Tensor, sizes: list[int], process_group: Any, heads: int) -> Tensor:
        return _heads_to_seq(input_, sizes, heads, process_group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, sizes, process_group, heads = inputs
        ctx.process_group = process_group
        ctx.heads = heads
        ctx.sizes = sizes

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None, None]:
        grad_input = _seq_to_heads(grad_output, ctx.sizes, ctx.heads, ctx.process_group)
        return grad_input, None, None, None


class _GatherForwardSplitBackward(torch.autograd.Function):
    """Gather the ragged input (padded all_gather) and concatenate; the backward keeps this rank's slice.

    Args:
        input_: (n_r, ...) this rank's rows
        sizes: every rank's length (:func:`gather_forward_split_backward` exchanges them first)
        process_group: communication group
    """

    @staticmethod
    def forward(input_: Tensor, sizes: list[int], process_group: Any) -> Tensor:
        return _pad_gather(input_, sizes, process_group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, sizes, process_group = inputs
        ctx.mode = process_group
        ctx.sizes = sizes

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        rank = dist.get_rank(ctx.mode)
        start = sum(ctx.sizes[:rank])
        return grad_output[start : start + ctx.sizes[rank]].contiguous(), None, None


def exchange_sizes(input_: Tensor, process_group: Any) -> list[int]:
    """Every rank's ``input_.shape[0]``: the seeds' size exchange (all_gather into a list, ``.item()``)."""
    return _gather_sizes(input_.shape[0], input_.device, process_group)


def seq_to_heads(input_: Tensor, sizes: list[int], process_group: Any, heads: int) -> Tensor:
    """``(n_r, H, D) -> (N, H_r, D)``: every token, this rank's heads."""
    return _SeqToHeads.apply(input_, sizes, process_group, heads)


def heads_to_seq(input_: Tensor, sizes: list[int], process_group: Any, heads: int) -> Tensor:
    """``(N, H_r, D) -> (n_r, H, D)``: the inverse re-shard."""
    return _HeadsToSeq.apply(input_, sizes, process_group, heads)


def gather_forward_split_backward(input_: Tensor, process_group: Any) -> Tensor:
    """The ragged gather of a loss's per-token terms (every rank then computes the same loss)."""
    # The sizes are exchanged here, just before the gather, as the seeds' forward does first
    # thing: a forward of torch's setup_context form has no ctx to keep them on.
    sizes = _gather_sizes(input_.shape[0], input_.device, process_group)
    return _GatherForwardSplitBackward.apply(input_, sizes, process_group)
