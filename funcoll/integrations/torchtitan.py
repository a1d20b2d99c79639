"""``funcoll.moe`` as a torchtitan token dispatcher, selected by config.

torchtitan's MoE layer (``torchtitan.models.common.moe``) routes its tokens, then
hands them to a token dispatcher (``RoutedExperts.token_dispatcher``) that moves
them to the ranks of their experts, runs its ``GroupedExperts`` on them and
combines the results. :class:`FuncollTokenDispatcher` is such a dispatcher, a
subclass of torchtitan's ``BaseEPTokenDispatcher`` with a ``Config``, built on
:func:`funcoll.moe.dispatch` and :func:`funcoll.moe.combine`:

* ``mode="exact"``: nothing dropped; one device-to-host read per layer (the
  counts an uneven all-to-all needs as host ints), where torchtitan's
  ``AllToAllTokenDispatcher`` makes two ``.to("cpu")`` and two ``.tolist()``.
* ``mode="static"``: static shapes and no host read; each rank sends at most
  ``capacity`` (token, choice) pairs to each rank, the first ones in token order,
  and drops the rest (their output is zero). ``capacity_factor`` instead sets
  ``capacity = ceil(capacity_factor * T * k / ep)`` from the layer's token count.
* ``mode="dropless"``: nothing dropped, static shapes while the routing fits. Each
  dispatch tries static mode's capacity (``capacity``, or ``capacity_factor``,
  default 1.0) and falls back to exact mode when some rank of the EP group would
  drop a pair (:func:`funcoll.moe.dispatch`'s ``mode="dropless"``: one host read
  per layer, as exact mode). Only the dispatch is redone, inside the dispatcher:
  no forward runs twice, so the router's load-balancing counter, or any other
  forward side effect, happens once. After an overflow the capacity grows to what
  fits, rounded up to 4 significant bits: at most 1/8 above the need (``grow``).
  Compiled, a graph cannot branch on the overflow: the dispatcher dispatches in
  exact mode there (nothing dropped, the same one host read, one graph for every
  routing).

It takes what torchtitan already has: the per-expert counts its MoE layer
computed (no recount) and the router's scores at dispatch (combine weights by
them in the experts' dtype, in one pass). It returns each local expert's block
size, padded to ``align``, whose cumulative sum is the ``offs`` torchtitan's
``GroupedExperts`` passes to ``torch._grouped_mm`` (``handle.ends``).

Select it in a model config::

    from funcoll.integrations.torchtitan import FuncollTokenDispatcher

    routed_experts=RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=E),
        token_dispatcher=FuncollTokenDispatcher.Config(num_experts=E, top_k=k, mode="static",
                                                       capacity_factor=1.25),
    )

or, without touching the model's config, with torchtitan's override mechanism
(``--override.imports``), which replaces every ``AllToAllTokenDispatcher.Config``::

    --override.imports 'funcoll.integrations.torchtitan.funcoll_dispatcher={"mode": "exact"}'

Expert parallelism wires the EP mesh as for torchtitan's own dispatchers
(``wire_meshes``); without one (EP of 1) it dispatches locally as torchtitan's
``LocalTokenDispatcher`` does. Importing this module imports torchtitan (tested
with 0.3.0: ``pip install "funcoll[torchtitan]"``, see docs/moe.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchtitan.config import override
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    BaseEPTokenDispatcher,
    LocalDispatchMetadata,
    LocalTokenDispatcher,
)

from .. import moe
from .._base._quant import Wire

__all__ = ["FuncollTokenDispatcher", "funcoll_dispatcher"]

MODES = ("exact", "static", "dropless")


class FuncollTokenDispatcher(BaseEPTokenDispatcher):
    """torchtitan's expert-parallel token dispatch on :func:`funcoll.moe.dispatch` / :func:`funcoll.moe.combine`.

    Config:
        num_experts, top_k: as torchtitan's dispatchers take them.
        mode: ``"exact"`` (nothing dropped, one host read per layer),
            ``"static"`` (static shapes, no host read, a capacity per destination)
            or ``"dropless"`` (static while it fits, exact otherwise; one host read
            per layer; exact when compiled).
        capacity: static and dropless modes: (token, choice) pairs each rank may
            send to each rank (dropless: the static path's first capacity).
        capacity_factor: instead of `capacity`: ``capacity = ceil(capacity_factor *
            T * top_k / ep)`` for a layer of ``T`` tokens (dropless's default: 1.0).
        align: each local expert's block starts at a multiple of it (zero rows
            between blocks), for grouped GEMMs that want aligned groups.
        grow: dropless mode: after an overflow, use the need rounded up to 4
            significant bits (at most 1/8 more) from then on (default True).
            ``overflows`` counts the dispatches that fell back to exact mode.
        dispatch_wire, dispatch_grad_wire, combine_wire, combine_grad_wire: the
            :class:`funcoll.Wire` formats of the token rows each way and of their
            gradients (docs/wire.md; None: exact). DeepEP's:
            ``dispatch_wire=Wire(torch.float8_e4m3fn, block=128)``,
            ``dispatch_grad_wire=Wire(torch.bfloat16)``, ``combine_wire=Wire(torch.bfloat16)``.

    ``dispatch`` returns ``(routed_input, block_sizes, handle)``: the tokens grouped
    by local expert (:func:`funcoll.moe.dispatch`'s ``recv``), each local expert's
    block size padded to `align` (``handle.counts``, int64, with `align` 1; int32
    otherwise; their cumulative sum is ``handle.ends``, the ``offs`` of
    ``torch._grouped_mm``), and the :class:`funcoll.moe.MoEHandle`
    that ``combine`` reads. ``combine`` returns ``(T, D)``: each token's expert
    outputs weighted by the router's scores and summed, in ``x``'s dtype. Gradients
    flow to the tokens, the scores and the experts.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        mode: str = "exact"
        capacity: int | None = None
        capacity_factor: float | None = None
        align: int = 1
        grow: bool = True
        dispatch_wire: Wire | None = None
        dispatch_grad_wire: Wire | None = None
        combine_wire: Wire | None = None
        combine_grad_wire: Wire | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.mode not in MODES:
            raise ValueError(
                "funcoll.integrations.torchtitan.FuncollTokenDispatcher: "
                f"`mode`={config.mode!r} is not one of {MODES}"
            )
        if config.mode == "exact" and (config.capacity is not None or config.capacity_factor is not None):
            raise ValueError(
                "funcoll.integrations.torchtitan.FuncollTokenDispatcher: "
                f"`capacity`={config.capacity} / `capacity_factor`={config.capacity_factor} are for "
                "mode='static' or 'dropless'; mode='exact' drops nothing"
            )
        if config.capacity is not None and config.capacity_factor is not None:
            raise ValueError(
                "funcoll.integrations.torchtitan.FuncollTokenDispatcher: "
                "give `capacity` or `capacity_factor`, not both"
            )
        if config.capacity_factor is not None and not config.capacity_factor > 0:
            raise ValueError(
                "funcoll.integrations.torchtitan.FuncollTokenDispatcher: "
                f"`capacity_factor`={config.capacity_factor} must be > 0"
            )
        self.mode = config.mode
        self.capacity = config.capacity
        self.capacity_factor = config.capacity_factor
        self.align = config.align
        self.grow = config.grow
        self.dispatch_formats = {"wire": config.dispatch_wire, "grad_wire": config.dispatch_grad_wire}
        self.combine_formats = {"wire": config.combine_wire, "grad_wire": config.combine_grad_wire}
        self.overflows = 0  # dropless: dispatches that fell back to exact mode
        self._grown = 0  # dropless: the capacity the last overflow grew to

    def _capacity(self, tokens: int, ep: int) -> int | None:
        if self.mode == "exact" or self.capacity is not None:
            return self.capacity
        factor = self.capacity_factor
        if factor is None:  # static: the dropless bound (None); dropless: factor 1.0
            if self.mode == "static":
                return None
            factor = 1.0
        return math.ceil(factor * tokens * self.top_k / ep)

    def dispatch(  # type: ignore[override]
        self,
        x_TD: Tensor,
        topk_scores_TK: Tensor,
        topk_expert_ids_TK: Tensor,
        num_local_tokens_per_expert_E: Tensor,
    ) -> tuple[Tensor, Tensor, Any]:
        """Send the tokens to their experts' ranks: ``(routed_input, block_sizes, handle)``."""
        if self.ep_mesh is None:  # EP of 1: torchtitan's local reorder, nothing to move
            return LocalTokenDispatcher.dispatch(
                self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
            )
        mode, capacity = self.mode, self._capacity(x_TD.shape[0], self.ep_mesh.size())
        if mode == "dropless":
            if torch.compiler.is_compiling():  # a graph cannot branch on the overflow: exact, dropless
                mode, capacity = "exact", None
            else:
                capacity = max(capacity, self._grown)  # type: ignore[type-var]
        recv, handle = moe.dispatch(
            x_TD,
            topk_expert_ids_TK,
            self.num_experts,
            group=self.ep_mesh,
            mode=mode,
            capacity=capacity,
            align=self.align,
            counts=num_local_tokens_per_expert_E,
            topk_weights=topk_scores_TK,
            **self.dispatch_formats,
        )
        if handle.group_needed is not None and handle.mode == "exact":  # dropless overflowed
            self.overflows += 1
            if self.grow:
                self._grown = _round_up(handle.group_needed)
        # GroupedExperts takes block sizes and cumsums them into grouped_mm's offs:
        # the padded sizes, so that their cumulative sum is handle.ends. Unpadded
        # (align 1) they are the counts themselves.
        if self.align == 1:
            return recv, handle.counts, handle
        return recv, torch.diff(handle.ends, prepend=handle.ends.new_zeros(1)), handle

    def combine(  # type: ignore[override]
        self, routed_output_RD: Tensor, metadata: Any, x_TD: Tensor
    ) -> Tensor:
        """Each token's expert outputs, weighted by its router scores and summed: ``(T, D)``."""
        if isinstance(metadata, LocalDispatchMetadata):
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        return moe.combine(routed_output_RD, metadata, **self.combine_formats).to(x_TD.dtype)


def _round_up(need: int) -> int:
    """The smallest int ``>= need`` with at most 4 significant bits: at most 1/8 above it.

    An overflow costs little here (exact mode's dispatch instead of static mode's,
    decided before any row moves), so the capacity grows tightly: every row of
    capacity is a row of padding on the wire and in the experts' buffer. Four bits
    keep the shapes a layer meets to 8 per doubling of the need.
    """
    step = 1 << max(need.bit_length() - 4, 0)
    return -(-need // step) * step


@override(
    target=AllToAllTokenDispatcher.Config,
    description="funcoll.moe's token dispatch (exact, static or dropless), compiled without graph breaks.",
)
def funcoll_dispatcher(
    cfg: AllToAllTokenDispatcher.Config,
    *,
    mode: str = "exact",
    capacity: int | None = None,
    capacity_factor: float | None = None,
    align: int = 1,
    grow: bool = True,
) -> FuncollTokenDispatcher.Config:
    """torchtitan override: every ``AllToAllTokenDispatcher`` of the model becomes a :class:`FuncollTokenDispatcher`."""
    return FuncollTokenDispatcher.Config(
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        mode=mode,
        capacity=capacity,
        capacity_factor=capacity_factor,
        align=align,
        grow=grow,
    )
