"""funcoll's main job: a sequence-parallel transformer trained on ragged batches, three ways.

``python -m funcoll.demo`` starts ``--world`` CPU ranks on gloo itself (or, under
``torchrun``, uses the launcher's ranks) and trains a tiny transformer with
Ulysses sequence parallelism on variable-length batches, where each rank holds a
ragged shard of every step's sequence (0 tokens on some steps):

1. with seed-style helpers (:mod:`funcoll._demo_seeds`: padded, list-based,
   ``autograd.Function`` wrappers, as widely copied; eager, since they do not
   compile);
2. with funcoll, eagerly;
3. with funcoll under ``torch.compile(fullgraph=True)``, compiled once per rank.

A single process trains the same model on the whole sequence as the reference.
It prints a progress bar per phase and a table: the largest loss and parameter
difference from the reference, graph breaks, compiles per rank, the collectives
and host reads per step (counted: what the seed-style helpers cost and
funcoll does not), the median step time, wall and CPU, and the share of the step
in which collectives run, with notes on what the times mean on the machine. It
exits 1 if any run differs from the reference (:mod:`funcoll._demo_train` has
the model).

``python -m funcoll.demo --tour`` runs the earlier 5-second tour: every op eager
and compiled on CPU ranks, checked against single-process results.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from typing import Any

import torch
import torch.distributed as dist

import funcoll
from funcoll import _demo_train as train
from funcoll.testing import run_ranks

TOLERANCE = 1e-9  # float64: the runs differ from the reference only in summation order (about 1e-15)


# ------------------------------------------------------------------------------------ tour
def _rank_rows(rank: int, n: int, width: int = 3) -> torch.Tensor:
    """Rank `rank`'s ragged input: n rows whose values say where they came from."""
    return torch.arange(n * width, dtype=torch.float64).view(n, width) + 100 * rank


def _lengths(world: int, step: int) -> list[int]:
    return [(3 * r + 2 * step) % 5 for r in range(world)]  # 0 included on purpose


def _tour(rank: int, world: int) -> list[tuple[str, bool, str]]:
    lines: list[tuple[str, bool, str]] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor, what: str, also: bool = True) -> None:
        lines.append((name, also and bool(torch.allclose(got, want)), what))

    # Ragged gather of variable-length sequences: values and the adjoint gradient.
    sizes = _lengths(world, 0)
    full = torch.cat([_rank_rows(r, n) for r, n in enumerate(sizes)])
    x = _rank_rows(rank, sizes[rank]).requires_grad_()
    y = funcoll.gather(x)
    (y.sin().sum()).backward()
    off = sum(sizes[:rank])
    want_grad = world * full.cos()[off : off + sizes[rank]]  # every rank's loss reaches every row
    check("gather (ragged)", y.detach(), full, f"sizes {sizes} -> {tuple(y.shape)}")
    check("  backward", x.grad, want_grad, "ragged reduce_scatter of the gradient")

    # all_to_all: sequence-sharded (B, S/w, H, D) -> head-sharded (B, S, H/w, D).
    heads, seq = 2 * world + 1, 2
    g = torch.Generator().manual_seed(0)
    glob = torch.randn(1, seq * world, heads, 4, generator=g, dtype=torch.float64)
    mine = glob[:, rank * seq : (rank + 1) * seq]
    out = funcoll.all_to_all(mine, None, scatter_dim=2, gather_dim=1)
    hs = torch.tensor_split(torch.arange(heads), world)[rank]
    check("all_to_all", out, glob[:, :, hs], f"{tuple(mine.shape)} -> {tuple(out.shape)} (H={heads} uneven)")

    # reduce_scatter and all_reduce against sums over the ranks' inputs.
    parts = [torch.arange(world * 2.0) * (r + 1) for r in range(world)]
    total = sum(parts)
    rs = funcoll.reduce_scatter(parts[rank])
    check("reduce_scatter", rs, total[2 * rank : 2 * rank + 2], "sum, this rank's slice")
    check("all_reduce", funcoll.all_reduce(parts[rank]), total, "sum")

    # all_to_all_v: MoE-style dispatch with uneven send sizes.
    send = [(rank + j) % 3 for j in range(world)]
    xs = torch.cat([torch.full((n,), 10.0 * rank + j) for j, n in enumerate(send)])
    got, recv = funcoll.all_to_all_v(xs, send)
    want = torch.cat([torch.full(((i + rank) % 3,), 10.0 * i + rank) for i in range(world)])
    check("all_to_all_v", got, want, f"send {send} recv {recv.tolist()}")  # host sync: demo print

    # Static shapes: the same rows padded to a bound, the lengths kept on the device.
    bound = 4
    padded = torch.cat(
        [_rank_rows(rank, sizes[rank]), torch.zeros(bound - sizes[rank], 3, dtype=torch.float64)]
    )
    yp, lens = funcoll.gather_padded(padded, torch.tensor(sizes[rank]))
    want_padded = torch.cat([full, full.new_zeros(world * bound - full.shape[0], 3)])
    lens_ok = lens.tolist() == sizes  # host sync: the demo's check
    check(
        "gather_padded",
        yp,
        want_padded,
        f"bound {bound} -> {tuple(yp.shape)}, sizes stay on the device",
        lens_ok,
    )

    # MoE dispatch with a capacity: the same exchange as all_to_all_v, shapes static.
    cap = 2
    blocks = torch.zeros(world * cap)
    for j, n in enumerate(send):
        blocks[j * cap : j * cap + n] = 10.0 * rank + j
    got_p, recv_p = funcoll.all_to_all_padded(blocks, torch.tensor(send))
    check("all_to_all_padded", got_p, torch.cat([want, want.new_zeros(world * cap - want.numel())]),
          f"capacity {cap} -> {tuple(got_p.shape)}, recv sizes stay on the device",
          torch.equal(recv_p, recv))  # fmt: skip

    # The same ragged step compiled: one graph, no recompiles as sizes change.
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda t: funcoll.gather(t).square().sum(), backend=counter, fullgraph=True)
    ok = True
    for i in range(1, 6):
        sz = _lengths(world, i)
        ref = torch.cat([_rank_rows(r, n) for r, n in enumerate(sz)]).square().sum()
        ok &= bool(torch.allclose(step(funcoll.mark_ragged(_rank_rows(rank, sz[rank]))), ref))
    lines.append(
        ("compiled gather", ok and counter.frame_count == 1, f"5 size sets, {counter.frame_count} compile")
    )
    return lines


