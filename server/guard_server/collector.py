"""A prometheus_client collector that builds every metric family from a store snapshot."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from guard_server.store import Snapshot, Store

__all__ = ["StoreCollector", "build_families", "new_registry"]

_RANK = ("run_id", "rank")


def _gauge(name: str, doc: str, *extra: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=[*_RANK, *extra])


def _counter(name: str, doc: str, *extra: str) -> CounterMetricFamily:
    # CounterMetricFamily strips a trailing _total and adds it back to every sample, so the
    # exposed names are exactly the ones given here.
    return CounterMetricFamily(name, doc, labels=[*_RANK, *extra])


def build_families(snap: Snapshot) -> list[Metric]:
    """Build the guard_* families of DESIGN.md from one snapshot (one pass over the ranks)."""
    step = _gauge("guard_step", "Step of the latest report from this rank.")
    seen = _gauge(
        "guard_last_report_timestamp_seconds",
        "Unix time at which the server last accepted a report from this rank.",
    )
    loss = _gauge("guard_loss", "Last finite loss the guard saw on this rank.")
    mass = _gauge(
        "guard_padding_mass_ratio",
        "Mean softmax probability on the padding columns [real, rows) over sampled tokens, "
        "before any mask; should be ~0.",
    )
    mass_max = _gauge(
        "guard_padding_mass_max_ratio",
        "Largest per-token softmax probability on the padding columns, before any mask.",
    )
    nonfinite = _counter(
        "guard_nonfinite_values_total",
        "NaN/Inf values seen since attach, per tensor (logits, hidden, loss).",
        "tensor",
    )
    out_of_range = _counter(
        "guard_out_of_range_tokens_total",
        "Token ids in [real, rows) or outside [0, rows) seen since attach, per kind.",
        "kind",
    )
    violations = _counter(
        "guard_violations_total",
        "Check violations since attach, per check and action.",
        "check",
        "action",
    )
    skipped = _counter("guard_skipped_steps_total", "Optimizer steps dropped by action skip.")
    halted = _gauge("guard_halted", "1 when this check's fail action stopped the run.", "check")
    vocab = _gauge(
        "guard_vocab_size",
        "Vocabulary sizes: real (tokenizer), rows (embedding/lm_head), aligned (padded).",
        "kind",
    )
    dropped = _counter(
        "guard_dropped_reports_total", "Reports the client dropped because its queue was full."
    )
    for view in snap.ranks:
        labels = [view.run_id, str(view.rank)]
        r = view.latest
        step.add_metric(labels, r.step)
        seen.add_metric(labels, view.last_seen)
        if r.loss is not None:
            loss.add_metric(labels, r.loss)
        if r.padding_mass is not None:
            mass.add_metric(labels, r.padding_mass)
        if r.padding_mass_max is not None:
            mass_max.add_metric(labels, r.padding_mass_max)
        nonfinite.add_metric([*labels, "logits"], r.nonfinite.logits)
        nonfinite.add_metric([*labels, "hidden"], r.nonfinite.hidden)
        nonfinite.add_metric([*labels, "loss"], r.nonfinite.loss)
        out_of_range.add_metric([*labels, "input"], r.out_of_range.input)
        out_of_range.add_metric([*labels, "label"], r.out_of_range.label)
        for check, by_action in r.violations.items():
            for action, count in by_action.items():
                violations.add_metric([*labels, check, action], count)
        skipped.add_metric(labels, r.skipped_steps)
        if r.halted is not None:
            halted.add_metric([*labels, r.halted], 1)
        vocab.add_metric([*labels, "real"], r.vocab.real)
        vocab.add_metric([*labels, "rows"], r.vocab.rows)
        vocab.add_metric([*labels, "aligned"], r.vocab.aligned)
        dropped.add_metric(labels, r.dropped_reports)

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
    return [
        step,
        seen,
        loss,
        mass,
        mass_max,
        nonfinite,
        out_of_range,
        violations,
        skipped,
        halted,
        vocab,
        dropped,
        ingested,
        rejected,
        runs,
        ranks,
        held,
    ]


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
