"""``funcoll.moe`` in a compiled training step: one graph for every routing, no graph break.

On 2 gloo ranks, a step routes each rank's tokens (top-2 of 4 experts, 2 per
rank), dispatches them, runs every local expert on its rows (a per-row weight
gather standing in for a grouped GEMM; nothing read on the host), combines with
the router weights and takes a weighted loss. It is compiled with
``fullgraph=True`` on aot_eager (so a graph break fails the step) and run for 12
steps, each with a fresh routing and fresh weights, the loss's backward
included, in each mode: exact, static, and the :class:`funcoll.moe.Dropless`
policy (its forward run through ``policy.run``, starting from a capacity that
the first step overflows). On 3 ranks, one of them with no tokens, exact mode and
the policy run 8 steps. On 2 ranks exact mode also runs 4 steps whose token
counts change (one rank holds none at one step) with `x`, `topk_idx` and
`topk_weights` each marked with ``funcoll.mark_ragged``, as docs/compile.md says to
mark MoE token counts: one graph, whose argument checks must not ask dynamo to
compare the marked sizes (a data-dependent guard error before). On inductor (2 ranks), the policy runs 6 steps, forward
and backward: its static graphs and, for its overflow reruns, exact mode's (the
compiled experts' arithmetic is inductor's, so values match eager to float64
rounding). Checked per rank and mode:

- one compile (``CompileCounterWithBackend.frame_count == 1``); the policy: one
  for its exact reruns and at most one per capacity it grew through;
- every step's output, loss, dropped count and the gradients of ``x``,
  ``topk_weights`` and the experts' weights equal the same step run eagerly (the
  eager policy growing through the same capacities), and the policy drops nothing;
- the AOT graphs' host reads (2 ranks): static mode and the policy's steady
  state have none (no ``_local_scalar_dense``, no funcoll custom op, forward or
  backward); exact mode has exactly one, the ``funcoll::host_ints`` read of the
  counts in the forward graph, and none in the backward;
- no collective left unwaited (``funcoll.testing.in_flight()``) after the
  compiled steps, nor after the eager ones.

The release matrix's smoke run (``_ops.SMOKE``) runs the inductor case only: the
policy's static graphs and its exact reruns' graph, forward and backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _ops import SMOKE
from torch import Tensor
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

import funcoll
from funcoll import moe
from funcoll.testing import in_flight, run_ranks

E_LOCAL, K, H = 2, 2, 6
TOKENS = {2: (7, 4), 3: (7, 0, 4)}  # per rank, per world: T = 0 on a rank at 3
STEPS = {2: 12, 3: 8}  # fewer at 3 ranks (and no plain static mode, which dropless runs): suite time
MODES = {2: ("exact", "static", "dropless"), 3: ("exact", "dropless")}
# On inductor, 2 ranks: the policy's steps compile its static graphs and its exact reruns' graph.
INDUCTOR_MODES, INDUCTOR_STEPS = ("dropless",), 6
# Exact mode at 2 ranks with token counts that change every step (rank r holds RAGGED_TOKENS[s] + r,
# rank 0 none at step 2), `x`, `topk_idx` and `topk_weights` each marked with mark_ragged: one graph.
RAGGED_TOKENS = (5, 3, 0, 6)
CAPACITY = 5  # static mode: some steps drop pairs
DROPLESS_START = 2  # the Dropless policy's first capacity: its first step overflows


def _inputs(step: int, rank: int, world: int, tokens: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = TOKENS[world][rank] if tokens is None else tokens
    x = torch.randn(t, H, generator=g, dtype=torch.float64)
    idx = (
        torch.rand(t, world * E_LOCAL, generator=g)
        .argsort(1)[:, :K]
        .clone(memory_format=torch.contiguous_format)
    )  # one stride at any T
    if step % 4 == 1:  # every pair to one expert some steps: the skewed routings
        idx = torch.full_like(idx, step % (world * E_LOCAL))
    w = torch.rand(t, K, generator=g, dtype=torch.float64)
    return x, idx, w


def _experts(rank: int) -> Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(E_LOCAL, H, H, generator=g, dtype=torch.float64) / H


def step_fn(x: Tensor, idx: Tensor, w: Tensor, weights: Tensor, mode: Any) -> tuple[Tensor, Tensor, Tensor]:
    capacity = CAPACITY if mode == "static" else None
    num_experts = weights.shape[0] * funcoll.axis_size(None)
    recv, h = moe.dispatch(x, idx, num_experts, mode=mode, capacity=capacity, align=4)
    rows = torch.arange(recv.shape[0], device=recv.device)
    expert = (torch.searchsorted(h.offsets, rows, right=True) - 1).clamp(min=0)  # padding rows: any expert
    y = torch.einsum("nh,nhg->ng", recv, weights[expert])
    out = moe.combine(y, h, w)
    loss = (out.sin() * torch.arange(out.shape[1], dtype=out.dtype)).sum()
    return out, loss, h.dropped


def _host_reads(gm: torch.fx.GraphModule) -> list[str]:
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and ("_local_scalar_dense" in str(n.target) or str(n.target).startswith("funcoll."))
    ]


def _one_step(
    fn: Any, step: int, rank: int, world: int, mode: Any, tokens: int | None = None
) -> list[Tensor]:
    x, idx, w = _inputs(step, rank, world, tokens)
    if tokens is not None:  # a token count that changes: every input's token dim marked, as users mark them
        for t in (x, idx, w):
            funcoll.mark_ragged(t, 0)
    weights = _experts(rank).requires_grad_()
    x.requires_grad_()
    w.requires_grad_()
    if isinstance(mode, moe.Dropless):  # the forward through the policy: one overflow check a step
        out, loss, dropped = mode.run(fn, x, idx, w, weights, mode)
    else:
        out, loss, dropped = fn(x, idx, w, weights, mode)
    loss.backward()
    return [out.detach(), loss.detach(), dropped, x.grad, w.grad, weights.grad]


def _steps(fn: Any, rank: int, world: int, mode: str, steps: int) -> tuple[list[list[Tensor]], list[int]]:
    """`steps` steps of fresh routings; with the dropless policy, also its capacity at each step's start."""
    policy = moe.Dropless(DROPLESS_START) if mode == "dropless" else None
    got, capacities = [], []
    for s in range(steps):
        capacities.append(policy.capacity if policy else 0)
        got.append(_one_step(fn, s, rank, world, policy or mode))
    return got, capacities


