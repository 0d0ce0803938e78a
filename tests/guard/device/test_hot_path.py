"""Static guard on the hot path: nothing the guard runs inside a hook reads a tensor to the host.

Three scans, all of the code as it is (no list kept by hand):
- every file under guard/device/ and guard/weights/ (a weight's rows, read before each read),
  except the one read of a step boundary (`Flags._wait`) and the host lists it turns into a
  Reading;
- what a stateful check's state runs in the hooks and before each read (guard/stateful/:
  `watches`, `count`, `end_step`, `check`), whatever the check;
- every function registered through `guard.device.hooks.hook`, wherever it lives: each call
  of `hook(...)` in guard/ is found and its function resolved. The run-time record of the
  helper (`registered()`) must hold nothing the scan did not find, and no file but the helper
  may call torch's `register_*_hook` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import CodeType

import pytest
import torch

import guard
import guard.device
import guard.weights
from guard.device.hooks import registered
from tests.conftest import batch, policy, tiny_gpt

GUARD = Path(guard.__file__).parent
DEVICE = Path(guard.device.__file__).parent
WEIGHTS = Path(guard.weights.__file__).parent
# .item() / .cpu() / .tolist() / .numpy() and bool(x) / float(x) / int(x) on a non-literal.
READS = {"item", "cpu", "tolist", "numpy"}
CASTS = {"bool", "float", "int"}
# (file, function) where a host read is the point: the read at a step boundary, and the plain
# lists of floats it returns, turned into a Reading.
ALLOWED = {("flags.py", "_wait"), ("reading.py", "reading")}
TORCH_REGISTER = {"register_forward_hook", "register_forward_pre_hook", "register_step_pre_hook",
                  "register_step_post_hook", "register_full_backward_hook",
                  "register_full_backward_pre_hook", "register_hook",
                  "register_post_accumulate_grad_hook"}

Function = ast.FunctionDef | ast.AsyncFunctionDef


def calls_in(fn: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of every host read in `fn`, nested functions included."""
    found = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in READS:
            found.append((node.lineno, f".{f.attr}()"))
        elif (isinstance(f, ast.Name) and f.id in CASTS and node.args
              and not isinstance(node.args[0], ast.Constant)):
            found.append((node.lineno, f"{f.id}()"))
    return found


def host_reads(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of every host read in the file."""
    tree = ast.parse(path.read_text())
    return [(fn.name, line, call) for fn in ast.walk(tree) if isinstance(fn, Function)
            for line, call in calls_in(fn)]


def _scopes(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _defs(scope: ast.AST) -> dict[str, Function]:
    return {n.name: n for n in ast.iter_child_nodes(scope) if isinstance(n, Function)}


def _imported(tree: ast.Module, name: str) -> tuple[Path, Function] | None:
    """The function `name` that `tree` imports from another module of guard/, and its file."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith("guard")):
            continue
        if any(alias.name == name and alias.asname is None for alias in node.names):
            path = GUARD.parent / (node.module.replace(".", "/") + ".py")
            fn = _defs(ast.parse(path.read_text())).get(name)
            if fn is not None:
                return path, fn
    return None


def hooked_functions() -> dict[tuple[str, int], Function]:
    """Every function given to `hook(...)` (or `wrap_loss(...)`: it runs inside the model's
    loss function; `wrap_step(...)`: inside a DeepSpeed optimizer's step; `wrap_call(...)`:
    inside a library's function, the loop's gradient clip) under guard/, by
    (file, line of its def): a method (`self._x`), a function of the module, or the nested
    function a factory call returns."""
    found: dict[tuple[str, int], Function] = {}
    for path in GUARD.rglob("*.py"):
        tree = ast.parse(path.read_text())
        parents = _scopes(tree)
        for call in ast.walk(tree):
            # register(fn): a function the guard hands the user (a pipeline's loss_fn)
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and (
                    (call.func.id in ("hook", "wrap_loss", "wrap_step") and len(call.args) >= 2)
                    or (call.func.id == "wrap_call" and len(call.args) == 3)
                    or (call.func.id == "register" and len(call.args) == 1))):
                continue
            arg, scope = call.args[-1 if call.func.id in ("register", "wrap_call") else 1], \
                parents[call]
            while not isinstance(scope, ast.ClassDef | ast.Module):
                scope = parents[scope]
            factory = isinstance(arg, ast.Call)
            target = arg.func if isinstance(arg, ast.Call) else arg
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            where, fn = path, _defs(scope).get(name) or _defs(tree).get(name)
            if fn is None and (imported := _imported(tree, name)) is not None:
                where, fn = imported
            assert fn is not None, f"{path}:{call.lineno}: cannot resolve the hook {name!r}"
            if factory:  # the hook is what the factory returns: its nested functions
                nested = [n for n in ast.walk(fn) if isinstance(n, Function) and n is not fn]
                assert nested, f"{path}:{call.lineno}: {name} defines no hook function"
                fns = nested
            else:
                fns = [fn]
            for f in fns:
                found[(str(where), f.lineno)] = f
    return found


