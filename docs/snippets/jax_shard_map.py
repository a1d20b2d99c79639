"""docs/jax.md's shard_map example: tests/test_lax.py runs `step` on 4 ranks against a single-process MLP."""

from __future__ import annotations

# --8<-- [start:mlp]
import torch
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

import funcoll
from funcoll import P, lax
from funcoll.testing import run_ranks

B, D, H = 4, 6, 8  # batch, model dim, hidden dim


def mlp(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:  # local: (B/dp, D), (D, H/tp), (H/tp, D)
    return lax.psum(torch.tanh(x @ w1) @ w2, "tp")


def global_inputs() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)  # the same global x, w1, w2 on every rank
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((B, D), (D, H), (H, D))]


def step(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, w1, w2 = (t.requires_grad_() for t in global_inputs())
    f = funcoll.shard_map(
        mlp, mesh, in_specs=(P("dp", None), P(None, "tp"), P("tp", None)), out_specs=P("dp", None)
    )
    y = f(x, w1, w2)  # a DTensor of global shape (B, D): Shard(0) over "dp", Replicate() over "tp"
    y.full_tensor().square().sum().backward()  # the gradients of the global function
    return {
        "y": y.full_tensor().detach(),
        "placements": str(y.placements),
        "grads": [x.grad, w1.grad, w2.grad],
    }


if __name__ == "__main__":
    out = run_ranks(step, world=4)[0]  # 4 gloo processes on this machine; rank 0's result
    print(out["placements"], out["y"].shape)  # (Shard(dim=0), Replicate()) torch.Size([4, 6])
# --8<-- [end:mlp]