def _run(rank: int, world: int, backend: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    modes, steps = (INDUCTOR_MODES, INDUCTOR_STEPS) if backend == "inductor" else (MODES[world], STEPS[world])
    for mode in modes:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(step_fn, fullgraph=True, backend=counter)
        got, capacities = _steps(compiled, rank, world, mode, steps)
        got = funcoll.wait(got)  # the eager backward's gradients may still be arriving
        left = {"compiled": in_flight()}
        eager, eager_capacities = _steps(step_fn, rank, world, mode, steps)
        eager = funcoll.wait(eager)
        left["eager"] = in_flight()
        assert capacities == eager_capacities, (capacities, eager_capacities)
        res[mode] = {
            "frames": counter.frame_count, "capacities": capacities, "got": got, "eager": eager, "in_flight": left,
        }  # fmt: skip
        if world == 2 and backend == "aot_eager":  # the AOT graphs' host reads (the same at any world size)
            graphs: list[torch.fx.GraphModule] = []

            def keep(gm: torch.fx.GraphModule, _: object, graphs: list = graphs) -> torch.fx.GraphModule:
                graphs.append(gm)
                return gm

            torch._dynamo.reset()
            traced = torch.compile(
                step_fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)
            )
            # The graphs of the steady state: a dropless policy whose capacity fits is static mode.
            policy = moe.Dropless(max(capacities)) if mode == "dropless" else None
            _one_step(traced, 0, rank, world, policy or mode)
            res[mode]["reads"] = [_host_reads(gm) for gm in graphs]
    if world == 2 and backend == "aot_eager":
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(step_fn, fullgraph=True, backend=counter)
        steps = list(enumerate(t + rank for t in RAGGED_TOKENS))
        got = funcoll.wait([_one_step(compiled, s, rank, world, "exact", t) for s, t in steps])
        left = {"compiled": in_flight()}
        eager = funcoll.wait([_one_step(step_fn, s, rank, world, "exact", t) for s, t in steps])
        left["eager"] = in_flight()
        res["exact, mark_ragged"] = {
            "frames": counter.frame_count, "capacities": [], "got": got, "eager": eager, "in_flight": left,
        }  # fmt: skip
    return res


@pytest.mark.parametrize(
    ("world", "backend"),
    [
        *(
            pytest.param(w, "aot_eager", id=f"w{w}-T{'.'.join(map(str, TOKENS[w]))}")
            for w in sorted(TOKENS)
            if not SMOKE
        ),  # the release matrix's smoke run (_ops.SMOKE): inductor only
        pytest.param(2, "inductor", id="w2-inductor"),
    ],
)
def test_compiled_moe_step_one_graph_matches_eager(world: int, backend: str) -> None:
    results = run_ranks(_run, world, backend, timeout=540)
    names = ("out", "loss", "dropped", "x.grad", "topk_weights.grad", "W.grad")
    dropped_any = False
    for rank, res in enumerate(results):
        for mode in res:
            r = res[mode]
            frames = r["frames"]
            if mode == "dropless":
                # A graph for the exact reruns, and static graphs for the capacities it grew
                # through: one each at most (dynamo's automatic dynamic may make the capacity
                # a symbol after its first change), none once the capacity stopped growing.
                grew = sorted(set(r["capacities"]))
                assert 2 <= frames <= len(grew) + 1, f"rank {rank}: {frames} compiles, capacities {grew}"
            else:
                assert frames == 1, f"rank {rank} {mode}: {frames} compiles"
            assert r["in_flight"] == {"compiled": 0, "eager": 0}, (
                f"rank {rank} {mode}: unwaited {r['in_flight']}"
            )
            want = [["funcoll.host_ints.default"], []] if mode == "exact" else [[], []]
            assert "reads" not in r or r["reads"] == want, f"rank {rank} {mode}: host reads {r['reads']}"
            for s, (a, b) in enumerate(zip(r["got"], r["eager"], strict=True)):
                for name, ta, tb in zip(names, a, b, strict=True):
                    torch.testing.assert_close(
                        ta,
                        tb,
                        msg=lambda m, n=name, r=rank, md=mode, st=s: f"rank {r} {md} step {st} {n}: {m}",
                    )
                dropped_any |= mode == "static" and int(a[2]) > 0
                assert mode != "dropless" or int(a[2]) == 0, f"rank {rank} dropless step {s} dropped"
    if "static" in results[0]:
        assert dropped_any, "no static step dropped a pair: the capacity is too large to test the drop path"
    # The policy met overflows (its first step at least) and grew: the rerun path ran compiled.
    assert len(set(results[0]["dropless"]["capacities"])) >= 2, results[0]["dropless"]["capacities"]
