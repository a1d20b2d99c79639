"""Quantized wire formats (``funcoll.Wire``) against the exact op: bytes on the wire and time, side by side.

Run: ``python benchmarks/bench_wire.py [--worlds 2 4] [--kib 64 1024 16384] [--rounds 5] [--quick]``

Each rank holds rows of 1024 float32 (``--kib`` of them per rank). For each op,
``all_gather``, ``reduce_scatter`` (the qgZ form: an all_to_all of the quantized
pieces, each decoded and summed in float32) and ``all_to_all`` (an equal share of
the rows to every rank), the exact op (the baseline) and the
same op with ``wire=`` int8 (block 128), float8 e4m3 (block 128) and bfloat16 run
in the same process, interleaved over `rounds` rounds of barrier-fenced calls
(``_timing.fenced_median``), eager and compiled (inductor, ``fullgraph=True``);
a row's time is the median over rounds, and its ratio the time over the exact
op's in the same mode. The time includes the quantization and the decoding. The
bytes are what one rank sends: the encoded tensor (codes and float32 block
scales), against the exact op's float32 bytes.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from _timing import add_link_argument, fenced_median, on_link  # benchmarks/, beside this script

import funcoll
from funcoll import Wire
from funcoll.testing import run_ranks

ROW = 1024  # float32 elements per row: 4 KiB
WIRES: dict[str, Wire | None] = {
    "exact": None,
    "int8": Wire(torch.int8, block=128),
    "fp8": Wire(torch.float8_e4m3fn, block=128),
    "bf16": Wire(torch.bfloat16),
}
OPS: dict[str, Callable[[torch.Tensor, Wire | None], torch.Tensor]] = {
    "all_gather": lambda x, w: funcoll.all_gather(x, wire=w),
    "reduce_scatter": lambda x, w: funcoll.reduce_scatter(x, wire=w),
    "all_to_all": lambda x, w: funcoll.all_to_all(x, None, 0, 0, wire=w),  # rows of 4 KiB to every rank
}


def sent_bytes(x: torch.Tensor, wire: Wire | None) -> int:
    """What one rank sends: its encoded tensor (the reduce-scatter's pieces, each with its own scales)."""
    return x.numel() * x.element_size() if wire is None else wire.nbytes(tuple(x.shape))


def _bench(
    rank: int, world: int, kib: list[int], rounds: int, iters: int, modes: list[str]
) -> list[dict[str, Any]]:
    # One lambda's code object compiled per op, format and size: past dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 64
    rows = []
    for op, call in OPS.items():
        steps = {
            (mode, name): (
                (lambda x, w=w, call=call: call(x, w))
                if mode == "eager"
                else torch.compile(lambda x, w=w, call=call: call(x, w), fullgraph=True, dynamic=False)
            )
            for mode in modes
            for name, w in WIRES.items()
        }
        for size in kib:
            n = max(world, size // 4 // world * world)  # rows of 4 KiB, a multiple of world
            x = torch.randn(n, ROW, generator=torch.Generator().manual_seed(rank), device="cpu").to(
                torch.get_default_device()
            )
            exact = call(x, None)
            for step in steps.values():  # warm up (compile), and check the result is close
                torch.testing.assert_close(step(x), exact, rtol=0.1, atol=0.1 * float(exact.abs().max()))
            times: dict[tuple[str, str], list[float]] = {k: [] for k in steps}
            for _ in range(rounds):  # interleaved: drift hits all alike
                for k, step in steps.items():
                    times[k].append(fenced_median(lambda step=step, x=x: step(x), iters))
            for mode in modes:
                base = statistics.median(times[mode, "exact"])
                for name, w in WIRES.items():
                    ms = 1e3 * statistics.median(times[mode, name])
                    rows.append({
                        "op": op, "mode": mode, "kib": size, "impl": name, "ms": ms, "ratio": ms / 1e3 / base,
                        "sent_bytes": sent_bytes(x, w), "exact_bytes": sent_bytes(x, None),
                    })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 1024, 16384], help="payload per rank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="fenced calls per round (median)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 64 KiB, 1 round, eager: a smoke run")
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    modes = ["eager", "compiled"]
    if args.quick:
        args.worlds, args.kib, args.rounds, args.iters, modes = [2], [64], 1, 1, ["eager"]
    print(f"torch {torch.__version__}, gloo on CPU, rows of {ROW} float32")
    print("| world | op | mode | KiB per rank | format | bytes sent / exact | ms | time / exact |")
    print("|---:|---|---|---:|---|---:|---:|---:|")
    for world in args.worlds:
        for row in run_ranks(_bench, world, args.kib, args.rounds, args.iters, modes, timeout=3600)[0]:
            print(
                f"| {world} | {row['op']} | {row['mode']} | {row['kib']} | {row['impl']} "
                f"| {row['sent_bytes'] / row['exact_bytes']:.3f} | {row['ms']:.2f} | {row['ratio']:.2f} |"
            )


if __name__ == "__main__":
    main()
