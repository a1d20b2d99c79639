"""Every worked multi-rank example in funcoll's public docstrings runs and holds, as JAX's doctests do.

The examples are read from the live docstrings (``inspect.getdoc``) of every name in
``funcoll.__all__`` and ``funcoll.compat.__all__``: each ``Example (2 ranks...)::`` block,
and the one-sentence form ``Example: on 2 ranks, ``expr`` is V on rank 0 and W on rank 1.``
(``... is V on both.``). Every line of a block is one of:

* inputs: ``# rank 0: x = [[1, 2]]    rank 1: x = [[3, 4]]`` (several names per rank, one
  rank per line, ``# both: x = ...``, ``# rank r: inp = [r, r]; ...``, an unnamed value
  bound to the first argument of the next call, ``x of shape (2, 3)``); Python literals
  become tensors with ``torch.tensor`` (ints int64, any float float32), bare numbers stay
  Python numbers;
* a call, with its results after ``#`` on the same line or on the comment lines after it
  (``# rank 0: R0    rank 1: R1``, ``# both: R``, ``# rank 0: y = ..., recv_sizes = ...``
  for the names the call assigns, ``# both: out == ...`` for a tensor written in place,
  ``..., shape (2, 1, 2)``, ``None``, tuples and lists of tensors, ``rank 0's (2, 3)`` for
  that rank's input of that shape);
* errors: ``# both ranks: ValueError: message ...`` after a call, and
  ``# rank 0: x of shape (2, 1), rank 1: (1, 2): ValueError on both`` (new inputs for the
  previous call, which must raise that error on every rank);
* backward: ``# backward with grad G: rank 0 x.grad = ..., rank 1 ...``: the named inputs
  are made float leaves that require grad before the call, the call's result is
  backpropagated with G (a scalar G on every rank fills the result's shape) and every
  stated ``x.grad`` is compared.

Any other line must be listed in ``SKIPPED`` with the reason it is not checked; a new
line that is neither parsed nor listed fails ``test_every_example_line_is_checked_or_listed``.
All examples run in one ``run_ranks`` call on 2 gloo ranks, with ``funcoll.set_checks(True)``
as everywhere in this suite (tests/conftest.py); each rank returns what every call
returned, raised and left in its variables, and one test per example compares it with
what the docstring states, on every rank.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
import torch
from _inputs import once_per_world
from torch import Tensor

import funcoll
import funcoll.compat
import funcoll.lax

WORLD = 2
TIMEOUT_S = 60.0
# example id prefix -> module; funcoll.lax's examples run with `mesh` (one axis, "i") bound
OWNERS: dict[str, ModuleType] = {"": funcoll, "compat.": funcoll.compat, "lax.": funcoll.lax}

# (example id, line as written) -> why the line is not checked
SKIPPED: dict[tuple[str, str], str] = {
    (
        "all_to_all",
        "# 3 heads on 2 ranks, back from heads to sequence (scatter_dim=0, gather_dim=1):",
    ): "narrative: introduces the next inputs, states no value",
    (
        "all_to_all",
        "# a sequence of 3 on 2 ranks, to heads (scatter_dim=1, gather_dim=0):",
    ): "narrative: introduces the next inputs, states no value",
    (
        "set_checks",
        "# (unchecked, gloo aborts the process; NCCL hangs)",
    ): "an aborting rank cannot be run inside the shared batch (and NCCL needs GPUs)",
}

# Names the examples use without defining them.
FREE_NAMES: dict[str, Any] = {}

# (example id, input name) -> dtype the op needs, overriding the literal's dtype
DTYPES: dict[tuple[str, str], torch.dtype] = {}

_WHO = re.compile(r"(?<![\w'])(?:rank (\d+|r)|(both ranks|both)):\s*")
_BACKWARD_WHO = re.compile(r"(?<![\w'])rank (\d+):?\s+")
_ERROR = re.compile(r"^([A-Z]\w*Error)(?::\s*(.*))?$")
# `inputs: XError on both (why)`: the words in parentheses explain; they are not matched to the message
_ERROR_INPUTS = re.compile(r"^(.*?):\s*([A-Z]\w*Error) on both(?:\s*\(([^()]*)\))?$")
_BACKWARD = re.compile(r"^backward with grad (.+?)( on every rank)?:\s*(.+)$")
_SHAPE = re.compile(r"^(?:(\w+) of )?(shape )?(\([\d,\s]*\))$")
_WITH_SHAPE = re.compile(r"^(.*),\s*shape (\([\d,\s]*\))$")
_PAREN_BINDINGS = re.compile(r"^(.*?)\s+\((\w+\s*=.*)\)$")
_ASSIGN = re.compile(r"^([A-Za-z_]\w*)\s*(==|=)(?!=)\s*(.*)$")
_RANKS_INPUT = re.compile(r"rank (\d+)'s (\([\d,\s]*\))")
_HEADER = re.compile(r"^Example \(2 ranks(?:,[^)]*)?\)::$")
_SENTENCE = re.compile(r"^Example: on 2 ranks, ``([^`]+)`` is (.+)\.$", re.M)


# ------------------------------------------------------------------------------ the plan
@dataclass
class Bind:
    """Values bound on each rank before the next call (a name of None: the call's first argument)."""

    line: str
    values: list[dict[str | None, Any]]


@dataclass
class Call:
    code: str
    targets: tuple[str, ...] = ()
    grad_names: tuple[str, ...] = ()
    grad: Any = None  # the backward gradient (a tensor, or a float filling the result's shape)


@dataclass
class Check:
    """What one example line states about one call on one rank."""

    line: str
    call: int  # index of the Call in the plan's steps
    rank: int
    kind: str  # "return", "var", "grad" or "error"
    name: str = ""  # the variable for "var" and "grad"
    expected: Any = None  # a value, or (error type, message prefix or None) for "error"
    shape: tuple[int, ...] | None = None


@dataclass
class Example:
    id: str
    lines: list[str]
    steps: list[Bind | Call] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    unparsed: dict[str, str] = field(default_factory=dict)  # line -> why it could not be parsed
    skipped: list[str] = field(default_factory=list)
    checked_lines: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- parsing
def _depths(text: str) -> list[int]:
    """Bracket depth before each character; inside brackets a quoted string counts as one more level
    (outside them a quote is an apostrophe: ``rank 1's``)."""
    out, depth, quote = [], 0, ""
    for ch in text:
        out.append(depth + bool(quote))
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"" and depth > 0:
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
    return out


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment text) of a line: the comment is what follows a ``#`` outside strings."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def _who_segments(text: str, who: re.Pattern[str] = _WHO) -> list[tuple[str, str]] | None:
    """``rank 0: A   rank 1: B`` -> [("0", "A"), ("1", "B")]; None unless `text` starts with one."""
    depth = _depths(text)
    marks = [m for m in who.finditer(text) if depth[m.start()] == 0]
    if not marks or text[: marks[0].start()].strip():
        return None
    out = []
    for m, nxt in zip(marks, [*marks[1:], None], strict=True):
        body = text[m.end() : nxt.start() if nxt else len(text)].strip().rstrip(",").strip()
        out.append((m.group(1) or "both", body))
    return out


