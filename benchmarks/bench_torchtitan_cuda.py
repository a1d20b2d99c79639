"""torchtitan's MoE layer on one CUDA GPU: its dispatcher beside funcoll's, bf16 grouped GEMMs, host syncs counted.

Run (needs a CUDA GPU and torchtitan as bench_torchtitan.py says):
``python benchmarks/bench_torchtitan_cuda.py [--tokens 4096 16384] [--iters 20] [--no-compile]``

One process, a one-rank NCCL group and a one-rank ``ep`` mesh (NCCL refuses two
ranks on one device): torchtitan 0.3.0's ``MoE`` layer (its router, its
``GroupedExperts``, whose three GEMMs are ``torch._grouped_mm`` on CUDA, its
load-balancing counter), ``E = 8`` experts, top-2, ``D = 2048``, ``F = 1024``,
parameters and tokens in bf16, built once per dispatcher from the same weights
(bench_torchtitan.py's ``_layer``):

- ``titan``: torchtitan's ``AllToAllTokenDispatcher`` (``spmd_backend="partial_dtensor"``);
- ``funcoll exact`` / ``static`` (capacity factor 1.25) / ``dropless`` (from
  1.25) / ``dropless 1.0`` (the default factor: on one rank the dropless bound
  ``T * k``): ``funcoll.integrations.torchtitan.FuncollTokenDispatcher``;
- ``..., compiled``: exact and static under ``torch.compile(fullgraph=True)``
  (inductor), compiled before the timed steps.

What one GPU measures is the part of a dispatcher the GPU runs whatever the world
size: the layout (counting, sorting, copying the routed rows into expert blocks
and back), its host syncs, and the collectives' one-rank form; not the network.
Two expert forms: ``grouped`` (torchtitan's), and ``scale`` (a per-feature scale,
so the step is the router and the dispatcher). For ``scale`` the ``x copy``
column is the step over copying the routed rows (``T * K`` rows of ``D``) device
to device four times: dispatch and combine each move them once forward and once
backward, so a dispatcher that only copied, with no router, would measure 1.0.

A step is the layer's forward and the backward of its output's sum, down to the
input, which requires grad (as every MoE layer's but a model's first). Times: the
median over `iters` steps after two warm-ups, each timed from the host with
``torch.cuda.synchronize()`` after it; every method's steps interleaved over
`rounds` rounds, the median of the rounds. Host syncs per step: CUDA's own
count (``torch.cuda.set_sync_debug_mode("warn")``, which also counts
torchtitan's ``.to("cpu")`` of its splits), and ``.tolist`` / ``.item`` calls.

torch 2.11 (the release on the GPU machines) lacks
``torch.compiler._is_non_strict_tracing``, which torchtitan 0.3.0's dispatchers
call to ask whether a non-strict export is tracing them; where it is missing
this script defines it to answer False (nothing here exports).

Without a GPU (``--quick`` in tests/test_benchmarks.py) it runs a small layer
(``D = F = 64``) on CPU tensors over a one-rank gloo group, eager, with no sync
count: a smoke run, not a CUDA figure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import gpu_median_ms, init_one_rank_group
from bench_moe_cuda import cuda_syncs
from bench_torchtitan import K, _layer, _step, dispatchers

from funcoll import testing

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
D, F = (2048, 1024) if CUDA else (64, 64)
LOCAL = 8
BF16 = torch.bfloat16


def _methods(experts: str, compile_: bool) -> dict[str, tuple[Any, Any]]:
    mesh = init_device_mesh(DEVICE, (1,), mesh_dim_names=("ep",))
    configs = dispatchers(LOCAL)

    def build(cfg: Any) -> Any:
        layer = _layer(1, 0, cfg, mesh, experts, d=D, f=F, local=LOCAL).to(DEVICE)
        # parameters in bf16, as FSDP's mixed precision computes; buffers as they are
        for p in layer.parameters():
            p.data = p.data.to(BF16)
        return layer

    methods = {}
    for name, cfg in configs.items():
        layer = build(cfg)
        methods[name] = (layer, layer)
        if compile_ and name in ("funcoll exact", "funcoll static"):
            compiled = build(cfg)
            methods[f"{name}, compiled"] = (
                torch.compile(compiled, fullgraph=True, backend="inductor"),
                compiled,
            )
    return methods


def _bench(t: int, experts: str, rounds: int, iters: int, compile_: bool) -> list[dict[str, Any]]:
    x = torch.randn(1, t, D, generator=torch.Generator().manual_seed(10)).to(DEVICE, BF16).requires_grad_()
    methods = _methods(experts, compile_)
    src, dst = x.new_ones(t * K, D), x.new_empty(t * K, D)  # the routed rows
    copy_ms = gpu_median_ms(lambda: [dst.copy_(src) for _ in range(4)], iters)
    try:
        ref = _step(*methods["titan"], x).detach().float()
    except Exception as e:  # noqa: BLE001 -- reported in every row; funcoll's steps still run
        ref, methods = None, {name: m for name, m in methods.items() if name != "titan"}
        print(f"titan's step failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    rows = {}
    for name, (fn, layer) in methods.items():
        row: dict[str, Any] = {"tokens": t, "experts": experts, "method": name, "ms": []}
        try:
            out = _step(fn, layer, x).detach().float()  # compiles the compiled ones
            row["max_err"] = None if ref is None else float((out - ref).abs().max() / ref.abs().max())
            run = functools.partial(_step, fn, layer, x)
            row["cuda_syncs"] = cuda_syncs(run) if CUDA else None
            with testing.count_host_reads() as reads:
                run()
            row["host_reads"] = reads.count
        except Exception as e:  # noqa: BLE001 -- a method that fails here is reported, the others go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows[name] = row
    for _ in range(rounds):
        for name, (fn, layer) in methods.items():
            if "error" not in rows[name]:
                rows[name]["ms"].append(gpu_median_ms(functools.partial(_step, fn, layer, x), iters))
    for name, row in rows.items():
        if "error" not in row:
            row["ms"] = statistics.median(row["ms"])
            row["copy_ms"] = copy_ms
            row["overflows"] = getattr(methods[name][1].routed_experts.token_dispatcher, "overflows", None)
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--experts", nargs="+", default=["grouped", "scale"], choices=["grouped", "scale"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="eager methods only")
    parser.add_argument(
        "--quick", action="store_true", help="T=64, scale experts, eager, 1 round: a smoke run"
    )
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.experts, args.rounds, args.iters, args.no_compile = [64], ["scale"], 1, 2, True
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch < 2.12: see the module's docstring
        torch.compiler._is_non_strict_tracing = lambda: False
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    where = init_one_rank_group()
    try:
        print(
            f"torch {torch.__version__}, {where}; torchtitan's MoE, "
            f"D={D}, F={F}, E={LOCAL}, k={K}, bf16; a step: forward and backward of the output's sum"
        )
        print(
            "| T | experts | method | ms | x titan | x copy | CUDA syncs / step | .tolist/.item | overflows | max rel. err |"
        )
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for experts in args.experts:
            for t in args.tokens:
                rows = _bench(t, experts, args.rounds, args.iters, not args.no_compile)
                base = next((r["ms"] for r in rows if r["method"] == "titan" and "error" not in r), None)
                for r in rows:
                    if "error" in r:
                        print(f"| {t} | {experts} | {r['method']} | failed: {r['error']} |||||||")
                        continue
                    copy = f"{r['ms'] / r['copy_ms']:.2f}" if experts == "scale" else ""
                    vs = "" if base is None else f"{r['ms'] / base:.2f}"
                    err = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
                    syncs = "n/a" if r["cuda_syncs"] is None else r["cuda_syncs"]
                    over = "" if r["overflows"] is None else r["overflows"]
                    print(
                        f"| {t} | {experts} | {r['method']} | {r['ms']:.3f} | {vs} | {copy} "
                        f"| {syncs} | {r['host_reads']} | {over} | {err} |"
                    )
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
