"""The `group=` canonicaliser (funcoll/_base/_group.py): every form of group, on real gloo ranks.

Forms: None, ``dist.group.WORLD``, a subgroup from ``dist.new_group([0, 2])``, a 1-D
DeviceMesh, ``(mesh, mesh_dim)`` with an int or a name on a 2-D ``("dp", "tp")`` mesh, and
c10d group-name strings. For each form every member rank runs a set of ops on that group,
and the parent checks them against a single-process reference over the group's members
(listed independently of funcoll: the mesh is ``arange(world).view(2, 2)``, row-major).
Without torch.distributed initialized, every op must return its single-rank result.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _inputs import once_per_world
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

import funcoll

WORLDS = (1, 3, 4)
TIMEOUT_S = 120.0
F32, F64 = torch.float32, torch.float64
DIFFERENTIABLE = ("all_gather", "all_reduce", "reduce_scatter", "broadcast", "ppermute", "all_to_all")


def seeded(shape: Sequence[int], dtype: torch.dtype, *key: object) -> Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(tuple(shape), generator=gen, dtype=dtype)


def form_labels(world: int) -> list[str]:
    """Every group form tested on `world` ranks; the body builds the same list."""
    labels = ["none", "world", "world-name", "mesh1d", "mesh1d-dim0", "mesh1d-dim-1"]
    if world >= 3:
        labels += ["sub02", "sub02-name"]
    if world == 4:
        labels += ["mesh2d-dp", "mesh2d-0", "mesh2d-tp", "mesh2d-1", "mesh2d-dim-1", "mesh2d-tp-name"]
    return labels


def members(label: str, rank: int, world: int) -> list[int] | None:
    """The global ranks of the group `label` names on `rank`, in group-rank order; None if not a member."""
    if label.startswith("sub02"):
        return [0, 2] if rank in (0, 2) else None
    if label in ("mesh2d-dp", "mesh2d-0"):  # mesh dim 0 of [[0, 1], [2, 3]]: the columns
        return [rank % 2, rank % 2 + 2]
    if label in ("mesh2d-tp", "mesh2d-1", "mesh2d-dim-1", "mesh2d-tp-name"):  # mesh dim 1: the rows
        return [rank // 2 * 2, rank // 2 * 2 + 1]
    return list(range(world))


# --------------------------------------------------------------------------- rank body
def group_input(label: str, rank: int, size: int) -> Tensor:
    """Rank `rank`'s x for form `label`: ``(2 * size, 3)``, so reduce_scatter and all_to_all divide."""
    return seeded((2 * size, 3), F64, label, "x", rank)


def ragged_piece(label: str, rank: int, index: int) -> Tensor:
    """A piece with ``index + 1`` rows: gather_forward_split_backward runs its size exchange on the group."""
    return seeded((index + 1, 3), F64, label, "piece", rank)


def op_weight(label: str, op: str, rank: int, shape: Sequence[int]) -> Tensor:
    return seeded(shape, F64, label, op, "w", rank)


def run_ops(label: str, group: Any, rank: int) -> dict[str, Any]:
    """Every op on `group`; the differentiable ones feed one loss whose gradient is recorded."""
    index, size = funcoll.axis_index(group), funcoll.axis_size(group)
    x = group_input(label, rank, size).requires_grad_(True)
    ys = {
        "all_gather": funcoll.all_gather(x, 0, group=group),
        "all_reduce": funcoll.all_reduce(x, group=group),
        "reduce_scatter": funcoll.reduce_scatter(x, 0, group=group),
        "broadcast": funcoll.broadcast(x, size - 1, group=group),
        "ppermute": funcoll.ppermute(x, [(i, (i + 1) % size) for i in range(size)], group=group),
        "all_to_all": funcoll.all_to_all(x, group, 0, 1),
    }
    loss = sum((y * op_weight(label, op, rank, y.shape)).sum() for op, y in ys.items())
    loss.backward()
    out = {op: y.detach() for op, y in ys.items()}
    out["gather_forward_split_backward"] = funcoll.gather_forward_split_backward(
        ragged_piece(label, rank, index), group, 0
    )
    out["split_forward_gather_backward"] = funcoll.split_forward_gather_backward(x.detach(), group, 0)
    return {"axis_index": index, "axis_size": size, "ys": out, "grad": x.grad}


@dataclass
class BadGroup:
    id: str
    group: Callable[[dict[str, Any]], Any]  # the rank's meshes -> the bad group
    exc: type[Exception]
    fragment: str


