"""funcoll.Wire: the ops in quantized wire formats, on real gloo ranks.

Every rank r holds seeded float32 data. The reference is computed in the parent in
float64 from all ranks' inputs: the concatenation (all_gather) or the sum of the
pieces (reduce_scatter), and each value's error bound: the format's rounding
(``funcoll._base._quant.ROUNDING``) of the value and of its block's scale, the
block's absolute maximum over the format's largest code, computed from the same
inputs; a reduce-scatter's bound is the sum of its pieces' bounds. Gradients: each
rank backpropagates ``(y * w_r).sum()`` with a seeded `w_r`; the reference gradient
is the same sum taken in float64, exact (``grad_wire=None``) or within the bound of
the gradient pieces' format. Every case of one world runs in one ``run_ranks`` call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _inputs import once_per_world
from torch import Tensor

import funcoll
import funcoll.testing
from funcoll import Wire
from funcoll._base._quant import ROUNDING, SCALED, decode, encode

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 240.0
I8, E4, E5, BF, F16 = torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16
FORMATS = {
    "int8-b128": Wire(I8, block=128),
    "int8-b5": Wire(I8, block=5),
    "e4m3-b32": Wire(E4, block=32),
    "e5m2-row": Wire(E5),
    "bf16": Wire(BF),
    "fp16": Wire(F16),
}


@dataclass(frozen=True)
class Case:
    id: str
    op: str  # "all_gather" | "reduce_scatter"
    shape: tuple[int, ...]  # this rank's x (reduce_scatter: dim's length is multiplied by world)
    dim: int
    wire: str | None
    grad_wire: str | None = None
    data: str = "randn"  # "randn" | "zero-block" (rank 0's first block all zero) | "inf" (one inf on rank 0)
    tiled: bool = True

    def x(self, rank: int, world: int) -> Tensor:
        shape = list(self.shape)
        if self.op == "reduce_scatter":
            shape[self.dim] *= world
        g = torch.Generator().manual_seed(1000 * rank + len(self.id))
        x = torch.randn(shape, generator=g) * (1 + rank)
        if self.data == "zero-block" and rank == 0 and x.numel():
            x.reshape(-1, x.shape[-1])[0, :5] = 0
        if self.data == "inf" and rank == 0 and x.numel():
            x.reshape(-1)[0] = float("inf")
        return x

    def w(self, rank: int, out_shape: tuple[int, ...]) -> Tensor:
        g = torch.Generator().manual_seed(77 + rank)
        return torch.randn(out_shape, generator=g)


CASES = [
    *(Case(f"ag-{f}", "all_gather", (3, 300), 0, f, f) for f in FORMATS),
    Case("ag-dim-last-int8", "all_gather", (2, 70), -1, "int8-b128", None),
    Case("ag-stack-e4m3", "all_gather", (2, 40), 1, "e4m3-b32", "bf16", tiled=False),
    Case("ag-0d-int8", "all_gather", (), 0, "int8-b128", None),
    Case("ag-empty-int8", "all_gather", (0, 64), 0, "int8-b128", "int8-b128"),
    Case("ag-zero-block-int8", "all_gather", (2, 20), 0, "int8-b5", None, data="zero-block"),
    Case("ag-inf-int8", "all_gather", (2, 20), 0, "int8-b5", None, data="inf"),
    Case("ag-inf-bf16", "all_gather", (2, 20), 0, "bf16", None, data="inf"),
    Case("ag-grad-only-int8", "all_gather", (3, 50), 0, None, "int8-b5"),
    *(Case(f"rs-{f}", "reduce_scatter", (2, 260), 0, f, f) for f in ("int8-b128", "e4m3-b32", "bf16")),
    Case("rs-dim1-e5m2", "reduce_scatter", (3, 4, 33), 1, "e5m2-row", None),
    Case("rs-avg-int8", "reduce_scatter", (2, 16), 0, "int8-b5", "int8-b5"),
    Case("rs-grad-only-bf16", "reduce_scatter", (2, 16), 0, None, "bf16"),
]
BY_ID = {c.id: c for c in CASES}


def _fmt(name: str | None) -> Wire | None:
    return None if name is None else FORMATS[name]


def _call(case: Case, x: Tensor, group: Any = None) -> Tensor:
    kw: dict[str, Any] = {"wire": _fmt(case.wire), "grad_wire": _fmt(case.grad_wire), "group": group}
    if case.op == "all_gather":
        return funcoll.all_gather(x, case.dim, tiled=case.tiled, **kw)
    return funcoll.reduce_scatter(x, case.dim, op="avg" if "avg" in case.id else "sum", **kw)


def _run_case(case: Case, rank: int, world: int) -> dict[str, Tensor]:
    x = case.x(rank, world).requires_grad_(case.data == "randn")
    y = _call(case, x)
    out = {"y": y.detach().clone()}
    if x.requires_grad:
        (y * case.w(rank, tuple(y.shape))).sum().backward()
        assert x.grad is not None
        out["dx"] = x.grad.clone()
    return out


def _compiled(rank: int, world: int) -> dict[str, Tensor]:
    """One fullgraph graph: an int8 all_gather with a bf16 backward, then an fp8 reduce-scatter with int8's."""

    def step(x: Tensor) -> Tensor:
        y = funcoll.all_gather(x, wire=Wire(I8, block=128), grad_wire=Wire(BF))
        return funcoll.reduce_scatter(y * 2, wire=Wire(E4, block=32), grad_wire=Wire(I8, block=128))

    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    y = torch.compile(step, fullgraph=True)(x)
    y.sum().backward()
    assert x.grad is not None
    return {"y": y.detach(), "dx": x.grad}


