"""A prometheus_client collector that builds every metric family from a store snapshot."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from guard_server.families import PER_RANK, Family
from guard_server.store import Snapshot, Store

__all__ = ["StoreCollector", "build_families", "new_registry"]

_RANK = ("run_id", "rank")


def _family(f: Family) -> GaugeMetricFamily | CounterMetricFamily:
    # CounterMetricFamily strips a trailing _total and adds it back to every sample, so the
    # exposed names are exactly the ones of the table.
    kind = GaugeMetricFamily if f.kind == "gauge" else CounterMetricFamily
    return kind(f.name, f.doc, labels=[*_RANK, *f.labels])


def build_families(snap: Snapshot) -> list[Metric]:
    """Build the guard_* families of DESIGN.md from one snapshot (one pass over the ranks):
    the per-rank table (guard_server/families.py), then the server's own."""
    families = [_family(f) for f in PER_RANK]
    # This loop is most of a scrape's own cost, so each sample is written as add_metric would
    # write it (the sample name, a dict of labels), without a dict(zip()) per sample: a rank's
    # run_id/rank dict is built once and shared by its samples without labels of their own
    # (the encoders only read it).
    writers = [(family.samples.append, family.name + ("_total" if f.kind == "counter" else ""),
                f.labels, f.samples) for family, f in zip(families, PER_RANK, strict=True)]
    for view in snap.ranks:
        rank, r, seen = {"run_id": view.run_id, "rank": str(view.rank)}, view.latest, view.last_seen
        for append, name, names, samples in writers:
            for extra, value in samples(r, seen):
                labels = rank
                if extra:
                    labels = rank.copy()
                    labels.update(zip(names, extra, strict=True))
                append(Sample(name, labels, value))

    ingested = CounterMetricFamily(
        "guard_ingest_reports_total", "Step reports this server accepted.", value=snap.reports_total
    )
    rejected = CounterMetricFamily(
        "guard_ingest_rejected_total",
        "Report requests this server rejected, per reason; nothing from them was stored.",
        labels=["reason"],
    )
    for reason, count in snap.rejected.items():
        rejected.add_metric([reason], count)
    # What the server holds now (after eviction): what its memory grows with.
    runs = GaugeMetricFamily("guard_server_runs", "Runs this server holds state for.",
                             value=len({view.run_id for view in snap.ranks}))
    ranks = GaugeMetricFamily("guard_server_ranks", "Ranks this server holds state for, over "
                              "all runs.", value=len(snap.ranks))
    held = GaugeMetricFamily("guard_server_bytes", "Estimated bytes of state held (reports and "
                             "events), what GUARD_SERVER_MAX_BYTES bounds.", value=snap.held_bytes)
    return [*families, ingested, rejected, runs, ranks, held]


class StoreCollector(Collector):
    """Reads the store at scrape time; holds no labelled children between scrapes."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        """Yield every guard_* family for the current state."""
        yield from build_families(self._store.snapshot())


def new_registry(store: Store) -> CollectorRegistry:
    """A fresh registry holding only the store's collector (never the global REGISTRY)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry
