"""funcoll.testing.run_ranks reports what went wrong, in bounded time.

A rank that raises is reported with its traceback. A rank that dies without a
result, from ``os._exit`` or a signal (a segfault), is reported as dead, with
its exit code or signal, even though its peers, left waiting in a collective,
fail or hang after it. Each case would otherwise end in run_ranks' TimeoutError
(or hang the suite), so a RankError that names the right rank and cause is the
test. ``gloo_worker_threads`` builds the gloo groups made inside its block with
the threads it is given, and only those.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import funcoll
from funcoll.testing import RankError, gloo_worker_threads, print_line, run_ranks, start_ranks

TIMEOUT_S = 60.0


def _fails(rank: int, world: int, how: str) -> object:
    if rank == world - 1:
        if how == "exit":
            os._exit(3)
        if how == "segv":
            faulthandler.disable()  # pytest's handler would print every thread's stack into the log
            os.kill(os.getpid(), signal.SIGSEGV)
        if how == "raise":
            raise ValueError("bad batch on the last rank")
    return funcoll.gather(torch.ones(rank + 1))  # the other ranks wait in the size exchange


@pytest.mark.parametrize(
    "how, fragment",
    [
        pytest.param("exit", "run_ranks: rank 2 of 3 died without a result (exit code 3)", id="os._exit"),
        pytest.param(
            "segv", "run_ranks: rank 2 of 3 died without a result (killed by SIGSEGV)", id="segfault"
        ),
        pytest.param("raise", "rank 2 of 3 raised:", id="raise"),  # before the peers' connection errors
    ],
)
def test_a_failing_rank_is_reported_as_the_cause(how: str, fragment: str) -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_fails, 3, how, timeout=TIMEOUT_S)
    message = str(info.value)
    assert message.startswith(fragment), message
    if how == "raise":
        assert "ValueError: bad batch on the last rank" in message, message


HANG_TIMEOUT_S = 8.0


def _hangs(rank: int, world: int) -> object:
    if rank == world - 1:
        time.sleep(10 * HANG_TIMEOUT_S)  # never calls anything: run_ranks kills it first
    return funcoll.gather(torch.ones(rank + 1))


def test_a_rank_that_never_calls_ends_in_a_timeout_error() -> None:
    # The others wait in the size exchange (the process group's timeout is far longer)
    # and the last rank never calls: run_ranks' deadline ends the run, and kills all.
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(_hangs, 2, timeout=HANG_TIMEOUT_S, pg_timeout=10 * HANG_TIMEOUT_S)
    took = time.monotonic() - start
    assert str(info.value) == f"run_ranks: ranks [0, 1] did not finish within {HANG_TIMEOUT_S:.0f}s"
    assert took < HANG_TIMEOUT_S + 5.0, f"the run took {took:.1f}s"


def _gathers(rank: int, world: int) -> torch.Tensor:
    return funcoll.gather(torch.full((rank + 1,), float(10 * world + rank)))


def test_groups_started_side_by_side_each_get_their_own_results() -> None:
    """Two start_ranks runs at once: each its own process group, read in either order."""
    two, three = start_ranks(_gathers, 2, timeout=TIMEOUT_S), start_ranks(_gathers, 3, timeout=TIMEOUT_S)
    for ranks, world in ((three, 3), (two, 2)):  # read in the other order than started
        want = torch.cat([torch.full((r + 1,), float(10 * world + r)) for r in range(world)])
        got = ranks.results()
        assert ranks.world == world and len(got) == world
        for r, y in enumerate(got):
            torch.testing.assert_close(y, want, msg=lambda m, r=r, w=world: f"world {w} rank {r}: {m}")
        assert ranks.results() is got  # read once, kept


def _gathers_then_marks(rank: int, world: int, marks: str) -> torch.Tensor:
    y = funcoll.gather(torch.ones(rank + 1)) + 0  # read: its collective is done
    Path(f"{marks}.{rank}").touch()
    return y


def test_results_that_arrived_count_when_read_after_the_deadline(tmp_path: Path) -> None:
    late = start_ranks(_gathers_then_marks, 2, str(tmp_path / "m"), timeout=1.0, pg_timeout=TIMEOUT_S)
    end = time.monotonic() + TIMEOUT_S
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < end:
        time.sleep(0.1)
    time.sleep(2.0)  # past the deadline; the ranks reported right after their marks
    assert [y.shape[0] for y in late.results()] == [3, 3]


def _raises(rank: int, world: int) -> None:
    raise ValueError(f"rank {rank} of {world}: bad input")


def _returns(rank: int, world: int, out: str) -> None:
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{rank}/{world}")


def test_launch_runs_every_rank_or_reports_the_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``launch`` (the examples' main without torchrun): 0 when every rank ran, 1 and the cause on stderr."""
    from funcoll.testing import launch

    assert launch(_returns, 2, str(tmp_path / "r"), timeout=60) == 0
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0/2", "1/2"]
    assert launch(_raises, 2, timeout=60) == 1
    assert "ValueError: rank 0 of 2: bad input" in capsys.readouterr().err


