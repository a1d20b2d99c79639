"""The values of JAX's typed mode: tensors that know which mesh axes they vary over.

Inside ``funcoll.shard_map(..., check_vma=True)`` every tensor `f` sees or makes is
a :class:`Typed`: a ``torch.Tensor`` subclass (``__torch_function__`` only, no
``__torch_dispatch__``) whose ``vma`` is the frozenset of manual mesh axes it varies
over, JAX's ``jax.typeof(x).vma``. Every torch function applied to typed values
returns values typed with the union of its inputs' axes, after casting each input
that varies over fewer of them to the union first, as JAX's automatic ``pcast`` does
(:data:`CAST`, set by ``funcoll._vma``: the identity forward, a psum over the axes
added in the backward, only where a gradient flows). ``funcoll.lax``'s collectives
take the plain tensors out (:func:`plain`), run, and type their results by JAX's rule
for each.

The subclass lives in the trace only: ``torch.compile`` inlines
``__torch_function__`` and its graph holds the plain ops, and ``shard_map`` hands
plain tensors in and out of `f`, so no typed tensor crosses a graph boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ._phase import Primitive

__all__ = ["CAST", "Typed", "no_transforms", "plain", "type_of", "typed", "vma_of"]

# While True, a Typed tensor's torch functions run as a plain tensor's (how `plain` unwraps).
_PLAIN: list[bool] = [False]
# funcoll._vma's cast of one tensor to vary over more axes: CAST[0](t, axes) -> plain tensor.
CAST: list[Callable[[Tensor, frozenset[str]], Tensor]] = []


# Tensor's operators that torch defines in Python (a wrapper that turns a TypeError into
# NotImplemented), which dynamo cannot trace for a __torch_function__ subclass: each as the torch
# function it calls, by the operator's name (dynamo hands over other function objects for them on
# some releases, and matches no function-keyed dict), so that the typed mode compiles `x ** 2`,
# `1 - x`, `1 / x`. Every one takes (self, other); "pow" is also torch.pow's name, which it calls.
_OPERATORS: dict[str, Callable[..., Tensor]] = {
    "pow": lambda a, b: torch.pow(a, b),
    "__rpow__": lambda a, b: torch.pow(b, a),
    "__rsub__": lambda a, b: torch.rsub(a, b),
    "__rdiv__": lambda a, b: torch.reciprocal(a) * b,
    "__rtruediv__": lambda a, b: torch.reciprocal(a) * b,
    "__rmod__": lambda a, b: torch.remainder(b, a),
    "__floordiv__": lambda a, b: torch.floor_divide(a, b),
    "__rfloordiv__": lambda a, b: torch.floor_divide(b, a),
    "__rlshift__": lambda a, b: torch.bitwise_left_shift(b, a),
    "__rrshift__": lambda a, b: torch.bitwise_right_shift(b, a),
    "__rmatmul__": lambda a, b: torch.matmul(b, a),
}


class _Type:
    """What a :class:`Typed` tensor varies over: its own axes (``vma``) and the type of the tensor it
    views (``of``), shared by the tensor and its views, and written in place with them; ``grad``:
    whether the tensor it views required grad when the view was made (``x.detach()`` does not)."""

    __slots__ = ("grad", "of", "vma")

    def __init__(self, vma: frozenset[str], of: _Type | None, grad: bool) -> None:
        self.vma = vma
        self.of = of
        self.grad = grad


class Typed(Tensor):
    """A tensor of ``shard_map(check_vma=True)``: the mesh axes its value varies over (:func:`vma_of`).

    The type is a :class:`_Type` the tensor holds. A view made inside `f` (``x.narrow(...)``,
    ``x[1:]``, ``x.view(-1)``, ``x.detach()``) holds a type whose ``of`` is its source's, so
    that the two share their writes: a write into the view widens the tensor it views (and
    what that views), and a view varies over what its source varies over, whenever that
    was written. Without the link ``x.narrow(0, 0, 1).copy_(y)`` retyped the view only,
    and ``x`` (or a sibling view of it) kept a type that said invariant while its ranks
    held different values. The type is an object of its own, not the tensor's attribute,
    because dynamo replaces a tensor written in place by a new variable that carries the
    attributes the tensor had before: a mutated ``_Type`` is seen through either.
    """

    _type: _Type

    @staticmethod
    def __new__(cls, t: Tensor, vma: frozenset[str], of: Tensor | None = None) -> Typed:
        out = t.as_subclass(cls)
        src = type_of(of)
        if src is None:
            out._type = _Type(vma, None, False)
        else:
            with torch._C.DisableTorchFunctionSubclass():  # a plain read, not a torch function of the type
                out._type = _Type(vma, src, of.requires_grad)  # type: ignore[union-attr]
        return out  # type: ignore[return-value]

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _PLAIN[0]:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if _AUTOGRAD.get(name, False):
            return _differentiate(func, args, kwargs)
        operator = _OPERATORS.get(name)
        if operator is not None and len(args) == 2 and not kwargs:
            func = operator
        vma: frozenset[str] = frozenset()
        for a in (*args, *kwargs.values()):
            vma = vma | _vma_in(a)
        target = _written(func, args, kwargs)
        if target is not None:
            _check_write(func, target, vma)
            _widen(target, vma)  # a typed target (and what it views) varies over what is written into it
        with torch._C.DisableTorchFunctionSubclass():
            if vma:
                args = tuple(a if a is target else _cast(a, vma) for a in args)
                kwargs = {k: v if v is target else _cast(v, vma) for k, v in kwargs.items()}
            out = func(*args, **kwargs)
        if out is target and type_of(target) is not None:
            return target  # the same tensor; compiled, the variable that holds its type
        return _typed_out(out, vma, _viewed(func, args, out))


# torch.autograd.grad, torch.autograd.backward and Tensor.backward, by name (as _OPERATORS): they
# differentiate the tensors they are given, which a cast would replace (`_differentiate`).
_AUTOGRAD: dict[str, bool] = {"grad": True, "backward": True}


def _differentiate(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.autograd.grad`` or ``backward`` inside a typed `f`, on the tensors as they are.

    No argument is cast: a cast is a new tensor, so ``grad(loss, w)`` would differentiate
    another output (an invariant loss cast to vary, whose gradient then psums: the
    result times the axis size) or another input (not in the graph). The gradients
    are typed as their inputs, as JAX types a cotangent as its primal; the casts that
    the forward made (a psum of the gradient where an invariant value met a varying
    one) are on the graph already, so an invariant input's gradient is the same on
    every rank.
    """
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if getattr(func, "__name__", "") != "grad" or not isinstance(out, tuple):
        return out  # backward: None
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    return tuple(g if g is None else typed(g, vma_of(i)) for g, i in zip(out, inputs, strict=True))


