"""``benchmarks/run.py --quick`` runs every family and writes the JSON and one plot per family.

A smoke run (one small size, 2 ranks, one round): it checks that the runner and
every family's benchmark still work against funcoll's current API and that the
records hold what docs/benchmarks.md reads, never how fast anything is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
sys.path.insert(0, str(RUN.parent))
import _timing  # noqa: E402 -- benchmarks/, beside run.py

FAMILIES = (
    "gather",
    "sweep",
    "dtensor",
    "moe",
    "checked",
    "overlap",
    "wire",
)  # and row_kernels, skipped without CUDA


LINK_FAMILIES = ("gather", "wire")

# name -> (its command, its timeout in seconds). They run side by side, started at
# the first test's read (suite time): the CUDA scripts' smoke runs hold one rank each.
SCRIPTS: dict[str, tuple[list[str], float]] = {
    "quick": ([str(RUN), "--quick", "--reuse-memory", "--out", "{out}"], 300.0),
    "link": (
        [str(RUN), "--quick", "--families", *LINK_FAMILIES, "--link", "7gbit", "--out", "{out}/link"],
        300.0,
    ),
    "bench_overlap_cuda.py": ([str(RUN.parent / "bench_overlap_cuda.py"), "--quick"], 600.0),
    "bench_torchtitan_cuda.py": ([str(RUN.parent / "bench_torchtitan_cuda.py"), "--quick"], 600.0),
}


@dataclasses.dataclass
class Script:
    """A script started in a subprocess; :meth:`done` waits for it."""

    proc: subprocess.Popen
    out: Path
    timeout: float

    def done(self) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        read = [(self.out.with_suffix(s)).read_text() for s in (".out", ".err")]
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, *read)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Script]:
    where = tmp_path_factory.mktemp("benchmarks")
    (where / "quick-out").mkdir()
    started = {}
    for name, (args, timeout) in SCRIPTS.items():
        if name == "bench_torchtitan_cuda.py" and importlib.util.find_spec("torchtitan") is None:
            continue  # its test skips
        out = where / name.removesuffix(".py")
        with out.with_suffix(".out").open("w") as o, out.with_suffix(".err").open("w") as e:
            cmd = [sys.executable, *(a.format(out=where / "quick-out") for a in args)]
            started[name] = Script(subprocess.Popen(cmd, stdout=o, stderr=e, text=True), out, timeout)
    return started


def test_quick_run_writes_records_and_plots(scripts: dict[str, Script]) -> None:
    done = scripts["quick"].done()
    tmp_path = scripts["quick"].out.parent / "quick-out"  # run.py's --out
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["meta"]) == set(FAMILIES)
    assert all(data["meta"][f]["quick"] is True and data["meta"][f]["torch"] for f in FAMILIES)
    assert all((m["backend"], m["device"]) == ("gloo", "cpu") for m in data["meta"].values())
    assert all(m["reuse_memory"] is True for m in data["meta"].values())
    assert all(m["link"] == "loopback" for m in data["meta"].values())
    for family in FAMILIES:
        mine = [r for r in data["records"] if r["family"] == family]
        assert mine, f"no {family} records"
        assert all(r["ratio"] > 0 and r["bytes"] > 0 and r["world"] == 2 for r in mine), mine[0]
        assert all(r["seconds"] > 0 for r in mine), family  # every plot has its time and bandwidth rows
        assert (tmp_path / f"{family}.png").stat().st_size > 10_000, f"{family}.png"
        assert f"### {family}: time / baseline" in done.stdout
    assert "row_kernels: skipped, funcoll's Triton kernels serve CUDA tensors" in done.stdout
    assert not (tmp_path / "row_kernels.png").exists()
    impls = {r["impl"] for r in data["records"] if r["family"] == "gather"}
    for expected in ("baseline", "funcoll.gather auto", "pad+list (seed 000)", "all_gather_object"):
        assert expected in impls, sorted(impls)
    sweep = {r["impl"] for r in data["records"] if r["family"] == "sweep"}
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert f"funcol {op} (even, baseline)" in sweep, sorted(sweep)
    moe = {r["impl"]: r["host_syncs"] for r in data["records"] if r["family"] == "moe"}
    # per step of 2 layers: one a layer for the recipe and exact mode, one a step for Dropless
    recipe = {"titan": 2, "funcoll.moe exact": 2, "funcoll.moe static": 0, "funcoll.moe dropless": 1}
    # torchtitan's own layer (one): its dispatcher reads its splits twice, exact and dropless modes
    # once, static never
    layer = {
        "torchtitan layer: titan": 2,
        "torchtitan layer: funcoll exact": 1,
        "torchtitan layer: funcoll static": 0,
        "torchtitan layer: funcoll dropless": 1,
        "torchtitan layer: funcoll dropless 1.0": 1,
        "torchtitan layer: funcoll exact, fp8 dispatch": 1,
    }
    # torchtitan 0.3.0 runs from torch 2.12 on (run.py skips its layer on 2.11, as test_torchtitan does)
    titan = importlib.util.find_spec("torchtitan") and hasattr(torch.compiler, "_is_non_strict_tracing")
    assert moe == (recipe | layer if titan else recipe), moe
    overlap = [r for r in data["records"] if r["family"] == "overlap"]
    assert {r["impl"] for r in overlap} >= {"funcol all_gather", "funcoll.all_gather"}, overlap
    assert {r["layout"] for r in overlap} == {"eager, sleep", "eager, matmul"}
    assert all(math.isfinite(r["hidden"]) and r["seconds"] > 0 for r in overlap), overlap  # quick: no meaning
    assert all(math.isfinite(r["exposed_seconds"]) for r in overlap), overlap
    wire = [r for r in data["records"] if r["family"] == "wire"]
    assert {(r["layout"], r["impl"]) for r in wire} == {
        (f"{op}, eager", f)
        for op in ("all_gather", "reduce_scatter", "all_to_all")
        for f in ("exact", "int8", "fp8", "bf16")
    }
    # what one rank sends: 8-bit codes and a float32 scale per 128 values, or bf16
    sent = {r["impl"]: r["sent_bytes"] / r["bytes"] for r in wire if r["layout"] == "all_gather, eager"}
    assert sent == {"exact": 1.0, "int8": (1 + 4 / 128) / 4, "fp8": (1 + 4 / 128) / 4, "bf16": 0.5}, sent
    checked = {(r["layout"], r["impl"]) for r in data["records"] if r["family"] == "checked"}
    assert checked == {(op, c) for op in ("gather", "all_gather") for c in ("checked", "unchecked")} | {
        (f"{op} eager, 16 calls", c)
        for op in ("all_gather", "all_to_all", "all_reduce", "broadcast")
        for c in ("default", "unchecked")
    }


def test_quick_run_on_a_rate_limited_link(scripts: dict[str, Script]) -> None:
    """``run.py --link 7gbit`` re-executes itself under netlink: its header and records name the link."""
    if _timing.netlink_tool() is None:
        pytest.skip("no netlink script on this machine (benchmarks/_timing.py: NETLINK_PLACES)")
    done = scripts["link"].done()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("link: 7gbit (netlink: "), done.stdout[:300]
    data = json.loads((scripts["link"].out.parent / "quick-out" / "link" / "results.json").read_text())
    assert {f: m["link"] for f, m in data["meta"].items()} == dict.fromkeys(LINK_FAMILIES, "7gbit")
    for family in LINK_FAMILIES:
        assert [r for r in data["records"] if r["family"] == family and r["seconds"] > 0], family


def _table(script: Script) -> list[list[str]]:
    """The rows of the markdown table a benchmark script prints, split into cells."""
    done = script.done()
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("| ") and not ln.startswith("| mode")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if not ln.startswith("| T ")]


def test_overlap_cuda_smoke_run(scripts: dict[str, Script]) -> None:
    """bench_overlap_cuda.py --quick: without a GPU, its steps on CPU tensors and a one-rank gloo group."""
    rows = _table(scripts["bench_overlap_cuda.py"])
    kinds = ("all_gather", "reduce_scatter", "all_to_all")
    assert {(r[0], r[1], r[2]) for r in rows} == {
        (m, k, side) for m in ("eager", "inductor+overlap") for k in kinds for side in ("funcol", "funcoll")
    }, rows
    for r in rows:  # comm, compute and step are times; quick: no meaning beyond that
        assert all(float(c) > 0 for c in r[3:6]), r
        assert r[0] != "eager" or float(r[8]) > 0, r  # the eager call's own time, over its collective's


def test_torchtitan_cuda_smoke_run(scripts: dict[str, Script]) -> None:
    """bench_torchtitan_cuda.py --quick: torchtitan's layer with each dispatcher, one rank, host reads counted."""
    pytest.importorskip("torchtitan")
    rows = _table(scripts["bench_torchtitan_cuda.py"])
    reads = {r[2]: int(r[7]) for r in rows}
    # torchtitan's dispatcher reads its splits twice; exact mode once; static never; dropless once a step
    want = {
        "titan": 2,
        "funcoll exact": 1,
        "funcoll static": 0,
        "funcoll dropless": 1,
        "funcoll dropless 1.0": 1,
        "funcoll exact, fp8 dispatch": 1,
    }
    assert reads == want, rows
    assert all(float(r[3]) > 0 and float(r[9]) < 2e-2 for r in rows), rows  # bf16 against titan's output