# ----------------------------------------------------- rows: all_to_all_v and moe
A2A_WIRE, A2A_GRAD = Wire(E4, block=64), Wire(I8, block=100)
MOE_WIRE, MOE_GRAD, COMBINE_WIRE = Wire(E4, block=128), Wire(BF), Wire(BF)
E_LOCAL, K, H = 2, 2, 160


def _send_sizes(rank: int, world: int) -> list[int]:
    return [(rank + 2 * j) % 3 for j in range(world)]  # zeros included: empty blocks


def _a2a_x(rank: int, world: int) -> Tensor:
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randn(sum(_send_sizes(rank, world)), 200, generator=g) * (1 + rank)


def _moe_inputs(rank: int, world: int) -> tuple[Tensor, Tensor, Tensor]:
    """x (T, H), distinct top-k expert ids (T, K), weights (T, K); rank 1 holds no token."""
    g = torch.Generator().manual_seed(900 + rank)
    tokens = 0 if rank == 1 else 3 + rank
    x = torch.randn(tokens, H, generator=g)
    picks = [torch.randperm(world * E_LOCAL, generator=g)[:K] for _ in range(tokens)]
    idx = torch.stack(picks) if picks else torch.zeros(0, K, dtype=torch.int64)
    return x, idx, torch.rand(tokens, K, generator=g)


def _rows_cases(rank: int, world: int) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    x = _a2a_x(rank, world).requires_grad_()
    y, _ = funcoll.all_to_all_v(x, _send_sizes(rank, world), wire=A2A_WIRE, grad_wire=A2A_GRAD)
    (y * _row_weights(rank, y.shape[0], y.shape[1])).sum().backward()
    assert x.grad is not None
    out["a2a_y"], out["a2a_dx"] = y.detach(), x.grad
    x, idx, w = _moe_inputs(rank, world)
    x.requires_grad_()
    for mode in ("exact", "static"):
        recv, handle = funcoll.moe.dispatch(
            x,
            idx,
            world * E_LOCAL,
            mode=mode,
            capacity=None if mode == "exact" else 8,
            wire=MOE_WIRE,
            grad_wire=MOE_GRAD,
        )
        if mode == "exact":  # the static recv's gradient reaches the same tokens
            (recv * _row_weights(rank, recv.shape[0], H)).sum().backward()
            assert x.grad is not None
            out["dispatch_dx"] = x.grad.clone()
        out[f"{mode}_recv"] = recv.detach()
        out[f"{mode}_offsets"], out[f"{mode}_ends"] = handle.offsets, handle.ends
    # combine in bf16 of rows that an exact dispatch brought (the experts: times 2)
    exact, handle = funcoll.moe.dispatch(x.detach(), idx, world * E_LOCAL)
    out["combined"] = funcoll.moe.combine(exact * 2, handle, w, wire=COMBINE_WIRE)
    return out


# Ulysses: (B, S_r, H, D) -> (B, S, H_r, D) and back, S and H that no world divides
UL_B, UL_S, UL_H, UL_D = 2, 7, 5, 48
UL_IN = (Wire(I8, block=16), Wire(BF))  # seq -> heads: int8 pieces, bf16 gradient
UL_BACK = (Wire(BF), Wire(E4, block=32))  # heads -> seq
EVEN_WIRE = (Wire(E5, block=8), None)  # an even all_to_all of (2, 3 * world, 20), dims 1 -> 0


def _ulysses_q(rank: int, world: int) -> Tensor:
    s = funcoll.split_sizes(UL_S, world)[rank]
    return torch.randn(UL_B, s, UL_H, UL_D, generator=torch.Generator().manual_seed(800 + rank)) * (1 + rank)


def _ulysses_o(rank: int, world: int) -> Tensor:
    h = funcoll.split_sizes(UL_H, world)[rank]
    return torch.randn(UL_B, UL_S, h, UL_D, generator=torch.Generator().manual_seed(850 + rank))


def _even_a2a_x(rank: int, world: int) -> Tensor:
    return torch.randn(2, 3 * world, 20, generator=torch.Generator().manual_seed(870 + rank))