# The functions that write their first argument in place, by name: torch's `name_` methods and
# functions (`x.add_(y)`, `torch.relu_`, `nn.init.normal_`), `x[i] = y` and Python's in-place
# operators (`x += y`). A dict lookup by name, as for _OPERATORS: dynamo traces it, where it
# cannot trace `str.endswith` on some functions' names.
_IN_PLACE: dict[str, bool] = {
    name: True
    for module in (torch.Tensor, torch, torch.nn.functional, torch.nn.init)
    for name in dir(module)
    if name.endswith("_") and not name.endswith("__")
}
_IN_PLACE.update(
    (f"__i{op}__", True)
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
               "lshift", "rshift")
)  # fmt: skip
_IN_PLACE["__setitem__"] = True


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The tensor `func` writes in place (``x.add_(y)``, ``x[i] = y``, ``x += y``, ``out=``,
    ``inplace=True``), or None for a function that makes new tensors."""
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        return out
    in_place = _IN_PLACE.get(getattr(func, "__name__", ""), False) or kwargs.get("inplace") is True
    return args[0] if in_place and args and isinstance(args[0], Tensor) else None


def _check_write(func: Any, target: Tensor, vma: frozenset[str]) -> None:
    """An in-place write that its target's type can follow, or a TypeError that says what to write.

    The written tensor, and what it views, take the union of the axes (:func:`_widen`). Two
    writes cannot be followed: into a plain tensor (one made inside `f` by a factory such as
    ``torch.zeros``, which carries no type) of a value that varies, and into a typed tensor
    that requires grad of a value that varies over more axes than it does, which JAX's
    automatic cast (a psum of the gradient where it widens the type) would have to apply
    to the tensor being overwritten. Either would leave a stale type and a value that
    varies where the type says it does not: an output that says replicated and is not.
    """
    have = vma_of(target)
    more = vma - have
    if not more:
        return
    name = getattr(func, "__name__", repr(func))
    if type_of(target) is None:
        why = "a tensor made inside f by a factory function (torch.zeros, torch.empty, ...) carries no type"
    elif target.requires_grad and torch.is_grad_enabled():
        why = "it requires grad, and widening its type casts it (a psum of its gradient), which has no in-place form"
    elif _views_grad(target) and torch.is_grad_enabled():
        why = (
            "it is a detached view of a tensor that requires grad, whose type widens with it and would be "
            "cast (a psum of its gradient), which has no in-place form"
        )
    else:
        return
    raise TypeError(
        f"funcoll.shard_map: `{name}` writes a value varying over {sorted(more)} in place into a tensor "
        f"typed as varying over {sorted(have)} inside shard_map(..., check_vma=True), and {why}; write it "
        f"out of place (`x = x + y`, `x = torch.where(...)`), or make the tensor from a typed value "
        f"(torch.zeros_like(y))"
    )


def type_of(t: object) -> _Type | None:
    """The type a typed tensor holds (:class:`Typed`), or None for anything else.

    Read as the tensor's attribute, not by its class: compiled, dynamo hands a tensor that
    was written in place on as a plain tensor, which still holds its attributes (a class
    test took it for untyped, and the type of everything computed from it was lost).
    """
    if isinstance(t, Typed):
        return t._type
    if isinstance(t, Tensor) and torch.compiler.is_compiling():
        return getattr(t, "_type", None)
    return None


def _widen(t: Tensor, vma: frozenset[str]) -> None:
    """`t` written in place with a value varying over `vma`: it and every tensor it views vary over it too."""
    of = type_of(t)
    while of is not None:
        of.vma = of.vma | vma
        of = of.of


def _views_grad(t: Tensor) -> bool:
    """Whether a tensor typed `t` views required grad when the view was made (``x.detach()`` of one)."""
    of = type_of(t)
    while of is not None:
        if of.grad:
            return True
        of = of.of
    return False


def _vma_in(a: Any) -> frozenset[str]:
    if isinstance(a, Tensor):
        return vma_of(a)
    if isinstance(a, (list, tuple)):
        vma: frozenset[str] = frozenset()
        for b in a:
            vma = vma | vma_of(b)
        return vma
    return frozenset()


def _cast(a: Any, vma: frozenset[str]) -> Any:
    """`a` made to vary over `vma` where its gradient needs the psum of JAX's automatic pcast."""
    if isinstance(a, Tensor):
        have = vma_of(a)
        if have != vma and a.requires_grad and torch.is_grad_enabled():
            no_transforms("funcoll.shard_map")
            return CAST[0](a, vma - have)
        return a
    if isinstance(a, (list, tuple)) and any(isinstance(b, Tensor) for b in a):
        return type(a)(_cast(b, vma) for b in a)
    return a


