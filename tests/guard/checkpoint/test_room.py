"""guard/checkpoint/ reads untrusted files without torch: no module in it imports torch or
anything of the library above it, and importing all of it (and the audit) loads no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import guard.checkpoint
from tests.test_exports import imported_after

ROOM = Path(guard.checkpoint.__file__).parent
# What the room may take from the rest of the library: the leaves.
LEAVES = ("guard.checkpoint", "guard.errors", "guard.quote", "guard.constants")


def imports(path: Path) -> list[str]:
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


def test_the_room_imports_no_torch_and_only_the_leaves_of_the_library() -> None:
    modules = sorted(ROOM.glob("*.py"))
    assert len(modules) > 5
    found = {f"{p.name}: {m}" for p in modules for m in imports(p)
             if m.split(".")[0] == "torch" or (m.startswith("guard")
                                              and not m.startswith(LEAVES))}
    assert found == set()


def test_importing_the_room_and_the_audit_loads_no_torch() -> None:
    code = "\n".join(f"import guard.checkpoint.{p.stem}" for p in sorted(ROOM.glob("*.py"))
                     if p.stem != "__init__")
    assert imported_after(f"{code}\nimport guard.checkpoint_audit") == set()
