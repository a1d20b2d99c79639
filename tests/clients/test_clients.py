"""Small programs written the way funcoll's users write their collective code, on real gloo ranks.

Each program passes its group as such code does, runs eagerly (on 2, 3 and 4 ranks)
and under ``torch.compile(fullgraph=True)`` (on 2 and 3), and is checked against a single-process
computation of the same model on the global data (float64 outputs and gradients):

* ``ulysses``: DeepSpeed-Ulysses style attention, a module holding its sequence-parallel
  group as ``self.spg``: all_to_all from sequence shards to head shards, attention
  over the whole sequence, all_to_all back; heads the world divides and heads it
  does not (``gather_sizes``), one head for up to 4 ranks (ranks with no head),
  sequence lengths it does not divide.
* ``megatron_sp``: Megatron sequence parallelism inside a tensor-parallel subgroup
  reached through a ``parallel_state``-style getter: gather the sequence shards
  (ragged), column- then row-parallel linear, reduce-scatter back to the ragged shards.
* ``megatron_moe``: Megatron's expert all-to-all with split sizes, on the same
  subgroup as the expert-parallel group: tokens sorted by expert, ``all_to_all_v``,
  each rank's expert, ``all_to_all_v`` back with the sizes swapped, unsorted.
* ``metrics``: a torchmetrics-style metric whose ``compute`` gathers variable-length
  predictions and targets (an empty rank included) and the per-rank counts (0-d),
  with its ``process_group`` passed as an argument.

Tensor-parallel subgroups are consecutive pairs of ranks ({0, 1}, {2, 3}; a lone
last rank is a group of one). One ``run_ranks`` call per world runs every program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _inputs import once_per_world, seeded
from torch import Tensor, nn

import funcoll

WORLDS = (2, 3, 4)
TIMEOUT_S = 300.0
F64 = torch.float64
MODES = ("eager", "compiled")
COMPILED_WORLDS = (2, 3)  # compiled at 2 and 3 ranks (odd), eager at every world: the suite's time


def _modes(world: int) -> tuple[str, ...]:
    return MODES if world in COMPILED_WORLDS else ("eager",)


def _compile(fn: Any, mode: str) -> Any:
    return fn if mode == "eager" else torch.compile(fn, fullgraph=True, backend="aot_eager")


def tsplit(n: int, world: int) -> list[int]:
    return [p.numel() for p in torch.tensor_split(torch.arange(n), world)]


# ------------------------------------------------------------------ parallel state
class parallel_state:  # Megatron's module of group getters, as a namespace
    """Groups made once per process, read through getters as Megatron-style code does."""

    _TP: Any = None

    @classmethod
    def initialize(cls, world: int) -> None:
        rank = dist.get_rank()
        for start in range(0, world, 2):  # every rank calls new_group for every group, in order
            ranks = list(range(start, min(start + 2, world)))
            pg = dist.new_group(ranks)
            if rank in ranks:
                cls._TP = pg

    @classmethod
    def get_tensor_model_parallel_group(cls) -> Any:
        return cls._TP

    @classmethod
    def get_expert_model_parallel_group(cls) -> Any:
        return cls._TP


def tp_members(rank: int, world: int) -> list[int]:
    start = rank // 2 * 2
    return list(range(start, min(start + 2, world)))


# ------------------------------------------------------------------------- ulysses
B, D = 2, 4


# torch 2.11's CPU scaled_dot_product_attention dies with SIGFPE on a tensor with no
# head (its flash kernel; the math backend and torch 2.12 on are right): a rank that
# holds none skips it there, as a model on that release must (docs/support.md).
_SDPA_DIES_ON_NO_HEAD = torch.__version__ < "2.12"


class DistributedAttention(nn.Module):
    """Sequence shards (B, S_r, H, D) in, sequence shards out; attention runs on head shards."""

    def __init__(self, sequence_process_group: Any, num_heads: int, seq_len: int) -> None:
        super().__init__()
        self.spg = sequence_process_group
        self.num_heads, self.seq_len = num_heads, seq_len

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        world = funcoll.axis_size(self.spg)
        seq = funcoll.split_sizes(self.seq_len, world)  # what each rank holds along S
        heads = funcoll.split_sizes(self.num_heads, world)
        # (B, S_r, H, D) -> (B, S, H_r, D): scatter heads, gather the sequence
        q, k, v = (funcoll.all_to_all(t, self.spg, 2, 1, gather_sizes=seq) for t in (q, k, v))
        if q.shape[2] == 0 and _SDPA_DIES_ON_NO_HEAD:  # this rank holds no head: nothing to attend
            o = (q + k + v).transpose(1, 2)  # (B, 0, S, D), in the graph of q, k and v
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        # (B, S, H_r, D) -> (B, S_r, H, D): scatter the sequence, gather heads
        return funcoll.all_to_all(o.transpose(1, 2), self.spg, 1, 2, gather_sizes=heads)


ULYSSES = {"even-heads": (4, 6), "uneven-heads": (3, 5), "one-head": (1, 7)}  # id -> (H, S)


def _qkv(cid: str, heads: int, seq: int) -> list[Tensor]:
    return [seeded((B, seq, heads, D), F64, "ulysses", cid, name) for name in "qkv"]


def _attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return o.transpose(1, 2)


def run_ulysses(rank: int, world: int, sub: Any, mode: str, cid: str) -> dict[str, Tensor]:
    heads, seq = ULYSSES[cid]
    mine = [t.tensor_split(world, 1)[rank].clone().requires_grad_() for t in _qkv(cid, heads, seq)]
    attn = _compile(DistributedAttention(sub, heads, seq), mode)
    out = attn(*mine)
    (out * seeded(out.shape, F64, "ulysses-w", cid, rank)).sum().backward()
    return {"out": out.detach(), **{f"grad_{n}": t.grad for n, t in zip("qkv", mine, strict=True)}}


def ref_ulysses(world: int, cid: str) -> list[dict[str, Tensor]]:
    heads, seq = ULYSSES[cid]
    full = [t.requires_grad_() for t in _qkv(cid, heads, seq)]
    outs = _attention(*full).tensor_split(world, 1)
    loss = sum((o * seeded(o.shape, F64, "ulysses-w", cid, r)).sum() for r, o in enumerate(outs))
    grads = torch.autograd.grad(loss, full)
    return [
        {"out": outs[r].detach(), **{f"grad_{n}": g.tensor_split(world, 1)[r] for n, g in zip("qkv", grads, strict=True)}}
        for r in range(world)
    ]  # fmt: skip


# --------------------------------------------------------------------- megatron sp
SP_SEQ, SP_BATCH, HIDDEN, FFN = 7, 2, 4, 6  # the sequence never divides by 2


def _sp_weights(members: list[int]) -> tuple[Tensor, Tensor]:
    return seeded((FFN, HIDDEN), F64, "w1", *members), seeded((HIDDEN, FFN), F64, "w2", *members)


def _sp_sizes(tp: int) -> list[int]:
    """Uneven sequence shards: rank i of the TP group holds these many positions."""
    return [SP_SEQ - 2 * (tp - 1)] + [2] * (tp - 1)


def _sp_input(members: list[int], index: int) -> Tensor:
    return seeded((_sp_sizes(len(members))[index], SP_BATCH, HIDDEN), F64, "sp-x", *members, index)


def sp_mlp(x: Tensor, w1: Tensor, w2: Tensor, sizes: list[int]) -> Tensor:
    """Megatron's sequence-parallel MLP on shards: the group comes from parallel_state."""
    tp = parallel_state.get_tensor_model_parallel_group()
    full = funcoll.gather(x, 0, group=tp)  # gather_from_sequence_parallel_region (ragged)
    h = F.gelu(full @ w1.t())  # ColumnParallelLinear: this rank's FFN columns
    y = h @ w2.t()  # RowParallelLinear: partial sums over the FFN shards
    return funcoll.reduce_scatter(y, 0, group=tp, sizes=sizes)  # reduce_scatter_to_sequence_parallel_region


