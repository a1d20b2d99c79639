"""Every public funcoll op as a compile-test case: per-rank inputs, the call, a single-process reference.

An :class:`OpCase` holds three things:

- ``inputs(rank, world)``: that rank's inputs, deterministic (seeded by the case id
  and the rank), so any process can rebuild every rank's inputs;
- ``call(*inputs, group=None)``: the funcoll call that ``torch.compile`` traces, on
  `group` (any form funcoll takes; ``takes_group=False`` for the seed helpers,
  which have no such argument and use the default group). It reads its rank and
  world from ``funcoll.axis_index(group)`` / ``funcoll.axis_size(group)`` (so those
  are traced too) and works at any world size, the fake process group's 1024 included;
- ``reference(all_inputs, world)``: every rank's expected outputs, computed in one
  process from all ranks' inputs with torch.cat / sum / tensor_split, never with
  funcoll. It is differentiable, so :func:`reference_grads` gets the expected
  gradients from torch.autograd.

Gradients follow the op's documented backward (``OpCase.grad``):

- ``"adjoint"``: every rank computes a loss; the reference is the gradient of the sum
  of those losses with respect to every rank's inputs (JAX's convention);
- ``"replicated"``: the input is the same on every rank (region ops that split in the
  forward); its gradient is that of the summed loss with respect to the one shared
  tensor, times the op's `grad_scale`;
- ``"own"``: the output is replicated and each rank's gradient is already complete
  (region ops that gather in the forward); rank r's input gradient is that of rank
  r's own loss, times `grad_scale`;
- ``"none"``: forward only.

Each rank's loss is ``sum_k (out_k * weight_k).sum()`` over its floating outputs,
with seeded weights from :func:`loss_weights`.

Also here, for every compile test to use: :func:`run_case` (one case on one rank,
eager or through a compiled function, forward and backward), :func:`run_batch` (many
cases on real ranks in one ``run_ranks`` call, kept in step so that a case that fails
on one rank cannot hang the others), :func:`trace_graphs` (the AOT forward and
backward graphs of a case, traced and never run) and :func:`summarize_graph` with
its readers (which collectives a graph holds).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import funcoll
from funcoll import compat
from funcoll._ops import _spec
from funcoll.testing import (
    Collective,
    RankError,
    Ranks,
    graph_collectives,
    in_flight,
    settled,
    start_ranks,
)

__all__ = [
    "A2A",
    "AG",
    "AR",
    "BC",
    "CASES",
    "CASES_BY_ID",
    "COLLECTIVE_PREFIX",
    "EXPECTED_AT_2",
    "KNOWN_BUGS",
    "RS",
    "SMOKE",
    "SMOKE_GROUP_CASES",
    "STOPPED",
    "WAIT",
    "OpCase",
    "Outputs",
    "collective_counts",
    "expected_collectives",
    "flatten",
    "forbidden_calls",
    "has_error",
    "in_flight",
    "last_rank_shape_changes",
    "last_rank_shifted",
    "loss_weights",
    "moe_step",
    "ragged_sizes",
    "recording_backend",
    "recv_sizes",
    "reference_grads",
    "reference_outputs",
    "run_batch",
    "run_case",
    "send_sizes",
    "summarize_graph",
    "trace_graphs",
]

Outputs = list[Tensor | None]
Inputs = tuple[Tensor, ...]


# ---------------------------------------------------------------------------- sizes
def ragged_sizes(world: int, alt: bool = False) -> list[int]:
    """Each rank's length along the ragged dim; every world >= 2 has a rank with 0 rows.

    ``ragged_sizes(2) == [1, 0]``, ``ragged_sizes(3) == [1, 0, 4]``;
    ``ragged_sizes(2, alt=True) == [3, 0]``, ``ragged_sizes(3, alt=True) == [3, 0, 2]``.
    """
    sizes = [(2 * r + 3) % 5 if alt else (4 * r + 1) % 5 for r in range(world)]
    if _LAST_RANK_SHIFTED and world > 1:
        sizes[-1] = (sizes[-1] + 2) % 5
    return sizes


_LAST_RANK_SHIFTED = False


@contextlib.contextmanager
def last_rank_shifted() -> Iterator[None]:
    """Inside the block, the last rank's ``ragged_sizes`` entry is ``(n + 2) % 5``: another static shape.

    Its rows to itself in ``send_sizes`` / ``recv_sizes`` are ``(n + 2) % 4`` too.

    A step run inside it, then the same step outside, is a schedule in which only the
    last rank sees a new shape on the second step (``ragged_sizes(2)``: 2 rows, then
    0; ``ragged_sizes(3)``: 1, then 4): that rank compiles again (a dimension that
    changed is dynamic on dynamo's second try, a 0 stays static), the others run
    what they compiled first. The sizes a case passes as arguments change on every
    rank alike, so a case that passes them recompiles everywhere.
    """
    global _LAST_RANK_SHIFTED
    _LAST_RANK_SHIFTED = True
    try:
        yield
    finally:
        _LAST_RANK_SHIFTED = False


def last_rank_shape_changes(case: OpCase, world: int) -> bool:
    """Whether the last rank's inputs to `case` have another shape inside :func:`last_rank_shifted`."""
    with last_rank_shifted():
        first = [t.shape for t in case.inputs(world - 1, world)]
    return first != [t.shape for t in case.inputs(world - 1, world)]


def send_sizes(rank: int, world: int) -> list[int]:
    """Rows rank `rank` sends to each rank in all_to_all_v (0 and 1 included): ``(rank + 2 j + 1) % 4``.

    O(world) so that a trace at 1024 ranks stays cheap; ``send_sizes(0, 2) == [1, 3]``,
    ``send_sizes(1, 2) == [2, 0]``.
    """
    sizes = [(rank + 2 * j + 1) % 4 for j in range(world)]
    if _LAST_RANK_SHIFTED and rank == world - 1 > 0:  # other rows to itself: no other rank's shape changes
        sizes[-1] = (sizes[-1] + 2) % 4
    return sizes


def recv_sizes(rank: int, world: int) -> list[int]:
    """Rows rank `rank` receives from each rank: column `rank` of the send sizes."""
    sizes = [(i + 2 * rank + 1) % 4 for i in range(world)]
    if _LAST_RANK_SHIFTED and rank == world - 1 > 0:
        sizes[-1] = (sizes[-1] + 2) % 4
    return sizes


def _rank_and_world(group: Any = None) -> tuple[int, int]:
    return funcoll.axis_index(group), funcoll.axis_size(group)


# --------------------------------------------------------------------------- inputs
def _seed(*key: object) -> int:
    return zlib.crc32("/".join(map(str, key)).encode())


def _randn(key: tuple[object, ...], shape: Sequence[int], noncontig: bool = False) -> Tensor:
    g = torch.Generator().manual_seed(_seed(*key))
    if not noncontig:
        return torch.randn(tuple(shape), generator=g, dtype=torch.float64)
    # The same kind of values with reversed (column-major) strides: a permuted view.
    t = torch.randn(tuple(reversed(shape)), generator=g, dtype=torch.float64)
    return t.permute(*reversed(range(t.dim())))


def loss_weights(case_id: str, rank: int, outputs: Outputs) -> list[Tensor | None]:
    """Seeded weights of rank `rank`'s loss, one per floating output (None for the rest)."""
    weights: list[Tensor | None] = []
    for k, out in enumerate(outputs):
        if out is None or not out.dtype.is_floating_point:
            weights.append(None)
        else:
            weights.append(_randn(("loss", case_id, rank, k), out.shape))
    return weights


def flatten(result: object) -> Outputs:
    """A funcoll result (tensor, None, tuple or list of tensors) as a flat list."""
    if isinstance(result, (tuple, list)):
        return list(result)
    if result is None or isinstance(result, Tensor):
        return [result]
    raise TypeError(f"unexpected funcoll result type {type(result).__name__}")


# ------------------------------------------------------------------------------ the case
@dataclass(frozen=True)
class OpCase:
    """One public op under one argument set; see the module docstring."""

    id: str
    inputs: Callable[[int, int], Inputs]
    call: Callable[..., Any]
    reference: Callable[[list[Inputs], int], list[Outputs]]
    grad: str = "adjoint"  # "adjoint" | "replicated" | "own" | "none"
    grad_scale: str | None = None  # "up" | "down" | None, for the region ops
    grad_inputs: tuple[int, ...] = (0,)  # the inputs that require grad
    exchanges_sizes: bool = False  # the op all_gathers a size header before the data
    writes_input: int | None = None  # index of an input the op writes in place
    min_world: int = 1
    takes_group: bool = True  # call(*inputs, group=...) works; False for the seed helpers without one
    op: str = ""  # the public op whose spec says its collectives; the id's first word when empty
    variant: str = ""  # which argument set (funcoll._ops._spec: "sizes", a strategy, "dst", "given")
    at_scale: bool = False  # traced on a fake group of 64 ranks, 1024 without a size exchange (test_fake_pg)

    @property
    def spec_name(self) -> str:
        return self.op or self.id.split("-")[0].removeprefix("compat.")

    def grad_factor(self, world: int) -> float:
        return {"up": float(world), "down": 1.0 / world, None: 1.0}[self.grad_scale]


def _split(t: Tensor, sizes: Sequence[int], dim: int) -> list[Tensor]:
    return list(torch.split(t, list(sizes), dim))


def _same(world: int, out: Outputs) -> list[Outputs]:
    return [list(out) for _ in range(world)]


def _firsts(all_inputs: list[Inputs]) -> list[Tensor]:
    return [inp[0] for inp in all_inputs]


def _shaped(
    case: str, *shape: int | Callable[[int, int], int], noncontig: bool = False
) -> Callable[[int, int], Inputs]:
    """Inputs of one tensor whose dims are ints or functions of (rank, world)."""

    def build(rank: int, world: int) -> Inputs:
        dims = [s(rank, world) if callable(s) else s for s in shape]
        return (_randn((case, rank), dims, noncontig),)

    return build


def _exact_in(wire: str, case: str, *shape: int | Callable[[int, int], int]) -> Callable[[int, int], Inputs]:
    """Inputs that a wire format carries exactly, so that the result equals the exact reference.

    "int8": integers in [-127, 127] with 127 in every row (a scale of 1 a row);
    "bf16": values with bfloat16's 8 bits of mantissa.
    """

    def build(rank: int, world: int) -> Inputs:
        dims = [s(rank, world) if callable(s) else s for s in shape]
        x = _randn((case, rank), dims)
        if wire == "bf16":
            return (x.bfloat16().double(),)
        x = (x * 40).round().clamp(-126, 126)
        x[..., 0] = 127
        return (x,)

    return build


def _replicated(case: str, *shape: int | Callable[[int, int], int]) -> Callable[[int, int], Inputs]:
    """The same tensor on every rank (seeded by the case alone)."""

    def build(rank: int, world: int) -> Inputs:
        dims = [s(0, world) if callable(s) else s for s in shape]
        return (_randn((case, "replicated"), dims),)

    return build


def _ragged(rank: int, world: int) -> int:
    return ragged_sizes(world)[rank]


def _ragged_alt(rank: int, world: int) -> int:
    return ragged_sizes(world, alt=True)[rank]


def _send_total(rank: int, world: int) -> int:
    return sum(send_sizes(rank, world))


# ----------------------------------------------------------------------- even collectives
def _ring(world: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % world) for i in range(world)]


