"""funcoll.lax and funcoll.shard_map against JAX itself: the same programs, run in both, compared.

Each program is written once, as a function of the ``lax`` module and the array
namespace (``fn(lax, ns, *xs)``), and runs twice: in JAX, as ``jax.shard_map``
(``check_vma=False``, x64 on, CPU with 8 forced host devices), and in funcoll on
gloo ranks (``funcoll.lax`` with ``torch``). Every output is compared on every
rank, value and dtype, and so is the float64 gradient of the scalar loss
``sum(out * w)`` (``w`` a fixed random array per rank): ``jax.grad`` against
funcoll's backward. JAX's gradients are those of ``check_vma=False``, where
``psum``'s transpose is ``psum``: each rank's loss is its own and the losses add up,
funcoll's convention for per-rank code.

* Ops: every ``funcoll.lax`` collective (psum, pmean, pmax, pmin, all_gather and
  psum_scatter tiled and untiled, all_to_all tiled and untiled, ppermute, pshuffle,
  axis_index, axis_size, ragged_all_to_all).
* Meshes: "i" (4), ("dp", "tp") (2x2) and ("a", "b", "c") (2x2x2); one axis, and
  tuples of axes in mesh order and out of it (``("tp", "dp")``, ``("c", "a", "b")``,
  ``("c", "b")``...), where JAX numbers ``ppermute``'s pairs in mesh order and the
  other collectives' indices in the tuple's.
* Dtypes: float64 (with gradients), float32, int8, uint8, int32, int64 and bool
  (JAX's promotions: ``psum`` of bool is int32, ``pmean`` of int64 float64).
* Programs: ``shard_map`` of a Megatron MLP on both meshes, a ring of ``ppermute``
  hops over axes out of mesh order, a sequence-parallel ``all_gather`` / matmul /
  ``psum_scatter`` whose input is replicated over another axis, and a ``psum``
  into a replicated output (the cotangent split over its replicas).
* Compiled: three per-rank cases over ``("tp", "dp")`` (ppermute, pshuffle, pmean of
  int64) also run under ``torch.compile(fullgraph=True, backend="aot_eager")``;
  compile_tests/test_lax_compile.py compiles the rest against eager.

Where JAX cannot run or differentiate a case, the test says so and does what JAX
documents instead:

* XLA:CPU has no ``ragged_all_to_all`` ("HLO opcode ragged-all-to-all is not
  supported"): its cases compare with JAX's documented semantics written in
  ``jnp`` (each sender's slice k written at ``output_offsets[k]`` on the receiver
  of index ``k // (K // n)``, the axis indexed in the tuple's order, as its lowering
  groups replicas), differentiated by ``jax.grad``. Should a JAX release run the
  op on CPU, its result is compared too.
* ``jax.grad`` of an untiled ``all_to_all`` with ``split_axis != concat_axis``
  raises in jax 0.10.2 (a cotangent of the wrong shape): those gradients come
  from ``jax.jacfwd`` of the same loss, forward mode, which is the same number.
* ``pmax`` / ``pmin`` have no gradient in either.
* jax 0.10.2 cannot run a negative ``scatter_dimension`` (XLA refuses it) or
  ``split_axis`` (XLA crashes): those cases' JAX side counts the same dims from the
  front (``_op_jax_at``); negative ``all_gather`` axes run in JAX as written.

JAX runs in a subprocess (``python tests/test_lax_jax.py OUT``), one ``jit`` per
mesh computing every output and gradient of its cases: ``run_ranks`` forks, and a
process that has started XLA's threads must not fork. The pytest process only
imports jax (``pytest.importorskip``), which starts no thread. The subprocess
runs while the ranks do: one ``run_ranks`` of 4 and one of 8 run every case.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jax")  # and numpy, which jax requires

import numpy as np
import torch
from _inputs import load_file, once_per_world
from torch import Tensor

import funcoll
import funcoll.lax as flax
from funcoll.testing import in_flight

TIMEOUT_S = 240.0
ROOT = Path(__file__).resolve().parents[1]

# name -> (shape, axis names); a rank's position in the mesh is its rank, row-major, in both
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "i": ((4,), ("i",)),
    "dp_tp": ((2, 2), ("dp", "tp")),
    "abc": ((2, 2, 2), ("a", "b", "c")),
}
WORLD = {"i": 4, "dp_tp": 4, "abc": 8}
# the axes every op runs over: one name, and tuples in mesh order and out of it
AXES: dict[str, list[Any]] = {
    "i": ["i"],
    "dp_tp": ["dp", "tp", ("dp", "tp"), ("tp", "dp")],
    "abc": ["b", ("a", "c"), ("b", "a"), ("c", "b"), ("c", "a", "b"), ("a", "b", "c")],
}


def size_of(mesh: str, axis: Any) -> int:
    shape, names = MESHES[mesh]
    out = 1
    for a in axis if isinstance(axis, tuple) else (axis,):
        out *= shape[names.index(a)]
    return out


def members(mesh: str, axis: Any, rank: int) -> list[int]:
    """The ranks of `rank`'s group along `axis`, in the order of JAX's index along it (the tuple's)."""
    shape, names = MESHES[mesh]
    named = [names.index(a) for a in (axis if isinstance(axis, tuple) else (axis,))]
    mine = np.unravel_index(rank, shape)
    group = []
    for pos in itertools.product(*(range(s) for s in shape)):
        if all(pos[d] == mine[d] for d in range(len(shape)) if d not in named):
            group.append(pos)
    index = {p: int(np.ravel_multi_index([p[d] for d in named], [shape[d] for d in named])) for p in group}
    return [int(np.ravel_multi_index(p, shape)) for p in sorted(group, key=index.__getitem__)]


def tag(axis: Any) -> str:
    return "_".join(axis) if isinstance(axis, tuple) else axis


def seeded(shape: Sequence[int], dtype: str, *key: object) -> np.ndarray:
    """A deterministic array: normal floats, small integers (non-negative when unsigned), booleans."""
    g = np.random.default_rng(zlib.crc32(repr(key).encode()))
    if dtype.startswith("float"):
        return g.standard_normal(tuple(shape)).astype(dtype)
    if dtype == "bool":
        return g.integers(0, 2, tuple(shape)).astype(bool)
    low = 0 if dtype.startswith("uint") else -4
    return g.integers(low, 5, tuple(shape)).astype(dtype)


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """`fn`(lax, ns, *xs) on every rank of `mesh`, each rank's xs of `inputs` (shape, dtype)."""

    id: str
    mesh: str
    fn: Callable[..., Any]
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    grad: str | None = "grad"  # "grad": jax.grad; "jacfwd": JAX's grad raises, forward mode; None
    compiled: bool = False  # also run funcoll's side under torch.compile(fullgraph=True)
    make: Callable[[int], list[np.ndarray]] | None = None  # per-rank inputs, where `inputs` won't do
    # JAX's documented semantics in jnp, where XLA:CPU has no op: (operand, output, *numpy int arrays)
    jnp_ref: Callable[..., Any] | None = None

    def arrays(self, rank: int) -> list[np.ndarray]:
        if self.make is not None:
            return self.make(rank)
        return [seeded(s, d, self.id, k, rank) for k, (s, d) in enumerate(self.inputs)]


def _op(op: str, axis_name: Any, **kw: Any) -> Callable[..., Any]:
    def fn(lax: Any, ns: Any, x: Any) -> Any:
        return getattr(lax, op)(x, axis_name, **kw)

    return fn


def _op_jax_at(op: str, axis_name: Any, kw: dict[str, int], jax_kw: dict[str, int]) -> Callable[..., Any]:
    """funcoll's `op` with `kw` (negative dims); JAX's with `jax_kw`, the same dims counted from the front.

    jax 0.10.2 types negative dims of ``psum_scatter`` and ``all_to_all`` but cannot
    run them: XLA refuses a negative ``scatter_dimension`` ("must be non-negative")
    and crashes (SIGSEGV) on a negative ``split_axis``. A negative dim counts from the
    end, as everywhere in JAX and torch, so JAX runs the same dims counted from the
    front.
    """

    def fn(lax: Any, ns: Any, x: Any) -> Any:
        return getattr(lax, op)(x, axis_name, **(kw if lax is flax else jax_kw))

    return fn


def _index(axis: Any) -> Callable[..., Any]:
    def fn(lax: Any, ns: Any, x: Any) -> Any:
        return x * lax.axis_size(axis) + lax.axis_index(axis)

    return fn


def _ring_loop(axis: Any, n: int) -> Callable[..., Any]:
    """n - 1 hops around the ring of `axis`, each hop's arrival weighted by its distance."""

    def fn(lax: Any, ns: Any, x: Any) -> Any:
        ring = [(i, (i + 1) % n) for i in range(n)]
        acc, y = x, x
        for hop in range(1, n):
            y = lax.ppermute(ns.tanh(y), axis, ring)
            acc = acc + y * hop
        return acc

    return fn


def _pmean_big(axis: Any) -> Callable[..., Any]:
    def fn(lax: Any, ns: Any, x: Any) -> Any:  # 2**24 + 1 and neighbours: not float32 numbers
        return lax.pmean(x + 2**24 + 1, axis)

    return fn


def op_cases(mesh: str, axis: Any) -> list[Case]:
    n, a, f = size_of(mesh, axis), tag(axis), "float64"
    ring = [(i, (i + 1) % n) for i in range(n)]
    rows: list[tuple[str, Callable[..., Any], tuple[int, ...], str | None]] = [
        ("psum-3x2", _op("psum", axis), (3, 2), "grad"),
        ("pmean-3", _op("pmean", axis), (3,), "grad"),
        ("pmax-2x3", _op("pmax", axis), (2, 3), None),
        ("pmin-2x3", _op("pmin", axis), (2, 3), None),
        ("all_gather-3x2-axis1", _op("all_gather", axis, axis=1), (3, 2), "grad"),
        ("all_gather-2x3-tiled", _op("all_gather", axis, tiled=True), (2, 3), "grad"),
        # JAX's invariant all-gather: the transpose is a slice of this rank's cotangent
        ("all_gather-3x2-axis1-invarying", _op("all_gather", axis, axis=1, to="invarying"), (3, 2), "grad"),
        (
            "all_gather-2x3-tiled-invarying",
            _op("all_gather", axis, tiled=True, to="invarying"),
            (2, 3),
            "grad",
        ),
        (f"psum_scatter-{n}x3", _op("psum_scatter", axis), (n, 3), "grad"),
        (
            f"psum_scatter-3x{2 * n}-dim1-tiled",
            _op("psum_scatter", axis, scatter_dimension=1, tiled=True),
            (3, 2 * n),
            "grad",
        ),
        (f"all_to_all-{n}x3-s0c0", _op("all_to_all", axis, split_axis=0, concat_axis=0), (n, 3), "grad"),
        (f"all_to_all-{n}x3-s0c1", _op("all_to_all", axis, split_axis=0, concat_axis=1), (n, 3), "jacfwd"),
        (f"all_to_all-2x{n}-s1c0", _op("all_to_all", axis, split_axis=1, concat_axis=0), (2, n), "jacfwd"),
        (
            f"all_to_all-3x{2 * n}-s1c0-tiled",
            _op("all_to_all", axis, split_axis=1, concat_axis=0, tiled=True),
            (3, 2 * n),
            "grad",
        ),
        ("ppermute-2-ring", _op("ppermute", axis, perm=ring), (2,), "grad"),
        ("ppermute-2-pairs", _op("ppermute", axis, perm=[(0, n - 1), (1, 0)]), (2,), "grad"),
        ("pshuffle-2-rotate", _op("pshuffle", axis, perm=[(i + 1) % n for i in range(n)]), (2,), "grad"),
        ("axis_index-size-2", _index(axis), (2,), "grad"),
        ("pcast-2x3-varying", _op("pcast", axis, to="varying"), (2, 3), "grad"),
    ]
    return [Case(f"{name}-{mesh}-{a}", mesh, fn, (((shape), f),), grad) for name, fn, shape, grad in rows]


def negative_dim_cases() -> list[Case]:
    """Dims counted from the end, on one axis (or tuple) of each mesh; JAX's oracle as `_op_jax_at` says."""
    out = []
    for mesh, axis in (("i", "i"), ("dp_tp", ("tp", "dp")), ("abc", ("c", "a", "b"))):
        n, a = size_of(mesh, axis), tag(axis)
        rows: list[tuple[str, Callable[..., Any], tuple[int, ...]]] = [
            ("all_gather-3x2-axis-1", _op("all_gather", axis, axis=-1), (3, 2)),  # JAX runs these itself
            ("all_gather-2x3-tiled-axis-1", _op("all_gather", axis, axis=-1, tiled=True), (2, 3)),
            (
                f"psum_scatter-3x{n}-dim-1",
                _op_jax_at("psum_scatter", axis, {"scatter_dimension": -1}, {"scatter_dimension": 1}),
                (3, n),
            ),
            (
                f"psum_scatter-3x{2 * n}-dim-1-tiled",
                _op_jax_at(
                    "psum_scatter",
                    axis,
                    {"scatter_dimension": -1, "tiled": True},
                    {"scatter_dimension": 1, "tiled": True},
                ),
                (3, 2 * n),
            ),
            (
                f"all_to_all-3x{2 * n}-s-1c-2-tiled",
                _op_jax_at(
                    "all_to_all",
                    axis,
                    {"split_axis": -1, "concat_axis": -2, "tiled": True},
                    {"split_axis": 1, "concat_axis": 0, "tiled": True},
                ),
                (3, 2 * n),
            ),
        ]
        out += [
            Case(f"{name}-{mesh}-{a}", mesh, fn, ((shape, "float64"),), "grad") for name, fn, shape in rows
        ]
    return out


def dtype_cases() -> list[Case]:
    out = []
    for mesh, axis in (("dp_tp", ("tp", "dp")), ("abc", ("c", "a", "b")), ("abc", ("c", "b"))):
        a, n = tag(axis), size_of(mesh, axis)
        for op, dtypes in (
            ("psum", ("int32", "int64", "bool", "uint8", "float32")),
            ("pmean", ("int8", "uint8", "int32", "int64", "bool", "float32")),
            ("pmax", ("int64", "bool")),
            ("pmin", ("int32", "bool")),
        ):
            out += [
                Case(f"{op}-2x3-{d}-{mesh}-{a}", mesh, _op(op, axis), (((2, 3), d),), None) for d in dtypes
            ]
        out += [
            Case(f"pmean-big-int64-{mesh}-{a}", mesh, _pmean_big(axis), (((3,), "int64"),), None),
            Case(
                f"all_gather-2-tiled-int32-{mesh}-{a}",
                mesh,
                _op("all_gather", axis, tiled=True),
                (((2,), "int32"),),
                None,
            ),
            Case(f"all_gather-2-bool-{mesh}-{a}", mesh, _op("all_gather", axis), (((2,), "bool"),), None),
            Case(
                f"psum_scatter-{n}x2-int64-{mesh}-{a}",
                mesh,
                _op("psum_scatter", axis),
                (((n, 2), "int64"),),
                None,
            ),
            Case(
                f"ppermute-3-int64-{mesh}-{a}",
                mesh,
                _op("ppermute", axis, perm=[(0, 1), (1, 2), (n - 1, 0)]),
                (((3,), "int64"),),
                None,
            ),
            Case(
                f"all_to_all-{n}x2-int32-{mesh}-{a}",
                mesh,
                _op("all_to_all", axis, split_axis=0, concat_axis=1),
                (((n, 2), "int32"),),
                None,
            ),
        ]
    return out


# ------------------------------------------------------------------------ ragged_all_to_all
def _ragged_make(mesh: str, axis: Any, per: int, key: str) -> Callable[[int], list[np.ndarray]]:
    """Rank r's six arguments; sizes from one seeded table over JAX's indices along `axis`:
    index i sends table[i, j * per + s] rows to index j in slice s, packed after one spare row."""
    n = size_of(mesh, axis)
    k = n * per
    table = np.random.default_rng(zlib.crc32(key.encode())).integers(0, 3, (n, k))
    recv_of = [table[:, j * per : (j + 1) * per].reshape(-1) for j in range(n)]  # (source, slice) order
    big_n = int(table.sum(1).max()) + 3
    big_m = max(int(r.sum()) for r in recv_of) + 3

    def make(rank: int) -> list[np.ndarray]:
        i = members(mesh, axis, rank).index(rank)
        send = table[i]
        out_off = np.array(
            [(np.cumsum(recv_of[j]) - recv_of[j] + 1)[i * per + s] for j in range(n) for s in range(per)]
        )
        return [
            seeded((big_n, 2), "float64", key, "operand", rank),
            seeded((big_m, 2), "float64", key, "output", rank),
            np.cumsum(send) - send + 1,
            send.copy(),
            out_off,
            recv_of[i].copy(),
        ]

    return make


def _ragged_fn(axis: Any) -> Callable[..., Any]:
    def fn(lax: Any, ns: Any, *args: Any) -> Any:
        return lax.ragged_all_to_all(*args, axis_name=axis)

    return fn


def _ragged_jnp(mesh: str, axis: Any) -> Callable[..., Any]:
    """jax.lax.ragged_all_to_all's documented semantics over the stacked per-rank arguments, in jnp."""

    def ref(operand: Any, output: Any, in_off: Any, send: Any, out_off: Any, recv: Any) -> Any:
        n = size_of(mesh, axis)
        per = in_off.shape[1] // n
        results = []
        for r in range(output.shape[0]):
            group = members(mesh, axis, r)
            j = group.index(r)
            y = output[r]
            for src in group:
                for s in range(per):
                    k = j * per + s
                    lo, size, at = int(in_off[src, k]), int(send[src, k]), int(out_off[src, k])
                    y = y.at[at : at + size].set(operand[src, lo : lo + size])
            results.append(y)
        return results

    return ref


def ragged_cases() -> list[Case]:
    out = []
    for mesh, axis, per in (
        ("i", "i", 1),
        ("i", "i", 2),
        ("dp_tp", ("tp", "dp"), 2),
        ("abc", ("c", "a", "b"), 1),
    ):
        key = f"ragged_all_to_all-per{per}-{mesh}-{tag(axis)}"
        out.append(
            Case(
                key,
                mesh,
                _ragged_fn(axis),
                (),
                make=_ragged_make(mesh, axis, per, key),
                jnp_ref=_ragged_jnp(mesh, axis),
            )
        )
    return out


def program_cases() -> list[Case]:
    return [
        Case("ring_loop-3-abc-c_a_b", "abc", _ring_loop(("c", "a", "b"), 8), (((3,), "float64"),)),
        Case("ring_loop-2x2-dp_tp-tp_dp", "dp_tp", _ring_loop(("tp", "dp"), 4), (((2, 2), "float64"),)),
        Case("ring_loop-3-i", "i", _ring_loop("i", 4), (((3,), "float64"),)),
    ]  # fmt: skip


COMPILED = {  # funcoll's side of these runs compiled too (each compile costs seconds on 4 ranks)
    "ppermute-2-pairs-dp_tp-tp_dp",
    "pshuffle-2-rotate-dp_tp-tp_dp",
    "pmean-big-int64-dp_tp-tp_dp",
    "all_gather-2x3-tiled-invarying-dp_tp-tp_dp",
}


def cases() -> list[Case]:
    out = [c for mesh, axes in AXES.items() for axis in axes for c in op_cases(mesh, axis)]
    out += negative_dim_cases() + dtype_cases() + ragged_cases() + program_cases()
    return [dataclasses.replace(c, compiled=True) if c.id in COMPILED else c for c in out]


# ------------------------------------------------------------------------ shard_map programs
@dataclass(frozen=True)
class MapCase:
    """shard_map(fn, mesh, in_specs, out_spec) on global inputs of `shapes` (float64), in both."""

    id: str
    mesh: str
    fn: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    in_specs: tuple[tuple[Any, ...], ...]  # the entries of each P
    out_spec: tuple[Any, ...]
    typed: bool = True  # also run with check_vma=True, as id + TYPED (in both)

    def arrays(self) -> list[np.ndarray]:
        return [seeded(s, "float64", self.id, k) for k, s in enumerate(self.shapes)]


TYPED = "@vma"  # the suffix of a program's id run with check_vma=True
# typed programs whose funcoll side runs compiled too (fullgraph; a few seconds each on 4 ranks)
COMPILED_TYPED = ("typing-psum-invariant-dp_tp",)


def _mlp(tp: Any) -> Callable[..., Any]:
    def fn(lax: Any, ns: Any, x: Any, w1: Any, w2: Any) -> Any:
        return lax.psum(ns.tanh(x @ w1) @ w2, tp)

    return fn


def _seq_parallel(axis: Any) -> Callable[..., Any]:
    def fn(lax: Any, ns: Any, x: Any, w: Any) -> Any:
        full = lax.all_gather(x, axis, tiled=True)
        return lax.psum_scatter(ns.tanh(full @ w), axis, tiled=True)

    return fn


def _psum_to_replicated(lax: Any, ns: Any, x: Any) -> Any:
    return lax.psum(x * x, "tp")


def _gather_invariant(lax: Any, ns: Any, x: Any, w: Any) -> Any:
    """The sequence gathered as an invariant value, a layer applied alike on every rank, cast back."""
    full = lax.all_gather(x, "tp", tiled=True, to="invarying")
    return lax.pcast(ns.tanh(full @ w), "dp", to="reduced") * 2.0


def map_cases() -> list[MapCase]:
    return [
        MapCase("mlp-dp_tp", "dp_tp", _mlp("tp"), ((4, 3), (3, 6), (6, 3)),
                (("dp", None), (None, "tp"), ("tp", None)), ("dp", None)),
        MapCase("mlp-abc-tp_bc", "abc", _mlp(("b", "c")), ((4, 3), (3, 8), (8, 3)),
                (("a", None), (None, ("b", "c")), (("b", "c"), None)), ("a", None)),
        # gathered over ("c", "b"), sharded over ("b", "c"): JAX's tuple order; replicated over "a"
        MapCase("seq_parallel-abc-c_b", "abc", _seq_parallel(("c", "b")), ((8, 3), (3, 3)),
                ((("b", "c"), None), ()), (("b", "c"), None)),
        MapCase("psum-to-replicated-dp_tp", "dp_tp", _psum_to_replicated, ((3, 4),), ((None, "tp"),), ()),
        # pcast(to="reduced") has no typed form in funcoll (no reduced values): untyped only
        MapCase("gather-invarying-dp_tp", "dp_tp", _gather_invariant, ((4, 3), (3, 3)), (("tp", None), ()), (),
                typed=False),
        *typing_cases(),
    ]  # fmt: skip


def _one(op: str, **kw: Any) -> Callable[..., Any]:
    def fn(lax: Any, ns: Any, x: Any) -> Any:
        return getattr(lax, op)(x, "tp", **kw)

    return fn


def _cast_mul(lax: Any, ns: Any, x: Any, w: Any) -> Any:
    """An invariant weight cast to vary over "dp" by hand, then one JAX casts itself (x @ w)."""
    return (x * lax.pcast(w[0], "dp", to="varying")) @ w


def typing_cases() -> list[MapCase]:
    """Each collective on a value invariant over "tp" (spec P()) and on one varying over it (P("tp")),
    in both modes: the typed transposes (psum's moves nothing, a cast's psums) against the untyped."""
    ring = [(0, 1), (1, 0)]
    ops: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
        ("psum", _one("psum"), ()),
        ("pmean", _one("pmean"), ()),
        ("all_gather", _one("all_gather", tiled=True), ("tp", None)),
        ("all_gather-invarying", _one("all_gather", tiled=True, to="invarying"), ()),
        ("psum_scatter", _one("psum_scatter", tiled=True), ("tp", None)),
        ("ppermute", _one("ppermute", perm=ring), ("tp", None)),
        ("all_to_all", _one("all_to_all", split_axis=1, concat_axis=0, tiled=True), ("tp", None)),
    ]
    out = []
    for name, fn, spec in ops:
        for kind, in_spec in (("invariant", ()), ("varying", ("tp", None))):
            if name == "all_gather-invarying" and kind == "invariant":
                continue  # JAX requires a varying input there
            out.append(MapCase(f"typing-{name}-{kind}-dp_tp", "dp_tp", fn, ((4, 4),), (in_spec,), spec))
    out.append(MapCase("typing-pcast-mul-dp_tp", "dp_tp", _cast_mul, ((4, 3), (3, 3)), (("dp", None), ()),
                       ("dp", None)))  # fmt: skip
    return out


