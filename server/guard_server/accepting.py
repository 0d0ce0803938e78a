"""How many connections a server may hold, and the listening socket that holds it to that.

asyncio's accept loop takes up to `backlog` (2048) waiting connections in one go and makes
transports of them later, so a cap applied once a connection is made came too late: 2,100
idle connections at the trainer's endpoint, under the usual 1,024 open-files limit, took every
descriptor of the training process (its own `open()` failed meanwhile), and each accept() that
then failed logged a traceback (~6,300 of them). Here the listening socket counts what it has
accepted and not yet closed, and closes a connection past the cap the moment it is accepted:
the server never holds more than its cap (and the listening socket, and one being closed). An
accept() that fails because the process is out of descriptors (its other files) is said once
a minute, not with a traceback each second.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
from collections.abc import Callable
from typing import Any

from guard_server.throttle import Throttle

__all__ = [  # noqa: RUF022 - sorted() order, as tests/server/test_isolation.py checks
    "CappedListener", "TRAINER_SHARE", "quiet_accept_errors", "raise_fd_limit",
    "trainer_connections",
]

log = logging.getLogger("guard_server")

# The trainer's endpoint holds at most this share of the process's soft open-files limit (64
# of the usual 1024): the training job's own files, sockets and data loaders come first.
TRAINER_SHARE = 16
# What asyncio's accept loop says when accept() fails for want of descriptors (EMFILE, ENFILE,
# ENOBUFS, ENOMEM: asyncio/selector_events.py); it then stops accepting for a second.
_OUT_OF_RESOURCE = "socket.accept() out of system resource"


class _Counted(socket.socket):
    """An accepted connection that gives its place back to its listener once closed (by its
    transport, or when collected unclosed)."""

    def __init__(self, listener: CappedListener, fd: int) -> None:
        super().__init__(listener.family, listener.type, listener.proto, fileno=fd)
        self._listener: CappedListener | None = listener

    def close(self) -> None:
        self._give_back()
        super().close()

    def detach(self) -> int:
        self._give_back()
        return super().detach()

    def __del__(self) -> None:
        self._give_back()
        super().__del__()  # type: ignore[misc]  # _socket.socket's: closes the descriptor

    def _give_back(self) -> None:
        listener = getattr(self, "_listener", None)  # unset if __init__ failed
        self._listener = None
        if listener is not None:
            listener.given_back()


class CappedListener(socket.socket):
    """`sock` (bound, not yet listening), whose accept() holds at most `cap` connections open
    at once and closes any past them at once; `refused()` is called for each of those."""

    def __init__(self, sock: socket.socket, cap: int, refused: Callable[[], None]) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.cap = cap
        self.held = 0
        self._refused = refused
        self._lock = threading.Lock()  # a connection collected unclosed gives back from any thread

    def accept(self) -> tuple[socket.socket, Any]:
        fd, address = self._accept()  # type: ignore[attr-defined]  # _socket.socket's
        with self._lock:
            full = self.held >= self.cap
            self.held += not full
        if full:
            # Closed, no answer: reading a request would cost what the cap saves.
            socket.socket(self.family, self.type, self.proto, fileno=fd).close()
            self._refused()
            # asyncio ends this turn of its accept loop on it, as when none waits: the next
            # connection is taken after whatever else the loop has ready.
            raise ConnectionAbortedError("over the connection limit")
        return _Counted(self, fd), address

    def given_back(self) -> None:
        with self._lock:
            self.held -= 1


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """On `loop`, an accept() that fails for want of descriptors is logged once a minute with
    the count, not once a second with a traceback; any other error is the loop's as before."""
    said = Throttle(log, logging.WARNING)
    before = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if context.get("message") == _OUT_OF_RESOURCE and isinstance(error, OSError):
            said.say("accept", f"guard server: cannot accept connections ({error.strerror}): "
                     "the process has no descriptor to spare (its open-files limit, ulimit -n); "
                     "it tries again every second")
        elif before is not None:
            before(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft open-files limit towards `wanted` (never past the hard limit); return
    how many connections it leaves room for (the limit less a margin for the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + 64 if hard == resource.RLIM_INFINITY else min(wanted + 64, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(soft - 64, 8)


def trainer_connections(wanted: int) -> int:
    """The connections the trainer's endpoint may hold: at most `wanted`, and at most
    1/TRAINER_SHARE of the process's soft open-files limit, which it never raises (a cap
    counted from a raised limit left the training loop 64 spare descriptors)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return min(wanted, max(8, soft // TRAINER_SHARE))
