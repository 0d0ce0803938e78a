"""A trainer's own endpoint at detach: where Prometheus scrapes it on an interval, the final
report (guard_rank_finished 1) is scraped before the endpoint stops, so a clean end never looks
like a rank that vanished (GuardRankSilent); where nothing scrapes it, detach does not wait."""

from __future__ import annotations

import threading

import httpx

import guard
from guard_server.embedded import EmbeddedServer
from guard_server.scrapes import ScrapeClock
from tests.conftest import tiny_gpt
from tests.guard.sinks.helpers import serving, train_steps, wait_until

FINISHED = 'guard_rank_finished{rank="0",run_id="sink-test"}'


def _scrape_every(url: str, every_s: float, stop: threading.Event, texts: list[str]) -> None:
    """A scraper on an interval, as Prometheus is; keeps every answer, stops when told or when
    the endpoint is gone."""
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            try:
                texts.append(client.get(url).text)
            except httpx.TransportError:
                return
            stop.wait(every_s)


def test_a_scraped_endpoint_is_scraped_finished_before_it_stops() -> None:
    m = tiny_gpt(garbage=0.5)
    texts: list[str] = []
    stop = threading.Event()
    g = guard.attach(m, policy=serving(serve="127.0.0.1:0"), vocab_size=100)
    assert g.metrics_url is not None
    scraper = threading.Thread(target=_scrape_every, args=(g.metrics_url, 0.3, stop, texts))
    scraper.start()
    try:
        train_steps(g, m, 2)
        assert wait_until(lambda: len(texts) >= 3)  # an interval seen, the reports scraped
        assert f"{FINISHED} 0.0" in texts[-1]
        g.detach()  # waits for the next scrape, then stops the endpoint
    finally:
        stop.set()
        scraper.join(10)
    assert f"{FINISHED} 1.0" in texts[-1], texts[-1][-400:]


def test_an_endpoint_nothing_scrapes_on_an_interval_stops_at_once() -> None:
    with EmbeddedServer("127.0.0.1", 0) as server:
        assert server.last_scrape() is None  # never scraped
        assert server.url is not None
        httpx.get(f"{server.url}/metrics")  # one look (a person's curl) is no interval
        assert server.last_scrape() is None


def test_the_wait_is_bounded_by_the_interval_seen() -> None:
    now = [100.0]
    clock = ScrapeClock(clock=lambda: now[0])
    assert clock.last_scrape_wait() == 0.0
    clock.note(100.0)
    clock.note(110.0)
    assert clock.interval() == 10.0 and clock.last_scrape_wait() == 21.0
    assert clock.last_scrape_wait(most_s=4.0) == 4.0
    clock.note(200.0)
    assert clock.last_scrape_wait() == 30.0  # 2 x 90 s + 1, capped: a slow scrape no longer
    assert clock.wait_after(150.0, timeout_s=0.0) and not clock.wait_after(200.0, timeout_s=0.0)
