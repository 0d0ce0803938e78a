"""The embedded /metrics endpoint: the server's own app, in a uvicorn thread of the trainer,
fed in-process (no HTTP on the training side)."""

from __future__ import annotations

import logging
from typing import Any

from guard_server.wire import ReportBatch

__all__ = ["EmbeddedSink", "start_embedded"]

log = logging.getLogger("guard")


class EmbeddedSink:
    """Stores each batch in the app's store: built with the wire's models, it is valid as is.

    Owns the server it starts from (host, port); given a running `server`, shares it (the
    demo feeds several guards into one endpoint) and leaves it running at close.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, server: Any = None) -> None:
        # Imported here: the library needs fastapi only when it serves (README.md, "Metrics").
        from guard_server.embedded import EmbeddedServer

        self._owned = server is None
        self.server = EmbeddedServer.for_trainer(host, port) if server is None else server
        self.url: str = self.server.start()

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def emit(self, batch: ReportBatch) -> None:
        self.server.store.ingest(batch)

    def close(self, timeout: float = 5.0) -> None:
        if self._owned:
            # The final report is stored: where Prometheus scrapes this endpoint, it reads it
            # once more, so the rank ends finished there rather than gone (GuardRankSilent).
            if self.server.last_scrape() is False:
                log.info("no scrape of %s came after the last report; Prometheus may "
                         "not have seen this rank finish", self.metrics_url)
            self.server.stop(timeout)


def start_embedded(host: str, port: int) -> EmbeddedSink | None:
    """The sink, or None with a warning when it cannot serve: training goes on either way."""
    try:
        sink = EmbeddedSink(host, port)
    except ImportError as e:
        log.warning("the embedded /metrics endpoint needs the serve extra "
                    "(pip install 'logitguard[serve]'): %s; continuing without it", e)
        return None
    except OSError as e:  # PortInUseError is an OSError
        log.warning("cannot serve /metrics on %s:%d (%s); continuing without it. Set "
                    "export.serve to another host:port, or null.", host, port, e)
        return None
    except (RuntimeError, ValueError) as e:  # did not start in time; a bad GUARD_SERVER_* value
        log.warning("no /metrics endpoint: %s; continuing without it", e)
        return None
    log.info("metrics at %s/metrics", sink.url)
    return sink
