"""No compiler pass may merge one rank's collectives and not another's.

AOT autograd's CSE merges equal nodes of the joint graph, collectives included.
Whether two collectives are equal can differ between ranks: the same tensor sent
twice is equal on every rank, but on a rank whose payload is empty by its static
shape two different gradients can be the same constant too. funcoll issues every
collective of a compiled graph under a group name of its own on every rank
(``_group.wire_name``), so the ranks issue the same collectives whatever their
shapes.

Each case compiles a training step with static ragged sizes where rank 1 holds
no rows, records every rank's forward and backward collectives after the
partitioner (the graphs aot_eager and inductor run), runs the step, and checks
the sequences equal rank 0's and the values and gradients equal a single-process
reference. A rank that issued fewer collectives would hang: ``run_ranks``' timeout
turns that into a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import funcoll
from funcoll.testing import run_ranks

WORLD = 2
ROWS = [3, 0]  # rank 1 holds nothing: its payloads are empty by their static shapes
COLS = 4


def _send(rank: int) -> list[int]:
    """all_to_all_v's static send sizes: rank 0 keeps 1 row and sends 2; rank 1 sends none."""
    return [1, 2] if rank == 0 else [0, 0]


def _recv(rank: int) -> list[int]:
    return [_send(src)[rank] for src in range(WORLD)]


def _twice_all_to_all_v(x: Tensor, rank: int) -> Tensor:
    """The same tensor dispatched twice (an MoE layer that sends its tokens to two expert groups)."""
    a = funcoll.all_to_all_v(x, _send(rank), _recv(rank))[0]
    b = funcoll.all_to_all_v(x, _send(rank), _recv(rank))[0]
    return a * 2 + b


def _twice_gather(x: Tensor, rank: int) -> Tensor:
    """The same tensor gathered twice with the lengths given, so that every shape is static."""
    return funcoll.gather(x, sizes=ROWS) * 3 - funcoll.gather(x, sizes=ROWS)


STEPS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "all_to_all_v": _twice_all_to_all_v,
    "gather": _twice_gather,
}


def _input(rank: int) -> Tensor:
    gen = torch.Generator().manual_seed(17 + rank)
    return torch.randn(ROWS[rank], COLS, generator=gen, dtype=torch.float64)


def _body(rank: int, world: int, name: str) -> dict[str, Any]:
    from funcoll.testing import recording_backend

    backend, seqs = recording_backend()
    x = _input(rank).requires_grad_()
    y = torch.compile(STEPS[name], fullgraph=True, backend=backend, dynamic=False)(x, rank)
    weight = torch.arange(float(y.numel()), dtype=torch.float64).view(y.shape) + rank
    (y * weight).sum().backward()
    return {"seqs": seqs, "y": y.detach(), "grad": x.grad}


def _reference(name: str) -> tuple[list[Tensor], list[Tensor]]:
    xs = [_input(r).requires_grad_() for r in range(WORLD)]
    if name == "gather":
        ys = [torch.cat(xs) * 2 for _ in range(WORLD)]
    else:
        blocks = [x.split(_send(r)) for r, x in enumerate(xs)]
        ys = [torch.cat([blocks[src][r] for src in range(WORLD)]) * 3 for r in range(WORLD)]
    loss = sum((y * (torch.arange(float(y.numel()), dtype=torch.float64).view(y.shape) + r)).sum()
               for r, y in enumerate(ys))  # fmt: skip
    loss.backward()
    return [y.detach() for y in ys], [x.grad for x in xs]


@pytest.mark.parametrize("name", list(STEPS))
def test_the_same_tensor_sent_twice_issues_the_same_collectives_on_every_rank(name: str) -> None:
    per_rank = run_ranks(_body, WORLD, name, timeout=60)
    first = per_rank[0]["seqs"]
    assert first["fw"].count("_c10d_functional.wait_tensor.default") >= 2, first
    for rank, got in enumerate(per_rank[1:], 1):
        assert got["seqs"] == first, f"rank {rank} (no rows) issues {got['seqs']}, rank 0 {first}"
    ys, grads = _reference(name)
    for rank, got in enumerate(per_rank):
        torch.testing.assert_close(got["y"], ys[rank], msg=lambda m, r=rank: f"rank {r} output: {m}")
        torch.testing.assert_close(got["grad"], grads[rank], msg=lambda m, r=rank: f"rank {r} grad: {m}")
