"""Every benchmark family in one command: one JSON of results, one plot per family, the ratio tables.

Run: ``python benchmarks/run.py [--families gather sweep dtensor moe checked overlap wire row_kernels]
[--worlds 2 4] [--backend gloo|nccl] [--device cpu|cuda] [--reuse-memory] [--link RATE] [--out docs/results]
[--quick] [--replot]``

Families (each one's own script documents its methods):

- ``gather`` (``bench_ragged_gather.py``): the ragged all-gather over message
  sizes, one line per implementation: funcoll's strategies (with and without
  ``sizes=``), ``gather_padded``, the seed helpers' pad-and-list recipes,
  ``all_gather_object``, funcol's even ``all_gather_into_tensor`` of the same
  bytes (the baseline) and the in-place ``dist.all_gather_into_tensor`` into a
  preallocated buffer;
- ``sweep`` (``sweep_ragged.py``): every ragged op against the even funcol
  collective of the same bytes (``all_gather_into_tensor``,
  ``reduce_scatter_tensor`` or ``all_to_all_single``), over payloads and layouts;
- ``dtensor`` (``bench_dtensor.py``): DTensor's ``redistribute`` and the
  gather-then-chunk recipe against funcoll's all_to_all and from_ragged;
- ``moe`` (``bench_moe.py``): a training step's token movement through 2 MoE
  layers (dispatch, combine, forward and backward), ``funcoll.moe`` exact,
  static and the ``Dropless`` policy against a retyped torchtitan recipe, eager
  and compiled, with the host reads per step; and, where torchtitan 0.3.0 is
  installed (``bench_torchtitan.py``), torchtitan's own MoE layer (with its
  ``GroupedExperts``, and with a per-feature scale as its experts, where the
  dispatch is the step) with its
  ``AllToAllTokenDispatcher`` (the baseline) and funcoll's
  ``FuncollTokenDispatcher`` (exact, static, dropless), eager and compiled, up to 4096
  tokens per rank (its bf16 grouped GEMMs on the CPU take seconds past that);
- ``checked`` (``bench_checked.py``): a compiled gather and all_gather with
  ``funcoll.set_checks(True)`` against the same step unchecked; and 1,000 eager
  all_gathers, all_to_alls, all_reduces and broadcasts at the default setting (calls
  1, 2, 4, ... checked, the others fingerprinted), impl ``default``, against the same
  calls with ``set_checks(False)``;
- ``overlap`` (``bench_overlap.py``): a step that issues a collective, runs
  independent work (a sleeping custom op, or a matmul), then reads the result:
  the fraction of the collective it hides and its time against funcol's same
  step, eager and compiled (aot_eager, inductor, inductor with its overlap
  passes), funcol beside every funcoll op family (the ragged gathers beside the
  padded funcol program: pad, all_gather, cut);
- ``wire`` (``bench_wire.py``): all_gather, reduce_scatter and all_to_all with ``wire=`` int8,
  float8 e4m3 (block 128) and bfloat16 against the exact op (the baseline), eager and
  compiled, quantization included, with the bytes one rank sends;
- ``row_kernels`` (``bench_row_kernels.py``, ``--device cuda`` only, one process):
  the pad and the cut around a padded all_gather, funcoll's Triton kernels against
  its torch ops, float32. On CPU it is skipped, and says so.

The ranks run on ``--backend`` and every tensor of a family is made on
``--device`` (each rank its own GPU on CUDA); the JSON records both.
``--reuse-memory`` keeps every rank's freed host memory in the process
(``_timing.reuse_freed_memory``): a new tensor then reuses pages rather than
faulting in fresh ones, as a GPU's caching allocator reuses its blocks; the
JSON records it too. The JSON
(``results.json``) holds every record, and per family the torch version, machine,
backend, device and date of the run that made it (a run of some families keeps
the others' records); the plots (``<family>.png``, matplotlib from the ``bench``
extra) show, a panel per world and layout, time and below it effective bandwidth
against the message size (the sweep adds a row of time over its baseline), one
line per implementation, named in one legend under the panels. Bandwidth follows
nccl-tests' convention where a family times collectives (gather, sweep,
checked): ``busbw = algbw * (world - 1) / world``, with ``algbw`` the bytes of the
whole tensor over the time for an all-gather (the output) or a reduce-scatter
(the input) and of one rank's buffer for an all-to-all, so that it compares
across world sizes; the other families plot payload over time. ``--quick`` runs
one small size on 2 ranks, one round: a smoke run (the suite runs it), not a
measurement.

``--link RATE`` runs the families where bytes cost what a network charges: the
command re-executes itself under ``../shared/tools/netlink RATE`` (``_timing.on_link``;
root, unshare and tc), whose loopback is rate-limited, so every byte the ranks
move is paid for. On a plain loopback a byte costs a memcpy, the same as the
packing, padding and quantizing around a collective, and the figures weigh this
CPU's copies. On this machine (about 9 GB/s of copy on one thread) ``7gbit``
stands for an NVLink-class link and ``700mbit`` for an InfiniBand-class one. The
header line and the JSON's meta name the link; the results go to
``docs/results/link-RATE`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
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

import bench_checked
import bench_dtensor
import bench_moe
import bench_overlap
import bench_ragged_gather
import bench_row_kernels
import bench_torchtitan
import bench_wire
import sweep_ragged
from _timing import add_link_argument, on_link, reusing_memory

from funcoll.testing import run_ranks

Record = dict[str, Any]


@dataclass(frozen=True)
class Setup:
    """Where the ranks run: the backend, and the device every tensor of a family is made on."""

    backend: str = "gloo"
    device: str = "cpu"
    quick: bool = False  # a smoke run: families skip what only costs time (moe's compiled layers)
    reuse_memory: bool = False  # host memory freed stays in the process (_timing.reuse_freed_memory)

    def wrap(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """`body` run with this device as the default (each rank its own GPU on CUDA)."""
        return reusing_memory(functools.partial(_run_on, self.device, body), self.reuse_memory)


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
                        "busbw_gbps": _busbw(total, seconds, world),
                    })  # fmt: skip
    return records


def _busbw(moved: float, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth, GB/s: `moved` bytes (see the module docstring) over the time, times (w-1)/w."""
    return moved / seconds * (world - 1) / world / 1e9


