"""funcoll's torchtitan token dispatcher inside torchtitan's own MoE layer, on real gloo ranks.

Each rank builds torchtitan's ``MoE`` (its router, its ``GroupedExperts`` with bf16
grouped GEMMs, its load-balancing counter) twice from the same seeded weights:
once with torchtitan's ``AllToAllTokenDispatcher`` (``spmd_backend="partial_dtensor"``:
the one that runs on gloo) and once with
:class:`funcoll.integrations.torchtitan.FuncollTokenDispatcher`, each rank holding
its ``E / world`` experts and the dispatchers wired to a 1-D ``ep`` mesh as
torchtitan's ``RoutedExperts.parallelize`` wires them. Routings: the router's own,
every token to experts 0 and 1, every token to rank 0's experts (the other ranks
receive nothing), and a rank holding no tokens. Dropless
mode runs with a capacity that overflows on most routings (its dispatch falls back to
exact mode, and the next step fits the capacity it grew to) and one that fits.

Checked, per rank: the output and the gradients of the tokens, the router's gate
and the local experts' weights against a dense single-process layer in float64 on
every rank's tokens and the routing they chose (bf16 tolerances: torchtitan's
experts compute in bf16), and against torchtitan's dispatcher (float32 tolerances:
the same experts, the same bf16 GEMMs); the load-balancing counter after the step
against the routing's counts (a forward side effect, once). The funcoll dispatcher
also runs compiled (``fullgraph=True``, forward and backward) where a rank holds
no tokens: exact mode on inductor at every world size, and at 2 ranks every mode on
inductor, exact and static also on aot_eager and on inductor with its overlap passes (under checks, as tests/ runs:
the case where inductor reused a header's buffer while it was still being sent,
``funcoll._collective._faults.checked_wait``), against the dense layer; the collectives each
rank's graphs issue must pair up, forward and backward.
All cases of a world run in one ``run_ranks`` call; the release matrix runs 2 ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _inputs import once_per_world, seeded
from torch import Tensor

pytest.importorskip(
    "torchtitan", reason="pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3; pip install tyro"
)
if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # what torchtitan 0.3.0's dispatchers call
    pytest.skip("torchtitan 0.3.0 needs torch 2.12 or newer", allow_module_level=True)

from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import (
    GroupedExperts,
    MoE,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from funcoll import Wire
from funcoll.integrations.torchtitan import FuncollTokenDispatcher
from funcoll.testing import collective_mismatch, compiling, in_flight

# The release matrix (.ci/matrix.py, FUNCOLL_SMOKE=1) runs 2 ranks alone: the 4-rank
# batch is most of this file's time, and the pinned release runs it.
WORLDS = (2,) if os.environ.get("FUNCOLL_SMOKE") == "1" else (2, 4)
E, K, D, F = 8, 2, 16, 24
TOKENS = 7  # per rank (B = 1); "empty": rank 1 holds none
ROUTINGS = ("router", "experts01", "rank0", "empty")
# At 4 ranks the router's own choice and a rank with no token (suite time): the forced
# routings' paths (every pair to experts 0 and 1, every token from rank 0) run at 2.
ROUTINGS_AT = {2: ROUTINGS, 4: ("router", "empty")}
# (name, FuncollTokenDispatcher.Config kwargs). Static: a capacity that drops nothing.
# Dropless: one that overflows on most routings (then exact mode), and one that fits.
MODES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("exact", {"mode": "exact"}),
    ("exact-align4", {"mode": "exact", "align": 4}),
    ("static", {"mode": "static", "capacity": TOKENS * K}),
    ("dropless", {"mode": "dropless", "capacity": 2, "align": 4}),
    ("dropless-fits", {"mode": "dropless", "capacity": TOKENS * K}),
    # bf16 rows both ways: the experts' GEMMs cast the rows to bf16 anyway, so it matches
    # torchtitan's dispatcher as exact mode does
    (
        "exact-bf16-wire",
        {
            "mode": "exact",
            **{
                f"{op}{g}_wire": Wire(torch.bfloat16) for op in ("dispatch", "combine") for g in ("", "_grad")
            },
        },
    ),
)
PARAMS = ("x", "gate", "w1", "w2", "w3")
# Compiled, forward and backward: the step where rank 1 routes no token, exact mode
# with inductor at every world size, static mode at 2 ranks (funcoll.moe's static graph
# compiles on inductor at 3 in compile_tests/test_rank_shapes: suite time), and at 2
# ranks both also with aot_eager and with inductor's compute/communication overlap passes; dropless mode (which compiles
# exact mode's graph, run by its policy) with inductor at 2 ranks. That rank compiles a
# graph of its own (its token count is a static 0) while the others compile another;
# their forward and backward graphs must issue the same collectives (read from the
# generated code, or from aot_eager's partitioned graphs).
COMPILERS = {2: ("inductor", "aot_eager", "inductor-overlap"), 4: ("inductor",)}
COMPILED = tuple(
    (world, mode, "empty", compiler)
    for world in WORLDS
    for mode in ("exact", "static", "dropless")[: 3 if world == 2 else 1]
    for compiler in (COMPILERS[world] if mode != "dropless" else ("inductor",))
)


def _tokens(world: int, rank: int, routing: str) -> int:
    return 0 if routing == "empty" and rank == 1 else TOKENS


def _weights() -> dict[str, Tensor]:
    """The global weights, float64: the gate (E, D) and every expert's w1, w3 (E, F, D), w2 (E, D, F)."""
    scale = {"gate": 0.3, "w1": 0.3, "w2": 0.3, "w3": 0.3}
    shapes = {"gate": (E, D), "w1": (E, F, D), "w2": (E, D, F), "w3": (E, F, D)}
    return {n: seeded(s, torch.float64, "tt-weights", n) * scale[n] for n, s in shapes.items()}


