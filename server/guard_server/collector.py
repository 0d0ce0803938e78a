"""The guard_* metric families, built from the store: per rank from the table of
guard_server/families.py, a piece of the ranks at a time (what GET /metrics streams,
guard_server/exposition.py), or all at once for a prometheus_client registry."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from guard_server.families import PER_RANK, Family
from guard_server.rejections import RejectReason
from guard_server.store import Row, Snapshot, Store

__all__ = ["StoreCollector", "build_families", "family", "new_registry", "server_families"]

_RANK = ("run_id", "rank")


def family(f: Family, rows: Iterable[Row]) -> GaugeMetricFamily | CounterMetricFamily:
    """The family `f` with the samples of `rows`' ranks, in their order."""
    # CounterMetricFamily strips a trailing _total and adds it back to every sample, so the
    # exposed names are exactly the ones of the table.
    kind = GaugeMetricFamily if f.kind == "gauge" else CounterMetricFamily
    metric = kind(f.name, f.doc, labels=[*_RANK, *f.labels])
    # This loop is most of a scrape's own cost, so each sample is written as add_metric would
    # write it (the sample name, a dict of labels), without a dict(zip()) per sample: a rank's
    # run_id/rank dict is shared by its samples without labels of their own (the encoders
    # only read it).
    append = metric.samples.append
    name = metric.name + ("_total" if f.kind == "counter" else "")
    names, samples = f.labels, f.samples
    for run_id, rank_no, r, seen in rows:
        rank = {"run_id": run_id, "rank": str(rank_no)}
        for extra, value in samples(r, seen):
            labels = rank
            if extra:
                labels = rank.copy()
                labels.update(zip(names, extra, strict=True))
            append(Sample(name, labels, value))
    return metric


def server_families(reports_total: int, rejected: Mapping[RejectReason, int], runs: int,
                    ranks: int, held_bytes: int,
                    unknown: Mapping[str, int] | None = None) -> list[Metric]:
    """The server's own families: what it accepted and refused, what it holds now (after
    eviction: what its memory grows with)."""
    ingested = CounterMetricFamily(
        "guard_ingest_reports_total", "Step reports this server accepted.", value=reports_total
    )
    refused = CounterMetricFamily(
        "guard_ingest_rejected_total",
        "Report requests this server rejected, per reason; nothing from them was stored.",
        labels=["reason"],
    )
    for reason, count in rejected.items():
        refused.add_metric([reason], count)
    fields = CounterMetricFamily(
        "guard_ingest_unknown_fields_total", "Times an accepted report carried a field this "
        "server does not know (a newer guard's), per field; stored without it.",
        labels=["field"])
    for name, count in (unknown or {}).items():
        fields.add_metric([name], count)
    return [ingested, refused, fields,
            GaugeMetricFamily("guard_server_runs", "Runs this server holds state for.",
                              value=runs),
            GaugeMetricFamily("guard_server_ranks", "Ranks this server holds state for, over "
                              "all runs.", value=ranks),
            GaugeMetricFamily("guard_server_bytes", "Estimated bytes of state held (reports "
                              "and events), what GUARD_SERVER_MAX_BYTES bounds.",
                              value=held_bytes)]


def build_families(snap: Snapshot) -> list[Metric]:
    """Every guard_* family of docs/metrics.md from one snapshot, built whole."""
    rows = [(v.run_id, v.rank, v.latest, v.last_seen) for v in snap.ranks]
    runs = len({view.run_id for view in snap.ranks})
    return [*(family(f, rows) for f in PER_RANK),
            *server_families(snap.reports_total, snap.rejected, runs, len(rows),
                             snap.held_bytes, snap.unknown)]


class StoreCollector(Collector):
    """Reads the store at collect time, whole (tests and in-process readers; GET /metrics
    streams instead); holds no labelled children between collections."""

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
