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


def imported_after(code: str) -> set[str]:
    """Top-level packages of interest in sys.modules after running `code` in a fresh process."""
    watch = ("torch", "fastapi", "uvicorn", "starlette", "prometheus_client", "guard_server",
             "guard_server.app", "guard_server.wire")
    run = f"import sys\n{code}\nprint(','.join(n for n in {watch!r} if n in sys.modules))"
    out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, check=True)
    return set(filter(None, out.stdout.strip().split(",")))


def test_a_guarded_step_needs_no_fastapi() -> None:
    # The whole library, attached and stepping (serve off): the wire's models, nothing of the
    # server's web stack.
    code = ("import torch, guard\n"
            "from tests.conftest import tiny_gpt, batch, policy\n"
            "m = tiny_gpt()\n"
            "with guard.attach(m, policy=policy(), vocab_size=100) as g:\n"
            "    g.step(m(*batch())[1])\n")
    assert imported_after(code) == {"torch", "guard_server", "guard_server.wire"}


def test_import_guard_loads_no_torch() -> None:
    assert imported_after("import guard") == set()


def test_guard_serve_and_audit_start_without_torch() -> None:
    serve = ("import guard.cli, guard_server\n"
             "guard_server.create_app(guard_server.Settings())\n")
    assert "torch" not in imported_after(serve)
    assert "guard_server.app" in imported_after(serve)
    assert imported_after("import guard.cli, guard.checkpoint_audit") == set()


def test_guard_lazy_names_are_the_real_objects() -> None:
    import guard.guard
    import guard.policy

    assert guard.attach is guard.guard.attach and guard.Policy is guard.policy.Policy
