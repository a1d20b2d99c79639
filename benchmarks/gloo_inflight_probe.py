"""Probe torch's gloo backend for the heap corruption that keeps funcoll's eager ops waiting on gloo.

Run: ``python benchmarks/gloo_inflight_probe.py [--runs 8] [--steps 3000] [--threads 1|2]
[--wait | --serial]``

No funcoll op runs here: only ``torch.ops._c10d_functional`` on 3 gloo CPU ranks,
started by ``funcoll.testing.run_ranks`` (each run bounded in time). Each step
issues an ``all_gather_into_tensor`` of 22 int64 and waits for it, then issues an
``all_to_all_single`` of random rows (0-4 to each peer, 1-15 columns of float32,
float64, bfloat16 or int64) and leaves it in flight; at most 2 stay in flight, the
oldest waited when a third is issued. ``--wait`` waits each all_to_all at once (the
control). ``--serial`` leaves each all_to_all in flight over the host's work and
waits for it before the next collective is issued: one collective in flight at a
time, what funcoll's eager ops keep on a two-thread gloo group. ``--threads`` builds the ranks' gloo group with that many worker
threads (``funcoll.testing.gloo_worker_threads``; torch's default is 2).

A run fails when a rank dies: glibc aborts ("malloc_consolidate(): unaligned
fastbin chunk detected") or a gloo thread segfaults. Setting
``MALLOC_CHECK_=3`` (with glibc's ``libc_malloc_debug.so`` preloaded, on glibc
2.34 and later) catches more. This is what a program that wants funcoll's
deferred results with collectives in flight together on a two-thread gloo group
(``FUNCOLL_GLOO_DEFER=1``) can run
on its own torch release first; docs/overlap.md has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time

import torch
import torch.distributed as dist

from funcoll import testing

WORLD = 3
F = torch.ops._c10d_functional


def _steps(rank: int, world: int, steps: int, wait_each: bool, serial: bool = False) -> int:
    group = dist.group.WORLD.group_name
    threads = dist.group.WORLD._get_backend(torch.device("cpu")).options._threads
    pending = []
    for step in range(steps):
        rng = random.Random(step)  # the same draws on every rank
        sizes = [rng.choice([0, 1, 2, 3, 4]) for _ in range(world)]
        header = torch.arange(22, dtype=torch.int64) + rank
        while serial and pending:  # funcoll's rule on a two-thread group: one in flight at a time
            F.wait_tensor(pending.pop(0))
        F.wait_tensor(F.all_gather_into_tensor(header, world, group))
        cols = rng.choice([1, 5, 7, 15])
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.int64])
        x = torch.ones(sizes[rank] * world, cols, dtype=dtype)
        out = F.all_to_all_single(x, sizes, [sizes[rank]] * world, group)
        if wait_each:
            F.wait_tensor(out)
            continue
        pending.append(out)
        if len(pending) > 2:
            F.wait_tensor(pending.pop(0))
    for out in pending:
        F.wait_tensor(out)
    return threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=None, help="gloo worker threads (torch's default: 2)")
    parser.add_argument("--wait", action="store_true", help="wait each all_to_all at once (the control)")
    parser.add_argument(
        "--serial",
        action="store_true",
        help="leave each all_to_all in flight over the host's work, wait it before the next collective",
    )
    args = parser.parse_args(argv)
    failed, threads, start = 0, None, time.perf_counter()
    for i in range(args.runs):
        try:
            threads_of_groups = (
                contextlib.nullcontext()
                if args.threads is None
                else testing.gloo_worker_threads(args.threads)
            )
            with threads_of_groups:  # the ranks fork inside it and build their group
                threads = testing.run_ranks(_steps, WORLD, args.steps, args.wait, args.serial, timeout=600)[0]
        except testing.RankError as e:
            failed += 1
            print(f"run {i}: {str(e).splitlines()[0][:200]}", flush=True)
    print(
        f"torch {torch.__version__}, gloo threads {threads if threads is not None else '?'}, "
        f"{'each waited' if args.wait else 'one in flight' if args.serial else 'left in flight'}: "
        f"{failed} of {args.runs} runs of "
        f"{args.steps} steps failed ({time.perf_counter() - start:.0f} s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