def run_megatron_sp(rank: int, world: int, sub: Any, mode: str, cid: str) -> dict[str, Tensor]:
    members = tp_members(rank, world)
    index, tp = members.index(rank), len(members)
    w1, w2 = _sp_weights(members)
    w1 = w1.tensor_split(tp, 0)[index].clone().requires_grad_()
    w2 = w2.tensor_split(tp, 1)[index].clone().requires_grad_()
    x = _sp_input(members, index).requires_grad_()
    out = _compile(sp_mlp, mode)(x, w1, w2, _sp_sizes(tp))
    (out * seeded(out.shape, F64, "sp-w", *members, index)).sum().backward()
    return {"out": out.detach(), "grad_x": x.grad, "grad_w1": w1.grad, "grad_w2": w2.grad}


def ref_megatron_sp(world: int, cid: str) -> list[dict[str, Tensor]]:
    out = []
    for rank in range(world):
        members = tp_members(rank, world)
        index, tp = members.index(rank), len(members)
        w1, w2 = (w.requires_grad_() for w in _sp_weights(members))
        xs = [_sp_input(members, i).requires_grad_() for i in range(tp)]
        ys = (F.gelu(torch.cat(xs) @ w1.t()) @ w2.t()).split(_sp_sizes(tp))
        loss = sum((y * seeded(y.shape, F64, "sp-w", *members, i)).sum() for i, y in enumerate(ys))
        gx, g1, g2 = torch.autograd.grad(loss, [xs[index], w1, w2])
        out.append({"out": ys[index].detach(), "grad_x": gx, "grad_w1": g1.tensor_split(tp, 0)[index],
                    "grad_w2": g2.tensor_split(tp, 1)[index]})  # fmt: skip
    return out