def _call_ppermute_ring(x: Tensor, group: Any = None) -> Tensor:
    return funcoll.ppermute(x, _ring(funcoll.axis_size(group)), group=group)


def _call_ppermute_partial(x: Tensor, group: Any = None) -> Tensor:
    return funcoll.ppermute(x, [(0, funcoll.axis_size(group) - 1)], group=group)


def _ref_ppermute(
    pairs: Callable[[int], list[tuple[int, int]]],
) -> Callable[[list[Inputs], int], list[Outputs]]:
    def ref(all_inputs: list[Inputs], world: int) -> list[Outputs]:
        xs = _firsts(all_inputs)
        src_of = {d: s for s, d in pairs(world)}
        return [[xs[src_of[r]] * 1 if r in src_of else torch.zeros_like(xs[r])] for r in range(world)]

    return ref


def _call_broadcast_last(x: Tensor, group: Any = None) -> Tensor:
    return funcoll.broadcast(x, src=funcoll.axis_size(group) - 1, group=group)


def _call_reduce_last(x: Tensor, group: Any = None) -> Tensor:
    return funcoll.reduce(x, funcoll.axis_size(group) - 1, group=group)


def _ref_reduce_last(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    total = sum(_firsts(all_inputs))
    return [[total if r == world - 1 else torch.zeros_like(total)] for r in range(world)]


def _call_reduce_scatter_ragged(x: Tensor, group: Any = None) -> Tensor:
    return funcoll.reduce_scatter(x, 0, sizes=ragged_sizes(funcoll.axis_size(group)), group=group)


def _ref_reduce_scatter_ragged(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    total = sum(_firsts(all_inputs))
    return [[piece] for piece in _split(total, ragged_sizes(world), 0)]


def _ref_all_to_all(scatter_dim: int, gather_dim: int) -> Callable[[list[Inputs], int], list[Outputs]]:
    def ref(all_inputs: list[Inputs], world: int) -> list[Outputs]:
        pieces = [torch.tensor_split(x, world, scatter_dim) for x in _firsts(all_inputs)]
        return [[torch.cat([pieces[i][r] for i in range(world)], gather_dim)] for r in range(world)]

    return ref


def _heads(rank: int, world: int) -> int:
    """This rank's share of world + 1 heads, split as torch.tensor_split does: they never divide."""
    return torch.tensor_split(torch.arange(world + 1), world)[rank].numel()


def _call_all_to_all_heads_back(x: Tensor, group: Any = None) -> Tensor:
    world = funcoll.axis_size(group)
    return funcoll.all_to_all(x, group, 1, 2, gather_sizes=funcoll.split_sizes(world + 1, world))


def _call_all_to_all_heads_back_int8(x: Tensor, group: Any = None) -> Tensor:
    world = funcoll.axis_size(group)
    return funcoll.all_to_all(
        x,
        group,
        1,
        2,
        gather_sizes=funcoll.split_sizes(world + 1, world),
        wire=funcoll.Wire(torch.int8),
    )


def _call_axis(x: Tensor, group: Any = None) -> Tensor:
    rank, world = _rank_and_world(group)
    return x * rank + world


# --------------------------------------------------------------------------- region ops
def _ref_split(dim: int) -> Callable[[list[Inputs], int], list[Outputs]]:
    def ref(all_inputs: list[Inputs], world: int) -> list[Outputs]:
        return [[torch.tensor_split(all_inputs[r][0], world, dim)[r]] for r in range(world)]

    return ref


def _ref_cat(dim: int) -> Callable[[list[Inputs], int], list[Outputs]]:
    def ref(all_inputs: list[Inputs], world: int) -> list[Outputs]:
        return _same(world, [torch.cat(_firsts(all_inputs), dim)])

    return ref


def _ref_stack(dim: int) -> Callable[[list[Inputs], int], list[Outputs]]:
    def ref(all_inputs: list[Inputs], world: int) -> list[Outputs]:
        return _same(world, [torch.stack(_firsts(all_inputs), dim)])

    return ref


# --------------------------------------------------------------------------- ragged ops
def _call_gather_dst0(x: Tensor, group: Any = None) -> Tensor | None:
    return funcoll.gather(x, 0, dst=0, group=group)


def _ref_gather_dst0(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    full = torch.cat(_firsts(all_inputs), 0)
    return [[full] if r == 0 else [None] for r in range(world)]


def _scatter_src0(rank: int, world: int) -> int:
    """Rank 0 (src) holds 2 world + 1 rows; the others their ragged length, which scatter does not use."""
    return 2 * world + 1 if rank == 0 else ragged_sizes(world)[rank]


def _ref_scatter_src0(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    return [[piece] for piece in torch.tensor_split(_firsts(all_inputs)[0], world, 0)]


def _scatter_given(rank: int, world: int) -> int:
    """The last rank (src) holds every rank's ragged length; the others nothing."""
    return sum(ragged_sizes(world)) if rank == world - 1 else 0


def _call_scatter_given(x: Tensor, group: Any = None) -> Tensor:
    world = funcoll.axis_size(group)
    return funcoll.scatter(x, world - 1, ragged_sizes(world), -1, group=group)


def _ref_scatter_given(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    return [[piece] for piece in _split(_firsts(all_inputs)[-1], ragged_sizes(world), -1)]


def _ref_all_gather_list(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    return _same(world, [x * 1 for x in _firsts(all_inputs)])


def _ref_all_gather_ragged(dim: int) -> Callable[[list[Inputs], int], list[Outputs]]:
    def ref(all_inputs: list[Inputs], world: int) -> list[Outputs]:
        xs = _firsts(all_inputs)
        sizes = torch.tensor([x.shape[dim] for x in xs], dtype=torch.int64)
        return _same(world, [torch.cat(xs, dim), sizes])

    return ref


def _call_all_to_all_v_exchanged(x: Tensor, group: Any = None) -> tuple[Tensor, Tensor]:
    rank, world = _rank_and_world(group)
    return funcoll.all_to_all_v(x, send_sizes(rank, world), group=group)


def _call_all_to_all_v_given(x: Tensor, group: Any = None) -> tuple[Tensor, Tensor]:
    rank, world = _rank_and_world(group)
    return funcoll.all_to_all_v(x, send_sizes(rank, world), recv_sizes(rank, world), group=group)


def _call_all_to_all_v_wire(x: Tensor, group: Any = None) -> tuple[Tensor, Tensor]:
    rank, world = _rank_and_world(group)
    return funcoll.all_to_all_v(x, send_sizes(rank, world), group=group, wire=funcoll.Wire(torch.int8))


def _ref_all_to_all_v(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    send = [send_sizes(i, world) for i in range(world)]
    blocks = [_split(x, send[i], 0) for i, x in enumerate(_firsts(all_inputs))]
    return [
        [
            torch.cat([blocks[i][r] for i in range(world)], 0),
            torch.tensor([send[i][r] for i in range(world)], dtype=torch.int64),
        ]
        for r in range(world)
    ]


# ------------------------------------------------------------------- static-shape ragged
PADDED_BOUND = 4  # >= every ragged_sizes() entry, so each rank's length fits


def _inputs_padded(case: str, dim: int, noncontig: bool = False) -> Callable[[int, int], Inputs]:
    """x of shape (3, 5) with the bound at `dim`, and this rank's length as a 0-d int64 tensor."""

    def build(rank: int, world: int) -> Inputs:
        shape = [3, 5]
        shape[dim] = PADDED_BOUND
        x = _randn((case, rank), shape, noncontig)
        return (x, torch.tensor(ragged_sizes(world)[rank], dtype=torch.int64))

    return build


def _ref_gather_padded(dim: int) -> Callable[[list[Inputs], int], list[Outputs]]:
    def ref(all_inputs: list[Inputs], world: int) -> list[Outputs]:
        lengths = [int(inp[1]) for inp in all_inputs]
        data = torch.cat([inp[0].narrow(dim, 0, n) for inp, n in zip(all_inputs, lengths, strict=True)], dim)
        pad = list(data.shape)
        pad[dim] = world * PADDED_BOUND - data.shape[dim]
        return _same(world, [torch.cat([data, data.new_zeros(pad)], dim), torch.tensor(lengths)])

    return ref


CAPACITY = 3  # all_to_all_padded: rows per destination block; send_sizes() stay below 4


def _inputs_a2a_padded(case: str) -> Callable[[int, int], Inputs]:
    """x of shape (world * CAPACITY, 5) and this rank's send sizes (0 to 3) as an int64 tensor."""

    def build(rank: int, world: int) -> Inputs:
        x = _randn((case, rank), (world * CAPACITY, 5))
        return (x, torch.tensor(send_sizes(rank, world), dtype=torch.int64))

    return build


def _ref_all_to_all_padded(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    out = []
    for j in range(world):
        counts = [int(all_inputs[i][1][j]) for i in range(world)]
        data = torch.cat([all_inputs[i][0][j * CAPACITY : j * CAPACITY + n] for i, n in enumerate(counts)])
        out.append(
            [torch.cat([data, data.new_zeros(world * CAPACITY - data.shape[0], 5)]), torch.tensor(counts)]
        )
    return out


# ------------------------------------------------------------------------------- compat
def _call_compat_all_gather(q: Tensor) -> list[Tensor]:
    return compat.all_gather(q, funcoll.axis_size(), q.device)


def _call_compat_agit_out_inside(x: Tensor, group: Any = None) -> Tensor:
    out = x.new_empty((funcoll.axis_size(group) * x.shape[0], *x.shape[1:]))
    compat.all_gather_into_tensor(out, x, group)
    return out


def _inputs_agit_out_buffer(rank: int, world: int) -> Inputs:
    out = torch.full((world, 3, 5), -1.0, dtype=torch.float64)  # stack layout, written in place
    return (out, _randn(("compat.all_gather_into_tensor-out-input", rank), (3, 5)))


def _call_compat_agit_out_input(out: Tensor, x: Tensor, group: Any = None) -> Tensor:
    compat.all_gather_into_tensor(out, x, group)
    return out.clone()


def _ref_agit_out_input(all_inputs: list[Inputs], world: int) -> list[Outputs]:
    stacked = torch.stack([inp[1] for inp in all_inputs], 0)
    return _same(world, [stacked, stacked])  # the returned clone, then the buffer itself


# ------------------------------------------------------------------------------- table
def _case(id: str, inputs: Callable[[int, int], Inputs] | None = None, **kw: Any) -> OpCase:
    return OpCase(id=id, inputs=inputs or _shaped(id, 3, 5), **kw)


def _twice(rank: int, world: int) -> int:
    return 2 * world


def _twice_plus_one(rank: int, world: int) -> int:
    return 2 * world + 1


CASES: list[OpCase] = [
    # even collectives
    _case(
        "all_gather-x3x5-dim0",
        call=lambda x, group=None: funcoll.all_gather(x, 0, group=group),
        reference=_ref_cat(0),
        at_scale=True,
    ),
    _case(
        "all_gather-x3x5-dim1-noncontig",
        _shaped("all_gather-x3x5-dim1-noncontig", 3, 5, noncontig=True),
        call=lambda x, group=None: funcoll.all_gather(x, 1, group=group),
        reference=_ref_cat(1),
    ),
    _case(
        "all_gather-untiled-x3x5-dim0",
        call=lambda x, group=None: funcoll.all_gather(x, 0, tiled=False, group=group),
        reference=_ref_stack(0),
    ),
    _case(
        "all_gather-untiled-x3x5-dim1",
        call=lambda x, group=None: funcoll.all_gather(x, 1, tiled=False, group=group),
        reference=_ref_stack(1),
        at_scale=True,
    ),
    _case(
        "all_gather_into_tensor-x3x5",
        call=lambda x, group=None: funcoll.all_gather_into_tensor(x, group=group),
        reference=_ref_stack(0),
    ),
    _case(
        "reduce_scatter-x2wx5-dim0",
        _shaped("reduce_scatter-x2wx5-dim0", _twice, 5),
        call=lambda x, group=None: funcoll.reduce_scatter(x, 0, group=group),
        reference=lambda xs, w: [[p] for p in torch.tensor_split(sum(_firsts(xs)), w, 0)],
        at_scale=True,
    ),
    _case(  # quantized: int8 codes and a scale per row travel in the one all_gather
        "all_gather-x3x5-dim0-wire-int8",
        _exact_in("int8", "all_gather-x3x5-dim0-wire-int8", 3, 5),
        call=lambda x, group=None: funcoll.all_gather(x, 0, wire=funcoll.Wire(torch.int8), group=group),
        reference=_ref_cat(0),
        at_scale=True,
    ),
    _case(  # quantized: the bf16 pieces travel by one all_to_all, each rank sums what it receives
        "reduce_scatter-x2wx5-dim0-wire-bf16",
        _exact_in("bf16", "reduce_scatter-x2wx5-dim0-wire-bf16", _twice, 5),
        variant="wire",
        call=lambda x, group=None: funcoll.reduce_scatter(
            x, 0, wire=funcoll.Wire(torch.bfloat16), group=group
        ),
        reference=lambda xs, w: [[p] for p in torch.tensor_split(sum(_firsts(xs)), w, 0)],
        at_scale=True,
    ),
    _case(
        "reduce_scatter-x3x2w-dim-1",
        _shaped("reduce_scatter-x3x2w-dim-1", 3, _twice),
        call=lambda x, group=None: funcoll.reduce_scatter(x, -1, group=group),
        reference=lambda xs, w: [[p] for p in torch.tensor_split(sum(_firsts(xs)), w, -1)],
    ),
    _case(
        "reduce_scatter-ragged-sizes-dim0",
        _shaped("reduce_scatter-ragged-sizes-dim0", lambda r, w: sum(ragged_sizes(w)), 5),
        variant="sizes",
        call=_call_reduce_scatter_ragged,
        reference=_ref_reduce_scatter_ragged,
        at_scale=True,  # the same `sizes` on every rank: nothing exchanged, one all_to_all
    ),
    _case(
        "all_reduce-x3x5",
        call=lambda x, group=None: funcoll.all_reduce(x, group=group),
        reference=lambda xs, w: _same(w, [sum(_firsts(xs))]),
        at_scale=True,
    ),
    _case(
        "all_to_all-x2x3x2wx5-scatter2-gather1",
        _shaped("all_to_all-x2x3x2wx5-scatter2-gather1", 2, 3, _twice, 5),
        call=lambda x, group=None: funcoll.all_to_all(x, group),
        reference=_ref_all_to_all(2, 1),
    ),
    _case(
        "all_to_all-x2w+1x3x5-uneven-scatter0-gather-1",
        _shaped("all_to_all-x2w+1x3x5-uneven-scatter0-gather-1", _twice_plus_one, 3, 5),
        call=lambda x, group=None: funcoll.all_to_all(x, group, 0, -1),
        reference=_ref_all_to_all(0, -1),
        at_scale=True,
    ),
    _case(
        # Ulysses' way back with a head count world does not divide: (B, S, H_r, D) -> (B, S_r, H, D)
        "all_to_all-x2x2w+1xH_rx3-uneven-heads-scatter1-gather2",
        _shaped("all_to_all-x2x2w+1xH_rx3-uneven-heads-scatter1-gather2", 2, _twice_plus_one, _heads, 3),
        call=_call_all_to_all_heads_back,
        reference=_ref_all_to_all(1, 2),
        at_scale=True,
    ),
    _case(
        "all_to_all-x2x3x2wx5-scatter2-gather1-wire-bf16",
        _exact_in("bf16", "all_to_all-x2x3x2wx5-scatter2-gather1-wire-bf16", 2, 3, _twice, 5),
        call=lambda x, group=None: funcoll.all_to_all(x, group, wire=funcoll.Wire(torch.bfloat16)),
        reference=_ref_all_to_all(2, 1),
    ),
    _case(
        # Ulysses' way back, heads uneven, each row of D in int8 (one scale a row)
        "all_to_all-x2x2w+1xH_rx3-uneven-heads-wire-int8",
        _exact_in("int8", "all_to_all-x2x2w+1xH_rx3-uneven-heads-wire-int8", 2, _twice_plus_one, _heads, 3),
        call=_call_all_to_all_heads_back_int8,
        reference=_ref_all_to_all(1, 2),
    ),
    _case("ppermute-ring-x3x5", call=_call_ppermute_ring, reference=_ref_ppermute(_ring), at_scale=True),
    _case(
        "ppermute-first-to-last-x3x5",
        call=_call_ppermute_partial,
        reference=_ref_ppermute(lambda w: [(0, w - 1)]),
        min_world=2,
    ),
    _case(
        "broadcast-src-last-x3x5",
        call=_call_broadcast_last,
        reference=lambda xs, w: _same(w, [xs[w - 1][0] * 1]),
        at_scale=True,
    ),
    _case("reduce-dst-last-x3x5", call=_call_reduce_last, reference=_ref_reduce_last, at_scale=True),
    _case(
        "axis_index-axis_size-x3x5",
        call=_call_axis,
        reference=lambda xs, w: [[x * r + w] for r, x in enumerate(_firsts(xs))],
    ),
    # region ops
    _case(
        "split_forward_gather_backward-x2w+1x5-dim0",
        _replicated("split_forward_gather_backward-x2w+1x5-dim0", _twice_plus_one, 5),
        call=lambda x, group=None: funcoll.split_forward_gather_backward(x, group, 0),
        reference=_ref_split(0),
        grad="replicated",
        at_scale=True,
    ),
    _case(
        "split_forward_gather_backward-x3x2w+1-dim-1-up",
        _replicated("split_forward_gather_backward-x3x2w+1-dim-1-up", 3, _twice_plus_one),
        call=lambda x, group=None: funcoll.split_forward_gather_backward(x, group, -1, grad_scale="up"),
        reference=_ref_split(-1),
        grad="replicated",
        grad_scale="up",
    ),
    _case(
        "gather_forward_split_backward-ragged-x_nx5-dim0",
        _shaped("gather_forward_split_backward-ragged-x_nx5-dim0", _ragged, 5),
        call=lambda x, group=None: funcoll.gather_forward_split_backward(x, group, 0),
        reference=_ref_cat(0),
        grad="own",
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "gather_forward_split_backward-ragged-x3x_n-dim-1-down",
        _shaped("gather_forward_split_backward-ragged-x3x_n-dim-1-down", 3, _ragged_alt),
        call=lambda x, group=None: funcoll.gather_forward_split_backward(x, group, -1, grad_scale="down"),
        reference=_ref_cat(-1),
        grad="own",
        grad_scale="down",
        exchanges_sizes=True,
    ),
    # ragged ops
    _case(
        "gather-auto-ragged-x_nx5-dim0",
        _shaped("gather-auto-ragged-x_nx5-dim0", _ragged, 5),
        call=lambda x, group=None: funcoll.gather(x, group=group),
        reference=_ref_cat(0),
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(  # quantized rows: each row's int8 codes and scale, by the "auto" strategy
        "gather-auto-ragged-wire-int8-x_nx5-dim0",
        _exact_in("int8", "gather-auto-ragged-wire-int8-x_nx5-dim0", _ragged, 5),
        call=lambda x, group=None: funcoll.gather(x, group=group, wire=funcoll.Wire(torch.int8)),
        reference=_ref_cat(0),
        exchanges_sizes=True,
    ),
    _case(
        "gather-given-ragged-x_nx5-dim0",
        _shaped("gather-given-ragged-x_nx5-dim0", _ragged, 5),
        variant="given",  # every rank's length passed in: no header, one collective fewer
        call=lambda x, group=None: funcoll.gather(
            x, group=group, sizes=ragged_sizes(funcoll.axis_size(group))
        ),
        reference=_ref_cat(0),
    ),
    _case(
        "gather-auto-ragged-x3x_n-dim-1-noncontig",
        _shaped("gather-auto-ragged-x3x_n-dim-1-noncontig", 3, _ragged_alt, noncontig=True),
        call=lambda x, group=None: funcoll.gather(x, -1, group=group),
        reference=_ref_cat(-1),
        exchanges_sizes=True,
    ),
    _case(
        "gather-pad-ragged-x_nx5-dim0",
        _shaped("gather-pad-ragged-x_nx5-dim0", _ragged, 5),
        variant="pad",
        call=lambda x, group=None: funcoll.gather(x, strategy="pad", group=group),
        reference=_ref_cat(0),
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "gather-shift-ragged-x_nx5-dim0",
        _shaped("gather-shift-ragged-x_nx5-dim0", _ragged_alt, 5),
        variant="shift",
        call=lambda x, group=None: funcoll.gather(x, strategy="shift", group=group),
        reference=_ref_cat(0),
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "gather-dst0-ragged-x_nx5-dim0-nograd",
        _shaped("gather-dst0-ragged-x_nx5-dim0-nograd", _ragged, 5),
        variant="dst",
        call=_call_gather_dst0,
        reference=_ref_gather_dst0,
        grad="none",
        grad_inputs=(),
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "scatter-src0-ragged-x_nx5-dim0",
        _shaped("scatter-src0-ragged-x_nx5-dim0", _scatter_src0, 5),
        call=lambda x, group=None: funcoll.scatter(x, 0, group=group),
        reference=_ref_scatter_src0,
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "scatter-given-x3x_n-dim-1",
        _shaped("scatter-given-x3x_n-dim-1", 3, _scatter_given),
        variant="given",  # the sizes passed on every rank: no header, one all_to_all
        call=_call_scatter_given,
        reference=_ref_scatter_given,
        at_scale=True,
    ),
    _case(
        "all_gather_list-ragged-x_nx5-dim0",
        _shaped("all_gather_list-ragged-x_nx5-dim0", _ragged, 5),
        call=lambda x, group=None: funcoll.all_gather_list(x, group=group),
        reference=_ref_all_gather_list,
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "all_gather_ragged-ragged-x3x_n-dim1",
        _shaped("all_gather_ragged-ragged-x3x_n-dim1", 3, _ragged_alt),
        call=lambda x, group=None: funcoll.all_gather_ragged(x, 1, group=group),
        reference=_ref_all_gather_ragged(1),
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "all_to_all_v-recv-exchanged-x_nx5",
        _shaped("all_to_all_v-recv-exchanged-x_nx5", _send_total, 5),
        call=_call_all_to_all_v_exchanged,
        reference=_ref_all_to_all_v,
        exchanges_sizes=True,
        at_scale=True,
    ),
    _case(
        "all_to_all_v-recv-given-x_nx5",
        _shaped("all_to_all_v-recv-given-x_nx5", _send_total, 5),
        variant="given",
        call=_call_all_to_all_v_given,
        reference=_ref_all_to_all_v,
        at_scale=True,
    ),
    _case(  # quantized rows: each row's int8 codes and scale, the splits in rows
        "all_to_all_v-recv-exchanged-wire-int8-x_nx5",
        _exact_in("int8", "all_to_all_v-recv-exchanged-wire-int8-x_nx5", _send_total, 5),
        call=_call_all_to_all_v_wire,
        reference=_ref_all_to_all_v,
        exchanges_sizes=True,
    ),
    _case(
        "gather_padded-x4x5-dim0",
        _inputs_padded("gather_padded-x4x5-dim0", 0),
        call=lambda x, n, group=None: funcoll.gather_padded(x, n, group=group),
        reference=_ref_gather_padded(0),
        at_scale=True,
    ),
    _case(
        "gather_padded-x3x4-dim-1-noncontig",
        _inputs_padded("gather_padded-x3x4-dim-1-noncontig", -1, noncontig=True),
        call=lambda x, n, group=None: funcoll.gather_padded(x, n, -1, group=group),
        reference=_ref_gather_padded(-1),
    ),
    _case(
        "all_to_all_padded-xw3x5-dim0",
        _inputs_a2a_padded("all_to_all_padded-xw3x5-dim0"),
        call=lambda x, n, group=None: funcoll.all_to_all_padded(x, n, group=group),
        reference=_ref_all_to_all_padded,
        at_scale=True,
    ),
    # compat (the seed helpers' signatures)
    _case(
        "compat.gather-ragged-x_nx5-dim0",
        _shaped("compat.gather-ragged-x_nx5-dim0", _ragged, 5),
        call=lambda t: compat.gather(t),
        takes_group=False,
        reference=_ref_cat(0),
        exchanges_sizes=True,
        min_world=2,  # on one rank compat.gather returns its input itself, as the original
    ),
    _case(
        "compat.all_gather-ragged-1d",
        _shaped("compat.all_gather-ragged-1d", _ragged_alt),
        op="gather",
        call=_call_compat_all_gather,
        takes_group=False,
        reference=_ref_all_gather_list,
        exchanges_sizes=True,
    ),
    _case(
        "compat.all_gather_nd-ragged-x_nx2x3",
        _shaped("compat.all_gather_nd-ragged-x_nx2x3", _ragged, 2, 3),
        op="gather",
        call=compat.all_gather_nd,
        takes_group=False,
        reference=_ref_all_gather_list,
        exchanges_sizes=True,
    ),
    _case(
        "compat.all_to_all-x2x3x2wx5",
        _shaped("compat.all_to_all-x2x3x2wx5", 2, 3, _twice, 5),
        call=lambda t, group=None: compat.all_to_all(t, group),
        reference=_ref_all_to_all(2, 1),
    ),
    _case(
        "compat.split_forward_gather_backward-x2w+1x5-dim0",
        _replicated("compat.split_forward_gather_backward-x2w+1x5-dim0", _twice_plus_one, 5),
        call=lambda t, group=None: compat.split_forward_gather_backward(t, group, 0),
        reference=_ref_split(0),
        grad="replicated",
    ),
    _case(
        "compat.gather_forward_split_backward-ragged-x_nx5-dim0",
        _shaped("compat.gather_forward_split_backward-ragged-x_nx5-dim0", _ragged, 5),
        call=lambda t, group=None: compat.gather_forward_split_backward(t, group, 0),
        reference=_ref_cat(0),
        grad="own",
        exchanges_sizes=True,
    ),
    _case(
        "compat.all_gather_into_tensor-x3x5-out-allocated-inside",
        call=_call_compat_agit_out_inside,
        reference=_ref_cat(0),
    ),
    _case(
        "compat.all_gather_into_tensor-x3x5-out-buffer-input",
        _inputs_agit_out_buffer,
        call=_call_compat_agit_out_input,
        reference=_ref_agit_out_input,
        grad="none",
        grad_inputs=(),
        writes_input=0,
    ),
]

CASES_BY_ID: dict[str, OpCase] = {c.id: c for c in CASES}
assert len(CASES_BY_ID) == len(CASES), "case ids must be unique"

# Case id -> the funcoll bug it shows. The compile tests mark such a case
# xfail(strict=True) and run it on real ranks in a run_ranks call of its own (a rank
# that fails alone can leave the others waiting in a collective until the timeout);
# delete the entry once the bug is fixed.
# The release matrix (.ci/matrix.py) sets FUNCOLL_SMOKE=1: the compile test files keep
# every case and every group form but compile fewer variants of each, so that one
# torch release's smoke run takes minutes (test_fullgraph: 2 ranks, dynamic=None, no
# explain, inductor at dynamic=None; test_group_forms: SMOKE_GROUP_CASES under every form).
SMOKE = os.environ.get("FUNCOLL_SMOKE") == "1"
# An even collective, a ragged one (size header, host read, data collective) and an
# uneven all_to_all: the three ways a group reaches a collective's arguments.
SMOKE_GROUP_CASES = (
    "all_gather-x3x5-dim0",
    "gather-auto-ragged-x_nx5-dim0",
    "all_to_all-x2x2w+1xH_rx3-uneven-heads-scatter1-gather2",
)
KNOWN_BUGS: dict[str, str] = {}  # case id -> reason, for open funcoll bugs (none now)


# ------------------------------------------------------------------------------ running
def _leaves(case: OpCase, inputs: Inputs) -> Inputs:
    return tuple(
        t.detach().requires_grad_(i in case.grad_inputs) if case.grad != "none" else t.clone()
        for i, t in enumerate(inputs)
    )


def _loss(case_id: str, rank: int, outputs: Outputs) -> Tensor | None:
    terms = [
        (out * w).sum()
        for out, w in zip(outputs, loss_weights(case_id, rank, outputs), strict=True)
        if w is not None and out is not None and out.requires_grad
    ]
    return torch.stack(terms).sum() if terms else None


def run_case(case: OpCase, rank: int, world: int, fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Run `fn` (default: ``case.call``, eagerly) on this rank's inputs, then the backward.

    Returns ``{"outputs": [...], "grads": [...]}`` (detached, grads None where an
    input needs none), or ``{"error": traceback}`` if anything raised.
    """
    try:
        inputs = _leaves(case, case.inputs(rank, world))
        outputs = flatten((case.call if fn is None else fn)(*inputs))
        loss = _loss(case.id, rank, outputs) if case.grad != "none" else None
        if loss is not None:
            loss.backward()
        if case.writes_input is not None:
            outputs.append(inputs[case.writes_input])
        return settled(
            {
                "outputs": [None if o is None else o.detach().clone() for o in outputs],
                "grads": [inputs[i].grad for i in case.grad_inputs],
            }
        )
    except Exception:  # noqa: BLE001 -- any failure is a result the test reports
        return {"error": traceback.format_exc(limit=-8)}


def has_error(result: dict[Any, Any]) -> bool:
    """Whether any step recorded in `result` (a dict of :func:`run_case` results) raised."""
    return any(isinstance(v, dict) and "error" in v for v in result.values())


def reference_grads(case: OpCase, world: int) -> list[list[Tensor]]:
    """Every rank's expected input gradients (in ``case.grad_inputs`` order), from torch.autograd."""
    all_inputs = [case.inputs(r, world) for r in range(world)]
    factor = case.grad_factor(world)

    def rank_loss(outputs: list[Outputs], r: int) -> Tensor:
        loss = torch.zeros((), dtype=torch.float64)
        for out, w in zip(outputs[r], loss_weights(case.id, r, outputs[r]), strict=True):
            if w is not None and out is not None:
                loss = loss + (out * w).sum()
        return loss

    def grads_of(loss: Tensor, leaves: Sequence[Tensor]) -> list[Tensor]:
        got = torch.autograd.grad(loss, list(leaves), allow_unused=True)
        return [torch.zeros_like(t) if g is None else g * factor for g, t in zip(got, leaves, strict=True)]

    if case.grad == "replicated":
        shared = all_inputs[0][0].detach().requires_grad_()
        outputs = case.reference([(shared,)] * world, world)
        g = grads_of(torch.stack([rank_loss(outputs, r) for r in range(world)]).sum(), [shared])
        return [g for _ in range(world)]
    leaves = [
        tuple(t.detach().requires_grad_(i in case.grad_inputs) for i, t in enumerate(inp))
        for inp in all_inputs
    ]
    if case.grad == "own":
        outputs = case.reference(leaves, world)
        return [
            grads_of(rank_loss(outputs, r), [leaves[r][i] for i in case.grad_inputs]) for r in range(world)
        ]
    outputs = case.reference(leaves, world)
    total = torch.stack([rank_loss(outputs, r) for r in range(world)]).sum()
    flat = [leaves[r][i] for r in range(world) for i in case.grad_inputs]
    g = grads_of(total, flat)
    n = len(case.grad_inputs)
    return [g[r * n : (r + 1) * n] for r in range(world)]


def reference_outputs(case: OpCase, world: int) -> list[Outputs]:
    """Every rank's expected outputs (detached)."""
    outs = case.reference([case.inputs(r, world) for r in range(world)], world)
    return [[None if o is None else o.detach() for o in rank_out] for rank_out in outs]


# ------------------------------------------------------------------------ captured graphs
def _simplify(arg: object) -> object:
    """A graph argument as plain data: nodes by name, symbolic ints as strings."""
    if isinstance(arg, torch.fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        return [_simplify(a) for a in arg]
    if isinstance(arg, (int, float, str, bool)) or arg is None:
        return arg
    return str(arg)


def _target_name(target: object) -> tuple[str, bool]:
    """(qualified name, whether it mutates an argument) of a call_function target."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}", target._schema.is_mutable
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', str(target))}", False


def summarize_graph(graph: torch.fx.Graph) -> list[dict[str, Any]]:
    """Every call_function node as ``{"op", "mutates", "args", "out_shape"}`` (picklable, for run_ranks).

    ``out_shape`` is the traced output's shape (symbolic sizes as strings), or None
    when the node's output is not a tensor.
    """
    calls = []
    for node in graph.nodes:
        if node.op == "call_function":
            name, mutates = _target_name(node.target)
            val = node.meta.get("val")
            shape = _simplify(list(val.shape)) if isinstance(val, Tensor) else None
            calls.append(
                {"op": name, "mutates": mutates, "args": _simplify(list(node.args)), "out_shape": shape}
            )
    return calls


COLLECTIVE_PREFIX = "_c10d_functional."


class _Traced(Exception):
    """Raised by a graph compiled by :func:`trace_graphs`: the graphs are recorded, nothing runs."""


def recording_backend(
    graphs: dict[str, Any], run: bool = True, collectives: list[list[Collective]] | None = None
) -> Any:
    """aot_autograd with the partitioner aot_eager and inductor use; records the graphs in `graphs`.

    `collectives`, when given, receives each graph's :class:`funcoll.testing.Collective`
    list (forward, then backward) for :func:`funcoll.testing.collective_mismatch`.

    The min-cut partitioner matters: it may move backward nodes that do not depend
    on the gradient into the forward, collectives included. With `run` the
    compiled graphs then run as aot_eager's would (its settings); without, calling
    them raises ``_Traced`` (:func:`trace_graphs`: traced, never run). A function
    compiled again (another shape) records its latest graphs over the earlier ones.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    collectives = [] if collectives is None else collectives

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        graphs["fw"], graphs["bw"] = summarize_graph(fw.graph), summarize_graph(bw.graph)
        collectives[:] = [graph_collectives(fw), graph_collectives(bw)]
        return fw, bw

    def stop(*args: Any) -> Any:
        raise _Traced

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return gm.forward if run else stop

    def inference(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:  # no gradient: not partitioned
        graphs.clear()
        graphs["fw"] = summarize_graph(gm.graph)
        collectives[:] = [graph_collectives(gm)]
        return compiler(gm, example_inputs)

    return aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        inference_compiler=inference,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


def trace_graphs(case: OpCase, rank: int, world: int, backward: bool = True) -> dict[str, Any]:
    """Trace ``case.call`` on this rank's inputs into AOT forward/backward graphs, without running them.

    Returns ``{"graphs": {"fw": calls, "bw": calls}, "collectives": [fw, bw],
    "seconds": trace time}`` (``bw`` only when an input requires grad, calls as
    :func:`summarize_graph` gives them, collectives as :func:`graph_collectives`),
    or ``{"error": traceback}``. Nothing executes, so it is safe on the fake process
    group, and no rank can be left waiting in a collective.
    """
    graphs: dict[str, Any] = {}
    collectives: list[list[Collective]] = []
    wants_grad = backward and case.grad != "none"
    inputs = tuple(
        t.requires_grad_(wants_grad and i in case.grad_inputs) for i, t in enumerate(case.inputs(rank, world))
    )
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        backend = recording_backend(graphs, run=False, collectives=collectives)
        torch.compile(case.call, fullgraph=True, backend=backend)(*inputs)
        return {"error": "the compiled function ran instead of stopping after the trace"}
    except _Traced:
        return {"graphs": graphs, "collectives": collectives, "seconds": time.perf_counter() - start}
    except Exception:  # noqa: BLE001 -- a failed trace is a result the test reports
        return {"error": traceback.format_exc(limit=-8)}
    finally:
        torch._dynamo.reset()


def collective_counts(calls: list[dict[str, Any]]) -> dict[str, int]:
    """How many of each ``_c10d_functional`` op (wait_tensor included) a summarized graph holds."""
    counts: dict[str, int] = {}
    for call in calls:
        if call["op"].startswith(COLLECTIVE_PREFIX):
            short = call["op"][len(COLLECTIVE_PREFIX) :]
            counts[short] = counts.get(short, 0) + 1
    return counts


def forbidden_calls(calls: list[dict[str, Any]]) -> list[str]:
    """Calls a funcoll graph must not hold: in-place/out collectives and torch.distributed functions."""
    bad = []
    for call in calls:
        op = call["op"]
        in_place_collective = call["mutates"] and ("c10d" in op.split(".")[0])
        legacy = op.split(".")[0] in ("c10d", "c10d_functional")
        if in_place_collective or legacy or op.startswith("torch.distributed"):
            bad.append(op)
    return bad


# ------------------------------------------------------------------ expected collectives
# The collectives of each case at `world` ranks, (forward, backward), are what the
# op's spec declares (funcoll/_ops/_spec.py: its `collectives`); backward None when no
# input requires grad.
AG, RS, AR, A2A, BC = _spec.AG, _spec.RS, _spec.AR, _spec.A2A, _spec.BC
WAIT = "wait_tensor"


def expected_collectives(case_id: str, world: int) -> tuple[dict[str, int], dict[str, int] | None]:
    """The collectives (forward, backward) of a case at `world` ranks, from its op's spec."""
    case = CASES_BY_ID[case_id]
    fw, bw = _spec.spec(case.spec_name).plan(world, case.variant)
    return fw, (None if case.grad == "none" else bw)


EXPECTED_AT_2 = {c.id: expected_collectives(c.id, 2) for c in CASES}


# ---------------------------------------------------------------------------------- MoE
def moe_step(mode: str, capacity: int | None, e_local: int = 2) -> Callable[[Tensor, Tensor], Tensor]:
    """A compiled-test MoE layer: dispatch, local expert e scales its rows by 1 + e, combine by (0.5, 0.25).

    `capacity` goes to static mode (None: exact). Top-2 routing; the reference is
    ``x * sum_j weight_j * (1 + expert_j % e_local)`` per token (dropped pairs add 0).
    """

    def step(x: Tensor, idx: Tensor) -> Tensor:
        n_experts = e_local * funcoll.axis_size(None)
        recv, h = funcoll.moe.dispatch(x, idx, n_experts, mode=mode, capacity=capacity)
        rows = torch.arange(recv.shape[0], device=recv.device)
        local = (torch.searchsorted(h.offsets, rows, right=True) - 1).clamp(min=0)
        y = recv * (1 + local).unsqueeze(1).to(recv.dtype)  # local expert e scales its rows by 1 + e
        return funcoll.moe.combine(y, h, torch.tensor([0.5, 0.25], dtype=x.dtype).expand(x.shape[0], 2))

    return step


# ------------------------------------------------------------------------------ batches
STOPPED = "__stopped__"  # key of a rank's results when its batch stopped early
IN_STEP_TIMEOUT_S = 60.0


def _save(obj: object, path: str) -> None:
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic: a rank killed mid-write leaves the last complete file


def _batch_worker(
    rank: int,
    world: int,
    save_dir: str,
    one_case: Callable[..., dict[Any, Any]],
    case_ids: list[str],
    args: tuple[Any, ...],
) -> dict[str, Any]:
    """Run ``one_case(rank, world, case_id, *args)`` for every case, in step with the other ranks.

    Results are saved after every case, so they survive a rank that has to stop. A
    case that raised on this rank may have left another rank waiting inside a
    collective, where only this process's exit (closing its connections) releases
    it; so after an error this rank waits for every rank to finish the case, through
    a file store rather than a collective, and stops if one does not.
    """
    store = dist.FileStore(os.path.join(save_dir, "in_step_store"), world)
    path = os.path.join(save_dir, f"rank{rank}.pt")
    out: dict[str, Any] = {}
    for cid in case_ids:
        out[cid] = one_case(rank, world, cid, *args)
        _save(out, path)
        store.set(f"{cid}/{rank}", "done")
        if has_error(out[cid]):
            try:
                store.wait([f"{cid}/{r}" for r in range(world)], timedelta(seconds=IN_STEP_TIMEOUT_S))
            except Exception as e:  # a rank is stuck in a collective of this case
                raise RuntimeError(
                    f"rank {rank}: stopping after case {cid!r}: another rank did not finish it"
                ) from e
    return out


class Batch:
    """A batch of cases started on its ranks (:func:`start_batch`); :meth:`results` waits for them."""

    def __init__(self, ranks: Ranks, save_dir: str) -> None:
        self._ranks, self._save_dir = ranks, save_dir
        self._done: list[dict[str, Any]] | None = None

    def results(self) -> list[dict[str, Any]]:
        """One results dict per rank; a batch that stopped early is as :func:`run_batch` says."""
        if self._done is None:
            try:
                self._done = self._ranks.results()
            except (RankError, TimeoutError) as e:
                self._done = []
                for r in range(self._ranks.world):
                    path = os.path.join(self._save_dir, f"rank{r}.pt")
                    saved = torch.load(path, weights_only=False) if os.path.exists(path) else {}
                    saved[STOPPED] = f"{type(e).__name__}: {e}"
                    self._done.append(saved)
            finally:
                shutil.rmtree(self._save_dir, ignore_errors=True)
        return self._done


def start_batch(
    one_case: Callable[..., dict[Any, Any]], world: int, case_ids: Sequence[str], *args: Any, timeout: float
) -> Batch:
    """:func:`run_batch` without the wait: batches of several worlds run side by side.

    Ranks that wait in a collective while a peer compiles leave a core idle; another
    world's batch, started beside, takes it (funcoll.testing.start_ranks).
    """
    save_dir = tempfile.mkdtemp(prefix="funcoll_batch_")
    ranks = start_ranks(_batch_worker, world, save_dir, one_case, list(case_ids), args, timeout=timeout)
    return Batch(ranks, save_dir)


def run_batch(
    one_case: Callable[..., dict[Any, Any]], world: int, case_ids: Sequence[str], *args: Any, timeout: float
) -> list[dict[str, Any]]:
    """Run cases on `world` gloo ranks in one ``run_ranks`` call; one results dict per rank.

    ``one_case(rank, world, case_id, *args)`` must return a dict whose failing steps
    are ``{"error": traceback}`` dicts (as :func:`run_case` returns them). If the
    batch stops early (a rank raised, died or hung) each rank's dict holds the
    cases finished before, plus ``results[STOPPED]``: why it stopped.
    """
    return start_batch(one_case, world, case_ids, *args, timeout=timeout).results()
