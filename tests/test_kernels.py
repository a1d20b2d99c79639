"""funcoll's Triton row kernels (``funcoll/_collective/_kernels.py``) and the ops that take them.

The kernels move rows between the padded layout (rank i's ``sizes[i]`` rows at
``i * bound``) and the packed one (at the running sum of the sizes). The references
here are built row by row with ``torch.cat`` of slices and zeros, in the parent.

Without a GPU the kernels run on CPU tensors under ``TRITON_INTERPRET=1``, which
must be set before triton is imported (triton's own library functions are jitted at
import). So every test runs its kernels in fresh child processes (``run_ranks`` with
the spawn start method) whose environment sets it, together with
``FUNCOLL_TRITON=1``, which makes funcoll's eager ops take the kernels for CPU
tensors too. On a CUDA machine the single-process cases run on the GPU, compiled;
the multi-rank ones (gloo, CPU tensors) stay interpreted.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import pytest
import torch
from _inputs import environ, seeded
from torch import Tensor

import funcoll
from funcoll._base._quant import decode, encode
from funcoll._collective._rows import pack_reference
from funcoll.testing import run_ranks

pytest.importorskip("triton")
# Without a GPU the children run the kernels under triton's interpreter, which needs numpy.
if not torch.cuda.is_available():
    pytest.importorskip("numpy", reason="triton's interpreter (TRITON_INTERPRET=1) needs numpy")

TIMEOUT_S = 180.0
F32, F64, BF16, F16, I64, BOOL, C64, U8 = (
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint8,
)  # fmt: skip
I8, E4M3, E5M2 = torch.int8, torch.float8_e4m3fn, torch.float8_e5m2


def run_with_kernels(fn: Callable[..., Any], world: int, interpret: bool) -> list[Any]:
    """``run_ranks(fn, world)`` in fresh processes where funcoll's ops take the kernels, interpreted or not."""
    env = {"FUNCOLL_TEST_START_METHOD": "spawn", "FUNCOLL_TRITON": "1"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    with environ(**env):
        return run_ranks(fn, world, timeout=TIMEOUT_S)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------- references
def ref_pack(blocks: Tensor, sizes: list[int], bound: int, n_out: int) -> Tensor:
    rows = [blocks[i * bound : i * bound + n] for i, n in enumerate(sizes)]
    data = torch.cat(rows) if rows else blocks[:0]
    return torch.cat([data, data.new_zeros((n_out - data.shape[0], *data.shape[1:]))])


def ref_unpack(packed: Tensor, sizes: list[int], bound: int) -> Tensor:
    out, off = [], 0
    for n in sizes:
        out += [packed[off : off + n], packed.new_zeros((bound - n, *packed.shape[1:]))]
        off += n
    return torch.cat(out) if out else packed[:0]


def ref_pad(x: Tensor, n_out: int) -> Tensor:
    return torch.cat([x, x.new_zeros((n_out - x.shape[0], *x.shape[1:]))])


# ------------------------------------------------------------------------- unit cases
# (id, dtype, row shape, sizes, misaligned): bound is max(sizes) + 1, so every rank pads.
UNIT = [
    ("f32-row3-w3", F32, (3,), [2, 0, 3], False),
    ("f64-row5x7-w4", F64, (5, 7), [1, 1, 1, 0], False),
    ("bf16-row7-w2", BF16, (7,), [4, 2], False),
    ("i64-scalar-rows-w5", I64, (), [0, 3, 1, 0, 2], False),
    ("bool-row3-w3", BOOL, (3,), [1, 0, 2], False),
    ("c64-row2x3-w2", C64, (2, 3), [2, 1], False),
    ("u8-row5-w3-odd-bytes", U8, (5,), [3, 3, 1], False),
    ("u8-row8-w2-misaligned", U8, (8,), [2, 3], True),  # byte-offset storage: byte words
    ("f32-row0-w2-empty-rows", F32, (0,), [1, 2], False),
    ("f32-row2-w1", F32, (2,), [3], False),
    ("f32-row2-all-zero-sizes", F32, (2,), [0, 0, 0], False),
    ("f32-row1500-w2-two-column-blocks", F32, (1500,), [2, 1], False),
    ("f32-row2-w70", F32, (2,), [(7 * i) % 4 for i in range(70)], False),  # WORLD_P2 = 128
]


def unit_blocks(case: tuple, device: torch.device) -> Tensor:
    cid, dtype, row, sizes, misaligned = case
    bound = max(sizes) + 1
    shape = (len(sizes) * bound, *row)
    t = seeded(shape, F64, cid).mul(10).to(dtype) if dtype != BOOL else seeded(shape, BOOL, cid)
    t = t.to(device)
    if misaligned:  # one byte into its storage: only byte words fit
        raw = torch.zeros(t.numel() + 1, dtype=U8, device=device)
        raw[1:] = t.reshape(-1)
        t = raw[1:].view(shape)
    return t


# (id, format, block, dtype, row shape, rows). Values span 12
# decades, so blocks hold float8 subnormals, values an int8 code rounds to 0, and
# whole blocks of zeros; "nonfinite" cases hold an inf, a -inf and a NaN.
WIRE_UNIT = [
    ("int8-b4-f32-row9", I8, 4, F32, (9,), 3),
    ("e4m3-b3-bf16-row2x7", E4M3, 3, BF16, (2, 7), 2),
    ("e5m2-whole-f64-row5", E5M2, None, F64, (5,), 3),
    ("e4m3-b4-f16-row8-nonfinite", E4M3, 4, F16, (8,), 3),
    ("e5m2-b4-f32-row8-nonfinite", E5M2, 4, F32, (8,), 2),
    ("int8-b2-f32-scalar-rows", I8, 2, F32, (), 4),
    ("int8-whole-f32-row600-three-steps", I8, None, F32, (600,), 1),  # a loop of CHUNK-value steps
    ("e4m3-b128-f32-row300-partial", E4M3, 128, F32, (300,), 2),
    ("e5m2-b4-f32-no-rows", E5M2, 4, F32, (6,), 0),
    ("int8-b4-f32-empty-rows", I8, 4, F32, (3, 0), 2),
]


def wire_x(case: tuple) -> Tensor:
    cid, _, _, dtype, row, rows = case
    x = seeded((rows, *row), F64, cid) * 10.0 ** seeded((rows, *row), F64, cid, "e").mul(3).round().clamp(
        -8, 4
    )
    flat = x.view(-1)
    flat[: min(4, flat.numel())] = 0.0  # an all-zero block (the first, for blocks up to 4)
    if "nonfinite" in cid:
        flat[5], flat[9], flat[-1] = float("inf"), float("nan"), float("-inf")
    return x.to(dtype)


def _run_unit(rank: int, world: int) -> dict[str, Any]:
    device = _device()
    from funcoll._collective import _kernels

    out = {}
    for case in UNIT:
        cid, _, _, sizes, _ = case
        bound = max(sizes) + 1
        blocks = unit_blocks(case, device)
        sz = torch.tensor([[n, -1] for n in sizes], device=device)[:, 0]  # a strided view, as funcoll passes
        packed_cut = _kernels.pack_rows(blocks, sz, bound, sum(sizes))
        packed_full = _kernels.pack_rows(blocks, sz, bound, blocks.shape[0])
        out[cid] = {
            "pack_cut": packed_cut.cpu(),
            "pack_full": packed_full.cpu(),
            "unpack": _kernels.unpack_rows(packed_full, sz, bound).cpu(),
            "pad": _kernels.pad_rows(blocks[: sizes[0]], bound + 2).cpu(),
            "pad_empty": _kernels.pad_rows(blocks[:0], 3).cpu(),
        }
    for case in WIRE_UNIT:
        cid, fmt, block, dtype, row, _ = case
        wire, x = funcoll.Wire(fmt, block=block), wire_x(case).to(device)
        b = _kernels.encode_rows(x, wire, lead=1)
        out[cid] = {"bytes": b.cpu(), "values": _kernels.decode_rows(b, wire, row, dtype).cpu()}
        out[cid]["whole"] = _kernels.encode_rows(x, wire).cpu()  # lead 0: x as one tensor
    return out


@pytest.fixture(scope="module")
def unit_results() -> dict[str, Any]:
    return run_with_kernels(_run_unit, 1, interpret=not torch.cuda.is_available())[0]


@pytest.mark.parametrize("case", UNIT, ids=lambda c: c[0])
def test_kernels_match_row_by_row_references(case: tuple, unit_results: dict[str, Any]) -> None:
    cid, dtype, _, sizes, _ = case
    bound = max(sizes) + 1
    blocks = unit_blocks(case, torch.device("cpu"))
    got = unit_results[cid]
    want = {
        "pack_cut": ref_pack(blocks, sizes, bound, sum(sizes)),
        "pack_full": ref_pack(blocks, sizes, bound, blocks.shape[0]),
        "unpack": ref_unpack(ref_pack(blocks, sizes, bound, blocks.shape[0]), sizes, bound),
        "pad": ref_pad(blocks[: sizes[0]], bound + 2),
        "pad_empty": ref_pad(blocks[:0], 3),
    }
    for name, ref in want.items():
        assert got[name].dtype == dtype and got[name].shape == ref.shape, (name, got[name].shape, ref.shape)
        assert torch.equal(got[name], ref), name
    # the torch ops funcoll runs where the kernels do not: the same result, bit for bit
    sz = torch.tensor(sizes)
    assert torch.equal(got["pack_cut"], pack_reference(blocks, sz, bound, sum(sizes), exact=True))
    assert torch.equal(got["pack_full"], pack_reference(blocks, sz, bound, blocks.shape[0]))


@pytest.mark.parametrize("case", WIRE_UNIT, ids=lambda c: c[0])
def test_wire_kernels_match_the_torch_encoding(case: tuple, unit_results: dict[str, Any]) -> None:
    """encode_rows and decode_rows against ``_quant.encode`` and ``decode`` (which test_wire
    bounds against float64): the same bytes, the same values, bit for bit. A block with an
    inf or a NaN decodes as all NaN either way; its codes are not compared (the torch ops
    keep a NaN's code, the kernel writes 0)."""
    cid, fmt, block, dtype, row, rows = case
    wire, x = funcoll.Wire(fmt, block=block), wire_x(case)
    got = unit_results[cid]
    want = encode(x, wire, lead=1)
    values = decode(want, wire, row, dtype)
    torch.testing.assert_close(got["values"], values, rtol=0, atol=0, equal_nan=True)
    finite = x.reshape(rows, prod(row)).isfinite().all(1)
    assert got["bytes"].shape == want.shape and torch.equal(got["bytes"][finite], want[finite]), cid
    if finite.all():
        assert torch.equal(got["whole"], encode(x, wire)), cid
    if "nonfinite" in cid:  # the blocks with an inf or a NaN, and only those, are NaN
        bad = ~x.float().reshape(rows, -1, block).isfinite().all(-1, keepdim=True)
        assert torch.equal(values.reshape(rows, -1, block).isnan(), bad.expand(-1, -1, block)), cid


@pytest.mark.parametrize("case", UNIT, ids=lambda c: c[0])
def test_torch_pack_matches_row_by_row_references(case: tuple) -> None:
    """``_rows.pack_reference``, the kernels' torch twin, against the row-by-row reference; its
    autograd backward (the unpack) too, for the dtypes autograd takes."""
    cid, dtype, _, sizes, _ = case
    bound = max(sizes) + 1
    blocks = unit_blocks(case, torch.device("cpu"))
    sz = torch.tensor(sizes)
    for n_out, exact in ((sum(sizes), True), (sum(sizes), False), (blocks.shape[0], False)):
        got = pack_reference(blocks, sz, bound, n_out, exact=exact)
        assert got.dtype == dtype and torch.equal(got, ref_pack(blocks, sizes, bound, n_out)), (n_out, exact)
    if dtype.is_floating_point and blocks.numel():
        leaf = blocks.detach().clone().requires_grad_()
        packed = pack_reference(leaf, sz, bound, blocks.shape[0])
        grad = seeded(packed.shape, F64, cid, "grad").to(dtype)
        (back,) = torch.autograd.grad(packed, leaf, grad)
        assert torch.equal(back, ref_unpack(grad, sizes, bound))


# ------------------------------------------------------------- the ops that use them
def _rows(rank: int, n: int, width: int = 3, dtype: torch.dtype = F64) -> Tensor:
    return seeded((n, width), dtype, "kernel-op-rows", rank)


def _lengths(world: int) -> list[int]:
    return [(3 * r + 2) % 5 for r in range(world)]  # rank 1 of 3 or 4 holds 0 rows


def _sends(rank: int, world: int) -> list[int]:
    return [(rank + 2 * j + 1) % 5 for j in range(world)]  # 0 to 4: the capacity below


def _block(rank: int, j: int, n: int, cap: int) -> Tensor:
    """Rank `rank`'s block for rank j: n data rows, then padding that must never arrive."""
    return torch.cat(
        [seeded((n, 3), F64, "kernel-op-a2a", rank, j), torch.full((cap - n, 3), 7.0, dtype=F64)]
    )


def _weight(rank: int, shape: torch.Size) -> Tensor:
    return seeded(shape, F64, "kernel-op-w", rank)


def _run_ops(rank: int, world: int) -> dict[str, Any]:
    from funcoll._collective import _kernels

    calls = {"pad_rows": 0, "pack_rows": 0, "unpack_rows": 0, "encode_rows": 0, "decode_rows": 0}

    def spy(name: str, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def counted(*args: Any, **kwargs: Any) -> Tensor:
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name in calls:  # count the launches funcoll makes: the kernels themselves still run
        setattr(_kernels, name, spy(name, getattr(_kernels, name)))
    lengths = _lengths(world)
    out: dict[str, Any] = {}

    x = _rows(rank, lengths[rank]).requires_grad_()
    y = funcoll.gather(x, strategy="pad")
    (y * _weight(rank, y.shape)).sum().backward()
    out["gather-pad"] = (y.detach(), x.grad)

    xt = _rows(rank, lengths[rank]).t().requires_grad_()  # ragged dim 1, non-contiguous
    yt, _ = funcoll.all_gather_ragged(xt, 1, strategy="pad")
    (yt * _weight(rank, yt.shape)).sum().backward()
    out["all_gather_ragged-pad-dim1"] = (yt.detach(), xt.grad)

    xb = _rows(rank, lengths[rank], dtype=BOOL)
    out["gather-pad-bool"] = (funcoll.gather(xb, strategy="pad"), None)

    bound = 5
    xp = torch.cat([_rows(rank, lengths[rank]), torch.full((bound - lengths[rank], 3), 7.0, dtype=F64)])
    xp.requires_grad_()
    yp, sizes = funcoll.gather_padded(xp, torch.tensor(lengths[rank]))
    (yp * _weight(rank, yp.shape)).sum().backward()
    out["gather_padded"] = (yp.detach(), xp.grad, sizes)

    cap = 4
    x2 = torch.cat([_block(rank, j, n, cap) for j, n in enumerate(_sends(rank, world))]).requires_grad_()
    y2, recv = funcoll.all_to_all_padded(x2, torch.tensor(_sends(rank, world)))
    (y2 * _weight(rank, y2.shape)).sum().backward()
    out["all_to_all_padded"] = (y2.detach(), x2.grad, recv)

    xq = _rows(rank, lengths[rank]).requires_grad_()  # int8 there, float8 back: 2 encodes, 2 decodes
    yq = funcoll.gather(xq, strategy="pad", wire=GATHER_WIRE, grad_wire=GATHER_GRAD_WIRE)
    (yq * _weight(rank, yq.shape)).sum().backward()
    out["gather-pad-wire"] = (yq.detach(), xq.grad)

    x3 = _rows(rank, sum(_sends(rank, world))).requires_grad_()  # float8 there, bfloat16 back (a cast)
    y3, _ = funcoll.all_to_all_v(x3, _sends(rank, world), wire=A2A_WIRE, grad_wire=funcoll.Wire(BF16))
    (y3 * _weight(rank, y3.shape)).sum().backward()
    out["all_to_all_v-wire"] = (y3.detach(), x3.grad)
    out["calls"] = calls
    return out


GATHER_WIRE, GATHER_GRAD_WIRE = funcoll.Wire(I8, block=2), funcoll.Wire(E4M3, block=2)
A2A_WIRE = funcoll.Wire(E5M2, block=2)


def _through(t: Tensor, wire: funcoll.Wire) -> Tensor:
    """`t`'s rows as they arrive in `wire`: the torch encoding, which test_wire bounds against float64."""
    return decode(encode(t, wire, lead=1), wire, t.shape[1:], t.dtype)


def _wire_reference(world: int) -> dict[str, Any]:
    """The quantized ops' results and gradients, from the torch encoding of each rank's rows."""
    lengths = _lengths(world)
    offs = [sum(lengths[:r]) for r in range(world)]
    y = torch.cat([_through(_rows(r, n), GATHER_WIRE) for r, n in enumerate(lengths)])
    # Rank r's gradient: every rank j's weight rows for r, each through the format, summed in rank order.
    pieces = [_through(_weight(j, y.shape), GATHER_GRAD_WIRE) for j in range(world)]
    grads = [torch.stack([p[o : o + n] for p in pieces]).sum(0) for o, n in zip(offs, lengths, strict=True)]
    xs = [_rows(r, sum(_sends(r, world))) for r in range(world)]
    start = [[sum(_sends(r, world)[:j]) for j in range(world)] for r in range(world)]
    ys, g3 = [], [torch.empty_like(x) for x in xs]
    for j in range(world):  # rank j gets rank i's rows for j, in rank order; sends back bf16 gradients
        rows = [xs[i][start[i][j] : start[i][j] + _sends(i, world)[j]] for i in range(world)]
        ys.append(_through(torch.cat(rows), A2A_WIRE))
        w = _weight(j, ys[j].shape).to(BF16).to(F64)
        off = 0
        for i, r in enumerate(rows):
            g3[i][start[i][j] : start[i][j] + r.shape[0]] = w[off : off + r.shape[0]]
            off += r.shape[0]
    return {"gather-pad-wire": (y, grads), "all_to_all_v-wire": (ys, g3)}


def _reference(world: int) -> dict[str, Any]:
    lengths = _lengths(world)
    xs = [_rows(r, n).requires_grad_() for r, n in enumerate(lengths)]
    y = torch.cat(xs)
    grads = torch.autograd.grad(sum((y * _weight(r, y.shape)).sum() for r in range(world)), xs)
    xts = [x.detach().t().requires_grad_() for x in xs]
    yt = torch.cat(xts, 1)
    grads_t = torch.autograd.grad(sum((yt * _weight(r, yt.shape)).sum() for r in range(world)), xts)
    yb = torch.cat([_rows(r, n, dtype=BOOL) for r, n in enumerate(lengths)])
    bound = 5
    yp = torch.cat([y.detach(), y.new_zeros(world * bound - y.shape[0], 3)])
    total_w = sum(_weight(j, yp.shape) for j in range(world))
    grads_p = [torch.zeros(bound, 3, dtype=F64) for _ in lengths]
    off = 0
    for r, n in enumerate(lengths):  # d(sum_j loss_j)/d(xp_r): the summed weights at r's packed rows
        grads_p[r][:n] = total_w[off : off + n]
        off += n
    cap = 4
    blocks = [
        torch.cat([_block(r, j, n, cap) for j, n in enumerate(_sends(r, world))]).requires_grad_()
        for r in range(world)
    ]
    ys2, recvs = [], []
    for j in range(world):  # rank j gets every rank's data rows for j, in rank order
        counts = [_sends(i, world)[j] for i in range(world)]
        got = torch.cat([blocks[i][j * cap : j * cap + n] for i, n in enumerate(counts)])
        ys2.append(torch.cat([got, got.new_zeros(world * cap - got.shape[0], 3)]))
        recvs.append(torch.tensor(counts))
    grads2 = torch.autograd.grad(sum((y2 * _weight(r, y2.shape)).sum() for r, y2 in enumerate(ys2)), blocks)
    return {
        "all_to_all_padded": ([y2.detach() for y2 in ys2], grads2, recvs),
        "gather-pad": (y.detach(), grads),
        "all_gather_ragged-pad-dim1": (yt.detach(), grads_t),
        "gather-pad-bool": (yb, None),
        "gather_padded": (yp, grads_p, torch.tensor(lengths)),
    }


@pytest.mark.parametrize("world", [2, 3])  # an even and an odd world; each rank a spawned process
def test_ops_on_the_kernels_match_references(world: int) -> None:
    results = run_with_kernels(_run_ops, world, interpret=True)  # gloo: CPU tensors
    ref, wref = _reference(world), _wire_reference(world)
    for rank, res in enumerate(results):
        for name in ("gather-pad", "all_gather_ragged-pad-dim1", "gather-pad-bool"):
            y, grad = res[name]
            y_ref, grads_ref = ref[name]
            assert torch.equal(y, y_ref), (rank, name)
            if grads_ref is not None:
                torch.testing.assert_close(
                    grad, grads_ref[rank], rtol=1e-12, atol=1e-12, msg=f"{rank} {name}"
                )
        yp, gp, sizes = res["gather_padded"]
        assert torch.equal(yp, ref["gather_padded"][0]) and torch.equal(sizes, ref["gather_padded"][2]), rank
        torch.testing.assert_close(gp, ref["gather_padded"][1][rank], rtol=1e-12, atol=1e-12)
        y2, g2, recv = res["all_to_all_padded"]
        ys2, grads2, recvs = ref["all_to_all_padded"]
        assert torch.equal(y2, ys2[rank]) and torch.equal(recv, recvs[rank]), rank
        torch.testing.assert_close(g2, grads2[rank], rtol=1e-12, atol=1e-12)
        yq, gq = res["gather-pad-wire"]
        assert torch.equal(yq, wref["gather-pad-wire"][0]), rank
        torch.testing.assert_close(gq, wref["gather-pad-wire"][1][rank], rtol=1e-12, atol=1e-12)
        y3, g3 = res["all_to_all_v-wire"]
        assert torch.equal(y3, wref["all_to_all_v-wire"][0][rank]), rank
        assert torch.equal(g3, wref["all_to_all_v-wire"][1][rank]), rank
        # Every gather padded (3 pads, and the quantized one's bytes), cut (3 packs, the
        # quantized one's, and one each in the two static ops), and the backward of the
        # float ones scattered back (2 unpacks, and one each in the static ops; the
        # quantized gather's goes by all_to_all). The quantized gather encodes and
        # decodes its rows and its gradient, all_to_all_v its rows (the bf16 gradient
        # is a cast).
        assert res["calls"] == {
            "pad_rows": 4, "pack_rows": 6, "unpack_rows": 4, "encode_rows": 3, "decode_rows": 3,
        }, (rank, res["calls"])  # fmt: skip
