"""Every device-to-host sync site in funcoll traces into one graph with no break.

The sites (each commented in the source): the read of the gathered header in
``funcoll::check_header`` (every ragged call), and the read of sizes passed as
tensors (``all_to_all_v`` with both size tensors, ``reduce_scatter`` with a CPU
``sizes`` tensor). Each is run under ``torch._dynamo.explain`` (fullgraph=False,
where a ``.tolist()`` would break the graph unless captured) and compiled with
``fullgraph=True``; values match a single-process reference.
"""

from __future__ import annotations

import pytest
import torch

import funcoll
from funcoll.testing import run_ranks


def _rows(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float64).view(n, 3) + 100 * rank


def _send(rank: int, world: int) -> list[int]:
    return [(rank + 2 * j) % 3 for j in range(world)]


def _sites(rank: int, world: int) -> dict[str, object]:
    send = _send(rank, world)
    recv = [_send(i, world)[rank] for i in range(world)]
    x = _rows(rank, sum(send))
    fns = {
        "gather": (lambda t: funcoll.gather(t) * 2, _rows(rank, rank + 1)),
        "all_to_all_v_tensors": (
            lambda t: funcoll.all_to_all_v(t, torch.tensor(send), torch.tensor(recv))[0] * 2,
            x,
        ),
        "reduce_scatter_cpu_sizes": (
            lambda t: funcoll.reduce_scatter(t, sizes=torch.tensor([1] * (world - 1) + [2])) * 2,
            _rows(0, world + 1),
        ),
    }
    out: dict[str, object] = {}
    for name, (fn, inp) in fns.items():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(inp)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(inp)
        out[name] = (explained.graph_break_count, compiled, fn(inp))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sync_sites_trace_without_breaks(world: int) -> None:
    results = run_ranks(_sites, world, timeout=240)
    for rank, res in enumerate(results):
        full = torch.cat([_rows(i, i + 1) for i in range(world)])
        recv_rows = [
            _rows(i, sum(_send(i, world)))[sum(_send(i, world)[:rank]) : sum(_send(i, world)[: rank + 1])]
            for i in range(world)
        ]
        sizes = [1] * (world - 1) + [2]
        total = world * _rows(0, world + 1)
        want = {
            "gather": 2 * full,
            "all_to_all_v_tensors": 2 * torch.cat(recv_rows),
            "reduce_scatter_cpu_sizes": 2 * torch.split(total, sizes)[rank],
        }
        for name, (breaks, compiled, eager) in res.items():
            assert breaks == 0, f"rank {rank} {name}: {breaks} graph breaks"
            torch.testing.assert_close(
                compiled, want[name], msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
            torch.testing.assert_close(eager, want[name], msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
