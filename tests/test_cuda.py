"""funcoll on CUDA tensors: the ops with the Triton row kernels on the GPU, and the deferred wait on NCCL.

Skipped without a CUDA GPU.

- ``test_op_on_cuda`` / ``test_moe_on_cuda``: 2 and 3 NCCL ranks, rank r on
  ``cuda:r``; skipped where the machine has fewer GPUs than ranks. (NCCL refuses
  two ranks on one device, and gloo is no way round it: on torch 2.11 and an
  H100, ``funcol.all_gather_tensor`` on a gloo group with CUDA tensors killed
  both ranks with SIGSEGV, without funcoll, where ``dist.all_gather_into_tensor``
  on the same group worked.) Every op's result and input gradient are compared
  with a single-process reference: the same global computation in plain torch
  ops (concatenations, sums, splits) on every rank's inputs, on the CPU, its
  gradients by autograd through it (the gradient of the sum over ranks of
  ``(y_r * weight_r).sum()``). Eager and compiled (``fullgraph=True``, inductor,
  which generates Triton for the GPU), forward and backward. On CUDA tensors the
  ragged gathers' pad and cut take funcoll's Triton row kernels
  (``funcoll._collective._rows``), so these values and gradients are the kernels' on the GPU.
  Rank 1 of 2 holds no rows of the ragged inputs. The MoE layer runs in float64
  and in bfloat16 (whose weights' gradient CUDA's embedding_bag has no kernel for).
- ``test_wait_holds_the_stream_not_the_host``: one NCCL rank, on any machine with
  a GPU. A collective's eager result is a :class:`funcoll._collective._async.Pending`; its
  wait at first use must make the current stream wait for the collective
  (``wait_tensor`` on NCCL), not block the host. A kernel that spins for about
  half a second is queued first, so the collective (NCCL's stream waits for its
  input on the current stream) cannot finish before it: after the call and after
  the first use the stream must still be busy, and the values, once synchronized,
  must be right. funcoll's ops compute a one-rank group's result locally, so this
  calls the primitive the ops issue through (``_prims.all_gather_p``) on the
  one-rank NCCL group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _inputs import environ, once_per_world, seeded
from torch import Tensor

import funcoll
from funcoll import moe
from funcoll.testing import in_flight, run_ranks

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

WORLDS = (2, 3)
BACKEND = "nccl"
# Ranks start by spawn: a process that has touched CUDA (or run a backward beside a GPU, which
# starts autograd's device threads) cannot fork children that use it.
START_METHOD = {"FUNCOLL_TEST_START_METHOD": "spawn"}
TIMEOUT_S = 420.0
COLS = 5
F64, BF16 = torch.float64, torch.bfloat16


def _rows(world: int) -> list[int]:
    """The ragged inputs' rows per rank: an empty rank at 2 ranks, descending at 3."""
    return [5, 0] if world == 2 else [7, 4, 1]


def _x(rank: int, rows: int, *key: object) -> Tensor:
    return seeded((rows, COLS), F64, "cuda", rank, rows, *key)


def _a2a_sizes(world: int) -> list[list[int]]:
    """``sizes[i][j]``: the rows rank i sends rank j (some 0)."""
    return [[(i + 2 * j) % 3 for j in range(world)] for i in range(world)]


def _padded_input(rank: int, world: int) -> Tensor:
    """gather_padded's input: the ragged rows, then padding rows of -1 up to the bound."""
    x, bound = _x(rank, _rows(world)[rank]), max(_rows(world))
    return torch.cat([x, x.new_full((bound - x.shape[0], COLS), -1.0)])


def _padded_ref(xs: list[Tensor], world: int) -> Tensor:
    data = torch.cat([x[:n] for x, n in zip(xs, _rows(world), strict=True)])
    return torch.cat([data, data.new_zeros(world * xs[0].shape[0] - data.shape[0], COLS)])