def _split_top(text: str, seps: str = ",;") -> list[str]:
    depth = _depths(text)
    parts, start = [], 0
    for i, ch in enumerate(text):
        if ch in seps and depth[i] == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _assignments(text: str) -> list[tuple[str, str, str]] | None:
    """``a = 1, b == [2, 3]`` -> [("a", "=", "1"), ("b", "==", "[2, 3]")]; None if not that form."""
    out: list[list[str]] = []
    for part in _split_top(text):
        m = _ASSIGN.match(part)
        if m:
            out.append([m.group(1), m.group(2), m.group(3)])
        elif out:  # a top-level comma inside one value
            out[-1][2] += ", " + part
        else:
            return None
    return [(n, op, v.strip()) for n, op, v in out]


def _without_note(text: str) -> str:
    """``[1, 2]   (the padding never shows)`` -> ``[1, 2]``: a trailing parenthesis of words is a note."""
    m = re.match(r"^(.*\S)\s{2,}\((.*)\)$", text)
    if m is None:
        return text
    try:
        ast.parse(m.group(2), mode="eval")
    except SyntaxError:
        return m.group(1)
    return text


def _ranks(who: str) -> list[int]:
    return list(range(WORLD)) if who in ("both", "both ranks", "r") else [int(who)]


class _Parser:
    def __init__(self, ex: Example) -> None:
        self.ex = ex
        self.state: list[dict[str, Any]] = [{} for _ in range(WORLD)]  # inputs per rank, as parsed
        self.last_call: int | None = None
        self.awaiting = False  # the last call's results may follow on the next comment lines
        self.keywords: dict[str, Any] = {}  # `(k=v)` after inputs: the next call passes k=v

    # values ----------------------------------------------------------------------
    def value(self, text: str, rank: int) -> Any:
        def rank_input(k: int, shape: tuple[int, ...]) -> Tensor:
            found = [v for v in self.state[k].values() if isinstance(v, Tensor) and tuple(v.shape) == shape]
            if len(found) != 1:
                raise ValueError(f"rank {k} has {len(found)} inputs of shape {shape}")
            return found[0]

        text = _RANKS_INPUT.sub(r"__rank_input__(\1, \2)", text)
        names = {"tensor": torch.tensor, "torch": torch, "r": rank, "__rank_input__": rank_input}
        return eval(text, {"__builtins__": {"float": float, "int": int}}, names)

    def input_value(self, name: str | None, text: str, rank: int) -> Any:
        shape = _SHAPE.match(text)
        if shape and (shape.group(1) or shape.group(2)):
            dims = ast.literal_eval(shape.group(3))
            dims = dims if isinstance(dims, tuple) else (dims,)
            v: Any = torch.arange(math.prod(dims), dtype=torch.float32).reshape(dims) + 100 * rank
        else:
            v = self.value(text, rank)
            if isinstance(v, list | tuple):
                v = torch.tensor(v)
        dtype = DTYPES.get((self.ex.id, name or ""))
        return v.to(dtype) if dtype is not None and isinstance(v, Tensor) else v

    # lines -------------------------------------------------------------------------
    def inputs(self, line: str, segments: list[tuple[str, str]]) -> None:
        values: list[dict[str | None, Any]] = [{} for _ in range(WORLD)]
        shape_name: str | None = None
        for who, text in segments:
            paren = _PAREN_BINDINGS.match(text)
            if paren and (keywords := _assignments(paren.group(2))):
                text = paren.group(1).strip()
                self.keywords.update({k: ast.literal_eval(v) for k, _, v in keywords})
            shape = _SHAPE.match(text)
            if shape and (shape.group(1) or shape.group(2) or shape_name is not None):
                shape_name = shape.group(1) or shape_name or ""
                if not (shape.group(1) or shape.group(2)):  # `rank 1: (1, 2)` after `x of shape (2, 1)`
                    text = f"shape {text}"
                pairs = [(shape_name or None, text)]
            elif (assigns := _assignments(text)) is not None:
                if any(op != "=" for _, op, _ in assigns):
                    raise ValueError("`==` in an input line")
                pairs = [(n, v) for n, _, v in assigns]
            else:
                pairs = [(None, text)]
            for rank in _ranks(who):
                for name, text_ in pairs:
                    values[rank][name] = self.input_value(name, text_, rank)
        if any(None in v for v in values) and not all(None in v for v in values):
            raise ValueError("an unnamed input on some ranks only")
        self.ex.steps.append(Bind(line, values))
        for rank in range(WORLD):
            self.state[rank].update({k: v for k, v in values[rank].items() if k is not None})
        self.awaiting = False

    def call(self, code: str) -> None:
        tree = ast.parse(code)
        targets: tuple[str, ...] = ()
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assign):
            t = tree.body[0].targets[0]
            elts = t.elts if isinstance(t, ast.Tuple) else [t]
            targets = tuple(e.id for e in elts if isinstance(e, ast.Name))
        passed = {
            k.arg: ast.literal_eval(k.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            for k in n.keywords
            if k.arg and isinstance(k.value, ast.Constant | ast.List | ast.Tuple)
        }
        for k, v in self.keywords.items():
            if passed.get(k, ...) != v:
                raise ValueError(f"the inputs say ({k}={v!r}), the call passes {passed.get(k, 'none')}")
        self.keywords = {}
        pending = [s for s in self.ex.steps if isinstance(s, Bind) and None in s.values[0]]
        if pending:  # an unnamed input is the first positional argument of this call
            first = [
                n.args[0].id
                for n in ast.walk(tree)
                if isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Name)
            ]
            if not first:
                raise ValueError("an unnamed input, and the call has no first argument to bind it to")
            for step in pending:
                for rank, vals in enumerate(step.values):
                    v = vals.pop(None)
                    dtype = DTYPES.get((self.ex.id, first[0]))
                    vals[first[0]] = v.to(dtype) if dtype is not None and isinstance(v, Tensor) else v
                    self.state[rank][first[0]] = vals[first[0]]
        self.ex.steps.append(Call(code, targets))
        self.last_call = len(self.ex.steps) - 1
        self.awaiting = True

    def results(self, line: str, segments: list[tuple[str, str]]) -> None:
        """Result segments of the last call: values, assigned names, ``name == v``, errors."""
        if self.last_call is None:
            raise ValueError("a result before any call")
        call = self.ex.steps[self.last_call]
        assert isinstance(call, Call)
        for who, text in segments:
            for rank in _ranks(who):
                self.ex.checks.extend(self.result_checks(line, call, rank, text))

    def result_checks(self, line: str, call: Call, rank: int, text: str) -> list[Check]:
        assert self.last_call is not None
        text = _without_note(text)
        base = {"line": line, "call": self.last_call, "rank": rank}
        if err := _ERROR.match(text):
            message = err.group(2)
            if message is not None and message.endswith("..."):
                message = message[:-3].rstrip()
            return [Check(**base, kind="error", expected=(err.group(1), message))]
        assigns = _assignments(text)
        if assigns is not None:
            out = []
            for name, op, value in assigns:
                if op == "=" and name not in call.targets:
                    raise ValueError(f"`{name} = ...` states a name the call does not assign")
                expected, shape = self.expected(value, rank)
                out.append(Check(**base, kind="var", name=name, expected=expected, shape=shape))
            return out
        expected, shape = self.expected(text, rank)
        return [Check(**base, kind="return", expected=expected, shape=shape)]

    def expected(self, text: str, rank: int) -> tuple[Any, tuple[int, ...] | None]:
        m = _WITH_SHAPE.match(text)
        if m:
            return self.value(m.group(1), rank), tuple(ast.literal_eval(m.group(2)))
        return self.value(text, rank), None

    def backward(self, line: str, m: re.Match[str]) -> None:
        if self.last_call is None:
            raise ValueError("a backward line before any call")
        call = self.ex.steps[self.last_call]
        assert isinstance(call, Call)
        grad = self.value(m.group(1), 0)
        call.grad = torch.tensor(grad, dtype=torch.float32) if isinstance(grad, list) else grad
        segments = _who_segments(m.group(3), _BACKWARD_WHO) or [("both", m.group(3))]
        name = ""
        for who, text in segments:
            g = re.match(r"^(\w+)\.grad\s*=\s*(.*)$", text)
            name, value = (g.group(1), g.group(2)) if g else (name, text)
            if not name:
                raise ValueError("a gradient without the name of its input")
            call.grad_names = tuple(dict.fromkeys([*call.grad_names, name]))
            for rank in _ranks(who):
                self.ex.checks.append(
                    Check(line, self.last_call, rank, "grad", name, self.value(value, rank))
                )

    def line(self, line: str) -> None:
        code, comment = _split_comment(line)
        if code:
            self.call(code)
            if comment:
                segments = _who_segments(comment)
                if segments is None:
                    raise ValueError("a comment after a call that is not `# both: ...` or `# rank 0: ...`")
                self.results(line, segments)
                self.awaiting = False
            return
        if m := _BACKWARD.match(comment):
            return self.backward(line, m)
        if m := _ERROR_INPUTS.match(comment):  # new inputs for the previous call, which raises
            segments = _who_segments(m.group(1))
            if segments is None or self.last_call is None:
                raise ValueError("an error line without inputs or a previous call")
            self.inputs(line, segments)
            previous = self.ex.steps[self.last_call]
            assert isinstance(previous, Call)
            self.call(previous.code)
            self.results(line, [("both", m.group(2))])
            self.awaiting = False
            return
        segments = _who_segments(comment)
        if segments is None:
            raise ValueError("not an input, call, result, error or backward line")
        if self.awaiting and self.is_result(segments):
            return self.results(line, segments)
        self.inputs(line, segments)

    def is_result(self, segments: list[tuple[str, str]]) -> bool:
        assert self.last_call is not None
        call = self.ex.steps[self.last_call]
        assert isinstance(call, Call)
        for _, text in segments:
            assigns = _assignments(text)
            if assigns is not None and any(op == "=" and n not in call.targets for n, op, _ in assigns):
                return False
        return True


