"""A large job scraped directly: many ranks, each behind its own /metrics endpoint.

`attached_rank()` attaches a real guard (default policy) to a tiny GPT and trains two steps;
`capture_exposition()` reads its embedded endpoint once: the text one rank really serves,
the endpoint's own `guard_ingest_*` / `guard_server_*` series included. `Template`
re-labels that text for any run and rank and sets chosen values, so a fleet of ranks keeps
the real names, labels, HELP and TYPE lines, and only the numbers are the test's.
`serve_fleet` serves one rendering per rank on as many loopback ports, from one asyncio loop
in a thread (a thread per port would not scale to thousands):

    template = Template(capture_exposition())
    render = lambda i, scrape, now: template.render("run", i, {"guard_step": 100 + scrape})
    with serve_fleet(1200, render) as targets:       # ["127.0.0.1:PORT", ...]
        ...

What a fleet opens is bounded: a listening socket per endpoint and at most `max_connections`
connections each (a new one closes the oldest: a scraper that timed out and reconnected
leaves its old connection behind), each closed after `idle_s` without a request.
`fleet_process` runs the fleet in a child process under an open-files limit of that bound,
so a fleet that runs out of descriptors fails alone, never the process that asked for it
(a pytest run):

    with fleet_process(1200, "tests.dashboards.scale_scenario:render") as fleet:
        fleet.targets, fleet.open_sockets()

Used by test_live_scale.py and bench/scale.py.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus 3 needs it exact
_SAMPLE = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Render = Callable[[int, int, float], bytes]
SeriesKey = tuple[str, frozenset[tuple[str, str]]]


def series_key(series: str) -> SeriesKey:
    """`guard_violations_total{check="coverage",action="warn"}` -> (name, its labels)."""
    match = _SAMPLE.fullmatch(series + " 0")
    if match is None:
        raise ValueError(f"not a series: {series!r}")
    return match.group(1), frozenset(_LABEL.findall(match.group(2) or ""))


class Template:
    """One rank's real exposition, re-rendered for another run / rank with chosen values."""

    def __init__(self, text: str) -> None:
        # Per family (in order): its HELP / TYPE lines and its samples, minus run_id / rank.
        self.families: dict[str, tuple[list[str], dict[SeriesKey, str]]] = {}
        family: tuple[list[str], dict[SeriesKey, str]] | None = None
        for line in text.splitlines():
            if line.startswith("# HELP "):
                family = self.families.setdefault(line.split()[2], ([], {}))
            if family is None:
                continue
            if line.startswith("#"):
                family[0].append(line)
                continue
            match = _SAMPLE.fullmatch(line)
            if match is None:
                raise ValueError(f"cannot read exposition line {line!r}")
            pairs = _LABEL.findall(match.group(2) or "")
            labels = frozenset((k, v) for k, v in pairs if k not in ("run_id", "rank"))
            family[1][(match.group(1), labels)] = match.group(3)

    def series_count(self) -> tuple[int, int]:
        """(series with a rank label, series of the endpoint itself) in the captured text."""
        own = sum(len(samples) for name, (_, samples) in self.families.items()
                  if name.startswith(("guard_ingest_", "guard_server_")))
        return sum(len(s) for _, s in self.families.values()) - own, own

    def render(self, run_id: str, rank: int, values: Mapping[str, float] | None = None) -> str:
        """The exposition of `rank` of `run_id`, with `values` ({series: value}) set.

        A series in `values` must exist in the template, or belong to one of its families
        (guard_halted has no sample until a rank halts); KeyError otherwise.
        """
        wanted = {series_key(s): v for s, v in (values or {}).items()}
        for name, _ in wanted:
            if name not in self.families:
                raise KeyError(f"{name}: no such family in the captured exposition")
        lines: list[str] = []
        for family, (head, samples) in self.families.items():
            lines += head
            keys = list(samples) + [k for k in wanted if k[0] == family and k not in samples]
            for key in keys:
                name, labels = key
                value = wanted.get(key, samples.get(key))
                own = family.startswith(("guard_ingest_", "guard_server_"))
                pairs = labels if own else labels | {("rank", str(rank)), ("run_id", run_id)}
                text = ",".join(f'{k}="{v}"' for k, v in sorted(pairs))
                lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")
        return "\n".join(lines) + "\n"


@contextmanager
def attached_rank(run_id: str = "captured", steps: int = 2) -> Iterator[str]:
    """One real rank: a guard on a tiny GPT (default policy, embedded endpoint), trained
    `steps` steps; yields its /metrics URL while it stays attached."""
    import torch

    import guard
    from guard.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32))
    opt = torch.optim.AdamW(model.parameters())
    policy = {"run_id": run_id, "export": {"serve": "127.0.0.1:0"}}
    # The untrained head puts mass on the padding columns [100, 128), which the default
    # policy masks and logs at every step: not this rank's business.
    log = logging.getLogger("guard")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with guard.attach(model, vocab_size=100, optimizer=opt, policy=policy) as g:
            for _ in range(steps):
                x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
                _, loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            if g.metrics_url is None:
                raise RuntimeError("the guard's embedded endpoint did not start")
            yield g.metrics_url
    finally:
        log.setLevel(level)