def _sweep(worlds: list[int], kibs: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    records: list[Record] = []
    seen: set[tuple] = set()
    for world in worlds:
        got = run_ranks(on.wrap(sweep_ragged._sweep), world, kibs, ["equal", "skew16"], iters, rounds,
                        timeout=7200, backend=on.backend)[0]  # fmt: skip
        for r in got:
            total = sum(r["sizes"]) * sweep_ragged.ROW * 4  # bytes of every rank's rows
            moved = total / world if r["baseline"] == "a2a" else total  # one rank's buffer for an all-to-all
            case = {"family": "sweep", "world": world, "layout": r["layout"], "bytes": r["kib_per_rank"] * 1024,
                    "sizes": r["sizes"]}  # fmt: skip
            baseline = f"funcol {sweep_ragged.BASELINES[r['baseline']]} (even, baseline)"
            if (world, r["layout"], case["bytes"], baseline) not in seen:  # once per case, not per method
                seen.add((world, r["layout"], case["bytes"], baseline))
                seconds = r["baseline_ms"] / 1e3
                records.append({**case, "impl": baseline, "seconds": seconds, "ratio": 1.0,
                                "busbw_gbps": _busbw(moved, seconds, world)})  # fmt: skip
            records.append({
                **case, "impl": r["method"], "seconds": r["seconds"], "ratio": r["ratio"],
                "ratio_min": r["ratio_min"], "ratio_max": r["ratio_max"],
                "busbw_gbps": _busbw(moved, r["seconds"], world),
            })  # fmt: skip
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
    if importlib.util.find_spec("torchtitan") is None:
        print("moe: torchtitan's layer skipped (pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3)\n")
        return records
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch 2.11: its dispatchers call it
        print(
            f"moe: torchtitan's layer skipped (torchtitan 0.3.0 needs torch 2.12; this is {torch.__version__})\n"
        )
        return records
    for experts in bench_torchtitan.EXPERTS:  # its GroupedExperts, then a scale (the dispatch is the step)
        for world in worlds:
            layer_tokens = [int(t) for t in tokens if t <= TITAN_MAX_TOKENS]
            rows = run_ranks(on.wrap(bench_torchtitan._body), world, layer_tokens, rounds, iters, not on.quick,
                             experts, timeout=3600, backend=on.backend)[0]  # fmt: skip
            for r in rows:
                records.append({
                    "family": "moe", "world": world,
                    "layout": f"torchtitan layer, top-{bench_torchtitan.K}, {experts} experts",
                    "tokens": r["tokens"], "bytes": r["tokens"] * bench_torchtitan.K * bench_torchtitan.D * 4,
                    "impl": f"torchtitan layer: {r['method']}", "seconds": r["ms"] / 1e3, "ratio": r["ratio"],
                    "ratio_range": r["ratio_range"], "host_syncs": r["host_reads"],
                })  # fmt: skip
    return records


# torchtitan's layer runs up to this many tokens per rank (its bf16 grouped GEMMs on the CPU
# take seconds a step past it).
TITAN_MAX_TOKENS = 4096


def _checked(worlds: list[int], kibs: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    records = []
    for world in worlds:
        res = run_ranks(on.wrap(bench_checked._bench), world, [int(k) for k in kibs], rounds, iters,
                        timeout=3600, backend=on.backend)  # fmt: skip
        # eager calls at the default setting (calls 1, 2, 4, ... checked) against none checked
        steps = 16 if on.quick else 1000
        eager = run_ranks(on.wrap(bench_checked._bench_default), world, [int(k) for k in kibs], rounds, steps,
                          timeout=3600, backend=on.backend)  # fmt: skip
        for row, on_impl in [(r, "checked") for r in res[0]] + [(r, "default") for r in eager[0]]:
            gathered = world * row["kib"] * 1024  # all_gather's output: every rank's rows
            for impl, ms in (("unchecked", row["off_ms"]), (on_impl, row["on_ms"])):
                records.append({
                    "family": "checked", "world": world, "layout": row["op"], "bytes": row["kib"] * 1024,
                    "impl": impl, "seconds": ms / 1e3, "ratio": ms / row["off_ms"],
                    "busbw_gbps": _busbw(gathered, ms / 1e3, world),
                })  # fmt: skip
    return records


def _overlap(worlds: list[int], mibs: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    """The step's time and the fraction of the collective it hides, per mode and form of work."""
    modes = ["eager"] if on.quick else list(bench_overlap.MODES)
    ops = ["funcoll.all_gather"] if on.quick else None  # funcol's baselines always run
    records = []
    for world in worlds:
        for mib in [1.0] if on.quick else mibs:
            rows = run_ranks(on.wrap(bench_overlap._bench), world, mib, rounds, iters, modes, ops,
                             timeout=3600, backend=on.backend)[0]  # fmt: skip
            for r in rows:
                base = bench_overlap.baseline(rows, r)
                records.append({
                    "family": "overlap", "world": world, "layout": f"{r['mode']}, {r['form']}",
                    "bytes": int(mib * 2**20), "impl": r["impl"], "seconds": r["step_ms"] / 1e3,
                    "ratio": r["step_ms"] / base["step_ms"], "hidden": r["hidden"],
                    "hidden_range": r["hidden_range"], "exposed_seconds": r["exposed_ms"] / 1e3,
                    "call_over_comm": r["call_over_comm"],
                })  # fmt: skip
    return records


def _wire(worlds: list[int], kibs: list[float], iters: int, rounds: int, on: Setup) -> list[Record]:
    """Each format's time over the exact op's, in the same process and mode, and the bytes a rank sends."""
    modes = ["eager"] if on.quick else ["eager", "compiled"]
    records = []
    for world in worlds:
        rows = run_ranks(on.wrap(bench_wire._bench), world, [int(k) for k in kibs], rounds, iters, modes,
                         timeout=3600, backend=on.backend)[0]  # fmt: skip
        for r in rows:
            records.append({
                "family": "wire", "world": world, "layout": f"{r['op']}, {r['mode']}", "bytes": r["kib"] * 1024,
                "impl": r["impl"], "seconds": r["ms"] / 1e3, "ratio": r["ratio"], "sent_bytes": r["sent_bytes"],
            })  # fmt: skip
    return records


def _row_kernels(
    worlds: list[int], sizes_mb: list[float], iters: int, rounds: int, on: Setup
) -> list[Record]:
    """One process, no collective: the row moves on this process's GPU, float32."""
    records = []
    for mb in sizes_mb:
        for r in bench_row_kernels.measure(worlds, mb, iters, (torch.float32,)):
            for impl in ("torch", "triton"):
                records.append({
                    "family": "row_kernels", "world": r["world"], "layout": r["layout"], "bytes": int(mb * 2**20),
                    "impl": f"{r['move']}, {impl}", "seconds": r[f"{impl}_ms"] / 1e3,
                    "ratio": r[f"{impl}_ms"] / r["torch_ms"],
                })  # fmt: skip
    return records


# family -> (message sizes: MB gathered in all for gather, KiB per rank for sweep and checked,
# MB for dtensor and row_kernels, tokens per rank for moe; iters per timing; rounds)
FAMILIES: dict[str, tuple[list[float], int, int]] = {
    "gather": ([0.125, 1, 8, 64], 9, 1),
    "sweep": ([4, 64, 1024, 16384], 9, 5),
    "dtensor": ([1, 8, 32], 7, 1),
    "moe": ([256, 1024, 4096, 16384], 3, 5),
    "checked": ([64, 1024, 16384], 5, 5),
    "overlap": ([16], 3, 3),
    "wire": ([64, 1024, 16384], 5, 5),
    "row_kernels": ([4, 64], 50, 1),
}
RUNS: dict[str, Callable[..., list[Record]]] = {
    "gather": _gather, "sweep": _sweep, "dtensor": _dtensor, "moe": _moe, "checked": _checked,
    "overlap": _overlap, "wire": _wire, "row_kernels": _row_kernels,
}  # fmt: skip
# Families that run only on some devices: why they are skipped elsewhere.
NEEDS_CUDA = {"row_kernels": "funcoll's Triton kernels serve CUDA tensors; run with --device cuda"}


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
    "checked": "bytes per rank",
    "overlap": "bytes per rank (the step's time; its hidden fraction is in the JSON)",
    "row_kernels": "bytes of rows in all",
    "wire": "bytes per rank (before encoding)",
}
# Legend names of the records' short implementation names, where those do not say what ran.
_LABELS = {
    ("gather", "baseline"): "funcol all_gather_into_tensor (even, baseline)",
    ("dtensor", "redistribute"): "DTensor.redistribute (baseline)",
    ("dtensor", "gather+chunk"): "all_gather + chunk (baseline)",
    ("moe", "titan"): "torchtitan recipe (baseline)",
    ("moe", "torchtitan layer: titan"): "torchtitan layer, its dispatcher (baseline)",
    ("checked", "unchecked"): "set_checks(False) (baseline)",
    ("checked", "checked"): "set_checks(True)",
    ("wire", "exact"): "exact op (baseline)",
    ("wire", "int8"): "Wire(int8, block=128)",
    ("wire", "fp8"): "Wire(float8_e4m3fn, block=128)",
    ("wire", "bf16"): "Wire(bfloat16)",
}
_BUSBW = ("gather", "sweep", "checked")  # families of collectives: nccl-tests' busbw


def _rows(family: str) -> list[tuple[str, str]]:
    """The plot's rows: (what a point reads, the y label)."""
    bw = "busbw GB/s (nccl-tests)" if family in _BUSBW else "payload / time, GB/s"
    rows = [("seconds", "seconds"), ("bandwidth", bw)]
    return [*rows, ("ratio", "time / baseline")] if family == "sweep" else rows


def _point(r: Record, what: str) -> float | None:
    if what == "ratio":
        return r["ratio"]
    if "seconds" not in r:  # sweep records from before run.py kept the sweep's times
        return None
    return r["seconds"] if what == "seconds" else r.get("busbw_gbps", r["bytes"] / r["seconds"] / 1e9)


def _plot(records: list[Record], family: str, path: Path, link: str = "loopback") -> bool:
    """Time and bandwidth against the message size, a panel per world and layout, one legend below."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def panel(r: Record) -> tuple:
        return r["world"], r.get("layout", r.get("job", ""))

    if family == "overlap":
        return _plot_hidden(records, path, link, plt)
    panels = list(dict.fromkeys(panel(r) for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))  # one style per implementation, every panel
    impls.sort(key=lambda impl: "baseline" not in _LABELS.get((family, impl), impl))  # baselines first
    # tab20's dark shades first, then its light ones: neighbours in the legend differ in hue
    style = {impl: {"color": plt.get_cmap("tab20")((2 * k + k // 10) % 20), "marker": "os^vD"[k % 5],
                    "label": _LABELS.get((family, impl), impl)} for k, impl in enumerate(impls)}  # fmt: skip
    rows = _rows(family)
    fig, axes = plt.subplots(len(rows), len(panels), figsize=(5 * len(panels), 3.6 * len(rows)),
                             squeeze=False, sharex="col")  # fmt: skip
    for col, p in enumerate(panels):
        mine = [r for r in records if panel(r) == p]
        for impl in dict.fromkeys(r["impl"] for r in mine):
            pts = sorted((r for r in mine if r["impl"] == impl), key=lambda r: r["bytes"])
            for row, (what, _) in enumerate(rows):
                xy = [(r["bytes"], _point(r, what)) for r in pts]
                xy = [(x, y) for x, y in xy if y is not None]
                if xy:
                    axes[row][col].plot([x for x, _ in xy], [y for _, y in xy], **style[impl])
        axes[0][col].set_title(f"{family}: world {p[0]}, {p[1]} ({link})")
        axes[-1][col].set_xlabel(_X_LABEL[family])
        for row, (_, label) in enumerate(rows):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_ylabel(label)
            if ax.lines:
                ax.set_yscale("log")
            else:  # records made before the family kept its times
                ax.text(0.5, 0.5, f"no times in these records:\nrerun --families {family}", ha="center",
                        va="center", transform=ax.transAxes)  # fmt: skip
    handles = [plt.Line2D([], [], **style[impl]) for impl in impls]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
               ncol=min(len(impls), max(1, len(panels)) + 1), frameon=False)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def _plot_hidden(records: list[Record], path: Path, link: str, plt: Any) -> bool:
    """The overlap family: each method's hidden fraction as a bar (its rounds' range as a line), a panel
    per mode and work (rows) and world (columns); one payload size, so no axis of sizes."""
    worlds = sorted({r["world"] for r in records})
    layouts = list(dict.fromkeys(r["layout"] for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    fig, axes = plt.subplots(len(layouts), len(worlds), figsize=(6 * len(worlds), 0.3 * len(impls) * len(layouts) + 1),
                             squeeze=False, sharey=True)  # fmt: skip
    for row, layout in enumerate(layouts):
        for col, world in enumerate(worlds):
            ax = axes[row][col]
            got = {r["impl"]: r for r in records if r["world"] == world and r["layout"] == layout}
            ys = range(len(impls))
            hidden = [got[i]["hidden"] if i in got and got[i]["hidden"] is not None else 0.0 for i in impls]
            colors = ["tab:gray" if i.startswith("funcol ") else "tab:blue" for i in impls]
            ax.barh(list(ys), hidden, color=colors)
            for y, i in zip(ys, impls, strict=True):
                low, high = (got.get(i) or {}).get("hidden_range") or (None, None)
                if low is not None:
                    ax.plot([low, high], [y, y], color="black", linewidth=1)
            ax.set_yticks(list(ys), impls, fontsize=7)
            ax.set_xlim(-0.5, 1.1)
            ax.axvline(0, color="black", linewidth=0.5)
            mib = records[0]["bytes"] / 2**20
            ax.set_title(f"world {world}, {layout}, {mib:g} MiB a rank ({link})", fontsize=9)
            if row == len(layouts) - 1:
                ax.set_xlabel("hidden fraction of the collective (1: all of it); grey: funcol's")
    axes[0][0].invert_yaxis()  # the axes share y: once for all, the first method on top
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--out", help="where the JSON and plots go (default docs/results, docs/results/link-RATE with --link)"
    )
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
    parser.add_argument(
        "--reuse-memory",
        action="store_true",
        help="every rank keeps its freed host memory for reuse, as a GPU's caching allocator does",
    )
    add_link_argument(parser)
    args = parser.parse_args(argv)
    link = on_link(None if args.replot else args.link)
    print(link, "\n")
    if args.out is None:
        results = Path(__file__).resolve().parents[1] / "docs" / "results"
        args.out = str(results / f"link-{args.link}" if args.link else results)
    on = Setup(args.backend, args.device, args.quick, args.reuse_memory)
    worlds = [2] if args.quick else args.worlds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        data = json.loads((out / "results.json").read_text())
        saved = data["records"]
        for family in args.families:
            got = [r for r in saved if r["family"] == family]
            if got:
                print(_table(got, _case, f"{family}: time / baseline (median)"), "\n")
                _plot(
                    got, family, out / f"{family}.png", data["meta"].get(family, {}).get("link", "loopback")
                )
        return 0
    records: list[Record] = []
    ran = []
    for family in args.families:
        if family in NEEDS_CUDA and args.device != "cuda":
            print(f"{family}: skipped, {NEEDS_CUDA[family]}\n")
            continue
        sizes, iters, rounds = FAMILIES[family]
        sizes, iters, rounds = (sizes[:1], 1, 1) if args.quick else (sizes, iters, rounds)
        got = RUNS[family](worlds, sizes, iters, rounds, on)
        records += got
        ran.append(family)
        print(_table(got, _case, f"{family}: time / baseline (median)"), "\n")
        png = out / f"{family}.png"
        print(
            f"plot: {png}"
            if _plot(got, family, png, args.link or "loopback")
            else "plot: skipped (pip install matplotlib)",
            "\n",
        )
    meta = {"torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "backend": args.backend, "device": args.device, "quick": args.quick,
            "reuse_memory": args.reuse_memory, "link": args.link or "loopback", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    # The families not run now keep their records (and the meta of the run that made them).
    path = out / "results.json"
    saved = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "records": []}
    kept = [r for r in saved["records"] if r["family"] not in ran]
    runs = {f: m for f, m in saved["meta"].items() if f not in ran and f in FAMILIES}
    runs.update({f: meta for f in ran})
    path.write_text(json.dumps({"meta": runs, "records": kept + records}, indent=1))
    print(f"wrote {len(records)} records to {path} ({len(kept)} kept from earlier runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
