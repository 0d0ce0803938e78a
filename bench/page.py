"""What the status pages cost (GET / and GET /runs/{run_id}, guard_server/routes/pages.py): the
bytes and the render time of each page, and the memory a render takes on top of the state
(tracemalloc peak), through the app in process (a TestClient: routing, auth, template, no
network), with the store at 1024 ranks of one run and at the caps (16,384 ranks in 64 runs);
typical ranks (a full trail of 60 points, one event) and ranks at the wire's limits (32
events of 4096 characters, every check with every action counted, halted).

    .venv/bin/python bench/page.py                          # the table in docs/benchmarks.md
    .venv/bin/python bench/page.py --screenshot docs/page.png   # the README's screenshot

`--screenshot` serves real reports instead (guards on nanoGPT pushing to a real uvicorn,
tests/server/page_runs.py) and has headless Chromium (tests/browser.py) take the run's page.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ when run as a script

from guard_server import ReportBatch, Settings, Store, create_app
from guard_server.trail import TRAIL_POINTS
from guard_server.wire import ACTIONS, CHECKS, MAX_EVENTS, MAX_MESSAGE


def _report(step: int, worst: bool) -> dict[str, Any]:
    counts = ({c: dict.fromkeys(ACTIONS, 2**40) for c in CHECKS} if worst else
              {"padding_mass": {"mask": 0}, "nonfinite": {"fail": 0}, "token_range": {"fail": 0}})
    return {"attach_id": "a" * 32, "step": step, "timestamp": 1.7e9, "loss": 2.5 + 1 / step,
            "padding_mass": 1e-3, "padding_mass_max": 4e-3,
            "nonfinite": {"logits": 0, "hidden": 0, "loss": 0},
            "out_of_range": {"input": 0, "label": 3}, "untrained_rows": None,
            "untrained_tokens": {"input": 0, "label": 0}, "violations": counts,
            "skipped_steps": 0, "halted": "token_range" if worst else None,
            "vocab": {"real": 50257, "rows": 50304, "aligned": 50304}, "dropped_reports": 0,
            "final": False, "events": []}


def _event(step: int, worst: bool) -> dict[str, Any]:
    message = ("<'&\">" * (MAX_MESSAGE // 5))[:MAX_MESSAGE] if worst else \
        f"token_range on rank 0 at step {step}: 3 label ids outside [0, 50257) ..."
    return {"check": "token_range", "action": "fail" if worst else "warn", "step": step,
            "message": message, "module": ("m" * 256) if worst else None}


def store_of(runs: int, ranks: int, worst: bool) -> Store:
    store = Store(Settings(max_step_rate=None, max_bytes=8 << 30, max_ranks_per_run=4096))
    for run in range(runs):
        run_id = (f"run-{run}-" + "x" * 128)[:128] if worst else f"run-{run}"
        for rank in range(ranks):
            reports = [_report(s, worst) for s in range(1, TRAIL_POINTS + 1)]
            reports[-1]["events"] = [_event(TRAIL_POINTS, worst)] * (MAX_EVENTS if worst else 1)
            store.ingest(ReportBatch.model_validate(
                {"run_id": run_id, "rank": rank, "reports": reports}))
    return store


def measure(client: TestClient, path: str, repeats: int) -> tuple[int, float, int]:
    """(bytes, median seconds, tracemalloc peak bytes) of GET path."""
    size, times = 0, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reply = client.get(path)
        times.append(time.perf_counter() - t0)
        assert reply.status_code == 200, (path, reply.status_code)
        size = len(reply.content)
    tracemalloc.start()
    client.get(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return size, statistics.median(times), peak


def table(repeats: int) -> None:
    print("| state | page | bytes | render (median) | peak memory of a render |")
    print("|---|---|---|---|---|")
    for label, runs, ranks, worst in (("1024 typical ranks, 1 run", 1, 1024, False),
                                      ("1024 ranks at the wire's limits, 1 run", 1, 1024, True),
                                      ("16,384 typical ranks, 64 runs (the caps)", 64, 256,
                                       False)):
        store = store_of(runs, ranks, worst)
        run_id = store.snapshot().ranks[0].run_id
        with TestClient(create_app(store.settings, store)) as client:
            for page in ("/", f"/runs/{run_id}", f"/runs/{run_id}?limit=256"):
                size, seconds, peak = measure(client, page, repeats)
                shown = page.replace(run_id, "{run_id}")
                print(f"| {label} | `{shown}` | {size / 1024:,.0f} KiB | {seconds * 1000:,.0f} ms "
                      f"| {peak / 2**20:,.1f} MiB |", flush=True)


def screenshot(path: Path) -> None:
    from guard_server import EmbeddedServer
    from tests.browser import Chromium
    from tests.server.page_runs import RUN_ID, train_and_push

    with EmbeddedServer(port=0, settings=Settings(port=0)) as server:
        train_and_push(server.url, None, steps=40, halt_at=25)
        with Chromium(width=1280, height=800) as browser:
            browser.open(f"{server.url}/runs/{RUN_ID}")
            browser.screenshot(path)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--screenshot", type=Path, default=None)
    args = p.parse_args()
    if args.screenshot is not None:
        screenshot(args.screenshot)
    else:
        table(args.repeats)


if __name__ == "__main__":
    main()
