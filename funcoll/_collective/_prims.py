"""The differentiable primitives: each an autograd.Function around ``_c10d_functional`` ops.

Every public op is a composition of differentiable aten ops (narrow, cat, movedim,
pad) and the primitives below, so its backward is assembled by autograd from the
primitives' adjoints:

======================  ==================================================
primitive               backward (its adjoint)
======================  ==================================================
``all_gather_p``        ``reduce_scatter_p`` (sum) of the gradient
``reduce_scatter_p``    ``all_gather_p`` of the gradient (sum; avg divides)
``all_reduce_p``        ``all_reduce_p`` (sum) of the gradient (JAX ``psum``)
``all_to_all_p``        ``all_to_all_p`` with send and receive splits swapped
``broadcast_p``         ``reduce_p`` (sum) of the gradient onto ``src``
``reduce_p``            ``broadcast_p`` of ``dst``'s gradient (avg divides)
``replicate_p``         the gradient as it is (avg: divided by world)
``all_gather_v_p``      ``reduce_scatter_v_p`` of the gradient
``reduce_scatter_v_p``  ``gather_rows`` (``"auto"``) of the gradient
======================  ==================================================

Primitives end in ``_p`` (JAX's ``psum_p`` beside ``psum``), so that no name here
is also a public op's. Their arguments: `group_name` the c10d group name, `world`
the group's size, `rank` this process's rank in it, `reduce_op` the reduction.

``gather_rows`` and ``gather_pieces`` run a ragged all-gather with the strategy
``_strategy.py`` chooses, from these primitives and the row moves of
``_rows.py`` (pad before a padded all_gather, cut after it).

All of them work on dim 0 of contiguous tensors; the public ops move the user's
dim to the front and back. The forward of each runs with grad disabled, so only
funcoll's own backward is ever used, whatever autograd the installed torch
registers on the ``_c10d_functional`` ops. Nothing here stores a ProcessGroup on
a ctx: only the group's name, world size and rank, which are plain Python values.

Each primitive has torch's two-part form, a ``forward`` without ctx and a
``setup_context(ctx, inputs, output)`` that fills the ctx from the inputs (and
names the running op for the backward's failures), which torch's function
transforms (``torch.func.grad``, ``vjp``) require of an autograd.Function: with
the classic ``forward(ctx, ...)`` they refuse it. Everything a backward reads is
the inputs' or the output's, so the two forms run the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._base._checks import IntLike
from .._base._config import checks_enabled
from .._base._group import rank_of, size_of, wire_name
from .._base._strategy import all_equal, common_rows, resolve
from .._base._sym import Stats, max_of
from . import _faults, _fingerprint, _issue
from ._async import Pending
from ._header import check_collective
from ._phase import Primitive
from ._rows import cut_padding, pad_rows

_F = torch.ops._c10d_functional


def _run(
    collective: str,
    group_name: str,
    x: Tensor,
    issue: Callable[[Tensor, str], Tensor],
    step: str = "",
    *,
    defer: bool = True,
    splits: tuple[Sequence[IntLike], Sequence[IntLike]] | None = None,
    reduce_op: str | None = None,
    root: int | None = None,
) -> Tensor:
    """Issue one collective through :func:`funcoll._collective._issue.run`, checked first under checks.

    `x` is the payload (contiguous) and ``issue(x, group)`` issues the collective;
    `splits` are an all_to_all's (send, receive) sizes. With ``funcoll.set_checks(True)``
    every data collective (not the size exchanges, ``defer=False``) first exchanges
    a header saying what it is (:func:`funcoll._collective._header.check_collective`), so that
    ranks whose next collectives differ raise the same ``ValueError`` instead of
    pairing them. In a compiled graph the check and the collective run under the
    one group name :func:`funcoll._base._group.wire_name` gives this collective.
    On an eager call that the default setting leaves unchecked
    (:func:`funcoll._collective._faults.unchecked`) the payload carries a fingerprint
    (:mod:`funcoll._collective._fingerprint`; `reduce_op` is a reduction's op, `root` a
    broadcast's src).
    """
    wire = wire_name(group_name) if torch.compiler.is_compiling() else None
    if defer and checks_enabled():
        x = check_collective(collective, wire or group_name, x, splits)
    call = _faults.unchecked() if defer and wire is None else None
    if call is not None:  # a default, unchecked eager call: fingerprinted
        world, rank = size_of(group_name), rank_of(group_name)
        sent = _fingerprint.pack(collective, group_name, x, issue, call, world, rank, splits, reduce_op, root)
        if sent is not None and sent.ahead:  # exchanged and checked first (ValueError), then the data as is
            sent.complete(_issue.run(collective, group_name, sent.payload, sent.issue, step, defer=False))
        elif sent is not None:
            return _issue.run(collective, group_name, sent.payload, sent.issue, step, sent=sent)
    return _issue.run(collective, group_name, x, issue, step, defer=defer, wire=wire)


def ctx_ints(sizes: Sequence[IntLike]) -> list[IntLike]:
    # Dynamo (2.13) fails with "Argument ... does not belong to this Graph" when a
    # SymInt that is a graph input is stored on an autograd ctx as is; `s + 0` is a
    # fresh SymInt of the same value that it handles. Plain ints pass through.
    return [s + 0 if isinstance(s, torch.SymInt) else int(s) for s in sizes]


# --------------------------------------------------------------------------- all_gather_p
def all_gather_impl(x: Tensor, group_name: str, world: int, step: str = "", *, defer: bool = True) -> Tensor:
    return _run(
        "all_gather", group_name, x.contiguous(), lambda t, g: _F.all_gather_into_tensor(t, world, g), step,
        defer=defer,
    )  # fmt: skip


class _AllGather(Primitive):
    @staticmethod
    def forward(x: Tensor, group_name: str, world: int) -> Tensor:
        return all_gather_impl(x, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.group_name, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return reduce_scatter_p(grad, "sum", ctx.group_name, ctx.world), None, None


def all_gather_p(x: Tensor, group_name: str, world: int) -> Tensor:
    """Concatenate every rank's `x` along dim 0: ``(n, *R) -> (world * n, *R)``."""
    return _AllGather.apply(x, group_name, world)


class _AllGatherInvariant(Primitive):
    @staticmethod
    def forward(x: Tensor, group_name: str, world: int, rank: int) -> Tensor:
        return all_gather_impl(x, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        x, _, _, rank = inputs
        ctx.start, ctx.len = ctx_ints([rank * x.shape[0], x.shape[0]])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad.narrow(0, ctx.start, ctx.len).contiguous(), None, None, None


def all_gather_invariant_p(x: Tensor, group_name: str, world: int, rank: int) -> Tensor:
    """:func:`all_gather_p` whose backward keeps this rank's rows of the gradient: no communication.

    The transpose of an all_gather whose result every rank then uses alike (JAX's
    ``all_gather(..., to="invarying")``): each rank's cotangent is already the whole
    one, so its slice is the input's, where :func:`all_gather_p` sums the slices.
    """
    return _AllGatherInvariant.apply(x, group_name, world, rank)


# ----------------------------------------------------------------------- reduce_scatter_p
def _avg_as_sum(
    collective: str, group_name: str, x: Tensor, reduce_op: str, world: int, issue: Any
) -> Tensor:
    """Run a reducing collective on `x`; avg runs as sum / world (not every backend has avg)."""
    o = "sum" if reduce_op == "avg" else reduce_op
    y = _run(collective, group_name, x.contiguous(), lambda t, g: issue(t, o, g), reduce_op=o)
    return y / world if reduce_op == "avg" else y


def reduce_scatter_impl(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
    return _avg_as_sum(
        "reduce_scatter",
        group_name,
        x,
        reduce_op,
        world,
        lambda t, o, g: _F.reduce_scatter_tensor(t, o, world, g),
    )


class _ReduceScatter(Primitive):
    @staticmethod
    def forward(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
        return reduce_scatter_impl(x, reduce_op, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.reduce_op, ctx.group_name, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = all_gather_p(differentiable("reduce_scatter", ctx.reduce_op, grad), ctx.group_name, ctx.world)
        return scale_for_op(ctx.reduce_op, g, ctx.world), None, None, None


def reduce_scatter_p(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
    """Reduce over ranks, keep this rank's 1/world of dim 0: ``(world * n, *R) -> (n, *R)``."""
    return _ReduceScatter.apply(x, reduce_op, group_name, world)


def scale_for_op(reduce_op: str, g: Tensor, world: int) -> Tensor:
    """The gradient `g` of a reduction over `world` ranks scaled for `reduce_op`: avg divided, else as is.

    A backward calls :func:`differentiable` on its incoming gradient first: any
    `reduce_op` other than sum and avg has raised there (eager) or raises when
    the compiled backward runs, before this value is used.
    """
    return g / world if reduce_op == "avg" else g


def differentiable(key: str, reduce_op: str | None, grad: Tensor) -> Tensor:
    """`grad`, if a reduction by `reduce_op` has a gradient (sum, avg; None: a broadcast); else it raises.

    A backward calls it on its incoming gradient before it communicates, so that
    max, min and product (JAX's ``pmax`` has no gradient either) raise the same
    ``NotImplementedError`` on every rank, with nothing sent. Eager it raises here.
    While compiling, raising would fail the trace of the forward (dynamo traces the
    backward with it), where eager code runs the forward and raises only when the
    backward runs: the gradient passes through ``funcoll::no_gradient`` instead,
    which raises the same error when the compiled backward runs it.
    """
    if reduce_op in (None, "sum", "avg"):
        return grad
    if torch.compiler.is_compiling():
        return torch.ops.funcoll.no_gradient(grad, key, reduce_op)
    raise NotImplementedError(
        f"funcoll.{key}: no gradient for op={reduce_op!r}; only 'sum' and 'avg' are differentiable"
    )


@torch.library.custom_op("funcoll::no_gradient", mutates_args=())
def _no_gradient(grad: Tensor, key: str, reduce_op: str) -> Tensor:
    return differentiable(key, reduce_op, grad).clone()  # run by the compiled backward: raises


@_no_gradient.register_fake
def _no_gradient_fake(grad: Tensor, key: str, reduce_op: str) -> Tensor:
    return torch.empty_like(grad)


torch.fx.node.has_side_effect(torch.ops.funcoll.no_gradient.default)  # it raises: never dead code


# ---------------------------------------------------------------------------- all_reduce
def _all_reduce_impl(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
    return _avg_as_sum("all_reduce", group_name, x, reduce_op, world, lambda t, o, g: _F.all_reduce(t, o, g))


class _AllReduce(Primitive):
    @staticmethod
    def forward(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
        return _all_reduce_impl(x, reduce_op, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.reduce_op, ctx.group_name, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = all_reduce_p(differentiable("all_reduce", ctx.reduce_op, grad), "sum", ctx.group_name, ctx.world)
        return scale_for_op(ctx.reduce_op, g, ctx.world), None, None, None


def all_reduce_p(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
    return _AllReduce.apply(x, reduce_op, group_name, world)


class _PsumInvariant(Primitive):
    @staticmethod
    def forward(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
        return _all_reduce_impl(x, reduce_op, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.reduce_op, _, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = differentiable("all_reduce", ctx.reduce_op, grad)
        return scale_for_op(ctx.reduce_op, g, ctx.world), None, None, None


def psum_invariant_p(x: Tensor, reduce_op: str, group_name: str, world: int) -> Tensor:
    """:func:`all_reduce_p` whose result every rank holds alike (JAX's psum with ``check_vma=True``).

    Its transpose is JAX's ``pvary``, which moves nothing: the gradient of an
    invariant result is the same on every rank already, so the backward has no
    collective (``all_reduce_p``'s sums the gradient again).
    """
    return _PsumInvariant.apply(x, reduce_op, group_name, world)


class _Pvary(Primitive):
    @staticmethod
    def forward(x: Tensor, group_name: str, world: int) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.group_name, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # JAX's transpose of pvary: a psum whose result is invariant, so its own transpose (a
        # gradient of this gradient) is pvary again, which moves nothing, not a second psum.
        return psum_invariant_p(grad.contiguous(), "sum", ctx.group_name, ctx.world), None, None


def pvary_p(x: Tensor, group_name: str, world: int) -> Tensor:
    """`x` as a value that varies over the group (JAX's ``pvary``): a view; the backward psums the gradient.

    The transpose of JAX's cast from invariant to varying: the ranks' gradients of
    the varying value differ, and the invariant one's is their sum.
    """
    return _Pvary.apply(x, group_name, world)


# ----------------------------------------------------------------------- all_to_all_p
def all_to_all_impl(x: Tensor, recv: list[IntLike], send: list[IntLike], group_name: str) -> Tensor:
    """all_to_all_single of `x`'s dim-0 rows, waited for.

    Complex rows travel as their pairs of reals: gloo has no complex all_to_all.
    """
    if x.is_complex():
        return torch.view_as_complex(all_to_all_impl(torch.view_as_real(x), recv, send, group_name))
    return _run(
        "all_to_all", group_name, x.contiguous(), lambda t, g: _F.all_to_all_single(t, recv, send, g),
        splits=(send, recv),
    )  # fmt: skip


class _AllToAll(Primitive):
    @staticmethod
    def forward(x: Tensor, recv: list[IntLike], send: list[IntLike], group_name: str) -> Tensor:
        return all_to_all_impl(x, recv, send, group_name)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, recv, send, ctx.group_name = inputs
        ctx.recv, ctx.send = ctx_ints(recv), ctx_ints(send)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return all_to_all_p(grad, ctx.send, ctx.recv, ctx.group_name), None, None, None


def all_to_all_p(x: Tensor, recv: Sequence[IntLike], send: Sequence[IntLike], group_name: str) -> Tensor:
    """Send ``send[j]`` rows of `x` (in order) to rank j; receive ``recv[i]`` rows from rank i."""
    return _AllToAll.apply(x, list(recv), list(send), group_name)


# ------------------------------------------------------- blocks with rows appended
# The static ops send a small header of their own beside the data, in the same
# collective: `extra` holds its rows, in the integer dtype of x's element size,
# bit-cast to x's dtype for the trip (a collective copies bits, so nothing is
# lost, and the data keeps the dtype the backend carries), and is not
# differentiable. Each rank's block is its data rows then the `extra` rows,
# which the caller reads back (bit-cast again).
def with_rows(blocks: Tensor, extra: Tensor) -> Tensor:
    """`blocks` ``(m, n, *R)`` with `extra` ``(k, *R)`` after each block's rows: ``(m * (n + k), *R)``."""
    m = blocks.shape[0]
    tail = extra.view(blocks.dtype).unsqueeze(0).expand(m, *extra.shape)
    return torch.cat([blocks, tail], 1).reshape(-1, *extra.shape[1:])


class _AllGatherBlocks(Primitive):
    @staticmethod
    def forward(x: Tensor, extra: Tensor, group_name: str, world: int) -> Tensor:
        return all_gather_impl(with_rows(x.unsqueeze(0), extra), group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        x, _, ctx.group_name, ctx.world = inputs
        ctx.n = ctx_ints([x.shape[0]])[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = reduce_scatter_p(grad, "sum", ctx.group_name, ctx.world).narrow(0, 0, ctx.n)
        return g, None, None, None


def all_gather_blocks_p(x: Tensor, extra: Tensor, group_name: str, world: int) -> Tensor:
    """all_gather of `x` ``(n, *R)`` with `extra`'s k rows after it: ``(world * (n + k), *R)``.

    Backward: ``reduce_scatter_p`` of the gradient, the `extra` rows' part dropped.
    """
    return _AllGatherBlocks.apply(x, extra, group_name, world)


class _AllToAllBlocks(Primitive):
    @staticmethod
    def forward(x: Tensor, extra: Tensor, group_name: str, world: int) -> Tensor:
        cap = x.shape[0] // world
        blocks = x.reshape(world, cap, *x.shape[1:])
        split = [cap + extra.shape[0]] * world
        return all_to_all_impl(with_rows(blocks, extra), split, split, group_name)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        x, extra, ctx.group_name, ctx.world = inputs
        cap = x.shape[0] // ctx.world
        ctx.cap, ctx.size = ctx_ints([cap, cap + extra.shape[0]])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        back = all_to_all_p(grad, [ctx.size] * ctx.world, [ctx.size] * ctx.world, ctx.group_name)
        g = back.reshape(ctx.world, ctx.size, *grad.shape[1:]).narrow(1, 0, ctx.cap)
        return g.reshape(ctx.world * ctx.cap, *grad.shape[1:]), None, None, None


def all_to_all_blocks_p(x: Tensor, extra: Tensor, group_name: str, world: int) -> Tensor:
    """all_to_all of `x`'s `world` equal blocks ``(world * C, *R)``, `extra`'s k rows after each.

    Rank r receives every rank's block r followed by that rank's `extra`:
    ``(world * (C + k), *R)``. Backward: every block returned to its sender by the
    inverse all_to_all, the `extra` rows' part dropped.
    """
    return _AllToAllBlocks.apply(x, extra, group_name, world)


# ------------------------------------------------------------------ broadcast and reduce
class _Broadcast(Primitive):
    @staticmethod
    def forward(x: Tensor, src: int, group_name: str, world: int, rank: int) -> Tensor:
        return _run("broadcast", group_name, x.contiguous(), lambda t, g: _F.broadcast(t, src, g), root=src)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.src, ctx.group_name, ctx.world, ctx.rank = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return reduce_p(grad, "sum", ctx.src, ctx.group_name, ctx.world, ctx.rank), None, None, None, None


def broadcast_p(x: Tensor, src: int, group_name: str, world: int, rank: int) -> Tensor:
    return _Broadcast.apply(x, src, group_name, world, rank)


class _Reduce(Primitive):
    @staticmethod
    def forward(x: Tensor, reduce_op: str, dst: int, group_name: str, world: int, rank: int) -> Tensor:
        # c10d's functional ops have no reduce: an all_reduce, whose result only dst keeps.
        total = _all_reduce_impl(x, reduce_op, group_name, world)
        if rank != dst and isinstance(total, Pending) and total.ticket.sent is not None:
            total.ticket.wait()  # a fingerprinted call: checked here, as dst checks it at its first read
        return total if rank == dst else x.new_zeros(x.shape)  # contiguous, whatever x's strides

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.reduce_op, ctx.dst, ctx.group_name, ctx.world, ctx.rank = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # op's gradient first: max/min/product raise on every rank before anything is sent
        g = scale_for_op(ctx.reduce_op, differentiable("reduce", ctx.reduce_op, grad), ctx.world)
        return broadcast_p(g, ctx.dst, ctx.group_name, ctx.world, ctx.rank), None, None, None, None, None


def reduce_p(x: Tensor, reduce_op: str, dst: int, group_name: str, world: int, rank: int) -> Tensor:
    """The reduction over ranks on `dst`, zeros of ``x``'s shape on the other ranks: ``broadcast_p``'s adjoint.

    Its output is linear in every rank's `x` (a constant 0 off `dst`), so its
    backward is the broadcast of `dst`'s gradient, which every rank joins.
    """
    return _Reduce.apply(x, reduce_op, dst, group_name, world, rank)


# --------------------------------------------------------------------------- replicate_p
class _Replicate(Primitive):
    @staticmethod
    def forward(x: Tensor, reduce_op: str | None, src: int, group_name: str, world: int) -> Tensor:
        if reduce_op is None:
            return _run(
                "broadcast", group_name, x.contiguous(), lambda t, g: _F.broadcast(t, src, g), root=src
            )
        return _all_reduce_impl(x, reduce_op, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, ctx.reduce_op, _, _, ctx.world = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = differentiable("all_reduce", ctx.reduce_op, grad)
        g = g if ctx.reduce_op is None else scale_for_op(ctx.reduce_op, g, ctx.world)
        return g, None, None, None, None


def replicate_p(x: Tensor, reduce_op: str | None, src: int, group_name: str, world: int) -> Tensor:
    """DTensor's all_reduce (`reduce_op`) or broadcast (from `src`, `reduce_op` None): a replicated result.

    The result is one value held on every rank (a ``Replicate()`` DTensor), so the
    gradient that comes back is that value's gradient, the same on every rank, and
    passes through (a ``Partial("avg")`` input: divided by world). Summing it over
    ranks, as ``all_reduce_p`` does for per-rank losses, would count it world times.
    """
    return _Replicate.apply(x, reduce_op, src, group_name, world)


# ------------------------------------------------------------------ ragged gather/scatter
def _all_gather_v_impl(
    x: Tensor, sizes: list[IntLike], common: IntLike, group_name: str, world: int, rank: int
) -> Tensor:
    """Ragged all-gather along dim 0 without padding.

    The first `common` rows of every rank (``common <= min(sizes)``) travel in one
    all_gather; the rest of each rank's rows in ``world - 1`` all_to_all_singles,
    the k-th of which sends them to rank ``rank + k`` (a shift by k). Each shift's
    input is the rows themselves, so nothing is copied to be sent: one
    all_to_all_single sending the rows to every rank at once would need them
    repeated ``world - 1`` times in its input. Every rank issues the same
    collectives whatever the sizes, and each one's input is this rank's own rows,
    so no compiler pass can treat a collective as independent of the data on some
    ranks and move it (the min-cut partitioner hoists tangent-independent nodes of
    a backward into the forward, which would reorder one rank's collectives
    against another's).
    """
    block = all_gather_impl(x.narrow(0, 0, common), group_name, world)
    extras = [n - common for n in sizes]
    mine = x.narrow(0, common, extras[rank]).contiguous()
    received: dict[int, Tensor] = {}
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        # `[0] * world` then one store: dynamo traces that in O(1) bytecode steps, a
        # comprehension in O(world), which is O(world**2) over the shifts.
        send = [0] * world
        send[to] = extras[rank]
        recv = [0] * world
        recv[frm] = extras[frm]
        received[frm] = all_to_all_impl(mine, recv, send, group_name)
    if not torch.compiler.is_compiling() and all(e == 0 for e in extras):
        return block  # eager, every row came in the all_gather: it already is the result
    pieces = []
    for i in range(world):
        pieces.append(block.narrow(0, i * common, common))
        pieces.append(mine if i == rank else received[i])
    return torch.cat(pieces, 0)


def _reduce_scatter_v_impl(
    x: Tensor, sizes: list[IntLike], reduce_op: str, group_name: str, world: int, rank: int
) -> Tensor:
    """Ragged reduce-scatter along dim 0: rank i gets the reduction of rows [off_i, off_i + sizes[i]).

    One all_to_all_single moves exactly those rows to their owner (no padding), who
    reduces the `world` pieces locally.
    """
    mine = sizes[rank]
    got = all_to_all_impl(x, [mine] * world, list(sizes), group_name)
    stacked = got.view(world, mine, *x.shape[1:])
    # sum/prod promote small integers to int64 by default; the collective keeps x's dtype.
    if reduce_op == "sum":
        return stacked.sum(0, dtype=x.dtype)
    if reduce_op == "avg":
        return stacked.sum(0) / world
    if reduce_op == "max":
        return stacked.amax(0)
    if reduce_op == "min":
        return stacked.amin(0)
    return stacked.prod(0, dtype=x.dtype)


def _padded_blocks(
    x: Tensor, sizes: list[IntLike], stats: Stats | None, group_name: str, world: int
) -> tuple[Tensor, IntLike]:
    """All-gather `x` padded to ``max(sizes)`` rows: (the ``world * max`` rows, max)."""
    longest = max_of(*sizes) if stats is None else stats[1]
    return all_gather_p(pad_rows(x, longest), group_name, world), longest


def gather_rows(
    x: Tensor,
    sizes: Sequence[IntLike],
    strategy: str,
    group_name: str,
    world: int,
    rank: int,
    stats: Stats | None = None,
) -> Tensor:
    """Ragged all-gather of dim 0 (``sizes[rank]`` rows here) with a strategy of funcoll.gather.

    ``"a2a"``: :func:`all_to_all_p` of the rows repeated `world` times, whose
    output is the result (differentiable through its adjoint and the repeat's sum).
    ``"pad"``: pad to ``max(sizes)``, all_gather_p, cut (differentiable through
    all_gather_p's adjoint and the pad/cut). ``"shift"``: all_gather_v_p with the
    common prefix ``min(sizes)`` in the all_gather.

    `stats` is ``(min(sizes), max(sizes), sum(sizes))`` when the caller has them
    (the world exchange reads them off the header table with the sizes): in a
    compiled graph they are then three plain symbols rather than expressions over
    every rank's length, whose tracing and partitioning cost grows faster than
    the world size.
    """
    sizes = list(sizes)
    torch._check(x.shape[0] == sizes[rank])
    strategy = resolve(strategy, world)
    if strategy == "a2a":
        return all_to_all_p(_repeat_rows(x, world), sizes, [sizes[rank]] * world, group_name)
    if strategy == "pad":
        if all_equal(sizes):  # nothing to pad and nothing to cut
            return all_gather_p(x, group_name, world)
        blocks, longest = _padded_blocks(x, sizes, stats, group_name, world)
        total = sum(sizes) if stats is None else stats[2]
        return cut_padding(blocks, sizes, longest, total)
    common = common_rows(sizes, None if stats is None else stats[0])
    for n in sizes:
        torch._check(n - common >= 0)
    return all_gather_v_p(x, sizes, common, group_name, world, rank, stats)


def _repeat_rows(x: Tensor, world: int) -> Tensor:
    """`x` ``(n, *R)`` as ``(world * n, *R)``: one copy per destination of an all_to_all that gathers."""
    return x.unsqueeze(0).expand(world, *x.shape).reshape(world * x.shape[0], *x.shape[1:])


def gather_pieces(
    x: Tensor,
    sizes: Sequence[IntLike],
    strategy: str,
    group_name: str,
    world: int,
    rank: int,
    stats: Stats | None = None,
) -> list[Tensor]:
    """:func:`gather_rows` as one tensor per rank: views into what the collectives return.

    The padded layout hands out each rank's block of the all_gather as it is
    (rank i's rows start at ``i * max(sizes)``), so no piece's offset is a sum over
    the ranks before it: those sums make a trace quadratic in the world size.
    """
    sizes = list(sizes)
    if resolve(strategy, world) != "pad" or all_equal(sizes):
        return list(torch.split(gather_rows(x, sizes, strategy, group_name, world, rank, stats), sizes))
    torch._check(x.shape[0] == sizes[rank])
    blocks, longest = _padded_blocks(x, sizes, stats, group_name, world)
    for n in sizes:
        torch._check(longest - n >= 0)
    return [blocks.narrow(0, i * longest, n) for i, n in enumerate(sizes)]


class _AllGatherV(Primitive):
    @staticmethod
    def forward(
        x: Tensor,
        sizes: list[IntLike],
        common: IntLike,
        group_name: str,
        world: int,
        rank: int,
        stats: Stats | None,
    ) -> Tensor:
        return _all_gather_v_impl(x, sizes, common, group_name, world, rank)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, sizes, _, ctx.group_name, ctx.world, ctx.rank, stats = inputs
        ctx.sizes, ctx.stats = ctx_ints(sizes), None if stats is None else tuple(ctx_ints(stats))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        g = reduce_scatter_v_p(grad, ctx.sizes, "sum", ctx.group_name, ctx.world, ctx.rank, ctx.stats)
        return g, None, None, None, None, None, None


class _ReduceScatterV(Primitive):
    @staticmethod
    def forward(
        x: Tensor,
        sizes: list[IntLike],
        reduce_op: str,
        group_name: str,
        world: int,
        rank: int,
        stats: Stats | None,
    ) -> Tensor:
        return _reduce_scatter_v_impl(x, sizes, reduce_op, group_name, world, rank)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _faults.remember(ctx)
        _, sizes, ctx.reduce_op, ctx.group_name, ctx.world, ctx.rank, stats = inputs
        ctx.sizes, ctx.stats = ctx_ints(sizes), None if stats is None else tuple(ctx_ints(stats))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad = differentiable("reduce_scatter", ctx.reduce_op, grad)
        g = gather_rows(grad, ctx.sizes, "auto", ctx.group_name, ctx.world, ctx.rank, ctx.stats)
        return (
            scale_for_op(ctx.reduce_op, g, ctx.world),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def all_gather_v_p(
    x: Tensor,
    sizes: Sequence[IntLike],
    common: IntLike,
    group_name: str,
    world: int,
    rank: int,
    stats: Stats | None = None,
) -> Tensor:
    """Ragged all-gather along dim 0: ``(sizes[rank], *R) -> (sum(sizes), *R)``.

    `stats` (``(min, max, sum)`` of `sizes`, or None) only serves the backward's gather.
    """
    return _AllGatherV.apply(x, list(sizes), common, group_name, world, rank, stats)


def reduce_scatter_v_p(
    x: Tensor,
    sizes: Sequence[IntLike],
    reduce_op: str,
    group_name: str,
    world: int,
    rank: int,
    stats: Stats | None = None,
) -> Tensor:
    """Ragged reduce-scatter along dim 0: ``(sum(sizes), *R) -> (sizes[rank], *R)``.

    `stats` (``(min, max, sum)`` of `sizes`, or None) only serves the backward's gather.
    """
    return _ReduceScatterV.apply(x, list(sizes), reduce_op, group_name, world, rank, stats)
