"""The even drop-ins of funcoll/compat.py on real gloo ranks, with the seed signatures.

Covers OpenSora's ``all_to_all`` (``(B, S, H, D)``, ``scatter_dim=2``, ``gather_dim=1`` by
default), ``split_forward_gather_backward`` (default ``grad_scale=1.0``: no scaling),
``gather_forward_split_backward``, and ``all_gather_into_tensor`` (written in place, in
both output layouts torch accepts, with ``async_op``). References are computed in one
process from every rank's seeded input; ``all_gather_into_tensor`` is also compared with
``torch.distributed.all_gather_into_tensor`` on the same ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _inputs import once_per_world, seeded
from torch import Tensor

from funcoll import compat

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 120.0
F32, F64, BF16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.int64


def leaf_and_view(
    shape: Sequence[int], dtype: torch.dtype, transposed: bool, *key: object
) -> tuple[Tensor, Tensor]:
    """``(leaf, x)`` with ``x.shape == shape``; with `transposed` x is a non-contiguous view of the leaf."""
    s = list(shape)
    if transposed:
        s[-1], s[-2] = s[-2], s[-1]
    leaf = seeded(s, dtype, *key).requires_grad_(dtype == F64)
    return leaf, (leaf.transpose(-1, -2) if transposed else leaf)


# -------------------------------------------------------------------------------- all_to_all
# (id, local shape (B, S, H, D) on `world` ranks, dtype, transposed, call)
A2A_CASES: list[tuple[str, Callable[[int], tuple[int, ...]], torch.dtype, bool, Callable[..., Tensor]]] = [
    ("defaults-x2x5x(3w)x3-f32", lambda w: (2, 5, 3 * w, 3), F32, False, lambda x: compat.all_to_all(x, None)),
    ("defaults-x2x5x7x3-bf16", lambda w: (2, 5, 7, 3), BF16, False, lambda x: compat.all_to_all(x, None)),
    ("keywords-x2x5x(3w)x3-i64", lambda w: (2, 5, 3 * w, 3), I64, False,
     lambda x: compat.all_to_all(input_=x, process_group=dist.group.WORLD, scatter_dim=2, gather_dim=1)),
    ("s1-g2-x2x(3w)x5x3-f32-T", lambda w: (2, 3 * w, 5, 3), F32, True, lambda x: compat.all_to_all(x, None, 1, 2)),
    ("defaults-x2x5x(3w)x3-f64-grad", lambda w: (2, 5, 3 * w, 3), F64, False, lambda x: compat.all_to_all(x, None)),
    ("defaults-x2x3x7x5-f64-T-grad", lambda w: (2, 3, 7, 5), F64, True, lambda x: compat.all_to_all(x, None)),
    ("s1-g2-x2x7x5x3-f64-grad", lambda w: (2, 7, 5, 3), F64, False,
     lambda x: compat.all_to_all(x, None, scatter_dim=1, gather_dim=2)),
]  # fmt: skip

A2A_DIMS = {"defaults": (2, 1), "keywords": (2, 1), "s1-g2": (1, 2)}


def a2a_dims(case_id: str) -> tuple[int, int]:
    return next(dims for prefix, dims in A2A_DIMS.items() if case_id.startswith(prefix))


def a2a_round_trip(x: Tensor) -> Tensor:
    """Sequence-parallel attention's pair: ``(B, S/w, H, D) -> (B, S, H/w, D) -> (B, S/w, H, D)``."""
    return compat.all_to_all(compat.all_to_all(x, None, 2, 1), None, 1, 2)


# ----------------------------------------------------------------------------- region ops
# (id, full shape, dim, grad_scale as passed (omitted if "default"), expected factor on world w)
SPLIT_CASES: list[tuple[str, tuple[int, ...], int, Any]] = [
    ("x7x5-dim0-default", (7, 5), 0, "default"),
    ("x5x7-dim-1-up", (5, 7), -1, "up"),
    ("x3x7x5-dim1-down", (3, 7, 5), 1, "down"),
    ("x2x5-dim0-1.0", (2, 5), 0, 1.0),
]
GATHER_CASES: list[tuple[str, tuple[int, ...], int, Any]] = [
    ("x7x5-dim0-default", (7, 5), 0, "default"),
    ("x5x7-dim-1-up", (5, 7), -1, "up"),
    ("x3x7x5-dim1-down", (3, 7, 5), 1, "down"),
]


def factor(grad_scale: Any, world: int) -> float:
    return {"default": 1.0, 1.0: 1.0, None: 1.0, "up": float(world), "down": 1.0 / world}[grad_scale]


def scale_kwargs(grad_scale: Any) -> dict[str, Any]:
    return {} if grad_scale == "default" else {"grad_scale": grad_scale}


