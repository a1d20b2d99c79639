"""The release matrix (.ci/matrix.py): its report reading, and docs/support.md in step with its results.

CI runs the matrix itself (``.ci/run``); here, in one process and no ranks, the
parts that decide what the support page says: which column a test lands in,
what a junit report counts, that the page shows the committed results, that those
cover every release the project names and no other, and that the floor the
packaging states is the oldest release the matrix runs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


@cache
def _matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("funcoll_matrix", ROOT / ".ci" / "matrix.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="compile_tests.test_fullgraph" name="test_inductor_matches_eager_and_reference[gather-dynamic=None]" />
<testcase classname="compile_tests.test_fullgraph" name="test_aot_eager_fullgraph_matches_eager_and_reference[w2-gather]">
  <failure message="boom">trace</failure></testcase>
<testcase classname="compile_tests.test_fullgraph" name="test_explain_reports_no_graph_break[w2-gather]" />
<testcase classname="tests.test_even" name="test_all_gather[w3]" />
<testcase classname="tests.test_even" name="test_skipped[w3]"><skipped message="no" /></testcase>
<testcase classname="tests.test_moe" name="test_dispatch[w2]"><error message="setup">trace</error></testcase>
<testcase classname="tests.test_benchmarks" name="test_not_in_the_matrix" />
</testsuite></testsuites>
"""


def test_junit_cells_count_each_test_once_in_its_column(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(JUNIT)
    cells = _matrix().read_junit(report)
    assert cells["inductor"] == {"passed": 1, "failed": 0, "skipped": 0, "failures": []}
    assert cells["compiled (aot_eager)"]["passed"] == 1
    assert cells["compiled (aot_eager)"]["failures"] == [
        "compile_tests/test_fullgraph.py::test_aot_eager_fullgraph_matches_eager_and_reference[w2-gather]"
    ]
    assert cells["eager"] == {"passed": 1, "failed": 0, "skipped": 1, "failures": []}
    assert cells["moe"]["failed"] == 1
    assert sum(c["passed"] + c["failed"] + c["skipped"] for c in cells.values()) == 6  # test_benchmarks: none


def test_render_marks_a_failed_column_and_an_unrun_one() -> None:
    m = _matrix()
    cells = {a: {"passed": 3, "failed": 0, "skipped": 0, "failures": []} for a in m.AREAS}
    cells["moe"] = {"passed": 2, "failed": 1, "skipped": 0, "failures": ["x"]}
    cells["DTensor"] = {"passed": 0, "failed": 0, "skipped": 4, "failures": []}
    table = m.render({"2.11.0": {"torch": "2.11.0", "cells": cells, "demo": {"ok": False, "route": None}}})
    row = next(line for line in table.splitlines() if line.startswith("| 2.11.0"))
    assert "NO (2, 1 failed)" in row and "yes (3)" in row and "| - |" in row and row.endswith("| NO |")


def test_every_smoke_file_has_a_column_and_exists() -> None:
    m = _matrix()
    columns = {f for files, _ in m.AREAS.values() for f in files}
    assert set(m.SMOKE) == columns
    assert all((ROOT / f).exists() for f in m.SMOKE)


def test_support_page_shows_the_committed_results() -> None:
    m = _matrix()
    page = m.PAGE.read_text()
    assert page == m._page_with(m.render(m._load())), "run `python .ci/matrix.py render`"


def test_results_hold_every_named_release_and_no_other() -> None:
    m = _matrix()
    rows = json.loads(m.RESULTS.read_text())
    assert set(rows) == {m.PINNED, *m.RELEASES}, "the support table must have a row per release funcoll names"


@pytest.mark.parametrize("where", ["pyproject.toml", "README.md", "docs/support.md"])
def test_the_stated_floor_is_the_oldest_release_the_matrix_runs(where: str) -> None:
    m = _matrix()
    oldest = min([m.PINNED, *m.RELEASES], key=lambda r: tuple(int(p) for p in r.split(".")))
    floor = ".".join(oldest.split(".")[:2])
    text = (ROOT / where).read_text()
    if where == "pyproject.toml":
        deps = tomllib.loads(text)["project"]["dependencies"]
        assert f"torch>={floor}" in deps
    else:
        newest = max([m.PINNED, *m.RELEASES], key=lambda r: tuple(int(p) for p in r.split(".")))
        assert re.search(rf"torch {re.escape(floor)} to {re.escape('.'.join(newest.split('.')[:2]))}", text)
