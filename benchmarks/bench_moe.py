"""MoE dispatch + combine speed: ``funcoll.moe`` against a torchtitan-style recipe, forward and backward.

Run: ``python benchmarks/bench_moe.py [--worlds 2 4] [--tokens 256 1024 4096 16384] [--layers 2]
[--rounds 5] [--quick]``

For each world size it starts that many gloo CPU ranks and, in one process
group, times one training step's token movement: `layers` MoE layers in a row
(each dispatch, an identity expert, combine with the router weights, its
output the next layer's input), then the backward of a weighted sum of the
last output down to the tokens and the router weights. Each implementation is
timed interleaved over `rounds` rounds (each the median of a few
barrier-fenced steps after a warm-up, ``_timing.fenced_median``); a row's time
is the median over rounds:

- ``titan`` (the baseline): torchtitan's expert-parallel dispatch, retyped:
  per-expert counts by ``torch.histc``, exchanged by funcol's
  ``all_to_all_single``, the splits read with ``.tolist()`` (a host sync per
  layer), the rows moved by funcol's ``all_to_all_single_autograd`` with those
  list splits, then permuted into expert order (``repeat_interleave`` of the
  counts, a stable argsort, an index); combine undoes the permutation
  (``index_put``), moves the rows back the same way and sums each token's k rows
  weighted.
- ``titan, compiled``: the recipe under ``torch.compile`` (inductor), which
  breaks the graph at each ``.tolist()`` and compiles the pieces around it.
  (torchtitan compiles it whole with ``capture_scalar_outputs``; on torch 2.13
  inductor then fails to generate code for the recipe's unbacked sizes.)
- ``funcoll.moe exact``: ``dispatch(mode="exact")`` then ``combine``.
- ``funcoll.moe static``: ``dispatch(mode="static")`` with a capacity of 1.25
  times the even share (``ceil(1.25 * T * k / world)`` rows per destination);
  the routing is uniform, so few pairs are dropped (the table gives how many).
- ``funcoll.moe dropless``: every dispatch ``mode=policy`` of one
  ``funcoll.moe.Dropless`` policy, the step's forward through ``policy.run``:
  static mode's layers and one agreed host read per step. Its capacity starts
  at the same 1.25 share and grows on the warm-up step if that overflows, so
  the timed steps are the steady state (the table gives the reruns in them).
- ``..., compiled``: funcoll's layers under ``torch.compile(fullgraph=True)``
  (inductor), compiled before the timed steps (not with ``--quick``); the
  dropless policy runs the compiled forward.

Host syncs per step are counted, not assumed: every ``Tensor.tolist`` and
``Tensor.item`` call during one step, forward and backward (on CUDA each is a
device-to-host sync; on CPU they cost nothing but are the same calls); compiled
graphs' reads are Python calls too, in inductor's wrapper code). Each
rank holds ``T`` tokens of ``H = 1024`` float32, top-2 routing over ``2 * world``
experts (2 per rank). Every implementation's output and gradients are compared
with the recipe's before timing.
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
import torch.distributed._functional_collectives as funcol
from _timing import add_link_argument, fenced_median, on_link  # benchmarks/, beside this script

import funcoll
from funcoll import moe, testing
from funcoll.testing import run_ranks

H, K, E_LOCAL = 1024, 2, 2
CAPACITY_FACTOR = 1.25
LAYERS = 2


# -------------------------------------------------------------------------------- the recipe
def titan_layer(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    world: int,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    e_local: int = E_LOCAL,
) -> torch.Tensor:
    """torchtitan's expert-parallel token dispatch and combine, retyped.

    `experts` maps the received rows in expert order and the rows per local expert
    (int64, on the device) to their outputs; None: identity experts.
    """
    group = dist.group.WORLD
    num_experts = world * e_local
    flat = idx.reshape(-1)
    per_expert = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts).to(torch.int64)
    per_expert_group = funcol.all_to_all_single(per_expert, None, None, group)
    splits = torch.cat([per_expert.view(world, -1).sum(1), per_expert_group.view(world, -1).sum(1)])
    splits_list = splits.tolist()  # device-to-host sync, as the recipe does: the splits as host ints
    input_splits, output_splits = splits_list[:world], splits_list[world:]
    order = torch.argsort(flat, stable=True)
    routed = x[order // K]
    received = funcol.all_to_all_single_autograd(routed, output_splits, input_splits, group)
    # Permute into expert order: each received row's local expert, then a stable sort.
    expert_of_row = torch.arange(num_experts, device=x.device) % e_local
    expert_of_row = torch.repeat_interleave(expert_of_row, per_expert_group, output_size=sum(output_splits))
    permuted_indices = torch.argsort(expert_of_row, stable=True)
    y = received[permuted_indices]
    if experts is not None:
        y = experts(y, per_expert_group.view(world, e_local).sum(0))
    # Combine: unpermute, send back, weight and sum each token's k rows.
    unpermuted = torch.zeros_like(y).index_put((permuted_indices,), y)
    back = funcol.all_to_all_single_autograd(unpermuted, input_splits, output_splits, group)
    per_pair = x.new_zeros(flat.shape[0], x.shape[1]).index_put((order,), back)  # T * k rows
    return (per_pair.view(-1, K, x.shape[1]) * w.unsqueeze(-1)).sum(1)


# ------------------------------------------------------------------------------- funcoll's
def funcoll_layer(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    world: int,
    mode: Any,
    experts: Callable[[torch.Tensor, moe.MoEHandle], torch.Tensor] | None = None,
    e_local: int = E_LOCAL,
) -> torch.Tensor:
    """``funcoll.moe``'s dispatch, the `experts` on its layout (None: identity), and combine."""
    capacity = math.ceil(CAPACITY_FACTOR * x.shape[0] * K / world) if mode == "static" else None
    recv, handle = moe.dispatch(x, idx, world * e_local, mode=mode, capacity=capacity)
    return moe.combine(recv if experts is None else experts(recv, handle), handle, w)


