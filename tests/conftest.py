import warnings
from collections.abc import Callable
from typing import Any

import pytest

import funcoll

_REPORT = pytest.StashKey[list[str]]()


@pytest.fixture(autouse=True)
def _cross_rank_checks():
    """Every test here runs with funcoll.set_checks(True): an even op whose ranks disagree
    raises funcoll's ValueError instead of aborting a rank. The ranks of run_ranks are
    forked inside the test, so they inherit the setting. compile_tests/ keeps the default
    (off), whose graphs are what users compile; compile_tests/test_checked_ops.py
    compiles the checked ops."""
    with funcoll.set_checks(True):
        yield


@pytest.fixture
def warnings_fail() -> object:
    """The warnings a user's program prints (those Python's default filters show) raise instead.

    In the test and in the ranks it forks (``run_ranks``: they inherit the filters),
    where pytest would otherwise record a rank's warning in that process's memory
    and nobody would see it. Deprecation, import and resource warnings stay
    ignored, as Python ignores them outside ``__main__``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        yield


@pytest.fixture(scope="session")
def report(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """Add a line to the "funcoll" section at the end of pytest's output, shown without -s.

    What a run measured rather than asserted: how many property examples ran, the
    soak's collectives, graphs and RSS growth."""
    return pytestconfig.stash.setdefault(_REPORT, []).append


def pytest_sessionfinish(session: pytest.Session) -> None:
    # In a pytest-xdist worker: its lines travel to the controller, which prints the section.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["funcoll_report"] = session.config.stash.get(_REPORT, [])


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: defined only when it is installed
def pytest_testnodedown(node: Any, error: object) -> None:
    lines = getattr(node, "workeroutput", {}).get("funcoll_report", [])
    node.config.stash.setdefault(_REPORT, []).extend(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.section("funcoll")
        for line in lines:
            terminalreporter.write_line(line)
