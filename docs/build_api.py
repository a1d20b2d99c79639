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
import funcoll.testing

SECTIONS = [
    ("Even collectives", funcoll, ["all_gather", "all_gather_into_tensor", "reduce_scatter", "all_reduce",
                                   "all_to_all", "ppermute", "broadcast", "axis_index", "axis_size",
                                   "split_sizes"]),
    ("Ragged collectives", funcoll, ["gather", "all_gather_list", "all_gather_ragged", "all_to_all_v",
                                     "mark_ragged"]),
    ("Static-shape ragged collectives", funcoll, ["gather_padded", "all_to_all_padded"]),
    ("Region ops", funcoll, ["split_forward_gather_backward", "gather_forward_split_backward"]),
    ("Checks", funcoll, ["set_checks", "checks_enabled"]),
    ("funcoll.compat", funcoll.compat, funcoll.compat.__all__),
    ("funcoll.testing", funcoll.testing, ["run_ranks"]),
]  # fmt: skip


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
