"""With funcoll.set_checks(True) the even ops compile with their check, and it raises in compiled code.

The check is an all_gather of a header and a custom op that reads it on the host
(``funcoll::host_ints``); nothing downstream uses its output but a runtime assert
funcoll ties to it, so the graph must be seen to keep it. On 2 gloo ranks each even op compiles with ``fullgraph=True`` on a
backend that records its forward graph (and on inductor for all_gather): ranks that
agree get what the unchecked eager op gives, and the graph holds one more
all_gather and the host read; ranks that disagree raise the same ``ValueError``
as eager, on every rank. The static ops, checked, read their counts header on the
host (``funcoll::check_counts``) instead of asserting on the device, and raise the
same ``ValueError`` compiled as eager. Checked, every data collective follows a
header of its own that says what it is (``funcoll::check_table`` reads it), so
that ranks whose graphs issue different collectives raise instead of pairing
them. The header exchanges are waited by ``funcoll::wait``, which carries the
op's name for a failure's message (tests/test_faults.py runs the failures), and
every data collective by the bare ``wait_tensor`` that inductor's overlap passes move.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _ops import AG, collective_counts, recording_backend, run_batch

import funcoll

WORLD = 2


def _z(rank: int, *shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 100 * rank


# op -> call(rank) on inputs every rank agrees on
AGREEING: dict[str, Callable[[int], Any]] = {
    "all_gather": lambda r: funcoll.all_gather(_z(r, 2, 3), 1),
    "all_gather_into_tensor": lambda r: funcoll.all_gather_into_tensor(_z(r, 3)),
    "reduce_scatter": lambda r: funcoll.reduce_scatter(_z(r, 4, 2)),
    "all_reduce": lambda r: funcoll.all_reduce(_z(r, 3), op="max"),
    "all_to_all": lambda r: funcoll.all_to_all(_z(r, 2, 4, 2 - r), None, 1, 2, gather_sizes=[2, 1]),
    "ppermute": lambda r: funcoll.ppermute(_z(r, 3), [(0, 1), (1, 0)]),
    "broadcast": lambda r: funcoll.broadcast(_z(r, 3), src=1),
    "reduce": lambda r: funcoll.reduce(_z(r, 3), dst=1, op="max"),
    "scatter": lambda r: funcoll.scatter(_z(r, 3 - 2 * r, 2), 0, sizes=[2, 1]),
    "split_forward_gather_backward": lambda r: funcoll.split_forward_gather_backward(_z(0, 5), None, 0),
}
# The static ops with checks on: the counts header goes first and is read on the host
# (``funcoll::check_counts``) instead of a device-side assert.
STATIC: dict[str, Callable[[int], Any]] = {
    "gather_padded": lambda r: funcoll.gather_padded(_z(r, 4, 3), torch.tensor(r + 1)),
    "all_to_all_padded": lambda r: funcoll.all_to_all_padded(_z(r, 4, 3), torch.tensor([1, 2 - r])),
}
# Ops whose collective results some rank drops: gather's non-destination ranks, and a
# step that calls an op for its side effect alone. Every rank must still issue and
# wait for the same collectives (the graph's waits are never dead code).
DROPPED: dict[str, Callable[[int], Any]] = {
    "gather-dst0": lambda r: funcoll.gather(_z(r, 1 + r, 3), dst=0),
    "all_reduce-unused": lambda r: (funcoll.all_reduce(_z(r, 3)), _z(r, 2))[1],
    "reduce-dst0": lambda r: funcoll.reduce(_z(r, 3), dst=0),  # rank 1's all_reduce result is unused
}
# Ranks that disagree, each way a checked op finds out: the even ops' header, the
# static ops' counts (rank 1's above the bound) and shapes.
MISMATCHES: dict[str, Callable[[int], Any]] = {
    "all_gather": lambda r: funcoll.all_gather(_z(r, 2 + r, 3)),
    "gather_padded-counts": lambda r: funcoll.gather_padded(_z(r, 4, 3), torch.tensor(1 + 4 * r)),
    "gather_padded-shape": lambda r: funcoll.gather_padded(_z(r, 4, 3 + r), torch.tensor(1)),
    "all_to_all_padded-counts": lambda r: funcoll.all_to_all_padded(
        _z(r, 4, 3), torch.tensor([1, 1 + 2 * r])
    ),
}
EAGER_ERRORS = {
    "all_gather": "funcoll.all_gather: ranks disagree on the shape of `x`",
    "gather_padded-counts": "funcoll.gather_padded: rank 1's `length` 5 is outside [0, 4] = [0, x.shape[dim]]",
    "gather_padded-shape": "funcoll.gather_padded: ranks disagree on `x` (rank 0: 2-d float32 (4, 3), dim 0; "
    "rank 1: 2-d float32 (4, 4), dim 0)",
    "all_to_all_padded-counts": "funcoll.all_to_all_padded: rank 1's `send_sizes` [1, 3] is outside [0, 2]",
}


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    except Exception:  # noqa: BLE001 -- anything but funcoll's ValueError is a failure
        return "wrong error: " + traceback.format_exc(limit=-4)
    return "no error"


def _one(rank: int, world: int, key: str) -> dict[str, Any]:
    torch._dynamo.reset()
    out: dict[str, Any] = {}
    if key.startswith("mismatch:"):
        bad = MISMATCHES[key.removeprefix("mismatch:")]
        with funcoll.set_checks(True):
            out["eager"] = _error(lambda: bad(rank))
            for backend in ("aot_eager", "inductor"):
                torch._dynamo.reset()
                fn = torch.compile(lambda: bad(rank), fullgraph=True, backend=backend)
                out[backend] = _error(fn)
        return out
    call = {**AGREEING, **STATIC, **DROPPED}[key]
    out["unchecked"] = call(rank)
    graphs: dict[str, Any] = {}
    with funcoll.set_checks(True):
        out["checked"] = torch.compile(
            lambda: call(rank), fullgraph=True, backend=recording_backend(graphs)
        )()
    out["graph"] = graphs["fw"]
    torch._dynamo.reset()
    return out


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_batch(
        _one, WORLD, [*AGREEING, *STATIC, *DROPPED, *(f"mismatch:{k}" for k in MISMATCHES)], timeout=300
    )


@pytest.mark.parametrize("op", list(AGREEING))
def test_checked_op_compiles_with_its_check_and_matches_unchecked(op: str) -> None:
    for rank, res in enumerate(_results()):
        got = res[op]
        torch.testing.assert_close(got["checked"], got["unchecked"], rtol=0, atol=0)
        counts = collective_counts(got["graph"])
        data = 1 if op.startswith("all_gather") else 0  # the op's own all_gather, beside the headers
        # the op's header, then one before each data collective (what it is: check_collective)
        assert counts.get(AG, 0) == data + 1 + counts.get("wait_tensor", 0), f"rank {rank}: {counts}"
        reads = [c["op"] for c in got["graph"] if c["op"].startswith("funcoll.host_ints")]
        assert len(reads) == 1, f"rank {rank}: the header read is not in the graph"
        _waits_name_the_op(got["graph"], counts, op, rank)


def _waits_name_the_op(graph: list[dict[str, Any]], counts: dict[str, int], op: str, rank: int) -> None:
    """Checked: the header exchanges (the op's, and one before each data collective: every
    collective the op issues that is not waited by ``funcoll::wait``) are waited by
    ``funcoll::wait`` carrying the public op's name, and each data collective's header is
    read by ``funcoll::check_table``; every data collective is waited by the bare
    ``wait_tensor`` (movable)."""
    waits = [c["args"] for c in graph if c["op"].startswith("funcoll.wait")]
    issued = sum(n for name, n in counts.items() if name != "wait_tensor")
    data = counts.get("wait_tensor", 0)
    checks = [c for c in graph if c["op"].startswith("funcoll.check_table")]
    assert len(checks) == data, f"rank {rank}: {len(checks)} collective checks, {data} data: {counts}"
    assert len(waits) == issued - data, f"rank {rank}: {len(waits)} named waits: {counts}"
    # funcoll::wait(result, sent, op, collective, group, step): `sent` keeps the input's buffer
    # until the wait (inductor gave it to the next header while gloo still sent it)
    assert all(args[2] == op for args in waits), f"rank {rank}: {[args[2:] for args in waits]}"


@pytest.mark.parametrize("op", list(STATIC))
def test_checked_static_op_reads_its_counts_on_the_host(op: str) -> None:
    for rank, res in enumerate(_results()):
        got = res[op]
        torch.testing.assert_close(got["checked"], got["unchecked"], rtol=0, atol=0)
        calls = [c["op"] for c in got["graph"]]
        assert sum(c.startswith("funcoll.check_counts") for c in calls) == 1, f"rank {rank}: {calls}"
        assert not any("assert_async" in c for c in calls), f"rank {rank}: a device assert is left: {calls}"
        _waits_name_the_op(got["graph"], collective_counts(got["graph"]), op, rank)


@pytest.mark.parametrize("op", list(DROPPED))
def test_checked_collective_whose_result_a_rank_drops_is_still_waited(op: str) -> None:
    for rank, res in enumerate(_results()):
        got = res[op]
        torch.testing.assert_close(got["checked"], got["unchecked"], rtol=0, atol=0)
        counts = collective_counts(got["graph"])
        assert sum(n for name, n in counts.items() if name != "wait_tensor") >= 1, f"rank {rank}: {counts}"
        _waits_name_the_op(got["graph"], counts, op.split("-")[0], rank)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_checked_mismatch_raises_in_compiled_code_as_in_eager(case: str) -> None:
    for rank, res in enumerate(_results()):
        got = res[f"mismatch:{case}"]
        assert got["eager"].startswith(EAGER_ERRORS[case]), got["eager"]
        for backend in ("aot_eager", "inductor"):
            assert got[backend] == got["eager"], f"rank {rank} {backend}: {got[backend]}"
