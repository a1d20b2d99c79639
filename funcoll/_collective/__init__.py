"""One collective, from its issue to its result: the layers under every op.

From the bottom: the issue and wait of one collective, eager results that arrive
later and failures that name their op (``_issue``, ``_async``, ``_faults``); the row
moves around a padded collective and their Triton kernels (``_rows``,
``_kernels``); the size exchange and cross-rank checks (``_header``); the
differentiable primitives, each with its adjoint as its backward (``_prims``).
The layers: docs/contributing.md.
"""
