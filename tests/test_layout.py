"""Rules of the tree that a review would otherwise have to re-check by hand: module sizes,
no frame walking, integrations on the public surface, one spec per per-step check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import guard
import guard_server

GUARD = Path(guard.__file__).parent
SERVER = Path(guard_server.__file__).parent
INTEGRATIONS = GUARD / "integrations"
# STYLE.md: most modules 40-200 lines; none past this.
MAX_LINES = 300


def sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


@pytest.mark.parametrize("path", sources(GUARD, SERVER), ids=lambda p: str(p.relative_to(
    p.parents[2] if p.is_relative_to(SERVER) else p.parents[1])))
def test_no_module_is_over_300_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_nothing_in_the_library_climbs_python_frames() -> None:
    # STYLE.md rule 12: take what the framework hands over; never climb frames to find it.
    climbing = ("_getframe", "currentframe", "f_back", "f_locals", "inspect.stack",
                "inspect.getouterframes")
    found = [f"{p.relative_to(GUARD)}: {word}" for p in sources(GUARD)
             for word in climbing if word in p.read_text()]
    assert found == []


def imports_outside_the_public_surface(path: Path) -> list[str]:
    """What `path` takes from guard/ other than `guard`'s public names, `guard.errors` and the
    integrations' own modules."""
    allowed_modules = ("guard", "guard.errors")
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("guard.")
                    and a.name not in allowed_modules
                    and not a.name.startswith("guard.integrations")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("guard"):
            module = node.module or ""
            if module == "guard":
                bad += [f"guard.{a.name}" for a in node.names if a.name not in guard.__all__]
            elif module not in allowed_modules and not module.startswith("guard.integrations"):
                bad.append(module)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "guard" and node.attr not in guard.__all__):
            bad.append(f"guard.{node.attr}")
    return bad


@pytest.mark.parametrize("path", sources(INTEGRATIONS), ids=lambda p: p.name)
def test_integrations_use_only_the_public_surface(path: Path) -> None:
    assert imports_outside_the_public_surface(path) == []


def test_the_surface_check_finds_an_internal_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import guard\nfrom guard.device.ops import mask_padding\n"
                   "from guard import attach, Record\nx = guard.probe\n")
    assert imports_outside_the_public_surface(bad) == ["guard.device.ops", "guard.Record",
                                                        "guard.probe"]


def test_every_per_step_check_has_one_spec_and_a_policy_model() -> None:
    from guard.checks import CHECKS
    from guard.policy import ATTACH_CHECKS, STEP_CHECKS, Checks

    # Every per-step check, and an attach check with a part at each read (vocab: the tie).
    assert set(STEP_CHECKS) <= {s.name for s in CHECKS} <= {*STEP_CHECKS, *ATTACH_CHECKS}
    assert all(s.name in Checks.model_fields for s in CHECKS)
    assert (GUARD / "checks").is_dir()
    modules = {p.stem for p in (GUARD / "checks").glob("*.py")}
    assert {s.name for s in CHECKS} <= modules  # guard/checks/<name>.py, one each


def test_ci_runs_the_linters_with_the_tests() -> None:
    """.ci/run runs the README's test command; it must run ruff and mypy --strict, so a lint
    or type error fails CI like a failing test."""
    root = GUARD.parent
    readme = (root / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.rstrip().endswith("# set up and run the tests"))
    assert "scripts/check" in line
    check = (root / "scripts" / "check").read_text()
    assert '"$py" -m ruff check . || exit' in check
    assert '"$py" -m mypy --strict' in check and 'exit "$types"' in check
    assert '"$py" -m pytest -q "$@"' in check


def test_the_check_fails_on_a_type_error(tmp_path: Path) -> None:
    """scripts/check's exit status carries mypy's: a copy of the script over a tree whose one
    module has a type error, and a stand-in python that runs mypy for real and passes the
    rest."""
    import shutil
    import subprocess
    import sys

    root = GUARD.parent
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(root / "scripts" / "check", tree / "scripts" / "check")
    (tree / "bad.py").write_text("def f() -> int:\n    return 'x'\n")
    (tree / ".venv" / "bin").mkdir(parents=True)
    fake = tree / ".venv" / "bin" / "python"
    fake.write_text(f"#!/bin/sh\nif [ \"$2\" = mypy ]; then exec {sys.executable} -m mypy "
                    "--strict --no-incremental bad.py; fi\nexit 0\n")
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(tree / "scripts" / "check")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert 'Incompatible return value type (got "str", expected "int")' in done.stderr
