"""Every snippet of README.md and docs/ runs as written, or says in its first line what it needs.

Every ``python`` block of these pages is one of:

- a program whose first line says how to launch it, ``# torchrun --nproc-per-node 2 <file>``:
  it is written to a file and run so, on gloo (the CPU); each rank must print a line
  starting ``rank <r>:`` (README.md, getting-started and the concepts page: the code a
  new user reads first);
- imports only: they are run here;
- a section of a snippet file written out as it is (getting-started's first program,
  which ``tests/test_site.py`` runs and whose output it checks against the page);
- an include of a snippet file or an example (``--8<--``), which ``tests/test_site.py``
  resolves and whose file a test runs;
- a fragment of a larger program, whose first line says what it needs (``# needs: ...``)
  and where there is a whole program.

A block that is none of these fails, so a snippet that stops running, or a new one
that cannot be run as written and does not say why, fails the suite.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from _torchrun import ROOT, torchrun

PAGES = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")))
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LAUNCH = re.compile(r"^# torchrun --nproc-per-node (\d+) (\S+\.py)")
SNIPPETS = ROOT / "docs" / "snippets"


def _sections() -> dict[str, str]:
    """Every ``[start:name]`` section of the snippet files, by ``file:name``."""
    out = {}
    for f in sorted(SNIPPETS.glob("*.py")):
        text = f.read_text()
        for name in re.findall(r"\[start:(\w+)\]", text):
            out[f"{f.name}:{name}"] = text.split(f"[start:{name}]\n", 1)[1].split("# --8<-- [end:", 1)[0]
    return out


def _blocks() -> list[tuple[str, str]]:
    """(id, code) of every python block of the pages."""
    blocks = []
    for page in PAGES:
        for i, code in enumerate(BLOCK.findall((ROOT / page).read_text())):
            blocks.append((f"{page}#{i}", code))
    return blocks


BLOCKS = _blocks()
PROGRAMS = [(bid, code) for bid, code in BLOCKS if LAUNCH.match(code)]


@pytest.mark.parametrize(("bid", "code"), BLOCKS, ids=[b for b, _ in BLOCKS])
def test_every_block_runs_or_says_what_it_needs(bid: str, code: str) -> None:
    if (
        LAUNCH.match(code)
        or code.startswith("--8<-- ")
        or code.strip() in {v.strip() for v in _sections().values()}
    ):
        return
    if code.startswith("# needs: "):
        assert len(code.splitlines()) > 1, f"{bid}: a `# needs:` line and no code"
        return
    tree = ast.parse(code)
    assert all(isinstance(node, ast.Import | ast.ImportFrom) for node in tree.body), (
        f"{bid}: neither a program (first line `# torchrun --nproc-per-node 2 <file>.py`), imports, a "
        f"snippet file's section written out as it is, an include, nor a fragment whose first line "
        f"says what it needs (`# needs: ...`):\n{code}"
    )
    exec(compile(tree, bid, "exec"), {})  # imports only: they run here


def test_the_pages_launch_programs() -> None:
    assert len(PROGRAMS) >= 4, [b for b, _ in PROGRAMS]


@pytest.mark.parametrize(("bid", "code"), PROGRAMS, ids=[b for b, _ in PROGRAMS])
def test_program_runs_as_written_under_torchrun(bid: str, code: str, tmp_path: Path) -> None:
    nproc, name = LAUNCH.match(code).groups()  # type: ignore[union-attr]
    path = tmp_path / name
    path.write_text(code)
    out, err = torchrun([str(path)], nproc=int(nproc), timeout=240)
    # a clean run warns of nothing: no torch or funcoll warning, no result left unwaited at exit
    assert "Warning" not in err and "unwaited" not in err, err[-3000:]
    # print writes a line's text and its newline apart: unbuffered ranks may cut each other's lines
    assert sorted(re.findall(r"rank (\d+):", out)) == [str(r) for r in range(int(nproc))], out
    # a training loop prints its weights: data parallel, every rank ends with the same
    weights = re.findall(r"weights (-?[\d.]+)", out)
    assert len(set(weights)) <= 1 and len(weights) in (0, int(nproc)), out
