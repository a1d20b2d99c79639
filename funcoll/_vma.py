"""JAX's typed mode, ``shard_map(check_vma=True)``: the rules of ``funcoll.lax`` and the check of `out_specs`.

Every value in `f` is a :class:`~funcoll._collective._typed.Typed` tensor that knows the
manual mesh axes it varies over (:func:`typeof`). The inputs vary over the axes their
in spec names; torch functions give the union of their inputs' axes (casting an input
that varies over fewer, as JAX's automatic ``pcast`` does); each collective has JAX's
rule (:data:`RULES`); and an output that varies over an axis its out spec does not
name is refused while tracing, as JAX refuses it. The gradients are JAX's
transposes in this mode:

- ``psum`` (``pmean``) of a varying value is invariant, and its transpose is
  ``pvary``, which moves nothing: no collective in the backward, where the untyped
  mode psums the gradient again;
- a cast from invariant to varying (``pcast(to="varying")``, JAX's automatic casts
  before a collective or a torch function that mixes the two, and an output whose
  spec names an axis its value does not vary over) psums the gradient over the
  axes it adds: the one place the typed mode communicates in a backward that the
  untyped mode does not;
- an output's cotangent enters `f` whole (the untyped mode divides a replicated
  output's by its replicas), and an input replicated over an axis gets its
  gradient from `f` as it is (the untyped mode sums it over the replicas).

The types are Python values while tracing: a compiled `f` holds the same ops as
the untyped one, less the collectives the typed transposes save, and no
``Typed`` tensor crosses the graph's boundary (``shard_map`` unwraps its outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._base._group import Group, resolve_group
from ._collective import _prims
from ._collective._typed import CAST, no_transforms, plain, typed, vma_of
from ._shard_map import TYPED, axis_names, current_mesh, resolve_axes

__all__ = ["TYPED", "ManualType", "cast_missing", "pvary_to", "typed_leaf", "typed_mode", "typeof"]

# Each funcoll.lax collective's type rule: the axes its result varies over, from those its
# input varies over (after JAX's automatic cast to vary over `axes`) and the axes it runs over.
RULES: dict[str, Callable[[frozenset[str], frozenset[str]], frozenset[str]]] = {
    "reduce": lambda have, axes: have - axes,  # psum, pmean, pmax, pmin: varying -> invariant
    "invariant": lambda have, axes: have - axes,  # all_gather(to="invarying")
    "varying": lambda have, axes: have | axes,  # all_gather, psum_scatter, all_to_all, ppermute
}


class ManualType(NamedTuple):
    """What :func:`typeof` says of a value: its shape, dtype and ``vma`` (JAX's ``jax.typeof(x)``)."""

    shape: torch.Size
    dtype: torch.dtype
    vma: frozenset[str]


def typeof(x: Tensor) -> ManualType:
    """The type of `x` in ``shard_map(check_vma=True)``: ``typeof(x).vma`` is the set of mesh axes it varies over.

    JAX's ``jax.typeof(x)`` (its ``.vma``). Inside a typed `f`, an input varies over
    the axes its in spec names, and a value computed by torch functions varies over
    the union of its inputs' axes; ``psum``, ``pmean``, ``pmax``, ``pmin`` and
    ``all_gather(to="invarying")`` remove their axes, ``all_gather``,
    ``psum_scatter``, ``all_to_all``, ``ppermute`` and ``pcast(to="varying")`` add
    them. Outside the typed mode (no ``shard_map``, or ``check_vma=False``) a tensor
    varies over no axis: ``frozenset()``. The type is read while tracing: compiled
    code reads it as a constant.

    Args:
        x: a tensor.

    Returns:
        ``(shape, dtype, vma)``: `x`'s shape and dtype, and the frozenset of mesh axis
        names its value varies over.

    Backward: none: it reads a type and computes nothing.

    In the example, `mesh` is ``init_device_mesh("cpu", (2,), mesh_dim_names=("i",))``.

    Example (2 ranks)::

        # both: x = [1., 2., 3., 4.]
        f = shard_map(lambda v: v * len(typeof(v).vma), mesh, P("i"), P("i"), check_vma=True)
        f(x).to_local()               # rank 0: [1., 2.]    rank 1: [3., 4.]
        g = shard_map(lambda v: v * len(typeof(funcoll.lax.psum(v, "i")).vma), mesh, P("i"), P("i"), check_vma=True)
        g(x).to_local()               # rank 0: [0., 0.]    rank 1: [0., 0.]
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"funcoll.typeof: `x` must be a tensor, got {type(x).__name__}")
    return ManualType(x.shape, x.dtype, vma_of(x))


def typed_mode() -> bool:
    """True inside ``shard_map(check_vma=True)``'s `f` (its innermost ``shard_map``)."""
    return bool(TYPED) and TYPED[-1]


def _group(opname: str, axes: frozenset[str]) -> Group:
    """The group over the mesh axes `axes` (any order: a reduction's group does not depend on it)."""
    m = current_mesh(opname, tuple(sorted(axes)))
    names = tuple(n for n in (m.mesh_dim_names or ()) if n in axes)
    return resolve_group(opname, resolve_axes(opname, names).group)


def pvary_to(t: Tensor, axes: frozenset[str], opname: str = "funcoll.lax.pcast") -> Tensor:
    """Plain `t` cast to vary over `axes` too: a view whose backward psums the gradient over them."""
    g = _group(opname, axes)
    return _prims.pvary_p(t, g.name, g.size) if g.size > 1 else t


CAST.append(pvary_to)


def cast_missing(t: Tensor, missing: frozenset[str], opname: str) -> Tensor:
    """Plain `t` cast to vary over `missing` too where a gradient flows through it (JAX's automatic pcast);
    `t` itself where none does, or nothing is missing: the cast moves nothing forward."""
    if missing and t.requires_grad and torch.is_grad_enabled():
        return pvary_to(t, missing, opname)
    return t


def typed_leaf(
    opname: str, axis_name: Any, rule: str, one: Callable[[Tensor], Tensor], *, sums: bool = False
) -> Callable[[Tensor], Tensor]:
    """`one`, a collective on a plain tensor, as the typed mode runs it, or `one` itself outside it.

    The input is cast to vary over the collective's axes first (JAX casts
    automatically: ``psum`` of an invariant value is the axis size times it, and the
    cast's backward psums its gradient), then `one` runs on the plain tensor and its
    result is typed by :data:`RULES`. A sum (`sums`: ``psum``, ``pmean``,
    ``psum_scatter``) takes a value that varies over all of its axes or over none,
    as JAX's does: one that varies over some only raises (:func:`_mixed_sum`).
    """
    if not typed_mode():
        return one
    no_transforms(opname)
    axes = frozenset(axis_names(opname, axis_name, current_mesh(opname, axis_name)))
    out_rule = RULES[rule]

    def leaf(v: Tensor) -> Tensor:
        have = vma_of(v)
        if sums and have & axes and axes - have:
            _mixed_sum(opname, axis_name, have, axes)
        p = cast_missing(plain(v), axes - have, opname)
        return typed(one(p), out_rule(have, axes))

    return leaf


def _mixed_sum(opname: str, axis_name: Any, have: frozenset[str], axes: frozenset[str]) -> None:
    """A sum over axes that its value varies over only some of: JAX refuses it while tracing.

    Casting it would count each copy along the invariant axes (a psum over ("dp", "tp") of
    a value varying over "tp" alone is twice its sum over "tp" on a 2-wide "dp"), which
    JAX's typed mode does not guess: it asks for the cast, or a sum over the varying axes.
    """
    varying, invariant = sorted(have & axes), sorted(axes - have)
    raise ValueError(
        f"{opname}: `x` varies over {varying} but not over {invariant} of axis_name={axis_name!r} in "
        f"shard_map(..., check_vma=True); a sum takes a value that varies over all of its axes or none, "
        f"as in JAX: sum over {tuple(varying) if len(varying) > 1 else varying[0]!r} alone, or cast first "
        f"(lax.pcast(x, {tuple(invariant) if len(invariant) > 1 else invariant[0]!r}, to='varying')) to count "
        f"each copy"
    )
