"""MoE dispatch and combine on one CUDA GPU: ``funcoll.moe`` against the torchtitan-style recipe, in bf16.

Run (needs a CUDA GPU): ``python benchmarks/bench_moe_cuda.py [--tokens 4096 16384 65536]
[--iters 20] [--compiled-tokens 16384]``

One process and a one-rank NCCL group: the token movement of expert parallelism
without the network, on one GPU. What it measures is the part of a dispatcher a
GPU runs whatever the world size: the layout (counting, sorting, copying the
routed rows into each expert's block and back), the host syncs, and the
collectives' one-rank form (the recipe's all_to_alls are NCCL's one-rank
copies; funcoll's ops compute a one-rank group's result locally). It is not
the network's bandwidth.

Each step is a training step of one MoE layer: dispatch, the experts, combine
with the router weights, then the backward of ``(out * g).sum()`` down to the
tokens, the router weights and the experts' weights. ``T`` tokens of ``H``
bf16 features, top-``K`` routing over ``E`` experts drawn uniformly. Two expert
forms:

- ``identity``: the experts return their rows: the step is the dispatcher alone.
  Its ``x copy`` column is the step's time over the time of copying the routed
  rows (``T * K`` rows of ``H``) device to device four times: dispatch and
  combine each move them once forward and once backward, so a dispatcher that
  only copied would measure 1.0 there.
- ``grouped_mm``: two grouped GEMMs (``torch._grouped_mm``, bf16, ``H -> F -> H``)
  on the expert blocks, the ``offs`` of each from the dispatcher (funcoll:
  ``handle.ends``; the recipe: the cumulative sum of its counts).

Methods: ``titan`` (``bench_moe.titan_layer``: counts exchanged, the splits read
on the host with ``.tolist()``, the rows moved by funcol's ``all_to_all_single``,
permuted into expert order by an argsort), and ``funcoll.moe`` exact, static
(capacity factor 1.25) and dropless (a ``Dropless`` policy from the same
capacity). With ``--compiled-tokens``, funcoll's static layer also runs under
``torch.compile(fullgraph=True)`` (inductor) at that ``T``.

Times: the median over `iters` steps after two warm-ups, each step timed from
the host with ``torch.cuda.synchronize()`` after it (a host sync inside the
step stalls the host there, and that is part of its cost). Host syncs per step:
CUDA's own count (``torch.cuda.set_sync_debug_mode("warn")``: every call that
makes the host wait for the device warns), and funcoll's count of ``.tolist()``
/ ``.item()`` calls.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _timing import gpu_median_ms  # benchmarks/, beside this script
from bench_moe import CAPACITY_FACTOR, K, funcoll_layer, titan_layer  # benchmarks/, beside this script

from funcoll import moe, testing

H, F, E = 2048, 1024, 8
BF16 = torch.bfloat16


def cuda_syncs(fn: Callable[[], object]) -> int:
    """How many times one call of `fn` makes the host wait for the device (CUDA's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


class GroupedMM:
    """Two grouped GEMMs over the expert blocks, ``H -> F -> H``, bf16 (torchtitan's GroupedExperts' shape)."""

    def __init__(self, gen: torch.Generator) -> None:
        # _grouped_mm takes its second operand column-major: (E, out, in) transposed
        w1 = torch.randn(E, F, H, generator=gen, device="cpu") / math.sqrt(H)
        w2 = torch.randn(E, H, F, generator=gen, device="cpu") / math.sqrt(F)
        self.w1 = w1.to("cuda", BF16).requires_grad_()
        self.w2 = w2.to("cuda", BF16).requires_grad_()

    def __call__(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        h = torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=ends)
        return torch._grouped_mm(torch.relu(h), self.w2.transpose(-2, -1), offs=ends)

    def titan(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self(rows, torch.cumsum(counts, 0).to(torch.int32))

    def funcoll(self, recv: torch.Tensor, handle: moe.MoEHandle) -> torch.Tensor:
        return self(recv, handle.ends)


def _bench(t: int, iters: int, compiled: bool) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=gen).to("cuda", BF16).requires_grad_()
    idx = torch.rand(t, E, generator=gen).argsort(1)[:, :K].contiguous().cuda()
    w = torch.rand(t, K, generator=gen).to("cuda", BF16).requires_grad_()
    g = torch.randn(t, H, generator=gen).to("cuda", BF16)
    experts = GroupedMM(gen)
    capacity = math.ceil(CAPACITY_FACTOR * t * K)
    rows = []
    src, dst = x.detach().new_ones(t * K, H), x.detach().new_empty(t * K, H)  # the routed rows
    copy_ms = gpu_median_ms(lambda: [dst.copy_(src) for _ in range(4)], iters)
    for form in ("identity", "grouped_mm"):
        ex_t = experts.titan if form == "grouped_mm" else None
        ex_f = experts.funcoll if form == "grouped_mm" else None
        policy = moe.Dropless(capacity)
        layer = functools.partial(funcoll_layer, world=1, experts=ex_f, e_local=E)
        forwards: dict[str, Callable[[], torch.Tensor]] = {
            "titan": lambda ex_t=ex_t: titan_layer(x, idx, w, 1, ex_t, E),
            "funcoll.moe exact": lambda layer=layer: layer(x, idx, w, mode="exact"),
            "funcoll.moe static": lambda layer=layer: layer(x, idx, w, mode="static"),
            "funcoll.moe dropless": lambda layer=layer, p=policy: p.run(layer, x, idx, w, mode=p),
        }
        if compiled:
            static_c = torch.compile(functools.partial(layer, mode="static"), fullgraph=True, dynamic=False)
            forwards["funcoll.moe static, compiled"] = lambda f=static_c: f(x, idx, w)

        def step(fwd: Callable[[], torch.Tensor]) -> torch.Tensor:
            x.grad = w.grad = experts.w1.grad = experts.w2.grad = None
            out = fwd()
            (out * g).sum().backward()
            return out

        ref = step(forwards["titan"]).detach().float()
        for name, fwd in forwards.items():
            row: dict[str, Any] = {"tokens": t, "form": form, "method": name}
            try:
                out = step(fwd).detach().float()
                row["max_err"] = float((out - ref).abs().max() / ref.abs().max())  # outside the timed steps
                run = functools.partial(step, fwd)
                row["cuda_syncs"] = cuda_syncs(run)
                with testing.count_host_reads() as reads:
                    run()
                row["host_reads"] = reads.count
                row["ms"] = gpu_median_ms(run, iters)
            except Exception as e:  # noqa: BLE001 -- a method that fails here is reported, the others go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
        for row in rows[-len(forwards) :]:
            row["copy_ms"] = copy_ms
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compiled-tokens", type=int, default=16384, help="0: no compiled method")
    args = parser.parse_args()
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        print(
            f"torch {torch.__version__}, {torch.cuda.get_device_name()}, one-rank NCCL group; "
            f"H={H}, F={F} bf16, E={E}, k={K}, capacity factor {CAPACITY_FACTOR}; a step: forward and backward"
        )
        print(
            "| T | experts | method | ms | x titan | x copy | CUDA syncs / step | .tolist/.item | max rel. err |"
        )
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
        for t in args.tokens:
            rows = _bench(t, args.iters, t == args.compiled_tokens)
            for r in rows:
                if "error" in r:
                    print(f"| {t} | {r['form']} | {r['method']} | failed: {r['error']} |||||")
                    continue
                base = next(b["ms"] for b in rows if b["form"] == r["form"] and b["method"] == "titan")
                copy = f"{r['ms'] / r['copy_ms']:.2f}" if r["form"] == "identity" else ""
                print(
                    f"| {t} | {r['form']} | {r['method']} | {r['ms']:.3f} | {r['ms'] / base:.2f} | {copy} "
                    f"| {r['cuda_syncs']} | {r['host_reads']} | {r['max_err']:.1e} |"
                )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
