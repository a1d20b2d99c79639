"""Run a function on N real ranks (gloo, CPU processes) and collect the results.

:func:`run_ranks` is what funcoll's own tests use, and it is public so that code
built on funcoll can test its collectives the same way: real processes and a real
backend, never mocks. It fails in bounded time: a rank that raises makes the whole
run raise :class:`RankError` with that rank's traceback; a rank that dies without a
result (``os._exit``, a segfault) makes it raise :class:`RankError` naming the rank
and its exit code or signal; and a rank that hangs or never calls a collective its
peers wait in (a deadlock, mismatched collectives) makes it raise ``TimeoutError``
after `timeout` seconds, naming the ranks that did not finish. Every child process
is killed either way.

Example::

    def body(rank, world):
        x = torch.full((rank + 1,), float(rank))
        return funcoll.gather(x)

    results = run_ranks(body, world=3)   # one result per rank

:func:`count_host_reads` counts the host reads of a block of code, the
device-to-host syncs it would make on a GPU. :func:`collective_mismatch` says
whether the collectives that each rank's compiled graphs issue pair up.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import io
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._base import _group
from ._collective import _async

__all__ = [
    "Collective",
    "HostReads",
    "RankError",
    "Ranks",
    "code_collectives",
    "collective_mismatch",
    "compiled_collectives",
    "compiling",
    "count_host_reads",
    "gloo_worker_threads",
    "graph_collectives",
    "group_of",
    "heartbeat",
    "in_flight",
    "launch",
    "print_line",
    "print_ranks",
    "recording_backend",
    "run_ranks",
    "settled",
    "start_ranks",
]


class RankError(RuntimeError):
    """A rank raised; the message holds its rank and traceback."""


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store_path: str,
    results: Any,
    args: tuple[Any, ...],
    backend: str,
    timeout: float,
) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        try:
            out = fn(rank, world, *args)
            _async.drain()  # no funcoll collective in flight beside the barrier's (on gloo)
            dist.barrier()  # every rank done before any tears its connections down
        finally:
            dist.destroy_process_group()
        # No gc.collect here, as launch has (0.15-0.3 s a call with torch loaded): a forked
        # rank ends in os._exit, without the interpreter's finalization, and a spawned one
        # runs funcoll's exit hook, which collects before finalization.
        results.put((rank, True, _dumps(out)))
    except BaseException:  # noqa: BLE001 -- report everything to the parent, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


def _exited(procs: list[Any], reported: set[int], failed_only: bool = False) -> list[int]:
    """The ranks whose process ended without reporting anything (`failed_only`: with a nonzero code).

    A worker exits with code 0 after it reports, so a 0 may only mean that its
    report is still in the queue; a nonzero code or a signal means it died.
    """
    return [
        r
        for r, p in enumerate(procs)
        if r not in reported and p.exitcode is not None and (p.exitcode != 0 or not failed_only)
    ]


def _dead_message(procs: list[Any], dead: list[int], world: int) -> str:
    def how(code: int) -> str:
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    return "\n".join(
        f"run_ranks: rank {r} of {world} died without a result ({how(procs[r].exitcode)})" for r in dead
    )


_GRACE_S = 2.0  # how long the other ranks get to report once one has failed or died
# What a rank raises when a peer is gone: a consequence, listed after the cause.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _failure(procs: list[Any], results: Any, reported: set[int], errors: dict[int, str], world: int) -> str:
    """The message of a failed run: the dead ranks, then every error, causes before consequences.

    A rank that raises or dies makes its peers fail in their next collective, and
    whichever report arrives first need not be the cause, so the others get
    :data:`_GRACE_S` seconds to report or die too.
    """
    end = time.monotonic() + _GRACE_S
    while len(reported) < len(procs) and time.monotonic() < end:
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            if all(p.exitcode is not None for r, p in enumerate(procs) if r not in reported):
                break
            continue
        reported.add(rank)
        if not ok:
            errors[rank] = payload
    dead = _exited(procs, reported, failed_only=True)
    order = sorted(errors, key=lambda r: (any(s in errors[r] for s in _PEER_GONE), r))
    parts = ([_dead_message(procs, dead, world)] if dead else []) + [
        f"rank {r} of {world} raised:\n{errors[r]}" for r in order
    ]
    return "\n".join(parts)


class Ranks:
    """Ranks that :func:`start_ranks` started; :meth:`results` waits for them."""

    def __init__(self, procs: list[Any], queue_: Any, store_path: str, timeout: float) -> None:
        self._procs, self._queue, self._store_path = procs, queue_, store_path
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout  # the run's bound counts from the start
        self._done: list[Any] | None = None

    @property
    def world(self) -> int:
        return len(self._procs)

    def results(self) -> list[Any]:
        """``[result of rank 0, result of rank 1, ...]``, once every rank reported; see :func:`run_ranks`.

        Raises:
            RankError: a rank raised or died without a result (as :func:`run_ranks`).
            TimeoutError: not every rank finished within the `timeout` given at the start.
        """
        if self._done is not None:
            return self._done
        procs, results, world = self._procs, self._queue, self.world
        out: dict[int, Any] = {}
        reported: set[int] = set()  # ranks that sent a result or an error
        try:
            while len(out) < world:
                left = self._deadline - time.monotonic()
                try:  # what arrived counts, however late it is read (ranks started side by side)
                    rank, ok, payload = results.get(timeout=min(max(left, 0.0), 1.0))
                except queue.Empty:
                    if left <= 0:
                        missing = sorted(set(range(world)) - set(out))
                        for p in procs:  # hung: nothing left to wait for
                            p.kill()
                        raise TimeoutError(
                            f"run_ranks: ranks {missing} did not finish within {self._timeout:.0f}s"
                        ) from None
                    if not _exited(procs, reported):
                        continue
                    try:  # an exit without a result: give the queue a moment, in case one is on its way
                        rank, ok, payload = results.get(timeout=_GRACE_S)
                    except queue.Empty:
                        raise RankError(_failure(procs, results, reported, {}, world)) from None
                reported.add(rank)
                if not ok:
                    raise RankError(_failure(procs, results, reported, {rank: payload}, world))
                out[rank] = _loads(payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            if os.path.exists(self._store_path):
                os.unlink(self._store_path)
        self._done = [out[r] for r in range(world)]
        return self._done


def start_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    pg_timeout: float | None = None,
) -> Ranks:
    """Start ``fn(rank, world, *args)`` on `world` processes; ``.results()`` waits for them.

    :func:`run_ranks` without the wait, so that groups of ranks run side by side:
    each start makes a process group of its own, and ranks that wait in a
    collective (a peer still compiling) leave the cores to the other group's.
    The arguments are :func:`run_ranks`'; `timeout` counts from the start. The
    processes are forked here, in the calling thread::

        two, three = start_ranks(body, 2), start_ranks(body, 3)
        assert two.results() == [0, 1] and three.results() == [0, 1, 2]  # body returns its rank
    """
    method = os.environ.get("FUNCOLL_TEST_START_METHOD", "fork")
    ctx = mp.get_context(method)
    results = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="funcoll_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                r,
                world,
                store_path,
                results,
                args,
                backend,
                timeout if pg_timeout is None else pg_timeout,
            ),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return Ranks(procs, results, store_path, timeout)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    pg_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on `world` processes and return the results in rank order.

    Args:
        fn: a module-level function (it is pickled for the child processes).
        world: the number of ranks.
        args: extra arguments passed to every rank (picklable).
        timeout: seconds the whole run may take, start-up included.
        backend: the torch.distributed backend; gloo runs on CPU.
        pg_timeout: the process group's timeout in seconds (default: `timeout`):
            how long a collective waits for a rank that does not call it. Below
            `timeout`, a rank that stays away makes its peers raise (gloo: "Timed
            out waiting") before the run as a whole times out.

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (results travel with ``torch.save``).

    Raises:
        RankError: a rank raised (the message carries its traceback), or died
            without a result: it exited (``os._exit``) or a signal killed it (a
            segfault), reported with its exit code or signal. A rank that dies
            usually makes its peers raise too (gloo: "Connection reset by peer");
            the dead rank is reported first, as the cause.
        TimeoutError: not every rank finished within `timeout` (a hang).
    """
    return start_ranks(fn, world, *args, timeout=timeout, backend=backend, pg_timeout=pg_timeout).results()


