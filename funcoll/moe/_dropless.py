"""The :class:`Dropless` policy: static dispatches with one overflow check a step, exact on an overflow."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor

from .._base._group import GroupLike, resolve_group
from .._ops import _even
from ._layout import is_int

_R = TypeVar("_R")


class Dropless:
    """Dropless dispatch with static shapes while the routing fits, and one host read per step.

    Pass the policy as every dispatch's `mode` and run the forward through
    :meth:`run`. Inside it, each ``dispatch(..., mode=policy)`` is a static
    dispatch with ``policy.capacity`` rows per (source, destination) block (no
    host read, static shapes: the compiled graph of the steady state) and keeps,
    on the device, the largest capacity any of them needed (``handle.needed``).
    After the forward, :meth:`run` takes the maximum over the group (one
    ``all_reduce`` of one int64) and reads it on the host: the step's one
    device-to-host sync, whatever the number of MoE layers. Every rank reads the
    same value, so every rank takes the same path:

    - it fits (``needed <= capacity``): nothing was dropped; the forward's result
      is returned.
    - it overflowed: the forward runs again with every dispatch in exact mode (one
      host read per dispatch on that step only), its result is returned, and with
      `grow` the capacity becomes the smallest power of two ``>= needed``, so that
      the steps after it fit again (a compiled forward compiles once per capacity
      it meets: at most ``log2(T * k)`` times, plus once for exact mode).

    The forward must be one that may run twice: it returns what the step needs
    (a loss, outputs) and leaves the optimizer step to the caller. The random
    number generators (CPU, and the current CUDA device's) are restored before it
    runs again, so dropout draws the same masks. With `state`, the buffers of
    those modules (a load-balancing counter, batch norm's running statistics)
    are copied before the forward and put back before it runs again, so that an
    overflowed step updates them once, as a step that fit does; the copy costs
    one clone of those buffers per step. Side effects outside them (a Python
    counter, a cache written elsewhere) happen twice on an overflowed step.
    ``policy.replays`` counts the steps that ran twice, ``policy.needed`` is the
    last step's agreed need.

    Inside one module: a model whose step's forward is not the caller's to wrap
    (a framework's MoE layer) can run the policy around the layer's own dispatch,
    experts and combine, ``policy.run(self._routed, x, ...)`` in its forward; only
    that part runs again after an overflow, and the policy reads the host once per
    layer instead of once per step. Eager only: the read is a graph break. Where
    not even the layer's experts can be wrapped (a framework's token dispatcher),
    :func:`dispatch`'s ``mode="dropless"`` decides per dispatch and redoes only the
    dispatch: nothing reruns.

    Args:
        capacity: the static capacity to start with (rows per block, the same on
            every rank), e.g. ``ceil(1.25 * T * k / world)``.
        group: the group whose ranks agree on the overflow: every rank that runs
            the forward (default: the default group).
        grow: grow the capacity after an overflow (default True).
        state: a module, or modules, whose buffers the forward updates: restored
            before a replay (default: none).

    Example (2 ranks)::

        policy = Dropless(capacity=2)
        def forward(x, idx, w):
            recv, handle = dispatch(x, idx, 4, mode=policy)
            return combine(recv, handle, w)
        # rank 0: x = [[1.], [2.], [3.]], idx = [[0], [1], [0]]: 3 pairs to rank 0
        # rank 1: x = [[4.]], idx = [[2]], w = ones
        out = policy.run(forward, x, idx, w)   # rank 0: [[1.], [2.], [3.]]   rank 1: [[4.]]
        policy.replays, policy.capacity        # both: (1, 4): rank 0 needed 3 > 2
    """

    def __init__(
        self,
        capacity: int,
        *,
        group: GroupLike = None,
        grow: bool = True,
        state: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
    ) -> None:
        if not is_int(capacity):
            raise TypeError(f"funcoll.moe.Dropless: `capacity` must be an int, got {type(capacity).__name__}")
        if capacity < 0:
            raise ValueError(f"funcoll.moe.Dropless: `capacity`={capacity} must be >= 0 (rows per block)")
        resolve_group("funcoll.moe.Dropless", group)  # a bad group is refused here, not after a forward
        modules = [state] if isinstance(state, torch.nn.Module) else list(state or ())
        for m in modules:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(
                    f"funcoll.moe.Dropless: `state` must be a torch.nn.Module or modules, got {type(m).__name__}"
                )
        self.state = modules
        self.capacity = capacity
        self.group = group
        self.grow = bool(grow)
        self.replays = 0
        self.needed: int | None = None
        self._active = False  # inside run()
        self._exact = False  # the second run of an overflowed step
        self._need: Tensor | None = None  # the largest need of this run's dispatches, on the device

    def __repr__(self) -> str:
        return f"Dropless(capacity={self.capacity}, grow={self.grow}, replays={self.replays})"

    def run(self, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """``fn(*args, **kwargs)`` with every ``dispatch(..., mode=self)`` in it dropless (see the class)."""
        opname = "funcoll.moe.Dropless.run"
        if self._active:
            raise RuntimeError(f"{opname}: already running: a policy's forward cannot run it again inside")
        rng = _rng_state()
        buffers = [b for m in self.state for b in m.buffers()]
        saved = [b.detach().clone() for b in buffers]  # what a replay puts back
        self._active, self._need = True, None
        try:
            out = fn(*args, **kwargs)
            need = self._need
        finally:
            self._active, self._need = False, None
        if need is None:
            raise ValueError(f"{opname}: `fn` made no dispatch with mode=this policy: nothing to check")
        agreed = _even.all_reduce(need, group=self.group, op="max")
        # Every rank learns whether any dispatch of any rank overflowed.
        self.needed = int(agreed.item())  # device-to-host sync: the one of a step
        if self.needed <= self.capacity:
            return out
        del out  # the dropped forward's graph goes before the exact one is built
        self.replays += 1
        if self.grow:
            self.capacity = 1 << (self.needed - 1).bit_length()
        _set_rng_state(rng)
        with torch.no_grad():
            for b, old in zip(buffers, saved, strict=True):
                b.copy_(old)
        self._active, self._exact = True, True
        try:
            return fn(*args, **kwargs)
        finally:
            self._active, self._exact = False, False

    def _mode(self, opname: str, capacity: object) -> tuple[str, int | None]:
        """The mode and capacity a dispatch (`opname`) with ``mode=self`` runs with."""
        if not self._active:
            raise ValueError(
                f"{opname}: `mode`={self!r} dispatches inside policy.run(forward, ...), which checks the "
                f"overflow after the forward; called outside it"
            )
        if capacity is not None:
            raise ValueError(f"{opname}: `capacity`={capacity} is the policy's own with mode=Dropless")
        return ("exact", None) if self._exact else ("static", self.capacity)

    def _record(self, needed: Tensor) -> None:
        self._need = needed if self._need is None else torch.maximum(self._need, needed)


def _rng_state() -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
