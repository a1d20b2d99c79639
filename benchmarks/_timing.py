"""The timer the multi-rank benchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch.distributed as dist


def fenced_median(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of `iters` calls of `fn`, each between two barriers, after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
