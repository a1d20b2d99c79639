"""The programs in examples/ run and check themselves: one rank launch per example.

Each example exposes ``run(rank, world)``, which computes its result on the ranks
and compares it with a single-process computation (raising on a mismatch);
here each runs once through ``funcoll.testing.run_ranks``, as the example's
own ``main`` does without torchrun. ``examples/dtensor_ragged.py`` runs under
torchrun in ``tests/test_dtensor.py`` (its docs show that command).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from funcoll.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# example file -> the world it runs on here (odd worlds where the example is about uneven splits)
WORLDS = {
    "ulysses_attention.py": 3, "moe_dispatch.py": 3, "eval_gather.py": 3, "dtensor_model.py": 2, "moe_layer.py": 2,
    "torchtitan_moe.py": 4,
}  # fmt: skip
# example file -> the extra arguments of its run() here (aot_eager: inductor's code generation costs
# the suite time and is not what the example checks)
ARGS: dict[str, tuple[object, ...]] = {"moe_layer.py": ("aot_eager",)}
ELSEWHERE = {"dtensor_ragged.py": ROOT / "tests" / "test_dtensor.py"}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"funcoll_example_{Path(name).stem}", EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_example_is_run_by_a_test() -> None:
    found = {p.name for p in EXAMPLES.glob("*.py")}
    assert found == set(WORLDS) | set(ELSEWHERE), "add the new example to WORLDS"
    for name, test in ELSEWHERE.items():
        assert f'"{name}"' in test.read_text(), f"{test.name} no longer runs {name}"


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_example_docstring_says_how_to_run_it(name: str) -> None:
    doc = _load(name).__doc__ or ""
    assert f"torchrun --nproc-per-node {WORLDS[name]} examples/{name}" in doc
    assert f"python examples/{name} --world {WORLDS[name]}" in doc


@pytest.mark.parametrize("name", sorted(WORLDS), ids=lambda n: f"{Path(n).stem}-world{WORLDS[n]}")
@pytest.mark.usefixtures("warnings_fail")
def test_example_matches_one_process(name: str, capfd: pytest.CaptureFixture[str]) -> None:
    """It runs and checks itself; no rank warns (a Python warning raises there) nor prints c10d's warnings."""
    results = run_ranks(_load(name).run, WORLDS[name], *ARGS.get(name, ()), timeout=120)
    assert len(results) == WORLDS[name]
    err = capfd.readouterr().err
    assert "Warning" not in err and "unwaited" not in err, err[-3000:]


def test_moe_layer_in_quantized_formats_tracks_the_exact_loss() -> None:
    """FP8 dispatch, bf16 combine, an int8 router gather: each step's loss near the exact one-process loss."""
    mod = _load("moe_layer.py")
    results = run_ranks(mod.run, 2, "aot_eager", "quantized", timeout=120)
    for r in results:  # run() asserted the tolerance on each rank; the curves must also have moved
        losses, ref = r["losses"], r["reference"]
        assert len(losses) == len(ref) == mod.STEPS
        drift = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        assert 0 < drift <= mod.LOSS_RTOL, drift


def test_example_script_runs_without_a_launcher() -> None:
    """The in-suite command of the docstrings, as a user types it: exit status 0, every rank reports."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "eval_gather.py"), "--world", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("every rank has") == 2
    # one whole line a rank, in rank order (funcoll.testing.print_ranks), and nothing on stderr to worry about
    ranks = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert ranks == ["rank 0", "rank 1"], proc.stdout
    assert "Warning" not in proc.stderr and "unwaited" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_listed_in_the_readme_and_shown_in_the_docs(name: str) -> None:
    """README.md names every example, and docs/examples.md includes its whole text."""
    assert f"`examples/{name}`" in (ROOT / "README.md").read_text(), name
    assert f'--8<-- "examples/{name}"' in (ROOT / "docs" / "examples.md").read_text(), name
