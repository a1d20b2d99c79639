"""The torch release matrix: funcoll's smoke run on every release it supports but the pinned one.

    python .ci/matrix.py install           # one venv per release, made once and kept (in parallel)
    python .ci/matrix.py run               # per release: the demo and the smoke tests; writes the results
    python .ci/matrix.py record FILE.xml   # the pinned release's row, from the whole suite's junit report
    python .ci/matrix.py render [--check]  # docs/support.md from the results (--check: fail if it differs)

Each release lives in its own venv under ``$FUNCOLL_MATRIX_CACHE`` (default
``~/.cache/funcoll-matrix``), made on first use and reused while its torch is the
release asked for: the registry's builds of the releases other than the pinned
2.13.0 are CUDA builds of several GB (they run on the CPU), so a venv is worth
keeping between runs. funcoll goes into each as an editable install of this
checkout, redone on every run. pip's machine-wide constraints cap torch at 2.14.1
here; the 2.15 install runs with ``PIP_CONSTRAINT`` pointed at an empty file.

The smoke run (:data:`SMOKE`) covers every public op eager and compiled: the
compile cases of ``compile_tests/_ops.py`` on aot_eager and inductor, every group
form, ``mark_ragged`` with one compile over changing lengths (and the ``min_size``
fallback where ``mark_unbacked`` has no ``min``), DTensor in and out, ``funcoll.lax``
and ``shard_map``, ``funcoll.moe`` (and torchtitan's MoE layer with funcoll's dispatcher,
where torchtitan supports the release), funcoll's Triton kernels under the release's own
triton's interpreter; then the demo. Each test lands in one column of
the support table (:data:`AREAS`) by its file and name. The results go to
``docs/results/matrix.json``; ``render`` writes the table into docs/support.md
from them, so the page says what the matrix ran, never what someone typed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "matrix.json"
PAGE = ROOT / "docs" / "support.md"
CACHE = Path(os.environ.get("FUNCOLL_MATRIX_CACHE", Path.home() / ".cache" / "funcoll-matrix"))
PINNED = "2.13.0"
RELEASES = ("2.11.0", "2.12.0", "2.14.1", "2.15.0")
# Releases newer than the machine-wide pip cap (torch<=2.14.1) install without it.
UNCAPPED = ("2.15.0",)
# What each release's venv gets beside torch (funcoll's own requirements come with `-e .`),
# and what it gets without dependencies: torchtitan's model code, as .ci/run installs it
# for the pinned release (tests/test_torchtitan.py skips before torch 2.12).
EXTRAS = ("pytest", "pytest-xdist", "hypothesis", "tyro")
# And numpy, which triton's interpreter needs (tests/test_kernels.py runs the kernels under
# TRITON_INTERPRET=1): "numpy", or the release's own requirement here. triton 3.6's (torch
# 2.11's) interpreter turns a kernel's scalar arguments into ints by int() of a one-element
# array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted").
NUMPY = {"2.11.0": "numpy<2.4"}
NO_DEPS = ("torchtitan==0.3.0", "spmd_types==0.2.3")

# The smoke run: whole files, so that the pinned release's row (read from the whole
# suite's report) counts the same tests.
SMOKE = (
    "tests/test_even.py",
    "tests/test_ragged.py",
    "tests/test_region.py",
    "tests/test_static.py",
    "tests/test_all_to_all_sizes.py",
    "tests/test_compat_even.py",
    "tests/test_compat_ragged.py",
    "compile_tests/test_fullgraph.py",
    "compile_tests/test_group_forms.py",
    "compile_tests/test_recompiles.py",
    "compile_tests/test_mark_ragged_min_size.py",
    "tests/test_dtensor.py",
    "compile_tests/test_dtensor_compile.py",
    "tests/test_lax.py",
    "compile_tests/test_lax_compile.py",
    "tests/test_moe.py",
    "compile_tests/test_moe_compile.py",
    "tests/test_torchtitan.py",
    "tests/test_kernels.py",
)
# Two files at a time, each whole in one worker (its batches launch their ranks once), as
# the README's test command runs the pinned release: a file's eager ranks leave a core idle.
XDIST = ("-n", "2", "--dist", "loadfile")
# Column -> (files, a pattern on the test's name that puts it there, or None for any).
# The first column that takes a test has it; "inductor" comes first so that the
# inductor tests of every file count there.
AREAS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "inductor": (
        ("compile_tests/test_fullgraph.py", "compile_tests/test_group_forms.py",
         "compile_tests/test_recompiles.py", "compile_tests/test_mark_ragged_min_size.py"),
        r"inductor",
    ),
    "eager": (
        ("tests/test_even.py", "tests/test_ragged.py", "tests/test_region.py", "tests/test_static.py",
         "tests/test_all_to_all_sizes.py", "tests/test_compat_even.py", "tests/test_compat_ragged.py"),
        None,
    ),
    "compiled (aot_eager)": (
        ("compile_tests/test_fullgraph.py", "compile_tests/test_group_forms.py",
         "compile_tests/test_recompiles.py", "compile_tests/test_mark_ragged_min_size.py"),
        None,
    ),
    "DTensor": (("tests/test_dtensor.py", "compile_tests/test_dtensor_compile.py"), None),
    "lax / shard_map": (("tests/test_lax.py", "compile_tests/test_lax_compile.py"), None),
    "moe": (("tests/test_moe.py", "compile_tests/test_moe_compile.py", "tests/test_torchtitan.py"), None),
    "Triton kernels": (("tests/test_kernels.py",), None),
}  # fmt: skip
# The columns in the order the page shows them.
COLUMNS = ("eager", "compiled (aot_eager)", "inductor", "DTensor", "lax / shard_map", "moe", "Triton kernels")


def venv_python(release: str) -> Path:
    """The python of `release`'s venv; the pinned release's is this python (its whole suite runs in CI)."""
    if release == PINNED:
        return Path(sys.executable)
    return CACHE / f"torch-{release}" / "bin" / "python"


def _pip_env(release: str) -> dict[str, str]:
    env = dict(os.environ)
    if release in UNCAPPED:
        empty = CACHE / "no-constraints.txt"
        empty.write_text("")
        env["PIP_CONSTRAINT"] = str(empty)
    return env


def _torch_version(python: Path) -> str | None:
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    return out.stdout.strip().split("+")[0] if out.returncode == 0 else None


def _extras(release: str) -> tuple[str, ...]:
    """EXTRAS and `release`'s numpy (:data:`NUMPY`)."""
    return (*EXTRAS, NUMPY.get(release, "numpy"))


