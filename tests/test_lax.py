"""funcoll.lax and funcoll.shard_map (funcoll/lax.py, funcoll/_shard_map.py) on real gloo ranks.

Every ``funcoll.lax`` function is checked against JAX's documented behaviour (the
facts of JAX's docstrings: ``psum(1, "i")`` is the axis size, ``psum_scatter(x)`` is
``psum(x)[axis_index]``, ``all_to_all``'s shape ``insert(delete(shape, split),
concat, n)``, ``ragged_all_to_all``'s two-device example, ``axis_index`` of a tuple
row-major) and against references computed in one process from every rank's input
(sums, stacks, chunks, permutations; never funcoll). Gradients are float64 and use
JAX's convention for per-rank code: each rank's loss ``sum(y_r * w_r)`` is its own and
the losses add up, so ``psum``'s backward is ``psum``.

``shard_map`` cases compare the DTensor outputs (``full_tensor()``, placements) and the
gradients of the global loss ``sum(Y * W)`` with a single-process computation of the
global function on the global inputs, plain tensors and DTensors alike.

Axes: a 1-D mesh "i" of 2 and 4 ranks, and on 4 ranks a 2x2 mesh ("dp", "tp"): one
axis, the other, and both as a tuple (the flattened sub-mesh). After every case no
collective is left unwaited (``funcoll.testing.in_flight()``). One ``run_ranks`` per
world size runs every case. tests/test_lax_jax.py runs the same kinds of programs in JAX
itself and compares.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _inputs import load_file, once_per_world, seeded
from torch import Tensor

import funcoll
import funcoll.lax as lax
from funcoll import P
from funcoll.testing import settled

WORLDS = (2, 4)
TIMEOUT_S = 120.0
F64 = torch.float64


# ------------------------------------------------------------------------------ axes
def coords(rank: int, mesh: str) -> dict[str, int]:
    """A rank's index along each axis of the named mesh: "i" (1-D) or "dp_tp" (2x2, dp major)."""
    return {"i": rank} if mesh == "i" else {"dp": rank // 2, "tp": rank % 2}


def members(rank: int, world: int, mesh: str, axis: Any) -> list[int]:
    """The ranks of `rank`'s group along `axis` (a name or a tuple), in JAX's axis_index order."""
    names = axis if isinstance(axis, tuple) else (axis,)
    mine = coords(rank, mesh)
    out = []
    for r in range(world):
        c = coords(r, mesh)
        if all(c[n] == mine[n] for n in mine if n not in names):
            out.append(r)
    sizes = {"i": world, "dp": 2, "tp": 2}

    def index(r: int) -> int:
        k = 0
        for n in names:
            k = k * sizes[n] + coords(r, mesh)[n]
        return k

    return sorted(out, key=index)


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One lax call on every rank: `op`(x, axis, **kw), x of `shape` per rank."""

    id: str
    op: str
    shape: tuple[int, ...]
    axis: Any
    mesh: str = "i"
    kw: dict[str, Any] = field(default_factory=dict)
    grad: bool = True


def lax_cases(world: int) -> list[Case]:
    w = world
    ring = [(i, (i + 1) % w) for i in range(w)]
    out = [
        Case("psum-3x5", "psum", (3, 5), "i"),
        Case("pmean-4", "pmean", (4,), "i"),
        Case("pmax-2x3", "pmax", (2, 3), "i", grad=False),
        Case("pmin-2x3", "pmin", (2, 3), "i", grad=False),
        Case("all_gather-3x5-axis0", "all_gather", (3, 5), "i"),
        Case("all_gather-3x5-axis1", "all_gather", (3, 5), "i", kw={"axis": 1}),
        Case("all_gather-3x5-axis-1", "all_gather", (3, 5), "i", kw={"axis": -1}),
        Case("all_gather-3x5-tiled-axis1", "all_gather", (3, 5), "i", kw={"axis": 1, "tiled": True}),
        # JAX's invariant all-gather: the backward is this rank's slice of its own gradient
        Case("all_gather-3x5-axis1-invarying", "all_gather", (3, 5), "i", kw={"axis": 1, "to": "invarying"}),
        Case(
            "all_gather-3x5-tiled-invarying",
            "all_gather",
            (3, 5),
            "i",
            kw={"tiled": True, "to": "invarying"},
        ),
        Case("pcast-3x2-varying", "pcast", (3, 2), "i", kw={"to": "varying"}),
        Case("pcast-3-reduced", "pcast", (3,), "i", kw={"to": "reduced"}),
        Case(f"psum_scatter-{w}x3", "psum_scatter", (w, 3), "i"),
        Case(
            f"psum_scatter-3x{2 * w}-dim1-tiled",
            "psum_scatter",
            (3, 2 * w),
            "i",
            kw={"scatter_dimension": 1, "tiled": True},
        ),
        Case(f"all_to_all-{w}x3-s0c1", "all_to_all", (w, 3), "i", kw={"split_axis": 0, "concat_axis": 1}),
        Case(
            f"all_to_all-3x{w}x2-s1c0", "all_to_all", (3, w, 2), "i", kw={"split_axis": 1, "concat_axis": 0}
        ),
        Case(f"all_to_all-{w}x3-s0c0", "all_to_all", (w, 3), "i", kw={"split_axis": 0, "concat_axis": 0}),
        Case(
            f"all_to_all-3x{2 * w}-s1c0-tiled",
            "all_to_all",
            (3, 2 * w),
            "i",
            kw={"split_axis": 1, "concat_axis": 0, "tiled": True},
        ),
        Case("ppermute-3x2-ring", "ppermute", (3, 2), "i", kw={"perm": ring}),
        Case("ppermute-3-one-pair", "ppermute", (3,), "i", kw={"perm": [(0, 1)]}),
        Case("pshuffle-2x2-reverse", "pshuffle", (2, 2), "i", kw={"perm": list(reversed(range(w)))}),
    ]
    if world == 4:  # a permutation that is not its own inverse: rank i receives from perm[i]
        out.append(Case("pshuffle-3-rotate", "pshuffle", (3,), "i", kw={"perm": [1, 2, 3, 0]}))
    if world == 4:  # the 2x2 mesh: one axis, the other, both in mesh order and out of it
        for axis in ("dp", "tp", ("dp", "tp"), ("tp", "dp")):
            a = "_".join(axis) if isinstance(axis, tuple) else axis
            n = 4 if isinstance(axis, tuple) else 2
            out += [
                Case(f"psum-3x2-{a}", "psum", (3, 2), axis, "dp_tp"),
                Case(f"all_gather-2x3-tiled-{a}", "all_gather", (2, 3), axis, "dp_tp", {"tiled": True}),
                Case(f"psum_scatter-{n}x2-{a}", "psum_scatter", (n, 2), axis, "dp_tp"),
                Case(
                    f"all_to_all-{n}x3-s0c1-{a}",
                    "all_to_all",
                    (n, 3),
                    axis,
                    "dp_tp",
                    {"split_axis": 0, "concat_axis": 1},
                ),
                Case(
                    f"ppermute-2-ring-{a}",
                    "ppermute",
                    (2,),
                    axis,
                    "dp_tp",
                    {"perm": [(i, (i + 1) % n) for i in range(n)]},
                ),
            ]
        # ("tp", "dp"): JAX's index is tp * 2 + dp, which is not the flattened group's rank order
        td, m = ("tp", "dp"), "dp_tp"
        out += [
            Case("pmean-3-tp_dp", "pmean", (3,), td, m),
            Case("pmax-2x2-tp_dp", "pmax", (2, 2), td, m, grad=False),
            Case("pmin-2x2-tp_dp", "pmin", (2, 2), td, m, grad=False),
            Case("all_gather-3x2-axis1-tp_dp", "all_gather", (3, 2), td, m, {"axis": 1}),
            Case("all_gather-2x3-axis1-tiled-tp_dp", "all_gather", (2, 3), td, m, {"axis": 1, "tiled": True}),
            Case(
                "all_gather-2x3-axis1-tiled-invarying-tp_dp",
                "all_gather",
                (2, 3),
                td,
                m,
                {"axis": 1, "tiled": True, "to": "invarying"},
            ),
            Case("pvary-2-tp_dp", "pvary", (2,), td, m),
            Case(
                "psum_scatter-3x8-dim1-tiled-tp_dp",
                "psum_scatter",
                (3, 8),
                td,
                m,
                {"scatter_dimension": 1, "tiled": True},
            ),
            Case(
                "all_to_all-4x3-s0c0-tp_dp", "all_to_all", (4, 3), td, m, {"split_axis": 0, "concat_axis": 0}
            ),
            Case(
                "all_to_all-3x8-s1c0-tiled-tp_dp",
                "all_to_all",
                (3, 8),
                td,
                m,
                {"split_axis": 1, "concat_axis": 0, "tiled": True},
            ),
            Case("ppermute-2-pairs-tp_dp", "ppermute", (2,), td, m, {"perm": [(0, 2), (1, 0), (3, 1)]}),
            Case("pshuffle-2-rotate-tp_dp", "pshuffle", (2,), td, m, {"perm": [1, 2, 3, 0]}),
        ]
    return out


def reference(case: Case, xs: list[Tensor], k: int) -> Tensor:
    """What rank k of a group whose inputs are `xs` (in axis order) gets, computed in one process."""
    n, kw = len(xs), case.kw
    total = torch.stack(xs).sum(0)
    if case.op == "psum":
        return total
    if case.op == "pmean":
        return total / n
    if case.op in ("pmax", "pmin"):
        return torch.stack(xs).amax(0) if case.op == "pmax" else torch.stack(xs).amin(0)
    if case.op == "all_gather":
        axis = kw.get("axis", 0)
        if kw.get("to") == "invarying":  # rank k's result carries the gradient of its own x only
            xs = [x if i == k else x.detach() for i, x in enumerate(xs)]
        return torch.cat(xs, axis) if kw.get("tiled") else torch.stack(xs, axis)
    if case.op in ("pcast", "pvary"):
        return xs[k]
    if case.op == "psum_scatter":
        d = kw.get("scatter_dimension", 0)
        return torch.chunk(total, n, d)[k] if kw.get("tiled") else total.select(d, k)
    if case.op == "all_to_all":
        s, c = kw["split_axis"], kw["concat_axis"]
        if kw.get("tiled"):
            return torch.cat([torch.chunk(x, n, s)[k] for x in xs], c)
        return torch.stack([x.select(s, k) for x in xs], c)  # JAX: insert(delete(shape, s), c, n)
    if case.op == "ppermute":
        src = {d: s for s, d in kw["perm"]}.get(k)
        return xs[src] if src is not None else torch.zeros_like(xs[0])
    if case.op == "pshuffle":
        return xs[kw["perm"][k]]
    raise AssertionError(case.op)


def call(case: Case, x: Tensor) -> Tensor:
    kw = dict(case.kw)
    if case.op in ("ppermute", "pshuffle"):
        return getattr(lax, case.op)(x, case.axis, kw.pop("perm"))
    if case.op == "all_to_all":
        return lax.all_to_all(x, case.axis, kw.pop("split_axis"), kw.pop("concat_axis"), **kw)
    return getattr(lax, case.op)(x, case.axis, **kw)


def x_of(case: Case, rank: int) -> Tensor:
    return seeded(case.shape, F64, case.id, "x", rank)


# ------------------------------------------------------------------------ ragged_all_to_all
def ragged_args(world: int, rank: int, per: int) -> dict[str, Tensor]:
    """Seeded ragged arguments: K = world * per slices, sizes from one seeded world x K table, so
    that send_sizes on rank r, entry j*per+s, is recv_sizes on rank j, entry r*per+s."""
    g = torch.Generator().manual_seed(world * 10 + per)
    k = world * per
    table = torch.randint(0, 3, (world, k), generator=g)  # table[r, j*per+s]: rows r sends to j in slice s
    send = table[rank]
    in_off = torch.cumsum(send, 0) - send + 1  # packed after one leading row that is never sent
    n = int(table.sum(1).max()) + 3  # one operand shape on every rank, as in JAX
    # receiver j's slices, in (source, slice) order, packed after one spare row
    recv_of = [
        torch.stack([table[i, j * per : (j + 1) * per] for i in range(world)]).reshape(-1)
        for j in range(world)
    ]
    recv = recv_of[rank]
    out_off = torch.stack(
        [
            (torch.cumsum(recv_of[j], 0) - recv_of[j] + 1)[rank * per + s]
            for j in range(world)
            for s in range(per)
        ]
    )
    m = max(int(r.sum()) for r in recv_of) + 3
    return {
        "operand": seeded((n, 2), F64, "ragged", world, per, rank),
        "output": seeded((m, 2), F64, "ragged-out", world, per, rank),
        "input_offsets": in_off,
        "send_sizes": send,
        "output_offsets": out_off,
        "recv_sizes": recv,
    }


# (result key, slices per rank, axis): over the tuple ("tp", "dp"), JAX's index is tp * 2 + dp
RAGGED = {
    2: [("ragged-1", 1, "i"), ("ragged-2", 2, "i")],
    4: [("ragged-1", 1, ("dp", "tp")), ("ragged-2", 2, ("dp", "tp")), ("ragged-2-tp_dp", 2, ("tp", "dp"))],
}


def jax_index(rank: int, axis: Any) -> int:
    """`rank`'s index along `axis` as JAX computes it: row-major over the names, the first major."""
    if axis == "i":
        return rank
    return members(rank, 4, "dp_tp", axis).index(rank)


def ragged_reference(args: list[dict[str, Tensor]], per: int) -> list[Tensor]:
    """JAX's pseudocode for ragged_all_to_all, in one process."""
    world = len(args)
    results = [a["output"].clone() for a in args]
    for a in args:
        for i in range(world * per):
            j = i // per
            lo, size = int(a["input_offsets"][i]), int(a["send_sizes"][i])
            at = int(a["output_offsets"][i])
            results[j] = torch.cat([results[j][:at], a["operand"][lo : lo + size], results[j][at + size :]])
    return results


# ---------------------------------------------------------------------- JAX's own examples
TUTORIAL_X = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 1, 2]  # the shard_map tutorial's x
RING4 = [(i, (i + 1) % 4) for i in range(4)]