def _all_to_alls(rank: int, world: int) -> dict[str, Tensor]:
    """Each call's result and x.grad, the gradient of ``(y * weights).sum()``."""
    s_sizes, h_sizes = funcoll.split_sizes(UL_S, world), funcoll.split_sizes(UL_H, world)
    calls = {
        "in": (_ulysses_q, lambda t: funcoll.all_to_all(t, None, 2, 1, gather_sizes=s_sizes, wire=UL_IN[0], grad_wire=UL_IN[1])),
        "back": (
            _ulysses_o,
            lambda t: funcoll.all_to_all(
                t, None, 1, 2, scatter_sizes=s_sizes, gather_sizes=h_sizes, wire=UL_BACK[0], grad_wire=UL_BACK[1]
            ),
        ),
        "even": (_even_a2a_x, lambda t: funcoll.all_to_all(t, None, 1, 0, wire=EVEN_WIRE[0])),
    }  # fmt: skip
    out: dict[str, Tensor] = {}
    for name, (make, call) in calls.items():
        x = make(rank, world).requires_grad_()
        y = call(x)
        (y * _a2a_weights(name, rank, tuple(y.shape))).sum().backward()
        assert x.grad is not None
        out[name], out[f"{name}-dx"] = y.detach(), x.grad
    return out


def _a2a_weights(name: str, rank: int, shape: tuple[int, ...]) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, name)) + rank))


GATHER_WIRE, GATHER_GRAD = Wire(I8, block=32), Wire(E5, block=32)
STRATEGIES = ("a2a", "pad", "shift")


def _ragged_x(rank: int, world: int) -> Tensor:
    """Rank r holds (r * 2) % 5 rows of (3, 70): rank 0 none; rows along dim 1."""
    g = torch.Generator().manual_seed(700 + rank)
    return torch.randn(3, (rank * 2) % 5, 70, generator=g)


def _gathers(rank: int, world: int) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for strategy in STRATEGIES:
        x = _ragged_x(rank, world).requires_grad_()
        y = funcoll.gather(x, 1, strategy=strategy, wire=GATHER_WIRE, grad_wire=GATHER_GRAD)
        assert y is not None
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(60 + rank))).sum().backward()
        assert x.grad is not None
        out[f"gather-{strategy}"], out[f"gather-{strategy}-dx"] = y.detach(), x.grad
    y, sizes = funcoll.all_gather_ragged(_ragged_x(rank, world), 1, wire=GATHER_WIRE)
    out["ragged"], out["ragged_sizes"] = y, sizes
    to_last = funcoll.gather(_ragged_x(rank, world), 1, world - 1, wire=GATHER_WIRE)
    out["dst"] = torch.zeros(0) if to_last is None else to_last
    return out


# --------------------------------------------------------------------- training
TD, T_STEPS, T_LR = 96, 10, 0.5  # TD rows shard evenly over 1 to 4 ranks
QUANTIZED = {  # (wire, grad_wire) per step of the model
    "weights": (Wire(I8, block=32), Wire(BF)),  # ZeRO++'s int8 weight gather, its gradient reduced in bf16
    "dispatch": (Wire(E4, block=32), Wire(BF)),  # DeepEP's FP8 dispatch, BF16 back
    "combine": (Wire(BF), None),
}


def _train(rank: int, world: int, quantized: bool) -> list[float]:
    """T_STEPS SGD steps of a model whose weight is sharded (gathered each step) and whose MoE layer spans the ranks.

    The loss summed over ranks after each step. Exact: every format None.
    """
    g = torch.Generator().manual_seed(0)
    full = torch.randn(TD, TD, generator=g) / TD**0.5
    router = torch.nn.Parameter(torch.randn(TD, world * E_LOCAL, generator=g))
    every_expert = torch.randn(world * E_LOCAL, TD, TD, generator=g) / TD**0.5
    shard = torch.nn.Parameter(full.chunk(world)[rank].clone())  # FSDP style: this rank's rows
    w = torch.nn.Parameter(every_expert[rank * E_LOCAL : (rank + 1) * E_LOCAL].clone())
    f = {k: v if quantized else (None, None) for k, v in QUANTIZED.items()}
    losses = []
    for step in range(T_STEPS):
        x = torch.randn(6 + (step + rank) % 4, TD, generator=torch.Generator().manual_seed(100 * step + rank))
        h = x @ funcoll.all_gather(shard, wire=f["weights"][0], grad_wire=f["weights"][1])
        weights, idx = torch.softmax(h @ router, -1).topk(K, -1)
        recv, handle = funcoll.moe.dispatch(
            h, idx, world * E_LOCAL, wire=f["dispatch"][0], grad_wire=f["dispatch"][1]
        )
        local = (torch.searchsorted(handle.offsets, torch.arange(recv.shape[0]), right=True) - 1).clamp(min=0)
        y = torch.tanh(torch.einsum("nd,nde->ne", recv, w[local]))
        out = h + funcoll.moe.combine(y, handle, weights, wire=f["combine"][0], grad_wire=f["combine"][1])
        loss = (out - x).square().mean()
        loss.backward()
        assert router.grad is not None
        router.grad = funcoll.all_reduce(router.grad)  # replicated: every rank's tokens use it
        with torch.no_grad():
            for p in (shard, router, w):  # shard.grad: the gathered gradient, reduce-scattered
                assert p.grad is not None
                p -= T_LR * p.grad
                p.grad = None
        losses.append(funcoll.all_reduce(loss.detach()).item())  # a CPU tensor: no device sync
    return losses


