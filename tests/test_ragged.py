"""Multi-rank tests of the ragged collectives (``funcoll/_ops/_ragged.py``) against single-process references.

Every case is a :class:`Case`: an op, a world size, a shape whose ragged dim holds a per-rank
length, a dtype and a memory layout. Rank r rebuilds its input from a generator seeded by
(case, r), so the parent process can rebuild every rank's input and compute the reference
independently: ``torch.cat`` of the inputs for the gathers, a stack-and-reduce then a split for
the ragged reduce-scatter, split-and-reassemble for ``all_to_all_v``. For float64 cases every
rank also computes a loss on its output and backpropagates; the reference gradient is
``torch.autograd`` on the single-process reference of the summed loss.

Ragged lengths come from a world x world matrix ``counts`` (seeded, or a fixed pattern): rank r
holds ``sum(counts[r])`` rows, and for ``all_to_all_v`` ``counts[i][j]`` rows travel from rank i to
rank j. Hypothesis draws further cases in the parent. All cases of one world size run in ONE
``run_ranks`` call (a module-scoped fixture); each test then checks its entry.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from _inputs import seeded
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor

import funcoll
from funcoll.testing import run_ranks

WORLDS = (1, 2, 3, 4)
DTYPES = ("float32", "float64", "bfloat16", "int64", "bool", "complex64")
REDUCE_DTYPES = ("float32", "float64", "bfloat16", "int64")
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
STRATEGIES = ("auto", "pad", "a2a", "shift")
LAYOUTS = ("contig", "strided", "transposed")
# Shape templates with the ragged dim (its entry is replaced by each rank's length): 1-D to 4-D,
# odd sizes, negative dims.
GEOMETRIES: tuple[tuple[tuple[int, ...], int], ...] = (
    ((0,), 0),
    ((0, 7), 0),
    ((5, 0), -1),
    ((3, 0, 7), 1),
    ((0, 5, 7), -3),
    ((2, 3, 0, 5), 2),
    ((2, 3, 5, 0), -1),
)
SIZE_PATTERNS = ("seeded", "zero-on-0-2", "all-zero", "equal")
TIMEOUT = 180.0


# --------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One call of a ragged op on `world` ranks, with everything needed to rebuild its inputs."""

    op: str  # gather | all_gather_list | all_gather_ragged | reduce_scatter | all_to_all_v
    world: int
    shape: tuple[int, ...]  # the entry at `dim` is replaced by the rank's length
    dim: int
    counts: tuple[tuple[int, ...], ...]  # world x world; rank r's length is sum(counts[r])
    dtype: str = "float32"
    layout: str = "contig"
    strategy: str = "auto"  # gather, all_gather_list, all_gather_ragged
    dst: int | None = None  # gather
    reduce_op: str = "sum"  # reduce_scatter
    sizes_as: str = "list"  # reduce_scatter / all_to_all_v: sizes passed as a list or a tensor
    exchange: bool = True  # all_to_all_v: recv_sizes=None, so funcoll exchanges them
    given: str = ""  # the gathers: "list"/"tensor" passes every rank's length as `sizes` (no exchange)
    grad: bool = False

    @property
    def sizes(self) -> list[int]:
        """Per-rank lengths along `dim` (gathers, all_to_all_v) or the scatter sizes (reduce_scatter)."""
        return [sum(row) for row in self.counts]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def rank_shape(self, rank: int) -> tuple[int, ...]:
        n = sum(self.sizes) if self.op == "reduce_scatter" else self.sizes[rank]
        shape = list(self.shape)
        shape[self.dim % self.ndim] = n
        return tuple(shape)

    @property
    def seed(self) -> int:
        return zlib.crc32(repr(self).encode())

    @property
    def id(self) -> str:
        d = self.dim % self.ndim
        shape = "x" + "x".join("R" if i == d else str(s) for i, s in enumerate(self.shape))
        if self.op == "gather":
            op = f"gather-{self.strategy}" if self.dst is None else f"gather-dst{self.dst}"
        elif self.op == "reduce_scatter":
            op = f"reduce_scatter-{self.reduce_op}-{self.sizes_as}"
        elif self.op == "all_to_all_v":
            op = f"all_to_all_v-{self.sizes_as}-{'exchanged' if self.exchange else 'given'}"
        else:
            op = self.op
        if self.given:
            op += f"-sizes_{self.given}"
        if self.op == "all_to_all_v":
            sizes = "send" + "_".join(".".join(map(str, row)) for row in self.counts)
        else:
            sizes = "sizes" + ".".join(map(str, self.sizes))
        parts = [f"w{self.world}", op, shape, f"dim{self.dim}", self.dtype, self.layout, sizes]
        return "-".join(parts + (["grad"] if self.grad else []))


