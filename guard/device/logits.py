"""The logits' reductions, inside the lm_head's forward hook: the padding mass and the
non-finite count of a sample of positions, into the padding_mass and nonfinite slots. Device
ops only; the sample moves with the step, never with the host's RNG."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from guard.checks import coverage, nonfinite, padding_mass
from guard.device.compile import compiling
from guard.device.dtensors import Columns, local
from guard.device.flags import Flags
from guard.device.ops import (
    chunk_positions,
    nonfinite_count,
    nonfinite_positions,
    one_thread,
    padding_mass_parts,
    reduction_dtype,
    sample_positions,
    sample_positions_at,
    sample_size,
)
from guard.device.shard_mass import ShardedMass, shard_parts
from guard.policy import Policy
from guard.vocab.resolve import Sizes

__all__ = ["Logits", "ProbeConfig"]


@dataclass(frozen=True)
class ProbeConfig:
    """What the hooks compute; derived from the policy and the sizes once at attach."""

    real: int  # ids [0, real) are real and have a row (Sizes.real_rows)
    rows: int  # of the whole vocab: labels at or past it have no row
    input_rows: int  # of the embedding: input ids at or past it have no row
    columns: int  # of this process's head output (a shard's under vocab_shard)
    real_columns: int  # head columns [0, real_columns) are real ids
    padding_mass: bool
    mask: bool
    sample_tokens: int
    exact: bool
    nonfinite: bool
    token_range: bool
    ignore_index: int | None
    shard: tuple[int, int] | None = None  # the global ids of the head's columns (None: all)
    # The ranks holding the other shards, whose parts the padding mass combines at each read
    # (guard/device/shard_mass.py); None: the head's columns are all there is here.
    tp_group: Any = None
    dtensor_head: bool = False  # the head's weight is a DTensor split by tensor parallel

    @property
    def head_columns(self) -> Columns:
        return Columns(self.columns, self.real_columns, self.shard, self.rows, self.real)

    @classmethod
    def from_policy(cls, policy: Policy, sizes: Sizes) -> ProbeConfig:
        c = policy.checks
        return cls(
            real=sizes.real_rows, rows=sizes.rows, input_rows=sizes.audit.embedding_rows,
            columns=sizes.columns, real_columns=sizes.real_columns,
            padding_mass=policy.enabled("padding_mass"), mask=policy.masks,
            sample_tokens=c.padding_mass.sample_tokens, exact=c.padding_mass.exact,
            nonfinite=policy.enabled("nonfinite"), token_range=policy.enabled("token_range"),
            ignore_index=c.token_range.ignore_index, shard=sizes.shard,
            tp_group=None if sizes.tp is None else sizes.tp.group,
            dtensor_head=sizes.tp is not None and sizes.tp.dtensor,
        )


# Positions of largest padding logit added to every sample (Logits._hottest).
HOTTEST = 2


class Logits:
    """Measures (..., columns) logits, or the head's logits of a sample of final hidden
    states, into the flags."""

    def __init__(self, cfg: ProbeConfig, flags: Flags) -> None:
        self.cfg, self.flags = cfg, flags
        self._step = 0
        # The sampling offset as a device tensor too, for compiled forwards (`_sample`).
        self._offset = torch.zeros((), dtype=torch.int64)
        self._buffer: torch.Tensor | None = None  # `_scratch`
        # A vocab-parallel head's padding mass: its parts kept until the read combines them.
        self.sharded = ShardedMass(flags, cfg.tp_group) \
            if cfg.padding_mass and cfg.tp_group is not None else None

    def begin(self, step: int) -> None:
        """A new step starts: move the sampling offset (a device write, never a read)."""
        self._step = step
        self._offset.fill_(step)

    def measure(self, logits: torch.Tensor) -> None:
        c = self.cfg
        flat = logits.reshape(-1, c.columns)  # (tokens, columns); a view for contiguous logits
        # The mask goes on after the measure.
        sample = self._sample(flat)
        self._reduce(sample, masked=c.mask, forward=flat.shape[0],
                     hottest=self._hottest(flat, sample))
        if c.nonfinite and not c.exact and logits.dtype == torch.float16:
            # float16 logits can overflow at single (position, column) pairs the sample misses;
            # float32 / bfloat16 cannot without a non-finite input or weight, which the hidden
            # check and the sample (every position sees every weight) already catch.
            total = flat[:, : c.real_columns].sum(dtype=torch.float32)
            self.flags.at_least(nonfinite.LOGITS, torch.isfinite(total).logical_not())

    def measure_fused(self, hidden: torch.Tensor, head: nn.Module, *,
                      masked: bool = False) -> None:
        """The forward computed its loss from the head's weight without calling the head (a
        fused linear-cross-entropy kernel, F.linear(h, wte.weight)): the logits of a sample of
        positions, from the final hidden states, measured as the head's would be. The mask
        cannot reach a fused kernel's logits (the verdict says so), unless the kernel was
        handed the real rows (`masked`, guard/device/fused.py)."""
        weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
        if not isinstance(weight, torch.Tensor) or hidden.shape[-1] != weight.shape[-1]:
            return
        hidden, weight = local(hidden), local(weight)  # a vocab-parallel head: its columns
        bias = local(bias) if isinstance(bias, torch.Tensor) else None
        f = self.flags
        f.follow(hidden.device)
        f.mark(coverage.SEEN["logits"])
        if not masked:
            f.put(padding_mass.FUSED, 1.0)
        with torch.no_grad():
            states = hidden.detach().reshape(-1, hidden.shape[-1])  # (tokens, d)
            positions = self._sample(states)  # (n, d)
            if self.cfg.nonfinite:
                f.put(nonfinite.HIDDEN, nonfinite_positions(positions))
            logits = torch.nn.functional.linear(positions.to(weight.dtype), weight,
                                                bias if isinstance(bias, torch.Tensor) else None)
            # (n, columns): already a sample; the loss the kernel computes from the same rows
            # is masked only where it was handed the real rows.
            self._reduce(logits, masked=masked, forward=states.shape[0])

    def _hottest(self, flat: torch.Tensor, sample: torch.Tensor) -> torch.Tensor | None:
        """The HOTTEST positions of largest padding logit, (HOTTEST, columns), chosen on the
        device (no read), measured beside the sample: in a tied model each position's own
        token gives it a large real logit, so garbage padding rows win most positions but not
        all, and a small forward's one or two strided positions can miss them all. The
        hottest is where the garbage is worst. None where the sample is every position or
        there is no padding mass to measure. Not concatenated to the sample: that copy of the
        sample's rows cost more than the two rows' own reduction (docs/benchmarks.md)."""
        c = self.cfg
        n = flat.shape[0]
        if (c.exact or not c.padding_mass or self.sharded is not None
                or c.real_columns >= c.columns or sample.shape[0] >= n):
            return None
        hot = flat[:, c.real_columns:].amax(dim=-1)  # (n,): a padding-columns read only
        return flat.index_select(0, hot.topk(min(HOTTEST, n)).indices)

    def _sample(self, flat: torch.Tensor) -> torch.Tensor:
        """(k, ...) of (tokens, ...): every position with `exact`, else `sample_size` of them,
        strided, the offset moving with the step."""
        c = self.cfg
        if c.exact:
            return flat
        k = sample_size(flat.shape[0], c.sample_tokens)
        if compiling():
            # The step as a Python int would be a constant of the graph: a recompile per step.
            if self._offset.device != flat.device:
                self._offset = self._offset.to(flat.device)
            return sample_positions_at(flat, k, self._offset)  # the same ones
        return sample_positions(flat, k, self._step)

    def _scratch(self, positions: torch.Tensor, per_chunk: int,
                 also: torch.Tensor | None = None) -> torch.Tensor | None:
        """The buffer each chunk's exp(x - max) is formed in (and `also`'s rows, reduced at
        once through it), kept from forward to forward: on the CPU only
        (ops.CPU_CHUNK_ELEMENTS says why), and not under torch.compile, whose compiler owns
        the buffers."""
        if positions.device.type != "cpu" or compiling():
            return None
        dtype = reduction_dtype(positions)
        rows = min(per_chunk, positions.shape[0])
        size = max(rows, 0 if also is None else also.shape[0]) * self.cfg.real_columns
        held = self._buffer
        if held is None or held.dtype != dtype or held.numel() < size:
            held = self._buffer = torch.empty(size, dtype=dtype)
        return held

    def _reduce(self, positions: torch.Tensor, *, masked: bool, forward: int,
                hottest: torch.Tensor | None = None) -> None:
        """Padding mass and non-finite counts of (n, columns) sampled logits of a forward of
        `forward` positions, and of the `hottest` rows beside them; the real columns in
        chunks. `masked`: the loss sees these logits with the padding masked (no padding
        mass)."""
        c, f = self.cfg, self.flags
        real = c.real_columns
        if positions.shape[0] == 0:  # an empty batch: nothing seen, nothing to count
            return
        per_chunk = chunk_positions(c.columns, positions.device, forward, sample=not c.exact)
        if self.sharded is not None:  # its figures are the whole vocab's, at the read
            with nullcontext() if c.exact else one_thread(positions.device):
                parts = shard_parts(positions, real, per_chunk,
                                    self._scratch(positions, per_chunk))
            self.sharded.add(parts, masked=masked)
            if c.nonfinite:  # this rank's columns: a NaN is named where it is
                f.put(nonfinite.LOGITS, nonfinite_count(parts[0]))
            return
        if c.padding_mass and real < c.columns:
            # A sample is a 32nd of the forward: one thread does it without waiting on
            # others (ops.one_thread); every position (exact) is worth the threads.
            with nullcontext() if c.exact else one_thread(positions.device):
                scratch = self._scratch(positions, per_chunk, hottest)
                mass, lse_real = padding_mass_parts(positions, real, per_chunk=per_chunk,
                                                    scratch=scratch)
                if hottest is not None:
                    hot_mass, hot_lse = padding_mass_parts(hottest, real, scratch=scratch)
                    mass, lse_real = torch.cat([mass, hot_mass]), torch.cat([lse_real, hot_lse])
            # A NaN mass means NaN on the padding columns: count it as all the mass.
            mass = torch.nan_to_num(mass, nan=1.0)  # (n,)
            f.put(padding_mass.SUM, mass.sum())
            top = mass.max()
            f.put(padding_mass.MAX, top)
            if not masked:
                f.put(padding_mass.LOSS_MAX, top)
            # log Z of the same positions, a figure from the values already reduced.
            f.put(padding_mass.LSE_SUM, lse_real.sum())
            top_lse = lse_real.max().to(f.t.dtype)
            f.put(padding_mass.LSE_MAX, top_lse + padding_mass.LSE_SHIFT)  # float64: exact
        else:
            lse_real = positions[:, :real].sum(dim=-1, dtype=torch.float32)  # (n,)
        if c.padding_mass:
            f.put(padding_mass.COUNT, lse_real.shape[0])
        if c.nonfinite:
            # Positions with a NaN or +Inf among the real-vocab logits make the position's
            # logsumexp (or sum) non-finite: counted per position, from values already reduced.
            f.put(nonfinite.LOGITS, nonfinite_count(lse_real))
