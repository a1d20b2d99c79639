"""Every rank issues the same collectives when the ranks' programs differ the way users' code does.

``test_rank_shapes.py`` holds the program fixed and varies each rank's shapes. Here
each rank runs its own variant of one compiled training step that calls every
public op (one case per argument set of ``_ops.CASES``, the gathers' ``sizes=``
as a list, a tensor and exchanged), ``funcoll.moe`` in exact and static mode, and
torchtitan's MoE layer with funcoll's dispatcher where torchtitan runs (the last
rank routing no token in the MoE cases), and each op's loss is transformed per
rank as users' code does:

- ``plain``: the loss as it is;
- ``zero``: ``loss * 0``, the data-parallel idiom for a rank whose loss does not
  count (inductor folds a product with an integer 0 to a constant before
  partitioning: the gradient reaching the op no longer depends on the step's
  incoming gradient);
- ``scaled``: ``loss * (rank + 2)``, a rank-dependent constant;
- ``detach``: the op's other outputs used detached, and its first output also
  read detached (a logged value);
- ``drop``: the op's other outputs dropped (unused) on this rank;
- ``branch``: a Python branch on the rank that changes only local compute
  (``out * 2 + 1`` before the loss).

In program ``cycle-k`` rank ``r`` gives the ``i``-th op the transform
``TRANSFORMS[(i + k + r) % len(TRANSFORMS)]``: on every rank a different one, and
over three programs (aot_eager, offsets 0, 2, 4, all ops in one step) every op
meets every transform on one rank or the other; in ``zero-on-r`` rank ``r``
multiplies every op's loss by 0 and the other cycles through the rest, each op
compiled in a step of its own (in a step of many ops the partitioner's min-cut may
keep a movable collective where it is; alone it moves), half the ops on inductor
and half with its overlap passes (suite time: test_rank_shapes compiles every op
with the overlap passes). Inductor's constant folding is what turns ``* 0`` into a
constant gradient. Each program is compiled with
``fullgraph=True`` on every rank, on aot_eager, inductor and inductor with its
overlap passes, forward and backward, and:

- the collectives each rank's graphs issue (``funcoll.testing.compiling``: the
  partitioned FX graphs, or inductor's generated code after every pass) pair up
  across ranks, forward and backward (``collective_mismatch``);
- every output and input gradient equals the same step run eagerly on that rank.

The mechanism under test is ``funcoll/_collective/_phase.py``: before it, the
``zero`` rank's backward collective moved into its forward graph on inductor and
the ranks hung; before its backward anchor (``_phase._anchor``), on torch 2.12 and
2.13, the ``zero`` rank's backward graph of torchtitan's layer ran the forward's
all_to_alls a second time.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _ops import CASES, OpCase, flatten, moe_step, ragged_sizes

import funcoll
from funcoll.testing import collective_mismatch, compiling, run_ranks, start_ranks

WORLD = 2
TRANSFORMS = ("plain", "zero", "scaled", "detach", "drop", "branch")
# The programs each compiler runs (see the module docstring): on aot_eager every op meets
# every transform on one rank or the other; inductor's compiles cost more (suite time):
# one program each, in which one rank's every loss is `* 0` and the other's cycle.
PROGRAMS = {
    "aot_eager": ("cycle-0", "cycle-2", "cycle-4"),
    "inductor": ("zero-on-1",),
    "inductor-overlap": ("zero-on-0",),
}


PROGRAMS_ALONE = ("inductor", "inductor-overlap")


def _how(program: str, i: int, rank: int) -> str:
    """The transform rank `rank` gives the `i`-th op in `program`."""
    kind, _, arg = program.rpartition("-")
    if kind == "cycle":
        return TRANSFORMS[(i + int(arg) + rank) % len(TRANSFORMS)]
    if rank == int(arg):
        return "zero"
    rest = [t for t in TRANSFORMS if t != "zero"]
    return rest[(i + rank) % len(rest)]


TIMEOUT = 900.0


# ------------------------------------------------------------------------------ the ops
def _sizes_tensor_call(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    return funcoll.gather(x, group=group, sizes=torch.tensor(ragged_sizes(funcoll.axis_size(group))))


def _moe_call(mode: str) -> Callable[..., torch.Tensor]:
    layer = moe_step(mode, 4 if mode == "static" else None)
    return lambda x, idx, group=None: layer(x, idx)


def _moe_inputs(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = 0 if rank == world - 1 else 3 + 2 * rank  # the last rank routes no token
    gen = torch.Generator().manual_seed(31 * world + rank)
    x = torch.randn(t, 4, generator=gen, dtype=torch.float64)
    return x, (torch.arange(t).unsqueeze(1) * 3 + rank + torch.tensor([0, 1])) % (2 * world)


_TORCHTITAN: dict[str, Any] = {}  # this rank's torchtitan MoE layer, built by _programs


def _torchtitan_ready() -> bool:
    """Whether torchtitan 0.3.0 is installed and runs on this torch (its dispatchers need 2.12)."""
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.compiler, "_is_non_strict_tracing")


def _build_torchtitan(world: int) -> None:
    """torchtitan's MoE layer (8 experts, top 2) with funcoll's dispatcher in exact mode, on an "ep" mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter

    from funcoll.integrations.torchtitan import FuncollTokenDispatcher

    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(5)  # the same weights on every rank
    e, k, d = 8, 2, 16  # the grouped GEMM wants rows of a multiple of 16 bytes
    layer = MoE.Config(
        num_experts=e,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=d, hidden_dim=24, num_experts=e // world),
            token_dispatcher=FuncollTokenDispatcher.Config(num_experts=e, top_k=k, mode="exact"),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=e, gate=Linear.Config(in_features=d, out_features=e), top_k=k
        ),
    ).build()
    with torch.no_grad():  # built uninitialized: seeded values, the same on every rank
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    layer.train()
    _TORCHTITAN["layer"] = layer


