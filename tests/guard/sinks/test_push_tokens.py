"""One token rule at both ends (guard_server.wire.bearer_token): stripped, refused at start
when it cannot go in a header, and never in any log, httpx's and httpcore's DEBUG lines
included. Against a real uvicorn on loopback that reads GUARD_TOKEN as the push sink does."""

from __future__ import annotations

import base64
import logging

import pytest

import guard
from guard.errors import AttachError
from guard.sinks.push import PushSink
from guard_server import EmbeddedServer, Settings, SettingsError
from tests.conftest import policy, tiny_gpt
from tests.guard.sinks.helpers import one_report, wait_until


def test_a_token_with_a_trailing_newline_works_at_both_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Kubernetes Secret made with --from-file: the server kept the newline, no client could
    # send it, every push was refused. Both ends read this one variable.
    monkeypatch.setenv("GUARD_TOKEN", "s3cret\n")
    with EmbeddedServer(port=0, settings=Settings(port=0, log_level="warning")) as server:
        assert server.url is not None
        sink = PushSink(server.url, flush_interval_s=0.05)
        sink.emit(one_report(final=True))
        assert wait_until(lambda: sink.sent == 1, timeout_s=10)
        sink.close(timeout=1)
        assert sink.dropped == 0 and server.store.snapshot().reports_total == 1


@pytest.mark.parametrize(("token", "says"), [
    ("s\u00e9cret", "character 2 of GUARD_TOKEN is a non-ASCII character"),
    ("two words", "character 4 of GUARD_TOKEN is a space"),
    ("line\x01feed", "character 5 of GUARD_TOKEN is a control character"),
])
def test_a_token_that_cannot_be_a_header_is_refused_at_start_at_both_ends(
    monkeypatch: pytest.MonkeyPatch, token: str, says: str
) -> None:
    # It used to raise UnicodeEncodeError (quoting the token) from attach, or to be accepted
    # by the server and compared in latin-1 there and in UTF-8 on the ingest route.
    monkeypatch.setenv("GUARD_TOKEN", token)
    with pytest.raises(SettingsError) as refused:
        Settings()
    pol = policy()
    pol["export"] = {"serve": None, "push": "http://127.0.0.1:9"}
    with pytest.raises(AttachError) as at_attach:
        guard.attach(tiny_gpt(), policy=pol, vocab_size=100)
    for error in (str(refused.value), str(at_attach.value)):
        assert "GUARD_TOKEN" in error and token not in error
    assert says in str(at_attach.value)
    assert says.replace("GUARD_TOKEN", "the token") in str(refused.value)


def test_no_token_reaches_any_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every logger at DEBUG (httpx, httpcore, uvicorn, guard): a right token, a wrong one,
    # credentials in the push URL (httpx's INFO line of each request printed the URL whole).
    monkeypatch.setenv("GUARD_TOKEN", "right-token")
    caplog.set_level(logging.DEBUG)
    # httpx is kept at WARNING once a push sink opened in this process (guard/sinks/quiet.py):
    # here it is asked for at DEBUG, as a user may, whatever ran before.
    for name in ("httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)
    with EmbeddedServer(port=0, settings=Settings(port=0)) as server:
        host = f"127.0.0.1:{server.port}"
        sinks = [PushSink(f"http://{host}", flush_interval_s=0.05),
                 PushSink(f"http://{host}", token="wrong-token", flush_interval_s=0.05),
                 PushSink(f"http://alice:hunter2@{host}", flush_interval_s=0.05)]
        for sink in sinks:
            sink.emit(one_report(final=True))
        assert wait_until(lambda: all(s.sent + s.dropped == 1 for s in sinks), timeout_s=10)
        for sink in sinks:
            sink.close(timeout=1)
    assert [s.sent for s in sinks] == [1, 0, 0]
    basic = base64.b64encode(b"alice:hunter2").decode()
    for secret in ("right-token", "wrong-token", "hunter2", basic):
        assert secret not in caplog.text, secret
    assert "HTTP Request: POST" in caplog.text  # httpx did log, without them
