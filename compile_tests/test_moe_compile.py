"""``funcoll.moe`` in a compiled training step: one graph for every routing, no graph break.

On 2 gloo ranks, a step routes each rank's tokens (top-2 of 4 experts, 2 per
rank), dispatches them, runs every local expert on its rows (a per-row weight
gather standing in for a grouped GEMM; nothing read on the host), combines with
the router weights and takes a weighted loss. It is compiled with
``fullgraph=True`` on aot_eager and run for 20 steps, each with a fresh routing
and fresh weights, in both modes, the loss's backward included. Checked per
rank and mode:

- one compile (``CompileCounterWithBackend.frame_count == 1``) and no graph
  break (``torch._dynamo.explain``);
- every step's output, loss and the gradients of ``x``, ``topk_weights`` and
  the experts' weights equal the same step run eagerly;
- the AOT graphs' host reads: static mode has none (no ``_local_scalar_dense``,
  no funcoll custom op, forward or backward); exact mode has exactly one,
  the ``funcoll::host_ints`` read of the counts in the forward graph, and none
  in the backward;
- no collective left unwaited (``funcoll.testing.in_flight()``) after the
  compiled steps, nor after the eager ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

from funcoll import moe
from funcoll.testing import in_flight, run_ranks

STEPS = 20
E_LOCAL, K, H = 2, 2, 6
TOKENS = (7, 4)  # per rank
CAPACITY = 5  # static mode: some steps drop pairs
MODES = ("exact", "static")


def _inputs(step: int, rank: int, world: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = TOKENS[rank]
    x = torch.randn(t, H, generator=g, dtype=torch.float64)
    idx = torch.rand(t, world * E_LOCAL, generator=g).argsort(1)[:, :K].contiguous()
    if step % 4 == 1:  # every pair to one expert some steps: the skewed routings
        idx = torch.full_like(idx, step % (world * E_LOCAL))
    w = torch.rand(t, K, generator=g, dtype=torch.float64)
    return x, idx, w


def _experts(rank: int) -> Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(E_LOCAL, H, H, generator=g, dtype=torch.float64) / H


def step_fn(x: Tensor, idx: Tensor, w: Tensor, weights: Tensor, mode: str) -> tuple[Tensor, Tensor, Tensor]:
    capacity = CAPACITY if mode == "static" else None
    recv, h = moe.dispatch(x, idx, weights.shape[0] * 2, mode=mode, capacity=capacity, align=4)
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


def _one_step(fn: Any, step: int, rank: int, world: int, mode: str) -> list[Tensor]:
    x, idx, w = _inputs(step, rank, world)
    weights = _experts(rank).requires_grad_()
    x.requires_grad_()
    w.requires_grad_()
    out, loss, dropped = fn(x, idx, w, weights, mode)
    loss.backward()
    return [out.detach(), loss.detach(), dropped, x.grad, w.grad, weights.grad]


def _run(rank: int, world: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for mode in MODES:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step_fn, fullgraph=True, backend=counter)
        got = [_one_step(compiled, s, rank, world, mode) for s in range(STEPS)]
        left = {"compiled": in_flight()}
        eager = [_one_step(step_fn, s, rank, world, mode) for s in range(STEPS)]
        left["eager"] = in_flight()
        graphs: list[torch.fx.GraphModule] = []

        def keep(gm: torch.fx.GraphModule, _: object, graphs: list = graphs) -> torch.fx.GraphModule:
            graphs.append(gm)
            return gm

        torch._dynamo.reset()
        traced = torch.compile(
            step_fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)
        )
        _one_step(traced, 0, rank, world, mode)
        torch._dynamo.reset()
        x, idx, w = _inputs(0, rank, world)
        breaks = torch._dynamo.explain(step_fn)(x, idx, w, _experts(rank), mode).graph_break_count
        res[mode] = {
            "frames": counter.frame_count,
            "got": got,
            "eager": eager,
            "reads": [_host_reads(gm) for gm in graphs],
            "breaks": breaks,
            "in_flight": left,
        }
    return res


def test_compiled_moe_step_one_graph_matches_eager() -> None:
    results = run_ranks(_run, 2, timeout=540)
    names = ("out", "loss", "dropped", "x.grad", "topk_weights.grad", "W.grad")
    dropped_any = False
    for rank, res in enumerate(results):
        for mode in MODES:
            r = res[mode]
            assert r["frames"] == 1, f"rank {rank} {mode}: {r['frames']} compiles"
            assert r["breaks"] == 0, f"rank {rank} {mode}: {r['breaks']} graph breaks"
            assert r["in_flight"] == {"compiled": 0, "eager": 0}, (
                f"rank {rank} {mode}: unwaited {r['in_flight']}"
            )
            want = [[], []] if mode == "static" else [["funcoll.host_ints.default"], []]
            assert r["reads"] == want, f"rank {rank} {mode}: host reads {r['reads']}"
            for s, (a, b) in enumerate(zip(r["got"], r["eager"], strict=True)):
                for name, ta, tb in zip(names, a, b, strict=True):
                    torch.testing.assert_close(
                        ta,
                        tb,
                        msg=lambda m, n=name, r=rank, md=mode, st=s: f"rank {r} {md} step {st} {n}: {m}",
                    )
                dropped_any |= mode == "static" and int(a[2]) > 0
    assert dropped_any, "no static step dropped a pair: the capacity is too large to test the drop path"
