"""Megatron-core's vocab-parallel layers under torchrun on gloo (CPU, use_cpu_initialization):
tp_models.MegatronLM on 2 and on 4 tensor-parallel ranks, every case in one launch each
(tp_worker.py). Needs megatron-core (the `tp` extra, in `dev`)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.integrations.test_distributed import DIST
from tests.integrations.tp_checks import CHECKS, launched

MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                              reason="needs megatron-core (pip install -e '.[tp]')")


megatron = launched("megatron")


@pytest.mark.slow
@DIST
@MEGATRON
@pytest.mark.parametrize("case", list(CHECKS))
def test_megatron_layers(megatron: list[dict[str, Any]], case: str) -> None:
    CHECKS[case]([res["megatron"][case] for res in megatron])


@pytest.mark.slow
@DIST
@MEGATRON
def test_megatron_layers_say_their_shard_and_degree(megatron: list[dict[str, Any]]) -> None:
    tp = len(megatron)
    for res in megatron:
        calls = res["attach"]
        assert calls["agreeing"] == {"rows": 1024, "tp": tp}
        assert "disagrees with output_layer: it is Megatron's ColumnParallelLinear" in \
            calls["another shard"]["error"]
        assert calls["another degree"]["error"] == (
            f"vocab.tensor_parallel: 8, but output_layer is Megatron's ColumnParallelLinear "
            f"split over {tp} ranks; set vocab.tensor_parallel: {tp} or leave it out")
