from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from guard.cli import main
from guard.demo.data import Corpus
from guard.demo.padded import build, uninitialised
from guard.demo.scenarios import REAL, ROWS, SCENARIOS

Arms = dict[str, dict[str, Any]]


def _demo(tmp_path: Path, *argv: str) -> tuple[int, Arms, dict[str, Any]]:
    rc = main(["demo", "--no-serve", "--out", str(tmp_path), *argv])
    summary = json.loads((tmp_path / "summary.json").read_text())
    return rc, {a["name"]: a for a in summary["arms"]}, summary


def test_seed_scenario_the_guard_notices_at_step_1_and_no_nan_check_does(tmp_path: Path) -> None:
    rc, arms, summary = _demo(tmp_path, "--steps", "8")
    assert rc == 0 and summary["scenario"] == "seed"
    unguarded = arms["unguarded"]
    # The unguarded loss stays finite: the failure a NaN check cannot see.
    assert all(isinstance(x, float) and math.isfinite(x) for x in unguarded["losses"])
    assert unguarded["padding_mass"][0] > 0.5  # the ghost classes hold the probability
    assert arms["NaN/Inf loss check"]["noticed"] is None
    assert arms["detect_anomaly"]["noticed"] is None
    assert arms["fail"]["noticed"] == 1 and arms["fail"]["steps_run"] == 1
    assert arms["fail"]["verdict"].startswith("stopped at step 1: padding_mass on rank 0")
    assert "[50000, 50016)" in arms["fail"]["verdict"]
    assert arms["mask"]["noticed"] == 1 and arms["mask"]["padding_ids"] == 0
    # Both levels: the figure noticed by both guarded arms at step 1; a violation only where
    # the loss trained on the ghost classes (fail stopped there), none where the mask kept them
    # out of it.
    assert (arms["fail"]["violations"], arms["mask"]["violations"]) == (1, 0)
    assert arms["mask"]["over_bound"] == 8
    assert arms["mask"]["verdict"].startswith("masked: padding mass over 10x healthy before "
                                              "the mask at 8 of 8 reads; 0 violations")
    # The mask arm's padding mass is the one before the mask (the README's figure), not the
    # 0 the masked logits give; the reference has no padding column.
    assert min(arms["mask"]["padding_mass"]) > 0.5
    assert arms["reference"]["padding_mass"] == [0.0] * 8
    # The closing sentences are this run's: the figures in them are the recorded series'.
    said = " ".join(summary["findings"])
    mass = unguarded["padding_mass"]
    assert f"at step 8 it is {mass[-1]:.2g}" in said
    assert f"ends at {unguarded['final_loss']:.3f}" in said
    assert arms["unguarded"]["violations"] is None
    assert summary["mask_vs_reference_max_abs_diff"] < 1e-4
    # The stall: behind the reference already after 8 steps.
    assert unguarded["final_loss"] > arms["reference"]["final_loss"] + 0.05
    assert (tmp_path / "losses.png").stat().st_size > 10_000


def test_nan_scenario_every_detector_fires_at_step_1(tmp_path: Path) -> None:
    rc, arms, _ = _demo(tmp_path, "--steps", "3", "--scenario", "nan")
    assert rc == 0
    assert arms["NaN/Inf loss check"]["noticed"] == 1 and arms["detect_anomaly"]["noticed"] == 1
    assert arms["fail"]["noticed"] == 1 and arms["mask"]["steps_run"] == 3


def test_the_closing_line_is_true_without_a_terminal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--steps", "1", "--serve", "127.0.0.1:0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "endpoint is closed" in out and "until exit" not in out
    # Not a terminal: the table at its natural width (rich would cut it to 80 columns), every
    # heading whole on one line, and sentences not folded.
    assert "padding mass before any mask, step 1 / last" in out
    assert "head over the real vocab only" in out
    assert max(len(line) for line in out.splitlines()) > 80
    assert "The unguarded run's padding mass (before any mask) was over the guard's bound" in out


def test_corpus_is_deterministic_and_in_the_real_vocab() -> None:
    a, b = Corpus(REAL, seed=3), Corpus(REAL, seed=3)
    x1, y1 = a.batch(5, 4, 16)
    x2, y2 = b.batch(5, 4, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert int(x1.max()) < REAL and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(a.batch(6, 4, 16)[0], x1)


def test_garbage_is_finite_and_the_reference_shares_the_real_rows() -> None:
    g = uninitialised((16, 8), seed=1)
    assert torch.isfinite(g).all() and float(g.abs().max()) > 1e30
    for scenario in SCENARIOS.values():
        padded, ref = build(scenario, 0, 16, 1)
        assert padded.lm_head.weight.shape[0] == ROWS and ref.lm_head.weight.shape[0] == REAL
        assert torch.equal(padded.lm_head.weight[:REAL], ref.lm_head.weight)
        assert torch.isfinite(padded.lm_head.weight).all()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--device", "gpu7"], "'gpu7' is not a torch device"),
    ],
)
def test_bad_demo_flags_name_the_flag(argv: list[str], expected: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--no-serve", *argv]) == 2
    assert expected in capsys.readouterr().err
