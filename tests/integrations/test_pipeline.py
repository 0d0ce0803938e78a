"""Pipeline parallel under torchrun on gloo with torch's own pipelining (`PipelineStage`,
`ScheduleGPipe` and `Schedule1F1B`, 2 micro-batches): a tiny GPT (real vocab 1000 in 1024
rows) split torchtitan's way (tests/integrations/pp_models.py), a guard attached on every
rank to its `PipelineStage`. One launch per layout runs every case (pp_worker.py); a rank that
skips a collective the others make hangs the launch, which is killed under its timeout."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.pp_models import REAL, ROWS
from tests.integrations.test_distributed import DIST, RUN_ID, run_ranks_with

WORKER = Path(__file__).with_name("pp_worker.py")
SCHEDULES = ("gpipe", "1f1b")
TIMEOUT_S = 300  # two schedules x four cases on two loaded CPU cores; a hang is killed


def launched(mode: str, nproc: int) -> Any:
    """A module fixture: every rank's results of pp_worker.py's `mode`, one launch on `nproc`
    ranks."""

    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp(mode)
        return run_ranks_with(out, ["--rdzv-id", RUN_ID, str(WORKER), str(out), mode], None,
                              TIMEOUT_S, nproc=nproc)

    return ranks


pp2, tie, pp3 = launched("pp2", 2), launched("tie", 2), launched("pp3", 3)


def cases(ranks: list[dict[str, Any]], schedule: str, case: str) -> list[dict[str, Any]]:
    out = [res[schedule][case] for res in ranks]
    for res in out:
        assert "error" not in res, res["error"]
    return out


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_healthy_pipeline_is_quiet_on_every_stage(pp2: list[dict[str, Any]],
                                                    schedule: str) -> None:
    # torch 2.13 infers the shapes at the first step by running each stage on torch.empty
    # tensors: before the guard let that pass by, it read as a NaN in the head's input (1F1B).
    first, last = cases(pp2, schedule, "healthy")
    for res in (first, last):
        assert res["violations"] == {} and res["logged"] == []  # no blind step either
    assert first["losses"] == [None] * 3 and first["stats_loss"] is None
    assert all(math.isfinite(x) and 6.0 < x < 12.0 for x in last["losses"])
    assert last["stats_loss"] == pytest.approx(last["losses"][-1])  # the micro-batches' mean


def assert_garbage_stops(res: dict[str, Any], holder: int) -> None:
    """Garbage padding rows held by rank `holder`: attach stops (padding_rows), and with the
    rows left alone and no mask, step 1 before any update (padding_mass), each named as
    that rank names it, on every rank of every stage."""
    rows = res["rows"]
    assert (rows["check"], rows["step"], rows["rank"]) == ("padding_rows", 0, holder)
    assert rows["message"].startswith(
        f"padding_rows on rank {holder} at step 0: rows [{REAL}, {ROWS}) of output.weight:")
    mass = res["mass"]
    assert mass["raised_at"] == 1 and mass["unchanged"]
    v = mass["violation"]
    assert (v["check"], v["step"], v["rank"]) == ("padding_mass", 1, holder)
    assert f"on the {ROWS - REAL} padding columns [{REAL}, {ROWS})" in v["message"]


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_garbage_padding_rows_in_the_head_stop_every_stage(pp2: list[dict[str, Any]],
                                                           schedule: str) -> None:
    for res in cases(pp2, schedule, "garbage"):
        assert_garbage_stops(res, 1)  # the last stage holds them; the first stops too


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_mask_trains_the_real_vocab_across_stages(pp2: list[dict[str, Any]],
                                                      schedule: str) -> None:
    first, last = cases(pp2, schedule, "mask")
    assert first["violations"] == {} and last["violations"] == {}
    # The losses of the same weights unsplit, real rows only, on the whole batches.
    assert last["losses"] == pytest.approx(last["reference"], abs=1e-4)
    assert last["padding_grad"] == [0.0, 0.0, 0.0]
    assert first["padding_grad"] == []  # the head is not there


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_ghost_input_id_on_the_first_stage_stops_every_stage(pp2: list[dict[str, Any]],
                                                               schedule: str) -> None:
    first, last = cases(pp2, schedule, "ghost")
    for res in (first, last):
        v = res["violation"]
        assert res["raised_at"] == 2 and res["unchanged"]  # before any stage's update
        assert (v["check"], v["step"], v["rank"]) == ("token_range", 2, 0)
        assert v["message"].startswith("token_range on rank 0 at step 2: 1 input id outside")
        assert f"input ids {REAL + 3} at [1, 2]" in v["message"]
    assert first["out_of_range"] == {"input": 1, "label": 0}


@pytest.mark.slow
@DIST
def test_tied_copies_on_two_stages_are_checked(tie: list[dict[str, Any]]) -> None:
    both = ("tok_embeddings.weight on pipeline stage 0 of 2 (the embedding), rank 0, and "
            "output.weight on pipeline stage 1 of 2 (the head), rank 1, differ in")
    for res in cases(tie, "gpipe", "tied"):
        # Kept in step by the gradient all-reduce: quiet.
        assert res["healthy"] == {"violations": {}, "logged": []}
        # One copy written between steps 1 and 2: named at step 2's read, every stage
        # stopped before its update.
        drift = res["drift"]
        assert drift["raised_at"] == 2 and drift["unchanged"]
        v = drift["violation"]
        assert (v["check"], v["step"]) == ("vocab", 2)
        assert f"{both} 2 rows (ids 5, 700)" in v["message"]
        # One copy loaded apart before attach: attach stops on every stage.
        v = res["at_attach"]
        assert (v["check"], v["step"]) == ("vocab", 0)
        assert f"{both} 1 row (ids 999)" in v["message"]


@pytest.mark.slow
@DIST
def test_untrained_rows_on_each_end_are_repaired_on_their_stage(
        tie: list[dict[str, Any]]) -> None:
    first, last = cases(tie, "gpipe", "untrained")
    for res in (first, last):  # one decision: both stages repaired at the same read
        assert res["violations"] == {"untrained_rows": {"repair": 1}}
    # Input id 10 used: its embedding row repaired, 11 (unused) left; label 600: its head row.
    assert first["repaired"] == {"embedding": [True, False]}
    assert last["repaired"] == {"head": [True]}
    assert first["message"] == last["message"]
    assert "ids 10, 600 (untrained in tok_embeddings.weight and output.weight)" in \
        first["message"]


def assert_nan_born_on(res: dict[str, Any], layer: int, stage: str) -> None:
    """Quiet when healthy; at step 2 a NaN born in the backward of `layer`'s MLP stops every
    stage before its update, named by that layer's parameter latest in the forward (the
    MLP's output Linear), then the rest of its stage's and the stages' below; the last
    stage's gradients are finite."""
    assert res["healthy"] == {"violations": {}, "logged": []}
    nan = res["nan"]
    assert nan["raised_at"] == 2 and nan["unchanged"]
    v = nan["violation"]
    assert (v["check"], v["step"]) == ("nonfinite", 2)
    assert (f"so it was born in the backward: the gradients of layers.{layer}.mlp.2.bias, "
            f"layers.{layer}.mlp.2.weight, layers.{layer}.mlp.0.bias") in v["message"]
    assert f"born on {stage}, the last stage whose" in v["message"]
    assert "output.weight" not in v["message"]


@pytest.mark.slow
@DIST
def test_a_nan_born_in_a_middle_stage_backward_is_named_there(
        pp3: list[dict[str, Any]]) -> None:
    for res in cases(pp3, "gpipe", "nan_middle"):
        # Three stages, the middle one holding neither end.
        assert_nan_born_on(res, 1, "pipeline stage 1 of 3 (neither end)")
