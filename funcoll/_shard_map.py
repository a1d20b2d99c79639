"""JAX's ``shard_map`` for PyTorch, and the mesh that ``funcoll.lax`` resolves axis names against.

``funcoll.lax`` names the devices a collective runs over by a mesh axis
(``psum(x, "tp")``), as JAX does. A name means something only against a mesh:
the mesh of the enclosing :func:`shard_map`, or one bound with
``with funcoll.lax.mesh(device_mesh):``. Both push it on one stack
(:data:`_MESHES`); the innermost wins, and hides the names of the meshes
outside it. A name resolves to the group of that mesh dim, ``(mesh, name)``, and
a tuple of names to the group of the sub-mesh they span, flattened in mesh order
(``DeviceMesh._flatten``). JAX indexes a tuple in the order given (along
``("tp", "dp")``, ``tp_index * dp_size + dp_index``); :class:`Axes` carries the
static permutation between the two orders, which the collectives apply.

:func:`shard_map` is built on DTensor: every input becomes a DTensor with the
placements its spec names (``P("dp", None)`` -> ``Shard(0)`` on "dp",
``Replicate()`` on every axis it does not mention), `f` runs on the local shards
(``to_local``) with the mesh bound, and every output is wrapped back
(``DTensor.from_local``) with the placements of its out spec. Gradients follow
JAX's ``shard_map`` with ``check_vma=False``, where ``psum``'s transpose is
``psum``: the cotangent of an output replicated over axes A enters `f` divided
by the number of those replicas, and the local cotangent of an input
replicated over axes A is summed over them (its gradient's placement there is
``Partial("sum")``). With funcoll's ops, whose backwards are JAX's transposes,
that gives every input the gradient of the one global function (docs/jax.md).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ._base._dtensor import contiguous_strides, is_placement
from ._base._group import GroupLike
from ._base._sym import prod
from ._collective._phase import Primitive
from ._collective._typed import CAST, plain, typed, vma_of

__all__ = [
    "Axes",
    "AxisName",
    "P",
    "axis_names",
    "axis_sizes",
    "current_mesh",
    "mesh",
    "prod",
    "resolve_axes",
    "shard_map",
]

AxisName = str | tuple[str, ...]

# The meshes bound by shard_map and `funcoll.lax.mesh`, innermost last.
_MESHES: list[DeviceMesh] = []
# The check_vma of each enclosing shard_map, innermost last (funcoll._vma reads it).
TYPED: list[bool] = []


class P(tuple):
    """A partition spec, JAX's ``P``: one entry per tensor dim, naming the mesh axes that shard it.

    An entry is None (the dim is not sharded), an axis name, or a tuple of axis
    names (the dim is sharded over all of them, the first one major). Mesh axes
    the spec does not mention replicate the tensor. Trailing dims the spec does
    not reach are not sharded. ``P()`` is replicated on every axis.

    Example::

        P("dp", None)          # dim 0 over "dp", dim 1 whole: [Shard(0), Replicate()] on ("dp", "tp")
        P(None, ("dp", "tp"))  # dim 1 over all 4 ranks of a 2x2 mesh: [Shard(1), Shard(1)]
    """

    __slots__ = ()

    def __new__(cls, *entries: str | tuple[str, ...] | None) -> P:
        return super().__new__(cls, entries)

    def __repr__(self) -> str:
        return "P(" + ", ".join(map(repr, self)) + ")"

    def __reduce__(self) -> tuple[Any, ...]:
        return (P, tuple(self))


class mesh:
    """Bind `device_mesh` for ``funcoll.lax``'s axis names inside the ``with`` block.

    Example::

        with funcoll.lax.mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))):
            y = funcoll.lax.psum(x, "tp")
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(
                f"funcoll.lax.mesh: `device_mesh` must be a DeviceMesh, got {type(device_mesh).__name__}"
            )
        if not device_mesh.mesh_dim_names:
            raise ValueError(
                "funcoll.lax.mesh: `device_mesh` has no mesh_dim_names; axis names need them "
                "(init_device_mesh(..., mesh_dim_names=(...)))"
            )
        self.device_mesh = device_mesh

    def __enter__(self) -> DeviceMesh:
        _MESHES.append(self.device_mesh)
        return self.device_mesh

    def __exit__(self, *exc: object) -> None:
        _MESHES.pop()


