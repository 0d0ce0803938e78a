"""The vocab check across pipeline stages: the token embedding on the first stage and the head
on the last are tied copies (Megatron's `share_embeddings_and_output_weights`, DeepSpeed's
`TiedLayerSpec`, `tied_across_stages=True`), kept equal by the framework's start-up sync and
a gradient all-reduce each step. A copy that drifts (a meta-device init that skipped the sync,
two optimizers updating the copies differently, a resume that loaded one copy) is a `vocab`
violation naming both stages and the rows that differ.

At attach, every rank of the pipeline says which copy it holds (one all_gather_object, on
every stage: a middle stage takes part), which pairs the ranks holding the same rows of the
two copies. Before the read at attach and every `checks.vocab.tie_every` reads after, each
rank computes the int32 checksums of its copy's blocks of rows (guard/device/checksums.py,
device ops) and all ranks all_gather them (a (world, BLOCKS) tensor, the same collective on
every rank); a pair that differs sets the flag. Where it fired, the host gathers the rows'
checksums of the differing blocks (a second collective, on every rank alike) to name them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from guard.checks import vocab
from guard.device.checksums import BLOCKS, block_checksums, block_of, row_checksums
from guard.device.dtensors import local
from guard.device.flags import Flags
from guard.device.reading import Reading
from guard.stateful.state import Attaching, CheckState
from guard.stateful.vocab import TieState
from guard.vocab.layout import placed
from guard.vocab.stage import Stage

__all__ = ["Copy", "TieAcrossState", "tie_state"]

_NAMED = 8  # rows named in a message


@dataclass(frozen=True)
class Copy:
    """What one rank holds of the tied pair: `end` "embedding" or "head" (None: neither)."""

    end: str | None
    start: int  # the global id of its first row (a vocab-parallel shard's start)
    rows: int
    name: str  # the parameter's name on its stage
    stage: str  # the stage's name (its index, where known)


def tie_state(at: Attaching) -> CheckState | None:
    """The vocab check's state: the tie inside this process (issue 29's check), or on a
    pipeline stage in a process group, the tie across stages (every stage of it: the layout
    exchange at attach is a collective)."""
    if at.stage is not None and dist.is_available() and dist.is_initialized() and \
            dist.get_world_size() > 1:
        return TieAcrossState.attach(at)
    return TieState.attach(at)


class TieAcrossState(CheckState):
    spec = vocab.SPEC
    at_detach = False  # a collective

    def __init__(self, flags: Flags, weight: torch.Tensor | None, copy: Copy,
                 layout: list[Copy], every: int, inner: TieState | None) -> None:
        self.flags, self.weight, self.copy, self.every = flags, weight, copy, every
        self.layout = layout
        self.inner = inner  # a tie inside this stage (one stage holding both ends)
        # (embedding's rank, head's rank): ranks holding the same rows of the two copies.
        self.pairs = [(e, h) for e, a in enumerate(layout) for h, b in enumerate(layout)
                      if a.end == "embedding" and b.end == "head" and a.start == b.start]
        self._reads = 0
        self._gathered: torch.Tensor | None = None  # (world, BLOCKS) of the last check

    @classmethod
    def attach(cls, at: Attaching) -> TieAcrossState | None:
        stage = at.stage
        assert stage is not None
        weight, copy = _held(at, stage)
        layout: list[Copy | None] = [None] * dist.get_world_size()
        dist.all_gather_object(layout, copy)  # every stage, tied or not
        every = [c for c in layout if c is not None]
        inner = TieState.attach(at)
        if not any(c.end is not None for c in every) and inner is None:
            return None  # no rank holds a tied copy: the same answer on every rank
        return cls(at.flags, weight, copy, every, at.policy.checks.vocab.tie_every, inner)

    def check(self) -> None:
        if self.inner is not None:
            self.inner.check()
        due = self._reads % self.every == 0  # the read at attach, then every tie_every
        self._reads += 1
        if not due or not self.pairs:
            return
        device = self.flags.device if self.weight is None else self.weight.device
        mine = torch.zeros(BLOCKS, dtype=torch.int64, device=device)
        if self.weight is not None:
            with torch.no_grad():
                mine = block_checksums(local(self.weight), self.copy.start)
        every = [torch.empty_like(mine) for _ in self.layout]
        dist.all_gather(every, mine)
        gathered = torch.stack(every)
        self._gathered = gathered
        e, h = (torch.tensor(side, device=device) for side in zip(*self.pairs, strict=True))
        drift = (gathered.index_select(0, e) != gathered.index_select(0, h)).any()
        self.flags.put(vocab.DRIFTED, drift.to(self.flags.t.dtype))

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        said = self.inner.detail(reading, reduce=reduce) if self.inner is not None else ""
        if self._gathered is None or not reduce:
            return said
        g = self._gathered.tolist()
        differ = [(e, h, [b for b in range(BLOCKS) if g[e][b] != g[h][b]]) for e, h in
                  self.pairs]
        differ = [d for d in differ if d[2]]
        if not differ:
            return said
        mine = self._rows_of({b for e, h, blocks in differ for b in blocks
                              if dist.get_rank() in (e, h)})
        rows: list[dict[int, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)  # every rank: the same differing blocks are known
        return "; ".join(self._said(e, h, rows) for e, h, _ in differ) or said

    def _rows_of(self, blocks: set[int]) -> dict[int, int]:
        """{global id: checksum} of this rank's rows in `blocks`."""
        if self.weight is None or not blocks:
            return {}
        with torch.no_grad():
            w = local(self.weight)
            sums = row_checksums(w, self.copy.start).tolist()
            where = block_of(w.shape[0], BLOCKS).tolist()
        return {self.copy.start + r: s for r, (s, b) in enumerate(zip(sums, where, strict=True))
                if b in blocks}

    def _said(self, e: int, h: int, rows: list[dict[int, int] | None]) -> str:
        a, b = rows[e] or {}, rows[h] or {}
        ids = sorted(i for i in set(a) | set(b) if a.get(i) != b.get(i))
        shown = ", ".join(str(i) for i in ids[:_NAMED]) + (
            f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else "")
        first, last = self.layout[e], self.layout[h]
        return (f"{first.name} on {first.stage}, rank {e}, and {last.name} on {last.stage}, "
                f"rank {h}, differ in {len(ids)} {'row' if len(ids) == 1 else 'rows'} "
                f"(ids {shown})")


def _held(at: Attaching, stage: Stage) -> tuple[torch.Tensor | None, Copy]:
    """This rank's copy: the embedding on a first stage, the head on a last one, when the
    two are tied copies on two stages; none else. Its first row's global id: where its own
    weight says (a vocab-parallel embedding on the first stage of a PP x TP mesh holds a
    shard as the head does on the last), else the head's shard (`vocab_shard=`), else 0."""
    heads, where = at.heads, stage.name
    start = at.sizes.shard[0] if at.sizes.shard is not None else 0
    if stage.tied and stage.embedding != stage.head:
        module = heads.embedding if stage.embedding else heads.head_holder
        name = heads.embedding_name if stage.embedding else heads.lm_head_name
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor):
            shard = placed(module, name, at.model)
            start = shard.start if shard is not None else start
            end = "embedding" if stage.embedding else "head"
            return w, Copy(end, start, int(w.shape[0]), f"{name}.weight", where)
    return None, Copy(None, start, 0, "", where)
