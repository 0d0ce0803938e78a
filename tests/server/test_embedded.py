"""EmbeddedServer: the app under uvicorn in a daemon thread, fed in-process."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from typing import Any

import httpx
import pytest

from guard_server import EmbeddedServer, PortInUseError, ReportBatch, Settings


def test_in_process_ingest_shows_on_the_scrape(make_batch: Any) -> None:
    root_handlers = list(logging.getLogger().handlers)
    with EmbeddedServer(port=0, settings=Settings(port=0)) as server:
        assert server.url == f"http://127.0.0.1:{server.port}" and server.port != 0
        server.store.ingest(ReportBatch.model_validate(make_batch("emb", 2, steps=(41,))))
        text = httpx.get(f"{server.url}/metrics").text
        assert 'guard_step{rank="2",run_id="emb"} 41.0' in text
        (thread,) = [t for t in threading.enumerate() if t.name == f"guard-metrics:{server.port}"]
        assert thread.daemon
    assert not thread.is_alive()
    assert logging.getLogger().handlers == root_handlers  # the trainer's logging is left alone


def test_a_taken_port_raises_port_in_use() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = EmbeddedServer(port=port, settings=Settings(port=port))
        with pytest.raises(PortInUseError) as info:
            server.start()
    assert isinstance(info.value, OSError) and info.value.errno == errno.EADDRINUSE
    assert f"127.0.0.1:{port}" in str(info.value)
    assert server.url is None
    server.stop()  # harmless when never started


def test_stop_is_idempotent_and_frees_the_port() -> None:
    server = EmbeddedServer(port=0, settings=Settings(port=0))
    url = server.start()
    assert server.start() == url  # already running: same URL
    port = server.port
    server.stop()
    server.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/healthz", timeout=1)
    again = EmbeddedServer(port=port, settings=Settings(port=port))
    assert again.start() == url
    again.stop()


def test_two_servers_in_one_process_keep_apart(make_batch: Any) -> None:
    with (
        EmbeddedServer(port=0, settings=Settings(port=0)) as one,
        EmbeddedServer(port=0, settings=Settings(port=0)) as two,
    ):
        one.store.ingest(ReportBatch.model_validate(make_batch("only-one")))
        assert "only-one" in httpx.get(f"{one.url}/metrics").text
        assert "only-one" not in httpx.get(f"{two.url}/metrics").text


def test_accepted_connections_send_without_nagle_delay() -> None:
    # asyncio sets TCP_NODELAY on an accepted socket only when the listening socket says
    # IPPROTO_TCP; without it each kept-alive scrape of the trainer's endpoint waited ~40 ms
    # on delayed ACK (bench/scale.py: 44 ms before, 0.7 ms after).
    import asyncio

    from guard_server.listen import listening_socket

    async def accept_one() -> int:
        sock = listening_socket("127.0.0.1", 0)
        nodelay: list[int] = []

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            nodelay.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            while not nodelay:
                await asyncio.sleep(0.01)
            writer.close()
        return nodelay[0]

    assert asyncio.run(asyncio.wait_for(accept_one(), 10)) != 0


_TRAINER = """\
import os, resource, sys, tempfile
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from guard_server import EmbeddedServer
server = EmbeddedServer.for_trainer("127.0.0.1", 0)
server.start()
print(server.port, flush=True)
sys.stdin.readline()  # the other side holds its idle connections now
files = []
try:
    for _ in range(200):
        files.append(tempfile.TemporaryFile())
except OSError:
    pass
print(len(files), flush=True)
"""


def test_the_trainers_endpoint_leaves_the_training_process_its_descriptors() -> None:
    # A training process with a 256-descriptor limit, 300 idle connections at its endpoint:
    # the endpoint holds at most 256 // 16 of them, and the loop still opens its 200 files.
    # Counted from the limit raised towards GUARD_SERVER_MAX_CONNECTIONS, it left 64 spare.
    import subprocess
    import sys

    # Its stderr: asyncio's accept() failing while the loop holds every descriptor it has.
    with subprocess.Popen([sys.executable, "-c", _TRAINER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as child:
        assert child.stdin is not None and child.stdout is not None
        idle = []
        try:
            port = int(child.stdout.readline())
            for _ in range(300):
                try:
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
            threading.Event().wait(1.0)  # accepted, and those past the cap closed
            child.stdin.write("go\n")
            child.stdin.flush()
            opened = int(child.stdout.readline())
        finally:
            for sock in idle:
                sock.close()
            child.kill()
    assert opened == 200
