"""The public ops, by family, above the primitives, and their one entry.

``_entry`` (``@entry``: the steps every op takes before its own work), the even
collectives (``_even``), the ragged ones (``_ragged``), the region ops
(``_region``), the static-shape ones (``_static``), ragged data into and out of
DTensor (``_shard``), and ``_spec``, what the docs and tests know of each op.
``funcoll/__init__.py`` re-exports them. The layers: docs/contributing.md.
"""
