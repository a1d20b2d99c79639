"""docs/jax.md's typed-mode example: tests/test_lax.py runs `step` on 2 ranks against one process's SGD step."""

from __future__ import annotations

# --8<-- [start:step]
import torch
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

import funcoll
from funcoll import P, lax
from funcoll.testing import run_ranks

# The JAX step it ports, line for line:
#
#   def sgd_step(w, x):                      # w: P() (replicated), x: P("dp") (the batch)
#       loss = lambda w: lax.pmean(jnp.sum((x @ w) ** 2), "dp")
#       return w - 0.1 * jax.grad(loss)(w)   # needs check_vma=True: the gradient is psummed
#
#   jax.shard_map(sgd_step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())


def sgd_step(w: Tensor, x: Tensor) -> Tensor:
    w = w.detach().requires_grad_()  # what jax.grad differentiates
    loss = lax.pmean(((x @ w) ** 2).sum(), "dp")
    (grad,) = torch.autograd.grad(loss, w)
    return w - 0.1 * grad


def global_inputs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)  # the same global w and x on every rank
    return torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(
        4, 3, generator=g, dtype=torch.float64
    )


def step(rank: int, world: int) -> dict[str, Tensor]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    w, x = global_inputs()
    new = {}
    for check_vma in (True, False):
        f = funcoll.shard_map(sgd_step, mesh, (P(), P("dp")), P(), check_vma=check_vma)
        new[f"check_vma={check_vma}"] = f(w, x).to_local()  # this rank's copy of the "replicated" w
    return new


if __name__ == "__main__":
    for rank, new in enumerate(run_ranks(step, world=2)):  # 2 gloo processes on this machine
        for mode, w in new.items():
            print(f"rank {rank}, {mode}: w[0] = {w[0].tolist()}")
# --8<-- [end:step]
