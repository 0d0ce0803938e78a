"""GET / and GET /runs/{run_id} (guard_server/routes/pages.py) over a TestClient: what they
show, escaped; their headers; paging; the read token from a browser (Basic) or a script
(Bearer). tests/server/test_pages_browser.py loads them in a real Chromium."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from guard_server import ReportBatch, Settings, Store, create_app
from guard_server.page.render import CSP
from guard_server.page.sparkline import sparkline
from guard_server.page.views import RANKS_SHOWN
from tests.server.conftest import MakeBatch

TOKEN = "t0ken"
# Untrusted text a trainer can send: a script element, quotes that would close an attribute
# the text is put in (the message is also an event's title="..."), markup in a module name.
SCRIPT = "<script>document.title='pwned';window.pwned=1</script>"
BREAKOUT = '" onmouseover="window.pwned=2" x="'
MODULE = "<img src=x onerror=window.pwned=3>"


def hostile_event(step: int) -> dict[str, Any]:
    return {"check": "token_range", "action": "fail", "step": step,
            "message": f"token_range on rank 2 at step {step}: {SCRIPT} {BREAKOUT} '&'",
            "module": MODULE}


@pytest.fixture
def app_client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings())) as c:
        yield c


def post(c: TestClient, batch: dict[str, Any], **headers: str) -> None:
    assert c.post("/v1/reports", json=batch, headers=headers).status_code == 202


def test_the_list_of_runs_shows_each_run_its_ranks_and_events(
        app_client: TestClient, make_batch: MakeBatch) -> None:
    post(app_client, make_batch("run-a", 0, steps=tuple(range(1, 6)), grad_norm=None))
    post(app_client, make_batch("run-a", 1, steps=(5,), halted="token_range",
                                violations={"token_range": {"fail": 1}},
                                events=[hostile_event(5)]))
    reply = app_client.get("/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    html = reply.text
    assert '<a href="runs/run-a">run-a</a>' in html and "2 ranks (0 finished)" in html
    assert '<span class="halted">1 halted</span> (rank 1: token_range)' in html
    # The halted rank comes first, with why: its fail event's message.
    assert html.index('id="rank-1"') < html.index('id="rank-0"')
    assert '<span class="halted">halted: token_range</span>' in html
    assert 'class="why"><bdi>token_range on rank 2 at step 5: &lt;script' in html
    assert "not reported" in html  # rank 0's grad norm: its reports have none
    assert "0.84 (largest: <bdi>transformer.wte.weight</bdi> 31%)" in html  # rank 1's
    assert '<meta http-equiv="refresh" content="5">' in html


def test_everything_a_trainer_sent_is_escaped(app_client: TestClient,
                                              make_batch: MakeBatch) -> None:
    post(app_client, make_batch("run-x", 2, halted="token_range", events=[hostile_event(1)]))
    for path in ("/", "/runs/run-x"):
        html = app_client.get(path).text
        assert "<script" not in html and "<img" not in html and "onmouseover=\"" not in html
        assert "&lt;script&gt;document.title=&#39;pwned&#39;" in html
        assert "&#34; onmouseover=&#34;window.pwned=2&#34; x=&#34;" in html
        assert "&lt;img src=x onerror=window.pwned=3&gt;" in html and "&#39;&amp;&#39;" in html


def test_the_pages_forbid_every_script(app_client: TestClient, make_batch: MakeBatch) -> None:
    post(app_client, make_batch("run-a"))
    for path in ("/", "/runs/run-a", "/runs/nope"):
        headers = app_client.get(path).headers
        assert headers["content-security-policy"] == CSP
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["cache-control"] == "no-store"
    assert CSP.startswith("default-src 'none'; style-src 'sha256-") and "script" not in CSP
    # The one inline style is the one the hash allows.
    html = app_client.get("/").text
    css = re.search(r"<style>(.*?)</style>", html, re.S)
    assert css is not None and html.count("<style>") == 1 and "style=" not in html
    digest = base64.b64encode(hashlib.sha256(css.group(1).encode()).digest()).decode()
    assert f"'sha256-{digest}'" in CSP


def test_a_runs_page_has_sparklines_or_says_why_not(app_client: TestClient,
                                                     make_batch: MakeBatch) -> None:
    post(app_client, make_batch("run-a", 0, steps=tuple(range(1, 11))))
    post(app_client, make_batch("run-a", 1, steps=(3,)))
    post(app_client, make_batch("run-a", 2, steps=(1, 2), loss=None, padding_mass=None,
                                padding_mass_max=None))
    html = app_client.get("/runs/run-a").text
    rank0 = html[html.index('id="rank-0"'):html.index('id="rank-1"')]
    assert rank0.count("<polyline points=") == 2  # loss and padding mass
    rank1 = html[html.index('id="rank-1"'):html.index('id="rank-2"')]
    assert "<svg" not in rank1 and rank1.count("one report so far: a line needs two") == 2
    rank2 = html[html.index('id="rank-2"'):]
    assert "no loss in the last 2 reports" in rank2 and "no padding mass in the last 2" in rank2
    assert app_client.get("/runs/nope").status_code == 404


def test_a_large_run_is_paged(make_batch: MakeBatch) -> None:
    store = Store(Settings(max_ranks_per_run=2000))
    for rank in range(1024):  # into the store: 1024 posts over a TestClient take seconds
        store.ingest(ReportBatch.model_validate(make_batch("big", rank)))
    with TestClient(create_app(store.settings, store)) as c:
        html = c.get("/runs/big").text
        assert html.count('<tr class="rank ') == 100 and "Ranks 0 to 99 of 1024" in html
        assert '<a href="?offset=100&amp;limit=100">next 100</a>' in html and "previous" not in html
        html = c.get("/runs/big?offset=1000&limit=100").text
        assert html.count('<tr class="rank ') == 24 and "Ranks 1000 to 1023 of 1024" in html
        assert '<a href="?offset=900&amp;limit=100">previous 100</a>' in html
        assert "next 100" not in html
        html = c.get("/").text
        assert html.count('<tr class="rank ') == RANKS_SHOWN
        assert f"{RANKS_SHOWN} of 1024 ranks shown" in html
        assert c.get("/runs/big?limit=100000").status_code == 422


def test_sparkline_scales_steps_and_values_and_breaks_at_gaps() -> None:
    s = sparkline([(0, 1.0), (5, 3.0), (10, None), (20, 2.0), (30, 2.0)], "loss")
    assert s.drawn and (s.low, s.high, s.steps) == (1.0, 3.0, (0, 30))
    assert s.lines == ("2.0,22.0 21.3,2.0", "79.3,12.0 118.0,12.0")
    assert sparkline([(0, 1e308), (1, -1e308)], "loss").lines == ("2.0,2.0 118.0,22.0",)
    assert sparkline([], "loss").why == "no reports held"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_with_a_token_a_browser_logs_in_and_a_script_sends_it(make_batch: MakeBatch) -> None:
    with TestClient(create_app(Settings(token=TOKEN))) as c:
        post(c, make_batch("run-a"), Authorization=f"Bearer {TOKEN}")
        for path in ("/", "/runs/run-a"):
            reply = c.get(path)
            assert reply.status_code == 401 and "run-a" not in reply.text
            assert reply.headers["www-authenticate"] == 'Basic realm="logitguard", charset="UTF-8"'
            assert "as the password in your browser" in reply.text
            assert reply.headers["content-security-policy"] == CSP
            for good in (basic("anyone", TOKEN), basic("", TOKEN), f"Bearer {TOKEN}"):
                assert c.get(path, headers={"Authorization": good}).status_code == 200, good
            for bad in (basic(TOKEN, "x"), basic("a", TOKEN + "x"), "Basic !!", f"Basic {TOKEN}",
                        "Basic " + base64.b64encode(TOKEN.encode()).decode()):
                assert c.get(path, headers={"Authorization": bad}).status_code == 401, bad
        # The JSON reads take the browser's credentials too; pushes only a bearer token.
        assert c.get("/v1/runs", headers={"Authorization": basic("a", TOKEN)}).status_code == 200
        reply = c.post("/v1/reports", json=make_batch("run-b"),
                       headers={"Authorization": basic("a", TOKEN)})
        assert reply.status_code == 401
        assert c.get("/healthz").status_code == 200
