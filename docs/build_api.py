"""Write docs/api.md from the docstrings of funcoll's public API.

Run ``python docs/build_api.py``; ``tests/test_docs.py`` fails when api.md is
stale, so the reference never drifts from the code and no docstring is copied by hand.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import funcoll
import funcoll.compat
import funcoll.lax
import funcoll.testing
from funcoll._ops._spec import FAMILIES, specs

# Public names that are not ops (no spec), shown after the ops of a section.
_EXTRA = {"JAX's shard_map": ["P"], "Even collectives": ["Wire"]}

# Every public op in the section its definition names (funcoll/_ops/_spec.py), then the submodules.
SECTIONS = [
    *(
        (family, funcoll, [s.name for s in specs() if s.family == family] + _EXTRA.get(family, []))
        for family in FAMILIES
    ),
    ("funcoll.lax", funcoll.lax, funcoll.lax.__all__),
    ("funcoll.compat", funcoll.compat, funcoll.compat.__all__),
    (
        "funcoll.testing",
        funcoll.testing,
        [
            "run_ranks",
            "start_ranks",
            "in_flight",
            "settled",
            "launch",
            "print_line",
            "print_ranks",
            "heartbeat",
            "recording_backend",
            "count_host_reads",
        ],
    ),
]


def render() -> str:
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/build_api.py`; do not edit by hand.",
        "",
    ]
    for title, module, names in SECTIONS:
        out += [f"## {title}", ""]
        if module is not funcoll:
            out += [inspect.cleandoc(module.__doc__ or ""), ""]
        for name in names:
            obj = getattr(module, name)
            prefix = "funcoll." if module is funcoll else f"{module.__name__}."
            doc = inspect.cleandoc(obj.__doc__ or "")
            summary, _, body = doc.partition("\n")
            out += [f"### `{prefix}{name}{inspect.signature(obj)}`", "", summary, ""]
            if body.strip():
                out += ["```text", body.strip("\n"), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    path = Path(__file__).with_name("api.md")
    path.write_text(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
