"""The guard's sinks against real servers on loopback: embedded endpoint, push, Prometheus."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import httpx
import pytest
import torch

import guard
from guard.sinks.push import PushSink
from guard_server.embedded import EmbeddedServer
from guard_server.testing import free_port, prometheus_binary, run_prometheus
from tests.conftest import batch, policy, tiny_gpt


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def serving(mass: str = "warn", **export: object) -> dict[str, object]:
    p = policy(padding_mass={"action": mass})
    p["export"] = {"serve": None, **export}
    p["run_id"] = "sink-test"
    return p


def train_steps(g: guard.Guard, model: torch.nn.Module, n: int) -> None:
    for i in range(n):
        _, loss = model(*batch(seed=i))
        loss.backward()
        g.step(loss)


def test_embedded_endpoint_serves_the_guards_reports() -> None:
    m = tiny_gpt(garbage=0.5)
    with guard.attach(m, policy=serving(serve="127.0.0.1:0"), vocab_size=100) as g:
        assert g.metrics_url is not None
        train_steps(g, m, 3)
        text = httpx.get(g.metrics_url).text
        runs = httpx.get(g.metrics_url.replace("/metrics", "/v1/runs/sink-test")).json()
    assert 'guard_step{rank="0",run_id="sink-test"} 3.0' in text
    labels = 'action="warn",check="padding_mass",rank="0",run_id="sink-test"'
    assert f"guard_violations_total{{{labels}}} 3.0" in text
    assert 'guard_vocab_size{kind="rows",rank="0",run_id="sink-test"} 128.0' in text
    assert "padding_mass on rank 0" in str(runs)
    with pytest.raises(httpx.ConnectError):  # stopped by detach
        httpx.get(g.metrics_url, timeout=1.0)


def test_taken_port_is_a_warning_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    m = tiny_gpt()
    try:
        pol = serving(serve=f"127.0.0.1:{port}")
        with caplog.at_level(logging.WARNING, logger="guard"), \
                guard.attach(m, policy=pol, vocab_size=100) as g:
            train_steps(g, m, 2)
            assert g.metrics_url is None and g.stats["step"] == 2
    finally:
        holder.close()
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in caplog.text
    assert "continuing without it" in caplog.text


def test_policy_push_builds_a_push_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARD_TOKEN", "s3cret")
    with guard.attach(tiny_gpt(), policy=serving(push="http://127.0.0.1:9"),
                      vocab_size=100) as g:
        (sink,) = g.sinks
        assert isinstance(sink, PushSink)
        assert sink._client.headers["authorization"] == "Bearer s3cret"


def ranks_step(server: EmbeddedServer, run_id: str = "sink-test") -> int | None:
    snap = server.store.snapshot(run_id)
    return snap.ranks[0].latest.step if snap.ranks else None


def test_push_survives_absent_killed_and_restarted_server() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    m = tiny_gpt(garbage=0.5)
    sink = PushSink(url, max_queue=4, batch_size=2, flush_interval_s=0.05,
                    backoff_s=(0.05, 0.2), timeout_s=1.0)
    with guard.attach(m, policy=serving(), vocab_size=100) as g:
        g.add_sink(sink)
        train_steps(g, m, 10)  # server absent: nothing raised, the queue overflows
        assert wait_until(lambda: sink.dropped >= 4)  # 10 - one in flight - 4 queued
        server = EmbeddedServer("127.0.0.1", port)
        server.start()
        try:
            assert wait_until(lambda: ranks_step(server) == 10)  # the newest reports arrive
            dropped_seen = server.store.snapshot("sink-test").ranks[0].latest.dropped_reports
            assert dropped_seen >= 4
        finally:
            server.stop()
        train_steps(g, m, 10)  # killed mid-run: training goes on
        assert g.stats["step"] == 20
        restarted = EmbeddedServer("127.0.0.1", port)
        restarted.start()
        try:
            train_steps(g, m, 2)
            assert wait_until(lambda: ranks_step(restarted) == 22)
        finally:
            g.detach()
            restarted.stop()
    assert sink.dropped >= 4 + 4


def test_push_close_is_time_bounded_when_the_server_is_gone() -> None:
    sink = PushSink(f"http://127.0.0.1:{free_port()}", backoff_s=(0.05, 0.1), timeout_s=0.5)
    sink.bind("r", 0)
    sink.emit({"step": 1, "final": True})
    start = time.monotonic()
    sink.close(timeout=0.5)
    assert time.monotonic() - start < 3.0
    assert sink.dropped == 1


def test_push_with_the_wrong_token_drops_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    from guard_server.settings import Settings

    port = free_port()
    settings = Settings(token="right", log_level="warning")
    server = EmbeddedServer("127.0.0.1", port, settings=settings)
    server.start()
    try:
        sink = PushSink(server.url or "", token="wrong", flush_interval_s=0.05)
        m = tiny_gpt()
        with guard.attach(m, policy=serving(), vocab_size=100) as g:
            g.add_sink(sink)
            train_steps(g, m, 2)
        assert sink.dropped >= 2 and sink.sent == 0
        assert server.store.snapshot().reports_total == 0
    finally:
        server.stop()


@pytest.mark.prometheus
@pytest.mark.skipif(prometheus_binary() is None, reason="prometheus binary not installed")
def test_real_prometheus_scrapes_a_real_training_run() -> None:
    m = tiny_gpt(garbage=0.5)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    server = EmbeddedServer("127.0.0.1", 0)
    server.start()
    try:
        with guard.attach(m, policy=serving(mass="mask", push=server.url), vocab_size=100,
                          optimizer=opt) as g:
            for i in range(5):
                _, loss = m(*batch(seed=i))
                loss.backward()
                opt.step()
                opt.zero_grad()
            g_step = g.stats["step"]
        with run_prometheus([server.url or ""], scrape_interval_s=0.5) as prom:
            step = prom.wait_for('guard_step{run_id="sink-test",rank="0"}')
            mass = prom.wait_for('guard_padding_mass_ratio{run_id="sink-test",rank="0"}')
            masked = prom.wait_for('guard_violations_total{check="padding_mass",action="mask"}')
    finally:
        server.stop()
    assert float(step[0]["value"][1]) == g_step == 5
    assert 0.05 < float(mass[0]["value"][1]) <= 1.0
    assert float(masked[0]["value"][1]) == 5
