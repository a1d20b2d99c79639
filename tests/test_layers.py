"""funcoll's modules import one another one way, and never another module's private names.

Read from the source (nothing is imported): every ``import`` of a funcoll module by
another, at the top of a file or inside a function, and every ``_module._name`` or
``from ._module import _name`` that reaches into another module. The layers are
folders, from the bottom: ``funcoll/_base`` (the switches and checks: ``_config``,
``_checks``, ``_group``, ...), ``funcoll/_collective`` (the issue and wait of one
collective, the size exchange, the primitives), ``funcoll/_ops`` (the op families and
their entry), the frontends (``lax``, ``compat``, ``moe``, ``integrations``), the tools
(``testing``, the demo): docs/contributing.md. Also read from the source: where the
ops' entry steps are called, and how long each function is.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "funcoll"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, level: int, name: str | None) -> str:
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, name] if name else base)


@functools.cache
def _imports() -> dict[str, dict[str, set[str]]]:
    """module -> {imported funcoll module: the names taken from it}."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module(path)
        edges = graph.setdefault(me, {})
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # a local name -> the funcoll module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):  # `import funcoll`, `import funcoll.moe as moe`
                for a in node.names:
                    if a.name.split(".")[0] == "funcoll":
                        edges.setdefault(a.name, set())
                        if a.asname:
                            aliases[a.asname] = a.name
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").split(".")[0] == "funcoll"
            ):
                target = (
                    _resolve(me, path.name == "__init__.py", node.level, node.module)
                    if node.level
                    else node.module
                )
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                        PACKAGE.parent / sub.replace(".", "/")
                    ).is_dir():
                        edges.setdefault(sub, set())
                        aliases[a.asname or a.name] = sub
                    else:
                        edges.setdefault(target, set()).add(a.name)
        for node in ast.walk(tree):  # `_prims._run`: a name taken through a module alias
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                edges[aliases[node.value.id]].add(node.attr)
    return graph


