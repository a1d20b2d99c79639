"""Ulysses sequence-parallel attention with a head count the world does not divide.

Each rank holds a slice of the sequence, ``(B, S_r, H, D)``. One
``funcoll.all_to_all`` turns sequence shards into head shards, ``(B, S, H_r, D)``:
every rank sees the whole sequence for its heads and runs ordinary attention;
a second all_to_all turns the output back into sequence shards. Here ``H = 5``
and ``S = 7``, so on 2 or 3 ranks both the heads and the sequence split
unevenly (``torch.tensor_split`` lengths, which ``funcoll.split_sizes`` gives
every rank without communicating). The backward of each all_to_all is the
all_to_all with the dims swapped, so the gradients flow back to each rank's
sequence slice.

The program checks the output and the gradients of q, k and v against causal
attention over the whole sequence in one process, and exits non-zero if they
differ.

Run it on ranks it starts itself (gloo, CPU), as the test suite does
(``tests/test_examples_dir.py`` calls :func:`run` through ``funcoll.testing.run_ranks``)::

    python examples/ulysses_attention.py --world 3

or under a launcher, one process per rank::

    torchrun --nproc-per-node 3 examples/ulysses_attention.py
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import funcoll
from funcoll.testing import launch, print_ranks

B, S, H, D = 2, 7, 5, 4


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on ``(B, S, H, D)`` tensors (SDPA takes ``(B, H, S, D)``)."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return o.transpose(1, 2)


def ulysses(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, group: funcoll.GroupLike = None
) -> torch.Tensor:
    """Attention over sequence shards ``(B, S_r, H, D)`` of a sequence of `seq_len`; returns ``(B, S_r, H, D)``."""
    world = funcoll.axis_size(group)
    seq = funcoll.split_sizes(seq_len, world)  # every rank's S_r: known everywhere, nothing exchanged
    heads = funcoll.split_sizes(q.shape[2], world)  # every rank's H_r after the first all_to_all
    # (B, S_r, H, D) -> (B, S, H_r, D): scatter the heads (dim 2), gather the sequence (dim 1).
    q, k, v = (funcoll.all_to_all(t, group, 2, 1, gather_sizes=seq) for t in (q, k, v))
    o = attention(q, k, v)  # the whole sequence, this rank's heads
    # (B, S, H_r, D) -> (B, S_r, H, D): scatter the sequence, gather the heads.
    return funcoll.all_to_all(o, group, 1, 2, gather_sizes=heads)


def run(rank: int, world: int) -> float:
    """One rank's part: Ulysses attention on this rank's slice, checked against one process.

    Returns the largest absolute error; raises ``AssertionError`` on a mismatch.
    """
    gen = torch.Generator().manual_seed(0)  # every rank draws the same global tensors
    q_full, k_full, v_full, w_full = (
        torch.randn(B, S, H, D, generator=gen, dtype=torch.float64) for _ in range(4)
    )

    # The single-process reference: attention over the whole sequence, and its gradients.
    ref = [t.clone().requires_grad_() for t in (q_full, k_full, v_full)]
    o_ref = attention(*ref)
    (o_ref * w_full).sum().backward()

    # This rank's sequence slice, as a data loader for sequence parallelism would hand it out.
    mine = [t.tensor_split(world, dim=1)[rank].clone().requires_grad_() for t in (q_full, k_full, v_full)]
    o = ulysses(*mine, seq_len=S)
    w = w_full.tensor_split(world, dim=1)[rank]
    (o * w).sum().backward()  # each rank's share of the same global loss

    torch.testing.assert_close(o, o_ref.tensor_split(world, dim=1)[rank])
    for got, want in zip(mine, ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad.tensor_split(world, dim=1)[rank])
    err = (o - o_ref.tensor_split(world, dim=1)[rank]).abs().max().item()  # a CPU tensor: no device sync
    print_ranks(f"rank {rank}: heads {funcoll.split_sizes(H, world)[rank]} of {H}, "
          f"sequence {mine[0].shape[1]} of {S}; matches one process (max error {err:.1e})")  # fmt: skip
    return err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--world", type=int, default=3, help="ranks to start (ignored under torchrun)")
    args = parser.parse_args()
    return launch(run, args.world, timeout=120)


if __name__ == "__main__":
    sys.exit(main())
