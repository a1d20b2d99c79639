"""Deterministic per-rank inputs, the cached batch runner and a torchrun runner shared by the test modules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from funcoll.testing import RankError, run_ranks


def seeded(shape: Sequence[int], dtype: torch.dtype, *key: object) -> Tensor:
    """A deterministic tensor for `key`. float64 is normal (for gradients); the other dtypes
    hold small integers, so sums, averages and products over 4 ranks are exact in bfloat16."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    if dtype == torch.float64:
        return torch.randn(tuple(shape), generator=gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    return torch.randint(-4, 5, tuple(shape), generator=gen).to(dtype)


def once_per_world(body: Callable[..., Any], timeout: float) -> Callable[[int], list[Any]]:
    """``batch(world)`` runs ``run_ranks(body, world)`` once per session and caches the result.

    A failed batch is cached too and re-raised for every test that reads it, so one
    broken batch costs one timeout, not one per test.
    """
    done: dict[int, list[Any]] = {}
    failed: dict[int, Exception] = {}

    def batch(world: int) -> list[Any]:
        if world not in done and world not in failed:
            try:
                done[world] = run_ranks(body, world, timeout=timeout)
            except (RankError, TimeoutError) as e:
                failed[world] = e
        if world in failed:
            raise RuntimeError(f"the world-{world} batch failed") from failed[world]
        return done[world]

    return batch


def torchrun(script: Path, nproc: int, timeout: float) -> tuple[str, str]:
    """Run `script` under ``torchrun --standalone`` on `nproc` gloo ranks, this checkout's funcoll first.

    Returns (stdout, stderr) of a run that exited with 0; fails the test with the end
    of stderr otherwise, or after `timeout` seconds (torchrun and its ranks killed).
    """
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": path}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout:.0f} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return out, err
