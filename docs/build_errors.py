"""Every error message funcoll writes, read from its source with `ast`: what docs/errors.md documents.

Run ``python docs/build_errors.py`` to print each message template with the
places that raise it; ``tests/test_errors_doc.py`` fails when docs/errors.md
lacks a template the code produces, or keeps one the code no longer produces.

A template is the message with every formatted field replaced by ``…``; the
op's name, however it reaches the message (``f"{opname}: ..."``,
``f"funcoll.{key}: ..."``, ``self.opname``), becomes ``funcoll.<op>``. The
sites read are:

- ``raise SomeError(message)``, and an exception built to be raised elsewhere
  (``return ValueError(...)`` in ``MeshAxis.refuse``; ``type(error)(message)``
  in ``_faults.failed``, the backend's own type);
- ``torch._assert_async(cond, message)`` (kind ``device assert``) and
  ``torch._check(cond, lambda: message)`` (kind ``compiled check``);
- the helpers in :data:`EXPANDED`, whose message is completed by an argument:
  their messages are read at each call site, with that argument filled in.

A ``raise`` whose message cannot be read this way is reported as a problem
unless :data:`UNEXTRACTABLE` lists its function with the reason, and the
internal invariants in :data:`EXCLUDED` are skipped: so a new site that is
neither fails the test.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "funcoll"
OP = "funcoll.<op>"  # the op's name, wherever a message takes it from a variable
HOLE = "…"  # any other formatted field

# Helpers whose message is completed at each call site by the parameters named here.
EXPANDED: dict[str, tuple[str, ...]] = {
    "disagree": ("what",),  # _header: f"{opname}: ranks disagree on {what} ({detail})"
    "same_tails": ("message",),  # _header: f"{opname}: {message.format(...)}"
    "check_equal": ("traced", "eager"),  # _checks: torch._check(..., lambda: traced) / ValueError(eager())
    "same_sizes": ("traced",),  # moe/_layout: torch._check(..., lambda: traced); the caller raises its own eagerly
}
# Functions that return an exception for their caller to raise; their own messages are read where
# they build it, so `raise ax.refuse(...)`, `raise _faults.failed(...)` and gather's
# `raise _grad_to_dst(...)` and funcoll.lax's `raise _no_reduced(...)` need nothing more.
BUILDERS = {"refuse", "failed", "_grad_to_dst", "_no_reduced"}

# (module, function) -> why its `raise` is not read statically. Keep each reason true.
UNEXTRACTABLE: dict[tuple[str, str], str] = {
    ("funcoll/testing.py", "results"): (
        "RankError(_failure(...)): the message is assembled at run time from the failed ranks' "
        "tracebacks and exit codes; docs/errors.md describes it in prose (funcoll.testing)"
    ),
}
# (module, function) -> why its errors are internal invariants, not user-facing.
EXCLUDED: dict[tuple[str, str], str] = {
    # OpSpec.plan is asked only by funcoll's tests and docs tooling, about ops that declare collectives.
    ("funcoll/_ops/_spec.py", "plan"): "internal: the op spec table queried for an op without collectives",
    # @entry's checks of its own declaration: they fail at import, on a wrongly written op.
    (
        "funcoll/_ops/_entry.py",
        "__init__",
    ): "internal: an op's @entry given *args, **kwargs or a positional-only parameter",
    (
        "funcoll/_ops/_entry.py",
        "decorate",
    ): "internal: an op's @entry naming an argument the op does not have",
    # The registries of the ops' definitions: they fail at import, on an op defined twice.
    ("funcoll/_ops/_spec.py", "register"): "internal: an op defined twice, or in no docs section",
    (
        "funcoll/_collective/_header.py",
        "register_header",
    ): "internal: an op's header registered twice, or two names with one CRC-32",
    # The demo's own self-check: every parameter reaches the loss by construction.
    (
        "funcoll/_demo_train.py",
        "_grad",
    ): "internal: the demo's invariant that every parameter gets a gradient",
}
# Not read at all, by rule: `assert` (internal invariants; funcoll has none today) and
# `torch._check(cond)` without a message, which states a fact about sizes for the compiler.


@dataclass(frozen=True)
class Site:
    """One message template and where it is raised."""

    path: str  # funcoll/_base/_checks.py
    line: int
    func: str  # the enclosing function (for an expanded helper: the caller)
    kind: str  # ValueError, TypeError, ..., "device assert", "compiled check", "backend's type"
    template: str
    op: str = ""  # the op, when the site's function names it (`opname = "funcoll.x"`)


@dataclass
class Scan:
    sites: list[Site] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unextractable sites not listed, stale entries
    excluded: list[str] = field(default_factory=list)


class _Skip(Exception):
    """The message needs an argument of an expanded helper: it is read at the helper's call sites."""


