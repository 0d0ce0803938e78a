"""The server never imports torch or the guard library, and its exports stay honest."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import guard_server


def _modules() -> list[str]:
    # Subpackages too: each route module under guard_server/routes/ keeps its own __all__.
    return [m.name for m in pkgutil.walk_packages(guard_server.__path__, "guard_server.")]


def test_importing_every_module_pulls_in_neither_torch_nor_guard() -> None:
    names = ["guard_server", *[m for m in _modules() if not m.endswith("__main__")]]
    code = (
        f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'guard')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_all_is_sorted_complete_and_real() -> None:
    for name in ["guard_server", *_modules()]:
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        exported = list(module.__all__)
        assert exported == sorted(exported), name
        assert all(hasattr(module, n) for n in exported), name
        # Route handlers are reached through the module's router, not imported by name.
        router = getattr(module, "router", None)
        handlers = {r.endpoint for r in router.routes} if router is not None else set()
        defined = {
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__ == name
            and obj not in handlers
        }
        missing = defined - set(exported)
        assert not missing, f"{name} defines but does not export {missing}"
