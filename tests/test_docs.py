"""The docs stay in step with the code: api.md is generated, every public op is documented."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

import funcoll

DOCS = Path(__file__).resolve().parent.parent / "docs"
OPS = [n for n in funcoll.__all__ if inspect.isfunction(getattr(funcoll, n))]


def _builder():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("build_api", DOCS / "build_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_reference_is_generated_from_current_docstrings() -> None:
    assert (DOCS / "api.md").read_text() == _builder().render(), "run `python docs/build_api.py`"


@pytest.mark.parametrize("name", OPS)
def test_public_op_is_in_the_api_reference(name: str) -> None:
    assert f"### `funcoll.{name}(" in (DOCS / "api.md").read_text()


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in OPS
        if n
        not in (
            "axis_index",
            "axis_size",
            "mark_ragged",
            "allow_compile_caches",
            "split_sizes",
            "checks_enabled",
        )
    ],
)
def test_public_op_docstring_has_the_sections(name: str) -> None:
    doc = inspect.getdoc(getattr(funcoll, name)) or ""
    for section in ("Args:", "Returns:", "Backward", "Example (2 ranks"):
        assert section in doc, f"funcoll.{name} docstring lacks {section!r}"


@pytest.mark.parametrize("name", OPS)
def test_public_op_is_fully_type_hinted(name: str) -> None:
    sig = inspect.signature(getattr(funcoll, name))
    missing = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
    assert not missing and sig.return_annotation is not inspect.Signature.empty, missing
