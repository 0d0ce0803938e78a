"""The `guard` command itself: --version, start-up without torch, the demo's scenarios."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from guard import cli


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"logitguard {importlib.metadata.version('logitguard')}\n"


def test_version_from_the_console_script() -> None:
    script = Path(sys.executable).parent / "guard"
    if not script.is_file():
        pytest.skip("the guard console script is not installed beside this python")
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"logitguard {importlib.metadata.version('logitguard')}"


def test_serve_audit_and_targets_start_without_torch(tmp_path: Path) -> None:
    # One fresh interpreter runs each command line in turn and says after each whether torch
    # (or the guard library's hook code) was imported: none may import it.
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128}))
    argvs = [
        ["--version"],
        ["serve", "--help"],
        ["audit", "--help"],
        ["audit", str(tmp_path)],  # unreadable (no weights): exit 2, after the whole import path
        ["targets", "--help"],
        ["targets", "--nodes", "node[01-02]", "--gpus-per-node", "8"],
        ["demo", "--help"],
    ]
    code = (
        "import json, sys\nfrom guard.cli import main\nseen = []\n"
        f"for argv in {argvs!r}:\n"
        "    try:\n        status = main(argv)\n"
        "    except SystemExit as e:\n        status = e.code\n"
        "    seen.append([argv[0], status, sorted(m for m in ('torch', 'guard.guard') "
        "if m in sys.modules)])\n"
        "print(json.dumps(seen), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    seen = json.loads(done.stderr.strip().splitlines()[-1])
    assert [status for _, status, _ in seen] == [0, 0, 0, 2, 0, 0, 0]
    assert all(imported == [] for _, _, imported in seen), seen


def test_demo_help_lists_both_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    from guard.demo.scenarios import SCENARIOS

    out = " ".join(capsys.readouterr().out.split())
    assert "--scenario {seed,nan}" in out
    assert "seed (default):" in out and "nan:" in out
    # The help is the scenarios' own text, and the description counts the demo's arms.
    assert all(" ".join(s.summary.split()) in out for s in SCENARIOS.values())
    assert "four times" in out and "collapses" not in out


@pytest.mark.parametrize(("argv", "scenario"), [([], "seed"), (["--scenario", "nan"], "nan")])
def test_demo_passes_the_scenario_through(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                          scenario: str) -> None:
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "_run_demo", lambda args: seen.append(args) or 0)
    assert cli.main(["demo", *argv]) == 0
    assert seen[0].scenario == scenario


def test_demo_refuses_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--scenario", "typo"])
    assert exit_.value.code == 2
    assert "invalid choice: 'typo'" in capsys.readouterr().err


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "guard.cli", "serve", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "status", "says"), [
    (["--port", "99999"], 2, ["port 99999 (--port / GUARD_SERVER_PORT)", "from 1 to 65535"]),
    (["--host", "256.1.1.1"], 2, ["host 256.1.1.1 (--host / GUARD_SERVER_HOST)",
                                  "is not an address", "0.0.0.0 for every interface"]),
])
def test_serve_says_in_one_line_which_option_is_wrong(args: list[str], status: int,
                                                      says: list[str]) -> None:
    done = _serve(*args)
    assert done.returncode == status
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()  # no traceback, no warning about listening first
    assert line.startswith("guard serve: ") and all(s in line for s in says), line


def test_serve_on_a_port_in_use_names_the_port_and_starts_nothing() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve("--port", str(port))
    assert done.returncode == 3
    (line,) = done.stderr.splitlines()  # not uvicorn's "startup complete", then a bind error
    assert f"port {port} (--port / GUARD_SERVER_PORT) is in use on 127.0.0.1" in line
    assert "choose another port" in line
