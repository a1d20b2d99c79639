"""The default setting's unchecked eager calls: a fingerprint travels in the data's own collective.

At the default setting an even op checks its eager calls 1, 2, 4, 8, ... on each
group (``_config.check_due``); the calls in between exchange no header. A call
whose ranks disagree there (a shape, a dtype or an argument that differs, or
ranks that issue different collectives) pairs collectives of different sizes or
meanings, and on gloo a rank whose buffer is larger than what arrives returned
it as data (the tail of its buffer unwritten), a broadcast's receivers with
another shape returned their buffer half filled, and ranks whose shapes differ
with the same byte count returned each other's bytes reinterpreted.

So on such a call every data collective carries a fingerprint of what this
rank is doing beside the payload, in the same collective: no extra round trip,
and the result is not handed out (the :class:`~funcoll._collective._async.Pending`'s
wait, or the op's return when it waits) before every rank's fingerprint was
compared with this rank's. A fingerprint is a 64-bit hash of the op and
what its header would have compared (its arguments, x's dtype, x's shape but
along a dim whose length may differ, its `sizes`), the collective, the
payload's dtype and shape (an all_to_all piece's rows and its source and
destination), and the number of fingerprinted collectives this process issued
on the group before (every rank counts alike, so a collective that one rank
skipped shows too, and a buffer that still holds a fingerprint of an earlier
call cannot pass for this one's). Ranks that disagree raise
funcoll's ``ValueError`` on every rank that received a fingerprint.

How it travels, by collective:

- all_gather of at least :data:`AHEAD_BYTES` a rank: ahead of the data, in an
  all_gather of the 8 fingerprint bytes that the host waits for and checks;
  the data's own all_gather then runs as it is, its result not copied. Carried
  in the payload, the fingerprint costs a copy of the input and one of the
  result on the calling thread (at 16 MiB a rank on this 2-core machine, about
  twice what the collective's exposed time is with the checks off); ahead, it
  costs one small collective's round trip, and ranks that disagree all raise
  before any data is sent. Every rank of a correct program gathers the same
  bytes, so every rank takes the same way; ranks whose bytes differ (one
  ahead, one not) pair collectives of different sizes, which the backend
  stops or the check catches as it does below;
- all_gather (smaller), all_to_all, broadcast (bytes moved as they are): the
  payload as bytes, then the 8 bytes of the fingerprint after it (after each
  piece, for an all_to_all); a received block whose last 8 bytes differ from the
  fingerprint this rank expects from its sender fails the check. The received
  blocks are then copied out without their fingerprints (all_gather, all_to_all:
  one copy of the result) or the result is a view of them (broadcast);
- all_reduce, reduce_scatter (values reduced): 32 bits of the fingerprint,
  each as the pair ``(b, 1 - b)`` of values of the payload's dtype, after the
  payload (after each rank's slice). Reduced over ranks a pair is ``(W b, W (1 -
  b))`` for a sum when every rank sent the same bit, ``(b, 1 - b)`` for max, min
  and product, and anything else (``(1, 1)``, ``(0, 0)``, a sum in between) when
  they did not: every rank sees the disagreement. The result is a view of the
  reduced values before the pairs.

A rank whose buffer is smaller than what a peer sends is stopped by the
backend itself (gloo aborts the process: "Received data size doesn't match
expected size. Is there a distributed collective mismatch in your code?"); the
fingerprint makes sure that no rank returns data from such a call. Under
``set_checks(True)`` the header exchanged before the data raises on every rank
first, naming what each rank passed.

The check reads the received fingerprints on the host: free for a CPU tensor,
a device-to-host sync for a GPU one, so only CPU payloads carry one (NCCL pairs
mismatched sizes by hanging, which no fingerprint can turn into an error).
Compiled code carries none: docs/errors.md says what the default leaves out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import _faults

__all__ = ["Sent", "pack"]

_F = torch.ops._c10d_functional
BITS = 32  # bits of the fingerprint a reduction carries, as BITS pairs of values
# From this many payload bytes a rank, an all_gather's fingerprint goes ahead of its data in
# a collective of its own (one round trip) instead of inside it (two copies on the calling
# thread). Every rank of a correct program gathers the same bytes: they all choose alike.
AHEAD_BYTES = 1 << 20
_REDUCED = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
            torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # fmt: skip
# Fingerprinted collectives so far on each group (by name): the same on every rank.
_counts: dict[str, int] = {}


def _hash(*parts: object) -> int:
    """A signed 64-bit hash of `parts` (their repr): the same on every rank for equal parts."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _bytes(h: int) -> Tensor:
    return torch.tensor([h], dtype=torch.int64).view(torch.uint8)


