"""torch.func.grad, vjp and grad_and_value over funcoll's collectives, on real gloo ranks.

torch's function transforms run an autograd.Function only in its two-part form
(``forward`` without ctx, ``setup_context``); every funcoll Function has it. Each
rank r differentiates its own loss ``sum(y_r * w_r)`` (``w_r`` seeded by case and
rank) through one op, three ways: ``torch.func.grad``, ``torch.func.vjp`` with
``w_r`` as the cotangent, and ``torch.func.grad_and_value``; and once more with
``torch.autograd.grad``, which the transforms must match. The expected gradient
follows JAX's convention for per-rank code (compile_tests/_ops.py,
``reference_grads``): the ranks' losses add up, and rank r's gradient is
d(sum_s loss_s)/d x_r, computed in this process by torch.autograd from every
rank's input rebuilt here and the ops' global results written with torch.cat,
sums and indexing (never funcoll).

The ``shard_map`` cases run ``lax.psum`` and ``lax.all_gather`` over a 1-D mesh "i",
with ``torch.func.grad`` taken inside `f` on each rank's block of rows, by the same
convention. In the untyped mode (``check_vma=False``) that is the gradient of the
summed losses, and autograd's. In the typed mode a transform's values carry no
type, and funcoll refuses it (``NotImplementedError`` on every rank) where it would
transpose by the wrong rules. A transform over a whole ``shard_map`` is refused in
both modes: its inputs and outputs pass through DTensor's from_local and to_local,
which torch's transforms refuse.

Every case runs on 1, 2 and 3 ranks, in ONE ``run_ranks`` launch per world size;
a test checks one case on every world (a single rank's ops take no collective, so
the larger worlds are the ones that reach funcoll's autograd Functions).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _inputs import once_per_world, seeded
from torch import Tensor

import funcoll
import funcoll.lax as lax
from funcoll import P
from funcoll.testing import settled

WORLDS = (1, 2, 3)
TIMEOUT_S = 120.0
F64 = torch.float64
TRANSFORMS = ("grad", "vjp", "grad_and_value")
METHODS = (*TRANSFORMS, "autograd")


# ------------------------------------------------------------------------------ cases
def ragged_sizes(world: int) -> list[int]:
    """Rows per rank for the ragged gather: rank 0 holds none (on one rank: 3)."""
    return [3] if world == 1 else [0, 2, 1][:world]


def counts(world: int) -> list[list[int]]:
    """``counts[i][j]``: rows rank i sends rank j in the ragged all_to_all_v; some are 0."""
    table = [[1, 0, 2], [2, 1, 0], [0, 3, 1]]
    return [row[:world] for row in table[:world]]


@dataclass(frozen=True)
class Case:
    """One funcoll op on every rank: ``run(x, rank, world)`` there, ``reference(xs, r, world)`` here."""

    id: str
    shape: Callable[[int, int], tuple[int, ...]]  # (rank, world) -> the rank's input shape
    run: Callable[[Tensor, int, int], Tensor]
    reference: Callable[[list[Tensor], int, int], Tensor]


def _ring(world: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % world) for i in range(world)]


def _a2a_v(x: Tensor, rank: int, world: int) -> Tensor:
    y, _ = funcoll.all_to_all_v(x, counts(world)[rank])  # receive sizes exchanged
    return y


CASES = [
    Case(
        "all_gather-dim1",
        lambda r, w: (2, 3),
        lambda x, r, w: funcoll.all_gather(x, 1),
        lambda xs, r, w: torch.cat(xs, 1),
    ),
    Case(
        "reduce_scatter-sum",
        lambda r, w: (2 * w, 3),
        lambda x, r, w: funcoll.reduce_scatter(x, 0),
        lambda xs, r, w: torch.stack(xs).sum(0)[2 * r : 2 * r + 2],
    ),
    Case(
        "reduce_scatter-avg",
        lambda r, w: (3, 2 * w),
        lambda x, r, w: funcoll.reduce_scatter(x, 1, op="avg"),
        lambda xs, r, w: torch.stack(xs).sum(0)[:, 2 * r : 2 * r + 2] / w,
    ),
    Case(
        "all_reduce",
        lambda r, w: (3, 2),
        lambda x, r, w: funcoll.all_reduce(x),
        lambda xs, r, w: torch.stack(xs).sum(0),
    ),
    Case(
        "all_to_all-s1-g0",
        lambda r, w: (2, 2 * w),
        lambda x, r, w: funcoll.all_to_all(x, None, 1, 0),
        lambda xs, r, w: torch.cat([x[:, 2 * r : 2 * r + 2] for x in xs], 0),
    ),
    Case(
        "ppermute-ring",
        lambda r, w: (4,),
        lambda x, r, w: funcoll.ppermute(x, _ring(w)),
        lambda xs, r, w: xs[(r - 1) % w],
    ),
    *[
        Case(
            f"gather-ragged-{strategy}",
            lambda r, w: (ragged_sizes(w)[r], 3),
            lambda x, r, w, s=strategy: funcoll.gather(x, 0, strategy=s),
            lambda xs, r, w: torch.cat(xs, 0),
        )
        for strategy in ("auto", "pad", "shift")
    ],
    Case(
        "all_to_all_v-exchanged",
        lambda r, w: (sum(counts(w)[r]), 2),
        _a2a_v,
        lambda xs, r, w: torch.cat([x.split(counts(w)[i])[r] for i, x in enumerate(xs)], 0),
    ),
]
CASE_IDS = [c.id for c in CASES]


def rank_input(case_id: str, rank: int, world: int, shape: tuple[int, ...]) -> Tensor:
    return seeded(shape, F64, case_id, "x", rank, world)


def weight(case_id: str, rank: int, world: int, shape: torch.Size | tuple[int, ...]) -> Tensor:
    return seeded(tuple(shape), F64, case_id, "w", rank, world)


# ------------------------------------------------------------------------------ shard_map
@dataclass(frozen=True)
class MapCase:
    """A ``funcoll.lax`` collective over the 1-D mesh "i" inside ``shard_map``, on rank r's block of rows.

    ``run(u)`` inside `f`; ``reference(blocks, r)`` is rank r's result from every rank's block.
    """

    id: str
    run: Callable[[Tensor], Tensor]
    reference: Callable[[list[Tensor], int], Tensor]


MAP_CASES = [
    MapCase("psum", lambda u: lax.psum(u, "i"), lambda bs, r: torch.stack(bs).sum(0)),
    MapCase(
        "all_gather-tiled", lambda u: lax.all_gather(u, "i", axis=0, tiled=True), lambda bs, r: torch.cat(bs)
    ),
]
MAP_ROWS = 2  # each rank's block of the global input


def map_input(case_id: str, world: int) -> Tensor:
    """The global input, the same on every rank; `shard_map` hands rank r rows ``[2r, 2r + 2)``."""
    return seeded((MAP_ROWS * world, 3), F64, case_id, "X", world)


def map_inside(case: MapCase, world: int, mesh: Any, check_vma: bool) -> dict[str, Any]:
    """Each rank's gradient of its own loss through the collective, by torch.func.grad inside `f` (and autograd's)."""

    def loss(u: Tensor) -> Tensor:
        y = case.run(u)
        return (y * weight(case.id, lax.axis_index("i"), world, y.shape)).sum()

    def by_grad(v: Tensor) -> Tensor:
        return torch.func.grad(loss)(v)

    def by_autograd(v: Tensor) -> Tensor:
        u = v.detach().requires_grad_()
        return torch.autograd.grad(loss(u), u)[0]

    x = map_input(case.id, world)
    out = {}
    for name, f in (("grad", by_grad), ("autograd", by_autograd)):
        mapped = funcoll.shard_map(f, mesh, P("i"), P("i"), check_vma=check_vma)
        out[name] = _attempt(lambda m=mapped: {"grad": m(x).to_local()})
    return out


def map_outside(world: int, mesh: Any, check_vma: bool) -> dict[str, Any]:
    """torch.func.grad of a loss through a whole ``shard_map``: refused (DTensor's from_local/to_local)."""
    mapped = funcoll.shard_map(lambda u: lax.psum(u, "i"), mesh, P("i"), P(), check_vma=check_vma)
    x = map_input("outside", world)
    return _attempt(lambda: {"grad": torch.func.grad(lambda v: mapped(v).full_tensor().sum())(x)})


# ---------------------------------------------------------------------------------- ranks
def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return settled(fn())
    except Exception:  # noqa: BLE001 -- reported by the case's test, with the rank's traceback
        return {"error": traceback.format_exc(limit=-8)}


def run_case(case: Case, rank: int, world: int) -> dict[str, Any]:
    """Rank `rank`'s gradient of its loss through `case`'s op, by each method."""
    x = rank_input(case.id, rank, world, case.shape(rank, world))

    def op(v: Tensor) -> Tensor:
        return case.run(v, rank, world)

    def loss(v: Tensor) -> Tensor:
        y = op(v)
        return (y * weight(case.id, rank, world, y.shape)).sum()

    def by_grad() -> dict[str, Any]:
        return {"grad": torch.func.grad(loss)(x)}

    def by_vjp() -> dict[str, Any]:
        y, pull = torch.func.vjp(op, x)
        (g,) = pull(weight(case.id, rank, world, y.shape))
        return {"grad": g, "y": y}

    def by_grad_and_value() -> dict[str, Any]:
        g, value = torch.func.grad_and_value(loss)(x)
        return {"grad": g, "value": value}

    def by_autograd() -> dict[str, Any]:
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss(leaf), leaf)
        return {"grad": g}

    methods = {"grad": by_grad, "vjp": by_vjp, "grad_and_value": by_grad_and_value, "autograd": by_autograd}
    return {m: _attempt(methods[m]) for m in METHODS}