# name -> (this rank's input, the op on it, the single-process reference of rank r's result
#          from every rank's input). Inputs are float64 on the CPU; the ranks move them to CUDA.
Input = Callable[[int, int], Tensor]
Op = Callable[[Tensor, int, int], Tensor]
Ref = Callable[[list[Tensor], int, int], Tensor]
CASES: dict[str, tuple[Input, Op, Ref]] = {
    "all_gather": (lambda r, w: _x(r, 2 * w), lambda x, r, w: funcoll.all_gather(x),
                   lambda xs, r, w: torch.cat(xs)),
    "all_gather-dim1": (lambda r, w: _x(r, 2 * w), lambda x, r, w: funcoll.all_gather(x, 1),
                        lambda xs, r, w: torch.cat(xs, 1)),
    "reduce_scatter": (lambda r, w: _x(r, 2 * w), lambda x, r, w: funcoll.reduce_scatter(x),
                       lambda xs, r, w: torch.stack(xs).sum(0).chunk(w)[r]),
    "all_reduce": (lambda r, w: _x(r, 2 * w), lambda x, r, w: funcoll.all_reduce(x),
                   lambda xs, r, w: torch.stack(xs).sum(0)),
    "all_to_all": (lambda r, w: _x(r, 2 * w), lambda x, r, w: funcoll.all_to_all(x, None, 0, 0),
                   lambda xs, r, w: torch.cat([x.chunk(w)[r] for x in xs])),
    "gather-auto": (lambda r, w: _x(r, _rows(w)[r]), lambda x, r, w: funcoll.gather(x),
                    lambda xs, r, w: torch.cat(xs)),
    "gather-sizes": (lambda r, w: _x(r, _rows(w)[r]), lambda x, r, w: funcoll.gather(x, sizes=_rows(w)),
                     lambda xs, r, w: torch.cat(xs)),
    "gather-pad": (lambda r, w: _x(r, _rows(w)[r]),
                   lambda x, r, w: funcoll.gather(x, sizes=_rows(w), strategy="pad"),
                   lambda xs, r, w: torch.cat(xs)),
    "gather-shift": (lambda r, w: _x(r, _rows(w)[r]),
                     lambda x, r, w: funcoll.gather(x, sizes=_rows(w), strategy="shift"),
                     lambda xs, r, w: torch.cat(xs)),
    "gather_padded": (_padded_input, lambda x, r, w: funcoll.gather_padded(x, _rows(w)[r])[0],
                      lambda xs, r, w: _padded_ref(xs, w)),
    "all_to_all_v": (lambda r, w: _x(r, sum(_a2a_sizes(w)[r]), "a2a"),
                     lambda x, r, w: funcoll.all_to_all_v(x, _a2a_sizes(w)[r])[0],
                     lambda xs, r, w: torch.cat([x.split(s)[r] for x, s in zip(xs, _a2a_sizes(w), strict=True)])),
}  # fmt: skip
COMPILED = ("all_gather", "reduce_scatter", "gather-pad", "gather-shift", "gather_padded", "all_to_all_v")


def _weight(name: str, rank: int, y: Tensor) -> Tensor:
    return seeded(y.shape, F64, "weight", name, rank)


def reference(name: str, world: int) -> list[tuple[Tensor, Tensor]]:
    """Every rank's (result, input gradient), computed in this process by plain torch ops and autograd."""
    make, _, ref = CASES[name]
    xs = [make(r, world).requires_grad_() for r in range(world)]
    ys = [ref(xs, r, world) for r in range(world)]
    sum((y * _weight(name, r, y)).sum() for r, y in enumerate(ys)).backward()
    return [(y.detach(), x.grad) for y, x in zip(ys, xs, strict=True)]


def _step(op: Op, x: Tensor, name: str, rank: int, world: int) -> tuple[Tensor, Tensor]:
    x = x.detach().requires_grad_()
    y = op(x, rank, world)
    (y * _weight(name, rank, y).to(y.device)).sum().backward()
    return y.detach(), x.grad