# ------------------------------------------------------------------------------ refusals
@dataclass(frozen=True)
class ErrCase:
    """A program JAX refuses while tracing (``check_vma=False``), run on the ("dp", "tp") mesh: funcoll
    must refuse it too, with the same exception class, before any collective."""

    id: str
    fn: Callable[[Any, Any], Any]  # fn(lax, x), x this rank's (1, 2) block


ERR_CASES = [
    ErrCase("all_gather-to-reduced", lambda lax, x: lax.all_gather(x, "tp", to="reduced")),
    ErrCase("all_gather-to-invariant", lambda lax, x: lax.all_gather(x, "tp", to="invariant")),  # 'invarying'
    ErrCase("pcast-to-unreduced", lambda lax, x: lax.pcast(x, "tp", to="unreduced")),
    ErrCase("pcast-to-invarying", lambda lax, x: lax.pcast(x, ("dp", "tp"), to="invarying")),
    ErrCase("pcast-axis-set", lambda lax, x: lax.pcast(x, {"tp"}, to="varying")),
]


# A shard_map(check_vma=True) that JAX refuses while tracing; funcoll refuses it with the same class.
TYPED_ERR_CASES = [
    MapCase("typed-varying-out-under-P-dp_tp", "dp_tp", lambda lax, ns, x: x * 2, ((4, 2),), (("tp", None),), ()),
    MapCase("typed-all_gather-out-under-P-dp_tp", "dp_tp", lambda lax, ns, x: lax.all_gather(x, "tp"),
            ((4, 2),), (("tp", None),), ()),
    MapCase("typed-psum-over-one-axis-out-under-P-dp_tp", "dp_tp", lambda lax, ns, x: lax.psum(x, "dp"),
            ((4, 2),), ((("dp", "tp"), None),), ()),
    MapCase("typed-pcast-varying-twice-dp_tp", "dp_tp", lambda lax, ns, x: lax.pcast(x, "tp", to="varying"),
            ((4, 2),), (("tp", None),), ("tp", None)),
    # a sum over ("dp", "tp") of a value varying over "tp" alone: JAX asks for a cast, or the varying axes
    MapCase("typed-psum-over-mixed-axes-dp_tp", "dp_tp", lambda lax, ns, x: lax.psum(x, ("dp", "tp")),
            ((2, 4),), ((None, "tp"),), ()),
    MapCase("typed-pmean-over-mixed-axes-dp_tp", "dp_tp", lambda lax, ns, x: lax.pmean(x, ("tp", "dp")),
            ((2, 4),), ((None, "tp"),), ()),
    MapCase("typed-psum_scatter-over-mixed-axes-dp_tp", "dp_tp",
            lambda lax, ns, x: lax.psum_scatter(x, ("dp", "tp"), scatter_dimension=1, tiled=True),
            ((2, 8),), ((None, "tp"),), (None, ("dp", "tp"))),
]  # fmt: skip


