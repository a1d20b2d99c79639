"""MoE token dispatch and combine, two ways: ``funcoll.all_to_all_v`` and ``funcoll.all_to_all_padded``.

Every rank holds its own number of tokens and ``E_LOCAL`` experts; a router
sends each token to one expert (top-1). Dispatch moves the tokens to the rank
of their expert, each rank runs its experts, and combine moves the results back
to the tokens' ranks, where they are scaled by the router's gate.

- :func:`moe_v`: exact sizes. ``all_to_all_v`` exchanges the per-rank counts
  (one small all_gather, read on the host), sends exactly the routed rows, and
  combine is the same op with the sizes swapped.
- :func:`moe_padded`: static shapes with a capacity ``C`` per destination rank
  (tokens past it are dropped, as in Switch/GShard). ``all_to_all_padded``
  sends ``world`` blocks of ``C`` rows and keeps the counts on the device:
  no host read, the same shapes every step.

Both are differentiable (the backward of each all_to_all is the all_to_all of
the gradient with the sizes swapped), and the program checks outputs and the
gradients of the tokens and of every expert's weight against one process that
holds all tokens and all experts. It exits non-zero on a mismatch.

Run it on ranks it starts itself (gloo, CPU), as the test suite does
(``tests/test_examples_dir.py`` calls :func:`run` through ``funcoll.testing.run_ranks``)::

    python examples/moe_dispatch.py --world 3

or under a launcher, one process per rank::

    torchrun --nproc-per-node 3 examples/moe_dispatch.py
"""

from __future__ import annotations

import argparse
import sys

import torch

import funcoll
from funcoll.testing import launch, print_ranks

D, E_LOCAL, CAPACITY = 6, 2, 3  # model dim, experts per rank, rows per destination rank (padded path)


def problem(world: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's tokens (5, 8, 3, ... rows), the router and the experts' weights: the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randn(5 + (3 * r) % 7, D, generator=gen, dtype=torch.float64) for r in range(world)]
    router = torch.randn(D, world * E_LOCAL, generator=gen, dtype=torch.float64)
    experts = torch.randn(world * E_LOCAL, D, D, generator=gen, dtype=torch.float64)
    return tokens, router, experts


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 routing: each token's expert and gate."""
    gate, expert = torch.softmax(x @ router, dim=-1).max(dim=-1)
    return expert, gate


def expert_forward(x: torch.Tensor, expert: torch.Tensor, weights: torch.Tensor, first: int) -> torch.Tensor:
    """Run each row through its expert; `weights` holds experts ``first, first + 1, ...``."""
    return torch.einsum("nd,nde->ne", x, weights[expert - first])


def keep_within_capacity(dest: torch.Tensor, world: int) -> torch.Tensor:
    """Which tokens fit: the first ``CAPACITY`` tokens (in order) bound for each rank."""
    one_hot = torch.nn.functional.one_hot(dest, world)
    position = (one_hot.cumsum(0) - 1).gather(1, dest[:, None])[:, 0]  # the token's place in its block
    return position < CAPACITY


