"""`__all__` is explicit, sorted and complete; each side imports only what DESIGN allows."""

from __future__ import annotations

import subprocess
import sys

import guard
import guard.errors


def test_guard_all_is_sorted_and_complete() -> None:
    assert guard.__all__ == sorted(guard.__all__)
    public = {n for n in dir(guard) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(guard, n)).__name__ == "module"}
    assert set(guard.__all__) == public - modules
    for name in ("attach", "audit", "pad_vocab_size", "padding_mass", "load_policy", "Policy",
                 "Guard", "Audit", "GuardError", "PolicyError", "AttachError", "GuardViolation"):
        assert name in guard.__all__


def test_error_tree() -> None:
    assert issubclass(guard.PolicyError, guard.GuardError) and issubclass(guard.PolicyError,
                                                                           ValueError)
    assert issubclass(guard.AttachError, guard.GuardError)
    assert issubclass(guard.GuardViolation, guard.GuardError)
    assert issubclass(guard.GuardViolation, RuntimeError)
    assert guard.errors.__all__ == sorted(guard.errors.__all__)


def test_library_import_needs_no_fastapi() -> None:
    code = ("import sys, guard, torch\n"
            "m = guard.demo.model if hasattr(guard, 'demo') else None\n"
            "bad = [n for n in ('fastapi', 'uvicorn', 'starlette', 'guard_server', "
            "'prometheus_client') if n in sys.modules]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
