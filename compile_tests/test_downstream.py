"""Results of ragged ops feed ordinary ops in the same compiled graph.

What the user gets inside ``torch.compile(fullgraph=True)``: the length of a ragged
result along its ragged dim is a sum of **unbacked SymInts**, one per rank. The
size exchange (``funcoll/_collective/_header.py``) all-gathers one header row per rank and
reads the sizes on the host inside the opaque custom op ``funcoll::check_header``;
its ``.tolist()`` turns them into unbacked symbols ``u0, u1, ...`` (dynamo has no
example value to specialize on, and none is ever guarded). funcoll adds these
facts with ``torch._check``:

* every exchanged size is ``>= 0``;
* this rank's own entry equals the local ``x.shape[dim]``, so that symbol is
  replaced by the input's own size (``s0``, or ``u0`` after ``mark_ragged``): on
  rank 0 of 2, ``gather(x)`` has length ``u0 + u2`` where ``x`` has ``u0``;
* the strategy's bounds: ``n - min(sizes) >= 0`` ("auto"), ``max(sizes) - n >= 0``
  ("pad"); ``sum(send_sizes) == x.shape[dim]`` (all_to_all_v) and
  ``sum(sizes) == x.shape[dim]`` (ragged reduce_scatter);
* sizes the caller passed as Python ints (reduce_scatter's `sizes`) equal the
  exchanged ones, so they stay static in the graph; sizes passed as a tensor (or
  taken from ``all_gather_ragged``) are unbacked like the others.

So ops that never ask a yes/no question about the length (matmul, softmax and
layer norm along either dim, reductions, masked ops, slicing, ``reshape(-1, k)``,
indexing with an int or an index tensor, ``repeat_interleave`` with
``output_size``) compile in one graph, and with ``mark_ragged`` on the input the
graph serves every length. A Python branch on the length (``if y.shape[0] > 0``)
is a data-dependent guard: dynamo raises under fullgraph; use ``torch._check``
to state what you know, or branch-free code. Two limits of torch 2.13 itself (a
plain ``mark_unbacked`` input without funcoll fails the same way), so no case
here uses them: the backward of ``cumsum`` along an unbacked length (it asks
``numel() <= 1``), and the backward of a matmul that contracts over an unbacked
length when an operand is a strided view such as ``y.sum(-1) @ y[1]`` for a
``(2, n, k)`` ``y`` (it asks whether a stride ``Max(1, n)`` equals 1).

Every case: world 2, three calls with the local lengths changing (0 and 1
included); forward, input gradients and the gradients of the replicated
parameters (float64) equal the single-process reference, compiled and eager.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.testing import CompileCounterWithBackend

import funcoll
from funcoll.testing import run_ranks

WORLD = 2
FEATURES = 6
TIMEOUT = 240.0
# Each call's local lengths (one entry per rank); every total is at least 3, so
# y[0], y[-1] and y[1:3] are in range.
LENGTHS = [[3, 4], [0, 5], [2, 1]]

Params = dict[str, Tensor]


def _prefixed(where: str) -> Callable[[str], str]:
    """An assert_close `msg` that says where the mismatch is."""
    return lambda message: f"{where}: {message}"


def _seed(*keys: int) -> int:
    seed = 43
    for k in keys:
        seed = (seed * 1_000_003 + k) % (1 << 62)
    return seed


def _params() -> Params:
    """The replicated parameters: the same values on every rank."""
    gen = torch.Generator().manual_seed(_seed(7))
    return {
        "w": torch.randn(FEATURES, 4, generator=gen, dtype=torch.float64),
        "ln_weight": 1 + 0.1 * torch.randn(FEATURES, generator=gen, dtype=torch.float64),
        "ln_bias": 0.1 * torch.randn(FEATURES, generator=gen, dtype=torch.float64),
    }


def _send_sizes(lengths: list[int], rank: int) -> list[int]:
    """all_to_all_v: rank r sends ceil(n/2) of its n rows to rank r+1, the rest to itself."""
    n = lengths[rank]
    send = [0] * len(lengths)
    send[(rank + 1) % len(lengths)] += (n + 1) // 2
    send[rank] += n // 2
    return send


def _aux(lengths: list[int], rank: int) -> Tensor:
    """The step's extra tensor input: an index tensor into the gathered rows, or send sizes."""
    total = sum(lengths)
    return torch.tensor([total - 1, 0, 1, total - 1])


