"""DTensor in, DTensor out (funcoll/_base/_dtensor.py, funcoll/_ops/_shard.py) on real gloo ranks.

Every case builds a DTensor of a global tensor X (``distribute_tensor``), or of per-rank
partials P_j (``Partial``: X is their sum, average or max), calls one funcoll op on it and
checks, against references computed in one process:

* the result is a DTensor on the same mesh, with the placements the op's table gives
  (the acted mesh dim changed, the others untouched) and X's global shape;
* ``full_tensor()`` is the global result (X itself, the reduced partials, or X's blocks
  permuted), and the local shard is what DTensor's own ``distribute_tensor`` puts on
  that rank for those placements (the layout: ``torch.chunk``'s, uneven included);
* float64 gradients of the one global loss ``sum(Y * W)``, computed with torch.autograd
  in one process from the global inputs: DTensor's semantics, where a replicated
  value's gradient is not summed over ranks.

1-D meshes of 1, 2, 3 and 4 ranks, and a 2x2 ("dp", "sp") mesh on 4 ranks acting on
"sp" with Shard/Partial placements on "dp" left alone. One ``run_ranks`` per world
size runs every case; the last rank first makes every bad call alone, so one that
communicated would put the batch out of step and fail it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _inputs import once_per_world, seeded
from _torchrun import ROOT, torchrun
from torch import Tensor

import funcoll
import funcoll.moe
from funcoll._base._dtensor import chunk_sizes

WORLDS = (1, 2, 3, 4)
TIMEOUT_S = 180.0
F64 = torch.float64


@dataclass(frozen=True)
class Case:
    """One op on one DTensor. Placements per mesh dim: "S<d>", "R", "P<op>" (Partial)."""

    id: str
    op: str
    shape: tuple[int, ...]
    placements: tuple[str, ...]
    out: str  # the placement the acted mesh dim should end with
    kw: dict[str, Any] = field(default_factory=dict)
    group: str = "default"  # how `group` is passed; see group_arg
    grad: bool = True

    @property
    def mesh_2d(self) -> bool:
        return len(self.placements) == 2

    @property
    def on(self) -> int:  # the mesh dim acted on: "sp" on the 2-D mesh
        return len(self.placements) - 1


def case(name: str, shape: tuple[int, ...], placements: tuple[str, ...], out: str, *, group: str = "default",
         grad: bool = True, **kw: Any) -> Case:  # fmt: skip
    """A case whose id reads as the test: ``all_to_all-x2x7x5-S1-to-S2-s2g1``."""
    args = "".join(f"{k[0]}{v}" for k, v in kw.items() if k != "perm")
    parts = [name, "x" + "x".join(map(str, shape)), "_".join(placements), "to", out, args,
             "" if group == "default" else group]  # fmt: skip
    return Case("-".join(p for p in parts if p), name, shape, placements, out, kw, group, grad)


def cases(world: int) -> list[Case]:
    ring = {"perm": [(i, (i + 1) % world) for i in range(world)]}
    one = [
        # Shard -> Replicate: 7 and 5 rows over 2, 3, 4 ranks are uneven (5 over 4: 2, 2, 1, 0)
        case("all_gather", (7, 3), ("S0",), "R", dim=0),
        case("all_gather", (3, 5, 2), ("S1",), "R", dim=1),
        case("all_gather", (2, 3), ("S0",), "R", dim=-2),  # 2 rows over 3 or 4 ranks: empty shards
        case("gather", (5, 3), ("S0",), "R", dim=0),
        case("gather", (3, 7), ("S1",), "R", dim=1, strategy="pad"),
        case("all_gather_ragged", (7, 2), ("S0",), "R", dim=0),
        case("gather_forward_split_backward", (2, 7), ("S1",), "R", dim=1),
        # Partial -> Shard / Replicate
        case("reduce_scatter", (7, 3), ("Psum",), "S0", dim=0),
        case("reduce_scatter", (3, 5), ("Pavg",), "S1", dim=1, op="avg"),
        case("reduce_scatter", (4 * world, 2), ("Pmax",), "S0", dim=0, op="max", grad=False),
        case("all_reduce", (3, 4), ("Psum",), "R"),
        case("all_reduce", (5,), ("Pavg",), "R", op="avg"),
        case("all_reduce", (2, 3), ("Pmin",), "R", op="min", grad=False),
        # Shard(gather_dim) -> Shard(scatter_dim): Ulysses' (B, S, H, D) with S and H uneven
        case("all_to_all", (2, 7, 5, 3), ("S1",), "S2", scatter_dim=2, gather_dim=1),
        case("all_to_all", (2, 7, 5, 3), ("S2",), "S1", scatter_dim=1, gather_dim=2),
        case("all_to_all", (6, 4 * world), ("S0",), "S1", scatter_dim=1, gather_dim=0),
        case("broadcast", (3, 2), ("R",), "R", src=world - 1),
        case("ppermute", (2 * world, 3), ("S0",), "S0", **ring),
        case("split_forward_gather_backward", (7, 3), ("R",), "S0", dim=0),
        case("split_forward_gather_backward", (3, 5), ("R",), "S1", dim=-1),
        # the group in every form that names the mesh's dim
        case("all_gather", (5, 2), ("S0",), "R", dim=0, group="mesh"),
        case("all_gather", (5, 2), ("S0",), "R", dim=0, group="tuple"),
    ]
    if world != 4:
        return one
    two = [  # the 2x2 mesh: act on "sp", leave "dp" as it is
        case("all_gather", (4, 7, 3), ("S0", "S1"), "R", dim=1),
        case("all_gather", (4, 7, 3), ("S0", "S1"), "R", dim=1, group="tuple-int"),
        case("all_gather", (4, 7, 3), ("S0", "S1"), "R", dim=1, group="submesh"),
        case("all_gather", (4, 7, 3), ("S0", "S1"), "R", dim=1, group="process-group"),
        case("all_gather", (4, 7, 3), ("S0", "S1"), "R", dim=1, group="name"),
        case("all_to_all", (2, 7, 5, 3), ("S0", "S1"), "S2", scatter_dim=2, gather_dim=1),
        case("all_to_all", (2, 5, 3, 2), ("R", "S2"), "S1", scatter_dim=1, gather_dim=2),
        case("reduce_scatter", (4, 5), ("S0", "Psum"), "S1", dim=1),
        case("all_reduce", (4, 3), ("S0", "Psum"), "R"),
        case("all_reduce", (4, 3), ("Psum", "Psum"), "R"),
        case("split_forward_gather_backward", (4, 7), ("S0", "R"), "S1", dim=1),
        case("gather", (3, 5), ("R", "S0"), "R", dim=0),
        case("broadcast", (4, 2), ("S0", "R"), "R", src=1),
        case("ppermute", (3, 4), ("S0", "S1"), "S1", perm=[(0, 1), (1, 0)]),
    ]
    return one + two


# ------------------------------------------------------------------------- placements
def placement(code: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code == "R":
        return Replicate()
    if code.startswith("S"):
        return Shard(int(code[1:]))
    return Partial(code[1:])


def mesh_of(world: int, two_d: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if two_d:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))


def group_arg(c: Case, mesh: Any) -> Any:
    """The `group` argument as real code passes it."""
    return {
        "default": None if not c.mesh_2d else (mesh, "sp"),
        "mesh": mesh,
        "tuple": (mesh, "sp"),
        "tuple-int": (mesh, 1),
        "submesh": mesh["sp"] if c.mesh_2d else mesh,
        "process-group": mesh.get_group("sp"),
        "name": mesh.get_group("sp").group_name,
    }[c.group]


def global_x(c: Case) -> Tensor:
    return seeded(c.shape, F64, c.id, "x")


def chunk(t: Tensor, parts: int, dim: int, i: int) -> Tensor:
    """Piece i of ``torch.chunk(t, parts, dim)``, empty where torch.chunk gives fewer pieces."""
    pieces = torch.chunk(t, parts, dim)
    return pieces[i] if i < len(pieces) else t.narrow(dim, t.shape[dim], 0)


def local_of(c: Case, coords: tuple[int, ...], sizes: tuple[int, ...], inputs: list[Tensor]) -> Tensor:
    """Rank `coords`' local shard: its partial along each "P" dim, its chunk along each "S" dim.

    `inputs` is ``[X]``, or one partial per coordinate of the "P" mesh dims (flattened
    row-major over those dims)."""
    pdims = [k for k, p in enumerate(c.placements) if p.startswith("P")]
    index = 0
    for k in pdims:
        index = index * sizes[k] + coords[k]
    t = inputs[index]
    for k, p in enumerate(c.placements):
        if p.startswith("S"):
            t = chunk(t, sizes[k], int(p[1:]), coords[k])
    return t


def inputs_of(c: Case, sizes: tuple[int, ...]) -> list[Tensor]:
    """``[X]`` without Partial; else one partial per coordinate of the Partial mesh dims."""
    count = 1
    for k, p in enumerate(c.placements):
        if p.startswith("P"):
            count *= sizes[k]
    if count == 1 and not any(p.startswith("P") for p in c.placements):
        return [global_x(c)]
    return [seeded(c.shape, F64, c.id, "partial", j) for j in range(count)]


def mesh_sizes(c: Case, world: int) -> tuple[int, ...]:
    return (2, 2) if c.mesh_2d else (world,)


def coords_of(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    return (rank // sizes[1], rank % sizes[1]) if len(sizes) == 2 else (rank,)


# ------------------------------------------------------------------------------ calls
CALLS: dict[str, Callable[..., Any]] = {
    "all_gather": lambda x, g, kw: funcoll.all_gather(x, kw["dim"], group=g),
    "gather": lambda x, g, kw: funcoll.gather(x, kw["dim"], group=g, strategy=kw.get("strategy", "auto")),
    "all_gather_ragged": lambda x, g, kw: funcoll.all_gather_ragged(x, kw["dim"], group=g),
    "gather_forward_split_backward": lambda x, g, kw: funcoll.gather_forward_split_backward(x, g, kw["dim"]),
    "split_forward_gather_backward": lambda x, g, kw: funcoll.split_forward_gather_backward(x, g, kw["dim"]),
    "reduce_scatter": lambda x, g, kw: funcoll.reduce_scatter(x, kw["dim"], group=g, op=kw.get("op", "sum")),
    "all_reduce": lambda x, g, kw: funcoll.all_reduce(x, group=g, op=kw.get("op", "sum")),
    "all_to_all": lambda x, g, kw: funcoll.all_to_all(x, g, kw["scatter_dim"], kw["gather_dim"]),
    "broadcast": lambda x, g, kw: funcoll.broadcast(x, kw["src"], group=g),
    "ppermute": lambda x, g, kw: funcoll.ppermute(x, kw["perm"], group=g),
}


def _chunks(c: Case, sizes: tuple[int, ...], dim: int) -> list[int]:
    """torch.chunk's lengths of tensor dim `dim` over the acted mesh dim (the reference's own)."""
    n, parts = c.shape[dim], sizes[c.on]
    got = [p.shape[0] for p in torch.chunk(torch.empty(n), parts)] if n else []
    return got + [0] * (parts - len(got))


# The plain ops that compute the same local result (the plain group: the mesh dim's).
PLAIN: dict[str, Callable[..., Tensor]] = {
    "all_gather": lambda t, g, kw, c, sz: funcoll.gather(t, kw["dim"], group=g),  # ragged: exchanges sizes
    "reduce_scatter": lambda t, g, kw, c, sz: funcoll.reduce_scatter(
        t, kw["dim"], group=g, op=kw.get("op", "sum"), sizes=_chunks(c, sz, kw["dim"])
    ),
    "all_to_all": lambda t, g, kw, c, sz: funcoll.all_to_all(
        t, g, kw["scatter_dim"], kw["gather_dim"], scatter_sizes=_chunks(c, sz, kw["scatter_dim"]),
        gather_sizes=_chunks(c, sz, kw["gather_dim"]),
    ),
}  # fmt: skip


def run_case(c: Case, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    sizes = mesh_sizes(c, world)
    mesh = mesh_of(world, c.mesh_2d)
    ins = inputs_of(c, sizes)
    places = [placement(p) for p in c.placements]
    leaf = local_of(c, coords_of(rank, sizes), sizes, ins).clone().requires_grad_(c.grad)
    x = DTensor.from_local(leaf, mesh, places, run_check=False, shape=torch.Size(c.shape),
                           stride=torch.empty(c.shape).stride())  # fmt: skip
    y = CALLS[c.op](x, group_arg(c, mesh), c.kw)
    out: dict[str, Any] = {}
    if c.op == "all_gather_ragged":
        y, out["sizes"] = y[0], y[1].tolist()  # a host read of a CPU tensor, for the check
    out["type"] = type(y).__name__
    out["placements"] = [str(p) for p in y.placements]
    out["shape"] = tuple(y.shape)
    out["full"] = y.full_tensor().detach()
    out["local"] = y.to_local().detach()
    # the local shard DTensor itself would hold (a Partial is left to the reference check)
    exact = [p if not p.is_partial() else placement("R") for p in y.placements]
    out["layout"] = (
        distribute_tensor(out["full"], mesh, exact).to_local() if exact == list(y.placements) else None
    )
    # the same collective on the plain local shard, where the plain op has one (its own code path)
    plain = PLAIN.get(c.op)
    out["plain"] = None if plain is None else plain(leaf.detach(), group_arg(c, mesh), c.kw, c, sizes)
    if c.grad:  # one global loss: W replicated where y is partial
        w = distribute_tensor(seeded(c.shape, F64, c.id, "w"), mesh, exact)
        (y * w).sum().full_tensor().backward()
        out["grad"] = leaf.grad
    return out


# ------------------------------------------------------------------------- bad calls
@dataclass
class BadCall:
    id: str
    call: Callable[[Any, Any], object]  # (mesh1d, mesh2d) -> the call
    exc: type[Exception]
    op: str
    fragments: tuple[str, ...]


def _dt(mesh: Any, shape: tuple[int, ...], *places: str) -> Any:
    """A zero DTensor of global `shape`, this rank holding its torch.chunk piece."""
    from torch.distributed.tensor import DTensor

    local, coords = torch.zeros(shape), mesh.get_coordinate()
    for k, p in enumerate(places):
        if p.startswith("S"):
            local = chunk(local, mesh.size(k), int(p[1:]), coords[k])
    return DTensor.from_local(local, mesh, [placement(p) for p in places], run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape).stride())  # fmt: skip


def bad_calls(world: int) -> list[BadCall]:
    f = funcoll
    calls = [
        BadCall("all_gather-partial", lambda m, m2: f.all_gather(_dt(m, (4, 2), "Psum")), ValueError,
                "all_gather", ("Partial('sum')", "mesh dim 0", "Shard(0)")),
        BadCall("all_gather-wrong-dim", lambda m, m2: f.all_gather(_dt(m, (4, 2), "S1"), 0), ValueError,
                "all_gather", ("Shard(1)", "Shard(0) (`dim`=0)")),
        BadCall("reduce_scatter-shard", lambda m, m2: f.reduce_scatter(_dt(m, (4, 2), "S0")), ValueError,
                "reduce_scatter", ("Shard(0)", "Partial('sum')")),
        BadCall("reduce_scatter-op", lambda m, m2: f.reduce_scatter(_dt(m, (4, 2), "Pmax")), ValueError,
                "reduce_scatter", ("Partial('max')", "`op`='sum'", "op='max'")),
        BadCall("reduce_scatter-sizes", lambda m, m2: f.reduce_scatter(_dt(m, (4, 2), "Psum"), sizes=[4] + [0] * (world - 1)),
                ValueError, "reduce_scatter", ("`sizes`",)),
        BadCall("all_reduce-replicate", lambda m, m2: f.all_reduce(_dt(m, (4, 2), "R")), ValueError,
                "all_reduce", ("Replicate()", "Partial('sum')")),
        BadCall("all_to_all-not-gather-dim", lambda m, m2: f.all_to_all(_dt(m, (2, 4, 4), "S2")), ValueError,
                "all_to_all", ("Shard(2)", "Shard(1) (`gather_dim`=1)")),
        BadCall("all_to_all-sizes", lambda m, m2: f.all_to_all(_dt(m, (2, 4, 4), "S1"), gather_sizes=[4] * world),
                ValueError, "all_to_all", ("`scatter_sizes` and `gather_sizes`",)),
        BadCall("all_to_all-same-dims", lambda m, m2: f.all_to_all(_dt(m, (2, 4, 4), "S1"), None, 1, 1),
                ValueError, "all_to_all", ("scatter_dim == gather_dim",)),
        BadCall("broadcast-shard", lambda m, m2: f.broadcast(_dt(m, (4, 2), "S0")), ValueError,
                "broadcast", ("Shard(0)", "Replicate()")),
        BadCall("ppermute-replicate", lambda m, m2: f.ppermute(_dt(m, (4, 2), "R"), [(0, 0)]), ValueError,
                "ppermute", ("Replicate()", "equal shards")),
        BadCall("split-shard", lambda m, m2: f.split_forward_gather_backward(_dt(m, (4, 2), "S0"), None, 0),
                ValueError, "split_forward_gather_backward", ("Shard(0)", "Replicate()")),
        BadCall("all_gather_list-dtensor", lambda m, m2: f.all_gather_list(_dt(m, (4, 2), "S0")), ValueError,
                "all_gather_list", ("is a DTensor", "x.to_local()")),
        BadCall("all_to_all_v-dtensor", lambda m, m2: f.all_to_all_v(_dt(m, (4, 2), "S0"), [0] * world),
                ValueError, "all_to_all_v", ("is a DTensor", "x.to_local()")),
        BadCall("gather_padded-dtensor", lambda m, m2: f.gather_padded(_dt(m, (4, 2), "S0"), 1), ValueError,
                "gather_padded", ("is a DTensor",)),
        BadCall("all_to_all_padded-dtensor", lambda m, m2: f.all_to_all_padded(_dt(m, (4, 2), "S0"), [0] * world),
                ValueError, "all_to_all_padded", ("is a DTensor",)),
        BadCall("gather-dst", lambda m, m2: f.gather(_dt(m, (4, 2), "S0"), dst=0), ValueError,
                "gather", ("with a `dst`",)),
        BadCall("all_gather-untiled", lambda m, m2: f.all_gather(_dt(m, (4, 2), "S0"), tiled=False), ValueError,
                "all_gather", ("new dim",)),
        BadCall("all_gather_into_tensor", lambda m, m2: f.all_gather_into_tensor(_dt(m, (4, 2), "S0")),
                ValueError, "all_gather_into_tensor", ("new dim",)),
        BadCall("to_ragged-plain", lambda m, m2: f.to_ragged(torch.zeros(2), [2] + [0] * (world - 1)), TypeError,
                "to_ragged", ("must be a DTensor",)),
        BadCall("to_ragged-sum", lambda m, m2: f.to_ragged(_dt(m, (world, 2), "S0"), [world + 1] + [0] * (world - 1)),
                ValueError, "to_ragged", ("`sizes`", f"x.shape[0]={world}")),
        BadCall("to_ragged-replicate", lambda m, m2: f.to_ragged(_dt(m, (4, 2), "R"), [4] + [0] * (world - 1)),
                ValueError, "to_ragged", ("Replicate()", "Shard(d)")),
        BadCall("from_ragged-sizes", lambda m, m2: f.from_ragged(torch.zeros(2, 1), group=m, sizes=[3] * world),
                ValueError, "from_ragged", ("`sizes`=", f"rank {world - 1} holds 3", "x.shape[0]=2")),
        BadCall("from_ragged-dtensor", lambda m, m2: f.from_ragged(_dt(m, (4, 2), "S0"), group=m), TypeError,
                "from_ragged", ("DTensor already",)),
        BadCall("from_ragged-group", lambda m, m2: f.from_ragged(torch.zeros(2), group=None), TypeError,
                "from_ragged", ("`group` must be a DeviceMesh",)),
        BadCall("from_ragged-placements", lambda m, m2: f.from_ragged(torch.zeros(2, 1), 0, group=m, placements=[placement("S1")]),
                ValueError, "from_ragged", ("`placements`[0] is Shard(1)",)),
        BadCall("moe.dispatch-dtensor", lambda m, m2: funcoll.moe.dispatch(_dt(m, (4, 2), "S0"), torch.zeros(1, 1, dtype=torch.int64), world),
                ValueError, "moe.dispatch", ("is a DTensor", "x.to_local()")),
    ]  # fmt: skip
    if world == 3:
        calls.append(BadCall("ppermute-uneven", lambda m, m2: f.ppermute(_dt(m, (4, 2), "S0"), [(0, 0)]),
                             ValueError, "ppermute", ("does not divide",)))  # fmt: skip
    if world == 4:
        calls += [
            BadCall("2d-no-group", lambda m, m2: f.all_gather(_dt(m2, (2, 2), "S0", "S1")), ValueError,
                    "all_gather", ("2-D mesh", "group=(mesh, mesh_dim)")),
            BadCall("2d-foreign-group", lambda m, m2: f.all_gather(_dt(m2, (2, 2), "R", "S0"), group=dist.group.WORLD),
                    ValueError, "all_gather", ("is not a dim of the DTensor's mesh",)),
            BadCall("2d-sharded-twice", lambda m, m2: f.all_gather(_dt(m2, (2, 2), "S0", "S0"), group=(m2, "sp")),
                    ValueError, "all_gather", ("also sharded along tensor dim 0", "mesh dim 0")),
            BadCall("2d-names-the-dim", lambda m, m2: f.all_reduce(_dt(m2, (2, 2), "S0", "R"), group=(m2, "sp")),
                    ValueError, "all_reduce", ("mesh dim 1 ('sp')",)),
        ]  # fmt: skip
    return calls


def bad_call_outcome(b: BadCall, meshes: tuple[Any, Any]) -> tuple[str, str]:
    try:
        b.call(*meshes)
    except Exception as e:  # noqa: BLE001 (recorded; the parent checks the type and the message)
        return type(e).__name__, str(e)
    return "no error", ""


# ----------------------------------------------------------------------- from_ragged
def ragged_lengths(world: int) -> list[int]:
    """Per-rank lengths with a 0 from world 2 on, neither sorted nor DTensor's."""
    return [(3 * r + 2) % 5 for r in range(world)]