def _torchtitan_inputs(rank: int, world: int) -> tuple[torch.Tensor]:
    t = 0 if rank == world - 1 else 5  # the last rank routes no token
    return (torch.randn(1, t, 16, generator=torch.Generator().manual_seed(rank)),)


def _torchtitan_call(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    return _TORCHTITAN["layer"](x)


def _ops() -> list[OpCase]:
    """One case per argument set of every public op, the sizes forms, the MoE modes and torchtitan's layer."""
    gather_given = next(c for c in CASES if c.id == "gather-given-ragged-x_nx5-dim0")
    picked = [c for c in CASES if c.at_scale or c.id == gather_given.id]
    extra = [
        OpCase("gather-sizes-tensor", gather_given.inputs, _sizes_tensor_call, gather_given.reference),
        *(
            OpCase(f"moe-{m}", _moe_inputs, _moe_call(m), lambda a, w: [], grad_inputs=(0,))
            for m in ("exact", "static")
        ),
    ]
    if _torchtitan_ready():  # funcoll's dispatcher in torchtitan's MoE layer
        extra.append(OpCase("torchtitan-dispatcher", _torchtitan_inputs, _torchtitan_call, lambda a, w: []))
    return picked + extra


OPS = _ops()


def _leaves(case: OpCase, rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(
        t.detach().clone().requires_grad_(case.grad != "none" and i in case.grad_inputs)
        for i, t in enumerate(case.inputs(rank, WORLD))
    )


def _transformed_loss(case: OpCase, rank: int, outputs: list[torch.Tensor | None], how: str) -> torch.Tensor:
    if how == "branch" and rank % 2 == 1:  # local compute only, on this rank
        outputs = [o * 2 + 1 if o is not None and o.dtype.is_floating_point else o for o in outputs]
    if how in ("detach", "drop"):
        outputs = outputs[:1] + [None if how == "drop" or o is None else o.detach() for o in outputs[1:]]
    loss = torch.zeros((), dtype=torch.float64)
    for k, out in enumerate(outputs):  # no seeded weights: a ragged output's shape is known only in the graph
        if out is not None and out.dtype.is_floating_point:
            loss = loss + out.pow(2).sum() * 0.5 + out.sum() * (k + 1) / 7
    if how == "detach" and outputs[0] is not None and outputs[0].dtype.is_floating_point:
        loss = loss + outputs[0].detach().sum() * 1e-3  # a read of the value that carries no gradient
    if how == "zero":
        return loss * 0
    if how == "scaled":
        return loss * (rank + 2)
    return loss


def _step(cases: list[OpCase], program: str, rank: int) -> Callable[..., Any]:
    """This rank's variant of `program` over `cases`: each op's call, then its transformed loss."""
    counts = [len(case.inputs(rank, WORLD)) for case in cases]
    first = OPS.index(cases[0])

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        total, outs, k = torch.zeros((), dtype=torch.float64), [], 0
        for i, case in enumerate(cases):
            outputs = flatten(case.call(*flat[k : k + counts[i]]))
            k += counts[i]
            total = total + _transformed_loss(case, rank, outputs, _how(program, first + i, rank))
            # The outputs leave detached: an output that requires grad gets a gradient input of
            # its own in the backward graph, which every backward collective would depend on.
            outs.extend(None if o is None else o.detach() for o in outputs)
        return total, outs

    return step


def _run(fn: Callable[..., Any], cases: list[OpCase], rank: int) -> dict[str, Any]:
    leaves = [t for case in cases for t in _leaves(case, rank)]
    loss, outs = fn(*leaves)
    if loss.requires_grad:
        loss.backward()
    return {
        "outputs": [None if o is None else o.clone() for o in outs],
        "grads": [t.grad for t in leaves if t.requires_grad],
    }


def _alone(compiler: str) -> list[OpCase]:
    """The ops one inductor variant compiles one by one: every other op each (suite time).

    torchtitan's layer is left out (its inductor compiles cost the most): it has a
    test of its own, ``test_torchtitans_layer_with_a_zero_loss_on_inductor``.
    """
    ops = [c for c in OPS if c.id != "torchtitan-dispatcher"]
    return ops[PROGRAMS_ALONE.index(compiler) :: len(PROGRAMS_ALONE)]


def _compiled_and_eager(rank: int, compiler: str, program: str, cases: list[OpCase]) -> dict[str, Any]:
    try:
        torch._dynamo.reset()
        eager = _run(_step(cases, program, rank), cases, rank)
        with compiling(compiler) as (backend, graphs):
            compiled = _run(
                torch.compile(_step(cases, program, rank), fullgraph=True, backend=backend), cases, rank
            )
        return {"eager": eager, "compiled": compiled, "graphs": list(graphs)}
    except Exception:  # noqa: BLE001 -- reported by the test, after every rank has stopped
        return {"error": traceback.format_exc(limit=-10)}


def _programs(rank: int, world: int, compiler: str) -> dict[tuple[str, str], Any]:
    """Every program on this rank, eager then compiled: on aot_eager all ops in one step, else one op a step."""
    results: dict[tuple[str, str], Any] = {}
    if _torchtitan_ready():
        _build_torchtitan(world)
    for program in PROGRAMS[compiler]:
        groups = [("every op", OPS)] if compiler == "aot_eager" else [(c.id, [c]) for c in _alone(compiler)]
        for name, cases in groups:
            results[program, name] = _compiled_and_eager(rank, compiler, program, cases)
            if "error" in results[program, name]:
                return results  # a rank that raised mid-step has left its peers in a collective
    return results


_RUNS: dict[str, Any] = {}


def _results(compiler: str) -> list[dict[tuple[str, str], Any]]:
    if not _RUNS:  # every compiler's ranks start side by side at the first read
        for c in PROGRAMS:
            _RUNS[c] = start_ranks(_programs, WORLD, c, timeout=TIMEOUT, pg_timeout=120.0)
    if not isinstance(_RUNS[compiler], list):
        _RUNS[compiler] = _RUNS[compiler].results()
    return _RUNS[compiler]


@pytest.mark.parametrize("compiler", list(PROGRAMS))
def test_every_rank_issues_the_same_collectives_whatever_its_program(compiler: str) -> None:
    per_rank = _results(compiler)
    for key in per_rank[0]:
        runs = [r.get(key, {"error": "did not run"}) for r in per_rank]
        errors = [r["error"] for r in runs if "error" in r]
        assert not errors, f"{key}: {errors[0]}"
        assert len({len(r["graphs"]) for r in runs}) == 1, (key, [len(r["graphs"]) for r in runs])
        for phase in range(len(runs[0]["graphs"])):
            mismatch = collective_mismatch([r["graphs"][phase] for r in runs])
            assert mismatch is None, f"{key}, graph {phase}: {mismatch}"
    assert len(per_rank[0]) == len(PROGRAMS[compiler]) * (
        1 if compiler == "aot_eager" else len(_alone(compiler))
    )


@pytest.mark.parametrize("compiler", list(PROGRAMS))
def test_compiled_programs_compute_what_eager_ones_do(compiler: str) -> None:
    per_rank = _results(compiler)
    for key in per_rank[0]:
        for rank, run in enumerate(r.get(key, {"error": "did not run"}) for r in per_rank):
            assert "error" not in run, run.get("error")
            for what in ("outputs", "grads"):
                for i, (got, want) in enumerate(zip(run["compiled"][what], run["eager"][what], strict=True)):
                    if want is None or not want.dtype.is_floating_point:
                        assert got is None or torch.equal(got, want), (key, rank, what, i)
                        continue
                    torch.testing.assert_close(
                        got, want, msg=lambda m, k=key, r=rank, w=what, i=i: f"{k} rank {r} {w} {i}: {m}"
                    )


def test_every_op_meets_every_transform() -> None:
    """On aot_eager each op gets each transform on one rank or the other; one inductor variant compiles it alone."""
    for i in range(len(OPS)):
        seen = {_how(p, i, r) for p in PROGRAMS["aot_eager"] for r in range(WORLD)}
        assert seen == set(TRANSFORMS), OPS[i].id
    alone = [c.id for compiler in PROGRAMS_ALONE for c in _alone(compiler)]
    assert sorted(alone) == sorted(c.id for c in OPS if c.id != "torchtitan-dispatcher")


def _torchtitan_zero(rank: int, world: int, compiler: str, program: str) -> dict[str, Any]:
    """torchtitan's layer compiled on `compiler`, one rank's loss ``* 0``: forward and backward, and eager.

    Before ``_phase._anchor`` rank 0's backward graph on torch 2.12 and 2.13 held a
    second copy of the forward's counts and dispatch all_to_alls (the other rank's
    did not): gloo aborted on the mismatched sizes (NCCL: a hang).
    """
    _build_torchtitan(world)
    return _compiled_and_eager(rank, compiler, program, [c for c in OPS if c.id == "torchtitan-dispatcher"])


@pytest.mark.skipif(not _torchtitan_ready(), reason="torchtitan 0.3.0 on torch 2.12 or newer")
@pytest.mark.parametrize(
    ("compiler", "program"), [("inductor", "zero-on-0"), ("inductor-overlap", "zero-on-1")]
)
def test_torchtitans_layer_with_a_zero_loss_on_inductor(compiler: str, program: str) -> None:
    runs = run_ranks(_torchtitan_zero, WORLD, compiler, program, timeout=300.0, pg_timeout=60.0)
    errors = [r["error"] for r in runs if "error" in r]
    assert not errors, errors[0]
    assert len({len(r["graphs"]) for r in runs}) == 1, [len(r["graphs"]) for r in runs]
    for phase in range(len(runs[0]["graphs"])):
        mismatch = collective_mismatch([r["graphs"][phase] for r in runs])
        assert mismatch is None, f"graph {phase}: {mismatch}"
    for rank, run in enumerate(runs):  # bf16 grouped GEMMs, fused otherwise: their rounding, to the norm
        for what in ("outputs", "grads"):
            for got, want in zip(run["compiled"][what], run["eager"][what], strict=True):
                assert got.shape == want.shape, (rank, what, got.shape, want.shape)
                err, scale = float((got - want).double().norm()), max(float(want.double().norm()), 1e-12)
                assert err <= 2e-2 * scale, f"rank {rank} {what}: relative error {err / scale:.3g}"