def test_no_module_imports_another_modules_private_names() -> None:
    private = [
        f"{me} takes {name} from {other}"
        for me, edges in _imports().items()
        for other, names in edges.items()
        if other != me and not other.startswith(me + ".")
        for name in sorted(names)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, "\n".join(private)


def test_the_imports_have_no_cycle() -> None:
    imports = _imports()
    graph = {me: {o for o in edges if o != me and o in imports} for me, edges in imports.items()}
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_reading_finds_the_known_imports() -> None:
    """The reader sees the edges it is meant to police (a reader that saw nothing would pass)."""
    graph = _imports()
    assert "funcoll._collective._issue" in graph["funcoll._collective._header"]
    assert "funcoll._collective._header" in graph["funcoll._collective._prims"]
    assert "check_collective" in graph["funcoll._collective._prims"]["funcoll._collective._header"]
    assert "funcoll._collective._prims" in graph["funcoll.moe._dispatch"]
    assert "funcoll._ops._even" in graph["funcoll.moe._dropless"]


# The calls of the entry's steps allowed outside funcoll/_ops/_entry.py, each with why: the
# group queries themselves, DTensor's own mesh dims, and the frontends whose group is
# not an op's argument as passed (a mesh dim read with placements, a handle's group,
# a policy's, compat's default world, shard_map's mesh axes).
ENTRY_STEPS = (
    "check_tensor",
    "resolve_group",
    "dtensor_input",
    "refuse_dtensor",
    "check_wire",
    "exact_for_dtensor",
)
ENTRY_STEPS_ELSEWHERE = {
    ("funcoll._base._group", "resolve_group"): 2,  # axis_index, axis_size: the group queries
    ("funcoll._base._dtensor", "resolve_group"): 2,  # a DTensor's mesh dim to its group
    ("funcoll._ops._shard", "resolve_group"): 1,  # from_ragged: the mesh dim, read with the placements
    ("funcoll.moe._dispatch", "resolve_group"): 2,  # dispatch once (the handle keeps the group), combine once
    ("funcoll.moe._dropless", "resolve_group"): 1,  # Dropless: a bad group refused at construction
    ("funcoll.compat", "resolve_group"): 2,  # the seeds' default world; all_gather_into_tensor's out buffer
    # shard_map's mesh axes; all_gather(to="invarying") and the typed mode's psum: no public op each
    ("funcoll.lax", "resolve_group"): 3,
    ("funcoll._vma", "resolve_group"): 1,  # the group of the axes a typed cast adds (its backward's psum)
    ("funcoll.testing", "resolve_group"): 1,  # print_ranks: a report's group, in any form the ops take
    ("funcoll._base._compile", "check_tensor"): 1,  # mark_ragged: no group, no collective
}


def test_the_entry_steps_are_written_once() -> None:
    """Tensor checks, wire formats, group resolution and DTensor in/refusal: in the ops' entry, not by hand."""
    found: dict[tuple[str, str], int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module(path)
        if me == "funcoll._ops._entry":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in ENTRY_STEPS:
                    found[me, name] = found.get((me, name), 0) + 1
    assert found == ENTRY_STEPS_ELSEWHERE, (
        "calls of an entry step outside funcoll/_ops/_entry.py (declare it in the op's @entry instead):\n"
        + "\n".join(f"{m}: {n} x{c}" for (m, n), c in sorted(found.items()))
    )


def test_no_function_is_longer_than_120_lines() -> None:
    """A function, its decorators and docstring included, fits in 120 lines: split a longer one by step."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or first) - first + 1
                if length > 120:
                    long.append(f"{_module(path)}.{node.name}: {length} lines")
    assert not long, "\n".join(long)


# The seed-style helpers the demo compares against are not funcoll's: their backwards are the seeds'.
NOT_PRIMITIVES = ("funcoll._demo_seeds",)


def test_every_autograd_function_is_a_primitive() -> None:
    """Every autograd.Function in funcoll subclasses ``_phase.Primitive``, whose compiled backward stays in the backward.

    A funcoll backward written on ``torch.autograd.Function`` directly would lose the
    partitioner's ``must_be_in_backward`` tag: on a rank whose gradient is a constant of
    the graph (``loss * 0``), its collectives would move into the forward graph.
    """
    plain = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _module(path) in NOT_PRIMITIVES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if bases & {"torch.autograd.Function", "Function", "autograd.Function"}:
                    plain.append(f"{_module(path)}.{node.name}")
    assert plain == ["funcoll._collective._phase.Primitive"], plain


def test_every_autograd_function_has_setup_context() -> None:
    """Every autograd.Function in funcoll has torch's two-part form: a forward without ctx, and setup_context.

    torch's function transforms (``torch.func.grad``, ``vjp``, ``grad_and_value``) refuse
    one whose forward takes the ctx ("it must override the setup_context staticmethod"):
    one such Function on an op's path and the transforms refuse the op
    (tests/test_func_transforms.py).
    """
    classic = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
            forward = methods.get("forward")
            if forward is None or "backward" not in methods:  # not an autograd.Function (a Module, say)
                continue
            takes_ctx = bool(forward.args.args) and forward.args.args[0].arg == "ctx"
            if takes_ctx or "setup_context" not in methods:
                classic.append(f"{_module(path)}.{node.name}")
    assert not classic, classic


# The folders, from the bottom (docs/contributing.md, "Layers"): a module imports its own
# folder's modules and those of the folders below, never one above.
FOLDERS = (
    "funcoll._base",  # foundations
    "funcoll._collective",  # one collective: issue and wait, row moves, size exchange, primitives
    "funcoll._ops",  # the public ops and their entry
    "funcoll",  # the frontends: lax, _shard_map, compat, moe, integrations; funcoll's own __init__
    "tools",  # testing, the demo
)
TOOLS = ("funcoll.testing", "funcoll.demo", "funcoll._demo_train", "funcoll._demo_seeds")


def _folder(module: str) -> int:
    if module in TOOLS:
        return FOLDERS.index("tools")
    for i, folder in enumerate(FOLDERS[:3]):
        if module == folder or module.startswith(folder + "."):
            return i
    return FOLDERS.index("funcoll")


def test_the_folders_are_layers_that_import_only_downward() -> None:
    up = [
        f"{me} ({FOLDERS[_folder(me)]}) imports {other} ({FOLDERS[_folder(other)]})"
        for me, edges in _imports().items()
        for other in edges
        if other.startswith("funcoll") and _folder(other) > _folder(me)
    ]
    assert not up, "imports that point up a layer:\n" + "\n".join(up)
    assert {_folder(m) for m in _imports()} == set(range(len(FOLDERS))), "a folder with no module"
