"""The demo's sentences, from recorded series: each figure it prints is the series' own."""

from __future__ import annotations

import io
import math

from rich.console import Console
from rich.table import Table

from guard.demo.arms import ArmResult, Detectors, bound
from guard.demo.scenarios import REAL, ROWS
from guard.demo.text import (
    detector_sentence,
    findings,
    mask_verdict,
    mass_sentence,
    print_table,
    spans,
)

LIMIT = bound(REAL, ROWS, 10.0)


def _issue_series() -> list[float]:
    """The shape the issue's plot showed: over the bound at steps 1-2 and 36-45, under it from
    step 3 to 35 and after 45, ending at 1.8e-07 (60 steps)."""
    return [0.9 if s in (1, 2) or 36 <= s <= 45 else (1.8e-07 if s == 60 else 1e-4)
            for s in range(1, 61)]


def test_spans_name_stretches_and_count_the_rest() -> None:
    assert spans([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert spans([1, 3, 5, 7, 9, 11], shown=2) == "1, 3 and 4 more stretches"
    assert spans([1, 3, 5], shown=2) == "1, 3 and 1 more stretch"


def test_the_mass_sentence_is_the_series_not_most_of_the_run() -> None:
    said = mass_sentence(ArmResult("unguarded", padding_mass=_issue_series()), LIMIT)
    assert f"over the guard's bound of {LIMIT:.2g} at 12 of 60 steps (steps 1-2, 36-45)" in said
    assert f"at most {0.9 / LIMIT:.3g}x the bound (step 1)" in said
    assert "at step 60 it is 1.8e-07, under the bound" in said
    assert "most of the run" not in said


def test_the_mass_sentence_when_never_over_or_not_finite() -> None:
    under = mass_sentence(ArmResult("mask", padding_mass=[1e-4, 2e-4]), LIMIT)
    assert "stayed under the guard's bound" in under and "at most 0.0002, step 2" in under
    nan = mass_sentence(ArmResult("unguarded", padding_mass=[math.nan, 0.9]), LIMIT)
    assert "at 1 of 2 steps (steps 2)" in nan and "not finite at 1 of 2 steps" in nan
    assert "was not finite at any" in mass_sentence(ArmResult("x", padding_mass=[math.nan]),
                                                   LIMIT)


def _arms() -> tuple[list[ArmResult], Detectors]:
    losses = [10.0, 9.0, 8.5, 8.0, 7.5, 7.0, 9.8, 7.4]
    ref_losses = [10.0, 8.8, 8.1, 7.6, 7.2, 6.9, 6.7, 6.5]
    unguarded = ArmResult("unguarded", losses=losses, padding_mass=[0.9] * 8)
    fail = ArmResult("fail", losses=[10.0], noticed=1, violations=1,
                     verdict="stopped at step 1: padding_mass on rank 0 ...")
    mask = ArmResult("mask", losses=ref_losses, padding_mass=[0.9] * 8, noticed=1,
                     violations=0, over_bound=8)
    ref = ArmResult("reference", losses=ref_losses, padding_mass=[0.0] * 8)
    detectors = Detectors(ArmResult("NaN/Inf loss check"), ArmResult("detect_anomaly",
                                                                     noticed=3))
    return [unguarded, fail, mask, ref], detectors


def test_findings_are_computed_from_the_arms() -> None:
    arms, detectors = _arms()
    said = findings(arms, detectors, LIMIT, 2e-7)
    text = " ".join(said)
    assert "the loss spiked at step 7 (7.00 -> 9.80)" in text
    assert "stayed finite at all 8 steps and ends at 7.400 against the reference's 6.500 " \
           "(+0.900)" in text
    assert "at 8 of 8 steps (steps 1-8)" in text
    assert detector_sentence(detectors) in said
    assert "NaN/Inf loss check never fired, and detect_anomaly fired at step 3" in text
    assert "The guard noticed at step 1: fail stopped the run at step 1; mask trained with 0 " \
           "violations" in text and "within 2e-07 of the reference's" in text
    # A non-finite loss is said as such, at its step.
    arms[0].losses[4] = math.inf
    assert "the loss was non-finite (inf) first at step 5 of 8" in " ".join(
        findings(arms, detectors, LIMIT, 2e-7))


def test_mask_verdict_counts_reads_and_violations() -> None:
    arms, _ = _arms()
    assert mask_verdict(arms[2], 10.0) == ("masked: padding mass over 10x healthy before the "
                                           "mask at 8 of 8 reads; 0 violations: the loss "
                                           "never saw it")
    arms[2].violations = 1
    assert "1 violation: the loss saw it" in mask_verdict(arms[2], 10.0)


def test_a_table_to_a_file_is_not_cut_to_80_columns() -> None:
    t = Table(title="t")
    for col in ("arm", "padding mass before any mask, step 1 / last", "verdict"):
        t.add_column(col)
    t.add_row("reference", "0 / 0", "head over the real vocab only, a long verdict here")
    out = io.StringIO()
    console = Console(file=out)  # a file: not a terminal, rich's width 80
    assert not console.is_terminal and console.width == 80
    print_table(console, t)
    lines = out.getvalue().splitlines()
    assert any("padding mass before any mask, step 1 / last" in line for line in lines)
    assert any("head over the real vocab only, a long verdict here" in line for line in lines)
    assert max(len(line) for line in lines) > 80
