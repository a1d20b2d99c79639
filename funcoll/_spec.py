"""One description per public op: what the rest of funcoll (and its tests and docs) knows about it.

Each :class:`OpSpec` says, for one name of ``funcoll.__all__``: the docs section
it belongs to (``docs/build_api.py`` builds docs/api.md from these), the header
its size exchange or cross-rank check carries (``_header.HEADERS``: arguments
that must agree, how the host ints are read, the op's own checks), what bounds
its counts (the static ops), where its compile test lives and which test
modules check it against single-process references. ``tests/test_specs.py``
fails when a public name has no spec, or a spec names no compile test, no docs
entry or no reference test: adding an op starts here (docs/contributing.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._header import HEADERS, Header

__all__ = ["FAMILIES", "SPECS", "OpSpec", "spec"]

# The docs sections, in the order docs/api.md shows them.
FAMILIES = (
    "Even collectives",
    "Ragged collectives",
    "Static-shape ragged collectives",
    "Region ops",
    "Groups and sizes",
    "Compiling",
    "Checks",
)
CASES = "compile_tests/_ops.py"  # the table of compiled cases (id prefix: the op name)


@dataclass(frozen=True)
class OpSpec:
    """What funcoll knows about one public op, in one place.

    `family`: its docs section. `header`: what its header carries (None: the op
    exchanges none). `limit`: for the static ops, what bounds each count (their
    error messages say it). `compiled_in`: the compile test that compiles it: the
    case table (``compile_tests/_ops.py``, a case id starting with `case`), a
    module of its own, or None for a setting read outside compiled code. `tests`: the test modules that check it against
    single-process references.
    """

    name: str
    family: str
    tests: tuple[str, ...]
    header: Header | None = None
    limit: str | None = None
    compiled_in: str | None = CASES
    case: str = ""  # the case id prefix in compile_tests/_ops.py; the name when empty

    @property
    def case_prefix(self) -> str:
        return self.case or self.name


def _op(name: str, family: str, *tests: str, exchanges: bool = True, **kw: object) -> OpSpec:
    """A spec whose header, if it exchanges one, is ``HEADERS[name]``."""
    return OpSpec(name, family, tuple(tests), HEADERS[name] if exchanges else None, **kw)  # type: ignore[arg-type]


_EVEN, _RAGGED, _STATIC, _REGION = FAMILIES[:4]
_T_EVEN, _T_RAGGED, _T_REGION = "tests/test_even.py", "tests/test_ragged.py", "tests/test_region.py"

SPECS: tuple[OpSpec, ...] = (
    _op("all_gather", _EVEN, _T_EVEN, "tests/test_checks.py"),
    _op("all_gather_into_tensor", _EVEN, _T_EVEN),
    _op("reduce_scatter", _EVEN, _T_EVEN, _T_RAGGED, "tests/test_sizes.py"),
    _op("all_reduce", _EVEN, _T_EVEN),
    _op("all_to_all", _EVEN, _T_EVEN, "tests/test_all_to_all_sizes.py", "tests/test_sizes.py"),
    _op("ppermute", _EVEN, _T_EVEN),
    _op("broadcast", _EVEN, _T_EVEN),
    _op("gather", _RAGGED, _T_RAGGED, "tests/test_ragged_errors.py"),
    _op("all_gather_list", _RAGGED, _T_RAGGED),
    _op("all_gather_ragged", _RAGGED, _T_RAGGED),
    _op("all_to_all_v", _RAGGED, _T_RAGGED, "tests/test_sizes.py"),
    _op("gather_padded", _STATIC, "tests/test_static.py", exchanges=False, limit="x.shape[dim]"),
    _op("all_to_all_padded", _STATIC, "tests/test_static.py", exchanges=False, limit="x.shape[dim] // world"),
    _op("split_forward_gather_backward", _REGION, _T_REGION),
    _op("gather_forward_split_backward", _REGION, _T_REGION),
    _op("axis_index", "Groups and sizes", "tests/test_group.py", exchanges=False),
    _op("axis_size", "Groups and sizes", "tests/test_group.py", exchanges=False, case="axis_index"),
    _op(
        "split_sizes",
        "Groups and sizes",
        "tests/test_all_to_all_sizes.py",
        exchanges=False,
        compiled_in="tests/clients/test_clients.py",
    ),
    _op(
        "mark_ragged",
        "Compiling",
        "compile_tests/test_recompiles.py",
        exchanges=False,
        compiled_in="compile_tests/test_downstream.py",
    ),
    _op(
        "set_checks",
        "Checks",
        "tests/test_checks.py",
        exchanges=False,
        compiled_in="compile_tests/test_checked_ops.py",
    ),
    _op("checks_enabled", "Checks", "tests/test_checks.py", exchanges=False, compiled_in=None),
)
_BY_NAME = {s.name: s for s in SPECS}


def spec(name: str) -> OpSpec:
    """The spec of public op `name` (without the ``funcoll.`` prefix)."""
    return _BY_NAME[name.removeprefix("funcoll.")]
