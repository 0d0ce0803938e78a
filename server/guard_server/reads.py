"""Reads that take turns (GUARD_SERVER_MAX_INFLIGHT_READS): the pages and the JSON pages of a
run, each built whole (bounded in bytes) in the thread pool and then handed to its connection
64 KiB at a time, its turn held until the client has taken all but the last of it (uvicorn
waits for that before each piece). So what a slow reader holds is one of the turns the byte
budget keeps room for (Settings.read_bytes), and a reader that stops loses its turn once none
of its answer moves for GUARD_SERVER_WRITE_STALL_S; an answer handed over whole stayed with
its connection until the write timeout, outside every bound (twelve readers of a 7.9 MiB list
of runs that never read grew the server by 259 MiB)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from guard_server.errors import BusyError
from guard_server.limits import Turns

__all__ = ["READ_WAIT_S", "SEND_BYTES", "in_turn", "reads_busy"]

# How long a read waits for a turn: a page reloads itself every 5 s (page/render.py).
READ_WAIT_S = 5.0
# Bytes handed to the connection at a time: uvicorn's high-water mark, so each waits for the
# client to have taken the one before.
SEND_BYTES = 64 << 10


def reads_busy(limit: int, waited_s: float) -> BusyError:
    return BusyError(limit, waited_s, setting="MAX_INFLIGHT_READS",
                     serving="answering {limit} reads", consequence="this one was not begun")


class _Held(StreamingResponse):
    """`answer`'s status, headers and body, the body a piece at a time; the turn given back
    once it is taken or the client is gone."""

    def __init__(self, answer: Response, turn: AsyncExitStack) -> None:
        super().__init__(_pieces(bytes(answer.body)), status_code=answer.status_code)
        self.raw_headers = answer.raw_headers  # with its Content-Length
        self.turn = turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.turn.aclose()


async def _pieces(body: bytes) -> AsyncIterator[bytes]:
    for at in range(0, len(body), SEND_BYTES):
        yield body[at:at + SEND_BYTES]


async def in_turn(turns: Turns, build: Callable[[], Response],
                  busy: Callable[[BusyError], Response]) -> Response:
    """`build()`'s answer, built in the thread pool in a turn of `turns` and held until taken;
    `busy(error)` when no turn frees in time."""
    turn = AsyncExitStack()
    try:
        await turn.enter_async_context(turns.turn())
    except BusyError as exc:
        return busy(exc)
    try:
        answer = await run_in_threadpool(build)
    except BaseException:
        await turn.aclose()
        raise
    return _Held(answer, turn)