BAD_OPS: dict[str, Callable[[Any], object]] = {
    "all_gather": lambda g: funcoll.all_gather(torch.ones(2, 3), group=g),
    "reduce_scatter": lambda g: funcoll.reduce_scatter(torch.ones(4, 3), group=g),
    "ppermute": lambda g: funcoll.ppermute(torch.ones(2), [], group=g),
    "split_forward_gather_backward": lambda g: funcoll.split_forward_gather_backward(torch.ones(4), g, 0),
    "axis_index": lambda g: funcoll.axis_index(g),
    "axis_size": lambda g: funcoll.axis_size(g),
}


def bad_groups(world: int) -> list[BadGroup]:
    bad = [
        BadGroup("int", lambda m: 3, TypeError, "`group` must be None, a ProcessGroup"),
        BadGroup("list-of-ranks", lambda m: [0, 1], TypeError, "`group` must be None, a ProcessGroup"),
        BadGroup("torch-device", lambda m: torch.device("cpu"), TypeError, "`group` must be"),
        BadGroup("tuple-1", lambda m: (m["mesh1d"],), TypeError, "`group` as a tuple"),
        BadGroup("tuple-3", lambda m: (m["mesh1d"], 0, 0), TypeError, "`group` as a tuple"),
        BadGroup("tuple-not-mesh", lambda m: ("mesh", 0), TypeError, "`group` as a tuple"),
        BadGroup(
            "mesh-dim-float", lambda m: (m["mesh1d"], 0.0), TypeError, "`group` as (DeviceMesh, mesh_dim)"
        ),
        BadGroup("mesh1d-dim1", lambda m: (m["mesh1d"], 1), ValueError, "`group` mesh_dim=1"),
        BadGroup("mesh1d-name-tp", lambda m: (m["mesh1d"], "tp"), ValueError, "`group` names mesh dim 'tp'"),
        BadGroup("unknown-name", lambda m: "no-such-group", ValueError, "`group`='no-such-group'"),
    ]
    if world == 4:
        bad += [
            BadGroup("mesh2d-bare", lambda m: m["mesh2d"], ValueError, "`group` is a 2-D DeviceMesh"),
            BadGroup("mesh2d-dim2", lambda m: (m["mesh2d"], 2), ValueError, "`group` mesh_dim=2"),
            BadGroup("mesh2d-dim-3", lambda m: (m["mesh2d"], -3), ValueError, "`group` mesh_dim=-3"),
            BadGroup(
                "mesh2d-name-pp", lambda m: (m["mesh2d"], "pp"), ValueError, "`group` names mesh dim 'pp'"
            ),
        ]
    return bad


