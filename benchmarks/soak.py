"""Soak funcoll: many random collectives, eager and compiled, each checked against a single-process reference.

Run: ``python benchmarks/soak.py [--long] [--worlds 2 3 4] [--count N] [--seed S]
[--backend aot_eager|inductor] [--checks]``

Every world size runs one set of gloo CPU ranks (``funcoll.testing.run_ranks``) that draw the
same random sequence of cases from ``tests/_cases.py``: any public op (``gather`` with the
strategies auto/pad/a2a/shift and with ``dst``, ``all_gather_list``, ``all_gather_ragged``,
``reduce_scatter`` with ``sizes=``, ``all_to_all_v``, the even ops, ``gather_padded`` /
``all_to_all_padded``, the region ops, ``from_ragged``/``to_ragged``, DTensor inputs,
``funcoll.moe.dispatch``/``combine`` and ``funcoll.lax``), sizes 0 included, random dims
(negative too), dtypes and memory layouts. About a quarter of the cases go through one of
eight fixed compiled steps (``torch.compile(fullgraph=True)`` of a small step calling the op,
the ragged dim marked with ``funcoll.mark_ragged``, float64 with gradients), so the number of
compiled functions, and the compile time, stays bounded. Each rank checks every
result and float64 gradient at once against the reference it computes from every rank's input
(``torch.cat`` / stack-and-reduce / splits, ``torch.autograd`` for the gradients, never
funcoll), so nothing accumulates; it reads its RSS (``/proc/self/statm``) after the warm-up
(every compiled step called twice) and at the end, records every warning (Python's, and every
line it writes to stderr, where C++ code warns), counts the graphs dynamo compiled, and reads
c10d's work registry (``funcoll.testing.in_flight()``) after every case and at the end.

The short run (default: 250 collectives per world, aot_eager) is what ``tests/test_soak.py``
runs in the suite; ``--long`` runs 1000 per world with inductor. The summary gives the
collectives run, per-op counts, compiled graphs per rank and their bound (one per compiled step:
``_cases.graph_bound``), RSS start/end/growth per rank, the collectives left unwaited, the
funcoll/c10d warnings and stderr lines, and the wall time. The exit code is 1 on any mismatch,
an RSS growth of 5% or more, more graphs than the bound, a collective left unwaited, or any
funcoll/c10d warning or stderr line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the shared cases and references

from _cases import COMPILED, SoakPlan, graph_bound, soak_rank

from funcoll.testing import run_ranks

RSS_GROWTH_MAX = 0.05
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # one compile worker per rank: 2 cores here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--long", action="store_true", help="1000 collectives per world, compiled with inductor")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4], help="world sizes (default: 2 3 4)")
    p.add_argument(
        "--count", type=int, default=None, help="collectives per world (default: 250, --long: 1000)"
    )
    p.add_argument("--seed", type=int, default=0, help="the random sequence (the same on every rank)")
    p.add_argument(
        "--backend", default=None, help="torch.compile backend (default: aot_eager, --long: inductor)"
    )
    p.add_argument("--checks", action="store_true", help="run under funcoll.set_checks(True)")
    p.add_argument(
        "--compiled-share", type=float, default=0.25, help="share of cases through a compiled step"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    return p.parse_args(argv)


def summarize(world: int, ranks: list[dict[str, Any]], bounds: list[int], wall: float) -> list[str]:
    """The summary lines of one world size (`bounds`: each rank's graph bound)."""
    r0 = ranks[0]
    lines = [
        f"world {world}: {r0['collectives']} collectives in {wall:.1f} s wall ({r0['seconds']:.1f} s in the loop)"
    ]
    eager = {k: v for k, v in sorted(r0["counts"].items()) if not k.endswith("[compiled]")}
    compiled = {
        k.removesuffix("[compiled]"): v for k, v in sorted(r0["counts"].items()) if k.endswith("[compiled]")
    }
    lines.append("  eager:    " + ", ".join(f"{k} {v}" for k, v in eager.items()))
    lines.append("  compiled: " + ", ".join(f"{k} {v}" for k, v in compiled.items()))
    for r, res in enumerate(ranks):
        growth = res["rss_end"] / res["rss_start"] - 1
        lines.append(
            f"  rank {r}: RSS {res['rss_start'] / 2**20:.1f} -> {res['rss_end'] / 2**20:.1f} MiB "
            f"({100 * growth:+.2f}%), {res['graphs']} compiled graphs (bound {bounds[r]}), "
            f"{res['n_failures']} mismatches, {res['in_flight']} left in flight, "
            f"{len(res['warnings'])} funcoll/c10d warnings, {len(res['stderr'])} stderr lines"
        )
        for w in res["warnings"]:
            lines.append(f"    warning: {w}")
        for line in res["stderr"][:10]:
            lines.append(f"    stderr: {line}")
        for f in res["failures"][:2]:
            lines.append("    mismatch: " + f.replace("\n", "\n      "))
    return lines


def passed(ranks: list[dict[str, Any]], bounds: list[int], count: int) -> bool:
    return all(
        res["collectives"] == count
        and res["n_failures"] == 0
        and not res["warnings"]
        and not res["stderr"]
        and res["in_flight"] == 0
        and 0 < res["graphs"] <= bound
        and res["rss_end"] / res["rss_start"] - 1 < RSS_GROWTH_MAX
        for res, bound in zip(ranks, bounds, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    count = args.count or (1000 if args.long else 250)
    backend = args.backend or ("inductor" if args.long else "aot_eager")
    names = tuple(COMPILED)
    print(f"soak: {count} random collectives per world on worlds {args.worlds}, compiled steps ({backend}): "
          f"{', '.join(names)}; checks {'on' if args.checks else 'off'}", flush=True)  # fmt: skip
    start, ok, total = time.perf_counter(), True, 0
    for world in args.worlds:
        plan = SoakPlan(world=world, count=count, seed=args.seed, compiled=names, backend=backend,
                        checks=args.checks, compiled_share=args.compiled_share)  # fmt: skip
        t0 = time.perf_counter()
        try:
            ranks = run_ranks(soak_rank, world, plan, timeout=args.timeout)
        except Exception as e:  # noqa: BLE001 -- a rank crashed or hung: report it and go on
            print(f"world {world}: FAILED to run: {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        bounds = [graph_bound(plan, r) for r in range(world)]
        good = passed(ranks, bounds, count)
        ok = ok and good
        total += ranks[0]["collectives"]
        print("\n".join(summarize(world, ranks, bounds, time.perf_counter() - t0)), flush=True)
        print(f"  -> {'ok' if good else 'FAILED'}", flush=True)
    wall = time.perf_counter() - start
    print(f"soak: {total} collectives, {wall:.1f} s wall: {'PASSED' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
