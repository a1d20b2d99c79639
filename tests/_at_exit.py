"""A short funcoll program that tests/test_faults.py runs under torchrun: nothing is left unwaited at exit.

Each rank calls several public ops, eager and compiled, forward and backward, and
meets two of funcoll's own errors raised in the middle of an op (ranks that disagree
on a gather's trailing shape, after the size exchange; a static op's checked count
error), then exits as a program does. A rank that exits normally (unlike the
``os._exit`` of a forked ``run_ranks`` rank) runs c10d's exit check, which prints
"unwaited collective calls" to stderr for any collective issued and never waited.

Run: ``torchrun --standalone --nproc-per-node 2 tests/_at_exit.py``
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

import funcoll
from funcoll import lax, moe
from funcoll.testing import in_flight, launch


def _errors(rank: int, world: int) -> list[str]:
    """funcoll's errors raised mid-op, with checks on: every rank raises the same."""
    seen = []
    with funcoll.set_checks(True):
        try:
            funcoll.gather(torch.ones(1, 2 + rank))  # the trailing shapes differ
        except ValueError as e:
            seen.append(str(e).split(":")[0])
        try:
            # a length above the bound, on the device: read in the counts' exchange
            funcoll.gather_padded(torch.zeros(4, 3), torch.tensor(5 if rank == 1 else 1))
        except ValueError as e:
            seen.append(str(e).split(":")[0])
    return seen


def run(rank: int, world: int) -> None:
    x = torch.arange(3.0 * (rank + 1), dtype=torch.float64).view(rank + 1, 3).requires_grad_()
    y = funcoll.gather(x)
    y = y + funcoll.all_reduce(y)
    (y.sum() + funcoll.all_gather(x.sum(0)).sum()).backward()
    funcoll.reduce_scatter(torch.ones(3, 2), sizes=[2] + [1] * (world - 1))
    funcoll.all_to_all_v(torch.ones(world, 2), [1] * world)
    funcoll.gather_padded(torch.ones(4, 2), rank + 1)
    tokens = torch.randn(rank + 2, 4, dtype=torch.float64, requires_grad=True)
    for mode in moe.MODES:  # dropless with a capacity its routing overflows: its exact path
        idx = torch.arange(2 * (rank + 2)).view(rank + 2, 2) % (2 * world)
        recv, handle = moe.dispatch(
            tokens, idx, 2 * world, mode=mode, capacity={"static": 4, "dropless": 2}.get(mode)
        )
        moe.combine(recv * 2, handle, torch.ones(rank + 2, 2, dtype=torch.float64)).sum().backward()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("i",))
    with lax.mesh(mesh):
        lax.psum(lax.all_gather(torch.ones(2), "i"), "i")
    piece, sizes = funcoll.from_ragged(torch.ones(rank + 1, 2), 0, group=mesh)
    funcoll.to_ragged(piece, sizes)
    step = torch.compile(lambda t: funcoll.gather(t * 2).sum(), fullgraph=True, backend="aot_eager")
    step(funcoll.mark_ragged(x.detach().clone().requires_grad_(), 0)).backward()
    errors = _errors(rank, world)
    print(f"rank {rank}: done, errors {errors}, {in_flight()} in flight", flush=True)


if __name__ == "__main__":
    sys.exit(launch(run, 2))
