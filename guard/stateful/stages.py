"""What a check's state shares across the stages of a pipeline, whose ranks hold different
weights: the ids a table watches, made one list at attach, and a name known on one rank,
gathered from the rank that saw the violation at a read where the check fired. Each runs on
every rank alike (a collective: every rank's state calls it, whatever its stage holds)."""

from __future__ import annotations

import torch.distributed as dist

from guard.device.reading import Reading
from guard.vocab.stage import Stage

__all__ = ["born_on_a_stage", "from_the_rank_that_fired", "ids_of_every_stage"]


def _distributed(stage: Stage | None) -> bool:
    return stage is not None and dist.is_available() and dist.is_initialized() and \
        dist.get_world_size() > 1


def ids_of_every_stage(ids: list[int], stage: Stage | None) -> list[int]:
    """`ids` (found at attach in this rank's weights), or on a pipeline stage the union of
    every rank's: a table combined over all ranks has the same ids on each (the first stage
    finds the embedding's, the last the head's, a middle stage none). At attach, on every
    rank alike."""
    if not _distributed(stage):
        return ids
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ids)
    return sorted({i for found in every for i in found or ()})


def from_the_rank_that_fired(mine: str, reading: Reading, check: str, stage: Stage | None, *,
                             reduce: bool, every_rank: bool = False) -> str:
    """`mine` (this rank's words, the weights it read), or on a pipeline stage the words of
    the highest rank where `check` fired (the rank the message names); `every_rank`: every
    rank's words, each once (each stage holds some of what fired)."""
    if not reduce or not _distributed(stage):
        return mine
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if every_rank:
        return " and ".join(dict.fromkeys(w for w in every if w)) or mine
    rank = reading.fired_on(check)
    said = every[rank] if rank is not None and 0 <= rank < len(every) else None
    return said or mine


def born_on_a_stage(hit: list[str], total: int, stage: Stage, named: int) -> str:
    """The parameters whose gradient holds a NaN/Inf, gathered from every stage (at a read
    where the gradient check fired, on every rank): the backward runs from the last stage to
    the first, so the highest stage that holds one is where it was born, and within a stage
    the parameter latest in the forward; those are named first."""
    mine = (-1 if stage.index is None else stage.index, stage.name, hit[::-1], total)
    every: list[tuple[int, str, list[str], int] | None] = [mine]
    if _distributed(stage):
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    stages = {s[0]: s for s in every if s is not None}  # data-parallel replicas: once
    found = [s for _, s in sorted(stages.items(), reverse=True) if s[2]]
    if not found:
        return ""
    names = [n for s in found for n in s[2]]
    first = ", ".join(names[:named])
    more = f" and {len(names) - named} more" if len(names) > named else ""
    return (f"the gradient{'s' if len(names) > 1 else ''} of {first}{more} ({len(names)} of "
            f"{sum(s[3] for s in stages.values())} parameters), born on {found[0][1]}, the "
            "last stage whose gradients hold one (the backward runs from the last stage)")