def test_count_host_reads_counts_item_and_tolist() -> None:
    """Each ``item`` and ``tolist`` once, through a default-device mode too; ``int(t)`` not; then restored."""
    from funcoll.testing import count_host_reads

    saved = torch.Tensor.item, torch.Tensor.tolist
    x = torch.arange(3)
    with count_host_reads() as reads:
        assert x.tolist() == [0, 1, 2] and x[1].item() == 1
        with torch.device("cpu"):  # a __torch_function__ mode that calls the method again
            x[2].item()
        int(x[0])
    assert reads.count == 3
    assert (torch.Tensor.item, torch.Tensor.tolist) == saved


def _threads_of_groups(rank: int, world: int) -> tuple[int, int]:
    """The worker threads of a gloo group built inside gloo_worker_threads(1), and of one built after it."""
    cpu = torch.device("cpu")
    with gloo_worker_threads(1):
        inside = dist.new_group(list(range(world)))
    after = dist.new_group(list(range(world)))
    return inside._get_backend(cpu).options._threads, after._get_backend(cpu).options._threads


def test_gloo_worker_threads_builds_groups_inside_the_block_only() -> None:
    assert run_ranks(_threads_of_groups, 2) == [(1, 2), (1, 2)]


@pytest.mark.parametrize("threads", [0, -1, 1.0, True])
def test_gloo_worker_threads_refuses_a_count_that_is_not_a_positive_int(threads: object) -> None:
    with pytest.raises(ValueError, match=r"gloo_worker_threads: `threads`="):
        with gloo_worker_threads(threads):  # type: ignore[arg-type]
            pass


# Excerpts of a graph inductor generated (torchtitan's MoE layer, overlap passes, checks on)
# before funcoll::wait took its collective's input: buf87, a header all_gather's input, is
# reused for the next header while that all_gather is still in flight.
_CALL = """
def call(args):
        buf87 = buf86
        buf88 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf87, 2, '0:funcoll4')
        assert_size_stride(buf88, (40, ), (1, ), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
        buf94 = torch.ops._c10d_functional.all_to_all_single.default(buf93, [u3, u4], [u1, u2], '0:funcoll3')
        {between}
        buf89 = torch.ops.funcoll.wait.default(buf88, {sent}'moe.dispatch', 'all_gather', '0', 'the collective check')
        torch.ops._c10d_functional.wait_tensor.default(buf94)
        del buf93
        {after}
"""


def test_code_collectives_refuses_an_input_freed_before_its_wait() -> None:
    from funcoll.testing import code_collectives

    freed = "buf141 = buf87; del buf87  # reuse"
    with pytest.raises(ValueError, match=r"frees or reuses buf87, the input of `buf88 = .*funcoll4'\)`"):
        code_collectives(_CALL.format(between=freed, sent="", after=""))
    with pytest.raises(ValueError, match=r"frees or reuses buf93"):  # a del of several, before the wait
        code_collectives(_CALL.format(between="del buf12, buf93", sent="buf87, ", after=""))
    # The input freed after the wait, as inductor orders it when the wait takes the input.
    calls = code_collectives(_CALL.format(between="", sent="buf87, ", after=freed))
    assert [c.op for c in calls] == ["all_gather_into_tensor", "all_to_all_single"]


