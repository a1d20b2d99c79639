"""The timers the benchmarks share (multi-rank and one-GPU), and the one-GPU ones' one-rank group."""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import funcoll

LINK_ENV = "FUNCOLL_BENCH_LINK"  # set inside the re-executed command: the rate it runs under


def add_link_argument(parser: argparse.ArgumentParser) -> None:
    """``--link RATE``: the ranks' bytes cross a loopback rate-limited to RATE (see :func:`on_link`)."""
    parser.add_argument(
        "--link",
        metavar="RATE",
        help="run under netlink RATE (tc units): the ranks' loopback limited to RATE, so a byte costs "
        "what a link charges; 7gbit stands for NVLink on this machine, 700mbit for InfiniBand",
    )


# Where the netlink script is looked for, after $FUNCOLL_NETLINK: beside the repository
# (the tool library's checkout, ../shared/tools), the library's place on these machines
# (a clone elsewhere, CI's), then PATH.
NETLINK_PLACES = ("{repo}/../shared/tools/netlink", "/work/shared/tools/netlink")


def netlink_tool() -> str | None:
    """The ``netlink`` script (``$FUNCOLL_NETLINK``, :data:`NETLINK_PLACES`, PATH), or None."""
    repo = Path(__file__).resolve().parents[1]
    places = [os.environ.get("FUNCOLL_NETLINK"), *(p.format(repo=repo) for p in NETLINK_PLACES)]
    for candidate in places:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("netlink")


def on_link(rate: str | None) -> str:
    """Run this command on the link `rate` names, re-executing it under ``netlink`` once; the header line.

    ``netlink RATE -- cmd`` runs `cmd` in a network namespace of its own whose
    loopback carries a token-bucket rate limit (tc), so gloo ranks started inside
    it pay for every byte they move, all ranks sharing the one link. On a plain
    loopback a byte costs a memcpy, as much as the packing, padding and
    quantizing around a collective, so loopback figures weigh this CPU's copies,
    not the bytes a design moves. `rate` None: the plain loopback.
    """
    if rate is None:
        return "link: loopback (no rate limit: a byte costs a memcpy)"
    if os.environ.get(LINK_ENV) != rate:  # not inside yet: the same command, under netlink
        tool = netlink_tool()
        if tool is None:
            raise SystemExit(
                "--link: no netlink script ($FUNCOLL_NETLINK, ../shared/tools/netlink beside the "
                "repository, /work/shared/tools/netlink, PATH); it needs root (unshare, tc)"
            )
        sys.stdout.flush()
        os.execve(tool, [tool, rate, "--", sys.executable, *sys.argv], {**os.environ, LINK_ENV: rate})
    return f"link: {rate} (netlink: the ranks' bytes cross one loopback rate-limited to {rate})"


def _sync() -> None:
    """Wait for the device when the benchmark runs on CUDA (``run.py --device cuda``)."""
    if torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


def reuse_freed_memory() -> bool:
    """Keep freed host memory in this process for reuse, as a GPU's caching allocator does.

    glibc returns a large freed block (from 128 KiB up, its default threshold,
    raised as blocks are freed) to the kernel, so the next tensor of that size
    is fresh pages: the thread that first writes it takes a page fault per 4
    KiB and the kernel zeroes each page. On this CPU that is most of the time
    of a copy into a new 16 MiB tensor (a pad, a cut, an all_to_all's repeated
    input), a cost a CUDA program, whose caching allocator hands back the block
    it freed, does not pay. Raising glibc's mmap and trim thresholds (``mallopt``)
    keeps every freed block in the heap, where the next allocation reuses its
    pages. Returns whether it applied (glibc only); the baseline and funcoll
    run in the same process, so both get it.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    big = ctypes.c_int(2**30)
    return bool(libc.mallopt(m_mmap_threshold, big)) and bool(libc.mallopt(m_trim_threshold, big))


def _reusing(body: Callable[..., Any], *args: Any) -> Any:
    reuse_freed_memory()
    return body(*args)


def reusing_memory(body: Callable[..., Any], reuse: bool) -> Callable[..., Any]:
    """`body`, which first calls :func:`reuse_freed_memory` where `reuse` is set (a rank's body)."""
    return functools.partial(_reusing, body) if reuse else body


def fenced_median(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of `iters` calls of `fn`, each between two barriers, after one warm-up call.

    On CUDA the device is synchronized before each barrier, so a call's time
    includes its kernels and collectives, not only their launch. An eager result
    whose collective is still in flight (funcoll's and funcol's return before
    their data arrives) is waited for inside the timed call (``funcoll.wait``).
    """
    funcoll.wait(fn())
    times = []
    for _ in range(iters):
        _sync()
        dist.barrier()
        t0 = time.perf_counter()
        funcoll.wait(fn())
        _sync()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync_gpu() -> None:
    """Wait for the GPU where there is one (the one-GPU benchmarks; their smoke runs take CPU tensors)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_median_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of `iters` calls of `fn` after two warm-ups, each timed from the host to :func:`sync_gpu`.

    A host sync inside the call stalls the host there, and is part of its time. A
    result whose collective is still in flight is waited for inside the timed
    call (``funcoll.wait``).
    """
    for _ in range(2):
        funcoll.wait(fn())
    sync_gpu()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        funcoll.wait(fn())
        sync_gpu()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def init_one_rank_group() -> str:
    """This process as a one-rank group: NCCL on ``cuda:0`` where there is a GPU, else gloo; says which.

    What one GPU allows (NCCL refuses two ranks on one device); without a GPU the
    one-GPU benchmarks' smoke runs take CPU tensors over gloo.
    """
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        return f"{torch.cuda.get_device_name()}, one-rank NCCL group"
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return "no GPU: CPU, one-rank gloo group"


def dump_records(path: str, records: list[dict]) -> None:
    """Write a benchmark's records to `path` as JSON with the torch release (nothing when `path` is empty)."""
    if path:
        with open(path, "w") as f:
            json.dump({"torch": torch.__version__, "records": records}, f, indent=1)