def ragged_piece(rank: int, lengths: list[int], tag: str, trail: tuple[int, ...] = (3,)) -> Tensor:
    full = seeded((sum(lengths), *trail), F64, "ragged", tag)
    return full[sum(lengths[:rank]) : sum(lengths[: rank + 1])]


def run_ragged(rank: int, world: int) -> dict[str, Any]:
    """from_ragged -> a funcoll op -> to_ragged on a 1-D mesh (dims 0 and 1), and on the 2x2 mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, Any] = {}
    lengths = ragged_lengths(world)
    mesh = mesh_of(world, False)
    for dim in (0, 1):
        piece = ragged_piece(rank, lengths, f"d{dim}")
        leaf = (piece if dim == 0 else piece.T.contiguous()).clone().requires_grad_()
        y, sizes = funcoll.from_ragged(leaf, dim, group=mesh)
        w = distribute_tensor(seeded(tuple(y.shape), F64, "ragged-w", dim), mesh, y.placements)
        back = funcoll.to_ragged(y * 2, sizes)
        ((y * w).sum().full_tensor() + (back * back).sum()).backward()
        out[f"d{dim}"] = {
            "sizes": list(sizes),
            "placements": [str(p) for p in y.placements],
            "shape": tuple(y.shape),
            "full": y.full_tensor().detach(),
            "local": y.to_local().detach(),
            "back": back.detach(),
            "grad": leaf.grad,
        }
    given, _ = funcoll.from_ragged(ragged_piece(rank, lengths, "d0"), 0, group=mesh, sizes=lengths)
    out["given"] = given.to_local()  # the lengths passed in: nothing exchanged, the same layout
    if world == 4:  # dp x sp: each dp group spreads its own batch row's tokens raggedly over sp
        mesh2 = mesh_of(world, True)
        dp, sp = coords_of(rank, (2, 2))
        lens = [[3, 4], [6, 1]][dp]  # both dp groups hold 7 tokens in all
        tokens = seeded((2, 7, 3), F64, "ragged-2d")[dp : dp + 1]
        piece = tokens[:, sum(lens[:sp]) : sum(lens[: sp + 1])].clone().requires_grad_()
        y, sizes = funcoll.from_ragged(piece, 1, group=(mesh2, "sp"), placements=[Shard(0), Shard(1)])
        z = funcoll.all_to_all(y, (mesh2, "sp"), 2, 1)  # tokens -> features, then back to the pieces
        back = funcoll.to_ragged(funcoll.all_to_all(z * 3, (mesh2, "sp"), 1, 2), sizes, group=(mesh2, "sp"))
        (back * seeded(tuple(back.shape), F64, "ragged-2d-w", rank)).sum().backward()
        out["2d"] = {
            "sizes": list(sizes),
            "placements": [str(p) for p in y.placements],
            "shape": tuple(y.shape),
            "full": y.full_tensor().detach(),
            "z_placements": [str(p) for p in z.placements],
            "back": back.detach(),
            "grad": piece.grad,
        }
    return out


# ------------------------------------------------------------------------------ batch
def dtensor_body(rank: int, world: int) -> dict[str, Any]:
    meshes = (mesh_of(world, False), mesh_of(world, True) if world == 4 else None)
    errors = {b.id: bad_call_outcome(b, meshes) for b in bad_calls(world)} if rank == world - 1 else {}
    results = {c.id: run_case(c, rank, world) for c in cases(world)}
    return {"results": results, "errors": errors, "ragged": run_ragged(rank, world)}


dtensor_batch = once_per_world(dtensor_body, TIMEOUT_S, worlds=WORLDS)


# -------------------------------------------------------------------------- reference
def reduce(op: str, ts: list[Tensor]) -> Tensor:
    s = torch.stack(ts)
    return {"sum": s.sum(0), "avg": s.mean(0), "max": s.amax(0), "min": s.amin(0)}[op]


def reference(c: Case, world: int) -> tuple[Tensor, list[Tensor]]:
    """(global result, every rank's expected local ``leaf.grad``), by autograd in one process."""
    sizes = mesh_sizes(c, world)
    leaves = [t.clone().requires_grad_() for t in inputs_of(c, sizes)]
    pcodes = [p for p in c.placements if p.startswith("P")]
    if not pcodes:
        x = leaves[0]
    elif len(pcodes) == 1:
        x = reduce(pcodes[0][1:], leaves)
    else:  # Partial on both mesh dims: every rank's partial adds up
        x = reduce("sum", leaves)
    y = x
    if c.op == "ppermute":  # blocks of the shard dim move from src to dst along the acted mesh dim
        d = int(c.placements[c.on][1:])
        n = sizes[c.on]
        blocks = list(torch.chunk(x, n, d))
        moved = [torch.zeros_like(b) for b in blocks]
        for src, dst in c.kw["perm"]:
            moved[dst] = blocks[src]
        y = torch.cat(moved, d)
    grads: list[Tensor] = []
    if c.grad:
        w = seeded(c.shape, F64, c.id, "w")
        gs = torch.autograd.grad((y * w).sum(), leaves, allow_unused=True)
        gs = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(gs, leaves, strict=True)]
        grads = [local_of(c, coords_of(r, sizes), sizes, gs) for r in range(world)]
    return y.detach(), grads


