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

from collections.abc import Callable
from dataclasses import dataclass, field

from .._base._strategy import resolve
from .._collective._header import HEADERS, Header

__all__ = ["FAMILIES", "SPECS", "OpSpec", "Plan", "spec"]

# The docs sections, in the order docs/api.md shows them.
FAMILIES = (
    "Even collectives",
    "Ragged collectives",
    "Static-shape ragged collectives",
    "Region ops",
    "DTensor",
    "Groups and sizes",
    "Compiling",
    "Checks",
    "JAX's shard_map",
    "Overlap",
)
CASES = "compile_tests/_ops.py"  # the table of compiled cases (id prefix: the op name)


# The _c10d_functional collectives, named as compiled graphs show them.
AG, RS, AR, A2A, BC = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
)
# What one call issues at a world size: (forward, backward) counts of each
# collective; backward None when nothing there requires grad.
Plan = tuple[dict[str, int], dict[str, int] | None]
HEADER = {AG: 1}  # the size exchange: one small all_gather


def _plus(*counts: dict[str, int]) -> dict[str, int]:
    return {k: sum(c.get(k, 0) for c in counts) for c in counts for k in c}


def _rows(world: int, strategy: str = "auto") -> Plan:
    """A ragged all-gather after its size header: "a2a" is one all_to_all (backward: one
    all_to_all, the ragged reduce_scatter); "pad" one all_gather of padded blocks
    (backward: its reduce_scatter); "shift" one all_gather of the common rows and
    world - 1 all_to_alls (backward: one all_to_all)."""
    strategy = resolve(strategy, world)
    if strategy == "a2a":
        return {A2A: 1}, {A2A: 1}
    if strategy == "pad":
        return {AG: 1}, {RS: 1}
    return {AG: 1, A2A: world - 1}, {A2A: 1}


def _fixed(fw: dict[str, int], bw: dict[str, int] | None) -> Callable[[int, str], Plan]:
    return lambda world, variant: (fw, bw)


def _ragged_gather(world: int, variant: str) -> Plan:
    """gather, all_gather_list, all_gather_ragged: the header, then the rows; variant: the strategy, "dst" or "given"."""
    if variant == "dst":  # one all_to_all to dst; no backward (inputs may not require grad)
        return _plus(HEADER, {A2A: 1}), None
    if variant == "given":  # `sizes` passed in: no header
        return _rows(world)
    fw, bw = _rows(world, variant or "auto")
    return _plus(HEADER, fw), bw


def _reduce_scatter(world: int, variant: str) -> Plan:
    if variant == "sizes":  # the ragged one: one all_to_all; backward a ragged all-gather
        return {A2A: 1}, _rows(world)[0]
    return {RS: 1}, {AG: 1}


def _all_to_all_v(world: int, variant: str) -> Plan:
    """variant "given": recv_sizes passed, nothing exchanged; else the sizes travel in a header."""
    return ({A2A: 1} if variant == "given" else _plus(HEADER, {A2A: 1})), {A2A: 1}


def _scatter(world: int, variant: str) -> Plan:
    """`src`'s length in a header, then one all_to_all from src (backward: one back to src); "given": no header."""
    return ({A2A: 1} if variant == "given" else _plus(HEADER, {A2A: 1})), {A2A: 1}


@dataclass(frozen=True)
class OpSpec:
    """What funcoll knows about one public op, in one place.

    `family`: its docs section. `header`: what its header carries (None: the op
    exchanges none). `limit`: for the static ops, what bounds each count (their
    error messages say it). `compiled_in`: the compile test that compiles it: the
    case table (``compile_tests/_ops.py``, a case id starting with `case`), a
    module of its own, or None for a setting read outside compiled code.
    `collectives`: ``(world, variant) -> (forward, backward)`` counts of each
    ``_c10d_functional`` collective one call issues, with checks off: what the
    graph tests and the fake-group traces expect; None for what issues none. `tests`: the test modules that check it against
    single-process references. `dtensor`: what a DTensor argument must be on the
    mesh dim the op acts on, and what the result is there (docs/dtensor.md's
    table); None when the op takes no DTensor (its result has no placement).
    """

    name: str
    family: str
    tests: tuple[str, ...]
    header: Header | None = None
    limit: str | None = None
    compiled_in: str | None = CASES
    case: str = ""  # the case id prefix in compile_tests/_ops.py; the name when empty
    collectives: Callable[[int, str], Plan] | None = field(default=None, compare=False)
    dtensor: tuple[str, str] | None = None

    def plan(self, world: int, variant: str = "") -> Plan:
        """The collectives one call issues at `world` ranks (`variant`: the op's argument set)."""
        if self.collectives is None:
            raise ValueError(f"funcoll.{self.name} issues no collectives")
        return self.collectives(world, variant)

    @property
    def case_prefix(self) -> str:
        return self.case or self.name


def _op(name: str, family: str, *tests: str, exchanges: bool = True, **kw: object) -> OpSpec:
    """A spec whose header, if it exchanges one, is ``HEADERS[name]``."""
    return OpSpec(name, family, tuple(tests), HEADERS[name] if exchanges else None, **kw)  # type: ignore[arg-type]


_EVEN, _RAGGED, _STATIC, _REGION, _DTENSOR = FAMILIES[:5]
_T_EVEN, _T_RAGGED, _T_REGION = "tests/test_even.py", "tests/test_ragged.py", "tests/test_region.py"

