"""A compiled funcoll collective takes its payload as it is, as funcol's does.

Each collective of a compiled graph runs under a group name of its own
(:func:`funcoll._base._group.wire_name`), so no compiler merges two of them, and its
input is the tensor the program made: no copy in aot_eager's graphs, no kernel
between the payload's producer and the collective in inductor's code. Three
producers, as in training code: a graph input (FSDP's parameters), a matmul
output (tensor parallelism's row-parallel output) and a pointwise output.
funcol's ``all_gather_tensor`` runs beside them as the shape to match. Values are
checked against single-process references; the graphs and code are read on
every rank of 2 gloo ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

import funcoll
from funcoll.testing import run_ranks

WORLD = 2
N = 4

PRODUCERS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "input": lambda x, w: x,
    "matmul": lambda x, w: x @ w,
    "pointwise": lambda x, w: x * 3 + 1,
}
# funcoll's op, and funcol's for the same collective: the shape to match.
COLLECTIVES: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] = {
    "all_gather": (funcoll.all_gather, lambda p: funcol.all_gather_tensor(p, 0, dist.group.WORLD)),
    "reduce_scatter": (
        funcoll.reduce_scatter,
        lambda p: funcol.reduce_scatter_tensor(p, "sum", 0, dist.group.WORLD),
    ),
    "all_reduce": (funcoll.all_reduce, lambda p: funcol.all_reduce(p, "sum", dist.group.WORLD)),
    "all_to_all": (
        lambda p: funcoll.all_to_all(p, None, 0, 0),
        lambda p: funcol.all_to_all_single(p, None, None, dist.group.WORLD),
    ),
}
ISSUES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_reduce_", "all_to_all_single")
VIEWS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "alias", "squeeze", "unsqueeze", "slice",
         "expand", "as_strided", "select"}  # fmt: skip
COPIES = {"sub", "clone", "copy", "bitwise_xor", "_to_copy", "contiguous"}
# A line of inductor's code that runs a kernel: a fused C++/Triton kernel, or an extern one.
KERNEL = re.compile(r"^\s*(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.\w+)\(")


def _x(rank: int) -> Tensor:
    return torch.arange(float(N * N)).view(N, N) + 100 * rank


def _w() -> Tensor:
    return torch.arange(float(N * N)).view(N, N) / 7


def _reference(coll: str, producer: str, rank: int) -> Tensor:
    ps = [PRODUCERS[producer](_x(r), _w()) for r in range(WORLD)]
    total = sum(ps)
    if coll == "all_gather":
        return torch.cat(ps)
    if coll == "reduce_scatter":
        return total.chunk(WORLD)[rank]
    if coll == "all_reduce":
        return total
    return torch.cat([p.chunk(WORLD)[rank] for p in ps])


def _graph_backend(graphs: list[torch.fx.GraphModule]) -> Any:
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def _collective_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(collective, the op that made its input's data) for every collective in `gm`.

    Views (free in either backend) are walked through to the op that wrote the data.
    """
    out = []
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and str(n.target).startswith("_c10d_functional.")
            and "wait" not in str(n.target)
        ):
            src = n.args[0]
            while src.op == "call_function" and str(src.target).split(".")[1] in VIEWS:
                src = src.args[0]
            made_by = "placeholder" if src.op == "placeholder" else str(src.target).split(".")[1]
            out.append((str(n.target).split(".")[1], made_by))
    return out


def _issue_lines(code: str) -> list[tuple[int, str]]:
    """(line, payload buffer) of every collective issue in inductor's code."""
    lines = code.splitlines()
    found = []
    for i, ln in enumerate(lines):
        m = re.search(r"_c10d_functional\.(\w+)\.default\((\w+),", ln)
        if m and m.group(1) in ISSUES:
            found.append((i, m.group(2)))
    return found


