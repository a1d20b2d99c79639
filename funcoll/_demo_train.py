"""The demo's training run: a tiny transformer, sequence-parallel over ragged token shards.

The data is a packed stream of variable-length documents: each step draws a new
global sequence of ``N`` tokens (``N`` changes every step), cut into documents,
and cuts it into ``world`` contiguous ragged shards, one per rank (some steps
leave a rank with 0 tokens). The task is to predict the previous token of the
same document (the first token of a document predicts itself), so attention
must look back across the shard boundaries.

The model (every parameter replicated, float64): token and in-document position
embeddings, ``LAYERS`` pre-norm blocks of Ulysses attention (``HEADS`` heads,
causal within each document) and an MLP, and a vocabulary head with a
per-token cross-entropy. One step on rank r, the funcoll way:

1. ``funcoll.all_gather_list(seg)``: every rank's document ids, which the
   attention mask needs over the whole sequence; the pieces' lengths are every
   rank's token count, the step's one size exchange (unbacked ints when
   compiled), handed to every later collective so nothing else is exchanged;
2. per block, ``funcoll.all_to_all`` re-shards q, k, v from ragged sequence
   shards to head shards, ``(n_r, H, 3D) -> (N, H_r, 3D)`` (``gather_sizes``:
   the lengths), attention runs over the whole sequence for this rank's heads,
   and ``funcoll.all_to_all`` goes back, ``(N, H_r, D) -> (n_r, H, D)``
   (``scatter_sizes``: the lengths, ``gather_sizes``: the head split; ``H`` need
   not divide by the world);
3. ``funcoll.gather(token_losses, sizes=lengths).mean()``: every rank gets the
   mean over all ``N`` tokens;
4. the backward runs the adjoints (all_to_all back, a ragged reduce_scatter for
   the gather), which sum the ``world`` identical losses' gradients over the
   ranks' parameter copies, so ``funcoll.all_reduce(grads, op="avg")`` gives
   the true gradient; then an SGD update.

The seed-style run (:mod:`funcoll._demo_seeds`) does the same computation with
padded, list-based helpers that exchange sizes on every call, and its loss
gather's backward keeps the rank's slice (the region-op convention), so its
gradients are summed instead. The single-process reference runs the same model
on the whole sequence with every head, no collective at all.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import funcoll

from . import _demo_seeds as seeds
from .testing import count_host_reads

__all__ = [
    "MODES",
    "Config",
    "PhaseResult",
    "RankBatch",
    "progress",
    "reference",
    "train_rank",
]

VOCAB = 16
EMBED = 24
HEADS = 3  # does not divide by 2 or 4 ranks on purpose: Ulysses with uneven head shards
HEAD_DIM = EMBED // HEADS
HIDDEN = 48
LAYERS = 2
MAX_DOC = 12  # the longest document (and the position table's length)
MIN_TOKENS, MAX_TOKENS = 24, 64  # the global sequence length N, drawn per step
LR = 0.5
WARMUP = 2  # steps left out of the timings: the compiled run compiles in its first
PROFILED = 5  # at most this many last steps run under torch.profiler, for the collectives' share

MODES = ("seed", "eager", "compiled")
MODE_TITLES = {
    "seed": "seed-style helpers (eager)",
    "eager": "funcoll eager",
    "compiled": "funcoll compiled",
    "quantized": "funcoll eager, FP8 all_to_alls",
    "reference": "reference (1 process)",
}
TITLE_WIDTH = max(map(len, MODE_TITLES.values())) + 1  # the progress bars start in one column
# --wire: the attention's all_to_alls in float8 e4m3, a scale per head's values (DeepEP's
# dispatch format), their gradients in bfloat16 (docs/wire.md)
WIRE = (funcoll.Wire(torch.float8_e4m3fn, block=HEAD_DIM), funcoll.Wire(torch.bfloat16))
WIRE_RTOL = 0.05  # the quantized run's every loss within 5% of the reference's

Params = dict[str, Tensor]
T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    """What the demo runs: the options of ``python -m funcoll.demo``.

    Args:
        steps: training steps per run.
        device: ``"cpu"`` or ``"cuda"``.
        compile_backend: the ``torch.compile`` backend of the compiled run.
        seed: the seed of the parameters and of every step's batch.
        wire: also train with the attention's all_to_alls in :data:`WIRE`'s formats.
    """

    steps: int = 30
    device: str = "cpu"
    compile_backend: str = "aot_eager"
    seed: int = 0
    wire: bool = False

    @property
    def modes(self) -> tuple[str, ...]:
        """The runs on the ranks, in order: :data:`MODES`, then with `wire` the quantized one."""
        return (*MODES, "quantized") if self.wire else MODES


@dataclass
class PhaseResult:
    """One run on one rank: what the summary table reads.

    Args:
        losses: every step's loss (the global mean, the same on every rank).
        params: the final parameters, on the CPU.
        step_times: seconds per step, every step (the first ones include warm-up and compiling).
        cpu_times: the CPU seconds of the rank's own thread per step (``time.thread_time``), every step.
        comm_share: the share of the profiled steps' time in which a collective ran (None: not profiled).
        comm_calls: collectives per profiled step.
        host_reads: ``Tensor.item``/``Tensor.tolist`` calls per profiled step (None: not profiled).
        graph_breaks: dynamo's graph-break count (compiled run only).
        compiles: frames compiled (compiled run only).
        unique_graphs: dynamo's ``unique_graphs`` counter (compiled run only).
        route: how the seed-style all_to_all moved its pieces (seed-style run only).
    """

    losses: list[float] = field(default_factory=list)
    params: Params = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    comm_share: float | None = None
    comm_calls: float | None = None
    host_reads: float | None = None
    graph_breaks: int | None = None
    compiles: int | None = None
    unique_graphs: int | None = None
    route: str | None = None


@dataclass(frozen=True)
class RankBatch:
    """One rank's shard of a step's sequence, every field of shape ``(n_r,)`` (int64).

    Args:
        tokens: token ids.
        pos: each token's position in its document.
        seg: each token's document id (documents do not attend to each other).
        tgt: each token's target (the previous token of its document).
    """

    tokens: Tensor
    pos: Tensor
    seg: Tensor
    tgt: Tensor

    def to(self, device: torch.device) -> RankBatch:
        """The batch on `device`."""
        return RankBatch(*(t.to(device) for t in (self.tokens, self.pos, self.seg, self.tgt)))

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(tokens, pos, seg, tgt)``."""
        return self.tokens, self.pos, self.seg, self.tgt


