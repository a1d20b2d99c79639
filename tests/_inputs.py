"""Deterministic per-rank inputs shared by the test modules."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor


def seeded(shape: Sequence[int], dtype: torch.dtype, *key: object) -> Tensor:
    """A deterministic tensor for `key`. float64 is normal (for gradients); the other dtypes
    hold small integers, so sums, averages and products over 4 ranks are exact in bfloat16."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    if dtype == torch.float64:
        return torch.randn(tuple(shape), generator=gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    return torch.randint(-4, 5, tuple(shape), generator=gen).to(dtype)
