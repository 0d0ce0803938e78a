"""The guard's log: one format (the logger's name says "guard", no message repeats it), quiet
by default (nothing at INFO once per push or step), one line per event; its HTTP client kept
at WARNING. In-process with caplog, and once as a user's script with basicConfig(level=INFO)
pushing to a real server."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import guard
from guard_server.embedded import EmbeddedServer
from guard_server.settings import Settings
from guard_server.testing import free_port
from tests.conftest import batch, tiny_gpt

ROOT = Path(__file__).resolve().parents[2]
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}

# What a user writes: logging turned on at INFO, a guarded loop pushing to a server.
SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO)
import torch
import guard
from tests.conftest import batch, tiny_gpt
m = tiny_gpt()
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
policy = {"run_id": "log-test", "export": {"serve": None, "push": sys.argv[1]}}
with guard.attach(m, policy=policy, vocab_size=100, optimizer=opt):
    for i in range(int(sys.argv[2])):
        _, loss = m(*batch(seed=i))
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def _train_pushing(url: str, steps: int) -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    policy = {"run_id": "log-test", "export": {"serve": None, "push": url}}
    with guard.attach(m, policy=policy, vocab_size=100, optimizer=opt):
        for i in range(steps):
            _, loss = m(*batch(seed=i))
            loss.backward()
            opt.step()
            opt.zero_grad()


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    server = EmbeddedServer("127.0.0.1", free_port(), settings=Settings(log_level="warning"))
    url = server.start()
    yield url
    server.stop()


def test_a_healthy_run_logs_the_attach_once_whatever_its_length(
        caplog: pytest.LogCaptureFixture, server_url: str) -> None:
    caplog.set_level(logging.INFO)
    said = []
    for steps in (2, 12):
        caplog.clear()
        _train_pushing(server_url, steps)
        said.append([(r.name, r.levelname, r.getMessage()) for r in caplog.records
                     if r.name.split(".")[0] in ("guard", "httpx", "httpcore")])
    assert said[0] == said[1]  # nothing per step or per push
    ((name, level, message),) = said[1]
    assert (name, level) == ("guard", "INFO")
    assert message.startswith("attached to wte / lm_head: vocab audit: real=100 rows=128")
    assert "\n" not in message


def _log_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, leading text) of each call log.<level>("...") / logger.<level>(f"...")."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in ("log", "logger") and node.args:
            first = node.args[0]
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append((node.lineno, first.value))
    return out


def test_no_log_message_of_the_library_repeats_the_loggers_name() -> None:
    # The logger is "guard": a format with %(name)s already says it ("INFO guard: guard: ..."
    # was the CLI's line before).
    found = []
    for path in sorted((ROOT / "guard").rglob("*.py")):
        for line, text in _log_calls(ast.parse(path.read_text(), str(path))):
            if text.lower().startswith(("guard:", "guard ")):
                found.append(f"{path.relative_to(ROOT)}:{line}: {text[:40]!r}")
    assert found == []


def test_a_users_script_at_info_shows_one_line_for_a_healthy_run(server_url: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GUARD_TOKEN", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, server_url, "30"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    # 30 steps and 30 pushes: one line, the attach's, in basicConfig's format, once prefixed.
    assert len(lines) == 1, lines
    assert lines[0].startswith("INFO:guard:attached to wte / lm_head: vocab audit: ")
