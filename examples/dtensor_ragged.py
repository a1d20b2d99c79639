"""Ragged sequences into a DTensor and back: run with ``torchrun --nproc-per-node 2 examples/dtensor_ragged.py``.

Each rank holds a different number of tokens (here 5 and 2). ``funcoll.from_ragged``
lays them out as a ``Shard(0)`` DTensor in DTensor's own layout (4 and 3 rows),
moving only the one row that changes owner; a funcoll op works on the DTensor; and
``funcoll.to_ragged`` gives every rank its own tokens back. The program checks both
against the tokens every rank can compute alone, and exits non-zero on a mismatch.

``tests/test_dtensor.py`` runs it under torchrun as above. Without a launcher it
starts its own gloo ranks (``funcoll.testing.run_ranks``)::

    python examples/dtensor_ragged.py --world 2
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

import funcoll
from funcoll.testing import launch, print_ranks


def run(rank: int, world: int) -> None:
    """One rank's part, on an initialized process group; raises ``AssertionError`` on a mismatch."""
    mesh = init_device_mesh("cpu", (world,))
    lengths = [5 if r % 2 == 0 else 2 for r in range(world)]
    start = sum(lengths[:rank])
    tokens = torch.arange(start, start + lengths[rank], dtype=torch.float32)[:, None].repeat(1, 3)

    x, sizes = funcoll.from_ragged(tokens, group=mesh)  # Shard(0) of all the tokens, in order
    # The DTensor's shards are torch's even chunks of all the tokens, not the ranks' own lengths.
    print_ranks(f"rank {rank}: {lengths[rank]} tokens of its own; DTensor {tuple(x.shape)} {x.placements}, "
               f"its even chunk: rows {x.to_local()[:, 0].tolist()}")  # fmt: skip
    full = funcoll.all_gather(x)  # Shard(0) -> Replicate(), the same global tensor
    assert torch.equal(full.to_local()[:, 0], torch.arange(sum(lengths), dtype=torch.float32))
    back = funcoll.to_ragged(x * 10, sizes)  # every rank its own tokens, times 10
    assert torch.equal(back, tokens * 10)
    print_ranks(f"rank {rank}: got its {back.shape[0]} tokens back")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks to start (ignored under torchrun)")
    args = parser.parse_args()
    return launch(run, args.world, timeout=120)


if __name__ == "__main__":
    sys.exit(main())