def outcome(call: Callable[[], object]) -> tuple[str, str]:
    """``(exception type name, message)`` of `call`, or ``("no error", "")``."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 (recorded; the parent checks the type and the message)
        return type(e).__name__, str(e)
    return "no error", ""


def group_body(rank: int, world: int) -> dict[str, Any]:
    # new_group and init_device_mesh are collective: every rank makes every call, in order.
    mesh1d = init_device_mesh("cpu", (world,))
    sub02 = dist.new_group([0, 2]) if world >= 3 else None
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) if world == 4 else None
    groups: dict[str, Any] = {
        "none": None,
        "world": dist.group.WORLD,
        "world-name": dist.group.WORLD.group_name,
        "mesh1d": mesh1d,
        "mesh1d-dim0": (mesh1d, 0),
        "mesh1d-dim-1": (mesh1d, -1),
    }
    if sub02 is not None:
        groups |= {"sub02": sub02, "sub02-name": sub02.group_name if rank in (0, 2) else None}
    if mesh2d is not None:
        groups |= {
            "mesh2d-dp": (mesh2d, "dp"),
            "mesh2d-0": (mesh2d, 0),
            "mesh2d-tp": (mesh2d, "tp"),
            "mesh2d-1": (mesh2d, 1),
            "mesh2d-dim-1": (mesh2d, -1),
            "mesh2d-tp-name": mesh2d.get_group("tp").group_name,
        }
    assert list(groups) == form_labels(world)
    # The last rank alone makes the bad calls: they must raise before communicating.
    meshes = {"mesh1d": mesh1d, "mesh2d": mesh2d}
    errors = {}
    if rank == world - 1:
        for b in bad_groups(world):
            for op, call in BAD_OPS.items():
                errors[(b.id, op)] = outcome(lambda call=call, b=b: call(b.group(meshes)))
    results = {}
    for label, group in groups.items():
        if members(label, rank, world) is not None:  # ranks 1 and 3 are not in sub02
            results[label] = run_ops(label, group, rank)
    return {"results": results, "errors": errors}


group_batch = once_per_world(
    group_body, TIMEOUT_S, worlds=WORLDS
)  # the batch on `world` ranks, run once per session


# --------------------------------------------------------------------------- reference
def reference_outputs(label: str, group_ranks: list[int], xs: list[Tensor]) -> dict[str, list[Tensor]]:
    """Each member's outputs of the differentiable ops, from the members' inputs, in one process."""
    s = len(group_ranks)
    total = torch.stack(xs).sum(0)
    return {
        "all_gather": [torch.cat(xs, 0)] * s,
        "all_reduce": [total] * s,
        "reduce_scatter": list(torch.tensor_split(total, s, 0)),
        "broadcast": [xs[s - 1]] * s,
        "ppermute": [xs[(i - 1) % s] for i in range(s)],
        "all_to_all": [torch.cat([torch.tensor_split(x, s, 0)[i] for x in xs], 1) for i in range(s)],
    }


def check_form(label: str, world: int, rank: int) -> None:
    group_ranks = members(label, rank, world)
    assert group_ranks is not None
    s, i = len(group_ranks), group_ranks.index(rank)
    got = group_batch(world)[rank]["results"][label]
    assert (got["axis_index"], got["axis_size"]) == (i, s)

    leaves = [group_input(label, m, s).requires_grad_(True) for m in group_ranks]
    expected = reference_outputs(label, group_ranks, leaves)
    for op in DIFFERENTIABLE:
        torch.testing.assert_close(got["ys"][op], expected[op][i], msg=lambda m, op=op: f"{op}: {m}")
    loss = sum((ys[j] * op_weight(label, op, m, ys[j].shape)).sum()
               for op, ys in expected.items() for j, m in enumerate(group_ranks))  # fmt: skip
    expected_grad = torch.autograd.grad(loss, leaves)[i]
    torch.testing.assert_close(got["grad"], expected_grad, msg=lambda m: f"x.grad: {m}")

    full = torch.cat([ragged_piece(label, m, j) for j, m in enumerate(group_ranks)], 0)
    torch.testing.assert_close(got["ys"]["gather_forward_split_backward"], full)
    split = torch.tensor_split(group_input(label, rank, s), s, 0)[i]
    torch.testing.assert_close(got["ys"]["split_forward_gather_backward"], split)


# ------------------------------------------------------------------------------- tests
FORMS = [
    pytest.param(w, label, r, id=f"w{w}-{label}-rank{r}")
    for w in WORLDS
    for label in form_labels(w)
    for r in range(w)
    if members(label, r, w) is not None
]


@pytest.mark.parametrize("world, label, rank", FORMS)
def test_group_form(world: int, label: str, rank: int) -> None:
    """axis_index/axis_size and every op on the group agree with the members' reference."""
    check_form(label, world, rank)


BAD = [
    pytest.param(w, b, op, id=f"w{w}-{b.id}-{op}") for w in WORLDS for b in bad_groups(w) for op in BAD_OPS
]


@pytest.mark.parametrize("world, bad, op", BAD)
def test_bad_group(world: int, bad: BadGroup, op: str) -> None:
    kind, message = group_batch(world)[world - 1]["errors"][(bad.id, op)]
    assert kind == bad.exc.__name__, message
    assert message.startswith(f"funcoll.{op}: "), message
    assert bad.fragment in message, message


# ------------------------------------------------- one process, torch.distributed not initialized
X = seeded((5, 7), F32, "single")


