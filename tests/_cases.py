"""Random cases of every public funcoll op, their per-rank inputs, and single-process references.

Shared by ``tests/test_properties.py`` (hypothesis-drawn cases, checked in the parent),
``tests/test_soak.py`` and ``benchmarks/soak.py`` (many random cases, eager and compiled,
each rank checking its own results). The pieces:

* :class:`Case`: one call of one op on `world` ranks: the op, every rank's input shape, the
  dtype, the memory layout, the op's arguments (``kw``, hashable), whether float64 gradients
  are checked, and, for the soak, the compiled step it goes through. Rank r's input is rebuilt
  from a generator seeded by (case, r), so any process can rebuild every rank's input.
* ``draw_case(op, world, draw)``: a random case of `op`, from a :class:`Draw`, which is either
  hypothesis (``HypothesisDraw``, for the property tests) or a seeded ``random.Random``
  (``RandomDraw``, for the soak): one generator per op serves both.
* :func:`run_case` (rank side): the input, the funcoll call, a weighted loss and its backward.
* :func:`reference` (one process, never funcoll): every rank's expected outputs from all
  ranks' inputs with ``torch.cat`` / ``torch.stack`` + a reduction / splits and permutations,
  and the expected float64 gradients from ``torch.autograd`` on those references. How a
  gradient relates to the ranks' losses depends on the op's documented backward:

  - ``adjoint`` (JAX's convention): each rank has its own loss; the expected gradient is that
    of the sum of all ranks' losses;
  - ``replicated`` (``split_forward_gather_backward``): every rank holds the same input; its
    gradient is the sum of every rank's piece gradient, times `grad_scale`;
  - ``own`` (``gather_forward_split_backward``): the output is replicated and complete on every
    rank; rank r's gradient is that of its own loss, times `grad_scale`;
  - ``dtensor``: DTensor's semantics, the gradient of the one global loss ``sum(Y * W)``
    (``W`` replicated where ``Y`` is), mapped to each rank's local shard.

* :func:`check_case`: compares one rank's results with the reference, exactly (bitwise) for
  pure data movement and max/min, with ``assert_close``'s tolerances for sums and averages.
* The soak: :data:`COMPILED` (a few fixed compiled steps, the ragged dim marked with
  ``funcoll.mark_ragged``), :func:`soak_plan` and :func:`soak_rank` (random cases run and
  checked on the ranks, with RSS and warnings recorded).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import resource
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor
from torch._dynamo.utils import counters as dynamo_counters

import funcoll
from funcoll.testing import in_flight, settled

T = TypeVar("T")
Out = Tensor | None | str | tuple[int, ...]  # one output: a tensor, None (gather's non-dst ranks), metadata

LAYOUTS = ("contig", "strided", "transposed")
MOVE_DTYPES = ("float64", "float32", "bfloat16", "float16", "complex64", "int64", "int32", "bool")
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
STRATEGIES = ("auto", "pad", "a2a", "shift")
GRAD_SCALES: tuple[str | float | None, ...] = (None, "up", "down", 1.0)


# ------------------------------------------------------------------------------------- drawing
class Draw(Protocol):
    """Where random choices come from: hypothesis in the property tests, ``random.Random`` in the soak."""

    def int(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...


class RandomDraw:
    """A :class:`Draw` over a seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


class HypothesisDraw:
    """A :class:`Draw` over hypothesis' ``draw`` (inside ``st.composite`` or ``st.data()``)."""

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self._draw, self._st = draw, st

    def int(self, lo: int, hi: int) -> int:
        return int(self._draw(self._st.integers(lo, hi)))

    def choice(self, options: Sequence[T]) -> T:
        return cast(T, self._draw(self._st.sampled_from(list(options))))


# ---------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One call of `op` on `world` ranks, with everything needed to rebuild every rank's input."""

    op: str
    world: int
    shapes: tuple[tuple[int, ...], ...]  # every rank's input shape (DTensor cases: the local shards)
    dtype: str = "float64"
    layout: str = "contig"
    kw: tuple[tuple[str, Any], ...] = ()  # the op's arguments besides x, as sorted (name, value) pairs
    grad: bool = False
    compiled: str = ""  # the soak's compiled step ("" = eager)

    def arg(self, name: str, default: Any = None) -> Any:
        return dict(self.kw).get(name, default)

    @property
    def seed(self) -> int:
        return zlib.crc32(repr(self).encode())

    @property
    def id(self) -> str:
        kw = ",".join(f"{k}={v}" for k, v in self.kw if k not in ("counts", "xshape"))
        shapes = "|".join("x".join(map(str, s)) or "()" for s in self.shapes)
        parts = [f"w{self.world}", self.op, kw, shapes, self.dtype, self.layout]
        parts += (["grad"] if self.grad else []) + ([f"compiled:{self.compiled}"] if self.compiled else [])
        return "-".join(p for p in parts if p)


def _case(name: str, world: int, shapes: Sequence[Sequence[int]], dtype: str, layout: str,
          grad: bool = False, /, **kw: Any) -> Case:  # fmt: skip
    ndim = len(shapes[0])
    layout = "contig" if ndim == 0 else ("strided" if layout == "transposed" and ndim < 2 else layout)
    return Case(name, world, tuple(tuple(s) for s in shapes), dtype, layout, tuple(sorted(kw.items())),
                grad and dtype == "float64")  # fmt: skip


def _shape(draw: Draw, lo: int = 1, hi: int = 4, max_size: int = 4) -> list[int]:
    return [draw.int(0, max_size) for _ in range(draw.int(lo, hi))]