def no_transforms(opname: str) -> None:
    """Refuse the typed mode's casts and collectives inside a torch.func transform (eager code).

    ``torch.func.grad`` (``vjp``, ``grad_and_value``, ``vmap``) hands its function
    torch's wrappers of the values it transforms: plain tensors, whose type (the axes
    a value varies over) is gone. The typed mode would take a varying input for an
    invariant one, cast it (a psum of its gradient) and transpose ``psum`` as the
    untyped mode does: gradients silently other than JAX's. ``torch.autograd.grad``
    inside the typed `f` keeps the types (``_differentiate``).
    """
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"{opname}: torch.func's transforms (grad, vjp, grad_and_value, vmap) do not run inside "
            f"shard_map(..., check_vma=True): the values they pass carry no type (funcoll.typeof(x).vma), so "
            f"the typed mode would transpose its collectives by the untyped rules; use torch.autograd.grad "
            f"inside the typed f, or torch.func inside shard_map(..., check_vma=False)"
        )


def _viewed(func: Any, args: tuple[Any, ...], out: Any) -> Tensor | None:
    """The typed tensor `func`'s result views (its first argument), or None for a result with its own data.

    A view function's results (:data:`_VIEWS`, torch's list of them) that are views (they
    have a ``_base``: ``reshape`` and indexing by a tensor copy instead), ``detach``'s,
    and a result that is the argument itself (``contiguous`` of a contiguous tensor).
    By name and not by ``_base`` alone: an op may return a view of a tensor of its own
    (``einsum``). Only the first argument is taken for the source: torch's view
    functions view it.
    """
    if not args or type_of(args[0]) is None:
        return None
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if first is args[0]:
        return args[0]
    name = getattr(func, "__name__", "")
    if _SHARES_DATA.get(name, False):
        return args[0]
    if not _VIEWS.get(name, False) or not isinstance(first, Tensor):
        return None
    with torch._C.DisableTorchFunctionSubclass():
        view = first._base is not None  # `_is_view()`, which dynamo does not trace
    return args[0] if view else None


