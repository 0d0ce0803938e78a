"""RowShard: the rows of a weight this rank holds, on one rank (two ranks under FSDP2:
tests/integrations/test_distributed.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import guard
from guard.errors import AttachError
from guard.weights.sharded import RowShard
from tests.conftest import policy
from tests.integrations.nanogpt import nanogpt

DIST = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                          reason="needs torch.distributed with gloo")


def test_a_plain_weight_is_all_its_rows_and_writes_go_through() -> None:
    w = torch.randn(8, 4)
    shard = RowShard.of(w, "lm_head.weight")
    assert (shard.first, shard.count, shard.dtensor) == (0, 8, False)
    assert shard.largest_norm_below(6) == w[:6].norm(dim=-1).amax()
    shard.rows_from(6).zero_()
    assert (w[6:] == 0).all() and (w[:6] != 0).all()
    assert shard.rows_from(8).shape == (0, 4)


@pytest.fixture
def mesh() -> Iterator[Any]:
    """A one-rank gloo group and CPU mesh, torn down after the test."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@DIST
def test_a_dtensor_sharded_by_rows_is_read_and_written_through_its_local_tensor(
        mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    shard = RowShard.of(w, "lm_head.weight")
    assert (shard.first, shard.count, shard.dtensor) == (0, 8, True)
    pad = shard.rows_from(6)
    assert type(pad) is torch.Tensor and pad.shape == (2, 4)  # local: no DTensor op, no gather
    pad.zero_()
    assert (w.to_local()[6:] == 0).all()


@DIST
def test_a_dtensor_sharded_by_columns_is_refused_with_the_fix(mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(1)])  # each row's norm split
    with pytest.raises(AttachError, match=r"lm_head\.weight that this rank holds, but it is a "
                       r"DTensor with placements \(Shard\(dim=1\),\).*Set checks\.padding_rows"
                       r"\.action: off"):
        RowShard.of(w, "lm_head.weight")


@DIST
def test_attach_after_an_evaluation_holds_the_sharded_weight_under_fsdp2(mesh: Any) -> None:
    # nanoGPT's train.py evaluates before the first step: under no_grad FSDP2 leaves the root's
    # weights gathered, and frees that copy after the next backward.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    m = nanogpt(garbage=1e3)
    fully_shard(m, mesh=mesh)
    m.eval()
    with torch.no_grad():
        m(torch.zeros(1, 4, dtype=torch.long))
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with guard.attach(m, policy=policy(padding_rows={"action": "repair"}), vocab_size=100,
                      optimizer=opt) as g:
        assert isinstance(m.lm_head.weight, DTensor)
        x = torch.randint(0, 100, (2, 8))
        for _ in range(2):
            m(x, x)[1].backward()
            opt.step()  # the read checks the shard, not the freed gathered copy
            opt.zero_grad()
    assert g.stats["violations"]["padding_rows"] == {"repair": 1}
    local = m.lm_head.weight.to_local()  # one rank: the whole weight
    assert torch.allclose(local[100:], local[:100].mean(dim=0).expand(28, -1), atol=1e-6)
