"""Every op that takes sizes refuses bad ones the same way: one validator, one error contract.

``funcoll._base._checks.check_sizes`` is the only size check: a wrong type (no list, a
float/bool/complex tensor, an entry that is no int) is a ``TypeError``, a wrong
value (the wrong count, a negative entry, a tensor of the wrong shape) a
``ValueError``, and the message names the op and the argument. Each bad value is
passed in every size argument of every op, on one process (world 1, nothing to
communicate: the check comes first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import funcoll

X = torch.arange(24.0).reshape(2, 3, 4)

# (op, argument) -> call with that argument set to `bad` and every other one valid (world 1)
SLOTS: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("reduce_scatter", "sizes"): lambda bad: funcoll.reduce_scatter(X, 0, sizes=bad),
    ("all_to_all_v", "send_sizes"): lambda bad: funcoll.all_to_all_v(X, bad),
    ("all_to_all_v", "recv_sizes"): lambda bad: funcoll.all_to_all_v(X, [2], bad),
    ("all_to_all", "scatter_sizes"): lambda bad: funcoll.all_to_all(X, None, 1, 2, scatter_sizes=bad),
    ("all_to_all", "gather_sizes"): lambda bad: funcoll.all_to_all(X, None, 1, 2, gather_sizes=bad),
    ("all_to_all_padded", "send_sizes"): lambda bad: funcoll.all_to_all_padded(X, bad),
    ("gather_padded", "length"): lambda bad: funcoll.gather_padded(X, bad),
    ("gather", "sizes"): lambda bad: funcoll.gather(X, sizes=bad),
    ("scatter", "sizes"): lambda bad: funcoll.scatter(X, 0, sizes=bad),
    ("all_gather_list", "sizes"): lambda bad: funcoll.all_gather_list(X, sizes=bad),
    ("all_gather_ragged", "sizes"): lambda bad: funcoll.all_gather_ragged(X, sizes=bad),
    ("gather_forward_split_backward", "sizes"): lambda bad: funcoll.gather_forward_split_backward(
        X, None, 0, sizes=bad
    ),
}
TAKES_NO_TENSOR = {("all_to_all", "scatter_sizes"), ("all_to_all", "gather_sizes")}
ONE_COUNT = {("gather_padded", "length")}  # one int (or a one-element tensor), not a list

# name -> (bad value for a list argument, bad value for a one-count argument, exception)
BAD: dict[str, tuple[object, object, type[Exception]]] = {
    "str": ("2", "2", TypeError),
    "float-entry": ([2.0], 2.0, TypeError),
    "bool-entry": ([True], True, TypeError),
    "float-tensor": (torch.tensor([2.0]), torch.tensor(2.0), TypeError),
    "bool-tensor": (torch.tensor([True]), torch.tensor(True), TypeError),
    "complex-tensor": (torch.tensor([2j]), torch.tensor(2j), TypeError),
    "too-many": ([1, 1], torch.tensor([1, 1]), ValueError),
    "too-many-tensor": (torch.tensor([1, 1]), torch.tensor([1, 1]), ValueError),
    "2-d-tensor": (torch.tensor([[2]]), torch.tensor([[2]]), ValueError),
    "negative": ([-1], -1, ValueError),
}


def _expected(slot: tuple[str, str], bad: str) -> tuple[object, type[Exception]]:
    for_list, for_one, exc = BAD[bad]
    value = for_one if slot in ONE_COUNT else for_list
    if slot in TAKES_NO_TENSOR and isinstance(value, torch.Tensor):
        exc = TypeError  # a tensor is no list of ints: the type is wrong, whatever its values
    return value, exc


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("slot", list(SLOTS), ids=[f"{op}-{arg}" for op, arg in SLOTS])
def test_bad_sizes_raise_the_same_error_in_every_op(slot: tuple[str, str], bad: str) -> None:
    op, arg = slot
    value, exc = _expected(slot, bad)
    with pytest.raises(exc) as info:
        SLOTS[slot](value)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert message.startswith(f"funcoll.{op}: "), message
    assert f"`{arg}`" in message, message


# The DTensor ops need a mesh: their slots run in one gloo rank (world 1), every bad value in one launch.
DTENSOR_SLOTS = {("from_ragged", "sizes"), ("to_ragged", "sizes")}


def _dtensor_slot_outcomes(rank: int, world: int) -> dict[tuple[str, str, str], tuple[str, str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    calls = {
        ("from_ragged", "sizes"): lambda bad: funcoll.from_ragged(X, group=mesh, sizes=bad),
        ("to_ragged", "sizes"): lambda bad: funcoll.to_ragged(distribute_tensor(X, mesh, [Shard(0)]), bad),
    }
    out = {}
    for (op, arg), call in calls.items():
        for bad in BAD:
            try:
                call(_expected((op, arg), bad)[0])
                out[op, arg, bad] = ("no error", "")
            except Exception as e:  # noqa: BLE001 (the test checks the type and the message)
                out[op, arg, bad] = (type(e).__name__, str(e))
    return out


@pytest.fixture(scope="module")
def dtensor_outcomes() -> dict[tuple[str, str, str], tuple[str, str]]:
    from funcoll.testing import run_ranks

    return run_ranks(_dtensor_slot_outcomes, 1, timeout=60)[0]


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize(
    "slot", sorted(DTENSOR_SLOTS), ids=[f"{op}-{arg}" for op, arg in sorted(DTENSOR_SLOTS)]
)
def test_bad_sizes_raise_the_same_error_in_dtensor_ops(
    slot: tuple[str, str], bad: str, dtensor_outcomes: Any
) -> None:
    op, arg = slot
    kind, message = dtensor_outcomes[op, arg, bad]
    assert kind == _expected(slot, bad)[1].__name__, f"{kind}: {message}"
    assert message.startswith(f"funcoll.{op}: "), message
    assert f"`{arg}`" in message, message


def test_every_size_argument_is_covered() -> None:
    """A public op with a *sizes/length argument that SLOTS does not list fails here."""
    import inspect

    found = set()
    for name in funcoll.__all__:
        fn = getattr(funcoll, name)
        if not callable(fn) or isinstance(fn, type):
            continue
        for p in inspect.signature(fn).parameters:
            if p.endswith("sizes") or p == "length":
                found.add((name, p))
    covered = set(SLOTS) | DTENSOR_SLOTS
    assert found == covered, f"size arguments without a case: {found - covered}"


@pytest.mark.parametrize("op", ["gather", "all_gather_list", "all_gather_ragged"])
def test_given_sizes_must_hold_this_ranks_length(op: str) -> None:
    """`sizes` whose entry for this rank is not its length is refused before communicating."""
    with pytest.raises(ValueError) as info:
        getattr(funcoll, op)(X, sizes=[5])
    message = str(info.value)
    assert message.startswith(f"funcoll.{op}: `sizes`=[5] says rank 0 holds 5, but its x.shape[0]=2"), message
