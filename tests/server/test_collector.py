"""The exposition has the families table's names, types and labels, and promtool finds no fault."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from typing import Any, get_args

import pytest
from fastapi.testclient import TestClient
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from guard_server import ReportBatch, Settings, Store, create_app
from guard_server.collector import build_families, new_registry, server_families
from guard_server.families import MAX_SERIES_PER_RANK, PER_RANK, series_of
from guard_server.rejections import RejectReason
from guard_server.routes.metrics import encoder_for
from guard_server.wire import ACTIONS, CHECKS


def exposed(metrics: Iterable[Metric]) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) of families as they are exposed (a counter's with _total)."""
    return {m.name + ("_total" if m.type == "counter" else ""):
            (m.type, {k for s in m.samples for k in s.labels}) for m in metrics}


# What the collector emits, taken from the code: per rank the families table (a rank's labels
# beside each family's own), and the server's own families. docs/metrics.md, which a test holds
# to a live server's /metrics, is the list a user reads.
DESIGN = {f.name: (f.kind, set(f.labels)) for f in PER_RANK}
SERVER = exposed(server_families(0, dict.fromkeys(get_args(RejectReason), 0), 0, 0, 0,
                                 {"a_field": 0}))

SERVER_PREFIXES = ("guard_ingest_", "guard_server_")


@pytest.fixture
def store(make_batch: Any, clock: Any) -> Store:
    store = Store(Settings(), clock=clock)
    store.ingest(
        ReportBatch.model_validate(make_batch(run_id="r1", rank=3, steps=(7,), halted="nonfinite"))
    )
    store.ingest(ReportBatch.model_validate(make_batch(run_id="r1", rank=4, steps=(8,), loss=None)))
    store.unknown.count(["reports.grad_norm"])  # what the ingest route counts of a newer guard
    return store


def test_names_types_and_labels_match_the_design(store: Store) -> None:
    text = generate_latest(new_registry(store)).decode()
    seen: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels}
        seen[name] = (family.type, labels)
        assert not labels & {"job", "instance", "step"}
    per_rank = {name: (kind, extra | {"run_id", "rank"}) for name, (kind, extra) in DESIGN.items()}
    assert seen == per_rank | SERVER


def test_values_read_back(store: Store, clock: Any) -> None:
    registry = new_registry(store)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"run_id": "r1", "rank": "3"} | labels)

    assert value("guard_step") == 7
    assert value("guard_last_report_timestamp_seconds") == clock.now
    assert value("guard_loss") == 2.13
    assert value("guard_padding_mass_ratio") == 1.2e-09
    assert value("guard_out_of_range_tokens_total", kind="label") == 3
    assert value("guard_violations_total", check="token_range", action="warn") == 1
    assert value("guard_halted", check="nonfinite") == 1
    assert value("guard_vocab_size", kind="aligned") == 50304
    assert (
        registry.get_sample_value(
            "guard_halted", {"run_id": "r1", "rank": "4", "check": "nonfinite"}
        )
        is None
    )
    # A null loss is absent, never a made-up zero.
    assert registry.get_sample_value("guard_loss", {"run_id": "r1", "rank": "4"}) is None
    assert registry.get_sample_value("guard_ingest_reports_total") == 2
    assert registry.get_sample_value("guard_ingest_rejected_total", {"reason": "invalid"}) == 0
    assert registry.get_sample_value("guard_server_runs") == 1
    assert registry.get_sample_value("guard_server_ranks") == 2


def test_each_app_has_its_own_registry(store: Store) -> None:
    from prometheus_client import REGISTRY

    assert new_registry(store) is not new_registry(store)
    assert REGISTRY.get_sample_value("guard_step", {"run_id": "r1", "rank": "3"}) is None


@pytest.mark.prometheus
def test_promtool_check_metrics_is_silent(store: Store) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; bootstrap --dev)")
    with TestClient(create_app(store.settings, store)) as client:
        scrape = client.get("/metrics").content  # the bytes Prometheus would get
    out = subprocess.run(
        [promtool, "check", "metrics"], input=scrape, capture_output=True, timeout=30
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, b"", b"")


PROMETHEUS_ACCEPT = (  # what Prometheus 2.42 sends when it scrapes
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.mark.parametrize(
    "accept",
    [
        PROMETHEUS_ACCEPT,
        "",
        "text/plain;version=1.0.0;escaping=underscores",
        "application/openmetrics-text;version=1.0.0;escaping=dots",
    ],
)
def test_the_faster_encoding_writes_prometheus_clients_bytes(store: Store, accept: str) -> None:
    registry = new_registry(store)
    fast, fast_type = encoder_for(accept)
    plain, plain_type = choose_encoder(accept)
    assert (fast(registry), fast_type) == (plain(registry), plain_type)


def test_series_of_counts_what_a_scrape_shows(make_batch: Any) -> None:
    # The store bounds a scrape by series_of (GUARD_SERVER_MAX_SERIES): it must count exactly
    # what build_families emits per rank, from the barest report to the costliest.
    every = {check: dict.fromkeys(ACTIONS, 1) for check in CHECKS}
    cases = {
        "bare": {"loss": None, "padding_mass": None, "padding_mass_max": None, "violations": {}},
        "typical": {},
        "worst": {"violations": every, "halted": "nonfinite"},
    }
    for name, fields in cases.items():
        store = Store(Settings())
        batch = ReportBatch.model_validate(make_batch(**fields))
        store.ingest(batch)
        families = build_families(store.snapshot())
        shown = sum(len(f.samples) for f in families if not f.name.startswith(SERVER_PREFIXES))
        assert series_of(batch.reports[0]) == shown == store.held_series, name
    assert shown == MAX_SERIES_PER_RANK
