"""Bearer-token checks, in constant time: on report pushes (the ingest route) and, when a
token is set, on the reads that show run names, losses and messages (a middleware).

A browser sends the token as HTTP Basic credentials, the token as the password: the server's
401 on a page asks for them (`WWW-Authenticate: Basic`), the browser shows its login dialog
and then sends them in the Authorization header with each request, never in the URL, so no
access log, proxy log or browser history holds the token, and no script is needed."""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Iterable

from pydantic import SecretStr
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["PAGES", "ReadAuth", "authorization", "authorized", "is_page", "read_authorized"]

# Reads that need the token when one is set. /healthz and /readyz stay open for probes.
_READS = ("/v1/runs", "/docs", "/redoc", "/openapi.json")
# The HTML pages: "/" itself (not every path starts with it: only this one) and /runs/...
PAGES = ("/runs/",)


def _same(presented: str, token: SecretStr) -> bool:
    # compare_digest on bytes: its time depends on the lengths only, never on where they differ.
    return hmac.compare_digest(presented.encode(), token.get_secret_value().encode())


def authorization(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The request's one Authorization header; None when it has none, or more than one (which
    of two is meant? A proxy in front may pass on either: refused, on reads and pushes alike)."""
    found = [value for name, value in headers if name.lower() == b"authorization"]
    return found[0].decode("latin-1") if len(found) == 1 else None


def authorized(header: str | None, token: SecretStr | None) -> bool:
    """True when no token is configured, or the Authorization header carries exactly it."""
    if token is None:
        return True
    scheme, _, presented = (header or "").partition(" ")
    return scheme.lower() == "bearer" and _same(presented.strip(), token)


def read_authorized(header: str | None, token: SecretStr | None) -> bool:
    """`authorized`, or Basic credentials whose password is the token (any user name): what a
    browser sends after its login dialog."""
    scheme, _, presented = (header or "").partition(" ")
    if token is None or scheme.lower() != "basic":
        return authorized(header, token)
    try:
        pair = base64.b64decode(presented.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return False
    _, colon, password = pair.partition(":")
    return bool(colon) and _same(password, token)


def is_page(path: str) -> bool:
    return path == "/" or path.startswith(PAGES)


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
        path = str(scope["path"]) if scope["type"] == "http" else ""
        page = is_page(path)
        protected = page or path.startswith(self.paths)
        if protected and not read_authorized(authorization(scope["headers"]), self.token):
            response = _page_401() if page else JSONResponse(
                {"detail": "missing or wrong bearer token (this server has a token; reads "
                           "need it too)"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _page_401() -> Response:
    # Imported here: the template engine loads with the first page, not with every app.
    from guard_server.page.render import page

    return page("message.html", status=401, refresh=False, back="",
                title="This server needs its token",
                text="It was started with a token (GUARD_TOKEN or GUARD_SERVER_TOKEN), and its "
                     "pages show run names, losses and messages. Give the token as the password "
                     "in your browser's login dialog (any user name): reload the page to see "
                     "the dialog again. From a script, send Authorization: Bearer <token>.",
                headers={"WWW-Authenticate": 'Basic realm="logitguard", charset="UTF-8"'})
