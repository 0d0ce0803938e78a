"""DeepSpeed ZeRO-2 and ZeRO-3, run for real on the CPU: two gloo ranks under torchrun, the
raw engine loop and the HF Trainer (tests/integrations/ds_worker.py, ds_trainer.py). One
launch per stage runs every case on both ranks; its op build is done once, outside the timed
part (the `built` fixture)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.test_distributed import DIST, run_ranks_with

if importlib.util.find_spec("deepspeed") is None:  # not imported here: the ranks do
    pytest.skip("needs deepspeed (the dev extra installs it)", allow_module_level=True)

WORKER = Path(__file__).with_name("ds_worker.py")
TIMEOUT_S = 400  # one stage's 14 cases take ~1 min on 2 cores; a hang is killed, not waited on
# The op is built into this environment's own folder: a cache shared between checkouts held a
# lock left by a killed build, and every later build waited on it until its timeout.
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
       "TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}
ENTRIES = ("engine", "trainer")


@pytest.fixture(scope="session")
def built() -> None:
    """DeepSpeed's shared-memory op compiles on first use (about 40 s, once per environment):
    here, before any launch is timed."""
    code = ("from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; "
            "ShareMemCommBuilder().load()")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                   env={**os.environ, **ENV}, timeout=900)


def launch(out: Path, stage: int) -> list[dict[str, Any]]:
    return run_ranks_with(out, [str(WORKER), str(out), str(stage)], ENV, TIMEOUT_S)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def ranks(request: pytest.FixtureRequest, built: None,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]]]:
    stage = int(request.param)
    return stage, launch(tmp_path_factory.mktemp(f"zero{stage}"), stage)


def cases(ranks: tuple[int, list[dict[str, Any]]], name: str) -> list[tuple[str, dict[str, Any]]]:
    """(entry, result) of both ranks, for each entry that ran the case."""
    return [(e, r[f"{e}/{name}"]) for e in ENTRIES for r in ranks[1] if f"{e}/{name}" in r]


@pytest.mark.slow
@DIST
def test_a_healthy_padded_model_trains_quiet_one_step_per_update(ranks: Any) -> None:
    for entry, res in cases(ranks, "healthy"):
        stats = res["stats"]
        assert res["raised"] is None and res["said"] == [], entry
        assert stats["violations"] == {}, entry  # no check fired, none was blind
        # Three updates are three steps, though ZeRO calls the torch optimizer's step once
        # per parameter group (two here, as the Trainer makes).
        assert stats["step"] == 3, entry
        if entry == "engine":
            assert res["inner_calls"] == 6
        assert stats["padding_mass"] is not None and stats["padding_mass"] < 0.1
        # The gradients were read from ZeRO's own buffers, every step.
        assert stats["grad_norm"] is not None and stats["grad_norm"] > 0
        assert stats["nonfinite"]["grad"] == 0
        assert res["padding"]["model"] <= 1.0 and res["padding"]["master"] <= 1.0


@pytest.mark.slow
@DIST
def test_garbage_padding_rows_fail_at_step_1_on_both_ranks(ranks: Any) -> None:
    for entry, res in cases(ranks, "padding-fail"):
        raised = res["raised"]
        assert raised is not None and (raised["check"], raised["step"]) == ("padding_mass", 1)
        assert raised["unchanged"], entry  # before the update


@pytest.mark.slow
@DIST
def test_the_mask_gives_the_real_vocab_loss_and_leaves_the_padding_rows(ranks: Any) -> None:
    for entry, res in cases(ranks, "mask"):
        assert res["raised"] is None and res["stats"]["violations"] == {}, entry
        if entry == "engine":  # the step-1 loss is that of a head over the real vocab only
            assert res["losses"][0] == pytest.approx(res["reference"], abs=1e-5)
        # No gradient reached them in three updates: as they were built, on both ranks.
        assert res["padding"]["rows"] == res["start"], entry
        assert res["padding"]["model"] > 10  # still garbage: the mask, not a repair


@pytest.mark.slow
@DIST
def test_the_default_repair_holds_after_several_updates(ranks: Any) -> None:
    for entry, res in cases(ranks, "repair"):
        assert res["raised"] is None, entry
        # Repaired once at attach and never again: DeepSpeed's fp32 copy was repaired too,
        # so no update wrote the garbage back.
        assert res["stats"]["violations"] == {"padding_rows": {"repair": 1}}, entry
        assert res["padding"]["model"] <= 1.0 and res["padding"]["master"] <= 1.0, entry


def stopped(ranks: Any, name: str, check: str) -> list[tuple[str, dict[str, Any]]]:
    """(entry, violation) of each rank and entry, each stopped by `check` at step 2 before
    that update: DeepSpeed's fp32 copy of every parameter as it was."""
    out = []
    for entry, res in cases(ranks, name):
        raised = res["raised"]
        assert raised is not None, entry
        assert (raised["check"], raised["step"]) == (check, 2), entry
        assert raised["unchanged"], entry
        out.append((entry, raised))
    return out


@pytest.mark.slow
@DIST
def test_a_ghost_label_on_one_rank_stops_both_before_the_update(ranks: Any) -> None:
    for entry, raised in stopped(ranks, "ghost", "token_range"):
        assert raised["rank"] == 1, entry


@pytest.mark.slow
@DIST
def test_a_nan_in_the_logits_stops_both_ranks_under_fail(ranks: Any) -> None:
    for entry, raised in stopped(ranks, "nan-logits", "nonfinite"):
        assert "in the real-vocab logits" in raised["message"], entry  # rank 0's, both stop


@pytest.mark.slow
@DIST
def test_a_nan_born_in_the_backward_is_read_from_zeros_gradients(ranks: Any) -> None:
    for entry, raised in stopped(ranks, "nan-backward", "nonfinite"):
        assert "born in the backward" in raised["message"], entry
        assert "transformer.h.0" in raised["message"], entry


@pytest.mark.slow
@DIST
def test_skip_drops_the_whole_update_on_every_rank(ranks: Any) -> None:
    # Rank 0's loss spikes at step 2 (its gradients finite, 100 times too large): both ranks
    # drop that update, every parameter group of it, and train on.
    for entry, res in cases(ranks, "spike-skip"):
        stats = res["stats"]
        assert res["raised"] is None and stats["step"] == 3, entry
        assert stats["skipped_steps"] == 1, entry
        assert stats["violations"] == {"loss_spike": {"skip": 1}}, entry
        assert res["unchanged"], entry  # DeepSpeed's fp32 copy as step 1 left it


@pytest.mark.slow
@DIST
def test_a_repair_between_updates_resets_the_moments_and_holds(ranks: Any) -> None:
    # The padding rows train unmasked; after step 1 garbage is written into them, in the model
    # and in DeepSpeed's fp32 copy: step 2's read repairs both and zeroes their Adam moments.
    held = set()
    for entry, res in cases(ranks, "repair-later"):
        assert res["stats"]["violations"]["padding_rows"] == {"repair": 1}, entry
        before_any, after_repair, after_update = res["moments"][:3]  # the reads of steps 1-3
        assert before_any == -1.0  # no optimizer state before the first update
        assert res["padding"]["model"] <= 10.0 and res["padding"]["master"] <= 10.0
        if after_repair is None:  # this rank's partition holds none of the padding rows
            continue
        held.add(entry)
        assert after_repair == 0.0  # read inside the boundary, right after the repair
        assert after_update is not None and after_update > 0.0  # the rows train on from there
    assert held == {"engine"}  # some rank held the rows' moments (the case runs in the engine)
