"""Inductor moves funcoll's waits past independent work, as it does funcol's.

A step issues a collective, runs a matmul that does not read its result, then
reads it. Compiled with inductor's overlap passes (``reorder_for_compute_comm_overlap``
with sink-waits, raise-comms and reorder-compute), the generated code must issue
the collective before the matmul and wait for it after: funcoll's collective
and ``wait_tensor`` are the bare ``_c10d_functional`` ops the passes move. Each
op's code is read on rank 0 of 2 gloo ranks, and its value checked against a
single-process reference. Ordering is checked, never time
(benchmarks/bench_overlap.py measures it).

Under ``funcoll.set_checks(True)`` the even ops first exchange a header and read
it on the host, then the header of the data collective itself: the data
collective must be issued only after those reads (the check runs before the data
it checks travels), and its wait must still come after the matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import funcoll
from funcoll.testing import run_ranks

WORLD = 2
ROWS, COLS = 4, 8


def _x(rank: int) -> Tensor:
    return torch.arange(float(ROWS * COLS)).view(ROWS, COLS) + 10 * rank


STEPS: dict[str, Callable[[Tensor], Tensor]] = {
    "all_gather": lambda x: funcoll.all_gather(x),
    "reduce_scatter": lambda x: funcoll.reduce_scatter(x),
    "all_to_all": lambda x: funcoll.all_to_all(x, None, 0, 0),
    "gather-sizes": lambda x: funcoll.gather(x, sizes=[ROWS] * WORLD, strategy="a2a"),
}


CHECKED = ["all_gather", "reduce_scatter", "all_to_all"]


def _reference(name: str, rank: int) -> Tensor:
    name = name.removesuffix("-checked")
    xs = [_x(r) for r in range(WORLD)]
    if name == "all_gather":
        return torch.cat(xs)
    if name == "reduce_scatter":
        return (xs[0] + xs[1]).chunk(WORLD)[rank]
    if name == "all_to_all":
        return torch.cat([x.chunk(WORLD)[rank] for x in xs])
    return torch.cat(xs)


def _positions(code: str) -> dict[str, list[int]]:
    lines = code.splitlines()
    calls = lambda ln: not ln.lstrip().startswith(("#", "assert"))  # noqa: E731 -- not comments or checks
    find = lambda *keys: [i for i, ln in enumerate(lines) if calls(ln) and any(k in ln for k in keys)]  # noqa: E731
    return {
        "issue": find(
            "_c10d_functional.all_gather_into_tensor",
            "_c10d_functional.reduce_scatter_tensor",
            "_c10d_functional.all_to_all_single",
        ),
        "mm": find("extern_kernels.mm("),
        "wait": find("_c10d_functional.wait_tensor"),
        "check": find("funcoll.host_ints"),
        "table": find("funcoll.check_table"),
    }


def _body(rank: int, world: int) -> dict[str, Any]:
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    out = {}
    passes = ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]
    with config.patch(reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=passes):
        for name, coll in [*STEPS.items(), *((f"{n}-checked", STEPS[n]) for n in CHECKED)]:
            torch._dynamo.reset()
            funcoll.set_checks(name.endswith("-checked"))

            def step(x: Tensor, w: Tensor, coll: Callable[[Tensor], Tensor] = coll) -> tuple[Tensor, Tensor]:
                y = coll(x)
                z = torch.mm(w, w)  # independent of y
                return y * 2, z

            w = torch.eye(16) * (rank + 1)
            (y, z), codes = run_and_get_code(
                torch.compile(step, fullgraph=True, backend="inductor"), _x(rank), w
            )
            out[name] = {"y": y, "z": z, "code": "\n".join(codes)}
    funcoll.set_checks(False)
    # funcoll.wait inside a graph: the identity (the graph waits for its own collectives)
    waited = torch.compile(lambda x: funcoll.wait({"y": funcoll.all_gather(x)})["y"] * 2, fullgraph=True,
                           backend="aot_eager")  # fmt: skip
    out["wait"] = waited(_x(rank))
    return out


@pytest.fixture(scope="module")
def compiled() -> list[dict[str, Any]]:
    return run_ranks(_body, WORLD, timeout=600)


def test_funcoll_wait_compiles_as_the_identity(compiled: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(compiled):
        torch.testing.assert_close(got["wait"], 2 * _reference("all_gather", rank))


@pytest.mark.parametrize("name", [*STEPS, *(f"{n}-checked" for n in CHECKED)])
def test_wait_comes_after_independent_matmul(compiled: list[dict[str, Any]], name: str) -> None:
    for rank, got in enumerate(compiled):
        r = got[name]
        torch.testing.assert_close(r["y"], 2 * _reference(name, rank))
        torch.testing.assert_close(r["z"], torch.eye(16) * (rank + 1) ** 2)
    pos = _positions(compiled[0][name]["code"])
    assert pos["issue"] and pos["mm"] and pos["wait"], pos
    data_issue = pos["issue"][-1]  # the data collective (a size exchange, if any, comes first)
    assert data_issue < pos["mm"][0] < pos["wait"][-1], (
        f"collective at line {data_issue}, matmul at {pos['mm']}, waits at {pos['wait']}:\n{compiled[0][name]['code']}"
    )


@pytest.mark.parametrize("name", CHECKED)
def test_checked_data_travels_after_the_check(compiled: list[dict[str, Any]], name: str) -> None:
    """The header's host read comes before the data collective, whatever the passes raise.

    So does the data collective's own header (what it is) and its read, after the op's.
    """
    code = compiled[0][f"{name}-checked"]["code"]
    pos = _positions(code)
    assert len(pos["issue"]) == 3 and len(pos["check"]) == 1 and len(pos["table"]) == 1, f"{pos}\n{code}"
    header, what, data = pos["issue"]
    assert header < pos["check"][0] < what < pos["table"][0] < data, (
        f"header at {header}, read at {pos['check']}, collective's header at {what}, read at "
        f"{pos['table']}, data at {data}:\n{code}"
    )
