"""torchtitan's MoE layer, expert-parallel, with funcoll's token dispatcher selected by config.

torchtitan (0.3.0) builds its MoE layer from a config: a router, ``GroupedExperts``
(bf16 grouped GEMMs) and a token dispatcher. Here the dispatcher is
``funcoll.integrations.torchtitan.FuncollTokenDispatcher`` in dropless mode (static
shapes with a capacity of the even share, ``capacity_factor`` 1.0, while the routing
fits; exact mode's dispatch when a rank overflows it, after which the capacity grows;
nothing dropped); each rank holds 2 of the 8 experts (``E / world``) and
the dispatcher is wired to a 1-D ``ep`` mesh as torchtitan's ``parallelize`` wires
it. The router's gate is replicated: its gradient is summed over the ranks with
``funcoll.all_reduce``, as data parallelism would.

After 3 SGD steps, each on fresh tokens, the program checks every step's loss and
the final weights against torchtitan's own layer in one process holding every
expert and every rank's tokens (no expert parallelism: torchtitan's local
dispatch). It exits non-zero on a mismatch.

Run it on ranks it starts itself (gloo, CPU), as the test suite does::

    python examples/torchtitan_moe.py --world 4

or under a launcher: ``torchrun --nproc-per-node 4 examples/torchtitan_moe.py``.
Needs ``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3`` and ``pip install tyro``.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

import funcoll
from funcoll.integrations.torchtitan import FuncollTokenDispatcher
from funcoll.testing import launch, print_line

E, K, DIM, HIDDEN, TOKENS, STEPS, LR = 8, 2, 16, 32, 12, 3, 0.05

# torchtitan's router asks for float32 autocast, which CPU autocast does not do: torch
# warns and runs the router without autocast, in float32 all the same, which is what
# torchtitan wants there. Harmless on the CPU (on a GPU the autocast is real), so not shown.
warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported", UserWarning)


def layer(num_local_experts: int, dispatcher: LocalTokenDispatcher.Config) -> MoE:
    """torchtitan's MoE layer holding `num_local_experts` experts, with every weight seeded the same."""
    moe = MoE.Config(
        num_experts=E,
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=DIM, out_features=E), top_k=K
        ),
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=num_local_experts),
            token_dispatcher=dispatcher,
        ),
        load_balance_coeff=None,
    ).build()
    return moe


def init(moe: MoE, experts: slice) -> None:
    """The global weights (the same on every rank), this layer's experts' slice of them."""
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(E, DIM, generator=g) * 0.3
    w1, w3 = (torch.randn(E, HIDDEN, DIM, generator=g) * 0.2 for _ in range(2))
    w2 = torch.randn(E, DIM, HIDDEN, generator=g) * 0.2
    inner = moe.routed_experts.inner_experts
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate)
        inner.w1_EFD.copy_(w1[experts])
        inner.w2_EDF.copy_(w2[experts])
        inner.w3_EFD.copy_(w3[experts])


def tokens(step: int, rank: int) -> Tensor:
    return torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(out: Tensor) -> Tensor:
    return (out.tanh() ** 2).sum()


def sgd(moe: MoE) -> None:
    with torch.no_grad():
        for p in moe.parameters():
            p -= LR * p.grad
            p.grad = None


def reference(world: int) -> tuple[list[float], MoE]:
    """torchtitan's layer in one process: every expert, every rank's tokens (each rank's own routing)."""
    moe = layer(E, LocalTokenDispatcher.Config(num_experts=E, top_k=K))
    init(moe, slice(0, E))
    losses = []
    for step in range(STEPS):
        total = sum(loss_of(moe(tokens(step, rank))) for rank in range(world))
        total.backward()  # type: ignore[union-attr]
        sgd(moe)
        losses.append(float(total.detach()))
    return losses, moe


def run(rank: int, world: int) -> dict[str, object]:
    """One rank's part: train STEPS steps, then check losses and weights against :func:`reference`."""
    e_local = E // world
    mine = slice(rank * e_local, (rank + 1) * e_local)
    dispatcher = FuncollTokenDispatcher.Config(num_experts=E, top_k=K, mode="dropless")
    moe = layer(e_local, dispatcher)
    init(moe, mine)
    moe.routed_experts.token_dispatcher.wire_meshes(
        ep_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    )
    losses = []
    for step in range(STEPS):
        loss = loss_of(moe(tokens(step, rank)))
        loss.backward()
        gate = moe.router.gate.weight
        gate.grad = funcoll.all_reduce(gate.grad)  # the replicated gate: every rank's tokens' gradient
        sgd(moe)
        losses.append(float(funcoll.all_reduce(loss.detach())))  # a CPU tensor: no device sync
    want_losses, want = reference(world)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=2e-2, atol=1e-3)
    got_experts, want_experts = moe.routed_experts.inner_experts, want.routed_experts.inner_experts
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        torch.testing.assert_close(
            getattr(got_experts, name), getattr(want_experts, name)[mine], rtol=2e-2, atol=1e-2
        )
    torch.testing.assert_close(moe.router.gate.weight, want.router.gate.weight, rtol=2e-2, atol=1e-2)
    overflows = moe.routed_experts.token_dispatcher.overflows  # dispatches that ran exact mode
    if rank == 0:
        print_line(
            f"losses {[round(v, 4) for v in losses]} match one process; dropless overflows: {overflows}"
        )
    return {"losses": losses, "overflows": overflows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks to start (ignored under torchrun)")
    return launch(run, parser.parse_args().world)


if __name__ == "__main__":
    sys.exit(main())
