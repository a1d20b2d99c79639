"""funcoll's one run-time switch: cross-rank checks before the data moves.

The even ops exchange nothing: every rank must pass the same shape, and a rank
that does not makes the backend abort the process (gloo: "Received data size
doesn't match expected size") or hang (NCCL). With checks on, every even op
first all-gathers the same small header and raises the same ``ValueError`` on
every rank when the ranks disagree, at the price of one small collective and one
device-to-host read per call.

The ragged ops exchange a header whenever they need the sizes, and it doubles
as that check. When the caller passes the sizes (``sizes=`` on the gathers and
the ragged reduce_scatter) nothing needs exchanging: checks on send the header
anyway, so that ranks whose sizes or shapes differ raise (all_to_all_v's
``recv_sizes`` are not checked across ranks either way). The static ops
(gather_padded, all_to_all_padded) send their counts header in the data's own
collective and check it with a device-side assert, which on CUDA surfaces
asynchronously without funcoll's words; checks on send it first, on its own,
and read it on the host (one device-to-host sync per call), so that bad counts
and ranks whose shapes differ raise funcoll's ``ValueError`` on every rank,
naming the rank and the value, before any data moves.

Compiled code with checks on waits for each header exchange with ``funcoll::wait``
(``_faults.checked_wait``) instead of the bare ``wait_tensor``, so that a rank that died or
stayed away before the op fails the step with the op's name, as in eager code.
The data collectives keep the bare ``wait_tensor`` (inductor's passes move it), and
their input depends on the check's host read (``_header.check_agreement``: one pass
over the payload), so that no pass issues them before the check.

Checks start off, or on when the environment says ``FUNCOLL_CHECKS=1``. A
compiled region reads the switch when it is traced and is traced again when it
changes (dynamo guards on it), so set it outside compiled code.
"""

from __future__ import annotations

import os
from types import TracebackType

__all__ = ["checks_enabled", "set_checks"]

_enabled = os.environ.get("FUNCOLL_CHECKS", "0") == "1"


def checks_enabled() -> bool:
    """Whether the even ops check across ranks that their shapes and arguments agree."""
    return _enabled


class set_checks:
    """Turn the cross-rank checks of the even ops on or off; usable as a context manager.

    ``funcoll.set_checks(True)`` turns them on for the rest of the process;
    ``with funcoll.set_checks(True): ...`` for a block, restoring the previous
    setting when it exits. Compiled with checks on, a fault (a peer that died
    or stayed away) names the op as in eager code, at the price of one copy of
    each collective's result. See docs/index.md, Checks, and docs/errors.md,
    Faults.

    Args:
        enabled: True to check, False not to.

    Example (2 ranks)::

        # rank 0: x of shape (2, 3)      rank 1: x of shape (3, 3)
        with funcoll.set_checks(True):
            funcoll.all_gather(x)
        # both ranks: ValueError: funcoll.all_gather: ranks disagree on the shape of `x` ...
        # (unchecked, gloo aborts the process; NCCL hangs)
    """

    def __init__(self, enabled: bool) -> None:
        global _enabled
        if not isinstance(enabled, bool):
            raise TypeError(f"funcoll.set_checks: `enabled` must be a bool, got {type(enabled).__name__}")
        self._previous = _enabled
        _enabled = enabled

    def __enter__(self) -> set_checks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _enabled
        _enabled = self._previous
