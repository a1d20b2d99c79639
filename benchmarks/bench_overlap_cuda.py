"""Overlap on one CUDA GPU: a collective on NCCL's stream beside matmuls on the compute stream, funcol beside funcoll.

Run (needs a CUDA GPU): ``python benchmarks/bench_overlap_cuda.py [--mib 1024] [--rounds 5] [--iters 10]
[--modes eager inductor inductor+overlap]``

One process and a one-rank NCCL group, the most one GPU allows (NCCL refuses two
ranks on one device). funcoll's ops compute a one-rank group's result locally and
issue no collective there, so the funcoll side of each row is the primitive
its ops issue through (``funcoll._collective._prims``: ``all_gather_p``, ``reduce_scatter_p``,
``all_to_all_p``), on the same group, with funcoll's eager deferral; the funcol
side is torch's wrapper of the same ``_c10d_functional`` op. NCCL runs the
one-rank collective (a device copy of the payload) on its own stream, as it runs
any collective, so the row shows what the wait does on CUDA: funcol's
``AsyncCollectiveTensor`` and funcoll's ``Pending`` both return at once, and
their wait at first use makes the compute stream wait for NCCL's, not the host.
What the network would add (its bandwidth, more ranks) one GPU cannot show.

The step is bench_overlap.py's: issue the collective on `x`, run work that does
not read its result (``n`` chained bf16 4096-square matmuls, ``n`` sized so the
work takes about as long as funcol's collective alone), then read the result::

    hidden = (comm + compute - step) / comm

A time is taken from the host, ``torch.cuda.synchronize()`` before and after:
the median of `iters` calls, over `rounds` rounds with every variant of a mode
interleaved, the median of the rounds. ``call / comm`` is the host time of the
eager call alone (no synchronize) over its collective's time: well under 1 when
the call returns before its data arrives. On one GPU the copy engine or NCCL's
copy kernel and the matmuls share the device's memory, so full overlap is not
reached by either side.

Without a GPU (``--quick`` in tests/test_benchmarks.py) it runs the same steps
on CPU tensors over a one-rank gloo group: a smoke run, not a CUDA figure.
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
import torch.distributed._functional_collectives as funcol
from _timing import gpu_median_ms, init_one_rank_group, sync_gpu  # benchmarks/, beside this script
from bench_overlap import _AG, _RS, MODES

import funcoll
from funcoll._collective import _prims

CUDA = torch.cuda.is_available()
SIDE = 4096 if CUDA else 128  # the work's matmuls: SIDE x SIDE x SIDE in bf16
BF16 = torch.bfloat16
DEVICE = "cuda" if CUDA else "cpu"


def _call_seconds(coll: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int) -> float:
    """Median host seconds until an eager call returns (its data may still be in flight)."""
    times = []
    for _ in range(iters):
        sync_gpu()
        t0 = time.perf_counter()
        y = coll(x)
        times.append(time.perf_counter() - t0)
        funcoll.wait(y)
        sync_gpu()
    return statistics.median(times)


def _collectives(group: dist.ProcessGroup) -> dict[str, dict[str, Callable[[torch.Tensor], torch.Tensor]]]:
    name = group.group_name
    return {
        "all_gather": {
            "funcol": lambda t: _AG(t, 0, group),
            "funcoll": lambda t: _prims.all_gather_p(t, name, 1),
        },
        "reduce_scatter": {
            "funcol": lambda t: _RS(t, "sum", 0, group),
            "funcoll": lambda t: _prims.reduce_scatter_p(t, "sum", name, 1),
        },
        "all_to_all": {
            "funcol": lambda t: funcol.all_to_all_single(t, None, None, group),
            "funcoll": lambda t: _prims.all_to_all_p(t, [t.shape[0]], [t.shape[0]], name),
        },
    }


def _side_copy(
    side: torch.cuda.Stream,
    x: torch.Tensor,
    work: Callable[[torch.Tensor], torch.Tensor] | None,
    w: torch.Tensor,
) -> torch.Tensor:
    """The step with a plain device copy of `x` on a side stream in place of the collective.

    What the device itself overlaps of a copy and the work, with no collective
    library involved: the bound the rows above can reach on one GPU.
    """
    current = torch.cuda.current_stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        y = x.clone()
    z = work(w).sum() if work is not None else 0
    current.wait_stream(side)  # the read's wait, after the work is queued
    y.record_stream(current)
    return y.sum() + z


def _work(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def work(w: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            w = w @ w
        return w

    return work


def _bench(mib: float, rounds: int, iters: int, modes: list[str]) -> list[dict[str, Any]]:
    group = dist.group.WORLD
    x = torch.randn(int(mib * 2**20) // (4 * 1024), 1024, device=DEVICE)
    w = torch.randn(SIDE, SIDE, device=DEVICE, dtype=BF16) / SIDE**0.5  # stays of order 1 when chained
    one_mm = gpu_median_ms(lambda: w @ w, iters) / 1e3
    rows = []
    for kind, variants in _collectives(group).items():
        comm0 = gpu_median_ms(lambda c=variants["funcol"]: c(x).sum(), iters) / 1e3
        work = _work(max(1, round(comm0 / one_mm)))  # about the collective's time, the same for both
        for mode in modes:
            backend, ctx = MODES[mode]
            with ctx():
                torch._dynamo.reset()
                fns: dict[str, Callable[[], Any]] = {"compute": lambda work=work: work(w).sum()}
                steps = {}
                for v, coll in variants.items():
                    fns[f"{v} comm"] = lambda c=coll: c(x).sum()
                    steps[v] = lambda c=coll, work=work: c(x).sum() + work(w).sum()
                fns.update({f"{v} step": f for v, f in steps.items()})
                side = CUDA and mode == "eager"  # the device's own bound, eager only
                if side:
                    stream = torch.cuda.Stream()
                    fns["copy comm"] = lambda s=stream: _side_copy(s, x, None, w)
                    fns["copy step"] = lambda s=stream, work=work: _side_copy(s, x, work, w)
                if backend is not None:
                    fns = {
                        k: torch.compile(lambda f=f: f(), fullgraph=True, backend=backend)
                        for k, f in fns.items()
                    }
                times: dict[str, list[float]] = {k: [] for k in fns}
                for _ in range(rounds):
                    for k, f in fns.items():
                        times[k].append(gpu_median_ms(f, iters) / 1e3)
            t = {k: statistics.median(v) for k, v in times.items()}
            for v, coll in variants.items():
                comm, step = t[f"{v} comm"], t[f"{v} step"]
                rows.append({
                    "mode": mode, "kind": kind, "variant": v, "comm": comm, "compute": t["compute"], "step": step,
                    "hidden": (comm + t["compute"] - step) / comm, "vs_funcol": step / t["funcol step"],
                    "call": _call_seconds(coll, x, iters) / comm if mode == "eager" else None,
                })  # fmt: skip
            if side:
                comm, step = t["copy comm"], t["copy step"]
                rows.append({
                    "mode": mode, "kind": kind, "variant": "copy on a side stream", "comm": comm,
                    "compute": t["compute"], "step": step, "hidden": (comm + t["compute"] - step) / comm,
                    "vs_funcol": step / t["funcol step"], "call": None,
                })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1024.0, help="payload, float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--modes", nargs="+", default=["eager", "inductor", "inductor+overlap"], choices=list(MODES)
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 MiB, 1 round, 2 calls, eager and inductor+overlap: a smoke run",
    )
    args = parser.parse_args()
    if args.quick:
        args.mib, args.rounds, args.iters, args.modes = 4.0, 1, 2, ["eager", "inductor+overlap"]
    where = init_one_rank_group()
    try:
        print(
            f"torch {torch.__version__}, {where}, "
            f"{args.mib:g} MiB float32 payload, work: bf16 {SIDE}-square matmuls"
        )
        print(
            "| mode | collective | side | comm ms | compute ms | step ms | hidden | step / funcol's | call / comm |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for r in _bench(args.mib, args.rounds, args.iters, args.modes):
            call = "" if r["call"] is None else f"{r['call']:.3f}"
            print(
                f"| {r['mode']} | {r['kind']} | {r['variant']} | {1e3 * r['comm']:.3f} | {1e3 * r['compute']:.3f} "
                f"| {1e3 * r['step']:.3f} | {100 * r['hidden']:.0f}% | {r['vs_funcol']:.2f} | {call} |"
            )
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