def body(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    res: dict[str, Any] = {c.id: run_case(c, rank, world) for c in CASES}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("i",))
    res["shard_map"] = {c.id: map_inside(c, world, mesh, check_vma=False) for c in MAP_CASES}
    res["typed"] = {c.id: map_inside(c, world, mesh, check_vma=True) for c in MAP_CASES}
    res["outside"] = {vma: map_outside(world, mesh, check_vma=vma) for vma in (False, True)}
    res["final_all_reduce"] = funcoll.all_reduce(torch.ones(1))  # every rank still in step
    return settled(res)


batch = once_per_world(body, TIMEOUT_S, worlds=WORLDS)


# ------------------------------------------------------------------------------ reference
def reference(case: Case, world: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Every rank's (output, loss, gradient): torch.autograd of the summed losses, in this process."""
    xs = [rank_input(case.id, r, world, case.shape(r, world)).requires_grad_() for r in range(world)]
    ys = [case.reference(xs, r, world) for r in range(world)]
    losses = [(y * weight(case.id, r, world, y.shape)).sum() for r, y in enumerate(ys)]
    grads = torch.autograd.grad(torch.stack(losses).sum(), xs)
    return [y.detach() for y in ys], [v.detach() for v in losses], list(grads)


def _ok(got: dict[str, Any], where: str) -> dict[str, Any]:
    assert "error" not in got, f"{where} raised:\n{got['error']}"
    assert got["in_flight"] == 0, f"{where}: {got['in_flight']} collectives left unwaited"
    return got


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("method", TRANSFORMS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradient_of_each_rank(case: Case, method: str) -> None:
    """`method`'s gradient on every rank of 1, 2 and 3 is d(sum of the ranks' losses)/d x_r."""
    for world in WORLDS:
        ys, losses, grads = reference(case, world)
        for r, ranks in enumerate(batch(world)):
            where = f"{case.id} {method} world {world} rank {r}"
            got = _ok(ranks[case.id][method], where)
            torch.testing.assert_close(got["grad"], grads[r], msg=lambda m, w=where: f"{w} gradient: {m}")
            if "y" in got:
                torch.testing.assert_close(got["y"], ys[r], msg=lambda m, w=where: f"{w} output: {m}")
            if "value" in got:
                torch.testing.assert_close(got["value"], losses[r], msg=lambda m, w=where: f"{w} value: {m}")


@pytest.mark.parametrize("method", TRANSFORMS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_transform_matches_autograd(case: Case, method: str) -> None:
    """A transform's gradient is torch.autograd.grad's on the same rank, bit for bit (the same backward)."""
    for world in WORLDS:
        for r, ranks in enumerate(batch(world)):
            where = f"{case.id} world {world} rank {r}"
            got = _ok(ranks[case.id][method], f"{where} {method}")
            expected = _ok(ranks[case.id]["autograd"], f"{where} autograd")
            torch.testing.assert_close(got["grad"], expected["grad"], rtol=0, atol=0)


def map_reference(case: MapCase, world: int) -> list[Tensor]:
    """Every rank's gradient of the summed losses, each rank's block of rows a leaf here."""
    blocks = [b.requires_grad_() for b in map_input(case.id, world).split(MAP_ROWS)]
    ys = [case.reference(blocks, r) for r in range(world)]
    losses = [(y * weight(case.id, r, world, y.shape)).sum() for r, y in enumerate(ys)]
    return list(torch.autograd.grad(torch.stack(losses).sum(), blocks))


@pytest.mark.parametrize("case", MAP_CASES, ids=[c.id for c in MAP_CASES])
def test_shard_map_grad_inside_f(case: MapCase) -> None:
    """torch.func.grad inside an untyped `f` (check_vma=False): the gradient of the summed losses, as autograd's."""
    for world in WORLDS:
        grads = map_reference(case, world)
        for r, ranks in enumerate(batch(world)):
            where = f"shard_map {case.id} world {world} rank {r}"
            got = _ok(ranks["shard_map"][case.id]["grad"], f"{where} torch.func.grad")
            by_autograd = _ok(ranks["shard_map"][case.id]["autograd"], f"{where} torch.autograd.grad")
            torch.testing.assert_close(got["grad"], grads[r], msg=lambda m, w=where: f"{w}: {m}")
            torch.testing.assert_close(got["grad"], by_autograd["grad"], rtol=0, atol=0)


TYPED_REFUSAL = (
    "NotImplementedError: funcoll.lax.{op}: torch.func's transforms (grad, vjp, grad_and_value, vmap) do not "
    "run inside shard_map(..., check_vma=True)"
)


@pytest.mark.parametrize("case", MAP_CASES, ids=[c.id for c in MAP_CASES])
def test_shard_map_typed_refuses_transforms(case: MapCase) -> None:
    """In the typed mode a transform's values carry no type: every rank raises, where autograd gives JAX's gradient."""
    op = case.id.split("-")[0]
    for world in WORLDS:
        grads = map_reference(case, world)
        for r, ranks in enumerate(batch(world)):
            where = f"typed shard_map {case.id} world {world} rank {r}"
            error = ranks["typed"][case.id]["grad"].get("error", "")
            assert TYPED_REFUSAL.format(op=op) in error, f"{where}: {error or 'no error'}"
            # torch.autograd.grad keeps the types, and JAX's typed transposes: the weights, made by a
            # factory inside f, are invariant, so psum's gradient is pvary's (no sum): the rank's own w
            got = _ok(ranks["typed"][case.id]["autograd"], f"{where} torch.autograd.grad")
            expected = grads[r] if case.id != "psum" else weight(case.id, r, world, grads[r].shape)
            torch.testing.assert_close(got["grad"], expected, msg=lambda m, w=where: f"{w}: {m}")


@pytest.mark.parametrize("check_vma", (False, True))
def test_transform_over_shard_map_refused(check_vma: bool) -> None:
    """A transform taken over a whole shard_map: funcoll's error naming where to take it, on every rank,
    before any communication (the ranks' last all_reduce is still in step)."""
    for world in WORLDS:
        for r, ranks in enumerate(batch(world)):
            error = ranks["outside"][check_vma].get("error", "")
            assert (
                "NotImplementedError: funcoll.shard_map: torch.func's transforms (grad, vjp, grad_and_value, vmap) "
                "do not run over shard_map" in error
            ), f"world {world} rank {r}: {error or 'no error'}"
            assert ranks["final_all_reduce"].tolist() == [float(world)]
