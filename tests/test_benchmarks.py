"""``benchmarks/run.py --quick`` runs every family and writes the JSON and one plot per family;
``benchmarks/bench_checked.py --quick`` prints its table.

A smoke run (one small size, 2 ranks, one round): it checks that the runner and
every family's benchmark still work against funcoll's current API and that the
records hold what docs/benchmarks.md reads, never how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
FAMILIES = ("gather", "sweep", "dtensor", "moe")


def test_quick_run_writes_records_and_plots(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(data["meta"][f]["quick"] is True and data["meta"][f]["torch"] for f in FAMILIES)
    for family in FAMILIES:
        mine = [r for r in data["records"] if r["family"] == family]
        assert mine, f"no {family} records"
        assert all(r["ratio"] > 0 and r["bytes"] > 0 and r["world"] == 2 for r in mine), mine[0]
        assert (tmp_path / f"{family}.png").stat().st_size > 10_000, f"{family}.png"
        assert f"### {family}: time / baseline" in done.stdout
    impls = {r["impl"] for r in data["records"] if r["family"] == "gather"}
    for expected in ("baseline", "funcoll.gather auto", "pad+list (seed 000)", "all_gather_object"):
        assert expected in impls, sorted(impls)
    moe = {r["impl"]: r["host_syncs"] for r in data["records"] if r["family"] == "moe"}
    assert moe == {"titan": 1, "funcoll.moe exact": 1, "funcoll.moe static": 0}, moe


def test_checked_benchmark_quick_run_prints_both_ops() -> None:
    script = RUN.with_name("bench_checked.py")
    done = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    assert sorted(r[2].strip() for r in rows) == ["all_gather", "gather"], done.stdout
    assert all(float(r[6]) > 0 for r in rows), done.stdout
