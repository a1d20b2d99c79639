"""Multi-rank tests of ``funcoll.moe`` (dispatch and combine) against a single-process MoE.

Every case is a :class:`Case`: a world size, each rank's token count, the hidden
size, top-k, experts per rank, `align`, the mode and capacity, and a routing
pattern. Rank r rebuilds its tokens, routing and router weights from a generator
seeded by (case, r), and the experts' weights ``W`` ``(E, H, H)`` from one seeded
by the case, so the parent process rebuilds every rank's inputs and computes the
reference itself: each pair (t, j) of rank r contributes ``w[t, j] * x[t] @
W[e]`` to its token, unless static mode drops it (the first `capacity` pairs of
each (source, destination) in token-major order are kept). The loss is
``sum_r (out_r * G_r).sum()`` with fixed per-rank ``G_r``; float64 gradients of
``x``, ``topk_weights`` and ``W`` are checked against autograd on the reference.
``recv``'s layout (expert-major, then source rank, then token order, padded to
`align` with zero rows), ``counts``, ``offsets`` and ``dropped`` are checked
exactly, and no collective may be left unwaited (``funcoll.testing.in_flight()``)
after a case, nor after static mode's checked capacity error. All cases of one
world size run in ONE ``run_ranks`` call.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _inputs import load_file, once_per_world
from torch import Tensor

import funcoll
from funcoll import moe
from funcoll.moe import _autograd as moe_autograd
from funcoll.moe import _layout as moe_layout
from funcoll.testing import count_host_reads, in_flight, run_ranks

WORLDS = (2, 3, 4)
SNIPPET = Path(__file__).resolve().parents[1] / "docs" / "snippets" / "moe_layer.py"
TIMEOUT = 180.0
ROUTINGS = ("uniform", "skewed", "one_expert", "first_expert", "zero_experts")


@dataclass(frozen=True)
class Case:
    world: int
    tokens: tuple[int, ...]  # T on each rank
    hidden: int
    k: int
    e_local: int
    align: int
    mode: str
    routing: str
    capacity: int | None = None

    @property
    def num_experts(self) -> int:
        return self.world * self.e_local

    @property
    def seed(self) -> int:
        return zlib.crc32(repr(self).encode())

    @property
    def id(self) -> str:
        cap = "" if self.mode == "exact" else f"-cap{self.capacity}"
        t = ".".join(map(str, self.tokens))
        return (
            f"w{self.world}-{self.mode}{cap}-{self.routing}-T{t}-H{self.hidden}-k{self.k}-El{self.e_local}"
            f"-align{self.align}"
        )


def cases(world: int) -> list[Case]:
    ragged = tuple((5 + 3 * r) % 8 for r in range(world))  # 5, 0, 3, 6: T=0 on rank 1
    equal = (6,) * world
    c = Case
    return [
        c(world, ragged, 5, 2, 2, 1, "exact", "uniform"),
        c(world, ragged, 3, 1, 1, 4, "exact", "skewed"),
        c(world, equal, 4, 2, 4, 1, "exact", "one_expert"),
        c(world, ragged, 5, 2, 2, 4, "exact", "zero_experts"),
        c(world, (0,) * world, 3, 2, 2, 1, "exact", "uniform"),  # no tokens anywhere
        c(world, equal, 5, 2, 2, 1, "static", "uniform"),  # capacity None: dropless
        c(world, ragged, 3, 1, 4, 4, "static", "skewed", capacity=2),  # drops
        c(world, ragged, 4, 2, 1, 1, "static", "one_expert", capacity=3),  # drops, T=0 on a rank
        # drops, and rank 0's layout is full: its last row, where a dropped pair's
        # gradient would come from if the spare rows' were not zero, carries data
        c(world, equal, 4, 2, 1, 1, "static", "first_expert", capacity=3),
        c(world, equal, 5, 1, 2, 4, "static", "zero_experts"),
        c(world, ragged, 3, 2, 2, 4, "static", "uniform", capacity=0),  # everything dropped
        c(world, (63, *ragged[1:]), 30, 2, 2, 4, "exact", "skewed"),  # odd sizes
        c(world, (63, *ragged[1:]), 30, 2, 4, 1, "static", "uniform", capacity=23),
        # Dropless policy: the first step overflows and runs again in exact mode, the
        # second fits the grown capacity; or the capacity fits from the start.
        c(world, ragged, 4, 2, 2, 4, "policy", "skewed", capacity=1),
        c(world, ragged, 3, 1, 1, 1, "policy", "one_expert", capacity=0),
        c(world, ragged, 5, 2, 2, 1, "policy", "uniform", capacity=16),
        # mode="dropless": static when every rank fits, exact when one overflows; the
        # capacity given differs by rank (the group takes its largest).
        c(world, ragged, 4, 2, 2, 4, "dropless", "skewed", capacity=1),
        c(world, equal, 3, 1, 1, 1, "dropless", "one_expert", capacity=0),
        c(world, ragged, 5, 2, 2, 1, "dropless", "uniform", capacity=16),
        c(world, (63, *ragged[1:]), 30, 2, 2, 4, "dropless", "zero_experts", capacity=40),
    ]


CASES = {w: cases(w) for w in WORLDS}


# ------------------------------------------------------------------------------------- inputs
def gen(case: Case, *keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(case.seed * 31 + sum((i + 1) * 1009 * k for i, k in enumerate(keys)))


def routing(case: Case, t: int, g: torch.Generator) -> Tensor:
    """(t, k) expert ids for one rank."""
    e = case.num_experts
    if case.routing == "uniform":  # k distinct experts per token
        return torch.rand(t, e, generator=g).argsort(1)[:, : case.k]
    if case.routing == "skewed":  # low ids far likelier
        probs = torch.tensor([0.6**i for i in range(e)], dtype=torch.float64)
        if t == 0:
            return torch.empty(0, case.k, dtype=torch.int64)
        return torch.multinomial(probs.expand(t, e), case.k, replacement=False, generator=g)
    if case.routing == "one_expert":  # every choice of every token: the last expert
        return torch.full((t, case.k), e - 1, dtype=torch.int64)
    if case.routing == "first_expert":  # every choice of every token: expert 0, rank 0's
        return torch.zeros(t, case.k, dtype=torch.int64)
    # zero_experts: only the even experts get tokens, with repeats allowed
    return 2 * torch.randint(0, (e + 1) // 2, (t, case.k), generator=g)


def rank_inputs(case: Case, rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rank r's x (T, H), topk_idx (T, k), topk_weights (T, k) and loss weights G (T, H)."""
    g = gen(case, 1, rank)
    t = case.tokens[rank]
    x = torch.randn(t, case.hidden, generator=g, dtype=torch.float64)
    idx = routing(case, t, g)
    w = torch.rand(t, case.k, generator=g, dtype=torch.float64)
    loss_w = torch.randn(t, case.hidden, generator=g, dtype=torch.float64)
    return x, idx, w, loss_w