def _row_weights(rank: int, rows: int, width: int) -> Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(40 + rank))


def _generated_code(rank: int, world: int) -> list[str]:
    """Inductor's code for a producer, a quantized collective and a consumer, forward only."""
    from torch._inductor.utils import run_and_get_code

    def gather(x: Tensor) -> Tensor:
        return funcoll.all_gather(x * 2 + 1, wire=Wire(I8, block=128)).relu()

    def scatter(x: Tensor) -> Tensor:
        return funcoll.reduce_scatter(x * 2 + 1, wire=Wire(E4, block=128)).relu()

    x = torch.randn(8 * world, 512)
    return [
        code for f in (gather, scatter) for code in run_and_get_code(torch.compile(f, fullgraph=True), x)[1]
    ]


def _errors(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """What each bad call raised (before any communication)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    x = torch.randn(world * 2, 4)
    mesh = init_device_mesh("cpu", (world,))
    calls = {
        "dtensor-gather": lambda: funcoll.all_gather(
            distribute_tensor(x, mesh, [Shard(0)]), group=mesh, wire=Wire(I8)
        ),
        "dtensor-scatter": lambda: funcoll.reduce_scatter(
            distribute_tensor(x, mesh, [Partial()]), group=mesh, grad_wire=Wire(BF)
        ),
        "wire-str": lambda: funcoll.all_gather(x, wire="int8"),  # type: ignore[arg-type]
        "int-data": lambda: funcoll.all_gather(x.long(), wire=Wire(I8)),
        "int-grad": lambda: funcoll.reduce_scatter(x.long(), grad_wire=Wire(BF)),
        "sizes": lambda: funcoll.reduce_scatter(x, sizes=[2] * world, wire=Wire(I8)),
        "a2a-blocks-dim": lambda: funcoll.all_to_all(
            torch.randn(2, 3, 1 + rank % 2),
            None,
            1,
            2,
            gather_sizes=[1 + r % 2 for r in range(world)],
            wire=Wire(I8),
        ),
        "dtensor-a2a": lambda: funcoll.all_to_all(
            distribute_tensor(torch.randn(world, world), mesh, [Shard(0)]), mesh, 1, 0, grad_wire=Wire(BF)
        ),
        "bad-dtype": lambda: Wire(torch.int32),
        "block-on-cast": lambda: Wire(BF, block=4),
        "block-zero": lambda: Wire(I8, block=0),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 -- the test reads what was raised
            out[name] = (type(e).__name__, str(e))
    return out


def run_body(rank: int, world: int) -> dict[str, Any]:
    return {
        "cases": {c.id: _run_case(c, rank, world) for c in CASES},
        "compiled": _compiled(rank, world),
        "errors": _errors(rank, world),
        "rows": _rows_cases(rank, world),
        "gathers": _gathers(rank, world),
        "all_to_alls": _all_to_alls(rank, world),
        "training": (_train(rank, world, False), _train(rank, world, True)),
        "code": _generated_code(rank, world) if world == 2 else [],
        "in_flight": funcoll.testing.in_flight(),
    }


batch = once_per_world(run_body, TIMEOUT_S, worlds=WORLDS)


# ------------------------------------------------------------------ the references
def bound(v: Tensor, wire: Wire | None) -> Tensor:
    """Each value's rounding bound in `wire` (float64; zero when exact), from its block's scale."""
    v = v.double()
    if wire is None:
        return torch.zeros_like(v)
    rel, ab = ROUNDING[wire.dtype]
    if not wire.scaled:
        return rel * v.abs() + ab
    t = v.reshape(1) if v.dim() == 0 else v
    last = t.shape[-1]
    width = wire.block or max(last, 1)
    block_of = torch.arange(last) // width
    nb = -(-last // width) if last else 0
    amax = torch.zeros(*t.shape[:-1], nb, dtype=torch.float64)
    amax = amax.scatter_reduce(-1, block_of.expand(t.shape), t.abs(), "amax")
    scale = (amax / SCALED[wire.dtype])[..., block_of]
    # float32 slack: the scale and the division run in float32
    return (rel * t.abs() + ab * scale + 2.0**-20 * (t.abs() + scale)).reshape(v.shape)


def _pieces(t: Tensor, dim: int, world: int) -> list[Tensor]:
    return list(t.chunk(world, dim)) if t.dim() else [t]


def reference(case: Case, world: int) -> list[dict[str, Tensor]]:
    xs = [case.x(r, world).double() for r in range(world)]
    wire, grad_wire = _fmt(case.wire), _fmt(case.grad_wire)
    single = world == 1  # a group of one moves nothing: exact
    out = []
    if case.op == "all_gather":
        d = case.dim % max(len(case.shape), 1)
        if not case.shape:
            y, err = torch.stack(xs), torch.stack([bound(x, wire) for x in xs])
        elif case.tiled:
            y, err = torch.cat(xs, d), torch.cat([bound(x, wire) for x in xs], d)
        else:
            y, err = torch.stack(xs, d), torch.stack([bound(x, wire) for x in xs], d)
        ws = [case.w(r, tuple(y.shape)).double() for r in range(world)]
        for r in range(world):
            ref: dict[str, Tensor] = {"y": y, "err": err * (not single)}
            if case.data == "randn":
                # x's gradient: the sum over ranks k of w_k's slice that came from rank r
                parts = [w.unbind(d)[r] if not case.tiled else _pieces(w, d, world)[r] for w in ws]
                if not case.shape:
                    parts = [w[r] for w in ws]
                ref["dx"] = sum(parts)  # type: ignore[assignment]
                ref["dx_err"] = sum(bound(p, grad_wire) for p in parts) * (not single)  # type: ignore[assignment]
            out.append(ref)
        return out
    d = case.dim
    pieces = [_pieces(x, d, world) for x in xs]
    avg = "avg" in case.id
    for r in range(world):
        y = sum(p[r] for p in pieces) / (world if avg else 1)
        err = sum(bound(p[r], wire) for p in pieces) / (world if avg else 1)
        ref = {"y": y, "err": err * (not single)}  # type: ignore[dict-item]
        ws = [case.w(k, tuple(y.shape)).double() for k in range(world)]
        ref["dx"] = torch.cat(ws, d) / (world if avg else 1)
        ref["dx_err"] = torch.cat([bound(w, grad_wire) for w in ws], d) / (world if avg else 1) * (not single)
        out.append(ref)
    return out


def _within(got: Tensor, want: Tensor, err: Tensor, where: str) -> None:
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    finite = torch.isfinite(want)
    diff = (got.double() - want).abs()
    slack = 1e-5 * (1 + want.abs())  # float32 data and sums against float64
    bad = finite & (diff > err + slack)
    assert not bad.any(), (
        f"{where}: {int(bad.sum())} values off by more than the bound; worst "
        f"{float((diff - err - slack)[bad].max()):.3g} over, at {bad.nonzero()[0].tolist()}"
    )


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cid", list(BY_ID))
def test_within_the_format_bound_of_the_float64_reference(world: int, cid: str) -> None:
    case = BY_ID[cid]
    results = batch(world)
    for r, ref in enumerate(reference(case, world)):
        got = results[r]["cases"][cid]
        where = f"{cid} w{world} rank {r}"
        if case.data == "inf":
            _non_finite(got["y"], ref["y"], case, world, where)
            continue
        _within(got["y"], ref["y"], ref["err"], where)
        if "dx" in ref:
            _within(got["dx"], ref["dx"], ref["dx_err"], f"{where} x.grad")
        if (
            world > 1
            and case.wire is not None
            and case.data == "randn"
            and case.shape
            and 0 not in case.shape
        ):
            assert not torch.equal(got["y"].double(), ref["y"]), (
                f"{where}: no rounding at all: did it quantize?"
            )


def _non_finite(got: Tensor, want: Tensor, case: Case, world: int, where: str) -> None:
    """An inf in a scaled format's block: that block arrives all NaN, the rest within bound; a cast keeps the inf."""
    wire = _fmt(case.wire)
    assert wire is not None
    if world == 1 or not wire.scaled:
        assert torch.isinf(got[0, 0]) and torch.equal(torch.isfinite(got), torch.isfinite(want)), where
        return
    block = wire.block or want.shape[-1]
    assert torch.isnan(got[0, :block]).all(), f"{where}: the inf's block is not all NaN: {got[0, :block]}"
    rest = torch.ones_like(got, dtype=torch.bool)
    rest[0, :block] = False
    assert torch.isfinite(got[rest]).all(), f"{where}: a NaN outside the inf's block"


@pytest.mark.parametrize("world", WORLDS)
def test_compiled_fullgraph_matches_the_reference(world: int) -> None:
    xs = [torch.randn(3, 300, generator=torch.Generator().manual_seed(r)).double() for r in range(world)]
    gathered = torch.cat(xs)
    g_err = torch.cat([bound(x, Wire(I8, block=128)) for x in xs]) * (world > 1)
    for r in range(world):
        got = batch(world)[r]["compiled"]
        n = 3
        # rank r: the sum over ranks of (2 * gathered)'s slice r (every rank holds the same gathered tensor)
        want = 2 * world * gathered[r * n : (r + 1) * n]
        slices = [2 * gathered[r * n : (r + 1) * n] for _ in range(world)]
        err = (
            sum(bound(s, Wire(E4, block=32)) for s in slices) * (world > 1)
            + 2 * world * g_err[r * n : (r + 1) * n]
        )
        _within(got["y"], want, err, f"compiled w{world} rank {r}")
        # x.grad: 2 * the sum over ranks of the ones the reduce-scatter's backward gathers (in int8,
        # then bf16: ones and 2 * world are exact in bf16, and 1 to int8's 127 / 127 in float32)
        torch.testing.assert_close(got["dx"], torch.full((3, 300), 2.0 * world), rtol=1e-6, atol=0)


@pytest.mark.parametrize("world", WORLDS)
def test_bad_formats_raise_before_communicating(world: int) -> None:
    want = {
        "wire-str": (
            "TypeError",
            "funcoll.all_gather: `wire` must be a funcoll.Wire or None, got str 'int8'",
        ),
        "int-data": ("TypeError", "funcoll.all_gather: `wire`=Wire(torch.int8) quantizes floating data"),
        "int-grad": ("TypeError", "funcoll.reduce_scatter: `grad_wire`=Wire(torch.bfloat16) quantizes"),
        "sizes": (
            "ValueError",
            "funcoll.reduce_scatter: `wire`=Wire(torch.int8), `grad_wire`=None are for equal",
        ),
        "a2a-blocks-dim": (
            "ValueError" if world > 1 else "no error",  # one rank: the sizes are all equal
            "funcoll.all_to_all: `gather_sizes`=[1, 2" if world > 1 else "",
        ),
        "dtensor-a2a": ("ValueError", "funcoll.all_to_all: `wire`=None, `grad_wire`=Wire(torch.bfloat16): a"),
        "bad-dtype": ("ValueError", "funcoll.Wire: `dtype`=torch.int32 is not a wire format"),
        "block-on-cast": ("ValueError", "funcoll.Wire: `block`=4 is for the 8-bit formats"),
        "block-zero": ("ValueError", "funcoll.Wire: `block`=0 must be an int in [1, 2**26] or None"),
        "dtensor-gather": (
            "ValueError",
            "funcoll.all_gather: `wire`=Wire(torch.int8), `grad_wire`=None: a DTensor",
        ),
        "dtensor-scatter": (
            "ValueError",
            "funcoll.reduce_scatter: `wire`=None, `grad_wire`=Wire(torch.bfloat16): a",
        ),
    }
    for r in range(world):
        got = batch(world)[r]
        for name, (kind, start) in want.items():
            assert got["errors"][name][0] == kind and got["errors"][name][1].startswith(start), (
                name,
                got["errors"][name],
            )
        assert got["in_flight"] == 0


def test_the_bytes_on_the_wire() -> None:
    """What travels: 8-bit codes and float32 block scales (a quarter of float32's bytes and a little), or 2 bytes a value."""
    x = torch.randn(16, 1024)
    assert encode(x, Wire(I8, block=128)).numel() == 16 * 1024 + 16 * 8 * 4
    assert encode(x, Wire(E4, block=128)).numel() == Wire(E4, block=128).nbytes(x.shape) == 16 * (1024 + 32)
    assert encode(x, Wire(BF)).numel() == 2 * x.numel()
    assert Wire(E5).nbytes((3, 5)) == 3 * 4 + 15 + 1  # one scale a row, padded to 4 bytes


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(7, 300), (5,), (), (4, 0), (2, 3, 129)])
def test_encode_decode_within_bound_eager_and_compiled(fmt: str, shape: tuple[int, ...]) -> None:
    """One process: the round trip within the bound, and inductor's bytes equal eager's."""
    wire = FORMATS[fmt]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 3
    y = decode(encode(x, wire), wire, x.shape, x.dtype)
    _within(y, x.double(), bound(x, wire), f"{fmt} {shape}")
    if len(shape) < 2 or 0 in shape:
        return
    torch.compiler.reset()  # one graph per case: not the recompile limit of one lambda
    compiled = torch.compile(lambda t: encode(t, wire), fullgraph=True)(x)
    assert torch.equal(compiled, encode(x, wire)), f"{fmt} {shape}: inductor's bytes differ from eager's"