# docs/jax.md's migration example: a JAX SGD step whose gradient is right only with check_vma=True.
STEP = "typed-sgd-step"
STEP_WORLD = 4


def _step_snippet() -> Any:
    return load_file(ROOT / "docs" / "snippets" / "jax_typed_step.py", "funcoll_docs_jax_typed_step")


def _step_inputs() -> list[np.ndarray]:
    return [t.numpy() for t in _step_snippet().global_inputs()]


# Gradients taken inside f (jax.grad there, torch.autograd.grad or backward here), on the step's mesh
# and inputs (w: P(), x: P("dp")), in both modes; each returns every rank's copy of its result.
def _grad_of_invariant_loss(lax: Any, ns: Any, grad: Any, w: Any, x: Any) -> Any:
    """x's gradient of a loss psummed over "dp": invariant, so typed, its transpose moves nothing."""
    return grad(lambda x: lax.psum(ns.sum((x @ w) ** 2), "dp"))(x)


def _grad_then_pmean(lax: Any, ns: Any, grad: Any, w: Any, x: Any) -> Any:
    """A data-parallel step's gradient of each rank's own loss, then its mean."""
    return lax.pmean(grad(lambda w: ns.sum(ns.tanh(x @ w)))(w), "dp")


def _hessian_vector(lax: Any, ns: Any, grad: Any, w: Any, x: Any) -> Any:
    """A gradient of a gradient: typed, the cast of w (into x @ w) is differentiated twice."""
    loss = lambda w: lax.pmean(ns.sum(ns.tanh(x @ w) ** 2), "dp")  # noqa: E731 -- as JAX code writes it
    return grad(lambda w: ns.sum(grad(loss)(w) * w))(w)