def expert_weights(case: Case) -> Tensor:
    g = gen(case, 2)
    return (
        torch.randn(case.num_experts, case.hidden, case.hidden, generator=g, dtype=torch.float64)
        / case.hidden
    )


def run_experts(recv: Tensor, counts: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
    """Each local expert's block of `recv` through its weight (a grouped GEMM, by hand).

    The rows outside the blocks are NaN, as a grouped GEMM leaves them unwritten:
    combine must read none of them into a token's output.
    """
    pieces, at = [], 0
    # Host reads in the test itself: the experts' loop bounds.
    for e, (o, c) in enumerate(zip(offsets.tolist(), counts.tolist(), strict=True)):
        pieces += [torch.full_like(recv[at:o], torch.nan), recv[o : o + c] @ weights[e]]
        at = o + c
    pieces.append(torch.full_like(recv[at:], torch.nan))
    return torch.cat(pieces)


# ---------------------------------------------------------------------------------------- ranks
def given_at_dispatch(case: Case) -> bool:
    """Half the cases pass the caller's counts and the router weights to dispatch (as torchtitan does)."""
    return zlib.crc32(case.id.encode()) % 2 == 1


def layer(case: Case, x: Tensor, idx: Tensor, w: Tensor, weights: Tensor, mode: Any) -> tuple[Tensor, ...]:
    capacity = case.capacity if case.mode == "static" else None
    if case.mode == "dropless":  # the group uses the largest: rank 0's
        capacity = rank_capacity(
            case, torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        )
    kw: dict[str, Any] = {"mode": mode, "capacity": capacity, "align": case.align}
    if given_at_dispatch(case):
        kw["counts"] = torch.bincount(idx.reshape(-1), minlength=case.num_experts).to(torch.int32)
        kw["topk_weights"] = w
    with count_host_reads() as reads:
        recv, h = moe.dispatch(x, idx, case.num_experts, **kw)
    seen = (h.mode, h.capacity, h.group_needed, reads.count)
    y = run_experts(recv, h.counts, h.offsets, weights)
    y.retain_grad()  # combine's backward: the rows outside the blocks get zero
    out = moe.combine(y, h) if given_at_dispatch(case) else moe.combine(y, h, w)
    # what ran: (mode, capacity, the group's need for mode="dropless", host reads)
    # the handle's fields computed when read: (needed, recv_counts, send_data)
    read = (h.needed, h.recv_counts, h.send_data)
    return out, recv, h.counts, h.offsets, h.dropped, h.ends, seen, y, h.kept, read


def run_case(case: Case, rank: int) -> dict[str, Any]:
    x, idx, w, loss_w = rank_inputs(case, rank)
    mine = slice(rank * case.e_local, (rank + 1) * case.e_local)
    weights = expert_weights(case)[mine].clone().requires_grad_()
    x.requires_grad_()
    w.requires_grad_()
    extra: dict[str, Any] = {}
    if case.mode == "policy":  # two steps of the same batch through one policy
        assert case.capacity is not None
        policy = moe.Dropless(case.capacity)
        out, recv, counts, offsets, dropped, ends, _, y, keep, read = policy.run(
            layer, case, x, idx, w, weights, policy
        )
        extra["step0"] = (policy.replays, policy.capacity, policy.needed)
        (out * loss_w).sum().backward()
        grads = (x.grad, w.grad, weights.grad)
        again = policy.run(layer, case, x, idx, w, weights, policy)[0]
        extra["step1"] = (policy.replays, policy.capacity, policy.needed)
        extra["out1"] = again.detach()
    else:
        out, recv, counts, offsets, dropped, ends, seen, y, keep, read = layer(
            case, x, idx, w, weights, case.mode
        )
        (out * loss_w).sum().backward()
        grads = (x.grad, w.grad, weights.grad)
        if case.mode == "dropless":  # (mode run, capacity, group's need, host reads)
            extra["seen"], extra["checked"] = seen, funcoll.checks_enabled()
    return {
        "recv": recv.detach(),
        "counts": counts,
        "offsets": offsets,
        "ends": ends,
        "dropped": dropped,
        "kept": keep,
        "needed": read[0],
        "recv_counts": read[1],
        "send_data": read[2],
        "out": out.detach(),
        "dx": grads[0],
        "dw": grads[1],
        "dW": grads[2],
        "dy": y.grad,
        "in_flight": in_flight(),
        **extra,
    }


def run_errors(rank: int, world: int) -> dict[str, Any]:
    """Errors that need a group of `world` ranks: every rank raises the same, before communicating."""
    got = {}
    x, idx = torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int64)
    for name, kwargs in {"num_experts": {"num_experts": world + 1}}.items():
        try:
            moe.dispatch(x, idx, **kwargs)  # type: ignore[arg-type]
        except ValueError as e:
            got[name] = str(e)
    # Static mode with capacity None on ranks with different T: the capacities differ. Checked
    # mode makes the blocks' all_to_all compare shapes first: the same ValueError on every rank.
    funcoll.set_checks(True)
    try:
        t = 3 + rank
        moe.dispatch(torch.zeros(t, 3), torch.zeros(t, 1, dtype=torch.int64), world, mode="static")
    except ValueError as e:
        got["capacity"] = str(e)
    finally:
        funcoll.set_checks(False)
    got["in_flight"] = in_flight()  # the capacity error came after the counts' exchange
    return got