def jax_examples(rank: int, meshes: dict[str, Any]) -> dict[str, Any]:
    """JAX's documented examples with 4 devices, as JAX writes them (the test holds JAX's printed values).

    The docstrings of psum, pmean, all_gather, psum_scatter and axis_index map over
    ``x = np.arange(4)`` (device r holds x[r]) or ``np.arange(16).reshape(4, 4)`` (row r)
    with ``jax.pmap``: here each rank holds the same under ``lax.mesh``. The shard_map
    tutorial's collectives run ``shard_map`` over a 1-D mesh "i" of 4 on `TUTORIAL_X`, and
    over a 2x2 mesh (its ("i", "j") are ("dp", "tp") here) on ``arange(16).reshape(4, 4)``.
    """
    x = torch.arange(4)[rank]  # 0-d, int64 (JAX: int32)
    row = torch.arange(16).reshape(4, 4)[rank]
    out: dict[str, Any] = {}
    with lax.mesh(meshes["i"]):
        out["psum"] = lax.psum(x, "i")
        out["x/psum"] = x / lax.psum(x, "i")
        out["psum-rows"] = lax.psum(row, "i")
        out["pmean"] = lax.pmean(x, "i")
        out["x/pmean"] = x / lax.pmean(x, "i")
        out["all_gather"] = lax.all_gather(x, "i")
        out["all_gather-1"] = lax.all_gather(x.reshape(1), "i")
        out["all_gather-1-tiled"] = lax.all_gather(x.reshape(1), "i", tiled=True)
        out["psum_scatter"] = lax.psum_scatter(row, "i")
        out["psum_scatter-tiled"] = lax.psum_scatter(row, "i", tiled=True)
        out["axis_index"] = lax.axis_index("i")
    sm, m, t = funcoll.shard_map, meshes["i"], torch.tensor(TUTORIAL_X)
    calls = {
        "tutorial-psum": (sm(lambda b: lax.psum(b, "i"), m, P("i"), P()), t),
        "tutorial-all_gather-tiled": (
            sm(lambda b: lax.all_gather(b, "i", tiled=True), m, P("i"), P("i")),
            torch.tensor([3, 9, 5, 2]),
        ),
        "tutorial-all_gather": (
            sm(lambda b: lax.all_gather(b, "i"), m, P("i"), P("i")),
            torch.tensor([3, 9, 5, 2]),
        ),
        "tutorial-psum_scatter": (sm(lambda b: lax.psum_scatter(b, "i", tiled=True), m, P("i"), P("i")), t),
        "tutorial-ppermute": (sm(lambda b: lax.ppermute(b, "i", RING4), m, P("i"), P("i")), torch.arange(8)),
        "tutorial-all_to_all": (
            sm(lambda b: lax.all_to_all(b, "i", split_axis=0, concat_axis=0, tiled=True), m, P("i"), P("i")),
            t,
        ),
        "tutorial-psum-2d-one-axis": (
            sm(lambda b: lax.psum(b, "dp"), meshes["dp_tp"], P("dp", "tp"), P(None, "tp")),
            torch.arange(16).reshape(4, 4),
        ),
        "tutorial-psum-2d-both-axes": (
            sm(lambda b: lax.psum(b, ("dp", "tp")), meshes["dp_tp"], P("dp", "tp"), P(None, None)),
            torch.arange(16).reshape(4, 4),
        ),
    }
    for name, (fn, value) in calls.items():
        out[name] = fn(value).full_tensor()
    return out


