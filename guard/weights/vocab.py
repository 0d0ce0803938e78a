"""The embedding's and the head's weights, each once (`vocab_weights`): what the padding_rows
and untrained_rows checks read and repair, found from the heads at attach and at each use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from guard.vocab.discover import Heads, weight_shape
from guard.weights.zero_rows import unreadable
from guard_server.wire import WEIGHTS, WeightName

__all__ = ["VocabWeight", "unread_rows", "vocab_weights"]


@dataclass(frozen=True)
class VocabWeight:
    """A distinct 2-D weight of the embedding and the head (one when they are tied)."""

    name: str  # "wte.weight", or "wte.weight (tied: lm_head.weight)"
    tensor: torch.Tensor  # (rows, d): the parameter itself
    real: int  # its first padding row, in its own row numbers
    roles: tuple[WeightName, ...]  # what it is: ("embedding",), ("lm_head",) or both when tied


def vocab_weights(heads: Heads, firsts: tuple[int, int]) -> list[VocabWeight]:
    """The weights of the embedding and the head, each once (a tied one named twice: it is
    checked and repaired once); `firsts`: the first padding row of each (Sizes.first_padding)."""
    out: list[VocabWeight] = []
    modules = (heads.embedding, heads.head_holder)
    names = (heads.embedding_name, heads.lm_head_name)
    for role, name, module, real in zip(WEIGHTS, names, modules, firsts, strict=True):
        w = getattr(module, "weight", None)
        if not (isinstance(w, torch.Tensor) and len(weight_shape(w)) == 2):
            continue
        tied = next((i for i, h in enumerate(out) if h.tensor is w), None)
        if tied is None:
            out.append(VocabWeight(f"{name}.weight", w, real, (role,)))
        else:
            h = out[tied]
            out[tied] = VocabWeight(f"{h.name} (tied: {name}.weight)", w, real, (*h.roles, role))
    return out


def unread_rows(heads: Heads, firsts: tuple[int, int]) -> str | None:
    """The weights of `heads` whose rows this rank cannot read between steps, and why (None:
    it reads them all): never taken for healthy ones."""
    why = [f"the rows of {h.name} ({reason})" for h in vocab_weights(heads, firsts)
           if (reason := unreadable(h.tensor)) is not None]
    return " and ".join(why) or None