def capture_exposition(run_id: str = "captured", steps: int = 2) -> str:
    """The text exposition of one real rank (`attached_rank`)."""
    import httpx

    with attached_rank(run_id, steps) as url:
        text: str = httpx.get(url, timeout=10).text
    return text


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  body: Callable[[], bytes], idle_s: float) -> None:
    # HTTP/1.1 keep-alive, as Prometheus scrapes: one GET head after another, no bodies; a
    # connection without a request for idle_s is closed.
    try:
        while head := await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle_s):
            found = head.split(b" ", 2)[1] == b"/metrics"
            payload = body() if found else b"not found\n"
            status = b"200 OK" if found else b"404 Not Found"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + CONTENT_TYPE.encode()
                         + b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n"
                         + payload)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, IndexError, TimeoutError):
        pass
    finally:
        writer.close()


@contextmanager
def serve_fleet(count: int, render: Render, host: str = "127.0.0.1", *,
                max_connections: int = 2, idle_s: float = 30.0) -> Iterator[list[str]]:
    """Serve `render(i, scrape, time.time())` for i in range(count), each on its own port.

    `scrape` counts the GETs of /metrics on endpoint i, from 1. Yields the "host:port" of
    each endpoint in order; everything is closed on exit. At most `max_connections` are open
    per endpoint and none stays idle past `idle_s` (the module docstring says why).
    """
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    servers: list[asyncio.Server] = []
    scrapes = [0] * count
    held: list[deque[asyncio.StreamWriter]] = [deque() for _ in range(count)]

    failed: list[BaseException] = []

    def endpoint(i: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                      Awaitable[None]]:
        def body() -> bytes:
            scrapes[i] += 1
            return render(i, scrapes[i], time.time())

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            mine = held[i]
            if len(mine) >= max_connections:
                mine.popleft().close()  # its reader sees the end and its task finishes
            mine.append(writer)
            try:
                await _answer(reader, writer, body, idle_s)
            finally:
                if writer in mine:
                    mine.remove(writer)

        return connected

    async def start() -> None:
        for i in range(count):
            servers.append(await asyncio.start_server(endpoint(i), host, 0))

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as e:  # e.g. out of file descriptors: re-raised in the caller
            failed.append(e)
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="fleet", daemon=True)
    thread.start()
    try:
        if not ready.wait(60) or failed:
            raise RuntimeError(f"the fleet of {count} endpoints did not start: {failed}")
        yield [f"{host}:{s.sockets[0].getsockname()[1]}" for s in servers]
    finally:
        async def stop() -> None:
            for server in servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if thread.is_alive() and ready.is_set():  # closes what did start, on failure too
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


# Descriptors a process needs besides its sockets (the interpreter, torch's libraries, pipes).
SPARE_FILES = 256


def files_bound(count: int, max_connections: int) -> int:
    """The most descriptors a fleet of `count` endpoints holds, spare ones included."""
    return count * (1 + max_connections) + SPARE_FILES


@dataclass
class Fleet:
    """A fleet served by a child process: its targets, and what it holds open."""

    targets: list[str]
    process: subprocess.Popen[str]

    def open_sockets(self) -> int:
        """Sockets the child holds now, listening and connected (Linux: /proc/PID/fd)."""
        fds = Path(f"/proc/{self.process.pid}/fd")
        found = 0
        for fd in fds.iterdir():
            try:
                found += os.readlink(fd).startswith("socket:")
            except OSError:  # closed since the listing
                continue
        return found


@contextmanager
def fleet_process(count: int, scenario: str, *, max_connections: int = 2,
                  idle_s: float = 30.0, start_timeout_s: float = 300.0) -> Iterator[Fleet]:
    """`serve_fleet(count, render)` in a child process, `render` made by `scenario`
    ("module:function", a function of no arguments run in the child), under an open-files
    limit of `files_bound(count, max_connections)`. The child exits when this context ends,
    or when its parent dies (its stdin closes)."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "tests.dashboards.fleet", "--count", str(count),
           "--scenario", scenario, "--max-connections", str(max_connections),
           "--idle-s", str(idle_s)]
    with subprocess.Popen(cmd, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as process:
        assert process.stdin is not None and process.stdout is not None
        try:
            ready = threading.Timer(start_timeout_s, process.kill)  # a child that never answers
            ready.start()
            try:
                line = process.stdout.readline()
            finally:
                ready.cancel()
            if not line:
                raise RuntimeError(f"the fleet process exited ({process.wait()}) before "
                                   "serving; its stderr is above")
            yield Fleet(json.loads(line), process)
        finally:
            process.stdin.close()  # the child's signal to stop
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def _child(argv: list[str] | None = None) -> None:
    """`python -m tests.dashboards.fleet`: serve a fleet until stdin closes (fleet_process)."""
    import resource

    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--scenario", required=True)
    p.add_argument("--max-connections", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=30.0)
    args = p.parse_args(argv)
    limit = files_bound(args.count, args.max_connections)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    module, _, function = args.scenario.partition(":")
    render: Render = getattr(importlib.import_module(module), function)()
    with serve_fleet(args.count, render, max_connections=args.max_connections,
                     idle_s=args.idle_s) as targets:
        print(json.dumps(targets), flush=True)
        sys.stdin.read()  # until the parent closes it, or dies
        # Thousands of sockets: the OS closes them all at once, where closing them one by one
        # on a loop that may be behind could outlast the parent's wait.
        os._exit(0)


if __name__ == "__main__":
    _child()