# ------------------------------------------------------------------------------------- data
def _generator(cfg: Config, *keys: int) -> torch.Generator:
    seed = cfg.seed * 1_000_003 + 12345
    for k in keys:
        seed = (seed * 1_000_003 + k) % (1 << 62)
    return torch.Generator().manual_seed(seed)


def global_batch(cfg: Config, step: int) -> RankBatch:
    """Step `step`'s whole sequence: ``N`` tokens in documents of 1 to ``MAX_DOC`` tokens."""
    gen = _generator(cfg, step)
    n = int(torch.randint(MIN_TOKENS, MAX_TOKENS + 1, (1,), generator=gen))
    lengths: list[int] = []
    while sum(lengths) < n:
        lengths.append(min(int(torch.randint(1, MAX_DOC + 1, (1,), generator=gen)), n - sum(lengths)))
    tokens = torch.randint(0, VOCAB, (n,), generator=gen)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(k) for k in lengths])
    previous = torch.cat([tokens[:1], tokens[:-1]])
    tgt = torch.where(pos == 0, tokens, previous)
    return RankBatch(tokens, pos, seg, tgt)


def shard_sizes(cfg: Config, step: int, world: int, total: int) -> list[int]:
    """How many of the `total` tokens each rank holds: random cuts, and every third step one rank holds 0."""
    gen = _generator(cfg, step, world, 1)
    # The batch's layout is drawn on the host.
    drawn = torch.randint(0, total + 1, (world - 1,), generator=gen)
    cuts = sorted(drawn.tolist())  # a CPU tensor: no device sync
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    if step % 3 == 2 and world > 1:  # a rank with no token at all
        empty = step % world
        sizes[(empty + 1) % world] += sizes[empty]
        sizes[empty] = 0
    return sizes


def rank_batch(cfg: Config, step: int, rank: int, world: int) -> tuple[RankBatch, list[int]]:
    """Rank `rank`'s contiguous shard of step `step`'s sequence, and every rank's length (for the display)."""
    whole = global_batch(cfg, step)
    sizes = shard_sizes(cfg, step, world, whole.tokens.shape[0])
    start = sum(sizes[:rank])
    part = RankBatch(*(t[start : start + sizes[rank]].clone() for t in whole.tensors()))
    return part, sizes