def seeded_counts(world: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """A world x world matrix of lengths 0..3 from a fixed-seed generator."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(row) for row in torch.randint(0, 4, (world, world), generator=gen).tolist())


def pattern_counts(pattern: str, world: int, seed: int) -> tuple[tuple[int, ...], ...]:
    counts = [list(row) for row in seeded_counts(world, seed)]
    if pattern == "zero-on-0-2":  # ranks 0 and 2 hold nothing (the first rank empty on purpose)
        for r in (0, 2):
            if r < world:
                counts[r] = [0] * world
        if world > 1 and sum(counts[1]) == 0:  # keep one non-empty rank
            counts[1][0] = 2
    elif pattern == "all-zero":
        counts = [[0] * world for _ in range(world)]
    elif pattern == "equal":
        counts = [[2] * world for _ in range(world)]
    return tuple(tuple(row) for row in counts)


def fit_layout(layout: str, ndim: int) -> str:
    return "strided" if layout == "transposed" and ndim < 2 else layout


def explicit_cases(world: int) -> list[Case]:
    """The hand-picked cases of one world size; geometry and layout rotate so every one shows up."""
    cases: list[Case] = []
    spin = iter(range(10**6))

    def make(op: str, pattern: str, **kw: Any) -> Case:
        i = next(spin)
        shape, dim = GEOMETRIES[i % len(GEOMETRIES)]
        layout = fit_layout(kw.pop("layout", LAYOUTS[i % len(LAYOUTS)]), len(shape))
        counts = pattern_counts(pattern, world, seed=1000 * world + i)
        return Case(op, world, shape, dim, counts, layout=layout, **kw)

    gather_variants: list[dict[str, Any]] = [
        *({"op": "gather", "strategy": s} for s in STRATEGIES),
        *({"op": "gather", "dst": k} for k in range(world)),
        {"op": "all_gather_list"},
        {"op": "all_gather_ragged"},
        {"op": "all_gather_list", "strategy": "pad"},
        {"op": "all_gather_ragged", "strategy": "shift"},
    ]
    given_variants: list[dict[str, Any]] = [  # the lengths passed in: nothing exchanged
        {"op": "gather", "strategy": "auto", "given": "list"},
        {"op": "gather", "strategy": "pad", "given": "tensor"},
        {"op": "gather", "dst": world - 1, "given": "list"},
        {"op": "all_gather_list", "given": "list"},
        {"op": "all_gather_ragged", "given": "tensor"},
    ]
    for variant in gather_variants + given_variants:  # every variant with every size pattern
        for pattern in SIZE_PATTERNS:
            cases.append(make(pattern=pattern, **variant))
    for variant in (given_variants[0], given_variants[-1]):
        for pattern in SIZE_PATTERNS[:3]:
            cases.append(make(pattern=pattern, dtype="float64", grad=True, **variant))
    for dtype in DTYPES:  # every gather variant in every dtype
        for variant in [*gather_variants[: len(STRATEGIES)], gather_variants[-5], *gather_variants[-4:-2]]:
            cases.append(make(pattern="zero-on-0-2", dtype=dtype, **variant))
    for variant in [*gather_variants[: len(STRATEGIES)], *gather_variants[-4:]]:  # gradients
        for pattern in SIZE_PATTERNS[:3]:
            cases.append(make(pattern=pattern, dtype="float64", grad=True, **variant))
    for i, rop in enumerate(REDUCE_OPS):  # ragged reduce_scatter
        for dtype in REDUCE_DTYPES:
            if rop == "avg" and dtype == "int64":
                continue
            cases.append(
                make(
                    "reduce_scatter",
                    SIZE_PATTERNS[i % 4],
                    dtype=dtype,
                    reduce_op=rop,
                    sizes_as=("list", "tensor")[i % 2],
                )
            )
    for rop in ("sum", "avg"):
        for pattern in SIZE_PATTERNS[:3]:
            cases.append(make("reduce_scatter", pattern, dtype="float64", reduce_op=rop, grad=True))
    for sizes_as in ("list", "tensor"):  # all_to_all_v
        for exchange in (True, False):
            for pattern in SIZE_PATTERNS:
                cases.append(make("all_to_all_v", pattern, sizes_as=sizes_as, exchange=exchange))
            for pattern in SIZE_PATTERNS[:2]:
                cases.append(
                    make(
                        "all_to_all_v",
                        pattern,
                        dtype="float64",
                        sizes_as=sizes_as,
                        exchange=exchange,
                        grad=True,
                    )
                )
    for dtype in DTYPES:
        cases.append(make("all_to_all_v", "seeded", dtype=dtype, sizes_as="tensor"))
    unique: dict[str, Case] = {}
    for case in cases:  # gathers show only the row sums in their id: keep one case per id
        unique.setdefault(case.id, case)
    return list(unique.values())


CASES: dict[int, list[Case]] = {w: explicit_cases(w) for w in WORLDS}


# ------------------------------------------------------------------------------------ hypothesis
@st.composite
def drawn_case(draw: st.DrawFn, world: int) -> Case:
    """Any ragged op, 1-D to 4-D (zero-size other dims included), any dim, any layout and dtype."""
    op = draw(
        st.sampled_from(("gather", "all_gather_list", "all_gather_ragged", "reduce_scatter", "all_to_all_v"))
    )
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(-ndim, ndim - 1))
    row = st.lists(st.integers(0, 3), min_size=world, max_size=world).map(tuple)
    counts = tuple(draw(st.lists(row, min_size=world, max_size=world)))
    dtype = draw(st.sampled_from(REDUCE_DTYPES if op == "reduce_scatter" else DTYPES))
    layout = draw(st.sampled_from(LAYOUTS if ndim >= 2 else LAYOUTS[:2]))
    case = Case(op, world, shape, dim, counts, dtype=dtype, layout=layout)
    if op == "gather":
        case = replace(
            case, strategy=draw(st.sampled_from(STRATEGIES)), dst=draw(st.none() | st.integers(0, world - 1))
        )
    if op == "reduce_scatter":
        ops = REDUCE_OPS if dtype != "int64" else tuple(o for o in REDUCE_OPS if o != "avg")
        case = replace(
            case, reduce_op=draw(st.sampled_from(ops)), sizes_as=draw(st.sampled_from(("list", "tensor")))
        )
    if op == "all_to_all_v":
        case = replace(case, sizes_as=draw(st.sampled_from(("list", "tensor"))), exchange=draw(st.booleans()))
    # float64 cases carry gradients wherever the op has them (not gather with a dst, not max/min/product)
    return replace(case, grad=dtype == "float64" and case.dst is None and case.reduce_op in ("sum", "avg"))


def hypothesis_cases(world: int, n: int = 12) -> list[Case]:
    """Draw `n` cases with hypothesis in this process, to run together in one run_ranks call."""
    drawn: list[Case] = []

    @settings(
        max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(data=st.data())
    def draw(data: st.DataObject) -> None:
        drawn.append(data.draw(drawn_case(world)))

    draw()
    return drawn


# ------------------------------------------------------------------------------ inputs and losses
def generator(case: Case, rank: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(case.seed * 97 + rank * 13 + stream)


def make_values(shape: tuple[int, ...], dtype: str, gen: torch.Generator) -> Tensor:
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == "int64":
        return torch.randint(-3, 4, shape, generator=gen)  # small: products stay exact
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(getattr(torch, dtype))


def with_layout(t: Tensor, layout: str) -> Tensor:
    """The same values in a non-contiguous layout: every other element, or a transposed buffer."""
    if layout == "strided":
        buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        buf[..., ::2] = t
        return buf[..., ::2]
    if layout == "transposed":
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    return t


def rank_input(case: Case, rank: int) -> Tensor:
    """Rank `rank`'s input; the parent rebuilds the same tensor for the reference."""
    x = with_layout(make_values(case.rank_shape(rank), case.dtype, generator(case, rank, 0)), case.layout)
    return x.requires_grad_() if case.grad else x


def loss(case: Case, out: Any, rank: int) -> Tensor:
    """Rank `rank`'s scalar loss on its output (weights seeded by case and rank)."""

    def weighted(y: Tensor, stream: int) -> Tensor:
        return (y * torch.randn(y.shape, generator=generator(case, rank, stream), dtype=y.dtype)).sum()

    if case.op == "all_gather_list":  # one piece left out: its gradient must be zero
        skip = (rank + 1) % case.world if case.world > 1 else None
        return sum(
            (weighted(y, 1 + i) for i, y in enumerate(out) if i != skip), torch.zeros((), dtype=torch.float64)
        )
    y = out[0] if isinstance(out, tuple) else out
    return weighted(y, 1)


def sizes_arg(sizes: list[int], sizes_as: str) -> list[int] | Tensor:
    return torch.tensor(sizes) if sizes_as == "tensor" else sizes


# --------------------------------------------------------------------------------- rank side
def call_op(case: Case, x: Tensor, rank: int) -> Any:
    given = {"sizes": sizes_arg(case.sizes, case.given)} if case.given else {}
    if case.op == "gather":
        return funcoll.gather(x, case.dim, case.dst, strategy=case.strategy, **given)
    if case.op == "all_gather_list":
        return funcoll.all_gather_list(x, case.dim, strategy=case.strategy, **given)
    if case.op == "all_gather_ragged":
        return funcoll.all_gather_ragged(x, case.dim, strategy=case.strategy, **given)
    if case.op == "reduce_scatter":
        return funcoll.reduce_scatter(
            x, case.dim, op=case.reduce_op, sizes=sizes_arg(case.sizes, case.sizes_as)
        )
    send = sizes_arg(list(case.counts[rank]), case.sizes_as)
    recv = None if case.exchange else sizes_arg([row[rank] for row in case.counts], case.sizes_as)
    return funcoll.all_to_all_v(x, send, recv, dim=case.dim)


def tensors(out: Any) -> Iterator[Tensor]:
    if isinstance(out, Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from tensors(o)


def detach(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out.detach()
    if isinstance(out, (list, tuple)):
        return type(out)(detach(o) for o in out)
    return out


def run_case(case: Case, rank: int) -> dict[str, Any]:
    x = rank_input(case, rank)
    out = call_op(case, x, rank)
    ptr = x.untyped_storage().data_ptr()
    aliases = any(t.numel() and funcoll.wait(t).untyped_storage().data_ptr() == ptr for t in tensors(out))
    grad = None
    if case.grad:
        loss(case, out, rank).backward()
        grad = x.grad
    return {"out": detach(out), "grad": grad, "aliases_input": aliases}


def grad_refusals(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """gather(dst=k) of a requires-grad x, and requires_grad differing across ranks: every rank raises."""
    out: dict[str, tuple[str, str]] = {}

    def attempt(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            out[name] = ("returned", repr(fn(*args, **kwargs)))
        except Exception as e:  # noqa: BLE001 -- recorded for the parent to check on every rank
            out[name] = (type(e).__name__, str(e))

    x = torch.randn(rank + 1, 3, dtype=torch.float64)
    for k in range(world):
        attempt(f"dst{k}-requires-grad", funcoll.gather, x.clone().requires_grad_(), 0, k)
    with torch.no_grad():  # without grad mode the same call is fine
        attempt("dst0-no-grad-mode", funcoll.gather, x.clone().requires_grad_(), 0, 0)
    mixed = x.clone().requires_grad_(rank % 2 == 0)
    for strategy in STRATEGIES:
        attempt(f"mixed-requires-grad-{strategy}", funcoll.gather, mixed, 0, strategy=strategy)
    attempt("mixed-requires-grad-dst0", funcoll.gather, mixed, 0, 0)
    attempt("mixed-requires-grad-all_gather_ragged", funcoll.all_gather_ragged, mixed, 0)
    attempt("after-refusals", funcoll.gather, x, 0)  # the group still works
    return out


def run_batch(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    results = []
    for case in cases:
        try:
            results.append(run_case(case, rank))
        except Exception as e:
            raise RuntimeError(f"rank {rank} failed on case {case.id}: {case!r}") from e
    return {"cases": results, "refusals": grad_refusals(rank, world) if world > 1 else {}}


# ------------------------------------------------------------------------------ the reference
def reference_out(case: Case, xs: list[Tensor], rank: int) -> Any:
    """What rank `rank` should get, computed from every rank's input in this process."""
    d = case.dim % case.ndim
    if case.op == "gather":
        return torch.cat(xs, d) if case.dst in (None, rank) else None
    if case.op == "all_gather_list":
        return list(xs)
    if case.op == "all_gather_ragged":
        return torch.cat(xs, d), torch.tensor(case.sizes, dtype=torch.int64)
    if case.op == "reduce_scatter":
        stacked = torch.stack(xs)
        reduced = {
            "sum": lambda: stacked.sum(0),
            "avg": lambda: stacked.sum(0) / case.world,
            "max": lambda: stacked.amax(0),
            "min": lambda: stacked.amin(0),
            "product": lambda: stacked.prod(0),
        }[case.reduce_op]().to(stacked.dtype)
        return torch.split(reduced, case.sizes, d)[rank]
    blocks = [torch.split(x, list(case.counts[i]), d) for i, x in enumerate(xs)]
    return torch.cat([b[rank] for b in blocks], d), torch.tensor([row[rank] for row in case.counts])


def reference(case: Case) -> tuple[list[Any], list[Tensor | None]]:
    """(every rank's expected output, every rank's expected x.grad)."""
    xs = [rank_input(case, r) for r in range(case.world)]
    outs = [reference_out(case, xs, r) for r in range(case.world)]
    grads: list[Tensor | None] = [None] * case.world
    if case.grad:
        sum(loss(case, outs[r], r) for r in range(case.world)).backward()  # type: ignore[union-attr]
        grads = [x.grad for x in xs]
    return detach(outs), grads


def assert_matches(got: Any, expected: Any, where: str, exact: bool) -> None:
    """Compare nested outputs; `exact` for pure data movement (bitwise), else assert_close's tolerances."""
    if expected is None:
        assert got is None, f"{where}: expected None, got {got!r}"
        return
    if isinstance(expected, (list, tuple)):
        assert type(got) is type(expected), (
            f"{where}: expected a {type(expected).__name__}, got {type(got).__name__}"
        )
        assert len(got) == len(expected), f"{where}: length {len(got)} != {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected, strict=False)):
            assert_matches(g, e, f"{where}[{i}]", exact)
        return
    tol: dict[str, float] = {"rtol": 0.0, "atol": 0.0} if exact else {}
    torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{where}: {m}")


# ------------------------------------------------------------------------------------- fixtures
class Batches:
    """Runs every case of one world size (explicit and hypothesis-drawn) in one run_ranks call."""

    def __init__(self) -> None:
        self._done: dict[int, dict[str, Any]] = {}

    def _run(self, world: int) -> dict[str, Any]:
        if world not in self._done:
            drawn = hypothesis_cases(world)
            per_rank = run_ranks(run_batch, world, CASES[world] + drawn, timeout=TIMEOUT)
            per_case = [[r["cases"][i] for r in per_rank] for i in range(len(CASES[world]) + len(drawn))]
            self._done[world] = {
                "explicit": {c.id: per_case[i] for i, c in enumerate(CASES[world])},
                "drawn": list(zip(drawn, per_case[len(CASES[world]) :], strict=False)),
                "refusals": [r["refusals"] for r in per_rank],
            }
        return self._done[world]

    def results(self, case: Case) -> list[dict[str, Any]]:
        return self._run(case.world)["explicit"][case.id]

    def drawn(self, world: int) -> list[tuple[Case, list[dict[str, Any]]]]:
        return self._run(world)["drawn"]

    def refusals(self, world: int) -> list[dict[str, tuple[str, str]]]:
        return self._run(world)["refusals"]


@pytest.fixture(scope="module")
def batches() -> Batches:
    return Batches()


def check_case(case: Case, ranks: list[dict[str, Any]]) -> None:
    expected, grads = reference(case)
    for r, res in enumerate(ranks):
        moves_only = case.op != "reduce_scatter" or case.dtype == "int64" or case.reduce_op in ("max", "min")
        assert_matches(res["out"], expected[r], f"{case.id} rank {r} output", exact=moves_only)
        assert not res["aliases_input"], f"{case.id} rank {r}: the result shares memory with the input"
        if case.op == "all_gather_ragged" or case.op == "all_to_all_v":
            sizes = res["out"][1]
            assert sizes.device == torch.device("cpu"), f"{case.id} rank {r}: sizes on {sizes.device}"
        if case.grad:
            assert_matches(res["grad"], grads[r], f"{case.id} rank {r} x.grad", exact=False)


# ---------------------------------------------------------------------------------------- tests
def params(op: str) -> list[Any]:
    return [pytest.param(c, id=c.id) for w in WORLDS for c in CASES[w] if c.op == op]


@pytest.mark.parametrize("case", params("gather"))
def test_gather(batches: Batches, case: Case) -> None:
    check_case(case, batches.results(case))


@pytest.mark.parametrize("case", params("all_gather_list"))
def test_all_gather_list(batches: Batches, case: Case) -> None:
    check_case(case, batches.results(case))


@pytest.mark.parametrize("case", params("all_gather_ragged"))
def test_all_gather_ragged(batches: Batches, case: Case) -> None:
    check_case(case, batches.results(case))


@pytest.mark.parametrize("case", params("reduce_scatter"))
def test_reduce_scatter_ragged(batches: Batches, case: Case) -> None:
    check_case(case, batches.results(case))


@pytest.mark.parametrize("case", params("all_to_all_v"))
def test_all_to_all_v(batches: Batches, case: Case) -> None:
    check_case(case, batches.results(case))


@pytest.mark.parametrize("world", WORLDS, ids=[f"w{w}" for w in WORLDS])
def test_hypothesis_cases(batches: Batches, world: int) -> None:
    """Hypothesis-drawn cases (drawn in this process, run in the world's batch); a failure names its Case."""
    drawn = batches.drawn(world)
    assert drawn, "hypothesis drew no case"
    for case, ranks in drawn:
        check_case(case, ranks)


@pytest.mark.parametrize("world", WORLDS[1:], ids=[f"w{w}" for w in WORLDS[1:]])
def test_gather_dst_refuses_requires_grad(batches: Batches, world: int) -> None:
    for r, got in enumerate(batches.refusals(world)):
        for k in range(world):
            kind, msg = got[f"dst{k}-requires-grad"]
            assert kind == "ValueError", f"rank {r}, dst={k}: {kind} {msg}"
            assert msg.startswith("funcoll.gather:") and "`dst`" in msg, msg
        kind, msg = got["dst0-no-grad-mode"]
        assert kind == "returned" and (msg == "None") == (r != 0), f"rank {r}: {kind} {msg}"


@pytest.mark.parametrize("world", WORLDS[1:], ids=[f"w{w}" for w in WORLDS[1:]])
def test_gather_refuses_requires_grad_mismatch(batches: Batches, world: int) -> None:
    names = [f"mixed-requires-grad-{s}" for s in (*STRATEGIES, "dst0", "all_gather_ragged")]
    for r, got in enumerate(batches.refusals(world)):
        for name in names:
            kind, msg = got[name]
            assert kind == "ValueError", f"rank {r}, {name}: {kind} {msg}"
            assert msg.startswith("funcoll.") and "requires grad" in msg, msg
        assert got["after-refusals"][0] == "returned", got["after-refusals"]


# ----------------------------------------------------------------- uninitialized: one-rank results
@pytest.mark.parametrize(
    "shape,dim",
    [
        pytest.param(s, d, id=f"x{'x'.join(map(str, s))}-dim{d}")
        for s, d in [((5,), 0), ((3, 5), -1), ((2, 0, 7), 1)]
    ],
)
def test_uninitialized_is_the_single_rank_result(shape: tuple[int, ...], dim: int) -> None:
    assert not torch.distributed.is_initialized()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    for strategy in STRATEGIES:
        y = funcoll.gather(x, dim, strategy=strategy)
        assert y is not x and torch.equal(y, x)
    y0 = funcoll.gather(x, dim, dst=0)
    assert y0 is not None and y0 is not x and torch.equal(y0, x)
    (piece,) = funcoll.all_gather_list(x, dim)
    assert torch.equal(piece, x)
    y, sizes = funcoll.all_gather_ragged(x, dim)
    assert torch.equal(y, x) and sizes.dtype == torch.int64 and sizes.tolist() == [x.shape[dim]]
    y, recv = funcoll.all_to_all_v(x, [x.shape[dim]], dim=dim)
    assert torch.equal(y, x) and recv.dtype == torch.int64 and recv.tolist() == [x.shape[dim]]
    y = funcoll.reduce_scatter(x, dim, sizes=[x.shape[dim]])
    assert y is not x and torch.equal(y, x)


# --------------------------------------------------------------------------------- known bugs
def bool_reduce_scatter(rank: int, world: int) -> dict[str, Any]:
    x = (
        torch.tensor([True, False, True, False, True])
        if rank == 0
        else torch.tensor([True, True, False, False, True])
    )
    out: dict[str, Any] = {}
    for rop in ("sum", "product"):
        try:
            out[rop] = funcoll.reduce_scatter(x, 0, op=rop, sizes=[3, 2])
        except (ValueError, TypeError) as e:
            out[rop] = str(e)
    return out


def test_reduce_scatter_ragged_bool_sum_product() -> None:
    """bool sum/product must give the logical or/and of the ranks' rows, or be refused with a clear error."""
    ranks = run_ranks(bool_reduce_scatter, 2, timeout=60)
    xs = [torch.tensor([True, False, True, False, True]), torch.tensor([True, True, False, False, True])]
    expected = {"sum": xs[0] | xs[1], "product": xs[0] & xs[1]}
    for r, got in enumerate(ranks):
        for rop in ("sum", "product"):
            if isinstance(got[rop], str):
                assert got[rop].startswith("funcoll.reduce_scatter:"), got[rop]
                continue
            want = torch.split(expected[rop], [3, 2])[r]
            where = f"rank {r} {rop}"
            torch.testing.assert_close(got[rop], want, rtol=0, atol=0, msg=lambda m, w=where: f"{w}: {m}")


# ------------------------------------------------------- the layout "auto" takes past 8 ranks
MANY_RANKS_SIZES = {2: [3, 0], 3: [0, 4, 1], 4: [2, 0, 5, 1]}


def many_ranks_input(world: int, rank: int, dim: int) -> Tensor:
    shape = [3, 2]
    shape[dim] = MANY_RANKS_SIZES[world][rank]
    return seeded(shape, torch.float64, "many-ranks", world, rank, dim)


def many_ranks_ops(x: Tensor, dim: int) -> list[Tensor]:
    y = funcoll.gather(x, dim, strategy="pad")
    pieces = funcoll.all_gather_list(x, dim, strategy="pad")
    z, _ = funcoll.all_gather_ragged(x, dim, strategy="pad")
    return [y, *pieces, z]


def many_ranks_body(rank: int, world: int) -> dict[int, Any]:
    # The padded layout (cut by index, the list as views of the padded blocks) of
    # every gather, forward and backward, in one run.
    out = {}
    for dim in (0, -1):
        x = many_ranks_input(world, rank, dim).requires_grad_()
        outs = many_ranks_ops(x, dim)
        weights = [seeded(o.shape, torch.float64, "many-ranks-w", rank, k) for k, o in enumerate(outs)]
        sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
        out[dim] = ([o.detach() for o in outs], x.grad)
    return out


@pytest.mark.parametrize("world", WORLDS[1:], ids=[f"w{w}" for w in WORLDS[1:]])
def test_padded_layout_of_every_gather(world: int) -> None:
    ranks = run_ranks(many_ranks_body, world, timeout=60)
    for dim in (0, -1):
        xs = [many_ranks_input(world, r, dim).requires_grad_() for r in range(world)]
        full = torch.cat(xs, dim)
        want = [full, *xs, full]
        total = 0
        for r in range(world):
            weights = [seeded(o.shape, torch.float64, "many-ranks-w", r, k) for k, o in enumerate(want)]
            total = total + sum((o * w).sum() for o, w in zip(want, weights, strict=True))
        grads = torch.autograd.grad(total, xs)
        for r, got in enumerate(ranks):
            outs, grad = got[dim]
            assert len(outs) == len(want), f"rank {r} dim {dim}: {len(outs)} outputs"
            for k, (o, w) in enumerate(zip(outs, want, strict=True)):
                torch.testing.assert_close(
                    o, w.detach(), rtol=0, atol=0, msg=f"rank {r} dim {dim} output {k}"
                )
            torch.testing.assert_close(grad, grads[r], msg=f"rank {r} dim {dim}: grad")