def _with(shape: Sequence[int], dim: int, n: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = n
    return tuple(out)


def _lengths(draw: Draw, world: int, hi: int = 3) -> list[int]:
    return [draw.int(0, hi) for _ in range(world)]


def _perm(draw: Draw, world: int) -> tuple[tuple[int, int], ...]:
    """A random partial permutation: some sources, each sent to a distinct destination."""
    dsts = list(range(world))
    for i in range(world - 1, 0, -1):  # a drawn shuffle
        j = draw.int(0, i)
        dsts[i], dsts[j] = dsts[j], dsts[i]
    keep = [draw.int(0, 3) > 0 for _ in range(world)]  # about a quarter of the pairs left out
    return tuple((src, dst) for src, dst, k in zip(range(world), dsts, keep, strict=True) if k)


def _reduce_dtype_ops(draw: Draw) -> tuple[str, str]:
    dtype = draw.choice(("float64", "float32", "bfloat16", "float16", "int64", "int32", "bool", "complex64"))
    ops = {
        "bool": ("sum", "max", "min", "product"),
        "int64": ("sum", "max", "min", "product"),
        "int32": ("sum", "max", "min", "product"),
        "complex64": ("sum",),
    }.get(dtype, REDUCE_OPS)
    return dtype, draw.choice(ops)


# one generator per op: `draw_<op>(world, draw) -> Case`
def draw_all_gather(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 0, 4)
    tiled = draw.choice((True, False))
    extra = 0 if tiled or not shape else 1
    dim = draw.int(-len(shape) - extra, len(shape) + extra - 1) if shape else draw.choice((0, -1))
    return _case("all_gather", world, [shape] * world, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True,
                 dim=dim, tiled=tiled)  # fmt: skip


def draw_all_gather_into_tensor(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 0, 3)
    return _case("all_gather_into_tensor", world, [shape] * world, draw.choice(MOVE_DTYPES),
                 draw.choice(LAYOUTS), True)  # fmt: skip


def draw_reduce_scatter(world: int, draw: Draw) -> Case:
    dtype, op = _reduce_dtype_ops(draw)
    shape = _shape(draw, 1, 4)
    dim = draw.int(-len(shape), len(shape) - 1)
    tiled = draw.int(0, 3) > 0
    shape[dim] = world * draw.int(0, 3) if tiled else world
    return _case("reduce_scatter", world, [shape] * world, dtype, draw.choice(LAYOUTS), op in ("sum", "avg"),
                 dim=dim, op=op, tiled=tiled)  # fmt: skip


def draw_all_reduce(world: int, draw: Draw) -> Case:
    dtype, op = _reduce_dtype_ops(draw)
    shape = _shape(draw, 0, 4)
    return _case(
        "all_reduce", world, [shape] * world, dtype, draw.choice(LAYOUTS), op in ("sum", "avg"), op=op
    )


def draw_all_to_all(world: int, draw: Draw) -> Case:
    base = _shape(draw, 1, 4)
    n = len(base)
    s, g = draw.int(-n, n - 1), draw.int(-n, n - 1)
    scatter_sizes = tuple(_lengths(draw, world)) if draw.choice((True, False)) else None
    total = sum(scatter_sizes) if scatter_sizes is not None else draw.int(0, 2 * world + 1)
    uneven = s % n != g % n and draw.choice((True, False))
    widths = _lengths(draw, world) if uneven else [base[g]] * world
    gather_sizes = tuple(widths) if uneven or draw.int(0, 3) == 0 else None
    if s % n == g % n:
        widths, gather_sizes = [total] * world, (tuple([total] * world) if gather_sizes else None)
    shapes = [_with(_with(base, g, w), s, total) for w in widths]
    return _case("all_to_all", world, shapes, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True,
                 scatter_dim=s, gather_dim=g, scatter_sizes=scatter_sizes,
                 gather_sizes=gather_sizes)  # fmt: skip


def draw_ppermute(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 0, 3)
    return _case("ppermute", world, [shape] * world, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True,
                 perm=_perm(draw, world))  # fmt: skip


def draw_broadcast(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 0, 3)
    return _case("broadcast", world, [shape] * world, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True,
                 src=draw.int(0, world - 1))  # fmt: skip


def draw_reduce(world: int, draw: Draw) -> Case:
    dtype, op = _reduce_dtype_ops(draw)
    shape = _shape(draw, 0, 4)
    return _case("reduce", world, [shape] * world, dtype, draw.choice(LAYOUTS), op in ("sum", "avg"),
                 dst=draw.int(0, world - 1), op=op)  # fmt: skip


def draw_scatter(world: int, draw: Draw) -> Case:
    """`src` holds the rows it splits; the other ranks any length along `dim` (unused), 0 included."""
    shape = _shape(draw, 1, 4)
    dim = draw.int(-len(shape), len(shape) - 1)
    src, sizes = draw.int(0, world - 1), tuple(_lengths(draw, world))
    shapes = [_with(shape, dim, sum(sizes) if r == src else draw.int(0, 3)) for r in range(world)]
    return _case("scatter", world, shapes, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True, dim=dim,
                 src=src, sizes=sizes, sizes_as=draw.choice(("", "list", "tensor")))  # fmt: skip


def draw_gather_padded(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 1, 3)
    dim = draw.int(-len(shape), len(shape) - 1)
    bound = draw.int(0, 4)
    shape[dim] = bound
    lengths = tuple(draw.int(0, bound) for _ in range(world))
    return _case("gather_padded", world, [shape] * world, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True,
                 dim=dim, lengths=lengths, length_as=draw.choice(("int", "tensor")))  # fmt: skip


def draw_all_to_all_padded(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 1, 3)
    dim = draw.int(-len(shape), len(shape) - 1)
    cap = draw.int(0, 3)
    shape[dim] = world * cap
    counts = tuple(tuple(draw.int(0, cap) for _ in range(world)) for _ in range(world))
    return _case("all_to_all_padded", world, [shape] * world, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS),
                 True, dim=dim, counts=counts, sizes_as=draw.choice(("list", "tensor")))  # fmt: skip


def draw_split_forward_gather_backward(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 1, 4, max_size=2 * world + 1)
    dim = draw.int(-len(shape), len(shape) - 1)
    return _case("split_forward_gather_backward", world, [shape] * world, draw.choice(MOVE_DTYPES),
                 draw.choice(LAYOUTS), True, dim=dim, grad_scale=draw.choice(GRAD_SCALES))  # fmt: skip


def draw_gather_forward_split_backward(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 1, 4)
    dim = draw.int(-len(shape), len(shape) - 1)
    shapes = [_with(shape, dim, n) for n in _lengths(draw, world)]
    return _case("gather_forward_split_backward", world, shapes, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS),
                 True, dim=dim, grad_scale=draw.choice(GRAD_SCALES),
                 sizes_as=draw.choice(("", "list", "tensor")))  # fmt: skip


def draw_ragged_dtensor(world: int, draw: Draw) -> Case:
    """from_ragged of ragged pieces, then to_ragged of the DTensor to other per-rank lengths."""
    shape = _shape(draw, 1, 3)
    dim = draw.int(-len(shape), len(shape) - 1)
    lengths = _lengths(draw, world)
    to = [0] * world
    for _ in range(sum(lengths)):  # the same total, spread over the ranks at random
        to[draw.int(0, world - 1)] += 1
    shapes = [_with(shape, dim, n) for n in lengths]
    return _case("ragged_dtensor", world, shapes, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True,
                 dim=dim, to_sizes=tuple(to), given=draw.choice((True, False)))  # fmt: skip


def draw_moe(world: int, draw: Draw) -> Case:
    """moe.dispatch, a scale per expert, moe.combine: each rank's input holds its T tokens and
    their k router weights side by side, ``(T, H + k)``, so x.grad checks both gradients."""
    k, e_local, hidden = draw.int(1, 2), draw.int(1, 3), draw.int(1, 3)
    mode = draw.choice(("exact", "static", "dropless"))
    tokens = _lengths(draw, world, 4)
    capacity = None
    if mode == "dropless":  # static if no rank routes more than it to one rank, exact otherwise
        capacity = draw.int(0, 4)
    if mode == "static":
        capacity = draw.choice((None, *range(5)))
        if capacity is None:  # the dropless bound T * k needs the same T on every rank
            tokens = [tokens[0]] * world
    routing = tuple(tuple(draw.int(0, world * e_local - 1) for _ in range(t * k)) for t in tokens)
    return _case("moe", world, [(t, hidden + k) for t in tokens], "float64", draw.choice(LAYOUTS), True,
                 k=k, e_local=e_local, hidden=hidden, mode=mode, capacity=capacity, align=draw.int(1, 2),
                 routing=routing)  # fmt: skip


LAX_FNS = ("psum", "all_gather", "psum_scatter", "ppermute")


def draw_lax(world: int, draw: Draw) -> Case:
    """A funcoll.lax collective over the 1-D mesh axis "i": JAX's arguments, JAX's semantics."""
    fn = draw.choice(LAX_FNS)
    shape = _shape(draw, 0 if fn != "psum_scatter" else 1, 3)
    kw: dict[str, Any] = {"fn": fn}
    if fn == "all_gather":
        kw["tiled"] = tiled = draw.choice((True, False)) and len(shape) > 0
        n = len(shape) + (0 if tiled else 1)
        kw["axis"] = draw.int(-n, n - 1)
    elif fn == "psum_scatter":
        kw["tiled"] = tiled = draw.choice((True, False))
        d = draw.int(-len(shape), len(shape) - 1)
        shape[d] = world * draw.int(0, 2) if tiled else world
        kw["scatter_dimension"] = d
    elif fn == "ppermute":
        kw["perm"] = _perm(draw, world)
    dtype = draw.choice(("float64", "float32", "bfloat16", "int64", "int32"))
    return _case("lax", world, [shape] * world, dtype, draw.choice(LAYOUTS), True, **kw)