def test_inductor_fuses_the_quantization_into_the_producer_and_the_consumer() -> None:
    """No kernel only reads and writes the full-precision payload.

    The producer (``x * 2 + 1``) fuses with the encoding, which reads float32 and writes
    8-bit codes and float32 scales; the decoding, which reads bytes, fuses with the
    consumer (``relu``). A kernel of float pointers alone would be a pass over the
    float32 payload that the quantization added (inductor's C++ kernels on the CPU).
    """
    code = "\n".join(batch(2)[0]["code"])
    kernels = re.findall(r"(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\])", code)
    assert len(kernels) >= 4, f"expected an encode and a decode kernel per op, got {[k for k, _ in kernels]}"
    for name, args in kernels:
        pointers = re.findall(r"'([^']*)\*'", args)
        assert not all(p.endswith("float") for p in pointers), (
            f"{name}{args}: a float-only pass over the payload"
        )
    encodes = [
        n for n, a in kernels if "const float*" in a and re.search(r"'(int8_t|at::Float8_e4m3fn)\*'", a)
    ]
    assert len(encodes) >= 2, f"no kernel reads the float input and writes 8-bit codes: {kernels}"


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_v_rows_within_the_bound(world: int) -> None:
    """Each row encoded on its own: rank j gets rank i's block j; the gradient comes back in int8."""
    xs = [_a2a_x(r, world).double() for r in range(world)]
    send = [_send_sizes(r, world) for r in range(world)]
    blocks = [list(x.split(s)) for x, s in zip(xs, send, strict=True)]  # blocks[i][j]: i's rows for j
    got = [batch(world)[r]["rows"] for r in range(world)]
    quantized = world > 1
    for j in range(world):
        want = torch.cat([blocks[i][j] for i in range(world)])
        _within(got[j]["a2a_y"], want, bound(want, A2A_WIRE) * quantized, f"all_to_all_v w{world} rank {j}")
    weights = [_row_weights(j, sum(send[i][j] for i in range(world)), 200).double() for j in range(world)]
    for i in range(world):  # rank i's rows for j came back from where they landed on j
        parts = []
        for j in range(world):
            start = sum(send[q][j] for q in range(i))
            parts.append(weights[j][start : start + send[i][j]])
        want = torch.cat(parts)
        _within(
            got[i]["a2a_dx"],
            want,
            bound(want, A2A_GRAD) * quantized,
            f"all_to_all_v w{world} rank {i} x.grad",
        )