def snippet() -> ModuleType:
    return load_file(SNIPPET, "funcoll_docs_moe_layer")


def docstring_example(rank: int) -> dict[str, Any]:
    """The ``Example (2 ranks ...)`` blocks of dispatch and combine, as written there."""
    x = [torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[4.0], [5.0]])][rank]
    topk_idx = [torch.tensor([[3], [0], [2]]), torch.tensor([[1], [0]])][rank]
    topk_weights = [torch.tensor([[0.5], [1.0], [2.0]]), torch.tensor([[1.0], [1.0]])][rank]
    recv, handle = moe.dispatch(x, topk_idx, 4)
    out = {"recv": recv.tolist(), "counts": handle.counts.tolist()}
    out["combined"] = moe.combine(recv, handle, topk_weights).tolist()
    recv, handle = moe.dispatch(x, topk_idx, 4, align=2)
    out["aligned"], out["offsets"], out["ends"] = recv.tolist(), handle.offsets.tolist(), handle.ends.tolist()
    # Dropless's example: rank 0 routes 3 pairs to rank 0, over the capacity of 2.
    policy = moe.Dropless(capacity=2)

    def forward(x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        recv, handle = moe.dispatch(x, idx, 4, mode=policy)
        return moe.combine(recv, handle, w)

    x = [torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[4.0]])][rank]
    idx = [torch.tensor([[0], [1], [0]]), torch.tensor([[2]])][rank]
    out["dropless"] = policy.run(forward, x, idx, torch.ones(x.shape[0], 1)).tolist()
    out["policy"] = (policy.replays, policy.capacity)
    # dispatch's mode="dropless" example: the first example's inputs
    x = [torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[4.0], [5.0]])][rank]
    for cap in (2, 1):
        recv, handle = moe.dispatch(x, topk_idx, 4, mode="dropless", capacity=cap)
        out[f"dropless{cap}"] = (recv.tolist(), handle.mode, handle.group_needed)
    return out


class Counting(torch.nn.Module):
    """An MoE layer with forward side effects: a per-expert counter (torchtitan's load balancer) and batch norm."""

    def __init__(self, policy: moe.Dropless | None = None) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))
        self.norm = torch.nn.BatchNorm1d(3)
        self.policy = policy  # set: the policy runs inside this module, around dispatch and combine only

    def routed(self, h: Tensor, idx: Tensor, w: Tensor, policy: moe.Dropless) -> Tensor:
        recv, handle = moe.dispatch(h, idx, 4, mode=policy)
        return moe.combine(recv, handle, w)

    def forward(self, x: Tensor, idx: Tensor, w: Tensor, policy: moe.Dropless | None = None) -> Tensor:
        self.seen.add_(torch.bincount(idx.flatten(), minlength=4).float())
        h = self.norm(x)
        if self.policy is not None:
            return self.policy.run(self.routed, h, idx, w, self.policy)
        assert policy is not None
        return self.routed(h, idx, w, policy)


def replay_state(rank: int) -> dict[str, Any]:
    """One step through a policy that overflows (rank 0 routes 3 pairs to rank 0, capacity 1), three ways."""
    x = [torch.tensor([[1.0, 2, 0], [2, 0, 1], [3, 1, 1]]), torch.tensor([[4.0, 1, 2], [0, 5, 1]])][rank]
    idx = [torch.tensor([[0], [1], [0]]), torch.tensor([[2], [3]])][rank]
    w = torch.ones(x.shape[0], 1)
    got: dict[str, Any] = {}
    for name in ("state", "no-state", "fits", "inside"):
        torch.manual_seed(0)
        model = Counting(moe.Dropless(1) if name == "inside" else None)
        if name in ("state", "no-state", "fits"):
            policy = moe.Dropless(8 if name == "fits" else 1, state=model if name != "no-state" else None)
            out = policy.run(model, x, idx, w, policy)
        else:
            policy = model.policy
            out = model(x, idx, w)
        got[name] = {"out": out.detach(), "replays": policy.replays,
                     "buffers": {k: v.clone() for k, v in model.named_buffers()}}  # fmt: skip
    return got


DTYPES = (torch.int64, torch.complex64, torch.float16, torch.bfloat16)


def dtypes(rank: int) -> dict[str, list[Tensor]]:
    """Each mode's combine of the identity experts, weights 1 and 2: 3x the tokens, in each dtype."""
    got = {}
    for dt in DTYPES:
        x = (torch.arange(12).view(4, 3) + 10 * rank).to(dt)
        idx = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 1]])
        w = torch.tensor([[1, 2]] * 4).to(dt)
        got[str(dt)] = []
        for mode, capacity in (("exact", None), ("static", 8), ("static", 2)):
            recv, h = moe.dispatch(x, idx, 4, mode=mode, capacity=capacity)
            got[str(dt)].append(moe.combine(recv, h, w))
    return got