_EVEN_AG, _EVEN_RS = _fixed({AG: 1}, {RS: 1}), _fixed({RS: 1}, {AG: 1})
_A2A = _fixed({A2A: 1}, {A2A: 1})
_NONE = _fixed({}, {})  # traced, but no collective
_S_R, _T_DT = ("Shard(dim)", "Replicate()"), "tests/test_dtensor.py"
_DT_COMPILED = "compile_tests/test_dtensor_compile.py"
_GROUPS, _COMPILING, _CHECKS, _JAX, _OVERLAP = FAMILIES[5:]

SPECS: tuple[OpSpec, ...] = (
    _op("all_gather", _EVEN, _T_EVEN, "tests/test_checks.py", _T_DT, collectives=_EVEN_AG, dtensor=_S_R),
    _op("all_gather_into_tensor", _EVEN, _T_EVEN, collectives=_EVEN_AG),
    _op("reduce_scatter", _EVEN, _T_EVEN, _T_RAGGED, "tests/test_sizes.py", _T_DT, collectives=_reduce_scatter,
        dtensor=("Partial(op)", "Shard(dim)")),
    _op("all_reduce", _EVEN, _T_EVEN, _T_DT, collectives=_fixed({AR: 1}, {AR: 1}),
        dtensor=("Partial(op)", "Replicate()")),
    _op("all_to_all", _EVEN, _T_EVEN, "tests/test_all_to_all_sizes.py", "tests/test_sizes.py", _T_DT,
        collectives=_A2A, dtensor=("Shard(gather_dim)", "Shard(scatter_dim)")),
    _op("ppermute", _EVEN, _T_EVEN, _T_DT, collectives=_A2A, dtensor=("Shard(d), equal shards", "Shard(d)")),
    _op("broadcast", _EVEN, _T_EVEN, _T_DT, collectives=_fixed({BC: 1}, {AR: 1}),
        dtensor=("Replicate()", "Replicate()")),
    _op("reduce", _EVEN, _T_EVEN, "tests/test_properties.py", collectives=_fixed({AR: 1}, {BC: 1})),
    _op("gather", _RAGGED, _T_RAGGED, "tests/test_ragged_errors.py", _T_DT, collectives=_ragged_gather,
        dtensor=("Shard(dim), dst=None", "Replicate()")),
    _op("all_gather_list", _RAGGED, _T_RAGGED, collectives=_ragged_gather),
    _op("all_gather_ragged", _RAGGED, _T_RAGGED, _T_DT, collectives=_ragged_gather, dtensor=_S_R),
    _op("scatter", _RAGGED, "tests/test_properties.py", "tests/test_ragged_errors.py", collectives=_scatter),
    _op("all_to_all_v", _RAGGED, _T_RAGGED, "tests/test_sizes.py", collectives=_all_to_all_v),
    _op("gather_padded", _STATIC, "tests/test_static.py", exchanges=False, limit="x.shape[dim]",
        collectives=_fixed({AG: 1}, {RS: 1})),  # the padded rows, the counts header's rows after them
    _op("all_to_all_padded", _STATIC, "tests/test_static.py", exchanges=False, limit="x.shape[dim] // world",
        collectives=_fixed({A2A: 1}, {A2A: 1})),  # the blocks, the counts header's rows after each
    _op("split_forward_gather_backward", _REGION, _T_REGION, _T_DT,  # backward: a ragged all-gather, sizes known
        collectives=lambda world, variant: ({}, _rows(world)[0]), dtensor=("Replicate()", "Shard(dim)")),
    _op("gather_forward_split_backward", _REGION, _T_REGION, _T_DT,  # backward: this rank's piece, no collective
        collectives=lambda world, variant: (_plus(HEADER, _rows(world)[0]), {}), dtensor=_S_R),
    _op("from_ragged", _DTENSOR, _T_DT, compiled_in=_DT_COMPILED,  # the sizes, then the rows that move
        collectives=_fixed(_plus(HEADER, {A2A: 1}), {A2A: 1}), dtensor=("a plain ragged piece", "Shard(dim)")),
    _op("to_ragged", _DTENSOR, _T_DT, compiled_in=_DT_COMPILED,
        collectives=_A2A, dtensor=("Shard(d)", "a plain ragged piece")),
    _op("axis_index", _GROUPS, "tests/test_group.py", exchanges=False, collectives=_NONE),
    _op("axis_size", _GROUPS, "tests/test_group.py", exchanges=False, case="axis_index", collectives=_NONE),
    _op("split_sizes", _GROUPS, "tests/test_all_to_all_sizes.py", exchanges=False,
        compiled_in="tests/clients/test_clients.py"),
    _op("mark_ragged", _COMPILING, "compile_tests/test_recompiles.py", exchanges=False,
        compiled_in="compile_tests/test_downstream.py"),
    _op("set_checks", _CHECKS, "tests/test_checks.py", exchanges=False,
        compiled_in="compile_tests/test_checked_ops.py"),
    _op("checks_enabled", _CHECKS, "tests/test_checks.py", exchanges=False, compiled_in=None),
    _op("shard_map", _JAX, "tests/test_lax.py", "tests/test_lax_jax.py", exchanges=False,  # issues what `f` issues
        compiled_in="compile_tests/test_lax_compile.py"),
    _op("wait", _OVERLAP, "tests/test_overlap.py", exchanges=False, compiled_in="compile_tests/test_overlap_order.py"),
)  # fmt: skip
_BY_NAME = {s.name: s for s in SPECS}


def spec(name: str) -> OpSpec:
    """The spec of public op `name` (without the ``funcoll.`` prefix)."""
    return _BY_NAME[name.removeprefix("funcoll.")]
