"""Multi-rank tests of the ragged drop-ins in ``funcoll.compat``: ``gather``, ``all_gather``, ``all_gather_nd``.

They must give what the widely copied originals give: ``gather(tensor, dim=0, dst=None)`` is the
concatenation along `dim` in rank order on every rank (``dst=None``) or on rank `dst` alone
(the others get None), and returns `tensor` itself when torch.distributed is not initialized
or the world has one rank; ``all_gather(q, ws, device)`` is the list of every rank's 1-D `q`
(`ws` must be the world size); ``all_gather_nd(tensor)`` the list of every rank's n-D tensor,
ragged along dim 0. Every rank's input is rebuilt from a seeded generator, so the parent
computes the expected result (``torch.cat`` / the list of inputs) in one process. All cases of
one world size run in ONE run_ranks call.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from funcoll import compat
from funcoll.testing import run_ranks

WORLDS = (1, 2, 3, 4)
DTYPES = ("float32", "float64", "bfloat16", "int64", "bool")
SIZE_PATTERNS = ("seeded", "zero-on-0", "all-zero", "equal")
LAYOUTS = ("contig", "strided", "transposed")
GATHER_GEOMETRIES: tuple[tuple[tuple[int, ...], int], ...] = (
    ((0,), 0),
    ((0, 7), 0),
    ((5, 0), -1),
    ((3, 0, 7), 1),
    ((0, 5, 7), -3),
    ((2, 3, 5, 0), -1),
)
ND_SHAPES: tuple[tuple[int, ...], ...] = ((0, 7), (0, 5, 3), (0, 2, 3, 5), (0, 1))
DEVICES: tuple[Any, ...] = ("cpu", torch.device("cpu"), None)
TIMEOUT = 120.0


@dataclass(frozen=True)
class CompatCase:
    fn: str  # gather | all_gather | all_gather_nd
    world: int
    shape: tuple[int, ...]  # the entry at `dim` is replaced by the rank's length
    dim: int
    sizes: tuple[int, ...]
    dtype: str = "float32"
    layout: str = "contig"
    dst: int | None = None  # gather
    device: Any = "cpu"  # all_gather
    grad: bool = False

    @property
    def id(self) -> str:
        d = self.dim % len(self.shape)
        shape = "x" + "x".join("R" if i == d else str(s) for i, s in enumerate(self.shape))
        fn = self.fn + ("" if self.fn != "gather" else "-all" if self.dst is None else f"-dst{self.dst}")
        device = [f"device-{self.device}"] if self.fn == "all_gather" else []
        parts = [f"w{self.world}", fn, shape, f"dim{self.dim}", self.dtype, self.layout, *device]
        parts.append("sizes" + ".".join(map(str, self.sizes)))
        return "-".join(parts + (["grad"] if self.grad else []))

    def rank_input(self, rank: int) -> Tensor:
        """Rank `rank`'s tensor, rebuilt identically in every process."""
        shape = list(self.shape)
        shape[self.dim % len(shape)] = self.sizes[rank]
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self!r}/{rank}".encode()))
        if self.dtype == "bool":
            x = torch.randint(0, 2, shape, generator=gen).bool()
        elif self.dtype == "int64":
            x = torch.randint(-100, 100, shape, generator=gen)
        else:
            x = torch.randn(shape, generator=gen, dtype=torch.float64).to(getattr(torch, self.dtype))
        if self.layout == "strided":  # every other element of a wider buffer
            buf = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
            buf[..., ::2] = x
            x = buf[..., ::2]
        elif self.layout == "transposed" and x.dim() > 1:
            x = x.transpose(0, -1).contiguous().transpose(0, -1)
        return x.requires_grad_() if self.grad else x

    def weight(self, rank: int, piece: int, shape: torch.Size) -> Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self!r}/w{rank}/{piece}".encode()))
        return torch.randn(shape, generator=gen, dtype=torch.float64)


def pattern_sizes(pattern: str, world: int, seed: int) -> tuple[int, ...]:
    sizes = torch.randint(0, 5, (world,), generator=torch.Generator().manual_seed(seed)).tolist()
    if pattern == "zero-on-0":
        sizes = [0] + [s or 1 for s in sizes[1:]]
    elif pattern == "all-zero":
        sizes = [0] * world
    elif pattern == "equal":
        sizes = [3] * world
    return tuple(sizes)