def parse(ex_id: str, lines: list[str]) -> Example:
    ex = Example(ex_id, lines)
    parser = _Parser(ex)
    i = 0
    while i < len(lines):
        line, j = lines[i], i + 1
        if line.rstrip().endswith(":") and not line.lstrip().startswith("#"):  # a compound statement
            while j < len(lines) and lines[j].startswith((" ", "\t")):
                j += 1
        text = "\n".join(lines[i:j])
        i = j
        if not text.strip():
            continue
        if (ex_id, text.strip()) in SKIPPED:
            ex.skipped.append(text.strip())
            continue
        before = len(ex.checks)
        try:
            parser.line(text)
        except Exception as e:  # noqa: BLE001 -- an unparsable line is reported by a test, not at import
            ex.unparsed[text] = f"{type(e).__name__}: {e}"
            continue
        if len(ex.checks) > before:
            ex.checked_lines.append(text)
    for k, step in enumerate(ex.steps):  # an input no later call reads may be a misread result
        if isinstance(step, Bind):
            later = {
                n.id
                for s in ex.steps[k + 1 :]
                if isinstance(s, Call)
                for n in ast.walk(ast.parse(s.code))
                if isinstance(n, ast.Name)
            }
            unused = sorted({n for v in step.values for n in v} - later, key=str)
            if unused:
                ex.unparsed[step.line] = f"binds {unused}, which no later call reads"
    if parser.keywords:
        ex.unparsed[lines[-1]] = f"no call after the inputs' ({parser.keywords})"
    return ex


