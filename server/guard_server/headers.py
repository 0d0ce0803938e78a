"""Headers every answer carries unless its route set its own (an ASGI middleware around every
route, the pages' 401 and the validation errors included):

- `X-Content-Type-Options: nosniff`: a browser never reads an answer as other than its type
  says (a 422 that quotes a client's query, a JSON read holding a trainer's messages);
- `Cache-Control: no-store`: run names, losses and messages, read under a token, are kept by
  no cache on the way.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AnswerHeaders"]

_DEFAULTS = ((b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-store"))


class AnswerHeaders:
    """Add each of _DEFAULTS to an answer that does not set it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, completing its answer's headers."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.lower() for name, _ in headers}
                headers += [pair for pair in _DEFAULTS if pair[0] not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, answering)
