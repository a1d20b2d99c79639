"""Run a program under torchrun, in bounded time: what the launcher tests share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120.0) -> tuple[str, str]:
    """``torchrun --standalone --nproc-per-node nproc *args`` in the repository root; its (stdout, stderr).

    This checkout's funcoll comes first on the ranks' path, and ``--standalone``
    picks a free port. The test fails unless the exit status is 0; after `timeout`
    seconds torchrun and every rank are killed (one process group) and it fails too.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *args,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout:g} s:\n{err[-3000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out, err