# ------------------------------------------------------------------------------------ model
def init_params(cfg: Config) -> Params:
    """The initial parameters (float64), the same in every process."""
    gen = _generator(cfg, -1)

    def randn(*shape: int, scale: float) -> Tensor:
        return scale * torch.randn(shape, generator=gen, dtype=torch.float64)

    p: Params = {"emb": randn(VOCAB, EMBED, scale=1.0), "pos": randn(MAX_DOC, EMBED, scale=0.5)}
    for layer in range(LAYERS):
        p[f"{layer}.ln1_w"] = 1 + randn(EMBED, scale=0.1)
        p[f"{layer}.ln1_b"] = randn(EMBED, scale=0.1)
        p[f"{layer}.wqkv"] = randn(EMBED, 3 * EMBED, scale=EMBED**-0.5)
        p[f"{layer}.wo"] = randn(EMBED, EMBED, scale=EMBED**-0.5)
        p[f"{layer}.ln2_w"] = 1 + randn(EMBED, scale=0.1)
        p[f"{layer}.ln2_b"] = randn(EMBED, scale=0.1)
        p[f"{layer}.w1"] = randn(EMBED, HIDDEN, scale=EMBED**-0.5)
        p[f"{layer}.b1"] = randn(HIDDEN, scale=0.1)
        p[f"{layer}.w2"] = randn(HIDDEN, EMBED, scale=HIDDEN**-0.5)
        p[f"{layer}.b2"] = randn(EMBED, scale=0.1)
    p["lnf_w"] = 1 + randn(EMBED, scale=0.1)
    p["lnf_b"] = randn(EMBED, scale=0.1)
    p["head"] = randn(EMBED, VOCAB, scale=EMBED**-0.5)
    return p


