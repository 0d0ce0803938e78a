"""GET /metrics written a piece at a time: the same bytes as prometheus_client's encoders
over the whole state, within what the byte budget keeps for a scrape, and a scrape whose
client stops reading cut at the write timeout, freeing its turn."""

from __future__ import annotations

import socket
import struct
import time
import tracemalloc
import uuid
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer, ReportBatch, Settings, Store
from guard_server.collector import new_registry
from guard_server.exposition import _pieces, exposition
from guard_server.families import MAX_SERIES_PER_RANK
from guard_server.routes.metrics import encoder_for
from guard_server.settings import _SCRAPE_BYTES_PER_RANK, _SCRAPE_PIECE_BYTES
from guard_server.wire import ACTIONS, CHECKS, MAX_COUNT

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"


def costliest(make_batch: Any, n: int) -> ReportBatch:
    """Rank `n` of the kind a scrape costs most: every check with every action, a halt,
    every optional value, a 128-character run_id and counts at 2**53."""
    every = {check: dict.fromkeys(ACTIONS, MAX_COUNT) for check in CHECKS}
    batch = make_batch(f"r{n // 4096:03d}".ljust(128, "x"), n % 4096, steps=(MAX_COUNT,),
                       violations=every, halted="nonfinite", skipped_steps=MAX_COUNT,
                       dropped_reports=MAX_COUNT, attach_id=uuid.uuid4().hex)
    return ReportBatch.model_validate(batch)


def filled(store: Store, make_batch: Any, costly: int, typical: int = 0) -> Store:
    for n in range(costly):
        store.ingest(costliest(make_batch, n))
    for rank in range(typical):
        store.ingest(ReportBatch.model_validate(make_batch("typical", rank)))
    return store


@pytest.mark.parametrize("accept", ["", OPENMETRICS])
@pytest.mark.parametrize("ranks", [1, 70])
def test_the_pieces_are_prometheus_clients_bytes(
    make_batch: Any, accept: str, ranks: int
) -> None:
    # 70: every family in several pieces; 1: all in one (a rank's own endpoint).
    store = filled(Store(Settings()), make_batch, costly=ranks // 2, typical=ranks // 2)
    store.ingest(ReportBatch.model_validate(make_batch("bare", 0, loss=None, padding_mass=None,
                                                      padding_mass_max=None, violations={})))
    encode, _ = encoder_for(accept)
    piece = max(60, MAX_SERIES_PER_RANK)  # one rank fits one piece
    pieces = len(list(_pieces(store, encode, piece)))
    assert (pieces == 1) if ranks == 1 else (pieces > 40)
    assert b"".join(exposition(store, encode, piece=piece)) == encode(new_registry(store))


def test_a_scrape_holds_what_the_budget_keeps_for_it(make_batch: Any) -> None:
    # The costliest series, so the pieces are the largest: what one scrape holds while it is
    # written (its keys, a piece built, what its connection holds of a piece or two) is within
    # GUARD_SERVER_MAX_BYTES' reserve for it. Built whole, this scrape held 30x its text.
    ranks = 600
    store = filled(Store(Settings()), make_batch, costly=ranks)
    encode, _ = encoder_for(OPENMETRICS)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        size = largest = 0
        for piece in exposition(store, encode):
            size, largest = size + len(piece), max(largest, len(piece))
        held = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert size > 7_000_000  # 600 of the costliest ranks
    reserve = ranks * _SCRAPE_BYTES_PER_RANK + _SCRAPE_PIECE_BYTES
    assert held + 2 * largest <= reserve, (held, largest, reserve)


def test_a_scrape_not_taken_is_cut_at_the_write_timeout_and_frees_its_turn(
    make_batch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # One turn; a client asks for 12 MB and reads nothing. Another scrape waits its turn in
    # vain (503); once the write timeout cuts the first, the next scrape is answered.
    # The write timeout runs from the request to the answer taken whole, rendering included:
    # 4 s leaves a 12 MB answer time enough on a loaded machine.
    settings = Settings(port=0, max_inflight_scrapes=1, scrape_wait_s=0.3, write_timeout_s=4.0)
    with EmbeddedServer(port=0, settings=settings) as server:
        filled(server.store, make_batch, costly=1000)
        stalled = socket.create_connection((server.host, server.port))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)  # its scrape has begun, and fills what the sockets hold
        busy = httpx.get(f"{server.url}/metrics", timeout=10)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
        assert "GUARD_SERVER_MAX_INFLIGHT_SCRAPES" in busy.text
        time.sleep(4.0)
        assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200
        # Reset, not closed: what the server's kernel still holds for it would trickle out
        # through a 4 KiB window for minutes.
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stalled.close()
    assert any("a connection with an answer not taken in time" in r.getMessage()
               for r in caplog.records)


def test_a_client_that_stops_reading_loses_its_turn_long_before_the_write_timeout(
    make_batch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Four turns (the default), four clients that ask for 12 MB and never read, the default
    # 60 s write timeout: each used to hold its turn 60 s, and a real scrape got 503 for as
    # long as they came back. Now a stalled answer is cut once no byte has moved for
    # GUARD_SERVER_WRITE_STALL_S, and the scrape that waited gets its turn.
    # 3 s without a byte taken: the scrape that waits gets through the others' cuts, and a
    # loaded machine's pause while the loop renders other answers is no stall.
    settings = Settings(port=0, scrape_wait_s=12.0, write_stall_s=3.0)
    assert settings.write_timeout_s == 60 and settings.max_inflight_scrapes == 4
    with EmbeddedServer(port=0, settings=settings) as server:
        filled(server.store, make_batch, costly=1000)
        stalled = []
        for _ in range(4):
            sock = socket.create_connection((server.host, server.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            stalled.append(sock)
        time.sleep(0.5)  # their scrapes have begun and hold every turn
        started = time.monotonic()
        scrape = httpx.get(f"{server.url}/metrics", timeout=60)
        waited = time.monotonic() - started
        assert scrape.status_code == 200 and waited < settings.write_timeout_s
        for sock in stalled:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
    assert any("whose client stopped taking its answer" in r.getMessage()
               for r in caplog.records)
