"""funcoll's one run-time switch: cross-rank checks before the data moves.

The even ops need to exchange nothing: every rank must pass the same shape, and a
rank that does not makes the backend abort the process (gloo: "Received data size
doesn't match expected size") or hang (NCCL). A checked call first all-gathers
the same small header and raises the same ``ValueError`` on every rank when the
ranks disagree, at the price of one small collective and one device-to-host read.

Three settings:

- the default (``set_checks(None)``, ``FUNCOLL_CHECKS`` unset): eager calls
  number 1, 2, 4, 8, ... of each even op on each group are checked
  (:func:`check_due`). The mistakes that kill a rank (a length, a shape or a
  dtype that differs between ranks) show on the first calls, and steady state
  pays for log2(calls) checks: 10 in 1,000 calls. Every rank counts the same calls
  of the same op on the same group, so every rank checks the same calls and the
  extra exchanges pair up. The calls in between carry a fingerprint of the call
  in their data's own collective when their payload is on the CPU
  (:mod:`funcoll._collective._fingerprint`): ranks that disagree there raise the
  same kind of ``ValueError`` before any rank hands out the data. Compiled code is not checked by default (a check in a
  graph would run on every call), and once a compiled graph holding such an op
  has run, no eager call is either: a rank whose frame falls back to eager
  (dynamo's recompile limit) must issue what the compiled ranks issue;
- on (``set_checks(True)``, ``FUNCOLL_CHECKS=1``): every call, eager or compiled,
  and every collective that carries data (below);
- off (``set_checks(False)``, ``FUNCOLL_CHECKS=0``): none.

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

Checks start at the default, on when the environment says ``FUNCOLL_CHECKS=1``
and off when it says ``FUNCOLL_CHECKS=0``. A compiled region reads the switch when
it is traced and is traced again when it changes (dynamo guards on it), so set it
outside compiled code.
"""

from __future__ import annotations

import os
from types import TracebackType

import torch

__all__ = ["check_due", "checks_enabled", "fingerprints", "set_checks"]

# True: every call; False: none; None: the default, eager calls 1, 2, 4, 8, ... (check_due).
_enabled: bool | None = {"1": True, "0": False}.get(os.environ.get("FUNCOLL_CHECKS", ""))
# Eager calls so far of each (op, group name): the same numbers on every rank of the group.
_calls: dict[tuple[str, str], int] = {}
# Whether this process has run a compiled graph that holds a checkable op (set where it runs).
_compiled = False


def checks_enabled() -> bool:
    """Whether every call checks across ranks that their shapes and arguments agree (``set_checks(True)``).

    False at the default, which checks an op's first calls on each group and then
    calls 4, 8, 16, ... (see :func:`funcoll.set_checks`), and with checks off.
    """
    return _enabled is True


def fingerprints() -> bool:
    """Whether an eager call that :func:`check_due` leaves unchecked sends a fingerprint with its data.

    At the default setting, until the process first runs a compiled graph holding a
    checkable op: after that, a rank whose frame falls back to eager must send
    exactly what the compiled ranks send (``funcoll._collective._fingerprint``).
    """
    return _enabled is None and not _compiled


def check_due(key: str, group_name: str) -> bool:
    """Whether this call of op `key` on the group `group_name` exchanges its cross-rank check header.

    Checks on: every call. Off: none. The default: eager calls number 1, 2, 4, 8,
    ... of each op on each group, until the process first runs a compiled graph
    that holds one of these ops. A group's ranks call its ops in the same order (a
    rank that does not already pairs mismatched collectives), so they count alike
    and check the same calls. Compiled code is not checked by default, and once it
    has run, no eager call is: a rank whose compiled frame falls back to eager
    (dynamo's recompile limit, reached on one rank and not on the others) must
    issue what the compiled ranks issue.
    """
    global _compiled
    if _enabled is not None:
        return _enabled
    if torch.compiler.is_compiling():
        _compiled = True  # a global store in traced code: dynamo makes it when the graph has run
        return False
    if _compiled:
        return False
    n = _calls[key, group_name] = _calls.get((key, group_name), 0) + 1
    return n & (n - 1) == 0


class set_checks:
    """Turn the cross-rank checks on or off, or back to the default; usable as a context manager.

    By default an even op's first eager calls on each group are checked, then
    calls 4, 8, 16, ...: a length, shape or dtype that differs between ranks
    raises funcoll's ``ValueError`` on every rank instead of aborting one, and
    1,000 calls pay for 10 checks. Compiled code is not checked by default, and
    once it has run no eager call is (a rank that falls back to eager must issue
    what the compiled ranks issue). ``funcoll.set_checks(True)`` checks every call,
    eager and compiled, and every collective that carries data, for the rest of
    the process; ``set_checks(False)`` checks none; ``set_checks(None)`` restores
    the default. ``with funcoll.set_checks(True): ...`` sets it for a block,
    restoring the previous setting when it exits. Compiled with checks on, a
    fault (a peer that died or stayed away) names the op as in eager code, at the
    price of one copy of each collective's result. See docs/index.md, Checks, and
    docs/errors.md, Faults.

    Args:
        enabled: True to check every call, False none, None the default (the
            first calls of each op and group, then calls 2^k).

    Example (2 ranks)::

        # rank 0: x of shape (2, 3)      rank 1: x of shape (3, 3)
        with funcoll.set_checks(True):
            funcoll.all_gather(x)
        # both ranks: ValueError: funcoll.all_gather: ranks disagree on the shape of `x` ...
        # (unchecked, gloo aborts the process; NCCL hangs)
    """

    def __init__(self, enabled: bool | None) -> None:
        global _enabled
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(
                f"funcoll.set_checks: `enabled` must be a bool or None, got {type(enabled).__name__}"
            )
        self._previous = _enabled
        _enabled = enabled

    def __enter__(self) -> set_checks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _enabled
        _enabled = self._previous