def _single_rank_cases() -> list[Any]:
    x, n = X, X.shape[0]
    zero = torch.zeros_like(X)
    cases: list[tuple[str, Callable[[], Any], Any]] = [
        ("all_gather", lambda: funcoll.all_gather(x), x),
        ("all_gather-dim-1", lambda: funcoll.all_gather(x, -1), x),
        ("all_gather-untiled-dim1", lambda: funcoll.all_gather(x, 1, tiled=False), x.unsqueeze(1)),
        ("all_gather-untiled-dim-1", lambda: funcoll.all_gather(x, -1, tiled=False), x.unsqueeze(-1)),
        ("all_gather_into_tensor", lambda: funcoll.all_gather_into_tensor(x), x.unsqueeze(0)),
        ("reduce_scatter-untiled", lambda: funcoll.reduce_scatter(x[:1], 0, tiled=False), x[0]),
        ("reduce_scatter-sizes", lambda: funcoll.reduce_scatter(x, 0, sizes=[n]), x),
        ("all_to_all", lambda: funcoll.all_to_all(x, None, 1, 0), x),
        ("ppermute-identity", lambda: funcoll.ppermute(x, [(0, 0)]), x),
        ("ppermute-empty", lambda: funcoll.ppermute(x, []), zero),
        ("broadcast", lambda: funcoll.broadcast(x, 0), x),
        ("split_forward_gather_backward", lambda: funcoll.split_forward_gather_backward(x, None, 1, "up"), x),
        (
            "gather_forward_split_backward",
            lambda: funcoll.gather_forward_split_backward(x, None, 0, "down"),
            x,
        ),
        ("gather", lambda: funcoll.gather(x, 1), x),
        ("gather-dst0", lambda: funcoll.gather(x, 0, dst=0), x),
        ("all_gather_list", lambda: funcoll.all_gather_list(x), [x]),
        ("all_gather_ragged", lambda: funcoll.all_gather_ragged(x, 1), (x, torch.tensor([7]))),
        ("all_to_all_v", lambda: funcoll.all_to_all_v(x, [n]), (x, torch.tensor([n]))),
        ("all_to_all_v-recv", lambda: funcoll.all_to_all_v(x, [n], [n]), (x, torch.tensor([n]))),
        ("axis_index", lambda: funcoll.axis_index(), 0),
        ("axis_size", lambda: funcoll.axis_size(), 1),
    ]
    for op in ("sum", "avg", "max", "min", "product"):
        cases.append((f"reduce_scatter-{op}", lambda op=op: funcoll.reduce_scatter(x, 1, op=op), x))
        cases.append((f"all_reduce-{op}", lambda op=op: funcoll.all_reduce(x, op=op), x))
    return [pytest.param(call, expected, id=name) for name, call, expected in cases]


def _tensors(result: Any) -> list[Tensor]:
    if isinstance(result, Tensor):
        return [result]
    return [t for item in result for t in _tensors(item)] if isinstance(result, (list, tuple)) else []


@pytest.mark.parametrize("call, expected", _single_rank_cases())
def test_single_rank_without_dist(call: Callable[[], Any], expected: Any) -> None:
    """Each op is the single-rank mathematics, a new tensor; any communication would raise."""
    assert not dist.is_initialized()
    result = call()
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    for t in _tensors(result):
        assert funcoll.wait(t).untyped_storage().data_ptr() != X.untyped_storage().data_ptr(), (
            "aliases the input"
        )


SINGLE_GRADS = [
    pytest.param(lambda x: funcoll.all_gather(x, 1), id="all_gather-dim1"),
    pytest.param(lambda x: funcoll.all_gather(x, 0, tiled=False), id="all_gather-untiled"),
    pytest.param(lambda x: funcoll.reduce_scatter(x, 0, op="avg"), id="reduce_scatter-avg"),
    pytest.param(lambda x: funcoll.all_reduce(x), id="all_reduce-sum"),
    pytest.param(lambda x: funcoll.all_to_all(x, None, 0, 1), id="all_to_all"),
    pytest.param(lambda x: funcoll.ppermute(x, [(0, 0)]), id="ppermute"),
    pytest.param(lambda x: funcoll.broadcast(x), id="broadcast"),
    pytest.param(lambda x: funcoll.split_forward_gather_backward(x, None, 0, "down"), id="split-down"),
    pytest.param(lambda x: funcoll.gather(x, 1), id="gather"),
]


@pytest.mark.parametrize("fn", SINGLE_GRADS)
def test_single_rank_grad_without_dist(fn: Callable[[Tensor], Tensor]) -> None:
    """On one rank every adjoint is the identity (world 1: avg and "down" divide by 1)."""
    assert not dist.is_initialized()
    x = seeded((5, 7), F64, "single-grad").requires_grad_(True)
    y = fn(x)
    w = seeded(y.shape, F64, "single-grad", "w")
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, w.reshape(x.shape))


@pytest.mark.parametrize(
    "group, exc, fragment",
    [
        pytest.param("no-such-group", ValueError, "`group`='no-such-group'", id="name"),
        pytest.param(3, TypeError, "`group` must be None", id="int"),
        pytest.param([0], TypeError, "`group` must be None", id="list"),
    ],
)  # fmt: skip
def test_group_without_dist(group: Any, exc: type[Exception], fragment: str) -> None:
    assert not dist.is_initialized()
    with pytest.raises(exc) as info:
        funcoll.all_gather(X, group=group)
    message = str(info.value)
    assert message.startswith("funcoll.all_gather: "), message
    assert fragment in message, message
