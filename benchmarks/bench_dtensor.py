"""DTensor resharding: funcoll against what DTensor code does today, bytes and time side by side.

Run: ``python benchmarks/bench_dtensor.py [--worlds 2 4] [--mb 32] [--iters 7]``

For each world size it starts that many gloo CPU ranks and, in one process group,
times (median of `iters` barrier-fenced runs after a warm-up) two resharding jobs:

1. ``Shard(1) -> Shard(2)`` of a ``(B, S, H, D)`` float32 DTensor (Ulysses' sequence
   to heads), `mb` MB in all, S and H uneven (``S = 7k``, ``H = 5``):

   - ``redistribute`` (baseline): ``x.redistribute(mesh, [Shard(2)])``. On gloo
     DTensor has no all_to_all and all-gathers the whole tensor, then keeps a chunk.
   - ``funcoll.all_to_all``: ``funcoll.all_to_all(x, None, 2, 1)``, one
     ``all_to_all_single``.

2. Ragged pieces into a ``Shard(0)`` DTensor in DTensor's layout: rank r holds a
   piece of ``(r + 1) * n`` rows of 1024 float32 (a skew that moves rows between
   ranks), `mb` MB in all:

   - ``gather+chunk`` (baseline): what users write without funcoll: all_gather the
     lengths, pad every piece to the longest, ``dist.all_gather_into_tensor``, cut the
     padding, keep this rank's ``torch.chunk`` and ``DTensor.from_local`` it.
   - ``funcoll.from_ragged``: one small all_gather of the lengths, then one
     ``all_to_all_single`` of the rows that change owner.

Bytes: what each rank sends, summed over the ranks (the payload of every collective:
an all_gather of ``b`` bytes per rank sends ``b * (world - 1)`` from each rank on a
ring; an all_to_all sends what leaves the rank). Times are ratios to the baseline,
measured in the same process group; tests never assert on them.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from _timing import add_link_argument, fenced_median, on_link  # benchmarks/, beside this script

import funcoll
from funcoll._base._dtensor import chunk_sizes, moves
from funcoll.testing import run_ranks

ROW = 1024


def _gather_then_chunk(piece: torch.Tensor, mesh: object, world: int) -> object:
    """The recipe without funcoll: gather everything (padded), keep this rank's chunk."""
    from torch.distributed.tensor import DTensor, Shard

    n = torch.tensor([piece.shape[0]])
    got = torch.empty(world, dtype=n.dtype)
    dist.all_gather_into_tensor(got, n)
    sizes = got.tolist()  # a host read of a CPU tensor: the recipe needs the lengths
    longest = max(sizes)
    padded = torch.zeros((longest, *piece.shape[1:]), dtype=piece.dtype)
    padded[: piece.shape[0]] = piece
    everything = torch.empty((world * longest, *piece.shape[1:]), dtype=piece.dtype)
    dist.all_gather_into_tensor(everything, padded)
    rows = torch.cat([everything[i * longest : i * longest + s] for i, s in enumerate(sizes)])
    mine = (
        torch.chunk(rows, world)[dist.get_rank()]
        if dist.get_rank() < len(torch.chunk(rows, world))
        else rows[:0]
    )
    return DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=rows.shape, stride=rows.stride())


def _body(rank: int, world: int, mb: int, iters: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore", category=FutureWarning)  # 2.13 renames all_gather_into_tensor
    mesh = init_device_mesh(torch.get_default_device().type, (world,))
    out: dict[str, object] = {}

    # 1. Shard(1) -> Shard(2)
    heads, dim = 5, 64
    seq = max(7, (mb << 20) // (4 * heads * dim) // 7 * 7)
    full = torch.randn(1, seq, heads, dim)
    x = distribute_tensor(full, mesh, [Shard(1)])
    assert torch.equal(
        funcoll.all_to_all(x, None, 2, 1).to_local(), x.redistribute(mesh, [Shard(2)]).to_local()
    )
    base = fenced_median(lambda: x.redistribute(mesh, [Shard(2)]), iters)
    ours = fenced_median(lambda: funcoll.all_to_all(x, None, 2, 1), iters)
    elem = full.element_size() * heads * dim  # bytes per sequence position
    s_sizes, h_sizes = chunk_sizes(seq, world), chunk_sizes(heads, world)
    # gloo's redistribute: an all_gather of every rank's Shard(1) piece (padded to the longest)
    red_bytes = world * (world - 1) * max(s_sizes) * elem
    a2a_bytes = sum(s_sizes[r] * (heads - h_sizes[r]) * dim * full.element_size() for r in range(world))
    out["a2a"] = {"base_s": base, "ratio": ours / base, "base_bytes": red_bytes, "bytes": a2a_bytes}

    # 2. ragged pieces -> Shard(0)
    unit = max(1, (mb << 20) // (ROW * 4) // (world * (world + 1) // 2))
    lengths = [(r + 1) * unit for r in range(world)]
    piece = torch.randn(lengths[rank], ROW)
    got, _ = funcoll.from_ragged(piece, group=mesh)
    assert torch.equal(got.to_local(), _gather_then_chunk(piece, mesh, world).to_local())
    base = fenced_median(lambda: _gather_then_chunk(piece, mesh, world), iters)
    ours = fenced_median(lambda: funcoll.from_ragged(piece, group=mesh), iters)
    row_bytes = ROW * 4
    gather_bytes = world * (world - 1) * max(lengths) * row_bytes
    moved = sum(sum(s for j, s in enumerate(moves(lengths, chunk_sizes(sum(lengths), world), r)[0]) if j != r)
                for r in range(world))  # fmt: skip
    out["from_ragged"] = {
        "base_s": base,
        "ratio": ours / base,
        "base_bytes": gather_bytes,
        "bytes": moved * row_bytes,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--iters", type=int, default=7)
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    print(
        "| world | job | baseline | baseline ms | baseline MB sent | funcoll MB sent | bytes ratio | time ratio |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for world in args.worlds:
        res = run_ranks(_body, world, args.mb, args.iters, timeout=900)[0]
        for job, base in (("a2a", "redistribute"), ("from_ragged", "gather+chunk")):
            r = res[job]
            print(
                f"| {world} | {job} | {base} | {1e3 * r['base_s']:.1f} | {r['base_bytes'] / 2**20:.1f} | "
                f"{r['bytes'] / 2**20:.1f} | {r['bytes'] / r['base_bytes']:.2f} | {r['ratio']:.2f} |"
            )


if __name__ == "__main__":
    main()
