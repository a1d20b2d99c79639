"""Every public op is defined once (its function under ``@entry``), and everything its definition names exists.

The definition registers the op's spec (``funcoll/_ops/_spec.py``) and its header;
these tests fail when an op in ``funcoll.__all__`` has no spec, its spec names no
docs section, it has no row in the tests' own table (``tests/_op_tests.py``: its
compile test and reference tests, which must exist and mention it), or a header
belongs to no op. docs/contributing.md walks through the steps these tests check.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest
from _op_tests import CASE_PREFIX, CASES, COMPILED_IN, TESTS

import funcoll
from funcoll._collective._header import HEADERS
from funcoll._ops._spec import FAMILIES, OpSpec, specs

ROOT = Path(__file__).resolve().parents[1]
NOT_OPS = {"Group", "GroupLike", "P", "Wire"}  # types, not ops
PUBLIC = sorted(n for n in funcoll.__all__ if n not in NOT_OPS)
SPECS = specs()


def _case_ids() -> list[str]:
    sys.path.insert(0, str(ROOT / "compile_tests"))
    try:
        return [c.id for c in importlib.import_module("_ops").CASES]
    finally:
        sys.path.pop(0)


def test_every_public_op_has_exactly_one_spec() -> None:
    names = [s.name for s in SPECS]
    assert len(names) == len(set(names)), "an op with two specs"
    assert sorted(names) == PUBLIC, (
        f"public ops without a spec: {sorted(set(PUBLIC) - set(names))}; "
        f"specs of no public op: {sorted(set(names) - set(PUBLIC))}"
    )


def test_every_header_belongs_to_an_op() -> None:
    used = {s.header.name for s in SPECS if s.header is not None}
    used |= {f"moe.{n}" for n in ("dispatch", "combine") if f"moe.{n}" in HEADERS}  # outside __all__
    # "collective" is no op's: the header every data collective sends under checks
    assert used | {"collective"} == set(HEADERS), f"headers no spec uses: {sorted(set(HEADERS) - used)}"
    for s in SPECS:
        assert s.header is None or HEADERS[s.name] is s.header, s.name


def test_every_op_that_exchanges_sizes_declares_its_header() -> None:
    """An op whose collectives start with a size exchange (or that checks across ranks) declares its header."""
    for s in SPECS:
        if s.collectives is None or s.family == "Groups and sizes":
            continue
        assert s.header is not None, f"funcoll.{s.name}: its definition declares no header"


def test_every_public_op_has_a_row_in_the_tests_table() -> None:
    assert sorted(TESTS) == PUBLIC, (
        f"no row in tests/_op_tests.py for {sorted(set(PUBLIC) - set(TESTS))}; "
        f"rows of no public op: {sorted(set(TESTS) - set(PUBLIC))}"
    )
    assert set(COMPILED_IN) <= set(PUBLIC) and set(CASE_PREFIX) <= set(PUBLIC)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_spec_names_a_docs_entry_a_compile_test_and_reference_tests(spec: OpSpec) -> None:
    assert spec.family in FAMILIES, spec.family
    api = (ROOT / "docs" / "api.md").read_text()
    assert f"### `funcoll.{spec.name}(" in api, (
        f"{spec.name}: no entry in docs/api.md (python docs/build_api.py)"
    )
    compiled_in = COMPILED_IN.get(spec.name, CASES)
    if compiled_in == CASES:
        prefix = CASE_PREFIX.get(spec.name, spec.name)
        ids = [i for i in _case_ids() if i.startswith(prefix + "-")]
        assert ids, f"{spec.name}: no case in {CASES} whose id starts with {prefix!r}"
    elif compiled_in is not None:
        text = (ROOT / compiled_in).read_text()
        assert spec.name in text, f"{spec.name}: {compiled_in} does not compile it"
    tests = TESTS.get(spec.name, ())
    assert tests, f"{spec.name}: no reference test in tests/_op_tests.py"
    for module in tests:
        path = ROOT / module
        assert path.is_file(), f"{spec.name}: {module} does not exist"
        assert spec.name in path.read_text(), f"{spec.name}: {module} never mentions it"


@pytest.mark.parametrize(
    "spec",
    [s for s in SPECS if s.collectives is not None and s.family != "Groups and sizes"],
    ids=lambda s: s.name,
)
def test_every_communicating_op_names_itself_in_collective_failures(spec: OpSpec) -> None:
    """``@public_op`` (funcoll/_collective/_faults.py): a collective that fails in eager code names this op."""
    fn = getattr(funcoll, spec.name)
    assert getattr(fn, "funcoll_op", None) == spec.name, (
        f"funcoll.{spec.name} is not decorated with @public_op({spec.name!r})"
    )


@pytest.mark.parametrize(
    "spec",
    [s for s in SPECS if s.collectives is not None and s.family != "Groups and sizes"],
    ids=lambda s: s.name,
)
def test_every_communicating_op_enters_through_its_declared_entry(spec: OpSpec) -> None:
    """``@entry`` (funcoll/_ops/_entry.py): the op's tensor checks, DTensor rule and group, declared once.

    An op says what a DTensor `x` does: its placement rule, or why it is refused;
    and the DTensor table of the docs (the spec's `placements`) names exactly the ops
    whose entry has a rule (from_ragged makes a DTensor from plain pieces: it
    refuses one as input).
    """
    entry = getattr(getattr(funcoll, spec.name), "funcoll_entry", None)
    assert entry is not None, f"funcoll.{spec.name} is not decorated with @entry (funcoll/_ops/_entry.py)"
    assert entry.name == spec.name
    assert entry.dtensor is not None or entry.refuse is not None, (
        f"funcoll.{spec.name}: its @entry says neither how a DTensor `x` is refused nor its placement rule"
    )
    takes_dtensor = spec.placements is not None and spec.name != "from_ragged"
    assert (entry.dtensor is not None) == takes_dtensor, (
        f"funcoll.{spec.name}: the spec's DTensor placements ({spec.placements}) and the entry's rule "
        f"({entry.dtensor}) disagree"
    )


def test_every_moe_op_enters_through_its_declared_entry() -> None:
    from funcoll import moe

    for name in ("dispatch", "combine"):
        entry = getattr(getattr(moe, name), "funcoll_entry", None)
        assert entry is not None and entry.name == f"moe.{name}", name
        assert entry.refuse is not None, name


def test_every_compat_helper_names_itself_in_collective_failures() -> None:
    from funcoll import compat

    for name in compat.__all__:
        assert getattr(getattr(compat, name), "funcoll_op", None) == f"compat.{name}", name


def test_every_moe_op_names_itself_in_collective_failures() -> None:
    from funcoll import moe

    for name in ("dispatch", "combine"):
        assert getattr(getattr(moe, name), "funcoll_op", None) == f"moe.{name}", name


def test_the_readme_ops_table_has_every_public_op() -> None:
    """README.md's ops table: a row for every public op, and none for a name that is not one."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| op | forward | backward |") :].split("\n\n", 1)[0]
    named = set()
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        named |= {call.split("(")[0] for call in re.findall(r"`(\w+\([^`]*\))`", first)}
    ops = {s.name for s in SPECS}
    assert ops <= named, f"README.md's ops table has no row for {sorted(ops - named)}"
    assert named <= ops, f"README.md's ops table names {sorted(named - ops)}, no public op"


def _opname_literals() -> list[tuple[str, str, str | None]]:
    """Every ``opname = "funcoll.x"`` in the package: (where, the name, the @entry name of its function or None)."""
    found = []
    for path in sorted(Path(funcoll.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            named = None
            for dec in fn.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "entry" and dec.args:
                    named = f"funcoll.{ast.literal_eval(dec.args[0])}"
            for node in ast.walk(fn):
                if not isinstance(node, ast.Assign) or not isinstance(node.value, (ast.Constant, ast.Tuple)):
                    continue
                targets = node.targets[0]
                names = targets.elts if isinstance(targets, ast.Tuple) else [targets]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for t, v in zip(names, values, strict=False):
                    if getattr(t, "id", None) == "opname" and isinstance(v, ast.Constant):
                        found.append((f"{path.name}:{node.lineno} {fn.name}", v.value, named))
    return found


def test_an_op_spells_its_name_once_and_its_helpers_are_given_it() -> None:
    """An op's body names itself as its @entry does; no helper respells an op's name (the op passes it)."""
    literals = _opname_literals()
    assert literals, "the scan found no opname at all: it no longer reads the package"
    entry_ops = {f"funcoll.{s.name}" for s in SPECS} | {"funcoll.moe.dispatch", "funcoll.moe.combine"}
    for where, name, named in literals:
        if named is not None:
            assert name == named, f"{where}: opname {name!r} in the body of @entry({named!r})"
        elif name in entry_ops:  # an op outside @entry (split_sizes, mark_ragged) names itself
            fn = where.split()[-1]
            assert name.endswith(f".{fn}"), f"{where}: a helper spells {name!r}; pass it the op's opname"
