"""scripts/bootstrap as a newcomer meets it: --help prints the usage and does nothing else, each
phase is said as it starts, and --dev installs each missing test tool's Debian package.

The script runs for real, in a copy of the tree whose .venv/bin/python, apt-get and id are
stand-ins that record what they were asked, on a PATH that holds only the tools given."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tree(tmp_path: Path, tools: list[str]) -> tuple[Path, dict[str, str]]:
    """A copy of scripts/bootstrap with stand-in binaries; the environment to run it in."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/bootstrap", tmp_path / "scripts/bootstrap")
    log = tmp_path / "calls.log"
    bin_ = tmp_path / "bin"
    venv = tmp_path / ".venv/bin"
    for folder in (bin_, venv):
        folder.mkdir(parents=True)
    stand_ins = {
        venv / "python": 'if [ "$1" = -c ]; then echo "torch 0+stand-in"; exit 0; fi\n'
                         f'echo "python $*" >> {log}\n',
        bin_ / "apt-get": f'echo "apt-get $*" >> {log}\n',
        bin_ / "id": "echo 0\n",  # root: the script installs Debian packages itself
        **{bin_ / name: "exit 0\n" for name in tools},
    }
    for path, body in stand_ins.items():
        path.write_text(f"#!/bin/sh\n{body}")
        path.chmod(0o755)
    for real in ("dirname", "cat"):  # the system tools the script itself uses
        (bin_ / real).symlink_to(shutil.which(real) or f"/usr/bin/{real}")
    return tmp_path, {"PATH": str(bin_), "HOME": os.environ.get("HOME", "/tmp")}


def bootstrap(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash") or "/bin/bash"
    return subprocess.run([bash, str(root / "scripts/bootstrap"), *args], env=env,
                          capture_output=True, text=True, timeout=60)


def calls(root: Path) -> list[str]:
    log = root / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_sets_up_nothing(tmp_path: Path, flag: str) -> None:
    root, env = tree(tmp_path, [])
    done = bootstrap(root, env, flag)
    assert done.returncode == 0
    assert done.stdout.startswith("usage: scripts/bootstrap [--dev] [--help]")
    assert "--dev" in done.stdout and "TORCH_SPEC" in done.stdout
    assert calls(root) == []  # no pip, no apt-get


def test_an_unknown_option_is_refused_before_anything_runs(tmp_path: Path) -> None:
    root, env = tree(tmp_path, [])
    done = bootstrap(root, env, "--devv")
    assert done.returncode == 2
    assert done.stderr.strip() == ("bootstrap: unknown option '--devv'; see scripts/bootstrap "
                                   "--help")
    assert calls(root) == []


def test_each_phase_is_said_as_it_starts(tmp_path: Path) -> None:
    root, env = tree(tmp_path, ["prometheus", "promtool", "amtool", "chromium"])
    done = bootstrap(root, env, "--dev")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("bootstrap: ")]
    assert said == [
        "bootstrap: using the virtual environment in .venv",
        "bootstrap: installing torch==2.13.0 (CPU build; the longest phase)",
        "bootstrap: installing logitguard with its dev extras (pip install -e .)",
        "bootstrap: prometheus, promtool, amtool and chromium are installed",
        "bootstrap: ready (torch 0+stand-in)",
    ]
    assert [c.split(" install ")[-1] for c in calls(root)] == [
        "torch==2.13.0", "-c constraints.txt -e .[dev]"]


@pytest.mark.parametrize(("present", "installed"), [
    (["prometheus", "promtool", "chromium"], "prometheus-alertmanager"),  # amtool missing
    (["amtool", "chromium"], "prometheus"),
    (["prometheus", "promtool", "amtool"], "chromium"),
    ([], "prometheus prometheus-alertmanager chromium"),
])
def test_dev_installs_the_package_of_each_missing_tool(tmp_path: Path, present: list[str],
                                                       installed: str) -> None:
    root, env = tree(tmp_path, present)
    done = bootstrap(root, env, "--dev")
    assert done.returncode == 0, done.stderr
    apt = [c for c in calls(root) if c.startswith("apt-get")]
    assert apt == ["apt-get update -qq", f"apt-get install -y -qq {installed}"]
    assert f"bootstrap: installing the Debian packages {installed}" in done.stderr