def expected_placements(c: Case) -> list[str]:
    out = [str(placement(p)) for p in c.placements]
    out[c.on] = str(placement(c.out))
    return out


# ------------------------------------------------------------------------------ tests
CASES = [pytest.param(w, c, id=f"w{w}-{c.id}") for w in WORLDS for c in cases(w)]
GRADS = [pytest.param(w, c, id=f"w{w}-{c.id}") for w in WORLDS for c in cases(w) if c.grad]
ERRORS = [pytest.param(w, b, id=f"w{w}-{b.id}") for w in WORLDS for b in bad_calls(w)]


@pytest.mark.parametrize("world, c", CASES)
def test_placements_and_global_shape(world: int, c: Case) -> None:
    for r, res in enumerate(dtensor_batch(world)):
        got = res["results"][c.id]
        assert got["type"] == "DTensor", f"rank {r}: {got['type']}"
        assert got["placements"] == expected_placements(c), f"rank {r}"
        assert got["shape"] == c.shape, f"rank {r}"


@pytest.mark.parametrize("world, c", CASES)
def test_values_and_layout(world: int, c: Case) -> None:
    expected, _ = reference(c, world)
    for r, res in enumerate(dtensor_batch(world)):
        got = res["results"][c.id]
        torch.testing.assert_close(got["full"], expected, msg=lambda m, r=r: f"rank {r}: {m}")
        # the local shard is the one DTensor itself puts there (torch.chunk's layout)
        if got["layout"] is not None:
            torch.testing.assert_close(got["local"], got["layout"], rtol=0, atol=0)
        if got["plain"] is not None:  # the plain op on the local shard agrees
            torch.testing.assert_close(got["local"], got["plain"], rtol=0, atol=0)
        if c.op == "all_gather_ragged":
            assert got["sizes"] == chunk_sizes(c.shape[c.kw["dim"]], mesh_sizes(c, world)[c.on])