def _pairs(h: int) -> list[int]:
    bits = [(h >> k) & 1 for k in range(BITS)]
    return [*bits, *(1 - b for b in bits)]


class Sent:
    """One fingerprinted collective: the payload to send, how to issue it, and how its result is read back.

    `payload` is what goes on the wire and ``issue(payload, group)`` issues it.
    ``result(out, into)`` is the op's result in the output `out`: a view of it, or
    with `copied` its values without the fingerprints copied into `into` (a new
    tensor if None; ``result(None, None)`` is that tensor before the data came);
    ``check(out)`` the ranks whose fingerprints differ from this rank's ([-1]:
    some rank's, unknown which). `ahead`: the payload is the fingerprint alone,
    exchanged and checked before the data's own collective, which then runs as it
    is (:func:`funcoll._collective._prims` issues both).
    """

    def __init__(
        self,
        payload: Tensor,
        issue: Callable[[Tensor, str], Tensor],
        check: Callable[[Tensor], list[int]],
        result: Callable[[Tensor | None, Tensor | None], Tensor],
        copied: bool,
        what: str,
        ahead: bool = False,
    ) -> None:
        self.payload, self.issue, self.check, self.result, self.copied = payload, issue, check, result, copied
        self.what, self.op, self.ahead = what, _faults.current_op(), ahead

    def placeholder(self, out: Tensor) -> Tensor:
        """The op's result for the output `out` of :attr:`issue` before the data arrived: :meth:`complete` fills it."""
        return self.result(None if self.copied else out, None)

    def complete(self, out: Tensor, into: Tensor | None = None) -> Tensor:
        """Check the arrived output `out` (``ValueError`` if the ranks disagree); the result, in `into` if given."""
        bad = self.check(out)  # reads a CPU tensor: no device sync
        if bad:
            opname = self.op
            ranks = "some rank" if bad == [-1] else f"rank(s) {bad}"
            raise ValueError(
                f"{opname}: ranks disagree on this call: the data of {ranks} came with another fingerprint "
                f"than this rank's ({self.what}). The ranks passed different shapes, dtypes or arguments, or "
                f"issued different collectives at this point; funcoll.set_checks(True) (FUNCOLL_CHECKS=1) "
                f"names what each rank passed (docs/errors.md). A rank whose buffer was too small for a peer's "
                f"data may have been stopped by the backend already"
            )
        return self.result(out, into)


def pack(
    collective: str,
    group_name: str,
    x: Tensor,
    issue: Callable[[Tensor, str], Tensor],
    call: tuple[str, str],
    world: int,
    rank: int,
    splits: tuple[Sequence[int], Sequence[int]] | None = None,
    reduce_op: str | None = None,
    root: int | None = None,
) -> Sent | None:
    """`x`'s collective with a fingerprint beside its payload, or None where none travels (the plain one runs).

    `issue` is the plain collective's (used as it is where the payload's layout
    keeps its arguments: all_gather, broadcast, the reductions); `call` what
    :func:`funcoll._collective._faults.unchecked` says of the op's call (what its
    header would compare, and how this rank's call shows); `splits` an
    all_to_all's (send, receive) rows; `reduce_op` a reduction's (sum, max, min,
    product: avg runs as sum); `root` a broadcast's src.
    """
    if x.device.type != "cpu" or (x.dim() == 0 and collective != "all_reduce"):
        return None  # a 0-d all_reduce (a loss, a norm) is one; the others reach here with a dim
    n = _counts[group_name] = _counts.get(group_name, 0) + 1
    what = f"rank {rank}: {call[1]}, its {collective}, fingerprinted collective {n} on group {group_name!r}"
    common = (n, collective, _faults.current_op(), call[0], str(x.dtype))
    if collective == "all_gather":
        return _all_gather(x, issue, world, common, what)
    if collective == "broadcast" and root is not None:
        return _broadcast(x, world, rank, root, common, what)
    if collective == "all_to_all" and splits is not None:
        return _all_to_all(x, world, rank, splits, common, what)
    if collective in ("all_reduce", "reduce_scatter") and x.dtype in _REDUCED and world < 128:
        return _reduced(x, issue, world, collective == "reduce_scatter", reduce_op, common, what)
    return None


