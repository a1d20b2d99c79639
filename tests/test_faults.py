"""A rank that raises, dies or stays away ends every other rank in a clear error, in bounded time.

Each case runs real gloo ranks (``funcoll.testing.run_ranks``) with a short
process-group timeout. Rank 1 is the faulty one: it raises before the op, exits
(``os._exit``) before it or in the middle of it, or stays away (sleeps past the
timeout, then raises). Rank 0 (and rank 2 at world 3) calls the op and must fail,
not hang, within the process group's timeout and a margin (timed on the rank):

* in eager code its error names funcoll's op and the step that failed (the size
  exchange of a ragged op, or its data collective), and keeps the backend's
  message and type, with checks on (``set_checks(True)``, the suite's setting) and
  off (the default users get);
* no collective is left registered in c10d's work registry after the failure
  (what would make c10d warn of "unwaited collective calls" at exit);
* inside a compiled step, under ``set_checks(True)``, the header exchange's
  ``funcoll::wait`` names the op and the step as eager code does, whether rank 1
  dies or stays away before the forward; a failure at a data collective (rank 1
  dies between forward and backward), and any failure with checks off, surfaces
  as the backend's own error, within the same bound: the data collectives keep
  the bare ``wait_tensor``, which inductor moves (docs/errors.md, "Faults").

The fault in the middle of an op is injected by a dispatch mode on rank 1 that
lets the first `n` functional collectives of the op through and exits the process
at the next one: the collectives themselves are real.

Last, a short program (``tests/_at_exit.py``) runs under torchrun: public ops, eager
and compiled, and funcoll's errors raised mid-op, after which its ranks exit normally
and c10d must not warn of "unwaited collective calls".
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _torchrun import torchrun
from torch.utils._python_dispatch import TorchDispatchMode

import funcoll
from funcoll.testing import RankError, run_ranks

PG_TIMEOUT_S = 3.0  # the process group's timeout: what a rank that stays away costs
BOUND_S = 40.0  # the whole run: start-up, the timeout, compile time and run_ranks' own grace
# A survivor's op alone, timed on the rank: the process group's timeout at most, and a margin.
SURVIVOR_MAX_S = PG_TIMEOUT_S + 5.0


class _ExitAtCollective(TorchDispatchMode):
    """Exit the process (code 7) when the op issues its (`after` + 1)-th functional collective."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.left = after

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] != "wait_tensor":
            if self.left == 0:
                os._exit(7)
            self.left -= 1
        return func(*args, **(kwargs or {}))


def _ragged(rank: int) -> torch.Tensor:
    return torch.arange(3.0 * (rank + 1)).view(rank + 1, 3)


OPS: dict[str, Callable[[int, int], Any]] = {
    "all_gather": lambda rank, world: funcoll.all_gather(torch.ones(2, 3)),
    "all_reduce": lambda rank, world: funcoll.all_reduce(torch.ones(4)),
    "gather": lambda rank, world: funcoll.gather(_ragged(rank)),
    "all_to_all_v": lambda rank, world: funcoll.all_to_all_v(_ragged(rank), [rank + 1] + [0] * (world - 1)),
    "gather_padded": lambda rank, world: funcoll.gather_padded(torch.ones(4, 2), rank + 1),
}


def _step(x: torch.Tensor) -> torch.Tensor:
    return funcoll.gather(x * 2) + 1


def _prepare(rank: int, world: int, op: str) -> Callable[[], Any]:
    """What every rank does before the fault; returns the call in which the fault must meet the survivor.

    ``compiled:<backend>`` and ``compiled_backward:<backend>``: a compiled step that
    gathers. Every rank first compiles its forward and backward with other lengths, so
    the fault meets the survivor in the compiled step, not while it still compiles
    (which can outlast run_ranks' grace on a busy machine). ``*backward``: every rank
    runs the forward, and the call is the backward.
    """
    kind, _, backend = op.partition(":")
    if kind.startswith("compiled"):
        step = torch.compile(_step, fullgraph=True, backend=backend)
        step(funcoll.mark_ragged(_ragged(world - rank).requires_grad_(), 0)).sum().backward()
        dist.barrier()
        x = funcoll.mark_ragged(_ragged(rank).requires_grad_(), 0)
        if kind == "compiled":
            return lambda: step(x)
        y = step(x)
        return lambda: y.sum().backward()
    if kind == "backward":
        y = funcoll.wait(funcoll.gather(_ragged(rank).requires_grad_()))  # the forward done on every rank
        return lambda: y.sum().backward()
    return lambda: OPS[op](rank, world)