@pytest.mark.parametrize("world, c", GRADS)
def test_grad(world: int, c: Case) -> None:
    _, expected = reference(c, world)
    for r, res in enumerate(dtensor_batch(world)):
        got = res["results"][c.id]["grad"]
        assert got is not None, f"rank {r}: no gradient"
        torch.testing.assert_close(got, expected[r], msg=lambda m, r=r: f"rank {r}: {m}")


@pytest.mark.parametrize("world, bad", ERRORS)
def test_bad_placement_raises_before_communicating(world: int, bad: BadCall) -> None:
    kind, message = dtensor_batch(world)[world - 1]["errors"][bad.id]
    assert kind == bad.exc.__name__, message
    assert message.startswith(f"funcoll.{bad.op}: "), message
    for fragment in bad.fragments:
        assert fragment in message, message


@pytest.mark.parametrize("world", WORLDS)
def test_from_ragged_round_trip(world: int) -> None:
    lengths = ragged_lengths(world)
    n, step = sum(lengths), -(-sum(lengths) // world)
    for dim in (0, 1):
        full = seeded((n, 3), F64, "ragged", f"d{dim}")
        full = full if dim == 0 else full.T
        w = seeded(tuple(full.shape), F64, "ragged-w", dim)
        for r, res in enumerate(dtensor_batch(world)):
            got = res["ragged"][f"d{dim}"]
            mine = full.narrow(dim, sum(lengths[:r]), lengths[r])
            assert got["sizes"] == lengths
            assert got["placements"] == [f"S({dim})"] and got["shape"] == tuple(full.shape)
            torch.testing.assert_close(got["full"], full, rtol=0, atol=0)
            # rank r holds rows [r * step, (r + 1) * step) of the global order: torch.chunk's layout
            torch.testing.assert_close(
                got["local"], full.narrow(dim, min(r * step, n), chunk_sizes(n, world)[r])
            )
            torch.testing.assert_close(got["back"], 2 * mine, rtol=0, atol=0)
            if dim == 0:
                torch.testing.assert_close(res["ragged"]["given"], got["local"], rtol=0, atol=0)
            # loss = sum(Y * W) + sum((2 X_r)^2) over ranks: d/dX_r = W_r + 8 X_r
            torch.testing.assert_close(got["grad"], w.narrow(dim, sum(lengths[:r]), lengths[r]) + 8 * mine)


def test_from_ragged_on_a_2d_mesh() -> None:
    tokens = seeded((2, 7, 3), F64, "ragged-2d")
    lens = [[3, 4], [6, 1]]
    for r, res in enumerate(dtensor_batch(4)):
        got = res["ragged"]["2d"]
        dp, sp = coords_of(r, (2, 2))
        assert got["sizes"] == lens[dp]
        assert got["placements"] == ["S(0)", "S(1)"] and got["shape"] == (2, 7, 3)
        assert got["z_placements"] == ["S(0)", "S(2)"]
        torch.testing.assert_close(got["full"], tokens, rtol=0, atol=0)
        mine = tokens[dp : dp + 1, sum(lens[dp][:sp]) : sum(lens[dp][: sp + 1])]
        torch.testing.assert_close(got["back"], 3 * mine, rtol=0, atol=0)
        w = seeded(tuple(mine.shape), F64, "ragged-2d-w", r)
        torch.testing.assert_close(got["grad"], 3 * w)


def test_chunk_sizes_are_torch_chunks() -> None:
    """DTensor shards as torch.chunk does, empty pieces last."""
    for n in range(12):
        for world in range(1, 6):
            want = [p.shape[0] for p in torch.chunk(torch.empty(n), world)] if n else []
            assert chunk_sizes(n, world) == want + [0] * (world - len(want)), (n, world)


def test_docs_placement_table_is_the_specs() -> None:
    """docs/dtensor.md lists every op's (takes, gives) as its spec says, and no other op."""
    import re

    from funcoll._ops._spec import specs

    text = (Path(__file__).resolve().parents[1] / "docs" / "dtensor.md").read_text()
    rows = dict(
        (m.group(1), (m.group(2), m.group(3)))
        for m in re.finditer(r"^\| `(\w+)` \| `([^`]+)` \| `([^`]+)` \|$", text, re.MULTILINE)
    )
    assert rows == {s.name: s.placements for s in specs() if s.placements is not None}


def test_torchrun_example_runs() -> None:
    """examples/dtensor_ragged.py as docs/dtensor.md runs it: torchrun, 2 gloo ranks; nothing left unwaited."""
    out, err = torchrun([str(ROOT / "examples" / "dtensor_ragged.py")])
    assert (
        "rank 0: 5 tokens of its own; DTensor (7, 3) (Shard(dim=0),), its even chunk: rows [0.0, 1.0, 2.0, 3.0]"
        in out
    )
    assert out.count("tokens back") == 2
    assert "unwaited" not in err, err[-3000:]
