"""torchtitan's MoE layer with its own dispatcher and with funcoll's, one training step, eager and compiled.

Run: ``python benchmarks/bench_torchtitan.py [--worlds 2 4] [--tokens 256 1024 4096] [--rounds 3]
[--iters 3] [--experts grouped scale] [--no-compile] [--reuse-memory]``  (needs ``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3``
and ``pip install tyro``)

For each world size it starts that many gloo CPU ranks. Each rank builds torchtitan
0.3.0's ``MoE`` layer (its router, ``GroupedExperts`` with bf16 grouped GEMMs, its
load-balancing counter; ``E = 4 * world`` experts, top-2, ``D = F = 256``) once per
dispatcher, from the same weights, each rank holding its ``E / world`` experts and
the dispatcher wired to a 1-D ``ep`` mesh:

- ``titan`` (the baseline): torchtitan's ``AllToAllTokenDispatcher``
  (``spmd_backend="partial_dtensor"``, the one that runs on gloo), eager.
- ``funcoll exact`` / ``funcoll static``: ``FuncollTokenDispatcher`` in exact mode,
  and in static mode with ``capacity_factor=1.25`` (the router's own routing:
  pairs past the capacity are dropped).
- ``funcoll dropless``: ``FuncollTokenDispatcher`` in dropless mode, starting at
  ``capacity_factor=1.25``: static mode's step while the routing fits, exact mode's
  dispatch when it overflows (the capacity then grows); nothing dropped. Its step
  counts its overflows before and during the timed steps. Not compiled: compiled, it
  is exact mode.
- ``funcoll dropless 1.0``: the same with the dispatcher's default factor, 1.0: on
  one rank the dropless bound ``T * k``; on more, the first step overflows and the
  capacity grows to the group's need, rounded up to 4 significant bits (at most
  1/8 above it), so its blocks carry fewer empty rows than factor 1.25's.
- ``funcoll exact, fp8 dispatch``: exact mode with DeepEP's formats
  (docs/wire.md): the token rows dispatched in float8 e4m3 with a scale per 128
  channels, their gradient and the combine in bfloat16.
- ``..., compiled``: the layer under ``torch.compile(fullgraph=True)`` (inductor),
  compiled before the timed steps.

Two expert forms (``--experts``):

- ``grouped``: torchtitan's ``GroupedExperts`` (three bf16 grouped GEMMs a layer,
  ``D = F = 256``). On a CPU their GEMMs are most of the step, so the dispatchers
  differ by a few percent of it.
- ``scale``: the layer with its experts replaced by a per-feature scale
  (``x * w``, ``w`` a learned ``(D,)`` vector): the router, the dispatch, the
  combine and their backward are then the step, which is what a dispatcher
  changes (on a GPU the experts' GEMMs are fast and the dispatch is a larger
  part of the step than on this CPU).

A step is the layer's forward on ``T`` tokens per rank and the backward of its
output's sum, down to the tokens: the input requires grad, as every MoE layer's
but a model's first does, so the backward runs the dispatch's (the tokens'
gradient sent back to their ranks) as well as the combine's. Every method is
timed interleaved over `rounds` rounds (each the median of `iters`
barrier-fenced steps after a warm-up, the slowest rank's time); a row's time is
the median over rounds, its ratio the median over rounds of the round's time
over the ``titan`` row's in the same round (same world, ``T`` and expert form),
with the range of those per-round ratios. Host reads per step
(``Tensor.tolist`` / ``.item`` calls, forward and backward; each a
device-to-host sync on CUDA) are counted in one step. torchtitan's dispatcher
also copies its splits with ``.to("cpu")`` twice per layer, which the count
does not include.

``--reuse-memory`` keeps each rank's freed host memory for reuse
(``_timing.reuse_freed_memory``), as a GPU's caching allocator does: without it,
the larger buffers a layout allocates (static mode's capacity rows) first fault
in fresh pages on every step, a cost of this CPU's allocator, not of the device
the dispatcher serves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import add_link_argument, fenced_median, on_link, reusing_memory

import funcoll
from funcoll import Wire, testing

K, D, F = 2, 256, 256
EXPERTS = ("grouped", "scale")  # torchtitan's GroupedExperts; a per-feature scale (the dispatch is the step)


class _ScaleExperts(torch.nn.Module):
    """Experts that cost next to nothing: each routed row times a learned ``(D,)`` scale."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.w_D = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        return x_RD * self.w_D


