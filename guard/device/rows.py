"""The embedding's and the head's weights, each once (`vocab_weights`), and their padding rows:
checked on the device at attach and at each read, and repaired in place (the padding_rows
check's state, guard/stateful/padding_rows.py, calls them). O(padding rows x hidden) per check,
no host read, no collective (FSDP2: each rank the rows it holds, guard/device/sharded.py; under
DeepSpeed ZeRO-3, whose ranks hold slices of the flattened weight, one all-reduce of the padding
rows' squared norms, guard/device/zero_rows.py); a repair, rare, is O(rows x hidden) and one
all-reduce of a row when sharded, and writes the optimizer's master copy too
(guard/device/masters.py), so the next update does not undo it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from guard.checks import padding_rows
from guard.device.flags import Flags
from guard.device.masters import Masters
from guard.device.row_copies import real_row_copies
from guard.device.sharded import RowShard, rows_of
from guard.device.zero_rows import ZeroRows, unreadable
from guard.vocab.discover import Heads, weight_shape
from guard_server.wire import WEIGHTS, WeightName

__all__ = ["PaddingRows", "VocabWeight", "unread_rows", "vocab_weights"]


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


class PaddingRows:
    """Rows [real, rows) of each distinct weight (one when embedding and head are tied)."""

    def __init__(self, weights: list[tuple[str, torch.Tensor, int]], flags: Flags,
                 biases: Sequence[tuple[str, torch.Tensor, int]] = (),
                 masters: Masters | None = None) -> None:
        # (name, (rows, d) parameter, its first padding row in its own row numbers: the real
        # vocab, or fewer on the shard of a vocab-parallel head)
        self.weights = weights
        self.flags = flags
        self.masters = masters or Masters(None)
        # Each rank reads the rows it holds: all of them, or its shard under FSDP2; the read's
        # all-reduce (MAX) combines the shards, so no rank gathers a weight. Taken at each use:
        # deepspeed.initialize may partition a weight after attach (ZeRO-3).
        self._named = [(name, w, real) for name, w, real in weights]
        self._bias = [(name, b, real) for name, b, real in biases]
        # The scale of a token row, taken once at attach: the largest real row's norm (of the
        # whole weight: a shard may hold few real rows, or none).
        with torch.no_grad():
            self._reference = [s.largest_norm_below(real) for s, real in self._shards]
            # Padding rows that copy a real row: put in the flags once, at the attach read.
            self._copies = [real_row_copies(s, real) for s, real in self._shards]

    @property
    def _shards(self) -> list[tuple[RowShard | ZeroRows, int]]:
        return [(rows_of(w, name), real) for name, w, real in self._named]

    @classmethod
    def of(cls, flags: Flags, heads: Heads, firsts: tuple[int, int],
           masters: Masters | None = None) -> PaddingRows | None:
        """None where no weight has a padding row. `firsts`: the first padding row of the
        embedding's and of the head's weight (Sizes.first_padding); `masters`: where the
        optimizer keeps its own copy of them (a repair writes there too)."""
        head, names = heads.head_holder, (heads.embedding_name, heads.lm_head_name)
        weights = [(h.name, h.tensor, h.real) for h in vocab_weights(heads, firsts)
                   if weight_shape(h.tensor)[0] > h.real and unreadable(h.tensor) is None]
        bias = getattr(head, "bias", None)
        shape = weight_shape(bias)
        biases = ([(f"{names[1]}.bias", bias, firsts[1])] if isinstance(bias, torch.Tensor)
                  and len(shape) == 1 and shape[0] > firsts[1] else [])
        return cls(weights, flags, biases, masters) if weights else None

    @property
    def names(self) -> str:
        return " and ".join(name for name, _, _ in self.weights)

    def check(self) -> None:
        """Non-finite values and the norm ratio into the flags (device ops only)."""
        with torch.no_grad():
            for (shard, real), ref in zip(self._shards, self._reference, strict=True):
                if isinstance(shard, ZeroRows):  # every rank: the squares' all-reduce
                    squares, nonfinite = shard.row_squares(real, shard.rows)
                    norm, bad = squares.sqrt().amax(), nonfinite.sum()
                    device = squares.device
                else:
                    pad = shard.rows_from(real).float()  # (padding rows held here, d)
                    if pad.shape[0] == 0:  # a shard of real rows only: the other ranks report
                        continue
                    norm, bad = pad.norm(dim=-1).amax(), torch.isfinite(pad).logical_not().sum()
                    device = pad.device
                ratio = torch.where(ref > 0, norm / ref.clamp_min(1e-30),
                                    torch.where(norm > 0, float("inf"), 0.0))
                self.flags.follow(device)
                self.flags.put(padding_rows.NONFINITE, bad)
                self.flags.put(padding_rows.RATIO, torch.nan_to_num(ratio, nan=float("inf")))
            for found in self._copies:
                if found is not None:
                    self.flags.put(padding_rows.COPIES, found[0])
                    self.flags.put(padding_rows.COPIED, found[1])
            self._copies = []

    def repair(self) -> None:
        """Set each padding row (and the head's padding bias) to the mean of the real ones,
        in place. Why the mean, not zeros: a padding id's logit is then the mean of the real
        logits, and exp(mean) <= mean(exp) (Jensen), so each padding id gets at most 1/N of the
        real ids' probability (N real rows) whatever the logits' scale: at most P/N for P
        padding ids, once the guard is gone. A zero row gives logit 0 instead, which beats
        every real id of a model whose logits are negative (pretrained GPT-2's are, by tens);
        its embedding row is a real token's average, not garbage. A collective under FSDP2
        (the mean of every rank's rows): all ranks repair at the same read."""
        with torch.no_grad():
            for name, w, real in [*self._named, *self._bias]:
                shard = rows_of(w, name)
                mean = shard.mean_below(real)  # every rank: a collective when sharded
                # Real rows that diverged (a NaN spread through an update) have a non-finite
                # mean: the rows are left as they are rather than written with it (a device
                # select, no host read; the verdict says the weights diverged).
                ok = torch.isfinite(mean).all()
                if isinstance(shard, ZeroRows):  # the elements of those rows held here
                    shard.fill(real, shard.rows, mean, ok)
                else:
                    pad = shard.rows_from(real)  # under FSDP2 the padding rows this rank holds
                    pad.copy_(torch.where(ok, mean.to(pad.dtype).expand_as(pad), pad))
                self.masters.written(w, real, weight_shape(w)[0], ok)

