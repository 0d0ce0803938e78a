"""One `Rows` interface made by one factory (guard/weights/rows.py): a plain weight and the same
weight as a ZeRO-3 partition (one rank holding it all) answer every verb alike, and no code
outside guard/weights/ asks a weight's layout or names a kind of rows."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

import guard
from guard.weights.rows import holding_of, rows_of
from guard.weights.sharded import RowShard
from guard.weights.zero_rows import ZeroRows

ROWS, D = 10, 7
GUARD = Path(guard.__file__).parent
# What only guard/weights/ may name: the kinds of rows and the questions about a layout.
LAYOUT = {"ZeroRows", "RowShard", "is_partitioned", "holding_of"}


def partition(w: torch.Tensor) -> nn.Parameter:
    """`w` as DeepSpeed ZeRO-3 leaves a parameter between steps, on a world of one rank."""
    p = nn.Parameter(torch.empty(0))
    p.ds_id, p.ds_shape = 0, w.shape  # type: ignore[attr-defined]
    p.ds_tensor = w.reshape(-1).clone()  # type: ignore[attr-defined]
    p.ds_tensor.ds_numel = w.numel()  # type: ignore[attr-defined]
    return p


def test_the_factory_makes_one_kind_per_layout() -> None:
    w = torch.randn(ROWS, D)
    z = partition(w)
    assert holding_of(w) == "plain" and holding_of(z) == "zero3"
    assert isinstance(rows_of(w, "w"), RowShard) and isinstance(rows_of(z, "w"), ZeroRows)


def test_every_verb_answers_alike_for_a_plain_weight_and_a_partition() -> None:
    torch.manual_seed(0)
    w = torch.randn(ROWS, D)
    w[8, 3] = float("nan")
    plain, zero = rows_of(w.clone(), "w"), rows_of(partition(w), "w")
    for a, b in zip(plain.norm_from(6) or (), zero.norm_from(6), strict=True):
        torch.testing.assert_close(a.double(), b.double(), equal_nan=True)
    assert [f for f, _ in plain.blocks(ROWS)] == [0] and [f for f, _ in zero.blocks(ROWS)] == [0]
    torch.testing.assert_close(next(plain.blocks(ROWS))[1], next(zero.blocks(ROWS))[1],
                               equal_nan=True)
    packed = torch.arange(4.0)
    plain.whole(packed)
    zero.whole(packed)  # no process group: nothing to sum, on either
    assert packed.tolist() == [0.0, 1.0, 2.0, 3.0]
    value = torch.full((D,), 0.5)
    plain.fill(6, ROWS, value, torch.tensor(True))
    zero.fill(6, ROWS, value, torch.tensor(True))
    write = torch.tensor([True, False])
    plain.fill_ids([1, 3], -value, write)
    zero.fill_ids([1, 3], -value, write)
    torch.testing.assert_close(plain.local(), zero.local().view(ROWS, D))
    assert (plain.local()[6:] == 0.5).all() and (plain.local()[1] == -0.5).all()
    assert not (plain.local()[3] == -0.5).all()


def test_a_shard_holding_no_row_from_the_first_says_none() -> None:
    assert RowShard(torch.randn(3, D), 0, 3).norm_from(3) is None


def test_no_code_outside_the_room_asks_a_weights_layout() -> None:
    found = []
    for path in sorted(GUARD.rglob("*.py")):
        if path.parent.name == "weights":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else \
                node.attr if isinstance(node, ast.Attribute) else \
                node.value if isinstance(node, ast.Constant) else None
            if name in LAYOUT:
                found.append(f"{path.relative_to(GUARD)}:{node.lineno}: {name}")
    assert found == []