def _forced_ids(world: int, routing: str, tokens: int) -> Tensor | None:
    """The (T, K) expert ids a routing forces, None for the router's own."""
    if routing in ("router", "empty"):
        return None
    if routing == "experts01":
        return torch.tensor([[0, 1]]).expand(tokens, K).contiguous()
    e_local = E // world  # rank 0's experts: a rotation of its e_local ids
    return torch.stack([(torch.arange(tokens) + j) % e_local for j in range(K)], 1)


def _build(world: int, rank: int, dispatcher: Any, mesh: Any) -> MoE:
    e_local = E // world
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=e_local),
            token_dispatcher=dispatcher,
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E), top_k=K
        ),
    )
    layer = cfg.build()
    w = _weights()
    mine = slice(rank * e_local, (rank + 1) * e_local)
    experts = layer.routed_experts.inner_experts
    with torch.no_grad():
        layer.router.gate.weight.copy_(w["gate"])
        experts.w1_EFD.copy_(w["w1"][mine])
        experts.w2_EDF.copy_(w["w2"][mine])
        experts.w3_EFD.copy_(w["w3"][mine])
    layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    layer.train()
    return layer


def _force(layer: MoE, ids: Tensor | None) -> None:
    """Make the router choose `ids` (scores: the router's own for those experts)."""
    if ids is None:
        return
    router, forward = layer.router, layer.router.forward

    def forced(x_BLD: Tensor, expert_bias_E: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        _, _, scores = forward(x_BLD, expert_bias_E)
        chosen = ids.view(1, -1, K).to(x_BLD.device)
        return scores.gather(-1, chosen), chosen, scores

    router.forward = forced  # type: ignore[method-assign]


def _step(layer: MoE, x: Tensor, upstream: Tensor, fn: Any = None) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    out = (layer if fn is None else fn)(x)
    (out * upstream).sum().backward()
    experts = layer.routed_experts.inner_experts
    grads = {
        "x": x.grad,
        "gate": layer.router.gate.weight.grad,
        "w1": experts.w1_EFD.grad,
        "w2": experts.w2_EDF.grad,
        "w3": experts.w3_EFD.grad,
    }
    return {"out": out.detach(), "grads": {k: v.clone() for k, v in grads.items()},
            "counter": layer.tokens_per_expert_E.clone()}  # fmt: skip


def _case(world: int, rank: int, mesh: Any, mode: str, routing: str) -> dict[str, Any]:
    kwargs = dict(MODES)[mode]
    tokens = _tokens(world, rank, routing)
    x = seeded((1, tokens, D), torch.float64, "tt-x", world, rank, routing).float()
    upstream = seeded((1, tokens, D), torch.float64, "tt-g", world, rank, routing).float()
    ids = _forced_ids(world, routing, tokens)
    got: dict[str, Any] = {}
    ours = _build(world, rank, FuncollTokenDispatcher.Config(num_experts=E, top_k=K, **kwargs), mesh)
    _force(ours, ids)
    got["funcoll"] = _step(ours, x, upstream)
    got["ids"] = _chosen_ids(ours, x)
    dispatcher = ours.routed_experts.token_dispatcher
    got["overflows"] = dispatcher.overflows
    if kwargs["mode"] == "dropless":  # a second step: the capacity grown after an overflow fits
        with torch.no_grad():
            torch.testing.assert_close(ours(x), got["funcoll"]["out"])
        got["overflows_after"] = dispatcher.overflows
    theirs = _build(world, rank, AllToAllTokenDispatcher.Config(num_experts=E, top_k=K), mesh)
    _force(theirs, ids)
    got["torchtitan"] = _step(theirs, x, upstream)
    got["compiled"] = {}
    for compiler in (c for w, m, r, c in COMPILED if (w, m, r) == (world, mode, routing)):
        compiled = _build(world, rank, FuncollTokenDispatcher.Config(num_experts=E, top_k=K, **kwargs), mesh)
        _force(compiled, ids)
        torch._dynamo.reset()
        # A compile error propagates: run_ranks then fails the world's batch at once, naming
        # the rank. Caught here, a rank whose compile failed alone would go on to the next
        # case while its peers wait in the compiled step's collectives, until the timeout.
        got["compiled"][compiler] = _compiled_step(compiled, x, upstream, compiler)
        torch._dynamo.reset()
    got["in_flight"] = in_flight()
    return got


def _compiled_step(layer: MoE, x: Tensor, upstream: Tensor, compiler: str) -> dict[str, Any]:
    """`layer` compiled (fullgraph) by `compiler`, one step; with the collectives of the graphs that ran."""
    with compiling(compiler) as (backend, graphs):
        got = _step(layer, x, upstream, torch.compile(layer, fullgraph=True, backend=backend))
    got["graphs"] = graphs
    return got


def _chosen_ids(layer: MoE, x: Tensor) -> Tensor:
    """The expert ids the layer's router chooses for `x` (no communication)."""
    with torch.no_grad():
        return layer.router(x, layer.expert_bias_E)[1].reshape(-1, K).clone()


def _body(rank: int, world: int) -> dict[tuple[str, str], Any]:
    from torch.distributed.device_mesh import init_device_mesh

    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {}
    for mode, _ in MODES:
        for routing in ROUTINGS_AT[world]:
            out[(mode, routing)] = _case(world, rank, mesh, mode, routing)
    return out


batch = once_per_world(_body, timeout=600.0, worlds=WORLDS)


# --------------------------------------------------------------------------------- reference
def _reference(world: int, routing: str, ids: list[Tensor]) -> dict[str, Any]:
    """Every rank's output and gradients from one float64 layer over every rank's tokens and routing."""
    w = {n: t.clone().requires_grad_() for n, t in _weights().items()}
    gates = [w["gate"].detach().clone().requires_grad_() for _ in range(world)]  # one per rank: its own grad
    xs, outs, loss = [], [], torch.zeros((), dtype=torch.float64)
    for r in range(world):
        tokens = _tokens(world, r, routing)
        x = seeded((1, tokens, D), torch.float64, "tt-x", world, r, routing).float().double().requires_grad_()
        g = seeded((1, tokens, D), torch.float64, "tt-g", world, r, routing).float().double()
        flat = x.reshape(tokens, D)
        scores = torch.sigmoid(flat @ gates[r].T)  # torchtitan's default score_func
        chosen = ids[r]
        out = torch.zeros(tokens, D, dtype=torch.float64)
        for j in range(K):
            e = chosen[:, j]
            h = torch.nn.functional.silu(torch.einsum("td,tfd->tf", flat, w["w1"][e]))
            h = h * torch.einsum("td,tfd->tf", flat, w["w3"][e])
            out = out + scores.gather(1, chosen[:, j : j + 1]) * torch.einsum("tf,tdf->td", h, w["w2"][e])
        xs.append(x)
        outs.append(out.view(1, tokens, D))
        loss = loss + (out.view(1, tokens, D) * g).sum()
    loss.backward()
    e_local = E // world
    return {
        "out": [o.detach() for o in outs],
        "grads": [
            {
                "x": xs[r].grad,
                "gate": gates[r].grad,
                **{n: w[n].grad[r * e_local : (r + 1) * e_local] for n in ("w1", "w2", "w3")},  # type: ignore[index]
            }
            for r in range(world)
        ],
    }


def _params() -> list[Any]:
    return [
        pytest.param(world, mode, routing, id=f"w{world}-{mode}-{routing}")
        for world in WORLDS
        for mode, kwargs in MODES
        for routing in ROUTINGS_AT[world]
    ]


# bf16 grouped GEMMs against float64: the experts' rounding, relative to the whole tensor's norm
BF16_REL = 2e-2


def _close_bf16(got: Tensor, want: Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = float((got.double() - want).norm())
    scale = max(float(want.norm()), 1e-12)
    assert err <= BF16_REL * scale, (
        f"{what}: relative error {err / scale:.3g} > {BF16_REL} (norm {scale:.3g})"
    )


# the same bf16 GEMMs on the same rows: only the combine's summation order differs
SAME = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize(("world", "mode", "routing"), _params())
def test_dispatcher_in_torchtitans_layer_matches_dense_and_torchtitan(
    world: int, mode: str, routing: str
) -> None:
    ranks = [per_rank[(mode, routing)] for per_rank in batch(world)]
    ref = _reference(world, routing, [r["ids"] for r in ranks])
    for r, got in enumerate(ranks):
        where = f"rank {r}"
        ours, theirs = got["funcoll"], got["torchtitan"]
        _close_bf16(ours["out"], ref["out"][r], f"{where} out")
        torch.testing.assert_close(
            ours["out"], theirs["out"], **SAME, msg=lambda m, w=where: f"{w} out vs torchtitan: {m}"
        )
        for name in PARAMS:
            mine, want = ours["grads"][name], ref["grads"][r][name]
            assert mine is not None, f"{where}: no gradient for {name}"
            _close_bf16(mine, want, f"{where} {name}.grad")
            if "wire" in mode:  # the gradients travel in bf16: bf16's rounding apart from torchtitan's
                _close_bf16(mine, theirs["grads"][name], f"{where} {name}.grad vs torchtitan")
                continue
            torch.testing.assert_close(
                mine,
                theirs["grads"][name],
                **SAME,
                msg=lambda m, n=name, w=where: f"{w} {n}.grad vs torchtitan: {m}",
            )
        counts = torch.bincount(got["ids"].reshape(-1), minlength=E).float()
        # the router's load-balancing counter counts each token once, dropless overflow or not
        assert ours["counter"].tolist() == counts.tolist() == theirs["counter"].tolist(), where
        assert got["in_flight"] == 0, f"{where}: {got['in_flight']} collectives left unwaited"
        if mode.startswith("dropless"):  # exact mode iff some rank routes more than the capacity to one rank
            need = max(int((r["ids"] // (E // world) == d).sum()) for r in ranks for d in range(world))
            assert got["overflows"] == got["overflows_after"] == int(need > dict(MODES)[mode]["capacity"]), (
                where,
                need,
                got["overflows"],
            )


@pytest.mark.parametrize(
    ("world", "mode", "routing", "compiler"),
    [pytest.param(*c, id="w{}-{}-{}-{}".format(*c)) for c in COMPILED],
)
def test_dispatcher_compiled_matches_dense(world: int, mode: str, routing: str, compiler: str) -> None:
    """Inductor keeps the experts' bf16 intermediates in float32: compared with the dense layer, not eager.

    The rank with no token compiled its own graphs: their collectives pair with the
    others', the forward's with the forward's and the backward's with the backward's.
    """
    ranks = [per_rank[(mode, routing)] for per_rank in batch(world)]
    graphs = [r["compiled"][compiler]["graphs"] for r in ranks]
    assert [len(g) for g in graphs] == [2] * world, [len(g) for g in graphs]
    for phase, name in enumerate(("forward", "backward")):
        mismatch = collective_mismatch([g[phase] for g in graphs])
        assert mismatch is None, f"{name}: {mismatch}"
    ref = _reference(world, routing, [r["ids"] for r in ranks])
    for r, got in enumerate(ranks):
        compiled = got["compiled"][compiler]
        _close_bf16(compiled["out"], ref["out"][r], f"rank {r} out")
        for name in PARAMS:
            _close_bf16(compiled["grads"][name], ref["grads"][r][name], f"rank {r} {name}.grad")
        assert compiled["counter"].tolist() == got["funcoll"]["counter"].tolist(), f"rank {r}: counter"


def test_config_errors_name_the_dispatcher() -> None:
    where = "funcoll.integrations.torchtitan.FuncollTokenDispatcher"
    with pytest.raises(ValueError, match=rf"^{where}: `mode`='auto' is not one of"):
        FuncollTokenDispatcher.Config(num_experts=E, top_k=K, mode="auto").build()
    with pytest.raises(
        ValueError, match=rf"^{where}: `capacity`=4 / `capacity_factor`=None are for mode='static'"
    ):
        FuncollTokenDispatcher.Config(num_experts=E, top_k=K, capacity=4).build()
    with pytest.raises(ValueError, match=rf"^{where}: give `capacity` or `capacity_factor`, not both"):
        FuncollTokenDispatcher.Config(
            num_experts=E, top_k=K, mode="static", capacity=4, capacity_factor=1.0
        ).build()
    with pytest.raises(ValueError, match=rf"^{where}: `capacity_factor`=0.0 must be > 0"):
        FuncollTokenDispatcher.Config(num_experts=E, top_k=K, mode="static", capacity_factor=0.0).build()


def test_override_swaps_torchtitans_dispatcher_config() -> None:
    from funcoll.integrations.torchtitan import funcoll_dispatcher

    cfg = funcoll_dispatcher(
        AllToAllTokenDispatcher.Config(num_experts=E, top_k=K), mode="static", capacity_factor=1.5
    )
    assert isinstance(cfg, FuncollTokenDispatcher.Config)
    assert (cfg.num_experts, cfg.top_k, cfg.mode, cfg.capacity_factor) == (E, K, "static", 1.5)
    dispatcher = cfg.build()
    assert isinstance(dispatcher, FuncollTokenDispatcher)
    assert dispatcher._capacity(10, 4) == 8  # ceil(1.5 * 10 tokens * top-2 / 4 ranks)
    dropless = funcoll_dispatcher(
        AllToAllTokenDispatcher.Config(num_experts=E, top_k=K), mode="dropless"
    ).build()
    assert (dropless.mode, dropless.grow, dropless._capacity(10, 4)) == ("dropless", True, 5)  # factor 1.0
    for mode in ("static", "dropless"):  # each takes the capacity, or the factor, it is given
        for kw, want in (({"capacity_factor": 1.25}, 7), ({"capacity": 3}, 3)):
            built = FuncollTokenDispatcher.Config(num_experts=E, top_k=K, mode=mode, **kw).build()
            assert built._capacity(10, 4) == want, (mode, kw)  # ceil(1.25 * 10 * 2 / 4) = 7
    static = FuncollTokenDispatcher.Config(num_experts=E, top_k=K, mode="static").build()
    assert static._capacity(10, 4) is None  # the dropless bound, T * k
    # after an overflow: the need rounded up to 4 significant bits, never more than 1/8 above it
    from funcoll.integrations.torchtitan import _round_up

    assert [_round_up(n) for n in (1, 15, 17, 33, 4300)] == [1, 15, 18, 36, 4608]
    assert all(n <= _round_up(n) <= n + n // 8 for n in range(1, 5000))