def _backward_inputs(lax: Any, ns: Any, grad: Any, w: Any, x: Any) -> Any:
    """_grad_then_pmean with ``loss.backward(inputs=[w])`` (torch only; JAX's side is jax.grad's)."""
    if ns is not torch:
        return _grad_then_pmean(lax, ns, grad, w, x)
    w = w.detach().requires_grad_()
    torch.tanh(x @ w).sum().backward(inputs=[w])
    return lax.pmean(w.grad, "dp")


GRAD_PROGRAMS: dict[str, Callable[..., Any]] = {
    "grad-of-invariant-loss": _grad_of_invariant_loss,
    "grad-then-pmean": _grad_then_pmean,
    "hessian-vector": _hessian_vector,
    "backward-inputs": _backward_inputs,
}


def _torch_grad(f: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``jax.grad(f)`` as torch code inside f writes it (create_graph, for a gradient of it)."""

    def g(v: Tensor) -> Tensor:
        leaf = v if v.requires_grad else v.detach().requires_grad_()
        (d,) = torch.autograd.grad(f(leaf), leaf, create_graph=True)
        return d

    return g


# ------------------------------------------------------------------------------ JAX's side
def run_jax(path: str) -> None:
    """Every program in JAX; writes {id: {"y": ..., "grads": ..., "grad_by": ...}} to `path`.

    A per-rank case's "y" is a list (one output per rank) and its "grads" a list (per
    input) of lists (per rank); a shard_map program's are the global arrays. One jit
    per mesh computes every output and gradient of that mesh.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_enable_x64", True)
    assert len(jax.devices()) >= 8, "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts"
    out: dict[str, Any] = {"jax": jax.__version__}
    meshes = {
        name: Mesh(np.array(jax.devices()[: WORLD[name]]).reshape(shape), names)
        for name, (shape, names) in MESHES.items()
    }

    def per_rank(c: Case, check_vma: bool = False) -> Callable[..., Any]:
        """`c` as a function of the stacked inputs (rank r's in row r) to the stacked outputs."""
        if c.jnp_ref is not None:  # the operand and output; the offsets and sizes are static numpy
            sizes = stacked(c)[2:]
            return lambda operand, output: jnp.stack(c.jnp_ref(operand, output, *sizes))
        rows = P(MESHES[c.mesh][1])  # dim 0 over every axis, the first major: position r holds row r

        def local(*blocks: Any) -> Any:  # each rank's block of rows: (1, *shape)
            return c.fn(lax, jnp, *(b[0] for b in blocks))[None]

        return jax.shard_map(local, mesh=meshes[c.mesh], in_specs=(rows,) * len(c.arrays(0)), out_specs=rows,
                             check_vma=check_vma)  # fmt: skip

    def stacked(c: Case) -> list[np.ndarray]:
        return [np.stack(t) for t in zip(*(c.arrays(r) for r in range(WORLD[c.mesh])), strict=True)]

    # id -> (function, its arguments, which are differentiated, how, weights of its output)
    programs: dict[str, tuple[Callable[..., Any], list[np.ndarray], list[int], str | None]] = {}
    for c in cases():
        args = stacked(c)[:2] if c.jnp_ref is not None else stacked(c)
        diff = [k for k, a in enumerate(args) if a.dtype == np.float64] if c.grad else []
        programs[c.id] = (per_rank(c), args, diff, c.grad if diff else None)
        if c.jnp_ref is None:
            programs[c.id + TYPED] = (per_rank(c, True), args, diff, c.grad if diff else None)
    map_ids = set()
    for mc in map_cases():
        for vma in (False, True) if mc.typed else (False,):
            f = jax.shard_map(
                lambda *a, mc=mc: mc.fn(lax, jnp, *a),
                mesh=meshes[mc.mesh],
                in_specs=tuple(P(*s) for s in mc.in_specs),
                out_specs=P(*mc.out_spec),
                check_vma=vma,
            )
            args = mc.arrays()
            key = mc.id + (TYPED if vma else "")
            programs[key] = (f, args, list(range(len(args))), "grad")
            map_ids.add(key)
    for key in [k for k in programs if k.endswith(TYPED)]:  # what the typed mode refuses while tracing
        f, args, _, _ = programs[key]
        try:
            jax.eval_shape(f, *args)
        except Exception as err:  # noqa: BLE001 -- the class is what the test compares
            out[key] = {"raised": type(err).__name__, "message": str(err).splitlines()[0][:200]}
            del programs[key]
    for e in TYPED_ERR_CASES:
        g = jax.shard_map(lambda *a, e=e: e.fn(lax, jnp, *a), mesh=meshes[e.mesh],
                          in_specs=tuple(P(*s) for s in e.in_specs), out_specs=P(*e.out_spec), check_vma=True)  # fmt: skip
        try:
            jax.eval_shape(g, *e.arrays())
            out[e.id] = {"raised": None}
        except Exception as err:  # noqa: BLE001 -- the class is what the test compares
            out[e.id] = {"raised": type(err).__name__, "message": str(err).splitlines()[0][:200]}

    def weights(key: str) -> np.ndarray:
        f, args, _, _ = programs[key]
        shape = jax.eval_shape(f, *args).shape
        if key in map_ids:
            return weight(key, shape, "global")
        return np.stack([weight(key, shape[1:], r) for r in range(shape[0])])

    def run(xs: dict[str, list[Any]], ws: dict[str, Any], keys: list[str]) -> dict[str, Any]:
        res = {}
        for key in keys:
            f, _, diff, how = programs[key]
            a = xs[key]

            w = ws.get(key)

            def loss(d: list[Any], f: Any = f, a: Any = a, diff: Any = diff, w: Any = w) -> Any:
                full = list(a)
                for k, v in zip(diff, d, strict=True):
                    full[k] = v
                y = f(*full)
                return (y * w).sum(), y

            d = [a[k] for k in diff]
            if how == "grad":
                (_, y), g = jax.value_and_grad(loss, has_aux=True)(d)
            elif how == "jacfwd":  # forward mode: JAX's grad of this program raises
                y, g = f(*a), jax.jacfwd(lambda d, loss=loss: loss(d)[0])(d)
            else:
                y, g = f(*a), None
            res[key] = (y, g)
        return res

    for mesh_name in MESHES:
        keys = [k for c in cases() if c.mesh == mesh_name for k in (c.id, c.id + TYPED) if k in programs]
        keys += [
            k for mc in map_cases() if mc.mesh == mesh_name for k in (mc.id, mc.id + TYPED) if k in programs
        ]
        xs = {k: programs[k][1] for k in keys}
        ws = {k: weights(k) for k in keys if programs[k][3] is not None}
        res = jax.jit(run, static_argnums=2)(xs, ws, tuple(keys))
        for key, (y, g) in res.items():
            how = programs[key][3]
            if key in map_ids:
                out[key] = {"y": np.asarray(y), "grads": [np.asarray(t) for t in g]}
                continue
            out[key] = {
                "y": list(np.asarray(y)),
                "grads": None if g is None else [list(np.asarray(t)) for t in g],
            }
            out[key]["grad_by"] = how and f"jax.{how}"
    for c in (c for c in cases() if c.jnp_ref is not None):
        out[c.id]["grad_by"] = "jax.grad of the jnp semantics"
        rows = P(MESHES[c.mesh][1])
        op = jax.shard_map(lambda *b, c=c: c.fn(lax, jnp, *(t[0] for t in b))[None], mesh=meshes[c.mesh],
                           in_specs=(rows,) * 6, out_specs=rows, check_vma=False)  # fmt: skip
        try:  # XLA:CPU has no ragged-all-to-all (jax 0.10.2); compare with the op where it runs
            out[c.id]["op"] = list(np.asarray(jax.jit(op)(*stacked(c))))
        except Exception as e:  # noqa: BLE001 -- recorded, and the jnp semantics stand in
            out[c.id]["op_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for e in ERR_CASES:
        rows = P(MESHES["dp_tp"][1])
        prog = jax.shard_map(lambda b, e=e: e.fn(lax, b), mesh=meshes["dp_tp"], in_specs=rows, out_specs=rows,
                             check_vma=False)  # fmt: skip
        try:
            jax.jit(prog)(np.zeros((4, 2)))
            out[e.id] = {"raised": None}
        except Exception as err:  # noqa: BLE001 -- the class is what the test compares
            out[e.id] = {"raised": type(err).__name__, "message": str(err).splitlines()[0][:200]}

    def sgd_step(w: Any, x: Any) -> Any:  # the JAX step the snippet ports; every rank's copy of the new w
        loss = lambda w: lax.pmean(jnp.sum((x @ w) ** 2), "dp")  # noqa: E731 -- as the docs write it
        return (w - 0.1 * jax.grad(loss)(w))[None]

    step_mesh = Mesh(np.array(jax.devices()[:STEP_WORLD]), ("dp",))
    out[STEP] = {
        vma: np.asarray(jax.jit(jax.shard_map(sgd_step, mesh=step_mesh, in_specs=(P(), P("dp")),
                                              out_specs=P("dp"), check_vma=vma))(*_step_inputs()))
        for vma in (True, False)
    }  # fmt: skip
    for name, prog in GRAD_PROGRAMS.items():
        out[name] = {
            vma: np.asarray(jax.jit(jax.shard_map(lambda w, x, prog=prog: prog(lax, jnp, jax.grad, w, x)[None],
                                                  mesh=step_mesh, in_specs=(P(), P("dp")), out_specs=P("dp"),
                                                  check_vma=vma))(*_step_inputs()))
            for vma in (True, False)
        }  # fmt: skip
    with open(path, "wb") as fh:
        pickle.dump(out, fh)


def weight(key: str, shape: Sequence[int], rank: object) -> np.ndarray:
    return seeded(tuple(shape), "float64", key, "w", rank)


def _jax_process(path: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_ENABLE_X64"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, __file__, path], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


# ---------------------------------------------------------------------------- funcoll's side
def _bound(m: Any, c: Case) -> Callable[..., Any]:
    def run(*xs: Any) -> Any:
        with flax.mesh(m):
            return c.fn(flax, torch, *xs)

    return run


def _run_case(c: Case, fn: Callable[..., Any], rank: int) -> dict[str, Any]:
    xs = [torch.from_numpy(a.copy()) for a in c.arrays(rank)]
    diff = [x for x in xs if x.dtype == torch.float64] if c.grad else []
    for x in diff:
        x.requires_grad_()
    y = fn(*xs)
    if diff:
        (y * torch.from_numpy(weight(c.id, y.shape, rank))).sum().backward()
    return {
        "y": y.detach().numpy(),
        "grads": [x.grad.numpy() for x in diff] if diff else None,
        "in_flight": in_flight(),
    }


def _run_map_case(mc: MapCase, m: Any, check_vma: bool = False, compiled: bool = False) -> dict[str, Any]:
    def local(*a: Any) -> Any:
        return mc.fn(flax, torch, *a)

    specs = tuple(funcoll.P(*s) for s in mc.in_specs)
    f = funcoll.shard_map(local, m, specs, funcoll.P(*mc.out_spec), check_vma=check_vma)
    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    xs = [torch.from_numpy(a).requires_grad_() for a in mc.arrays()]
    try:
        y = f(*xs).full_tensor()
    except Exception as err:  # noqa: BLE001 -- compared with JAX's refusal
        return {"raised": type(err).__name__, "message": str(err), "in_flight": in_flight()}
    key = mc.id + (TYPED if check_vma else "")
    (y * torch.from_numpy(weight(key, y.shape, "global"))).sum().backward()
    return {"y": y.detach().numpy(), "grads": [x.grad.numpy() for x in xs], "in_flight": in_flight()}


def _run_typed_case(c: Case, m: Any, world: int) -> dict[str, Any]:
    """A per-rank case in shard_map(check_vma=True), as JAX's side runs it: rank r's inputs are row r of
    the global ones, each varying over every axis; every rank returns every rank's rows and gradients."""
    names = MESHES[c.mesh][1]
    rows = funcoll.P(names)
    xs = [torch.from_numpy(np.stack(t)) for t in zip(*(c.arrays(r) for r in range(world)), strict=True)]
    diff = [x for x in xs if x.dtype == torch.float64] if c.grad else []
    for x in diff:
        x.requires_grad_()

    def local(*blocks: Any) -> Any:
        return c.fn(flax, torch, *(b[0] for b in blocks))[None]

    f = funcoll.shard_map(local, m, (rows,) * len(xs), rows, check_vma=True)
    try:
        y = f(*xs).full_tensor()
    except Exception as err:  # noqa: BLE001 -- compared with JAX's refusal
        return {"raised": type(err).__name__, "message": str(err), "in_flight": in_flight()}
    if diff:
        w = np.stack([weight(c.id + TYPED, y.shape[1:], r) for r in range(world)])
        (y * torch.from_numpy(w)).sum().backward()
    return {
        "y": y.detach().numpy(),
        "grads": [x.grad.numpy() for x in diff] if diff else None,
        "in_flight": in_flight(),
    }


def _run_err_case(e: ErrCase, m: Any) -> dict[str, Any]:
    try:
        with flax.mesh(m):
            e.fn(flax, torch.zeros(1, 2, dtype=torch.float64))
        return {"raised": None, "in_flight": in_flight()}
    except Exception as err:  # noqa: BLE001 -- compared with JAX's
        return {"raised": type(err).__name__, "message": str(err), "in_flight": in_flight()}


def _run_step() -> dict[bool, np.ndarray]:
    """The snippet's sgd_step in both modes: every rank's copy of the new w, stacked."""
    from torch.distributed.device_mesh import init_device_mesh

    sgd_step = _step_snippet().sgd_step
    m = init_device_mesh("cpu", (STEP_WORLD,), mesh_dim_names=("dp",))
    w, x = (torch.from_numpy(a) for a in _step_inputs())
    return {
        vma: funcoll.shard_map(lambda w, x: sgd_step(w, x)[None], m, (funcoll.P(), funcoll.P("dp")),
                               funcoll.P("dp"), check_vma=vma)(w, x).full_tensor().detach().numpy()
        for vma in (True, False)
    }  # fmt: skip


def _run_grad_programs() -> dict[str, dict[bool, np.ndarray]]:
    """GRAD_PROGRAMS in both modes: every rank's copy of each result, stacked."""
    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh("cpu", (STEP_WORLD,), mesh_dim_names=("dp",))
    w, x = (torch.from_numpy(a) for a in _step_inputs())
    out: dict[str, dict[bool, Any]] = {}
    for name, prog in GRAD_PROGRAMS.items():
        out[name] = {}
        for vma in (True, False):
            f = funcoll.shard_map(lambda w, x, prog=prog: prog(flax, torch, _torch_grad, w, x)[None], m,
                                  (funcoll.P(), funcoll.P("dp")), funcoll.P("dp"), check_vma=vma)  # fmt: skip
            try:
                out[name][vma] = f(w, x).full_tensor().detach().numpy()
            except Exception:  # noqa: BLE001 -- reported by the program's test
                out[name][vma] = traceback.format_exc(limit=-6)
    return out


def body(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        name: init_device_mesh("cpu", shape, mesh_dim_names=names)
        for name, (shape, names) in MESHES.items()
        if WORLD[name] == world
    }
    res: dict[str, Any] = {}
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for c in (c for c in cases() if c.mesh in meshes):
        jobs.append((c.id, lambda c=c: _run_case(c, _bound(meshes[c.mesh], c), rank)))
        if c.compiled:
            compiled = torch.compile(_bound(meshes[c.mesh], c), fullgraph=True, backend="aot_eager")
            jobs.append((c.id + "-compiled", lambda c=c, f=compiled: _run_case(c, f, rank)))
    for c in (c for c in cases() if c.mesh in meshes and c.jnp_ref is None):
        jobs.append((c.id + TYPED, lambda c=c: _run_typed_case(c, meshes[c.mesh], world)))
    for mc in (mc for mc in map_cases() if mc.mesh in meshes):
        jobs.append((mc.id, lambda mc=mc: _run_map_case(mc, meshes[mc.mesh])))
        if mc.typed:
            jobs.append((mc.id + TYPED, lambda mc=mc: _run_map_case(mc, meshes[mc.mesh], True)))
        if mc.id in COMPILED_TYPED:
            jobs.append(
                (mc.id + TYPED + "-compiled", lambda mc=mc: _run_map_case(mc, meshes[mc.mesh], True, True))
            )
    for e in (e for e in TYPED_ERR_CASES if e.mesh in meshes):
        jobs.append((e.id, lambda e=e: _run_map_case(e, meshes[e.mesh], True)))
    if world == STEP_WORLD:
        jobs.append((STEP, _run_step))
        jobs.append(("grad-programs", _run_grad_programs))
    if "dp_tp" in meshes:
        for e in ERR_CASES:
            jobs.append((e.id, lambda e=e: _run_err_case(e, meshes["dp_tp"])))
    for key, job in jobs:
        try:
            res[key] = job()
        except Exception:  # noqa: BLE001 -- reported by the case's test
            res[key] = {"error": traceback.format_exc(limit=-6)}
    return res


batch = once_per_world(body, TIMEOUT_S)


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    """JAX's results, computed in a subprocess while the ranks run funcoll's side."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "jax.pkl")
        proc = _jax_process(path)
        try:
            for world in sorted(set(WORLD.values())):
                try:
                    batch(world)
                except RuntimeError:
                    pass  # re-raised by every test that reads the batch
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"the JAX side failed (exit {proc.returncode}):\n{log.decode()[-4000:]}")
        with open(path, "rb") as fh:
            return pickle.load(fh)  # the file this module's subprocess just wrote


# ---------------------------------------------------------------------------------- tests
def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, JAX {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, JAX {want.shape}"
    if got.dtype.kind == "f":
        tol = 1e-12 if got.dtype == np.float64 else 1e-6  # sums taken in another order: a few ulps
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def _check(case: Case, key: str, want: dict[str, Any]) -> None:
    results = batch(WORLD[case.mesh])
    for r in range(WORLD[case.mesh]):
        got = results[r][key]
        assert "error" not in got, f"rank {r}, {key}:\n{got['error']}"
        assert got["in_flight"] == 0, f"rank {r}, {key}: {got['in_flight']} collectives left unwaited"
        _same(got["y"], want["y"][r], f"rank {r}, {key}, output")
        if case.grad is not None:
            assert len(got["grads"]) == len(want["grads"])
            for k, g in enumerate(want["grads"]):
                _same(got["grads"][k], g[r], f"rank {r}, {key}, gradient {k} ({want['grad_by']})")


ALL = cases()


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_lax_matches_jax(case: Case, oracle: dict[str, Any]) -> None:
    want = oracle[case.id]
    if case.jnp_ref is not None and "op" in want:  # the op itself, where JAX's backend runs it
        for r, y in enumerate(want["op"]):
            _same(want["y"][r], y, f"rank {r}: the jnp semantics against jax.lax.ragged_all_to_all")
    _check(case, case.id, want)


@pytest.mark.parametrize("case", [c for c in ALL if c.compiled], ids=lambda c: c.id)
def test_lax_compiled_matches_jax(case: Case, oracle: dict[str, Any]) -> None:
    _check(case, case.id + "-compiled", oracle[case.id])


def _same_refusal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got.get("raised") == want["raised"], (
        f"{what}: funcoll {got.get('raised')}: {got.get('message')}; JAX {want}"
    )
    assert got["message"].startswith("funcoll."), got["message"]
    assert got["in_flight"] == 0


MAP_RUNS = [(mc, vma) for mc in map_cases() for vma in ((False, True) if mc.typed else (False,))]


def _both_ran(got: dict[str, Any], want: dict[str, Any], where: str) -> bool:
    """True when JAX and funcoll both ran the program (then no collective is left unwaited); False when
    both refused it, with the same class."""
    assert "error" not in got, f"{where}:\n{got['error']}"
    if "raised" in want:
        _same_refusal(got, want, where)
        return False
    assert "raised" not in got, f"{where}: funcoll raised {got}, JAX ran it"
    assert got["in_flight"] == 0
    return True


def _same_global(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    _same(got["y"], want["y"], f"{where}, output")
    for k, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        _same(g, w, f"{where}, gradient {k}")


@pytest.mark.parametrize(
    "case, check_vma", MAP_RUNS, ids=lambda v: v.id if isinstance(v, MapCase) else f"vma{v}"
)
def test_shard_map_matches_jax(case: MapCase, check_vma: bool, oracle: dict[str, Any]) -> None:
    """The global outputs and the gradients of the global inputs (plain tensors, whole on every rank)."""
    key = case.id + (TYPED if check_vma else "")
    for r, res in enumerate(batch(WORLD[case.mesh])):
        if _both_ran(res[key], oracle[key], f"rank {r}, {key}"):
            _same_global(res[key], oracle[key], f"rank {r}, {key}")


@pytest.mark.parametrize("name", COMPILED_TYPED)
def test_compiled_typed_shard_map_matches_jax(name: str, oracle: dict[str, Any]) -> None:
    """A typed program compiled with fullgraph=True: JAX's values and gradients, as eager."""
    want, key = oracle[name + TYPED], name + TYPED + "-compiled"
    case = next(mc for mc in map_cases() if mc.id == name)
    for r, res in enumerate(batch(WORLD[case.mesh])):
        assert _both_ran(res[key], want, f"rank {r}, {key}")
        _same_global(res[key], want, f"rank {r}, {key}")


@pytest.mark.parametrize("case", [c for c in ALL if c.jnp_ref is None], ids=lambda c: c.id)
def test_lax_typed_matches_jax(case: Case, oracle: dict[str, Any]) -> None:
    """Every per-rank case again in shard_map(check_vma=True), in both: each rank's rows and gradients."""
    key = case.id + TYPED
    want = oracle[key]
    for r, res in enumerate(batch(WORLD[case.mesh])):
        got = res[key]
        if not _both_ran(got, want, f"rank {r}, {key}"):
            continue
        for i, y in enumerate(want["y"]):
            _same(got["y"][i], y, f"rank {r}, {key}, rank {i}'s output")
        if case.grad is not None:
            for k, g in enumerate(want["grads"]):
                for i, gi in enumerate(g):
                    _same(
                        got["grads"][k][i],
                        gi,
                        f"rank {r}, {key}, rank {i}'s gradient {k} ({want['grad_by']})",
                    )


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "untyped"])
def test_docs_typed_step_matches_jax(check_vma: bool, oracle: dict[str, Any]) -> None:
    """docs/jax.md's SGD step, ported from JAX: with check_vma=True every rank holds the same new weights,
    JAX's; with check_vma=False each rank's differ (its own gradient), as JAX's do in that mode."""
    want = oracle[STEP][check_vma]
    assert (np.ptp(want, axis=0) == 0).all() == check_vma, "JAX's copies agree exactly when typed"
    for r, got in enumerate(batch(STEP_WORLD)):
        assert "error" not in got[STEP], f"rank {r}:\n{got[STEP]['error']}"
        _same(got[STEP][check_vma], want, f"rank {r}, check_vma={check_vma}")


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "untyped"])
@pytest.mark.parametrize("name", list(GRAD_PROGRAMS))
def test_gradient_taken_inside_f_matches_jax(name: str, check_vma: bool, oracle: dict[str, Any]) -> None:
    """``torch.autograd.grad`` (and ``backward(inputs=...)``) inside f, where JAX calls ``jax.grad``: the
    same values on every rank, a gradient of a gradient included. Typed, they differentiate the tensors
    they are given: a cast of the loss or of the input made another graph (the gradient of a loss
    psummed over "dp" came out times its size, silently)."""
    want = oracle[name][check_vma]
    for r, got in enumerate(batch(STEP_WORLD)):
        assert "error" not in got["grad-programs"], f"rank {r}:\n{got['grad-programs']['error']}"
        mine = got["grad-programs"][name][check_vma]
        assert not isinstance(mine, str), f"rank {r}:\n{mine}"
        _same(mine, want, f"rank {r}, {name}, check_vma={check_vma}")


