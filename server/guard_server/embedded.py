"""The in-process endpoint: the server app under uvicorn in a daemon thread of the trainer.

`EmbeddedServer(host, port).start()` returns the base URL, or raises: PortInUseError (an
OSError) when the port is taken, RuntimeError when uvicorn does not start in time. It never
returns None; the caller decides whether training goes on without the endpoint.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import uvicorn

from guard_server.app import create_app
from guard_server.listen import listening_socket
from guard_server.runner import QuietAcceptServer, uvicorn_config
from guard_server.scrapes import LAST_SCRAPE_WAIT_S, ScrapeClock
from guard_server.settings import Settings
from guard_server.store import Store

__all__ = ["EmbeddedServer"]


class _Server(QuietAcceptServer):
    """A uvicorn server that signals the starting thread once startup has run."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_done = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Run uvicorn's startup, then wake `start()` whether it worked or not."""
        try:
            await super().startup(sockets)
        finally:
            self.startup_done.set()


class EmbeddedServer:
    """`create_app()` served from a daemon thread; feed `.store` directly, scrape `.url`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9464,
        *,
        settings: Settings | None = None,
        store: Store | None = None,
        ingest: bool = True,
        start_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port  # 0 picks a free port; start() replaces it with the bound one
        if settings is None:
            # Quiet: the trainer's log is for training, not for uvicorn's start-up lines.
            settings = Settings(host=host, port=port, log_level="warning")
        self.settings = settings
        self.store = store if store is not None else Store(settings)
        # The trainer's endpoint passes ingest=False: its store is fed in-process only.
        self.app = create_app(settings, self.store, ingest=ingest)
        self.url: str | None = None
        self._start_timeout_s = start_timeout_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._trainer = False  # the training process's own endpoint (for_trainer)

    @classmethod
    def for_trainer(cls, host: str = "127.0.0.1", port: int = 9464) -> EmbeddedServer:
        """The trainer's endpoint: reads only (no POST /v1/reports: the guard feeds its store
        in-process), quiet, no step-rate bound (its reports are the trainer's own), and at
        most 1/16 of the process's soft open-files limit in connections."""
        settings = Settings(host=host, port=port, log_level="warning", max_step_rate=None)
        server = cls(host, port, settings=settings, ingest=False)
        server._trainer = True  # a share of the trainer's descriptors (connections.py)
        return server

    def start(self) -> str:
        """Bind and serve; return the base URL. Raises PortInUseError if the port is taken."""
        if self.url is not None:
            return self.url
        sock = listening_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config, sock = uvicorn_config(self.app, self.settings, sock, host=self.host,
                                      port=self.port, own_logging=False, trainer=self._trainer)
        server = _Server(config)
        thread = threading.Thread(
            target=server.run,
            kwargs={"sockets": [sock]},
            name=f"guard-metrics:{self.port}",
            daemon=True,  # never keeps a finished training process alive
        )
        self._server, self._thread = server, thread
        thread.start()
        if not server.startup_done.wait(self._start_timeout_s) or not server.started:
            self.stop()
            sock.close()
            raise RuntimeError(
                f"guard metrics endpoint on {self.host}:{self.port} did not start within "
                f"{self._start_timeout_s} s; training goes on without it"
            )
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        return self.url

    def last_scrape(self, most_s: float = LAST_SCRAPE_WAIT_S) -> bool | None:
        """Where something scrapes this endpoint on an interval (two scrapes seen), wait for
        its next scrape (at most twice its interval and a second, and `most_s`), so that it
        reads the state as it is now (the trainer's final report, before the process exits).
        True once one came, False when none came in time, None when nothing scrapes it."""
        scrapes: ScrapeClock = self.app.state.scrapes
        wait_s = scrapes.last_scrape_wait(most_s)
        if self.url is None or wait_s <= 0:
            return None
        return scrapes.wait_after(scrapes.clock(), wait_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and join the thread (at most `timeout_s`); idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        self.url = None
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout_s)

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