def run_batch(rank: int, world: int, batch: list[Case]) -> dict[str, Any]:
    out = {"cases": [run_case(c, rank) for c in batch], "errors": run_errors(rank, world)}
    if world == 2:  # docs/moe.md's layer and the docstrings' examples
        out["snippet"] = {mode: snippet().step(rank, world, mode) for mode in ("exact", "static")}
        out["example"] = docstring_example(rank)
        out["replay_state"] = replay_state(rank)
        out["dtypes"] = dtypes(rank)
    return out


# ------------------------------------------------------------------------------------ reference
def rank_capacity(case: Case, rank: int) -> int:
    """mode="dropless": rank r passes ``capacity - r`` (at least 0), so the ranks' capacities differ."""
    assert case.capacity is not None
    return max(case.capacity - rank, 0)


def kept(case: Case, idx: Tensor) -> Tensor:
    """Static mode's rule: a rank keeps the first `capacity` pairs per destination, token-major."""
    flat = idx.reshape(-1)
    if case.mode != "static":  # exact, and the dropless policy
        return torch.ones_like(idx, dtype=torch.bool)
    cap = case.k * case.tokens[0] if case.capacity is None else case.capacity
    seen = [0] * case.world
    keep = []
    for e in flat.tolist():
        d = e // case.e_local
        keep.append(seen[d] < cap)
        seen[d] += 1
    return torch.tensor(keep, dtype=torch.bool).view(idx.shape)


def needed(case: Case) -> int:
    """The capacity that drops nothing: the most pairs one rank routes to one rank, over the ranks."""
    most = 0
    for r in range(case.world):
        dest = rank_inputs(case, r)[1].reshape(-1) // case.e_local
        most = max([most, *(int((dest == d).sum()) for d in range(case.world))])
    return most