def _install_extras(python: Path, release: str) -> None:
    """EXTRAS and NO_DEPS into a release's venv (quick when they are there already)."""
    for args in (_extras(release), ("--no-deps", *NO_DEPS)):
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *args],
            check=True, env=_pip_env(release), stdout=subprocess.DEVNULL,
        )  # fmt: skip


def install(release: str) -> str:
    """Make (or keep) the venv of `release`; return a line saying what was done."""
    python = venv_python(release)
    if _torch_version(python) == release:
        _install_extras(python, release)
        return f"torch {release}: kept {python.parent.parent}"
    if release == PINNED:
        raise SystemExit(f"matrix: this python has torch {_torch_version(python)}, not the pinned {PINNED}")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(python.parent.parent)], check=True)
    log = CACHE / f"install-{release}.log"
    with log.open("w") as f:
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", f"torch=={release}", *_extras(release)],
            check=True, stdout=f, stderr=subprocess.STDOUT, env=_pip_env(release),
        )  # fmt: skip
    _install_extras(python, release)
    got = _torch_version(python)
    if got != release:
        raise SystemExit(f"matrix: the venv of torch {release} has torch {got} (see {log})")
    return f"torch {release}: installed in {time.perf_counter() - start:.0f} s"


def _classify(file: str, name: str) -> str | None:
    for area, (files, pattern) in AREAS.items():
        if file in files and (pattern is None or re.search(pattern, name)):
            return area
    return None