class Survivor(RuntimeError):
    """What a healthy rank raises after its op failed: the failure's timing and what it left behind."""


def _body(rank: int, world: int, op: str, fault: str, checks: bool) -> None:
    funcoll.set_checks(checks)
    dist.barrier()  # every rank connected: the fault strikes in the op, not in gloo's start-up
    call = _prepare(rank, world, op)
    if rank == 1:
        if fault == "raises":
            raise ValueError("rank 1 fails before the op")
        if fault == "exits":
            os._exit(3)
        if fault == "stays_away":
            time.sleep(PG_TIMEOUT_S + 2.0)
            raise ValueError("rank 1 never called the op")
        with _ExitAtCollective(int(fault.removeprefix("exits_after_"))):
            funcoll.wait(call())
        raise AssertionError("rank 1 should have exited in the op")
    start = time.monotonic()
    try:
        funcoll.wait(call())  # an eager result waits at first use: the failure surfaces there
    except RuntimeError as e:
        left = torch._C._distributed_c10d._get_work_registry_size()
        raise Survivor(f"survivor after {time.monotonic() - start:.1f}s, in flight {left}") from e
    raise AssertionError(f"rank {rank}: the op returned although rank 1 failed")


def _run(op: str, fault: str, world: int = 2, checks: bool = True) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_body, world, op, fault, checks, timeout=BOUND_S, pg_timeout=PG_TIMEOUT_S)
    return str(info.value), time.monotonic() - start


def _survivors(message: str, world: int) -> dict[int, str]:
    """Each healthy rank's report (its traceback, the backend's error and funcoll's), by rank.

    Each must have failed in its op within the process group's timeout and a margin
    (measured on the rank, around the op alone), and left no collective registered.
    """
    parts = re.split(r"^rank (\d+) of \d+ raised:$", message, flags=re.M)
    reports = {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}
    healthy = [r for r in range(world) if r != 1]
    missing = [r for r in healthy if r not in reports or "Survivor: survivor after" not in reports[r]]
    assert not missing, f"ranks {missing} did not fail with their op's error:\n{message}"
    for r in healthy:
        took = float(re.findall(r"Survivor: survivor after ([0-9.]+)s", reports[r])[0])
        assert took < SURVIVOR_MAX_S, f"rank {r} failed after {took:.1f}s, beyond {SURVIVOR_MAX_S:.0f}s"
        assert "in flight 0" in reports[r], f"rank {r} left collectives registered:\n{reports[r]}"
    return {r: reports[r] for r in healthy}


def _funcoll_error(report: str) -> str:
    found = re.findall(r"^(?:RuntimeError|DistBackendError): (funcoll\..*)$", report, flags=re.M)
    assert found, f"no funcoll-named error:\n{report}"
    return found[0]


