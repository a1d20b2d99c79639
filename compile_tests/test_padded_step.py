"""The static-shape ragged ops in a compiled training step: one graph whatever the sizes, no host sync.

On 3 gloo ranks (an odd world; 2 ranks ran the same graphs, for the suite's time), one step runs both ops of ``funcoll/_ops/_static.py``:
``gather_padded`` of a bound-padded tensor (variable-length sequences) and
``all_to_all_padded`` of capacity blocks (an MoE dispatch), each followed by a softmax
and a weighted loss, plus the cumsum of the returned sizes. It is compiled with
``fullgraph=True`` and called for 12 steps, each rank drawing fresh sizes every step
(0 and the bound included). Checked:

- the step compiles once per rank (``CompileCounterWithBackend.frame_count == 1``)
  on aot_eager with ``dynamic=None/True`` and on inductor (``False`` compiles what
  ``None`` does: the padded shapes never change);
- every step's outputs, loss and input gradients equal a single-process reference
  (the ranks' data rows concatenated, zero-padded; the gradients by torch.autograd
  of the summed losses);
- the AOT forward and backward graphs hold no host read (``_local_scalar_dense``),
  no funcoll custom op (the ragged ops' size read) and no graph break;
- with ``dynamic=True`` and a row width that changes between steps, rows at least as
  wide as the size header that travels beside them share one graph (the header is one
  row: a guard on the width's range, not its value), narrower rows a second one, and
  every step matches the reference.
"""

from __future__ import annotations

import functools
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
BOUND = 5  # gather_padded's rows per rank
CAP = 3  # all_to_all_padded's rows per destination block
WIDTH = 4
# Row widths one dynamic=True step sees in turn: as wide as the size header that travels
# beside the rows (16 + 2 * world int64: 22 float64 elements on these 3 ranks) or wider,
# then narrower. The wide ones share one graph (the header takes one row
# whatever the width), the narrow ones another.
WIDTHS = (24, 32, 4, 6)
CONFIGS = (("aot_eager", None), ("aot_eager", True), ("inductor", None))
OUTPUTS = ("y", "sizes", "y2", "recv_sizes", "loss")


def length(step: int, rank: int) -> int:
    """Fresh every step; over the 12 steps every rank sees 0 and BOUND."""
    return (5 * step + 3 * rank) % (BOUND + 1)


def send(step: int, rank: int, world: int) -> list[int]:
    """Rows this rank sends to each rank at this step: 0 to CAP, fresh every step."""
    return [(step + 2 * rank + 3 * j) % (CAP + 1) for j in range(world)]


def _randn(rows: int, *key: object, width: int = WIDTH) -> Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(rows, width, generator=g, dtype=torch.float64)


def _inputs(step: int, rank: int, world: int, width: int = WIDTH) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (
        _randn(BOUND, "x", step, rank, width=width),
        torch.tensor(length(step, rank)),
        _randn(world * CAP, "x2", step, rank, width=width),
        torch.tensor(send(step, rank, world)),
    )


def _weights(world: int, rank: int, width: int = WIDTH) -> tuple[Tensor, Tensor]:
    return _randn(world * BOUND, "w", rank, width=width), _randn(world * CAP, "w2", rank, width=width)


def _step(fn: Any, step: int, rank: int, world: int, width: int = WIDTH) -> list[Tensor]:
    """One call of `fn` and its backward: the outputs, then both inputs' gradients."""
    x, n, x2, counts = _inputs(step, rank, world, width)
    x.requires_grad_()
    x2.requires_grad_()
    got = fn(x, n, x2, counts, *_weights(world, rank, width))
    got[-1].backward()
    return [t.detach() for t in got] + [x.grad, x2.grad]


def step_fn(x: Tensor, n: Tensor, x2: Tensor, counts: Tensor, w: Tensor, w2: Tensor) -> tuple[Tensor, ...]:
    y, sizes = funcoll.gather_padded(x, n)
    y2, recv_sizes = funcoll.all_to_all_padded(x2, counts)
    ends = torch.cumsum(sizes, 0) + torch.cumsum(recv_sizes, 0).sum()
    loss = (torch.softmax(y, -1) * w).sum() + (torch.softmax(y2, -1) * w2).sum() + ends.sum()
    return y, sizes, y2, recv_sizes, loss


def _host_reads(gm: torch.fx.GraphModule) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and ("_local_scalar_dense" in name or name.startswith("funcoll.")):
            bad.append(name)
    return bad