def read_junit(*paths: Path) -> dict[str, dict[str, object]]:
    """Per column: passed, failed, skipped counts and the first failures' ids, from junit reports.

    A test in several reports counts once, as the last one has it (a rerun of a file).
    """
    cells: dict[str, dict[str, object]] = {
        a: {"passed": 0, "failed": 0, "skipped": 0, "failures": []} for a in AREAS
    }
    files = {f for fs, _ in AREAS.values() for f in fs}
    latest: dict[tuple[str, str], ET.Element] = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            latest[case.get("classname", ""), case.get("name", "")] = case
    for (classname, name), case in latest.items():
        # pytest's classname is the module's dotted path, then the class for a method.
        parts = classname.split(".")
        file = next((f for k in range(len(parts), 0, -1) if (f := "/".join(parts[:k]) + ".py") in files), "")
        area = _classify(file, name)
        if area is None:
            continue
        cell = cells[area]
        if case.find("failure") is not None or case.find("error") is not None:
            cell["failed"] += 1  # type: ignore[operator]
            failures = cell["failures"]
            assert isinstance(failures, list)
            if len(failures) < 5:
                failures.append(f"{file}::{name}")
        elif case.find("skipped") is not None:
            cell["skipped"] += 1  # type: ignore[operator]
        else:
            cell["passed"] += 1  # type: ignore[operator]
    return cells


def _load() -> dict[str, dict[str, object]]:
    """The recorded rows of the releases funcoll names (a release dropped from the list drops out)."""
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    return {r: row for r, row in rows.items() if r in (PINNED, *RELEASES)}


def _save(results: dict[str, dict[str, object]]) -> None:
    RESULTS.write_text(json.dumps(dict(sorted(results.items())), indent=1, sort_keys=True) + "\n")