# torch's view functions (docs: "Tensor Views"), by name (as _OPERATORS); `__getitem__` is a view for
# basic indexing, `reshape`, `flatten` and `unflatten` when the strides allow: `_viewed` checks `_base`.
_VIEWS: dict[str, bool] = dict.fromkeys(
    ("__getitem__", "adjoint", "as_strided", "chunk", "diagonal", "expand", "expand_as", "flatten", "hsplit",
     "movedim", "moveaxis", "narrow", "permute", "reshape", "reshape_as", "select", "split", "split_with_sizes",
     "squeeze", "swapaxes", "swapdims", "t", "tensor_split", "transpose", "unbind", "unflatten", "unfold",
     "unsqueeze", "view", "view_as", "view_as_real", "view_as_complex", "vsplit", "dsplit", "real", "imag",
     "__get__"),
    True,
)  # fmt: skip
# Functions whose result shares their input's data without being a view of it (by name, as _OPERATORS).
_SHARES_DATA: dict[str, bool] = {"detach": True}


def _typed_out(out: Any, vma: frozenset[str], of: Tensor | None = None) -> Any:
    if isinstance(out, Tensor):
        return typed(out, vma, of)
    if isinstance(out, torch.Size) or not isinstance(out, (tuple, list)):
        return out
    if type(out) in (tuple, list):
        return type(out)(_typed_out(o, vma, of) for o in out)
    return type(out)([_typed_out(o, vma, of) for o in out])  # torch.return_types: max, sort, topk, ...


def typed(t: Tensor, vma: frozenset[str], of: Tensor | None = None) -> Typed:
    """`t` (plain or typed) as a typed tensor varying over `vma`: the same data and autograd history;
    `of`: the typed tensor `t` is a view of, whose writes' types it shares (:class:`Typed`)."""
    if isinstance(t, Typed):
        t = plain(t)
    elif isinstance(t, AsyncCollectiveTensor):
        # An eager collective's pending result cannot be re-classed: its values are waited for
        # here, where the typed mode types them (compiled graphs have no pending results).
        t = _Arrived.apply(t)
    return Typed(t, vma, of)


class _Arrived(Primitive):
    """A pending result's values, waited for, as a plain tensor on the same autograd path (no copy)."""

    @staticmethod
    def forward(t: AsyncCollectiveTensor) -> Tensor:
        return t.wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        return None  # the backward is the identity: it keeps nothing

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def plain(t: Tensor) -> Tensor:
    """`t` as a plain ``torch.Tensor`` (a view: the same data and autograd history); `t` if plain."""
    if not isinstance(t, Typed):
        return t
    _PLAIN[0] = True
    try:
        return t.view_as(t)
    finally:
        _PLAIN[0] = False


def vma_of(t: object) -> frozenset[str]:
    """The mesh axes `t` varies over: a typed tensor's own and those of the tensors it views
    (:class:`Typed`); none for anything else."""
    of = type_of(t)
    if of is None:
        return frozenset()
    vma = of.vma
    while of.of is not None:  # a view: the axes of what it views too
        of = of.of
        vma = vma | of.vma
    return vma
