"""Multi-rank tests of the static-shape ragged ops (``funcoll/_ops/_static.py``) on real gloo ranks.

``gather_padded``: rank r holds a seeded tensor padded to a bound B along the ragged dim,
of which the first ``lengths[r]`` rows are data. Reference: the data rows of every rank
concatenated in rank order, zeros up to ``world * B`` rows, and the lengths.

``all_to_all_padded``: rank r holds ``world`` blocks of capacity C; the first
``send[r][j]`` rows of block j are data for rank j. Reference for rank j: rank i's data
rows for j, for every i in order, zeros up to ``world * C`` rows, and ``send[i][j]``
over i.

Both references are computed in the parent in one process. For float64 cases every rank
computes ``loss_r = (y_r * w_r).sum()`` and backpropagates; the reference gradient is
torch.autograd of ``sum_r loss_r`` through the single-process reference (zero on padding
rows). Every case of one world size runs in one ``run_ranks`` call; the error cases run
in others, each rank recording what it raised and that no collective was left unwaited
(``funcoll.testing.in_flight()``), checked or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _inputs import once_per_world, seeded
from torch import Tensor

import funcoll
from funcoll.testing import in_flight, run_ranks

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 120.0
F32, F64, BF16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool
C64, C128, I8, F16 = torch.complex64, torch.complex128, torch.int8, torch.float16
# How the counts header travels: "fused" (checks off) as rows after the data in the
# data's own collective, "separate" (checks on) in an all_gather of its own first.
HEADERS = {"fused": False, "separate": True}
GATHER, A2A = "gather_padded", "all_to_all_padded"


@dataclass(frozen=True)
class Case:
    id: str
    op: str  # GATHER | A2A
    shape: tuple[int, ...]  # the entry at `dim` is the bound B (gather) or the capacity C (a2a)
    dim: int
    dtype: torch.dtype
    counts: str  # "seeded" | "zero" | "full" | "zero-on-0"
    counts_as: str = "tensor"  # "tensor" (int64) | "ints" | "int32-cpu"
    transposed: bool = False  # x is a non-contiguous transpose of its last two dims
    grad: bool = False

    @property
    def limit(self) -> int:
        return self.shape[self.dim]

    def row_counts(self, rank: int, world: int) -> list[int]:
        """gather: [this rank's length]; a2a: the rows this rank sends to each rank."""
        n = 1 if self.op == GATHER else world
        if self.counts == "zero":
            return [0] * n
        if self.counts == "full":
            return [self.limit] * n
        got = [(3 * rank + 2 * j + 2 + len(self.id)) % (self.limit + 1) for j in range(n)]
        return [0] * n if self.counts == "zero-on-0" and rank == 0 else got

    def x_shape(self, world: int) -> list[int]:
        shape = list(self.shape)
        if self.op == A2A:
            shape[self.dim] *= world
        return shape


def cases() -> list[Case]:
    raw = [
        Case("g-1d-b5-f32", GATHER, (5,), 0, F32, "seeded"),
        Case("g-x4x3-dim0-f64-grad", GATHER, (4, 3), 0, F64, "seeded", grad=True),
        Case("g-x3x6-dim-1-f64-T-grad", GATHER, (3, 6), -1, F64, "seeded", transposed=True, grad=True),
        Case("g-x2x3x5-dim1-f64-int-grad", GATHER, (2, 3, 5), 1, F64, "zero-on-0", "ints", grad=True),
        Case("g-x2x3x4x5-dim2-bf16", GATHER, (2, 3, 4, 5), 2, BF16, "seeded", "int32-cpu"),
        Case("g-x3x5-dim0-i64-zero", GATHER, (3, 5), 0, I64, "zero"),
        Case("g-x5x3-dim-2-bool-T", GATHER, (5, 3), -2, BOOL, "seeded", transposed=True),
        Case("g-x4x7-dim0-f64-full-grad", GATHER, (4, 7), 0, F64, "full", grad=True),
        Case("g-x2x0-dim0-f32-empty-rows", GATHER, (2, 0), 0, F32, "seeded"),
        Case("g-x0x5-dim0-f32-bound0", GATHER, (0, 5), 0, F32, "zero"),
        Case("a-1d-c3-f32", A2A, (3,), 0, F32, "seeded"),
        Case("a-x2x5-dim0-f64-grad", A2A, (2, 5), 0, F64, "seeded", grad=True),
        Case("a-x3x4-dim-1-f64-T-grad", A2A, (3, 4), -1, F64, "seeded", transposed=True, grad=True),
        Case("a-x2x3x5-dim1-f64-ints-grad", A2A, (2, 3, 5), 1, F64, "zero-on-0", "ints", grad=True),
        Case("a-x2x3x4x5-dim2-bf16", A2A, (2, 3, 4, 5), 2, BF16, "seeded", "int32-cpu"),
        Case("a-x4x3-dim0-i64-full", A2A, (4, 3), 0, I64, "full"),
        Case("a-x3x2-dim-2-bool-zero-T", A2A, (3, 2), -2, BOOL, "zero", transposed=True),
        Case("a-x2x0-dim0-f32-empty-rows", A2A, (2, 0), 0, F32, "seeded"),
        Case("a-x0x5-dim0-f32-capacity0", A2A, (0, 5), 0, F32, "zero"),
        # every element size: its header rows as uint8, int16, int32, int64, or apart (16 bytes)
        Case("g-x3x2-dim0-c64", GATHER, (3, 2), 0, C64, "seeded"),
        Case("g-x3x2-dim-1-c128-T", GATHER, (3, 2), -1, C128, "seeded", transposed=True),
        Case("a-x2x3-dim0-i8", A2A, (2, 3), 0, I8, "seeded"),
        Case("a-x2x3-dim0-f16", A2A, (2, 3), 0, F16, "full"),
        Case("a-x1x2-dim0-c128", A2A, (1, 2), 0, C128, "seeded"),
        Case("a-x2x2-dim-1-c64-T", A2A, (2, 2), -1, C64, "seeded", transposed=True),
        Case("g-x3x64-dim0-f32-wide-rows", GATHER, (3, 64), 0, F32, "seeded"),  # the header in one row
    ]
    assert len({c.id for c in raw}) == len(raw)
    return raw


def make_input(c: Case, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """``(leaf, x)``; with `transposed`, x is a non-contiguous view of the leaf."""
    shape = c.x_shape(world)
    if c.transposed:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    leaf = seeded(shape, c.dtype, c.id, rank).requires_grad_(c.grad)
    return leaf, (leaf.transpose(-1, -2) if c.transposed else leaf)


def counts_arg(c: Case, counts: list[int]) -> object:
    if c.counts_as == "ints":
        return counts[0] if c.op == GATHER else counts
    dtype = torch.int32 if c.counts_as == "int32-cpu" else torch.int64
    return torch.tensor(counts[0] if c.op == GATHER else counts, dtype=dtype)


def call(c: Case, x: Tensor, counts: list[int]) -> tuple[Tensor, Tensor]:
    return getattr(funcoll, c.op)(x, counts_arg(c, counts), c.dim)


def weight(c: Case, rank: int, shape: torch.Size) -> Tensor:
    return seeded(shape, F64, c.id, "w", rank)


def reference(c: Case, world: int) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
    """Every rank's (y, sizes) and its input gradient, computed in one process."""
    leaves, xs = zip(*(make_input(c, r, world) for r in range(world)), strict=True)
    counts = [c.row_counts(r, world) for r in range(world)]
    d = c.dim % len(c.shape)
    if c.op == GATHER:
        pieces = [[x.narrow(d, 0, cnt[0]) for x, cnt in zip(xs, counts, strict=True)]] * world
        sizes = [torch.tensor([cnt[0] for cnt in counts])] * world
    else:  # rank j gets, from every rank i, the data rows of i's block j
        pieces = [[xs[i].narrow(d, j * c.limit, counts[i][j]) for i in range(world)] for j in range(world)]
        sizes = [torch.tensor([counts[i][j] for i in range(world)]) for j in range(world)]
    ys = []
    for parts in pieces:
        data = torch.cat(parts, d)
        pad = list(data.shape)
        pad[d] = world * c.limit - data.shape[d]
        ys.append(torch.cat([data, data.new_zeros(pad)], d))
    grads: list[Tensor | None] = [None] * world
    if c.grad:
        sum((y * weight(c, r, y.shape)).sum() for r, y in enumerate(ys)).backward()
        grads = [leaf.grad for leaf in leaves]
    return [y.detach() for y in ys], sizes, grads


# --------------------------------------------------------------------------- rank bodies
def _run_cases(rank: int, world: int) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for header, checked in HEADERS.items():
        with funcoll.set_checks(checked):
            for c in cases():
                leaf, x = make_input(c, rank, world)
                y, sizes = call(c, x, c.row_counts(rank, world))
                res: dict[str, Any] = {"y": y.detach(), "sizes": sizes}
                if c.grad:
                    (y * weight(c, rank, y.shape)).sum().backward()
                    res["grad"] = leaf.grad
                out[header, c.id] = res
    return out


_batch = once_per_world(_run_cases, TIMEOUT_S, worlds=WORLDS)


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("c", cases(), ids=lambda c: c.id)
def test_static_op_matches_reference(c: Case, world: int, header: str) -> None:
    ys, sizes, grads = reference(c, world)
    for rank, results in enumerate(_batch(world)):
        res = results[header, c.id]
        assert res["y"].dtype == c.dtype and res["y"].shape == ys[rank].shape, (rank, res["y"].shape)
        torch.testing.assert_close(res["y"], ys[rank], rtol=0, atol=0, msg=f"rank {rank}")
        assert res["sizes"].dtype == torch.int64
        torch.testing.assert_close(res["sizes"], sizes[rank], msg=f"rank {rank} sizes")
        if c.grad:
            torch.testing.assert_close(res["grad"], grads[rank], rtol=1e-12, atol=1e-12, msg=f"rank {rank}")


def test_gather_padded_example_from_the_docstring() -> None:
    def body(rank: int, world: int) -> tuple[list, list]:
        x = torch.tensor([[1.0], [2.0], [0.0]]) if rank == 0 else torch.tensor([[5.0], [9.0], [9.0]])
        y, sizes = funcoll.gather_padded(x, torch.tensor(2 if rank == 0 else 1))
        return y.tolist(), sizes.tolist()

    for y, sizes in run_ranks(body, 2, timeout=TIMEOUT_S):
        assert y == [[1.0], [2.0], [5.0], [0.0], [0.0], [0.0]] and sizes == [2, 1]


# ----------------------------------------------------------------------------- errors
X = torch.zeros(4, 3)


@pytest.mark.parametrize(
    "length, exc, fragment",
    [
        pytest.param(2.0, TypeError, "got float", id="float"),
        pytest.param(True, TypeError, "got bool", id="bool"),
        pytest.param("2", TypeError, "got str", id="str"),
        pytest.param(torch.tensor(2.0), TypeError, "torch.float32 tensor", id="float-tensor"),
        pytest.param(torch.tensor(True), TypeError, "torch.bool tensor", id="bool-tensor"),
        pytest.param(torch.tensor([1, 2]), ValueError, "shape (2,)", id="two-values"),
        pytest.param(5, ValueError, "`length`=5 is outside [0, 4] = [0, x.shape[dim]]", id="int-above-bound"),
        pytest.param(-1, ValueError, "`length`=-1 is outside [0, 4]", id="int-negative"),
    ],
)
def test_bad_length_raises_before_communicating(length: object, exc: type[Exception], fragment: str) -> None:
    # No process group exists here: the check must come before anything would communicate.
    with pytest.raises(exc, match=r"funcoll\.gather_padded: `length`") as info:
        funcoll.gather_padded(X, length)
    assert fragment in str(info.value)


def test_bad_dim_and_x_raise() -> None:
    with pytest.raises(ValueError, match=r"funcoll.gather_padded: `dim`=2 is out of range"):
        funcoll.gather_padded(X, 1, 2)
    with pytest.raises(TypeError, match=r"funcoll.gather_padded: `x` must be a torch.Tensor, got list"):
        funcoll.gather_padded([1.0], 1)


def _disagreeing(rank: int, world: int, kind: str, checked: bool = True) -> str:
    """Rank 1 breaks the contract in one way; every rank records what it raised."""
    funcoll.set_checks(checked)
    x, n = torch.zeros(4, 3), torch.tensor(1)
    if rank == 1:
        if kind == "length-above-bound":
            n = torch.tensor(5)
        elif kind == "length-negative":
            n = torch.tensor(-2)
        elif kind == "bound":
            x = torch.zeros(5, 3)
        elif kind == "dtype":
            x = torch.zeros(4, 3, dtype=torch.float64)
    try:
        funcoll.gather_padded(x, n)
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e} [in flight {in_flight()}]"
    return "no error"


# Unchecked, the counts travel with the data and are checked after it moved, by a
# device-side assert (on CPU a RuntimeError with funcoll's general message); a rank
# whose shape differs then sends a block of another size, which the backend
# refuses (gloo aborts), as for the even ops: those kinds run checked only.
# Checked, the header goes first and is read on the host: a ValueError naming the
# rank and the value, the same on every rank.
CHECKED_GATHER = {
    "length-above-bound": "ValueError: funcoll.gather_padded: rank 1's `length` 5 is outside [0, 4] = "
    "[0, x.shape[dim]]",
    "length-negative": "ValueError: funcoll.gather_padded: rank 1's `length` -2 is outside [0, 4]",
    "bound": "ValueError: funcoll.gather_padded: ranks disagree on `x` (rank 0: 2-d float32 (4, 3), dim 0; "
    "rank 1: 2-d float32 (5, 3), dim 0",
    "dtype": "ValueError: funcoll.gather_padded: ranks disagree on `x` (rank 0: 2-d float32 (4, 3), dim 0; "
    "rank 1: 2-d float64 (4, 3), dim 0",
}
UNCHECKED = "RuntimeError: funcoll.{op}: every rank's row counts must lie in [0, {limit}]"
DISAGREEING = [
    *(
        pytest.param(k, c, id=f"{k}-{h}")
        for k in ("length-above-bound", "length-negative")
        for h, c in HEADERS.items()
    ),
    *(pytest.param(k, True, id=f"{k}-separate") for k in ("bound", "dtype")),
]


@pytest.mark.parametrize("kind, checked", DISAGREEING)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_all_raise(world: int, kind: str, checked: bool) -> None:
    want = CHECKED_GATHER[kind] if checked else UNCHECKED.format(op=GATHER, limit="x.shape[dim]")
    for rank, msg in enumerate(run_ranks(_disagreeing, world, kind, checked, timeout=TIMEOUT_S)):
        assert msg.startswith(want), (rank, msg, want)
        assert msg.endswith("[in flight 0]"), f"rank {rank}: collectives left unwaited: {msg}"


def test_all_to_all_padded_example_from_the_docstring() -> None:
    def body(rank: int, world: int) -> tuple[list, list]:
        if rank == 0:
            x, send = torch.tensor([[1.0], [2.0], [3.0], [0.0]]), torch.tensor([2, 1])
        else:
            x, send = torch.tensor([[4.0], [9.0], [5.0], [6.0]]), torch.tensor([1, 2])
        y, recv_sizes = funcoll.all_to_all_padded(x, send)
        return y.tolist(), recv_sizes.tolist()

    (y0, r0), (y1, r1) = run_ranks(body, 2, timeout=TIMEOUT_S)
    assert (y0, r0) == ([[1.0], [2.0], [4.0], [0.0]], [2, 1])
    assert (y1, r1) == ([[3.0], [5.0], [6.0], [0.0]], [1, 2])


# (id, x rows, send_sizes, exception, message fragment), on 2 ranks (capacity 2 with 4 rows)
A2A_BAD = [
    ("rows-not-divisible", 5, [1, 1], ValueError, "`x` has 5 rows along dim 0, which 2 ranks do not divide"),
    ("one-size-for-two-ranks", 4, [1], ValueError, "`send_sizes`=[1] must be 2 ints, one per rank, got 1"),
    (
        "int-above-capacity",
        4,
        [1, 3],
        ValueError,
        "`send_sizes`[1]=3 is outside [0, 2] = [0, x.shape[dim] // world]",
    ),
    ("negative-int", 4, [-1, 0], ValueError, "`send_sizes`[0]=-1 is outside [0, 2]"),
    ("float-entry", 4, [1.0, 0], TypeError, "`send_sizes`[0] must be an int, got float 1.0"),
    ("an-int", 4, 2, TypeError, "`send_sizes` must be an integer tensor or a list of ints, got int"),
    ("float-tensor", 4, torch.tensor([1.0, 0.0]), TypeError, "got a torch.float32 tensor"),
    (
        "tensor-of-3",
        4,
        torch.tensor([1, 0, 0]),
        ValueError,
        "must hold 2 value(s), got a tensor of shape (3,)",
    ),
]


def _a2a_bad_calls(rank: int, world: int) -> dict[str, tuple[str, str]]:
    out = {}
    for cid, rows, send, _, _ in A2A_BAD:
        try:
            funcoll.all_to_all_padded(torch.zeros(rows, 3), send)
            out[cid] = ("no error", "")
        except Exception as e:  # noqa: BLE001 (recorded; the parent checks the type and the message)
            out[cid] = (type(e).__name__, str(e))
    return out


def test_all_to_all_padded_bad_arguments_raise_on_every_rank_before_communicating() -> None:
    # Every rank makes every bad call and then returns: had one communicated, the
    # other rank's next call would have mismatched it (a gloo error or a timeout).
    for rank, got in enumerate(run_ranks(_a2a_bad_calls, 2, timeout=TIMEOUT_S)):
        for cid, _, _, exc, fragment in A2A_BAD:
            name, msg = got[cid]
            assert name == exc.__name__ and msg.startswith("funcoll.all_to_all_padded: "), (rank, cid, msg)
            assert fragment in msg, (rank, cid, msg)


def _a2a_disagreeing(rank: int, world: int, kind: str, checked: bool = True) -> str:
    funcoll.set_checks(checked)
    x, send = torch.zeros(2 * world, 3), torch.ones(world, dtype=torch.int64)
    if rank == 1:
        if kind == "size-above-capacity":
            send = torch.tensor([0] * (world - 1) + [3])
        elif kind == "capacity":
            x = torch.zeros(3 * world, 3)
    try:
        funcoll.all_to_all_padded(x, send)
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e} [in flight {in_flight()}]"
    return "no error"


@pytest.mark.parametrize(
    "kind, checked",
    [*(pytest.param("size-above-capacity", c, id=f"size-above-capacity-{h}") for h, c in HEADERS.items()),
     pytest.param("capacity", True, id="capacity-separate")],
)  # fmt: skip
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_padded_ranks_that_disagree_all_raise(world: int, kind: str, checked: bool) -> None:
    if not checked:
        want = UNCHECKED.format(op=A2A, limit="x.shape[dim] // world")
    elif kind == "size-above-capacity":
        sizes = [0] * (world - 1) + [3]
        want = f"ValueError: funcoll.all_to_all_padded: rank 1's `send_sizes` {sizes} is outside [0, 2]"
    else:
        want = "ValueError: funcoll.all_to_all_padded: ranks disagree on `x` (rank 0: 2-d float32"
    for rank, msg in enumerate(run_ranks(_a2a_disagreeing, world, kind, checked, timeout=TIMEOUT_S)):
        assert msg.startswith(want), (rank, msg, want)
        assert msg.endswith("[in flight 0]"), f"rank {rank}: collectives left unwaited: {msg}"
