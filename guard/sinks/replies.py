"""What the push sink makes of a server's answer, or of its absence: the answer read within a
bound, how long a 429 asks to wait, which failures will not heal by retrying, and what the
log says about them (never a credential, never an answer's text unquoted)."""

from __future__ import annotations

import contextlib
import email.utils
import logging
import os
import ssl
import time
import urllib.parse
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import cast

import httpx

from guard.quote import quote
from guard_server.wire import WIRE_VERSION_HEADER

__all__ = ["Answer", "certificate_problem", "certificate_refused", "failure", "read_answer",
           "redact", "refusal", "retry_after", "split_credentials", "unusable"]

log = logging.getLogger("guard")

# A Retry-After is honoured up to this; a longer one (or a forged one) would silence the rank.
_RETRY_AFTER_MAX_S = 60.0
# Characters of a refusal's text that reach the log, quoted (a server's answer can hold
# newlines that would forge log lines of their own).
_SHOWN_CHARS = 200


@dataclass(frozen=True)
class Answer:
    """The part of an HTTP answer the sink uses: its status, its Retry-After, its first bytes."""

    status: int
    retry_after_s: float | None
    text: str
    wire_version: str | None = None  # its Guard-Wire-Version header, as sent


async def read_answer(client: httpx.AsyncClient, request: httpx.Request,
                      max_bytes: int) -> Answer:
    """Send `request`; read at most `max_bytes` of the answer's body, as it came over the wire
    (no decompression: a small gzip body can inflate a thousandfold), and close the rest
    unread (a server answering 256 MiB grew the trainer by ~580 MiB when read whole)."""
    response = await client.send(request, stream=True)
    head = bytearray()
    # Closed here, not by the loop's finaliser: the push thread's loop runs only in its calls.
    chunks = cast(AsyncGenerator[bytes, None], response.aiter_raw())
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                head += chunk[: max_bytes - len(head)]
                if len(head) >= max_bytes:
                    break
    finally:
        await response.aclose()  # what is left unread: the connection is closed, not reused
    return Answer(response.status_code, retry_after(response),
                  head.decode("utf-8", errors="replace"),
                  response.headers.get(WIRE_VERSION_HEADER))


def retry_after(response: httpx.Response) -> float | None:
    """The seconds a 429 / 503 asks to wait (delta-seconds or an HTTP date), at most
    _RETRY_AFTER_MAX_S; None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):  # a year of 20 digits: OverflowError
            return None
    return min(max(seconds, 0.0), _RETRY_AFTER_MAX_S)


def _under(error: BaseException, wanted: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception of `error`'s chain (itself, then what caused it) that is `wanted`:
    httpx keeps the OS's and ssl's errors a few causes down."""
    seen: BaseException | None = error
    while seen is not None and not wanted(seen):
        seen = seen.__cause__ or seen.__context__
    return seen


def certificate_problem(error: BaseException) -> str | None:
    """Why the server's TLS certificate was refused, when that is what `error` is: a wrong
    name or an unknown issuer does not heal by retrying."""
    seen = _under(error, lambda e: isinstance(e, ssl.SSLCertVerificationError))
    if not isinstance(seen, ssl.SSLCertVerificationError):
        return None
    return str(seen.verify_message or seen)


def failure(error: BaseException) -> str:
    """`error` and the OS's reason under it ("ConnectError: ... (Connection refused)")."""
    inner = _under(error, lambda e: isinstance(e, OSError) and bool(e.errno))
    code = inner.errno if isinstance(inner, OSError) else None  # < 0: a getaddrinfo error
    os_error = os.strerror(code) if code and code > 0 else getattr(inner, "strerror", None)
    return f"{type(error).__name__}: {error}" + (f" ({os_error})" if os_error else "")


def refusal(where: str, count: int, answer: Answer, *, token_sent: bool) -> str:
    """The error for a push the server refused for good: what to do about it."""
    head = f"{where} rejected {count} reports (HTTP {answer.status})"
    if answer.status in (401, 403):
        return (f"{head}: the server wants a token and the trainer sent "
                f"{'a wrong one' if token_sent else 'none'}; set GUARD_TOKEN in the trainer's "
                "environment to the server's token (docs/server.md); dropped")
    return f"{head}: the server said {quote(answer.text, _SHOWN_CHARS)}; dropped"


def certificate_refused(where: str, count: int, why: str) -> str:
    """The error for a push whose server showed a TLS certificate the trainer refuses."""
    return (f"{where}: the server's TLS certificate is refused ({why}); retrying will not "
            f"heal this: fix the certificate (its name must be the URL's host) or the URL, or "
            f"trust its issuer with SSL_CERT_FILE; {count} reports dropped")


def unusable(where: str, count: int, why: str) -> str:
    """The error for a push that failed in a way nothing expects (an answer no one can read):
    retrying would fail the same way."""
    return (f"{where}: a push failed in a way retrying will not heal ({quote(why, 300)}); "
            f"{count} reports dropped")


def redact(url: str) -> str:
    """`url` without the credentials of its user-info part, for logs: http://***@host/."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{_host_port(parts)}"))


def split_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """`url` without its user-info, and that user-info as basic auth: handed to httpx inside
    the URL, it reached httpx's own INFO log line of every request."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    auth = httpx.BasicAuth(urllib.parse.unquote(parts.username or ""),
                           urllib.parse.unquote(parts.password or ""))
    return urllib.parse.urlunsplit(parts._replace(netloc=_host_port(parts))), auth


def _host_port(parts: urllib.parse.SplitResult) -> str:
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return host if parts.port is None else f"{host}:{parts.port}"
