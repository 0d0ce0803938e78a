"""The pages and the answers' headers against what a hostile or careless trainer or client can
send, over a real uvicorn on loopback (issue 41, items 1 and 8): every value the wire takes
draws, bidi controls stay inside their text, no Location from a Host header, every answer
nosniff and uncached, one reading of a repeated Authorization header."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer, Settings
from tests.server.conftest import MakeBatch

MAX = sys.float_info.max
TOKEN = "t0ken"
# (loss, padding mass) of a rank's reports, step after step: the edges of what the wire takes.
EDGES: dict[str, list[tuple[float, float]]] = {
    "zero and the smallest denormal": [(0.0, 0.0), (5e-324, 1.0)],
    "two denormals": [(5e-324, 1.0), (1e-323, 0.0)],
    "equal values": [(2.0, 0.5), (2.0, 0.5), (2.0, 0.5)],
    "the widest span": [(-MAX, 0.0), (MAX, 1.0), (0.0, 0.5)],
    "max float twice": [(MAX, 1.0), (MAX, 1.0)],
    "one point": [(1.0, 0.0)],
}


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[EmbeddedServer]:
    values: dict[str, Any] = {"port": 0, **getattr(request, "param", {})}
    with EmbeddedServer(port=0, settings=Settings(**values)) as running:
        yield running


def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


def test_every_value_the_wire_takes_draws_or_says_why(
        server: EmbeddedServer, make_batch: MakeBatch, caplog: pytest.LogCaptureFixture) -> None:
    with httpx.Client(base_url=f"{server.url}", timeout=30) as client:
        for n, (name, points) in enumerate(EDGES.items()):
            for step, (loss, mass) in enumerate(points, 1):
                batch = make_batch(f"edge-{n}", steps=(step,), loss=loss, padding_mass=mass,
                                   padding_mass_max=mass)
                assert client.post("/v1/reports", json=batch).status_code == 202, name
            page = client.get(f"/runs/edge-{n}")
            assert page.status_code == 200, name
            assert "default-src 'none'" in page.headers["content-security-policy"]
            drawn = page.text.count('<svg class="spark"')
            assert drawn == (0 if len(points) == 1 else 2), name
            if len(points) == 1:
                assert "one report so far: a line needs two" in page.text
        assert client.get("/").status_code == 200
    _quiet(caplog)


RLO, PDI = "\u202e", "\u2069"  # right-to-left override; pop directional isolate


class _Where(HTMLParser):
    """Where bidi controls stand in a page: inside a <bdi> element, elsewhere in its text, or in
    an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # of open <bdi> elements
        self.isolated = self.loose = self.in_attributes = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.depth += tag == "bdi"
        self.in_attributes += sum(_controls(v or "") for _, v in attrs)

    def handle_endtag(self, tag: str) -> None:
        self.depth -= tag == "bdi"

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.isolated += _controls(data)
        else:
            self.loose += _controls(data)


def _controls(text: str) -> int:
    return sum(ch in (RLO, PDI) for ch in text)


def test_bidi_controls_from_a_trainer_stay_inside_its_text(
        server: EmbeddedServer, make_batch: MakeBatch) -> None:
    # An unmatched PDI would close an isolate the page opened; an RLO reverses what follows.
    text = f"{PDI}{RLO}gnp.live"
    event = {"check": "token_range", "action": "fail", "step": 1, "message": text,
             "module": text}
    batch = make_batch("bidi", halted="token_range", events=[event], grad_norm_top=text)
    assert httpx.post(f"{server.url}/v1/reports", json=batch).status_code == 202
    for path in ("/", "/runs/bidi"):
        where = _Where()
        where.feed(httpx.get(f"{server.url}{path}").text)
        assert where.isolated and not where.loose and not where.in_attributes, path


def test_no_redirect_goes_where_the_host_header_says(server: EmbeddedServer,
                                                     make_batch: MakeBatch) -> None:
    assert httpx.post(f"{server.url}/v1/reports", json=make_batch("x")).status_code == 202
    for path in ("/runs/x/", "/v1/runs/", "/metrics/", "/v1/runs/x/?limit=1"):
        reply = httpx.get(f"{server.url}{path}", headers={"Host": "evil.example"})
        assert "evil.example" not in reply.headers.get("location", ""), path
        assert reply.status_code < 500, path


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/runs/x", "/v1/runs/x?limit=0",
                                  "/runs/x?offset=-1", "/v1/runs/nope", "/runs/nope",
                                  "/healthz", "/nope", "/openapi.json", "/"])
def test_every_answer_is_nosniff_and_uncached(server: EmbeddedServer, make_batch: MakeBatch,
                                              path: str) -> None:
    assert httpx.post(f"{server.url}/v1/reports", json=make_batch("x")).status_code == 202
    reply = httpx.get(f"{server.url}{path}")
    assert reply.headers.get_list("x-content-type-options") == ["nosniff"], reply.status_code
    assert reply.headers.get_list("cache-control") == ["no-store"], reply.status_code


@pytest.mark.parametrize("server", [{"token": TOKEN}], indirect=True)
def test_two_authorization_headers_are_refused_by_reads_and_pushes_alike(
        server: EmbeddedServer, make_batch: MakeBatch) -> None:
    good, bad = ("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer nope")
    with httpx.Client(base_url=f"{server.url}") as client:
        for pair in ([good, bad], [bad, good]):
            headers = httpx.Headers(pair)
            assert client.post("/v1/reports", json=make_batch("two"),
                               headers=headers).status_code == 401
            for path in ("/v1/runs", "/", "/runs/two"):
                assert client.get(path, headers=headers).status_code == 401, path
        assert server.store.size() == (0, 0)  # nothing stored from the refused pushes
        assert client.post("/v1/reports", json=make_batch("one"),
                           headers=dict([good])).status_code == 202
        assert client.get("/v1/runs", headers=dict([good])).status_code == 200


# Text that escapes the most: a quote (6 bytes in HTML), a bidi control (3 bytes, 14 in a
# tooltip), an astral character (4 bytes), markup.
WORST = '"' * 1024 + RLO * 1024 + "\U0001f600" * 1024 + "<&>'" * 256


@pytest.mark.parametrize("bound", [512 << 10, 1 << 20])
def test_every_page_stays_within_its_bytes_whatever_the_text(make_batch: MakeBatch,
                                                             bound: int) -> None:
    from fastapi.testclient import TestClient

    from guard_server import ReportBatch, Store, create_app

    settings = Settings(max_page_bytes=bound, max_step_rate=None, max_bytes=1 << 30)
    store = Store(settings)
    event = {"check": "token_range", "action": "fail", "step": 1, "message": WORST[:4096],
             "module": WORST[:256]}
    every = {"token_range": {"fail": 2**53, "warn": 2**53}, "nonfinite": {"skip": 1}}
    for run in range(12):
        for rank in range(80 if run == 0 else 8):
            batch = make_batch(f"run-{run}", rank, steps=tuple(range(1, 61)), events=[],
                               grad_norm_top=WORST[:256], halted="token_range",
                               violations=every, loss=-MAX)
            batch["reports"][-1]["events"] = [event] * 32
            store.ingest(ReportBatch.model_validate(batch))
    with TestClient(create_app(settings, store)) as client:
        for path in ("/", "/runs/run-0?limit=256", "/runs/run-0?offset=7&limit=256"):
            reply = client.get(path)
            assert reply.status_code == 200, path
            assert len(reply.content) <= bound, (path, len(reply.content))
        first = client.get("/runs/run-0?limit=256").text
    assert "more not shown" in first and "next 256" in first  # the rest: the JSON, next page
