"""Connection hygiene for uvicorn's h11 protocol: a deadline for each request's headers, one
for its answer to be taken whole, and one for a client that stops taking its answer (no
progress: a stalled reader holds a scrape's turn). The cap on open connections is the
listening socket's (guard_server/accepting.py).

uvicorn bounds neither: a connection that never sends a byte stays open forever (its
keep-alive timer starts only after a first response), and every stalled client holds a file
descriptor. Here one that has not sent a complete request head within the read timeout is
closed; a slow body is the route's own timeout. A body is read only once the route asks for
it, and what uvicorn buffered of a body the route never read goes once the response is sent.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

from uvicorn.protocols.http.h11_impl import H11Protocol

from guard_server.throttle import Throttle

__all__ = ["guarded_protocol"]

log = logging.getLogger("guard_server")

# SO_LINGER on, 0 s: closing the socket resets the connection, dropping what it has not sent.
_RESET = struct.pack("ii", 1, 0)
# Bytes read from a connection at a time (asyncio's default is 256 KiB).
_READ_BYTES = 64 << 10


def _cancel(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel `timer` when one is set; returns None, what its attribute holds from then on."""
    if timer is not None:
        timer.cancel()
    return None


def guarded_protocol(read_timeout_s: float, write_timeout_s: float,
                     write_stall_s: float = 5.0) -> type[H11Protocol]:
    """uvicorn's H11Protocol with a request-head deadline, an answer deadline and a progress
    deadline for the answer."""
    said = Throttle(log, logging.WARNING)
    limits = (
        f"GUARD_SERVER_READ_TIMEOUT_S={read_timeout_s}, "
        f"GUARD_SERVER_WRITE_TIMEOUT_S={write_timeout_s}, "
        f"GUARD_SERVER_WRITE_STALL_S={write_stall_s}"
    )

    def _closed(kind: str) -> None:
        said.say(kind, f"guard server: closed a connection {kind}; {limits}")

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _answer_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if hasattr(transport, "max_size"):
                # asyncio reads up to 256 KiB a recv, and a request head may come with that
                # much of its body before the route has looked at it.
                transport.max_size = _READ_BYTES
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._answered()
            self._moving()
            super().connection_lost(exc)

        # Progress: the transport pauses the answer's writer when more than its high-water
        # mark (64 KiB) waits unsent, and resumes it once the client has taken all but the
        # low-water mark (16 KiB). Paused for write_stall_s, the client has stopped reading:
        # its answer, and the scrape turn it holds, are cut then, not at the write timeout.
        def pause_writing(self) -> None:
            super().pause_writing()
            self._moving()
            self._stall_timer = self.loop.call_later(write_stall_s, self._stalled)

        def resume_writing(self) -> None:
            self._moving()
            super().resume_writing()

        def _moving(self) -> None:
            self._stall_timer = _cancel(self._stall_timer)

        def _stalled(self) -> None:
            self._stall_timer = None
            _closed("whose client stopped taking its answer")
            self._reset()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the head has arrived; the body has the route's timeout
                if self.cycle is not before:
                    self._answered()  # an answer before it was taken whole; this one counts now
                    self._answer_timer = self.loop.call_later(write_timeout_s, self._late)
                    if self.cycle.more_body:
                        # A request whose body is still to come: read no more of it until the
                        # route asks for it (uvicorn's receive() resumes), so a body the route
                        # refuses, or makes wait for its turn, is not buffered here meanwhile.
                        self.flow.pause_reading()

        def on_response_complete(self) -> None:
            if not self.transport.get_write_buffer_size():
                self._answered()  # else the deadline still runs: the client has not taken it
            if self.cycle is not None:
                # The part of a body nobody read (a refused request) would otherwise stay with
                # the connection until its next request or its close: up to ~128 KiB each.
                self.cycle.body.clear()
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # waiting for the next request on a kept-alive connection

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(read_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            self._head_timer = _cancel(self._head_timer)

        def _answered(self) -> None:
            self._answer_timer = _cancel(self._answer_timer)

        def _late(self) -> None:
            # The request's answer (a scrape, most likely) is not written, or not taken, whole
            # in time: cut it. Reset, not closed: a close waits for the client to take what is
            # buffered, here and in the kernel, and a client that does not read never does.
            self._answer_timer = None
            written = self.cycle is None or self.cycle.response_complete
            if not written or self.transport.get_write_buffer_size():
                _closed("with an answer not taken in time")
                self._reset()

        def _reset(self) -> None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            self.transport.abort()

        def _head_timeout(self) -> None:
            self._head_timer = None
            active = self.cycle is not None and not self.cycle.response_complete
            if not active and not self.transport.is_closing():
                _closed("without a request in time")
                self.transport.close()

    return GuardedH11Protocol
