"""The timer the multi-rank benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import funcoll


def _sync() -> None:
    """Wait for the device when the benchmark runs on CUDA (``run.py --device cuda``)."""
    if torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


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
