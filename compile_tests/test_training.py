"""An end-to-end compiled training loop with sequence parallelism on 2 and 3 CPU ranks.

The model is a two-layer transformer (embedding 16, 4 heads of dim 4, MLP 32,
causal attention) trained by SGD on a regression loss. Each rank holds a chunk of
the sequence:

* attention re-shards with ``funcoll.all_to_all`` (DeepSpeed-Ulysses): the
  sequence-sharded ``(B, L, H, D)`` q, k, v become head-sharded ``(B, w*L, H/w, D)``
  (on 3 ranks the 4 heads split 2, 1, 1: tensor_split semantics), and the output
  goes back, by ``all_to_all`` again when the heads split evenly and by
  ``all_to_all_v`` when they do not (the head-sharded pieces then differ in shape
  between ranks). The sequence all_to_all needs equal local chunks, so the chunk
  length ``L`` is the same on every rank but changes from step to step;
* the loss is taken on a ragged subset of positions: rank r scores ``n_r`` of its
  ``L`` tokens, ``n_r`` drawn per step and per rank (0 allowed), and
  ``funcoll.gather`` concatenates the per-rank predictions and targets, so every
  rank computes the same loss over all scored tokens.

Parameters are replicated. Every rank's loss is the same L, so funcoll's adjoint
backward computes the gradient of ``world * L`` split over the ranks' parameter
copies; ``all_reduce(op="avg")`` of the gradients gives exactly dL/dθ on every
rank before ``optimizer.step()``.

The compiled step (``torch.compile(step, fullgraph=True)``, aot_eager) must run 12
steps with one graph per rank (``mark_ragged`` on the chunk and the scored
positions), have no graph break (``torch._dynamo.explain``), and give the losses
and parameters of the eager distributed run and of a single-process model trained
on the full sequence.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.testing import CompileCounterWithBackend

import funcoll
from funcoll.testing import run_ranks

EMBED = 16
HEADS = 4
HEAD_DIM = EMBED // HEADS
HIDDEN = 32
LAYERS = 2
BATCH = 2
STEPS = 12
LR = 0.2
MAX_CHUNK = 3  # the local chunk length L is drawn from 1..3 per step
TIMEOUT = 240.0

Params = dict[str, Tensor]
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def _prefixed(where: str) -> Callable[[str], str]:
    """An assert_close `msg` that says where the mismatch is."""
    return lambda message: f"{where}: {message}"


def _seed(*keys: int) -> int:
    seed = 71
    for k in keys:
        seed = (seed * 1_000_003 + k) % (1 << 62)
    return seed


def _init_params() -> Params:
    """The initial parameters, the same in every process."""
    gen = torch.Generator().manual_seed(_seed(1))

    def randn(*shape: int, scale: float) -> Tensor:
        return scale * torch.randn(shape, generator=gen, dtype=torch.float64)

    p: Params = {}
    for layer in range(LAYERS):
        p[f"{layer}.ln1_w"] = 1 + randn(EMBED, scale=0.1)
        p[f"{layer}.ln1_b"] = randn(EMBED, scale=0.1)
        p[f"{layer}.wqkv"] = randn(EMBED, 3 * EMBED, scale=EMBED**-0.5)
        p[f"{layer}.wo"] = randn(EMBED, EMBED, scale=EMBED**-0.5)
        p[f"{layer}.ln2_w"] = 1 + randn(EMBED, scale=0.1)
        p[f"{layer}.ln2_b"] = randn(EMBED, scale=0.1)
        p[f"{layer}.w1"] = randn(EMBED, HIDDEN, scale=EMBED**-0.5)
        p[f"{layer}.b1"] = randn(HIDDEN, scale=0.1)
        p[f"{layer}.w2"] = randn(HIDDEN, EMBED, scale=HIDDEN**-0.5)
        p[f"{layer}.b2"] = randn(EMBED, scale=0.1)
    return p


# -------------------------------------------------------------------------------- data
def _chunk_length(world: int, step: int) -> int:
    gen = torch.Generator().manual_seed(_seed(world, step))
    return int(torch.randint(1, MAX_CHUNK + 1, (1,), generator=gen))


def _scored_counts(world: int, step: int) -> list[int]:
    """How many of its L tokens each rank scores (0 allowed; at least one token in all)."""
    length = _chunk_length(world, step)
    gen = torch.Generator().manual_seed(_seed(world, step, 1))
    counts = torch.randint(0, length + 1, (world,), generator=gen).tolist()
    if sum(counts) == 0:
        counts[step % world] = 1
    return counts


def _rank_batch(world: int, step: int, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rank `rank`'s (x (B, L, E), scored positions (n,), targets (n, B, E)) of one step."""
    length = _chunk_length(world, step)
    n = _scored_counts(world, step)[rank]
    gen = torch.Generator().manual_seed(_seed(world, step, rank, 2))
    x = torch.randn(BATCH, length, EMBED, generator=gen, dtype=torch.float64)
    positions = torch.randperm(length, generator=gen)[:n].sort().values
    targets = torch.randn(n, BATCH, EMBED, generator=gen, dtype=torch.float64)
    return x, positions, targets


