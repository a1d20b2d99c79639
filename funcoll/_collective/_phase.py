"""A compiled backward's collectives stay in the backward graph, on every rank.

AOT autograd traces a compiled step's forward and backward as one joint graph and
its partitioner splits it: every node that depends on the incoming gradient (a
tangent) goes to the backward graph, and a node that does not may be computed in
the forward and saved. Collectives are never recomputed, so a backward
collective whose input does not depend on the gradient is issued in the forward.
Whether it does can differ between ranks: ``loss * 0`` on some ranks (inductor
folds a product with an integer 0 to a constant before partitioning), a
gradient a rank's code builds from constants, a backward whose payload is a
constant on a rank that holds no rows. A collective that moves on one rank
alone pairs with another collective on the others: a backend abort or a hang.

torch's partitioner has a tag for nodes that must stay in the backward whatever
their inputs (``node.meta["partitioner_tag"] = "must_be_in_backward"``, the tag
of a backward's in-place copies), read from the joint graph's nodes, which take
it from the nodes of the graph dynamo traced. Every funcoll autograd.Function
subclasses :class:`Primitive`, whose backward, while dynamo traces it, runs
inside ``torch.fx.traceback.annotate`` (dynamo keeps the node metadata of an
annotated region) and sets that tag on the way in (:func:`_must_be_in_backward`,
which dynamo calls while tracing, as it does every
``torch.compiler.assume_constant_result`` function). So every node of a funcoll
backward, its collectives first, is in the backward graph on every rank, in the
order autograd runs them, whatever the partitioner, dead-code elimination or
constant folding can prove about its inputs; the tag costs nothing at run time.
Eager code takes none of this: autograd runs a backward when its gradient
arrives.

A collective issued in the forward is the partitioner's forward node, but it is
also copied into the backward graph when everything it reads is there (a size
exchange's header is built from host ints, a constant of the graph) and a node
that reads its result has a side effect (the host read of the sizes, its runtime
asserts): the exchange then runs twice on that rank. Headers are built by
``funcoll::header`` (``_header``), an ordered effectful op: AOT autograd threads
an effect token through such ops, the forward's from the forward graph's inputs
and the backward's from the backward's, so a header and what reads it stay in
the graph of their phase, in program order, on every rank.

A forward collective whose inputs the backward holds anyway (saved values) is
copied into the backward graph by the partitioner too, and kept there, since its
wait is a side effect; AOT autograd then rebuilds the backward from its first
node that reads a tangent and drops copies nothing needs. On torch before 2.14
inductor folds a loss's ``* 0`` into a constant gradient before partitioning, so
on that rank no node reads a tangent, the rebuild is skipped and the copies run:
its forward collectives a second time, on that rank alone. Every compiled funcoll
backward there starts with :func:`_anchor`, an ordered effect whose token AOT
autograd passes as a tangent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import Tensor
from torch._library.effects import EffectType

__all__ = ["Primitive", "in_phase"]

_ANNOTATION = {"funcoll": "backward"}
# torch 2.12 and 2.13 (2.11 too: the same pass) fold a loss's ``* 0`` into its
# gradient before partitioning; 2.14.1 and 2.15 keep the product (see _anchor).
_ANCHOR = torch.torch_version.TorchVersion(torch.__version__) < (2, 14)


@torch.compiler.assume_constant_result
def _must_be_in_backward() -> bool:
    """Tag the nodes dynamo traces from here to the end of the annotated backward.

    Dynamo calls this while tracing (its result is taken as a constant; nothing of
    it enters the graph) inside the annotated region, whose node metadata dynamo
    copies from ``current_meta`` and restores when the region ends. Outside that
    region (eager code, another tracer) it changes nothing.
    """
    custom = fx_traceback.current_meta.get("custom")
    if (
        fx_traceback.has_preserved_node_meta()
        and isinstance(custom, dict)
        and custom.get("funcoll") == "backward"
    ):
        fx_traceback.current_meta["partitioner_tag"] = "must_be_in_backward"
        return True
    return False


def _anchor(grads: tuple[Any, ...]) -> None:
    """Give the compiled backward a node that reads a backward input: an ordered effect's token.

    After partitioning, AOT autograd rebuilds the backward graph from its first
    node that reads a tangent (``reordering_to_mimic_autograd_engine``), which
    drops the forward nodes the partitioner copied in and nothing needs. Where no
    node reads a tangent (inductor folded the loss's ``* 0`` into a constant
    gradient) the graph stays as extracted, and the copies stay with it: a
    forward collective whose payload the backward can compute from saved values
    (torchtitan's MoE layer saves its routing ids) runs a second time, on that
    rank alone, because its wait is a side effect that dead-code elimination
    keeps. A backward's ordered effect reads the backward's token, which AOT
    autograd passes as a tangent, so the rebuild runs whatever the gradients are.
    In every funcoll backward, so the first backward collective follows one:
    ``funcoll::anchor``, which reads one of the gradients and does nothing (no
    kernel, no copy, no collective, no sync). An anchor that made a tensor (a
    one-byte ``funcoll::header``, as before) cost inductor a generated kernel per
    backward op, about 0.25 s of compile time each on this CPU
    (``benchmarks/bench_compile.py``).
    """
    grad = next((g for g in grads if isinstance(g, Tensor)), None)
    torch.ops.funcoll.anchor(torch.empty(0) if grad is None else grad)


def _in_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(backward)
    def traced(ctx: Any, *grads: Any) -> Any:
        if not torch.compiler.is_compiling():
            return backward(ctx, *grads)
        with fx_traceback.annotate(_ANNOTATION):
            _must_be_in_backward()
            if _ANCHOR:
                _anchor(grads)
            return backward(ctx, *grads)

    return traced


class Primitive(torch.autograd.Function):
    """An autograd.Function whose backward, compiled, stays in the backward graph on every rank.

    Every autograd.Function in funcoll subclasses it (``tests/test_layers.py``
    checks): its ``backward`` is wrapped once, when the class is defined.

    Each has torch's two-part form, a ``forward`` without ctx and a
    ``setup_context(ctx, inputs, output)``: torch's function transforms
    (``torch.func.grad``, ``vjp``, ``grad_and_value``) refuse an autograd.Function
    whose forward takes the ctx (``tests/test_layers.py`` checks this too).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backward = cls.__dict__.get("backward")
        if isinstance(backward, staticmethod):
            cls.backward = staticmethod(_in_backward(backward.__func__))  # type: ignore[method-assign]


def in_phase(header: Tensor) -> Tensor:
    """`header` (a few ints), pinned to the graph and the place where it is issued, in a compiled graph.

    Eager it is `header` itself. Compiled it is a copy made by ``funcoll::header``,
    an ordered effectful op: AOT autograd orders it after every earlier such op of
    its phase and keeps it in its phase's graph, so that a header exchange is
    never copied into the other graph nor moved past another header.
    """
    if not torch.compiler.is_compiling():
        return header
    return torch.ops.funcoll.header(header)


@torch.library.custom_op("funcoll::header", mutates_args=())
def _header(header: Tensor) -> Tensor:
    return header.clone()  # a few ints: an effectful op may not return its input


@_header.register_fake
def _header_fake(header: Tensor) -> Tensor:
    return torch.empty_like(header)


_header.register_effect(EffectType.ORDERED)


@torch.library.custom_op("funcoll::anchor", mutates_args=())
def _anchor_op(grad: Tensor) -> None:
    """Nothing: an ordered effect whose token ties a compiled backward to its own inputs (`_anchor`)."""


@_anchor_op.register_fake
def _anchor_fake(grad: Tensor) -> None:
    return None


_anchor_op.register_effect(EffectType.ORDERED)