def tour(world: int) -> int:
    """Run the tour of the ops on `world` CPU ranks; print one line per op; 1 if anything differs."""
    results = run_ranks(_tour, world, timeout=300)
    print(f"funcoll {funcoll.__version__} tour on {world} gloo ranks (torch {torch.__version__})")
    failed = False
    for i, (name, _, what) in enumerate(results[0]):
        ok = all(r[i][1] for r in results)
        failed |= not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {name:<18} {what}")
    print("all results match the single-process reference" if not failed else "MISMATCH: see FAIL lines")
    return 1 if failed else 0


# -------------------------------------------------------------------------------- training
def _rank_runs(rank: int, world: int, cfg: train.Config) -> dict[str, train.PhaseResult]:
    """Every run on one rank, in order (seed-style, funcoll eager, funcoll compiled); rank 0 shows bars."""
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    return {mode: train.train_rank(mode, cfg, rank, world, show=rank == 0) for mode in cfg.modes}


def report(cfg: train.Config, world: int, backend: str, runs: list[dict[str, train.PhaseResult]]) -> int:
    """Train the reference, print the summary table; 0 if every run matches it, else 1."""
    ref = train.reference(cfg, show=True)
    sys.stderr.flush()
    heads = funcoll.split_sizes(train.HEADS, world)
    print()
    print(
        f"funcoll {funcoll.__version__} demo: {world} {backend} ranks on {cfg.device}, torch {torch.__version__}, "
        f"{cfg.steps} steps, float64"
    )
    print(
        f"model: {train.LAYERS} blocks, embed {train.EMBED}, {train.HEADS} heads split {heads} over the ranks "
        f"(Ulysses all_to_all), vocab {train.VOCAB}; every step a new sequence of "
        f"{train.MIN_TOKENS}-{train.MAX_TOKENS} tokens in documents, cut into ragged rank shards "
        f"({'every third step one rank holds 0' if world > 1 else 'one rank'})"
    )
    example = [train.rank_batch(cfg, s, 0, world)[1] for s in range(min(cfg.steps, 3))]
    print(f"tokens per rank, first steps: {', '.join(str(e) for e in example)}")
    print()
    rows, failed, waits = _rows(cfg, runs, ref)
    _print_table(rows)
    print()
    marks = sorted({0, cfg.steps // 2, cfg.steps - 1})
    print("loss, every run and rank: " + ", ".join(f"step {s} {ref.losses[s]:.6f}" for s in marks))
    for note in _notes(cfg, runs, waits):
        print(textwrap.fill(note, width=110, initial_indent="  - ", subsequent_indent="    "))
    if cfg.wire:
        drift = _drift([r["quantized"] for r in runs], ref)
        print(
            f"FP8 all_to_alls ({train.WIRE[0]}, gradients in {train.WIRE[1]}): every step's loss within "
            f"{drift:.2%} of the reference's (allowed: {train.WIRE_RTOL:.0%}; one rank sends nothing: exact)"
        )
        print("loss, reference vs FP8: " + ", ".join(
            f"step {s} {ref.losses[s]:.4f} vs {runs[0]['quantized'].losses[s]:.4f}" for s in marks
        ))  # fmt: skip
    if failed:
        print(
            f"MISMATCH: a run differs from the reference by more than {TOLERANCE:g} (the FP8 run: more than "
            f"{train.WIRE_RTOL:.0%}), or compiled more than once"
        )
    else:
        print(
            f"OK: the three runs match the single-process reference within {TOLERANCE:g} on every step's loss "
            f"and on the final parameters"
        )
    return 1 if failed else 0


def _rows(
    cfg: train.Config, runs: list[dict[str, train.PhaseResult]], ref: train.PhaseResult
) -> tuple[list[tuple[str, ...]], bool, dict[str, float]]:
    """The summary table's rows (a header, then one per run and the reference), whether a run failed, and each
    mode's wait per collective."""
    rows = [
        (
            "run",
            "max|dloss|",
            "max|dparam|",
            "graph breaks",
            "compiles/rank",
            "coll/step",
            "host reads/step",
            "step ms",
            "CPU ms",
            "in coll",
        )
    ]
    failed = False
    waits: dict[str, float] = {}
    for mode in cfg.modes:
        per_rank = [r[mode] for r in runs]
        dloss = max(train.max_abs_diff(r.losses, ref.losses) for r in per_rank)
        dparam = max(train.max_param_diff(r.params, ref.params) for r in per_rank)
        if mode == "quantized":  # rounded on the wire: each loss near the reference's (one rank: exact)
            drift = _drift(per_rank, ref)
            failed |= not (drift <= train.WIRE_RTOL and (drift > 0 or len(runs) == 1))
        else:
            failed |= not (dloss <= TOLERANCE and dparam <= TOLERANCE)
        title = train.MODE_TITLES[mode] + (f" ({cfg.compile_backend})" if mode == "compiled" else "")
        compiled = mode == "compiled"
        breaks = [r.graph_breaks for r in per_rank] if compiled else None
        compiles = [r.compiles for r in per_rank] if compiled else None
        if compiled:
            unique = [r.unique_graphs for r in per_rank]
            failed |= any(b != 0 for b in breaks or []) or any(c != 1 for c in [*(compiles or []), *unique])
        share = sum(r.comm_share or 0.0 for r in per_rank) / len(per_rank)
        calls = max(r.comm_calls or 0.0 for r in per_rank)
        reads = max(r.host_reads or 0.0 for r in per_rank)
        wall, cpu = train.median_ms(per_rank, cfg.steps), train.median_ms(per_rank, cfg.steps, cpu=True)
        if calls:
            waits[mode] = (wall - cpu) / calls
        rows.append(
            (
                title,
                f"{dloss:.1e}",
                f"{dparam:.1e}",
                "-" if breaks is None else "/".join(str(b) for b in breaks),
                "-" if compiles is None else "/".join(str(c) for c in compiles),
                f"{calls:g}",
                f"{reads:g}",
                f"{wall:.1f}",
                f"{cpu:.1f}",
                f"{100 * share:.0f}%",
            )
        )
    rows.append(
        (
            train.MODE_TITLES["reference"],
            "0",
            "0",
            "-",
            "-",
            "0",
            "0",
            f"{train.median_ms([ref], cfg.steps):.1f}",
            f"{train.median_ms([ref], cfg.steps, cpu=True):.1f}",
            "-",
        )
    )
    return rows, failed, waits


def _drift(per_rank: list[train.PhaseResult], ref: train.PhaseResult) -> float:
    """The largest relative difference of a run's losses from the reference's, every rank."""
    return max(abs(a - b) / abs(b) for r in per_rank for a, b in zip(r.losses, ref.losses, strict=True))


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print(
            "  "
            + "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _notes(
    cfg: train.Config,
    runs: list[dict[str, train.PhaseResult]],
    waits: dict[str, float],
) -> list[str]:
    """The notes under the table and the losses: what each column measures and how."""
    timed, profiled = train.step_ranges(cfg.steps)
    timed = timed or profiled
    compile_s = max(r["compiled"].step_times[0] for r in runs)
    coll = "NCCL kernels" if cfg.device == "cuda" else "gloo's spans"
    exchanges = 1 + train.LAYERS + 1  # the seed-style step: document ids, each block's attention, the loss
    route = runs[0]["seed"].route or "no collective (one rank)"
    notes = [
        "max|dloss|, max|dparam|: the largest difference from the reference over every step's loss and "
        "the final parameters, every rank.",
        f"compiled: torch.compile(fullgraph=True, backend={cfg.compile_backend!r}), funcoll.mark_ragged on "
        f"the inputs; graph breaks: torch._dynamo.utils.counters['graph_break']; compiles: frames counted "
        f"by a CompileCounterWithBackend, per rank; its first step (compiling) took {compile_s:.1f} s.",
        f"coll/step, host reads/step: counted, the mean over steps {profiled.start}-{profiled.stop - 1}: "
        f"the collectives the backend ran ({coll} in torch.profiler) and the Tensor.item/tolist calls "
        f"(funcoll.testing.count_host_reads). Eager funcoll at the default checks exchanges a header on "
        f"calls 1, 2, 4, 8, ... of each op, so its steps differ by those (a fraction in the mean). Seed-style: every call "
        f"exchanges sizes, {exchanges} all_gathers a step, each read back with one .item() per rank, and "
        f"pads to the longest rank; its all_to_all went by {route}. funcoll: one size exchange a step "
        f"(one host read), its sizes passed to every later op.",
        f"step ms: wall time, median of steps {timed.start}-{timed.stop - 1} (after warm-up), slowest rank. "
        f"CPU ms: the rank's own thread's CPU time in the step (model, Python, copies). in coll: the share "
        f"of steps {profiled.start}-{profiled.stop - 1} in which a collective ran (mean over ranks).",
    ]
    if cfg.device == "cpu":
        per_call = ", ".join(f"{mode} {ms:.2f}" for mode, ms in waits.items())
        notes.append(
            f"On CPU the step is latency: each collective moves a few KB, and the step waits on round trips "
            f"between processes ((step ms - CPU ms) / coll/step: {per_call} ms a collective here). The more "
            f"processes share the cores, the longer each wait, so step ms follows the collectives count and "
            f"the machine's load; the runs go one after another, and a change of load between them moves "
            f"their times by tens of percent. The counts do not move."
        )
    notes.append(
        "A host read costs nothing on CPU tensors (the sizes are in host memory already); on a GPU each is "
        "a device-to-host sync, which stalls the CPU until the GPU has caught up."
    )
    return notes


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _launched(cfg: train.Config, backend: str) -> int:
    """Under torchrun: this process is one rank; rank 0 prints the summary, every rank returns its verdict."""
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = _rank_runs(rank, world, cfg)
        runs: list[Any] = [None] * world
        dist.all_gather_object(runs, mine)
        code = [report(cfg, world, backend, runs) if rank == 0 else 0]
        dist.broadcast_object_list(code, src=0)
        return int(code[0])
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """The command line: the training demo (default) or ``--tour``; returns the exit code."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--tour", action="store_true", help="the tour of the ops instead of the training demo"
    )
    parser.add_argument("--world", type=int, default=2, help="number of CPU ranks to start (default 2)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: gloo on cpu, nccl on cuda"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--compile-backend",
        default="aot_eager",
        help="torch.compile backend of the compiled run (default aot_eager)",
    )
    parser.add_argument(
        "--wire",
        action="store_true",
        help="also train with the attention's all_to_alls in FP8 (docs/wire.md) and compare the losses",
    )
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world must be >= 1, got {args.world}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.tour:
        return tour(args.world)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    cfg = train.Config(
        steps=args.steps, device=args.device, compile_backend=args.compile_backend, wire=args.wire
    )
    if _under_launcher():
        return _launched(cfg, backend)
    start = time.perf_counter()
    print(
        f"funcoll demo: training on {args.world} {backend} ranks ({cfg.device}) three ways, then on one process",
        flush=True,
    )
    runs = run_ranks(_rank_runs, args.world, cfg, timeout=600, backend=backend)
    code = report(cfg, args.world, backend, runs)
    print(f"wall time {time.perf_counter() - start:.1f} s (ranks started by the demo)")
    return code


if __name__ == "__main__":
    sys.exit(main())
