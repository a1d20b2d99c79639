"""The main job, ``python -m funcoll.demo``: the training demo agrees with its reference, and the tour passes.

The demo runs in-process through its entry function (``funcoll.demo.main``), which
starts its own gloo ranks, with few steps: the compiled run's compile is most of
its time. One test runs it as a user does under a launcher: ``torchrun -m funcoll.demo``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest
from _torchrun import torchrun

import funcoll
from funcoll import _demo_train as train
from funcoll import demo

STEPS = 6  # the quantized run's drift shows from the second step on


def _keep_runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Make the demo's run_ranks also keep what the ranks returned, under "runs"."""
    captured: dict[str, Any] = {}
    real_run_ranks = demo.run_ranks

    def keep_runs(*args: Any, **kwargs: Any) -> Any:
        captured["runs"] = real_run_ranks(*args, **kwargs)
        return captured["runs"]

    monkeypatch.setattr(demo, "run_ranks", keep_runs)
    return captured


@pytest.mark.usefixtures("warnings_fail")
def test_demo_trains_three_ways_in_agreement_and_fp8_tracks_them(
    monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    """6 steps on 2 ranks with ``--wire``: exit 0, agreement with the reference, 0 graph breaks, 1 compile
    per rank; and the fourth run, its all_to_alls in FP8, every loss within WIRE_RTOL of the reference's
    (and not equal). One demo run for both (suite time): ``--wire`` adds the fourth run and changes
    nothing of the three. No warning: a Python warning raises on the rank, and stderr holds none of c10d's."""
    captured = _keep_runs(monkeypatch)
    with funcoll.set_checks(False):  # as a user runs it: the counts below are those without checks
        assert demo.main(["--world", "2", "--steps", str(STEPS), "--wire"]) == 0
    out, err = capfd.readouterr()
    assert "Warning" not in err and "unwaited" not in err, err[-3000:]
    assert "OK: the three runs match the single-process reference" in out
    assert "FP8 all_to_alls" in out
    (compiled,) = [
        line.split() for line in out.splitlines() if line.startswith("  funcoll compiled (aot_eager)")
    ]
    assert compiled[5:7] == ["0/0", "1/1"], compiled  # graph breaks, compiles per rank

    runs = captured["runs"]
    assert len(runs) == 2 and all(set(r) == {*train.MODES, "quantized"} for r in runs)
    for r in runs:
        assert [len(r[m].losses) for m in train.MODES] == [STEPS] * 3
        assert all(math.isfinite(x) for m in train.MODES for x in r[m].losses)
        # The counts the table shows. Seed-style: a size exchange (an all_gather and one .item() per rank)
        # for the document ids, each block's attention and the loss, the two padded gathers, 4 all_to_alls
        # a block (forward and backward), the gradients' all_reduce. funcoll: one size exchange (one host
        # read), the ids' all_to_all, the 4 all_to_alls a block, the loss gather and its adjoint, the all_reduce.
        exchanges = 1 + train.LAYERS + 1
        assert (r["seed"].comm_calls, r["seed"].host_reads) == (
            exchanges + 2 + 4 * train.LAYERS + 1,
            2 * exchanges,
        )
        for mode in ("eager", "compiled"):
            assert (r[mode].comm_calls, r[mode].host_reads) == (2 + 4 * train.LAYERS + 2 + 1, 1), mode

    ref = train.reference(train.Config(steps=STEPS), show=False)
    for r in runs:
        q = r["quantized"]
        drift = max(abs(a - b) / abs(b) for a, b in zip(q.losses, ref.losses, strict=True))
        assert 0 < drift <= train.WIRE_RTOL, drift
        assert q.comm_calls == r["eager"].comm_calls  # the same collectives, fewer bytes in each
    # One rank sends nothing, so its quantized run is exact: that passes (not "nothing was quantized").
    one = {**runs[0], "quantized": dataclasses.replace(runs[0]["quantized"], losses=list(ref.losses))}
    assert demo.report(train.Config(steps=STEPS, wire=True), 1, "gloo", [one]) == 0
    # A quantized run beyond the tolerance fails the demo.
    saved = list(runs[0]["quantized"].losses)
    runs[0]["quantized"].losses[3] *= 1 + 2 * train.WIRE_RTOL
    assert demo.report(train.Config(steps=STEPS, wire=True), 2, "gloo", runs) == 1
    assert "MISMATCH" in capfd.readouterr().out
    runs[0]["quantized"].losses[:] = saved
    # A run that drifts from the reference by more than the tolerance fails the demo.
    runs[1]["eager"].losses[2] += 10 * demo.TOLERANCE
    assert demo.report(train.Config(steps=STEPS, wire=True), 2, "gloo", runs) == 1
    assert "MISMATCH" in capfd.readouterr().out


def test_demo_runs_under_torchrun() -> None:
    """``torchrun --nproc-per-node 2 -m funcoll.demo``: the launcher's ranks train, rank 0 prints the summary.

    2 steps, and dynamo's ``eager`` backend for the compiled run (the launcher path is
    under test here, not AOT autograd, which the in-process test compiles with).
    """
    out, err = torchrun(["-m", "funcoll.demo", "--steps", "2", "--compile-backend", "eager"], timeout=180)
    assert "Warning" not in err and "unwaited" not in err, err[-3000:]
    assert f"funcoll {funcoll.__version__} demo: 2 gloo ranks on cpu" in out, out[-3000:]
    assert out.count("OK: the three runs match the single-process reference") == 1, out[-3000:]
    assert "funcoll compiled (eager)" in out


def test_tour_still_passes(capsys: Any) -> None:
    """``--tour``: every op eager and compiled on 2 ranks, checked against single-process results."""
    assert demo.main(["--tour", "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "all results match the single-process reference" in out
    assert "FAIL" not in out


def test_shards_are_ragged_and_cover_the_sequence() -> None:
    """The data: every step's shards concatenate to its sequence, lengths vary, and some rank holds 0."""
    cfg = train.Config(steps=6)
    lengths = set()
    for step in range(cfg.steps):
        whole = train.global_batch(cfg, step)
        parts = [train.rank_batch(cfg, step, r, 3) for r in range(3)]
        sizes = parts[0][1]
        assert sum(sizes) == whole.tokens.shape[0]
        assert all(p.tokens.shape[0] == n for (p, _), n in zip(parts, sizes, strict=True))
        assert all(
            p.tokens.tolist() == whole.tokens[sum(sizes[:r]) :][: sizes[r]].tolist()
            for r, (p, _) in enumerate(parts)
        )
        lengths.add(whole.tokens.shape[0])
        if step % 3 == 2:
            assert 0 in sizes
    assert len(lengths) > 1


def test_progress_is_not_silent_while_a_step_runs(capfd: Any) -> None:
    """A long first step (a compile) shows: in a log (not a terminal), a line after each quiet interval,
    naming the step and what it does; then the phase's closing line."""
    for i in train.progress(range(2), 2, "funcoll compiled", True, first="compiling", every=0.05, quiet=0.2):
        time.sleep(0.7 if i == 0 else 0.0)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("funcoll compiled")]
    assert 2 <= sum("step 1/2 (compiling)" in line for line in lines) <= 4, err
    assert lines[-1].split()[-3:-1] == ["2", "steps"], err
