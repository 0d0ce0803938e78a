"""Ingest benchmark: simulated ranks push to one guard server on loopback.

Measures step reports ingested per second, request latency (p50/p99), and the time of one
/metrics scrape holding 1024 and 16384 typical ranks, and as many of the costliest ranks as
the default caps admit (56 series each). The server runs in its own process
(`python -m guard_server`, one uvicorn worker); the ranks are asyncio tasks in this process,
each with its own httpx client and keep-alive connection, as real ranks have.

    .venv/bin/python bench/ingest.py                           # print the results
    .venv/bin/python bench/ingest.py --write docs/benchmarks.md  # and update that section
    .venv/bin/python bench/ingest.py --seconds 1 --scrape-ranks 64 --worst-series 2000  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from guard_server.families import MAX_SERIES_PER_RANK, TYPICAL_SERIES_PER_RANK, series_of
from guard_server.settings import Settings
from guard_server.testing import free_port
from guard_server.wire import ACTIONS, CHECKS, ID_KINDS, MAX_COUNT, TENSORS, WEIGHTS, StepReport

HEADING = "## Ingest (bench/ingest.py)"
BODIES_PER_RANK = 8  # cycled; later cycles repeat old steps, which the store ingests as well


@dataclass
class Scenario:
    """One load shape: `ranks` concurrent pushers, `batch` reports a request, optional pacing."""

    name: str
    ranks: int
    batch: int
    interval_s: float | None  # None: back to back (saturation); else one request per interval


@dataclass
class Result:
    """What one scenario measured."""

    scenario: Scenario
    seconds: float
    requests: int
    reports: int
    errors: int
    latencies_s: list[float]

    def row(self) -> str:
        """One markdown table row."""
        lat = sorted(self.latencies_s)
        p50 = lat[len(lat) // 2] * 1000
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
        s = self.scenario
        pace = "back to back" if s.interval_s is None else f"every {s.interval_s:g} s"
        return (
            f"| {s.name} | {s.ranks} | {s.batch} | {pace} | {self.requests / self.seconds:,.0f} | "
            f"**{self.reports / self.seconds:,.0f}** | {p50:.1f} | {p99:.1f} | {self.errors} |"
        )


def _report(step: int, event: bool) -> dict[str, object]:
    # Values as a healthy guarded rank sends them under the default policy (every field of
    # today's wire, each enabled check's violations at 0 from the start); one report in 50
    # carries a violation. Its series are families.TYPICAL_SERIES_PER_RANK (`_held_to`).
    events = [
        {
            "check": "token_range",
            "action": "warn",
            "step": step,
            "message": f"token_range on rank 0 at step {step}: 3 label ids in [50257, 50304)",
            "module": None,
        }
    ]
    violations: dict[str, dict[str, int]] = {check: {"warn": 0} for check in CHECKS}
    violations["token_range"] = {"warn": step // 50}
    return {
        "attach_id": "bench-attach-0001",
        "step": step,
        "timestamp": time.time(),
        "loss": 2.0 + 1.0 / (1 + step),
        "padding_mass": 1.2e-09,
        "padding_mass_max": 4.0e-08,
        "nonfinite": {"logits": 0, "hidden": 0, "loss": 0, "grad": 0},
        "out_of_range": {"input": 0, "label": step // 50},
        "untrained_rows": {"embedding": 0, "lm_head": 0},
        "untrained_tokens": {"input": 0, "label": 0},
        "violations": violations,
        "skipped_steps": 0,
        "halted": None,
        "vocab": {"real": 50257, "rows": 50304, "aligned": 50304},
        "dropped_reports": 0,
        "final": False,
        "events": events if event else [],
        "grad_norm": 1.25 + 1.0 / (1 + step),
        "grad_norm_top": "transformer.h.3.mlp.c_proj.weight",
        "grad_norm_top_share": 0.21,
        "logsumexp": 10.8,
        "logsumexp_max": 11.9,
        "scaler_skipped_steps": 0,
    }


def _bodies(run_id: str, rank: int, batch: int, count: int) -> list[bytes]:
    bodies = []
    for i in range(count):
        steps = range(i * batch, (i + 1) * batch)
        reports = [_report(s, s % 50 == 49) for s in steps]
        bodies.append(json.dumps({"run_id": run_id, "rank": rank, "reports": reports}).encode())
    return bodies


def _worst_body(n: int) -> bytes:
    # The rank a scrape costs most: every check with every action, a halt, every optional
    # value, a 128-character run_id and counts at 2**53 (the longest sample values).
    report = _worst_report()
    run_id = f"worst-{n // 4096:03d}".ljust(128, "x")
    return json.dumps({"run_id": run_id, "rank": n % 4096, "reports": [report]}).encode()


def _worst_report() -> dict[str, object]:
    """The costliest report: its series are families.MAX_SERIES_PER_RANK (`_held_to`)."""
    return _report(MAX_COUNT, False) | {
        "violations": {check: dict.fromkeys(ACTIONS, MAX_COUNT) for check in CHECKS},
        "halted": "nonfinite",
        "skipped_steps": MAX_COUNT,
        "dropped_reports": MAX_COUNT,
        "nonfinite": dict.fromkeys(TENSORS, MAX_COUNT),
        "out_of_range": dict.fromkeys(ID_KINDS, MAX_COUNT),
        "untrained_rows": dict.fromkeys(WEIGHTS, MAX_COUNT),
        "untrained_tokens": dict.fromkeys(ID_KINDS, MAX_COUNT),
        "scaler_skipped_steps": MAX_COUNT,
    }


def _default(setting: str) -> object:
    return Settings.model_fields[setting].default


def _held_to() -> None:
    """The bench's typical and costliest ranks are the families table's: a field added to the
    wire and not here would make the scrape figures those of a smaller rank."""
    for report, want in ((_report(0, False), TYPICAL_SERIES_PER_RANK),
                         (_worst_report(), MAX_SERIES_PER_RANK)):
        got = series_of(StepReport.model_validate(report))
        assert got == want, f"bench report has {got} series, the families table says {want}"


@contextlib.contextmanager
def server(**settings: str) -> Iterator[str]:
    """A fresh `python -m guard_server` on a free loopback port, with `settings` as
    GUARD_SERVER_* variables on top of the benchmark's; killed on exit."""
    port = free_port()
    # The saturating scenarios push ~3000 steps a second per rank, more than any model trains
    # and more than the server's step-rate bound allows; the bound is lifted for them.
    env = os.environ | {"GUARD_SERVER_LOG_LEVEL": "warning", "GUARD_SERVER_MAX_STEP_RATE": "1e9",
                        "GUARD_SERVER_MAX_RANKS": "65536"}
    env |= {f"GUARD_SERVER_{name.upper()}": value for name, value in settings.items()}
    env.pop("GUARD_TOKEN", None)
    cmd = [sys.executable, "-m", "guard_server", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("guard server did not start")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


async def _push(scenario: Scenario, url: str, seconds: float, warmup_s: float) -> Result:
    bodies = [_bodies("bench", r, scenario.batch, BODIES_PER_RANK) for r in range(scenario.ranks)]
    # One client (one keep-alive connection) per rank, as each real rank has its own. They
    # share one TLS context: building one per client costs ~10 ms of CPU each (unused here).
    tls = ssl.create_default_context()
    clients = [httpx.AsyncClient(base_url=url, timeout=30, verify=tls) for _ in bodies]
    latencies: list[float] = []
    counts = {"requests": 0, "reports": 0, "errors": 0}
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds
    headers = {"Content-Type": "application/json"}

    async def rank(r: int, client: httpx.AsyncClient) -> None:
        # Paced ranks start spread over one interval: real ranks never tick in lockstep.
        if scenario.interval_s is not None:
            await asyncio.sleep(scenario.interval_s * r / scenario.ranks)
        i = 0
        while (now := time.perf_counter()) < stop_at:
            body = bodies[r][i % BODIES_PER_RANK]
            reply = await client.post("/v1/reports", content=body, headers=headers)
            done = time.perf_counter()
            i += 1
            if now >= measure_from:
                latencies.append(done - now)
                counts["requests"] += 1
                if reply.status_code == 202:
                    counts["reports"] += scenario.batch
                else:
                    counts["errors"] += 1
            if scenario.interval_s is not None:
                await asyncio.sleep(max(0.0, scenario.interval_s - (done - now)))

    try:
        await asyncio.gather(*(rank(r, c) for r, c in enumerate(clients)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return Result(
        scenario, seconds, counts["requests"], counts["reports"], counts["errors"], latencies
    )


def scrape_times(url: str, ranks: int, repeats: int) -> dict[str, float]:
    """Load `ranks` typical ranks (4096 a run, the default per-run cap), then time GET
    /metrics (median ms) per format."""
    json_body = {"Content-Type": "application/json"}
    with httpx.Client(base_url=url, timeout=60) as client:
        for r in range(ranks):
            body = _bodies(f"scrape-{r // 4096}", r % 4096, 1, 1)[0]
            assert client.post("/v1/reports", content=body, headers=json_body).status_code == 202
        return _time_scrapes(client, repeats)


def worst_scrape_times(url: str, repeats: int) -> tuple[int, dict[str, float]]:
    """Load the costliest ranks until the server's caps refuse one (429), then time GET
    /metrics as `scrape_times` does; return the ranks held and the times."""
    json_body = {"Content-Type": "application/json"}
    with httpx.Client(base_url=url, timeout=60) as client:
        ranks = 0
        while (status := client.post("/v1/reports", content=_worst_body(ranks),
                                     headers=json_body).status_code) == 202:
            ranks += 1
        assert status == 429, status
        return ranks, _time_scrapes(client, repeats)


def _time_scrapes(client: httpx.Client, repeats: int) -> dict[str, float]:
    """Median ms of GET /metrics per format, with the series and bytes of the last reply."""
    formats = {
        "text (0.0.4)": {},
        "OpenMetrics (Prometheus' default Accept)": {
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"
        },
    }
    medians = {}
    for name, headers in formats.items():
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            reply = client.get("/metrics", headers=headers)
            times.append(time.perf_counter() - t)
            assert reply.status_code == 200
        series = sum(1 for line in reply.text.splitlines() if line.startswith("guard_"))
        medians[name] = statistics.median(times) * 1000
        medians[f"{name} series"] = series
        medians[f"{name} bytes"] = len(reply.content)
    return medians


def machine() -> str:
    """CPU model, core count, Python and library versions."""
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        found = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
        model = found.group(1).strip() if found else model
    libs = ["fastapi", "starlette", "uvicorn", "pydantic", "prometheus-client", "httpx", "h11"]
    versions = ", ".join(f"{lib} {importlib.metadata.version(lib)}" for lib in libs)
    return f"{model}, {os.cpu_count()} cores; Python {platform.python_version()}; {versions}"


def render(
    results: list[Result],
    scrapes: dict[str, dict[str, float]],
    command: str,
    load: tuple[float, float],
) -> str:
    """The markdown section for docs/benchmarks.md."""
    lines = [
        HEADING,
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')})  ",
        f"Machine: {machine()}  ",
        f"1-minute load average {load[0]:.2f} before the run, {load[1]:.2f} after (other work "
        "on the machine lowers every figure)  ",
        "Server: `python -m guard_server` in its own process, one uvicorn worker (h11); "
        "clients: asyncio tasks in the benchmark process, one httpx client (one keep-alive "
        "connection) per rank; both share the machine's cores. Targets: >= 20,000 step "
        "reports/s; a 1024-rank scrape <= 250 ms.",
        "",
        "| scenario | ranks | reports / request | pacing | requests/s | step reports/s "
        "| p50 ms | p99 ms | non-202 |",
        "|---|---|---|---|---|---|---|---|---|",
        *(r.row() for r in results),
        "",
        "Scrape of `/metrics` (median of the repeats, wall time at the client; runs of at "
        "most 4096 ranks, the default per-run cap). Prometheus' default `scrape_timeout` is "
        "10 s; the server's default caps (GUARD_SERVER_MAX_RANKS "
        f"{_default('max_ranks')}, GUARD_SERVER_MAX_SERIES {_default('max_series')}) keep a full "
        f"scrape inside it, typical ranks ({TYPICAL_SERIES_PER_RANK} series each: a healthy "
        "rank of the default policy) or the costliest (\"worst case\": "
        f"{MAX_SERIES_PER_RANK} series each, every check with every action, a halt, every "
        "optional value, 128-character run_ids, counts at 2**53; as many as the caps admit):",
        "",
        "| ranks | format | series | bytes | median ms |",
        "|---|---|---|---|---|",
        *(
            f"| {ranks} | {name} | {int(scrape[f'{name} series'])} "
            f"| {int(scrape[f'{name} bytes']):,} | **{scrape[name]:.0f}** |"
            for ranks, scrape in scrapes.items()
            for name in scrape
            if not name.endswith((" series", " bytes"))
        ),
        "",
        "Latency under back-to-back load is mostly queueing (all ranks wait on one worker); the "
        "paced row is what a rank sees at a realistic push rate.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str, heading: str = HEADING) -> None:
    """Replace the section under `heading` in `path` (or append it), keeping the others."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    """Run every scenario on a fresh server each, then the scrape; print and optionally write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured time per scenario")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured lead-in per scenario")
    parser.add_argument("--scrape-ranks", default="1024,16384",
                        help="comma-separated rank counts, one scrape measurement each")
    parser.add_argument("--scrape-repeats", type=int, default=5)
    parser.add_argument("--worst-series", type=int,
                        help="GUARD_SERVER_MAX_SERIES for the worst-case scrape (default: the "
                        "server's own; smaller for a quick run)")
    parser.add_argument("--write", type=Path, help="update this markdown file's Ingest section")
    args = parser.parse_args()
    _held_to()
    scenarios = [
        Scenario("saturate, batched", ranks=16, batch=100, interval_s=None),
        Scenario("saturate, batched", ranks=64, batch=100, interval_s=None),
        Scenario("saturate, one report a request", ranks=16, batch=1, interval_s=None),
        Scenario("paced, 256 ranks", ranks=256, batch=10, interval_s=1.0),
    ]
    load_before = os.getloadavg()[0]
    results = []
    for scenario in scenarios:
        with server() as url:
            results.append(asyncio.run(_push(scenario, url, args.seconds, args.warmup)))
        print(results[-1].row(), flush=True)
    scrapes = {}
    for ranks in map(int, args.scrape_ranks.split(",")):
        # Under the server's own rank cap, whose scrape reserve (Settings.inflight_bytes)
        # leaves the byte budget room for 16,384 typical ranks (65,536 would not).
        with server(max_ranks=str(_default("max_ranks"))) as url:
            scrapes[str(ranks)] = scrape_times(url, ranks, args.scrape_repeats)
        print(ranks, {k: round(v) for k, v in scrapes[str(ranks)].items()}, flush=True)
    # The worst case under the server's own caps: MAX_RANKS back at its default.
    caps = {"max_ranks": str(_default("max_ranks"))}
    if args.worst_series is not None:
        caps["max_series"] = str(args.worst_series)
    with server(**caps) as url:
        held, times = worst_scrape_times(url, args.scrape_repeats)
    scrapes[f"{held} worst case"] = times
    print(held, "worst case", {k: round(v) for k, v in times.items()}, flush=True)
    command = shlex.join([".venv/bin/python", "bench/ingest.py", *sys.argv[1:]])
    load = (load_before, os.getloadavg()[0])
    section = render(results, scrapes, command, load)
    print(section)
    if args.write:
        write_section(args.write, section)


if __name__ == "__main__":
    main()
