"""Static guard on the hot path: no file under guard/device/ reads a tensor to the host,
except at the one read of a step boundary (`Flags._wait`) and the host lists it unpacks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import guard.device

DEVICE = Path(guard.device.__file__).parent
# .item() / .cpu() / .tolist() / .numpy() and bool(x) / float(x) / int(x) on a non-literal.
READS = {"item", "cpu", "tolist", "numpy"}
CASTS = {"bool", "float", "int"}
# (file, function) where a host read is the point: the read at a step boundary, and the
# plain lists of floats it returns, turned into a Reading.
ALLOWED = {("flags.py", "_wait"), ("flags.py", "_values"), ("flags.py", "_reading")}


def host_reads(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of every host read in the file."""
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in READS:
                found.append((fn.name, node.lineno, f".{f.attr}()"))
            elif (isinstance(f, ast.Name) and f.id in CASTS and node.args
                  and not isinstance(node.args[0], ast.Constant)):
                found.append((fn.name, node.lineno, f"{f.id}()"))
    return found


def test_the_folder_holds_the_hook_code() -> None:
    names = {p.name for p in DEVICE.glob("*.py")}
    assert {"checks.py", "flags.py", "probe.py", "loss.py"} <= names


@pytest.mark.parametrize("path", sorted(DEVICE.glob("*.py")), ids=lambda p: p.name)
def test_no_host_read_in_device_code(path: Path) -> None:
    hits = [(fn, line, call) for fn, line, call in host_reads(path)
            if (path.name, fn) not in ALLOWED]
    assert hits == []


# Hook code that lives beside what it serves rather than in guard/device/: a pre-hook on
# every training forward (which inputs to keep for localising a NaN), the clock's forward
# hooks (a boundary's read happens in tick(), not here), and the mask the callbacks leave on
# the head after training. (file under guard/, function)
ELSEWHERE = [("step/episodes.py", "_keep"), ("step/clock.py", "_forward_start"),
             ("step/clock.py", "_forward_end"), ("integrations/common.py", "mask")]


@pytest.mark.parametrize(("file", "function"), ELSEWHERE, ids=lambda v: str(v))
def test_no_host_read_in_hooks_outside_the_folder(file: str, function: str) -> None:
    path = DEVICE.parent / file
    names = {n.name for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.FunctionDef)}
    assert function in names  # the list follows the code
    assert [(fn, line, call) for fn, line, call in host_reads(path) if fn == function] == []


def test_the_check_finds_a_host_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def hook(t):\n    if float(t.sum()) > 0:\n        return t.max().item()\n")
    assert [(fn, call) for fn, _, call in host_reads(bad)] == [("hook", "float()"),
                                                              ("hook", ".item()")]
