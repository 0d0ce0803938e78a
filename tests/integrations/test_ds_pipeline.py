"""DeepSpeed's pipeline engine with tied embeddings, run for real on the CPU: two gloo ranks
under torchrun (DS_ACCELERATOR=cpu), a `PipelineModule` whose embedding is a `TiedLayerSpec`
on the first stage and, under the same key, the head on the last (its `forward_fn`), trained
by `engine.train_batch` (tests/integrations/ds_pipe_worker.py). One launch runs every case."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.pp_models import REAL, ROWS
from tests.integrations.test_distributed import DIST, run_ranks_with

if importlib.util.find_spec("deepspeed") is None:  # not imported here: the ranks do
    pytest.skip("needs deepspeed (the dev extra installs it)", allow_module_level=True)

from tests.integrations.test_deepspeed import ENV, built  # noqa: F401  (the op built once)

WORKER = Path(__file__).with_name("ds_pipe_worker.py")
TIMEOUT_S = 300  # two cases on two loaded cores; a hang is killed, not waited on


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    request.getfixturevalue("built")  # DeepSpeed's op, compiled outside the timed launch
    out = tmp_path_factory.mktemp("ds_pipe")
    every = run_ranks_with(out, [str(WORKER), str(out)], ENV, TIMEOUT_S)
    for res in every:
        for case in res.values():
            assert "error" not in case, case["error"]
    return every


@pytest.mark.slow
@DIST
def test_a_healthy_deepspeed_pipeline_is_quiet_on_both_stages(
        ranks: list[dict[str, Any]]) -> None:
    first, last = (res["healthy"] for res in ranks)
    # The stages as DeepSpeed's PipelineModule says them, the tie from its TiedLayerSpec.
    assert first["stage"] == "pipeline stage 0 of 2 (the embedding)" and first["tied"]
    assert last["stage"] == "pipeline stage 1 of 2 (the head)" and last["tied"]
    for res in (first, last):
        assert res["violations"] == {} and res["logged"] == []  # no blind step either
        assert all(math.isfinite(x) and 6.0 < x < 12.0 for x in res["losses"])


@pytest.mark.slow
@DIST
def test_the_forward_fn_head_logits_are_seen_garbage_rows_stop_both_stages(
        ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        # DeepSpeed calls the tied head through its forward_fn, past the module's hooks: the
        # guard measures the logits where g.loss_fn is given them.
        res = res["garbage"]
        assert res["raised_at"] == 1 and res["unchanged"]
        v = res["violation"]
        assert (v["check"], v["step"], v["rank"]) == ("padding_mass", 1, 1)
        assert f"on the {ROWS - REAL} padding columns [{REAL}, {ROWS})" in v["message"]


@pytest.mark.slow
@DIST
def test_tied_layer_spec_copies_made_to_drift_are_named_at_the_next_read(
        ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        drift = res["drift"]
        assert drift["raised_at"] == 2 and drift["unchanged"]  # both stages, before the update
        v = drift["violation"]
        assert (v["check"], v["step"]) == ("vocab", 2)
        assert ("tied_modules.embed.weight on pipeline stage 0 of 2 (the embedding), rank 0, "
                "and tied_modules.embed.weight on pipeline stage 1 of 2 (the head), rank 1, "
                "differ in 2 rows (ids 5, 700)") in v["message"]
