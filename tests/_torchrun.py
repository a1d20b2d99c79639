"""Run a program under torchrun, in bounded time: what the launcher tests share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A rank that aborted at interpreter exit, after its program ended (SIGABRT, after every
# line it prints): a gloo worker thread of a process group still alive at finalization
# took the finalizing interpreter's GIL (docs/errors.md, "Faults"). funcoll now frees
# the groups that cycles hold before finalization (`launch`, and its exit hook): 0 of
# 160 runs under load aborted, against 3 of 40 before. A group a module global holds
# can still meet it, so a run that fails only so is run once more, with a warning.
AT_EXIT_ABORT = "terminate called without an active exception"


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120.0) -> tuple[str, str]:
    """``torchrun --standalone --nproc-per-node nproc *args`` in the repository root; its (stdout, stderr).

    This checkout's funcoll comes first on the ranks' path, and ``--standalone``
    picks a free port. The test fails unless the exit status is 0; after `timeout`
    seconds torchrun and every rank are killed (one process group) and it fails too.
    A run whose only fault is :data:`AT_EXIT_ABORT` is run once more, with a warning
    that shows the first run's end: the test fails if the second run fails too.
    """
    out, err, code = _launch(args, nproc, timeout)
    if code != 0 and AT_EXIT_ABORT in err and "Traceback" not in out + err.split(AT_EXIT_ABORT)[0]:
        warnings.warn(
            f"torchrun {args}: a rank aborted at exit; run again. Its end:\n{err[-1500:]}", stacklevel=2
        )
        out, err, code = _launch(args, nproc, timeout)
    assert code == 0, out[-3000:] + err[-3000:]
    return out, err


def _launch(args: list[str], nproc: int, timeout: float) -> tuple[str, str, int]:
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
    return out, err, proc.returncode