def _moe_reference(world: int) -> tuple[list[Tensor], list[list[tuple[int, int, int]]]]:
    """Every rank's exact recv (float64) and which (source rank, token, expert) each row is.

    Rank j's rows: its local experts in order; within one, the source ranks in
    order; within a source, its tokens in order (docs/moe.md's layout, align 1).
    """
    inputs = [_moe_inputs(r, world) for r in range(world)]
    recv, pairs = [], []
    for j in range(world):
        rows, who = [], []
        for e in range(j * E_LOCAL, (j + 1) * E_LOCAL):
            for i, (x, idx, _) in enumerate(inputs):
                for t in range(x.shape[0]):
                    if e in idx[t].tolist():
                        rows.append(x[t].double())
                        who.append((i, t, e))
        recv.append(torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.float64))
        pairs.append(who)
    return recv, pairs


@pytest.mark.parametrize("world", WORLDS)
def test_moe_dispatch_in_fp8_and_combine_in_bf16_within_the_bound(world: int) -> None:
    """DeepEP's formats: FP8 dispatch (BF16 gradient back), BF16 combine, exact and static modes."""
    recv, pairs = _moe_reference(world)
    got = [batch(world)[r]["rows"] for r in range(world)]
    quantized = world > 1
    for j in range(world):
        err = bound(recv[j], MOE_WIRE) * quantized
        _within(got[j]["exact_recv"], recv[j], err, f"dispatch exact w{world} rank {j}")
        # static mode: each expert's block holds the same rows, zeros after them
        static, offsets, ends = got[j]["static_recv"], got[j]["static_offsets"], got[j]["static_ends"]
        counts = [sum(1 for *_, f in pairs[j] if f == e) for e in range(j * E_LOCAL, (j + 1) * E_LOCAL)]
        start = 0
        for e, n in enumerate(counts):
            block = static[int(offsets[e]) : int(ends[e])]
            _within(
                block,
                recv[j][start : start + n],
                err[start : start + n],
                f"dispatch static w{world} rank {j} e{e}",
            )
            start += n
    # x.grad: the weights of every row a token's copies landed in, summed, each row in bf16
    for i in range(world):
        x, _, w = _moe_inputs(i, world)
        want = torch.zeros(x.shape[0], H, dtype=torch.float64)
        err = torch.zeros_like(want)
        for j in range(world):
            v = _row_weights(j, len(pairs[j]), H).double()
            for p, (src, t, _) in enumerate(pairs[j]):
                if src == i:
                    want[t] += v[p]
                    err[t] += bound(v[p], MOE_GRAD) * quantized
        _within(got[i]["dispatch_dx"], want, err, f"dispatch w{world} rank {i} x.grad")
        # combine: sum_c w[t, c] * 2 * x[t], the rows 2 * x[t] back in bf16
        rows = 2 * x.double()
        combined = (w.double().sum(1, keepdim=True)) * rows
        c_err = w.double().sum(1, keepdim=True) * bound(rows, COMBINE_WIRE) * quantized
        _within(got[i]["combined"], combined, c_err, f"combine w{world} rank {i}")