def step(
    run: Callable[[], torch.Tensor], x: torch.Tensor, w: torch.Tensor, g: torch.Tensor
) -> tuple[Any, ...]:
    """One training step's token movement: the forward `run`, then the backward of ``(out * g).sum()``."""
    x.grad = w.grad = None
    out = run()
    (out * g).sum().backward()
    return out.detach(), x.grad, w.grad


# ----------------------------------------------------------------------------- host reads
def count_host_reads(fn: Callable[[], object]) -> int:
    """How many ``Tensor.tolist`` / ``Tensor.item`` calls one call of `fn` makes, compiled graphs' included.

    Compiled graphs read the host from Python too: inductor's wrapper code calls
    ``.item()`` for each unbacked scalar, and ``funcoll::host_ints`` calls ``.tolist()``.
    """
    with testing.count_host_reads() as reads:
        fn()
    return reads.count


# ---------------------------------------------------------------------------- the methods
_COMPILED: dict[str, Callable[..., torch.Tensor]] = {}


def _compiled(
    name: str, fn: Callable[..., torch.Tensor], fullgraph: bool = True
) -> Callable[..., torch.Tensor]:
    """`fn` under torch.compile (inductor), one per name and process."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, fullgraph=fullgraph, dynamic=False)
    return _COMPILED[name]


def _methods(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, world: int, layers: int, compiled: bool
) -> tuple[dict[str, Callable[[], torch.Tensor]], moe.Dropless, moe.Dropless]:
    """Each method's forward, and the two Dropless policies (eager, compiled) whose reruns are reported."""
    capacity = math.ceil(CAPACITY_FACTOR * x.shape[0] * K / world)
    policy, policy_c = moe.Dropless(capacity), moe.Dropless(capacity)

    def titan(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):  # each layer's output the next one's tokens
            x = titan_layer(x, idx, w, world)
        return x

    def ours(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, mode: Any) -> torch.Tensor:
        for _ in range(layers):
            x = funcoll_layer(x, idx, w, world, mode)
        return x

    methods: dict[str, Callable[[], torch.Tensor]] = {
        "titan": lambda: titan(x, idx, w),
        "funcoll.moe exact": lambda: ours(x, idx, w, "exact"),
        "funcoll.moe static": lambda: ours(x, idx, w, "static"),
        "funcoll.moe dropless": lambda: policy.run(ours, x, idx, w, policy),
    }
    if compiled:
        # The recipe breaks the graph at its .tolist(): inductor compiles the pieces around it.
        # (With capture_scalar_outputs it traces whole, but torch 2.13's inductor fails to
        # generate code for its unbacked sizes.)
        titan_c = _compiled("titan", titan, fullgraph=False)
        exact_c = _compiled("exact", functools.partial(ours, mode="exact"))
        static_c = _compiled("static", functools.partial(ours, mode="static"))
        dropless_c = _compiled("dropless", ours)
        methods["titan, compiled"] = lambda: titan_c(x, idx, w)
        methods["funcoll.moe exact, compiled"] = lambda: exact_c(x, idx, w)
        methods["funcoll.moe static, compiled"] = lambda: static_c(x, idx, w)
        methods["funcoll.moe dropless, compiled"] = lambda: policy_c.run(dropless_c, x, idx, w, policy_c)
    return methods, policy, policy_c


