"""A collective that fails in eager code says which funcoll op issued it.

When a rank of a group dies, raises before an op, or never calls it, every
other rank's next collective fails in the backend: gloo raises at once when the
dead rank's connections close ("Connection closed by peer"), and after the
process group's `timeout` when a live rank stays away ("Timed out waiting").
The backend's message names neither the op nor the step, so in eager code the
public op records its name (:func:`public_op`) and :func:`failed` re-raises the
backend's error, of the same type, with the op, the collective, the step (the
size exchange or the data) and the group in front of the backend's message.

Inside a compiled graph the collectives run from generated code, where no
funcoll frame is left to name them. By default the backend's error surfaces from
the compiled function as it is (docs/errors.md, "Faults"), and the graph keeps
the bare ``wait_tensor`` that inductor schedules around. Under
``funcoll.set_checks(True)`` the public op's name is kept while it is traced
(:func:`traced_op`) and the wait of each header exchange (the cross-rank check,
the size exchange) is the custom op ``funcoll::wait`` (:func:`wait`), which waits,
re-raises a failure as :func:`failed` does in eager code, and returns a copy of
the header (a custom op may not return its input): a few ints, which the host
reads next anyway. The data collectives keep the bare ``wait_tensor``, so that
inductor's passes move their waits past independent work as in an unchecked
graph; a failure there surfaces as the backend's error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from .._base._config import checks_enabled

__all__ = [
    "checked_wait",
    "current_op",
    "failed",
    "mark_unchecked",
    "public_op",
    "remember",
    "traced_op",
    "unchecked",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# The public op now running in eager code (the outermost one: an op built on
# another, like the region ops on gather, reports its own name).
_OP: ContextVar[str | None] = ContextVar("funcoll_op", default=None)

# What the eager op now running was called with, if that call exchanged no header at
# the default setting (``mark_unchecked``): its data collectives then carry a
# fingerprint of it (``_fingerprint``). Reset with `_OP` when the outermost op returns.
_UNCHECKED: ContextVar[tuple[str, str] | None] = ContextVar("funcoll_unchecked", default=None)

# The public ops being traced, outermost first, under set_checks(True) only. Dynamo
# tracks the appends and pops as side effects of the traced frame (the list is
# empty again after each op), and `traced_op` reads the name as a constant.
_TRACED: list[str] = []

# Every public op's name, in the order funcoll defines them: the same on every rank, so
# a header can carry an op as its position here (`op_code`).
OP_NAMES: list[str] = []


def public_op(name: str) -> Callable[[_F], _F]:
    """Decorate the public op `name`: in eager code its collectives' failures name it."""

    def decorate(fn: _F) -> _F:
        if name not in OP_NAMES:
            OP_NAMES.append(name)

        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                if _TRACED or not checks_enabled():
                    return fn(*args, **kwargs)
                _TRACED.append(name)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _TRACED.pop()
            if _OP.get() is not None:
                return fn(*args, **kwargs)
            token, unchecked = _OP.set(name), _UNCHECKED.set(None)
            try:
                return fn(*args, **kwargs)
            finally:
                _UNCHECKED.reset(unchecked)
                _OP.reset(token)

        op.funcoll_op = name  # type: ignore[attr-defined]  # what tests/test_specs.py looks for
        return op  # type: ignore[return-value]

    return decorate


def remember(ctx: Any) -> None:
    """Keep the running op's name on an autograd node (`ctx`), for its backward's failures."""
    if not torch.compiler.is_compiling():
        ctx.funcoll_op = _OP.get()


def mark_unchecked(call: str, shown: str) -> None:
    """Say that the eager op now running checks nothing across ranks on this call (the default's unchecked calls).

    `call` is what the header would have compared (the op's arguments that must
    agree, as text), `shown` how an error shows this rank's call. Every rank of the
    group makes the same call unchecked (``check_due`` counts alike), so every
    rank's data collectives of this call carry a fingerprint, or none do. Outside
    an op (a backward) it does nothing.
    """
    if _OP.get() is not None:
        _UNCHECKED.set((call, shown))


def unchecked() -> tuple[str, str] | None:
    """What the eager op now running passed to :func:`mark_unchecked` on this call, None if it did not."""
    return _UNCHECKED.get()


def traced_op() -> str:
    """The public op being traced (under set_checks(True)), or "" outside any."""
    return _TRACED[0] if _TRACED else ""


def op_code() -> int:
    """The public op running (eager) or being traced (under checks), as its position in OP_NAMES; -1 if none."""
    name = traced_op() if torch.compiler.is_compiling() else _OP.get()
    if name is None and not torch.compiler.is_compiling():
        name = getattr(torch._C._current_autograd_node(), "funcoll_op", None)
    return OP_NAMES.index(name) if name in OP_NAMES else -1


