"""``@entry`` (funcoll/_ops/_entry.py), the one entry of every op, in one process (no group: world 1).

The ops' results through the entry are checked against references at 1-4 ranks by
their own modules; here, what the entry itself promises: a call the op's signature
refuses gets Python's own error, tensor arguments are checked by name, a resolved
``funcoll.Group`` passes as it is, and a wrongly declared entry fails at import.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import funcoll
import funcoll.moe
from funcoll._ops._entry import Refusal, entry


def _message(call) -> str:
    with pytest.raises(TypeError) as info:
        call()
    return str(info.value)


# Plain functions with the ops' signatures: what Python says about a bad call to them.
def all_gather(x, dim=0, *, group=None, tiled=True): ...
def split_forward_gather_backward(x, group, dim, grad_scale=None): ...


@pytest.mark.parametrize(
    ("op", "plain", "args", "kwargs"),
    [
        (funcoll.all_gather, all_gather, (torch.ones(2), 0, None), {}),  # group is keyword-only
        (funcoll.all_gather, all_gather, (torch.ones(2),), {"x": torch.ones(2)}),  # x twice
        (funcoll.all_gather, all_gather, (torch.ones(2),), {"axis": 0}),  # no such argument
        (funcoll.all_gather, all_gather, (), {"dim": 0}),  # x missing
        (funcoll.split_forward_gather_backward, split_forward_gather_backward, (torch.ones(2),), {}),
    ],
    ids=["too-many-positional", "x-twice", "unknown-keyword", "x-missing", "group-missing"],
)
def test_a_call_the_signature_refuses_gets_pythons_own_error(op, plain, args, kwargs) -> None:
    assert _message(lambda: op(*args, **kwargs)) == _message(lambda: plain(*args, **kwargs))


def test_tensor_arguments_are_checked_by_name_in_order() -> None:
    x, idx = torch.ones(2, 3), torch.zeros(2, 1, dtype=torch.int64)
    assert (
        _message(lambda: funcoll.all_gather([1.0]))
        == "funcoll.all_gather: `x` must be a torch.Tensor, got list"
    )
    assert (
        _message(lambda: funcoll.moe.dispatch(x, [[0], [0]], 2))
        == "funcoll.moe.dispatch: `topk_idx` must be a torch.Tensor, got list"
    )
    assert (  # an optional one, when given
        _message(lambda: funcoll.moe.dispatch(x, idx, 1, counts=[2]))
        == "funcoll.moe.dispatch: `counts` must be a torch.Tensor, got list"
    )
    assert (  # the first bad one, in the declared order
        _message(lambda: funcoll.moe.dispatch(None, None, 1))
        == "funcoll.moe.dispatch: `x` must be a torch.Tensor, got NoneType"
    )


def test_the_group_is_checked_before_the_body_and_a_resolved_group_passes_as_it_is() -> None:
    x = torch.arange(3.0)
    assert _message(lambda: funcoll.all_gather(x, group=3.5)) == (
        "funcoll.all_gather: `group` must be None, a ProcessGroup, a DeviceMesh, (DeviceMesh, mesh_dim) or a "
        "group name, got float"
    )
    single = funcoll.Group(name="", size=1, rank=0)
    for op in (
        lambda g: funcoll.all_gather(x, group=g),
        lambda g: funcoll.gather(x, group=g),
        lambda g: funcoll.all_reduce(x, group=g),
        lambda g: funcoll.split_forward_gather_backward(x, g, 0),  # group by position
    ):
        y = op(single)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # a new tensor, as with group=None


def test_a_wrongly_declared_entry_fails_when_the_op_is_defined() -> None:
    with pytest.raises(TypeError, match=r"funcoll\.bad: the entry names `y`, which is not a parameter"):

        @entry("bad", tensors=("y",), refuse=Refusal("no reason"))
        def bad(x: Tensor, *, group: object = None) -> Tensor: ...

    with pytest.raises(TypeError, match=r"an op's parameters are named"):

        @entry("bad", refuse=Refusal("no reason"))
        def bad_varargs(x: Tensor, *rest: object, group: object = None) -> Tensor: ...


def test_the_entry_is_declared_on_the_op() -> None:
    declared = funcoll.gather.funcoll_entry  # type: ignore[attr-defined]
    assert declared.name == "gather" and declared.tensors == ("x",) and declared.resolves_group
    assert declared.dtensor is not None and declared.refuse is not None
    assert declared.refuse.when is not None and declared.refuse.when({"dst": 0})
    assert not declared.refuse.when({"dst": None})
