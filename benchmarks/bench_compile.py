"""What a compiled step's first call costs with funcoll's ops, beside the same step on funcol's even ops.

Run: ``python benchmarks/bench_compile.py [--worlds 2 4] [--backends aot_eager inductor] [--rounds 2]
[--warm [--allow-caches]] [--json out.json]``

A training step's first compiled call traces it (dynamo), builds its joint graph and
partitions it (AOT autograd) and, on inductor, generates and compiles code; on a
small CPU that is seconds to a minute before the first step runs. This benchmark
times that first call (forward and backward) of one step written three ways, in
one process per rank, cold each time (``torch._dynamo.reset()`` and inductor's
caches off), with the methods interleaved over rounds:

- ``funcol even`` (the baseline): torch's own autograd-aware functional
  collectives, ``all_gather_tensor_autograd`` -> a linear ->
  ``reduce_scatter_tensor_autograd`` -> ``all_to_all_single_autograd``, equal
  shards of ``T`` rows on every rank.
- ``funcoll even``: the same step on ``funcoll.all_gather``,
  ``funcoll.reduce_scatter`` and ``funcoll.all_to_all`` (default checks).
- ``funcoll ragged``: ``funcoll.gather`` of ``T + rank`` rows (lengths exchanged
  in the graph, ``mark_ragged`` input) -> a linear -> ``funcoll.reduce_scatter``
  back to each rank's rows (``sizes=`` the lengths as a list): two collectives
  and the length exchange, so compare it with ``funcoll even`` for what
  raggedness costs the compiler.
- ``... eager``: the first eager call of the funcol and funcoll steps, for scale.

With ``--warm`` inductor's caches stay on (the FX graph cache and AOT autograd's,
on disk, as a job has them by default) and the untimed round fills them: each timed
first call is then what a restarted job pays for a step it compiled before. A graph
that a cache refuses ("bypass", counted per method in ``torch._dynamo.utils.counters``
and reported) compiles in full again. ``--allow-caches`` calls
``funcoll.allow_compile_caches()`` in every rank first, so that the caches keep
funcoll's graphs too (docs/compile.md).

Reported per method: the first call's wall time (the slowest rank's), the steady
step's time after it (median of 3 calls), and the first call's time over the
baseline's in the same round (median over rounds; an untimed round first
pays the process's one-time warm-ups), plus where the compile went
(dynamo's ``compilation_time_metrics``: dynamo's trace of the Python, and
inductor's code generation, ``compile_fx_inner``, for the forward graph and the
backward graph, which it compiles at the first backward).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _timing import add_link_argument, dump_records, on_link

import funcoll
from funcoll.testing import run_ranks

T, D = 256, 256  # rows a rank holds (funcoll ragged: T + rank), features
STEADY = 3  # calls after the first, for the step's own time
# dynamo's compile-time metrics (torch._dynamo.utils.compilation_time_metrics) that split the first call.
PHASES = {
    "total": "_compile.compile_inner",
    "backend": "OutputGraph.call_user_compiler",
    "aot": "create_aot_dispatcher_function",
    "inductor": "compile_fx_inner",
}


def _steps(
    rank: int, world: int, form: str
) -> dict[str, tuple[Callable[..., torch.Tensor], torch.Tensor, bool]]:
    """name -> (step, its input, ragged?): each step returns its loss (forward only; the caller runs backward).

    `form` "bare": the collectives around one matmul, the worst case for the ratio;
    "mlp": a sequence-parallel MLP block (Megatron's: all_gather the sequence,
    layer norm, ``D -> 4D`` GELU ``-> D``, reduce_scatter it back), what a model's
    step around these collectives is made of.
    """
    group = dist.group.WORLD
    torch.manual_seed(0)
    w = torch.randn(D, D) / D**0.5
    w1, w2 = torch.randn(D, 4 * D) / D**0.5, torch.randn(4 * D, D) / (4 * D) ** 0.5

    def body(y: torch.Tensor) -> torch.Tensor:
        if form == "bare":
            return y @ w
        y = torch.nn.functional.layer_norm(y, (D,))
        return torch.nn.functional.gelu(y @ w1) @ w2

    def funcol_even(x: torch.Tensor) -> torch.Tensor:
        y = body(funcol.all_gather_tensor_autograd(x, 0, group))
        z = funcol.reduce_scatter_tensor_autograd(y, "sum", 0, group)
        return funcol.all_to_all_single_autograd(z, None, None, group).square().sum()

    def funcoll_even(x: torch.Tensor) -> torch.Tensor:
        y = body(funcoll.all_gather(x, 0))
        z = funcoll.reduce_scatter(y, 0)
        return funcoll.all_to_all(z, None, 0, 0).square().sum()

    ragged_sizes = [T + r for r in range(world)]

    def funcoll_ragged(x: torch.Tensor) -> torch.Tensor:
        y = body(funcoll.gather(x, 0))  # the lengths exchanged in the graph
        return funcoll.reduce_scatter(y, 0, sizes=ragged_sizes).square().sum()

    even = torch.randn(T, D, generator=torch.Generator().manual_seed(rank))
    ragged = torch.randn(T + rank, D, generator=torch.Generator().manual_seed(rank))
    return {
        "funcol even": (funcol_even, even, False),
        "funcoll even": (funcoll_even, even, False),
        "funcoll ragged": (funcoll_ragged, ragged, True),
    }


def _call(step: Callable[..., torch.Tensor], x: torch.Tensor, ragged: bool) -> None:
    x = x.detach().clone().requires_grad_()
    if ragged:
        x = funcoll.mark_ragged(x, 0)
    step(x).backward()


def _first_call(step: Callable[..., torch.Tensor], x: torch.Tensor, ragged: bool) -> tuple[float, float]:
    """Seconds of the first call (after a barrier) and the median of the `STEADY` calls after it."""
    dist.barrier()
    start = time.perf_counter()
    _call(step, x, ragged)
    first = time.perf_counter() - start
    steady = []
    for _ in range(STEADY):
        dist.barrier()
        start = time.perf_counter()
        _call(step, x, ragged)
        steady.append(time.perf_counter() - start)
    return first, statistics.median(steady)


def _bench(
    rank: int,
    world: int,
    backends: list[str],
    forms: list[str],
    rounds: int,
    warm: bool = False,
    allow_caches: bool = False,
) -> list[dict]:
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import compilation_time_metrics, counters

    if not warm:
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # what the next line asks for
        inductor_config.force_disable_caches = True  # every first call compiles cold: no FX graph / AOT cache
    if allow_caches:
        funcoll.allow_compile_caches()
    caches: dict[tuple[str, str, str], dict[str, int]] = {}
    steps = {form: _steps(rank, world, form) for form in forms}
    modes = ["eager", *backends]
    times: dict[tuple[str, str, str], list[tuple[float, float, dict[str, float]]]] = {}
    # Round 0: the process's one-time warm-ups (imports, lazy inits), untimed.
    for round_ in range(rounds + 1):
        for form, mode in itertools.product(forms, modes):
            for name, (fn, x, ragged) in steps[form].items():
                if mode == "eager" and name == "funcoll ragged":
                    continue  # its first eager call is funcoll even's, plus the length exchange
                torch._dynamo.reset()
                compilation_time_metrics.clear()
                counters.clear()
                step = fn if mode == "eager" else torch.compile(fn, backend=mode, fullgraph=True)
                first, steady = _first_call(step, x, ragged)
                phases = {k: sum(compilation_time_metrics.get(v, [])) for k, v in PHASES.items()}
                if round_ == 0:
                    continue
                caches[(form, mode, name)] = {
                    f"{what}_{how}": n
                    for what, key in (("aot", "aot_autograd"), ("fx", "inductor"))
                    for name_, n in counters[key].items()
                    for how in ("hit", "miss", "bypass")
                    if name_.endswith(f"cache_{how}")
                    and name_.startswith(("autograd_cache", "fxgraph_cache"))
                }
                times.setdefault((form, mode, name), []).append((first, steady, phases))
    records = []
    for (form, mode, name), runs in times.items():
        base = times[(form, mode, "funcol even")]
        records.append({
            "world": world, "rank": rank, "form": form, "mode": mode, "method": name,
            "first_s": statistics.median(r[0] for r in runs),
            "steady_ms": 1e3 * statistics.median(r[1] for r in runs),
            "ratio": statistics.median(r[0] / b[0] for r, b in zip(runs, base, strict=True)),
            "phases_s": {k: statistics.median(r[2][k] for r in runs) for k in PHASES},
            "caches": caches.get((form, mode, name), {}),
        })  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--forms", nargs="+", default=["bare", "mlp"], choices=["bare", "mlp"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="", help="write every record to this file")
    parser.add_argument(
        "--warm", action="store_true", help="inductor's caches on, filled by the untimed round"
    )
    parser.add_argument(
        "--allow-caches",
        action="store_true",
        help="with --warm: funcoll.allow_compile_caches() first, so the caches keep funcoll's graphs",
    )
    add_link_argument(parser)
    args = parser.parse_args()
    if args.allow_caches and not args.warm:
        parser.error("--allow-caches needs --warm (cold compiles turn the caches off)")
    print(on_link(args.link))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # ranks share the cores; no worker pool
    records = []
    for world in args.worlds:
        per_rank = run_ranks(
            _bench, world, args.backends, args.forms, args.rounds, args.warm, args.allow_caches, timeout=3600
        )
        # The slowest rank's first call is the step's: the collectives wait for it.
        for r0 in per_rank[0]:
            key = (r0["form"], r0["mode"], r0["method"])
            same = [r for rank in per_rank for r in rank if (r["form"], r["mode"], r["method"]) == key]
            slowest = max(same, key=lambda r: r["first_s"])
            records.append({**slowest, "ratio": max(r["ratio"] for r in same)})
    print(f"torch {torch.__version__}, gloo on CPU, {T} x {D} float32 rows a rank, "
          f"{'warm caches' if args.warm else 'cold compiles'}{' (allow_compile_caches)' if args.allow_caches else ''}, "
          f"medians of {args.rounds} interleaved rounds, slowest rank")  # fmt: skip
    print(
        "| world | step | mode | method | first call s | x funcol | steady ms | dynamo trace s | inductor s "
        "| caches (rank 0's last round) |"
    )
    print("|---:|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in records:
        p = r["phases_s"]
        trace = p["total"] - p["backend"]  # dynamo's compile less the backend's (AOT autograd, inductor)
        print(f"| {r['world']} | {r['form']} | {r['mode']} | {r['method']} | {r['first_s']:.2f} | {r['ratio']:.2f} "
              f"| {r['steady_ms']:.1f} | {trace:.2f} | {p['inductor']:.2f} "
              f"| {' '.join(f'{k} {v}' for k, v in sorted(r['caches'].items()))} |")  # fmt: skip
    dump_records(args.json, records)


if __name__ == "__main__":
    main()
