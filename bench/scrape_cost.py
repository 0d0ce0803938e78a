"""The server's own cost of one /metrics scrape, in process: a store holding N typical ranks,
the collector's families and prometheus_client's text encoding, without HTTP (bench/ingest.py
times the same through a real server); on a tree with guard_server.exposition, written a
piece at a time as GET /metrics does. Uses guard_server's public names only, so it runs
against any tree:

    .venv/bin/python bench/scrape_cost.py
    cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/old/server /work/main/.venv/bin/python \\
        /work/main/bench/scrape_cost.py                     # another tree, same machine
"""

from __future__ import annotations

import argparse
import statistics
import time

import guard_server
from guard_server import ReportBatch, Settings, Store
from guard_server.collector import build_families, new_registry
from guard_server.routes.metrics import encoder_for


def _batch(run: int, rank: int) -> ReportBatch:
    """A typical rank: the default policy's checks at 0, a padding mass and a loss."""
    return ReportBatch.model_validate({"run_id": f"run-{run}", "rank": rank, "reports": [{
        "attach_id": f"attach{run:04d}{rank:06d}", "step": 1000, "timestamp": 1.7e9,
        "loss": 2.5, "padding_mass": 1e-9, "padding_mass_max": 4e-8,
        "nonfinite": {"logits": 0, "hidden": 0, "loss": 0},
        "out_of_range": {"input": 0, "label": 0},
        "violations": {"alignment": {"fail": 0}, "vocab": {"fail": 0},
                       "padding_mass": {"mask": 0}, "nonfinite": {"fail": 0},
                       "token_range": {"fail": 0}, "padding_rows": {"repair": 0}},
        "skipped_steps": 0, "halted": None,
        "vocab": {"real": 50257, "rows": 50304, "aligned": 50304},
        "dropped_reports": 0, "final": False, "events": []}]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    store = Store(Settings(max_step_rate=None))
    for r in range(args.ranks):
        store.ingest(_batch(r // 4096, r % 4096))
    registry = new_registry(store)
    encode, _ = encoder_for("text/plain")
    try:  # what GET /metrics runs: a piece at a time since issue 22, the registry whole before
        from guard_server.exposition import exposition

        def scrape() -> bytes:
            return b"".join(exposition(store, encode))
    except ImportError:
        def scrape() -> bytes:
            return encode(registry)
    times, families = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        build_families(store.snapshot())
        t1 = time.perf_counter()
        body = scrape()  # the families again, then the text
        times.append(time.perf_counter() - t1)
        families.append(t1 - t0)
    print(f"guard_server {guard_server.__file__}")
    print(f"{args.ranks} ranks, {len(body):,} bytes: scrape median "
          f"{1e3 * statistics.median(times):.1f} ms (min {1e3 * min(times):.1f}); of it the "
          f"snapshot and families {1e3 * statistics.median(families):.1f} ms "
          f"(min {1e3 * min(families):.1f}); {args.repeats} scrapes")


if __name__ == "__main__":
    main()