def reference(
    tokens: list[torch.Tensor], router: torch.Tensor, experts: torch.Tensor, capacity: bool
) -> tuple:
    """One process, every token and every expert: outputs per rank and the gradients."""
    world = len(tokens)
    xs = [t.clone().requires_grad_() for t in tokens]
    w = experts.clone().requires_grad_()
    outs = []
    for x in xs:
        expert, gate = route(x, router)
        y = expert_forward(x, expert, w, 0) * gate[:, None]
        if capacity:  # a dropped token's MoE output is zero
            y = y * keep_within_capacity(expert // E_LOCAL, world)[:, None]
        outs.append(y)
    sum((y.sin()).sum() for y in outs).backward()
    return [y.detach() for y in outs], [x.grad for x in xs], w.grad


def moe_v(x: torch.Tensor, router: torch.Tensor, weights: torch.Tensor, group: funcoll.GroupLike = None):
    """Dispatch with exact sizes (``all_to_all_v``), run the local experts, combine."""
    rank, world = funcoll.axis_index(group), funcoll.axis_size(group)
    expert, gate = route(x, router)
    order = torch.argsort(expert, stable=True)  # the tokens grouped by expert, so by destination rank
    send_sizes = torch.bincount(expert // E_LOCAL, minlength=world).tolist()  # a CPU tensor: no device sync
    # Dispatch: the rows, then their expert ids with the sizes now known (no second exchange).
    recv, recv_sizes = funcoll.all_to_all_v(x[order], send_sizes, group=group)
    recv_expert, _ = funcoll.all_to_all_v(expert[order], send_sizes, recv_sizes, group=group)
    y = expert_forward(recv, recv_expert, weights, rank * E_LOCAL)
    # Combine: the same op with the sizes swapped brings every row back to its sender, in its order.
    back, _ = funcoll.all_to_all_v(y, recv_sizes, send_sizes, group=group)
    out = torch.empty_like(back).index_copy(0, order, back)  # undo the sort
    return out * gate[:, None]


def moe_padded(x: torch.Tensor, router: torch.Tensor, weights: torch.Tensor, group: funcoll.GroupLike = None):
    """Dispatch with a capacity per destination rank (``all_to_all_padded``): static shapes, no host read."""
    rank, world = funcoll.axis_index(group), funcoll.axis_size(group)
    expert, gate = route(x, router)
    dest = expert // E_LOCAL
    keep = keep_within_capacity(dest, world)
    position = (torch.nn.functional.one_hot(dest, world).cumsum(0) - 1).gather(1, dest[:, None])[:, 0]
    slot = torch.where(keep, dest * CAPACITY + position, world * CAPACITY)  # dropped tokens: a spare row
    blocks = x.new_zeros(world * CAPACITY + 1, x.shape[1]).index_copy(0, slot, x)[:-1]
    block_expert = expert.new_zeros(world * CAPACITY + 1).index_copy(0, slot, expert)[:-1]
    send_sizes = torch.bincount(dest[keep], minlength=world)  # stays a tensor: nothing is read on the host

    recv, recv_sizes = funcoll.all_to_all_padded(blocks, send_sizes, group=group)  # packed, zeros after
    recv_expert, _ = funcoll.all_to_all_padded(block_expert, send_sizes, group=group)
    y = expert_forward(
        recv, recv_expert.clamp(rank * E_LOCAL, rank * E_LOCAL + E_LOCAL - 1), weights, rank * E_LOCAL
    )

    # Combine: put the rows from rank i back in block i, then all_to_all_padded returns them to i.
    ends = recv_sizes.cumsum(0)
    i = torch.arange(world * CAPACITY)
    src_rank, k = i // CAPACITY, i % CAPACITY
    valid = k < recv_sizes[src_rank]
    src_row = torch.where(valid, ends[src_rank] - recv_sizes[src_rank] + k, 0)
    reblocked = torch.where(valid[:, None], y[src_row], 0)
    back, _ = funcoll.all_to_all_padded(reblocked, recv_sizes, group=group)
    # `back` holds, packed, the rows this rank sent, in block order: the kept tokens sorted by (dest, position).
    packed_at = torch.cumsum(send_sizes, 0) - send_sizes
    row = torch.where(keep, packed_at[dest] + position.clamp(max=CAPACITY - 1), 0)
    return torch.where(keep[:, None], back[row], 0) * gate[:, None]


def run(rank: int, world: int) -> float:
    """One rank's part: both MoE layers on this rank's tokens, checked against one process.

    Returns the largest absolute error; raises ``AssertionError`` on a mismatch.
    """
    tokens, router, experts = problem(world)
    worst = 0.0
    for name, layer, capacity in (("all_to_all_v", moe_v, False), ("all_to_all_padded", moe_padded, True)):
        ref_out, ref_dx, ref_dw = reference(tokens, router, experts, capacity)
        x = tokens[rank].clone().requires_grad_()
        mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
        weights = experts[mine].clone().requires_grad_()  # this rank's experts
        out = layer(x, router, weights)
        out.sin().sum().backward()  # this rank's share of the reference's loss
        torch.testing.assert_close(out, ref_out[rank])
        torch.testing.assert_close(x.grad, ref_dx[rank])
        torch.testing.assert_close(weights.grad, ref_dw[mine])  # summed over every rank's tokens
        worst = max(worst, (out - ref_out[rank]).abs().max().item())  # a CPU tensor: no device sync
        dropped = int((~keep_within_capacity(route(x, router)[0] // E_LOCAL, world)).sum()) if capacity else 0
        print_ranks(f"rank {rank}: {name}: {x.shape[0]} tokens ({dropped} over capacity) through {E_LOCAL} "
              "local experts; outputs and gradients match one process")  # fmt: skip
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--world", type=int, default=3, help="ranks to start (ignored under torchrun)")
    args = parser.parse_args()
    return launch(run, args.world, timeout=120)


if __name__ == "__main__":
    sys.exit(main())