# DTensor in, DTensor out: (funcoll op, the input placement kind, the output placement kind)
DTENSOR_OPS: dict[str, tuple[str, str]] = {
    "all_gather": ("S", "R"),
    "gather": ("S", "R"),
    "all_gather_ragged": ("S", "R"),
    "gather_forward_split_backward": ("S", "R"),
    "reduce_scatter": ("P", "S"),
    "all_reduce": ("P", "R"),
    "all_to_all": ("S", "S"),
    "broadcast": ("R", "R"),
    "ppermute": ("S", "S"),
    "split_forward_gather_backward": ("R", "S"),
}


def chunk_lengths_split(n: int, world: int) -> list[int]:
    """torch.tensor_split's lengths of a dim of length n over world ranks (the first ones one longer)."""
    return [p.numel() for p in torch.tensor_split(torch.empty(n), world)]


def chunk_lengths(n: int, world: int) -> list[int]:
    """torch.chunk's lengths of a dim of length n over world ranks, 0 where it gives fewer pieces."""
    got = [p.shape[0] for p in torch.chunk(torch.empty(n), world)] if n else []
    return got + [0] * (world - len(got))


def draw_dtensor(world: int, draw: Draw) -> Case:
    """A DTensor of a random global shape on a 1-D mesh, through one of the ops that take DTensors."""
    name = draw.choice(tuple(DTENSOR_OPS))
    shape = _shape(draw, 1, 3, max_size=2 * world + 1)
    n = len(shape)
    d = draw.int(-n, n - 1)
    kw: dict[str, Any] = {"fn": name, "dim": d}
    src_dim, out_dim = d % n, d % n
    if name == "all_to_all":
        if n == 1:
            shape.append(draw.int(0, 4))
            n = 2
        s = draw.int(0, n - 1)
        g = draw.choice([k for k in range(n) if k != s])
        kw.update(dim=g, scatter_dim=s)
        src_dim, out_dim = g, s
    if name == "ppermute":
        shape[d] = world * draw.int(0, 2)
        kw["perm"] = _perm(draw, world)
    if name in ("reduce_scatter", "all_reduce"):
        kw["op"] = draw.choice(("sum", "avg", "max", "min"))
    if name == "broadcast":
        kw["src"] = draw.int(0, world - 1)
    if name == "gather":
        kw["strategy"] = draw.choice(STRATEGIES)
    if name in ("gather_forward_split_backward", "split_forward_gather_backward"):
        kw["grad_scale"] = draw.choice(GRAD_SCALES)
    inp, out = DTENSOR_OPS[name]
    kw["in_place"] = "R" if inp == "R" else ("P" + kw["op"] if inp == "P" else f"S{src_dim}")
    kw["out_place"] = "R" if out == "R" else f"S{out_dim}"
    kw["xshape"] = tuple(shape)
    locals_ = [_local_shape(kw, world, r) for r in range(world)]
    grad = kw.get("op", "sum") in ("sum", "avg")
    return _case("dtensor", world, locals_, "float64", "contig", grad, **kw)


def _local_shape(kw: dict[str, Any], world: int, rank: int) -> tuple[int, ...]:
    shape = list(kw["xshape"])
    place = kw["in_place"]
    if place.startswith("S"):
        d = int(place[1:])
        shape[d] = chunk_lengths(shape[d], world)[rank]
    return tuple(shape)


# --- the ragged ops (the property tests leave them to tests/test_ragged.py; the soak draws them)
def draw_gather(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 1, 4)
    dim = draw.int(-len(shape), len(shape) - 1)
    shapes = [_with(shape, dim, n) for n in _lengths(draw, world)]
    dst = draw.choice((None, None, *range(world)))
    grad = dst is None
    return _case("gather", world, shapes, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), grad, dim=dim,
                 dst=dst, strategy=draw.choice(STRATEGIES),
                 sizes_as=draw.choice(("", "", "list", "tensor")))  # fmt: skip


def draw_all_gather_list(world: int, draw: Draw) -> Case:
    c = draw_gather(world, draw)
    return _case("all_gather_list", world, c.shapes, c.dtype, c.layout, True, dim=c.arg("dim"),
                 strategy=c.arg("strategy"), sizes_as=c.arg("sizes_as"))  # fmt: skip


def draw_all_gather_ragged(world: int, draw: Draw) -> Case:
    c = draw_all_gather_list(world, draw)
    return Case("all_gather_ragged", world, c.shapes, c.dtype, c.layout, c.kw, c.grad)


def draw_reduce_scatter_v(world: int, draw: Draw) -> Case:
    dtype, op = _reduce_dtype_ops(draw)
    shape = _shape(draw, 1, 4)
    dim = draw.int(-len(shape), len(shape) - 1)
    sizes = tuple(_lengths(draw, world))
    shape[dim] = sum(sizes)
    return _case("reduce_scatter_v", world, [shape] * world, dtype, draw.choice(LAYOUTS), op in ("sum", "avg"),
                 dim=dim, op=op, sizes=sizes, sizes_as=draw.choice(("list", "tensor")))  # fmt: skip


def draw_all_to_all_v(world: int, draw: Draw) -> Case:
    shape = _shape(draw, 1, 4)
    dim = draw.int(-len(shape), len(shape) - 1)
    counts = tuple(tuple(_lengths(draw, world)) for _ in range(world))
    shapes = [_with(shape, dim, sum(row)) for row in counts]
    return _case("all_to_all_v", world, shapes, draw.choice(MOVE_DTYPES), draw.choice(LAYOUTS), True, dim=dim,
                 counts=counts, sizes_as=draw.choice(("list", "tensor")),
                 exchange=draw.choice((True, False)))  # fmt: skip


DRAWS: dict[str, Callable[[int, Draw], Case]] = {
    "all_gather": draw_all_gather,
    "all_gather_into_tensor": draw_all_gather_into_tensor,
    "reduce_scatter": draw_reduce_scatter,
    "all_reduce": draw_all_reduce,
    "all_to_all": draw_all_to_all,
    "ppermute": draw_ppermute,
    "broadcast": draw_broadcast,
    "reduce": draw_reduce,
    "scatter": draw_scatter,
    "gather_padded": draw_gather_padded,
    "all_to_all_padded": draw_all_to_all_padded,
    "split_forward_gather_backward": draw_split_forward_gather_backward,
    "gather_forward_split_backward": draw_gather_forward_split_backward,
    "ragged_dtensor": draw_ragged_dtensor,
    "dtensor": draw_dtensor,
    "moe": draw_moe,
    "lax": draw_lax,
    "gather": draw_gather,
    "all_gather_list": draw_all_gather_list,
    "all_gather_ragged": draw_all_gather_ragged,
    "reduce_scatter_v": draw_reduce_scatter_v,
    "all_to_all_v": draw_all_to_all_v,
}
RAGGED_OPS = ("gather", "all_gather_list", "all_gather_ragged", "reduce_scatter_v", "all_to_all_v")
PROPERTY_OPS = tuple(op for op in DRAWS if op not in RAGGED_OPS)  # what tests/test_ragged.py does not draw


def draw_case(op: str, world: int, draw: Draw) -> Case:
    return DRAWS[op](world, draw)


