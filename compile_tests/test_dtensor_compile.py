"""DTensor programs that call funcoll ops, compiled with ``fullgraph=True`` on real gloo ranks.

The model is one transformer block written as DTensor code: a tensor-parallel MLP
(``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``) followed by
Ulysses sequence-parallel attention. Tokens arrive raggedly (rank r holds ``n_r``
of the sequence, 0 allowed) and enter through ``funcoll.from_ragged``; funcoll does
every collective on DTensors: ``all_gather`` of the sequence before the MLP,
``reduce_scatter`` of its ``Partial`` output, ``all_to_all`` from sequence to heads
and back (6 heads: 2, 2, 2, 0 over 4 ranks, DTensor's own chunks), and
``to_ragged`` hands every rank its own tokens back. The step runs eager and compiled
(aot_eager with the min-cut partitioner, the graphs recorded), and both must match a
single-process dense block on the concatenated tokens: loss, outputs and every
parameter gradient, in float64.

* 1-D mesh, 2 and 4 ranks, two steps with other lengths;
* 2x2 mesh ("dp", "sp"), 4 ranks: each dp group spreads its own batch row over
  "sp"; the block acts on "sp" and leaves ``Shard(0)`` on "dp" alone. The MLP lives
  on the "sp" submesh, as torchtitan places tensor parallelism, and the per-token
  layers run on the local tokens (DTensor's view rule cannot flatten two sharded dims).

The lengths come from the caller (``from_ragged(..., sizes=...)``) and the block is
compiled with ``dynamic=False``: one graph per set of lengths. funcoll's own ops
compile with lengths read from the exchange (unbacked SymInts; the program of every
op below), but DTensor's matmul, einsum and view rules in torch 2.13 fail to trace on
unbacked or dynamic lengths (docs/dtensor.md, Compiling).

Every rank's forward and backward graphs must issue the same collectives in the same
order. The DTensor forms of every op, ``from_ragged`` and ``to_ragged`` included,
compile in one program too (no collective left unwaited after it, eager or
compiled: ``funcoll.testing.in_flight()``), and so does ``local_map`` around a
function that calls funcoll ops on local shards.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _ops import COLLECTIVE_PREFIX, SMOKE, recording_backend
from torch import Tensor, nn

import funcoll
from funcoll.testing import run_ranks, settled

D, HEADS, HIDDEN = 12, 6, 8
HEAD_DIM = D // HEADS
TIMEOUT_S = 300.0
F64 = torch.float64
LENGTHS = {2: ([3, 0], [1, 4]), 4: ([3, 0, 5, 1], [2, 2, 0, 4])}  # two steps' per-rank lengths
LENGTHS_2D = [[3, 4], [6, 1]]  # per dp row: the "sp" ranks' lengths, 7 tokens each


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % (1 << 31))


def dense_layers() -> dict[str, nn.Module]:
    """The block's layers with their initial weights, the same in every process."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(D, HIDDEN, bias=False), nn.Tanh(), nn.Linear(HIDDEN, D, bias=False))
    return {"mlp": mlp.double(), "qkv": nn.Linear(D, 3 * D).double(), "out": nn.Linear(D, D).double()}


