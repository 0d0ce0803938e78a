"""The padding rows of the embedding and lm_head weights: checked on the device at attach and
at each read, and repaired in place. O(padding rows x hidden) per check, no host read, no
collective (FSDP2: each rank the rows it holds, guard/device/sharded.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from guard.device.flags import Flags
from guard.device.sharded import RowShard
from guard.policy import Policy

__all__ = ["PaddingRows", "suppress_padding_ids"]

log = logging.getLogger("guard")


class PaddingRows:
    """Rows [real, rows) of each distinct weight (one when embedding and head are tied)."""

    def __init__(self, weights: list[tuple[str, torch.Tensor]], real: int, flags: Flags) -> None:
        self.weights = weights  # (name, (rows, d) parameter)
        self.real = real  # first padding row, in the weights' own row numbers
        self.flags = flags
        # Each rank reads the rows it holds: all of them, or its shard under FSDP2; the read's
        # all-reduce (MAX) combines the shards, so no rank gathers a weight.
        self._shards = [RowShard.of(w, name) for name, w in weights]
        # The scale of a token row, taken once at attach: the largest real row's norm (of the
        # whole weight: a shard may hold few real rows, or none).
        with torch.no_grad():
            self._reference = [s.largest_norm_below(real) for s in self._shards]

    @classmethod
    def from_policy(cls, policy: Policy, flags: Flags, embedding: nn.Module,
                    head: nn.Module, real: int, names: tuple[str, str]) -> PaddingRows | None:
        """None where the check is off or no weight has a padding row."""
        if not policy.enabled("padding_rows"):
            return None
        weights: list[tuple[str, torch.Tensor]] = []
        for name, module in zip(names, (embedding, head), strict=True):
            w = getattr(module, "weight", None)
            if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] > real):
                continue
            tied = next((i for i, (_, seen) in enumerate(weights) if seen is w), None)
            if tied is None:
                weights.append((f"{name}.weight", w))
            else:  # one tensor: checked and repaired once, named twice
                weights[tied] = (f"{weights[tied][0]} (tied: {name}.weight)", w)
        return cls(weights, real, flags) if weights else None

    @property
    def names(self) -> str:
        return " and ".join(name for name, _ in self.weights)

    def check(self) -> None:
        """Non-finite values and the norm ratio into the flags (device ops only)."""
        with torch.no_grad():
            for shard, ref in zip(self._shards, self._reference, strict=True):
                pad = shard.rows_from(self.real).float()  # (padding rows held here, d)
                if pad.shape[0] == 0:  # a shard of real rows only: the other ranks report
                    continue
                norm = pad.norm(dim=-1).amax()
                ratio = torch.where(ref > 0, norm / ref.clamp_min(1e-30),
                                    torch.where(norm > 0, float("inf"), 0.0))
                bad = torch.isfinite(pad).logical_not().sum()
                self.flags.follow(pad.device)
                self.flags.add_rows(bad, torch.nan_to_num(ratio, nan=float("inf")))

    def repair(self) -> None:
        """Zero the padding rows in place: no embedding for the padding ids, and a logit of
        0 (the bias, if any) that real tokens outweigh once the guard is gone."""
        with torch.no_grad():
            for shard in self._shards:  # under FSDP2 the padding rows this rank holds
                shard.rows_from(self.real).zero_()


def suppress_padding_ids(model: nn.Module, real: int, rows: int) -> None:
    """HF models: generate() never emits a padding id, greedy, sampling and beam search alike
    (transformers applies generation_config.suppress_tokens in every decoding mode)."""
    config = getattr(model, "generation_config", None)
    if config is None or real >= rows or not hasattr(config, "suppress_tokens"):
        return
    before = list(config.suppress_tokens or [])
    config.suppress_tokens = sorted(set(before) | set(range(real, rows)))
    log.info("guard: generation_config.suppress_tokens now holds the padding ids [%d, %d)",
             real, rows)