@pytest.mark.parametrize("case", TYPED_ERR_CASES, ids=lambda e: e.id)
def test_typed_refusals_match_jax(case: MapCase, oracle: dict[str, Any]) -> None:
    """What JAX's typed mode refuses while tracing (an output varying over an axis its spec replicates it
    over, a cast of a varying value to varying), funcoll's refuses: the same class, on every rank."""
    want = oracle[case.id]
    assert want["raised"] is not None, f"{case.id}: JAX ran it; the case is stale"
    for r, got in enumerate(batch(WORLD[case.mesh])):
        _same_refusal(got[case.id], want, f"rank {r}")


@pytest.mark.parametrize("case", ERR_CASES, ids=lambda e: e.id)
def test_refusals_match_jax(case: ErrCase, oracle: dict[str, Any]) -> None:
    """What JAX refuses while tracing, funcoll refuses before any collective: the same class, on every rank."""
    want = oracle[case.id]
    assert want["raised"] is not None, f"{case.id}: JAX ran it; the case is stale"
    for r, got in enumerate(batch(WORLD["dp_tp"])):
        got = got[case.id]
        assert got["raised"] == want["raised"], f"rank {r}: funcoll {got}, JAX {want}"
        assert got["message"].startswith("funcoll.lax."), got["message"]
        assert got["in_flight"] == 0


def test_oracle_is_jax_and_cpu_has_no_ragged_all_to_all(oracle: dict[str, Any], report: Any) -> None:
    """The version the suite compared with, and the reason ragged_all_to_all's cases use jnp."""
    n = len(ALL) + sum(c.jnp_ref is None for c in ALL) + len(MAP_RUNS) + len(ERR_CASES) + len(TYPED_ERR_CASES)
    n += 2 * (1 + len(GRAD_PROGRAMS))  # the docs' SGD step and the gradients taken inside f, in both modes
    report(f"test_lax_jax: {n} programs compared with jax {oracle['jax']} (check_vma False and True)")
    ragged = [c.id for c in ALL if c.jnp_ref is not None]
    for key in ragged:
        assert "op" in oracle[key] or "not supported by XLA:CPU" in oracle[key]["op_error"], oracle[key]


if __name__ == "__main__":
    run_jax(sys.argv[1])