def _all_gather(
    x: Tensor, issue: Callable[[Tensor, str], Tensor], world: int, common: tuple[object, ...], what: str
) -> Sent:
    """The 8 fingerprint bytes after each rank's payload bytes, the result copied out without them; or ahead.

    From :data:`AHEAD_BYTES` a rank the fingerprint goes ahead (:class:`Sent`'s
    `ahead`): every rank's 8 bytes in an all_gather of their own.
    """
    shape = tuple(x.shape)
    h = _hash(*common, shape)
    nb = x.numel() * x.element_size()
    if nb >= AHEAD_BYTES:

        def check_ahead(out: Tensor) -> list[int]:
            return _differ(out.view(world, 8), _bytes(h).expand(world, 8), range(world))

        return Sent(_bytes(h), issue, check_ahead, lambda out, into: out, copied=False, what=what, ahead=True)  # type: ignore[arg-type, return-value]
    data = x.reshape(-1).view(torch.uint8)
    out_shape = (world * shape[0], *shape[1:])

    def check(out: Tensor) -> list[int]:
        return _differ(out.view(world, nb + 8)[:, nb:], _bytes(h).expand(world, 8), range(world))

    def result(out: Tensor | None, into: Tensor | None) -> Tensor:
        into = x.new_empty(out_shape) if into is None else into
        if out is not None:  # the one copy: each rank's bytes without the fingerprint after them
            into.view(-1).view(torch.uint8).view(world, nb).copy_(out.view(world, nb + 8)[:, :nb])
        return into

    return Sent(torch.cat([data, _bytes(h)]), issue, check, result, copied=True, what=what)


def _broadcast(x: Tensor, world: int, rank: int, root: int, common: tuple[object, ...], what: str) -> Sent:
    """An all_to_all: every rank's fingerprint to every rank, src's payload after it to the others.

    A fingerprint is 16 bytes (h twice), so that the data after it stays aligned for
    every dtype. Every rank then sees every rank's fingerprint, as in an all_gather
    (a broadcast tells src nothing, and a receiver only about src). A block shorter
    than this rank expects still starts with what its sender sent.
    """
    shape = tuple(x.shape)
    h = _hash(*common, shape)
    data = x.reshape(-1).view(torch.uint8)
    nb = data.shape[0]
    head = torch.cat([_bytes(h), _bytes(h)])
    if rank == root:
        payload = torch.cat([head if r == root else torch.cat([head, data]) for r in range(world)])
    else:
        payload = head.repeat(world)
    send = [16 + (nb if rank == root and r != root else 0) for r in range(world)]
    recv = [16 + (nb if r == root and rank != root else 0) for r in range(world)]
    starts = [sum(recv[:r]) for r in range(world)]

    def issue_b(t: Tensor, g: str) -> Tensor:
        return _F.all_to_all_single(t, recv, send, g)

    def check(out: Tensor) -> list[int]:
        heads = torch.stack([out[at : at + 16] for at in starts])
        return _differ(heads, head.expand(world, 16), range(world))

    def result(out: Tensor | None, into: Tensor | None) -> Tensor:
        if into is not None:
            return into
        if out is None or rank == root:
            return x.clone()
        at = starts[root] + 16
        return out[at : at + nb].view(x.dtype).view(shape)

    return Sent(payload, issue_b, check, result, copied=False, what=what)


