"""Running the app under uvicorn: the blocking `serve()` behind `guard serve`."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from guard_server.accepting import (
    CappedListener,
    quiet_accept_errors,
    raise_fd_limit,
    trainer_connections,
)
from guard_server.app import create_app
from guard_server.connections import guarded_protocol
from guard_server.listen import server_socket
from guard_server.settings import Settings
from guard_server.throttle import Throttle
from guard_server.wire import WIRE_VERSION, WIRE_VERSION_HEADER

log = logging.getLogger("guard_server")

__all__ = ["QuietAcceptServer", "is_loopback", "serve", "uvicorn_config"]


def uvicorn_config(
    app: FastAPI, settings: Settings, sock: socket.socket, *, host: str, port: int,
    own_logging: bool, trainer: bool = False,
) -> tuple[uvicorn.Config, socket.socket]:
    """One uvicorn worker for `app`, and the socket to serve it from: `sock` (bound), holding
    at most the connections the process has room for. `own_logging=False` leaves the host's
    logging alone; `trainer` (the training process's own endpoint) takes a share of its
    descriptors and never raises its open-files limit."""
    # A single worker on purpose: the state lives in this process's memory, so a second worker
    # would hold a different half of the ranks and each scrape would see one half.
    extra: dict[str, Any] = {} if own_logging else {"log_config": None}
    if settings.ssl_certfile is not None:
        extra |= {"ssl_certfile": str(settings.ssl_certfile),
                  "ssl_keyfile": str(settings.ssl_keyfile)}
    room = (trainer_connections(settings.max_connections) if trainer
            else raise_fd_limit(settings.max_connections))
    if room < settings.max_connections and not trainer:
        log.warning("guard server: the open-files limit leaves room for %d connections, not "
                    "GUARD_SERVER_MAX_CONNECTIONS=%d; raise `ulimit -n`", room,
                    settings.max_connections)
    cap = min(room, settings.max_connections)
    said = Throttle(log, logging.WARNING)
    why = (f"the trainer's share, 1/16 of its open-files limit: {cap}" if trainer
           else f"GUARD_SERVER_MAX_CONNECTIONS={cap}")
    listener = CappedListener(sock, cap, lambda: said.say(
        "over", f"guard server: closed a connection over the connection limit ({why})"))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        workers=1,
        loop="asyncio",
        lifespan="on",
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=5,
        http=guarded_protocol(settings.read_timeout_s, settings.write_timeout_s,
                              settings.write_stall_s),
        # uvicorn takes whole seconds here (it passes the value to call_later unchanged).
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
        # Every answer says the wire version this server reads: the push sink lowers its
        # reports to it (docs/wire.md, "Versions").
        headers=[(WIRE_VERSION_HEADER, str(WIRE_VERSION))],
        **extra,
    )
    return config, listener


class QuietAcceptServer(uvicorn.Server):
    """uvicorn's server, whose loop says an accept() failing for want of descriptors once a
    minute (guard_server/accepting.py)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets)


class _Server(QuietAcceptServer):
    """`guard serve`'s, saying where it listens: uvicorn says so only for sockets it bound."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            scheme = "https" if self.config.ssl else "http"
            where = f"[{host}]" if ":" in host else host
            logging.getLogger("uvicorn.error").info(
                "guard server listening on %s://%s:%d (Ctrl-C to stop)", scheme, where, port)


def serve(
    host: str | None = None, port: int | None = None, settings: Settings | None = None
) -> None:
    """Serve until SIGINT/SIGTERM; host and port default to GUARD_SERVER_HOST/PORT.
    AddressError, before anything starts, when it cannot listen there."""
    overrides = {key: val for key, val in {"host": host, "port": port}.items() if val is not None}
    settings = Settings(**overrides) if settings is None else settings.model_copy(update=overrides)
    # Bound first: a bad host or a taken port is one error, not a warning about listening
    # followed by uvicorn's "startup complete" and a raw bind error.
    sock = server_socket(settings.host, settings.port)
    config, sock = uvicorn_config(create_app(settings), settings, sock, host=settings.host,
                                  port=settings.port, own_logging=True)
    _warn_if_exposed(settings)
    try:
        _Server(config).run(sockets=[sock])
    finally:
        sock.close()


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _warn_if_exposed(settings: Settings) -> None:
    # Beyond loopback, anyone who can reach the port can write reports and read run names,
    # losses and messages unless there is a token, and read the token off the wire without TLS.
    if is_loopback(settings.host):
        return
    if settings.token is None:
        log.warning("guard server: listening on %s with no token: anyone who can reach it can "
                    "push reports and read every run; set GUARD_TOKEN", settings.host)
    if settings.ssl_certfile is None:
        log.warning("guard server: listening on %s without TLS: tokens and reports cross the "
                    "network in clear; set GUARD_SERVER_SSL_CERTFILE and GUARD_SERVER_SSL_KEYFILE "
                    "(or put a TLS proxy in front)", settings.host)
