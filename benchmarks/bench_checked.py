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

The default setting (neither on nor off) checks an op's eager calls 1, 2, 4, 8,
... on each group, and the calls in between carry a fingerprint in their data's
collective (``funcoll._collective._fingerprint``). ``_bench_default`` measures what
that costs a run of eager calls (``--steps``, 1,000 by default; ``--eager-only``
runs these rows alone): each round runs them once at the default on a new
group, whose count starts at 0, so that every one of its checks is paid, and
once with ``set_checks(False)`` on another new group, interleaved; a row's time
is the median per call over rounds. all_gather's fingerprint costs a copy of its
input and of its result (from ``_fingerprint.AHEAD_BYTES`` a rank: a round trip
ahead of the data instead, and the row "fingerprint in the payload" is the same
calls with the copies, interleaved with the others), all_to_all's a copy of its
input and of its result, all_reduce's one of its input, broadcast's one of its
input per receiving rank on src (it runs as an all_to_all).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _timing import add_link_argument, fenced_median, on_link  # benchmarks/, beside this script

import funcoll
from funcoll._collective import _fingerprint
from funcoll.testing import run_ranks

ROW = 1024  # float32 elements per row: 4 KiB

STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gather": lambda x: funcoll.gather(x),
    "all_gather": lambda x: funcoll.all_gather(x),
}


def _timed(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, checks: bool, iters: int) -> float:
    with funcoll.set_checks(checks):
        return fenced_median(lambda: step(x), iters)


def _row(op: str, kib: int, off: list[float], on: list[float]) -> dict[str, Any]:
    """A row: the median seconds of each setting over rounds, and the range of the per-round ratios."""
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    return {
        "op": op,
        "kib": kib,
        "off_ms": 1e3 * statistics.median(off),
        "on_ms": 1e3 * statistics.median(on),
        "spread": (min(ratios), max(ratios)),
    }


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
            rows.append(_row(op, size, off, on))
    return rows


EAGER: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "all_gather": lambda x, g: funcoll.all_gather(x, group=g),
    "all_to_all": lambda x, g: funcoll.all_to_all(x, g, 0, 1),
    "all_reduce": lambda x, g: funcoll.all_reduce(x, group=g),
    "broadcast": lambda x, g: funcoll.broadcast(x, 0, group=g),
}


def _run_of_calls(op: str, x: torch.Tensor, checks: bool | None, steps: int, inline: bool = False) -> float:
    """Seconds per call of `steps` eager calls of `op` on a new group (its check count starts at 0).

    `inline`: every fingerprint travels in the payload, whatever its size (none ahead).
    """
    g = dist.new_group(list(range(dist.get_world_size())))
    call = EAGER[op]
    ahead = _fingerprint.AHEAD_BYTES
    with funcoll.set_checks(checks), contextlib.ExitStack() as stack:
        if inline:
            _fingerprint.AHEAD_BYTES = 1 << 62
            stack.callback(setattr, _fingerprint, "AHEAD_BYTES", ahead)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            funcoll.wait(call(x, g))
        dist.barrier()
        return (time.perf_counter() - t0) / steps


def _bench_default(rank: int, world: int, kib: list[int], rounds: int, steps: int) -> list[dict[str, Any]]:
    """Eager calls at the default setting against set_checks(False): a row per op and size."""
    rows = []
    for op in EAGER:
        for size in kib:
            x = torch.randn(max(world, size // 4 // world * world), ROW)  # size KiB, rows of 4 KiB
            ahead = op == "all_gather" and x.numel() * x.element_size() >= _fingerprint.AHEAD_BYTES
            off, on, inline = [], [], []
            for _ in range(rounds):  # interleaved: drift hits them alike
                off.append(_run_of_calls(op, x, False, steps))
                on.append(_run_of_calls(op, x, None, steps))
                if ahead:
                    inline.append(_run_of_calls(op, x, None, steps, inline=True))
            rows.append(
                _row(f"{op} eager, {steps} calls" + (", fingerprint ahead" if ahead else ""), size, off, on)
            )
            if ahead:
                rows.append(_row(f"{op} eager, {steps} calls, fingerprint in the payload", size, off, inline))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 1024, 16384], help="payload per rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="fenced calls per round (median)")
    parser.add_argument("--steps", type=int, default=1000, help="eager calls per run at the default setting")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 64 KiB, 1 round: a smoke run")
    parser.add_argument(
        "--eager-only", action="store_true", help="only the eager calls at the default setting"
    )
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    if args.quick:
        args.worlds, args.kib, args.rounds, args.iters, args.steps = [2], [64], 1, 1, 16
    print(f"torch {torch.__version__}, gloo on CPU, compiled (inductor), rows of {ROW} float32")
    print("| world | op | KiB per rank | unchecked ms | checked ms | checked / unchecked | spread |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for world in args.worlds:
        res = (
            [[]]
            if args.eager_only
            else run_ranks(_bench, world, args.kib, args.rounds, args.iters, timeout=3600)
        )
        eager = run_ranks(_bench_default, world, args.kib, args.rounds, args.steps, timeout=3600)
        for row in res[0] + eager[0]:
            lo, hi = row["spread"]
            print(
                f"| {world} | {row['op']} | {row['kib']} | {row['off_ms']:.2f} | {row['on_ms']:.2f} "
                f"| {row['on_ms'] / row['off_ms']:.2f} | {lo:.2f}-{hi:.2f} |"
            )


if __name__ == "__main__":
    main()