# ------------------------------------------------------------------------------- model
def _causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(B, S, h, D) q, k, v -> (B, S, h, D), causal over S."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return o.transpose(1, 2)


def _sequence_parallel_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Ulysses: (B, L, H, D) per rank -> heads sharded over the full sequence -> back."""
    q, k, v = (funcoll.all_to_all(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))  # (B, w*L, h_r, D)
    return _heads_to_sequence(_causal_attention(q, k, v))


def _heads_to_sequence(o: Tensor) -> Tensor:
    """(B, w*L, h_r, D) head-sharded -> (B, L, H, D) sequence-sharded: the inverse re-shard.

    With equal head counts that is ``all_to_all`` with the dims swapped. With uneven
    ones (4 heads on 3 ranks: 2, 1, 1) the pieces differ in shape between ranks,
    which all_to_all does not allow, so the rows travel by ``all_to_all_v``: rank r
    sends each rank j its ``L`` positions for its own ``h_r`` heads.
    """
    world, rank = funcoll.axis_size(), funcoll.axis_index()
    if HEADS % world == 0:
        return funcoll.all_to_all(o, scatter_dim=1, gather_dim=2)
    batch, seq, _, head_dim = o.shape
    length = seq // world
    heads = [(HEADS - i + world - 1) // world for i in range(world)]  # torch.tensor_split sizes
    rows = o.permute(1, 2, 0, 3).reshape(seq * heads[rank], batch, head_dim)  # (position, head) rows
    got, _ = funcoll.all_to_all_v(rows, [length * heads[rank]] * world, [length * h for h in heads])
    pieces = got.split([length * h for h in heads])  # the rows from rank i: (L * h_i, B, D)
    merged = torch.cat(
        [p.reshape(length, h, batch, head_dim) for p, h in zip(pieces, heads, strict=True)], dim=1
    )
    return merged.permute(2, 0, 1, 3)  # (B, L, H, D)


def _model(x: Tensor, p: Params, attend: Attend) -> Tensor:
    """(B, S, E) -> (B, S, E): LAYERS pre-norm transformer layers."""
    batch, seq = x.shape[0], x.shape[1]
    for layer in range(LAYERS):
        h = F.layer_norm(x, (EMBED,), p[f"{layer}.ln1_w"], p[f"{layer}.ln1_b"])
        q, k, v = (h @ p[f"{layer}.wqkv"]).chunk(3, dim=-1)
        o = attend(*(t.reshape(batch, seq, HEADS, HEAD_DIM) for t in (q, k, v)))
        x = x + o.reshape(batch, seq, EMBED) @ p[f"{layer}.wo"]
        h = F.layer_norm(x, (EMBED,), p[f"{layer}.ln2_w"], p[f"{layer}.ln2_b"])
        x = x + F.gelu(h @ p[f"{layer}.w1"] + p[f"{layer}.b1"]) @ p[f"{layer}.w2"] + p[f"{layer}.b2"]
    return x


def _train_step_loss(p: Params, x: Tensor, positions: Tensor, targets: Tensor) -> Tensor:
    """The distributed forward and loss: the function that is compiled."""
    # L is unbacked (mark_ragged); scaled_dot_product_attention asks whether the
    # sequence is empty, which only this hint answers.
    torch._check(x.shape[1] >= 1)
    out = _model(x, p, _sequence_parallel_attention)  # (B, L, E)
    scored = out.index_select(1, positions).transpose(0, 1)  # (n_r, B, E), ragged over ranks
    predictions = funcoll.gather(scored)  # (sum n, B, E), rank order
    return ((predictions - funcoll.gather(targets)) ** 2).mean()


# ---------------------------------------------------------------------------- rank side
def _train(rank: int, world: int, compiled: bool) -> dict[str, Any]:
    params = {k: v.requires_grad_() for k, v in _init_params().items()}
    optimizer = torch.optim.SGD(params.values(), lr=LR)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step_fn = (
        torch.compile(_train_step_loss, backend=counter, fullgraph=True) if compiled else _train_step_loss
    )
    losses = []
    for step in range(STEPS):
        x, positions, targets = _rank_batch(world, step, rank)
        if compiled:
            x = funcoll.mark_ragged(x, 1)
            positions = funcoll.mark_ragged(positions, 0)
            targets = funcoll.mark_ragged(targets, 0)
        optimizer.zero_grad()
        loss = step_fn(params, x, positions, targets)
        loss.backward()
        for p in params.values():
            p.grad = funcoll.all_reduce(p.grad, op="avg")
        optimizer.step()
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": {k: v.detach().clone() for k, v in params.items()},
        "graphs": counter.frame_count if compiled else None,
    }


def _explain(rank: int, world: int) -> dict[str, Any]:
    torch._dynamo.reset()
    params = _init_params()
    x, positions, targets = _rank_batch(world, 0, rank)
    x, positions, targets = (funcoll.mark_ragged(t, d) for t, d in ((x, 1), (positions, 0), (targets, 0)))
    report = torch._dynamo.explain(_train_step_loss)(params, x, positions, targets)
    torch._dynamo.reset()
    return {
        "graph_count": report.graph_count,
        "graph_break_count": report.graph_break_count,
        "break_reasons": [str(b.reason) for b in report.break_reasons],
    }


def _rank_body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, run in (
        ("explain", lambda: _explain(rank, world)),
        ("eager", lambda: _train(rank, world, compiled=False)),
        ("compiled", lambda: _train(rank, world, compiled=True)),
    ):
        try:
            out[name] = run()
        except Exception:  # noqa: BLE001 -- recorded: the parent reports every rank's error
            out[name] = {"error": traceback.format_exc()}
    return out


# --------------------------------------------------------- single-process reference
def _reference(world: int) -> dict[str, Any]:
    """The same model trained on the full sequence in one process (all heads, no collectives)."""
    params = {k: v.requires_grad_() for k, v in _init_params().items()}
    optimizer = torch.optim.SGD(params.values(), lr=LR)
    losses = []
    for step in range(STEPS):
        batches = [_rank_batch(world, step, r) for r in range(world)]
        length = batches[0][0].shape[1]
        x = torch.cat([b[0] for b in batches], dim=1)  # (B, world * L, E)
        positions = torch.cat([b[1] + r * length for r, b in enumerate(batches)])
        targets = torch.cat([b[2] for b in batches])
        optimizer.zero_grad()
        out = _model(x, params, _causal_attention)
        loss = ((out[:, positions].transpose(0, 1) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": {k: v.detach() for k, v in params.items()}}


_RESULTS: dict[int, list[dict[str, Any]] | BaseException] = {}


def _results(world: int) -> list[dict[str, Any]]:
    """One run_ranks call per world, shared by its tests (a failure is cached too)."""
    if world not in _RESULTS:
        try:
            _RESULTS[world] = run_ranks(_rank_body, world, timeout=TIMEOUT)
        except BaseException as e:  # noqa: BLE001 -- a hang or a crash: every test of this world reports it
            _RESULTS[world] = e
    got = _RESULTS[world]
    if isinstance(got, BaseException):
        raise RuntimeError(f"run_ranks on world {world} failed") from got
    return got


def _run(world: int, name: str) -> list[dict[str, Any]]:
    per_rank = [r[name] for r in _results(world)]
    for rank, res in enumerate(per_rank):
        assert "error" not in res, f"{name} rank {rank}:\n{res['error']}"
    return per_rank


# -------------------------------------------------------------------------------- tests
WORLDS = [pytest.param(2, id="w2-heads4-embed16"), pytest.param(3, id="w3-heads4-split2,1,1-embed16")]


@pytest.mark.parametrize("world", WORLDS)
def test_inputs_are_ragged(world: int) -> None:
    """A check of the data: chunk lengths change, and ranks score different counts, 0 included."""
    assert len({_chunk_length(world, s) for s in range(STEPS)}) > 1
    counts = [_scored_counts(world, s) for s in range(STEPS)]
    assert any(0 in c for c in counts) and any(len(set(c)) > 1 for c in counts)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_matches_single_process_training(world: int, mode: str) -> None:
    reference = _reference(world)
    for rank, res in enumerate(_run(world, mode)):
        torch.testing.assert_close(res["losses"], reference["losses"], msg=_prefixed(f"rank {rank} losses"))
        for name, value in reference["params"].items():
            torch.testing.assert_close(res["params"][name], value, msg=_prefixed(f"rank {rank} {name}"))


@pytest.mark.parametrize("world", WORLDS)
def test_compiled_matches_eager(world: int) -> None:
    for rank, (eager, compiled) in enumerate(zip(_run(world, "eager"), _run(world, "compiled"), strict=True)):
        torch.testing.assert_close(compiled["losses"], eager["losses"], msg=_prefixed(f"rank {rank}"))
        for name, value in eager["params"].items():
            torch.testing.assert_close(compiled["params"][name], value, msg=_prefixed(f"rank {rank} {name}"))


@pytest.mark.parametrize("world", WORLDS)
def test_one_graph_per_rank(world: int) -> None:
    for rank, res in enumerate(_run(world, "compiled")):
        assert res["graphs"] == 1, f"rank {rank} compiled {res['graphs']} graphs over {STEPS} steps"


@pytest.mark.parametrize("world", WORLDS)
def test_no_graph_break(world: int) -> None:
    for rank, res in enumerate(_run(world, "explain")):
        assert res["graph_break_count"] == 0, f"rank {rank}: {res['break_reasons']}"
        assert res["graph_count"] == 1, f"rank {rank}: {res['graph_count']} graphs"


def test_training_moves_parameters() -> None:
    """The loop really trains, so parameter equality is not equality of untouched weights."""
    initial, final = _init_params(), _reference(2)["params"]
    assert all(torch.isfinite(v).all() for v in final.values())
    assert min(float((final[k] - initial[k]).abs().max()) for k in initial) > 1e-3
