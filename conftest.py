"""Settings and a warm-up shared by tests/ and compile_tests/.

``funcoll.testing.run_ranks`` forks its ranks from pytest's process. A process's
first ``torch.compile`` imports and registers most of dynamo, AOT autograd and
inductor: here a 2-rank launch that compiles one small funcoll step takes about
2.9 s on aot_eager and 5.5 to 11 s on inductor when forked from a cold process, and
about 0.9 s and 1.0 s when forked after this warm-up. So pytest's process compiles a
small step once on each backend (25-30 s on 2 cores) before the first test that
compiles: one from compile_tests/, or one whose module names a compiler
(``torch.compile``, ``aot_eager``, ``inductor``). A run of eager tests alone starts
at once. Nothing it compiled stays: dynamo is reset and its counters are cleared,
so every test starts from a fresh compiler state. ``FUNCOLL_TEST_WARM=0`` turns the
warm-up off (to measure it).
"""

from __future__ import annotations

import os
from pathlib import Path

# Inductor's compile workers are subprocesses; on a 2-core machine one is enough.
# Set before torch's inductor config is first read.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch


def _eager_backward() -> None:
    # An eager backward first, at the session's start. Autograd's engine decides once
    # per process, at its first backward, whether it needs device threads, from the
    # devices registered then. On torch's CUDA builds (no GPU here) a first backward
    # after a compile decides that it does, and a rank forked afterwards then fails its
    # own backward ("Unable to handle autograd's threading in combination with
    # fork-based multiprocessing"). Decided before any compile, it stays decided.
    x = torch.ones(1, requires_grad=True)
    (x * 2).sum().backward()


def _warm() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ x.T).sum()

    for backend in ("aot_eager", "inductor"):
        x = torch.randn(3, 3, requires_grad=True)
        torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(x).backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


_WARM = os.environ.get("FUNCOLL_TEST_WARM", "1") != "0"
_COMPILES = ("torch.compile", "aot_eager", "inductor")
_compiling_files: dict[str, bool] = {}  # a test file -> whether it compiles
_warmed = False


def _compiles(path: Path) -> bool:
    if str(path) not in _compiling_files:
        text = path.read_text() if path.suffix == ".py" else ""
        _compiling_files[str(path)] = "compile_tests" in path.parts or any(c in text for c in _COMPILES)
    return _compiling_files[str(path)]


def pytest_sessionstart(session: object) -> None:
    _eager_backward()


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _warmed
    if _WARM and not _warmed and _compiles(Path(item.path)):
        _warmed = True
        _warm()
