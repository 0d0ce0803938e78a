"""Scale benchmark: what scraping every rank directly costs, per 1000 ranks.

Three measurements, each of the real part:

1. One rank's embedded endpoint (a real guard on a tiny GPT, default policy, `export.serve`):
   series and bytes per scrape, and the time one scrape takes (median at the client). That is
   what each trainer pays per scrape interval, on a thread of its own.
2. A real Prometheus scraping `--ranks` endpoints that serve that rank's real exposition,
   re-labelled per rank (tests/dashboards/fleet.py), with the PodMonitor's metric relabeling
   (the endpoint's own guard_ingest_* / guard_server_* series dropped): its CPU seconds per
   scrape round, resident memory, head series and scrape durations, scaled to 1000 ranks.
3. The push path for comparison: `guard serve` holding 1024 ranks, one /metrics scrape
   (bench/ingest.py's figures, in the Ingest section).

    .venv/bin/python -m bench.scale                               # print the results
    .venv/bin/python -m bench.scale --write docs/benchmarks.md    # and update that section

Run from the repository root (`-m`: it imports tests.dashboards.fleet).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.ingest import machine, write_section
from guard_server.testing import Prometheus, prometheus_binary, run_prometheus
from tests.dashboards.fleet import Template, attached_rank, serve_fleet

HEADING = "## Scale: every rank scraped directly (bench/scale.py)"
DROP = "guard_(ingest|server)_.+"  # deploy/kubernetes/podmonitor-ranks.yaml, slurm/prometheus.yml


def embedded_endpoint(repeats: int) -> tuple[str, float]:
    """A real guard's exposition after 3 steps, and the median ms of one scrape of it."""
    times = []
    with attached_rank("scale", steps=3) as url, httpx.Client(timeout=10) as client:
        for _ in range(repeats):
            t = time.perf_counter()
            text = client.get(url).text
            times.append(time.perf_counter() - t)
    return text, statistics.median(times) * 1000


def _self_metric(prom: Prometheus, name: str) -> float:
    text = httpx.get(f"{prom.url}/metrics", timeout=10).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    if found is None:
        raise RuntimeError(f"Prometheus exposes no {name}")
    return float(found.group(1))


def prometheus_fleet(template: Template, ranks: int, interval_s: float,
                     seconds: float) -> dict[str, float]:
    """A real Prometheus scraping `ranks` endpoints every `interval_s` for `seconds`."""
    def render(rank: int, scrape: int, now: float) -> bytes:
        values = {"guard_step": 100 + scrape, "guard_last_report_timestamp_seconds": now}
        return template.render("scale", rank, values).encode()

    with serve_fleet(ranks, render) as targets, \
            run_prometheus(targets, scrape_interval_s=interval_s, drop_metrics=DROP) as prom:
        prom.wait_for(f"count(up == 1) >= {ranks}", timeout_s=120)
        cpu0, t0 = _self_metric(prom, "process_cpu_seconds_total"), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = _self_metric(prom, "process_cpu_seconds_total"), time.monotonic()
        rss = _self_metric(prom, "process_resident_memory_bytes")
        head = _self_metric(prom, "prometheus_tsdb_head_series")
        durations = [float(s["value"][1]) for s in prom.query("scrape_duration_seconds")]
        up = len(prom.query("up == 1"))
    rounds = (t1 - t0) / interval_s
    return {
        "cpu_s_per_round": (cpu1 - cpu0) / rounds,
        "cpu_cores": (cpu1 - cpu0) / (t1 - t0),
        "rss_mib": rss / 2**20,
        "head_series": head,
        "scrape_p50_ms": statistics.median(durations) * 1000,
        "scrape_p99_ms": sorted(durations)[int(len(durations) * 0.99)] * 1000,
        "up": up,
    }


def render_section(command: str, text: str, scrape_ms: float, ranks: int, interval_s: float,
                   fleet: dict[str, float], load: tuple[float, float]) -> str:
    template = Template(text)
    per_rank, own = template.series_count()
    scale = 1000 / ranks
    return "\n".join([
        HEADING,
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')})  ",
        f"Machine: {machine()}; Prometheus {_prometheus_version()}  ",
        f"1-minute load average {load[0]:.2f} before, {load[1]:.2f} after  ",
        "",
        "One rank's embedded endpoint (a real guard, default policy, after 3 steps):",
        "",
        "| series with run_id/rank | endpoint's own series (dropped by the recipe) "
        "| bytes per scrape | scrape on a kept-alive connection, median ms |",
        "|---|---|---|---|",
        f"| {per_rank} | {own} | {len(text.encode()):,} | **{scrape_ms:.2f}** |",
        "",
        f"A real Prometheus scraping {ranks} such endpoints (fleet.py) every {interval_s:g} s "
        f"({int(fleet['up'])} up), measured over the run after every target was up; "
        "with the recipe's metric relabeling (the endpoint's own series dropped); per 1000 "
        "ranks is that scaled linearly:",
        "",
        "| ranks | head series | Prometheus CPU s per scrape round | cores busy at this "
        "interval | RSS MiB | scrape p50 / p99 ms |",
        "|---|---|---|---|---|---|",
        f"| {ranks} | {int(fleet['head_series']):,} | {fleet['cpu_s_per_round']:.2f} "
        f"| {fleet['cpu_cores']:.2f} | {fleet['rss_mib']:.0f} "
        f"| {fleet['scrape_p50_ms']:.1f} / {fleet['scrape_p99_ms']:.1f} |",
        f"| per 1000 | {fleet['head_series'] * scale:,.0f} | "
        f"**{fleet['cpu_s_per_round'] * scale:.2f}** | at 15 s: "
        f"**{fleet['cpu_s_per_round'] * scale / 15:.3f}** | - | - |",
        "",
        "The push path for comparison (one `guard serve` holding every rank, one scrape): "
        "the Ingest section's scrape table.",
        "",
    ])


def _prometheus_version() -> str:
    import subprocess

    binary = prometheus_binary()
    if binary is None:
        return "not installed"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"version (\S+)", out)
    return found.group(1) if found else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1000, help="endpoints Prometheus scrapes")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape interval, seconds")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured time")
    parser.add_argument("--repeats", type=int, default=50, help="scrapes of the one endpoint")
    parser.add_argument("--write", type=Path, help="update this markdown file's Scale section")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    text, scrape_ms = embedded_endpoint(args.repeats)
    print(f"embedded endpoint: {len(text):,} bytes, {scrape_ms:.1f} ms", flush=True)
    fleet = prometheus_fleet(Template(text), args.ranks, args.interval, args.seconds)
    print(fleet, flush=True)
    command = shlex.join([".venv/bin/python", "-m", "bench.scale", *sys.argv[1:]])
    section = render_section(command, text, scrape_ms, args.ranks, args.interval, fleet,
                             (load_before, os.getloadavg()[0]))
    print(section)
    if args.write:
        write_section(args.write, section, HEADING)


if __name__ == "__main__":
    main()
