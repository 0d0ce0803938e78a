"""The per-rank metric families of /metrics (docs/metrics.md), one table: what the collector emits
for a rank and what the store counts at ingest to bound a scrape (GUARD_SERVER_MAX_SERIES)
before any scrape happens. A family added here is emitted and counted alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from guard_server.wire import ACTIONS, CHECKS, ID_KINDS, TENSORS, WEIGHTS, StepReport

__all__ = ["Family", "MAX_SERIES_PER_RANK", "PER_RANK", "TYPICAL_SERIES_PER_RANK",  # noqa: RUF022
           "series_of"]

# A rank's samples of a family: each its label values beside run_id and rank, and its value
# (one function per family: the collector calls each once per rank). A label's values are the
# wire's (TENSORS, ID_KINDS, WEIGHTS), in the fields of the report model that holds them.
Samples = Sequence[tuple[tuple[str, ...], float]]


@dataclass(frozen=True)
class Family:
    """One guard_* family with `run_id` and `rank` labels (plus `labels`)."""

    name: str
    kind: Literal["gauge", "counter"]
    doc: str
    labels: tuple[str, ...]
    # The rank's samples from its latest report and the time the server last heard from it.
    samples: Callable[[StepReport, float], Samples]
    most: int = 1  # the most samples one rank can have
    varies: bool = False  # the count depends on the report (else every rank has `most`)
    # The number of samples without building them, where that is cheaper (counted at every
    # ingest; tests/server/test_collector.py holds it to len(samples)).
    count: Callable[[StepReport], int] | None = None


def _gauge(value: float | None) -> Samples:
    """A family without labels of its own: one sample, or none where the rank reports none."""
    return () if value is None else (((), value),)


def _violations(r: StepReport, seen: float) -> Samples:
    return [((check, action), count) for check, by_action in r.violations.items()
            for action, count in by_action.items()]


PER_RANK: tuple[Family, ...] = (
    Family("guard_step", "gauge", "Step of the latest report from this rank.", (),
           lambda r, seen: (((), r.step),)),
    Family("guard_last_report_timestamp_seconds", "gauge",
           "Unix time at which the server last accepted a report from this rank.", (),
           lambda r, seen: (((), seen),)),
    Family("guard_rank_finished", "gauge",
           "1 once this rank's guard sent its last report (detach: the run ended or halted); "
           "0 while it trains.", (), lambda r, seen: (((), 1.0 if r.final else 0.0),)),
    Family("guard_loss", "gauge", "Last finite loss the guard saw on this rank.", (),
           lambda r, seen: _gauge(r.loss), varies=True),
    Family("guard_padding_mass_ratio", "gauge",
           "Mean softmax probability on the padding columns [real, rows) over sampled tokens, "
           "before any mask; should be ~0.", (),
           lambda r, seen: _gauge(r.padding_mass), varies=True),
    Family("guard_padding_mass_max_ratio", "gauge",
           "Largest per-token softmax probability on the padding columns, before any mask.", (),
           lambda r, seen: _gauge(r.padding_mass_max), varies=True),
    Family("guard_nonfinite_values_total", "counter",
           "NaN/Inf values seen since attach, per tensor (logits, hidden, loss).", ("tensor",),
           lambda r, seen: [((t,), n) for t in TENSORS
                            if (n := getattr(r.nonfinite, t)) is not None],
           most=len(TENSORS), varies=True),
    Family("guard_out_of_range_tokens_total", "counter",
           "Token ids in [real, rows) or outside [0, rows) seen since attach, per kind.",
           ("kind",), lambda r, seen: [((k,), getattr(r.out_of_range, k)) for k in ID_KINDS],
           most=len(ID_KINDS)),
    Family("guard_untrained_rows", "gauge",
           "Rows of the real vocab found never trained and not repaired, per weight "
           "(embedding, lm_head).", ("weight",),
           lambda r, seen: () if r.untrained_rows is None else
           [((w,), getattr(r.untrained_rows, w)) for w in WEIGHTS], most=len(WEIGHTS),
           varies=True),
    Family("guard_untrained_tokens_total", "counter",
           "Input ids and labels that fell on never-trained rows since attach, per kind.",
           ("kind",), lambda r, seen: () if r.untrained_tokens is None else
           [((k,), getattr(r.untrained_tokens, k)) for k in ID_KINDS], most=len(ID_KINDS),
           varies=True),
    Family("guard_grad_norm", "gauge",
           "Total gradient norm of the last step read (over every gradient the optimizer "
           "applies).", (), lambda r, seen: _gauge(r.grad_norm), varies=True),
    Family("guard_logsumexp", "gauge",
           "log Z of the real-vocab logits, mean over the sampled positions (z-loss keeps it "
           "near 0).", (), lambda r, seen: _gauge(r.logsumexp), varies=True),
    Family("guard_logsumexp_max", "gauge",
           "log Z of the real-vocab logits, largest over the sampled positions.", (),
           lambda r, seen: _gauge(r.logsumexp_max), varies=True),
    Family("guard_scaler_skipped_steps_total", "counter",
           "Optimizer updates the training loop skipped (GradScaler found inf/NaN gradients).",
           (), lambda r, seen: _gauge(r.scaler_skipped_steps), varies=True),
    Family("guard_violations_total", "counter",
           "Check violations since attach, per check and action.", ("check", "action"),
           _violations, most=len(CHECKS) * len(ACTIONS), varies=True,
           count=lambda r: sum(map(len, r.violations.values()))),
    Family("guard_skipped_steps_total", "counter", "Optimizer steps dropped by action skip.", (),
           lambda r, seen: (((), r.skipped_steps),)),
    Family("guard_halted", "gauge", "1 when this check's fail action stopped the run.",
           ("check",), lambda r, seen: () if r.halted is None else (((r.halted,), 1),),
           varies=True),
    Family("guard_vocab_size", "gauge",
           "Vocabulary sizes: real (tokenizer), rows (embedding/lm_head), aligned (padded).",
           ("kind",), lambda r, seen: [(("real",), r.vocab.real), (("rows",), r.vocab.rows),
                                       (("aligned",), r.vocab.aligned)], most=3),
    Family("guard_dropped_reports_total", "counter",
           "Reports the client dropped because its queue was full.", (),
           lambda r, seen: (((), r.dropped_reports),)),
)

# The most series one rank can put on /metrics: every check with every action, a halt, the
# loss, both padding-mass ratios and the untrained rows per weight.
MAX_SERIES_PER_RANK = sum(f.most for f in PER_RANK)
# A healthy rank under the default policy: every family with all its samples but the
# violations, which hold one series per check (the library reports each enabled check at 0
# from the start; all are enabled by default), and the halt, which it never has.
TYPICAL_SERIES_PER_RANK = sum(
    len(CHECKS) if f.name == "guard_violations_total" else 0 if f.name == "guard_halted"
    else f.most for f in PER_RANK)


_FIXED = sum(f.most for f in PER_RANK if not f.varies)
_VARYING = tuple((f.count, f.samples) for f in PER_RANK if f.varies)


def series_of(report: StepReport) -> int:
    """The series `report` adds to a scrape (what the collector emits for its rank): counted
    at every ingest, so only the families whose count varies are asked."""
    n = _FIXED
    for count, samples in _VARYING:
        n += count(report) if count is not None else len(samples(report, 0.0))
    return n
