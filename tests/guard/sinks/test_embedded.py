"""The embedded /metrics endpoint, fed by a guard: served, scraped, and never in the way."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest
import torch

import guard
from guard_server.embedded import EmbeddedServer
from guard_server.testing import prometheus_binary, run_prometheus
from tests.conftest import batch, tiny_gpt
from tests.guard.sinks.helpers import serving, train_steps


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


def test_the_trainers_endpoint_serves_the_page_of_its_run() -> None:
    m = tiny_gpt(garbage=0.5)
    with guard.attach(m, policy=serving(serve="127.0.0.1:0"), vocab_size=100) as g:
        assert g.metrics_url is not None
        train_steps(g, m, 3)
        base = g.metrics_url.removesuffix("metrics")
        index = httpx.get(base)
        run = httpx.get(f"{base}runs/sink-test")
    assert index.status_code == 200 and '<a href="runs/sink-test">sink-test</a>' in index.text
    assert "content-security-policy" in index.headers
    assert run.status_code == 200 and run.text.count("<polyline points=") == 2  # 3 reports


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
    assert 0.5 < float(mass[0]["value"][1]) <= 1.0  # the garbage's mass, before the mask
    assert float(masked[0]["value"][1]) == 0  # the mask did its job: no violation
