"""The untrained_rows check on the device: the ids its state found untrained at attach
(guard/stateful/untrained_rows.py) as lookup tables, counted in every training forward with
device ops only, and repaired in place.

Per kind of id a table over the vocab gives each id its place among the untrained ids, or n
(their number) when its row is trained: input ids look up the embedding's rows, labels the
head's (the same table when tied). A forward's ids cost a clamp, a gather, a compare, a sum
and an index_fill into `used`, (n + 1,) marks of the ids used since attach; nothing is read to
the host. The host reads `used` only when NEW says a message has new ids to name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from guard.checks import untrained_rows as spec
from guard.device.flags import Flags
from guard.vocab.discover import weight_shape
from guard.weights.masters import Masters
from guard.weights.rows import Rows, rows_of
from guard.weights.vocab import VocabWeight
from guard_server.wire import IdKind, WeightName

__all__ = ["UntrainedTables", "UntrainedWeight", "id_kind"]


def id_kind(role: WeightName) -> IdKind:
    """The ids that look up a weight's rows: input ids the embedding's, labels the head's."""
    return "input" if role == "embedding" else "label"


@dataclass
class UntrainedWeight:
    """The untrained rows of one weight (of the real vocab), and its state on the device."""

    weight: VocabWeight
    shard: Rows  # as at attach (the repair takes the rows as they are then)
    ids: list[int]  # the untrained rows, ids of the whole vocab
    why: list[int]  # per id, guard/weights/features.py's bits
    reference: float  # the median norm of its other rows
    exempt: list[int]  # rows untrained by design (an embedding's padding_idx): not in the mean
    # On the device, per id: its place among all the untrained ids, and whether it still waits
    # for a repair; the rows of the real vocab that are trained (the repair's mean).
    pos: torch.Tensor = field(init=False)
    pending: torch.Tensor = field(init=False)
    keep: torch.Tensor = field(init=False)


class UntrainedTables:
    """The lookup tables, the ids used and the rows left; `count` runs in the id hooks
    (guard/device/ids.py), `check` before each read, `repair` at a violation under `repair`."""

    def __init__(self, weights: Sequence[UntrainedWeight], flags: Flags,
                 masters: Masters | None = None, ids: Sequence[int] = ()) -> None:
        self.weights = list(weights)
        self.flags = flags
        self.masters = masters or Masters(None)  # a repair writes the optimizer's copy too
        # Every untrained id, once; `ids`: more of them, held by other ranks (the stages of a
        # pipeline hold different weights, and `used` is combined over every rank).
        self.ids = sorted({i for w in weights for i in w.ids} | set(ids))
        self.n = len(self.ids)
        place = {i: k for k, i in enumerate(self.ids)}
        device = weights[0].shard.local().device if weights else flags.device  # a middle stage
        self.tables: dict[IdKind, torch.Tensor] = {}
        for w in weights:
            rows = weight_shape(w.weight.tensor)[0]
            w.pos = torch.tensor([place[i] for i in w.ids], dtype=torch.int64, device=device)
            w.pending = torch.ones(len(w.ids), dtype=torch.bool, device=device)
            w.keep = torch.arange(rows, device=device) < w.weight.real
            w.keep[w.ids + w.exempt] = False
            # (rows + 1,): an id clamped to [-1, rows] finds n for a trained row, an ignore
            # index or an id with no row (-1 and rows both land on the last entry).
            table = torch.full((rows + 1,), self.n, dtype=torch.int64, device=device)
            table[w.ids] = w.pos
            for role in w.weight.roles:
                if w.ids:
                    self.tables[id_kind(role)] = table
        self.used = torch.zeros(self.n + 1, device=device)  # the last entry: trained ids
        self.named = torch.zeros(self.n + 1, device=device)  # what a message has named
        self._changed = True  # the rows left changed since the flags last got them

    def watches(self, kind: IdKind) -> bool:
        """Some row this kind of id looks up is untrained (else its hook counts nothing)."""
        return kind in self.tables

    def count(self, kind: IdKind, ids: torch.Tensor) -> None:
        """Ids of this forward that fall on untrained rows, into the flags (device ops)."""
        table = self.tables.get(kind)
        if table is None:
            return
        if table.device != ids.device:  # the model moved after attach: a copy, once
            self._to(ids.device)
            table = self.tables[kind]
        place = table[ids.clamp(-1, table.shape[0] - 1)]  # ids' shape: n where trained
        self.flags.put(spec.SLOTS[kind], (place < self.n).sum())
        self.used.index_fill_(0, place.reshape(-1), 1.0)

    def check(self) -> None:
        """Before a read (device ops): the rows left per weight when they changed (at attach
        and after a repair: a gauge keeps its last value), and, where any row is untrained,
        the ids not named yet. A model with none costs nothing after attach."""
        f = self.flags
        if self._changed:
            self._changed = False
            f.put(spec.READ, 1.0)
            for role, slot in spec.LEFT.items():
                w = next((w for w in self.weights if role in w.weight.roles), None)
                f.put(slot, 0.0 if w is None else w.pending.sum())
        if self.n:
            f.put(spec.NEW, (self.used[: self.n] > self.named[: self.n]).sum())

    def take_new(self, *, reduce: bool) -> torch.Tensor:
        """(n,) bool: the ids used on any rank that no message named yet, now named. A
        collective when `reduce` and distributed: every rank calls it at the same read."""
        used = self._union(reduce=reduce)
        new = used[: self.n] > self.named[: self.n]
        self.named.copy_(used)
        return new

    def repair(self) -> None:
        """The rows of the ids used (on any rank) that are untrained, in every weight, set to
        the mean of that weight's trained rows in place; those ids then count no more. A
        collective when distributed (the ids used, and the mean under FSDP2), so every rank
        repairs at the same read. Rows whose trained rows diverged (a non-finite mean) are
        left as they are: a device select, no host read."""
        self._changed = True
        with torch.no_grad():
            hit = self._union(reduce=True)[: self.n] > 0
            for w in self.weights:
                shard = rows_of(w.weight.tensor, w.weight.name, "untrained_rows")
                mean = shard.mean_below(w.weight.real, keep=w.keep)  # (d,) float32
                write = hit.to(w.pos.device)[w.pos] & w.pending & torch.isfinite(mean).all()
                shard.fill_ids(w.ids, mean, write)  # the rows (or elements) held here
                for j, i in enumerate(w.ids):  # the optimizer's copy (its moments zeroed)
                    self.masters.written(w.weight.tensor, i, i + 1, write[j])
                w.pending &= ~write
                for role in w.weight.roles:
                    kind = id_kind(role)
                    if kind in self.tables:
                        ids = torch.tensor(w.ids, device=w.pos.device)
                        self.tables[kind].index_copy_(
                            0, ids, torch.where(w.pending, w.pos, self.n))

    def _union(self, *, reduce: bool) -> torch.Tensor:
        """`used`, max-combined over ranks when `reduce` and distributed (kept so)."""
        if reduce and dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            dist.all_reduce(self.used, op=dist.ReduceOp.MAX)
        return self.used

    def _to(self, device: torch.device) -> None:
        self.tables = {k: t.to(device) for k, t in self.tables.items()}
        self.used, self.named = self.used.to(device), self.named.to(device)
        for w in self.weights:
            w.pos, w.pending, w.keep = w.pos.to(device), w.pending.to(device), w.keep.to(device)
