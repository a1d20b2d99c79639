"""Ragged all-gather speed, as ratios to funcol's even all-gather of the same bytes.

Run: ``python benchmarks/bench_ragged_gather.py [--worlds 2 4] [--mb 64] [--iters 7]``

For each world size it starts that many gloo CPU ranks and, in one process group,
times side by side (median of `iters` barrier-fenced runs after a warm-up):

- ``baseline``: ``torch.ops._c10d_functional.all_gather_into_tensor`` + ``wait_tensor``
  of an even shard holding the same total bytes (it allocates its output, like every
  functional op). Every other row is a ratio to this one.
- ``funcoll.all_gather`` of the even shard: funcoll's even op, no size exchange.
- ``funcoll.gather`` with strategy ``auto`` (the default), ``pad`` and ``a2a``; and
  ``auto`` and ``pad`` with ``sizes=`` (every rank's length passed in, as a caller
  that already holds them does): no size exchange.
- ``funcoll.gather_padded``: the static-shape gather, each rank's input already padded
  to the bound ``max(sizes)`` (as static-shape code holds it), its length a tensor; its
  result has ``world * max(sizes)`` rows, zeros after the data.
- ``pad+list (seed 000)``: the widely copied recipe of the ragged ``gather`` helper:
  all_gather the sizes, ``.item()`` each, pad to the max, ``dist.all_gather`` into a
  list, cut the padding and ``torch.cat``.
- ``pad+list (seed 001)``: the ``all_gather_nd`` recipe: the same with the sizes as a
  shape tensor, padding by ``torch.cat`` and a list result.
- ``all_gather_object``: pickling the tensors.
- ``dist.all_gather_into_tensor (prealloc)``: the in-place collective into a buffer
  allocated once outside the timed region, for context: it pays no allocation.

Layouts: ``equal`` (every rank the same rows) and ``skew16`` (rank 0 holds 16x the
rows of each other rank), float32 rows of 1024 elements, `mb` MB gathered in all.

On CPU, outputs above glibc's mmap threshold are fresh pages at every allocation,
so every method that allocates its output pays first-touch page faults; the
preallocated row shows what that costs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
from _timing import add_link_argument, fenced_median, on_link  # benchmarks/, beside this script

import funcoll
from funcoll.testing import run_ranks

ROW = 1024


def _pad_list_gather_seed000(x: torch.Tensor, world: int) -> torch.Tensor:
    n = torch.tensor([x.shape[0]], dtype=torch.long)
    got = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(got, n)
    sizes = [s.item() for s in got]  # host sync, as the recipe does
    longest = max(sizes)
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype)
    padded[: x.shape[0]] = x
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=False)])


def _pad_list_gather_seed001(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    shape = torch.tensor(x.size())
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    longest = max(s[0] for s in shapes)
    missing = longest.item() - shape[0].item()  # host sync, as the recipe does
    if missing:
        x = torch.cat((x, torch.zeros((missing, *x.shape[1:]), dtype=x.dtype)))
    parts = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return [p[: s[0]] for p, s in zip(parts, shapes, strict=False)]


def _gather_object(x: torch.Tensor, world: int) -> list[object]:
    out: list[object] = [None] * world
    dist.all_gather_object(out, x)
    return out


def _layouts(world: int, total_rows: int) -> dict[str, list[int]]:
    unit = total_rows // (16 + world - 1)
    return {"equal": [total_rows // world] * world, "skew16": [16 * unit] + [unit] * (world - 1)}


def _methods(
    x: torch.Tensor, even: torch.Tensor, world: int, name: str, padded: torch.Tensor, sizes: list[int]
) -> dict[str, Callable[[], object]]:
    ops = torch.ops._c10d_functional
    length = torch.tensor(x.shape[0])
    prealloc = torch.empty(world * even.shape[0], ROW)
    return {
        "baseline": lambda: ops.wait_tensor(ops.all_gather_into_tensor(even, world, name)),
        "funcoll.all_gather (even shard, no size exchange)": lambda: funcoll.all_gather(even),
        "funcoll.gather auto": lambda: funcoll.gather(x),
        "funcoll.gather pad": lambda: funcoll.gather(x, strategy="pad"),
        "funcoll.gather a2a": lambda: funcoll.gather(x, strategy="a2a"),
        "funcoll.gather auto, sizes= (lengths known)": lambda: funcoll.gather(x, sizes=sizes),
        "funcoll.gather pad, sizes= (lengths known)": lambda: funcoll.gather(x, strategy="pad", sizes=sizes),
        "funcoll.gather_padded (static shapes, bound max)": lambda: funcoll.gather_padded(padded, length),
        "pad+list (seed 000)": lambda: _pad_list_gather_seed000(x, world),
        "pad+list (seed 001)": lambda: _pad_list_gather_seed001(x, world),
        "all_gather_object": lambda: _gather_object(x, world),
        "dist.all_gather_into_tensor (prealloc)": lambda: dist.all_gather_into_tensor(prealloc, even),
    }


def _bench(rank: int, world: int, mb: float, iters: int) -> dict[str, dict[str, float]]:
    name = dist.group.WORLD.group_name
    total_rows = max(world * (16 + world), int(mb * 1024 * 1024) // (4 * ROW))
    out: dict[str, dict[str, float]] = {}
    for layout, sizes in _layouts(world, total_rows).items():
        x = torch.randn(sizes[rank], ROW)
        even = torch.randn(sum(sizes) // world, ROW)
        # gather_padded's input as static-shape code holds it: padded to the bound already.
        padded = torch.cat([x, x.new_zeros(max(sizes) - sizes[rank], ROW)])
        methods = _methods(x, even, world, name, padded, sizes)
        # Interleave the methods over the rounds so drift hits all of them alike.
        rounds: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(3):
            for m, fn in methods.items():
                rounds[m].append(fenced_median(fn, max(1, iters // 3)))
        out[layout] = {m: min(ts) for m, ts in rounds.items()}
        out[layout]["_sizes"] = sizes  # type: ignore[assignment]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=float, default=64, help="MB gathered in all (0.125: 64 KiB a rank on 2)")
    parser.add_argument("--iters", type=int, default=9)
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    print(f"torch {torch.__version__}, gloo on CPU, {args.mb} MB gathered, float32 rows of {ROW}")
    for world in args.worlds:
        res = run_ranks(_bench, world, args.mb, args.iters, timeout=1800)[0]
        for layout, row in res.items():
            sizes = row.pop("_sizes")
            base = row["baseline"]
            print(f"\nworld {world}, {layout} (rows per rank {sizes}); baseline {base * 1e3:.1f} ms")
            print("| method | ms | x baseline |\n|---|---:|---:|")
            for m, t in row.items():
                print(f"| {m} | {t * 1e3:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
