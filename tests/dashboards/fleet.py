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

Used by test_live_scale.py and bench/scale.py.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager

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
                  body: Callable[[], bytes]) -> None:
    # HTTP/1.1 keep-alive, as Prometheus scrapes: one GET head after another, no bodies.
    try:
        while head := await reader.readuntil(b"\r\n\r\n"):
            found = head.split(b" ", 2)[1] == b"/metrics"
            payload = body() if found else b"not found\n"
            status = b"200 OK" if found else b"404 Not Found"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + CONTENT_TYPE.encode()
                         + b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n"
                         + payload)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, IndexError):
        pass
    finally:
        writer.close()


@contextmanager
def serve_fleet(count: int, render: Render, host: str = "127.0.0.1") -> Iterator[list[str]]:
    """Serve `render(i, scrape, time.time())` for i in range(count), each on its own port.

    `scrape` counts the GETs of /metrics on endpoint i, from 1. Yields the "host:port" of
    each endpoint in order; everything is closed on exit.
    """
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    servers: list[asyncio.Server] = []
    scrapes = [0] * count

    failed: list[BaseException] = []

    def endpoint(i: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                      Awaitable[None]]:
        def body() -> bytes:
            scrapes[i] += 1
            return render(i, scrapes[i], time.time())

        return lambda reader, writer: _answer(reader, writer, body)

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
