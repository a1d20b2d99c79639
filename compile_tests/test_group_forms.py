"""Every case compiles with the group passed the way real code passes it.

Real sequence- and tensor-parallel code hands funcoll its own groups: the default
group object, a ``new_group`` subgroup held on a module (``self.spg``), passed as an
argument or reached through a closure, a group name, a DeviceMesh, ``(mesh, dim)``
by index or name. Each form reaches dynamo differently (an opaque script object
as a graph input, a constant from a closure cell or a module attribute, a
string), and each must resolve inside the compiled region with no graph break.

For one or two cases per op and argument set of ``_ops.CASES`` (``at_scale``), with
the group held on a module (``subgroup-attribute``, the Megatron/DeepSpeed form) and
on a 2-rank subgroup of 3 ranks (``test_fullgraph`` compiles every case), and for
``_ops.SMOKE_GROUP_CASES`` (an even collective, a
ragged one, an uneven all_to_all: the three ways a group reaches a collective's
arguments) with each other form, each rank compiles ``case.call`` with ``fullgraph=True`` on a backend that records the
AOT forward and backward graphs (min-cut partitioned, as aot_eager and inductor
split them) and runs them. The outputs and input gradients must equal the
single-process reference; each graph must hold the case's expected collectives,
every one on the group's c10d name. ``sub01-of-3`` is a subgroup of ranks {0, 1}
on 3 ranks, where rank 2 never calls. Inductor compiles the ragged gather (size
header, host read, data collectives) with every form, and its code must name the
group in every collective.
"""

from __future__ import annotations

