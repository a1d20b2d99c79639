"""What shard_map's typed mode (``check_vma=True``) costs a training step, beside the untyped mode.

Run: ``python benchmarks/bench_typed.py [--sizes 8x64x256 64x512x2048] [--steps 20] [--rounds 5]
[--json out.json] [--link RATE]``

The step is docs/jax.md's Megatron MLP on a 2x2 ("dp", "tp") mesh of 4 gloo ranks:
``psum(tanh(x @ w1) @ w2, "tp")`` inside ``funcoll.shard_map``, its output's square
summed and backpropagated to the global inputs. Each size is ``BxDxH`` (batch,
model dim, hidden dim). Four methods run side by side, `rounds` times interleaved,
`steps` steps each after a barrier: eager and compiled (``torch.compile(fullgraph=True,
backend="aot_eager")``: the graphs as traced, without inductor's compile time), untyped
and typed. A method's figure is the median over rounds of its wall time per step
and of the calling thread's CPU time per step (``time.thread_time``: the Python
of the step, which is where the typed mode's per-op bookkeeping shows), each over
the untyped mode's of the same form in the same round. The typed mode's compiled
backward holds one collective fewer (the psum's); its eager steps pay the
``__torch_function__`` of every op on a typed value and wait each ``funcoll.lax``
result where they type it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _timing import add_link_argument, dump_records, on_link

import funcoll
from funcoll import P, lax
from funcoll.testing import run_ranks


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return lax.psum(torch.tanh(x @ w1) @ w2, "tp")


def _methods(b: int, d: int, h: int) -> dict[str, Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*s, generator=g).requires_grad_() for s in ((b, d), (d, h), (h, d))]
    specs = (P("dp", None), P(None, "tp"), P("tp", None))
    out: dict[str, Callable[[], None]] = {}
    for form in ("eager", "compiled"):
        for typed in (False, True):
            f = funcoll.shard_map(_mlp, mesh, specs, P("dp", None), check_vma=typed)
            if form == "compiled":
                f = torch.compile(f, fullgraph=True, backend="aot_eager")

            def step(f: Callable[..., torch.Tensor] = f) -> None:
                f(*inputs).to_local().square().sum().backward()

            out[f"{form}, {'check_vma=True' if typed else 'untyped'}"] = step
    return out


def _timed(fn: Callable[[], None], steps: int) -> tuple[float, float]:
    dist.barrier()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.thread_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def _bench(rank: int, world: int, sizes: list[str], steps: int, rounds: int) -> list[dict]:
    records = []
    for size in sizes:
        b, d, h = (int(v) for v in size.split("x"))
        methods = _methods(b, d, h)
        for fn in methods.values():  # compile, and warm
            for _ in range(3):
                fn()
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        wall: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(rounds):
            for m, fn in methods.items():
                c, w = _timed(fn, steps)
                cpu[m].append(c)
                wall[m].append(w)
        for m in methods:
            base = m.split(",")[0] + ", untyped"
            records.append({
                "world": world, "size": size, "method": m, "rank": rank,
                "ms": 1e3 * statistics.median(wall[m]), "cpu_ms": 1e3 * statistics.median(cpu[m]),
                "ratio": statistics.median(w / u for w, u in zip(wall[m], wall[base], strict=True)),
                "cpu_ratio": statistics.median(c / u for c, u in zip(cpu[m], cpu[base], strict=True)),
            })  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["8x64x256", "64x512x2048"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="", help="write every record to this file")
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    records = run_ranks(_bench, 4, args.sizes, args.steps, args.rounds, timeout=3600)[0]
    print(
        f"torch {torch.__version__}, gloo on CPU, 4 ranks (2x2), rank 0, medians of {args.rounds} "
        f"interleaved rounds of {args.steps} steps; x: over the untyped mode of the same form"
    )
    print("| BxDxH | method | ms/step | x | CPU ms/step | x |")
    print("|---|---|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['size']} | {r['method']} | {r['ms']:.2f} | {r['ratio']:.2f} | {r['cpu_ms']:.2f} "
              f"| {r['cpu_ratio']:.2f} |")  # fmt: skip
    dump_records(args.json, records)


if __name__ == "__main__":
    main()