def in_flight() -> int:
    """How many collectives this process has issued and not yet waited for (c10d's work registry).

    A functional collective stays registered until its ``wait_tensor``; any left
    when the process exits make c10d warn of "unwaited collective calls". An
    eager funcoll result is registered until it is first read (or freed): after
    reading every result of funcoll's ops, eager or compiled, forward or backward,
    and after any error one raised, it is 0. Check it in code built on funcoll the
    same way (:func:`settled` reads the results first). On a gloo group of two
    worker threads funcoll's next collective also waits for it, so at most one
    of funcoll's is in flight there::

        def body(rank, world):
            y = funcoll.gather(torch.ones(rank + 1))
            issued = in_flight()  # 1: the data is still on its way
            y = y + 1             # the first read waits
            return issued, in_flight()

        assert run_ranks(body, world=2) == [(1, 0), (1, 0)]
    """
    return torch._C._distributed_c10d._get_work_registry_size()


@contextlib.contextmanager
def gloo_worker_threads(threads: int) -> Iterator[None]:
    """Gloo groups built inside the block run `threads` worker threads (torch's own: 2).

    ``init_process_group`` and ``new_group`` take no gloo options, so inside the
    block torch's ``ProcessGroupGloo`` is swapped, in this process, for a subclass
    that passes them. A gloo group with one worker thread runs its collectives one
    at a time, in the order they were issued, on that thread, while the calling
    thread goes on: funcoll's eager ops defer their waits on such a group as on
    NCCL (:func:`funcoll.wait`; :func:`in_flight` has an example). On torch's two
    threads funcoll keeps one collective in flight at a time itself
    (``benchmarks/gloo_inflight_probe.py`` says why).
    """
    import torch.distributed.distributed_c10d as c10d

    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"funcoll.testing.gloo_worker_threads: `threads`={threads!r} must be an int >= 1")
    base = c10d.ProcessGroupGloo

    class _Gloo(base):  # type: ignore[misc, valid-type]
        def __init__(
            self, store: Any, rank: int, size: int, timeout: timedelta = timedelta(minutes=30), **more: Any
        ) -> None:
            options = base._Options()
            options._timeout = timeout
            for key, value in more.items():  # what later releases pass too (2.15: enable_reconfigure)
                setattr(options, key, value)
            options._threads = threads
            options._devices = [base.create_default_device()]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = _Gloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = base


