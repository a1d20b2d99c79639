"""funcoll.allow_compile_caches: a step compiled again (a restarted job) hits inductor's caches.

By torch's defaults AOT autograd's cache and the FX graph cache refuse every graph
that holds funcoll's ops (its autograd.Functions, its ordered effects, a ragged size
header), so a restarted job compiles them in full again. With
``funcoll.allow_compile_caches()`` the first compile stores them and a second one,
after ``torch._dynamo.reset()`` (what a new process finds on disk), loads them: AOT
autograd's cache hits for the whole step and the FX graph cache for its forward and
backward, with no miss or bypass.

One step on 2 gloo ranks: ``funcoll.gather`` of ``3 + 2 rank`` rows (the lengths
exchanged in the graph: the size header), a linear, a ragged ``reduce_scatter``
back with ``sizes=``, and an even ``all_gather`` of its row sums; its backward
holds funcoll's anchors. Both compiles' outputs and input gradients are compared
with a single-process reference built from every rank's input.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import Tensor

import funcoll
from funcoll.testing import run_ranks

WORLD = 2
D = 8


def _x(rank: int) -> Tensor:
    rows = 3 + 2 * rank
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _w() -> Tensor:
    return torch.randn(D, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _step(w: Tensor, group: Any) -> Any:
    def step(x: Tensor, sizes: list[int]) -> tuple[Tensor, Tensor]:
        y = funcoll.gather(x, 0, group=group) @ w  # the lengths exchanged in the graph
        z = funcoll.reduce_scatter(y, 0, group=group, sizes=sizes)
        return z, funcoll.all_gather(z.sum(0, keepdim=True), 0, group=group)

    return step


def _reference(rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's outputs and input gradient (loss: every rank's outputs summed), in one process."""
    xs = [_x(r).requires_grad_() for r in range(WORLD)]
    y = torch.cat(xs) @ _w()
    z = list((WORLD * y).split([x.shape[0] for x in xs]))  # every rank's copy of y summed, then its rows
    s = torch.cat([p.sum(0, keepdim=True) for p in z])  # the same on every rank
    (sum(p.sum() for p in z) + WORLD * s.sum()).backward()
    return z[rank].detach(), s.detach(), xs[rank].grad  # type: ignore[return-value]


def _run(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    funcoll.allow_compile_caches()
    step = _step(_w(), torch.distributed.group.WORLD)
    sizes = [_x(r).shape[0] for r in range(world)]
    out: dict[str, Any] = {}
    for attempt in ("cold", "warm"):
        torch._dynamo.reset()
        counters.clear()
        x = _x(rank).requires_grad_()
        z, s = torch.compile(step, backend="inductor", fullgraph=True)(funcoll.mark_ragged(x), sizes)
        (z.sum() + s.sum()).backward()
        caches = {
            name: n
            for key in ("aot_autograd", "inductor")
            for name, n in counters[key].items()
            if name.startswith(("autograd_cache", "fxgraph_cache"))
        }
        out[attempt] = (z.detach(), s.detach(), x.grad, caches)
    funcoll.allow_compile_caches(False)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cache_dir = str(tmp_path_factory.mktemp("inductor_cache"))
    return run_ranks(_run, WORLD, cache_dir, timeout=400.0)


def test_second_compile_hits_both_caches(results: list[dict[str, Any]]) -> None:
    for rank, per_rank in enumerate(results):
        cold, warm = per_rank["cold"][3], per_rank["warm"][3]
        assert cold.get("autograd_cache_saved") == 1, (rank, cold)
        assert warm == {"autograd_cache_hit": 1, "fxgraph_cache_hit": 2}, (rank, warm)


@pytest.mark.parametrize("attempt", ["cold", "warm"])
def test_values_and_gradients_match_the_reference(results: list[dict[str, Any]], attempt: str) -> None:
    for rank, per_rank in enumerate(results):
        *got, _ = per_rank[attempt]
        for name, g, want in zip(("z", "s", "x.grad"), got, _reference(rank), strict=True):
            torch.testing.assert_close(g, want, msg=lambda m, r=rank, n=name: f"rank {r}, {n}: {m}")


def test_off_restores_torch_defaults() -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    before = dict(inductor_config.unsafe_marked_cacheable_functions)
    funcoll.allow_compile_caches()
    assert functorch_config.autograd_cache_allow_custom_autograd_functions
    assert "torch.ops.higher_order.with_effects" in inductor_config.unsafe_marked_cacheable_functions
    funcoll.allow_compile_caches(False)
    assert not functorch_config.autograd_cache_allow_custom_autograd_functions
    assert inductor_config.unsafe_marked_cacheable_functions == before
    with pytest.raises(
        TypeError, match=r"funcoll.allow_compile_caches: `enable` must be a bool, got str 'yes'"
    ):
        funcoll.allow_compile_caches("yes")  # type: ignore[arg-type]
