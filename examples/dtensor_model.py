"""A DTensor model with funcoll at its edges: a tensor-parallel MLP block, trained one step on ragged tokens.

Each rank holds a different number of tokens of one sequence (5, 2, 4, 0, ...
by rank). The block is ``y = x + W2 gelu(W1 x + b1)``, written as DTensor code on
a 1-D mesh with Megatron's sequence parallelism: the MLP's weights are DTensors
(``parallelize_module``: ``ColwiseParallel`` shards ``W1`` and ``b1`` by output
row, ``RowwiseParallel`` shards ``W2`` by input column), and funcoll moves the
activations at the MLP's edges, as DTensor ops:

- ``funcoll.from_ragged``: the ranks' tokens -> a ``Shard(0)`` DTensor in
  DTensor's own layout (here 7 tokens as 4 and 3), moving only the rows that
  change owner;
- ``funcoll.all_gather``: ``Shard(0) -> Replicate()``, the whole sequence for
  the column-parallel layer (backward: this rank's piece of the gradient);
- ``funcoll.reduce_scatter``: the row-parallel layer's ``Partial()`` sum ->
  ``Shard(0)``, back to the sequence shard (backward: all_gather);
- ``funcoll.to_ragged``: every rank its own tokens' outputs back.

The loss is the mean squared error over every token; the backward gives every
weight its DTensor gradient and each rank its tokens' gradient, and one SGD step
updates the sharded weights. The program checks the loss, the outputs, the
gradients (weights and tokens) and the updated weights against the same block
trained on the whole sequence in one process (float64), and exits non-zero on a
mismatch.

Run it on ranks it starts itself (gloo, CPU), as the test suite does
(``tests/test_examples_dir.py`` calls :func:`run` through ``funcoll.testing.run_ranks``)::

    python examples/dtensor_model.py --world 2

or under a launcher, one process per rank::

    torchrun --nproc-per-node 2 examples/dtensor_model.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import funcoll
from funcoll.testing import launch, print_ranks

# HIDDEN divides by 2, 3 and 4: on 3 ranks a hidden dim of 10 (4, 3, 3) fails in torch 2.13 DTensor's
# sharding propagation of the MLP's matmul. The tokens are ragged; the weights are sharded evenly.
D, HIDDEN, LR = 6, 12, 0.1


def lengths(world: int) -> list[int]:
    """How many tokens each rank holds: 5, 2, 4, 0, 5, 2, ..."""
    return [(5, 2, 4, 0)[r % 4] for r in range(world)]


def data(world: int) -> tuple[Tensor, Tensor]:
    """The whole sequence's tokens and targets, ``(N, D)`` each, the same in every process."""
    gen = torch.Generator().manual_seed(0)
    n = sum(lengths(world))
    tokens, targets = torch.randn(2, n, D, generator=gen, dtype=torch.float64)
    return tokens, targets


def mlp() -> nn.Sequential:
    """The MLP with its initial weights, the same in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D, bias=False)).double()


def train_step(model: nn.Module, x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """One SGD step of the single-process block on the whole sequence: (loss, outputs), before the update."""
    y = x + model(x)
    loss = ((y - t) ** 2).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), y.detach()


def run(rank: int, world: int) -> float:
    """One rank's part: the DTensor block on this rank's tokens, checked. Returns the loss."""
    mesh = init_device_mesh("cpu", (world,))
    sizes = lengths(world)
    start, n = sum(sizes[:rank]), sizes[rank]
    tokens, targets = data(world)
    mine = tokens[start : start + n].clone().requires_grad_()

    # The weights as DTensors: W1, b1 sharded by output row, W2 by input column; W2's output stays a
    # Partial() sum for funcoll to reduce-scatter to the sequence shard.
    model = parallelize_module(mlp(), mesh, {
        "0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    })  # fmt: skip
    x, sizes = funcoll.from_ragged(mine, group=mesh)  # Shard(0): (N, D), DTensor's chunks
    t, _ = funcoll.from_ragged(targets[start : start + n], group=mesh, sizes=sizes)  # no second exchange
    full = funcoll.all_gather(x)  # Shard(0) -> Replicate(): the sequence for the column-parallel layer
    y = x + funcoll.reduce_scatter(model(full))  # Partial() -> Shard(0)
    loss = ((y - t) ** 2).mean()  # a DTensor scalar: the mean over every token
    loss.backward()
    out = funcoll.to_ragged(y, sizes).detach()  # this rank's tokens' outputs, (n, D)
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()

    # The single-process reference: the same block on the whole sequence.
    ref_x = tokens.clone().requires_grad_()
    ref = mlp()
    ref_loss, ref_y = train_step(ref, ref_x, targets)
    value = loss.detach().full_tensor()
    close = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(value, ref_loss, **close)
    torch.testing.assert_close(out, ref_y[start : start + n], **close)
    assert ref_x.grad is not None and mine.grad is not None
    torch.testing.assert_close(mine.grad, ref_x.grad[start : start + n], **close)
    for k, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[k], p.grad, **close)
        torch.testing.assert_close(model.get_parameter(k).full_tensor(), p.detach(), **close)
    w1, w2 = model.get_parameter("0.weight"), model.get_parameter("2.weight")
    print_ranks(f"rank {rank}: {n} tokens, Shard(0) rows {x.to_local().shape[0]} of {x.shape[0]}; "
          f"W1 {tuple(w1.to_local().shape)} of {tuple(w1.shape)}, W2 {tuple(w2.to_local().shape)} of "
          f"{tuple(w2.shape)}; loss {float(value):.6f}, as in one process, and so is the step")  # fmt: skip
    return float(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks to start (ignored under torchrun)")
    args = parser.parse_args()
    return launch(run, args.world, timeout=120)


if __name__ == "__main__":
    sys.exit(main())