def tokens(batch: int, n: int, step: int) -> Tensor:
    return torch.randn(batch, n, D, dtype=F64, generator=_gen("tokens", batch, n, step))


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(B, S, H, Dh) -> (B, S, H, Dh), on plain tensors or DTensors sharded on H."""
    a = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k) / HEAD_DIM**0.5, -1)
    return torch.einsum("bhst,bthd->bshd", a, v)


# ---------------------------------------------------------------------- the DTensor block
class Block(nn.Module):
    """TP MLP, then Ulysses attention, on tokens that arrive raggedly; acts on mesh dim "sp"."""

    def __init__(self, mesh: Any) -> None:
        from torch.distributed.tensor import Partial, Replicate, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        super().__init__()
        self.mesh, self.two_d = mesh, mesh.ndim == 2
        self.sp = (mesh, "sp") if self.two_d else mesh
        self.sp_mesh = mesh["sp"] if self.two_d else mesh
        layers = dense_layers()
        # The MLP's second layer keeps its Partial sum: funcoll reduce-scatters it to the sequence.
        plan = {
            "0": ColwiseParallel(),
            "2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
        }
        self.mlp = parallelize_module(layers["mlp"], self.sp_mesh, plan)
        self.qkv, self.out = layers["qkv"], layers["out"]
        if not self.two_d:  # replicated DTensor parameters: DTensor sums their gradients
            for m in (self.qkv, self.out):
                for name, p in list(m.named_parameters()):
                    setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))

    def project(self, x: Any, layer: nn.Linear) -> Any:
        """A per-token linear layer. 1-D: DTensor's. 2-D: on the local tokens, so that
        DTensor never flattens the two sharded dims (its view rule guards on their sizes)."""
        if not self.two_d:
            return layer(x)
        return self.local(F.linear(x.to_local(), layer.weight, layer.bias), x, layer.weight.shape[0])

    @staticmethod
    def local(y: Tensor, like: Any, last: int | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        shape = torch.Size([*like.shape[:-1], last if last is not None else like.shape[-1]])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            y, like.device_mesh, like.placements, run_check=False, shape=shape, stride=stride
        )

    def forward(self, piece: Tensor, sizes: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """(the loss, this rank's tokens out) for this rank's `piece` of the sequence."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        places = [Shard(0), Shard(1)] if self.two_d else None
        x, sizes = funcoll.from_ragged(piece, 1, group=self.sp, placements=places, sizes=sizes)
        full = funcoll.all_gather(x, 1, group=self.sp)  # Shard(1) -> Replicate()
        if self.two_d:  # the TP MLP lives on the "sp" submesh; this dp row's tokens are local
            full = DTensor.from_local(full.to_local(), self.sp_mesh, [Replicate()], run_check=False)
        h = self.mlp(full)  # Partial() on "sp"
        if self.two_d:  # back to the 2-D mesh: dp rows sharded, the MLP's sum still pending on "sp"
            h = DTensor.from_local(
                h.to_local(),
                self.mesh,
                [Shard(0), Partial()],
                run_check=False,
                shape=x.shape,
                stride=x.stride(),
            )
        x = x + funcoll.reduce_scatter(h, 1, group=self.sp)  # Partial() -> Shard(1)
        b, s = x.shape[0], x.shape[1]
        q, k, v = self.project(x, self.qkv).view(b, s, 3, HEADS, HEAD_DIM).unbind(2)
        q, k, v = (funcoll.all_to_all(t, self.sp, 2, 1) for t in (q, k, v))  # Shard(1) -> Shard(2)
        if self.two_d:
            o = self.local(attention(q.to_local(), k.to_local(), v.to_local()), q)
        else:
            o = attention(q, k, v)
        o = funcoll.all_to_all(o, self.sp, 1, 2).reshape(b, s, D)  # Shard(2) -> Shard(1)
        y = x + self.project(o, self.out)
        loss = (y * y).sum().full_tensor()  # one global loss, reduced by DTensor
        return loss, funcoll.to_ragged(y, sizes, group=self.sp).detach()  # this rank's tokens back


def dense_block(x: Tensor, layers: dict[str, nn.Module]) -> Tensor:
    """The single-process reference: the same block on the full (B, N, D) tokens."""
    x = x + layers["mlp"](x)
    b, s = x.shape[0], x.shape[1]
    q, k, v = layers["qkv"](x).view(b, s, 3, HEADS, HEAD_DIM).unbind(2)
    return x + layers["out"](attention(q, k, v).reshape(b, s, D))


# ------------------------------------------------------------------------------- ranks
def _grads(block: Block) -> dict[str, Tensor]:
    """Every parameter's full gradient, summed as data parallelism would sum it."""
    out = {}
    for name, p in block.named_parameters():
        g = p.grad
        if type(g).__name__ != "DTensor":  # a replicated plain parameter: each rank holds its tokens' share
            out[name] = funcoll.all_reduce(g)
        elif block.two_d and g.device_mesh.ndim == 1:  # the MLP on "sp": one dp row's share
            out[name] = funcoll.all_reduce(g.full_tensor(), group=(block.mesh, "dp"))
        else:
            out[name] = g.full_tensor()
    return out


def _collectives(graphs: dict[str, Any]) -> dict[str, list[str]]:
    return {
        k: [c["op"] for c in calls if c["op"].startswith(COLLECTIVE_PREFIX)] for k, calls in graphs.items()
    }


def block_body(rank: int, world: int, two_d: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        if two_d:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
            dp, sp = divmod(rank, 2)
            lens, steps = LENGTHS_2D[dp], 1
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
            steps = 2
        out: dict[str, Any] = {"eager": [], "compiled": [], "graphs": None}
        blocks = {"eager": Block(mesh), "compiled": Block(mesh)}
        graphs: dict[str, Any] = {}
        compiles = {"n": 0}
        backend = recording_backend(graphs)

        def counting(gm: Any, example_inputs: Any) -> Any:
            compiles["n"] += 1
            return backend(gm, example_inputs)

        # dynamic=False: one graph per set of lengths (see the module docstring)
        compiled = torch.compile(blocks["compiled"], fullgraph=True, dynamic=False, backend=counting)
        for step in range(steps):
            if two_d:
                full = tokens(2, 7, step)
                mine = slice(dp, dp + 1), slice(sum(lens[:sp]), sum(lens[: sp + 1]))
                sizes: list[int] | None = lens
            else:
                lens = LENGTHS[world][step]
                full = tokens(1, sum(lens), step)
                mine = slice(None), slice(sum(lens[:rank]), sum(lens[: rank + 1]))
                sizes = lens
            for kind, fn in (("eager", blocks["eager"]), ("compiled", compiled)):
                leaf = full[mine].clone().requires_grad_()
                blocks[kind].zero_grad(set_to_none=True)
                loss, back = fn(leaf, sizes)
                loss.backward()
                out[kind].append({
                    "loss": loss.detach(),
                    "back": back.detach(), "x_grad": leaf.grad,
                    "grads": _grads(blocks[kind]),
                })  # fmt: skip
        out["graphs"] = _collectives(graphs)
        out["compiles"] = compiles["n"]
        return out
    except Exception:  # noqa: BLE001 -- reported by the test with the rank's traceback
        return {"error": traceback.format_exc(limit=-12)}


def reference(world: int, two_d: bool, step: int) -> dict[str, Any]:
    """Loss, every rank's returned tokens and input gradient, parameter gradients: in one process."""
    layers = dense_layers()
    if two_d:
        x = tokens(2, 7, step).requires_grad_()
        pieces = [(dp, LENGTHS_2D[dp], sp) for dp in range(2) for sp in range(2)]
    else:
        lens = LENGTHS[world][step]
        x = tokens(1, sum(lens), step).requires_grad_()
        pieces = [(0, lens, r) for r in range(world)]
    y = dense_block(x, layers)
    loss = (y * y).sum()
    grads = torch.autograd.grad(loss, [x, *[p for m in layers.values() for p in m.parameters()]])
    names = [f"{k}.{n}" for k, m in layers.items() for n, _ in m.named_parameters()]

    def cut(t: Tensor, dp: int, lens: list[int], r: int) -> Tensor:
        return t[dp : dp + 1, sum(lens[:r]) : sum(lens[: r + 1])]

    return {
        "loss": loss.detach(),
        "back": [cut(y.detach(), *p) for p in pieces],
        "x_grad": [cut(grads[0], *p) for p in pieces],
        "grads": dict(zip(names, grads[1:], strict=True)),
    }


# A 1-D mesh on 2 ranks and a 2x2 mesh on 4 (a 1-D mesh of 4 runs the same ops: the suite's time);
# the release matrix's smoke run (_ops.SMOKE), the 1-D mesh.
CONFIGS = [
    pytest.param(2, False, id="mesh1d-w2"),
    *([] if SMOKE else [pytest.param(4, True, id="mesh2x2-w4")]),
]


# torch 2.11 (the oldest release funcoll supports): DTensor's sharding rule for expand
# guards on the length it expands to (2.12 on: guard_or_false), so the backward of
# `(y * y).sum()` on the DTensor from_ragged returns, whose length is unbacked (read from
# the exchange), fails to trace: "Could not guard on data-dependent expression Eq(u3, 1)".
# The program's own code, not funcoll's; docs/support.md says how to avoid it.
_TORCH_2_11 = tuple(int(p) for p in torch.__version__.split(".")[:2]) == (2, 11)
KNOWN_ON_2_11 = pytest.mark.xfail(
    _TORCH_2_11, reason="torch 2.11: DTensor's expand rule guards on an unbacked length", strict=True
)


@pytest.mark.parametrize("world, two_d", CONFIGS)
def test_compiled_dtensor_block_matches_eager_and_reference(world: int, two_d: bool) -> None:
    results = run_ranks(block_body, world, two_d, timeout=TIMEOUT_S)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    steps = len(results[0]["eager"])
    for step in range(steps):
        ref = reference(world, two_d, step)
        for r, res in enumerate(results):
            for kind in ("eager", "compiled"):
                got = res[kind][step]
                where = f"rank {r}, {kind}, step {step}"
                torch.testing.assert_close(got["loss"], ref["loss"], msg=lambda m, w=where: f"{w}: loss: {m}")
                torch.testing.assert_close(got["back"], ref["back"][r], msg=lambda m, w=where: f"{w}: y: {m}")
                torch.testing.assert_close(
                    got["x_grad"], ref["x_grad"][r], msg=lambda m, w=where: f"{w}: dx: {m}"
                )
                # parameter names: Block's ("mlp.0.weight") and the dense layers' ("mlp.0.weight")
                assert sorted(got["grads"]) == sorted(ref["grads"]), where
                for name, g in got["grads"].items():
                    torch.testing.assert_close(
                        g, ref["grads"][name], msg=lambda m, w=where, n=name: f"{w}: {n}: {m}"
                    )
    # one graph per set of lengths, none more: no graph break, no guard failing within a step
    assert [res["compiles"] for res in results] == [steps] * world
    graphs = [res["graphs"] for res in results]
    assert graphs[0]["fw"] and graphs[0]["bw"], graphs[0]
    for r in range(1, world):
        assert graphs[r] == graphs[0], f"rank {r} issues other collectives than rank 0"
    fw = graphs[0]["fw"]
    for op in ("all_to_all_single", "all_gather_into_tensor", "wait_tensor"):
        assert COLLECTIVE_PREFIX + op in fw, f"no {op} in the forward: {fw}"


# ------------------------------------------------------------- every op's DTensor form
def ops_body(rank: int, world: int) -> dict[str, Any]:
    """Every DTensor-taking op in one compiled program (uneven shards), against eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    ring = [(i, (i + 1) % world) for i in range(world)]

    def program(x: Any, p: Tensor, piece: Tensor) -> tuple[Tensor, list[Tensor]]:
        partial = DTensor.from_local(p, mesh, [Partial()], run_check=False)
        outs = [
            funcoll.all_gather(x, 1),
            funcoll.gather(x, 1),
            funcoll.all_gather_ragged(x, 1)[0],
            funcoll.gather_forward_split_backward(x, None, 1),
            funcoll.all_to_all(x, None, 2, 1),
            funcoll.reduce_scatter(partial, 0),
            funcoll.all_reduce(partial),
            funcoll.broadcast(funcoll.all_gather(x, 1), world - 1),
            funcoll.split_forward_gather_backward(funcoll.all_gather(x, 1), None, 2),
            funcoll.ppermute(funcoll.all_to_all(x, None, 0, 1), ring),
        ]
        y, sizes = funcoll.from_ragged(piece, 0, group=mesh)
        back = funcoll.to_ragged(y * 2, sizes)
        loss = sum((o * o).sum().full_tensor() for o in outs) + (y * y).sum().full_tensor() + back.sum()
        return loss, [o.full_tensor().detach() for o in outs] + [back.detach()]

    try:
        x_full = torch.randn(world * 2, 7, 5, dtype=F64, generator=_gen("ops-x", world))
        p = torch.randn(7, 3, dtype=F64, generator=_gen("ops-p", rank))
        piece = torch.randn((3 * rank + 2) % 5, 2, dtype=F64, generator=_gen("ops-piece", rank))
        out = {}
        for kind, fn in (
            ("eager", program),
            ("compiled", torch.compile(program, fullgraph=True, backend="aot_eager")),
        ):
            x = distribute_tensor(x_full, mesh, [Shard(1)]).requires_grad_()
            pl, pc = p.clone().requires_grad_(), piece.clone().requires_grad_()
            loss, values = fn(x, pl, pc)
            loss.backward()
            out[kind] = settled({"loss": loss.detach(), "values": values,
                                 "grads": [x.grad.full_tensor(), pl.grad, pc.grad]})  # fmt: skip
        return out
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc(limit=-12)}


@KNOWN_ON_2_11
def test_every_dtensor_op_compiles_in_one_program() -> None:
    for r, res in enumerate(run_ranks(ops_body, 3, timeout=TIMEOUT_S)):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        for kind in ("eager", "compiled"):
            assert res[kind]["in_flight"] == 0, f"rank {r} {kind}: {res[kind]['in_flight']} left unwaited"
        torch.testing.assert_close(res["compiled"]["loss"], res["eager"]["loss"])
        for a, b in zip(res["compiled"]["values"] + res["compiled"]["grads"],
                        res["eager"]["values"] + res["eager"]["grads"], strict=True):  # fmt: skip
            torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- local_map
def local_map_body(rank: int, world: int) -> dict[str, Any]:
    """Ulysses attention as JAX's shard_map would write it: a local_map'd function that
    calls funcoll.all_to_all on the local shards, eager and compiled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import local_map

    mesh = init_device_mesh("cpu", (world,))

    def ulysses(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # local (B, S/w, H, Dh)
        q, k, v = (funcoll.all_to_all(t, mesh, 2, 1) for t in (q, k, v))  # (B, S, H/w, Dh)
        return funcoll.all_to_all(attention(q, k, v), mesh, 1, 2)  # back to (B, S/w, H, Dh)

    seq = [Shard(1)]
    sharded = local_map(ulysses, out_placements=seq, in_placements=(seq, seq, seq), device_mesh=mesh)
    try:
        qkv = torch.randn(3, 2, 4 * world, 2 * world, HEAD_DIM, dtype=F64, generator=_gen("local_map", world))
        out = {}
        for kind, fn in (
            ("eager", sharded),
            ("compiled", torch.compile(sharded, fullgraph=True, backend="aot_eager")),
        ):
            ins = [distribute_tensor(t, mesh, seq).requires_grad_() for t in qkv]
            o = fn(*ins)
            (o * o).sum().full_tensor().backward()
            out[kind] = {"o": o.full_tensor().detach(), "placements": [str(p) for p in o.placements],
                         "grads": [t.grad.full_tensor() for t in ins]}  # fmt: skip
        return out
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc(limit=-12)}


@pytest.mark.parametrize("world", [2] if SMOKE else [2, 3])  # the smoke run (_ops.SMOKE): 2 ranks
def test_local_map_calls_funcoll_on_local_shards(world: int) -> None:
    qkv = torch.randn(3, 2, 4 * world, 2 * world, HEAD_DIM, dtype=F64, generator=_gen("local_map", world))
    leaves = [t.clone().requires_grad_() for t in qkv]
    o = attention(*leaves)
    grads = torch.autograd.grad((o * o).sum(), leaves)
    for r, res in enumerate(run_ranks(local_map_body, world, timeout=TIMEOUT_S)):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        for kind in ("eager", "compiled"):
            assert res[kind]["placements"] == ["S(1)"]
            torch.testing.assert_close(res[kind]["o"], o.detach())
            for got, want in zip(res[kind]["grads"], grads, strict=True):
                torch.testing.assert_close(got, want)