# ------------------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Case:
    """A compiled step and its single-process reference.

    ``step(x, aux, params)`` runs on every rank. ``reference(xs, auxs, params, r)``
    computes rank r's output from every rank's input, using ``params[r]`` (each
    rank's own copy of the replicated parameters, so that their gradients come out
    per rank).
    """

    name: str
    step: Callable[[Tensor, Tensor, Params], Tensor]
    reference: Callable[[list[Tensor], list[Tensor], list[Params], int], Tensor]
    shape: tuple[int, ...] = (-1, FEATURES)  # x.shape, -1 the ragged dim
    ragged_dim: int = 0


def _on_gather(name: str, post: Callable[[Tensor, Tensor, Params], Tensor]) -> Case:
    """A case where `post` consumes ``funcoll.gather(x)`` (rows of every rank, dim 0)."""

    def step(x: Tensor, aux: Tensor, p: Params) -> Tensor:
        return post(funcoll.gather(x), aux, p)

    def reference(xs: list[Tensor], auxs: list[Tensor], ps: list[Params], r: int) -> Tensor:
        return post(torch.cat(xs), auxs[r], ps[r])

    return Case(name, step, reference)


def _segment_sum_step(x: Tensor, aux: Tensor, p: Params) -> Tensor:
    y, sizes = funcoll.all_gather_ragged(x)
    owner = torch.repeat_interleave(torch.arange(WORLD), sizes, output_size=y.shape[0])
    per_rank = torch.zeros(WORLD, FEATURES, dtype=y.dtype).index_add(0, owner, y)
    return per_rank @ p["w"] + sizes.to(y.dtype)[:, None]


def _segment_sum_reference(xs: list[Tensor], auxs: list[Tensor], ps: list[Params], r: int) -> Tensor:
    per_rank = torch.stack([x.sum(0) for x in xs])
    sizes = torch.tensor([x.shape[0] for x in xs], dtype=torch.float64)
    return per_rank @ ps[r]["w"] + sizes[:, None]


def _gather_dim1_step(x: Tensor, aux: Tensor, p: Params) -> Tensor:
    y = funcoll.gather(x, dim=1)  # (2, total, FEATURES)
    return torch.softmax(y @ p["w"], dim=1) * y[1].sum(-1, keepdim=True)


def _gather_dim1_reference(xs: list[Tensor], auxs: list[Tensor], ps: list[Params], r: int) -> Tensor:
    y = torch.cat(xs, 1)
    return torch.softmax(y @ ps[r]["w"], dim=1) * y[1].sum(-1, keepdim=True)


def _moe_step(x: Tensor, send: Tensor, p: Params) -> Tensor:
    """Dispatch rows to ranks, run the 'expert' there, bring the results back."""
    routed, recv = funcoll.all_to_all_v(x, send)
    hidden = torch.relu(routed @ p["w"])
    back, _ = funcoll.all_to_all_v(hidden, recv)
    return torch.softmax(back, dim=-1)


def _moe_reference(xs: list[Tensor], sends: list[Tensor], ps: list[Params], r: int) -> Tensor:
    # Row block j of rank r is processed on rank j, with rank j's copy of w.
    start, blocks = 0, []
    for j, n in enumerate(sends[r].tolist()):
        blocks.append(torch.relu(xs[r][start : start + n] @ ps[j]["w"]))
        start += n
    return torch.softmax(torch.cat(blocks), dim=-1)


def _gfsb_step(x: Tensor, aux: Tensor, p: Params) -> Tensor:
    y = funcoll.gather_forward_split_backward(x, None, 0)
    return F.layer_norm(y, (FEATURES,), p["ln_weight"], p["ln_bias"]) @ p["w"]


def _gfsb_reference(xs: list[Tensor], auxs: list[Tensor], ps: list[Params], r: int) -> Tensor:
    # The backward keeps rank r's slice of its own gradient: the other pieces are constants.
    y = torch.cat([x if i == r else x.detach() for i, x in enumerate(xs)])
    return F.layer_norm(y, (FEATURES,), ps[r]["ln_weight"], ps[r]["ln_bias"]) @ ps[r]["w"]


def _reduce_scatter_step(x: Tensor, aux: Tensor, p: Params) -> Tensor:
    """The adjoint pair in one graph: gather, a row-wise op, then scatter back with the gathered sizes."""
    y, sizes = funcoll.all_gather_ragged(x)
    return funcoll.reduce_scatter(torch.tanh(y @ p["w"]), 0, sizes=sizes)


def _reduce_scatter_reference(xs: list[Tensor], auxs: list[Tensor], ps: list[Params], r: int) -> Tensor:
    start = sum(x.shape[0] for x in xs[:r])
    rows = slice(start, start + xs[r].shape[0])
    return sum(torch.tanh(torch.cat(xs) @ p["w"])[rows] for p in ps)


