"""The 1200-rank job of test_live_scale.py, as the fleet process serves it (fleet.py): which
ranks are faulty, halted, silent or straggling, and what each reports at each scrape.

  FAULTY     unmasked padding mass, non-finite logits, ghost labels, skipped steps, blind
             steps, input ids on untrained rows, dropped reports, and a loss of 87
  HALTED     stopped by nonfinite (one of FAULTY)
  SILENT     last report 10 minutes ago, its step frozen
  STRAGGLER  steps at a fifth of the others' rate
  every rank counts loss_spike violations: the guard's decisions are all-reduced, so a run-wide
             fault is counted on every rank, the case that makes per-rank alerts fan out.
"""

from __future__ import annotations

from tests.dashboards.fleet import Render, Template, capture_exposition

__all__ = ["FAULTY", "HALTED", "RANKS", "RUN", "SILENT", "STRAGGLER", "render", "values"]

RUN = "scale.1"  # the dot checks that the dashboard's regex matchers escape run ids
RANKS = 1200
FAULTY = {7, 613, 1187}
HALTED = {7}
SILENT = {1024}
STRAGGLER = {333}


def values(rank: int, scrape: int, now: float) -> dict[str, float]:
    """What rank `rank` reports at its `scrape`-th scrape; counters grow once a scrape."""
    n, bad = scrape, rank in FAULTY
    found = {
        "guard_step": 100 + (0 if rank in SILENT else n if rank in STRAGGLER else 5 * n),
        "guard_last_report_timestamp_seconds": now - 600 if rank in SILENT else now,
        "guard_loss": 87.0 if bad else 2.0 + rank / 1e5,
        "guard_padding_mass_ratio": 0.99 if bad else 0.02,  # garbage rows, or healthy ones
        "guard_padding_mass_max_ratio": 1.0 if bad else 0.03,
        'guard_violations_total{check="padding_mass",action="warn"}': n if bad else 0,
        'guard_violations_total{check="loss_spike",action="warn"}': n,
        'guard_violations_total{check="coverage",action="warn"}': n if bad else 0,
        'guard_nonfinite_values_total{tensor="logits"}': 4 * n if bad else 0,
        'guard_out_of_range_tokens_total{kind="label"}': 3 * n if bad else 0,
        'guard_untrained_tokens_total{kind="input"}': 2 * n if bad else 0,
        "guard_skipped_steps_total": n if bad else 0,
        "guard_dropped_reports_total": 7 * n if bad else 0,
    }
    if rank in HALTED:
        found['guard_halted{check="nonfinite"}'] = 1
    return found


def render() -> Render:
    """Each rank's exposition: a real guard's (captured once), re-labelled, with `values`."""
    template = Template(capture_exposition())

    def rendered(rank: int, scrape: int, now: float) -> bytes:
        return template.render(RUN, rank, values(rank, scrape, now)).encode()

    return rendered
