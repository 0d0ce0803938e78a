"""GuardRankSilent live: a real `guard serve`, a real Prometheus with the shipped rule file (its
thresholds shortened by a string substitution: seconds, not minutes), and four real training
processes, two pushing to the server and two scraped on their own endpoints (export.serve).
One of each trains, detaches and exits; the other is killed with SIGKILL mid-training.

The alert fires for both killed trainers and never, pending included, for the two that
finished: not within the rule's window after their end, nor later in the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard_server.testing import free_port, prometheus_binary, run_prometheus
from tests import served
from tests.dashboards.queries import ALERT_RULES, ROOT

pytestmark = pytest.mark.prometheus

SILENT_S, FOR_S = 10, 2  # the shipped 120 s and 1 m, shortened
# The shipped rules, each substitution found exactly once (a changed rule fails here first).
FAST = {
    "    interval: 30s\n": "    interval: 1s\n",
    "guard_last_report_timestamp_seconds[15m])) > 120\n":
        f"guard_last_report_timestamp_seconds[15m])) > {SILENT_S}\n",
    "        for: 1m\n": f"        for: {FOR_S}s\n",
}
PUSHED, OWN = ("push-clean", "push-killed"), ("own-clean", "own-killed")


def fast_rules() -> str:
    text = ALERT_RULES.read_text()
    for old, new in FAST.items():
        assert text.count(old) == 1, f"{ALERT_RULES}: {old!r} is not there once"
        text = text.replace(old, new)
    return text


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith(("GUARD_SERVER_", "GUARD_TOKEN"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.fixture
def guard_serve(tmp_path: Path) -> Iterator[str]:
    """`guard serve --port N`; its base URL once it answers."""
    with served.guard_serve(["--port", "{port}"], _env(), tmp_path / "guard-serve.log") as url:
        yield url


def _trainer(name: str, stop: Path, *specs: str) -> subprocess.Popen[bytes]:
    """A training process with one rank per spec (RUN_ID:push:URL, RUN_ID:serve:HOST:PORT)."""
    with (stop.parent / f"{name}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.dashboards.silent_trainer", str(stop), *specs],
            cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def test_rank_silent_fires_for_killed_trainers_never_for_finished_ones(
    guard_serve: str, tmp_path: Path
) -> None:
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    rules = tmp_path / "guard-alerts.yml"
    rules.write_text(fast_rules())
    ports = {run_id: free_port() for run_id in OWN}
    targets = [guard_serve, *(f"127.0.0.1:{port}" for port in ports.values())]
    with run_prometheus(targets, scrape_interval_s=0.5, rule_files=[rules]) as prom:
        # Two processes of two ranks each (a torch import is seconds of a loaded CPU): one
        # rank pushes, the other serves its own endpoint.
        trainers = {
            end: _trainer(end, tmp_path / f"stop-{end}", f"push-{end}:push:{guard_serve}",
                          f"own-{end}:serve:127.0.0.1:{ports[f'own-{end}']}")
            for end in ("clean", "killed")}
        try:
            # Every rank scraped training a few times (the own endpoints: an interval seen).
            prom.wait_for("count(count_over_time(guard_step[1m]) >= 3) == 4",
                          timeout_s=300)
            (tmp_path / "stop-clean").touch()  # the killed one's never comes
            detached = tmp_path / "stop-clean.detached"
            while not detached.exists():
                assert trainers["clean"].poll() is None, (tmp_path / "clean.log").read_text()
                time.sleep(0.2)
            ended = time.time()
            trainers["killed"].send_signal(signal.SIGKILL)
            trainers["killed"].wait(10)
            firing = 'ALERTS{alertname="GuardRankSilent", alertstate="firing"}'
            for run_id in ("push-killed", "own-killed"):
                prom.wait_for(f'{firing[:-1]}, run_id="{run_id}"}}', timeout_s=60)
            # The finished ranks' window (silence, then the pending time) is over, twice over.
            while time.time() < ended + 2 * (SILENT_S + FOR_S):
                time.sleep(0.5)
            clean = 'run_id=~"push-clean|own-clean"'
            fired = prom.query(
                f'count_over_time(ALERTS{{alertname="GuardRankSilent", {clean}}}[5m])')
            assert fired == [], (fired, (tmp_path / "clean.log").read_text())
            # Prometheus recorded both as finished: the trainer's endpoint waited for its scrape.
            finished = prom.query(f"last_over_time(guard_rank_finished{{{clean}}}[5m]) == 1")
            assert {s["metric"]["run_id"] for s in finished} == {"push-clean", "own-clean"}
        finally:
            for proc in trainers.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)