CASES = [
    _on_gather("gather-matmul", lambda y, aux, p: y @ p["w"]),
    _on_gather("gather-softmax-ragged-dim", lambda y, aux, p: torch.softmax(y @ p["w"], dim=0)),
    _on_gather("gather-softmax-feature-dim", lambda y, aux, p: torch.softmax(y @ p["w"], dim=-1)),
    _on_gather("gather-contract-ragged-dim", lambda y, aux, p: y.T @ (y @ p["w"])),
    _on_gather("gather-sum-ragged-dim", lambda y, aux, p: (y @ p["w"]).sum(0)),
    _on_gather("gather-mean-ragged-dim", lambda y, aux, p: y.mean(0) @ p["w"]),
    _on_gather("gather-int-index", lambda y, aux, p: torch.stack([y[0], y[-1], y[1]]) @ p["w"]),
    _on_gather("gather-slice", lambda y, aux, p: torch.cat([y[1:3], y[-2:], y[:, 1:4].sum(1, True).expand(-1, FEATURES)]) @ p["w"]),
    _on_gather("gather-tensor-index", lambda y, aux, p: y[aux] @ p["w"] + y.index_select(0, aux[:2]).sum()),
    _on_gather("gather-reshape-view", lambda y, aux, p: (y.reshape(-1, 2, 3).sum(1) + y.view(-1).view(-1, 3)[::2]) @ p["w"][:3]),
    _on_gather("gather-layer-norm", lambda y, aux, p: F.layer_norm(y, (FEATURES,), p["ln_weight"], p["ln_bias"])),
    _on_gather("gather-masked", lambda y, aux, p: y.masked_fill(y > 0.5, 0.0) + torch.where(y > 0, y, 0.1 * y) @ p["w"] @ p["w"].T),
    _on_gather("gather-bool-mask-select", lambda y, aux, p: y[y > 0] * 2),
    Case("gather-dim1-softmax", _gather_dim1_step, _gather_dim1_reference, shape=(2, -1, FEATURES), ragged_dim=1),
    Case("all_gather_ragged-segment-sum", _segment_sum_step, _segment_sum_reference),
    Case("all_to_all_v-moe-roundtrip", _moe_step, _moe_reference),
    Case("gather_forward_split_backward-layer-norm", _gfsb_step, _gfsb_reference),
    Case("all_gather_ragged-then-reduce_scatter-sizes", _reduce_scatter_step, _reduce_scatter_reference),
]  # fmt: skip


def _case_aux(case: Case, lengths: list[int], rank: int) -> Tensor:
    if case.step is _moe_step:
        return torch.tensor(_send_sizes(lengths, rank))
    return _aux(lengths, rank)


def _input(case_index: int, call: int, rank: int) -> Tensor:
    case = CASES[case_index]
    n = LENGTHS[call][rank]
    shape = tuple(n if s == -1 else s for s in case.shape)
    gen = torch.Generator().manual_seed(_seed(case_index, call, rank))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _upstream(case_index: int, call: int, rank: int, shape: torch.Size) -> Tensor:
    """The weights of rank `rank`'s loss ``(out * w).sum()``."""
    gen = torch.Generator().manual_seed(_seed(case_index, call, rank, 1))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def _reference(case_index: int, call: int) -> tuple[list[Tensor], list[Tensor], list[Params]]:
    """(outputs, x grads, param grads) per rank for the loss summed over ranks, in one process."""
    case = CASES[case_index]
    lengths = LENGTHS[call]
    xs = [_input(case_index, call, r).requires_grad_() for r in range(WORLD)]
    ps = [{k: v.requires_grad_() for k, v in _params().items()} for _ in range(WORLD)]
    auxs = [_case_aux(case, lengths, r) for r in range(WORLD)]
    outs = [case.reference(xs, auxs, ps, r) for r in range(WORLD)]
    loss = sum((o * _upstream(case_index, call, r, o.shape)).sum() for r, o in enumerate(outs))
    leaves = xs + [t for p in ps for t in p.values()]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    x_grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads[:WORLD], xs, strict=True)]
    flat = [
        g if g is not None else torch.zeros_like(t)
        for g, t in zip(grads[WORLD:], leaves[WORLD:], strict=True)
    ]
    names = list(ps[0])
    p_grads = [
        dict(zip(names, flat[r * len(names) : (r + 1) * len(names)], strict=True)) for r in range(WORLD)
    ]
    return [o.detach() for o in outs], x_grads, p_grads


