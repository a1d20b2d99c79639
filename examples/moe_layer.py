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

The router is sharded over the ranks ZeRO-3 style (each rank keeps its experts'
columns) and gathered inside the step; the gather's backward reduce-scatters its
gradient, so every rank's shard gets the sum over ranks' tokens.

The forward is compiled with ``torch.compile(fullgraph=True)``. After 6 SGD
steps on fresh tokens, the program checks every step's loss and the final
weights (router and experts, every rank's) against one process that holds all
tokens and all experts, in float64. It exits non-zero on a mismatch.

With ``--wire quantized`` the bytes travel in fewer bits (docs/wire.md): the
router's gather in int8 (ZeRO++'s qwZ, its gradient back in bfloat16), the
dispatch in float8 e4m3 with a bfloat16 backward and the combine in bfloat16
(DeepEP's choice). Each step's loss must then stay within ``LOSS_RTOL`` of the
exact one-process loss, and the program prints both curves.

Run it on ranks it starts itself (gloo, CPU), as the test suite does
(``tests/test_examples_dir.py`` calls :func:`run` through ``funcoll.testing.run_ranks``)::

    python examples/moe_layer.py --world 2
    python examples/moe_layer.py --world 2 --wire quantized

or under a launcher, one process per rank::

    torchrun --nproc-per-node 2 examples/moe_layer.py
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import Tensor, nn

import funcoll
from funcoll import Wire, moe
from funcoll.testing import heartbeat, launch, print_line

HIDDEN, FFN, E_LOCAL, K, STEPS, LR = 8, 16, 2, 2, 6, 0.5
# --wire quantized: (wire, grad_wire) of each collective of the layer; one scale a row
QUANTIZED = {
    "router": (Wire(torch.int8), Wire(torch.bfloat16)),
    "dispatch": (Wire(torch.float8_e4m3fn), Wire(torch.bfloat16)),
    "combine": (Wire(torch.bfloat16), None),
}
EXACT = dict.fromkeys(QUANTIZED, (None, None))
LOSS_RTOL = 0.1  # quantized: each step's loss within 10% of the exact one (e4m3 keeps 3 bits: 6% a value)


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

    def __init__(
        self,
        params: dict[str, Tensor],
        rank: int,
        world: int,
        policy: moe.Dropless,
        formats: dict[str, tuple[Wire | None, Wire | None]],
    ) -> None:
        super().__init__()
        mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
        self.router = nn.Parameter(params["router"][:, mine].clone())  # this rank's experts' columns
        self.w1 = nn.Parameter(params["w1"][mine].clone())
        self.w2 = nn.Parameter(params["w2"][mine].clone())
        self.num_experts = world * E_LOCAL
        self.policy = policy
        self.formats = formats

    def forward(self, x: Tensor) -> Tensor:
        f = self.formats
        router = funcoll.all_gather(self.router, 1, wire=f["router"][0], grad_wire=f["router"][1])
        weights, idx = torch.softmax(x @ router, -1).topk(K, -1)
        recv, handle = moe.dispatch(
            x, idx, self.num_experts, mode=self.policy, wire=f["dispatch"][0], grad_wire=f["dispatch"][1]
        )
        # Each received row's local expert, from the block offsets (no host read).
        rows = torch.arange(recv.shape[0], device=recv.device)
        local = (torch.searchsorted(handle.offsets, rows, right=True) - 1).clamp(min=0)
        y = experts(recv, local, self.w1, self.w2)
        return x + moe.combine(y, handle, weights, wire=f["combine"][0], grad_wire=f["combine"][1])


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


def run(rank: int, world: int, backend: str = "inductor", wire: str = "exact") -> dict[str, object]:
    """One rank's part: train STEPS steps, then check losses and weights against :func:`reference`.

    `backend` compiles the forward (the test suite passes ``"aot_eager"``: the same
    graphs, without inductor's code generation). `wire`: ``"exact"``, or
    ``"quantized"`` (:data:`QUANTIZED`; the losses then track the reference's
    within :data:`LOSS_RTOL`, and the weights are not compared).
    """
    if wire not in ("exact", "quantized"):
        raise ValueError(f"moe_layer: `wire`={wire!r} must be 'exact' or 'quantized'")
    policy = moe.Dropless(capacity=4)  # small on purpose: the first step overflows and it grows
    layer = MoELayer(parameters(world), rank, world, policy, QUANTIZED if wire == "quantized" else EXACT)
    step_fn = torch.compile(lambda x: loss_of(layer(x)), fullgraph=True, backend=backend)
    if rank == 0:
        print_line(
            f"moe_layer: compiling the forward ({backend}; on a small CPU a graph takes tens of seconds, and "
            f"each step says when it is done). "
            f"Expect 4 graphs a rank (3 recompiles), by design: one static graph for each capacity the "
            f"Dropless policy tries (it starts small on purpose and grows after each overflow) and the exact "
            f"one it reruns an overflowed step with"
        )
    losses = []
    start = time.perf_counter()
    for step in range(STEPS):
        with heartbeat(f"moe_layer: step {step + 1} of {STEPS} (compiles on a new shape)", enabled=rank == 0):
            loss = policy.run(step_fn, funcoll.mark_ragged(tokens(step, rank), 0))
            loss.backward()  # the router's gradient: reduce-scattered onto each rank's shard by the gather
        if rank == 0:
            print_line(
                f"moe_layer: step {step + 1} of {STEPS} done ({time.perf_counter() - start:.1f} s so far)"
            )
        total = funcoll.all_reduce(loss.detach())  # the loss summed over ranks
        with torch.no_grad():
            for p in layer.parameters():
                p -= LR * p.grad
                p.grad = None
        losses.append(total.item())  # a CPU tensor: no device sync

    ref_losses, ref = reference(world)
    mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    assert policy.replays >= 1, "the first step should have overflowed capacity 4"
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    if wire == "quantized":
        assert drift <= LOSS_RTOL, f"quantized losses {losses} drift {drift:.2%} from the exact {ref_losses}"
        if world > 1:  # one rank sends nothing: its collectives are exact
            assert losses != ref_losses, "quantized losses equal the exact ones: nothing was quantized"
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        torch.testing.assert_close(layer.router.detach(), ref["router"][:, mine])
        torch.testing.assert_close(layer.w1.detach(), ref["w1"][mine])
        torch.testing.assert_close(layer.w2.detach(), ref["w2"][mine])
    if rank == 0:
        same = "equal one process" if wire == "exact" else f"within {drift:.2%} of one process's exact losses"
        print_line(
            f"moe_layer: {world} ranks, {STEPS} steps, {wire} wire, losses {[round(v, 4) for v in losses]} {same}; "
            f"the policy reran {policy.replays} overflowed step(s) exactly and grew its capacity to {policy.capacity}"
        )
        if wire == "quantized":
            print_line(f"moe_layer: exact losses {[round(v, 4) for v in ref_losses]}")
    return {"losses": losses, "reference": ref_losses, "replays": policy.replays, "capacity": policy.capacity}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks to start (ignored under torchrun)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument(
        "--wire", choices=("exact", "quantized"), default="exact", help="the collectives' formats"
    )
    args = parser.parse_args()
    return launch(run, args.world, args.backend, args.wire)


if __name__ == "__main__":
    sys.exit(main())