def make_cases(world: int) -> list[CompatCase]:
    cases: list[CompatCase] = []
    i = 0
    for dst in (None, *range(world)):
        for pattern in SIZE_PATTERNS:
            shape, dim = GATHER_GEOMETRIES[i % len(GATHER_GEOMETRIES)]
            layout = LAYOUTS[i % len(LAYOUTS)] if len(shape) > 1 else LAYOUTS[i % 2]
            sizes = pattern_sizes(pattern, world, 100 * world + i)
            cases.append(CompatCase("gather", world, shape, dim, sizes, DTYPES[i % len(DTYPES)], layout, dst))
            i += 1
    for pattern in SIZE_PATTERNS:
        for k in range(2):
            sizes = pattern_sizes(pattern, world, 100 * world + i)
            dtype, device = DTYPES[i % len(DTYPES)], DEVICES[i % len(DEVICES)]
            cases.append(CompatCase("all_gather", world, (0,), 0, sizes, dtype, LAYOUTS[k], device=device))
            shape = ND_SHAPES[i % len(ND_SHAPES)]
            cases.append(
                CompatCase("all_gather_nd", world, shape, 0, sizes, dtype, LAYOUTS[i % len(LAYOUTS)])
            )
            i += 1
    for pattern in SIZE_PATTERNS[:2]:  # gradients (funcoll's addition to the originals)
        sizes = pattern_sizes(pattern, world, 100 * world + i)
        cases.append(CompatCase("gather", world, (3, 0, 5), -2, sizes, "float64", "transposed", grad=True))
        cases.append(CompatCase("all_gather_nd", world, (0, 5), 0, sizes, "float64", "strided", grad=True))
        i += 1
    assert len({c.id for c in cases}) == len(cases)
    return cases


CASES: dict[int, list[CompatCase]] = {w: make_cases(w) for w in WORLDS}


# --------------------------------------------------------------------------------- rank side
def call(case: CompatCase, x: Tensor) -> Any:
    if case.fn == "gather":
        return compat.gather(x, case.dim, case.dst)
    if case.fn == "all_gather":
        return compat.all_gather(x, case.world, case.device)
    return compat.all_gather_nd(x)


def loss(case: CompatCase, out: Any, rank: int) -> Tensor:
    pieces = out if isinstance(out, list) else [out]
    return sum((p * case.weight(rank, i, p.shape)).sum() for i, p in enumerate(pieces))  # type: ignore[return-value]


def run_case(case: CompatCase, rank: int) -> dict[str, Any]:
    x = case.rank_input(rank)
    out = call(case, x)
    grad = None
    if case.grad:
        loss(case, out, rank).backward()
        grad = x.grad
    if isinstance(out, Tensor):
        is_input, out = out is x, out.detach()
    else:
        is_input, out = False, out if out is None else [o.detach() for o in out]
    return {"out": out, "is_input": is_input, "grad": grad}


def ws_errors(rank: int, world: int) -> dict[str, tuple[str, str]]:
    out = {}
    for ws in (world + 1, world - 1):
        try:
            out[f"ws{ws}"] = ("returned", repr(compat.all_gather(torch.zeros(rank), ws, "cpu")))
        except Exception as e:  # noqa: BLE001 -- recorded for the parent to check on every rank
            out[f"ws{ws}"] = (type(e).__name__, str(e))
    return out


def run_batch(rank: int, world: int, cases: list[CompatCase]) -> dict[str, Any]:
    results = []
    for case in cases:
        try:
            results.append(run_case(case, rank))
        except Exception as e:
            raise RuntimeError(f"rank {rank} failed on case {case.id}: {case!r}") from e
    return {"cases": results, "ws_errors": ws_errors(rank, world)}


class Batches:
    def __init__(self) -> None:
        self._done: dict[int, list[dict[str, Any]]] = {}

    def get(self, world: int) -> list[dict[str, Any]]:
        if world not in self._done:
            self._done[world] = run_ranks(run_batch, world, CASES[world], timeout=TIMEOUT)
        return self._done[world]

    def results(self, case: CompatCase) -> list[dict[str, Any]]:
        i = CASES[case.world].index(case)
        return [r["cases"][i] for r in self.get(case.world)]


