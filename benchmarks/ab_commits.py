"""Two commits of funcoll side by side: a benchmark's ratios of each, in interleaved rounds.

Run: ``python benchmarks/ab_commits.py REV_A REV_B [--bench sweep|call_cost] [--kib 64 1024 16384]
[--worlds 2] [--layouts equal] [--rounds 6] [--iters 9] [--methods ...] [--metric ratio|cpu_us|...]
[--link RATE]``

Each commit is checked out once into a worktree (``$TMPDIR/funcoll-ab/<sha>``). A
round runs this checkout's benchmark (``sweep_ragged.py``: one round of it, every
method and its funcol baseline interleaved in one process group; or
``bench_call_cost.py``: one round of `iters` calls a method, the calling thread's
CPU per call beside the wall time) once per commit, with
``PYTHONPATH`` pointing at that commit's worktree, so that the benchmark code is the
same and only funcoll differs; the commits' order alternates between rounds, so
that drift hits both alike. Each run's ratio (method over its funcol baseline,
measured in the same process) is one sample; the table gives, per commit, the
median over rounds and the range, and B's median over A's. ``--link RATE`` runs
every round under ``netlink RATE`` (``_timing.on_link``). This is how a
regression between two commits is found (bisect with it) and how a change is
measured before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import add_link_argument, on_link

HERE = Path(__file__).resolve().parent
_CALLS = ["funcol all_gather_into_tensor", "funcoll.all_gather", "funcoll.gather, sizes=",
          "funcoll.gather (exchanged)", "funcoll.all_to_all"]  # fmt: skip
REPO = HERE.parent


def _worktree(rev: str) -> tuple[str, Path]:
    """`rev`'s commit and a worktree of it (made once)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True, text=True)
    commit = sha.stdout.strip()
    where = Path(tempfile.gettempdir()) / "funcoll-ab" / commit[:12]
    if not where.is_dir():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(where), commit],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    return commit, where


def _one_round(where: Path, args: argparse.Namespace) -> list[dict]:
    """One round of the benchmark with funcoll from `where`: its records (rank 0's)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        common = ["--rounds", "1", "--worlds", *map(str, args.worlds), "--kib", *map(str, args.kib),
                  "--json", out.name]  # fmt: skip
        if args.bench == "sweep":
            cmd = [sys.executable, str(HERE / "sweep_ragged.py"), *common, "--iters", str(args.iters),
                   "--layouts", *args.layouts]  # fmt: skip
        else:
            cmd = [sys.executable, str(HERE / "bench_call_cost.py"), *common, "--calls", str(args.iters)]
        env = {**os.environ, "PYTHONPATH": str(where)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"sweep at {where} failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())["records"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs=2, metavar="REV")
    parser.add_argument("--bench", default="sweep", choices=["sweep", "call_cost"])
    parser.add_argument(
        "--metric", default="ratio", help="the record's field compared (call_cost: cpu_us, ...)"
    )
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--layouts", nargs="+", default=["equal"], choices=["equal", "skew16"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument(
        "--methods", nargs="+", help="default: the sweep's gathers, or every call_cost method"
    )
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    trees = [_worktree(rev) for rev in args.revs]
    methods = args.methods or (["gather auto", "gather auto, sizes="] if args.bench == "sweep" else _CALLS)
    samples: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for k in range(2) if r % 2 == 0 else (1, 0):
            for rec in _one_round(trees[k][1], args):
                if rec["method"] in methods and rec.get("rank", 0) == 0:
                    key = (k, rec["world"], rec["kib_per_rank"], rec["layout"], rec["method"])
                    samples.setdefault(key, []).append(rec[args.metric])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    a, b = (f"{rev} ({commit[:7]})" for rev, (commit, _) in zip(args.revs, trees, strict=True))
    print(f"{args.bench} {args.metric} (ratio: over funcol's even collective of the same bytes): "
          f"median [min-max] of {args.rounds} rounds")  # fmt: skip
    print(f"| world | KiB/rank | layout | method | A: {a} | B: {b} | B / A |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for key in dict.fromkeys(k[1:] for k in samples):
        got = [samples[(k, *key)] for k in range(2)]
        med = [statistics.median(s) for s in got]
        cells = [f"{m:.2f} [{min(s):.2f}-{max(s):.2f}]" for m, s in zip(med, got, strict=True)]
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {cells[0]} | {cells[1]} | {med[1] / med[0]:.2f} |"
        )


if __name__ == "__main__":
    main()
