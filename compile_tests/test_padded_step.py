"""``funcoll.gather_padded`` in a compiled training step: one graph whatever the lengths, no host sync.

On 2 and 3 gloo ranks, a step ``gather_padded -> softmax -> weighted loss (+ the
cumsum of the sizes)`` is compiled with ``fullgraph=True`` and called for 12 steps,
each rank drawing a fresh length every step (0 and the bound B included). Checked:

- the step compiles once per rank (``CompileCounterWithBackend.frame_count == 1``)
  on aot_eager with ``dynamic=None/True/False`` and on inductor;
- every step's outputs, loss and input gradient equal a single-process reference
  (the ranks' data rows concatenated, zero-padded to ``world * B``; the gradient by
  torch.autograd of the summed losses);
- the AOT forward and backward graphs hold no host read (``_local_scalar_dense``),
  no funcoll custom op (the ragged ops' size read) and no graph break.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
from torch import Tensor
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

import funcoll
from funcoll.testing import run_ranks

STEPS = 12
BOUND = 5
WIDTH = 4
CONFIGS = (("aot_eager", None), ("aot_eager", True), ("aot_eager", False), ("inductor", None))


def length(step: int, rank: int) -> int:
    """Fresh every step; over the 12 steps every rank sees 0 and BOUND."""
    return (5 * step + 3 * rank) % (BOUND + 1)


def _seeded(*key: object) -> Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(BOUND, WIDTH, generator=g, dtype=torch.float64)


def _weight(world: int, rank: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(world * BOUND, WIDTH, generator=g, dtype=torch.float64)


def step_fn(x: Tensor, n: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    y, sizes = funcoll.gather_padded(x, n)
    ends = torch.cumsum(sizes, 0)
    loss = (torch.softmax(y, -1) * w).sum() + ends.sum()
    return y, sizes, loss


def _host_reads(gm: torch.fx.GraphModule) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and ("_local_scalar_dense" in name or name.startswith("funcoll.")):
            bad.append(name)
    return bad


def _run(rank: int, world: int) -> dict[str, Any]:
    w = _weight(world, rank)
    out: dict[str, Any] = {}
    for backend, dynamic in CONFIGS:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        fn = torch.compile(step_fn, fullgraph=True, dynamic=dynamic, backend=counter)
        steps = []
        for s in range(STEPS):
            x = _seeded(s, rank).requires_grad_()
            y, sizes, loss = fn(x, torch.tensor(length(s, rank)), w)
            loss.backward()
            steps.append((y.detach(), sizes, loss.detach(), x.grad))
        out[f"{backend}-{dynamic}"] = {"graphs": counter.frame_count, "steps": steps}
    # The AOT graphs of the step, read for host reads; and dynamo's own count of breaks.
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    x = _seeded(0, rank).requires_grad_()
    fn = torch.compile(step_fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    fn(x, torch.tensor(length(0, rank)), w)[2].backward()
    out["host_reads"] = [_host_reads(gm) for gm in graphs]
    torch._dynamo.reset()
    out["breaks"] = torch._dynamo.explain(step_fn)(x, torch.tensor(1), w).graph_break_count
    return out


def _reference(world: int, s: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    xs = [_seeded(s, r).requires_grad_() for r in range(world)]
    lengths = [length(s, r) for r in range(world)]
    data = torch.cat([x[:n] for x, n in zip(xs, lengths, strict=True)])
    y = torch.cat([data, data.new_zeros(world * BOUND - data.shape[0], WIDTH)])
    sizes = torch.tensor(lengths)
    ends_sum = torch.cumsum(sizes, 0).sum()
    losses = [(torch.softmax(y, -1) * _weight(world, r)).sum() + ends_sum for r in range(world)]
    grads = torch.autograd.grad(sum(losses), xs)
    return [(y.detach(), sizes, losses[r].detach(), grads[r]) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_step_compiles_once_and_matches_reference(world: int) -> None:
    results = run_ranks(_run, world, timeout=540)
    refs = [_reference(world, s) for s in range(STEPS)]
    for rank, res in enumerate(results):
        assert res["breaks"] == 0, f"rank {rank}: {res['breaks']} graph breaks"
        assert len(res["host_reads"]) == 2 and res["host_reads"] == [[], []], (rank, res["host_reads"])
        for backend, dynamic in CONFIGS:
            got = res[f"{backend}-{dynamic}"]
            assert got["graphs"] == 1, f"rank {rank} {backend} dynamic={dynamic}: {got['graphs']} graphs"
            for s, (step, ref) in enumerate(zip(got["steps"], refs, strict=True)):
                for name, a, b in zip(("y", "sizes", "loss", "grad"), step, ref[rank], strict=True):
                    torch.testing.assert_close(
                        a,
                        b,
                        rtol=1e-9,
                        atol=1e-9,
                        msg=f"rank {rank} {backend} dynamic={dynamic} step {s} {name}",
                    )
