"""funcoll's main job: a multi-rank tour of the ops on CPU ranks it starts itself.

Run ``python -m funcoll.demo [--world N]``. It starts N gloo processes, and on
each one runs the collectives eagerly and under ``torch.compile(fullgraph=True)``,
checks every result and gradient against a single-process computation of the same
global result, and prints one line per op. It exits non-zero if anything differs.
"""

from __future__ import annotations

import argparse
import sys

import torch

import funcoll
from funcoll.testing import run_ranks


def _rank_rows(rank: int, n: int, width: int = 3) -> torch.Tensor:
    """Rank `rank`'s ragged input: n rows whose values say where they came from."""
    return torch.arange(n * width, dtype=torch.float64).view(n, width) + 100 * rank


def _lengths(world: int, step: int) -> list[int]:
    return [(3 * r + 2 * step) % 5 for r in range(world)]  # 0 included on purpose


def _tour(rank: int, world: int) -> list[tuple[str, bool, str]]:
    lines: list[tuple[str, bool, str]] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor, what: str, also: bool = True) -> None:
        lines.append((name, also and bool(torch.allclose(got, want)), what))

    # Ragged gather of variable-length sequences: values and the adjoint gradient.
    sizes = _lengths(world, 0)
    full = torch.cat([_rank_rows(r, n) for r, n in enumerate(sizes)])
    x = _rank_rows(rank, sizes[rank]).requires_grad_()
    y = funcoll.gather(x)
    (y.sin().sum()).backward()
    off = sum(sizes[:rank])
    want_grad = world * full.cos()[off : off + sizes[rank]]  # every rank's loss reaches every row
    check("gather (ragged)", y.detach(), full, f"sizes {sizes} -> {tuple(y.shape)}")
    check("  backward", x.grad, want_grad, "ragged reduce_scatter of the gradient")

    # all_to_all: sequence-sharded (B, S/w, H, D) -> head-sharded (B, S, H/w, D).
    heads, seq = 2 * world + 1, 2
    g = torch.Generator().manual_seed(0)
    glob = torch.randn(1, seq * world, heads, 4, generator=g, dtype=torch.float64)
    mine = glob[:, rank * seq : (rank + 1) * seq]
    out = funcoll.all_to_all(mine, None, scatter_dim=2, gather_dim=1)
    hs = torch.tensor_split(torch.arange(heads), world)[rank]
    check("all_to_all", out, glob[:, :, hs], f"{tuple(mine.shape)} -> {tuple(out.shape)} (H={heads} uneven)")

    # reduce_scatter and all_reduce against sums over the ranks' inputs.
    parts = [torch.arange(world * 2.0) * (r + 1) for r in range(world)]
    total = sum(parts)
    rs = funcoll.reduce_scatter(parts[rank])
    check("reduce_scatter", rs, total[2 * rank : 2 * rank + 2], "sum, this rank's slice")
    check("all_reduce", funcoll.all_reduce(parts[rank]), total, "sum")

    # all_to_all_v: MoE-style dispatch with uneven send sizes.
    send = [(rank + j) % 3 for j in range(world)]
    xs = torch.cat([torch.full((n,), 10.0 * rank + j) for j, n in enumerate(send)])
    got, recv = funcoll.all_to_all_v(xs, send)
    want = torch.cat([torch.full(((i + rank) % 3,), 10.0 * i + rank) for i in range(world)])
    check("all_to_all_v", got, want, f"send {send} recv {recv.tolist()}")  # host sync: demo print

    # Static shapes: the same rows padded to a bound, the lengths kept on the device.
    bound = 4
    padded = torch.cat(
        [_rank_rows(rank, sizes[rank]), torch.zeros(bound - sizes[rank], 3, dtype=torch.float64)]
    )
    yp, lens = funcoll.gather_padded(padded, torch.tensor(sizes[rank]))
    want_padded = torch.cat([full, full.new_zeros(world * bound - full.shape[0], 3)])
    lens_ok = lens.tolist() == sizes  # host sync: the demo's check
    check(
        "gather_padded",
        yp,
        want_padded,
        f"bound {bound} -> {tuple(yp.shape)}, sizes stay on the device",
        lens_ok,
    )

    # MoE dispatch with a capacity: the same exchange as all_to_all_v, shapes static.
    cap = 2
    blocks = torch.zeros(world * cap)
    for j, n in enumerate(send):
        blocks[j * cap : j * cap + n] = 10.0 * rank + j
    got_p, recv_p = funcoll.all_to_all_padded(blocks, torch.tensor(send))
    check("all_to_all_padded", got_p, torch.cat([want, want.new_zeros(world * cap - want.numel())]),
          f"capacity {cap} -> {tuple(got_p.shape)}, recv sizes stay on the device",
          torch.equal(recv_p, recv))  # fmt: skip

    # The same ragged step compiled: one graph, no recompiles as sizes change.
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda t: funcoll.gather(t).square().sum(), backend=counter, fullgraph=True)
    ok = True
    for i in range(1, 6):
        sz = _lengths(world, i)
        ref = torch.cat([_rank_rows(r, n) for r, n in enumerate(sz)]).square().sum()
        ok &= bool(torch.allclose(step(funcoll.mark_ragged(_rank_rows(rank, sz[rank]))), ref))
    lines.append(
        ("compiled gather", ok and counter.frame_count == 1, f"5 size sets, {counter.frame_count} compile")
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3, help="number of CPU ranks (default 3)")
    args = parser.parse_args(argv)
    results = run_ranks(_tour, args.world, timeout=300)
    print(f"funcoll {funcoll.__version__} demo on {args.world} gloo ranks (torch {torch.__version__})")
    failed = False
    for i, (name, _, what) in enumerate(results[0]):
        ok = all(r[i][1] for r in results)
        failed |= not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {name:<18} {what}")
    print("all results match the single-process reference" if not failed else "MISMATCH: see FAIL lines")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
