"""Issue one collective and wait for it: the bottom layer, under the primitives and the size exchange.

Every collective funcoll runs goes through :func:`run`: the differentiable
primitives' (``_prims._run``, which checks it first under ``set_checks``), and
the size exchanges and cross-rank checks of ``_header`` (:func:`gather_rows`),
which the primitives' checks themselves run on. Nothing here knows an op, a
header or a gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .._base._config import checks_enabled
from .._base._group import wire_name
from . import _async, _faults, _fingerprint
from ._phase import in_phase

__all__ = ["ALIAS_WAIT", "gather_rows", "run"]

_F = torch.ops._c10d_functional
_COPIED = frozenset({"all_reduce", "broadcast"})  # collectives whose functional op copies `x` at the issue

# Dynamo 2.11 on the "eager" backend (dynamo alone, no AOT autograd) drops the gradient
# of an autograd.Function whose forward returns ``wait_tensor``'s result itself: the
# input's gradient came back zero, for every primitive, and for a bare Function around
# ``all_reduce`` and ``wait_tensor``. A view of it (``aten.alias``: no copy, no kernel)
# keeps the gradient. aot_eager and inductor were right on 2.11, and every backend is
# right from 2.12 on (compile_tests/test_fullgraph.py, the eager-backend case).
ALIAS_WAIT = torch.__version__ < "2.12"


def run(
    collective: str,
    group_name: str,
    x: Tensor,
    issue: Callable[[Tensor, str], Tensor],
    step: str = "",
    *,
    defer: bool = True,
    wire: str | None = None,
    sent: _fingerprint.Sent | None = None,
) -> Tensor:
    """Issue one collective; its result, waited for at first use (eager) or by the graph's wait.

    Eager, the result is a :class:`funcoll._collective._async.Pending` (funcol's
    ``AsyncCollectiveTensor`` design): the call returns once the collective is
    issued, and the wait happens when an op first reads the values, so the
    caller's work in between overlaps with the communication. On a gloo group
    with two worker threads (torch's default) it is also waited before funcoll's
    next eager collective is issued, so that one is in flight at a time
    (:func:`funcoll._collective._async.defers`).
    A backend failure (a peer rank died, raised or stayed away) is re-raised
    naming the funcoll op, the collective and its `step` (:mod:`funcoll._collective._faults`),
    at the issue or at that wait. ``defer=False`` waits at once: the size exchanges, whose values
    the host reads next. While compiling this is the issue and the wait, which
    inductor's passes may move past independent work; under checks a size
    exchange's wait (``defer=False``) is ``funcoll::wait``, which names the op
    too: the host reads the sizes next, so there is no overlap to lose.

    `x` is the payload (contiguous) and ``issue(x, group)`` issues the collective.
    `wire`: the group name a compiled graph issues it under, when the caller took
    one already (:func:`funcoll._base._group.wire_name`, one per collective); else this
    takes one.

    Eager, the issue and the wait dispatch below autograd. Every collective here
    runs inside a primitive's forward (grad off, funcoll's own backward) or on a
    size header, which has no gradient, so the autograd kernels torch registers
    on the ``_c10d_functional`` ops (in Python, in torch 2.13) would only check
    the grad mode and redispatch. Skipping them saves 20-35 us of CPU per
    collective (2 gloo CPU ranks, torch 2.13: issue and wait take 15-20 us of the
    calling thread's CPU instead of 35-55 us).
    """
    if torch.compiler.is_compiling():
        out = issue(x, wire or wire_name(group_name))
        if checks_enabled() and not defer:  # a checked header: the host reads it next, nothing to move
            return _faults.checked_wait(out, x, _faults.traced_op(), collective, group_name, step)
        y = _F.wait_tensor(out)
        return torch.ops.aten.alias(y) if ALIAS_WAIT else y
    _async.drain()  # a gloo collective kept in flight is waited before the next one runs
    try:
        with torch._C._AutoDispatchBelowAutograd():
            out = issue(x, group_name)
            how = _async.defers(out, group_name) if defer else None  # on gloo: _async.defers
            if how is None:
                out = _F.wait_tensor(out)
                return out if sent is None else sent.complete(out)
    except RuntimeError as e:
        raise _faults.failed(collective, group_name, step, e) from e
    # What the backend reads while the collective is in flight, checked at the wait for writes
    # (`_async._written_in_flight`): `x`, except where the functional op copies it as it is
    # issued (all_reduce and broadcast reduce or fill a copy in place).
    payload = None if collective in _COPIED else x
    return _async.defer(out, collective, group_name, step, serial=how == "serial", sent=sent, payload=payload)


def gather_rows(rows: Tensor, group_name: str, world: int, step: str) -> Tensor:
    """Every rank's `rows` (a small header), concatenated along dim 0 and waited for: the host reads them next."""
    return run(
        "all_gather", group_name, in_phase(rows.contiguous()),
        lambda t, g: _F.all_gather_into_tensor(t, world, g), step, defer=False,
    )  # fmt: skip
