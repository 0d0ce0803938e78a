"""The pages in a real browser: headless Chromium (tests/browser.py) loads them from a real
uvicorn on loopback holding real reports (guards on nanoGPT pushing through the ingest route,
and a trainer's hostile events), logs in with the read token as a person does, and reads what
the page shows after load: the run listed, the halted rank marked, the sparklines drawn, the
hostile text shown as text, and no script of it run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard.checks.padding_mass import bound
from guard.policy import Policy
from guard_server import EmbeddedServer, Settings
from tests.browser import Chromium, chromium_binary
from tests.integrations import nanogpt
from tests.server.conftest import MakeBatch
from tests.server.page_runs import RUN_ID, train_and_push
from tests.server.test_pages import BREAKOUT, MODULE, SCRIPT, TOKEN, hostile_event

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(chromium_binary() is None,
                       reason="chromium not installed (Debian package chromium; bootstrap --dev)"),
]

# What the page shows of each row, as a person reads it (innerText), keyed by the row's id.
ROWS = "Object.fromEntries([...document.querySelectorAll('tr.rank')].map(r => [r.id, r.innerText]))"
# Whatever a script of the data could have done: set a global, change the title, add elements.
RAN = ("[typeof window.pwned, document.scripts.length, document.images.length, "
       "document.querySelectorAll('[onmouseover],[onerror],[onload]').length]")


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(port=0, settings=Settings(port=0, token=TOKEN)) as running:
        train_and_push(running.url, TOKEN)
        yield running


@pytest.fixture
def browser() -> Iterator[Chromium]:
    with Chromium() as b:
        yield b


def hostile(server: EmbeddedServer, make_batch: MakeBatch) -> None:
    """A trainer that sends markup: rank 9 of another run, halted, with a hostile event."""
    batch = make_batch("hostile-run", 9, steps=(1, 2, 3), halted="token_range",
                       events=[hostile_event(3)])
    reply = httpx.post(f"{server.url}/v1/reports", json=batch,
                       headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 202


def test_without_the_token_a_person_sees_the_login_page(server: EmbeddedServer,
                                                        browser: Chromium) -> None:
    browser.login(None)  # the login dialog, cancelled
    browser.open(f"{server.url}/")
    assert browser.evaluate("document.title") == "This server needs its token: logitguard"
    assert RUN_ID not in browser.evaluate("document.body.innerText")


def test_the_list_of_runs_as_a_person_sees_it(server: EmbeddedServer, browser: Chromium,
                                              make_batch: MakeBatch, tmp_path: Path) -> None:
    hostile(server, make_batch)
    browser.login("me", TOKEN)
    browser.open(f"{server.url}/")
    assert browser.evaluate("document.title") == "logitguard: 2 runs, 2 halted ranks"
    text: str = browser.evaluate("document.body.innerText")
    assert RUN_ID in text and "3 ranks (3 finished), 1 halted (rank 2: token_range)" in text
    rows: dict[str, Any] = browser.evaluate(ROWS)
    assert rows["rank-2"].split("\t")[:3] == ["2", "halted: token_range", "12"]
    assert rows["rank-0"].split("\t")[:3] == ["0", "finished", "20"]
    # The padding mass beside the bound it is judged against: the default policy's for
    # nanoGPT's 100 real ids of 128 rows, as each guard put it on the wire.
    limit = bound(Policy(), nanogpt.REAL, nanogpt.ROWS)
    assert f"; bound {limit:.4g})" in rows["rank-0"] or f"; over the bound {limit:.4g})" in \
        rows["rank-0"]
    assert "1 ranks" not in text and "1 label ids" not in text
    # The halted mark is drawn as its stylesheet says: the inline style the CSP allows applied.
    colour = browser.evaluate("getComputedStyle(document.querySelector('span.halted'))"
                              ".backgroundColor")
    assert colour == "rgb(207, 34, 46)"
    # The hostile text is on the page as text, and none of it ran.
    assert SCRIPT in text and BREAKOUT.strip() in text and MODULE in text
    assert browser.evaluate(RAN) == ["undefined", 0, 0, 0]
    assert browser.log == []  # no CSP refusal, no console line: the page asked for nothing
    browser.screenshot(tmp_path / "runs.png")
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_runs_page_draws_each_ranks_sparklines(server: EmbeddedServer, browser: Chromium,
                                                 make_batch: MakeBatch) -> None:
    hostile(server, make_batch)
    browser.login("me", TOKEN)
    browser.open(f"{server.url}/runs/{RUN_ID}")
    assert browser.evaluate("document.title") == f"{RUN_ID}: logitguard"
    lines = browser.evaluate("[...document.querySelectorAll('tr.rank')].map(r => "
                             "r.querySelectorAll('svg.spark polyline').length)")
    assert lines == [2, 2, 2]  # loss and padding mass, every rank
    box = browser.evaluate("document.querySelector('svg.spark polyline').getBBox().width")
    assert box > 100  # drawn across the sparkline's 120 pixels
    why = browser.evaluate("document.querySelector('td.why').innerText")
    assert why.startswith("token_range on rank 2 at step 12: 1 label id outside [0, 100)")
    browser.open(f"{server.url}/runs/hostile-run")
    assert browser.evaluate(RAN) == ["undefined", 0, 0, 0]
    assert browser.evaluate("document.title") == "hostile-run: logitguard"
    assert "one report so far" not in browser.evaluate("document.body.innerText")
    assert browser.log == []