@pytest.mark.parametrize("world", WORLDS)
def test_ragged_gathers_within_the_bound(world: int) -> None:
    """gather (each strategy, and to a dst) and all_gather_ragged: rows of (3, n_r, 70) along dim 1, rank 0 empty."""
    xs = [_ragged_x(r, world).double() for r in range(world)]
    want = torch.cat(xs, 1)
    # each row is a slice along dim 1: its blocks run along the last dim (70, blocks of 32)
    err = torch.cat([bound(x, GATHER_WIRE) for x in xs], 1) * (world > 1)
    lengths = [x.shape[1] for x in xs]
    ws = [
        torch.randn(want.shape, generator=torch.Generator().manual_seed(60 + r)).double()
        for r in range(world)
    ]
    for r in range(world):
        got = batch(world)[r]["gathers"]
        for strategy in STRATEGIES:
            _within(got[f"gather-{strategy}"], want, err, f"gather {strategy} w{world} rank {r}")
            start = sum(lengths[:r])
            parts = [w[:, start : start + lengths[r]] for w in ws]
            dx_err = sum(bound(p, GATHER_GRAD) for p in parts) * (world > 1)
            _within(
                got[f"gather-{strategy}-dx"],
                sum(parts),
                dx_err,
                f"gather {strategy} w{world} rank {r} x.grad",
            )
        _within(got["ragged"], want, err, f"all_gather_ragged w{world} rank {r}")
        assert got["ragged_sizes"].tolist() == lengths
        if r == world - 1:
            _within(got["dst"], want, err, f"gather dst w{world} rank {r}")
        else:
            assert got["dst"].numel() == 0