def run(release: str, junit_dir: Path) -> dict[str, object]:
    """The demo and the smoke tests on `release`: its row of results."""
    python = venv_python(release)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)],
        check=True, env=_pip_env(release), stdout=subprocess.DEVNULL,
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The compile tests: every case, fewer variants (compile_tests/_ops.py, SMOKE).
    tests_env = dict(env, FUNCOLL_SMOKE="1")
    row: dict[str, object] = {"torch": _torch_version(python), "source": "smoke"}
    start = time.perf_counter()
    demo = subprocess.run(
        [str(python), "-m", "funcoll.demo", "--world", "2"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    flat = " ".join(demo.stdout.split())  # the demo's notes are wrapped
    ok_line = next((line for line in demo.stdout.splitlines() if line.startswith(("OK:", "MISMATCH"))), "")
    row["demo"] = {
        "ok": demo.returncode == 0,
        "seconds": round(time.perf_counter() - start),
        "route": next((m.group(1) for m in re.finditer(r"all_to_all went by (.+?)\. funcoll", flat)), None),
        "line": ok_line,
    }
    if demo.returncode != 0:
        tail = (demo.stdout + demo.stderr)[-3000:]
        print(f"matrix: the demo failed on torch {release}:\n{tail}", flush=True)
    junit, log = junit_dir / f"torch-{release}.xml", junit_dir / f"torch-{release}.log"
    start = time.perf_counter()
    with log.open("w") as f:  # the report as it goes: `tail -f` it to follow a release
        tests = subprocess.run(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *XDIST, f"--junitxml={junit}", *SMOKE],
            cwd=ROOT, env=tests_env, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    row["tests_seconds"] = round(time.perf_counter() - start)
    report = log.read_text().splitlines()
    summary = [line for line in report if line.strip()][-1:] or [""]
    demo_word = "ok" if demo.returncode == 0 else "FAILED"
    print(f"matrix: torch {release}: {summary[0]} (demo {demo_word})", flush=True)
    if tests.returncode != 0:
        print("\n".join(line for line in report if line.startswith(("FAILED", "ERROR"))), flush=True)
    row["cells"] = read_junit(junit) if junit.exists() else {}
    row["tests_ok"] = tests.returncode == 0
    return row


def statuses(text: str) -> dict[str, list[str]]:
    """Each release's row of a support table, as the first word of each cell ("yes", "NO", "-").

    What ``render --check`` compares: whether each column passed on each release.
    The counts beside the words are the last recorded run's, and the pinned row
    counts the whole suite in CI.
    """
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and re.match(r"\d+\.\d+\.\d+", cells[0]):
            rows[cells[0].split()[0]] = [c.split()[0] if c else "" for c in cells[1:]]
    return rows


def _mark(cell: dict[str, object]) -> str:
    passed, failed = cell["passed"], cell["failed"]
    if not passed and not failed:
        return "-"
    return f"{'yes' if not failed else 'NO'} ({passed}{f', {failed} failed' if failed else ''})"


def render(results: dict[str, dict[str, object]]) -> str:
    """The support table, from the results: one row per release."""
    head = ["torch", *COLUMNS, "demo"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for release in sorted(results, key=lambda r: tuple(int(p) for p in r.split("."))):
        row = results[release]
        cells = row["cells"]
        assert isinstance(cells, dict)
        demo = row.get("demo")
        demo_text = "-" if not isinstance(demo, dict) else "yes" if demo["ok"] else "NO"
        name = (
            f"{release} (pinned{': whole suite' if row.get('source') == 'whole suite' else ''})"
            if release == PINNED
            else release
        )
        lines.append("| " + " | ".join([name, *(_mark(cells[a]) for a in COLUMNS), demo_text]) + " |")
    routes = sorted({(r, row["demo"]["route"]) for r, row in results.items()
                     if isinstance(row.get("demo"), dict) and row["demo"]["route"]})  # type: ignore[index]  # fmt: skip
    notes = [f"- torch {r}: the demo's seed-style all_to_all went by {route}." for r, route in routes
             if not route.startswith("dist.all_to_all of lists")]  # fmt: skip
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


BEGIN, END = (
    "<!-- matrix:begin (docs/results/matrix.json, by .ci/matrix.py render) -->",
    "<!-- matrix:end -->",
)


def _page_with(table: str) -> str:
    text = PAGE.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table + text[stop:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("install", "run"):
        p = sub.add_parser(name)
        p.add_argument("--releases", nargs="*", default=list(RELEASES))
    sub.choices["run"].add_argument("--junit-dir", type=Path, default=CACHE / "junit")
    rec = sub.add_parser("record")
    rec.add_argument("junit", type=Path, nargs="+", help="reports; a later one's result of a test wins")
    rec.add_argument("--release", default=PINNED)
    rec.add_argument("--source", default=None, help='what ran, e.g. "whole suite" (default: as recorded)')
    ren = sub.add_parser("render")
    ren.add_argument("--check", action="store_true")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    if args.cmd == "install":
        with concurrent.futures.ThreadPoolExecutor(len(args.releases) or 1) as pool:
            for line in pool.map(install, args.releases):
                print(f"matrix: {line}", flush=True)
        return 0
    if args.cmd == "run":
        args.junit_dir.mkdir(parents=True, exist_ok=True)
        ok, passed, failed = True, 0, 0
        for release in args.releases:
            print(f"matrix: {install(release)}", flush=True)
            row = run(release, args.junit_dir)
            _save({**_load(), release: row})  # read again: another release's run may have written since
            ok &= bool(row["tests_ok"]) and bool(row["demo"]["ok"])  # type: ignore[index]
            for cell in row["cells"].values():  # type: ignore[attr-defined]
                passed, failed = passed + cell["passed"], failed + cell["failed"]
        print(f"matrix: {passed} passed, {failed} failed")  # every release's smoke tests together
        return 0 if ok else 1
    if args.cmd == "record":
        results = _load()
        cells = read_junit(*args.junit)
        row = results.get(args.release) or {"torch": args.release, "source": "whole suite"}
        row.update(cells=cells, tests_ok=not any(c["failed"] for c in cells.values()))
        if args.source:
            row["source"] = args.source
        _save({**results, args.release: row})
        return 0
    table = render(_load())
    if args.check:
        shown, got = statuses(PAGE.read_text()), statuses(table)
        if shown != got:
            print(f"matrix: {PAGE.relative_to(ROOT)} does not show these results; they give:\n{table}")
            return 1
        print(f"matrix: {PAGE.relative_to(ROOT)} shows what ran on torch {', '.join(sorted(got))}")
        return 0
    PAGE.write_text(_page_with(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