def blocks(doc: str) -> list[list[str]]:
    """The dedented lines of every ``Example (2 ranks...)::`` block and ``Example: on 2 ranks`` sentence."""
    out: list[list[str]] = []
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if not _HEADER.match(line.strip()):
            continue
        body: list[str] = []
        for nxt in lines[i + 1 :]:
            if nxt.strip() and not nxt.startswith("    "):
                break
            body.append(nxt[4:])
        while body and not body[-1].strip():
            body.pop()
        out.append([b for b in body if b.strip()])
    for m in _SENTENCE.finditer(doc):
        every = re.fullmatch(r"(\S+) on rank 0 and (\S+) on rank 1", m.group(2))
        both = re.fullmatch(r"(\S+) on both", m.group(2))
        if every:
            out.append([f"{m.group(1)}  # rank 0: {every.group(1)}  rank 1: {every.group(2)}"])
        elif both:
            out.append([f"{m.group(1)}  # both: {both.group(1)}"])
        else:
            out.append([m.group(0)])  # reported as unparsed
    return out


def public_docs() -> dict[str, str]:
    """id -> docstring, for every public name of funcoll and funcoll.compat."""
    return {
        prefix + name: inspect.getdoc(getattr(module, name)) or ""
        for prefix, module in OWNERS.items()
        for name in module.__all__
    }


