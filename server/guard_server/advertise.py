"""Every answer says the wire version this server reads (`Guard-Wire-Version`, an ASGI
middleware around every route): the push sink lowers its reports to it, so a newer guard
never sends this server a field or a check it does not know (docs/wire.md, "Versions")."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guard_server.wire import WIRE_VERSION, WIRE_VERSION_HEADER

__all__ = ["AdvertiseVersion"]

_HEADER = (WIRE_VERSION_HEADER.lower().encode(), str(WIRE_VERSION).encode())


class AdvertiseVersion:
    """Add the Guard-Wire-Version header to every HTTP answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; stamp the answer's head."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), _HEADER]}
            await send(message)

        await self.app(scope, receive, stamped)
