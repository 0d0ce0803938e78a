"""GET /metrics written a piece at a time: each family's samples for a few thousand series,
encoded by prometheus_client's own encoder and handed on to the connection, which takes most
of it before the next piece is built.

Built whole, one scrape of the costliest ranks the caps admit (393,190 series, 86 MB of
text) grew the server by 291 MiB, more than GUARD_SERVER_MAX_BYTES; 8 at once, by eight
times that. Written in pieces, a scrape holds the sorted (run_id, rank) keys, one piece's
samples and text, and what the connection has not taken yet of the chunk before (the writer
waits for it), and it reads each piece's reports when it writes them, so it pins no report a
newer one replaced.
The bytes are prometheus_client's, piece by piece (tests/server/test_exposition.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from guard_server.collector import family, server_families
from guard_server.families import MAX_SERIES_PER_RANK, PER_RANK, Family
from guard_server.store import Store

__all__ = ["Encoder", "PIECE_SAMPLES", "SEND_BYTES", "exposition"]  # noqa: RUF022 - sorted(), as test_isolation

Encoder = Callable[[Collector], bytes]

# Samples encoded at a time: a piece of the costliest series (220-byte lines) is ~0.45 MB of
# text and ~2 MB while it is built; its own overhead (an encoder call, a thread hop) is a
# fraction of a percent of its time.
PIECE_SAMPLES = 2048
# Bytes handed to the connection at a time (at least; a piece more at most).
SEND_BYTES = 128 << 10


class _Families(Collector):
    """Families to hand an encoder, which asks any Collector for them."""

    def __init__(self, *families: Metric) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(store: Store, encode: Encoder,
               piece: int = PIECE_SAMPLES) -> Generator[bytes, None, None]:
    """The bytes `encode` would write for the store's families, built a piece of at most
    about `piece` samples at a time and handed on in chunks of SEND_BYTES or more."""
    # Each chunk is a hop to the thread pool and a write: a scrape of a few ranks goes in one,
    # not in the 25 pieces it is built in (as 25, it cost 3-5x the CPU of the whole scrape).
    chunk: list[bytes] = []
    size = 0
    for text in _pieces(store, encode, piece):
        chunk.append(text)
        size += len(text)
        if size >= SEND_BYTES:
            yield b"".join(chunk)
            chunk, size = [], 0
    yield b"".join(chunk)


def _pieces(store: Store, encode: Encoder, piece: int) -> Iterator[bytes]:
    keys = store.rank_keys()
    if len(keys) * MAX_SERIES_PER_RANK <= piece:
        # All of it fits one piece (a rank's own endpoint): one encoder call, as before the
        # pieces, not two for each family.
        rows = store.latest(keys)
        yield encode(_Families(*(family(f, rows) for f in PER_RANK), *_server(store, keys)))
        return
    for f in PER_RANK:
        head, eof = _framing(f, encode)
        yield head
        ranks = max(1, piece // f.most)
        for start in range(0, len(keys), ranks):
            text = encode(_Families(family(f, store.latest(keys[start:start + ranks]))))
            # The encoder writes the family's HELP and TYPE lines (and OpenMetrics' # EOF)
            # around each piece; the exposition has them once.
            yield text[len(head):len(text) - len(eof)]
    yield encode(_Families(*_server(store, keys)))


def _server(store: Store, keys: list[tuple[str, int]]) -> list[Metric]:
    reports, held = store.totals()
    runs = len({run_id for run_id, _ in keys})
    return server_families(reports, store.rejections.snapshot(), runs, len(keys), held,
                           store.unknown.snapshot())


def _framing(f: Family, encode: Encoder) -> tuple[bytes, bytes]:
    """What `encode` writes before a family's samples (HELP, TYPE) and after them (# EOF in
    OpenMetrics, nothing in the text format)."""
    empty = encode(_Families(family(f, ())))
    eof = b"# EOF\n" if empty.endswith(b"# EOF\n") else b""
    return empty[:len(empty) - len(eof)], eof
