"""What a funcoll call costs the calling thread: CPU microseconds per call, beside funcol's even op.

Run: ``python benchmarks/bench_call_cost.py [--worlds 2] [--kib 64 1024] [--calls 200] [--rounds 7]
[--json out.json] [--link RATE]``

Wall time of a collective on gloo swings with the backend's threads and the
kernel's scheduling (on loopback a 1 MiB all_gather's ratio to funcol's moves by
±30% between runs); the calling thread's CPU time does not: it is the Python of
the call (funcoll's entry, checks, plans), the dispatch of its ops and the copies
made on that thread, and it leaves out the wait for the data, which gloo's threads
move. So this is the figure a per-call overhead shows in, and what a regression
of the fixed cost is bisected with (``ab_commits.py --bench call_cost``).

For each payload (KiB a rank, rows of 1024 float32) every method runs `calls`
calls, `rounds` times interleaved; a method's figures are the medians over rounds
of its calling thread's CPU per call (``time.thread_time``) and its wall time per
call, both also over funcol's ``all_gather_into_tensor`` + ``wait_tensor`` of the
same bytes measured in the same round. Every call's result is read (``.sum()`` of
one element) so that a deferred wait happens inside the timed call. Eager calls
at the default checks (``FUNCOLL_CHECKS`` unset): calls 1, 2, 4, ... of an op
exchange a header, the others carry a fingerprint; ``--unchecked`` times
``set_checks(False)``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _timing import add_link_argument, dump_records, on_link

import funcoll
from funcoll.testing import run_ranks

ROW = 1024  # float32 elements a row: 4 KiB


def _methods(rank: int, world: int, rows: int) -> dict[str, Callable[[], torch.Tensor]]:
    ops = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    x = torch.randn(rows, ROW)
    sizes = [rows] * world
    return {
        "funcol all_gather_into_tensor": lambda: ops.wait_tensor(ops.all_gather_into_tensor(x, world, name)),
        "funcoll.all_gather": lambda: funcoll.all_gather(x, 0),
        "funcoll.gather, sizes=": lambda: funcoll.gather(x, sizes=sizes),
        "funcoll.gather (exchanged)": lambda: funcoll.gather(x),
        "funcoll.all_to_all": lambda: funcoll.all_to_all(x, None, 0, 0),
    }


def _timed(fn: Callable[[], torch.Tensor], calls: int) -> tuple[float, float]:
    """CPU seconds of this thread and wall seconds, per call, over `calls` calls after a barrier."""
    dist.barrier()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        fn().reshape(-1)[:1].sum()  # read: a deferred wait happens in the call
    return (time.thread_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def _bench(rank: int, world: int, kibs: list[int], calls: int, rounds: int, unchecked: bool) -> list[dict]:
    if unchecked:
        funcoll.set_checks(False)
    records = []
    for kib in kibs:
        methods = _methods(rank, world, max(1, kib // 4))
        for fn in methods.values():  # warm: first calls, first checks
            for _ in range(5):
                fn()
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        wall: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(rounds):
            for m, fn in methods.items():
                c, w = _timed(fn, calls)
                cpu[m].append(c)
                wall[m].append(w)
        base = "funcol all_gather_into_tensor"
        for m in methods:
            records.append({
                "world": world, "kib_per_rank": kib, "layout": "equal", "method": m, "rank": rank,
                "cpu_us": 1e6 * statistics.median(cpu[m]), "wall_us": 1e6 * statistics.median(wall[m]),
                "cpu_ratio": statistics.median(c / b for c, b in zip(cpu[m], cpu[base], strict=True)),
                "ratio": statistics.median(w / b for w, b in zip(wall[m], wall[base], strict=True)),
            })  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--unchecked", action="store_true", help="funcoll.set_checks(False)")
    parser.add_argument("--json", default="", help="write every record to this file")
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    records = []
    for world in args.worlds:
        records += run_ranks(_bench, world, args.kib, args.calls, args.rounds, args.unchecked, timeout=3600)[
            0
        ]
    print(
        f"torch {torch.__version__}, gloo on CPU, rank 0, medians of {args.rounds} rounds of {args.calls} calls"
    )
    print("| world | KiB/rank | method | CPU us/call | x funcol | wall us/call | x funcol |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['world']} | {r['kib_per_rank']} | {r['method']} | {r['cpu_us']:.1f} | {r['cpu_ratio']:.2f} "
              f"| {r['wall_us']:.1f} | {r['ratio']:.2f} |")  # fmt: skip
    dump_records(args.json, records)


if __name__ == "__main__":
    main()