# what JAX prints for each (per rank where the devices differ)
JAX_EXAMPLES: dict[str, Any] = {
    "psum": [6] * 4,
    "x/psum": [0.0, 1 / 6, 1 / 3, 0.5],
    "psum-rows": [[24, 28, 32, 36]] * 4,
    "pmean": [1.5] * 4,
    "x/pmean": [0.0, 2 / 3, 4 / 3, 2.0],
    "all_gather": [[0, 1, 2, 3]] * 4,
    "all_gather-1": [[[0], [1], [2], [3]]] * 4,
    "all_gather-1-tiled": [[0, 1, 2, 3]] * 4,
    "psum_scatter": [24, 28, 32, 36],
    "psum_scatter-tiled": [[24], [28], [32], [36]],
    "axis_index": [0, 1, 2, 3],
    "tutorial-psum": [[22, 20, 12, 17]] * 4,
    "tutorial-all_gather-tiled": [[3, 9, 5, 2] * 4] * 4,
    "tutorial-all_gather": [[[3], [9], [5], [2]] * 4] * 4,
    "tutorial-psum_scatter": [[22, 20, 12, 17]] * 4,
    "tutorial-ppermute": [[6, 7, 0, 1, 2, 3, 4, 5]] * 4,
    "tutorial-all_to_all": [[3, 5, 5, 9, 1, 9, 3, 7, 4, 2, 5, 1, 1, 6, 8, 2]] * 4,
    "tutorial-psum-2d-one-axis": [[[8, 10, 12, 14], [16, 18, 20, 22]]] * 4,
    "tutorial-psum-2d-both-axes": [[[20, 24], [36, 40]]] * 4,
}


# ------------------------------------------------------------------------------- shard_map
@dataclass(frozen=True)
class MapCase:
    """shard_map(f, mesh, in_specs, out_specs, **kw) on global inputs; `ref` is the global function."""

    id: str
    f: Callable[..., Any]
    ref: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    in_specs: Any
    out_specs: Any
    dtensor_in: tuple[Any, ...] | None = None  # placements to distribute each input with first
    kw: dict[str, Any] = field(default_factory=dict)  # shard_map's keyword arguments


def _psum_tp(x: Tensor) -> Tensor:
    return lax.psum(x, "tp")


def _psum_dp(x: Tensor) -> Tensor:
    return lax.psum(x, "dp")


def _gather_dp_tp(x: Tensor) -> Tensor:
    return lax.all_gather(x, ("dp", "tp"), axis=0, tiled=True) * 3.0


def _scatter_back(x: Tensor) -> Tensor:
    return lax.psum_scatter(x, "tp", scatter_dimension=1, tiled=True)