# --------------------------------------------------------------------- all_gather_into_tensor
# (id, input shape, dtype, transposed, output shape on world w, async_op)
AGIT_CASES: list[tuple[str, tuple[int, ...], torch.dtype, bool, Callable[[int], tuple[int, ...]], bool]] = [
    ("x5x7-out(5w)x7-f32", (5, 7), F32, False, lambda w: (5 * w, 7), False),
    ("x5x7-out(w)x5x7-bf16", (5, 7), BF16, False, lambda w: (w, 5, 7), False),
    ("x3x5-out(3w)x5-i64-T", (3, 5), I64, True, lambda w: (3 * w, 5), False),
    ("x5x7-out(5w)x7-f32-async", (5, 7), F32, False, lambda w: (5 * w, 7), True),
    ("x7-out(w)x7-f64-async", (7,), F64, False, lambda w: (w, 7), True),
]


def agit_input(
    case_id: str, shape: tuple[int, ...], dtype: torch.dtype, transposed: bool, rank: int
) -> Tensor:
    return leaf_and_view(shape, dtype, transposed, "agit", case_id, rank)[1].detach()


def bad_agit_calls(world: int) -> dict[str, tuple[Callable[[], object], type[Exception], str]]:
    inp = torch.ones(5, 7)
    return {
        "out-numel-plus-one": (lambda: compat.all_gather_into_tensor(torch.empty(5 * world + 1, 7), inp),
                               ValueError, "`output_tensor` has"),
        "out-numel-of-input": (lambda: compat.all_gather_into_tensor(torch.empty(1, 5, 8), inp),
                               ValueError, "`output_tensor` has 40 elements"),
        "out-dtype-f64": (lambda: compat.all_gather_into_tensor(torch.empty(world, 5, 7, dtype=F64), inp),
                          TypeError, "`output_tensor` is torch.float64"),
    }  # fmt: skip


# --------------------------------------------------------------------------------- rank body
# torch 2.13 renames dist.all_gather_into_tensor to all_gather_single (the old name warns).
torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def compat_body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": {}}
    # The last rank alone makes the bad calls first: they must raise before communicating.
    if rank == world - 1:
        for name, (call, _, _) in bad_agit_calls(world).items():
            try:
                call()
                out["errors"][name] = ("no error", "")
            except Exception as e:  # noqa: BLE001 (recorded; the parent checks the type and the message)
                out["errors"][name] = (type(e).__name__, str(e))

    a2a = {}
    for case_id, shape, dtype, transposed, call in A2A_CASES:
        leaf, x = leaf_and_view(shape(world), dtype, transposed, "a2a", case_id, rank)
        y = call(x)
        res = {"y": y.detach()}
        if leaf.requires_grad:
            (y * seeded(y.shape, F64, "a2a", case_id, "w", rank)).sum().backward()
            res["grad"] = leaf.grad
        a2a[case_id] = res
    x = seeded((2, 5, 3 * world, 3), F32, "round-trip", rank)
    out["a2a"], out["round_trip"] = a2a, (x, a2a_round_trip(x))

    split = {}
    for case_id, shape, dim, grad_scale in SPLIT_CASES:
        x = seeded(shape, F64, "split", case_id).requires_grad_(True)  # replicated
        y = compat.split_forward_gather_backward(x, None, dim, **scale_kwargs(grad_scale))
        (y * seeded(y.shape, F64, "split", case_id, "w", rank)).sum().backward()
        split[case_id] = {"y": y.detach(), "grad": x.grad}
    out["split"] = split

    gather = {}
    for case_id, shape, dim, grad_scale in GATHER_CASES:
        piece = torch.tensor_split(seeded(shape, F64, "gather", case_id), world, dim)[rank]
        x = piece.clone().requires_grad_(True)
        y = compat.gather_forward_split_backward(
            input_=x, process_group=None, dim=dim, **scale_kwargs(grad_scale)
        )
        (torch.sin(y) * seeded(y.shape, F64, "gather", case_id, "w")).sum().backward()  # replicated loss
        gather[case_id] = {"y": y.detach(), "grad": x.grad}
    out["gather"] = gather

    agit = {}
    for case_id, shape, dtype, transposed, out_shape, async_op in AGIT_CASES:
        inp = agit_input(case_id, shape, dtype, transposed, rank)
        target = torch.full(out_shape(world), -7).to(dtype)
        ptr = target.data_ptr()
        ret = compat.all_gather_into_tensor(target, inp, group=None, async_op=async_op)
        waited = ret.wait() if async_op else None
        torch_out = torch.empty_like(target)
        # gloo takes only the concatenated layout; a view of the same memory serves both.
        torch_all_gather(torch_out.view(world * shape[0], *shape[1:]), inp.contiguous())
        agit[case_id] = {
            "out": target,
            "in_place": target.data_ptr() == ptr,
            "returned": "None" if ret is None else type(ret).__name__,
            "waited": waited,
            "completed": ret.is_completed() if async_op else None,
            "torch": torch_out,
        }
    out["agit"] = agit
    return out


compat_batch = once_per_world(
    compat_body, TIMEOUT_S, worlds=WORLDS
)  # the batch on `world` ranks, run once per session


# ------------------------------------------------------------------------------------ tests
def ids(world_cases: list[tuple[int, str]]) -> list[Any]:
    return [pytest.param(w, c, id=f"w{w}-{c}") for w, c in world_cases]


