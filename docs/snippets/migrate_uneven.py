"""docs/migrate/uneven-gathers.md: torchmetrics' and accelerate's padded gathers (before) and funcoll (after).

Each pair is two functions of ``(rank, world)`` returning the same thing on
every rank; tests/test_site.py runs them on 2 gloo ranks. "before" re-implements
with plain ``torch.distributed`` what ``torchmetrics.utilities.distributed.gather_all_tensors``
and accelerate's ``pad_across_processes`` + ``gather_for_metrics`` compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import funcoll


def _preds(rank: int) -> torch.Tensor:
    """Rank r scored r + 2 samples in this batch (a last batch that does not divide)."""
    return torch.arange(float(rank + 2)) / 10 + rank


# --8<-- [start:torchmetrics_before]
def gather_all_tensors(result: torch.Tensor) -> list[torch.Tensor]:
    """torchmetrics: gather every rank's shape, pad every dim to the largest, all_gather, trim."""
    world_size = dist.get_world_size()
    local_size = torch.tensor(result.shape, device=result.device)
    local_sizes = [torch.zeros_like(local_size) for _ in range(world_size)]
    dist.all_gather(local_sizes, local_size)
    max_size = torch.stack(local_sizes).max(dim=0).values
    pad = []
    for by in reversed((max_size - local_size).tolist()):  # a host sync
        pad += [0, by]
    padded = F.pad(result, pad)
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)  # the padding travels
    return [g[tuple(slice(n) for n in size.tolist())] for g, size in zip(gathered, local_sizes, strict=True)]


def torchmetrics_before(rank: int, world: int) -> list[torch.Tensor]:
    return gather_all_tensors(_preds(rank))


# --8<-- [end:torchmetrics_before]


# --8<-- [start:torchmetrics_after]
def torchmetrics_after(rank: int, world: int) -> list[torch.Tensor]:
    return funcoll.all_gather_list(_preds(rank))  # one tensor per rank, only the rows travel


# --8<-- [end:torchmetrics_after]


def _sequences(rank: int) -> list[torch.Tensor]:
    """Rank r generated r + 2 sequences of lengths 1, 2, 3, ...: variable-length predictions."""
    return [torch.arange(1, n + 2) + 100 * rank for n in range(rank + 2)]


# --8<-- [start:accelerate_before]
def pad_across_processes(tensor: torch.Tensor, dim: int, pad_index: int) -> torch.Tensor:
    """accelerate: pad `dim` to the largest size on any rank, with `pad_index`."""
    size = torch.tensor(tensor.shape, device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    max_size = int(max(s[dim] for s in sizes))  # a host sync
    new_size = list(tensor.shape)
    new_size[dim] = max_size
    out = tensor.new_full(new_size, pad_index)
    out.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return out


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """accelerate.utils.gather: concatenate every rank's (equal-shaped) tensor along dim 0."""
    out = tensor.new_empty(dist.get_world_size() * tensor.shape[0], *tensor.shape[1:])
    dist.all_gather_into_tensor(out, tensor.contiguous())
    return out


def accelerate_before(rank: int, world: int) -> list[torch.Tensor]:
    seqs = _sequences(rank)
    # the sequences padded to a batch, then the batch padded to the longest sequence on any rank
    batch = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=-1)
    batch = pad_across_processes(batch, dim=1, pad_index=-1)
    # even_batches pads the sample dim too, repeating samples; gather_for_metrics drops them again
    n = torch.tensor([batch.shape[0]])
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    most = int(max(counts))
    batch = torch.cat([batch, batch[: most - batch.shape[0]]])
    gathered = gather(batch)
    keep = torch.cat([torch.arange(int(c)) + r * most for r, c in enumerate(counts)])
    return [row[row != -1] for row in gathered[keep]]  # strip the padding from every sequence


# --8<-- [end:accelerate_before]


# --8<-- [start:accelerate_after]
def accelerate_after(rank: int, world: int) -> list[torch.Tensor]:
    seqs = _sequences(rank)
    lengths = funcoll.gather(torch.tensor([len(s) for s in seqs]))  # every sample's length, rank order
    tokens = funcoll.gather(torch.cat(seqs))  # every token, no padding, no repeated samples
    return list(tokens.split(lengths.tolist()))


# --8<-- [end:accelerate_after]


PAIRS = {
    "torchmetrics.gather_all_tensors": (torchmetrics_before, torchmetrics_after),
    "accelerate.pad_across_processes + gather_for_metrics": (accelerate_before, accelerate_after),
}
