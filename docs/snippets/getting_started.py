"""The first program of docs/getting-started.md: tests/test_site.py runs it and checks what it prints."""

from __future__ import annotations

# --8<-- [start:program]
import torch

import funcoll
from funcoll.testing import run_ranks


def step(rank: int, world: int) -> dict[str, list]:
    x = torch.arange(2.0 + rank) + 10 * rank  # rank 0: [0, 1]   rank 1: [10, 11, 12]
    x.requires_grad_()
    y = funcoll.gather(x)  # every rank: [0, 1, 10, 11, 12]
    (y * torch.arange(1.0, 6.0)).sum().backward()  # each rank's loss; the losses add up
    return {"y": y.tolist(), "grad": x.grad.tolist()}  # x.grad: the reduce_scatter of the gradients


if __name__ == "__main__":
    for rank, out in enumerate(run_ranks(step, world=2)):
        print(rank, out)
# --8<-- [end:program]