def settled(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every pending result in them waited for, and ``"in_flight"``: what is left after that.

    An eager funcoll result is pending until something reads it
    (:func:`funcoll.wait`); one that is still alive and unread is rightly in
    flight. A rank function that reports what it computed waits for it first,
    then counts what stayed registered: 0 unless a collective was issued and
    never waited. ::

        def body(rank, world):
            y = funcoll.all_gather(torch.ones(2))
            return settled({"y": y})  # {"y": tensor([1., 1., 1., 1.]), "in_flight": 0}
    """
    from . import wait

    out = wait(dict(values))
    out["in_flight"] = in_flight()
    return out


def launch(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> int:
    """Run ``fn(rank, world, *args)`` on every rank, as a program's ``main``: under torchrun or here.

    Under a launcher (``LOCAL_RANK`` set, as torchrun does) this process is one
    rank: it initializes the default process group on `backend`, runs `fn` with
    the launcher's rank and world size (`world` is ignored), and waits at a
    barrier so that no rank tears the group down while a peer still reads (gloo
    aborts that peer). Otherwise it starts `world` ranks here with
    :func:`run_ranks`. The examples in ``examples/`` end with
    ``sys.exit(launch(run, args.world))``.

    Returns:
        0, or 1 after printing why the ranks failed (a :class:`RankError` or a
        timeout) to stderr.
    """
    if "LOCAL_RANK" in os.environ:  # started by a launcher: this process is one rank
        dist.init_process_group(backend)
        try:
            fn(dist.get_rank(), dist.get_world_size(), *args)
            # Free the groups that cycles in fn's locals hold, so that destroy_process_group
            # joins their gloo threads; at finalization they abort the process (the exit
            # hook, funcoll._collective._async._wait_left, says how).
            gc.collect()
            _async.drain()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return 0
    try:
        run_ranks(fn, world, *args, timeout=timeout, backend=backend)
    except (RankError, TimeoutError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


def print_line(text: str) -> None:
    """Print `text` as one whole line, in one write to stdout, flushed.

    ``print`` writes the text and its newline separately, and when stdout is not
    buffered (``python -u``, ``PYTHONUNBUFFERED=1``) ranks that share it, under
    torchrun or :func:`run_ranks`, can cut each other's lines
    (``...match one processrank 1: ...``). One write of a line shorter than the
    pipe's atomic size (4 KiB on Linux) lands whole. The examples print with it. ::

        print_line(f"rank {rank}: {n} tokens")
    """
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def heartbeat(what: str, every: float = 5.0, enabled: bool = True) -> Iterator[None]:
    """While the block runs, print ``<what>: still running (N s)`` every `every` seconds.

    For work that is silent for long (a first ``torch.compile`` call: tens of
    seconds on a small CPU), so that a user sees it is alive and how long it has
    taken. A daemon thread prints (:func:`print_line`); it stops when the block
    ends. `enabled` False (say on ranks other than 0): nothing is printed. ::

        with heartbeat(f"step {i}: compiling", enabled=rank == 0):
            loss = step_fn(x)
    """
    if not enabled:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            print_line(f"{what}: still running ({time.perf_counter() - start:.0f} s)")

    thread = threading.Thread(target=beat, name="funcoll-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def print_ranks(text: str, group: _group.GroupLike = None) -> None:
    """Print every rank's `text` from the group's first rank, in rank order, one whole line each.

    A collective: every rank of `group` (any form funcoll's ops take; None: the
    default group) calls it with its own line. The lines travel to every rank
    (``all_gather_object``: pickled, on the host) and the group's rank 0 writes
    them with :func:`print_line`, so that ranks sharing a terminal under torchrun
    or :func:`run_ranks` neither interleave their lines nor print them out of
    order. Meant for a program's report lines, not for a hot loop. ::

        print_ranks(f"rank {rank}: {n} tokens")  # rank 0 prints "rank 0: ...", then "rank 1: ..."
    """
    g = _group.resolve_group("funcoll.testing.print_ranks", group)
    if g.is_single:
        print_line(text)
        return
    pg = dist.distributed_c10d._resolve_process_group(g.name)
    lines: list[Any] = [None] * g.size
    dist.all_gather_object(lines, text, group=pg)
    if g.rank == 0:
        for line in lines:
            print_line(str(line))


def recording_backend() -> tuple[Callable[..., Any], dict[str, list[str]]]:
    """A ``torch.compile`` backend that records the collectives each compiled graph issues, in order.

    Returns ``(backend, seqs)``. Compile with ``backend=backend`` (aot_eager's
    graphs, split by the min-cut partitioner that aot_eager and inductor use);
    after a forward and backward, ``seqs["fw"]`` and ``seqs["bw"]`` list the
    ``_c10d_functional`` ops of the last compiled forward and backward graphs
    (``"_c10d_functional.all_to_all_single.default"``, ...), and the waits: c10d's
    ``wait_tensor``, or ``"funcoll.wait.default"`` under ``funcoll.set_checks(True)``. Every rank must
    record the same lists: a rank whose list differs would hang its peers. ::

        backend, seqs = recording_backend()
        loss = torch.compile(step, fullgraph=True, backend=backend)(x)
        loss.backward()
        return seqs  # from each rank of run_ranks; compare them in the parent
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    seqs: dict[str, list[str]] = {}

    def names(gm: torch.fx.GraphModule) -> list[str]:
        return [str(n.target) for n in gm.graph.nodes
                if n.op == "call_function" and str(n.target).startswith(("_c10d_functional.", "funcoll.wait"))]  # fmt: skip

    def partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        seqs["fw"], seqs["bw"] = names(fw), names(bw)
        return fw, bw

    backend = aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=lambda gm, _: gm.forward,
                           partition_fn=partition)  # fmt: skip
    return backend, seqs


