"""The logits in what a head returns (guard/device/dtensors.py) and the mask where autograd
forbids it in place; on plain tensors in one process (the DTensor forms run under torchrun in
tests/integrations/test_tp_torch.py)."""

from __future__ import annotations

from typing import Any

import torch

from guard.device.dtensors import Columns, head_output, mask_columns

SHARD = Columns(columns=8, real_columns=5, shard=(8, 16), rows=16, real=13)


def test_a_tensor_and_megatrons_tuple() -> None:
    logits, bias = torch.randn(2, 3, 8), torch.zeros(8)
    found = head_output(logits, SHARD)
    assert found is not None and found.columns is logits and found.masked is logits
    assert found.real == 5
    pair = head_output((logits, bias), SHARD)  # ColumnParallelLinear: (output, bias)
    assert pair is not None and pair.columns is logits
    new = torch.ones(2, 3, 8)
    put = pair.put(new)
    assert put[0] is new and put[1] is bias
    assert head_output(torch.randn(2, 3, 7), SHARD) is None  # another width
    assert head_output((None, bias), SHARD) is None


def test_every_column_gathered_measures_its_own_and_masks_the_whole() -> None:
    logits = torch.randn(2, 3, 16)  # gather_output / output_layouts=Replicate()
    found = head_output(logits, SHARD)
    assert found is not None and found.masked is logits and found.real == 13
    assert torch.equal(found.columns, logits[..., 8:16])


class _View(torch.autograd.Function):
    """A view made inside a custom Function, as DTensor's to_local hands one out."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_the_mask_goes_out_of_place_on_a_view_autograd_forbids_changing() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    view = _View.apply(x * 1.0)
    masked = mask_columns(view, 5)
    assert masked is not view and torch.isneginf(masked[:, 5:]).all()
    assert torch.equal(masked[:, :5], view[:, :5])
    masked[:, :5].sum().backward()
    assert x.grad is not None and (x.grad[:, 5:] == 0).all() and (x.grad[:, :5] == 1).all()
    plain = x.detach() * 1.0
    assert mask_columns(plain, 5) is plain  # in place, as without tensor parallel
