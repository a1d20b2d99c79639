"""Mixture-of-experts token dispatch and combine: dropless, differentiable, one compiled graph.

``dispatch`` sends every (token, choice) pair of a top-k router to the rank that
owns its expert and lays the rows out as a grouped GEMM takes them; ``combine``
brings the experts' outputs back and sums each token's k outputs weighted by its
router weights. Both are compositions of funcoll collectives whose backwards
exist (``all_to_all``, ``all_to_all_v``'s primitive) and of local row
moves (``index_select``, a weighted sum over the k choices), so autograd gives
the adjoints: the backward of dispatch moves gradients the way combine moves
outputs (unweighted), and the backward of combine moves them the way dispatch
moves tokens. The row moves' backward is a gather through the inverse map
(:class:`_Gather`), not autograd's zero fill and scatter-add.

Layout. ``E = num_experts`` experts split evenly over the group's ``world``
ranks: rank r owns the ``E_local = E // world`` experts ``[r * E_local, (r + 1) *
E_local)``, local expert e being global expert ``r * E_local + e``. Token t's
choice j (``topk_idx[t, j]``) is one row. The rows a rank receives are grouped by
local expert (expert-major), then by source rank, then in the source's token
order (t, then j), each expert's block padded with zero rows to a multiple of
`align`: expert e's rows sit at ``[offsets[e], offsets[e] + counts[e])``.

Modes, and where each reads the device on the host:

- ``"exact"``: the per-expert counts travel in one small even ``all_to_all``,
  are read on the host once (the one device-to-host sync per dispatch: an
  uneven all-to-all takes its splits as host ints), and the rows move by
  ``all_to_all_v``'s differentiable primitive with both size lists given (no
  size exchange, and no sizes tensor built from host ints). Nothing is padded
  on the wire and nothing is dropped. ``combine`` reads nothing on the host: it
  reuses the host sizes kept in the handle. Compiled, the sizes are unbacked
  SymInts and the graph is the same for every routing.
- ``"static"``: every (source, destination) pair sends a block of `capacity`
  rows in one even ``all_to_all`` (the counts are known from the counts'
  exchange, so no header travels); nothing is read on the host and every shape is
  static. A rank's rows beyond `capacity` for one destination are dropped: the
  first `capacity` of them in token-major order (t, then j) are kept, and the
  dropped count is returned on the device in ``handle.dropped``. A dropped
  pair contributes zero to its token's combined output. ``capacity=None`` is
  the dropless bound ``T * k`` (every rank must then hold the same ``T``): each
  rank's receive buffer is ``world * T * k`` rows of ``H``. (On the wire each
  block has one spare row more, never data.)
- ``"dropless"`` (with a `capacity`, eager only): static mode's layout when it
  drops nothing, exact mode's otherwise, decided per dispatch. The counts travel
  in one ``all_gather`` (every rank's per-expert counts and capacity, in place of
  the other modes' ``all_to_all``), so every rank knows the most pairs any rank
  routes to one rank and the group's largest capacity; one host read of them
  (with exact mode's ints, so that an overflow reads nothing more) tells every
  rank alike which path to take, before any row moves.
  Nothing outside the dispatch runs again: this is the dropless mode for a layer
  that cannot wrap its step (a framework's token dispatcher). One host read per
  dispatch, as exact mode; a compiled graph cannot branch on it, so compiling it
  raises (compile ``"exact"``).
- a :class:`Dropless` policy (``mode=policy``): dropless without a host read per
  layer. Inside ``policy.run(forward, ...)`` every dispatch is static with the
  policy's capacity and records, on the device, the capacity it needed; after
  the forward one ``all_reduce`` (max) of that over the group and one host read
  of the result (the step's one sync) tell every rank alike whether any
  dispatch of any rank overflowed. If one did, the forward runs again with every
  dispatch in exact mode (that step's results are exact), and the capacity
  grows to the next power of two that fits, so later steps fit again.
"""

from __future__ import annotations

from ._dispatch import MODES, combine, dispatch
from ._dropless import Dropless
from ._handle import MoEHandle

__all__ = ["MODES", "Dropless", "MoEHandle", "combine", "dispatch"]