def _all_to_all(
    x: Tensor,
    world: int,
    rank: int,
    splits: tuple[Sequence[int], Sequence[int]],
    common: tuple[object, ...],
    what: str,
) -> Sent:
    """Each piece's 8 fingerprint bytes after it (hashing its rows, source and destination)."""
    shape = tuple(x.shape)
    send, recv = [int(s) for s in splits[0]], [int(s) for s in splits[1]]
    row = _row_bytes(x)
    data = x.reshape(-1).view(torch.uint8)
    pieces: list[Tensor] = []
    start = 0
    for dst, rows in enumerate(send):
        pieces += [data[start : start + rows * row], _bytes(_hash(*common, shape[1:], rank, dst, rows))]
        start += rows * row
    expected = torch.cat(
        [_bytes(_hash(*common, shape[1:], src, rank, rows)) for src, rows in enumerate(recv)]
    )
    out_send, out_recv = [s * row + 8 for s in send], [r * row + 8 for r in recv]
    out_shape = (sum(recv), *shape[1:])

    def issue_a2a(t: Tensor, g: str) -> Tensor:
        return _F.all_to_all_single(t, out_recv, out_send, g)

    def check(out: Tensor) -> list[int]:
        ends = [sum(out_recv[: i + 1]) for i in range(world)]
        tails = torch.stack([out[e - 8 : e] for e in ends])
        return _differ(tails, expected.view(world, 8), range(world))

    def result(out: Tensor | None, into: Tensor | None) -> Tensor:
        into = x.new_empty(out_shape) if into is None else into
        if out is not None:  # the one copy: each piece without the fingerprint after it
            flat, at, to = into.view(-1).view(torch.uint8), 0, 0
            for r in recv:
                flat[to : to + r * row].copy_(out[at : at + r * row])
                at, to = at + r * row + 8, to + r * row
        return into

    return Sent(torch.cat(pieces), issue_a2a, check, result, copied=True, what=what)


def _reduced(
    x: Tensor,
    issue: Callable[[Tensor, str], Tensor],
    world: int,
    scatter: bool,
    reduce_op: str | None,
    common: tuple[object, ...],
    what: str,
) -> Sent:
    """32 fingerprint bits as pairs of values before the payload (before each rank's slice)."""
    shape = tuple(x.shape)
    pairs = _pairs(_hash(*common, reduce_op, shape))
    want = torch.tensor([world * v for v in pairs] if reduce_op == "sum" else pairs, dtype=x.dtype)
    blocks = world if scatter else 1
    flat = x.reshape(blocks, -1)
    # Before the data, as broadcast's: an all_reduce's output starts as this rank's input.
    head = torch.tensor(pairs, dtype=x.dtype).expand(blocks, 2 * BITS)
    payload = torch.cat([head, flat], dim=1).reshape(-1)
    out_shape = shape if blocks == 1 else (shape[0] // world, *shape[1:])

    def check(out: Tensor) -> list[int]:
        return _differ(out[: 2 * BITS].view(1, -1), want.view(1, -1), [-1])

    def result(out: Tensor | None, into: Tensor | None) -> Tensor:
        return into if into is not None else out[2 * BITS :].view(out_shape)  # type: ignore[index]

    return Sent(payload, issue, check, result, copied=False, what=what)


def _differ(got: Tensor, want: Tensor, sources: Sequence[int]) -> list[int]:
    """The `sources` whose row of `got` differs from `want`'s: none when they are equal.

    ``torch.equal`` on CPU tensors: no host read of a tensor's values is counted
    (``funcoll.testing.count_host_reads``), as none is made on a GPU, where no
    fingerprint travels. Which rows differ is read only on the way to the error.
    """
    if torch.equal(got, want):
        return []
    rows = (got != want).reshape(got.shape[0], -1).any(1)
    differ = rows.nonzero().flatten().tolist()  # host sync, deliberate (none: CPU), to the error
    return [sources[i] for i in differ]


def _row_bytes(x: Tensor) -> int:
    """Bytes in one dim-0 row of `x`, also when it has no rows."""
    count = 1
    for s in x.shape[1:]:
        count *= s
    return count * x.element_size()
