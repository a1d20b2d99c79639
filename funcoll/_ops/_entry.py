"""One definition for every public op: what it is, and the steps it takes before its own work.

An op is defined in one place, its function under ``@entry``::

    @entry("all_gather", EVEN,
           header=Header(args=(Arg("dim"), Arg("tiled", bool)), reads=NDIM_ONLY, check_only=True),
           collectives=fixed({AG: 1}, {RS: 1}),
           placements=("Shard(dim)", "Replicate()"),
           dtensor=_all_gather_dtensor,
           refuse=Refusal("its result stacks the ranks' tensors along a new dim",
                          "funcoll.all_gather(x, dim)", when=lambda a: not a["tiled"]))
    def all_gather(x, dim=0, *, group=None, tiled=True): ...

What it is (its docs section, its header, the collectives it issues, its DTensor
placements) is registered when it is defined (``_spec.register``,
``_header.register_header``), where the rest of funcoll reads it; and every call
then goes through the same steps, in this order, before the body:

1. the op's name is recorded, so that a failed collective names it (:func:`public_op`);
2. each tensor argument (`tensors`, and each of `optional` that is not None) is a
   ``torch.Tensor``, or a ``TypeError`` names the op and the argument;
3. a DTensor `x` is refused (`refuse`: why no placement describes the result, and
   what to use) or handed to the op's placement rule (`dtensor`), which gets the
   :class:`~funcoll._base._dtensor.MeshAxis` of `x` and the op's other arguments by name,
   and returns the op's result on the mesh;
4. an op with `wire` and `grad_wire` parameters gets them checked
   (:func:`~funcoll._base._quant.check_wire`: Wires or None, asked only of a floating
   first tensor); a DTensor `x` travels exactly, so its placement rule gets neither,
   and a format given with one is refused;
5. `group` is resolved once (:func:`~funcoll._base._group.resolve_group`) and the body
   gets the resolved :class:`~funcoll._base._group.Group` in its place, so that what it
   calls with it resolves nothing again.

The body then checks its own arguments (dims, sizes, reduce ops: what differs from
op to op) and issues its primitives. ``tests/test_specs.py`` fails when a public op
has no entry, or takes a tensor `x` and says neither how a DTensor is refused nor
what its placement rule is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

from .._base._checks import check_tensor
from .._base._dtensor import MeshAxis, dtensor_input, is_dtensor, refuse_dtensor
from .._base._group import resolve_group
from .._base._quant import check_wire, exact_for_dtensor
from .._collective._faults import public_op
from .._collective._header import Header, register_header
from .._collective._typed import type_of, vma_of
from ._spec import OpSpec, Plan, register

__all__ = ["Refusal", "entry"]

_F = TypeVar("_F", bound=Callable[..., Any])
_EMPTY = inspect.Parameter.empty


@dataclass(frozen=True)
class Refusal:
    """Why a DTensor `x` is refused (no placement describes the result), and what to use instead.

    `when`: refuse only when it holds of the op's arguments (by name, defaults filled
    in); None: always, or whenever the op has no placement rule. `raises`: the op's
    own refusal, called as ``raises(opname, arg, x)``, for one that is not about
    placements (``from_ragged`` makes a DTensor, and takes none: a ``TypeError``).
    """

    why: str = ""
    instead: str = ""
    when: Callable[[Mapping[str, Any]], bool] | None = None
    raises: Callable[[str, str, object], None] | None = None

    def raise_for(self, opname: str, arg: str, x: object) -> None:
        if self.raises is not None:
            self.raises(opname, arg, x)
        refuse_dtensor(opname, x, self.why, self.instead, arg)


@dataclass(frozen=True)
class Entry:
    """What :func:`entry` knows of one op: read by tests/test_specs.py and the docs."""

    name: str
    tensors: tuple[str, ...]
    optional: tuple[str, ...]
    dtensor: Callable[..., Any] | None
    refuse: Refusal | None
    resolves_group: bool


class _Arguments:
    """An op's arguments by name in a call's ``(args, kwargs)``: a cheaper binding than ``inspect``'s."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = list(inspect.signature(fn).parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
            raise TypeError(f"{fn.__name__}: an op's parameters are named (no *args, **kwargs or /)")
        self.names = tuple(p.name for p in params)
        self.positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self.defaults = {p.name: p.default for p in params if p.default is not _EMPTY}
        self.index = {name: i for i, name in enumerate(self.names)}

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """Every argument by name, defaults filled in; None where Python would refuse the call
        itself (too many positional arguments, one given twice or unknown, a required one missing).

        Written for dynamo as much as for Python: a compiled caller's first call traces
        every bytecode here (about 0.1-0.2 ms each on a small CPU), so the dict is built
        by the interpreter's own operations (``{**a, **b}``), which dynamo handles natively,
        not by ``dict(...)``/``update``, which it runs as Python polyfills.
        """
        n = len(args)
        if n > self.positional:
            return None
        for k in kwargs:  # a keyword is a parameter's, not one the positional arguments bound
            i = self.index.get(k)
            if i is None or i < n:
                return None
        values = {**self.defaults, **kwargs}
        for name, a in zip(self.names, args, strict=False):  # len(args) <= len(self.names): checked above
            values[name] = a
        return values if len(values) == len(self.names) else None  # fewer: a required one is missing


