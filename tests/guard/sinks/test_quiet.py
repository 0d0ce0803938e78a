"""httpx stays quiet at INFO: a run that pushes logs no line per request, unless asked."""

from __future__ import annotations

import logging

import pytest

import guard
from guard_server.embedded import EmbeddedServer
from guard_server.settings import Settings
from guard_server.testing import free_port
from tests.conftest import tiny_gpt
from tests.guard.sinks.helpers import serving, train_steps


def _run_pushing() -> None:
    server = EmbeddedServer("127.0.0.1", free_port(), settings=Settings(log_level="warning"))
    url = server.start()
    try:
        m = tiny_gpt()
        with guard.attach(m, policy=serving(push=url), vocab_size=100) as g:
            train_steps(g, m, 2)
    finally:
        server.stop()


def test_push_logs_no_httpx_line_at_info(caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger("httpx"), "level", logging.NOTSET)
    caplog.set_level(logging.INFO)
    _run_pushing()
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]


def test_a_level_the_user_set_is_kept(caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger("httpx"), "level", logging.INFO)
    caplog.set_level(logging.INFO)
    _run_pushing()
    assert logging.getLogger("httpx").level == logging.INFO
    assert [r for r in caplog.records if r.name == "httpx"]