def test_the_folder_holds_the_hook_code() -> None:
    names = {p.name for p in DEVICE.glob("*.py")}
    assert {"ops.py", "flags.py", "probe.py", "loss.py", "logits.py", "hooks.py"} <= names


@pytest.mark.parametrize("path", sorted([*DEVICE.glob("*.py"), *WEIGHTS.glob("*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_host_read_in_device_code(path: Path) -> None:
    hits = [(fn, line, call) for fn, line, call in host_reads(path)
            if (path.name, fn) not in ALLOWED]
    assert hits == []


STATEFUL = GUARD / "stateful"
# The verbs of a check's state that run in the id hooks, at each boundary and before every
# read (CheckState).
PER_STEP = {"watches", "count", "check", "end_step"}


@pytest.mark.parametrize("path", sorted(STATEFUL.glob("*.py")), ids=lambda p: p.name)
def test_no_host_read_in_what_a_state_does_every_step(path: Path) -> None:
    assert [(fn, line, call) for fn, line, call in host_reads(path) if fn in PER_STEP] == []


def test_the_state_scan_sees_every_state() -> None:
    from guard.stateful import STATEFUL as MADE

    defined = {n.name for p in STATEFUL.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, Function) and n.name in PER_STEP}
    assert defined == PER_STEP and len(MADE) >= 2


def test_no_host_read_in_any_function_registered_as_a_hook() -> None:
    fns = hooked_functions()
    # The sites as they are: the probe's six, the clock's three, the inputs kept for a re-run,
    # the localiser's per-module hook, the mask a detach can leave and the clip's total norm.
    names = {f.name for f in fns.values()}
    assert {"_model_pre", "_model_post", "_embedding_pre", "_head_pre", "_head_post",
            "_hidden_post", "_optimizer_pre", "_forward_start", "_forward_end", "_keep",
            "hook", "mask", "at_loss", "total_norm"} <= names
    hits = {f"{Path(file).relative_to(GUARD)}:{fn.name}": calls_in(fn)
            for (file, _), fn in fns.items() if calls_in(fn)}
    assert hits == {}


def test_every_hook_goes_through_the_helper() -> None:
    direct = []
    for path in GUARD.rglob("*.py"):
        if path.name == "hooks.py" and path.parent == DEVICE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in TORCH_REGISTER):
                direct.append(f"{path.relative_to(GUARD)}:{node.lineno}")
    assert direct == []


def test_what_registers_at_run_time_is_what_the_scan_found() -> None:
    """A guard with every hook on (both boundaries, a NaN for the localiser, the kept mask)."""
    m = tiny_gpt()
    pol = policy(nonfinite={"action": "warn"}, padding_rows={"action": "warn"})
    with guard.attach(m, policy=pol, vocab_size=100) as g:  # forward boundary
        _, loss = m(*batch())
        g.step(loss * float("nan"))  # nonfinite: localiser armed for the next forward
        m(*batch())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    g = guard.attach(m, policy=pol, vocab_size=100, optimizer=opt)
    g.detach(keep_mask=True)
    g.release()
    from transformers import GPT2Config, GPT2LMHeadModel  # an HF loss function to wrap

    hf = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=16, n_layer=1, n_head=2))
    x, _ = batch()
    with guard.attach(hf, policy=pol, vocab_size=100):
        hf(input_ids=x, labels=x)
    scanned = {(file, line) for file, line in hooked_functions()}
    codes: dict[CodeType, str] = registered()
    at_run_time = {(c.co_filename, c.co_firstlineno) for c in codes}
    assert len(at_run_time) >= 12
    assert at_run_time <= scanned, sorted(at_run_time - scanned)


def test_the_check_finds_a_host_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def hook(t):\n    if float(t.sum()) > 0:\n        return t.max().item()\n")
    assert [(fn, call) for fn, _, call in host_reads(bad)] == [("hook", "float()"),
                                                              ("hook", ".item()")]