# ---------------------------------------------------------------------------------------- inputs
def generator(case: Case, rank: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((case.seed * 1_000_003 + rank * 97 + stream) % (1 << 62))


def _small(case: Case) -> bool:
    """Reductions get small integers (exact sums and products over 4 ranks in bfloat16/float16)."""
    summed = case.op in ("reduce_scatter", "all_reduce", "reduce_scatter_v", "reduce") or (
        case.op == "lax" and case.arg("fn") in ("psum", "psum_scatter")
    )
    return summed and case.dtype != "float64"


def values(shape: Sequence[int], dtype: str, gen: torch.Generator, small: bool = False) -> Tensor:
    shape = tuple(shape)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in ("int64", "int32"):
        return torch.randint(-3, 4, shape, generator=gen).to(getattr(torch, dtype)) if small else (
            torch.randint(-1000, 1000, shape, generator=gen).to(getattr(torch, dtype)))  # fmt: skip
    if small:
        t = torch.randint(-3, 4, (2, *shape), generator=gen).double()
    else:
        t = torch.randn((2, *shape), generator=gen, dtype=torch.float64)
    if dtype == "complex64":
        return torch.complex(t[0], t[1]).to(torch.complex64)
    return t[0].to(getattr(torch, dtype))


def with_layout(t: Tensor, layout: str) -> Tensor:
    """The same values, in a non-contiguous layout: every other element of the last dim, or transposed."""
    if layout == "strided" and t.dim() >= 1:
        buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        buf[..., ::2] = t
        return buf[..., ::2]
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    return t


def rank_input(case: Case, rank: int) -> Tensor:
    """Rank `rank`'s input (a leaf that requires grad for a gradient case); any process rebuilds it."""
    if case.op == "dtensor":
        x = _dtensor_local(case, _dtensor_globals(case), rank)
    else:
        source = 0 if case.op == "split_forward_gather_backward" else rank  # the same input on every rank
        x = values(case.shapes[rank], case.dtype, generator(case, source, 0), _small(case))
    x = with_layout(x.detach().clone(), case.layout)
    return x.requires_grad_() if case.grad else x


def weights(case: Case, rank: int, outs: Sequence[Out]) -> list[Tensor | None]:
    """Rank `rank`'s loss weights, one per output: seeded randoms for float64 results (None elsewhere)."""
    if case.op == "dtensor":
        w = _dtensor_weight(case)
        return [_place(w, case.arg("out_place"), case.world, rank), *[None] * (len(outs) - 1)]
    return [
        torch.randn(o.shape, generator=generator(case, rank, 100 + k), dtype=torch.float64)
        if isinstance(o, Tensor) and o.dtype == torch.float64
        else None
        for k, o in enumerate(outs)
    ]


def loss(case: Case, rank: int, outs: Sequence[Out]) -> Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for o, w in zip(outs, weights(case, rank, outs), strict=True):
        if w is not None and isinstance(o, Tensor):
            total = total + (o * w).sum()
    return total


def _sizes_arg(sizes: Sequence[int], how: str) -> list[int] | Tensor | None:
    """`sizes` as the call passes them: a list, an int64 tensor, or None ("": funcoll exchanges them)."""
    return _given(sizes, how) if how else None


def _given(sizes: Sequence[int], how: str) -> list[int] | Tensor:
    return torch.tensor(list(sizes), dtype=torch.int64) if how == "tensor" else list(sizes)


def _scale(case: Case) -> float:
    s = case.arg("grad_scale")
    return float(case.world) if s == "up" else (1.0 / case.world if s == "down" else 1.0)


# ------------------------------------------------------------------------------------- rank side
_MESHES: dict[int, Any] = {}


def mesh(world: int) -> Any:
    """This rank's 1-D DeviceMesh over the world, axis "i", made once per process (no new group per case)."""
    if world not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[world] = init_device_mesh("cpu", (world,), mesh_dim_names=("i",))
    return _MESHES[world]


def call(case: Case, x: Tensor, rank: int) -> list[Out]:
    """The funcoll call of `case` on this rank's `x`, its results as a flat list."""
    if case.compiled:
        return call_compiled(case, x, rank)
    a, op, w = case.arg, case.op, case.world
    if op == "all_gather":
        return [funcoll.all_gather(x, a("dim"), tiled=a("tiled"))]
    if op == "all_gather_into_tensor":
        return [funcoll.all_gather_into_tensor(x)]
    if op == "reduce_scatter":
        return [funcoll.reduce_scatter(x, a("dim"), op=a("op"), tiled=a("tiled"))]
    if op == "all_reduce":
        return [funcoll.all_reduce(x, op=a("op"))]
    if op == "all_to_all":
        ss, gs = a("scatter_sizes"), a("gather_sizes")
        return [
            funcoll.all_to_all(x, None, a("scatter_dim"), a("gather_dim"),
                               scatter_sizes=None if ss is None else list(ss),
                               gather_sizes=None if gs is None else list(gs))
        ]  # fmt: skip
    if op == "ppermute":
        return [funcoll.ppermute(x, [list(p) for p in a("perm")])]
    if op == "broadcast":
        return [funcoll.broadcast(x, a("src"))]
    if op == "reduce":
        return [funcoll.reduce(x, a("dst"), a("op"))]
    if op == "scatter":
        return [funcoll.scatter(x, a("src"), _sizes_arg(a("sizes"), a("sizes_as")), a("dim"))]
    if op == "gather_padded":
        n = a("lengths")[rank]
        return list(
            funcoll.gather_padded(x, torch.tensor([n]) if a("length_as") == "tensor" else n, a("dim"))
        )
    if op == "all_to_all_padded":
        return list(funcoll.all_to_all_padded(x, _given(a("counts")[rank], a("sizes_as")), a("dim")))
    if op == "split_forward_gather_backward":
        return [funcoll.split_forward_gather_backward(x, None, a("dim"), a("grad_scale"))]
    if op == "gather_forward_split_backward":
        sizes = _sizes_arg([s[a("dim")] for s in case.shapes], a("sizes_as"))
        return [funcoll.gather_forward_split_backward(x, None, a("dim"), a("grad_scale"), sizes=sizes)]
    if op == "ragged_dtensor":
        lengths = [s[a("dim")] for s in case.shapes]
        y, sizes = funcoll.from_ragged(x, a("dim"), group=mesh(w), sizes=lengths if a("given") else None)
        back = funcoll.to_ragged(y, list(a("to_sizes")))
        return [y.to_local(), back, torch.tensor([int(s) for s in sizes]), _placements(y), tuple(y.shape)]
    if op == "dtensor":
        return _call_dtensor(case, x)
    if op == "moe":
        return _call_moe(case, x, rank)
    if op == "lax":
        return [_call_lax(case, x)]
    sizes = _sizes_arg([s[a("dim")] for s in case.shapes], a("sizes_as", ""))
    if op == "gather":
        return [funcoll.gather(x, a("dim"), a("dst"), strategy=a("strategy"), sizes=sizes)]
    if op == "all_gather_list":
        return list(funcoll.all_gather_list(x, a("dim"), strategy=a("strategy"), sizes=sizes))
    if op == "all_gather_ragged":
        return list(funcoll.all_gather_ragged(x, a("dim"), strategy=a("strategy"), sizes=sizes))
    if op == "reduce_scatter_v":
        return [funcoll.reduce_scatter(x, a("dim"), op=a("op"), sizes=_given(a("sizes"), a("sizes_as")))]
    if op == "all_to_all_v":
        counts = a("counts")
        send = _given(counts[rank], a("sizes_as"))
        recv = None if a("exchange") else _given([row[rank] for row in counts], a("sizes_as"))
        return list(funcoll.all_to_all_v(x, send, recv, dim=a("dim")))
    raise KeyError(op)


def _routing(case: Case, rank: int) -> Tensor:
    return torch.tensor(case.arg("routing")[rank], dtype=torch.int64).view(-1, case.arg("k"))


def _expert_scale(expert: Tensor) -> Tensor:
    """The experts of the MoE cases: global expert e multiplies its rows by (e + 1) / 2."""
    return ((expert + 1) / 2).to(torch.float64).unsqueeze(-1)


def _call_moe(case: Case, x: Tensor, rank: int) -> list[Out]:
    a = case.arg
    h, w = a("hidden"), case.world
    recv, handle = funcoll.moe.dispatch(x[:, :h], _routing(case, rank), w * a("e_local"), mode=a("mode"),
                                        capacity=a("capacity"), align=a("align"))  # fmt: skip
    # Each row's local expert from the blocks' offsets, on the device (padding rows are zero).
    local = torch.searchsorted(handle.offsets, torch.arange(recv.shape[0]), right=True) - 1
    y = recv * _expert_scale(rank * a("e_local") + local)
    out = funcoll.moe.combine(y, handle, x[:, h:])
    return [recv, handle.counts, handle.offsets, handle.dropped, out]


def _call_lax(case: Case, x: Tensor) -> Tensor:
    a, fn = case.arg, case.arg("fn")
    with funcoll.lax.mesh(mesh(case.world)):
        if fn == "psum":
            return funcoll.lax.psum(x, "i")
        if fn == "all_gather":
            return funcoll.lax.all_gather(x, "i", axis=a("axis"), tiled=a("tiled"))
        if fn == "psum_scatter":
            return funcoll.lax.psum_scatter(
                x, "i", scatter_dimension=a("scatter_dimension"), tiled=a("tiled")
            )
        return funcoll.lax.ppermute(x, "i", [tuple(p) for p in a("perm")])


def _placements(y: Any) -> str:
    return ",".join(str(p) for p in y.placements)


def run_case(case: Case, rank: int) -> dict[str, Any]:
    """Run `case` on this rank: the input, the call, then (gradient cases) the loss's backward."""
    x = rank_input(case, rank)
    outs = call(case, x, rank)
    grad = None
    if case.grad:
        total = loss(case, rank, outs)
        if total.requires_grad:
            total.backward()
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return settled({"outs": [o.detach() if isinstance(o, Tensor) else o for o in outs], "grad": grad})


# ------------------------------------------------------------------------------------- reference
def reduce(op: str, xs: Sequence[Tensor]) -> Tensor:
    """The reduction over ranks, in one process (bool: sum/max is or, product/min is and)."""
    s = torch.stack(list(xs))
    if s.dtype == torch.bool:
        return s.any(0) if op in ("sum", "max") else s.all(0)
    out = {
        "sum": lambda: s.sum(0),
        "avg": lambda: s.sum(0) / len(xs),
        "max": lambda: s.amax(0),
        "min": lambda: s.amin(0),
        "product": lambda: s.prod(0),
    }[op]()
    return out.to(s.dtype)


def _pad_to(t: Tensor, dim: int, n: int) -> Tensor:
    pad = torch.zeros(_with(t.shape, dim, n - t.shape[dim]), dtype=t.dtype)
    return torch.cat([t, pad], dim)


def reference_outputs(case: Case, xs: list[Tensor]) -> list[list[Out]]:
    """Every rank's expected outputs, from every rank's input, in this process (differentiable)."""
    a, op, w = case.arg, case.op, case.world
    nd = xs[0].dim()
    if op == "all_gather":
        if nd == 0:
            y = torch.stack(xs)
        elif a("tiled"):
            y = torch.cat(xs, a("dim"))
        else:
            y = torch.stack(xs, a("dim") % (nd + 1))
        return [[y]] * w
    if op == "all_gather_into_tensor":
        return [[torch.stack(xs)]] * w
    if op == "reduce_scatter":
        red, d = reduce(a("op"), xs), a("dim")
        if a("tiled"):
            return [[torch.split(red, [red.shape[d] // w] * w, d)[r]] for r in range(w)]
        return [[red.select(d, r)] for r in range(w)]
    if op == "all_reduce":
        return [[reduce(a("op"), xs)]] * w
    if op == "all_to_all":
        s, g = a("scatter_dim"), a("gather_dim")
        total = xs[0].shape[s]
        ss = list(a("scatter_sizes") or [len(p) for p in torch.tensor_split(torch.empty(total), w)])
        pieces = [torch.split(x, ss, s) for x in xs]
        return [[torch.cat([pieces[i][r] for i in range(w)], g)] for r in range(w)]
    if op == "ppermute":
        src_of = {dst: src for src, dst in a("perm")}
        return [[xs[src_of[r]] if r in src_of else torch.zeros_like(xs[r])] for r in range(w)]
    if op == "broadcast":
        return [[xs[a("src")]]] * w
    if op == "reduce":
        total = reduce(a("op"), xs)
        return [[total if r == a("dst") else torch.zeros_like(total)] for r in range(w)]
    if op == "scatter":
        x, d = xs[a("src")], a("dim")
        sizes = list(a("sizes")) if a("sizes_as") else chunk_lengths_split(x.shape[d], w)
        return [[piece] for piece in torch.split(x, sizes, d)]
    if op == "gather_padded":
        d, lens = a("dim"), a("lengths")
        bound = xs[0].shape[d]
        y = torch.cat([x.narrow(d, 0, n) for x, n in zip(xs, lens, strict=True)], d)
        return [[_pad_to(y, d, w * bound), torch.tensor(lens)]] * w
    if op == "all_to_all_padded":
        d, counts = a("dim"), a("counts")
        cap = xs[0].shape[d] // w
        out = []
        for r in range(w):
            y = torch.cat([xs[i].narrow(d, r * cap, counts[i][r]) for i in range(w)], d)
            out.append([_pad_to(y, d, w * cap), torch.tensor([counts[i][r] for i in range(w)])])
        return out
    if op == "split_forward_gather_backward":
        return [[torch.tensor_split(xs[r], w, a("dim"))[r]] for r in range(w)]
    if op == "ragged_dtensor":
        d = a("dim") % nd
        y = torch.cat(xs, d)
        local = torch.split(y, chunk_lengths(y.shape[d], w), d)
        back = torch.split(y, list(a("to_sizes")), d)
        lengths = torch.tensor([x.shape[d] for x in xs])
        return [[local[r], back[r], lengths, str(_placement(f"S{d}")), tuple(y.shape)] for r in range(w)]
    if op == "moe":
        return _moe_reference(case, xs)
    if op == "lax":
        return _lax_reference(case, xs)
    d = a("dim")
    if op in ("gather_forward_split_backward", "all_gather_ragged", "gather"):
        y = torch.cat(xs, d)
        if op == "all_gather_ragged":
            return [[y, torch.tensor([x.shape[d] for x in xs])]] * w
        if op == "gather":
            return [[y if a("dst") in (None, r) else None] for r in range(w)]
        return [[y]] * w
    if op == "all_gather_list":
        return [list(xs)] * w
    if op == "reduce_scatter_v":
        return [[torch.split(reduce(a("op"), xs), list(a("sizes")), d)[r]] for r in range(w)]
    if op == "all_to_all_v":
        counts = a("counts")
        blocks = [torch.split(x, list(counts[i]), d) for i, x in enumerate(xs)]
        return [[torch.cat([blocks[i][r] for i in range(w)], d), torch.tensor([row[r] for row in counts])]
                for r in range(w)]  # fmt: skip
    raise KeyError(op)


def _moe_kept(case: Case, rank: int) -> list[bool]:
    """Static mode's rule: rank `rank` keeps its first `capacity` pairs per destination, (t, j) order."""
    a, routes = case.arg, case.arg("routing")[rank]
    if a("mode") in ("exact", "dropless"):
        return [True] * len(routes)
    cap = a("k") * case.shapes[rank][0] if a("capacity") is None else a("capacity")
    seen = [0] * case.world
    keep = []
    for e in routes:
        keep.append(seen[e // a("e_local")] < cap)
        seen[e // a("e_local")] += 1
    return keep


def _moe_need(case: Case) -> int:
    """The most pairs any rank routes to one rank: mode="dropless" runs static iff it fits the capacity."""
    el = case.arg("e_local")
    return max((sum(e // el == d for e in routes) for routes in case.arg("routing") for d in range(case.world)),
               default=0)  # fmt: skip


def _moe_reference(case: Case, xs: list[Tensor]) -> list[list[Out]]:
    """Every rank's recv, counts, offsets, dropped and combined output, pair by pair in Python."""
    a, w = case.arg, case.world
    h, k, el, align = a("hidden"), a("k"), a("e_local"), a("align")
    keeps = [_moe_kept(case, r) for r in range(w)]
    pairs = [(s, f // k, e) for s in range(w) for f, e in enumerate(a("routing")[s]) if keeps[s][f]]
    out: list[list[Out]] = []
    for r in range(w):
        rows, counts, offsets = [], [], []
        for e in range(r * el, (r + 1) * el):
            mine = [xs[s][t, :h] for s, t, pe in pairs if pe == e]  # source-major, then token order
            offsets.append(len(rows))
            counts.append(len(mine))
            rows += mine + [torch.zeros(h, dtype=torch.float64)] * (-len(mine) % align)
        if a("mode") == "static" or (a("mode") == "dropless" and _moe_need(case) <= a("capacity")):
            # a static number of rows: zeros after the blocks
            cap = k * case.shapes[0][0] if a("capacity") is None else a("capacity")
            total = w * cap + el * (align - 1)
            rows += [torch.zeros(h, dtype=torch.float64)] * (total + -total % align - len(rows))
        recv = torch.stack(rows) if rows else torch.zeros(0, h, dtype=torch.float64)
        x, routes = xs[r], _routing(case, r)
        keep = torch.tensor(keeps[r], dtype=torch.bool).view(-1, k).unsqueeze(-1)
        picked = x[:, :h].unsqueeze(1) * _expert_scale(routes) * x[:, h:].unsqueeze(-1)  # (T, k, H)
        combined = (picked * keep).sum(1)
        dropped = torch.tensor(sum(not kept for kept in keeps[r]))
        out.append([recv, torch.tensor(counts), torch.tensor(offsets), dropped, combined])
    return out


def _lax_reference(case: Case, xs: list[Tensor]) -> list[list[Out]]:
    a, fn, w = case.arg, case.arg("fn"), case.world
    if fn == "psum":
        return [[reduce("sum", xs)]] * w
    if fn == "all_gather":
        nd = xs[0].dim()
        y = torch.cat(xs, a("axis")) if a("tiled") else torch.stack(xs, a("axis") % (nd + 1))
        return [[y]] * w
    if fn == "psum_scatter":
        total, d = reduce("sum", xs), a("scatter_dimension")
        if a("tiled"):
            return [
                [torch.split(total, total.shape[d] // w, d)[r]] if total.shape[d] else [total]
                for r in range(w)
            ]
        return [[total.select(d, r)] for r in range(w)]
    src_of = {dst: src for src, dst in a("perm")}
    return [[xs[src_of[r]] if r in src_of else torch.zeros_like(xs[r])] for r in range(w)]


def reference(case: Case) -> tuple[list[list[Out]], list[Tensor | None]]:
    """(every rank's expected outputs, every rank's expected x.grad), computed in this process."""
    if case.op == "dtensor":
        return _dtensor_reference(case)
    xs = [rank_input(case, r) for r in range(case.world)]
    outs = reference_outputs(case, xs)
    grads: list[Tensor | None] = [None] * case.world
    if case.grad:
        mode = {"split_forward_gather_backward": "replicated", "gather_forward_split_backward": "own"}.get(
            case.op, "adjoint"
        )
        losses = [loss(case, r, outs[r]) for r in range(case.world)]
        if mode == "own":
            grads = [_grad(losses[r], [xs[r]])[0] * _scale(case) for r in range(case.world)]
        else:
            gs = _grad(sum(losses, torch.zeros((), dtype=torch.float64)), xs)
            if mode == "replicated":  # every rank's piece gradient, gathered onto the one shared input
                gs = [sum(gs, torch.zeros_like(xs[0])) * _scale(case)] * case.world
            grads = [g for g in gs]
    return [[o.detach() if isinstance(o, Tensor) else o for o in row] for row in outs], grads


def _grad(total: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    if not total.requires_grad:
        return [torch.zeros_like(x) for x in leaves]
    gs = torch.autograd.grad(total, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves, strict=True)]


# ---------------------------------------------------------------------------------- DTensor cases
def _dtensor_globals(case: Case) -> list[Tensor]:
    """The global inputs: one tensor X, or (Partial) one partial per rank whose reduction is X."""
    shape = case.arg("xshape")
    n = case.world if case.arg("in_place").startswith("P") else 1
    return [values(shape, "float64", generator(case, j, 0)) for j in range(n)]


def _place(t: Tensor, place: str, world: int, rank: int) -> Tensor:
    """Rank `rank`'s local piece of the global `t` under `place` ("R", or "S<d>": torch.chunk's piece)."""
    if place.startswith("S"):
        d = int(place[1:])
        return torch.split(t, chunk_lengths(t.shape[d], world), d)[rank]
    return t


def _dtensor_local(case: Case, globals_: list[Tensor], rank: int) -> Tensor:
    place = case.arg("in_place")
    if place.startswith("P"):
        return globals_[rank]
    return _place(globals_[0], place, case.world, rank)


def _dtensor_weight(case: Case) -> Tensor:
    return values(case.arg("xshape"), "float64", generator(case, 0, 99))


def _placement(code: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code == "R":
        return Replicate()
    if code.startswith("S"):
        return Shard(int(code[1:]))
    return Partial(code[1:])


def _call_dtensor(case: Case, leaf: Tensor) -> list[Out]:
    from torch.distributed.tensor import DTensor

    a = case.arg
    shape = torch.Size(a("xshape"))
    x = DTensor.from_local(leaf, mesh(case.world), [_placement(a("in_place"))], run_check=False, shape=shape,
                           stride=torch.empty(shape).stride())  # fmt: skip
    fn, d = a("fn"), a("dim")
    extra: list[Out] = []
    if fn == "all_gather":
        y = funcoll.all_gather(x, d)
    elif fn == "gather":
        y = funcoll.gather(x, d, strategy=a("strategy"))
    elif fn == "all_gather_ragged":
        y, sizes = funcoll.all_gather_ragged(x, d)
        extra = [sizes]
    elif fn == "gather_forward_split_backward":
        y = funcoll.gather_forward_split_backward(x, None, d, a("grad_scale"))
    elif fn == "reduce_scatter":
        y = funcoll.reduce_scatter(x, d, op=a("op"))
    elif fn == "all_reduce":
        y = funcoll.all_reduce(x, op=a("op"))
    elif fn == "all_to_all":
        y = funcoll.all_to_all(x, None, a("scatter_dim"), d)
    elif fn == "broadcast":
        y = funcoll.broadcast(x, a("src"))
    elif fn == "ppermute":
        y = funcoll.ppermute(x, [list(p) for p in a("perm")])
    else:
        y = funcoll.split_forward_gather_backward(x, None, d, a("grad_scale"))
    return [y.to_local(), y.full_tensor(), _placements(y), tuple(y.shape), *extra]


def _grad_scaled(t: Tensor, scale: float) -> Tensor:
    """`t` in the forward, its gradient times `scale` in the backward."""
    return t.detach() + (t - t.detach()) * scale


def _dtensor_reference(case: Case) -> tuple[list[list[Out]], list[Tensor | None]]:
    a, w = case.arg, case.world
    leaves = [g.clone().requires_grad_(case.grad) for g in _dtensor_globals(case)]
    place = a("in_place")
    x = reduce(place[1:], leaves) if place.startswith("P") else leaves[0]
    fn = a("fn")
    y = x
    if fn == "ppermute":
        d = int(place[1:])
        blocks = torch.split(x, x.shape[d] // w, d) if x.shape[d] else [x] * w
        moved = [torch.zeros_like(b) for b in blocks]
        for src, dst in a("perm"):
            moved[dst] = blocks[src]
        y = torch.cat(moved, d)
    if fn in ("gather_forward_split_backward", "split_forward_gather_backward"):
        y = _grad_scaled(x, _scale(case))
    out_place = a("out_place")
    outs: list[list[Out]] = []
    for r in range(w):
        row: list[Out] = [_place(y, out_place, w, r), y, str(_placement(out_place)), tuple(y.shape)]
        if fn == "all_gather_ragged":
            row.append(torch.tensor(chunk_lengths(y.shape[a("dim")], w)))
        outs.append(row)
    grads: list[Tensor | None] = [None] * w
    if case.grad:
        gs = _grad((y * _dtensor_weight(case)).sum(), leaves)
        grads = [gs[r] if place.startswith("P") else _place(gs[0], place, w, r) for r in range(w)]
    return [[o.detach() if isinstance(o, Tensor) else o for o in row] for row in outs], grads


# ------------------------------------------------------------------------------------- checking
def exact(case: Case) -> bool:
    """Pure data movement (and max/min, integer and bool reductions) must match bitwise."""
    op = case.arg("op", "sum")
    if case.op == "moe":  # combine sums each token's k weighted rows
        return False
    if case.op == "lax":
        return case.arg("fn") in ("all_gather", "ppermute") or case.dtype in ("int64", "int32")
    if case.op not in ("reduce_scatter", "all_reduce", "reduce_scatter_v", "reduce", "dtensor"):
        return True
    if case.op == "dtensor" and case.arg("fn") not in ("reduce_scatter", "all_reduce"):
        return True
    return op in ("max", "min") or case.dtype in ("int64", "int32", "bool")


def check_case(case: Case, rank: int, got: dict[str, Any], expected: list[Out], grad: Tensor | None) -> None:
    """Assert that rank `rank`'s results equal the reference; the message names the case."""
    where = f"{case.id} rank {rank}"
    assert got["in_flight"] == 0, f"{where}: {got['in_flight']} collectives left unwaited\n{case!r}"
    outs = got["outs"]
    assert len(outs) == len(expected), f"{where}: {len(outs)} outputs, expected {len(expected)}\n{case!r}"
    tol: dict[str, float] = {"rtol": 0.0, "atol": 0.0} if exact(case) else {}
    for k, (o, e) in enumerate(zip(outs, expected, strict=True)):
        name = f"{where} output {k}"
        if isinstance(e, Tensor):
            assert isinstance(o, Tensor), f"{name}: expected a tensor, got {o!r}\n{case!r}"
            torch.testing.assert_close(o, e, **tol, msg=lambda m, n=name: f"{n}: {m}\n{case!r}")
        else:
            assert o == e, f"{name}: got {o!r}, expected {e!r}\n{case!r}"
    if case.grad:
        torch.testing.assert_close(got["grad"], grad, msg=lambda m: f"{where} x.grad: {m}\n{case!r}")


def check_all(case: Case, per_rank: list[dict[str, Any]]) -> None:
    """Every rank's results of one case against the reference computed here."""
    expected, grads = reference(case)
    for r, got in enumerate(per_rank):
        if "error" in got:
            raise AssertionError(f"{case.id} rank {r} raised:\n{got['error']}\n{case!r}")
        check_case(case, r, got, expected[r], grads[r])


def run_batch(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Run every case on this rank, in order (a rank that raises fails the whole batch, naming the case)."""
    out = []
    for case in cases:
        try:
            out.append(run_case(case, rank))
        except Exception as e:
            raise RuntimeError(f"rank {rank} failed on case {case.id}: {case!r}") from e
    return out


# ------------------------------------------------------------------------------- compiled steps
@dataclass(frozen=True)
class Compiled:
    """A fixed compiled step: one op at one layout, float64; only the sizes vary from call to call."""

    name: str
    op: str
    ragged_dim: int | None  # the dim of x marked with funcoll.mark_ragged (None: static shapes)
    step: Callable[..., Any]
    draw: Callable[[int, Draw], Case]


def _c_gather(x: Tensor) -> Tensor:
    return funcoll.gather(x, 0)


def _c_all_gather_ragged(x: Tensor) -> tuple[Tensor, Tensor]:
    return funcoll.all_gather_ragged(x, -1, strategy="pad")


def _c_reduce_scatter_v(x: Tensor, sizes: Tensor) -> Tensor:
    return funcoll.reduce_scatter(x, 0, sizes=sizes)


def _c_all_to_all_v(x: Tensor, send: Tensor) -> tuple[Tensor, Tensor]:
    return funcoll.all_to_all_v(x, send)


def _c_all_gather(x: Tensor) -> Tensor:
    return funcoll.all_gather(x, 1)


def _c_gather_padded(x: Tensor, length: Tensor) -> tuple[Tensor, Tensor]:
    return funcoll.gather_padded(x, length, 0)


def _c_gather_forward_split_backward(x: Tensor) -> Tensor:
    return funcoll.gather_forward_split_backward(x, None, 0, "up")


def _c_all_reduce(x: Tensor) -> Tensor:
    return funcoll.all_reduce(x)


def _fixed(op: str, **kw: Any) -> Callable[[int, Draw], Case]:
    """A drawer of `op`'s cases at the compiled step's fixed layout (only per-rank lengths drawn)."""

    def draw(world: int, d: Draw) -> Case:
        lens = _lengths(d, world, 4)
        if op == "gather":
            return _case(op, world, [(n, 3) for n in lens], "float64", "contig", True, dim=0, dst=None,
                         strategy="auto", sizes_as="")  # fmt: skip
        if op == "all_gather_ragged":
            return _case(op, world, [(2, n) for n in lens], "float64", "contig", True, dim=-1, strategy="pad",
                         sizes_as="")  # fmt: skip
        if op == "reduce_scatter_v":
            return _case(op, world, [(sum(lens), 2)] * world, "float64", "contig", True, dim=0, op="sum",
                         sizes=tuple(lens), sizes_as="tensor")  # fmt: skip
        if op == "all_to_all_v":
            counts = tuple(tuple(_lengths(d, world)) for _ in range(world))
            return _case(op, world, [(sum(row), 3) for row in counts], "float64", "contig", True, dim=0,
                         counts=counts, sizes_as="tensor", exchange=True)  # fmt: skip
        if op == "all_gather":
            return _case(op, world, [(2, lens[0])] * world, "float64", "contig", True, dim=1, tiled=True)
        if op == "gather_padded":
            return _case(op, world, [(4, 2)] * world, "float64", "contig", True, dim=0,
                         lengths=tuple(min(n, 4) for n in lens), length_as="tensor")  # fmt: skip
        if op == "gather_forward_split_backward":
            return _case(op, world, [(n, 2) for n in lens], "float64", "contig", True, dim=0, grad_scale="up",
                         sizes_as="")  # fmt: skip
        return _case(op, world, [(lens[0], 3)] * world, "float64", "contig", True, op="sum")

    return draw


COMPILED: dict[str, Compiled] = {
    c.name: c
    for c in (
        Compiled("gather", "gather", 0, _c_gather, _fixed("gather")),
        Compiled("all_gather_ragged", "all_gather_ragged", 1, _c_all_gather_ragged, _fixed("all_gather_ragged")),
        Compiled("reduce_scatter_v", "reduce_scatter_v", 0, _c_reduce_scatter_v, _fixed("reduce_scatter_v")),
        Compiled("all_to_all_v", "all_to_all_v", 0, _c_all_to_all_v, _fixed("all_to_all_v")),
        Compiled("all_gather", "all_gather", 1, _c_all_gather, _fixed("all_gather")),
        Compiled("gather_padded", "gather_padded", None, _c_gather_padded, _fixed("gather_padded")),
        Compiled("gather_forward_split_backward", "gather_forward_split_backward", 0,
                 _c_gather_forward_split_backward, _fixed("gather_forward_split_backward")),
        Compiled("all_reduce", "all_reduce", 0, _c_all_reduce, _fixed("all_reduce")),
    )
}  # fmt: skip
_STEPS: dict[str, Callable[..., Any]] = {}
_BACKEND = {"name": "aot_eager"}


def call_compiled(case: Case, x: Tensor, rank: int) -> list[Out]:
    """`case` through its compiled step (one torch.compile per step and process), the ragged dim marked."""
    c = COMPILED[case.compiled]
    if c.name not in _STEPS:
        _STEPS[c.name] = torch.compile(c.step, fullgraph=True, backend=_BACKEND["name"])
    a = case.arg
    args: list[Tensor] = []
    if c.op == "reduce_scatter_v":
        args = [torch.tensor(a("sizes"))]
    elif c.op == "all_to_all_v":
        args = [torch.tensor(a("counts")[rank])]
    elif c.op == "gather_padded":
        args = [torch.tensor([a("lengths")[rank]])]
    marked = x if c.ragged_dim is None else funcoll.mark_ragged(x, c.ragged_dim)
    out = _STEPS[c.name](marked, *args)
    return list(out) if isinstance(out, tuple) else [out]


# ------------------------------------------------------------------------------------------ soak
SOAK_OPS = (*PROPERTY_OPS, *RAGGED_OPS)


@dataclass
class SoakPlan:
    """What one soak run does on every rank: `count` random cases of `world` ranks from `seed`."""

    world: int
    count: int
    seed: int
    compiled: tuple[str, ...]  # the compiled steps this run uses
    compiled_share: float = 0.25  # the share of cases that go through a compiled step
    backend: str = "aot_eager"
    checks: bool = False
    warmup: int = 0  # cases before the first RSS reading (every compiled step is called twice first)
    ops: tuple[str, ...] = field(default=SOAK_OPS)


def soak_cases(plan: SoakPlan) -> list[Case]:
    """The run's cases, the same on every rank: each compiled step twice first (the warm-up), then random."""
    draw = RandomDraw(plan.seed * 7919 + plan.world)
    cases: list[Case] = []
    for name in plan.compiled:
        for _ in range(2):
            cases.append(_compiled_case(name, plan.world, draw))
    while len(cases) < plan.count:
        if plan.compiled and draw.rng.random() < plan.compiled_share:
            cases.append(_compiled_case(draw.choice(plan.compiled), plan.world, draw))
        else:
            cases.append(draw_case(draw.choice(plan.ops), plan.world, draw))
    return cases


def _compiled_case(name: str, world: int, draw: Draw) -> Case:
    c = COMPILED[name]
    case = c.draw(world, draw)
    return Case(case.op, case.world, case.shapes, case.dtype, case.layout, case.kw, case.grad, name)


def rss_bytes() -> int:
    """This process's resident set size now (/proc/self/statm's second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


RELEVANT_WARNING = re.compile(r"funcoll|c10d|distributed|ProcessGroup|gloo", re.IGNORECASE)


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Collect the lines this process writes to its stderr while inside: C++ warnings too.

    c10d, gloo and torch's C++ code warn on file descriptor 2, not through Python's
    ``warnings``, so the descriptor itself goes to a temporary file meanwhile; the
    non-empty lines are in the yielded list on exit.
    """
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines.extend(line for line in f.read().decode(errors="replace").splitlines() if line.strip())


def soak_rank(rank: int, world: int, plan: SoakPlan) -> dict[str, Any]:
    """Run the plan's cases on this rank, each checked at once against the reference computed here.

    Each rank computes the single-process reference itself (from every rank's input, never with
    funcoll), so nothing accumulates: RSS is read after the warm-up and at the end. Returns the
    counts, the first mismatches, the RSS readings, the funcoll/c10d warnings seen (Python's, and
    every line written to stderr, where C++ warns), the graphs dynamo compiled and the collectives
    left unwaited at the end.
    """
    _BACKEND["name"] = plan.backend
    torch._dynamo.reset()
    graphs_before = int(dynamo_counters["stats"]["unique_graphs"])  # the counters outlive reset()
    cases = soak_cases(plan)
    warmup = max(plan.warmup, 2 * len(plan.compiled))
    counts: dict[str, int] = {}
    failures: list[str] = []
    rss_start = rss_bytes()
    start = time.perf_counter()
    with (
        captured_stderr() as stderr,
        warnings.catch_warnings(record=True) as seen,
        funcoll.set_checks(plan.checks),
    ):
        warnings.simplefilter("always")
        for i, case in enumerate(cases):
            if i == warmup:
                rss_start = rss_bytes()
            key = case.op + ("[compiled]" if case.compiled else "")
            counts[key] = counts.get(key, 0) + 1
            try:
                got = run_case(case, rank)
            except Exception:  # noqa: BLE001 -- the others are now out of step: report and stop
                failures.append(f"case {i} {case.id} raised:\n{traceback.format_exc()}\n{case!r}")
                break
            expected, grads = reference(case)
            try:
                check_case(case, rank, got, expected[rank], grads[rank])
            except AssertionError as e:
                failures.append(f"case {i}: {e}")
    rss_end = rss_bytes()
    relevant = [
        f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}"
        for w in seen
        if RELEVANT_WARNING.search(f"{w.filename} {w.message}")
    ]
    return {
        "collectives": sum(counts.values()),
        "counts": counts,
        "failures": failures[:5],
        "n_failures": len(failures),
        "rss_start": rss_start,
        "rss_end": rss_end,
        "warnings": sorted(set(relevant)),
        "stderr": stderr,
        "seconds": time.perf_counter() - start,
        "graphs": int(dynamo_counters["stats"]["unique_graphs"]) - graphs_before,
        "in_flight": in_flight(),
    }


def graph_bound(plan: SoakPlan, rank: int) -> int:
    """The graphs rank `rank` of a soak may compile: one per compiled step, whose signature is fixed.

    One more for a step whose first call on this rank is empty on a marked dim that is
    not the outermost: dynamo then traces its stride static and the next non-empty call
    compiles the graph that serves every length (``funcoll.mark_ragged``'s docstring).
    """
    first: dict[str, Case] = {}
    for case in soak_cases(plan):
        if case.compiled:
            first.setdefault(case.compiled, case)
    bound = len(first)
    for name, case in first.items():
        d, shape = COMPILED[name].ragged_dim, case.shapes[rank]
        bound += d is not None and d % len(shape) != 0 and shape[d] == 0
    return bound
