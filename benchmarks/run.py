"""Every benchmark family in one command: one JSON of results, one plot per family, the ratio tables.

Run: ``python benchmarks/run.py [--families gather sweep dtensor moe] [--worlds 2 4]
[--out docs/results] [--quick] [--replot]``

Families (each one's own script documents its methods):

- ``gather`` (``bench_ragged_gather.py``): the ragged all-gather over message
  sizes, one line per implementation: funcoll's strategies (with and without
  ``sizes=``), ``gather_padded``, the seed helpers' pad-and-list recipes,
  ``all_gather_object``, funcol's even ``all_gather_into_tensor`` of the same
  bytes (the baseline) and the in-place ``dist.all_gather_into_tensor`` into a
  preallocated buffer;
- ``sweep`` (``sweep_ragged.py``): every ragged op as a ratio to the even
  collective of the same bytes, over payloads and layouts;
- ``dtensor`` (``bench_dtensor.py``): DTensor's ``redistribute`` and the
  gather-then-chunk recipe against funcoll's all_to_all and from_ragged;
- ``moe`` (``bench_moe.py``): one MoE layer's dispatch and combine,
  ``funcoll.moe`` exact and static against a retyped torchtitan recipe, with the
  host reads per layer.

Everything runs on gloo CPU ranks started here. The JSON (``results.json``) holds
every record, and per family the torch version, machine and date of the run
that made it (a run of some families keeps the others' records); the plots (``<family>.png``,
matplotlib from the ``bench`` extra) show time and effective bandwidth against
the message size. Bandwidth follows nccl-tests' convention: ``algbw`` is the
bytes gathered (the output's size) over the time, and ``busbw = algbw * (world -
1) / world`` for an all-gather, what each link carries on a ring, so that it
compares across world sizes. ``--quick`` runs one small size on 2 ranks, one
round: a smoke run (the suite runs it), not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the family scripts import _timing beside them

import bench_dtensor
import bench_moe
import bench_ragged_gather
import sweep_ragged

from funcoll.testing import run_ranks

Record = dict[str, Any]


@dataclass(frozen=True)
class Setup:
    """Where the ranks run: the backend, and the device every tensor of a family is made on."""

    backend: str = "gloo"
    device: str = "cpu"
    quick: bool = False  # a smoke run: families skip what only costs time (moe's compiled layers)

    def wrap(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """`body` run with this device as the default (each rank its own GPU on CUDA)."""
        return functools.partial(_run_on, self.device, body)


def _run_on(device: str, body: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.set_default_device(device)
    return body(rank, world, *args)


def _gather(worlds: list[int], sizes_mb: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    records = []
    for world in worlds:
        for mb in sizes_mb:
            res = run_ranks(
                on.wrap(bench_ragged_gather._bench), world, mb, iters, timeout=3600, backend=on.backend
            )[0]
            for layout, row in res.items():
                sizes = row.pop("_sizes")
                total = sum(sizes) * bench_ragged_gather.ROW * 4  # bytes gathered
                for impl, seconds in row.items():
                    records.append({
                        "family": "gather", "world": world, "layout": layout, "bytes": total, "impl": impl,
                        "seconds": seconds, "ratio": seconds / row["baseline"],
                        "busbw_gbps": total / seconds * (world - 1) / world / 1e9,
                    })  # fmt: skip
    return records


def _sweep(worlds: list[int], kibs: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    records = []
    for world in worlds:
        for r in run_ranks(
            sweep_ragged._sweep, world, kibs, ["equal", "skew16"], iters, rounds, timeout=7200
        )[0]:
            records.append(
                {"family": "sweep", "impl": r.pop("method"), "bytes": r["kib_per_rank"] * 1024, **r}
            )
    return records


def _dtensor(worlds: list[int], sizes_mb: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    records = []
    for world in worlds:
        for mb in sizes_mb:
            res = run_ranks(on.wrap(bench_dtensor._body), world, mb, iters, timeout=1800, backend=on.backend)[
                0
            ]
            for job, (base, ours) in {
                "a2a": ("redistribute", "funcoll.all_to_all"),
                "from_ragged": ("gather+chunk", "funcoll.from_ragged"),
            }.items():
                r = res[job]
                for impl, seconds, sent in ((base, r["base_s"], r["base_bytes"]),
                                            (ours, r["base_s"] * r["ratio"], r["bytes"])):  # fmt: skip
                    records.append({
                        "family": "dtensor", "job": job, "world": world, "bytes": mb << 20, "impl": impl,
                        "seconds": seconds, "ratio": seconds / r["base_s"], "bytes_sent": sent,
                    })  # fmt: skip
    return records


def _moe(worlds: list[int], tokens: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    records = []
    for world in worlds:
        res = run_ranks(on.wrap(bench_moe._bench), world, [int(t) for t in tokens], rounds, iters,
                        not on.quick, timeout=3600, backend=on.backend)  # fmt: skip
        for row in res[0]:
            sent = row["tokens"] * bench_moe.K * bench_moe.H * 4  # bytes of the rows a rank dispatches
            base = row["ms"]["titan"]
            for impl, ms in row["ms"].items():
                records.append({
                    "family": "moe", "world": world, "layout": f"top-{bench_moe.K} uniform",
                    "tokens": row["tokens"], "bytes": sent, "impl": impl, "seconds": ms / 1e3,
                    "ratio": ms / base, "host_syncs": row["syncs"][impl],
                })  # fmt: skip
    return records


# family -> (message sizes: MB gathered in all for gather, KiB per rank for sweep, MB for
# dtensor, tokens per rank for moe; iters per timing; rounds)
FAMILIES: dict[str, tuple[list[float], int, int]] = {
    "gather": ([0.125, 1, 8, 64], 9, 1),
    "sweep": ([4, 64, 1024, 16384], 9, 5),
    "dtensor": ([1, 8, 32], 7, 1),
    "moe": ([256, 1024, 4096, 16384], 3, 5),
}
RUNS: dict[str, Callable[..., list[Record]]] = {
    "gather": _gather, "sweep": _sweep, "dtensor": _dtensor, "moe": _moe,
}  # fmt: skip


def _case(r: Record) -> tuple:
    return f"w{r['world']}", r.get("layout", r.get("job")), f"{r['bytes'] >> 10} KiB"


def _table(records: list[Record], key: Callable[[Record], tuple], title: str) -> str:
    """Markdown: one row per `key`, one column per implementation, the ratio to the baseline."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    lines = [f"### {title}", "", "| " + " | ".join(["case", *impls]) + " |", "|---|" + "---:|" * len(impls)]
    for k in dict.fromkeys(key(r) for r in records):
        row = {r["impl"]: r["ratio"] for r in records if key(r) == k}
        lines.append("| " + " ".join(map(str, k)) + " | " + " | ".join(
            f"{row[i]:.2f}" if i in row else "" for i in impls) + " |")  # fmt: skip
    return "\n".join(lines)