def current_mesh(opname: str, axis_name: object) -> DeviceMesh:
    """The innermost bound mesh, or a ValueError saying how to bind one."""
    if not _MESHES:
        raise ValueError(
            f"{opname}: `axis_name`={axis_name!r} names a mesh axis, but no mesh is bound; call it inside "
            f"funcoll.shard_map, or inside `with funcoll.lax.mesh(device_mesh):`"
        )
    return _MESHES[-1]


def axis_names(opname: str, axis_name: object, device_mesh: DeviceMesh) -> tuple[str, ...]:
    """`axis_name` as a tuple of the mesh's axis names, checked: each known, none twice."""
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    known = device_mesh.mesh_dim_names or ()
    for n in names:
        if not isinstance(n, str):
            raise TypeError(
                f"{opname}: `axis_name` must be a mesh axis name or a tuple of them, got {axis_name!r}"
            )
        if n not in known:
            raise ValueError(f"{opname}: `axis_name`={axis_name!r}: {n!r} is not an axis of the mesh {known}")
    if len(set(names)) != len(names):
        raise ValueError(f"{opname}: `axis_name`={axis_name!r} names an axis twice")
    return tuple(names)


class Axes(NamedTuple):
    """What an `axis_name` names in the current mesh.

    `group` spans its mesh axes taken in MESH order (torch's DeviceMesh flattens
    sub-meshes that way only), and `size` is its number of ranks. JAX indexes a
    tuple of axes in the tuple's order, the first name major; where the two orders
    differ, `order[c]` is the JAX index of the group's rank c and `ranks[j]` the
    group rank of JAX index j (both None where they agree). The collectives use
    them to put blocks and slices in JAX's order: static permutations, fixed while
    tracing. ``ppermute`` does not: JAX numbers its pairs in mesh order, the
    group's own.
    """

    group: GroupLike  # None for an empty tuple: no axis
    size: int
    order: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None


def resolve_axes(opname: str, axis_name: AxisName) -> Axes:
    """The :class:`Axes` that `axis_name` names in the current mesh.

    One name is ``(mesh, name)``; several are the sub-mesh they span, flattened in
    mesh order into one group (created once, on every rank; eager or while tracing).
    An empty tuple is no axis: the group is None and callers return `x` unchanged.
    """
    m = current_mesh(opname, axis_name)
    names = axis_names(opname, axis_name, m)
    size = prod(axis_sizes(m, names))
    if not names:
        return Axes(None, size)
    if len(names) == 1:
        return Axes((m, names[0]), size)
    in_mesh_order = tuple(n for n in (m.mesh_dim_names or ()) if n in names)
    group = _flattened_group_name(m, in_mesh_order)
    if in_mesh_order == names:
        return Axes(group, size)
    order = _tuple_order(m, in_mesh_order, names)
    ranks = [0] * size
    for c, j in enumerate(order):
        ranks[j] = c
    return Axes(group, size, order, tuple(ranks))


@torch._dynamo.assume_constant_result
def _flattened_group_name(device_mesh: DeviceMesh, in_mesh_order: tuple[str, ...]) -> str:
    """The c10d name of the group over the mesh dims `in_mesh_order`, flattened into one.

    DeviceMesh's flattening, which creates the group once, on every rank, and caches
    it in the root mesh. Dynamo before torch 2.12 cannot trace it (it refuses
    ``DeviceMesh._create_flatten_mesh``), so while tracing it runs as it is, on the
    real mesh, and its result, a string, is a constant of the graph; eager code
    calls it directly. Every rank flattens the same dims in the same order, as
    DeviceMesh requires.
    """
    flat = "_".join(in_mesh_order)
    device_mesh[in_mesh_order]._create_flatten_mesh(flat)
    return device_mesh.get_group(flat).group_name


