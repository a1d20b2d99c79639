"""funcoll's foundations: what every layer above uses and that uses nothing of funcoll's.

Argument checks (``_checks``), the one run-time switch (``_config``), the group
canonicaliser (``_group``), ints and SymInts without guards (``_sym``), dtypes and
reductions on the wire (``_wire``), the ragged strategies (``_strategy``), DTensor
in and out (``_dtensor``) and ``mark_ragged`` (``_compile``). The layers:
docs/contributing.md.
"""