def test_print_line_writes_the_whole_line_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One write of the text and its newline, then a flush: ranks sharing stdout cannot cut the line."""

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def write(self, text: str) -> int:
            self.calls.append(("write", text))
            return len(text)

        def flush(self) -> None:
            self.calls.append(("flush", ""))

    out = Recorder()
    monkeypatch.setattr("sys.stdout", out)
    print_line("rank 1: 8 tokens")
    assert out.calls == [("write", "rank 1: 8 tokens\n"), ("flush", "")]


def _ranks_print(rank: int, world: int) -> None:
    time.sleep(0.2 * (world - rank))  # the last rank is ready first: order must not follow readiness
    funcoll.testing.print_ranks(f"rank {rank}: {rank + 2} tokens")
    funcoll.testing.print_ranks(f"rank {rank}: second line", group=dist.new_group(list(range(world))))


def test_print_ranks_prints_every_rank_in_rank_order_from_rank_0() -> None:
    """Three ranks, the last one ready first: rank 0 writes the three lines in rank order, twice."""
    script = (
        "from tests.test_testing import _ranks_print\n"
        "from funcoll.testing import run_ranks\n"
        "run_ranks(_ranks_print, 3, timeout=60)\n"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")]
    assert lines == [f"rank {r}: {r + 2} tokens" for r in range(3)] + [
        f"rank {r}: second line" for r in range(3)
    ]


def test_heartbeat_says_the_block_is_still_running_until_it_ends(capsys: pytest.CaptureFixture[str]) -> None:
    with funcoll.testing.heartbeat("step 1: compiling", every=0.05):
        time.sleep(0.32)
    time.sleep(0.15)  # nothing after the block
    beats = capsys.readouterr().out.splitlines()
    assert 3 <= len(beats) <= 7, beats
    assert all(b.startswith("step 1: compiling: still running (") and b.endswith(" s)") for b in beats), beats
    with funcoll.testing.heartbeat("quiet", every=0.01, enabled=False):
        time.sleep(0.05)
    assert capsys.readouterr().out == ""


_CYCLE_PROGRAM = """
import atexit, gc, os, socket, sys, weakref
seen = []
# registered before funcoll's own exit hook, so it runs after it
atexit.register(lambda: print("exit:", "alive" if seen[0]() is not None else "freed"))
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import funcoll
from funcoll.testing import launch

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
gc.disable()  # only funcoll may collect: the test must not pass by the collector's chance

def run(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    held = {"x": funcoll.all_gather(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))}
    held["self"] = held  # a cycle holds the DTensor, its mesh and the mesh's process group
    seen.append(weakref.ref(mesh.get_group()))

if sys.argv[1] == "launch":
    assert launch(run, 1) == 0
    print("launch:", "alive" if seen[0]() is not None else "freed")
else:  # a program of its own, as the README's: init, work, destroy
    dist.init_process_group("gloo")
    run(0, 1)
    dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    "how, expect",
    [("launch", ["launch: freed", "exit: freed"]), ("plain", ["exit: freed"])],
)
def test_no_process_group_is_left_for_interpreter_finalization(how: str, expect: list[str]) -> None:
    """A process group a cycle holds is freed before the interpreter finalizes: by ``launch``, or at exit.

    A gloo group freed only by finalization's own collection has worker threads
    that may take the GIL of a finalizing interpreter: SIGABRT after the program's
    last line. ``launch`` collects before its barrier; funcoll's exit hook collects
    for a program that destroys its group itself.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _CYCLE_PROGRAM, how], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == expect, done.stdout + done.stderr[-3000:]
