"""Argument checks shared by every op: one place, one wording.

Every message starts with the op's public name and names the argument in
backticks, then shows the bad value and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

IntLike = int | torch.SymInt

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def check_tensor(opname: str, arg: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{opname}: `{arg}` must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_dim(opname: str, x: Tensor, dim: object, arg: str = "dim", extra: int = 0) -> int:
    """Normalise a (possibly negative) tensor dim of `x`; `extra` allows one past the end."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{opname}: `{arg}` must be an int, got {type(dim).__name__}")
    ndim = x.dim() + extra
    if ndim == 0:
        raise ValueError(f"{opname}: `{arg}`={dim} needs a tensor with at least one dim, got a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{opname}: `{arg}`={dim} is out of range for a {x.dim()}-d tensor of shape {tuple(x.shape)}"
        )
    return dim % ndim


def check_reduce_op(opname: str, reduce_op: object, x: Tensor | None = None) -> str:
    """`reduce_op` lower-cased, one of ``REDUCE_OPS``; ``"avg"`` of `x` (when given) needs a floating dtype."""
    if not isinstance(reduce_op, str) or reduce_op.lower() not in REDUCE_OPS:
        raise ValueError(f"{opname}: `op`={reduce_op!r} is not one of {REDUCE_OPS}")
    if reduce_op.lower() == "avg" and x is not None and not x.dtype.is_floating_point:
        raise ValueError(f"{opname}: `op`='avg' needs a floating dtype, got {x.dtype}")
    return reduce_op.lower()


def check_rank(opname: str, arg: str, value: object, size: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{opname}: `{arg}` must be an int rank, got {type(value).__name__}")
    if not 0 <= value < size:
        raise ValueError(f"{opname}: `{arg}`={value} is not a rank of a group of size {size}")
    return value


def tensor_split_sizes(n: IntLike, parts: int) -> list[IntLike]:
    """Sizes of ``torch.tensor_split(t, parts)`` along a dim of length `n`: first ranks get one more.

    Branch-free (``ceil((n - i) / parts)``), so a SymInt `n` adds no guard.
    Example: ``tensor_split_sizes(7, 3) == [3, 2, 2]``.
    """
    return [(n - i + parts - 1) // parts for i in range(parts)]


def fresh(x: Tensor) -> Tensor:
    """A new contiguous copy: what an op returns when it has nothing to communicate."""
    return x.clone(memory_format=torch.contiguous_format)


def is_int_dtype(dtype: torch.dtype) -> bool:
    """An integer dtype: bool, floating and complex dtypes are not."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_sizes(
    opname: str,
    arg: str,
    sizes: object,
    count: int | None,
    *,
    tensors: bool = True,
    bound: IntLike | None = None,
    bound_text: str = "",
) -> list[IntLike] | Tensor:
    """`sizes`: `count` row counts (one per rank), as ints or an integer tensor.

    funcoll's one size check, one contract for every op that takes sizes:

    - ``TypeError``: `sizes` is neither a list/tuple of ints nor (with `tensors`) a
      tensor; a tensor whose dtype is not an integer one (float, complex, bool); an
      entry that is not an int (a bool, a float).
    - ``ValueError``: not `count` entries (a tensor must be 1-d, or 0-d for one
      entry); a negative entry; with `bound`, an entry above it (`bound_text` says
      what the bound is).

    `count` None means one count given on its own (an int, or a tensor of one
    element), such as ``gather_padded``'s `length`. Ints are checked here, before
    any communication; SymInt entries pass (a compiled graph asserts on them where
    they are used). A tensor's values are checked where they are read: on the host
    (``host_ints``) or on the device after the header exchange. Returns the ints as
    a list, or the tensor.
    """
    n_wanted = 1 if count is None else count
    kinds = "an int" if count is None else "a list of ints"
    kinds = f"an integer tensor or {kinds}" if tensors else kinds
    if isinstance(sizes, Tensor) and tensors:
        if not is_int_dtype(sizes.dtype):
            raise TypeError(f"{opname}: `{arg}` must be {kinds}, got a {sizes.dtype} tensor")
        if sizes.dim() > 1 or sizes.numel() != n_wanted or (sizes.dim() == 0 and count not in (None, 1)):
            raise ValueError(
                f"{opname}: `{arg}` must hold {n_wanted} value(s), got a tensor of shape {tuple(sizes.shape)}"
            )
        return sizes
    if count is None:
        if isinstance(sizes, bool) or not isinstance(sizes, (int, torch.SymInt)):
            raise TypeError(f"{opname}: `{arg}` must be {kinds}, got {type(sizes).__name__}")
        ints, where = [sizes], lambda i: f"`{arg}`"
    else:
        if not isinstance(sizes, (list, tuple)):
            raise TypeError(f"{opname}: `{arg}` must be {kinds}, got {type(sizes).__name__}")
        for i, n in enumerate(sizes):
            if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
                raise TypeError(f"{opname}: `{arg}`[{i}] must be an int, got {type(n).__name__} {n!r}")
        if len(sizes) != count:
            raise ValueError(
                f"{opname}: `{arg}`={list(sizes)!r} must be {count} ints, one per rank, got {len(sizes)}"
            )
        ints, where = list(sizes), lambda i: f"`{arg}`[{i}]"
    for i, n in enumerate(ints):
        if isinstance(n, torch.SymInt):
            continue
        if bound is not None and isinstance(bound, int) and not 0 <= n <= bound:
            raise ValueError(f"{opname}: {where(i)}={n} is outside [0, {bound}] = [0, {bound_text}]")
        if n < 0:
            raise ValueError(f"{opname}: {where(i)}={n} is negative: sizes are row counts")
    return ints


def check_equal(a: IntLike, b: IntLike, traced: str, eager: Callable[[], str]) -> None:
    """``a == b``: a ValueError saying ``eager()`` now, or a run-time assert saying `traced`.

    Under dynamo a SymInt passes ``isinstance(., int)`` and fails
    ``isinstance(., SymInt)``, so in a compiled graph (or on SymInts) the check is
    asserted at run time; `traced` may hold only constants (dynamo refuses a
    message closure over SymInts). The message is bound as a default argument, not
    a closure: dynamo before torch 2.13 refuses any message function with a
    closure (a graph break), and takes one whose defaults are constants.
    """
    if torch.compiler.is_compiling() or isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        torch._check(a == b, lambda traced=traced: traced)
    elif a != b:
        raise ValueError(eager())


def check_total(opname: str, arg: str, sizes: list[IntLike], total: IntLike, what: str) -> None:
    """`sizes` add up to `total` (`what` names it)."""
    got = sum(sizes)
    check_equal(got, total, f"{opname}: `{arg}` does not sum to {what}",
                lambda: f"{opname}: `{arg}`={list(sizes)} sums to {got}, but {what}={total}")  # fmt: skip