# Relative distance between the quantized and the exact run's loss at every step. Top-k
# routing is discontinuous: a token near a tie may pick another expert once rounded, so
# the runs drift apart slowly (at most 6.6% over 10 steps here, at 4 ranks).
TRAINING_RTOL = 0.1


@pytest.mark.parametrize("world", WORLDS)
def test_training_with_quantized_formats_tracks_the_exact_run(world: int) -> None:
    """int8 weight gathers (bf16 gradients), FP8 dispatch (bf16 back), bf16 combine: the loss tracks the exact run."""
    exact, quantized = batch(world)[0]["training"]
    for r in range(world):
        assert batch(world)[r]["training"] == (exact, quantized), f"rank {r}: another summed loss"
    for step, (e, q) in enumerate(zip(exact, quantized, strict=True)):
        assert abs(q - e) <= TRAINING_RTOL * abs(e), f"w{world} step {step}: quantized {q:.4f}, exact {e:.4f}"
    if world > 1:  # one rank moves nothing: its run is the exact one
        assert quantized != exact, "the formats changed nothing: did they quantize?"
        first, last = sum(quantized[:3]) / 3, sum(quantized[-3:]) / 3
        assert last < 0.85 * first, f"w{world}: the quantized run does not learn: {quantized}"


def _a2a_reference(scatter: int, gather: int, xs: list[Tensor], scatter_sizes: list[int]) -> list[Tensor]:
    """Rank j's all_to_all result in one process: piece j of every rank's x, concatenated in rank order."""
    return [torch.cat([x.split(scatter_sizes, scatter)[j] for x in xs], gather) for j in range(len(xs))]


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_within_the_bound(world: int) -> None:
    """Ulysses both ways with S and H that the world does not divide, and an even all_to_all; and x.grad."""
    s_sizes, h_sizes = funcoll.split_sizes(UL_S, world), funcoll.split_sizes(UL_H, world)
    quantized = world > 1
    cases = {  # name: (inputs, scatter dim, gather dim, scatter sizes, the gather dim's sizes, formats)
        "in": ([_ulysses_q(r, world) for r in range(world)], 2, 1, h_sizes, s_sizes, UL_IN),
        "back": ([_ulysses_o(r, world) for r in range(world)], 1, 2, s_sizes, h_sizes, UL_BACK),
        "even": ([_even_a2a_x(r, world) for r in range(world)], 1, 0, [3] * world, [2] * world, EVEN_WIRE),
    }
    for name, (xs, sd, gd, pieces, widths, (wire, grad_wire)) in cases.items():
        want = _a2a_reference(sd, gd, [x.double() for x in xs], pieces)
        got = [batch(world)[r]["all_to_alls"] for r in range(world)]
        ws = [_a2a_weights(name, r, tuple(want[r].shape)).double() for r in range(world)]
        # x.grad on rank i: its piece j's weights from rank j, where rank i's rows landed
        dx = [torch.cat([w.split(widths, gd)[i] for w in ws], sd) for i in range(world)]
        for r in range(world):
            where = f"all_to_all {name} w{world} rank {r}"
            _within(got[r][name], want[r], bound(want[r], wire) * quantized, where)
            _within(got[r][f"{name}-dx"], dx[r], bound(dx[r], grad_wire) * quantized, f"{where} x.grad")
            if quantized and wire is not None and want[r].numel():
                assert not torch.equal(got[r][name].double(), want[r]), f"{where}: no rounding at all"