@pytest.mark.parametrize("world, case_id", ids([(w, c[0]) for w in WORLDS for c in A2A_CASES]))
def test_all_to_all(world: int, case_id: str) -> None:
    _, shape, dtype, transposed, _ = next(c for c in A2A_CASES if c[0] == case_id)
    s, g = a2a_dims(case_id)
    leaves, xs = zip(
        *(leaf_and_view(shape(world), dtype, transposed, "a2a", case_id, r) for r in range(world)),
        strict=False,
    )
    expected = [torch.cat([torch.tensor_split(x, world, s)[r] for x in xs], g) for r in range(world)]
    results = [res["a2a"][case_id] for res in compat_batch(world)]
    for r in range(world):
        torch.testing.assert_close(results[r]["y"], expected[r].detach(), msg=lambda m, r=r: f"rank {r}: {m}")
    if dtype == F64:
        loss = sum((y * seeded(y.shape, F64, "a2a", case_id, "w", r)).sum() for r, y in enumerate(expected))
        grads = torch.autograd.grad(loss, leaves)
        for r in range(world):
            torch.testing.assert_close(results[r]["grad"], grads[r], msg=lambda m, r=r: f"rank {r} grad: {m}")


@pytest.mark.parametrize("world", WORLDS, ids=[f"w{w}-x2x5x(3w)x3" for w in WORLDS])
def test_all_to_all_round_trip(world: int) -> None:
    """scatter H / gather S, then scatter S / gather H, gives every rank its input back."""
    for r, res in enumerate(compat_batch(world)):
        x, back = res["round_trip"]
        torch.testing.assert_close(back, seeded((2, 5, 3 * world, 3), F32, "round-trip", r), rtol=0, atol=0)
        torch.testing.assert_close(x, back, rtol=0, atol=0)


@pytest.mark.parametrize("world, case_id", ids([(w, c[0]) for w in WORLDS for c in SPLIT_CASES]))
def test_split_forward_gather_backward(world: int, case_id: str) -> None:
    _, shape, dim, grad_scale = next(c for c in SPLIT_CASES if c[0] == case_id)
    x = seeded(shape, F64, "split", case_id).requires_grad_(True)
    ys = torch.tensor_split(x, world, dim)
    loss = sum((y * seeded(y.shape, F64, "split", case_id, "w", r)).sum() for r, y in enumerate(ys))
    (expected_grad,) = torch.autograd.grad(loss, [x])
    expected_grad = expected_grad * factor(grad_scale, world)
    for r, res in enumerate(compat_batch(world)):
        got = res["split"][case_id]
        torch.testing.assert_close(got["y"], ys[r].detach(), rtol=0, atol=0)
        torch.testing.assert_close(got["grad"], expected_grad, msg=lambda m, r=r: f"rank {r} grad: {m}")


@pytest.mark.parametrize("world, case_id", ids([(w, c[0]) for w in WORLDS for c in GATHER_CASES]))
def test_gather_forward_split_backward(world: int, case_id: str) -> None:
    _, shape, dim, grad_scale = next(c for c in GATHER_CASES if c[0] == case_id)
    full = seeded(shape, F64, "gather", case_id).requires_grad_(True)
    (dfull,) = torch.autograd.grad(
        (torch.sin(full) * seeded(shape, F64, "gather", case_id, "w")).sum(), [full]
    )
    expected_grads = torch.tensor_split(dfull * factor(grad_scale, world), world, dim)
    for r, res in enumerate(compat_batch(world)):
        got = res["gather"][case_id]
        torch.testing.assert_close(got["y"], full.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got["grad"], expected_grads[r], msg=lambda m, r=r: f"rank {r} grad: {m}")


@pytest.mark.parametrize("world, case_id", ids([(w, c[0]) for w in WORLDS for c in AGIT_CASES]))
def test_all_gather_into_tensor(world: int, case_id: str) -> None:
    _, shape, dtype, transposed, out_shape, async_op = next(c for c in AGIT_CASES if c[0] == case_id)
    inputs = [agit_input(case_id, shape, dtype, transposed, r) for r in range(world)]
    expected = torch.stack(inputs).reshape(out_shape(world))
    for r, res in enumerate(compat_batch(world)):
        got = res["agit"][case_id]
        assert got["in_place"], f"rank {r}: output_tensor was not written in place"
        torch.testing.assert_close(got["out"], expected, rtol=0, atol=0, msg=lambda m, r=r: f"rank {r}: {m}")
        torch.testing.assert_close(
            got["out"], got["torch"], rtol=0, atol=0, msg=lambda m, r=r: f"rank {r} vs torch: {m}"
        )
        if async_op:
            assert got["returned"] != "None" and got["waited"] and got["completed"], got
        else:
            assert got["returned"] == "None", got


@pytest.mark.parametrize("world, name", ids([(w, n) for w in WORLDS for n in bad_agit_calls(w)]))
def test_all_gather_into_tensor_bad_output(world: int, name: str) -> None:
    _, exc, fragment = bad_agit_calls(world)[name]
    kind, message = compat_batch(world)[world - 1]["errors"][name]
    assert kind == exc.__name__, message
    assert message.startswith("funcoll.compat.all_gather_into_tensor: "), message
    assert fragment in message, message
