"""Eager results that arrive later: a collective's output whose wait happens at first use.

funcol's eager ops return an ``AsyncCollectiveTensor``: the collective has been
issued, and the wait (``wait_tensor``: on CUDA the current stream waits for the
collective's stream, on gloo the host waits for the work) happens when an op
first reads the values. Views (``narrow``, ``movedim``, ``view``, a bit-cast)
read nothing, so they stay pending too. Everything the caller computes between
the call and the first read overlaps with the communication.

:class:`Pending` is that design with funcoll's fault naming kept: it subclasses
``AsyncCollectiveTensor`` (so the torch code that knows those, AOT autograd's
input handling and DTensor's, treats it as one), and its wait re-raises a
backend failure naming the funcoll op, the collective and the step, taken when
the collective was issued (:func:`funcoll._collective._faults.failed`), as the blocking wait
did. A result and all its views share one :class:`_Ticket`, so the collective is
waited once, whichever of them is read first.

Only eager code gets a :class:`Pending`: a compiled graph has the bare
``wait_tensor`` that inductor schedules (``_issue.run``).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor, _is_view_op
from torch.utils._pytree import tree_map_only

from . import _faults
from ._phase import Primitive

__all__ = ["Pending", "defer", "defers", "drain", "wait"]

_wait_tensor = torch.ops._c10d_functional.wait_tensor
_view = torch.ops.aten.view.default


class _Ticket:
    """One issued collective: its output, whether it was waited, and what to name if it failed."""

    __slots__ = (
        "__weakref__", "collective", "done", "group_name", "op", "output", "payload", "result", "sent", "step",
        "version",
    )  # fmt: skip

    def __init__(
        self,
        output: Tensor,
        op: str,
        collective: str,
        group_name: str,
        step: str,
        sent: Any = None,
        payload: Tensor | None = None,
    ) -> None:
        self.output, self.done, self.sent, self.result = output, False, sent, None
        self.op, self.collective, self.group_name, self.step = op, collective, group_name, step
        # What the collective reads, and its version counter (shared with every view of its
        # memory) at the issue: `_written_in_flight` compares it at the wait.
        self.payload, self.version = payload, payload._version if payload is not None else 0

    def wait(self) -> None:
        if self.done:
            return
        self.done = True  # waited once, failed or not: a second read must not wait on a dead group
        try:
            with torch._C._AutoDispatchBelowAutograd():
                _wait_tensor(self.output)
        except RuntimeError as e:
            raise _faults.failed(self.collective, self.group_name, self.step, e, op=self.op) from e
        payload, self.payload = self.payload, None
        if payload is not None and payload._version != self.version:
            self.output = self.sent = self.result = None  # type: ignore[assignment]
            _written_in_flight(self.op, self.collective, self.version, payload._version)
        if self.sent is not None:  # a fingerprinted collective: checked (ValueError) before any read
            sent, result, self.sent, self.result = self.sent, self.result, None, None
            with torch._C._AutoDispatchBelowAutograd():
                sent.complete(self.output, into=result)
        self.output = None  # type: ignore[assignment]  # the values live on in the views' elems

    def __del__(self) -> None:
        # Every result of this collective was dropped unread: wait now, so that nothing
        # is left in c10d's registry (a leak, and "unwaited collective calls" at exit).
        # The peers issued this collective before anything later, so the wait ends.
        # A failure here has no caller to raise to: it is a warning naming the op.
        try:
            self.wait()
        except (RuntimeError, ValueError) as e:
            warnings.warn(f"{e} (its result was never read)", RuntimeWarning, stacklevel=1)


def _written_in_flight(op: str, collective: str, before: int, after: int) -> None:
    """The tensor a collective read was written in place between its issue and its wait.

    The backend reads it while the collective is in flight (a gloo worker thread, an
    NCCL stream), so the data this rank sent may hold the values written: a silently
    wrong result on every rank that received it. An SPMD program writes on every rank,
    so every rank raises here, at its read of the result. (torch's functional
    collectives send whatever the memory holds when the backend reads it.)
    """
    raise ValueError(
        f"{op}: its input was written in place while its {collective} was in flight (the tensor's version "
        f"went from {before} to {after}), so what this rank sent may hold the written values; read the "
        f"result (or funcoll.wait(result)) before writing to the input, or pass a copy (x.clone())"
    )


class Pending(AsyncCollectiveTensor):
    """A collective's eager result (or a view of one) whose values may not have arrived yet.

    Any op that reads the values waits first (once per collective); a view op
    returns another :class:`Pending` on the same collective. ``.wait()`` returns the
    plain tensor. Pickling, ``deepcopy`` and ``repr`` wait and act on the values.
    """

    __slots__ = ["ticket"]
    ticket: _Ticket

    @staticmethod
    def __new__(cls, elem: Tensor, ticket: _Ticket) -> Pending:  # type: ignore[override]
        r = AsyncCollectiveTensor.__new__(cls, elem)
        r.ticket = ticket
        return r  # type: ignore[return-value]

    def __init__(self, elem: Tensor, ticket: _Ticket) -> None:
        super().__init__()

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], meta: Any, outer_size: Any, outer_stride: Any
    ) -> Tensor:
        # A traced copy of a result: the trace has no collective to wait for here.
        return AsyncCollectiveTensor(inner["elem"])

    def trigger_wait(self) -> Tensor:
        self.ticket.wait()
        self.completed = True
        return self.elem

    def wait(self) -> Tensor:
        return self.trigger_wait()

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Pending({self.trigger_wait()})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.trigger_wait().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        return self.trigger_wait().clone()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Every op on a result, waited or not, comes here: the common cases (a view, or
        # arguments with no tensor inside a list) skip the pytree walks, which cost ten
        # times the op on small tensors (the counts of moe's layout, say).
        kwargs = kwargs or {}
        if func is _view:  # the commonest view
            return Pending(func(args[0].elem, *args[1:], **kwargs), args[0].ticket)
        flat = not any(map(_nests_tensors, args)) and not any(map(_nests_tensors, kwargs.values()))
        if _is_view(func):
            ticket = next(a.ticket for a in args if isinstance(a, Pending))
            out = _call(func, args, kwargs, flat, lambda p: p.elem)
            if isinstance(out, Tensor):
                return Pending(out, ticket)
            return tree_map_only(Tensor, lambda t: Pending(t, ticket), out)
        return _call(func, args, kwargs, flat, Pending.trigger_wait)


def _call(func: Any, args: Any, kwargs: dict[str, Any], flat: bool, get: Any) -> Any:
    """``func`` with every pending argument replaced by ``get(it)``: by a plain loop when `flat`."""
    if flat:
        return func(*[get(a) if isinstance(a, Pending) else a for a in args],
                    **{k: get(v) if isinstance(v, Pending) else v for k, v in kwargs.items()})  # fmt: skip
    return func(*tree_map_only(Pending, get, args), **tree_map_only(Pending, get, kwargs))


_VIEWS: dict[Any, bool] = {}  # op -> whether funcol's rule treats it as a view: read per op once


def _is_view(func: Any) -> bool:
    views = _VIEWS.get(func)
    if views is None:
        views = _VIEWS[func] = bool(_is_view_op(func))
    return views


def _nests_tensors(arg: Any) -> bool:
    """`arg` is a list, tuple or dict that may hold a tensor (the pytree walk's case)."""
    if isinstance(arg, dict):
        return True
    return isinstance(arg, (list, tuple)) and any(isinstance(e, (Tensor, list, tuple, dict)) for e in arg)


# funcoll's collectives in flight on gloo groups of more than one worker thread, in
# this process: each is waited before the next eager collective is issued (`drain`).
_serial: weakref.WeakSet[_Ticket] = weakref.WeakSet()
# Every ticket whose result is alive: a result never read (a global still referenced
# when the program ends) is waited at exit, before c10d's registry is torn down.
_live: weakref.WeakSet[_Ticket] = weakref.WeakSet()


@atexit.register
def _wait_left() -> None:
    """At interpreter exit, wait every collective whose result is alive and was never read.

    A result a program keeps but never reads (``recv, sizes = all_to_all_v(...)``
    at module level, ``sizes`` read and ``recv`` not) stays registered with c10d,
    which at process termination warns of "unwaited collective calls" on every
    rank. In a program that ended normally the collective finished long before
    (everything after it came later on every rank), so the wait returns at once.
    A program that ends on an uncaught exception is left as it is (its peers may
    never issue the collective), and the waits run on a thread given 10 s, so that
    exit never blocks on a peer that is gone; a failure has no caller left to
    raise to and is dropped with the rest of the process.

    Then, unless a wait is still stuck, it frees what reference cycles hold
    (``gc.collect``) while the interpreter still runs. A DTensor or DeviceMesh
    keeps its process group alive past ``destroy_process_group``, and the group's
    gloo worker threads with it; left to the collection inside interpreter
    finalization, a worker thread that drops a finished collective's tensors
    takes the GIL of a finalizing interpreter, which ends the thread by force:
    "terminate called without an active exception", SIGABRT after the program's
    last line (docs/errors.md, "Faults"). Freed here, the group's destructor joins
    its threads as it does in mid-program.
    """
    if getattr(sys, "last_value", None) is not None:  # set when an uncaught exception ended it
        return
    left = [t for t in list(_live) if not t.done]
    if left:

        def waits() -> None:
            for ticket in left:
                try:
                    ticket.wait()
                except Exception:  # noqa: BLE001 -- the process is ending; the peers may be gone
                    pass

        thread = threading.Thread(target=waits, name="funcoll-exit-waits", daemon=True)
        thread.start()
        thread.join(timeout=10.0)
        if thread.is_alive():  # a peer is gone: freeing its group now could join a stuck thread
            return
    gc.collect()


def drain() -> None:
    """Wait for the gloo collectives :func:`defers` keeps one at a time, before issuing another.

    Called before every eager issue: cheap when nothing is in flight (one set's
    length). Waiting names the op whose collective failed, as a read would.
    """
    while _serial:
        _serial.pop().wait()


def defers(output: Tensor, group_name: str) -> Literal["defer", "serial"] | None:
    """How `output`'s collective stays in flight past the op's return: None (it waits in the op).

    ``"defer"``: at its first read, as funcol's ``AsyncCollectiveTensor``: NCCL,
    every other backend, a gloo group with one worker thread, and any gloo group
    when the environment says ``FUNCOLL_GLOO_DEFER=1``.

    ``"serial"``: at its first read or before funcoll's next eager collective,
    whichever comes first (:func:`drain`): a gloo group with torch's two worker
    threads. Two gloo collectives in flight at once corrupted the heap; one in
    flight while the host went on did not. ``all_to_all_single`` left unwaited,
    then an ``all_gather_into_tensor`` issued and waited, both straight on
    ``torch.ops._c10d_functional`` (no funcoll code), 3 ranks, a few rows each
    (``benchmarks/gloo_inflight_probe.py``): glibc aborted ("malloc(): unaligned
    fastbin chunk detected", or a SIGSEGV in a gloo thread) in runs of 3000 steps
    on every torch funcoll supports (2.11: 1 of 4 runs, 2.12: 2 of 4, 2.13: 4 of 8
    and 4 of 20, 2.14.1: 1 of 4, 2.15: 1 of 4), and funcoll's deferred results
    did the same about once in 600 runs of a 3-rank test batch (torch 2.12 and
    2.13). With one worker thread (:func:`funcoll.testing.gloo_worker_threads`),
    which runs the group's collectives one at a time while the host goes on,
    none did: 0 of 32 probe runs; and none did with the collective left in
    flight over the host's work and waited before the next one was issued, on
    two threads (``--serial``; docs/overlap.md has the counts). So on a
    two-thread group funcoll keeps one collective in flight at a time: the
    host's work overlaps the communication, successive collectives do not
    overlap each other.
    """
    # Read per call (a few microseconds): a group name is reused once its group is destroyed.
    pg = torch._C._distributed_c10d._resolve_process_group(group_name)
    try:
        backend = pg._get_backend(output.device)
    except RuntimeError:  # no backend for this device type: the op itself has raised already
        return None if pg.name() == "gloo" else "defer"
    if backend.name() != "gloo":
        return "defer"
    if getattr(getattr(backend, "options", None), "_threads", None) == 1:
        return "defer"
    return "defer" if os.environ.get("FUNCOLL_GLOO_DEFER") == "1" else "serial"


def defer(
    output: Tensor,
    collective: str,
    group_name: str,
    step: str,
    serial: bool = False,
    sent: Any = None,
    payload: Tensor | None = None,
) -> Tensor:
    """`output` of a collective just issued, as a :class:`Pending` that waits at first use.

    The funcoll op to name if the wait fails is read now, while the op (or the
    backward of one) is still running. `serial`: also waited before funcoll's
    next eager collective (:func:`drain`). `sent`: the collective carries a
    fingerprint (:class:`funcoll._collective._fingerprint.Sent`): the result is its
    placeholder, checked and filled by the wait. `payload`: the tensor the collective
    reads, which must not be written until the wait (a ``ValueError`` there if it was).
    """
    ticket = _Ticket(output, _faults.current_op(), collective, group_name, step, sent, payload)
    _live.add(ticket)
    if serial:
        _serial.add(ticket)
    if sent is None:
        return Pending(output, ticket)
    ticket.result = sent.placeholder(output)
    return Pending(ticket.result, ticket)


def wait(tree: Any) -> Any:
    """Wait for the collectives behind every pending result in `tree`; the same tree, of plain tensors.

    Eager funcoll ops (as funcol's) return once their collectives are issued: the
    result waits for its data when an op first reads it, so the caller's work
    between the call and that read overlaps with the communication
    (docs/overlap.md). ``wait`` makes that point explicit: for a timer that must
    include the communication, or before handing the tensors to code that reads
    memory without torch's dispatch (``data_ptr()``, a custom kernel, numpy). On
    NCCL the current stream waits for the collective's stream and the host does
    not; on gloo the host waits here. On a gloo group with torch's two worker
    threads a result is also waited before funcoll's next eager collective is
    issued, one in flight at a time (:func:`defers`); call ``wait`` before a
    collective funcoll does not issue (``dist.*``, funcol, DTensor) while a result
    is unread there. A
    failure of the collective raises here, naming the funcoll op that issued
    it. Anything else in `tree` (a plain tensor, a compiled graph's output,
    which its graph already waited for, a number) is returned as it is; inside
    a compiled graph ``wait`` is the identity.

    Args:
        tree: a tensor, or any nesting of lists, tuples and dicts holding some
            (funcoll's pending results, funcol's ``AsyncCollectiveTensor``).

    Returns:
        The same structure, each pending result replaced by a plain tensor of
        the same shape, dtype and device, holding the arrived values.

    Backward: the identity (waiting moves no values); the autograd history of
    each result is kept.

    Example (2 ranks)::

        # rank 0: x = [0., 1.]        rank 1: x = [2., 3.]
        wait(all_gather(x))           # both: [0., 1., 2., 3.]
    """
    return tree_map_only(AsyncCollectiveTensor, _waited, tree)


class _Waited(Primitive):
    """A pending result's values as a plain tensor, with its autograd history: the identity."""

    @staticmethod
    def forward(t: AsyncCollectiveTensor) -> Tensor:
        return t.trigger_wait().detach()  # a new tensor object on the same values: the output's own

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        return None  # the backward is the identity: it keeps nothing

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def _waited(t: AsyncCollectiveTensor) -> Tensor:
    if t.requires_grad and torch.is_grad_enabled():
        return _Waited.apply(t)
    return t.trigger_wait()