# ---------------------------------------------------------------------------- rank side
def _run_calls(rank: int, case_index: int, step: Callable[..., Tensor], mark: bool) -> dict[str, Any]:
    case = CASES[case_index]
    outs, x_grads, p_grads = [], [], []
    for call, lengths in enumerate(LENGTHS):
        x = _input(case_index, call, rank).requires_grad_()
        arg = funcoll.mark_ragged(x, case.ragged_dim) if mark else x
        params = {k: v.requires_grad_() for k, v in _params().items()}
        out = step(arg, _case_aux(case, lengths, rank), params)
        (out * _upstream(case_index, call, rank, out.shape)).sum().backward()
        outs.append(out.detach())
        x_grads.append(x.grad if x.grad is not None else torch.zeros_like(x))
        p_grads.append({k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in params.items()})
    return {"outputs": outs, "x_grads": x_grads, "p_grads": p_grads}


def _run_case(rank: int, case_index: int) -> dict[str, Any]:
    case = CASES[case_index]
    out: dict[str, Any] = {}
    try:
        out["eager"] = _run_calls(rank, case_index, case.step, mark=False)
    except Exception:  # noqa: BLE001 -- recorded: the parent reports every rank's error
        out["eager"] = {"error": traceback.format_exc()}
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(case.step, backend=counter, fullgraph=True)
    try:
        out["compiled"] = _run_calls(rank, case_index, compiled, mark=True)
        out["compiled"]["graphs"] = counter.frame_count
    except Exception:  # noqa: BLE001 -- recorded: the parent reports every rank's error
        out["compiled"] = {"error": traceback.format_exc()}
    return out


def _rank_body(rank: int, world: int) -> list[dict[str, Any]]:
    return [_run_case(rank, i) for i in range(len(CASES))]


_RESULTS: list[Any] = []


def _results() -> list[list[dict[str, Any]]]:
    """One run_ranks call for the module, shared by its tests (a failure is cached too).

    The cases can share a run: with mark_ragged every size in the graph is unbacked,
    so all ranks compile the same graph and a compile error is raised on all of them
    before any collective, leaving none behind inside one.
    """
    if not _RESULTS:
        try:
            _RESULTS.append(run_ranks(_rank_body, WORLD, timeout=TIMEOUT))
        except BaseException as e:  # noqa: BLE001 -- a hang or a crash: every test reports it
            _RESULTS.append(e)
    if isinstance(_RESULTS[0], BaseException):
        raise RuntimeError(f"run_ranks on world {WORLD} failed") from _RESULTS[0]
    return _RESULTS[0]


# -------------------------------------------------------------------------------- tests
GRAPH_COUNT_BUGS: dict[str, str] = {}


def _params_for(bugs: dict[str, str]) -> list[Any]:
    params = []
    for i, case in enumerate(CASES):
        marks = [pytest.mark.xfail(strict=True, reason=bugs[case.name])] if case.name in bugs else []
        params.append(pytest.param(i, marks=marks, id=f"w{WORLD}-{case.name}"))
    return params


def _assert_matches(res: dict[str, Any], case_index: int, mode: str) -> None:
    for rank in range(WORLD):
        assert "error" not in res[rank], f"{mode} rank {rank}:\n{res[rank]['error']}"
    for call, lengths in enumerate(LENGTHS):
        ref_outs, ref_x_grads, ref_p_grads = _reference(case_index, call)
        for rank in range(WORLD):
            where = f"{mode}, call {call}, lengths {lengths}, rank {rank}"
            got = res[rank]
            torch.testing.assert_close(got["outputs"][call], ref_outs[rank], msg=_prefixed(where))
            torch.testing.assert_close(
                got["x_grads"][call], ref_x_grads[rank], msg=_prefixed(f"{where} x.grad")
            )
            for name, g in ref_p_grads[rank].items():
                torch.testing.assert_close(
                    got["p_grads"][call][name], g, msg=_prefixed(f"{where} {name}.grad")
                )


@pytest.mark.parametrize("case_index", _params_for({}))
def test_compiled_fullgraph_matches_reference(case_index: int) -> None:
    _assert_matches([r[case_index]["compiled"] for r in _results()], case_index, "compiled")


@pytest.mark.parametrize("case_index", _params_for({}))
def test_eager_matches_reference(case_index: int) -> None:
    _assert_matches([r[case_index]["eager"] for r in _results()], case_index, "eager")


@pytest.mark.parametrize("case_index", _params_for(GRAPH_COUNT_BUGS))
def test_one_graph_serves_every_length(case_index: int) -> None:
    """With mark_ragged, the downstream ops add no guard that a new length would fail."""
    for rank, r in enumerate(_results()):
        res = r[case_index]["compiled"]
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert res["graphs"] == 1, f"rank {rank} compiled {res['graphs']} graphs for lengths {LENGTHS}"
