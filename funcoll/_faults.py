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
funcoll frame is left to name them: the backend's error surfaces from the
compiled function as it is (docs/errors.md, "Faults"). Nothing here runs while
compiling, so the graphs are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

__all__ = ["failed", "public_op", "remember"]

_F = TypeVar("_F", bound=Callable[..., Any])

# The public op now running in eager code (the outermost one: an op built on
# another, like the region ops on gather, reports its own name).
_OP: ContextVar[str | None] = ContextVar("funcoll_op", default=None)


def public_op(name: str) -> Callable[[_F], _F]:
    """Decorate the public op `name`: in eager code its collectives' failures name it."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or _OP.get() is not None:
                return fn(*args, **kwargs)
            token = _OP.set(name)
            try:
                return fn(*args, **kwargs)
            finally:
                _OP.reset(token)

        op.funcoll_op = name  # type: ignore[attr-defined]  # what tests/test_specs.py looks for
        return op  # type: ignore[return-value]

    return decorate


def remember(ctx: Any) -> None:
    """Keep the running op's name on an autograd node (`ctx`), for its backward's failures."""
    if not torch.compiler.is_compiling():
        ctx.funcoll_op = _OP.get()


def _op_name() -> str:
    """The public op whose collective is running: the eager op, or the op whose backward this is."""
    op = _OP.get()
    if op is not None:
        return f"funcoll.{op}"
    node = torch._C._current_autograd_node()  # the node whose backward runs, if any
    op = getattr(node, "funcoll_op", None)
    return f"funcoll.{op} (backward)" if op is not None else "funcoll (backward)"


def _where(group_name: str) -> str:
    """``group 'g' (rank r of w)``, or just the name if the group is gone."""
    try:
        pg = torch._C._distributed_c10d._resolve_process_group(group_name)
        return f"group {group_name!r} (rank {pg.rank()} of {pg.size()})"
    except Exception:  # noqa: BLE001 -- only a message is at stake; the name is enough
        return f"group {group_name!r}"


def failed(collective: str, group_name: str, step: str, error: RuntimeError) -> RuntimeError:
    """The backend's `error` of `collective`, re-made with funcoll's op and step in front.

    The type is kept (gloo raises ``RuntimeError``, NCCL ``DistBackendError``), so
    code that catches the backend's errors still catches it; the original is the
    new one's ``__cause__``.
    """
    at = f" in {step}" if step else ""
    message = (
        f"{_op_name()}: the {collective}{at} on {_where(group_name)} failed. The backend said: {error}. "
        f"If that is about a peer (a closed connection, a timeout), a rank of the group died, raised before "
        f"this op, or never called it: find the first error in the other ranks' logs. Otherwise the backend "
        f"refused this rank's tensor (a dtype or device it does not support)."
    )
    try:
        return type(error)(message)
    except Exception:  # noqa: BLE001 -- an error type that takes no message: keep the message
        return RuntimeError(message)
