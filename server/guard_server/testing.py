"""Real parts for tests: a free loopback port, a self-signed TLS certificate and a real
Prometheus scraping given targets.

Not imported by the server itself; shared by tests/server and the library's end-to-end tests:

    with run_prometheus(["127.0.0.1:9464"]) as prom:
        series = prom.wait_for('guard_step{run_id="r1", rank="0"}', timeout_s=30)
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["Prometheus", "free_port", "prometheus_binary", "run_prometheus", "self_signed"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may still take it before you)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def self_signed(directory: Path, name: str = "127.0.0.1") -> tuple[Path, Path]:
    """(certificate, key) files of a fresh self-signed certificate for `name` (an IP address
    or a DNS name), made with the openssl command (FileNotFoundError when it is absent)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    kind = "IP" if name.replace(".", "").isdigit() or ":" in name else "DNS"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", f"subjectAltName={kind}:{name}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def prometheus_binary() -> str | None:
    """Path of the prometheus binary (Debian package `prometheus`), or None when absent."""
    return shutil.which("prometheus") or next(
        (p for p in ("/usr/bin/prometheus",) if Path(p).is_file()), None
    )


@dataclass
class Prometheus:
    """A running Prometheus: its base URL and a small client for the query API."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path
    # One client for every query: a new httpx client loads the CA bundle (~30 ms), which a
    # test that polls or runs a few hundred queries paid each time.
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5.0), repr=False)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate an instant query; return its `data.result` list."""
        reply = self.client.get(f"{self.url}/api/v1/query", params={"query": expr})
        reply.raise_for_status()
        result: list[dict[str, Any]] = reply.json()["data"]["result"]
        return result

    def wait_for(
        self, expr: str, timeout_s: float = 30.0, poll_s: float = 0.25
    ) -> list[dict[str, Any]]:
        """Poll `expr` until it returns a series; TimeoutError (with the log tail) if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"no series for {expr!r} after {timeout_s} s\n{self.log_tail()}")
            time.sleep(poll_s)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines Prometheus logged, for failure messages."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _config(targets: Sequence[str], scrape_interval_s: float, rule_files: Sequence[Path],
            drop_metrics: str | None = None) -> str:
    # Targets may be base URLs (EmbeddedServer.url); Prometheus wants "host:port".
    hosts = [target.split("://")[-1].rstrip("/") for target in targets]
    interval = f"{int(scrape_interval_s * 1000)}ms"
    job: dict[str, Any] = {"job_name": "guard", "static_configs": [{"targets": hosts}]}
    if drop_metrics is not None:
        job["metric_relabel_configs"] = [
            {"source_labels": ["__name__"], "regex": drop_metrics, "action": "drop"}
        ]
    # JSON is valid YAML, so no YAML writer is needed.
    return json.dumps(
        {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [job],
        }
    )


def _start(binary: str, workdir: Path, port: int) -> Prometheus:
    log = workdir / f"prometheus-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Prometheus(f"http://127.0.0.1:{port}", process, log)


def _ready(prom: Prometheus, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and prom.process.poll() is None:
        try:
            if prom.client.get(f"{prom.url}/-/ready", timeout=1.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def run_prometheus(
    targets: Sequence[str],
    *,
    scrape_interval_s: float = 1.0,
    rule_files: Sequence[Path] = (),
    drop_metrics: str | None = None,
    start_timeout_s: float = 30.0,
    binary: str | None = None,
    config: str | None = None,
) -> Iterator[Prometheus]:
    """Start Prometheus on a free loopback port scraping `targets`; always stop it.

    Targets are "host:port" or base URLs such as `EmbeddedServer.url`; `drop_metrics`, a
    regex of metric names dropped at scrape (metric relabeling), as deploy/'s recipes do.
    `config`: a whole configuration (YAML or JSON) instead, the other arguments unused.
    """
    binary = binary or prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus binary not found (Debian package `prometheus`)")
    with tempfile.TemporaryDirectory(prefix="guard-prometheus-") as tmp:
        workdir = Path(tmp)
        if config is None:
            config = _config(targets, scrape_interval_s, rule_files, drop_metrics)
        (workdir / "prometheus.yml").write_text(config)
        # The free port can be taken between probe and bind (Prometheus then exits at once);
        # a fresh port covers that race. Alive but never ready is not worth another wait.
        for _ in range(3):
            prom = _start(binary, workdir, free_port())
            try:
                if _ready(prom, start_timeout_s):
                    yield prom
                    return
                exited = prom.process.poll() is not None
            finally:
                _stop(prom.process)
                prom.client.close()
            if not exited:
                break
        raise RuntimeError(f"prometheus did not become ready\n{prom.log_tail()}")