import functools
import re
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _ops import (
    CASES,
    CASES_BY_ID,
    COLLECTIVE_PREFIX,
    SMOKE,
    SMOKE_GROUP_CASES,
    STOPPED,
    WAIT,
    OpCase,
    collective_counts,
    expected_collectives,
    has_error,
    recording_backend,
    reference_grads,
    reference_outputs,
    run_batch,
    run_case,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import Module

from funcoll.testing import group_of

FORMS_W2 = (
    "world-object",  # dist.group.WORLD, read inside the compiled function
    "subgroup-closure",  # a new_group of every rank, from a closure cell
    "subgroup-attribute",  # ... held by a module as self.pg
    "subgroup-argument",  # ... passed as an argument of the compiled function
    "name",  # the subgroup's c10d name
    "mesh",  # a 1-D DeviceMesh
    "mesh-dim-index",  # (mesh, 0)
    "mesh-dim-name",  # (mesh, "sp")
)
FORMS_W3 = ("sub01-of-3",)
INDUCTOR_CASE = "gather-auto-ragged-x_nx5-dim0"
# The forms that run one or two cases per op and argument set (`at_scale`: every op;
# test_fullgraph compiles every case, on the world group); the others run
# SMOKE_GROUP_CASES (the form decides how the group reaches the op: every op hands it
# to the same resolver).
AT_SCALE_FORMS = ("subgroup-attribute", "sub01-of-3")


def _cases(size: int, form: str) -> list[OpCase]:
    cases = [
        c for c in CASES if c.takes_group and size >= c.min_world and (not SMOKE or c.id in SMOKE_GROUP_CASES)
    ]
    if form in AT_SCALE_FORMS:
        return [c for c in cases if c.at_scale or c.id in SMOKE_GROUP_CASES]
    return [c for c in cases if c.id in SMOKE_GROUP_CASES]


# ------------------------------------------------------------------------- rank side
@functools.cache
def _groups(world: int) -> dict[str, Any]:
    """The groups of this process, made once and in the same order on every rank."""
    sub = dist.new_group(list(range(world)))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    sub01 = dist.new_group([0, 1]) if world == 3 else None
    return {"sub": sub, "mesh": mesh, "sub01": sub01}


def _group_of(form: str, world: int) -> Any:
    """The group object (or name, or mesh form) that `form` hands funcoll; None if this rank is not in it."""
    gs = _groups(world)
    if form == "world-object":
        return dist.group.WORLD
    if form.startswith("subgroup"):
        return gs["sub"]
    if form == "name":
        return gs["sub"].group_name
    if form == "mesh":
        return gs["mesh"]
    if form == "mesh-dim-index":
        return (gs["mesh"], 0)
    if form == "mesh-dim-name":
        return (gs["mesh"], "sp")
    assert form == "sub01-of-3", form
    return gs["sub01"] if dist.get_rank() in (0, 1) else None


def _c10d_name(form: str, world: int) -> str:
    """The c10d name every collective must carry, read off the group objects themselves."""
    gs = _groups(world)
    if form == "world-object":
        return dist.group.WORLD.group_name
    if form.startswith("mesh"):
        return gs["mesh"].get_group(0).group_name
    return (gs["sub01"] if form == "sub01-of-3" else gs["sub"]).group_name


class _Holder(Module):
    """Megatron/DeepSpeed style: the module keeps its communicator as an attribute."""

    def __init__(self, call: Callable[..., Any], pg: Any) -> None:
        super().__init__()
        self.call, self.pg = call, pg

    def forward(self, *inputs: Any) -> Any:
        return self.call(*inputs, group=self.pg)


def _bind(form: str, case: OpCase, group: Any, compile_: Callable[[Any], Any]) -> Callable[..., Any]:
    """``inputs -> result``: `case.call` on `group`, compiled, the group reaching it as `form` says."""
    call = case.call
    if form == "world-object":
        return compile_(lambda *xs: call(*xs, group=dist.group.WORLD))
    if form == "subgroup-attribute":
        return compile_(_Holder(call, group))
    if form == "subgroup-argument":
        fn = compile_(lambda *xs_and_group: call(*xs_and_group[:-1], group=xs_and_group[-1]))
        return lambda *xs: fn(*xs, group)
    return compile_(lambda *xs: call(*xs, group=group))  # closure: subgroups, names, meshes


def _one(rank: int, world: int, key: str, backend: str) -> dict[str, Any]:
    """One (form, case) on this rank: the compiled run, its graphs or code, and the group's facts."""
    form, case_id = key.split("|")
    case = CASES_BY_ID[case_id]
    group = _group_of(form, world)
    if group is None:
        return {"member": False}
    pg = _group_pg(form, world)
    index, size = dist.get_rank(pg), dist.get_world_size(pg)
    graphs: dict[str, Any] = {}
    torch._dynamo.reset()
    try:
        if backend == "inductor":
            from torch._inductor.utils import run_and_get_code

            fn = _bind(form, case, group, lambda f: torch.compile(f, fullgraph=True, backend="inductor"))
            res, code = run_and_get_code(lambda: run_case(case, index, size, fn))
            graphs["code"] = code
        else:
            compile_ = functools.partial(torch.compile, fullgraph=True, backend=recording_backend(graphs))
            res = run_case(case, index, size, _bind(form, case, group, compile_))
    except Exception:  # noqa: BLE001 -- reported by the test
        res = {"error": traceback.format_exc(limit=-8)}
    finally:
        torch._dynamo.reset()
    return {"member": True, "run": res, "graphs": graphs, "index": index, "size": size,
            "name": _c10d_name(form, world)}  # fmt: skip


def _group_pg(form: str, world: int) -> dist.ProcessGroup:
    gs = _groups(world)
    if form == "world-object":
        return dist.group.WORLD
    if form.startswith("mesh"):
        return gs["mesh"].get_group(0)
    return gs["sub01"] if form == "sub01-of-3" else gs["sub"]


# ----------------------------------------------------------------------- parent side
def _keys(forms: tuple[str, ...], size: int, case_ids: list[str] | None = None) -> list[str]:
    return [f"{form}|{cid}" for form in forms for cid in case_ids or [c.id for c in _cases(size, form)]]


@functools.cache
def _results(world: int, backend: str) -> list[dict[str, Any]]:
    if backend == "inductor":
        keys = _keys(FORMS_W2, 2, [INDUCTOR_CASE])
    else:
        keys = _keys(FORMS_W2, 2) if world == 2 else _keys(FORMS_W3, 2)
    return run_batch(_one, world, keys, backend, timeout=600)


def _member_results(world: int, backend: str, key: str) -> list[dict[str, Any]]:
    out = []
    for rank, per_rank in enumerate(_results(world, backend)):
        if key not in per_rank:
            pytest.fail(f"rank {rank}: not run, the batch stopped before {key}: {per_rank.get(STOPPED)}")
        if per_rank[key]["member"]:
            out.append(per_rank[key])
    return out


def _check_values(case: OpCase, got: list[dict[str, Any]]) -> None:
    size = got[0]["size"]
    assert [g["index"] for g in got] == list(range(size)), "every member ran, in group-rank order"
    want_out = reference_outputs(case, size)
    want_grads = reference_grads(case, size) if case.grad != "none" else None
    for g in got:
        run, i = g["run"], g["index"]
        if has_error({"run": run}):
            pytest.fail(f"group rank {i} raised:\n{run['error']}")
        for k, (o, w) in enumerate(zip(run["outputs"], want_out[i], strict=True)):
            if w is None:
                assert o is None
            else:
                torch.testing.assert_close(o, w, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"output {k}: {m}")
        if want_grads is not None:
            for k, (gr, w) in enumerate(zip(run["grads"], want_grads[i], strict=True)):
                assert gr is not None, f"group rank {i}: input {k} got no gradient"
                torch.testing.assert_close(gr, w, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"grad {k}: {m}")


def _check_graphs(case: OpCase, got: list[dict[str, Any]]) -> None:
    want_fw, want_bw = expected_collectives(case.id, got[0]["size"])
    for g in got:
        graphs, name = g["graphs"], g["name"]
        for kind, want in (("fw", want_fw), ("bw", want_bw)):
            if want is None:
                continue
            calls = graphs[kind]
            counts = collective_counts(calls)
            waits = counts.pop(WAIT, 0)
            assert counts == {k: v for k, v in want.items() if v}, f"{kind}: {counts}, expected {want}"
            assert waits == sum(counts.values()), f"{kind}: {waits} waits for {counts}"
            names = {
                group_of(c["args"][-1])
                for c in calls
                if c["op"].startswith(COLLECTIVE_PREFIX) and not c["op"].endswith(WAIT)
            }
            assert names <= {name}, f"{kind}: collectives on groups {names}, expected {name!r}"


def _params(forms: tuple[str, ...], world: int) -> list:
    return [
        pytest.param(world, form, case, id=f"w{world}-{form}-{case.id}")
        for form in forms
        for case in _cases(2, form)
    ]


@pytest.mark.parametrize(("world", "form", "case"), _params(FORMS_W2, 2) + _params(FORMS_W3, 3))
def test_group_form_compiles_fullgraph_matches_reference_on_its_group(
    world: int, form: str, case: OpCase
) -> None:
    got = _member_results(world, "aot_eager", f"{form}|{case.id}")
    assert len(got) == 2, f"{len(got)} members ran"
    _check_values(case, got)
    _check_graphs(case, got)


# A collective in inductor's code, with its arguments: the group name is the last one.
_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)")


@pytest.mark.parametrize("form", FORMS_W2)
def test_inductor_with_every_group_form(form: str) -> None:
    case = CASES_BY_ID[INDUCTOR_CASE]
    got = _member_results(2, "inductor", f"{form}|{case.id}")
    _check_values(case, got)
    for g in got:
        named = 0
        for module in g["graphs"]["code"]:
            for line in module.splitlines():
                m = _CALL.search(line)
                if m is None or line.lstrip().startswith("#") or m.group(1) == WAIT:
                    continue
                on = m.group(2).rstrip().rsplit(",", 1)[-1].strip().strip("'")
                assert group_of(on) == g["name"], f"not on {g['name']!r}: {line.strip()}"
                named += 1
        fw, bw = expected_collectives(case.id, 2)
        assert named == sum(fw.values()) + sum((bw or {}).values()), f"{named} collectives in the code"