# -------------------------------------------------------------------- megatron moe
TOKENS = {"skewed": lambda i: 5 + 2 * i, "empty-rank": lambda i: 0 if i == 0 else 6}


def _moe_tokens(members: list[int], i: int, cid: str) -> tuple[Tensor, Tensor]:
    n = TOKENS[cid](i)
    x = seeded((n, HIDDEN), F64, "moe-x", cid, *members, i)
    g = torch.Generator().manual_seed(1000 * len(members) + i)
    # skewed routing: most tokens go to the group's first expert, and some expert may get none
    expert = (torch.rand(n, generator=g) > 0.7).long() * (len(members) - 1)
    return x, expert


def _experts(members: list[int]) -> list[Tensor]:
    return [seeded((HIDDEN, HIDDEN), F64, "expert", *members, e) for e in range(len(members))]


def moe_layer(x: Tensor, expert: Tensor, w: Tensor) -> Tensor:
    """Megatron-style token dispatch: permute, all_to_all with split sizes, expert, back, unpermute."""
    ep = parallel_state.get_expert_model_parallel_group()
    order = torch.argsort(expert, stable=True)
    experts = torch.arange(funcoll.axis_size(ep), device=expert.device)
    send = (expert[:, None] == experts).sum(0)  # input_split_sizes (a bincount of static length)
    routed, recv = funcoll.all_to_all_v(x[order], send, group=ep)  # output_split_sizes exchanged
    y = torch.tanh(routed @ w.t())  # this rank's expert
    back, _ = funcoll.all_to_all_v(y, recv, send, group=ep)  # the way back: sizes swapped
    return torch.empty_like(back).index_copy(0, order, back)


def run_megatron_moe(rank: int, world: int, sub: Any, mode: str, cid: str) -> dict[str, Tensor]:
    members = tp_members(rank, world)
    index = members.index(rank)
    x, expert = _moe_tokens(members, index, cid)
    x = x.requires_grad_()
    w = _experts(members)[index].requires_grad_()
    out = _compile(moe_layer, mode)(x, expert, w)
    (out * seeded(out.shape, F64, "moe-w", cid, *members, index)).sum().backward()
    return {"out": out.detach(), "grad_x": x.grad, "grad_w": w.grad}


def ref_megatron_moe(world: int, cid: str) -> list[dict[str, Tensor]]:
    out = []
    for rank in range(world):
        members = tp_members(rank, world)
        index = members.index(rank)
        ws = [w.requires_grad_() for w in _experts(members)]
        toks = [_moe_tokens(members, i, cid) for i in range(len(members))]
        xs = [x.requires_grad_() for x, _ in toks]
        ys = [torch.stack([torch.tanh(ws[e] @ t) for t, e in zip(x, ex.tolist(), strict=True)])
              if x.shape[0] else x * 0 for x, (_, ex) in zip(xs, toks, strict=True)]  # fmt: skip
        loss = sum((y * seeded(y.shape, F64, "moe-w", cid, *members, i)).sum() for i, y in enumerate(ys))
        gx, gw = torch.autograd.grad(loss, [xs[index], ws[index]], allow_unused=True)
        out.append({"out": ys[index].detach(), "grad_x": gx,
                    "grad_w": torch.zeros_like(ws[index]) if gw is None else gw})  # fmt: skip
    return out


# ------------------------------------------------------------------------ metrics
class Accuracy:
    """torchmetrics style: states per rank, one gather of every rank's states in compute()."""

    def __init__(self) -> None:
        self.preds: list[Tensor] = []
        self.target: list[Tensor] = []

    def update(self, preds: Tensor, target: Tensor) -> None:
        self.preds.append(preds)
        self.target.append(target)

    def compute(self, process_group: Any = None) -> tuple[Tensor, Tensor, Tensor]:
        preds, target = torch.cat(self.preds), torch.cat(self.target)
        all_preds = funcoll.gather(preds, group=process_group)
        all_target = funcoll.gather(target, group=process_group)
        counts = funcoll.gather(torch.tensor(preds.shape[0]), group=process_group)  # per-rank scalars
        return (all_preds == all_target).double().mean(), all_preds, counts