CHECKED, UNCHECKED = True, False
CASES = [
    ("all_gather", "raises", CHECKED, "funcoll.all_gather: the all_gather in the cross-rank check on group"),
    # Checked, every data collective first exchanges a header of its own (what it is).
    ("all_gather", "exits_after_1", CHECKED, "funcoll.all_gather: the all_gather in the collective check on group"),
    ("all_reduce", "exits_after_1", CHECKED, "funcoll.all_reduce: the all_gather in the collective check on group"),
    # An even op with checks off (the default): its one collective, a peer that stays away.
    ("all_reduce", "stays_away", UNCHECKED, "funcoll.all_reduce: the all_reduce on group"),
    ("gather", "exits", CHECKED, "funcoll.gather: the all_gather in the size exchange on group"),
    ("gather", "stays_away", CHECKED, "funcoll.gather: the all_gather in the size exchange on group"),
    ("gather", "exits_after_1", CHECKED, "funcoll.gather: the all_gather in the collective check on group"),
    # A ragged op with checks off: its size exchange goes first all the same.
    ("all_to_all_v", "exits_after_1", UNCHECKED, "funcoll.all_to_all_v: the all_to_all on group"),
    ("gather_padded", "raises", CHECKED, "funcoll.gather_padded: the all_gather in the counts exchange on group"),
    ("backward", "exits", CHECKED, "funcoll.gather (backward): the all_gather in the collective check on group"),
    # A compiled step (checks on): rank 1 dies before it, raises and stays away, or dies
    # between its forward and backward.
    ("compiled:aot_eager", "stays_away", CHECKED, "funcoll.gather: the all_gather in the size exchange on group"),
    ("compiled:inductor", "exits", CHECKED, "funcoll.gather: the all_gather in the size exchange on group"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("op", "fault", "checks", "names"),
    CASES,
    ids=[f"{o}-{f}" + ("" if c else "-unchecked") for o, f, c, _ in CASES],
)
def test_op_fails_naming_funcoll_op(op: str, fault: str, checks: bool, names: str) -> None:
    message, took = _run(op, fault, checks=checks)
    assert took < BOUND_S, f"the failure took {took:.0f}s"
    error = _funcoll_error(_survivors(message, 2)[0])
    assert error.startswith(names) and "The backend said: " in error, error
    # With checks off the survivors are told how to get funcoll's own error instead.
    assert ("funcoll.set_checks(True) or FUNCOLL_CHECKS=1" in error) == (not checks), error
    if fault == "stays_away":
        assert "Timed out" in error, error
        assert "ValueError: rank 1 never called the op" in message, message
    if fault.startswith("exits"):
        assert "rank 1 of 2 died without a result (exit code " in message, message


def test_every_healthy_rank_fails_at_world_3() -> None:
    message, took = _run("gather", "exits_after_1", world=3)
    assert took < BOUND_S
    for r, report in _survivors(message, 3).items():
        assert _funcoll_error(report).startswith(
            "funcoll.gather: the all_gather in the collective check on group"
        ), r


@pytest.mark.parametrize(
    ("op", "checks"),
    [("compiled:aot_eager", UNCHECKED), ("compiled_backward:inductor", CHECKED)],
    ids=["forward-unchecked", "backward-checked"],
)
def test_compiled_data_collective_fails_with_the_backends_error(op: str, checks: bool) -> None:
    """A compiled graph's data collectives keep the bare wait_tensor (movable), checked or not.

    Checked, each is preceded by its own header exchange, waited by ``funcoll::wait``:
    a peer that died fails that exchange first, named.
    """
    message, took = _run(op, "exits", checks=checks)
    assert took < BOUND_S, f"the failure took {took:.0f}s"
    report = _survivors(message, 2)[0]
    assert "Connection" in report or "Timed out" in report, report
    named = re.findall(r"^(?:RuntimeError|DistBackendError): (funcoll\..*)$", report, flags=re.M)
    if checks:
        assert named and "the all_gather in the collective check" in named[0], report
    else:
        assert not named, report
    assert "rank 1 of 2 died without a result (exit code 3)" in message


def test_no_unwaited_collective_at_exit() -> None:
    """tests/_at_exit.py under torchrun: public ops, eager and compiled, and errors raised mid-op.

    Its ranks exit as a program does (a forked ``run_ranks`` rank ends in ``os._exit``
    and skips it), so c10d's exit check runs and would print "unwaited collective
    calls" to stderr for any collective funcoll issued and never waited.
    """
    out, err = torchrun([str(Path(__file__).with_name("_at_exit.py"))], 2, timeout=BOUND_S * 3)
    for r in range(2):
        line = f"rank {r}: done, errors ['funcoll.gather', 'funcoll.gather_padded'], 0 in flight"
        assert line in out, out
    assert "unwaited" not in err, err[-3000:]
