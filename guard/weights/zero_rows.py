"""A DeepSpeed ZeRO-3 weight as rows. Outside a forward the parameter itself is empty
(`weight.shape == [0]`); its real shape is `ds_shape`, and each rank of `ds_process_group` holds
a contiguous slice of the flattened weight, `ds_tensor`: elements [rank * n, rank * n + n) of
the whole, n = `ds_tensor.ds_numel` (the last rank's slice padded). A row may straddle two
ranks, so what the checks need of rows is summed by each rank over the elements it holds and
combined with one all-reduce (SUM): per-row squares (a (rows,) vector), column sums (one row's
width), or a bounded block of rows gathered for the attach-time features. Nothing gathers a
whole weight; every rank of the group calls each read, whether it holds any of the rows or not
(a rank that skipped one would hang the others). Writes go to the elements this rank holds, in
the partition the next forward gathers and, through guard/weights/masters.py, in the fp32 copy
the optimizer updates."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Piece", "ZeroRows", "is_partitioned", "unreadable"]

_BLOCK = 1024  # rows per gathered block at attach: 1024 x 4096 float32 is 16 MiB


def is_partitioned(weight: object) -> bool:
    """A ZeRO-3 parameter (DeepSpeed's attributes; the library is never imported here)."""
    return hasattr(weight, "ds_id") and hasattr(weight, "ds_tensor")


def unreadable(weight: torch.Tensor) -> str | None:
    """Why this rank cannot read its part of a ZeRO-3 weight between steps (None: it can, or
    the weight is no ZeRO-3 one): an NVMe offload keeps it on disk, not in memory."""
    if not hasattr(weight, "ds_id"):
        return None
    part = getattr(weight, "ds_tensor", None)
    if part is None:
        return "it has no partition (ds_tensor is None)"
    where = getattr(part, "final_location", None)
    status = getattr(getattr(part, "status", None), "name", "AVAILABLE")
    if str(getattr(where, "value", where)).lower() == "nvme" or status != "AVAILABLE":
        return f"its partition is offloaded (final_location {where}, status {status})"
    return None


@dataclass(frozen=True)
class Piece:
    """Elements of one flat tensor that lie in rows [row, row + t.shape[0]) and columns
    [col, col + t.shape[1]) of the whole weight: a view, so writes land in place."""

    row: int
    col: int
    t: torch.Tensor  # (r, c)


class ZeroRows:
    """Rows of a ZeRO-3 weight of `shape` (rows, d) (a bias: (rows,), taken as (rows, 1))."""

    dtensor = False

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        shape: tuple[int, ...] = tuple(getattr(weight, "ds_shape", ()))  # Python ints
        self.rows, self.width = shape[0], shape[1] if len(shape) > 1 else 1
        self.group: Any = getattr(weight, "ds_process_group", None)
        part: Any = weight.ds_tensor  # type: ignore[attr-defined]
        n: int = getattr(part, "ds_numel", part.numel())
        rank = dist.get_rank(group=self.group) if dist.is_initialized() else 0
        self.start = n * rank
        self.valid = max(0, min(n, self.rows * self.width - self.start))

    def local(self) -> torch.Tensor:
        """This rank's elements, flat (the partition itself: writes are in place)."""
        part: torch.Tensor = self.weight.ds_tensor  # type: ignore[attr-defined]
        return part.view(-1)[: self.valid]

    def pieces(self, flat: torch.Tensor, first: int, end: int) -> Iterator[Piece]:
        """The elements of rows [first, end) in `flat` (this rank's elements, or a tensor
        laid out as they are: the fp32 partition, an optimizer moment), as at most three
        views: a row's tail, whole rows, a row's head."""
        w = self.width
        s, e = max(first * w, self.start), min(end * w, self.start + self.valid)
        if s >= e:
            return
        x = flat[s - self.start : e - self.start]
        if lead := s % w:  # the part of a row that began on the previous rank
            take = min(w - lead, e - s)
            yield Piece(s // w, lead, x[:take].view(1, take))
            x, s = x[take:], s + take
        whole = x.shape[0] // w
        if whole:
            yield Piece(s // w, 0, x[: whole * w].view(whole, w))
        if tail := x.shape[0] - whole * w:  # the head of a row that ends on the next rank
            yield Piece(s // w + whole, 0, x[whole * w :].view(1, tail))

    def row_squares(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of [first, end) of the whole weight, float64: its squared norm and its
        count of non-finite values, (end - first,) each. A collective over the group."""
        both = torch.zeros(2, max(end - first, 0), dtype=torch.float64,
                           device=self.local().device)
        for p in self.pieces(self.local(), first, end):
            x = p.t.double()
            at = slice(p.row - first, p.row - first + x.shape[0])
            both[0, at] += x.square().sum(dim=1)
            both[1, at] += torch.isfinite(x).logical_not().sum(dim=1)
        self._sum(both)
        return both[0], both[1]

    def largest_norm_below(self, end: int) -> torch.Tensor:
        """0-dim float32: the largest norm of rows [0, end) (0 for none); a collective."""
        squares, _ = self.row_squares(0, end)
        return squares.sqrt().amax().float() if end > 0 else squares.new_zeros(()).float()

    def mean_below(self, end: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 (d,): the mean of rows [0, end), or of those `keep` ((rows,) bool) marks;
        each rank sums its elements by column, one all-reduce (SUM) of d numbers."""
        local = self.local()
        total = torch.zeros(self.width, dtype=torch.float32, device=local.device)
        for p in self.pieces(local, 0, end):
            x = p.t.float()
            if keep is not None:
                x = x * keep[p.row : p.row + x.shape[0]].to(x).unsqueeze(1)
            total[p.col : p.col + x.shape[1]] += x.sum(dim=0)
        self._sum(total)
        count = torch.tensor(max(end, 1)) if keep is None else keep[:end].sum()
        mean = total / count.clamp_min(1).to(total)
        return mean if len(getattr(self.weight, "ds_shape", ())) > 1 else mean[0]

    def blocks(self, end: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows [0, end) gathered a block at a time, (b, d) each on every rank: each rank
        fills the elements it holds, zeros elsewhere, and one all-reduce (SUM) per block
        assembles it (x + 0 is x bit for bit). At attach only (the untrained rows' features)."""
        local = self.local()
        for first in range(0, end, _BLOCK):
            last = min(first + _BLOCK, end)
            block = torch.zeros(last - first, self.width, dtype=local.dtype, device=local.device)
            for p in self.pieces(local, first, last):
                block[p.row - first : p.row - first + p.t.shape[0],
                      p.col : p.col + p.t.shape[1]] = p.t
            self._sum(block)
            yield first, block

    def fill(self, first: int, end: int, value: torch.Tensor,
             ok: torch.Tensor | None = None) -> None:
        """Rows [first, end) held here set to `value` ((d,), or a scalar for a bias) where
        `ok` (0-dim bool, on the device) holds: a device select, no host read."""
        value = value.reshape(-1)
        for p in self.pieces(self.local(), first, end):
            new = value[p.col : p.col + p.t.shape[1]].to(p.t.dtype).expand_as(p.t)
            p.t.copy_(new if ok is None else torch.where(ok.to(p.t.device), new, p.t))
        if self.weight.numel() == self.rows * self.width:
            # Gathered now on every rank: a parameter small enough for ZeRO-3 to keep whole
            # (under stage3_param_persistence_threshold), which the forward reads rather than
            # the partition until the next step gathers it again; written alike.
            rows = self.weight.data.view(self.rows, self.width)[first:end]
            new = value.to(rows.dtype).expand_as(rows)
            rows.copy_(new if ok is None else torch.where(ok.to(rows.device), new, rows))

    def whole(self, t: torch.Tensor) -> None:
        """Nothing: `blocks` gathered every row on every rank already."""

    def norm_from(self, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The largest norm and the count of non-finite values of rows [first, rows) of the
        whole weight: every rank calls it (the squares' all-reduce)."""
        squares, nonfinite = self.row_squares(first, self.rows)
        return squares.sqrt().amax(), nonfinite.sum()

    def fill_ids(self, ids: Sequence[int], value: torch.Tensor, write: torch.Tensor) -> None:
        """The elements of rows `ids` held here set to `value` where `write` ((len(ids),)
        bool, on the device) says."""
        for j, i in enumerate(ids):
            self.fill(i, i + 1, value, write[j])

    def _sum(self, t: torch.Tensor) -> None:
        if dist.is_initialized() and dist.get_world_size(group=self.group) > 1:
            dist.all_reduce(t, group=self.group)
