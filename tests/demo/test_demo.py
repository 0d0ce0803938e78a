from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from guard.cli import main
from guard.demo.data import Corpus
from guard.demo.run import REAL, ROWS, build, uninitialised


def test_short_demo_shows_the_three_outcomes(tmp_path: Path) -> None:
    rc = main(["demo", "--steps", "4", "--no-serve", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    arms = {a["name"]: a for a in summary["arms"]}
    assert rc == 0
    # unguarded: the collapse really happens (NaN / spike), at a step the demo reports
    assert arms["unguarded"]["first_bad"] == 1 and arms["unguarded"]["steps_run"] == 4
    assert "collapsed at step 1" in arms["unguarded"]["verdict"]
    # fail: stopped at the first step with the guard's message
    assert arms["fail"]["verdict"].startswith("stopped at step 1: padding_mass on rank 0")
    assert "[50000, 50016)" in arms["fail"]["verdict"]
    # mask: the reference's loss curve
    assert arms["mask"]["first_bad"] is None and arms["mask"]["steps_run"] == 4
    assert summary["mask_vs_reference_max_abs_diff"] < 1e-4
    assert (tmp_path / "losses.png").stat().st_size > 10_000


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
    padded, ref = build(0, 16, 1)
    assert padded.wte.weight.shape[0] == ROWS and ref.wte.weight.shape[0] == REAL
    assert torch.equal(padded.wte.weight[:REAL], ref.wte.weight)


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
