"""The pad and the cut around a padded all_gather on CUDA: Triton kernels vs the torch ops.

Run (needs a CUDA GPU and triton): ``python benchmarks/bench_row_kernels.py [--mb 64] [--iters 50]``

No collective runs: this times the local row moves alone, on the layout an all_gather
of `world` padded blocks leaves (rank i's rows at ``i * max(sizes)``), in one process,
side by side. For each world size and layout it times, with CUDA events (median of
`iters` after a warm-up), each move both ways:

- ``pad``: this rank's rows followed by zeros up to ``max(sizes)``;
- ``cut``: the padded blocks -> the ranks' rows packed in order (``gather``'s "pad"
  strategy, ``sum(sizes)`` rows);
- ``pack``: the same into ``world * max`` rows, zeros after (``gather_padded``);
- ``cut+bw``: the cut and its backward, which scatters the gradient back to the
  padded layout (autograd's index_add on the torch path, one kernel on the other).

Then, once per dtype (world 1, layout ``own``: a rank encodes its own rows), the two kernels
of the wire formats (docs/wire.md) on the same `mb` MB of rows:

- ``enc e4m3``/``enc int8``: block maxima, scales and codes, laid out as the bytes
  the collective moves (float8 e4m3 or int8, one scale per 128 values);
- ``dec e4m3``/``dec int8``: those bytes back to the rows' dtype.

``torch`` is funcoll's torch-op path (what runs with ``FUNCOLL_TRITON=0``, and what a
compiled graph holds before inductor fuses it); ``triton`` is the kernel. The ratio
column is triton / torch (below 1: the kernel is faster). Both read the sizes from the
device; neither syncs with the host.

Layouts: ``equal`` (every rank the same rows) and ``skew16`` (rank 0 16x the rows of
the others), float32 and bfloat16 rows of 1024 elements, `mb` MB of rows in all.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch

import funcoll
from funcoll._collective import _quantized, _rows

ROW = 1024


def _time_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _with(mode: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        os.environ["FUNCOLL_TRITON"] = mode
        return fn()

    return run


def _sizes(world: int, layout: str, total_rows: int) -> list[int]:
    weights = [16 if (layout == "skew16" and r == 0) else 1 for r in range(world)]
    return [total_rows * w // sum(weights) for w in weights]


def _moves(sizes: list[int], dtype: torch.dtype, dev: torch.device) -> dict[str, Callable[[], object]]:
    world, longest, total = len(sizes), max(sizes), sum(sizes)
    blocks = torch.randn(world * longest, ROW, device=dev).to(dtype)
    counts = torch.tensor(sizes, device=dev)
    mine = torch.randn(sizes[-1], ROW, device=dev).to(dtype)
    leaf = blocks.clone().requires_grad_()
    grad = torch.randn(total, ROW, device=dev).to(dtype)

    def cut_fw_bw() -> object:  # the cut and its backward (the scatter back to the padded layout)
        return torch.autograd.grad(_rows.cut_padding(leaf, sizes, longest, total), leaf, grad)

    return {
        "pad": lambda: _rows.pad_rows(mine, longest),
        "cut": lambda: _rows.cut_padding(blocks, sizes, longest, total),
        "pack": lambda: _rows.pack(blocks, counts, longest, blocks.shape[0]),
        "cut+bw": cut_fw_bw,
    }


def _codecs(total_rows: int, dtype: torch.dtype, dev: torch.device) -> dict[str, Callable[[], object]]:
    x = torch.randn(total_rows, ROW, device=dev).to(dtype)
    moves: dict[str, Callable[[], object]] = {}
    for name, fmt in (("e4m3", torch.float8_e4m3fn), ("int8", torch.int8)):
        wire = funcoll.Wire(fmt, block=128)
        b = _quantized._encode(x, wire, lead=1)
        moves[f"enc {name}"] = lambda x=x, wire=wire: _quantized._encode(x, wire, lead=1)
        moves[f"dec {name}"] = lambda b=b, wire=wire: _quantized._decode(b, wire, x.shape[1:], dtype)
    return moves


def measure(
    worlds: list[int], mb: float, iters: int, dtypes: tuple[torch.dtype, ...]
) -> list[dict[str, Any]]:
    """Every move's median ms, torch path and kernel, per dtype, world and layout (rows of `mb` MB in all)."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_row_kernels: needs a CUDA GPU (the kernels serve CUDA tensors)")
    rows = []
    for dtype in dtypes:
        total_rows = int(mb * 2**20) // (ROW * dtype.itemsize)
        for world in worlds:
            for layout in ("equal", "skew16"):
                moves = _moves(_sizes(world, layout, total_rows), dtype, torch.device("cuda"))
                for name, fn in moves.items():
                    rows.append({
                        "world": world, "layout": layout, "dtype": str(dtype)[6:], "move": name,
                        "torch_ms": _time_ms(_with("0", fn), iters), "triton_ms": _time_ms(_with("auto", fn), iters),
                    })  # fmt: skip
        for name, fn in _codecs(total_rows, dtype, torch.device("cuda")).items():
            rows.append({
                "world": 1, "layout": "own", "dtype": str(dtype)[6:], "move": name,
                "torch_ms": _time_ms(_with("0", fn), iters), "triton_ms": _time_ms(_with("auto", fn), iters),
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 64])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    rows = measure(args.worlds, args.mb, args.iters, (torch.float32, torch.bfloat16))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; median ms of {args.iters}")
    print(f"{'world':>5} {'layout':>7} {'dtype':>9} {'move':>8} {'torch':>8} {'triton':>8} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['world']:>5} {r['layout']:>7} {r['dtype']:>9} {r['move']:>8} "
            f"{r['torch_ms']:8.3f} {r['triton_ms']:8.3f} {r['triton_ms'] / r['torch_ms']:6.2f}"
        )


if __name__ == "__main__":
    main()