def _bench(
    rank: int,
    world: int,
    tokens: list[int],
    rounds: int,
    iters: int,
    compiled: bool = True,
    layers: int = LAYERS,
) -> list[dict[str, Any]]:
    # The steady state: no cross-rank checks, whose default (an op's calls 1, 2, 4, ... on a
    # group) would add header reads to the first steps counted here; the checked family
    # measures their cost.
    funcoll.set_checks(False)
    rows = []
    for t in tokens:
        gen = torch.Generator().manual_seed(1000 * t + rank)
        dev = torch.get_default_device()  # run.py --device cuda: drawn on the CPU, then moved
        x = torch.randn(t, H, generator=gen, device="cpu").to(dev).requires_grad_()
        idx = (
            torch.rand(t, world * E_LOCAL, generator=gen, device="cpu").argsort(1)[:, :K].contiguous().to(dev)
        )
        w = torch.rand(t, K, generator=gen, device="cpu").to(dev).requires_grad_()
        g = torch.randn(t, H, generator=gen, device="cpu").to(dev)
        methods, policy, policy_c = _methods(x, idx, w, world, layers, compiled)
        # Warm-up, compiles and the check: every method's output and gradients are the recipe's
        # (static mode's only where it dropped nothing on any rank), outside the timed steps.
        ref = step(methods["titan"], x, w, g)
        capacity = math.ceil(CAPACITY_FACTOR * t * K / world)
        _, handle = moe.dispatch(x.detach(), idx, world * E_LOCAL, mode="static", capacity=capacity)
        dropped = int(handle.dropped)  # a host read, outside the timed steps
        none_dropped = int(_all_max(handle.dropped)) == 0
        for m, fn in methods.items():
            got = step(fn, x, w, g)
            if "static" not in m or none_dropped:
                # float32 sums over H and k in another order: the tolerance of such sums
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3, msg=lambda s, m=m: f"{m}: {s}")
        syncs = {m: count_host_reads(functools.partial(step, fn, x, w, g)) for m, fn in methods.items()}
        reruns = policy.replays, policy_c.replays
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(rounds):  # interleaved: drift hits every method alike
            for m, fn in methods.items():
                times[m].append(fenced_median(functools.partial(step, fn, x, w, g), iters))
        rows.append(
            {
                "tokens": t,
                "layers": layers,
                "dropped": dropped,
                "capacity": capacity,
                "dropless_capacity": policy.capacity,
                "dropless_reruns": (policy.replays - reruns[0], policy_c.replays - reruns[1]),
                "ms": {m: 1e3 * statistics.median(ts) for m, ts in times.items()},
                "syncs": syncs,
            }
        )
    return rows


def _all_max(t: torch.Tensor) -> torch.Tensor:
    """The maximum of `t` over the ranks (an outside-the-timing helper)."""
    return funcol.all_reduce(t, "max", dist.group.WORLD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--layers", type=int, default=LAYERS, help="MoE layers per step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3, help="fenced steps per round (median)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 64 tokens, 1 round: a smoke run")
    add_link_argument(parser)
    args = parser.parse_args()
    print(on_link(args.link))
    if args.quick:
        args.worlds, args.tokens, args.rounds, args.iters = [2], [64], 1, 1
    print(
        f"torch {torch.__version__}, gloo on CPU, H={H} float32, k={K}, {E_LOCAL} experts per rank, "
        f"{args.layers} layers a step, forward and backward"
    )
    print("| world | T | method | ms | x titan | host syncs / step | dropped (static), reruns (dropless) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for world in args.worlds:
        res = run_ranks(
            _bench, world, args.tokens, args.rounds, args.iters, not args.quick, args.layers, timeout=3600
        )
        for i, row in enumerate(res[0]):
            base = row["ms"]["titan"]
            dropped = sum(r[i]["dropped"] for r in res)
            for m, ms in row["ms"].items():
                note = ""
                if "static" in m:
                    note = f"{dropped} of {world * row['tokens'] * K} (C={row['capacity']})"
                elif "dropless" in m:
                    reruns = row["dropless_reruns"][int("compiled" in m)]
                    note = f"{reruns} reruns (C={row['dropless_capacity']})"
                print(
                    f"| {world} | {row['tokens']} | {m} | {ms:.2f} | {ms / base:.2f} | {row['syncs'][m]} | {note} |"
                )


if __name__ == "__main__":
    main()