class _Built(Exception):
    """The message is an exception a builder makes: read where the builder makes it."""


class _Unreadable(Exception):
    pass


@dataclass
class _Ctx:
    path: str
    funcs: list[ast.FunctionDef | ast.AsyncFunctionDef]  # enclosing functions, innermost last
    env: dict[str, tuple[ast.AST, _Ctx]] = field(default_factory=dict)  # expanded helper's arguments

    @property
    def func(self) -> str:
        return self.funcs[-1].name if self.funcs else "<module>"

    def assigned(self, name: str) -> ast.AST | None:
        """The value of `name` when the innermost function assigns it exactly once."""
        if not self.funcs:
            return None
        values = [
            n.value
            for n in ast.walk(self.funcs[-1])
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        ]
        return values[0] if len(values) == 1 else None

    def op(self) -> str:
        """The op named by an `opname = "funcoll.x"` in an enclosing function, else ''."""
        for f in reversed(self.funcs):
            for n in ast.walk(f):
                if (
                    isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "opname" for t in n.targets)
                    and isinstance(n.value, ast.Constant)
                    and isinstance(n.value.value, str)
                ):
                    return n.value.value
        return ""


def _is_op_field(node: ast.AST) -> bool:
    """A formatted field that holds the op's name."""
    if isinstance(node, ast.Name):
        return node.id in ("opname", "key")
    if isinstance(node, ast.Attribute):
        return node.attr == "opname"
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_op_name"


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _render(node: ast.AST, ctx: _Ctx) -> str:
    """The template of a message expression (see the module docstring)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = ""
        parts = list(node.values)
        for i, part in enumerate(parts):
            if isinstance(part, ast.Constant):
                text = str(part.value)
                nxt = parts[i + 1] if i + 1 < len(parts) else None
                if text.endswith("funcoll.") and isinstance(nxt, ast.FormattedValue):
                    text = text[: -len("funcoll.")]  # f"funcoll.{key}: ..." -> funcoll.<op>
                    parts[i + 1] = ast.FormattedValue(ast.Name("opname"), -1, None)
                out += text
            elif isinstance(part, ast.FormattedValue):
                v = part.value
                if _is_op_field(v):
                    out += OP
                elif any(isinstance(n, ast.Name) and (n.id in ctx.env or _expanded_param(n.id, ctx))
                         for n in ast.walk(v)):  # fmt: skip
                    try:  # a helper's argument: `{what}`, `{message.format(...)}`
                        out += _render(v, ctx)
                    except _Unreadable:  # the caller passes a value, not text: a field like any other
                        out += HOLE
                else:
                    out += HOLE
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left, ctx) + _render(node.right, ctx)
    if isinstance(node, ast.IfExp):
        return HOLE
    if isinstance(node, ast.Lambda):
        return _render(node.body, ctx)
    if isinstance(node, ast.Name):
        if node.id in ctx.env:
            return _render_arg(node.id, ctx)
        if _expanded_param(node.id, ctx):
            raise _Skip
        value = ctx.assigned(node.id)
        if value is not None:
            return _render(value, ctx)
        raise _Unreadable(f"the variable `{node.id}`")
    if isinstance(node, ast.Call):
        name = _call_name(node)
        if name in BUILDERS:
            raise _Built
        if name == "str" and len(node.args) == 1:
            return _render(node.args[0], ctx)
        if name == "format" and isinstance(node.func, ast.Attribute):
            return re.sub(r"\{[^{}]*\}", HOLE, _render(node.func.value, ctx))
        if isinstance(node.func, ast.Name) and not node.args and not node.keywords:
            if node.func.id in ctx.env:  # eager(): the caller's lambda
                return _render_arg(node.func.id, ctx)
            if _expanded_param(node.func.id, ctx):
                raise _Skip
        raise _Unreadable(f"a call of `{name or ast.unparse(node.func)}`")
    raise _Unreadable(f"a {type(node).__name__} expression")


def _expanded_param(name: str, ctx: _Ctx) -> bool:
    """`name` is a parameter of an expanded helper, read with its value at each call site instead."""
    return not ctx.env and any(name in EXPANDED.get(f.name, ()) for f in ctx.funcs)


def _render_arg(name: str, ctx: _Ctx) -> str:
    node, caller = ctx.env[name]
    return _render(node, caller)


def _tidy(template: str) -> str:
    return re.sub(f"{HOLE}+", HOLE, template)


def _exception_kind(call: ast.Call, func: str) -> str | None:
    """The kind of exception `call` (in function `func`) constructs, or None if it constructs none."""
    f = call.func
    if isinstance(f, ast.Name) and (f.id.endswith("Error") or f.id == "Exception"):
        return f.id
    # `type(error)(message)`: a builder re-making the backend's error (elsewhere, `type(tree)(...)` is no error)
    if func in BUILDERS and isinstance(f, ast.Call) and isinstance(f.func, ast.Name) and f.func.id == "type":
        return "backend's type"
    return None


def _message_sites(node: ast.AST) -> list[tuple[ast.AST, str, ast.AST | None]]:
    """(node, kind, message expression) for each place in `node` (a function or module) that writes a message."""
    out: list[tuple[ast.AST, str, ast.AST | None]] = []
    func = getattr(node, "name", "")
    for n in _walk(node):
        if isinstance(n, ast.Raise) and n.exc is not None:
            exc = n.exc
            if isinstance(exc, ast.Call) and _exception_kind(exc, func):
                out.append((n, _exception_kind(exc, func) or "", exc.args[0] if exc.args else None))
            elif isinstance(exc, ast.Call) and _call_name(exc) in BUILDERS:
                continue
            elif isinstance(exc, ast.Name) and not exc.id[:1].isupper():  # re-raising a caught exception
                continue
            elif isinstance(exc, ast.Name):  # `raise ValueError`: a class, no message
                out.append((n, exc.id, None))
            else:
                out.append((n, "raise", None))
        elif isinstance(n, ast.Call):
            name = _call_name(n)
            is_torch = isinstance(n.func, ast.Attribute) and ast.unparse(n.func.value) == "torch"
            if is_torch and name == "_assert_async":
                out.append((n, "device assert", n.args[1] if len(n.args) > 1 else None))
            elif is_torch and name == "_check" and len(n.args) > 1:
                out.append((n, "compiled check", n.args[1]))
            elif _exception_kind(n, func) and not _is_raised(n, node):
                out.append((n, _exception_kind(n, func) or "", n.args[0] if n.args else None))
    return out


def _is_raised(call: ast.Call, root: ast.AST) -> bool:
    return any(isinstance(n, ast.Raise) and n.exc is call for n in ast.walk(root))


def _walk(node: ast.AST):  # type: ignore[no-untyped-def]
    """ast.walk without descending into nested function or class definitions (they are visited on their own)."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))