def _kernels_between_producer_and_issue(code: str) -> list[str]:
    """The kernel lines that run after the payload's last writer and before its collective."""
    lines = code.splitlines()
    between = []
    for i, buf in _issue_lines(code):
        writer = max((j for j in range(i) if KERNEL.match(lines[j]) and re.search(rf"\b{buf}\b", lines[j])),
                     default=-1)  # fmt: skip
        start = writer if writer >= 0 else 0
        between += [lines[j].strip() for j in range(start + 1, i) if KERNEL.match(lines[j])]
    return between


def _body(rank: int, world: int) -> dict[str, Any]:
    from torch._inductor.utils import run_and_get_code

    out: dict[Any, Any] = {}
    for coll_name, (ours, theirs) in COLLECTIVES.items():
        for prod_name, prod in PRODUCERS.items():
            for lib, coll in (("funcoll", ours), ("funcol", theirs)):

                def step(x: Tensor, w: Tensor, prod: Any = prod, coll: Any = coll) -> Tensor:
                    return coll(prod(x, w)) * 2

                torch._dynamo.reset()
                graphs: list[torch.fx.GraphModule] = []
                y = torch.compile(step, fullgraph=True, backend=_graph_backend(graphs))(
                    _x(rank).requires_grad_(lib == "funcoll"), _w()
                )
                if lib == "funcoll":  # funcol's ops have no backward to check
                    y.sum().backward()
                torch._dynamo.reset()
                y_ind, codes = run_and_get_code(
                    torch.compile(step, fullgraph=True, backend="inductor"), _x(rank), _w()
                )
                code = "\n".join(codes)
                out[lib, coll_name, prod_name] = {
                    "y": funcoll.wait(y).detach(),
                    "y_ind": y_ind,
                    "inputs": [_collective_inputs(g) for g in graphs],
                    "issues": len(_issue_lines(code)),
                    "between": _kernels_between_producer_and_issue(code),
                    "code": code,
                }
    return out


@pytest.fixture(scope="module")
def compiled() -> list[dict[Any, Any]]:
    return run_ranks(_body, WORLD, timeout=600)


CASES = [(c, p) for c in COLLECTIVES for p in PRODUCERS]


@pytest.mark.parametrize(("coll", "producer"), CASES)
def test_values_match_the_reference(compiled: list[dict[Any, Any]], coll: str, producer: str) -> None:
    for rank, got in enumerate(compiled):
        want = 2 * _reference(coll, producer, rank)
        for lib in ("funcoll", "funcol"):
            torch.testing.assert_close(got[lib, coll, producer]["y"], want)
            torch.testing.assert_close(got[lib, coll, producer]["y_ind"], want)


@pytest.mark.parametrize(("coll", "producer"), CASES)
def test_aot_graphs_send_the_payload_uncopied(
    compiled: list[dict[Any, Any]], coll: str, producer: str
) -> None:
    """Forward and backward: every collective's input comes from the program's own op."""
    for got in compiled:
        inputs = [pair for graph in got["funcoll", coll, producer]["inputs"] for pair in graph]
        assert inputs, got["funcoll", coll, producer]
        copied = [(c, made_by) for c, made_by in inputs if made_by in COPIES]
        assert not copied, f"collectives fed by a copy: {copied} (all: {inputs})"
        if producer == "input":
            assert inputs[0][1] == "placeholder", inputs
        if producer == "matmul":
            assert inputs[0][1] == "mm", inputs


@pytest.mark.parametrize(("coll", "producer"), CASES)
def test_inductor_runs_no_kernel_between_producer_and_collective(
    compiled: list[dict[Any, Any]], coll: str, producer: str
) -> None:
    """funcol's code is the reference: funcoll's runs no kernel that funcol's does not."""
    for got in compiled:
        ours, theirs = got["funcoll", coll, producer], got["funcol", coll, producer]
        assert ours["issues"] >= 1 and theirs["issues"] >= 1, ours["code"]
        assert len(ours["between"]) <= len(theirs["between"]), (
            f"kernels between the payload's producer and the collective: {ours['between']} "
            f"(funcol's: {theirs['between']})\n{ours['code']}"
        )
        if coll != "all_reduce":  # funcol's in-place all_reduce_ copies a payload it may not mutate
            assert not ours["between"], ours["code"]