def group_of(name: str) -> str:
    """The c10d group that a compiled collective's group argument names.

    In a compiled graph every funcoll collective runs under a group name of its
    own, ``f"{group}:funcoll{k}"`` for the k-th collective a frame traces on
    ``group``, registered with c10d for the same ``ProcessGroup``, so that no
    compiler pass merges two collectives (docs/compile.md). A test that reads the
    group names in a graph (``recording_backend``'s calls, ``TORCH_LOGS``) maps them
    back with this; any other name is returned as it is. ::

        group_of("0:funcoll3") == "0"
        group_of(dist.group.WORLD.group_name) == dist.group.WORLD.group_name
    """
    return _group.group_of(name)


@dataclass
class HostReads:
    """What :func:`count_host_reads` has counted so far: ``count``, the ``item``/``tolist`` calls."""

    count: int = 0


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the ``Tensor.item`` and ``Tensor.tolist`` calls made inside the block.

    On CUDA each is a device-to-host sync: the CPU stops queueing work until the
    GPU has caught up. On CPU tensors nothing waits, but the count says what the
    same code would cost on a GPU. funcoll's size exchanges are counted in compiled
    graphs too: the graph reads the sizes inside the custom op ``funcoll::host_ints``,
    which calls ``tolist``. Only the outermost call counts (under
    ``torch.set_default_device`` a call passes through a ``__torch_function__`` mode
    that calls the method again); ``int(t)``, ``float(t)`` and ``bool(t)`` are not
    counted. ::

        with count_host_reads() as reads:
            out = funcoll.gather(x)      # eager: one read, the exchanged sizes
        assert reads.count == 1
    """
    reads, depth = HostReads(), [0]
    saved = torch.Tensor.item, torch.Tensor.tolist

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            reads.count += depth[0] == 0
            depth[0] += 1
            try:
                return original(self, *a, **kw)
            finally:
                depth[0] -= 1

        return wrapper

    torch.Tensor.item, torch.Tensor.tolist = counted(saved[0]), counted(saved[1])  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        torch.Tensor.item, torch.Tensor.tolist = saved  # type: ignore[method-assign]


@dataclass(frozen=True)
class Collective:
    """One collective of a compiled graph, by what must agree between ranks (see :func:`collective_mismatch`).

    ``op``: the ``_c10d_functional`` op (``"all_gather_into_tensor"``, ...);
    ``group``: the c10d group (:func:`group_of` of its name); ``shape``: the
    result's shape, where the graph says it; ``send`` / ``recv``: all_to_all_single's
    input and output split sizes (None elsewhere). A size the graph holds as a
    symbol (an exchanged, unbacked size) is None.
    """

    op: str
    group: str
    shape: tuple[int | None, ...] | None = None
    send: tuple[int | None, ...] | None = None
    recv: tuple[int | None, ...] | None = None


def _agree(a: tuple[int | None, ...] | None, b: tuple[int | None, ...] | None) -> bool:
    """Whether two sizes can be the same: None (not known to the graph: symbolic) matches anything."""
    if a is None or b is None:
        return True
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b, strict=True))


def _ints(sizes: Any) -> tuple[int | None, ...]:
    return tuple(s if type(s) is int else None for s in sizes)


def _collective(op: str, group: str, shape: Any, args: list[Any]) -> Collective:
    """A Collective from an op's name, group name, result shape and arguments (all_to_all: splits 1, 2)."""
    a2a = op == "all_to_all_single"
    return Collective(op, group_of(group), None if shape is None else _ints(shape),
                      _ints(args[2]) if a2a else None, _ints(args[1]) if a2a else None)  # fmt: skip