def _tuple_order(
    device_mesh: DeviceMesh, in_mesh_order: tuple[str, ...], names: tuple[str, ...]
) -> tuple[int, ...]:
    """For each rank c of the group over `in_mesh_order`, its index along `names` (row-major, first name major)."""
    sizes = dict(zip(in_mesh_order, axis_sizes(device_mesh, in_mesh_order), strict=True))
    order = []
    for c in range(prod(list(sizes.values()))):
        coord: dict[str, int] = {}
        rest = c
        for n in reversed(in_mesh_order):
            rest, coord[n] = divmod(rest, sizes[n])
        j = 0
        for n in names:
            j = j * sizes[n] + coord[n]
        order.append(j)
    return tuple(order)


def axis_sizes(device_mesh: DeviceMesh, names: Sequence[str]) -> list[int]:
    known = list(device_mesh.mesh_dim_names or ())
    return [device_mesh.size(known.index(n)) for n in names]


# ------------------------------------------------------------------------------ shard_map
class _ScaleGrad(Primitive):
    """Identity forward; the gradient times `scale` (an output's cotangent over its replicas)."""

    @staticmethod
    def forward(x: Tensor, scale: float) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, ctx.scale = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _entry_axes(entry: object) -> tuple[object, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def placements_of(opname: str, spec: P, device_mesh: DeviceMesh, ndim: int, arg: str) -> list[Placement]:
    """The DTensor placements of `spec` on `device_mesh`: Shard(d) where dim d names the axis, else Replicate()."""
    if not isinstance(spec, P):
        raise TypeError(f"{opname}: `{arg}` entries must be funcoll.P specs, got {spec!r}")
    if len(spec) > ndim:
        raise ValueError(f"{opname}: `{arg}`={spec!r} has {len(spec)} entries for a {ndim}-d tensor")
    known = list(device_mesh.mesh_dim_names or ())
    placements: list[Placement] = [Replicate()] * device_mesh.ndim
    seen: list[object] = []
    for d, entry in enumerate(spec):
        axes = _entry_axes(entry)
        for a in axes:
            if a not in known:
                raise ValueError(
                    f"{opname}: `{arg}`={spec!r}: {a!r} is not an axis of the mesh {tuple(known)}"
                )
            if a in seen:
                raise ValueError(f"{opname}: `{arg}`={spec!r} names the axis {a!r} twice")
            seen.append(a)
            placements[known.index(a)] = Shard(d)
        idx = [known.index(a) for a in axes]  # type: ignore[arg-type]
        if idx != sorted(idx):
            raise NotImplementedError(
                f"{opname}: `{arg}`={spec!r} shards dim {d} over {axes} out of the mesh's axis order "
                f"{tuple(known)}; DTensor shards one dim over several axes in mesh order"
            )
    return placements


def _divisor(spec: P, device_mesh: DeviceMesh, d: int) -> int:
    names = _entry_axes(spec[d]) if d < len(spec) else ()
    return prod(axis_sizes(device_mesh, names))  # type: ignore[arg-type]


def _replicas(spec: P, device_mesh: DeviceMesh) -> int:
    """How many ranks hold each shard: the product of the sizes of the axes `spec` does not mention."""
    mentioned = {a for entry in spec for a in _entry_axes(entry)}
    names = device_mesh.mesh_dim_names or ()
    return prod([device_mesh.size(i) for i, n in enumerate(names) if n not in mentioned])


def _to_local(opname: str, x: Tensor, spec: P, device_mesh: DeviceMesh, check_vma: bool = False) -> Tensor:
    """The local shard of `x` (a DTensor, or a plain tensor holding the global value) under `spec`."""
    placements = placements_of(opname, spec, device_mesh, x.dim(), "in_specs")
    for d in range(len(spec)):
        n = _divisor(spec, device_mesh, d)
        if x.shape[d] % n != 0:
            raise ValueError(
                f"{opname}: `in_specs` entry {spec!r} shards dim {d} of a tensor of global shape "
                f"{tuple(x.shape)} over {n} ranks, which does not divide {x.shape[d]}"
            )
    if isinstance(x, DTensor):
        if x.device_mesh != device_mesh:
            raise ValueError(f"{opname}: a DTensor input lives on {x.device_mesh}, not on the shard_map mesh")
    else:  # the global value, on every rank: shard it (the gradient comes back whole on every rank)
        x = DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
    if tuple(x.placements) != tuple(placements):
        x = x.redistribute(device_mesh, placements)
    if check_vma:
        # JAX's typed mode: the value varies over the axes its spec names, and the gradient of an
        # input replicated over an axis is invariant there already (the casts inside f psummed it).
        return typed(x.to_local(grad_placements=placements), _named(spec))
    # An input replicated over an axis gets the sum of its replicas' local gradients (JAX's
    # shard_map transpose psums it there): Partial("sum") says so, and DTensor reduces it.
    grads = [Partial("sum") if is_placement(p, Replicate) else p for p in placements]
    return x.to_local(grad_placements=grads)


def _from_local(
    opname: str, y: Tensor, spec: P, device_mesh: DeviceMesh, check_vma: bool = False, where: str = ""
) -> DTensor:
    placements = placements_of(opname, spec, device_mesh, y.dim(), "out_specs")
    shape = [
        y.shape[d] * _divisor(spec, device_mesh, d) if d < len(spec) else y.shape[d] for d in range(y.dim())
    ]
    if check_vma:  # JAX's check of the spec; the cotangent enters whole (the types say where it varies)
        y = _checked_output(opname, y, where, spec)
    elif (replicas := _replicas(spec, device_mesh)) > 1:
        # JAX (check_vma=False): a replicated output's cotangent is split over its replicas
        y = _ScaleGrad.apply(y, 1.0 / replicas)
    return DTensor.from_local(
        y.contiguous(),
        device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
    )


def _named(spec: P) -> frozenset[str]:
    return frozenset(a for entry in spec for a in _entry_axes(entry))  # type: ignore[misc]


def _checked_output(opname: str, y: Tensor, where: str, spec: P) -> Tensor:
    """A typed output checked against its out spec, then plain (JAX's check with ``check_vma=True``).

    An output that varies over an axis its spec does not name is refused; one that
    varies over fewer axes than its spec names is cast to vary over them (JAX's
    automatic ``pcast``), whose backward psums its cotangent there.
    """
    named, have = _named(spec), vma_of(y)
    extra = sorted(have - named)
    if extra:
        axis = extra[0]
        raise ValueError(
            f"{opname}: output {where} has `out_specs`={spec!r}, which says it is replicated over {axis!r}, "
            f"but its value varies over {axis!r} (funcoll.typeof(y).vma={set(sorted(have))}); reduce it over "
            f"{axis!r} first (funcoll.lax.psum or pmean), name {axis!r} in its spec, or pass check_vma=False "
            f"to trust the spec (JAX raises the same with check_vma=True)"
        )
    p = plain(y)
    missing = named - have
    if missing and p.requires_grad and torch.is_grad_enabled():
        p = CAST[0](p, missing)
    return p


def _map(
    opname: str, fn: Callable[[Tensor, P, str], Any], tree: Any, specs: Any, arg: str, path: str = ""
) -> Any:
    """Apply `fn` to every tensor of `tree` with its spec and its path (``[0]['a']``); `specs` is a prefix
    of `tree` (a P covers a subtree)."""
    if isinstance(specs, P):
        if isinstance(tree, Tensor):
            return fn(tree, specs, path)
        if isinstance(tree, (list, tuple)):
            return type(tree)(_map(opname, fn, t, specs, arg, f"{path}[{i}]") for i, t in enumerate(tree))
        if isinstance(tree, dict):
            return {k: _map(opname, fn, v, specs, arg, f"{path}[{k!r}]") for k, v in tree.items()}
        return tree  # a Python number, None: passed through
    if isinstance(specs, (list, tuple)) and isinstance(tree, (list, tuple)) and len(specs) == len(tree):
        return type(tree)(
            _map(opname, fn, t, s, arg, f"{path}[{i}]")
            for i, (t, s) in enumerate(zip(tree, specs, strict=True))
        )
    if isinstance(specs, dict) and isinstance(tree, dict) and specs.keys() == tree.keys():
        return {k: _map(opname, fn, tree[k], specs[k], arg, f"{path}[{k!r}]") for k in tree}
    raise ValueError(
        f"{opname}: `{arg}`={specs!r} does not match the structure of the values it describes "
        f"(a funcoll.P, or a tuple/list/dict of them shaped like the values)"
    )


def shard_map(
    f: Callable[..., Any] | None = None,
    mesh: DeviceMesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    *,
    axis_names: AbstractSet[str] = frozenset(),
    check_vma: bool | None = None,
    check_rep: bool | None = None,
) -> Callable[..., Any]:
    """JAX's ``shard_map``: run `f` on every rank's shards, with ``funcoll.lax`` collectives by axis name.

    Args:
        f: the per-shard function. It receives local tensors (plain ``torch.Tensor``)
            and calls ``funcoll.lax`` collectives with the mesh's axis names. Without
            `f`, ``shard_map(mesh=..., in_specs=..., out_specs=...)`` is a decorator.
        mesh: a DeviceMesh with ``mesh_dim_names``.
        in_specs: one :class:`P` per positional argument of `f` (a tuple of them), or
            one P for every argument; a P covers a whole (nested) list/tuple/dict
            argument. ``P("dp", None)`` shards dim 0 over "dp" and replicates over
            every axis it does not mention. An argument may be a DTensor on `mesh`
            (redistributed to the spec if its placements differ) or a plain tensor
            holding the GLOBAL value on every rank, which is sharded here. A sharded
            dim must divide by the product of its axes' sizes, as in JAX.
        out_specs: the same for `f`'s outputs (a P for a single output).
        axis_names: the mesh axes `f` is manual over, a set (JAX's ``axis_names``);
            empty, the default, is every axis. Only these may appear in the specs
            and in the collectives inside `f` (the others are unknown names there).
            Over the other axes `f` runs on the whole value, replicated: their
            placements are ``Replicate()`` in and out (a DTensor input sharded over
            one is gathered first), where JAX leaves their sharding to its compiler.
            Values and gradients are JAX's.
        check_vma: True: JAX's typed mode (JAX's default). Every value in `f` knows
            the mesh axes it varies over (:func:`funcoll.typeof`), each
            ``funcoll.lax`` collective has JAX's type rule, an output that varies over
            an axis its out spec says it is replicated over raises a ValueError
            naming the output and the axis, and the gradients take JAX's typed
            transposes (``psum``'s moves nothing). False, or left out: JAX's
            ``check_vma=False``, funcoll's behaviour before the typed mode: nothing is
            typed, out specs are trusted, ``psum``'s transpose is ``psum``. funcoll's
            default stays False (docs/jax.md says why); gradients agree for out
            specs that hold, except where the untyped rules differ from the typed
            ones (an ``all_gather(to="invarying")`` into a sharded output).
        check_rep: the older name of `check_vma` (``jax.experimental.shard_map``);
            pass one of the two.

    Returns:
        A function of the global inputs whose outputs are DTensors on `mesh` with
        the placements of `out_specs` (``Shard(d)`` per axis named at dim d,
        ``Replicate()`` elsewhere) and the global shape: each local output's
        sharded dims times their axes' sizes. ``y.full_tensor()`` is the global
        value, ``y.to_local()`` this rank's shard. With ``check_vma=False``, as in
        JAX, a spec that says an output is replicated is trusted, not checked.

    Backward: gradients are those of the global function (a loss computed on the
    DTensor outputs, e.g. from ``full_tensor()``), as in JAX. ``check_vma=False``:
    the cotangent of an output replicated over axes A enters `f` divided by their
    size (each replica carries its share), the collectives inside transpose as
    JAX's do (``psum`` to ``psum``, ``all_gather`` to ``psum_scatter``), and an
    input's local gradient is summed over the axes its spec does not mention
    (``Partial("sum")`` there). ``check_vma=True``: the cotangent enters whole,
    ``psum``'s transpose moves nothing, and each cast of an invariant value to a
    varying one (``pcast``, or the one JAX makes when the two meet) psums its
    gradient. A plain-tensor input gets the whole global gradient on every rank.

    In the example, `mesh` is ``init_device_mesh("cpu", (2,), mesh_dim_names=("i",))``
    and `x` holds the global value on both ranks.

    Compiles with ``torch.compile(fullgraph=True)``: the mesh is bound and the
    axis names are resolved while tracing, and the graph holds the collectives.

    Example (2 ranks)::

        # both: x = [1., 2., 3., 4.]
        f = shard_map(lambda v: funcoll.lax.psum(v, "i"), mesh, P("i"), P())
        f(x).to_local()               # both: [4., 6.]
        g = shard_map(lambda v: v * 2, mesh, P("i"), P("i"))
        g(x).to_local()               # rank 0: [2., 4.]    rank 1: [6., 8.]
        g(x).full_tensor()            # both: [2., 4., 6., 8.]
    """
    opname = "funcoll.shard_map"
    if f is None:
        return functools.partial(  # type: ignore[return-value]
            shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
            axis_names=axis_names, check_vma=check_vma, check_rep=check_rep,
        )  # fmt: skip
    if not callable(f):
        raise TypeError(f"{opname}: `f` must be callable, got {type(f).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{opname}: `mesh` must be a DeviceMesh, got {type(mesh).__name__}")
    if not mesh.mesh_dim_names:
        raise ValueError(f"{opname}: `mesh` needs mesh_dim_names, the axis names specs and collectives use")
    typed = _check_vma(opname, check_vma, check_rep)
    manual = _manual_axes(opname, mesh, axis_names)
    for arg, specs in (("in_specs", in_specs), ("out_specs", out_specs)):
        for s in _leaves(specs):
            if not isinstance(s, P):
                raise TypeError(f"{opname}: `{arg}` must hold funcoll.P specs, got {s!r} in {specs!r}")
            for a in (a for entry in s for a in _entry_axes(entry)):
                if a in mesh.mesh_dim_names and a not in manual:
                    raise ValueError(
                        f"{opname}: `{arg}`={s!r} names the axis {a!r}, which is not in "
                        f"`axis_names`={set(axis_names)!r}; specs name the manual axes only"
                    )
    device_mesh = mesh
    # The mesh `f` sees: the manual axes only (a name outside them is unknown inside f, as in JAX).
    bound = mesh if len(manual) == mesh.ndim else mesh[manual]

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        return _run(opname, f, args, in_specs, out_specs, device_mesh, bound, typed)

    if not torch.compiler.is_compiling():  # inside a compiled region dynamo inlines `mapped`
        mapped.__code__ = _code_for(f, mapped.__code__)
    return mapped


# A code object of `mapped`'s per function mapped: dynamo keeps its compiled frames per code
# object, with a limit of recompiles on each (torch._dynamo.config.recompile_limit, 8), so with
# one code object for every shard_map the ninth program compiled with fullgraph=True raised
# FailOnRecompileLimitHit. Keyed by the mapped function's code, so that a shard_map rebuilt
# around the same function each step still finds its compiled frame (dynamo guards on the
# rest, as it does for any function). A program has finitely many code objects: not weak.
_CODES: dict[object, types.CodeType] = {}


def _code_for(f: Callable[..., Any], code: types.CodeType) -> types.CodeType:
    inner = getattr(f, "func", f)  # a functools.partial: its function's
    key = getattr(inner, "__code__", None) or type(inner)  # a module or other callable: its class
    if key not in _CODES:
        _CODES[key] = code.replace()  # a copy: the same bytecode, a code object of its own
    return _CODES[key]


def _run(
    opname: str,
    f: Callable[..., Any],
    args: tuple[Any, ...],
    in_specs: Any,
    out_specs: Any,
    device_mesh: DeviceMesh,
    bound: DeviceMesh,
    typed: bool,
) -> Any:
    """One call of a shard_map: the inputs' local shards, `f` with `bound` bound, the outputs wrapped."""
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        # DTensor's from_local and to_local are autograd.Functions of the forward(ctx, ...) form, which
        # torch's transforms refuse (on every torch funcoll supports): say where to take the transform.
        raise NotImplementedError(
            f"{opname}: torch.func's transforms (grad, vjp, grad_and_value, vmap) do not run over shard_map: "
            f"its inputs and outputs pass through DTensor's from_local and to_local, which torch's transforms "
            f"refuse; take the transform inside f, on the local values (shard_map(..., check_vma=False)), or "
            f"use torch.autograd.grad"
        )
    specs = in_specs if isinstance(in_specs, P) else tuple(in_specs)
    if not isinstance(specs, P) and len(specs) != len(args):
        raise ValueError(f"{opname}: `in_specs` has {len(specs)} specs for {len(args)} arguments")
    prefix = specs if isinstance(specs, P) else list(specs)
    local = _map(
        opname, lambda x, s, _: _to_local(opname, x, s, device_mesh, typed), list(args), prefix, "in_specs"
    )
    _MESHES.append(bound)
    TYPED.append(typed)
    try:  # the outputs are checked and cast with the mesh still bound
        out = f(*local)
        return _map(
            opname,
            lambda y, s, where: _from_local(opname, y, s, device_mesh, typed, where or "0"),
            out,
            out_specs,
            "out_specs",
        )
    finally:
        TYPED.pop()
        _MESHES.pop()


def _check_vma(opname: str, check_vma: object, check_rep: object) -> bool:
    """The typed mode asked for, under either name: True, or False (also when left out)."""
    if check_vma is not None and check_rep is not None:
        raise TypeError(f"{opname}: pass `check_vma` or its older name `check_rep`, not both")
    arg, value = ("check_rep", check_rep) if check_rep is not None else ("check_vma", check_vma)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"{opname}: `{arg}` must be a bool, got {value!r}")
    return value


def _manual_axes(opname: str, device_mesh: DeviceMesh, axis_names: object) -> tuple[str, ...]:
    """`axis_names` checked as JAX checks it, in mesh order; every axis when it is empty."""
    known = tuple(device_mesh.mesh_dim_names or ())
    if not isinstance(axis_names, (set, frozenset)):
        raise TypeError(f"{opname}: `axis_names` must be a set of mesh axis names, got {axis_names!r}")
    unknown = [a for a in axis_names if a not in known]
    if unknown:
        raise ValueError(
            f"{opname}: `axis_names`={set(axis_names)!r} names {unknown[0]!r}, which is not an axis of "
            f"the mesh {known}"
        )
    return tuple(a for a in known if a in axis_names) if axis_names else known


def _leaves(specs: Any) -> Iterator[Any]:
    if isinstance(specs, P) or not isinstance(specs, (list, tuple, dict)):
        yield specs
        return
    for s in specs.values() if isinstance(specs, dict) else specs:
        yield from _leaves(s)