def collect() -> dict[str, Example]:
    out: dict[str, Example] = {}
    for ex_id, doc in public_docs().items():
        for k, lines in enumerate(blocks(doc)):
            key = ex_id if k == 0 else f"{ex_id}#{k + 1}"
            out[key] = parse(ex_id, lines)
    return out


EXAMPLES = collect()


# ------------------------------------------------------------------------------ ranks
def _detached(v: Any) -> Any:
    if type(v).__name__ == "DTensor":  # an example states a DTensor's local shard on each rank
        return v.to_local().detach().clone()
    if isinstance(v, Tensor):
        return v.detach().clone()
    if isinstance(v, list | tuple):
        return type(v)(_detached(e) for e in v)
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return repr(v)


def _namespace(ex_id: str) -> dict[str, Any]:
    """The names a call line sees: its module's public names (compat's own for compat examples)."""
    prefix = max((p for p in OWNERS if ex_id.startswith(p)), key=len)
    module = OWNERS[prefix]
    return {
        **{n: getattr(module, n) for n in module.__all__},
        "funcoll": funcoll,
        "torch": torch,
        "mesh": _mesh(),
        **FREE_NAMES,
    }


@functools.cache
def _mesh() -> Any:
    """The 1-D DeviceMesh over the example's ranks that DTensor examples pass as ``group=mesh``;
    its axis is called "i" for funcoll.lax and shard_map."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("i",))


def run_example(rank: int, ex: Example) -> list[dict[str, Any]]:
    """Run every step of `ex` on this rank: one record per step (empty for a Bind)."""
    env: dict[str, Any] = {}
    base = _namespace(ex.id)
    records: list[dict[str, Any]] = []
    for step in ex.steps:
        if isinstance(step, Bind):
            env.update({k: v.clone() if isinstance(v, Tensor) else v for k, v in step.values[rank].items()})
            records.append({})
            continue
        rec: dict[str, Any] = {"return": None, "error": None, "grads": {}}
        try:
            for name in step.grad_names:
                v = env[name].detach()
                env[name] = (v if v.is_floating_point() else v.to(torch.float32)).requires_grad_()
            ns = {**base, **env}
            tree = ast.parse(step.code)
            if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
                rec["return"] = eval(step.code, ns)
            else:
                exec(step.code, ns)
            env.update({n: ns[n] for n in step.targets})
            if step.grad is not None:
                out = rec["return"]
                g = step.grad if isinstance(step.grad, Tensor) else torch.full_like(out, float(step.grad))
                out.backward(g.to(out.dtype))
                rec["grads"] = {n: _detached(env[n].grad) for n in step.grad_names}
        except Exception as e:  # noqa: BLE001 -- the parent compares it with the stated error
            rec["error"] = (type(e).__name__, str(e))
        rec["return"] = _detached(rec["return"])
        rec["vars"] = {n: _detached(v) for n, v in env.items()}
        records.append(rec)
    return records


def run_all(rank: int, world: int) -> dict[str, list[dict[str, Any]]]:
    assert world == WORLD
    out = {}
    with funcoll.set_checks(True):  # as tests/conftest.py sets it for every test
        for ex_id, ex in EXAMPLES.items():
            if ex_id.startswith("lax."):  # funcoll.lax names the axis; bind the mesh that has it
                with funcoll.lax.mesh(_mesh()):
                    out[ex_id] = run_example(rank, ex)
            else:
                out[ex_id] = run_example(rank, ex)
    return out


batch = once_per_world(run_all, TIMEOUT_S)


# ---------------------------------------------------------------------------- checking
def _compare(actual: Any, expected: Any, shape: tuple[int, ...] | None = None) -> str | None:
    """None when `actual` is what the example states, else what differs."""
    if shape is not None and (not isinstance(actual, Tensor) or tuple(actual.shape) != shape):
        return f"expected shape {shape}, got {getattr(actual, 'shape', type(actual).__name__)}"
    if expected is None:
        return None if actual is None else f"expected None, got {actual!r}"
    if isinstance(expected, tuple) or (
        isinstance(expected, list) and expected and all(isinstance(e, Tensor) for e in expected)
    ):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            return f"expected a {type(expected).__name__} of {len(expected)}, got {actual!r}"
        for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
            if (why := _compare(a, e)) is not None:
                return f"element {k}: {why}"
        return None
    if isinstance(actual, list) and all(type(a) is int for a in actual):  # host ints, e.g. sizes
        actual = torch.tensor(actual, dtype=torch.int64)
    if isinstance(expected, bool | int | float) and not isinstance(actual, Tensor):
        ok = type(actual) in (int, float, bool) and math.isclose(actual, expected, rel_tol=1e-6)
        return None if ok else f"expected {expected!r}, got {actual!r}"
    if not isinstance(actual, Tensor):
        return f"expected a tensor {expected!r}, got {actual!r}"
    want = expected if isinstance(expected, Tensor) else torch.tensor(expected)
    if actual.shape != want.shape:
        return f"expected {want.tolist()} (shape {tuple(want.shape)}), got {actual.tolist()} (shape {tuple(actual.shape)})"
    if not torch.allclose(actual.double(), want.double(), rtol=1e-5, atol=1e-6):
        return f"expected {want.tolist()}, got {actual.tolist()}"
    return None


def failures(ex: Example, per_rank: list[list[dict[str, Any]]]) -> list[str]:
    """What the ranks did that `ex` does not state: wrong values, missing or unexpected errors."""
    out: list[str] = []
    if [len(r) for r in per_rank] != [len(ex.steps)] * WORLD:
        return [f"the ranks ran {[len(r) for r in per_rank]} steps, the example has {len(ex.steps)}"]
    raises = {(c.call, c.rank) for c in ex.checks if c.kind == "error"}
    for k, step in enumerate(ex.steps):
        for rank in range(WORLD):
            err = per_rank[rank][k].get("error")
            if isinstance(step, Call) and err is not None and (k, rank) not in raises:
                out.append(f"{step.code!r}: rank {rank} raised {err[0]}: {err[1]}")
    for c in ex.checks:
        rec = per_rank[c.rank][c.call]
        where = f"line {c.line!r}, rank {c.rank}"
        if c.kind == "error":
            kind, message = c.expected
            got = rec["error"]
            if got is None:
                out.append(f"{where}: expected {kind}, nothing raised")
            elif got[0] != kind or (message is not None and not got[1].startswith(message)):
                out.append(f"{where}: expected {kind}: {message}, got {got[0]}: {got[1]}")
            continue
        if rec["error"] is not None:
            continue  # reported above
        if c.kind == "return":
            actual = rec["return"]
        elif c.kind == "var":
            actual = rec["vars"].get(c.name)
        else:
            actual = rec["grads"].get(c.name)
        if (why := _compare(actual, c.expected, c.shape)) is not None:
            label = {"return": "", "var": f"{c.name}: ", "grad": f"{c.name}.grad: "}[c.kind]
            out.append(f"{where}: {label}{why}")
    return out


# ------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("ex_id", sorted(EXAMPLES))
def test_docstring_example_holds_on_every_rank(ex_id: str) -> None:
    ex = EXAMPLES[ex_id]
    assert ex.checks, f"{ex_id}: the example states nothing that is checked"
    results = batch(WORLD)
    problems = failures(ex, [results[r][ex_id] for r in range(WORLD)])
    assert not problems, f"{ex_id}:\n" + "\n".join(problems)


@pytest.mark.parametrize("ex_id", sorted(EXAMPLES))
def test_every_example_line_is_checked_or_listed(ex_id: str) -> None:
    ex = EXAMPLES[ex_id]
    assert not ex.unparsed, (
        f"{ex_id}: lines neither parsed nor listed in SKIPPED (parse them, or list them with a reason):\n"
        + "\n".join(f"  {line!r}: {why}" for line, why in ex.unparsed.items())
    )


def test_skip_list_names_only_lines_that_exist() -> None:
    present = {(ex.id, line) for ex in EXAMPLES.values() for line in ex.skipped}
    stale = set(SKIPPED) - present
    assert not stale, f"SKIPPED lists lines no example has any more: {sorted(stale)}"
    assert all(reason.strip() for reason in SKIPPED.values())


def test_every_public_multi_rank_example_is_covered() -> None:
    docs = public_docs()
    for ex_id, doc in docs.items():
        n = doc.count("Example (2 ranks") + doc.count("Example: on 2 ranks")
        found = [k for k in EXAMPLES if k.split("#")[0] == ex_id]
        assert len(found) == n, f"{ex_id}: {n} multi-rank examples in its docstring, {len(found)} collected"
        for k in found:
            assert EXAMPLES[k].checks, f"{k}: nothing checked"
    # the examples the docs are known to hold, so that a broken collector cannot pass by finding none
    assert {"all_gather", "all_to_all_padded", "gather", "set_checks", "axis_index"} <= set(EXAMPLES)
    assert {"compat.all_gather", "compat.all_gather_into_tensor", "compat.gather"} <= set(EXAMPLES)


# A stated value changed in a copy of a docstring must fail against what the ranks did.
MUTATIONS: dict[str, tuple[str, str, str]] = {
    "value": ("all_reduce", "# both: [4., 6.]", "# both: [4., 7.]"),
    "shape": ("all_gather", "shape (2, 1, 2)", "shape (1, 2, 2)"),
    "assigned-name": ("all_to_all_padded", "recv_sizes = [1, 2]", "recv_sizes = [2, 1]"),
    "none": ("gather", "# rank 0: None   rank 1:", "# rank 0: [[1, 2]]   rank 1:"),
    "error-kind": ("gather", "ValueError on both", "TypeError on both"),
    "error-message": ("set_checks", "ranks disagree on the shape", "ranks disagree on the dtype"),
    "gradient": ("gather_forward_split_backward", "rank 1 [30.]", "rank 1 [20.]"),
    "compat-in-place": ("compat.all_gather_into_tensor", "[[0., 0.], [1., 1.]]", "[[0., 0.], [1., 2.]]"),
    "sentence": ("axis_index", "rank 1: 1", "rank 1: 0"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_stated_value_fails(mutation: str) -> None:
    ex_id, old, new = MUTATIONS[mutation]
    ex = EXAMPLES[ex_id]
    hits = [k for k, line in enumerate(ex.lines) if old in line]
    assert len(hits) == 1, f"{old!r} is in {len(hits)} lines of {ex_id}'s example"
    lines = list(ex.lines)
    lines[hits[0]] = lines[hits[0]].replace(old, new)
    mutated = parse(ex_id, lines)
    assert [getattr(s, "code", None) for s in mutated.steps] == [getattr(s, "code", None) for s in ex.steps]
    results = batch(WORLD)
    per_rank = [results[r][ex_id] for r in range(WORLD)]
    assert not failures(ex, per_rank)
    assert failures(mutated, per_rank), f"{ex_id} with {new!r} for {old!r} still passes"


# A line the parser cannot read, or reads as an input that no call uses, must be reported.
UNREADABLE: dict[str, tuple[str, str, str]] = {
    "new-prose-line": (
        "all_reduce",
        'all_reduce(x, op="max")       # both: [3., 4.]',
        "# and the min is below",
    ),
    "stated-keyword-differs": (
        "all_to_all",
        "[[3], [7]]   (gather_sizes=[2, 1])",
        "[[3], [7]]   (gather_sizes=[1, 2])",
    ),
    "result-read-as-input": (
        "broadcast",
        "broadcast(x, src=0)           # both: [1., 2.]",
        "# both: z = [1.]",
    ),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_an_unchecked_line_is_reported(case: str) -> None:
    ex_id, old, new = UNREADABLE[case]
    lines = list(EXAMPLES[ex_id].lines)
    hits = [k for k, line in enumerate(lines) if old in line]
    assert len(hits) == 1, f"{old!r} is in {len(hits)} lines of {ex_id}'s example"
    if old == lines[hits[0]]:  # a whole line: the new one follows it
        lines.insert(hits[0] + 1, new)
    else:
        lines[hits[0]] = lines[hits[0]].replace(old, new)
    assert parse(ex_id, lines).unparsed, f"{ex_id}: {new!r} was taken as checked"
