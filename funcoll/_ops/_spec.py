"""What funcoll knows about each public op, read from the op's own definition.

An op is defined in one place: its function, under ``@entry(...)``
(``_entry.py``), which names its docs section (`family`), its header (what its
size exchange or cross-rank check carries: arguments that must agree, how the host
ints are read, the op's own checks), its collectives at a world size, its DTensor
placements and what bounds its counts (the static ops). The entry registers an
:class:`OpSpec` here, and the rest of funcoll, its docs builder
(``docs/build_api.py``) and its tests read it through :func:`spec` and
:func:`specs`. The public names that are not ops (settings, group queries,
``shard_map``) are listed below with their docs section.

``tests/test_specs.py`` fails when a public name has no spec, or an op's
definition lacks a piece; where each op is tested is the tests' own table
(``tests/_op_tests.py``). docs/contributing.md walks through adding an op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._base._strategy import resolve
from .._collective._header import Header

__all__ = [
    "A2A", "AG", "AR", "BC", "CHECKS", "COMPILING", "DTENSOR", "EVEN", "FAMILIES", "GROUPS", "HEADER", "JAX",
    "OVERLAP", "RAGGED", "REGION", "RS", "STATIC", "OpSpec", "Plan", "fixed", "plus", "register", "rows_plan",
    "spec", "specs",
]  # fmt: skip

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
EVEN, RAGGED, STATIC, REGION, DTENSOR, GROUPS, COMPILING, CHECKS, JAX, OVERLAP = FAMILIES


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


def plus(*counts: dict[str, int]) -> dict[str, int]:
    return {k: sum(c.get(k, 0) for c in counts) for c in counts for k in c}


def rows_plan(world: int, strategy: str = "auto") -> Plan:
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


def fixed(fw: dict[str, int], bw: dict[str, int] | None) -> Callable[[int, str], Plan]:
    return lambda world, variant: (fw, bw)


@dataclass(frozen=True)
class OpSpec:
    """What funcoll knows about one public op, in one place.

    `family`: its docs section. `header`: what its header carries (None: the op
    exchanges none). `limit`: for the static ops, what bounds each count (their
    error messages say it). `collectives`: ``(world, variant) -> (forward,
    backward)`` counts of each ``_c10d_functional`` collective one call issues,
    with checks off: what the graph tests and the fake-group traces expect; None
    for what issues none. `placements`: what a DTensor argument must be on the mesh
    dim the op acts on, and what the result is there (docs/dtensor.md's table);
    None when the op takes no DTensor (its result has no placement).
    """

    name: str
    family: str
    header: Header | None = None
    limit: str | None = None
    collectives: Callable[[int, str], Plan] | None = field(default=None, compare=False)
    placements: tuple[str, str] | None = None

    def plan(self, world: int, variant: str = "") -> Plan:
        """The collectives one call issues at `world` ranks (`variant`: the op's argument set)."""
        if self.collectives is None:
            raise ValueError(f"funcoll.{self.name} issues no collectives")
        return self.collectives(world, variant)


_SPECS: dict[str, OpSpec] = {}


def register(s: OpSpec) -> OpSpec:
    """Register the spec of a public op (``@entry`` does, for every op it defines)."""
    if s.family not in FAMILIES:
        raise ValueError(f"funcoll.{s.name}: family {s.family!r} is none of {FAMILIES}")
    if s.name in _SPECS:
        raise ValueError(f"funcoll.{s.name}: a second spec")
    _SPECS[s.name] = s
    return s


def spec(name: str) -> OpSpec:
    """The spec of public op `name` (without the ``funcoll.`` prefix)."""
    return _SPECS[name.removeprefix("funcoll.")]


def specs() -> tuple[OpSpec, ...]:
    """Every registered spec, in the order the definitions were read (``import funcoll`` reads them all)."""
    return tuple(_SPECS.values())


NONE = fixed({}, {})  # traced, but no collective
# The public names that are not ops: defined below the ops (settings, group queries) or
# above them (shard_map), so that no definition of theirs can name its docs section.
for _name, _family, _collectives in (
    ("axis_index", GROUPS, NONE),
    ("axis_size", GROUPS, NONE),
    ("split_sizes", GROUPS, None),
    ("mark_ragged", COMPILING, None),
    ("allow_compile_caches", COMPILING, None),
    ("set_checks", CHECKS, None),
    ("checks_enabled", CHECKS, None),
    ("shard_map", JAX, None),  # issues what `f` issues
    ("typeof", JAX, None),  # a value's type in shard_map(check_vma=True), read while tracing
    ("wait", OVERLAP, None),
):
    register(OpSpec(_name, _family, collectives=_collectives))
