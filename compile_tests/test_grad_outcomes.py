"""Compiled code ends where eager code ends: the same forward, the same backward or the same error.

max, min and product have no gradient (JAX's ``pmax`` has none either): eager code
runs the forward and raises funcoll's ``NotImplementedError`` when the backward
runs, on every rank, before anything is sent. Dynamo traces an autograd.Function's
backward while it traces the forward, so a backward that raised in Python failed
the compile of the forward ("Observed exception"): an amax all-reduce of a tensor
that requires grad (FP8 scaling, gradient-norm clipping) could not be compiled.
Compiled, the gradient now passes through ``funcoll::no_gradient``, which raises
the same error when the compiled backward runs it.

Every reducing op under every ``op`` (and its other argument forms: a ragged
``reduce_scatter``, a quantized one), on an input that requires grad, on 2 gloo
ranks: eager, then compiled with ``fullgraph=True`` on aot_eager (and inductor for
the ops without a gradient), and the outcomes compared: the forward's values,
then the input's gradient or the backward's error, type and message. The ops
whose backward always exists compare their compiled values and gradients with
eager in test_fullgraph.py (every case of ``_ops.CASES``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import funcoll
from funcoll.testing import run_ranks

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
SIZES = [1, 3]  # the ragged reduce_scatter's slices of 4 rows


def _forms() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    forms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for op in REDUCE_OPS:
        forms[f"all_reduce-{op}"] = lambda x, op=op: funcoll.all_reduce(x, op=op)
        forms[f"reduce-dst1-{op}"] = lambda x, op=op: funcoll.reduce(x, 1, op=op)
        forms[f"reduce_scatter-{op}"] = lambda x, op=op: funcoll.reduce_scatter(x, op=op)
        forms[f"reduce_scatter-ragged-{op}"] = lambda x, op=op: funcoll.reduce_scatter(x, op=op, sizes=SIZES)
    for op in ("sum", "max"):
        forms[f"reduce_scatter-wire-bf16-{op}"] = lambda x, op=op: funcoll.reduce_scatter(
            x, op=op, wire=funcoll.Wire(torch.bfloat16)
        )
    return forms


FORMS = _forms()
NO_GRADIENT = ("max", "min", "product")


def _outcome(call: Callable[[torch.Tensor], torch.Tensor], rank: int) -> dict[str, Any]:
    x = (torch.arange(8, dtype=torch.float64).reshape(4, 2) * (rank + 1) - 3).requires_grad_()
    try:
        y = call(x)
    except Exception as e:  # noqa: BLE001 -- the outcome compared
        return {"forward": f"{type(e).__name__}: {e}"}
    out = {"forward": y.detach().clone()}
    try:
        (y * torch.linspace(1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        out["backward"] = x.grad
    except Exception as e:  # noqa: BLE001
        out["backward"] = f"{type(e).__name__}: {e}"
    return out


def _run(rank: int, world: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name, call in FORMS.items():
        modes = ["eager", "aot_eager"] + (["inductor"] if name.endswith(NO_GRADIENT) else [])
        for mode in modes:
            torch._dynamo.reset()
            fn = call if mode == "eager" else torch.compile(call, fullgraph=True, backend=mode)
            results.setdefault(name, {})[mode] = _outcome(fn, rank)
    return results


_RESULTS: list[Any] = []


def _results() -> list[dict[str, dict[str, Any]]]:
    if not _RESULTS:
        _RESULTS.append(run_ranks(_run, 2, timeout=600.0, pg_timeout=120.0))
    return _RESULTS[0]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b)
    return a == b


@pytest.mark.parametrize("form", list(FORMS))
def test_compiled_outcome_is_eager_outcome(form: str) -> None:
    for rank, per_rank in enumerate(_results()):
        eager = per_rank[form]["eager"]
        assert isinstance(eager["forward"], torch.Tensor), eager["forward"]  # every form runs forward
        for mode, got in per_rank[form].items():
            assert set(got) == set(eager), (rank, mode, got)
            for stage in eager:
                assert _same(got[stage], eager[stage]), (rank, mode, stage, got[stage], eager[stage])


@pytest.mark.parametrize("form", [f for f in FORMS if f.endswith(NO_GRADIENT)])
def test_no_gradient_raises_at_backward_naming_the_op(form: str) -> None:
    op = form.split("-")[-1]
    key = form.split("-")[0]
    for per_rank in _results():
        for mode, got in per_rank[form].items():
            assert got["backward"] == (
                f"NotImplementedError: funcoll.{key}: no gradient for op={op!r}; "
                "only 'sum' and 'avg' are differentiable"
            ), (mode, got["backward"])
