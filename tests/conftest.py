import os

import pytest

import funcoll

# Inductor's compile workers are subprocesses; on a 2-core machine one is enough.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def _cross_rank_checks():
    """Every test here runs with funcoll.set_checks(True): an even op whose ranks disagree
    raises funcoll's ValueError instead of aborting a rank. The ranks of run_ranks are
    forked inside the test, so they inherit the setting. compile_tests/ keeps the default
    (off), whose graphs are what users compile; compile_tests/test_checked_ops.py
    compiles the checked ops."""
    with funcoll.set_checks(True):
        yield