# What a typed shard_map's program calls instead of a funcoll op (`_refuse_typed`).
_LAX_FORM = {
    "all_gather": "funcoll.lax.all_gather(x, axis_name, axis=dim, tiled=True)",
    "all_gather_into_tensor": "funcoll.lax.all_gather(x, axis_name, tiled=True)",
    "all_reduce": "funcoll.lax.psum(x, axis_name) (or pmean, pmax, pmin)",
    "reduce_scatter": "funcoll.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)",
    "all_to_all": "funcoll.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)",
    "all_to_all_v": "funcoll.lax.ragged_all_to_all",
    "ppermute": "funcoll.lax.ppermute(x, axis_name, perm)",
}


def _refuse_typed(name: str, arg: str, x: Tensor) -> None:
    """A value of ``shard_map(check_vma=True)`` handed to a funcoll op that is not ``funcoll.lax``'s.

    funcoll's ops know nothing of the typed mode: they would neither type their result
    by JAX's rule nor transpose as the typed mode does (a typed ``all_reduce``'s
    gradient came out other than ``lax.psum``'s), so their results there would be
    silently wrong. Every rank runs the same `f`, so every rank raises, before any
    communication.
    """
    instead = _LAX_FORM.get(name, "funcoll.lax's collectives (psum, all_gather, psum_scatter, all_to_all, "
                                  "ppermute, ragged_all_to_all)")  # fmt: skip
    raise TypeError(
        f"funcoll.{name}: `{arg}` is a value of funcoll.shard_map(..., check_vma=True) (it varies over "
        f"{sorted(vma_of(x))}), where collectives are funcoll.lax's: they type their results and take "
        f"their gradients by JAX's rules, which funcoll.{name} does not know. Use {instead} inside "
        f"the typed f, or shard_map(..., check_vma=False), whose values funcoll's ops take as they are"
    )


def entry(
    name: str,
    family: str | None = None,
    *,
    header: Header | None = None,
    collectives: Callable[[int, str], Plan] | None = None,
    placements: tuple[str, str] | None = None,
    limit: str | None = None,
    tensors: tuple[str, ...] = ("x",),
    optional: tuple[str, ...] = (),
    dtensor: Callable[..., Any] | None = None,
    refuse: Refusal | None = None,
    resolve: bool = True,
) -> Callable[[_F], _F]:
    """Define the public op `name` (``funcoll.<name>``): what it is, and the one entry every op takes.

    What it is, registered in :mod:`._spec` (None where the op has none):
    `family`: its docs section (None for an op outside ``funcoll.__all__``, such as
    ``moe.dispatch``); `header`: what its size exchange or cross-rank check carries,
    registered under `name`; `collectives`: ``(world, variant) -> (forward,
    backward)`` counts of the collectives one call issues; `placements`: a DTensor
    argument's placement and the result's (docs/dtensor.md); `limit`: what bounds a
    static op's counts.

    Its entry:
    `tensors`: the arguments that must be tensors, checked in this order; `optional`:
    those checked when not None. `dtensor`: the placement rule, called as
    ``dtensor(ax, **the other arguments)`` for a DTensor `x`; `refuse`: why a DTensor
    `x` is refused. `resolve`: hand the body a resolved group (False for the ops
    whose group is a mesh dim they read themselves).
    """
    opname = f"funcoll.{name}"
    if header is not None:
        header = register_header(name, header)
    if family is not None:
        register(OpSpec(name, family, header, limit, collectives, placements))

    def decorate(fn: _F) -> _F:
        arguments = _Arguments(fn)
        for arg in (*tensors, *optional, *(("group",) if resolve else ())):
            if arg not in arguments.names:
                raise TypeError(f"{opname}: the entry names `{arg}`, which is not a parameter")
        first = tensors[0] if tensors else None
        # The tensor arguments in the order they are checked, each with whether None is allowed.
        checked = (*((arg, False) for arg in tensors), *((arg, True) for arg in optional))
        formats = ("wire", "grad_wire") if {"wire", "grad_wire"} <= set(arguments.names) else ()

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            values = arguments.bind(args, kwargs)
            if values is None:
                return fn(*args, **kwargs)  # Python's own TypeError for the call itself
            for arg, may_be_none in checked:
                value = values[arg]
                if may_be_none and value is None:
                    continue
                check_tensor(opname, arg, value)
                if type_of(value) is not None:  # typed (by its type: dynamo may hand it on as plain)
                    _refuse_typed(name, arg, value)
            x = values[first] if first is not None else None
            if first is not None and is_dtensor(x):
                if refuse is not None and (
                    dtensor is None or (refuse.when is not None and refuse.when(values))
                ):
                    refuse.raise_for(opname, first, x)
                if dtensor is not None:
                    if formats:
                        exact_for_dtensor(opname, values["wire"], values["grad_wire"])
                    ax: MeshAxis = dtensor_input(opname, x, values["group"])  # type: ignore[assignment]
                    rest = {n: v for n, v in values.items() if n not in (first, "group", *formats)}
                    return dtensor(ax, **rest)
            if formats:
                check_wire(opname, x, values["wire"], values["grad_wire"])
            if resolve:
                values["group"] = resolve_group(opname, values["group"])
            return fn(**values)

        call.funcoll_entry = Entry(name, tensors, optional, dtensor, refuse, resolve)  # type: ignore[attr-defined]
        return public_op(name)(call)  # type: ignore[return-value]

    return decorate