def _batches(rank: int) -> list[tuple[Tensor, Tensor]]:
    sizes = [[3, 0], [0, 0], [2, 5], [1, 1]][rank]  # rank 1 saw no data
    g = torch.Generator().manual_seed(rank)
    return [(torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def run_metrics(rank: int, world: int, sub: Any, mode: str, cid: str) -> dict[str, Tensor]:
    metric = Accuracy()
    for preds, target in _batches(rank):  # updates run eagerly, batch by batch
        metric.update(preds, target)
    acc, preds, counts = _compile(metric.compute, mode)(sub)  # the evaluation gather, compiled
    return {"acc": acc, "preds": preds, "counts": counts}


def ref_metrics(world: int, cid: str) -> list[dict[str, Tensor]]:
    batches = [_batches(r) for r in range(world)]
    preds = torch.cat([p for b in batches for p, _ in b])
    target = torch.cat([t for b in batches for _, t in b])
    counts = torch.tensor([sum(p.shape[0] for p, _ in b) for b in batches])
    acc = (preds == target).double().mean()
    return [{"acc": acc, "preds": preds, "counts": counts} for _ in range(world)]


# ----------------------------------------------------------------------- the table
Runner = Callable[[int, int, Any, str, str], dict[str, Tensor]]
PROGRAMS: dict[str, tuple[Runner, Callable[[int, str], list[dict[str, Tensor]]], tuple[str, ...]]] = {
    "ulysses": (run_ulysses, ref_ulysses, tuple(ULYSSES)),
    "megatron_sp": (run_megatron_sp, ref_megatron_sp, ("uneven-seq",)),
    "megatron_moe": (run_megatron_moe, ref_megatron_moe, tuple(TOKENS)),
    "metrics": (run_metrics, ref_metrics, ("variable-length",)),
}


def run_body(rank: int, world: int) -> dict[str, Any]:
    parallel_state.initialize(world)
    sub = dist.new_group(list(range(world)))  # the sequence-parallel group: all ranks
    out: dict[str, Any] = {}
    for name, (run, _, cids) in PROGRAMS.items():
        for cid in cids:
            for mode in _modes(world):
                torch._dynamo.reset()
                out[(name, cid, mode)] = run(rank, world, sub, mode, cid)
    return out


batch = once_per_world(run_body, TIMEOUT_S, worlds=WORLDS)


@functools.cache
def _reference(name: str, world: int, cid: str) -> list[dict[str, Tensor]]:
    return PROGRAMS[name][1](world, cid)


def _program_params() -> list:
    return [
        pytest.param(name, cid, mode, world, id=f"{name}-{cid}-{mode}-w{world}")
        for name, (_, _, cids) in PROGRAMS.items()
        for cid in cids
        for world in WORLDS
        for mode in _modes(world)
    ]


@pytest.mark.parametrize(("name", "cid", "mode", "world"), _program_params())
def test_program_matches_single_process_reference(name: str, cid: str, mode: str, world: int) -> None:
    results = batch(world)
    for rank in range(world):
        got, want = results[rank][(name, cid, mode)], _reference(name, world, cid)[rank]
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(
                got[key], want[key], rtol=1e-10, atol=1e-12, msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}"
            )


def _collective_sequence(rank: int, world: int) -> dict[str, list[str]]:
    """The collectives of this rank's compiled Ulysses step with one head, in graph order.

    Every rank but rank 0 holds no head, so its q, k and v gradients are empty
    tensors of static shape: equal constants that a compiler pass could merge,
    leaving that rank with fewer backward collectives than rank 0 (a hang). The
    graphs are recorded after the partitioner, the way aot_eager and inductor split
    them; the step runs forward and backward.
    """
    from funcoll.testing import recording_backend

    backend, seqs = recording_backend()
    heads, seq = ULYSSES["one-head"]
    mine = [t.tensor_split(world, 1)[rank].clone().requires_grad_() for t in _qkv("one-head", heads, seq)]
    out = torch.compile(DistributedAttention(None, heads, seq), fullgraph=True, backend=backend)(*mine)
    out.sum().backward()
    return seqs


@pytest.mark.parametrize("world", [2, 4])
def test_compiled_ulysses_with_empty_head_shards_issues_the_same_collectives_on_every_rank(
    world: int,
) -> None:
    from funcoll.testing import run_ranks

    per_rank = run_ranks(_collective_sequence, world, timeout=120)
    bw = per_rank[0]["bw"]
    # 4 all_to_alls, their 4 waits; under this directory's set_checks(True), each after a
    # header of its own (an all_gather waited by funcoll::wait)
    assert bw.count("_c10d_functional.all_to_all_single.default") == 4, bw
    assert bw.count("_c10d_functional.wait_tensor.default") == 4, bw
    assert (
        bw.count("_c10d_functional.all_gather_into_tensor.default") == bw.count("funcoll.wait.default") == 4
    ), bw
    for rank, seqs in enumerate(per_rank[1:], 1):
        assert seqs == per_rank[0], f"rank {rank} (no head) issues {seqs}, rank 0 {per_rank[0]}"