def graph_collectives(gm: torch.fx.GraphModule) -> list[Collective]:
    """The collectives of an FX graph (an AOT backend's forward or backward), in node order.

    For a backend built with ``aot_autograd``: call it from the `fw_compiler` and
    `bw_compiler` on the graph they receive, which is what runs.
    """
    out = []
    for n in gm.graph.nodes:
        op = n.target.__name__.split(".")[0] if n.op == "call_function" else ""
        if getattr(n.target, "namespace", None) == "_c10d_functional" and not op.startswith("wait"):
            val = n.meta.get("val")
            out.append(
                _collective(
                    op, str(n.args[-1]), val.shape if isinstance(val, torch.Tensor) else None, list(n.args)
                )
            )
    return out


# `buf = op(...)`, or an in-place op (`all_reduce_`, `broadcast_`) on its first argument
_CODE_CALL = re.compile(r"^\s*(?:(\w+) = )?torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)\s*$")
_CODE_SIZE = re.compile(r"^\s*assert_size_stride\((\w+), ")
_CODE_CHECKED_WAIT = re.compile(r"^\s*(?:\w+ = )?torch\.ops\.funcoll\.wait\.default\((\w+)")
_CODE_FREE = re.compile(r"\bdel ([\w, ]+)")


def _literal(node: ast.expr) -> Any:
    """A constant, or a list of them; None for a buffer or a symbol (an unbacked size)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    return None


def code_collectives(code: str) -> list[Collective]:
    """The collectives of one graph's inductor-generated code, in the order its ``call`` issues them.

    Raises ``ValueError`` where the code frees or reuses a collective's input
    buffer before that collective's wait: the backend may still be reading it (a
    gloo or NCCL collective runs after its issue returns), and would send whatever
    the buffer holds next. Inductor keeps the input of a ``_c10d_functional``
    collective alive until its ``wait_tensor``; funcoll's own wait (``funcoll::wait``,
    under ``set_checks(True)``) takes the input as an argument for the same reason.
    """
    shapes: dict[str, Any] = {}
    calls = []
    sending: dict[str, tuple[str, str]] = {}  # a collective's output buffer -> (its input's, the call)
    for line in code[code.index("def call(") :].splitlines():
        if m := _CODE_SIZE.match(line):
            shapes[m.group(1)] = _literal(ast.parse(line.strip(), mode="eval").body.args[1])  # type: ignore[attr-defined]
        elif m := _CODE_CALL.match(line):
            nodes = ast.parse(f"f({m.group(3)})", mode="eval").body.args  # type: ignore[attr-defined]
            buf = m.group(1) or (nodes[0].id if nodes and isinstance(nodes[0], ast.Name) else "")
            if m.group(2).startswith("wait"):
                sending.pop(buf, None)
                continue
            calls.append((buf, m.group(2).rstrip("_"), [_literal(a) for a in nodes]))
            sent = next(
                (
                    n.id
                    for n in ast.walk(nodes[0])
                    if isinstance(n, ast.Name) and n.id != "reinterpret_tensor"
                ),
                "",
            )
            sending[buf] = (sent, line.strip())
        elif m := _CODE_CHECKED_WAIT.match(line):
            sending.pop(m.group(1), None)
        elif m := _CODE_FREE.search(line):
            freed = {name.strip() for name in m.group(1).split(",")}
            for sent, call in sending.values():
                if sent in freed:
                    raise ValueError(
                        f"funcoll.testing.code_collectives: the generated code frees or reuses {sent}, the input of "
                        f"`{call}`, before that collective's wait (`{line.strip()}`): the backend may "
                        f"still be sending it"
                    )
    return [_collective(op, next(a for a in reversed(args) if isinstance(a, str)), shapes.get(buf), args)
            for buf, op, args in calls]  # fmt: skip


@contextlib.contextmanager
def compiled_collectives() -> Iterator[list[list[Collective]]]:
    """The collectives of every graph inductor compiles inside the block, one list per graph, in order.

    Read from the generated code (:func:`code_collectives`), after every pass, so
    they are what runs, in the order it runs (inductor's overlap passes included).
    A compiled step's forward graph comes first, its backward's when the backward
    first runs. Inductor's FX graph cache is off inside the block, so that a graph
    found in the cache is generated (and read) again. Compare the ranks' lists,
    phase by phase, with :func:`collective_mismatch`. ::

        with compiled_collectives() as graphs:
            loss = torch.compile(step, fullgraph=True)(batch)
            loss.backward()
        return graphs                 # [forward's, backward's], from each rank of run_ranks
    """
    from unittest import mock

    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    graphs: list[list[Collective]] = []
    with (
        config.patch(fx_graph_cache=False),
        mock.patch.object(
            GraphLowering, "save_output_code", lambda code: graphs.append(code_collectives(code))
        ),
    ):
        yield graphs


# Inductor's passes that move collectives and waits for overlap (``reorder_for_compute_comm_overlap``).
OVERLAP_PASSES = ("sink_waits", "raise_comms", "reorder_compute_for_overlap")
COMPILERS = ("aot_eager", "inductor", "inductor-overlap")


@contextlib.contextmanager
def compiling(compiler: str = "inductor") -> Iterator[tuple[Any, list[list[Collective]]]]:
    """A ``torch.compile`` backend, and the collectives of every graph it compiles inside the block.

    `compiler` is one of ``COMPILERS``: ``"inductor"``; ``"inductor-overlap"``,
    inductor with its compute/communication overlap passes (``OVERLAP_PASSES``,
    the schedule that moves collectives and waits the farthest; torch 2.12's SPMD
    check off, as docs/support.md says); or ``"aot_eager"``, AOT autograd's
    partitioned graphs run as they are. Inductor's collectives are read from the
    generated code (:func:`compiled_collectives`), aot_eager's from its FX graphs
    (:func:`graph_collectives`): one list per graph, in the order they compile, a
    step's forward first and its backward when that first runs. Compare the
    ranks' lists, phase by phase, with :func:`collective_mismatch`. ::

        with compiling("inductor-overlap") as (backend, graphs):
            step = torch.compile(train_step, fullgraph=True, backend=backend)
            step(batch).sum().backward()
        return graphs                 # [forward's, backward's], from each rank of run_ranks
    """
    if compiler not in COMPILERS:
        raise ValueError(f"funcoll.testing.compiling: `compiler`={compiler!r} is not one of {COMPILERS}")
    if compiler == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        recorded: list[list[Collective]] = []

        def record(gm: torch.fx.GraphModule, _: Any) -> Callable[..., Any]:
            recorded.append(graph_collectives(gm))
            return gm.forward

        yield (
            aot_autograd(
                fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition
            ),
            recorded,
        )
        return
    from torch._inductor import config

    patch: dict[str, Any] = {}
    if compiler == "inductor-overlap":
        patch = {"reorder_for_compute_comm_overlap": True,
                 "reorder_for_compute_comm_overlap_passes": list(OVERLAP_PASSES)}  # fmt: skip
        # torch 2.12 turns on an SPMD check with these passes: it all_gathers each graph's
        # hash while compiling, which ranks that compile different graphs cannot pass.
        if getattr(getattr(config, "aten_distributed_optimizations", None), "spmd_check", False):
            patch["aten_distributed_optimizations.spmd_check"] = False
    with config.patch(patch), compiled_collectives() as graphs:
        yield "inductor", graphs


def collective_mismatch(per_rank: list[list[Collective]]) -> str | None:
    """Where the ranks' collectives would not pair up; None where they do.

    `per_rank` holds each rank's collectives in the order it issues them (its
    compiled graphs' generated code, forward then backward). The k-th of every
    rank must be the same op on the same group; an all_gather, reduce_scatter,
    all_reduce or broadcast must have the same shape; an all_to_all_single the same
    row shape, and what rank r receives from rank j must be what rank j sends to
    rank r. A rank whose k-th collective differs would pair it with another's:
    a backend abort on gloo, a hang or garbage on NCCL. Returns a message naming
    the first such collective and the ranks.
    """
    world = len(per_rank)
    counts = [len(s) for s in per_rank]
    for k in range(min(counts)):
        calls = [s[k] for s in per_rank]
        c0 = calls[0]
        a2a = c0.op == "all_to_all_single"
        for r, c in enumerate(calls):
            rows = (lambda s: s) if not a2a else (lambda s: None if s is None else s[1:])
            if (c.op, c.group) != (c0.op, c0.group) or not _agree(rows(c.shape), rows(c0.shape)):
                return f"collective {k}: rank 0 issues {c0}, rank {r} issues {c}"
        if a2a and all(c.send is not None and c.recv is not None for c in calls):
            for r in range(world):
                for j in range(world):
                    got, sent = calls[r].recv[j], calls[j].send[r]  # type: ignore[index]
                    if not _agree((got,), (sent,)):
                        return (
                            f"collective {k}: rank {r} expects {got} rows from rank {j}, which sends {sent}"
                        )
    if len(set(counts)) > 1:
        return f"the ranks issue different numbers of collectives: {counts}"
    return None
