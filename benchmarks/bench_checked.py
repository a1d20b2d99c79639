"""What ``funcoll.set_checks(True)`` costs a compiled step: checked against unchecked, same graph code.

Run: ``python benchmarks/bench_checked.py [--worlds 2 4] [--kib 64 1024 16384] [--rounds 5] [--quick]``

One step function, compiled once with ``torch.compile(fullgraph=True)``
(inductor), is called with checks off and on (dynamo keeps one graph for each
setting), interleaved over `rounds` rounds of barrier-fenced calls
(``_timing.fenced_median``); a row's time is the median over rounds and the
spread is the range of the per-round ratios. Each rank holds rows of 1024 float32,
the same count on every rank, and the step is one op:

- ``gather`` (ragged, sizes exchanged): its size exchange is its check, and its
  data collective keeps the bare ``wait_tensor`` either way (only a header's
  wait is ``funcoll::wait``); checks add the data collective's own header (what
  it is: one small all_gather and a host read) and make the payload depend on
  its read (one pass over it);
- ``all_gather`` (even): checks add the cross-rank header before the data and
  the data collective's own header, each one small all_gather and a host read,
  and make the payload depend on the reads, so that the data travels after the
  checks.

The two results are compared before timing.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from _timing import fenced_median  # benchmarks/, beside this script

import funcoll
from funcoll.testing import run_ranks

ROW = 1024  # float32 elements per row: 4 KiB

STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gather": lambda x: funcoll.gather(x),
    "all_gather": lambda x: funcoll.all_gather(x),
}


def _timed(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, checks: bool, iters: int) -> float:
    with funcoll.set_checks(checks):
        return fenced_median(lambda: step(x), iters)


def _bench(rank: int, world: int, kib: list[int], rounds: int, iters: int) -> list[dict[str, Any]]:
    rows = []
    for op, step in STEPS.items():
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        for size in kib:
            gen = torch.Generator().manual_seed(
                rank
            )  # on the CPU: drawn there, then moved to the default device
            x = torch.randn(max(1, size // 4), ROW, generator=gen, device="cpu").to(
                torch.get_default_device()
            )
            with funcoll.set_checks(False):
                plain = compiled(x)
            with funcoll.set_checks(True):
                checked = compiled(x)
            torch.testing.assert_close(checked, plain, rtol=0, atol=0)

            off, on = [], []
            for _ in range(rounds):  # interleaved: drift hits both alike
                off.append(_timed(compiled, x, False, iters))
                on.append(_timed(compiled, x, True, iters))
            ratios = [b / a for a, b in zip(off, on, strict=True)]
            rows.append(
                {
                    "op": op,
                    "kib": size,
                    "off_ms": 1e3 * statistics.median(off),
                    "on_ms": 1e3 * statistics.median(on),
                    "spread": (min(ratios), max(ratios)),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 1024, 16384], help="payload per rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="fenced calls per round (median)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 64 KiB, 1 round: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.kib, args.rounds, args.iters = [2], [64], 1, 1
    print(f"torch {torch.__version__}, gloo on CPU, compiled (inductor), rows of {ROW} float32")
    print("| world | op | KiB per rank | unchecked ms | checked ms | checked / unchecked | spread |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for world in args.worlds:
        res = run_ranks(_bench, world, args.kib, args.rounds, args.iters, timeout=3600)
        for row in res[0]:
            lo, hi = row["spread"]
            print(
                f"| {world} | {row['op']} | {row['kib']} | {row['off_ms']:.2f} | {row['on_ms']:.2f} "
                f"| {row['on_ms'] / row['off_ms']:.2f} | {lo:.2f}-{hi:.2f} |"
            )


if __name__ == "__main__":
    main()