# --------------------------------------------------------------------------------- MoE
E_LOCAL, K, TOKENS = 2, 2, 6


def _routing(rank: int, world: int) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, top-k expert ids, router weights): rank 1 sends every token to rank 0's experts."""
    x = seeded((TOKENS, COLS), F64, "moe", rank)
    ids = torch.arange(TOKENS * K).view(TOKENS, K) * (rank + 1) % (E_LOCAL * world)
    if rank == 1:
        ids = torch.stack([torch.zeros(TOKENS), torch.ones(TOKENS)], 1).long()
    return x, ids, seeded((TOKENS, K), F64, "moe-w", rank).abs()


def _experts(recv: Tensor, handle: moe.MoEHandle, rank: int) -> Tensor:
    """Expert e (global id) scales its rows by e + 1; the expert of a row from the block ends."""
    local = torch.searchsorted(
        handle.ends.long(), torch.arange(recv.shape[0], device=recv.device), right=True
    )
    scale = (rank * E_LOCAL + local.clamp(max=E_LOCAL - 1) + 1).to(recv.dtype)
    return recv * scale.unsqueeze(1)


def _moe_layer(x: Tensor, ids: Tensor, w: Tensor, rank: int, world: int, mode: str) -> Tensor:
    capacity = 2 * TOKENS * K if mode == "static" else None  # drops nothing
    recv, handle = moe.dispatch(x, ids, E_LOCAL * world, mode=mode, capacity=capacity)
    return moe.combine(_experts(recv, handle, rank), handle, w)


