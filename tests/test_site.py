"""The docs site builds with warnings as errors, covers every public name, and its snippets run.

``mkdocs build --strict`` renders docs/ with the docstrings pulled in by
mkdocstrings (``::: funcoll.gather``) and the snippets included from
docs/snippets/ and examples/. The migration guides' before/after pairs and the
getting-started program run here on 2 gloo ranks, in one launch.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import funcoll
import funcoll.compat
from funcoll._ops._spec import specs
from funcoll.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
MIGRATIONS = sorted(SNIPPETS.glob("migrate_*.py"))
DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)
INCLUDE = re.compile(r'--8<-- "([^":]+)(?::(\w+))?"')

pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra: pip install -e '.[docs]'")


def _pages() -> dict[str, str]:
    return {p.relative_to(DOCS).as_posix(): p.read_text() for p in DOCS.rglob("*.md")}


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"funcoll_docs_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    html = (tmp_path / "site" / "reference" / "ragged" / "index.html").read_text()
    assert 'id="funcoll.gather"' in html, "mkdocstrings rendered no docstring"


def test_every_page_is_in_the_nav() -> None:
    """mkdocs only logs a page left out of the nav; here it fails."""
    import yaml

    config = (ROOT / "mkdocs.yml").read_text()
    nav = yaml.safe_load(config.split("\nplugins:")[0].split("\nmarkdown_extensions:")[0])["nav"]

    def walk(items: Any) -> list[str]:
        if isinstance(items, str):
            return [items]
        if isinstance(items, list):
            return [p for i in items for p in walk(i)]
        return [p for v in items.values() for p in walk(v)]

    listed = set(walk(nav)) | {"api.md"}  # api.md: generated, linked from the home page (not_in_nav)
    assert set(_pages()) == listed, "add the page to mkdocs.yml's nav (or remove it from there)"


def test_every_public_name_has_one_reference_entry() -> None:
    """Every name of funcoll.__all__ and funcoll.compat.__all__ is rendered once, on the page of its family."""
    where: dict[str, list[str]] = {}
    for page, text in _pages().items():
        for name in DIRECTIVE.findall(text):
            where.setdefault(name, []).append(page)
    wanted = {f"funcoll.{n}" for n in funcoll.__all__} | {
        f"funcoll.compat.{n}" for n in funcoll.compat.__all__
    }
    missing = sorted(wanted - set(where))
    assert not missing, f"no `::: name` entry in docs/reference/ for {missing}"
    twice = {n: p for n, p in where.items() if n in wanted and len(p) > 1}
    assert not twice, twice
    family_pages: dict[str, set[str]] = {}
    for s in specs():
        family_pages.setdefault(s.family, set()).update(where[f"funcoll.{s.name}"])
    split = {f: p for f, p in family_pages.items() if len(p) > 1}
    assert not split, f"one page per op family: {split}"


def test_every_snippet_section_is_shown() -> None:
    """Each `[start:name]` section of a snippet file is on some page (included, or written out as it
    is: tests/test_snippets.py checks those), and every include resolves."""
    pages = _pages()
    included = {(path, section) for text in pages.values() for path, section in INCLUDE.findall(text)}
    for path, section in included:
        assert (ROOT / path).is_file(), path
        if section:
            assert f"[start:{section}]" in (ROOT / path).read_text(), (path, section)
    for f in SNIPPETS.glob("*.py"):
        rel = f.relative_to(ROOT).as_posix()
        text = f.read_text()
        for section in re.findall(r"\[start:(\w+)\]", text):
            body = text.split(f"[start:{section}]\n", 1)[1].split("# --8<-- [end:", 1)[0].strip()
            block = f"```python\n{body}\n```"
            indented = textwrap.indent(block, "    ", lambda line: True)  # in an admonition
            written_out = any(block in page or indented in page for page in pages.values())
            assert (rel, section) in included or written_out, f"{rel}:{section} is on no page"


def _run_docs(rank: int, world: int, paths: list[str]) -> dict[str, Any]:
    warnings.simplefilter("ignore", FutureWarning)  # torch.distributed.nn.functional is deprecated in 2.13
    out: dict[str, Any] = {"getting_started": _load(SNIPPETS / "getting_started.py").step(rank, world)}
    for path in paths:
        for name, (before, after) in _load(Path(path)).PAIRS.items():
            out[f"{Path(path).stem}: {name}"] = (before(rank, world), after(rank, world))
    return out


def test_snippets_run_and_before_equals_after() -> None:
    """One launch of 2 ranks: every migration pair gives the same values and gradients before and after."""
    results = run_ranks(_run_docs, 2, [str(p) for p in MIGRATIONS], timeout=120)
    pairs = 0
    for rank, result in enumerate(results):
        for name, value in result.items():
            if name == "getting_started":
                continue
            before, after = value
            torch.testing.assert_close(after, before, msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
            pairs += 1
    assert pairs == 2 * sum(len(_load(p).PAIRS) for p in MIGRATIONS) and pairs >= 2 * 4 * 2

    printed = "\n".join(f"{rank} {r['getting_started']}" for rank, r in enumerate(results))
    assert printed in (DOCS / "getting-started.md").read_text(), printed


def test_migration_snippets_call_funcoll_after_and_not_before() -> None:
    """The "after" of each pair uses funcoll; the "before", wherever it runs on gloo, does not."""
    for path in MIGRATIONS:
        for name, (before, after) in _load(path).PAIRS.items():
            assert "funcoll." in inspect.getsource(after), (path.name, name)
            assert "funcoll." not in inspect.getsource(before), (path.name, name)