def reference(case: Case) -> dict[str, Any]:
    """Every rank's outputs, recv layouts and gradients, computed in one process."""
    inputs = [rank_inputs(case, r) for r in range(case.world)]
    weights = expert_weights(case).requires_grad_()
    xs = [x.clone().requires_grad_() for x, *_ in inputs]
    ws = [w.clone().requires_grad_() for _, _, w, _ in inputs]
    outs, loss = [], torch.zeros((), dtype=torch.float64)
    keeps = [kept(case, idx) for _, idx, _, _ in inputs]
    for x, w, (_, idx, _, loss_w), keep in zip(xs, ws, inputs, keeps, strict=True):
        y = torch.einsum("th,tkhg->tkg", x, weights[idx])
        out = (y * (w * keep).unsqueeze(-1)).sum(1)
        outs.append(out)
        loss = loss + (out * loss_w).sum()
    loss.backward()
    recvs, dys, counts, offsets, dropped, kepts = [], [], [], [], [], []
    needs, recv_counts, send_data = [], [], []
    cap = case.k * case.tokens[0] if case.capacity is None else case.capacity
    for r in range(case.world):
        # pairs rank r routes to each rank, before and after the capacity; each block
        # carries the kept ones first, then cap + 1 - kept empty rows (static layouts)
        dest = inputs[r][1].reshape(-1) // case.e_local
        wanted = [int((dest == d).sum()) for d in range(case.world)]
        needs.append(max(wanted))
        sent = [int((dest[keeps[r].reshape(-1)] == d).sum()) for d in range(case.world)]
        send_data.append([i < n for n in sent for i in range(cap + 1)])
        recv_counts.append(
            [int((inputs[s][1][keeps[s]] // case.e_local == r).sum()) for s in range(case.world)]
        )
        blocks, dy, c, o, at = [], [], [], [], 0
        zero = torch.zeros(case.hidden, dtype=torch.float64)
        for e in range(r * case.e_local, (r + 1) * case.e_local):
            pairs = [
                (s, t, j)
                for s in range(case.world)
                for t, j in ((f // case.k, f % case.k) for f in range(case.tokens[s] * case.k))
                if inputs[s][1][t, j] == e and keeps[s][t, j]
            ]
            n = len(pairs)
            pad = -(-n // case.align) * case.align - n
            o.append(at)
            c.append(n)
            blocks += [inputs[s][0][t] for s, t, _ in pairs] + [zero] * pad
            # the loss's gradient at expert row (s, t, j): its weight times token t's loss weights
            dy += [inputs[s][2][t, j] * inputs[s][3][t] for s, t, j in pairs] + [zero] * pad
            at += n + pad
        recv = torch.stack(blocks) if blocks else torch.zeros(0, case.hidden, dtype=torch.float64)
        grad = torch.stack(dy) if dy else torch.zeros(0, case.hidden, dtype=torch.float64)
        # A static number of rows: zeros after the blocks. The dropless policy's first step
        # and mode="dropless" return static mode's layout when it fits the capacity, exact
        # mode's otherwise.
        static = case.mode == "static" or (case.mode in ("policy", "dropless") and needed(case) <= cap)
        if static:
            total = -(-(case.world * cap + case.e_local * (case.align - 1)) // case.align) * case.align
            recv = torch.cat([recv, recv.new_zeros(total - recv.shape[0], case.hidden)])
            grad = torch.cat([grad, grad.new_zeros(total - grad.shape[0], case.hidden)])
        recvs.append(recv)
        dys.append(grad)
        counts.append(c)
        offsets.append(o)
        dropped.append(int((~keeps[r]).sum()))
        kepts.append(keeps[r].reshape(-1))
    return {
        "out": [o.detach() for o in outs],
        "dx": [x.grad for x in xs],
        "dw": [w.grad for w in ws],
        "dW": weights.grad,
        "recv": recvs,
        "dy": dys,
        "counts": counts,
        "offsets": offsets,
        "dropped": dropped,
        "kept": kepts,
        "needed": needs,
        "recv_counts": recv_counts,
        "send_data": send_data,
    }


# ------------------------------------------------------------------------------------- fixtures
def _world_batch(rank: int, world: int) -> dict[str, Any]:
    return run_batch(rank, world, CASES[world])


# Every world's batch starts at the first read, side by side; a rank killed by SIGABRT
# runs its batch once more (tests/_inputs.py).
_per_rank = once_per_world(_world_batch, TIMEOUT, worlds=WORLDS)


class Batches:
    def __init__(self) -> None:
        self._done: dict[int, dict[str, Any]] = {}

    def get(self, world: int) -> dict[str, Any]:
        if world not in self._done:
            per_rank = _per_rank(world)
            self._done[world] = {
                "cases": {c.id: [r["cases"][i] for r in per_rank] for i, c in enumerate(CASES[world])},
                "errors": [r["errors"] for r in per_rank],
                "snippet": [r.get("snippet") for r in per_rank],
                "example": [r.get("example") for r in per_rank],
                "dtypes": [r.get("dtypes") for r in per_rank],
                "replay_state": [r.get("replay_state") for r in per_rank],
            }
        return self._done[world]


@pytest.fixture(scope="module")
def batches() -> Batches:
    return Batches()


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for w in WORLDS for c in CASES[w]])
def test_dispatch_combine_match_one_process(batches: Batches, case: Case) -> None:
    ranks = batches.get(case.world)["cases"][case.id]
    ref = reference(case)
    for r, got in enumerate(ranks):
        where = f"{case.id} rank {r}"
        exact = {"rtol": 0.0, "atol": 0.0}
        torch.testing.assert_close(
            got["recv"], ref["recv"][r], **exact, msg=lambda m, where=where: f"{where} recv: {m}"
        )
        assert got["counts"].dtype == torch.int64 and got["counts"].tolist() == ref["counts"][r], where
        assert got["offsets"].tolist() == ref["offsets"][r], where
        # grouped GEMMs' offs: each block's end, its start plus its count padded to `align`
        padded = [-(-c // case.align) * case.align for c in ref["counts"][r]]
        want_ends = [o + p for o, p in zip(ref["offsets"][r], padded, strict=True)]
        assert got["ends"].dtype == torch.int32 and got["ends"].tolist() == want_ends, where
        assert got["dropped"].dtype == torch.int64 and int(got["dropped"]) == ref["dropped"][r], where
        # a static layout (static mode, or dropless's static path, where every pair is kept)
        assert got["needed"].dtype == torch.int64 and int(got["needed"]) == ref["needed"][r], where
        if got["kept"] is not None:
            assert got["kept"].tolist() == ref["kept"][r].tolist(), where
            assert got["recv_counts"].tolist() == ref["recv_counts"][r], where
            assert got["send_data"].tolist() == ref["send_data"][r], where
        else:  # exact mode's layout: static mode's fields are None
            assert got["recv_counts"] is None and got["send_data"] is None, where
        torch.testing.assert_close(got["out"], ref["out"][r], msg=lambda m, where=where: f"{where} out: {m}")
        torch.testing.assert_close(got["dx"], ref["dx"][r], msg=lambda m, where=where: f"{where} x.grad: {m}")
        torch.testing.assert_close(
            got["dw"], ref["dw"][r], msg=lambda m, where=where: f"{where} topk_weights.grad: {m}"
        )
        # the experts' outputs' gradient: zero outside the blocks and in their padding
        torch.testing.assert_close(got["dy"], ref["dy"][r], msg=lambda m, where=where: f"{where} y.grad: {m}")
        mine = slice(r * case.e_local, (r + 1) * case.e_local)
        torch.testing.assert_close(
            got["dW"], ref["dW"][mine], msg=lambda m, where=where: f"{where} W.grad: {m}"
        )
        assert got["in_flight"] == 0, f"{where}: {got['in_flight']} collectives left unwaited"
        if case.mode == "dropless":  # static iff the group's need fits its largest capacity
            need = needed(case)
            # one host read; under set_checks(True) (this directory's), one more for dispatch's
            # cross-rank check and one for each of its two collectives' own headers (what each
            # is: the counts' all_gather, then static's blocks or exact's all_to_all)
            fits = need <= case.capacity  # type: ignore[operator]
            reads = 4 if got["checked"] else 1
            want = ("static", case.capacity, need, reads) if fits else ("exact", None, need, reads)
            assert got["seen"] == want, f"{where}: (mode, capacity, group_needed, host reads) {got['seen']}"
        if case.mode == "policy":  # (replays, capacity, agreed need) after each of two steps
            assert case.capacity is not None
            torch.testing.assert_close(
                got["out1"], ref["out"][r], msg=lambda m, where=where: f"{where} out1: {m}"
            )
            need = needed(case)
            if need > case.capacity:  # overflowed once, then fits the power of two it grew to
                grown = 1 << (need - 1).bit_length()
                assert got["step0"] == (1, grown, need) and got["step1"] == (1, grown, need), where
            else:
                assert got["step0"] == (0, case.capacity, need) == got["step1"], where


def run_gathered(rank: int, world: int, batch: list[Case]) -> list[dict[str, Any]]:
    """The cases with bags of rows gathered, masked and summed: the path every device but the CPU takes.

    Static mode's drop order also takes its path for many pairs (a sort by destination).
    """
    moe_autograd.by_gather = lambda t: True  # this rank's process only
    moe_layout.RUNNING_COUNT_LIMIT = 0
    return [run_case(c, rank) for c in batch]


def test_gathered_bags_match_one_process() -> None:
    """The gathered bags (moe._autograd.by_gather, CUDA's path) against the same reference, on 3 ranks.

    On the CPU the bags are one embedding_bag; here the cases of 3 ranks (every mode,
    drops, empty experts, padding to `align`) run with the path CUDA takes, whose
    values and gradients must equal the single-process reference as the CPU path's do,
    and with the drop order's sort (`moe._layout.rank_in_dest` beyond its running count).
    """
    world = 3
    per_rank = run_ranks(run_gathered, world, CASES[world], timeout=TIMEOUT)
    for i, case in enumerate(CASES[world]):
        ref = reference(case)
        for r in range(world):
            got, where = per_rank[r][i], f"{case.id} rank {r}, bags gathered"
            torch.testing.assert_close(
                got["recv"], ref["recv"][r], rtol=0, atol=0, msg=lambda m, w=where: f"{w}: {m}"
            )
            for key in ("out", "dx", "dw", "dy"):
                want = ref[key][r]
                torch.testing.assert_close(got[key], want, msg=lambda m, w=where, key=key: f"{w} {key}: {m}")
            mine = slice(r * case.e_local, (r + 1) * case.e_local)
            torch.testing.assert_close(got["dW"], ref["dW"][mine], msg=lambda m, w=where: f"{w} W.grad: {m}")


@pytest.mark.parametrize("limit", [1 << 30, 0], ids=["running-count", "sort"])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_rank_in_dest(monkeypatch: pytest.MonkeyPatch, limit: int, n: int) -> None:
    """moe._layout.rank_in_dest, both paths, against a count pair by pair (destinations with no pair)."""
    monkeypatch.setattr(moe_layout, "RUNNING_COUNT_LIMIT", limit)
    world = 4
    dest = torch.randint(0, world - 1, (n,), generator=torch.Generator().manual_seed(n))  # rank 3 gets none
    seen = [0] * world
    want = []
    for d in dest.tolist():
        seen[d] += 1
        want.append(seen[d])
    wanted = torch.bincount(dest, minlength=world)
    got = moe_layout.rank_in_dest(dest, world, wanted)
    assert got.dtype == torch.int64 and got.tolist() == want


@pytest.mark.parametrize("gathered", [False, True], ids=["embedding_bag", "gathered"])
def test_bag_helpers(monkeypatch: pytest.MonkeyPatch, gathered: bool) -> None:
    """moe._autograd.sum_bags and take_valid, both paths, against row-by-row sums (repeated rows, invalid rows, no rows)."""
    monkeypatch.setattr(moe_autograd, "by_gather", lambda t: gathered)
    g = torch.Generator().manual_seed(5)
    t = torch.randn(7, 3, dtype=torch.float64, generator=g)
    bags = torch.randint(0, 7, (5, 2), generator=g)
    bags[1] = 4  # one row twice in a bag
    want = torch.stack([sum((t[j] for j in row.tolist()), torch.zeros(3, dtype=t.dtype)) for row in bags])
    torch.testing.assert_close(moe_autograd.sum_bags(t, bags), want, rtol=0, atol=1e-15)
    index = torch.tensor([3, 0, 6, 0, 2])
    valid = torch.tensor([True, False, True, False, True])
    want = torch.where(valid[:, None], t[index], 0)
    assert torch.equal(moe_autograd.take_valid(t, index, valid), want)
    if gathered:  # no valid entry: t may then have no rows (embedding_bag's path needs one)
        nothing = torch.zeros(3, dtype=torch.bool)
        assert torch.equal(
            moe_autograd.take_valid(t[:0], torch.zeros(3, dtype=torch.int64), nothing), t.new_zeros(3, 3)
        )


def test_some_static_case_drops() -> None:
    """The capacities above are small enough that the static cases do drop pairs (the drop path runs)."""
    assert any(sum(reference(c)["dropped"]) > 0 for c in CASES[2] if c.capacity)


@pytest.mark.parametrize("world", [2, 3], ids=["w2", "w3"])
def test_num_experts_must_divide(batches: Batches, world: int) -> None:
    for errors in batches.get(world)["errors"]:
        assert errors["num_experts"].startswith("funcoll.moe.dispatch: `num_experts`=")
        assert f"{world} ranks" in errors["num_experts"]
    capacities = [3 + r for r in range(world)]  # capacity=None: T * k, a different T per rank
    for errors in batches.get(world)["errors"]:
        assert errors["capacity"].startswith("funcoll.moe.dispatch: ranks disagree on the static capacity"), (
            errors
        )
        assert all(f"rank {r}: {c}" in errors["capacity"] for r, c in enumerate(capacities)), errors
        assert errors["in_flight"] == 0, f"{errors['in_flight']} collectives left unwaited after the errors"


def test_docs_layer_matches_one_process(batches: Batches) -> None:
    """docs/moe.md's layer (docs/snippets/moe_layer.py), in both modes, on 2 ranks."""
    ref = snippet().reference(2)
    for r, got in enumerate(batches.get(2)["snippet"]):
        for mode, (out, grad) in got.items():
            torch.testing.assert_close(
                out, ref[r][0], msg=lambda m, mode=mode, r=r: f"rank {r} {mode} out: {m}"
            )
            torch.testing.assert_close(
                grad, ref[r][1], msg=lambda m, mode=mode, r=r: f"rank {r} {mode} W.grad: {m}"
            )


def test_dtypes_the_weighted_sum_does_not_fuse(batches: Batches) -> None:
    """Integer, complex and half tokens through both modes: every token comes back 3 times over.

    Static mode with capacity 2 keeps each rank's first 2 pairs per destination in
    token-major order. Experts 0 and 1 live on rank 0, whose pairs are (token 0,
    choice 0), (0, 1), (2, 1), (3, 0), (3, 1): (0, 0) and (0, 1) are kept. Rank 1's
    are (1, 0), (1, 1), (2, 0): (1, 0) and (1, 1) are kept. So tokens 0 and 1 come
    back whole (weights 1 + 2), tokens 2 and 3 as zeros.
    """
    for r, got in enumerate(batches.get(2)["dtypes"]):
        for dt in DTYPES:
            x = (torch.arange(12).view(4, 3) + 10 * r).to(dt)
            exact, roomy, tight = got[str(dt)]
            assert exact.dtype == dt and torch.equal(exact, 3 * x), (r, dt, exact)
            assert torch.equal(roomy, 3 * x), (r, dt, roomy)
            want = torch.stack([3 * x[0], 3 * x[1], 0 * x[2], 0 * x[3]])
            assert torch.equal(tight, want), (r, dt, tight)


def test_docstring_examples_hold(batches: Batches) -> None:
    rank0, rank1 = batches.get(2)["example"]
    assert rank0["recv"] == [[2.0], [5.0], [4.0]] and rank0["counts"] == [2, 1]
    assert rank1["recv"] == [[3.0], [1.0]] and rank1["counts"] == [1, 1]
    assert rank0["aligned"] == [[2.0], [5.0], [4.0], [0.0]] and rank0["offsets"] == [0, 2]
    assert rank0["ends"] == [2, 4]
    assert rank0["combined"] == [[0.5], [2.0], [6.0]] and rank1["combined"] == [[4.0], [5.0]]
    assert rank0["dropless"] == [[1.0], [2.0], [3.0]] and rank1["dropless"] == [[4.0]]
    assert rank0["policy"] == rank1["policy"] == (1, 4)
    assert rank0["dropless2"] == ([[2.0], [5.0], [4.0], [0.0]], "static", 2)
    assert rank1["dropless2"] == ([[3.0], [1.0], [0.0], [0.0]], "static", 2)
    assert rank0["dropless1"] == ([[2.0], [5.0], [4.0]], "exact", 2)
    assert rank1["dropless1"] == ([[3.0], [1.0]], "exact", 2)


def test_replay_leaves_the_state_of_a_step_that_fit(batches: Batches) -> None:
    """An overflowed step's buffers (a counter, batch norm's running statistics) as if it ran once."""
    for rank, got in enumerate(batches.get(2)["replay_state"]):
        fits, state, no_state, inside = got["fits"], got["state"], got["no-state"], got["inside"]
        assert fits["replays"] == 0 and state["replays"] == no_state["replays"] == inside["replays"] == 1, (
            rank
        )
        for name, want in fits["buffers"].items():
            for how in (state, inside):
                torch.testing.assert_close(
                    how["buffers"][name], want, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
                )
            torch.testing.assert_close(state["out"], fits["out"])
        # Without `state`, the replay updates them again: the counter counts the step twice.
        assert no_state["buffers"]["seen"].tolist() == (2 * fits["buffers"]["seen"]).tolist(), rank
        assert int(no_state["buffers"]["norm.num_batches_tracked"]) == 2, rank


def test_benchmark_quick_run() -> None:
    """benchmarks/bench_moe.py --quick (2 ranks, 64 tokens, one round of 2-layer steps): it runs, its
    layers agree, and it counts each one's host reads a step: one a layer for the recipe and exact
    mode, none for static mode, one a step for the Dropless policy."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    methods = (("titan", 2), ("funcoll.moe exact", 2), ("funcoll.moe static", 0), ("funcoll.moe dropless", 1))
    for method, syncs in methods:
        assert re.search(rf"\| 2 \| 64 \| {re.escape(method)} \|[^|]+\|[^|]+\| {syncs} \|", done.stdout), (
            done.stdout
        )


def test_single_rank_without_process_group() -> None:
    """No process group: every expert is local, and the result is the reference's."""
    case = Case(1, (7,), 4, 2, 3, 4, "exact", "uniform")
    for mode, capacity in (
        ("exact", None),
        ("static", None),
        ("policy", 1),
        ("dropless", 1),
        ("dropless", 20),
    ):
        c = Case(**{**case.__dict__, "mode": mode, "capacity": capacity})
        got = run_case(c, 0)
        ref = reference(c)
        torch.testing.assert_close(got["out"], ref["out"][0])
        torch.testing.assert_close(got["recv"], ref["recv"][0])
        torch.testing.assert_close(got["dx"], ref["dx"][0])
        torch.testing.assert_close(got["dW"], ref["dW"])


X, IDX = torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.int64)


@pytest.mark.parametrize(
    "kwargs, error, start",
    [
        ({"x": torch.zeros(4)}, ValueError, "funcoll.moe.dispatch: `x` must be 2-D"),
        ({"x": [[1.0]]}, TypeError, "funcoll.moe.dispatch: `x` must be a torch.Tensor"),
        (
            {"topk_idx": torch.zeros(4, dtype=torch.int64)},
            ValueError,
            "funcoll.moe.dispatch: `topk_idx` must be 2-D",
        ),
        (
            {"topk_idx": IDX[:, :0]},
            ValueError,
            "funcoll.moe.dispatch: `topk_idx` has shape (4, 0): each token",
        ),
        ({"topk_idx": torch.zeros(4, 2)}, TypeError, "funcoll.moe.dispatch: `topk_idx` must hold integer"),
        ({"topk_idx": IDX[:3]}, ValueError, "funcoll.moe.dispatch: `topk_idx` has 3 rows but `x` has 4"),
        ({"num_experts": 2.0}, TypeError, "funcoll.moe.dispatch: `num_experts` must be an int"),
        ({"num_experts": 0}, ValueError, "funcoll.moe.dispatch: `num_experts`=0 must be a positive multiple"),
        ({"mode": "auto"}, ValueError, "funcoll.moe.dispatch: `mode`='auto' is not one of"),
        ({"mode": "static", "capacity": -1}, ValueError, "funcoll.moe.dispatch: `capacity`=-1 must be >= 0"),
        ({"mode": "static", "capacity": 2.5}, TypeError, "funcoll.moe.dispatch: `capacity` must be an int"),
        (
            {"capacity": 4},
            ValueError,
            "funcoll.moe.dispatch: `capacity`=4 is for mode='static' or 'dropless'",
        ),
        (
            {"mode": "dropless"},
            ValueError,
            "funcoll.moe.dispatch: `capacity`=None: mode='dropless' needs the capacity",
        ),
        (
            {"mode": "dropless", "capacity": -2},
            ValueError,
            "funcoll.moe.dispatch: `capacity`=-2 must be >= 0",
        ),
        ({"align": 0}, ValueError, "funcoll.moe.dispatch: `align`=0 must be >= 1"),
        ({"align": True}, TypeError, "funcoll.moe.dispatch: `align` must be an int"),
        ({"counts": [2, 2, 2, 2]}, TypeError, "funcoll.moe.dispatch: `counts` must be a torch.Tensor"),
        (
            {"counts": torch.zeros(4)},
            TypeError,
            "funcoll.moe.dispatch: `counts` must hold integer pair counts",
        ),
        (
            {"counts": torch.zeros(3, dtype=torch.int64)},
            ValueError,
            "funcoll.moe.dispatch: `counts` has shape (3,), expected (num_experts,) = (4,)",
        ),
        (
            {"topk_weights": torch.ones(4, 1)},
            ValueError,
            "funcoll.moe.dispatch: `topk_weights` has shape (4, 1), expected `topk_idx`'s (4, 2)",
        ),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_dispatch_errors(kwargs: dict[str, Any], error: type, start: str) -> None:
    args = {"x": X, "topk_idx": IDX, "num_experts": 4, **kwargs}
    with pytest.raises(error) as info:
        moe.dispatch(args.pop("x"), args.pop("topk_idx"), args.pop("num_experts"), **args)
    assert str(info.value).startswith(start), str(info.value)


def test_dropless_mode_refuses_to_compile() -> None:
    """A compiled graph cannot branch on the overflow's host read: a clear error, at trace time."""

    def fn(x: Tensor, idx: Tensor) -> Tensor:
        return moe.dispatch(x, idx, 4, mode="dropless", capacity=2)[0]

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"funcoll.moe.dispatch: `mode`='dropless' cannot be compiled"):
        torch.compile(fn, fullgraph=True, backend="eager")(X, IDX)
    torch._dynamo.reset()


def test_dropless_errors() -> None:
    policy = moe.Dropless(2)
    with pytest.raises(
        ValueError, match=r"^funcoll.moe.dispatch: `mode`=Dropless\(capacity=2.*called outside it"
    ):
        moe.dispatch(X, IDX, 4, mode=policy)
    with pytest.raises(ValueError, match=r"^funcoll.moe.dispatch: `capacity`=3 is the policy's own"):
        policy.run(lambda: moe.dispatch(X, IDX, 4, mode=policy, capacity=3))
    with pytest.raises(ValueError, match=r"^funcoll.moe.Dropless.run: `fn` made no dispatch"):
        policy.run(lambda: X)
    with pytest.raises(RuntimeError, match=r"^funcoll.moe.Dropless.run: already running"):
        policy.run(lambda: policy.run(lambda: X))
    with pytest.raises(TypeError, match=r"^funcoll.moe.Dropless: `capacity` must be an int, got float"):
        moe.Dropless(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^funcoll.moe.Dropless: `capacity`=-1 must be >= 0"):
        moe.Dropless(-1)
    with pytest.raises(
        TypeError, match=r"^funcoll.moe.Dropless: `state` must be a torch.nn.Module or modules, got"
    ):
        moe.Dropless(2, state=[torch.zeros(1)])  # type: ignore[list-item]
    assert not policy._active  # an error inside the forward leaves the policy usable


@pytest.mark.parametrize("bad", [4, -1, 2**40], ids=["num-experts", "negative", "huge"])
def test_expert_id_out_of_range(bad: int) -> None:
    idx = IDX.clone()
    idx[1, 0] = bad  # one id outside [0, 4), the others valid
    with pytest.raises(RuntimeError, match=r"funcoll.moe.dispatch: `topk_idx` holds an expert id outside"):
        moe.dispatch(X, idx, 4)


def test_caller_counts_are_checked_only_with_checks_on() -> None:
    wrong = torch.tensor([7, 1, 0, 0])  # IDX routes all 8 pairs to expert 0
    with (
        funcoll.set_checks(True),
        pytest.raises(
            RuntimeError,
            match=r"funcoll.moe.dispatch: `counts` are not the counts of `topk_idx`'s expert ids",
        ),
    ):
        moe.dispatch(X, IDX, 4, counts=wrong)
    right = torch.tensor([8, 0, 0, 0], dtype=torch.int32)
    with funcoll.set_checks(True):
        recv, h = moe.dispatch(X, IDX, 4, counts=right)
    assert h.counts.tolist() == [8, 0, 0, 0] and recv.shape == (8, 3)


def test_combine_errors() -> None:
    recv, h = moe.dispatch(X, IDX, 4)
    w = torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"^funcoll.moe.combine: `y` has 9 rows but dispatch's `recv` had 8"):
        moe.combine(torch.zeros(9, 3), h, w)
    with pytest.raises(ValueError, match=r"^funcoll.moe.combine: `y` must be 2-D"):
        moe.combine(torch.zeros(8), h, w)
    with pytest.raises(ValueError, match=r"^funcoll.moe.combine: `topk_weights` has shape \(4, 1\)"):
        moe.combine(recv, h, torch.ones(4, 1))
    with pytest.raises(TypeError, match=r"^funcoll.moe.combine: `handle` must be the MoEHandle"):
        moe.combine(recv, (1, 2), w)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^funcoll.moe.combine: `y` must be a torch.Tensor"):
        moe.combine([1.0], h, w)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^funcoll.moe.combine: `topk_weights` is None and dispatch was given"
    ):
        moe.combine(recv, h)


def test_public_submodule() -> None:
    assert funcoll.moe is moe
    assert "moe" not in funcoll.__all__