def _layer(
    world: int,
    rank: int,
    dispatcher: Any,
    mesh: Any,
    experts: str = "grouped",
    d: int = D,
    f: int = F,
    local: int = 4,
) -> Any:
    """torchtitan's MoE layer: `local` experts a rank (``world * local`` in all), features `d`, expert hidden `f`."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter

    e = local * world
    layer = MoE.Config(
        num_experts=e,
        router=TokenChoiceTopKRouter.Config(
            num_experts=e, gate=Linear.Config(in_features=d, out_features=e), top_k=K
        ),
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=d, hidden_dim=f, num_experts=local),
            token_dispatcher=dispatcher,
        ),
    ).build()
    g = torch.Generator().manual_seed(rank)  # each rank's own experts; the gate the same everywhere
    inner = layer.routed_experts.inner_experts
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.randn(e, d, generator=torch.Generator().manual_seed(0)) / d**0.5)
        for p in (inner.w1_EFD, inner.w2_EDF, inner.w3_EFD):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    if experts == "scale":
        layer.routed_experts.inner_experts = _ScaleExperts(d)
    layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return layer


def dispatchers(e: int) -> dict[str, Any]:
    """The dispatchers compared, by name, for a layer of `e` experts: torchtitan's, then funcoll's modes."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from funcoll.integrations.torchtitan import FuncollTokenDispatcher

    return {
        "titan": AllToAllTokenDispatcher.Config(num_experts=e, top_k=K),
        "funcoll exact": FuncollTokenDispatcher.Config(num_experts=e, top_k=K, mode="exact"),
        "funcoll static": FuncollTokenDispatcher.Config(
            num_experts=e, top_k=K, mode="static", capacity_factor=1.25
        ),
        "funcoll dropless": FuncollTokenDispatcher.Config(
            num_experts=e, top_k=K, mode="dropless", capacity_factor=1.25
        ),
        "funcoll dropless 1.0": FuncollTokenDispatcher.Config(num_experts=e, top_k=K, mode="dropless"),
        # DeepEP's formats (docs/wire.md): the tokens in FP8 (a scale per 128 channels), their
        # gradient and the combine in bf16
        "funcoll exact, fp8 dispatch": FuncollTokenDispatcher.Config(
            num_experts=e,
            top_k=K,
            mode="exact",
            dispatch_wire=Wire(torch.float8_e4m3fn, block=128),
            dispatch_grad_wire=Wire(torch.bfloat16),
            combine_wire=Wire(torch.bfloat16),
        ),
    }


def _step(fn: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = fn(x)
    out.sum().backward()
    return out


def _body(
    rank: int,
    world: int,
    tokens: list[int],
    rounds: int,
    iters: int,
    compile_: bool,
    experts: str = "grouped",
) -> list[dict]:
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    # The steady state: no cross-rank checks, whose default (an op's calls 1, 2, 4, ... on a
    # group) would add header reads to the first steps counted here; the checked family
    # measures their cost.
    funcoll.set_checks(False)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    configs = dispatchers(4 * world)
    rows = []
    for t in tokens:
        x = torch.randn(1, t, D, generator=torch.Generator().manual_seed(10 + rank)).requires_grad_()
        methods = {}
        for name, cfg in configs.items():
            layer = _layer(world, rank, cfg, mesh, experts)
            methods[name] = (layer, layer)
            if compile_ and name in ("funcoll exact", "funcoll static", "funcoll exact, fp8 dispatch"):
                # compiled dropless: exact's graph
                compiled_layer = _layer(world, rank, cfg, mesh, experts)
                fn = torch.compile(compiled_layer, fullgraph=True, backend="inductor")
                _step(fn, compiled_layer, x)  # compile before timing
                methods[f"{name}, compiled"] = (fn, compiled_layer)
        reads = {}
        for name, (fn, layer) in methods.items():
            with testing.count_host_reads() as counted:
                _step(fn, layer, x)
            reads[name] = counted.count
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(rounds):
            for name, (fn, layer) in methods.items():
                mine = torch.tensor(fenced_median(lambda fn=fn, layer=layer, x=x: _step(fn, layer, x), iters))
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's step
                times[name].append(float(mine))
        for name, (_, layer) in methods.items():
            # each round's time over titan's in the same round: the pair shares that round's load
            ratios = [a / b for a, b in zip(times[name], times["titan"], strict=True)]
            dispatcher = layer.routed_experts.token_dispatcher
            rows.append({"world": world, "tokens": t, "experts": experts, "method": name,
                         "ms": statistics.median(times[name]) * 1e3, "ratio": statistics.median(ratios),
                         "ratio_range": (min(ratios), max(ratios)), "host_reads": reads[name],
                         "overflows": getattr(dispatcher, "overflows", None)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--experts", nargs="+", default=list(EXPERTS), choices=list(EXPERTS))
    parser.add_argument("--no-compile", action="store_true", help="eager methods only")
    parser.add_argument(
        "--reuse-memory",
        action="store_true",
        help="each rank keeps its freed host memory for reuse (_timing.reuse_freed_memory)",
    )
    add_link_argument(parser)
    args = parser.parse_args(argv)
    print(on_link(args.link))
    print(
        "| experts | world | T | method | step ms | vs titan (range) | host reads | overflows |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for experts in args.experts:
        for world in args.worlds:
            rows = testing.run_ranks(
                reusing_memory(_body, args.reuse_memory),
                world,
                args.tokens,
                args.rounds,
                args.iters,
                not args.no_compile,
                experts,
                timeout=3000,
            )[0]
            for r in rows:
                lo, hi = r["ratio_range"]
                print(
                    f"| {experts} | {r['world']} | {r['tokens']} | {r['method']} | {r['ms']:.1f} "
                    f"| {r['ratio']:.2f} ({lo:.2f}-{hi:.2f}) | {r['host_reads']} "
                    f"| {'' if r['overflows'] is None else r['overflows']} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