def moe_reference(world: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Every rank's (output, token gradient, weight gradient) of the dense layer, by autograd."""
    out = []
    for r in range(world):
        x, ids, w = _routing(r, world)
        x, w = x.requires_grad_(), w.requires_grad_()
        y = (w.unsqueeze(-1) * (ids + 1).to(F64).unsqueeze(-1) * x.unsqueeze(1)).sum(1)
        (y * seeded(y.shape, F64, "moe-g", r)).sum().backward()
        out.append((y.detach(), x.grad, w.grad))
    return out


def _moe_step(
    layer: Callable[..., Tensor], rank: int, world: int, dtype: torch.dtype = F64
) -> tuple[Tensor, Tensor, Tensor]:
    x, ids, w = _routing(rank, world)
    x, ids, w = x.to("cuda", dtype).requires_grad_(), ids.cuda(), w.to("cuda", dtype).requires_grad_()
    y = layer(x, ids, w, rank, world)
    (y * seeded(y.shape, F64, "moe-g", rank).to("cuda", dtype)).sum().backward()
    return tuple(t.to(F64) for t in (y.detach(), x.grad, w.grad))  # type: ignore[return-value]


# ------------------------------------------------------------------------------ the batch
def _cpu(t: Any) -> Any:
    return tuple(v.cpu() for v in funcoll.wait(t))  # the backward's results are still pending: read them


def _attempt(fn: Callable[[], Any]) -> Any:
    """fn's result on the CPU, or the error it raised (the same on every rank: nothing left waiting)."""
    try:
        return _cpu(fn())
    except Exception as e:  # noqa: BLE001 -- reported per case by the parent
        return f"{type(e).__name__}: {e}"


def _body(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    got: dict[str, Any] = {}
    for name, (make, op, _) in CASES.items():
        x = make(rank, world).cuda()
        got[name, "eager"] = _attempt(functools.partial(_step, op, x, name, rank, world))
        if name in COMPILED:
            compiled = torch.compile(op, fullgraph=True, backend="inductor")
            got[name, "compiled"] = _attempt(functools.partial(_step, compiled, x, name, rank, world))
    for mode in ("exact", "static"):
        layer = functools.partial(_moe_layer, mode=mode)
        got["moe", mode] = _attempt(functools.partial(_moe_step, layer, rank, world))
        got["moe", f"{mode}, bf16"] = _attempt(functools.partial(_moe_step, layer, rank, world, BF16))
    static = torch.compile(functools.partial(_moe_layer, mode="static"), fullgraph=True, backend="inductor")
    got["moe", "static, compiled"] = _attempt(functools.partial(_moe_step, static, rank, world))
    torch.cuda.synchronize()
    got["left"] = in_flight()
    return got


# A rank that stays away fails its peers' collective within `pg_timeout`, so a broken
# case costs a minute, not the whole timeout.
_batch = once_per_world(_body, TIMEOUT_S, env=START_METHOD, backend=BACKEND, pg_timeout=60)


def batch(world: int) -> list[dict[str, Any]]:
    """The world's ranks, run once per session (a failed run is re-raised by every test that reads it)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"{world} NCCL ranks need {world} GPUs; this machine has {torch.cuda.device_count()}")
    return _batch(world)


def _check(got: Any, want: tuple[Tensor, ...], what: str, **tol: float) -> None:
    assert not isinstance(got, str), f"{what}: {got}"
    for g, ref, part in zip(got, want, ("value", "gradient", "weight gradient")[: len(want)], strict=True):
        torch.testing.assert_close(g, ref, **tol, msg=lambda s, part=part: f"{what}, {part}: {s}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", list(CASES))
def test_op_on_cuda(world: int, mode: str, name: str) -> None:
    if mode == "compiled" and name not in COMPILED:
        pytest.skip("eager only: its compiled form is covered on the CPU")
    results = batch(world)
    for rank, want in enumerate(reference(name, world)):
        _check(results[rank][name, mode], want, f"{name}, {mode}, rank {rank} of {world}")
        assert results[rank]["left"] == 0


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["exact", "static", "exact, bf16", "static, bf16", "static, compiled"])
def test_moe_on_cuda(world: int, mode: str) -> None:
    results = batch(world)
    # bf16: the tokens, weights and products round to 8 bits of mantissa; the sums of up to
    # k = 2 products and COLS = 5 gradient terms stay within a few of its ulps.
    tol = {"rtol": 2e-2, "atol": 5e-2} if "bf16" in mode else {}
    for rank, want in enumerate(moe_reference(world)):
        _check(results[rank]["moe", mode], want, f"moe {mode}, rank {rank} of {world}", **tol)


# --------------------------------------------------------------------------- NCCL's wait
SPIN_CYCLES = 1 << 30  # about half a second on a GPU clocked near 2 GHz


def _wait_on_nccl(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from funcoll._collective import _async, _prims

    torch.cuda.set_device(0)
    name = dist.group.WORLD.group_name
    x = torch.arange(12.0, device="cuda").view(4, 3)
    # Outside the check: the communicator's lazy set-up, and a first launch of each kernel the
    # check runs (CUDA loads a kernel's module at its first launch, which can wait for the device).
    (_prims.all_gather_p(x, name, 1) * 2).sum().item()  # a host read, to start from an idle device
    torch.cuda._sleep(1)
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(SPIN_CYCLES)
    y = _prims.all_gather_p(x, name, 1)
    after_call = {"busy": not stream.query(), "pending": in_flight(), "type": type(y).__name__}
    z = y * 2  # the first use: the wait, then the multiply, both queued on the stream
    after_use = {
        "busy": not stream.query(),
        "pending": in_flight(),
        "is_pending": isinstance(z, _async.Pending),
    }
    torch.cuda.synchronize()
    return {"after_call": after_call, "after_use": after_use, "z": z.cpu(), "x": x.cpu()}


def test_wait_holds_the_stream_not_the_host() -> None:
    with environ(**START_METHOD):
        (got,) = run_ranks(_wait_on_nccl, 1, timeout=120, backend="nccl")
    assert got["after_call"] == {"busy": True, "pending": 1, "type": "Pending"}
    # The host went on past the wait while the stream was still spinning: nothing blocked it.
    assert got["after_use"] == {"busy": True, "pending": 0, "is_pending": False}
    torch.testing.assert_close(got["z"], got["x"] * 2)
