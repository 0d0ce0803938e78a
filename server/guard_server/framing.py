"""When a connection must close after its answer (an ASGI middleware around every route):

- a request framed two ways, with both Content-Length and Transfer-Encoding (RFC 9112 section
  6.3: h11 goes by the chunks, a proxy in front may go by the length, and a second request
  hidden behind the chunked body would run next on the same connection);
- a request answered before its body was read whole (a 401, 413, 415, 429 or 408 refuses it
  unread): keeping the connection would mean reading the rest first, and a client trickling
  it held the connection for as long as it trickled.

The answer says `Connection: close`, so h11 closes the connection once it is sent and the
client knows not to send another request on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CloseAfter", "ambiguous_framing"]

_CLOSE = (b"connection", b"close")


def ambiguous_framing(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Both Content-Length and Transfer-Encoding: the two framings a proxy in front and this
    server may each read differently."""
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def _has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


class CloseAfter:
    """Add `Connection: close` to the answer of a request framed two ways or answered before
    its body was read whole."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, watching how much of its body the app reads."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        close_anyway = ambiguous_framing(headers)
        unread = _has_body(headers)

        async def reading() -> Message:
            nonlocal unread
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                unread = False
            return message

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start" and (close_anyway or unread):
                message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
            await send(message)

        await self.app(scope, reading, answering)
