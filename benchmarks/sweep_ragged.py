"""Every ragged op against the even collective of the same bytes, over payloads, worlds and layouts.

Run: ``python benchmarks/sweep_ragged.py [--worlds 2 4] [--kib 4 64 1024 16384 65536]
[--layouts equal skew16] [--iters 9] [--rounds 5] [--json sweep.json] [--reuse-memory]``

For each world size it starts that many gloo CPU ranks; in one process group, for
each payload (KiB a rank holds on average, rows of 1024 float32) and layout
(``equal``: every rank the same rows; ``skew16``: rank 0 holds 16 times the rows of
each other rank) it times every method `rounds` times, interleaved so that drift
hits all of them alike, each time the median of `iters` barrier-fenced calls
(fewer above 1 MiB: half of them to 16 MiB, a third past it, at least 3).
Each method's ratio is to its baseline, measured in the same round: funcol's
``all_gather_into_tensor`` of an even shard of the same total bytes for the
gathers, ``reduce_scatter_tensor`` of the same total for the ragged
reduce_scatter, ``all_to_all_single`` of the same rows for ``all_to_all_v`` and
``all_to_all_padded`` (whose capacity fits the largest send, so a skew pads it).
The table shows the median ratio over the rounds and its range; ``--json`` writes
every record, with each method's median time (``seconds``), its baseline's kind
(``ag``, ``rs``, ``a2a``: ``BASELINES``) and that baseline's median time.
``--reuse-memory``: each rank keeps its freed host memory for reuse, as a GPU's
caching allocator does (``_timing.reuse_freed_memory``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from _timing import (  # benchmarks/, beside this script
    add_link_argument,
    fenced_median,
    on_link,
    reusing_memory,
)

import funcoll
from funcoll.testing import run_ranks

ROW = 1024  # float32 elements a row: 4 KiB


def _layout(name: str, world: int, rows: int) -> list[int]:
    """Rows per rank: `rows` on average."""
    if name == "equal":
        return [rows] * world
    unit = max(1, world * rows // (16 + world - 1))
    return [16 * unit] + [unit] * (world - 1)


def _methods(sizes: list[int], rank: int, world: int) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (baseline kind, call)."""
    x = torch.randn(sizes[rank], ROW)
    full = torch.randn(sum(sizes), ROW)  # the ragged reduce_scatter's input
    send = [sizes[rank] // world + (1 if j < sizes[rank] % world else 0) for j in range(world)]
    recv = [sizes[i] // world + (1 if rank < sizes[i] % world else 0) for i in range(world)]
    padded = torch.cat([x, x.new_zeros(max(sizes) - sizes[rank], ROW)])
    length = torch.tensor(sizes[rank])
    cap = max(-(-n // world) for n in sizes)  # all_to_all_padded: the capacity every rank's sends fit
    blocks = torch.randn(world * cap, ROW)
    send_t = torch.tensor(send)
    return {
        "gather auto": ("ag", lambda: funcoll.gather(x)),
        "gather pad": ("ag", lambda: funcoll.gather(x, strategy="pad")),
        "gather shift": ("ag", lambda: funcoll.gather(x, strategy="shift")),
        "gather auto, sizes=": ("ag", lambda: funcoll.gather(x, sizes=sizes)),
        "gather pad, sizes=": ("ag", lambda: funcoll.gather(x, strategy="pad", sizes=sizes)),
        "all_gather_list": ("ag", lambda: funcoll.all_gather_list(x)),
        "all_gather_ragged": ("ag", lambda: funcoll.all_gather_ragged(x)),
        "gather_forward_split_backward": ("ag", lambda: funcoll.gather_forward_split_backward(x, None, 0)),
        "gather_padded": ("ag", lambda: funcoll.gather_padded(padded, length)),
        "all_to_all_padded": ("a2a", lambda: funcoll.all_to_all_padded(blocks, send_t)),
        "reduce_scatter sizes=": ("rs", lambda: funcoll.reduce_scatter(full, 0, sizes=sizes)),
        "all_to_all_v exchanged": ("a2a", lambda: funcoll.all_to_all_v(x, send)),
        "all_to_all_v given": ("a2a", lambda: funcoll.all_to_all_v(x, send, recv)),
    }


# The baselines' kinds, as their funcol ops (``torch.ops._c10d_functional``, each with ``wait_tensor``).
BASELINES = {"ag": "all_gather_into_tensor", "rs": "reduce_scatter_tensor", "a2a": "all_to_all_single"}


def _baselines(sizes: list[int], world: int) -> dict[str, Callable[[], object]]:
    ops = torch.ops._c10d_functional
    name = torch.distributed.group.WORLD.group_name
    per = -(-sum(sizes) // world)  # rows a rank holds in the even layout
    even = torch.randn(per, ROW)
    total = torch.randn(world * per, ROW)
    block = -(-per // world)  # all_to_all: the same rows to every rank
    blocks = torch.randn(world * block, ROW)
    return {
        "ag": lambda: ops.wait_tensor(ops.all_gather_into_tensor(even, world, name)),
        "rs": lambda: ops.wait_tensor(ops.reduce_scatter_tensor(total, "sum", world, name)),
        "a2a": lambda: ops.wait_tensor(ops.all_to_all_single(blocks, [block] * world, [block] * world, name)),
    }


def _sweep(rank: int, world: int, kibs: list[int], layouts: list[str], iters: int, rounds: int) -> list[dict]:
    records = []
    for kib in kibs:
        rows = max(1, kib // 4)
        for layout in layouts:
            sizes = _layout(layout, world, rows)
            methods, bases = _methods(sizes, rank, world), _baselines(sizes, world)
            ratios: dict[str, list[float]] = {m: [] for m in methods}
            times: dict[str, list[float]] = {m: [] for m in methods}
            base_s: dict[str, list[float]] = {k: [] for k in bases}
            # large payloads: fewer calls
            n = iters if kib <= 1024 else max(3, iters // (2 if kib <= 16384 else 3))
            for _ in range(rounds):
                base = {k: fenced_median(fn, n) for k, fn in bases.items()}
                for k, t in base.items():
                    base_s[k].append(t)
                for m, (kind, fn) in methods.items():
                    times[m].append(fenced_median(fn, n))
                    ratios[m].append(times[m][-1] / base[kind])
            for m, rs in ratios.items():
                kind = methods[m][0]
                records.append({
                    "world": world, "kib_per_rank": kib, "layout": layout, "sizes": sizes, "method": m,
                    "ratio": statistics.median(rs), "ratio_min": min(rs), "ratio_max": max(rs),
                    "seconds": statistics.median(times[m]), "baseline": kind,
                    "baseline_ms": 1e3 * statistics.median(base_s[kind]),
                })  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kib", type=int, nargs="+", default=[4, 64, 1024, 16384, 65536])
    parser.add_argument("--layouts", nargs="+", default=["equal", "skew16"], choices=["equal", "skew16"])
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="", help="write every record to this file")
    parser.add_argument(
        "--reuse-memory", action="store_true", help="each rank keeps its freed host memory for reuse"
    )
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    records = []
    for world in args.worlds:
        records += run_ranks(
            reusing_memory(_sweep, args.reuse_memory),
            world,
            args.kib,
            args.layouts,
            args.iters,
            args.rounds,
            timeout=7200,
        )[0]
    print(f"torch {torch.__version__}, gloo on CPU; median ratio over {args.rounds} rounds [min-max]")
    methods = list(dict.fromkeys(r["method"] for r in records))
    print("| world | KiB/rank | layout | " + " | ".join(methods) + " |")
    print("|---:|---:|---|" + "---:|" * len(methods))
    for key in dict.fromkeys((r["world"], r["kib_per_rank"], r["layout"]) for r in records):
        row = {r["method"]: r for r in records if (r["world"], r["kib_per_rank"], r["layout"]) == key}
        cells = [
            f"{row[m]['ratio']:.2f} [{row[m]['ratio_min']:.2f}-{row[m]['ratio_max']:.2f}]" for m in methods
        ]
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "records": records}, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")


if __name__ == "__main__":
    main()