@pytest.fixture(scope="module")
def batches() -> Batches:
    return Batches()


# ------------------------------------------------------------------------------ the reference
def expected(case: CompatCase) -> tuple[list[Any], list[Tensor | None]]:
    """Every rank's expected output and x.grad, from every rank's input in this process."""
    xs = [case.rank_input(r) for r in range(case.world)]
    outs: list[Any]
    if case.fn == "gather":
        d = case.dim % len(case.shape)
        outs = [torch.cat(xs, d) if case.dst in (None, r) else None for r in range(case.world)]
    else:
        outs = [list(xs) for _ in range(case.world)]
    grads: list[Tensor | None] = [None] * case.world
    if case.grad:
        sum(loss(case, outs[r], r) for r in range(case.world)).backward()  # type: ignore[union-attr]
        grads = [x.grad for x in xs]
    detached = [
        o.detach() if isinstance(o, Tensor) else o if o is None else [p.detach() for p in o] for o in outs
    ]
    return detached, grads


def check(case: CompatCase, ranks: list[dict[str, Any]]) -> None:
    outs, grads = expected(case)
    for r, (res, want) in enumerate(zip(ranks, outs, strict=False)):
        where = f"{case.id} rank {r}"
        if case.fn == "gather" and case.world == 1:
            assert res["is_input"], f"{where}: a one-rank gather must return the input itself"
        if want is None:
            assert res["out"] is None, f"{where}: expected None, got {res['out']!r}"
        elif isinstance(want, list):
            assert isinstance(res["out"], list) and len(res["out"]) == len(want), f"{where}: {res['out']!r}"
            for i, (g, e) in enumerate(zip(res["out"], want, strict=False)):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, w=f"{where}[{i}]": f"{w}: {m}")
        else:
            torch.testing.assert_close(res["out"], want, rtol=0, atol=0, msg=lambda m, w=where: f"{w}: {m}")
        if case.grad:
            torch.testing.assert_close(res["grad"], grads[r], msg=lambda m, w=where: f"{w} x.grad: {m}")


# ---------------------------------------------------------------------------------------- tests
def params(fn: str) -> list[Any]:
    return [pytest.param(c, id=c.id) for w in WORLDS for c in CASES[w] if c.fn == fn]


@pytest.mark.parametrize("case", params("gather"))
def test_gather(batches: Batches, case: CompatCase) -> None:
    check(case, batches.results(case))


@pytest.mark.parametrize("case", params("all_gather"))
def test_all_gather(batches: Batches, case: CompatCase) -> None:
    check(case, batches.results(case))


@pytest.mark.parametrize("case", params("all_gather_nd"))
def test_all_gather_nd(batches: Batches, case: CompatCase) -> None:
    check(case, batches.results(case))


@pytest.mark.parametrize("world", WORLDS, ids=[f"w{w}" for w in WORLDS])
def test_all_gather_wrong_ws_raises_on_every_rank(batches: Batches, world: int) -> None:
    for rank, res in enumerate(batches.get(world)):
        for ws in (world + 1, world - 1):
            kind, msg = res["ws_errors"][f"ws{ws}"]
            assert kind == "ValueError", f"rank {rank}, ws={ws}: {kind}: {msg}"
            assert msg.startswith(f"funcoll.compat.all_gather: `ws`={ws}") and str(world) in msg, msg


@pytest.mark.parametrize("dst", [None, 0, 1], ids=["dst-None", "dst0", "dst1"])
def test_gather_uninitialized_returns_the_input_itself(dst: int | None) -> None:
    assert not torch.distributed.is_initialized()
    x = torch.arange(6.0).view(2, 3)
    assert compat.gather(x, 1, dst) is x


def test_all_gather_uninitialized_is_one_rank() -> None:
    assert not torch.distributed.is_initialized()
    q = torch.tensor([1.5, 2.3])
    (got,) = compat.all_gather(q, 1, "cpu")
    torch.testing.assert_close(got, q, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^funcoll\.compat\.all_gather: `ws`=2"):
        compat.all_gather(q, 2, "cpu")
    t = torch.arange(15).view(5, 3)
    (got,) = compat.all_gather_nd(t)
    torch.testing.assert_close(got, t, rtol=0, atol=0)
