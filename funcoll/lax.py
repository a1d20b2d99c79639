"""JAX's ``jax.lax`` collectives by name, over mesh axes: JAX code ports line for line.

Each function has JAX's signature and semantics and is a thin layer over one
funcoll op: it resolves `axis_name` against the current mesh (the enclosing
:func:`funcoll.shard_map`, or ``with funcoll.lax.mesh(device_mesh):``) into a
group, canonicalises JAX's arguments into the op's, and calls it. A tuple of
axis names is the group of the sub-mesh they span, in any order: indices along it
are JAX's, the first name major (``axis_index(("tp", "dp"))`` is
``tp * dp_size + dp``). torch flattens sub-meshes in mesh order only, so where the
tuple's order differs the ops permute blocks and slices between the two orders
(static permutations, differentiable; reductions need none). ``ppermute`` and
``pshuffle`` are the exception, as in JAX: their indices count the sub-mesh in mesh
order whatever the tuple's order.
The backward of each is the op's, which is JAX's transpose: ``psum`` to
``psum``, ``all_gather`` to ``psum_scatter``, ``all_to_all`` to the
``all_to_all`` with the axes swapped, ``ppermute`` to the inverse permutation.

=====================  ==========================  ==============================
``jax.lax``            funcoll op                  ``_c10d_functional`` op
=====================  ==========================  ==============================
psum, pmean            all_reduce(op="sum")        all_reduce
pmax, pmin             all_reduce(op="max"/"min")  all_reduce
all_gather             all_gather                  all_gather_into_tensor
psum_scatter           reduce_scatter              reduce_scatter_tensor
all_to_all             all_to_all                  all_to_all_single
ppermute, pshuffle     ppermute                    all_to_all_single
ragged_all_to_all      all_to_all (padded slices)  all_to_all_single (x2)
axis_index, axis_size  axis_index, axis_size       none (Python ints)
=====================  ==========================  ==============================

Every argument a value may be a pytree (nested lists, tuples and dicts of
tensors), mapped leaf by leaf as in JAX. Errors start with the function's name,
``funcoll.lax.psum: ...``. docs/jax.md lists every difference from JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils import _pytree

from ._base._checks import check_dim
from ._base._dtensor import is_dtensor
from ._base._group import resolve_group
from ._base._sym import prod
from ._collective._typed import Typed, no_transforms, plain, typed, vma_of
from ._ops import _even
from ._shard_map import AxisName, axis_names, axis_sizes, current_mesh, mesh, resolve_axes
from ._vma import TYPED, cast_missing, pvary_to, typed_leaf, typed_mode

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "mesh",
    "pcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pshuffle",
    "psum",
    "psum_scatter",
    "pvary",
    "ragged_all_to_all",
]

_T = TypeVar("_T")


def _leaves(
    opname: str, x: _T, fn: Callable[[Tensor], Tensor], number: Callable[[Any], Any] | None = None
) -> _T:
    """Apply `fn` to every tensor leaf of the pytree `x` (JAX maps collectives over pytrees).

    A Python int or float leaf goes to `number` where the op has a rule for constants
    (the reductions: ``psum(1, "i")`` is the axis size), else it becomes a 0-d tensor
    on the current mesh's device and goes to `fn`, as JAX binds a constant as an array.
    """

    def leaf(v: Any) -> Any:
        if isinstance(v, Tensor):
            if is_dtensor(v):
                raise TypeError(
                    f"{opname}: got a DTensor; funcoll.lax collectives take the local tensors that "
                    f"funcoll.shard_map passes to its function (or x.to_local())"
                )
            return fn(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if number is not None:
                return number(v)
            return fn(torch.tensor(v, device=current_mesh(opname, None).device_type))
        raise TypeError(
            f"{opname}: `x` must be a tensor or a pytree of tensors, got a leaf {type(v).__name__}"
        )

    if isinstance(x, Tensor):
        return leaf(x)  # type: ignore[no-any-return]
    return _pytree.tree_map(leaf, x)  # type: ignore[no-any-return]


def _blocks(v: Tensor, d: int, order: Sequence[int] | None) -> Tensor:
    """`v` with the ``len(order)`` equal blocks of dim `d` reordered: block i is `v`'s block ``order[i]``.

    How a collective over a tuple of axes given out of mesh order meets JAX's index
    order (:class:`Axes`): a static permutation, a ``cat`` of ``narrow`` views, whose
    backward is the inverse permutation. None: `v` itself.
    """
    if order is None:
        return v
    n = v.shape[d] // len(order)
    return torch.cat([v.narrow(d, i * n, n) for i in order], d)


def _reduce(opname: str, x: _T, axis_name: AxisName, op: str, number: Callable[[Any, int], Any]) -> _T:
    ax = resolve_axes(opname, axis_name)  # the order of the axes does not change a reduction
    # The typed mode's result is invariant, so its transpose moves nothing (no psum in the backward).
    group = resolve_group(opname, ax.group) if typed_mode() and ax.group is not None else None

    def one(v: Tensor) -> Tensor:
        if v.dtype == torch.bool and op == "sum":  # JAX sums booleans as int32; pmax/pmin keep bool
            v = v.to(torch.int32)
        if ax.group is None:
            return v.clone()
        if group is not None:
            return _even.all_reduce_invariant(v, group, op)
        return _even.all_reduce(v, group=ax.group, op=op)

    leaf = typed_leaf(opname, axis_name, "reduce", one, sums=op == "sum")
    return _leaves(opname, x, leaf, lambda n: number(n, ax.size))


def psum(x: _T, axis_name: AxisName) -> _T:
    """Sum `x` over the mesh axis `axis_name`; every rank gets the sum (``jax.lax.psum``).

    Args:
        x: this rank's tensor (or a pytree of them, or a Python number), the same
            shape and dtype on every rank. Booleans are summed as int32, as in JAX.
        axis_name: a mesh axis name, or a tuple of them (the sub-mesh they span).

    Returns:
        A new tensor of ``x.shape``: the sum over the axis. A value that is the same on
        every rank comes out multiplied by the axis size, as in JAX (``psum(1, "i")``
        is the axis size).

    Backward: ``psum`` of the gradient over the same axis (JAX's transpose;
    ``funcoll.all_reduce``'s backward).

    Example (2 ranks)::

        # rank 0: x = [0., 1.]        rank 1: x = [2., 3.]
        psum(x, "i")                  # both: [2., 4.]
        # backward with grad 1.0: rank 0 x.grad = [2., 2.], rank 1 [2., 2.]
        x / psum(x, "i")              # rank 0: [0., 0.25]   rank 1: [1., 0.75]
        psum(1, "i")                  # both: 2
    """
    return _reduce("funcoll.lax.psum", x, axis_name, "sum", lambda n, size: n * size)


def pmean(x: _T, axis_name: AxisName) -> _T:
    """The mean of `x` over the mesh axis `axis_name` (``jax.lax.pmean``): ``psum(x) / axis_size``.

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.

    Returns:
        A new tensor of ``x.shape``: the mean. Integers give a float mean, as JAX's
        true division does (x64 on): int64 a float64 one, narrower integers and
        booleans (summed as int32) a float32 one. Floating dtypes are kept.

    Backward: ``psum`` of the gradient divided by the axis size.

    Example (2 ranks)::

        # rank 0: x = [0., 1.]        rank 1: x = [2., 3.]
        pmean(x, "i")                 # both: [1., 2.]
        # backward with grad 1.0: rank 0 x.grad = [1., 1.], rank 1 [1., 1.]
    """
    opname = "funcoll.lax.pmean"
    size = resolve_axes(opname, axis_name).size
    summed = _reduce(opname, x, axis_name, "sum", lambda n, _: n * size)
    return _leaves(opname, summed, lambda v: _inexact(v) / size, lambda n: n / size)


def _inexact(v: Tensor) -> Tensor:
    """`v` as JAX's true division promotes it (x64 on): 64-bit integers to float64, narrower ones to float32.

    torch's ``int / int`` gives the default dtype whatever the width (float32: 2**24 + 1 is lost).
    """
    if v.is_floating_point() or v.is_complex():
        return v
    return v.to(torch.float64 if v.dtype.itemsize == 8 else torch.float32)


def pmax(x: _T, axis_name: AxisName) -> _T:
    """The elementwise maximum of `x` over the mesh axis `axis_name` (``jax.lax.pmax``).

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.

    Returns:
        A new tensor of ``x.shape`` and ``x.dtype`` (a bool `x` stays bool, as in
        JAX), the same on every rank of the axis.

    Backward: none, as in JAX: a backward through it raises.

    Example (2 ranks)::

        # rank 0: x = [1., 5.]        rank 1: x = [3., 2.]
        pmax(x, "i")                  # both: [3., 5.]
    """
    return _reduce("funcoll.lax.pmax", x, axis_name, "max", lambda n, _: n)


def pmin(x: _T, axis_name: AxisName) -> _T:
    """The elementwise minimum of `x` over the mesh axis `axis_name` (``jax.lax.pmin``).

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.

    Returns:
        A new tensor of ``x.shape`` and ``x.dtype`` (a bool `x` stays bool, as in
        JAX), the same on every rank of the axis.

    Backward: none, as in JAX: a backward through it raises.

    Example (2 ranks)::

        # rank 0: x = [1., 5.]        rank 1: x = [3., 2.]
        pmin(x, "i")                  # both: [1., 2.]
    """
    return _reduce("funcoll.lax.pmin", x, axis_name, "min", lambda n, _: n)


def all_gather(x: _T, axis_name: AxisName, *, axis: int = 0, tiled: bool = False, to: str = "varying") -> _T:
    """Gather `x` from every rank of the mesh axis `axis_name` (``jax.lax.all_gather``).

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.
        axis: ``tiled=False``: where the new axis of size ``axis_size`` goes;
            ``tiled=True``: the dim the ranks' tensors are concatenated along.
        tiled: stack (False, JAX's default) or concatenate (True).
        to: JAX's type of the result over `axis_name`. ``"varying"`` (default): the
            ranks may use the result differently, so the backward sums their
            gradients. ``"invarying"``: every rank uses it alike (JAX's
            ``all_gather_invariant``), so each rank's gradient is already the whole
            one and the backward only slices it. ``"reduced"`` needs JAX's typed
            mode (``check_vma=True``), which funcoll does not track: ValueError, as
            JAX raises with ``check_vma=False``.

    Returns:
        ``tiled=False``: ``x.shape`` with a new dim of size ``axis_size`` at `axis`,
        rank i's `x` at index i. ``tiled=True``: ``x.shape[axis]`` times ``axis_size``.

    Backward: ``to="varying"``: ``psum_scatter`` of the gradient along the same dim
    (JAX's transpose). ``to="invarying"``: this rank's slice of the gradient, no
    communication (JAX's transpose of ``all_gather_invariant``, with
    ``check_vma=False``: the slice of this rank's own cotangent).

    Example (2 ranks)::

        # rank 0: x = [0., 1.]        rank 1: x = [2., 3.]
        all_gather(x, "i")            # both: [[0., 1.], [2., 3.]]
        all_gather(x, "i", axis=1)    # both: [[0., 2.], [1., 3.]]
        all_gather(x, "i", tiled=True)  # both: [0., 1., 2., 3.]
        # backward with grad 1.0: rank 0 x.grad = [2., 2.], rank 1 [2., 2.]
        all_gather(x, "i", to="invarying")  # both: [[0., 1.], [2., 3.]]
        # backward with grad 1.0: rank 0 x.grad = [1., 1.], rank 1 [1., 1.]
    """
    opname = "funcoll.lax.all_gather"
    if to not in ("varying", "invarying", "reduced"):
        raise ValueError(f"{opname}: `to`={to!r} must be 'varying', 'invarying' or 'reduced' (JAX's values)")
    ax = resolve_axes(opname, axis_name)
    if to == "reduced" and ax.group is not None and typed_mode():
        raise _no_reduced(opname, to)
    if to == "reduced" and ax.group is not None:
        raise ValueError(
            f"{opname}: `to`='reduced' gathers a value typed varying over {axis_name!r} into a reduced one, "
            f"which needs JAX's typed mode (check_vma=True); funcoll types no value varying, so, as JAX "
            f"with check_vma=False, it refuses (use to='varying' or to='invarying')"
        )

    def one(v: Tensor) -> Tensor:
        d = check_dim(opname, v, axis, "axis", extra=0 if tiled else 1)
        if ax.group is None:
            return v.clone() if tiled else v.unsqueeze(d).clone()
        if to == "invarying":
            # not a public op, so no @entry resolves its group
            gathered = _even.all_gather_invariant(v, d, resolve_group(opname, ax.group), tiled)
        else:
            gathered = _even.all_gather(v, d, group=ax.group, tiled=tiled)
        return _blocks(gathered, d, ax.ranks)

    rule = "invariant" if to == "invarying" else "varying"
    return _leaves(opname, x, typed_leaf(opname, axis_name, rule, one))


def psum_scatter(x: _T, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False) -> _T:
    """Sum `x` over the mesh axis `axis_name` and keep this rank's part (``jax.lax.psum_scatter``).

    ``psum_scatter(x, "i")`` is ``psum(x, "i")[axis_index("i")]``, without the
    rest of the sum ever being formed.

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.
        scatter_dimension: the dim the sum is scattered along.
        tiled: False (JAX's default): ``x.shape[scatter_dimension]`` must equal
            the axis size, and that dim is removed. True: it must divide by the axis
            size, and rank i keeps slice i.

    Returns:
        A new tensor: ``x.shape`` without `scatter_dimension` (``tiled=False``), or
        with it divided by the axis size (``tiled=True``).

    Backward: ``all_gather`` of the gradient along `scatter_dimension` (JAX's transpose).

    Example (2 ranks)::

        # rank 0: x = [[0., 1.], [2., 3.]]     rank 1: x = [[4., 5.], [6., 7.]]
        psum_scatter(x, "i")                   # rank 0: [4., 6.]      rank 1: [8., 10.]
        psum_scatter(x, "i", tiled=True)       # rank 0: [[4., 6.]]    rank 1: [[8., 10.]]
        # backward with grad 1.0: rank 0 x.grad = [[1., 1.], [1., 1.]], rank 1 [[1., 1.], [1., 1.]]
    """
    opname = "funcoll.lax.psum_scatter"
    ax = resolve_axes(opname, axis_name)
    size = ax.size

    def one(v: Tensor) -> Tensor:
        d = check_dim(opname, v, scatter_dimension, "scatter_dimension")
        n = v.shape[d]
        if tiled and n % size != 0:
            raise ValueError(
                f"{opname}: x.shape[{d}]={n} (`scatter_dimension`={scatter_dimension}) does not divide by the "
                f"size {size} of axis {axis_name!r} (tiled=True)"
            )
        if not tiled and n != size:
            raise ValueError(
                f"{opname}: x.shape[{d}]={n} (`scatter_dimension`={scatter_dimension}) must equal the size "
                f"{size} of axis {axis_name!r} (tiled=False)"
            )
        if ax.group is None:
            return v.clone() if tiled else v.squeeze(d).clone()
        return _even.reduce_scatter(_blocks(v, d, ax.order), d, group=ax.group, op="sum", tiled=tiled)

    return _leaves(opname, x, typed_leaf(opname, axis_name, "varying", one, sums=True))


def all_to_all(x: _T, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False) -> _T:
    """Split `split_axis` over the ranks of `axis_name` and gather what arrives along `concat_axis` (``jax.lax.all_to_all``).

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.
        split_axis: the dim cut into ``axis_size`` chunks; chunk j goes to rank j.
        concat_axis: ``tiled=True``: the dim the received chunks are concatenated
            along, in rank order. ``tiled=False``: where, in the result, the new
            dim of size ``axis_size`` (indexed by the source rank) goes.
        tiled: False (JAX's default): ``x.shape[split_axis]`` must equal the axis
            size and that dim is removed. True: it must divide by the axis size.

    Returns:
        ``tiled=False``: ``x.shape`` without `split_axis`, with a dim of size
        ``axis_size`` inserted at `concat_axis`. ``tiled=True``: ``x.shape`` with
        ``split_axis`` divided and ``concat_axis`` multiplied by the axis size.

    Backward: ``all_to_all`` of the gradient with `split_axis` and `concat_axis`
    swapped (JAX's transpose).

    Example (2 ranks)::

        # rank 0: x = [[0., 1.], [2., 3.]]     rank 1: x = [[4., 5.], [6., 7.]]
        all_to_all(x, "i", 0, 0)               # rank 0: [[0., 1.], [4., 5.]]   rank 1: [[2., 3.], [6., 7.]]
        all_to_all(x, "i", 1, 0, tiled=True)   # rank 0: [[0.], [2.], [4.], [6.]]   rank 1: [[1.], [3.], [5.], [7.]]
        # backward with grad [[1.], [2.], [3.], [4.]]: rank 0 x.grad = [[1., 1.], [2., 2.]], rank 1 [[3., 3.], [4., 4.]]
    """
    opname = "funcoll.lax.all_to_all"
    ax = resolve_axes(opname, axis_name)
    size = ax.size

    def one(v: Tensor) -> Tensor:
        s = check_dim(opname, v, split_axis, "split_axis")
        n = v.shape[s]
        if tiled:
            c = check_dim(opname, v, concat_axis, "concat_axis")
            if n % size != 0:
                raise ValueError(
                    f"{opname}: x.shape[{s}]={n} (`split_axis`) does not divide by the size {size} of axis "
                    f"{axis_name!r} (tiled=True)"
                )
        else:
            c = check_dim(opname, v, concat_axis, "concat_axis")  # a position in the result, of v.dim() dims
            if n != size:
                raise ValueError(
                    f"{opname}: x.shape[{s}]={n} (`split_axis`) must equal the size {size} of axis "
                    f"{axis_name!r} (tiled=False)"
                )
            if s < c:  # JAX: concat_axis is a position after split_axis is removed
                c += 1
                v = v.unsqueeze(c)
            elif c < s:
                v = v.unsqueeze(c)
                s += 1
        if ax.group is None:
            y = v.clone()
        else:  # chunk j goes to JAX index j, and arrives at the place of its source's JAX index
            y = _blocks(_even.all_to_all(_blocks(v, s, ax.order), ax.group, s, c), c, ax.ranks)
        return y.squeeze(s) if not tiled and s != c else y

    return _leaves(opname, x, typed_leaf(opname, axis_name, "varying", one))


def ppermute(x: _T, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> _T:
    """Send `x` along the (source, destination) index pairs of `perm` (``jax.lax.ppermute``).

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.
        perm: ``(source_index, destination_index)`` pairs of indices along the axis;
            no index is a source twice or a destination twice. Over a tuple of axes
            the indices count the sub-mesh in MESH order, whatever the tuple's order,
            as in JAX: on a ("dp", "tp") mesh, index ``dp * tp_size + tp`` along
            ``("tp", "dp")`` too, where ``axis_index(("tp", "dp"))`` is
            ``tp * dp_size + dp`` (docs/jax.md, difference 6).

    Returns:
        A new tensor of ``x.shape``: what the source paired with this rank sent, or
        zeros where no pair names this rank as a destination.

    Backward: ``ppermute`` of the gradient with every pair reversed (JAX's transpose).

    Example (2 ranks)::

        # rank 0: x = [1., 1.]        rank 1: x = [2., 2.]
        ppermute(x, "i", [(0, 1), (1, 0)])   # rank 0: [2., 2.]      rank 1: [1., 1.]
        ppermute(x, "i", [(0, 1)])           # rank 0: [0., 0.]      rank 1: [1., 1.]
        # backward with grad [1., 2.]: rank 0 x.grad = [1., 2.], rank 1 [0., 0.]
    """
    opname = "funcoll.lax.ppermute"
    ax = resolve_axes(opname, axis_name)
    pairs = [tuple(p) for p in perm]

    def one(v: Tensor) -> Tensor:
        if ax.group is None:
            return v.clone() if (0, 0) in pairs else torch.zeros_like(v)
        # The indices are the group's ranks as they are: JAX numbers a ppermute's pairs in mesh order
        # whatever the tuple's order (its lowering sorts each replica group), so `ax.ranks` is not
        # applied here. The op checks the pairs.
        return _even.ppermute(v, pairs, group=ax.group)  # type: ignore[arg-type]

    return _leaves(opname, x, typed_leaf(opname, axis_name, "varying", one))


def pshuffle(x: _T, axis_name: AxisName, perm: Sequence[int]) -> _T:
    """``ppermute`` with JAX's other encoding: rank i gets the `x` of rank ``perm[i]`` (``jax.lax.pshuffle``).

    Args:
        x: this rank's tensor (or a pytree of them), the same shape on every rank.
        axis_name: a mesh axis name, or a tuple of them.
        perm: a permutation of ``range(axis_size)``: the source of each index.
            Over a tuple of axes, indices count the sub-mesh in mesh order, as
            ``ppermute``'s do (and JAX's).

    Returns:
        A new tensor of ``x.shape``: rank ``perm[rank]``'s `x`.

    Backward: ``ppermute`` of the gradient with the inverse permutation.

    Example (2 ranks)::

        # rank 0: x = [1., 1.]        rank 1: x = [2., 2.]
        pshuffle(x, "i", [1, 0])      # rank 0: [2., 2.]      rank 1: [1., 1.]
        pshuffle(x, "i", [0, 1])      # rank 0: [1., 1.]      rank 1: [2., 2.]
    """
    opname = "funcoll.lax.pshuffle"
    size = resolve_axes(opname, axis_name).size
    srcs = list(perm)
    if any(isinstance(p, bool) or not isinstance(p, int) for p in srcs) or sorted(srcs) != list(range(size)):
        raise ValueError(f"{opname}: `perm`={perm!r} is not a permutation of range({size}), the axis size")
    return ppermute(x, axis_name, [(src, dst) for dst, src in enumerate(srcs)])


_PCAST_TO = ("varying", "reduced", "unreduced")


def pcast(x: _T, axis_name: AxisName, *, to: str) -> _T:
    """Cast `x`'s type over the mesh axes `axis_name` (``jax.lax.pcast``); its values are unchanged.

    In JAX's typed mode (``shard_map(check_vma=True)``) a value is invariant or
    varying (or reduced) over each mesh axis, and ``pcast`` converts between the
    types. funcoll runs as JAX with ``check_vma=False``, where no value is typed
    varying: there, as in JAX, ``to="varying"`` and ``to="reduced"`` return `x`
    as it is and ``to="unreduced"`` is refused (JAX: "Unsupported pcast
    from=invarying"). Porting code keeps its ``pcast`` calls; they cost nothing.

    Args:
        x: a tensor (or a pytree of them).
        axis_name: a mesh axis name, or a tuple of them (a set is a TypeError, as
            in JAX); each must be an axis of the current mesh.
        to: ``"varying"``, ``"reduced"`` or ``"unreduced"`` (JAX's values).

    Returns:
        `x`'s values: each tensor as a view of itself (no copy; do not modify it in
        place).

    Backward: the identity.

    Example (2 ranks)::

        # rank 0: x = [0., 1.]        rank 1: x = [2., 3.]
        pcast(x, "i", to="varying")   # rank 0: [0., 1.]    rank 1: [2., 3.]
        # backward with grad 1.0: rank 0 x.grad = [1., 1.], rank 1 [1., 1.]
    """
    opname = "funcoll.lax.pcast"
    if isinstance(axis_name, (set, frozenset)):
        raise TypeError(f"{opname}: `axis_name`={axis_name!r} must be a tuple or a str, not a set")
    if not axis_name:  # JAX returns x before it reads `to`
        return x
    if to not in _PCAST_TO:
        raise ValueError(f"{opname}: `to`={to!r} must be one of {_PCAST_TO} (JAX's values)")
    names = axis_names(opname, axis_name, current_mesh(opname, axis_name))
    if typed_mode():
        no_transforms(opname)
        return _pcast_typed(opname, x, frozenset(names), to)
    if to == "unreduced":
        raise ValueError(
            f"{opname}: `to`='unreduced' casts a varying value over {axis_name!r}; funcoll types every value "
            f"invarying (JAX with check_vma=False), and JAX refuses a pcast from invarying to unreduced"
        )
    return _leaves(opname, x, lambda v: v.view_as(v))


def _no_reduced(opname: str, to: str) -> NotImplementedError:
    return NotImplementedError(
        f"{opname}: `to`={to!r}: funcoll's typed mode (check_vma=True) has varying and invariant values, "
        f"not JAX's reduced and unreduced ones; use to='varying'"
    )


def _pcast_typed(opname: str, x: _T, axes: frozenset[str], to: str) -> _T:
    """pcast in ``shard_map(check_vma=True)``: invariant to varying over `axes`, the backward a psum there."""
    if to != "varying":
        raise _no_reduced(opname, to)

    def cast(v: Tensor) -> Tensor:
        have = vma_of(v)
        if axes & have:
            raise ValueError(
                f"{opname}: `x` varies over {sorted(axes & have)} already (funcoll.typeof(x).vma={set(sorted(have))});"
                f" pcast(to='varying') casts a value that is invariant over `axis_name` (JAX: Unsupported pcast "
                f"from=varying, to='varying')"
            )
        p = plain(v)
        p = pvary_to(p, axes, opname) if p.requires_grad and torch.is_grad_enabled() else p.view_as(p)
        return typed(p, have | axes)

    return _leaves(opname, x, cast)


def pvary(x: _T, axis_name: AxisName) -> _T:
    """``pcast(x, axis_name, to="varying")``: JAX's older name (``jax.lax.pvary``, removed in JAX 0.10).

    Example (2 ranks)::

        # rank 0: x = [0., 1.]        rank 1: x = [2., 3.]
        pvary(x, "i")                 # rank 0: [0., 1.]    rank 1: [2., 3.]
        # backward with grad 1.0: rank 0 x.grad = [1., 1.], rank 1 [1., 1.]
    """
    return pcast(x, axis_name, to="varying")


def axis_index(axis_name: AxisName) -> int:
    """This rank's index along the mesh axis `axis_name` (``jax.lax.axis_index``).

    Args:
        axis_name: a mesh axis name, or a tuple of them: the index over the sub-mesh
            they span, the first axis major (``("dp", "tp")``: ``dp * tp_size + tp``).

    Returns:
        A Python int (JAX returns an int32 array): a constant of a compiled graph.

    Backward: none (an int).

    Example (2 ranks)::

        axis_index("i")               # rank 0: 0    rank 1: 1
        axis_index(())                # both: 0
    """
    opname = "funcoll.lax.axis_index"
    m = current_mesh(opname, axis_name)
    index = 0
    for name in axis_names(opname, axis_name, m):  # row-major over the named axes, as JAX computes it
        g = resolve_group(opname, (m, name))
        index = index * g.size + g.rank
    return index


def axis_size(axis_name: AxisName) -> int:
    """The number of ranks along the mesh axis `axis_name` (``jax.lax.axis_size``).

    Args:
        axis_name: a mesh axis name, or a tuple of them (the product of their sizes).

    Returns:
        A Python int, a constant of a compiled graph.

    Backward: none (an int).

    Example (2 ranks)::

        axis_size("i")                # both: 2
    """
    opname = "funcoll.lax.axis_size"
    m = current_mesh(opname, axis_name)
    return prod(axis_sizes(m, axis_names(opname, axis_name, m)))


def _offsets(opname: str, arg: str, v: object, count: int | None, device: torch.device) -> Tensor:
    t = v if isinstance(v, Tensor) else torch.tensor(v, dtype=torch.int64)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(
            f"{opname}: `{arg}` must be a 1-D integer tensor, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if count is not None and t.shape[0] != count:
        raise ValueError(f"{opname}: `{arg}` has {t.shape[0]} entries, `input_offsets` has {count}")
    return t.to(device=device, dtype=torch.int64)


def ragged_all_to_all(
    operand: Tensor,
    output: Tensor,
    input_offsets: Tensor,
    send_sizes: Tensor,
    output_offsets: Tensor,
    recv_sizes: Tensor,
    *,
    axis_name: AxisName,
) -> Tensor:
    """Send slices of a ragged array to the ranks of `axis_name`, written at offsets the senders name (``jax.lax.ragged_all_to_all``).

    A ragged array is JAX's triple ``(data, offsets, sizes)``: component k is
    ``data[offsets[k] : offsets[k] + sizes[k]]`` along dim 0. With K entries in each
    offset and size array and n ranks on the axis, entry k concerns rank
    ``k // (K // n)``: this rank sends ``operand[input_offsets[k] :][: send_sizes[k]]``
    to it, to be written on that rank at ``output_offsets[k]`` (an offset in the
    RECEIVER's buffer), and receives ``recv_sizes[k]`` rows from it. Received rows
    land at the offsets their senders chose: ``all_to_all(output_offsets, axis_name,
    0, 0, tiled=True)`` gives them on the receiver. ``send_sizes[k]`` on rank r is
    ``recv_sizes`` on rank ``k // (K // n)``'s entry for r.

    Args:
        operand: ``(N, ...)``, the rows to send.
        output: ``(M, ...)``, the same trailing dims and dtype: the buffer the
            received rows are written into (a new tensor is returned; `output` is
            not modified).
        input_offsets: ``(K,)`` integers (K divisible by the axis size, on any device):
            where in `operand` slice k starts.
        send_sizes: ``(K,)`` integers: how many rows slice k sends.
        output_offsets: ``(K,)`` integers: where slice k lands in its RECEIVER's buffer.
        recv_sizes: ``(K,)`` integers: how many rows arrive from entry k's rank.
        axis_name: a mesh axis name, or a tuple of them.

    Returns:
        A new tensor of `output`'s shape (static): `output` with the received rows
        written in. Nothing is read on the host: no device-to-host sync. Each slice
        travels padded to ``min(N, M)`` rows (one even all_to_all of
        ``K * min(N, M)`` rows, after one of the K output offsets).

    Backward: the gradient of `operand` is the ``ragged_all_to_all`` of the
    result's gradient back (the ``all_to_all`` of the padded slices reversed), and
    `output`'s gradient is the result's with the received rows zeroed (JAX's transpose).

    Example (2 ranks)::

        # rank 0: operand = [1., 2., 2.], input_offsets = [0, 1], send_sizes = [1, 2]
        # rank 0: output = [0., 0., 0., 0.], output_offsets = [0, 0], recv_sizes = [1, 1]
        # rank 1: operand = [3., 4., 0.], input_offsets = [0, 1], send_sizes = [1, 1]
        # rank 1: output = [0., 0., 0., 0.], output_offsets = [1, 2], recv_sizes = [2, 1]
        ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name="i")
        # rank 0: [1., 3., 0., 0.]   rank 1: [2., 2., 4., 0.]
    """
    opname = "funcoll.lax.ragged_all_to_all"
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    if typed_mode():  # the rows of every rank land here: varying over the axes, and over the inputs' axes
        no_transforms(opname)
        axes = frozenset(axis_names(opname, axis_name, current_mesh(opname, axis_name)))
        have = frozenset().union(*(vma_of(a) for a in args))
        untyped = [plain(a) if isinstance(a, Typed) else a for a in args]
        for i in (0, 1):
            if isinstance(untyped[i], Tensor):
                untyped[i] = cast_missing(untyped[i], axes - vma_of(args[i]), opname)
        TYPED.append(False)
        try:
            return typed(ragged_all_to_all(*untyped, axis_name=axis_name), have | axes)
        finally:
            TYPED.pop()
    for arg, v in (("operand", operand), ("output", output)):
        if not isinstance(v, Tensor):
            raise TypeError(f"{opname}: `{arg}` must be a torch.Tensor, got {type(v).__name__}")
        if is_dtensor(v):
            raise TypeError(
                f"{opname}: `{arg}` is a DTensor; pass the local tensors (inside funcoll.shard_map)"
            )
        if v.dim() == 0:
            raise ValueError(f"{opname}: `{arg}` must have at least one dim, got a 0-d tensor")
    if operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
        raise ValueError(
            f"{opname}: `operand` {operand.dtype}{tuple(operand.shape)} and `output` "
            f"{output.dtype}{tuple(output.shape)} must agree in dtype and in every dim but the first"
        )
    dev = operand.device
    in_off = _offsets(opname, "input_offsets", input_offsets, None, dev)
    k = in_off.shape[0]
    send = _offsets(opname, "send_sizes", send_sizes, k, dev)
    out_off = _offsets(opname, "output_offsets", output_offsets, k, dev)
    recv = _offsets(opname, "recv_sizes", recv_sizes, k, dev)
    ax = resolve_axes(opname, axis_name)
    group, size = ax.group, ax.size
    if k % size != 0:
        raise ValueError(
            f"{opname}: the offset and size arrays have {k} entries, not a multiple of the axis size {size}"
        )
    n, m = operand.shape[0], output.shape[0]
    cap = min(n, m)  # no slice is longer: it lies in `operand` and lands in `output`
    steps = torch.arange(cap, device=dev)
    # Sender: slice k padded to `cap` rows, zeros after send_sizes[k]; no host read.
    rows = (in_off[:, None] + steps).clamp(0, max(n - 1, 0))  # (K, cap)
    keep = (steps < send[:, None]).reshape(k, cap, *([1] * (operand.dim() - 1)))
    slices = torch.where(keep, operand[rows], torch.zeros((), dtype=operand.dtype, device=dev))
    if group is not None and size > 1:  # slice k goes to JAX index k // (K / size), in the group's order
        slices = _even.all_to_all(_blocks(slices, 0, ax.order), group, 0, 0)
        out_off = _even.all_to_all(_blocks(out_off, 0, ax.order), group, 0, 0)
        recv = _blocks(recv, 0, ax.order)  # what arrives comes in the group's order of the sources
    # Receiver: slice k's first recv_sizes[k] rows go to out_off[k] + j; the rest to a spare row M, cut off.
    at = out_off[:, None] + steps  # (K, cap)
    at = torch.where((steps < recv[:, None]) & (at >= 0) & (at < m), at, m)
    spare = torch.cat([output, output.new_zeros((1, *output.shape[1:]))])
    written = spare.index_put((at.reshape(-1),), slices.reshape(k * cap, *output.shape[1:]))
    return written[:m]
