"""The padding rows of the embedding's and the head's weights (guard/weights/vocab.py):
checked on the device at attach and at each read, and repaired in place (the padding_rows
check's state, guard/stateful/padding_rows.py, calls them). O(padding rows x hidden) per check,
no host read, no collective (FSDP2: each rank the rows it holds, guard/weights/sharded.py; under
DeepSpeed ZeRO-3, whose ranks hold slices of the flattened weight, one all-reduce of the padding
rows' squared norms, guard/weights/zero_rows.py); a repair, rare, is O(rows x hidden) and one
all-reduce of a row when sharded, and writes the optimizer's master copy too
(guard/weights/masters.py), so the next update does not undo it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from guard.checks import padding_rows
from guard.device.flags import Flags
from guard.vocab.discover import Heads, weight_shape
from guard.weights.masters import Masters
from guard.weights.row_copies import real_row_copies
from guard.weights.rows import Rows, rows_of
from guard.weights.vocab import vocab_weights
from guard.weights.zero_rows import unreadable

__all__ = ["PaddingRows"]


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
    def _shards(self) -> list[tuple[Rows, int]]:
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
                # ZeRO-3: every rank (the squares' all-reduce); a shard of real rows only
                # gives None: the other ranks report.
                if (found := shard.norm_from(real)) is None:
                    continue
                norm, bad = found
                ratio = torch.where(ref > 0, norm / ref.clamp_min(1e-30),
                                    torch.where(norm > 0, float("inf"), 0.0))
                self.flags.follow(norm.device)
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
                rows = weight_shape(w)[0]
                shard.fill(real, rows, mean, ok)  # the padding rows (or elements) held here
                self.masters.written(w, real, rows, ok)