def _two_outputs(d: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    return d["a"] * lax.axis_index("dp"), lax.pmean(d["b"], ("dp", "tp"))


def _ring(x: Tensor) -> Tensor:
    n = lax.axis_size("tp")
    return lax.ppermute(x, "tp", [(i, (i + 1) % n) for i in range(n)]) + x


def map_cases() -> list[MapCase]:
    def psum_tp_ref(x: Tensor) -> Tensor:
        return x[:, :2] + x[:, 2:]

    def ring_ref(x: Tensor) -> Tensor:  # tp blocks of dim 1 rotate by one
        a, b = x[:, :3], x[:, 3:]
        return torch.cat([b + a, a + b], 1)

    cases = [
        # a replicated output of a sum over "tp": psum's backward meets the divided cotangent
        MapCase("psum-tp-to-replicated", _psum_tp, psum_tp_ref, ((3, 4),), (P(None, "tp"),), P()),
        # an input replicated over "tp" (P("dp")): psum of an invariant value is axis_size * x, as in JAX
        MapCase(
            "psum-of-replicated",
            _psum_tp,
            lambda x: 2 * x,
            ((4, 3),),
            (P("dp"),),
            P("dp"),
            kw={"check_rep": False},
        ),
        # all 4 ranks' rows gathered over the flattened ("dp", "tp") axis
        MapCase("all_gather-dp_tp", _gather_dp_tp, lambda x: 3 * x, ((8, 2),), (P(("dp", "tp")),), P()),
        # a DTensor input on other placements is redistributed; Shard(1) over "tp" comes back
        MapCase(
            "psum_scatter-dtensor-in",
            _scatter_back,
            lambda x: 2 * x,
            ((2, 4),),
            (P("dp"),),
            P("dp", "tp"),
            dtensor_in=(("R", "S1"),),
        ),
        MapCase(
            "ppermute-tp-ring",
            _ring,
            ring_ref,
            ((2, 6),),
            P(None, "tp"),
            P(None, "tp"),
            kw={"check_vma": False},
        ),
        # manual over "dp" only: f runs on whole "tp" values (an input sharded over "tp" is gathered)
        MapCase(
            "axis_names-dp-dtensor-sharded-over-tp",
            _psum_dp,
            lambda x: x[:2] + x[2:],
            ((4, 3),),
            (P("dp"),),
            P(),
            dtensor_in=(("R", "S0"),),
            kw={"axis_names": {"dp"}},
        ),
        MapCase(
            "dict-in-two-out",
            _two_outputs,
            lambda d: (torch.cat([d["a"][:2] * 0, d["a"][2:] * 1]), d["b"] / 4 * 4),
            ({"a": (4, 3), "b": (2, 3)},),
            ({"a": P("dp"), "b": P()},),
            (P("dp"), P()),
        ),
    ]
    # Each again in JAX's typed mode: the same global values and gradients, by other transposes.
    typed = [
        dataclasses.replace(c, id=f"{c.id}-check_vma", kw={**c.kw, "check_vma": True})
        for c in cases
        # all_gather-dp_tp: a varying all_gather under P(), which the typed mode refuses (JAX's too)
        if not {"check_vma", "check_rep"} & c.kw.keys() and c.id != "all_gather-dp_tp"
    ]
    typed.append(
        MapCase(
            "all_gather-invarying-dp_tp-check_vma",
            lambda x: lax.all_gather(x, ("dp", "tp"), tiled=True, to="invarying") * 3.0,
            lambda x: 3 * x,
            ((8, 2),),
            (P(("dp", "tp")),),
            P(),
            kw={"check_vma": True},
        )
    )
    return cases + typed


def _placement(code: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


def _map_inputs(case: MapCase) -> list[Any]:
    def make(shape: Any, key: str) -> Any:
        if isinstance(shape, dict):
            return {k: make(v, f"{key}.{k}") for k, v in shape.items()}
        return seeded(shape, F64, case.id, key)

    return [make(s, str(i)) for i, s in enumerate(case.shapes)]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [v for k in sorted(tree) for v in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [v for t in tree for v in _leaves(t)]
    return [tree]


def _weights(case: MapCase, outs: list[Tensor]) -> list[Tensor]:
    return [seeded(tuple(o.shape), F64, case.id, "w", k) for k, o in enumerate(outs)]


def map_reference(case: MapCase) -> dict[str, Any]:
    inputs = _map_inputs(case)
    leaves = [t.requires_grad_() for t in _leaves(inputs)]
    outs = _leaves(case.ref(*inputs))
    loss = sum((o * w).sum() for o, w in zip(outs, _weights(case, outs), strict=True))
    return {"outs": [o.detach() for o in outs], "grads": list(torch.autograd.grad(loss, leaves))}


def run_map_case(case: MapCase, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    inputs = _map_inputs(case)
    if case.dtensor_in is not None:
        inputs = [
            distribute_tensor(x, mesh, [_placement(p) for p in ps])
            for x, ps in zip(inputs, case.dtensor_in, strict=True)
        ]
    leaves = [t.requires_grad_() for t in _leaves(inputs)]
    outs = _leaves(funcoll.shard_map(case.f, mesh, case.in_specs, case.out_specs, **case.kw)(*inputs))
    full = [o.full_tensor() for o in outs]
    loss = sum((o * w).sum() for o, w in zip(full, _weights(case, full), strict=True))
    loss.backward()
    grads = [t.grad.full_tensor() if hasattr(t.grad, "full_tensor") else t.grad for t in leaves]
    return settled(
        {
            "outs": [o.detach() for o in full],
            "placements": [[str(p) for p in o.placements] for o in outs],
            "local": [o.to_local().detach() for o in outs],
            "grads": [g.detach() for g in grads],
        }
    )


# -------------------------------------------------------------------------------- errors
def _set_first(a: Tensor, v: Tensor) -> Tensor:
    a = a.clone()
    a[0] = v[0]  # an invariant tensor written with a varying value: it varies
    return a


def _detached_write(a: Tensor, v: Tensor) -> Tensor:
    h = a * 1
    h.detach().add_(v)  # `h` requires grad, and its detached view shares its data
    return h


def errors(rank: int, world: int, meshes: dict[str, Any]) -> dict[str, str]:
    """Every bad call, made on every rank before any communication; the message each raised."""
    x = torch.ones(3, 2)
    calls: dict[str, Callable[[], Any]] = {
        "no-mesh": lambda: lax.psum(x, "i"),
        "unknown-axis": lambda: _in(meshes["i"], lambda: lax.psum(x, "tp")),
        "not-a-name": lambda: _in(meshes["i"], lambda: lax.psum(x, 0)),  # type: ignore[arg-type]
        "psum_scatter-size": lambda: _in(meshes["i"], lambda: lax.psum_scatter(x, "i")),
        "all_to_all-size": lambda: _in(
            meshes["i"],
            lambda: lax.all_to_all(x, "i", 1, 0, tiled=True) if world == 4 else lax.all_to_all(x, "i", 0, 0),
        ),
        "pshuffle-not-a-permutation": lambda: _in(meshes["i"], lambda: lax.pshuffle(x, "i", [0] * world)),
        "dtensor-in-lax": lambda: _in(meshes["i"], lambda: lax.psum(_replicated(x, meshes["i"]), "i")),
        "ragged-bad-count": lambda: _in(
            meshes["i"],
            lambda: lax.ragged_all_to_all(
                x,
                x,
                torch.zeros(3, dtype=torch.int64),
                torch.zeros(3, dtype=torch.int64),
                torch.zeros(3, dtype=torch.int64),
                torch.zeros(3, dtype=torch.int64),
                axis_name="i",
            ),
        ),
        "spec-unknown-axis": lambda: funcoll.shard_map(lambda v: v, meshes["i"], P("tp"), P())(x),
        "spec-not-divisible": lambda: funcoll.shard_map(lambda v: v, meshes["i"], P(None, "i"), P())(
            torch.ones(2, 3)
        ),
        "spec-not-a-P": lambda: funcoll.shard_map(lambda v: v, meshes["i"], ("i",), P()),
        "check_vma-not-a-bool": lambda: funcoll.shard_map(lambda v: v, meshes["i"], P(), P(), check_vma=1),
        "check_vma-varying-under-P": lambda: funcoll.shard_map(
            lambda v: v * 2, meshes["i"], P("i"), P(), check_vma=True
        )(torch.ones(2 * world)),
        "check_rep-varying-under-P": lambda: funcoll.shard_map(
            lambda v: {"y": [v]}, meshes["i"], P("i"), {"y": [P()]}, check_rep=True
        )(torch.ones(2 * world)),
        "check_vma-pcast-varying": lambda: funcoll.shard_map(
            lambda v: lax.pcast(v, "i", to="varying"), meshes["i"], P("i"), P("i"), check_vma=True
        )(torch.ones(2 * world)),
        "check_vma-pcast-reduced": lambda: funcoll.shard_map(
            lambda v: lax.pcast(v, "i", to="reduced"), meshes["i"], P(), P(), check_vma=True
        )(torch.ones(2)),
        "check_vma-all_gather-reduced": lambda: funcoll.shard_map(
            lambda v: lax.all_gather(v, "i", to="reduced"), meshes["i"], P("i"), P("i"), check_vma=True
        )(torch.ones(2 * world)),
        "check_vma-funcoll-all_reduce": lambda: funcoll.shard_map(
            lambda v: funcoll.all_reduce(v, group=(meshes["i"], "i")),
            meshes["i"],
            P("i"),
            P("i"),
            check_vma=True,
        )(torch.ones(2 * world)),
        "check_vma-funcoll-all_gather-invariant": lambda: funcoll.shard_map(
            lambda v: funcoll.all_gather(v, 0, group=meshes["i"]), meshes["i"], P(), P("i"), check_vma=True
        )(torch.ones(2)),
        "check_vma-funcoll-gather-sizes": lambda: funcoll.shard_map(
            lambda v, n: funcoll.gather(v, 0, group=meshes["i"], sizes=n),
            meshes["i"],
            (P("i"), P()),
            P(),
            check_vma=True,
        )(torch.ones(2 * world), torch.ones(world, dtype=torch.int64)),
        "check_vma-add_-under-P": lambda: funcoll.shard_map(
            lambda a, v: a.clone().add_(v), meshes["i"], (P(), P("i")), P(), check_vma=True
        )(torch.ones(2), torch.ones(2 * world)),
        "check_vma-setitem-under-P": lambda: funcoll.shard_map(
            _set_first, meshes["i"], (P(), P("i")), P(), check_vma=True
        )(torch.ones(2), torch.ones(2 * world)),
        "check_vma-write-into-factory": lambda: funcoll.shard_map(
            lambda v: torch.zeros(2).copy_(v), meshes["i"], P("i"), P("i"), check_vma=True
        )(torch.ones(2 * world)),
        "check_vma-write-into-grad": lambda: funcoll.shard_map(
            lambda a, v: (a * 1).add_(v), meshes["i"], (P(), P("i")), P("i"), check_vma=True
        )(torch.ones(2, requires_grad=True), torch.ones(2 * world)),
        "check_vma-write-into-detached-grad": lambda: funcoll.shard_map(
            _detached_write, meshes["i"], (P(), P("i")), P("i"), check_vma=True
        )(torch.ones(2, requires_grad=True), torch.ones(2 * world)),
        "check_vma-and-check_rep": lambda: funcoll.shard_map(
            lambda v: v, meshes["i"], P(), P(), check_vma=False, check_rep=False
        ),
        "axis_names-not-a-set": lambda: funcoll.shard_map(
            lambda v: v, meshes["i"], P(), P(), axis_names=("i",)
        ),
        "axis_names-unknown": lambda: funcoll.shard_map(
            lambda v: v, meshes["i"], P(), P(), axis_names={"tp"}
        ),
        "psum_scatter-number": lambda: _in(meshes["i"], lambda: lax.psum_scatter(1.0, "i")),
        "all_gather-to-unknown": lambda: _in(meshes["i"], lambda: lax.all_gather(x, "i", to="invariant")),
        "all_gather-to-reduced": lambda: _in(meshes["i"], lambda: lax.all_gather(x, "i", to="reduced")),
        "pcast-to-unknown": lambda: _in(meshes["i"], lambda: lax.pcast(x, "i", to="invarying")),
        "pcast-to-unreduced": lambda: _in(meshes["i"], lambda: lax.pcast(x, "i", to="unreduced")),
        "pcast-axis-set": lambda: _in(meshes["i"], lambda: lax.pcast(x, {"i"}, to="varying")),  # type: ignore[arg-type]
        "pvary-unknown-axis": lambda: _in(meshes["i"], lambda: lax.pvary(x, "tp")),
    }
    if world == 4:
        calls["spec-names-an-auto-axis"] = lambda: funcoll.shard_map(
            lambda v: v, meshes["dp_tp"], P("tp"), P(), axis_names={"dp"}
        )
        calls["auto-axis-unknown-inside-f"] = lambda: funcoll.shard_map(
            lambda v: lax.psum(v, "tp"), meshes["dp_tp"], P("dp"), P(), axis_names={"dp"}
        )(torch.ones(4, 2))
        calls["spec-out-of-order"] = lambda: funcoll.shard_map(
            lambda v: v, meshes["dp_tp"], P(("tp", "dp")), P()
        )(torch.ones(4, 2))
    out = {}
    for name, fn in calls.items():
        try:
            fn()
            out[name] = "nothing raised"
        except Exception as e:  # noqa: BLE001 -- the parent checks type and message
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _in(m: Any, fn: Callable[[], Any]) -> Any:
    with lax.mesh(m):
        return fn()


def _replicated(x: Tensor, m: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(x, m, [Replicate()], run_check=False)


EXPECTED_ERRORS = {
    "no-mesh": "ValueError: funcoll.lax.psum: `axis_name`='i' names a mesh axis, but no mesh is bound",
    "all_gather-to-unknown": "ValueError: funcoll.lax.all_gather: `to`='invariant' must be 'varying', 'invarying'",
    "all_gather-to-reduced": "ValueError: funcoll.lax.all_gather: `to`='reduced' gathers a value typed varying",
    "pcast-to-unknown": "ValueError: funcoll.lax.pcast: `to`='invarying' must be one of",
    "pcast-to-unreduced": "ValueError: funcoll.lax.pcast: `to`='unreduced' casts a varying value over 'i'",
    "pcast-axis-set": "TypeError: funcoll.lax.pcast: `axis_name`={'i'} must be a tuple or a str, not a set",
    "pvary-unknown-axis": "ValueError: funcoll.lax.pcast: `axis_name`='tp': 'tp' is not an axis of the mesh ('i',)",
    "unknown-axis": "ValueError: funcoll.lax.psum: `axis_name`='tp': 'tp' is not an axis of the mesh ('i',)",
    "not-a-name": "TypeError: funcoll.lax.psum: `axis_name` must be a mesh axis name",
    "psum_scatter-size": "ValueError: funcoll.lax.psum_scatter: x.shape[0]=3",
    "all_to_all-size": "ValueError: funcoll.lax.all_to_all: x.shape[",
    "pshuffle-not-a-permutation": "ValueError: funcoll.lax.pshuffle: `perm`=",
    "dtensor-in-lax": "TypeError: funcoll.lax.psum: got a DTensor",
    "ragged-bad-count": "ValueError: funcoll.lax.ragged_all_to_all: the offset and size arrays have 3 entries",
    "spec-unknown-axis": "ValueError: funcoll.shard_map: `in_specs`=P('tp'): 'tp' is not an axis of the mesh ('i',)",
    "spec-not-divisible": "ValueError: funcoll.shard_map: `in_specs` entry P(None, 'i') shards dim 1",
    "spec-not-a-P": "TypeError: funcoll.shard_map: `in_specs` must hold funcoll.P specs",
    "check_vma-not-a-bool": "TypeError: funcoll.shard_map: `check_vma` must be a bool, got 1",
    "check_vma-varying-under-P": "ValueError: funcoll.shard_map: output 0 has `out_specs`=P(), which says it is "
    "replicated over 'i', but its value varies over 'i' (funcoll.typeof(y).vma={'i'}); reduce it over 'i' first",
    "check_rep-varying-under-P": "ValueError: funcoll.shard_map: output ['y'][0] has `out_specs`=P(), which says",
    "check_vma-pcast-varying": "ValueError: funcoll.lax.pcast: `x` varies over ['i'] already",
    "check_vma-pcast-reduced": "NotImplementedError: funcoll.lax.pcast: `to`='reduced': funcoll's typed mode",
    "check_vma-all_gather-reduced": "NotImplementedError: funcoll.lax.all_gather: `to`='reduced': funcoll's typed",
    "check_vma-add_-under-P": "ValueError: funcoll.shard_map: output 0 has `out_specs`=P(), which says it is "
    "replicated over 'i', but its value varies over 'i'",
    "check_vma-setitem-under-P": "ValueError: funcoll.shard_map: output 0 has `out_specs`=P(), which says it is "
    "replicated over 'i', but its value varies over 'i'",
    "check_vma-write-into-factory": "TypeError: funcoll.shard_map: `copy_` writes a value varying over ['i'] in "
    "place into a tensor typed as varying over [] inside shard_map(..., check_vma=True), and a tensor made inside "
    "f by a factory function",
    "check_vma-write-into-grad": "TypeError: funcoll.shard_map: `add_` writes a value varying over ['i'] in place "
    "into a tensor typed as varying over [] inside shard_map(..., check_vma=True), and it requires grad",
    "check_vma-write-into-detached-grad": "TypeError: funcoll.shard_map: `add_` writes a value varying over ['i'] "
    "in place into a tensor typed as varying over [] inside shard_map(..., check_vma=True), and it is a detached "
    "view of a tensor that requires grad",
    "check_vma-funcoll-all_reduce": "TypeError: funcoll.all_reduce: `x` is a value of funcoll.shard_map(..., "
    "check_vma=True) (it varies over ['i']), where collectives are funcoll.lax's: they type their results and "
    "take their gradients by JAX's rules, which funcoll.all_reduce does not know. Use funcoll.lax.psum(x, "
    "axis_name) (or pmean, pmax, pmin) inside the typed f, or shard_map(..., check_vma=False)",
    "check_vma-funcoll-all_gather-invariant": "TypeError: funcoll.all_gather: `x` is a value of "
    "funcoll.shard_map(..., check_vma=True) (it varies over []), where collectives are funcoll.lax's",
    "check_vma-funcoll-gather-sizes": "TypeError: funcoll.gather: `x` is a value of funcoll.shard_map(..., "
    "check_vma=True) (it varies over ['i'])",
    "check_vma-and-check_rep": "TypeError: funcoll.shard_map: pass `check_vma` or its older name `check_rep`",
    "axis_names-not-a-set": "TypeError: funcoll.shard_map: `axis_names` must be a set of mesh axis names",
    "axis_names-unknown": "ValueError: funcoll.shard_map: `axis_names`={'tp'} names 'tp', which is not an axis",
    "psum_scatter-number": "ValueError: funcoll.lax.psum_scatter: `scatter_dimension`",
    "spec-names-an-auto-axis": "ValueError: funcoll.shard_map: `in_specs`=P('tp') names the axis 'tp', which is not in",
    "auto-axis-unknown-inside-f": "ValueError: funcoll.lax.psum: `axis_name`='tp': 'tp' is not an axis of the mesh ('dp',)",
    "spec-out-of-order": "NotImplementedError: funcoll.shard_map: `in_specs`=P(('tp', 'dp')) shards dim 0",
}


# ---------------------------------------------------------------------------------- ranks
def body(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"i": init_device_mesh("cpu", (world,), mesh_dim_names=("i",))}
    if world == 4:
        meshes["dp_tp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    res: dict[str, Any] = {"errors": errors(rank, world, meshes)}  # first: none may communicate
    for case in lax_cases(world):
        try:
            x = x_of(case, rank).requires_grad_(case.grad)
            with lax.mesh(meshes[case.mesh]):
                y = call(case, x)
            if case.grad:
                y.backward(seeded(tuple(y.shape), F64, case.id, "w", rank))
            res[case.id] = settled({"y": y.detach(), "grad": None if x.grad is None else x.grad.clone()})
        except Exception:  # noqa: BLE001 -- reported by the case's test
            res[case.id] = {"error": traceback.format_exc(limit=-6)}
    with lax.mesh(meshes["i"]):
        res["scalars"] = {
            "psum-1": lax.psum(1, "i"),
            "pmean-2.5": lax.pmean(2.5, "i"),
            "psum-bool": lax.psum(torch.tensor([True, rank == 0]), "i"),
            "pmax-bool": lax.pmax(torch.tensor([rank == 0, False]), "i"),
            "pmin-bool": lax.pmin(torch.tensor([True, rank == 0]), "i"),
            "all_gather-number": lax.all_gather(1.5, "i"),
            "ppermute-number": lax.ppermute(rank, "i", [(i, (i + 1) % world) for i in range(world)]),
            "psum-tree": lax.psum({"a": torch.ones(2), "b": [torch.full((1,), float(rank))]}, "i"),
            "psum-empty-axes": lax.psum(torch.full((2,), float(rank)), ()),
            "axis_index": lax.axis_index("i"),
            "axis_size": lax.axis_size("i"),
            "psum_scatter-is-psum-at-index": (
                lax.psum_scatter(torch.arange(float(world * 2)).reshape(world, 2) * (rank + 1), "i"),
                lax.psum(torch.arange(float(world * 2)).reshape(world, 2) * (rank + 1), "i")[
                    lax.axis_index("i")
                ],
            ),
        }
        try:
            y = lax.pmax(torch.ones(2, requires_grad=True), "i")
            y.sum().backward()
            res["scalars"]["pmax-backward"] = "nothing raised"
        except Exception as e:  # noqa: BLE001
            res["scalars"]["pmax-backward"] = f"{type(e).__name__}: {e}"
    with lax.mesh(meshes["i"]):  # JAX's dtypes (x64 on): 64-bit integers average to float64
        big = 2**24 + 1  # not a float32
        res["scalars"]["pmean-dtypes"] = {
            str(dt): lax.pmean(torch.full((2,), big if dt == torch.int64 else 3, dtype=dt), "i")
            for dt in (torch.int64, torch.int32, torch.int8, torch.uint8, torch.float16)  # gloo has no int16
        }
        res["scalars"]["pmean-dtypes"]["bool"] = lax.pmean(torch.tensor([True, rank == 0]), "i")
    if world == 4:
        with lax.mesh(meshes["dp_tp"]):
            # JAX numbers ppermute's pairs in mesh order over ("tp", "dp"), axis_index in the tuple's
            x = torch.tensor([float(rank + 1)])  # position dp * 2 + tp holds its position + 1
            res["scalars"]["ppermute-tp_dp-0-1"] = lax.ppermute(x, ("tp", "dp"), [(0, 1)])
            res["scalars"]["pshuffle-tp_dp-rotate"] = lax.pshuffle(x, ("tp", "dp"), [1, 2, 3, 0])
            res["scalars"]["axis_index-dp_tp"] = lax.axis_index(("dp", "tp"))
            res["scalars"]["axis_index-tp_dp"] = lax.axis_index(("tp", "dp"))
            res["scalars"]["axis_size-dp_tp"] = lax.axis_size(("dp", "tp"))
    res["scalars"] = funcoll.wait(res["scalars"])  # read now: the cases below count what is left in flight
    for key, per, axis in RAGGED[world]:
        try:
            index = jax_index(rank, axis)
            args = ragged_args(world, index, per)
            args["operand"].requires_grad_()
            args["output"].requires_grad_()
            with lax.mesh(meshes["i"] if axis == "i" else meshes["dp_tp"]):
                y = lax.ragged_all_to_all(**args, axis_name=axis)
            y.backward(seeded(tuple(y.shape), F64, "ragged-w", per, index))
            res[key] = settled({"y": y.detach(), "grads": [args["operand"].grad, args["output"].grad]})
        except Exception:  # noqa: BLE001
            res[key] = {"error": traceback.format_exc(limit=-6)}
    if world == 4:
        for key, fn in (
            ("jax-examples", lambda: jax_examples(rank, meshes)),
            ("docs-snippet", lambda: _snippet().step(rank, world)),
        ):
            try:
                res[key] = settled(fn())
            except Exception:  # noqa: BLE001
                res[key] = {"error": traceback.format_exc(limit=-8)}
    if world == 2:  # docs/jax.md's typed-mode example (it makes its own 1-D mesh)
        try:
            res["docs-typed-step"] = settled(_typed_snippet().step(rank, world))
        except Exception:  # noqa: BLE001
            res["docs-typed-step"] = {"error": traceback.format_exc(limit=-8)}
    if world == 2:  # JAX's docstring example, exactly
        a = {0: ([1, 2, 2], [0, 1], [1, 2], [0, 0], [1, 1]), 1: ([3, 4, 0], [0, 1], [1, 1], [1, 2], [2, 1])}[
            rank
        ]
        with lax.mesh(meshes["i"]):
            res["ragged-jax-example"] = lax.ragged_all_to_all(
                torch.tensor(a[0]),
                torch.zeros(4, dtype=torch.int64),
                *map(torch.tensor, a[1:]),
                axis_name="i",
            )
    if world == 4:
        for case in map_cases():
            try:
                res[case.id] = run_map_case(case, meshes["dp_tp"])
            except Exception:  # noqa: BLE001
                res[case.id] = {"error": traceback.format_exc(limit=-8)}
    return res


batch = once_per_world(body, TIMEOUT_S, worlds=WORLDS)
SNIPPET = Path(__file__).resolve().parents[1] / "docs" / "snippets" / "jax_shard_map.py"


def _snippet() -> ModuleType:
    """docs/jax.md's shard_map example."""
    return load_file(SNIPPET, "funcoll_docs_jax_shard_map")


def _typed_snippet() -> ModuleType:
    """docs/jax.md's typed-mode example."""
    return load_file(SNIPPET.with_name("jax_typed_step.py"), "funcoll_docs_jax_typed_step")


def _ok(res: dict[str, Any], rank: int, key: str) -> dict[str, Any]:
    got = res[key]
    assert "error" not in got, f"rank {rank}, {key}:\n{got['error']}"
    assert got["in_flight"] == 0, f"rank {rank}, {key}: {got['in_flight']} collectives left unwaited"
    return got


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "world,case",
    [(w, c) for w in WORLDS for c in lax_cases(w)],
    ids=lambda v: v if isinstance(v, int) else v.id,
)
def test_lax_op_matches_single_process_reference(world: int, case: Case) -> None:
    results = batch(world)
    xs = [x_of(case, r).requires_grad_(case.grad) for r in range(world)]
    ys = []
    for r in range(world):
        group = members(r, world, case.mesh, case.axis)
        if case.op in ("ppermute", "pshuffle"):  # JAX numbers their pairs in mesh (rank) order
            group = sorted(group)
        ys.append(reference(case, [xs[m] for m in group], group.index(r)))
    for r in range(world):
        got = _ok(results[r], r, case.id)
        torch.testing.assert_close(got["y"], ys[r].detach(), msg=lambda m, r=r: f"rank {r}: {m}")
    if case.grad:
        loss = sum((y * seeded(tuple(y.shape), F64, case.id, "w", r)).sum() for r, y in enumerate(ys))
        grads = torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True)
        for r in range(world):
            torch.testing.assert_close(
                results[r][case.id]["grad"], grads[r], msg=lambda m, r=r: f"rank {r}: {m}"
            )


@pytest.mark.parametrize("world", WORLDS)
def test_scalars_pytrees_and_indices_follow_jax(world: int) -> None:
    results = batch(world)
    for r in range(world):
        s = results[r]["scalars"]
        assert s["psum-1"] == world  # JAX: psum(1, axis) is the axis size
        assert s["pmean-2.5"] == pytest.approx(2.5)
        assert s["psum-bool"].dtype == torch.int32 and s["psum-bool"].tolist() == [world, 1]  # as int32
        assert s["pmax-bool"].dtype == torch.bool and s["pmax-bool"].tolist() == [True, False]  # bool stays
        assert s["pmin-bool"].dtype == torch.bool and s["pmin-bool"].tolist() == [True, False]
        assert s["all_gather-number"].tolist() == [1.5] * world  # a constant is an array, as in JAX
        assert s["ppermute-number"].item() == (r - 1) % world
        torch.testing.assert_close(s["psum-tree"]["a"], torch.full((2,), float(world)))
        torch.testing.assert_close(s["psum-tree"]["b"][0], torch.full((1,), float(sum(range(world)))))
        torch.testing.assert_close(s["psum-empty-axes"], torch.full((2,), float(r)))  # no axis: x itself
        assert (s["axis_index"], s["axis_size"]) == (r, world)
        torch.testing.assert_close(*s["psum_scatter-is-psum-at-index"])  # JAX's definition of psum_scatter
        assert (
            s["pmax-backward"].startswith("NotImplementedError")
            and "no gradient for op='max'" in s["pmax-backward"]
        )
        for name, mean in s["pmean-dtypes"].items():  # what jax.lax.pmean gives with x64 on
            want = {"torch.int64": torch.float64, "torch.float16": torch.float16}.get(name, torch.float32)
            assert mean.dtype == want, (name, mean.dtype)
            value = {"torch.int64": 2**24 + 1, "bool": [1.0, 1 / world]}.get(name, 3)
            assert mean.tolist() == (value if isinstance(value, list) else [value] * 2), (name, mean)
        if world == 4:  # row-major over the named axes, whatever their order (JAX's axis_index of a tuple)
            # the values jax 0.10.2 gives on a 2x2 mesh: ppermute's pairs count in mesh order
            assert s["ppermute-tp_dp-0-1"].tolist() == [[0.0], [1.0], [0.0], [0.0]][r]
            assert s["pshuffle-tp_dp-rotate"].tolist() == [[2.0], [3.0], [4.0], [1.0]][r]
            dp, tp = divmod(r, 2)
            assert s["axis_index-dp_tp"] == dp * 2 + tp
            assert s["axis_index-tp_dp"] == tp * 2 + dp
            assert s["axis_size-dp_tp"] == 4


def test_ragged_all_to_all_is_jax_docstring_example() -> None:
    results = batch(2)
    assert results[0]["ragged-jax-example"].tolist() == [1, 3, 0, 0]
    assert results[1]["ragged-jax-example"].tolist() == [2, 2, 4, 0]


@pytest.mark.parametrize(
    "world,key,per,axis",
    [pytest.param(w, *c, id=f"{w}-{c[0]}") for w in WORLDS for c in RAGGED[w]],
)
def test_ragged_all_to_all_matches_jax_pseudocode(world: int, key: str, per: int, axis: Any) -> None:
    """The reference is indexed by JAX's index along `axis` (row-major over its names, in the order given)."""
    results = batch(world)
    args = [ragged_args(world, j, per) for j in range(world)]
    for a in args:
        a["operand"].requires_grad_()
        a["output"].requires_grad_()
    want = ragged_reference(args, per)
    loss = sum((y * seeded(tuple(y.shape), F64, "ragged-w", per, j)).sum() for j, y in enumerate(want))
    leaves = [t for a in args for t in (a["operand"], a["output"])]
    grads = torch.autograd.grad(loss, leaves)
    for r in range(world):
        j = jax_index(r, axis)
        got = _ok(results[r], r, key)
        torch.testing.assert_close(got["y"], want[j].detach())  # the shape is output's: static
        torch.testing.assert_close(got["grads"][0], grads[2 * j])
        torch.testing.assert_close(got["grads"][1], grads[2 * j + 1])


@pytest.mark.parametrize("case", map_cases(), ids=lambda c: c.id)
def test_shard_map_matches_global_function(case: MapCase) -> None:
    results = batch(4)
    want = map_reference(case)
    out_specs = (
        case.out_specs
        if isinstance(case.out_specs, tuple) and not isinstance(case.out_specs, P)
        else (case.out_specs,)
    )
    for r in range(4):
        got = _ok(results[r], r, case.id)
        for k, (o, w) in enumerate(zip(got["outs"], want["outs"], strict=True)):
            torch.testing.assert_close(o, w, msg=lambda m, r=r, k=k: f"rank {r}, output {k}: {m}")
        for k, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            torch.testing.assert_close(g, w, msg=lambda m, r=r, k=k: f"rank {r}, gradient {k}: {m}")
        for spec, placements in zip(out_specs, got["placements"], strict=True):
            expected = ["R", "R"]
            for d, entry in enumerate(spec):
                for a in entry if isinstance(entry, tuple) else (entry,):
                    if a is not None:
                        expected[("dp", "tp").index(a)] = f"S({d})"
            assert placements == expected, (spec, placements)


@pytest.mark.parametrize("world", WORLDS)
def test_bad_calls_raise_before_communicating(world: int) -> None:
    results = batch(world)
    for r in range(world):
        for name, message in results[r]["errors"].items():
            assert message.startswith(EXPECTED_ERRORS[name]), f"rank {r}, {name}: {message}"
    assert "i'," in EXPECTED_ERRORS["unknown-axis"]  # the message lists the known axes


def test_jax_documented_examples_hold_literally() -> None:
    """The printed values of JAX's docstrings and shard_map tutorial, on 4 ranks, exactly."""
    results = batch(4)
    for r in range(4):
        got = _ok(results[r], r, "jax-examples")
        assert set(got) - {"in_flight"} == set(JAX_EXAMPLES)
        for name, want in JAX_EXAMPLES.items():
            value = got[name]
            value = value.tolist() if isinstance(value, Tensor) else value
            expected = want[r]
            if name in ("x/psum", "x/pmean", "pmean"):
                assert value == pytest.approx(expected), (r, name, value)
            else:
                assert value == expected, (r, name, value)


def test_docs_shard_map_snippet_matches_single_process() -> None:
    """docs/snippets/jax_shard_map.py (the example on docs/jax.md) on 4 ranks against the plain MLP."""
    mod = _snippet()
    x, w1, w2 = (t.requires_grad_() for t in mod.global_inputs())
    want = torch.tanh(x @ w1) @ w2
    grads = torch.autograd.grad(want.square().sum(), [x, w1, w2])
    results = batch(4)
    for r in range(4):
        got = _ok(results[r], r, "docs-snippet")
        assert got["placements"] == "(Shard(dim=0), Replicate())"
        torch.testing.assert_close(got["y"], want.detach())
        for g, w in zip(got["grads"], grads, strict=True):
            torch.testing.assert_close(g, w)


def test_docs_typed_step_matches_single_process() -> None:
    """docs/snippets/jax_typed_step.py on 2 ranks: with check_vma=True each rank's new weights are one
    process's SGD step on the whole batch (the mean loss's gradient); with check_vma=False each rank's are
    the step on its own rows, as JAX's are in that mode, though the spec says they are replicated."""
    w, x = _typed_snippet().global_inputs()
    rows = x.chunk(2)

    def sgd(batch: Tensor, scale: float) -> Tensor:
        v = w.clone().requires_grad_()
        ((batch @ v) ** 2).sum().mul(scale).backward()
        return w - 0.1 * v.grad

    for r, got in enumerate(batch(2)):
        got = _ok(got, r, "docs-typed-step")
        torch.testing.assert_close(got["check_vma=True"], sgd(x, 0.5), msg=lambda m, r=r: f"rank {r}: {m}")
        torch.testing.assert_close(
            got["check_vma=False"], sgd(rows[r], 1.0), msg=lambda m, r=r: f"rank {r}: {m}"
        )
