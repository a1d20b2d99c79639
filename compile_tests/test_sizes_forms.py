"""A ragged gather's `sizes` as a list, a tensor or exchanged, compiled over lengths that change every step.

A training loop of 12 steps on 3 ranks: each step every rank holds 0 to 5 rows
(marked with ``funcoll.mark_ragged``), computes ``relu(x @ W)`` and gathers it with
``sizes=`` a Python list, a tensor, or not given (exchanged), then a loss and its
backward. Each rank's loss and ``W.grad`` are compared with a single-process
reference, and the compiles counted:

- a tensor (read on the host as unbacked sizes) and the exchange compile once;
- a list's ints are dynamo inputs: a static graph first, then one with dynamic
  ints, then one more (dynamo specializes ints 0 and 1): 3 graphs over these steps,
  the same on every rank.

Before, the list's entry for this rank was asserted equal to the marked length,
which replaced the length's unbacked symbol by the list's int, and inductor
failed to lower the backward ("The size of tensor a (u0) must match the size of
tensor b (4)", a reshape to ``[3*s38]`` in the all_to_all's repeat): the list
form runs on inductor here, the counts on aot_eager.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import funcoll
from funcoll.testing import run_ranks

WORLD, STEPS, D = 3, 12, 4
_rng = random.Random(5)
LENGTHS = [[_rng.choice([0, 0, 1, 2, 3, 4, 5]) for _ in range(WORLD)] for _ in range(STEPS)]
FORMS = {"list": "aot_eager", "tensor": "aot_eager", "exchanged": "aot_eager", "list-inductor": "inductor"}


def _x(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(LENGTHS[step][rank], D, generator=gen, dtype=torch.float64)


def _w() -> torch.Tensor:
    return torch.linspace(-1, 1, D * D, dtype=torch.float64).reshape(D, D)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.arange(1, D + 1, dtype=y.dtype)).pow(2).mean()


def _loop(rank: int, world: int, form: str) -> dict[str, Any]:
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(FORMS[form])
    w = _w().requires_grad_()

    def step(x: torch.Tensor, sizes: Any) -> torch.Tensor:
        h = torch.relu(x @ w)
        return _loss(funcoll.gather(h) if sizes is None else funcoll.gather(h, sizes=sizes))

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    losses, grads = [], []
    for s in range(STEPS):
        x = funcoll.mark_ragged(_x(s, rank), 0)
        sizes = {"tensor": torch.tensor(LENGTHS[s]), "exchanged": None}.get(form, LENGTHS[s])
        w.grad = None
        loss = compiled(x, sizes)
        loss.backward()
        losses.append(loss.detach())
        grads.append(w.grad.clone())
    return {"losses": losses, "grads": grads, "graphs": counter.frame_count}


_RESULTS: dict[str, list[dict[str, Any]]] = {}


def _results(form: str) -> list[dict[str, Any]]:
    if form not in _RESULTS:
        _RESULTS[form] = run_ranks(_loop, WORLD, form, timeout=600.0, pg_timeout=120.0)
    return _RESULTS[form]


@pytest.mark.parametrize("form", list(FORMS))
def test_every_step_matches_the_reference(form: str) -> None:
    for rank, got in enumerate(_results(form)):
        for s in range(STEPS):
            ws = [_w().requires_grad_() for _ in range(WORLD)]  # each rank's copy of W
            loss = _loss(torch.cat([torch.relu(_x(s, r) @ ws[r]) for r in range(WORLD)]))
            # every rank's loss is this one; this rank's W reaches it through its own rows
            (grad,) = torch.autograd.grad(loss * WORLD, ws[rank])
            torch.testing.assert_close(
                got["losses"][s], loss.detach(), msg=lambda m, s=s, r=rank: f"rank {r} step {s}: {m}"
            )
            torch.testing.assert_close(
                got["grads"][s], grad, msg=lambda m, s=s, r=rank: f"rank {r} step {s} grad: {m}"
            )


@pytest.mark.parametrize("form", list(FORMS))
def test_compiles(form: str) -> None:
    graphs = [got["graphs"] for got in _results(form)]
    want = 3 if form.startswith("list") else 1
    assert graphs == [want] * WORLD, graphs
