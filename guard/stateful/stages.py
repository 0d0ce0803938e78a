"""What a check's state says at a read where it fired, across the stages of a pipeline: the
ranks of different stages hold different weights, so a name known on one rank is gathered from
the rank that saw the violation. Runs at a read where the check fired, on every rank alike (a
collective: every rank's state calls it, whatever its stage holds)."""

from __future__ import annotations

import torch.distributed as dist

from guard.device.reading import Reading
from guard.vocab.stage import Stage

__all__ = ["from_the_rank_that_fired"]


def from_the_rank_that_fired(mine: str, reading: Reading, check: str, stage: Stage | None, *,
                             reduce: bool) -> str:
    """`mine` (this rank's words, the weights it read), or on a pipeline stage the words of
    the highest rank where `check` fired (the rank the message names)."""
    if stage is None or not reduce or not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size() == 1:
        return mine
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    rank = reading.fired_on(check)
    said = every[rank] if rank is not None and 0 <= rank < len(every) else None
    return said or mine
