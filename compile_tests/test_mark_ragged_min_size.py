"""mark_ragged(min_size=1): a ragged length that feeds scaled_dot_product_attention compiles once.

Without a lower bound the unbacked length may be 0, and SDPA's branch on an empty
size cannot be traced; with ``min_size=1`` (or ``torch._check(n >= 1)`` in the
compiled function, on any torch) one graph serves every length. Single process:
the bound is a fact about the input, not about communication. The reference is
the same attention run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import funcoll
from funcoll._base._compile import _mark_unbacked_takes_min

LENGTHS = (3, 5, 1, 7, 2)


def _attention(q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q).sum(2)


def _q(n: int) -> torch.Tensor:
    return torch.randn(2, 3, n, 4, generator=torch.Generator().manual_seed(n), dtype=torch.float64)


def _checked(q: torch.Tensor) -> torch.Tensor:
    torch._check(q.shape[2] >= 1)
    return _attention(q)


def _frames_over_lengths(fn: Callable[[torch.Tensor], torch.Tensor], min_size: int) -> int:
    """Compile `fn`, call it on every length (marked ragged), check each result; the frames compiled."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(fn, fullgraph=True, backend=counter)
    for n in LENGTHS:
        q = _q(n)
        torch.testing.assert_close(step(funcoll.mark_ragged(q, 2, min_size=min_size)), _attention(q))
    return counter.frame_count


@pytest.mark.skipif(not _mark_unbacked_takes_min(), reason="this torch's mark_unbacked takes no min")
def test_min_size_one_compiles_once_across_lengths() -> None:
    assert _frames_over_lengths(_attention, min_size=1) == 1


@pytest.mark.skipif(_mark_unbacked_takes_min(), reason="this torch's mark_unbacked takes min")
def test_min_size_without_torch_support_names_the_fallback() -> None:
    """torch 2.11: mark_unbacked has no `min`; the error names the torch._check to write instead."""
    with pytest.raises(NotImplementedError, match=r"funcoll\.mark_ragged: `min_size` needs") as info:
        funcoll.mark_ragged(_q(3), 2, min_size=1)
    assert "torch._check(x.shape[2] >= 1)" in str(info.value)


def test_check_in_the_compiled_function_serves_any_torch() -> None:
    assert _frames_over_lengths(_checked, min_size=0) == 1


def test_without_a_bound_the_empty_branch_cannot_be_traced_before_torch_2_15() -> None:
    """Before 2.15, SDPA's branch on an empty length fails to trace; from 2.15 one graph serves every length."""
    torch._dynamo.reset()
    step = torch.compile(_attention, fullgraph=True, backend="aot_eager")
    if _release() < (2, 15):
        with pytest.raises(Exception, match="data-dependent"):
            step(funcoll.mark_ragged(_q(3), 2))
    else:
        assert _frames_over_lengths(_attention, min_size=0) == 1


def _release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize(
    ("x", "min_size", "error", "fragment"),
    [(torch.zeros(2, 0), 1, ValueError, "below `min_size`=1"),
     (torch.zeros(2, 3), -1, ValueError, "`min_size`=-1"),
     (torch.zeros(2, 3), 1.0, TypeError, "`min_size` must be an int, got float 1.0")],
    ids=["below", "negative", "float"],
)  # fmt: skip
def test_bad_min_size_raises(x: torch.Tensor, min_size: object, error: type, fragment: str) -> None:
    with pytest.raises(error, match=r"funcoll\.mark_ragged") as info:
        funcoll.mark_ragged(x, 1, min_size=min_size)  # type: ignore[arg-type]
    assert fragment in str(info.value)