def _functions(tree: ast.AST) -> list[list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module with its enclosing functions: [outer, ..., fn]."""
    out = []

    def visit(node: ast.AST, stack: list) -> None:  # type: ignore[type-arg]
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append([*stack, child])
                visit(child, [*stack, child])
            else:
                visit(child, stack)

    visit(tree, [])
    return out


def _bind(fn: ast.FunctionDef, call: ast.Call) -> dict[str, ast.AST]:
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    bound = dict(zip(params, call.args, strict=False))
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    return bound


def _modules(package: Path) -> dict[str, ast.Module]:
    return {
        str(p.relative_to(package.parent)): ast.parse(p.read_text(), filename=str(p))
        for p in sorted(package.rglob("*.py"))
    }


def scan(package: Path = PACKAGE) -> Scan:
    """Read every module under `package` (funcoll/): the message sites, and any that cannot be read."""
    result = Scan()
    modules = _modules(package)
    helpers: dict[str, ast.FunctionDef] = {}
    for tree in modules.values():
        for stack in _functions(tree):
            if stack[-1].name in EXPANDED:
                assert stack[-1].name not in helpers, f"two functions called {stack[-1].name}"
                helpers[stack[-1].name] = stack[-1]  # type: ignore[assignment]
    seen_unreadable: set[tuple[str, str]] = set()

    def emit(node: ast.AST, kind: str, message: ast.AST | None, ctx: _Ctx, where: _Ctx) -> None:
        key = (where.path, where.func)
        if key in EXCLUDED:
            result.excluded.append(f"{where.path}:{node.lineno} ({where.func}): {EXCLUDED[key]}")
            return
        try:
            if message is None:
                raise _Unreadable("no message argument")
            template = _tidy(_render(message, ctx))
        except (_Skip, _Built):
            return
        except _Unreadable as e:
            if key in UNEXTRACTABLE:
                seen_unreadable.add(key)
            else:
                result.problems.append(
                    f"{where.path}:{node.lineno} ({where.func}): cannot read the message of this {kind} "
                    f"({e}); write it so that build_errors.py reads it, or list it in UNEXTRACTABLE with why"
                )
            return
        result.sites.append(Site(where.path, node.lineno, where.func, kind, template, where.op()))

    for path, tree in modules.items():
        for stack in [[], *_functions(tree)]:
            root = stack[-1] if stack else tree
            ctx = _Ctx(path, stack)
            for node, kind, message in _message_sites(root):
                emit(node, kind, message, ctx, ctx)
            for call in (n for n in _walk(root) if isinstance(n, ast.Call)):
                fn = helpers.get(_call_name(call))
                if fn is None or (stack and stack[-1] is fn):
                    continue
                bound = _bind(fn, call)
                env = {p: (bound[p], ctx) for p in EXPANDED[fn.name] if p in bound}
                inner = _Ctx(path, [fn], env)
                for _, kind, message in _message_sites(fn):
                    emit(call, kind, message, inner, ctx)
    for key, why in UNEXTRACTABLE.items():
        if key not in seen_unreadable:
            result.problems.append(
                f"UNEXTRACTABLE lists {key}, which has no unreadable site any more ({why})"
            )
    for key in EXCLUDED:
        if not any(f"{key[0]}:" in e and f"({key[1]})" in e for e in result.excluded):
            result.problems.append(f"EXCLUDED lists {key}, which raises nothing any more")
    return result


def templates() -> dict[str, list[Site]]:
    """Every template, with the sites that produce it."""
    out: dict[str, list[Site]] = defaultdict(list)
    for s in scan().sites:
        out[s.template].append(s)
    return dict(out)


def main() -> int:
    result = scan()
    by_template: dict[str, list[Site]] = defaultdict(list)
    for s in result.sites:
        by_template[s.template].append(s)
    for template, sites in sorted(by_template.items(), key=lambda kv: (kv[1][0].path, kv[1][0].line)):
        kinds = sorted({s.kind for s in sites})
        ops = sorted({s.op.removeprefix("funcoll.") for s in sites if s.op})
        print(f"| `` {template} `` | {', '.join(kinds)} | {', '.join(ops)} |")
        for s in sites:
            print(f"    {s.path}:{s.line} ({s.func})")
    print(f"\n{len(by_template)} templates from {len(result.sites)} sites", file=sys.stderr)
    for p in result.problems:
        print("PROBLEM:", p, file=sys.stderr)
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
