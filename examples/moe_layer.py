"""An expert-parallel MoE layer, trained compiled, dropless, with one host read per step.

Each rank owns 2 experts (a two-layer MLP each) and holds its own tokens, a
different number on each rank and each step (a rank may hold none). A router
picks each token's top-2 experts; ``funcoll.moe.dispatch`` sends the tokens to
the ranks of their experts, grouped by local expert, the experts run on their
rows, and ``funcoll.moe.combine`` brings the outputs back weighted by the
router. The step's forward runs through a ``funcoll.moe.Dropless`` policy: its
dispatches are static (no host read in the layer, static shapes in the compiled
graph), and after the forward one agreed read tells every rank whether any
dispatch overflowed its capacity, in which case the forward runs again exactly.
The policy starts with a small capacity, so the first steps overflow and it
grows.

The forward is compiled with ``torch.compile(fullgraph=True)``. After 6 SGD
steps on fresh tokens, the program checks every step's loss and the final
weights (router and experts, every rank's) against one process that holds all
tokens and all experts, in float64. It exits non-zero on a mismatch.

Run it on ranks it starts itself (gloo, CPU), as the test suite does
(``tests/test_examples_dir.py`` calls :func:`run` through ``funcoll.testing.run_ranks``)::

    python examples/moe_layer.py --world 2

or under a launcher, one process per rank::

    torchrun --nproc-per-node 2 examples/moe_layer.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import Tensor, nn

import funcoll
from funcoll import moe
from funcoll.testing import launch, print_line

HIDDEN, FFN, E_LOCAL, K, STEPS, LR = 8, 16, 2, 2, 6, 0.5


def tokens(step: int, rank: int) -> Tensor:
    """Rank `rank`'s tokens at `step`: 0 to 9 of them (rank 1 has none on step 2)."""
    n = 0 if (step, rank) == (2, 1) else 3 + (5 * step + 3 * rank) % 7
    return torch.randn(
        n, HIDDEN, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64
    )


def parameters(world: int) -> dict[str, Tensor]:
    """The router and every expert's weights, the same on every rank (rank r uses its own experts)."""
    g = torch.Generator().manual_seed(7)
    n = world * E_LOCAL
    return {
        "router": torch.randn(HIDDEN, n, generator=g, dtype=torch.float64),
        "w1": torch.randn(n, HIDDEN, FFN, generator=g, dtype=torch.float64) / HIDDEN**0.5,
        "w2": torch.randn(n, FFN, HIDDEN, generator=g, dtype=torch.float64) / FFN**0.5,
    }


def experts(rows: Tensor, expert: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """Each row through its expert's MLP: a grouped GEMM written as per-row weight gathers."""
    h = torch.relu(torch.einsum("nh,nhf->nf", rows, w1[expert]))
    return torch.einsum("nf,nfh->nh", h, w2[expert])


class MoELayer(nn.Module):
    """A top-2 MoE layer whose experts are spread over the ranks of `group` (Megatron/torchtitan style)."""

    def __init__(self, params: dict[str, Tensor], rank: int, world: int, policy: moe.Dropless) -> None:
        super().__init__()
        mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
        self.router = nn.Parameter(params["router"].clone())
        self.w1 = nn.Parameter(params["w1"][mine].clone())
        self.w2 = nn.Parameter(params["w2"][mine].clone())
        self.num_experts = world * E_LOCAL
        self.policy = policy

    def forward(self, x: Tensor) -> Tensor:
        weights, idx = torch.softmax(x @ self.router, -1).topk(K, -1)
        recv, handle = moe.dispatch(x, idx, self.num_experts, mode=self.policy)
        # Each received row's local expert, from the block offsets (no host read).
        rows = torch.arange(recv.shape[0], device=recv.device)
        local = (torch.searchsorted(handle.offsets, rows, right=True) - 1).clamp(min=0)
        y = experts(recv, local, self.w1, self.w2)
        return x + moe.combine(y, handle, weights)


def loss_of(out: Tensor) -> Tensor:
    return (out.tanh() ** 2).sum()


def reference(world: int) -> tuple[list[float], dict[str, Tensor]]:
    """Every step's loss (summed over ranks) and the final weights, in one process holding everything."""
    params = {k: v.clone().requires_grad_() for k, v in parameters(world).items()}
    losses = []
    for step in range(STEPS):
        total = torch.zeros((), dtype=torch.float64)
        for rank in range(world):
            x = tokens(step, rank)
            weights, idx = torch.softmax(x @ params["router"], -1).topk(K, -1)
            out = x.clone()
            for j in range(K):
                out = out + weights[:, j : j + 1] * experts(x, idx[:, j], params["w1"], params["w2"])
            total = total + loss_of(out)
        total.backward()
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
                p.grad = None
        losses.append(total.item())  # a CPU tensor: no device sync
    return losses, {k: v.detach() for k, v in params.items()}


def run(rank: int, world: int, backend: str = "inductor") -> dict[str, object]:
    """One rank's part: train STEPS steps, then check losses and weights against :func:`reference`.

    `backend` compiles the forward (the test suite passes ``"aot_eager"``: the same
    graphs, without inductor's code generation).
    """
    policy = moe.Dropless(capacity=4)  # small on purpose: the first step overflows and it grows
    layer = MoELayer(parameters(world), rank, world, policy)
    step_fn = torch.compile(lambda x: loss_of(layer(x)), fullgraph=True, backend=backend)
    if rank == 0:
        print_line(
            f"moe_layer: compiling the forward ({backend}; on a CPU inductor takes about 10 s a graph). "
            f"Expect 4 graphs a rank (3 recompiles), by design: one static graph for each capacity the "
            f"Dropless policy tries (it starts small on purpose and grows after each overflow) and the exact "
            f"one it reruns an overflowed step with"
        )
    losses = []
    for step in range(STEPS):
        loss = policy.run(step_fn, funcoll.mark_ragged(tokens(step, rank), 0))
        loss.backward()
        # The loss summed over ranks, and the router's gradient: every rank's tokens use it.
        total = funcoll.all_reduce(loss.detach())
        layer.router.grad = funcoll.all_reduce(layer.router.grad)
        with torch.no_grad():
            for p in layer.parameters():
                p -= LR * p.grad
                p.grad = None
        losses.append(total.item())  # a CPU tensor: no device sync

    ref_losses, ref = reference(world)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    torch.testing.assert_close(layer.router.detach(), ref["router"])
    torch.testing.assert_close(layer.w1.detach(), ref["w1"][mine])
    torch.testing.assert_close(layer.w2.detach(), ref["w2"][mine])
    assert policy.replays >= 1, "the first step should have overflowed capacity 4"
    if rank == 0:
        print_line(
            f"moe_layer: {world} ranks, {STEPS} steps, losses {[round(v, 4) for v in losses]} equal one process; "
            f"the policy reran {policy.replays} overflowed step(s) exactly and grew its capacity to {policy.capacity}"
        )
    return {"losses": losses, "replays": policy.replays, "capacity": policy.capacity}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks to start (ignored under torchrun)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args()
    return launch(run, args.world, args.backend)


if __name__ == "__main__":
    sys.exit(main())