def _run(rank: int, world: int) -> dict[str, Any]:
    w, w2 = _weights(world, rank)
    out: dict[str, Any] = {}
    for backend, dynamic in CONFIGS:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        fn = torch.compile(step_fn, fullgraph=True, dynamic=dynamic, backend=counter)
        steps = [_step(fn, s, rank, world) for s in range(STEPS)]
        out[f"{backend}-{dynamic}"] = {"graphs": counter.frame_count, "steps": steps}
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(step_fn, fullgraph=True, dynamic=True, backend=counter)
    out["widths"] = {"steps": [_step(fn, s, rank, world, width) for s, width in enumerate(WIDTHS)]}
    out["widths"]["graphs"] = counter.frame_count
    # The AOT graphs of the step, read for host reads; and dynamo's own count of breaks.
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    x, n, x2, counts = _inputs(0, rank, world)
    x.requires_grad_()
    fn = torch.compile(step_fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    fn(x, n, x2, counts, w, w2)[-1].backward()
    out["host_reads"] = [_host_reads(gm) for gm in graphs]
    torch._dynamo.reset()
    out["breaks"] = torch._dynamo.explain(step_fn)(x, n, x2, counts, w, w2).graph_break_count
    return out


def _reference(world: int, s: int, width: int = WIDTH) -> list[list[Tensor]]:
    """Every rank's outputs and input gradients at step `s`, from all ranks' inputs in one process."""
    inputs = [_inputs(s, r, world, width) for r in range(world)]
    xs = [inp[0].requires_grad_() for inp in inputs]
    x2s = [inp[2].requires_grad_() for inp in inputs]
    lengths = [length(s, r) for r in range(world)]
    data = torch.cat([x[:n] for x, n in zip(xs, lengths, strict=True)])
    y = torch.cat([data, data.new_zeros(world * BOUND - data.shape[0], width)])
    sizes = torch.tensor(lengths)
    sends = [send(s, r, world) for r in range(world)]
    outs, losses = [], []
    for j in range(world):
        got = torch.cat([x2s[i][j * CAP : j * CAP + sends[i][j]] for i in range(world)])
        y2 = torch.cat([got, got.new_zeros(world * CAP - got.shape[0], width)])
        recv_sizes = torch.tensor([sends[i][j] for i in range(world)])
        w, w2 = _weights(world, j, width)
        ends = torch.cumsum(sizes, 0) + torch.cumsum(recv_sizes, 0).sum()
        loss = (torch.softmax(y, -1) * w).sum() + (torch.softmax(y2, -1) * w2).sum() + ends.sum()
        outs.append([y, sizes, y2, recv_sizes, loss])
        losses.append(loss)
    grads = torch.autograd.grad(sum(losses), xs + x2s)
    return [[t.detach() for t in outs[r]] + [grads[r], grads[world + r]] for r in range(world)]


@functools.cache
def _results(world: int) -> list[dict[str, Any]]:
    """Every rank's runs, once per world size for the tests below (one launch of the ranks)."""
    return run_ranks(_run, world, timeout=540)


def _assert_steps(rank: int, label: str, steps: list[list[Tensor]], refs: list[list[list[Tensor]]]) -> None:
    for s, (step, ref) in enumerate(zip(steps, refs, strict=True)):
        names = (*OUTPUTS, "x.grad", "x2.grad")
        for name, a, b in zip(names, step, ref[rank], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"rank {rank} {label} step {s} {name}")


@pytest.mark.parametrize("world", [3])
def test_compiled_step_compiles_once_and_matches_reference(world: int) -> None:
    results = _results(world)
    refs = [_reference(world, s) for s in range(STEPS)]
    for rank, res in enumerate(results):
        assert res["breaks"] == 0, f"rank {rank}: {res['breaks']} graph breaks"
        assert len(res["host_reads"]) == 2 and res["host_reads"] == [[], []], (rank, res["host_reads"])
        for backend, dynamic in CONFIGS:
            got = res[f"{backend}-{dynamic}"]
            assert got["graphs"] == 1, f"rank {rank} {backend} dynamic={dynamic}: {got['graphs']} graphs"
            _assert_steps(rank, f"{backend} dynamic={dynamic}", got["steps"], refs)


@pytest.mark.parametrize("world", [3])
def test_dynamic_row_widths_share_a_graph_per_header_layout(world: int) -> None:
    """Rows at least as wide as the header (16, 24) share one graph; narrower ones (4, 6) another."""
    refs = [_reference(world, s, width) for s, width in enumerate(WIDTHS)]
    for rank, res in enumerate(_results(world)):
        assert res["widths"]["graphs"] == 2, f"rank {rank}: {res['widths']['graphs']} graphs for {WIDTHS}"
        _assert_steps(rank, f"widths {WIDTHS}", res["widths"]["steps"], refs)
