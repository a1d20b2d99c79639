"""docs/errors.md lists exactly the error messages funcoll's code writes.

docs/build_errors.py reads every module under funcoll/ with `ast` and gives each
message as a template (``funcoll.<op>`` for the op, ``…`` for each value); the
page's tables hold one row per template: the template in double backticks, the
error, the ops that raise it, the cause and fix. A message added to the code
without a row, a row whose message the code no longer writes, and a raise whose
message the extractor cannot read (and that is not listed with a reason) all fail
here, with the rows to paste. One process, no ranks: about a second.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGE = DOCS / "errors.md"
# A table row whose first cell is a template: | `` template `` | error | raised by | cause and fix |
ROW = re.compile(r"^\|\s*`` (?P<template>.+?) ``\s*\|(?P<kind>[^|]*)\|(?P<ops>[^|]*)\|(?P<cause>.*)\|\s*$")
# What the error column must say for each kind of site.
KIND_WORDS = {
    "device assert": "device assert",
    "compiled check": "compiled check",
    "backend's type": "backend's type",
}


@cache
def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_errors", DOCS / "build_errors.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while they are built
    spec.loader.exec_module(mod)
    return mod


@cache
def _scan():  # type: ignore[no-untyped-def]
    return _builder().scan()


def _rows() -> dict[str, list[dict[str, str]]]:
    """The page's template rows, by template (`\\|` in a cell is a literal `|`)."""
    rows: dict[str, list[dict[str, str]]] = {}
    for line in PAGE.read_text().splitlines():
        m = ROW.match(line.replace("\\|", "\x00"))
        if m:
            row = {k: v.replace("\x00", "|").strip() for k, v in m.groupdict().items()}
            rows.setdefault(row["template"], []).append(row)
    return rows


def _by_template() -> dict[str, list]:  # type: ignore[type-arg]
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for site in _scan().sites:
        out.setdefault(site.template, []).append(site)
    return out


def _suggested_row(template: str, sites: list) -> str:  # type: ignore[type-arg]
    kinds = ", ".join(sorted({s.kind for s in sites}))
    ops = ", ".join(sorted({f"`{s.op.removeprefix('funcoll.')}`" for s in sites if s.op})) or "?"
    where = ", ".join(f"{s.path}:{s.line}" for s in sites)
    return f"| `` {template} `` | {kinds} | {ops} | cause and fix ({where}) |"


def test_every_raise_is_read() -> None:
    problems = _scan().problems
    assert not problems, "docs/build_errors.py could not read these sites:\n" + "\n".join(problems)


def test_enough_templates_are_read() -> None:
    # A guard on the extractor itself: a change that made it read nothing would pass the tests below.
    assert len(_by_template()) >= 100, len(_by_template())


def test_every_message_is_documented() -> None:
    rows = _rows()
    missing = {t: s for t, s in _by_template().items() if t not in rows}
    assert not missing, (
        f"docs/errors.md lacks {len(missing)} error message(s) the code writes; add a row for each "
        f"(in the section of its kind) and say what causes it and how to fix it:\n"
        + "\n".join(_suggested_row(t, s) for t, s in missing.items())
    )


def test_no_stale_entries() -> None:
    produced = _by_template()
    stale = [t for t in _rows() if t not in produced]
    assert not stale, (
        "docs/errors.md documents message(s) the code no longer writes; update or remove these rows "
        "(`python docs/build_errors.py` prints the current templates):\n"
        + "\n".join(f"`` {t} ``" for t in stale)
    )


def test_each_message_is_documented_once() -> None:
    twice = [t for t, rows in _rows().items() if len(rows) > 1]
    assert not twice, "documented in more than one row:\n" + "\n".join(twice)


def test_rows_name_the_error_and_the_ops() -> None:
    rows = _rows()
    wrong = []
    for template, sites in _by_template().items():
        if template not in rows:
            continue  # test_every_message_is_documented reports it
        row = rows[template][0]
        for site in sites:
            word = KIND_WORDS.get(site.kind, site.kind)
            if word not in row["kind"]:
                wrong.append(
                    f"`` {template} ``: the error column should say {word!r} ({site.path}:{site.line})"
                )
            op = site.op.removeprefix("funcoll.")
            if op and op not in row["ops"]:
                wrong.append(
                    f"`` {template} ``: the raised-by column should name `{op}` ({site.path}:{site.line})"
                )
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_an_unreadable_message_is_reported(tmp_path: Path) -> None:
    """A raise whose message the extractor cannot read fails `test_every_raise_is_read`, not silently."""
    package = tmp_path / "funcoll"
    package.mkdir()
    (package / "_new.py").write_text(
        "def op(x, opname='funcoll.op'):\n"
        "    if x is None:\n"
        "        raise ValueError(f'{opname}: `x` is None')\n"
        "    if x == 1:\n"
        "        raise ValueError(_describe(x))\n"
        "    raise TypeError\n"
    )
    result = _builder().scan(package)
    assert [s.template for s in result.sites] == ["funcoll.<op>: `x` is None"]
    assert len(result.problems) == 2 + len(_builder().UNEXTRACTABLE) + len(_builder().EXCLUDED), (
        result.problems
    )
    assert any("funcoll/_new.py:5 (op): cannot read" in p and "_describe" in p for p in result.problems)
    assert any("funcoll/_new.py:6 (op): cannot read" in p for p in result.problems)


def test_the_page_is_linked() -> None:
    assert "errors.md" in (DOCS / "index.md").read_text()
    assert "errors.md" in (DOCS / "contributing.md").read_text()