_X_LABEL = {
    "gather": "bytes gathered in all",
    "sweep": "bytes per rank",
    "dtensor": "bytes of the global tensor",
    "moe": "bytes a rank dispatches (T * k * H * 4)",
}


def _plot(records: list[Record], family: str, path: Path) -> bool:
    """Time (and bandwidth where it means one) against the message size, a panel per world and layout."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def panel(r: Record) -> tuple:
        return r["world"], r.get("layout", r.get("job", ""))

    panels = list(dict.fromkeys(panel(r) for r in records))
    y_key, y_label = ("ratio", "time / baseline") if family == "sweep" else ("seconds", "seconds")
    rows = 1 if family == "sweep" else 2
    fig, axes = plt.subplots(rows, len(panels), figsize=(5 * len(panels), 4 * rows), squeeze=False)
    for col, p in enumerate(panels):
        mine = [r for r in records if panel(r) == p]
        for k, impl in enumerate(dict.fromkeys(r["impl"] for r in mine)):
            style = {"color": plt.get_cmap("tab20")(k % 20), "marker": "os^vD"[k % 5], "label": impl}
            pts = sorted((r["bytes"], r) for r in mine if r["impl"] == impl)
            xs = [b for b, _ in pts]
            axes[0][col].plot(xs, [r[y_key] for _, r in pts], **style)
            if rows == 2:
                bw = [r.get("busbw_gbps", b / r["seconds"] / 1e9) for b, r in pts]
                axes[1][col].plot(xs, bw, **style)
        axes[0][col].set_title(f"{family}: world {p[0]}, {p[1]}")
        axes[0][col].set_ylabel(y_label)
        for ax in (a[col] for a in axes):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(_X_LABEL[family])
        if rows == 2:
            axes[1][col].set_ylabel("busbw GB/s" if family == "gather" else "payload / time, GB/s")
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"))
    parser.add_argument(
        "--quick", action="store_true", help="one small size, 2 ranks, one round: a smoke run"
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="redraw the plots and tables from <out>/results.json; run nothing",
    )
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    on = Setup(args.backend, args.device, args.quick)
    worlds = [2] if args.quick else args.worlds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((out / "results.json").read_text())["records"]
        for family in args.families:
            got = [r for r in saved if r["family"] == family]
            if got:
                print(_table(got, _case, f"{family}: time / baseline (median)"), "\n")
                _plot(got, family, out / f"{family}.png")
        return 0
    records: list[Record] = []
    for family in args.families:
        sizes, iters, rounds = FAMILIES[family]
        sizes, iters, rounds = (sizes[:1], 1, 1) if args.quick else (sizes, iters, rounds)
        got = RUNS[family](worlds, sizes, iters, rounds, on)
        records += got
        print(_table(got, _case, f"{family}: time / baseline (median)"), "\n")
        png = out / f"{family}.png"
        print(f"plot: {png}" if _plot(got, family, png) else "plot: skipped (pip install matplotlib)", "\n")
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "backend": args.backend, "device": args.device, "quick": args.quick,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    # The families not run now keep their records (and the meta of the run that made them).
    path = out / "results.json"
    saved = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "records": []}
    kept = [r for r in saved["records"] if r["family"] not in args.families]
    runs = {f: m for f, m in saved["meta"].items() if f not in args.families and f in FAMILIES}
    runs.update({f: meta for f in args.families})
    path.write_text(json.dumps({"meta": runs, "records": kept + records}, indent=1))
    print(f"wrote {len(records)} records to {path} ({len(kept)} kept from earlier runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
