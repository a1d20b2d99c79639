"""MoE dispatch + combine speed: ``funcoll.moe`` against a torchtitan-style recipe.

Run: ``python benchmarks/bench_moe.py [--worlds 2 4] [--tokens 256 1024 4096 16384] [--rounds 5] [--quick]``

For each world size it starts that many gloo CPU ranks and, in one process
group, times one MoE layer's token movement (dispatch, an identity expert, combine
with the router weights; forward only) three ways, interleaved over `rounds`
rounds (each the median of a few barrier-fenced calls after a warm-up,
``_timing.fenced_median``); a row's time is the median over rounds:

- ``titan`` (the baseline): the recipe of torchtitan's expert-parallel dispatch,
  retyped: per-expert counts by ``torch.histc``, exchanged by
  ``dist.all_to_all_single``, the splits read with ``.tolist()``, the rows moved by
  ``dist.all_to_all_single`` with list splits into a preallocated buffer, then
  permuted into expert order (``repeat_interleave`` of the counts and a stable
  argsort); combine undoes the permutation, moves the rows back the same way and
  sums each token's k rows weighted.
- ``funcoll.moe exact``: ``dispatch(mode="exact")`` then ``combine``.
- ``funcoll.moe static``: ``dispatch(mode="static")`` with a capacity of 1.25
  times the even share (``ceil(1.25 * T * k / world)`` rows per destination),
  then ``combine``; the routing is uniform, so few pairs are dropped (the
  table gives how many);
- ``..., compiled``: the same two layers under ``torch.compile(fullgraph=True)``
  (inductor), compiled before the timed calls (not with ``--quick``).

Host syncs per layer are counted, not assumed: every ``Tensor.tolist`` and
``Tensor.item`` call during one layer (on CUDA each is a device-to-host sync; on
CPU they cost nothing but are the same calls). Each rank holds ``T`` tokens of
``H = 1024`` float32, top-2 routing over ``2 * world`` experts (2 per rank). The
three outputs are compared before timing.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _timing import fenced_median  # benchmarks/, beside this script

from funcoll import moe, testing
from funcoll.testing import run_ranks

H, K, E_LOCAL = 1024, 2, 2
CAPACITY_FACTOR = 1.25


def titan_layer(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, world: int) -> torch.Tensor:
    """torchtitan's expert-parallel token dispatch and combine, retyped (identity experts)."""
    num_experts = world * E_LOCAL
    flat = idx.reshape(-1)
    per_expert = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts).to(torch.int64)
    per_expert_group = torch.empty_like(per_expert)
    dist.all_to_all_single(per_expert_group, per_expert)
    splits = torch.cat([per_expert.view(world, -1).sum(1), per_expert_group.view(world, -1).sum(1)])
    splits_list = splits.tolist()  # device-to-host sync, as the recipe does: the splits as host ints
    input_splits, output_splits = splits_list[:world], splits_list[world:]
    order = torch.argsort(flat, stable=True)
    routed = x[order // K]
    received = routed.new_empty(sum(output_splits), x.shape[1])
    dist.all_to_all_single(received, routed, output_splits, input_splits)
    # Permute into expert order: each received row's local expert, then a stable sort.
    expert_of_row = torch.arange(world * E_LOCAL, device=x.device) % E_LOCAL
    expert_of_row = torch.repeat_interleave(expert_of_row, per_expert_group)
    permuted_indices = torch.argsort(expert_of_row, stable=True)
    grouped = received[permuted_indices]
    y = grouped  # the experts: identity
    # Combine: unpermute, send back, weight and sum each token's k rows.
    unpermuted = torch.empty_like(y)
    unpermuted[permuted_indices] = y
    back = unpermuted.new_empty(routed.shape[0], x.shape[1])
    dist.all_to_all_single(back, unpermuted, input_splits, output_splits)
    per_pair = torch.empty_like(back)
    per_pair[order] = back
    return (per_pair.view(-1, K, x.shape[1]) * w.unsqueeze(-1)).sum(1)


def funcoll_layer(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, world: int, mode: str) -> torch.Tensor:
    capacity = math.ceil(CAPACITY_FACTOR * x.shape[0] * K / world) if mode == "static" else None
    recv, handle = moe.dispatch(x, idx, world * E_LOCAL, mode=mode, capacity=capacity)
    return moe.combine(recv, handle, w)


def count_host_reads(fn: Callable[[], object]) -> int:
    """How many ``Tensor.tolist`` / ``Tensor.item`` calls one call of `fn` makes."""
    with testing.count_host_reads() as reads:
        fn()
    return reads.count


_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def _compiled(mode: str, world: int) -> Callable[..., torch.Tensor]:
    """funcoll's layer under torch.compile(fullgraph=True) (inductor), one per mode and process."""
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(
            functools.partial(funcoll_layer, world=world, mode=mode), fullgraph=True, dynamic=False
        )
    return _COMPILED[mode]


def _methods(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, world: int, compiled: bool
) -> dict[str, Callable[[], object]]:
    methods: dict[str, Callable[[], object]] = {
        "titan": lambda: titan_layer(x, idx, w, world),
        "funcoll.moe exact": lambda: funcoll_layer(x, idx, w, world, "exact"),
        "funcoll.moe static": lambda: funcoll_layer(x, idx, w, world, "static"),
    }
    if compiled:
        methods["funcoll.moe exact, compiled"] = lambda: _compiled("exact", world)(x, idx, w)
        methods["funcoll.moe static, compiled"] = lambda: _compiled("static", world)(x, idx, w)
    return methods


def _bench(
    rank: int, world: int, tokens: list[int], rounds: int, iters: int, compiled: bool = True
) -> list[dict[str, Any]]:
    rows = []
    for t in tokens:
        g = torch.Generator().manual_seed(1000 * t + rank)
        dev = torch.get_default_device()  # run.py --device cuda: drawn on the CPU, then moved
        x = torch.randn(t, H, generator=g, device="cpu").to(dev)
        idx = torch.rand(t, world * E_LOCAL, generator=g, device="cpu").argsort(1)[:, :K].contiguous().to(dev)
        w = torch.rand(t, K, generator=g, device="cpu").to(dev)
        methods = _methods(x, idx, w, world, compiled)
        ref = titan_layer(x, idx, w, world)
        torch.testing.assert_close(funcoll_layer(x, idx, w, world, "exact"), ref)
        if compiled:  # compiles here, outside the timed and counted calls
            torch.testing.assert_close(_compiled("exact", world)(x, idx, w), ref)
            _compiled("static", world)(x, idx, w)
        capacity = math.ceil(CAPACITY_FACTOR * t * K / world)
        _, handle = moe.dispatch(x, idx, world * E_LOCAL, mode="static", capacity=capacity)
        dropped = int(handle.dropped)  # a host read, outside the timed calls
        syncs = {m: count_host_reads(fn) for m, fn in methods.items()}
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(rounds):  # interleaved: drift hits every method alike
            for m, fn in methods.items():
                times[m].append(fenced_median(fn, iters))
        rows.append(
            {
                "tokens": t,
                "dropped": dropped,
                "capacity": capacity,
                "ms": {m: 1e3 * statistics.median(ts) for m, ts in times.items()},
                "syncs": syncs,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3, help="fenced calls per round (median)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 64 tokens, 1 round: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.tokens, args.rounds, args.iters = [2], [64], 1, 1
    print(f"torch {torch.__version__}, gloo on CPU, H={H} float32, k={K}, {E_LOCAL} experts per rank")
    print("| world | T | method | ms | x titan | host syncs / layer | dropped (static) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for world in args.worlds:
        res = run_ranks(_bench, world, args.tokens, args.rounds, args.iters, not args.quick, timeout=3600)
        for i, row in enumerate(res[0]):
            base = row["ms"]["titan"]
            dropped = sum(r[i]["dropped"] for r in res)
            for m, ms in row["ms"].items():
                drop = (
                    f"{dropped} of {world * row['tokens'] * K} (C={row['capacity']})" if "static" in m else ""
                )
                print(
                    f"| {world} | {row['tokens']} | {m} | {ms:.2f} | {ms / base:.2f} | {row['syncs'][m]} | {drop} |"
                )


if __name__ == "__main__":
    main()
