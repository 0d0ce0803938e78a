"""Bearer-token checks, in constant time: on report pushes (the ingest route) and, when a
token is set, on the reads that show run names, losses and messages (a middleware)."""

from __future__ import annotations

import hmac

from pydantic import SecretStr
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ReadAuth", "authorized"]

# Reads that need the token when one is set. /healthz and /readyz stay open for probes.
_READS = ("/v1/runs", "/docs", "/redoc", "/openapi.json")


def authorized(header: str | None, token: SecretStr | None) -> bool:
    """True when no token is configured, or the Authorization header carries exactly it."""
    if token is None:
        return True
    scheme, _, presented = (header or "").partition(" ")
    # compare_digest on bytes: its time depends on the lengths only, never on where they differ.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        presented.strip().encode(), token.get_secret_value().encode()
    )


class ReadAuth:
    """Answer 401 to a read of a protected path without the token (ASGI middleware).

    Installed only when the server has a token, so a server without one pays nothing.
    `/metrics` is protected when `metrics` is true (GUARD_SERVER_METRICS_TOKEN).
    """

    def __init__(self, app: ASGIApp, token: SecretStr, *, metrics: bool) -> None:
        self.app = app
        self.token = token
        self.paths = (*_READS, "/metrics") if metrics else _READS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, unless it reads a protected path without the token."""
        if scope["type"] == "http" and str(scope["path"]).startswith(self.paths):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not authorized(header, self.token):
                response = JSONResponse(
                    {"detail": "missing or wrong bearer token (this server has a token; reads "
                               "need it too)"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
