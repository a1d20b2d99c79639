"""How much of a collective's time a step hides behind independent work: funcol beside funcoll.

Run: ``python benchmarks/bench_overlap.py [--worlds 2 4] [--mib 16] [--rounds 3] [--gloo-threads 1]
[--reuse-memory] [--defer-all] [--quick]``

The step issues a collective on `x`, runs work that does not read its result,
then reads the result (``coll(x).sum() + work(w)``)::

    hidden = (comm + compute - step) / comm

with ``comm`` the collective and its read alone, ``compute`` the work alone and
``step`` both; 1 is full overlap, 0 none. ``exposed = step - compute`` is the
time the step spends on communication the work did not cover. Where two
variants' ``comm`` differ (the ragged gathers against funcol's padded program,
which moves the padding too), a shorter collective hides a smaller fraction of
less time: compare their ``exposed``, what the step pays. The work is sized once per collective
kind, from funcol's collective alone, and every variant of that kind runs the same
work: their steps then differ only by the collective and what overlaps it. Each rank holds `mib` MiB of float32
rows (the ragged ops: rank r holds ``r + 1`` parts of the rows, scaled so the
total equals the even ops'). funcol has no ragged gather: the ragged ops' baseline
is the program a funcol user writes (``funcol all_gather, padded``: pad to the
largest rank's rows, all_gather, cut). Each row also gives its ``comm`` time: the
ragged gathers' against the even all_gather's of the same total shows what the
layout costs (the largest rank sends more than the even share). The independent
work has two forms:

- ``sleep``: a custom op (``funcoll_bench::sleep``) that sleeps for the
  time funcol's collective of its kind took alone, and returns its input plus one: like a GPU
  kernel, it leaves the host's cores to the communication, and as a custom op it
  stays in a compiled graph, where inductor schedules it as an extern kernel;
- ``matmul``: a float32 matmul sized to take about as long on this machine (on
  the CPU it competes with gloo for the cores: a harder case than a GPU's).

Modes: eager, then ``torch.compile(fullgraph=True)`` with aot_eager, inductor as
configured by default, and inductor with its overlap passes
(``reorder_for_compute_comm_overlap`` with sink-waits, raise-comms and
reorder-compute). Every variant of a (world, form, mode) runs interleaved in one
process over `rounds` rounds of barrier-fenced calls; a time is the median of
the slowest rank's per-round medians. The step's ratio is the funcoll step over
funcol's step of the same collective kind in the same mode.

On a gloo group with torch's two worker threads (the ranks' group by default)
funcoll keeps one collective in flight at a time: a result is waited at its
first read or before funcoll's next collective (``funcoll._collective._async.defers`` says
why), so a step's one collective overlaps its work as on NCCL. ``--defer-all``
sets ``FUNCOLL_GLOO_DEFER=1`` in every rank: collectives then stay in flight
together, as funcol's. ``--gloo-threads 1`` builds the group with one thread
(``funcoll.testing.gloo_worker_threads``), which runs its collectives one at a
time by itself.

``--reuse-memory`` keeps each rank's freed host memory for reuse
(``_timing.reuse_freed_memory``). Without it, every copy into a new 16 MiB
tensor on this CPU (a pad, a cut, an all_to_all's repeated input) first
faults in fresh pages, most of that copy's time, which a GPU's caching
allocator does not pay; the work cannot hide it, since the host runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _timing import (  # benchmarks/, beside this script
    add_link_argument,
    fenced_median,
    on_link,
    reusing_memory,
)

import funcoll
from funcoll.testing import gloo_worker_threads, run_ranks

ROW = 1024  # float32 elements per row: 4 KiB
# funcol's public wrappers, by their names on this release (torch 2.13 renamed the two below).
_AG = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_RS = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


@torch.library.custom_op("funcoll_bench::sleep", mutates_args=())
def sleep(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """Independent work that takes `seconds` and leaves the cores free: ``x + 1`` after a sleep."""
    time.sleep(seconds)
    return x + 1


@sleep.register_fake
def _sleep_fake(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


def _ragged_rows(rank: int, world: int, rows: int) -> list[int]:
    """Every rank's rows, rank r holding r + 1 parts, summing to ``world * rows``."""
    parts = world * (world + 1) // 2
    sizes = [world * rows * (r + 1) // parts for r in range(world)]
    sizes[-1] += world * rows - sum(sizes)
    return sizes


def _collectives(rank: int, world: int, rows: int) -> dict[str, tuple[str, Callable[..., torch.Tensor], Any]]:
    """name -> (the funcol baseline it is compared with, the collective, its input)."""
    group = dist.group.WORLD
    name = group.group_name
    sizes = _ragged_rows(rank, world, rows)
    even = torch.randn(rows, ROW)
    mine = torch.randn(sizes[rank], ROW)
    return {
        "funcol all_gather": ("all_gather", lambda t: _AG(t, 0, name), even),
        "funcoll.all_gather": ("all_gather", lambda t: funcoll.all_gather(t), even),
        # The ragged gathers: funcol has none, so its baseline is the program a funcol user
        # writes (pad to the largest rank's rows, all_gather, cut the padding out).
        "funcol all_gather, padded": ("ragged gather", lambda t: _funcol_padded_gather(t, sizes, name), mine),
        "funcoll.gather": ("ragged gather", lambda t: funcoll.gather(t), mine),
        "funcoll.gather(sizes=)": ("ragged gather", lambda t: funcoll.gather(t, sizes=sizes), mine),
        'funcoll.gather(strategy="shift")': (
            "ragged gather",
            lambda t: funcoll.gather(t, sizes=sizes, strategy="shift"),
            mine,
        ),
        'funcoll.gather(strategy="pad")': (
            "ragged gather",
            lambda t: funcoll.gather(t, sizes=sizes, strategy="pad"),
            mine,
        ),
        "funcoll.gather_padded": (
            "ragged gather",
            lambda t: funcoll.gather_padded(t, sizes[rank])[0],
            _padded(mine, rows, world),
        ),
        "funcol reduce_scatter": ("reduce_scatter", lambda t: _RS(t, "sum", 0, name), even),
        "funcoll.reduce_scatter": ("reduce_scatter", lambda t: funcoll.reduce_scatter(t), even),
        "funcol all_to_all": ("all_to_all", lambda t: funcol.all_to_all_single(t, None, None, name), even),
        "funcoll.all_to_all": ("all_to_all", lambda t: funcoll.all_to_all(t, None, 0, 0), even),
        "funcoll.all_to_all_v": (
            "all_to_all",
            lambda t: funcoll.all_to_all_v(t, [rows // world] * world)[0],
            even,
        ),
    }


def _funcol_padded_gather(t: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
    """A ragged gather in funcol: pad to ``max(sizes)``, ``all_gather``, cut each rank's padding out."""
    longest = max(sizes)
    y = _AG(torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[0])), 0, name)
    return torch.cat([y[i * longest : i * longest + n] for i, n in enumerate(sizes)])


def _padded(mine: torch.Tensor, rows: int, world: int) -> torch.Tensor:
    """`mine` in a buffer of the largest rank's rows (what gather_padded sends)."""
    bound = max(_ragged_rows(0, world, rows))
    return torch.cat([mine, mine.new_zeros(bound - mine.shape[0], *mine.shape[1:])])


@contextlib.contextmanager
def _overlap_passes() -> Iterator[None]:
    from torch._inductor import config

    passes = ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]
    with config.patch(reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=passes):
        yield


MODES: dict[str, tuple[str | None, Callable[[], Any]]] = {
    "eager": (None, contextlib.nullcontext),
    "aot_eager": ("aot_eager", contextlib.nullcontext),
    "inductor": ("inductor", contextlib.nullcontext),
    "inductor+overlap": ("inductor", _overlap_passes),
}


FORMS = ("sleep", "matmul")


def _slowest(seconds: float) -> float:
    """The slowest rank's time (every rank gets it)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return float(t)


def _matmul_side(seconds: float) -> torch.Tensor:
    """A square matrix whose matmul with itself takes about `seconds` here (the same side on every rank)."""
    n = 256
    while True:
        a = torch.randn(n, n)
        took = _slowest(fenced_median(lambda a=a: a @ a, 3))  # every rank decides alike
        if took >= seconds or n >= 4096:
            return a
        n = int(n * min(2.0, max(1.1, (seconds / took) ** (1 / 3))))


def _bench(rank: int, world: int, mib: float, rounds: int, iters: int, modes: list[str],
           names: list[str] | None, forms: tuple[str, ...] = FORMS, defer_all: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    # funcoll's default on gloo keeps one collective in flight at a time; with the
    # variable set, they stay in flight together (funcoll._collective._async.defers says why).
    if defer_all:
        os.environ["FUNCOLL_GLOO_DEFER"] = "1"  # this rank's process only
    # Every variant's step is the same code object with other defaults: one graph each.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    rows = max(world, int(mib * 2**20) // (ROW * 4) // world * world)
    colls = _collectives(rank, world, rows)
    if names:  # those asked for, and funcol's of the same kinds
        kinds = {colls[k][0] for k in names}
        if "ragged gather" in kinds:  # the even all_gather of the same total, for its comm time
            kinds.add("all_gather")
        colls = {k: v for k, v in colls.items() if k in names or (k.startswith("funcol ") and v[0] in kinds)}
    out = []
    for mode in modes:
        backend, ctx = MODES[mode]
        for form in forms:
            with ctx():
                steps: dict[str, dict[str, Callable[[], Any]]] = {}
                # One length of work per collective kind, funcol's collective alone: every
                # variant of a kind then runs the same work, so that their steps compare.
                alone = {name: _slowest(fenced_median(lambda c=coll, x=x: c(x).sum(), iters))
                         for name, (_kind, coll, x) in colls.items()}  # fmt: skip
                base = {colls[n][0]: t for n, t in alone.items() if n.startswith("funcol ")}
                for name, (kind, coll, x) in colls.items():
                    work, w = _work(form, base.get(kind, alone[name]))

                    def comm(c=coll, x=x) -> torch.Tensor:
                        return c(x).sum()

                    def compute(work=work, w=w) -> torch.Tensor:
                        return work(w).sum()

                    def step(c=coll, x=x, work=work, w=w) -> torch.Tensor:
                        y = c(x)
                        z = work(w)
                        return y.sum() + z.sum()

                    fns = {"comm": comm, "compute": compute, "step": step}
                    if backend is not None:
                        fns = {k: torch.compile(f, fullgraph=True, backend=backend) for k, f in fns.items()}
                    for f in fns.values():
                        f()  # compile and warm up outside the timing
                    steps[name] = fns
                times: dict[str, dict[str, list[float]]] = {n: {"comm": [], "compute": [], "step": [],
                                                               "call": []} for n in steps}  # fmt: skip
                for _ in range(rounds):  # interleaved: drift hits every variant alike
                    for name, fns in steps.items():
                        for part, f in fns.items():
                            times[name][part].append(_slowest(fenced_median(f, iters)))
                        if backend is None:
                            times[name]["call"].append(
                                _slowest(_call_time(colls[name][1], colls[name][2], iters))
                            )
            for name, t in times.items():
                comm, compute, step = (statistics.median(t[k]) for k in ("comm", "compute", "step"))
                out.append({"mode": mode, "form": form, "impl": name, "kind": colls[name][0],
                            "comm_ms": 1e3 * comm, "compute_ms": 1e3 * compute, "step_ms": 1e3 * step,
                            "exposed_ms": 1e3 * (step - compute),
                            "hidden": (comm + compute - step) / comm,
                            "hidden_range": _hidden_range(t),
                            "call_over_comm": statistics.median(t["call"]) / comm if t["call"] else None})  # fmt: skip
    return out


def _hidden_range(t: dict[str, list[float]]) -> tuple[float, float]:
    per_round = [(c + w - s) / c for c, w, s in zip(t["comm"], t["compute"], t["step"], strict=True)]
    return min(per_round), max(per_round)


def _call_time(coll: Callable[..., torch.Tensor], x: torch.Tensor, iters: int) -> float:
    """Eager: how long the call itself takes to return (its result is read after the timer stops)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        y = coll(x)
        times.append(time.perf_counter() - t0)
        funcoll.wait(y)
    return statistics.median(times)


def _work(form: str, seconds: float) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    if form == "sleep":
        return (lambda w, s=seconds: torch.ops.funcoll_bench.sleep(w, s)), torch.zeros(4)
    a = _matmul_side(seconds)
    return (lambda w: w @ w), a


def baseline(rows: list[dict[str, Any]], r: dict[str, Any]) -> dict[str, Any]:
    """funcol's row of the same mode, form and collective kind as `r`."""
    return next(b for b in rows if b["mode"] == r["mode"] and b["form"] == r["form"]
                and b["kind"] == r["kind"] and b["impl"].startswith("funcol "))  # fmt: skip


def _opt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=float, default=16.0, help="payload per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3, help="fenced calls per round (median)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument(
        "--ops", nargs="*", default=None, help="funcoll variants (funcol's of their kinds run too)"
    )
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument(
        "--gloo-threads", type=int, default=None, help="1: the ranks' gloo group runs one worker thread"
    )
    parser.add_argument(
        "--reuse-memory", action="store_true", help="each rank keeps its freed host memory for reuse"
    )
    parser.add_argument(
        "--defer-all", action="store_true", help="FUNCOLL_GLOO_DEFER=1: collectives in flight together"
    )
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1 MiB, 1 round, eager: a smoke run")
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    if args.quick:
        args.worlds, args.mib, args.rounds, args.iters, args.modes = [2], 1.0, 1, 1, ["eager"]
    threads = "torch's 2" if args.gloo_threads is None else args.gloo_threads
    threads = f"{threads}, FUNCOLL_GLOO_DEFER=1" if args.defer_all else threads
    memory = ", freed host memory reused" if args.reuse_memory else ""
    print(
        f"torch {torch.__version__}, gloo on CPU (worker threads: {threads}), {args.mib:g} MiB per rank{memory}"
    )
    print(
        "| world | mode | work | impl | comm ms | hidden | range | exposed ms | step / funcol's | call / comm |"
    )
    print("|---:|---|---|---|---:|---|---:|---:|---:|---:|")
    for world in args.worlds:
        groups = (
            contextlib.nullcontext() if args.gloo_threads is None else gloo_worker_threads(args.gloo_threads)
        )
        with groups:  # the ranks fork inside it and build their group
            rows = run_ranks(reusing_memory(_bench, args.reuse_memory), world, args.mib, args.rounds, args.iters, args.modes, args.ops,
                             tuple(args.forms), args.defer_all, timeout=3600)[0]  # fmt: skip
        for r in rows:
            base = baseline(rows, r)
            lo, hi = r["hidden_range"]
            print(f"| {world} | {r['mode']} | {r['form']} | {r['impl']} | {r['comm_ms']:.1f} | {r['hidden']:.0%} "
                  f"| {lo:.0%} to {hi:.0%} | {r['exposed_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f} "
                  f"| {_opt(r['call_over_comm'])} |")  # fmt: skip


if __name__ == "__main__":
    main()
