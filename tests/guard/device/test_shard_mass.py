"""The whole vocab's padding mass from its shards' parts (guard/device/shard_mass.py): each
shard's logsumexp of its real and padding columns, combined by logsumexp over the shards, is
the mass of the whole logits; in one process, the pure functions and a group of one."""

from __future__ import annotations

import pytest
import torch

import guard
from guard.checks import padding_mass
from guard.device.flags import Flags
from guard.device.shard_mass import ShardedMass, shard_parts, whole_vocab
from tests.conftest import policy

REAL, ROWS, TP = 100, 128, 4  # shards of 32 columns: the last holds 4 real ones, 28 padding


def test_the_shards_parts_combine_to_the_whole_vocabs_mass() -> None:
    logits = torch.randn(6, ROWS, generator=torch.Generator().manual_seed(0)) * 3.0
    logits[:, REAL:] += 2.0  # padding columns heavier than the real ones
    width = ROWS // TP
    parts = torch.stack([shard_parts(logits[:, k * width:(k + 1) * width],
                                     min(max(REAL - k * width, 0), width)) for k in range(TP)])
    assert torch.isneginf(parts[0, 1]).all()  # a shard of real columns only
    lse = whole_vocab(parts)  # (2, n)
    mass = torch.sigmoid(lse[1] - lse[0])
    assert torch.allclose(mass, guard.padding_mass(logits, REAL), atol=1e-6)
    assert torch.allclose(lse[0], torch.logsumexp(logits[:, :REAL], dim=-1), atol=1e-5)


def test_a_group_of_one_writes_its_own_mass_at_the_read() -> None:
    flags = Flags.from_policy(guard.load_policy(policy()), torch.device("cpu"), 0)
    mass = ShardedMass(flags, None)
    logits = torch.randn(5, ROWS, generator=torch.Generator().manual_seed(1))
    mass.add(shard_parts(logits, REAL), masked=True)
    mass.add(shard_parts(logits, REAL), masked=False)
    mass.combine(reduce=True)
    values = flags.read(lagged=False).local[padding_mass.SPEC]
    expected = guard.padding_mass(logits, REAL)
    assert values.mean == pytest.approx(float(expected.mean()), rel=1e-5)
    assert values.max == pytest.approx(float(expected.max()), rel=1e-5)
    assert values.loss_max == pytest.approx(float(expected.max()), rel=1e-5)  # the unmasked
    mass.add(shard_parts(logits, REAL), masked=False)
    mass.combine(reduce=False)  # detach's local read: no whole-vocab figure, none written
    assert flags.read(lagged=False).local[padding_mass.SPEC].mean is None
