"""Reading a request body under a byte limit, whatever its Content-Length claims."""

from __future__ import annotations

from starlette.requests import Request

from guard_server.errors import BodyTooLargeError

__all__ = ["read_body"]


async def read_body(request: Request, limit: int) -> bytes:
    """Return the whole body, or raise BodyTooLargeError as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        # Refuse before reading a byte; the header is honest more often than not.
        raise BodyTooLargeError(limit, int(declared))
    # Chunked bodies (no Content-Length) and lying headers are caught here, chunk by chunk,
    # so at most `limit` bytes plus one chunk are ever held.
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(limit, size)
        chunks.append(chunk)
    return b"".join(chunks)
