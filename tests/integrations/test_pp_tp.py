"""Pipeline parallel x tensor parallel under torchrun on gloo: 4 ranks on a ("pp", "tp") mesh,
torch's own pipelining (`PipelineStage`, `ScheduleGPipe` and `Schedule1F1B`, 2 micro-batches)
over "pp", each stage's end vocab-parallel over "tp" with torch's tensor parallel (issue 31's
layout): the first stage's embedding `RowwiseParallel`, the last stage's head
`ColwiseParallel` with its logits a DTensor under `loss_parallel`. Ranks 0 and 1 hold stage 0
(tp 0 and 1), ranks 2 and 3 stage 1; rank 3 holds the head's rows [512, 1024), the padding
rows [1000, 1024) among them. A guard on every rank takes one decision over the four. One
launch runs every case under both schedules (pp_worker.py `pp2tp2`); a rank that skips a
collective the others make hangs it, and the launch is killed under its timeout."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.integrations.pp_models import REAL
from tests.integrations.test_distributed import DIST
from tests.integrations.test_pipeline import (
    SCHEDULES,
    assert_garbage_stops,
    assert_nan_born_on,
    cases,
    launched,
)

pptp = launched("pp2tp2", 4)
FIRST, LAST = (0, 1), (2, 3)  # the ranks of each stage


def by_stage(ranks: list[dict[str, Any]], schedule: str,
             case: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    every = cases(ranks, schedule, case)
    return [every[r] for r in FIRST], [every[r] for r in LAST]


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_healthy_pp_tp_pipeline_is_quiet_on_every_rank(
        pptp: list[dict[str, Any]], schedule: str) -> None:
    first, last = by_stage(pptp, schedule, "healthy")
    for res in first + last:
        assert res["violations"] == {} and res["logged"] == []  # no blind step either
    for res in first:
        assert res["losses"] == [None] * 3 and res["stats_loss"] is None
    assert last[0]["losses"] == last[1]["losses"]  # loss_parallel: one loss on the tp group
    for res in last:
        assert all(math.isfinite(x) and 6.0 < x < 12.0 for x in res["losses"])
        assert res["stats_loss"] == pytest.approx(res["losses"][-1])


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_garbage_padding_rows_on_one_tp_rank_stop_every_stage(
        pptp: list[dict[str, Any]], schedule: str) -> None:
    for res in cases(pptp, schedule, "garbage"):
        # Rank 3 holds them; the padding mass is the whole vocab's, the two tp shards'
        # columns combined (both last-stage ranks measure one softmax), named by the highest.
        assert_garbage_stops(res, 3)


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_mask_trains_the_real_vocab_across_pp_and_tp(
        pptp: list[dict[str, Any]], schedule: str) -> None:
    first, last = by_stage(pptp, schedule, "mask")
    for res in first + last:
        assert res["violations"] == {}
    for res in first:
        assert res["padding_grad"] == []  # no head on the first stage
    for res in last:
        # The losses of the same weights unsplit, real rows only, on the whole batches.
        assert res["losses"] == pytest.approx(res["reference"], abs=1e-4)
        # Rank 3 holds the padding rows: none of them gets a gradient (rank 2 holds none).
        assert res["padding_grad"] == [0.0, 0.0, 0.0]


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_ghost_input_id_on_the_first_stage_stops_every_rank(
        pptp: list[dict[str, Any]], schedule: str) -> None:
    first, _ = by_stage(pptp, schedule, "ghost")
    for res in cases(pptp, schedule, "ghost"):
        v = res["violation"]
        assert res["raised_at"] == 2 and res["unchanged"]  # before any rank's update
        # Both first-stage ranks see the replicated input ids: the highest names it.
        assert (v["check"], v["step"], v["rank"]) == ("token_range", 2, 1)
        assert v["message"].startswith("token_range on rank 1 at step 2: 1 input id outside")
        assert f"input ids {REAL + 3} at [1, 2]" in v["message"]
    for res in first:
        assert res["out_of_range"] == {"input": 1, "label": 0}


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_nan_born_in_the_first_stage_backward_is_named_there(
        pptp: list[dict[str, Any]], schedule: str) -> None:
    for res in cases(pptp, schedule, "nan_first"):
        # The first stage's: the last stage's gradients (the vocab-parallel head's among
        # them) are finite.
        assert_nan_born_on(res, 0, "pipeline stage 0 of 2 (the embedding)")


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tied_vocab_parallel_copies_on_two_stages_are_checked_shard_by_shard(
        pptp: list[dict[str, Any]], schedule: str) -> None:
    def pair(tp: int, ids: str) -> str:
        return (f"tok_embeddings.weight on pipeline stage 0 of 2 (the embedding), rank {tp}, "
                f"and output.weight on pipeline stage 1 of 2 (the head), rank {tp + 2}, "
                f"differ in {ids}")

    for res in cases(pptp, schedule, "tied"):
        # Each tp rank of stage 0 holds the rows its peer on stage 1 holds: quiet in step.
        assert res["healthy"] == {"violations": {}, "logged": []}
        drift = res["drift"]  # rows 5 (tp 0's) and 700 (tp 1's) written between steps 1, 2
        assert drift["raised_at"] == 2 and drift["unchanged"]
        v = drift["violation"]
        assert (v["check"], v["step"]) == ("vocab", 2)
        assert f"{pair(0, '1 row (ids 5)')}; {pair(1, '1 row (ids 700)')}" in v["message"]
        v = res["at_attach"]  # row 999 of the head loaded apart: attach stops
        assert (v["check"], v["step"]) == ("vocab", 0)
        assert pair(1, "1 row (ids 999)") in v["message"]
