"""torch's tensor parallel under torchrun on gloo: tp_models.TinyLM through parallelize_module
(torchtitan's plan) on 2 and on 4 ranks, its logits in each form, a head sharded by hand
(vocab_shard=), and FSDP2 over tensor parallel on a 2 x 2 mesh. One launch per layout runs
every case (tp_worker.py); a rank that skips a collective the others make hangs the launch,
which is killed under its timeout."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.test_distributed import DIST, run_ranks
from tests.integrations.tp_checks import CHECKS, HAND, REAL, WHOLE_ROWS, WORKER, launched

FORMS = ("dtensor", "local", "gathered")


torch_tp = launched("torch")


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(CHECKS))
def test_parallelize_module(torch_tp: list[dict[str, Any]], form: str, case: str) -> None:
    CHECKS[case]([res[form][case] for res in torch_tp])


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("case", HAND)
def test_a_head_sharded_by_hand(torch_tp: list[dict[str, Any]], case: str) -> None:
    # vocab_shard=(start, end); the world is the tensor-parallel group, so no group is given.
    CHECKS[case]([res["hand"][case] for res in torch_tp])


@pytest.mark.slow
@DIST
def test_a_dtensor_head_says_its_shard_and_degree(torch_tp: list[dict[str, Any]]) -> None:
    tp = len(torch_tp)
    for rank, res in enumerate(torch_tp):
        calls, width = res["attach"], WHOLE_ROWS // tp
        # The docs' old call, vocab_shard= and the degree given, agrees and is accepted.
        assert calls["agreeing"] == {"rows": WHOLE_ROWS, "tp": tp}
        other = (0, width) if rank else (width, 2 * width)
        assert calls["another shard"]["error"] == (
            f"vocab_shard={other} disagrees with lm_head: it is a DTensor Shard(0) on mesh dim "
            f"'tp', whose columns here are the ids [{rank * width}, {(rank + 1) * width}) of "
            f"{WHOLE_ROWS}; drop vocab_shard= (the guard reads it from the head)")
        assert calls["another degree"]["error"] == (
            f"vocab.tensor_parallel: 8, but lm_head is a DTensor Shard(0) on mesh dim 'tp' "
            f"split over {tp} ranks; set vocab.tensor_parallel: {tp} or leave it out")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("mesh"), "mesh", nproc=4, worker=WORKER)[0]


@pytest.mark.slow
@DIST
def test_fsdp2_over_tp_padding_rows_fail_naming_the_rank_that_holds_them(
        mesh: list[dict[str, Any]]) -> None:
    for res in mesh:
        # FSDP2's strided shard over tensor parallel's: one block of rows per rank.
        assert res["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        fail = res["fail"]
        assert (fail["check"], fail["step"], fail["rank"]) == ("padding_rows", 0, 3)
        assert fail["message"].startswith(
            f"padding_rows on rank 3 at step 0: rows [{REAL}, {WHOLE_ROWS}) of tok.weight and "
            "lm_head.weight")


@pytest.mark.slow
@DIST
def test_fsdp2_over_tp_repairs_padding_rows_in_place(mesh: list[dict[str, Any]]) -> None:
    for res in mesh:
        assert res["repair"]["fixed"]
        assert res["repair"]["violations"] == {"padding_rows": {"repair": 1}}
        assert res["healthy"] == {"violations": {}, "logged": []}


@pytest.mark.slow
@DIST
def test_fsdp2_over_tp_untrained_rows_found_whole_and_repaired_where_used(
        mesh: list[dict[str, Any]]) -> None:
    for res in mesh:
        u = res["untrained"]
        assert u["found"] == {"embedding": 9, "lm_head": 9}
        assert u["violations"] == {"untrained_rows": {"repair": 1}}
        for weight in ("embedding", "head"):
            assert u[weight]["repaired"] == [11, 601]
            assert u[weight]["zero"] == [10, 12, 300, 301, 302, 600, 602]
