"""Helpers for compiled code that calls funcoll: the sizes that change from call to call, and the caches.

Not collectives: they tell ``torch.compile`` about the inputs of a compiled step
so that one graph serves every ragged length, and let inductor's on-disk caches
keep the graphs that hold funcoll's ops (docs/compile.md).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import Tensor

from ._checks import check_dim, check_tensor
from ._version import __version__

__all__ = ["allow_compile_caches", "mark_ragged"]


def _mark_unbacked_takes_min() -> bool:
    return "min" in inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters


def mark_ragged(x: Tensor, dim: int = 0, *, min_size: int = 0) -> Tensor:
    """Mark `dim` of `x` as a size that changes from call to call, before a compiled step.

    A thin wrapper over ``torch._dynamo.decorators.mark_unbacked``: the compiled graph
    treats ``x.shape[dim]`` as an unbacked symbol, so it never specializes on it (not
    even on 0 or 1) and one graph serves every length. Call it on the input outside
    the compiled function; inside one, and in eager code, it does nothing. It marks
    `x` itself, as ``mark_dynamic`` and ``mark_unbacked`` do, and returns it, so
    both ``mark_ragged(x, 1); step(x)`` and ``step(mark_ragged(x, 1))`` work.

    An empty `x` gets the strides of its shape, unclamped, in place: torch gives an
    empty ``(2, 0)`` tensor strides ``(1, 1)``, not ``(0, 1)``, and a graph traced
    with ``stride(0) == size(1)`` would be compiled again for every new local
    length of 0 on a dim that is not the outermost. The tensor holds no elements,
    so only its strides change, and its version counter is kept, so a backward
    that saved it still runs (an inference tensor, made under
    ``torch.inference_mode()``, has none to keep and is changed in that mode).
    One case stays dynamo's own: if the *first* call has length 0 there, dynamo
    cannot tie the stride to the unbacked size and traces it static, so the next
    non-empty call compiles a second graph, which then serves every length.

    `min_size` tells the compiler the length is never below it. Code after the
    op that branches on an empty length, as ``scaled_dot_product_attention``
    does, cannot trace an unbacked size that may be 0 ("Could not guard on
    data-dependent expression Eq(u0, 0)"); ``min_size=1`` makes that branch
    static, and each call checks the bound at run time. It needs a torch whose
    ``mark_unbacked`` takes ``min`` (2.12 and later do, 2.11 does not); anywhere,
    ``torch._check(x.shape[dim] >= 1)`` at the top of the compiled function
    says the same (docs/compile.md).

    Args:
        x: the input of a compiled step.
        dim: the dim whose length changes from call to call.
        min_size: the smallest length any call will have (0: none assumed).

    Example::

        step = torch.compile(step_fn, fullgraph=True)
        for batch in loader:                 # the local length varies per step
            step(funcoll.mark_ragged(batch, 0))
        attn = torch.compile(sp_attention, fullgraph=True)     # calls scaled_dot_product_attention
        attn(funcoll.mark_ragged(q, 2, min_size=1))             # no rank's sequence is empty
    """
    opname = "funcoll.mark_ragged"
    check_tensor(opname, "x", x)
    d = check_dim(opname, x, dim)
    if not isinstance(min_size, int) or isinstance(min_size, bool):
        raise TypeError(f"{opname}: `min_size` must be an int, got {type(min_size).__name__} {min_size!r}")
    if min_size < 0:
        raise ValueError(f"{opname}: `min_size`={min_size} must be >= 0")
    if torch.compiler.is_compiling():
        return x
    if x.shape[d] < min_size:
        raise ValueError(f"{opname}: x.shape[{d}]={x.shape[d]} is below `min_size`={min_size}")
    bound: dict[str, int] = {}
    if min_size > 0:
        if not _mark_unbacked_takes_min():
            raise NotImplementedError(
                f"{opname}: `min_size` needs torch._dynamo.mark_unbacked(min=...), which torch "
                f"{torch.__version__} lacks; put torch._check(x.shape[{d}] >= {min_size}) at the top of "
                f"the compiled function instead"
            )
        bound["min"] = min_size
    if x.numel() == 0:
        strides = [1] * x.dim()
        for i in range(x.dim() - 2, -1, -1):
            strides[i] = strides[i + 1] * x.shape[i + 1]
        if tuple(strides) != x.stride():
            # Metadata only, as x holds no elements: the version counter stays, so an
            # autograd node that saved x does not see a change that changed no value.
            # An inference tensor has no version counter, no autograd node saved it, and
            # only inference mode may change it in place.
            if x.is_inference():
                keep: contextlib.AbstractContextManager[Any] = torch.inference_mode()
            else:
                keep = torch.autograd.grad_mode._unsafe_preserve_version_counter(x)
            with torch.no_grad(), keep:
                x.as_strided_(x.shape, strides)
    torch._dynamo.decorators.mark_unbacked(x, d, **bound)
    return x


# What inductor's caches refuse in a graph that holds funcoll's ops, by the name torch's
# cacheability checks look up: the ordered effects of funcoll's backward anchor and size
# header (the FX graph cache), and the tensor a size header is built from when its lengths
# are symbols (AOT autograd's cache: dynamo records it as torch._refs.tensor).
_MARKED = ("torch.ops.higher_order.with_effects", "torch._refs.tensor")


def allow_compile_caches(enable: bool = True) -> None:
    """Let inductor's on-disk caches keep compiled graphs that hold funcoll's ops, so a restarted job reuses them.

    A job that compiles its step again after a restart (a preempted run, the next
    launch of the same script) normally finds the graphs in inductor's caches:
    AOT autograd's cache skips the joint trace and the partition, the FX graph
    cache the code generation. By torch's defaults both refuse ("bypass") every
    graph that holds a funcoll op, which then compiles in full again:

    - AOT autograd's cache refuses any ``torch.autograd.Function`` (every funcoll
      primitive is one) unless ``torch._functorch.config.
      autograd_cache_allow_custom_autograd_functions`` is set. This sets it.
    - The FX graph cache refuses the ``with_effects`` higher-order op, which holds
      funcoll's backward anchor and its size header (ordered effects that keep the
      ranks' collectives in one order, docs/compile.md), and AOT autograd's cache
      refuses ``torch._refs.tensor``, the size header of a ragged op whose
      lengths are symbols. This names both in
      ``torch._inductor.config.unsafe_marked_cacheable_functions``, keyed by the
      torch and funcoll versions, so an upgrade of either compiles afresh.

    Why it is sound for funcoll's graphs: dynamo traces each Function's forward
    and backward into the graph the caches hash, so the key covers them, and
    every rank-dependent value (rank, world, group names, checks) is a constant
    of that graph; the anchor and the header are funcoll custom ops, run by name
    at run time; ``torch._refs.tensor`` is a pure function of the graph's values.
    Dynamo itself still traces each step after a restart (the caches start after
    its trace), so the group names a graph uses are registered again.

    The settings are torch's and global: they also let the caches keep graphs
    with your own autograd.Functions and ordered effects, which torch leaves to
    you to vouch for. Call it once, before the first compile, on every rank (a
    rank that hits the cache and one that compiles issue the same collectives,
    but the hit saves the compile only where it is on). ``enable=False``
    restores torch's defaults.

    Args:
        enable: turn the caching of funcoll's graphs on (True) or off (False).

    Example::

        import funcoll
        funcoll.allow_compile_caches()          # before torch.compile, on every rank
        step = torch.compile(train_step, fullgraph=True)
        # a restart's first step: AOT autograd's and the FX graph cache hit
    """
    opname = "funcoll.allow_compile_caches"
    if not isinstance(enable, bool):
        raise TypeError(f"{opname}: `enable` must be a bool, got {type(enable).__name__} {enable!r}")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    functorch_config.autograd_cache_allow_custom_autograd_functions = enable
    marked = {k: v for k, v in inductor_config.unsafe_marked_cacheable_functions.items() if k not in _MARKED}
    if enable:
        marked.update(dict.fromkeys(_MARKED, f"torch {torch.__version__}, funcoll {__version__}"))
    inductor_config.unsafe_marked_cacheable_functions = marked
