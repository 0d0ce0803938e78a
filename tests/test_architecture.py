"""docs/architecture.md against the code: the folders' import graph has no cycle, and what a
new per-step or stateful check touches is what the checks of each kind touch today."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import guard
from guard.checks import CHECKS
from guard.stateful import STATEFUL

GUARD = Path(guard.__file__).parent
ROOT = GUARD.parent
DOC = ROOT / "docs/architecture.md"
NUMBERS = {"five": 5, "six": 6, "seven": 7, "eight": 8}


def library_files() -> list[Path]:
    return sorted([*GUARD.rglob("*.py"), *(ROOT / "server/guard_server").rglob("*.py")])


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and n.body and isinstance(n.body[0], ast.Expr) \
                and isinstance(n.body[0].value, ast.Constant):
            out.add(id(n.body[0].value))
    return out


def names_in_code(path: Path, name: str) -> bool:
    """`path` names the check `name` in its code (not in a docstring or a comment): as a
    string ("untrained_rows", "untrained_rows.input"), an identifier or attribute, or its
    module (`from guard.checks import untrained_rows`)."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs \
                and re.fullmatch(rf"{name}([.:].*)?", n.value):
            return True
        if (isinstance(n, ast.Name) and n.id == name) or \
                (isinstance(n, ast.Attribute) and n.attr == name) or \
                (isinstance(n, ast.alias) and n.name.split(".")[-1] == name) or \
                (isinstance(n, ast.ImportFrom) and (n.module or "").endswith(f".{name}")):
            return True
    return False


def touched(name: str) -> set[str]:
    return {str(p.relative_to(ROOT)) for p in library_files() if names_in_code(p, name)}


def documented() -> tuple[list[str], list[str], str]:
    """The per-step list, the stateful list (its own lines) and the text of the extras."""
    text = DOC.read_text()
    step = text.split("### A per-step check:", 1)[1].split("###", 1)[0]
    stateful = text.split("### A stateful check:", 1)[1].split("###", 1)[0]
    extras = text.split("### Besides, where a check has them", 1)[1]

    def paths(section: str) -> list[str]:
        return re.findall(r"^- `([^`]+)`", section, re.M)

    return paths(step), paths(stateful), extras


def matches(pattern: str, files: set[str], name: str) -> set[str]:
    """The files a documented path stands for: `<name>` is the check's, `<module>` one file."""
    rx = re.escape(pattern.replace("<name>", name)).replace(re.escape("<module>"), r"\w+")
    found = {f for f in files if re.fullmatch(rx, f)}
    assert "<module>" in pattern or len(found) <= 1
    return found


def assert_touches_what_the_doc_says(name: str, kinds: list[str], extras: str) -> None:
    files = touched(name)
    for pattern in kinds:
        hit = matches(pattern, files, name)
        assert len(hit) == 1, f"{name} should touch one file {pattern}, touches {sorted(hit)}"
        files -= hit
    # What is left are the extras the doc names (figures on the wire, the offline audit).
    assert all(f"`{f}`" in extras for f in files), sorted(files)


def test_the_folders_import_no_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for path in GUARD.rglob("*.py"):
        part = path.relative_to(GUARD).parts
        src = part[0] if len(part) > 1 else part[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for m in mods:
                if m.startswith("guard.") and (dst := m.split(".")[1]) != src:
                    edges.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n}))
                   for n in edges.get(a, ()))

    cycles = sorted(f for f in edges if reaches(f, f, set()))
    assert cycles == [], cycles
    assert "device" not in edges.get("vocab", set()) and "vocab" not in edges.get("policy", set())
    # A weight's rows are read by the device code and the states, never the other way; the
    # untrusted-file readers stand on the leaves alone (no torch: test_room.py).
    assert not {"device", "step", "stateful", "policy"} & edges.get("weights", set())
    assert edges.get("checkpoint", set()) <= {"constants", "errors", "quote"}


def test_a_per_step_check_touches_the_documented_files() -> None:
    step, _, extras = documented()
    assert len(step) == 5
    assert_touches_what_the_doc_says("loss_spike", step, extras)


def test_a_stateful_check_touches_the_documented_files() -> None:
    step, stateful, extras = documented()
    assert_touches_what_the_doc_says("untrained_rows", [*step, *stateful], extras)


@pytest.mark.parametrize("spec", CHECKS, ids=lambda s: s.name)
def test_every_check_is_registered_where_the_doc_says(spec: object) -> None:
    step, stateful, _ = documented()
    name = getattr(spec, "check")  # noqa: B009 - a Spec
    kinds = [*step, *stateful] if name in STATEFUL else step
    files = touched(name)
    for pattern in kinds:
        if "<module>" not in pattern:
            assert matches(pattern, files, name), f"{name}: nothing in {pattern}"


def test_the_counts_said_elsewhere_are_the_docs() -> None:
    step, stateful, _ = documented()
    words = {v: k for k, v in NUMBERS.items()}
    text = DOC.read_text()
    assert f"### A per-step check: {words[len(step)]} files" in text
    assert f"### A stateful check: {words[len(step) + len(stateful)]} files" in text
    # README's contributor material lives in docs/architecture.md ("Where the code is").
    where = " ".join(text.split("## Where the code is", 1)[1].split())
    assert (f"A new per-step check is {words[len(step)]} files, a stateful one "
            f"{words[len(step) + len(stateful)]} (below") in where
    assert "`docs/architecture.md`" in (ROOT / "README.md").read_text()
    spec = " ".join((GUARD / "checks/spec.py").read_text().split())
    assert "docs/architecture.md lists the files each kind touches" in spec


def test_the_reference_scan_finds_a_check_and_skips_prose(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""untrained_rows in a docstring."""\n# untrained_rows in a comment\n')
    assert not names_in_code(f, "untrained_rows")
    f.write_text('x = policy.action("untrained_rows")\n')
    assert names_in_code(f, "untrained_rows")
    f.write_text("from guard.checks import untrained_rows as spec\n")
    assert names_in_code(f, "untrained_rows")