def _op_name(traced: str | None = None, issued_by: str | None = None) -> str:
    """The public op whose collective is running: the eager op, or the op whose backward this is.

    `traced` is the name a compiled graph's ``funcoll::wait`` carries ("" if the
    collective was traced outside a public op); its collective runs in a backward
    when an autograd node is running. `issued_by` is the name read when a
    deferred collective was issued (:func:`current_op`): it wins.
    """
    if issued_by is not None:
        return issued_by
    node = torch._C._current_autograd_node()  # the node whose backward runs, if any
    if traced is not None:
        name = f"funcoll.{traced}" if traced else "funcoll"
        return f"{name} (backward)" if node is not None else name
    op = _OP.get()
    if op is not None:
        return f"funcoll.{op}"
    op = getattr(node, "funcoll_op", None)
    return f"funcoll.{op} (backward)" if op is not None else "funcoll (backward)"


def _where(group_name: str) -> str:
    """``group 'g' (rank r of w)``, or just the name if the group is gone."""
    try:
        pg = torch._C._distributed_c10d._resolve_process_group(group_name)
        return f"group {group_name!r} (rank {pg.rank()} of {pg.size()})"
    except Exception:  # noqa: BLE001 -- only a message is at stake; the name is enough
        return f"group {group_name!r}"


def current_op() -> str:
    """The funcoll op (or backward of one) running now, as a failure names it: read at issue time."""
    return _op_name()


def failed(
    collective: str,
    group_name: str,
    step: str,
    error: RuntimeError,
    traced: str | None = None,
    op: str | None = None,
) -> RuntimeError:
    """The backend's `error` of `collective`, re-made with funcoll's op and step in front.

    The type is kept (gloo raises ``RuntimeError``, NCCL ``DistBackendError``), so
    code that catches the backend's errors still catches it; the original is the
    new one's ``__cause__``. `traced` is the op name a compiled graph carries
    (see :func:`wait`); None in eager code. `op` is the name :func:`current_op`
    read when a deferred collective was issued (``funcoll._collective._async``): its wait
    runs after the op has returned.
    """
    at = f" in {step}" if step else ""
    # With checks off, ranks that passed different shapes or dtypes pair mismatched buffers:
    # the backend aborts one of them and the others end here. Say how to get funcoll's error.
    hint = (
        ""
        if checks_enabled()
        else " Ranks that pass an op different shapes, dtypes or sizes end this way: with "
        "funcoll.set_checks(True) or FUNCOLL_CHECKS=1, every rank raises funcoll's ValueError naming what differs."
    )
    message = (
        f"{_op_name(traced, op)}: the {collective}{at} on {_where(group_name)} failed. The backend said: {error}. "
        f"If that is about a peer (a closed connection, a timeout), a rank of the group died, raised before "
        f"this op, or never called it: find the first error in the other ranks' logs. Otherwise the backend "
        f"refused this rank's tensor (a dtype or device it does not support).{hint}"
    )
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 -- an error type that takes no message: keep the message
        return RuntimeError(message)


@torch.library.custom_op("funcoll::wait", mutates_args=())
def checked_wait(
    x: torch.Tensor, sent: torch.Tensor, op: str, collective: str, group_name: str, step: str
) -> torch.Tensor:
    """Wait for the collective whose output is `x`, naming funcoll's `op` if it failed.

    A compiled graph's wait under ``set_checks(True)``: the collective is issued
    by the graph, this op waits for it (c10d finds the work by `x`), re-raises a
    backend failure as :func:`failed` does in eager code, and returns a copy of
    the result.

    `sent` is the collective's input, unread here: an input of this op, its buffer
    lives until the wait. Inductor keeps a collective's input alive until its
    ``wait_tensor`` (its "out-of-place collective safety"), but it does not know
    this op for a wait: without `sent` it reused the buffer of a header still in
    flight for the next header it computed, once its passes had moved this wait
    down, and the backend sent the next header's values (torchtitan's MoE layer on
    inductor with its overlap passes, on the rank that routed no token).
    """
    try:
        y = torch.ops._c10d_functional.wait_tensor(x)
    except RuntimeError as e:
        raise failed(collective, group_name, step, e, traced=op) from e
    return y.clone()


# Like c10d's wait_tensor: never dead code, even when nothing reads the result (a
# collective whose output a rank drops must still be waited, on every rank alike).
torch.fx.node.has_side_effect(torch.ops.funcoll.wait.default)
torch.fx.node.has_side_effect(torch.ops.funcoll.wait)


@checked_wait.register_fake
def _wait_fake(
    x: torch.Tensor, sent: torch.Tensor, op: str, collective: str, group_name: str, step: str
) -> torch.Tensor:
    return torch.empty_like(x)
