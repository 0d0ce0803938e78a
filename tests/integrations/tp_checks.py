"""What every tensor-parallel run must show, whatever made the vocab-parallel head (torch's
parallelize_module, Megatron-core): the assertions of tests/integrations/test_tp_*.py on the
results of tp_worker.py's cases, rank by rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from guard.device.ops import sample_size
from guard.policy import Policy
from tests.integrations.test_distributed import run_ranks
from tests.integrations.tp_models import REAL, B, T

WORKER = Path(__file__).with_name("tp_worker.py")

WHOLE_ROWS = 1024
# A head sharded by hand (vocab_shard=) masked, stopped at ghosts and NaNs before issue 31
# already; its padding mass was its shard's, against the whole vocab's threshold: the cases
# it runs.
HAND = ("healthy", "garbage")


def launched(mode: str) -> Any:
    """A module fixture: every rank's results of tp_worker.py's `mode`, one launch on 2 and
    one on 4 ranks."""

    @pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
    def ranks(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp(f"{mode}{request.param}")
        return run_ranks(out, mode, nproc=request.param, worker=WORKER)[0]

    return ranks


def assert_healthy_is_quiet(ranks: list[dict[str, Any]]) -> None:
    """Nothing fires or is logged; unmasked, every rank reports the whole vocab's padding mass
    (exact, over every position), not its shard's."""
    for res in ranks:
        assert res["violations"] == {} and res["logged"] == []
        unmasked, whole = res["unmasked"], res["whole"]
        assert unmasked["violations"] == {}
        assert unmasked["padding_mass"] == pytest.approx(whole["mean"], rel=1e-4)
        assert unmasked["padding_mass_max"] == pytest.approx(whole["max"], rel=1e-4)
        assert unmasked["logsumexp"] == pytest.approx(whole["logsumexp"], rel=1e-4)
    figures = [(r["unmasked"]["padding_mass"], r["unmasked"]["padding_mass_max"]) for r in ranks]
    assert len(set(figures)) == 1  # g.stats the same on every rank of the group


def assert_garbage_stops_every_rank(ranks: list[dict[str, Any]]) -> None:
    """The last rank holds the padding rows [1000, 1024): every rank stops, naming it."""
    holder = len(ranks) - 1
    for res in ranks:
        rows = res["rows"]
        assert (rows["check"], rows["step"], rows["rank"]) == ("padding_rows", 0, holder)
        assert rows["message"].startswith(
            f"padding_rows on rank {holder} at step 0: rows [{REAL}, {WHOLE_ROWS}) of ")
        mass = res["mass"]
        assert (mass["check"], mass["step"], mass["rank"]) == ("padding_mass", 1, holder)
        # The threshold enforced is the whole vocab's, and the message quotes it.
        assert mass["threshold"] == pytest.approx(res["whole_threshold"])
        assert f"on the {WHOLE_ROWS - REAL} padding columns [{REAL}, {WHOLE_ROWS})" in \
            mass["message"]
        assert res["mass_max"] > 0.5  # rank 0's too: the whole vocab's, not its shard's 0
    assert len({r["mass_max"] for r in ranks}) == 1


def assert_mask_trains_the_real_vocab(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert res["losses"] == pytest.approx(res["reference"], abs=1e-4)
        assert res["padding_grad"] == [0.0, 0.0, 0.0]
        assert res["violations"] == {}
    assert ranks[-1]["held"] == WHOLE_ROWS - REAL and ranks[0]["held"] == 0


def assert_ghost_stops_every_rank(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        v = res["violation"]
        assert res["raised_at"] == 2 and res["unchanged"]
        assert (v["check"], v["step"]) == ("token_range", 2)
        assert "label id" in v["message"] and str(REAL + 7) in v["message"]
        # The input id too, as a global id, through the vocab-parallel embedding.
        assert res["out_of_range"] == {"input": 1, "label": 1}


def assert_nan_stops_every_rank(ranks: list[dict[str, Any]]) -> None:
    """A NaN in rank 0's columns reaches every rank's loss: all stop at step 2, before the
    update; the real-vocab logits' count is rank 0's alone."""
    for res in ranks:
        v = res["violation"]
        assert res["raised_at"] == 2 and res["unchanged"]
        assert (v["check"], v["step"], v["rank"]) == ("nonfinite", 2, len(ranks) - 1)
        assert "Localisation: " in v["message"] and "forward raised" not in v["message"]
    sampled = sample_size(B * T, Policy().checks.padding_mass.sample_tokens)
    assert [r["logits"] for r in ranks] == [sampled] + [0] * (len(ranks) - 1)


CHECKS = {"healthy": assert_healthy_is_quiet, "garbage": assert_garbage_stops_every_rank,
          "mask": assert_mask_trains_the_real_vocab, "ghost": assert_ghost_stops_every_rank,
          "nan": assert_nan_stops_every_rank}