def attention(qkv: Tensor, seg: Tensor) -> Tensor:
    """``(N, h, 3 * HEAD_DIM)`` per-head ``[q | k | v]`` over the whole sequence -> ``(N, h, HEAD_DIM)``.

    Causal within each document: token i attends to token j when ``j <= i`` and
    both carry the same document id in `seg` (``(N,)``). Written with plain ops
    (no ``scaled_dot_product_attention``, which branches on an empty length), so
    a rank with no head (``h = 0``) and unbacked lengths trace as they are.
    """
    q, k, v = qkv.split(HEAD_DIM, dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    idx = torch.arange(seg.shape[0], device=seg.device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


Attend = Callable[[Tensor], Tensor]


def token_losses(p: Params, batch: tuple[Tensor, Tensor, Tensor, Tensor], attend: Attend) -> Tensor:
    """The model on a shard ``(tokens, pos, seg, tgt)``: each token's cross-entropy, ``(n,)``.

    `attend` maps this shard's ``(n, HEADS, 3 * HEAD_DIM)`` q, k, v to its
    ``(n, HEADS, HEAD_DIM)`` attention output; it alone differs between the runs.
    """
    tokens, pos, _, tgt = batch
    x = p["emb"][tokens] + p["pos"][pos]  # (n, E)
    n = x.shape[0]
    for layer in range(LAYERS):
        h = F.layer_norm(x, (EMBED,), p[f"{layer}.ln1_w"], p[f"{layer}.ln1_b"])
        o = attend((h @ p[f"{layer}.wqkv"]).view(n, HEADS, 3 * HEAD_DIM))
        x = x + o.reshape(n, EMBED) @ p[f"{layer}.wo"]
        h = F.layer_norm(x, (EMBED,), p[f"{layer}.ln2_w"], p[f"{layer}.ln2_b"])
        x = x + F.gelu(h @ p[f"{layer}.w1"] + p[f"{layer}.b1"]) @ p[f"{layer}.w2"] + p[f"{layer}.b2"]
    logits = F.layer_norm(x, (EMBED,), p["lnf_w"], p["lnf_b"]) @ p["head"]
    return F.cross_entropy(logits, tgt, reduction="none")


# ------------------------------------------------------------------------------- the steps
def funcoll_loss(
    p: Params,
    tokens: Tensor,
    pos: Tensor,
    seg: Tensor,
    tgt: Tensor,
    formats: tuple[funcoll.Wire | None, funcoll.Wire | None] = (None, None),
) -> Tensor:
    """The funcoll step's forward and loss (the function the compiled run compiles).

    `formats`: the attention all_to_alls' ``(wire, grad_wire)`` (None: exact).
    """
    # The four inputs are one shard, each marked ragged on its own: say their lengths
    # are one (dynamo before torch 2.13 cannot prove it where cross_entropy meets them).
    for t in (pos, seg, tgt):
        torch._check(t.shape[0] == tokens.shape[0])
    pieces = funcoll.all_gather_list(seg)  # every rank's document ids; the step's one size exchange
    sizes = [piece.shape[0] for piece in pieces]  # every rank's length (unbacked ints when compiled)
    seg_all = torch.cat(pieces)
    heads = funcoll.split_sizes(HEADS, funcoll.axis_size())

    def attend(qkv: Tensor) -> Tensor:
        wire, grad_wire = formats
        full = funcoll.all_to_all(
            qkv, None, scatter_dim=1, gather_dim=0, gather_sizes=sizes, wire=wire, grad_wire=grad_wire
        )
        o = attention(full, seg_all)  # (N, H_r, D): the whole sequence, this rank's heads
        return funcoll.all_to_all(
            o, None, 0, 1, scatter_sizes=sizes, gather_sizes=heads, wire=wire, grad_wire=grad_wire
        )

    losses = token_losses(p, (tokens, pos, seg, tgt), attend)
    return funcoll.gather(losses, sizes=sizes).mean()  # the global mean, on every rank


def seed_loss(p: Params, tokens: Tensor, pos: Tensor, seg: Tensor, tgt: Tensor) -> Tensor:
    """The seed-style step's forward and loss: the same model with :mod:`funcoll._demo_seeds`."""
    group = dist.group.WORLD
    seg_all = seeds.gather(seg, group)

    def attend(qkv: Tensor) -> Tensor:
        sizes = seeds.exchange_sizes(qkv, group)
        full = seeds.seq_to_heads(qkv, sizes, group, HEADS)
        return seeds.heads_to_seq(attention(full, seg_all), sizes, group, HEADS)

    losses = token_losses(p, (tokens, pos, seg, tgt), attend)
    return seeds.gather_forward_split_backward(losses, group).mean()


def _sync_grads(mode: str, params: Params) -> dict[str, Tensor]:
    """The true gradient on every rank: one all_reduce of the flattened gradients."""
    names = list(params)
    flat = torch.cat([_grad(params[k]).reshape(-1) for k in names])
    if mode == "seed":  # the seed's loss gather keeps the slice in its backward: partial gradients add up
        dist.all_reduce(flat)  # in place, eager: the seed-style run uses torch.distributed as the seeds do
    else:  # funcoll's adjoint gather sums world identical losses' gradients: average them
        flat = funcoll.all_reduce(flat, op="avg")
    out, start = {}, 0
    for k in names:
        n = params[k].numel()
        out[k] = flat[start : start + n].view_as(params[k])
        start += n
    return out


def _grad(p: Tensor) -> Tensor:
    """`p`'s gradient, which the backward has just written."""
    if p.grad is None:
        raise RuntimeError("funcoll.demo: a parameter got no gradient")  # every parameter reaches the loss
    return p.grad


def _sgd(params: Params, grads: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for k, p in params.items():
            p -= LR * grads[k]
            p.grad = None


# ------------------------------------------------------------------------------ measuring
def _is_backend_collective(event: Any, device: str) -> bool:
    """A collective as the backend runs it: gloo's spans on its worker threads, NCCL's kernels on the GPU."""
    if device == "cuda":
        return event.device_type == torch.autograd.DeviceType.CUDA and "nccl" in event.name.lower()
    return event.name.startswith("gloo:")


def collective_share(prof: torch.profiler.profile, step_span: str, device: str) -> tuple[float, float]:
    """``(share, calls per step)``: the time collectives run inside the `step_span` ranges, over their length.

    The backend's own spans are used, not the caller's ops: an in-place
    ``dist.all_gather`` returns before its wait, which the profiler does not record,
    while gloo's span on its worker thread lasts until the data has arrived (the
    waiting for a slower peer included). Spans are merged where they overlap, so
    concurrent collectives count once.
    """
    events = prof.events()
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == step_span)
    comm = sorted((e.time_range.start, e.time_range.end) for e in events if _is_backend_collective(e, device))
    inside = [(a, b) for a, b in comm if any(s <= a < t for s, t in steps)]
    merged: list[list[int]] = []
    for a, b in inside:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    covered = sum(max(0, min(b, t) - max(a, s)) for a, b in merged for s, t in steps)
    total = sum(t - s for s, t in steps)
    return (covered / total if total > 0 else 0.0), len(inside) / max(len(steps), 1)


def progress(
    items: Iterable[T],
    total: int,
    desc: str,
    enabled: bool,
    first: str | None = None,
    every: float = 1.0,
    quiet: float = 5.0,
) -> Iterator[T]:
    """A progress bar over `items`: tqdm when it is installed, else a plain one on stderr.

    The bar stays alive while a step runs: a daemon thread redraws its elapsed time
    every `every` seconds (in a log, not a terminal: a line after each `quiet`
    seconds of a running step), so a long
    step (a first compiled call: 10-50 s on a small CPU) is never silent. `first`
    labels the first step while it runs (``"compiling"``).
    """
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    lock = threading.Lock()
    start = time.perf_counter()
    done_steps = 0
    live = tqdm is not None or sys.stderr.isatty()  # redraw in place; in a log, one line now and then
    bar = None
    if tqdm is not None:
        fmt = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
        bar = tqdm(total=total, desc=f"{desc:<{TITLE_WIDTH}}", bar_format=fmt, leave=True, ncols=100)

    def note() -> str:
        return first if first is not None and done_steps == 0 else ""

    def draw() -> None:
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.set_postfix_str(note(), refresh=False)
            bar.refresh()
        elif live:
            width = 30
            filled = "#" * (width * done_steps // max(total, 1))
            label = f" step {done_steps + 1}: {note()}" if note() and done_steps < total else ""
            sys.stderr.write(
                f"\r{desc:<{TITLE_WIDTH - 1}} [{filled:<{width}}] {done_steps}/{total} {elapsed:5.1f}s{label:<24}"
            )
            sys.stderr.flush()

    stop = threading.Event()

    def tick() -> None:
        quiet_since = time.perf_counter()
        while not stop.wait(every):
            with lock:
                if live:
                    draw()
                elif time.perf_counter() - quiet_since >= quiet:  # a log: a line now and then
                    quiet_since = time.perf_counter()
                    running = f"step {done_steps + 1}/{total}" + (f" ({note()})" if note() else "")
                    sys.stderr.write(f"{desc:<28} {running}, {time.perf_counter() - start:5.1f}s\n")
                    sys.stderr.flush()

    ticker = threading.Thread(target=tick, name="funcoll-demo-progress", daemon=True)
    with lock:
        draw()
    ticker.start()
    try:
        for item in items:
            yield item
            with lock:
                done_steps += 1
                if bar is not None:
                    bar.update(1)
                draw()
    finally:
        stop.set()
        ticker.join()
        if bar is not None:
            bar.set_postfix_str("", refresh=False)
            bar.close()
        elif live:
            sys.stderr.write("\n")
        else:
            sys.stderr.write(f"{desc:<28} {total} steps {time.perf_counter() - start:5.1f}s\n")
        sys.stderr.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_rank(mode: str, cfg: Config, rank: int, world: int, show: bool) -> PhaseResult:
    """Train the model for ``cfg.steps`` steps the `mode` way (``"seed"``, ``"eager"``, ``"compiled"``, ``"quantized"``)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    device = (
        torch.device(cfg.device, torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    )
    params = {k: v.to(device).requires_grad_() for k, v in init_params(cfg).items()}
    result = PhaseResult()
    step_fn: Callable[..., Tensor] = seed_loss if mode == "seed" else funcoll_loss
    if mode == "quantized":
        step_fn = functools.partial(funcoll_loss, formats=WIRE)
    counter = None
    if mode == "compiled":
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend(cfg.compile_backend)
        step_fn = torch.compile(funcoll_loss, backend=counter, fullgraph=True)
    _, profiled = step_ranges(cfg.steps)
    # kineto prints "profiler_start"/"profiler_stop" on every profile below log level 6.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    reads = 0
    with contextlib.ExitStack() as profiling_steps:
        first = "compiling" if mode == "compiled" else None  # its first step compiles: 10-50 s, not silent
        for step in progress(range(cfg.steps), cfg.steps, MODE_TITLES[mode], show, first=first):
            batch, _ = rank_batch(cfg, step, rank, world)
            inputs = batch.to(device).tensors()
            if mode == "compiled":
                inputs = tuple(funcoll.mark_ragged(t, 0) for t in inputs)
            if step == profiled.start:
                profiling_steps.enter_context(prof)
            span = (
                torch.profiler.record_function("demo_step") if step in profiled else contextlib.nullcontext()
            )
            counting = count_host_reads() if step in profiled else contextlib.nullcontext(None)
            _sync(device)
            start, cpu_start = time.perf_counter(), time.thread_time()
            with span, counting as counted:
                loss = step_fn(params, *inputs)
                loss.backward()
                _sgd(params, _sync_grads(mode, params))
                _sync(device)
            result.step_times.append(time.perf_counter() - start)
            result.cpu_times.append(time.thread_time() - cpu_start)
            reads += counted.count if counted is not None else 0
            result.losses.append(float(loss.detach()))  # host read of the loss, after the timing: the display
    result.comm_share, result.comm_calls = collective_share(prof, "demo_step", device.type)
    result.host_reads = reads / len(profiled)
    result.params = {k: v.detach().cpu() for k, v in params.items()}
    if mode == "seed" and world > 1:
        result.route = seeds.list_all_to_all_route()
    if counter is not None:
        result.compiles = counter.frame_count
        result.graph_breaks = sum(counters["graph_break"].values())
        result.unique_graphs = counters["stats"]["unique_graphs"]
    return result


def step_ranges(steps: int) -> tuple[range, range]:
    """``(timed, profiled)``: the steps whose times the median reads, and the last ones, profiled.

    The first ``WARMUP`` steps are in neither (the compiled run compiles in its
    first); the rest is split, at most ``PROFILED`` profiled and at least as many
    timed (with 1 step, the one step is profiled and timed).
    """
    warm = min(WARMUP, steps - 1)
    profiled = min(PROFILED, max(1, (steps - warm) // 2))
    return range(warm, steps - profiled), range(steps - profiled, steps)


def timed_steps(times: list[float], steps: int) -> list[float]:
    """The entries of per-step `times` that the median reads (see :func:`step_ranges`)."""
    timed, profiled = step_ranges(steps)
    return [times[i] for i in (timed or profiled)]


def median_ms(results: Sequence[PhaseResult], steps: int, cpu: bool = False) -> float:
    """The median step time over the ranks' timed steps, in ms (the slowest rank's median).

    `cpu`: the rank's own CPU time per step instead of the wall time.
    """
    return 1e3 * max(
        statistics.median(timed_steps(r.cpu_times if cpu else r.step_times, steps)) for r in results
    )


def reference(cfg: Config, show: bool) -> PhaseResult:
    """The same training on one process: the whole sequence, every head, no collective."""
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # as the ranks run: a tiny model, where a thread pool on a busy machine only waits
    try:
        return _reference(cfg, show)
    finally:
        torch.set_num_threads(threads)


def _reference(cfg: Config, show: bool) -> PhaseResult:
    params = {k: v.requires_grad_() for k, v in init_params(cfg).items()}
    result = PhaseResult()
    for step in progress(range(cfg.steps), cfg.steps, MODE_TITLES["reference"], show):
        whole = global_batch(cfg, step)
        start, cpu_start = time.perf_counter(), time.thread_time()
        loss = token_losses(params, whole.tensors(), functools.partial(attention, seg=whole.seg)).mean()
        loss.backward()
        _sgd(params, {k: _grad(v) for k, v in params.items()})
        result.step_times.append(time.perf_counter() - start)
        result.cpu_times.append(time.thread_time() - cpu_start)
        result.losses.append(float(loss.detach()))  # host read of the loss: the display
    result.params = {k: v.detach() for k, v in params.items()}
    return result


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """``max |a_i - b_i|`` (inf if the lengths differ or a value is not finite)."""
    if len(a) != len(b) or not all(math.isfinite(x) for x in [*a, *b]):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def max_param_diff(a: Params, b: Params) -> float:
    """The largest absolute difference between two parameter sets."""
    if a.keys() != b.keys():
        return math.inf
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    return worst if math.isfinite(worst) else math.inf
