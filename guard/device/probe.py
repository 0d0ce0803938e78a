"""Forward hooks on the embedding, the lm_head and the model: they run the pure checks on
the device and accumulate into the flags. Nothing here reads a tensor to the host."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.device.checks import (
    chunk_rows,
    masked_logits,
    nonfinite_count,
    out_of_range_parts,
    padding_mass_parts,
    sample_rows,
    sample_rows_at,
)
from guard.device.compile import compiling, eager_at_top_level
from guard.device.flags import Flags
from guard.device.loss import StepLoss
from guard.device.rows import PaddingRows
from guard.policy import Policy
from guard.vocab.discover import Heads
from guard.vocab.sizes import Audit

__all__ = ["Probe", "ProbeConfig", "find_loss", "labels_position"]

_LABEL_KWARGS = ("labels", "targets")


@dataclass(frozen=True)
class ProbeConfig:
    """What the hooks compute; derived from the policy once at attach."""

    real: int  # real vocab (token ids), clipped to the vocab rows
    rows: int  # columns of this process's head output (a shard's columns under vocab_shard)
    padding_mass: bool
    mask: bool
    sample_tokens: int
    exact: bool
    nonfinite: bool
    token_range: bool
    ignore_index: int | None
    # Head output columns [0, head_real) are real tokens: `real` for a whole head, fewer on
    # the shard of a vocab-parallel head that holds the padding (attach's vocab_shard).
    head_real: int | None = None

    @classmethod
    def from_policy(cls, policy: Policy, audit: Audit,
                    shard: tuple[int, int] | None = None) -> ProbeConfig:
        c = policy.checks
        rows, head_real = audit.rows, None
        if shard is not None:
            # The head's columns are global ids [start, end): padding from id `real` on.
            start, end = shard
            rows, head_real = end - start, min(max(audit.real - start, 0), end - start)
        return cls(
            real=min(audit.real, audit.rows), rows=rows,
            padding_mass=policy.enabled("padding_mass"), mask=policy.masks,
            sample_tokens=c.padding_mass.sample_tokens, exact=c.padding_mass.exact,
            nonfinite=policy.enabled("nonfinite"), token_range=policy.enabled("token_range"),
            ignore_index=c.token_range.ignore_index, head_real=head_real,
        )

    @property
    def real_columns(self) -> int:
        return min(self.real, self.rows) if self.head_real is None else self.head_real


def find_loss(output: Any) -> torch.Tensor | None:
    """The scalar loss in a model's output: HF `.loss`, a dict's 'loss', nanoGPT's tuple, or
    the output itself when it is a 0-dim float tensor."""
    cand = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if cand is None and isinstance(output, dict):
        cand = output.get("loss")
    if cand is None and isinstance(output, tuple | list):
        cand = next((o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0), None)
    if isinstance(cand, torch.Tensor) and cand.dim() == 0 and cand.is_floating_point():
        return cand
    return None


def labels_position(model: nn.Module) -> int | None:
    """Index in *args of a `labels` / `targets` parameter of model.forward, if any."""
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return next((i for i, name in enumerate(params) if name in _LABEL_KWARGS), None)


class Probe:
    """The device side of the guard: hooks that add reductions to `flags` and feed the model's
    loss to `loss`; `install` returns their handles (the guard owns and removes them)."""

    def __init__(self, cfg: ProbeConfig, flags: Flags, loss: StepLoss,
                 rows: PaddingRows | None = None) -> None:
        self.cfg = cfg
        self.flags = flags
        self.loss = loss
        self.rows = rows  # the padding rows of the weights, checked before each read
        self._step = 0
        # The sampling offset as a device tensor too, for compiled forwards (`_sample`).
        self._offset = torch.zeros((), dtype=torch.int64)
        self._label_pos: int | None = None
        # This forward's final hidden states, and whether it called the head: a forward that
        # computes its loss from the head's weight without calling it (a fused
        # linear-cross-entropy kernel) is measured from the hidden states instead.
        self._hidden: torch.Tensor | None = None
        self._head_called = False
        self._head: nn.Module | None = None

    def begin(self, step: int) -> None:
        """A new step starts: move the sampling offset (a device write, never a read)."""
        self._step = step
        self._offset.fill_(step)

    def check_weights(self) -> None:
        """Before a read: the padding rows of the weights into the flags (device ops)."""
        if self.rows is not None:
            self.rows.check()

    def install(self, model: nn.Module, heads: Heads) -> list[RemovableHandle]:
        """Hooks for the enabled checks only: a check that is off costs nothing."""
        self._label_pos = labels_position(model)
        self._head = heads.lm_head
        c = self.cfg
        eager_at_top_level(self._model_pre, self._model_post)
        handles = [model.register_forward_pre_hook(self._model_pre, with_kwargs=True)]
        if c.token_range:
            handles.append(heads.embedding.register_forward_pre_hook(self._embedding_pre))
        if c.nonfinite:
            handles.append(heads.lm_head.register_forward_pre_hook(self._head_pre))
        if c.padding_mass or c.mask or c.nonfinite:
            handles.append(heads.lm_head.register_forward_hook(self._head_post))
            if heads.final_norm is not None:
                handles.append(heads.final_norm.register_forward_hook(self._hidden_post))
        handles.append(model.register_forward_hook(self._model_post))
        return handles

    # -- hooks -------------------------------------------------------------------------------

    def _embedding_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            with torch.no_grad():
                self.flags.add_out_of_range("input", *out_of_range_parts(args[0], self.cfg.real,
                                                                         None))

    def _model_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training:
            return
        self._hidden, self._head_called = None, False
        if not self.cfg.token_range:
            return
        labels = next((kwargs[k] for k in _LABEL_KWARGS if k in kwargs), None)
        if labels is None and self._label_pos is not None and len(args) > self._label_pos:
            labels = args[self._label_pos]
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
            self.flags.saw("labels")
            with torch.no_grad():
                parts = out_of_range_parts(labels, self.cfg.real, self.cfg.ignore_index)
                self.flags.add_out_of_range("label", *parts)

    def _head_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            self.flags.follow(args[0].device)
            with torch.no_grad():
                self.flags.add_nonfinite("hidden", nonfinite_count(args[0]))

    def _head_post(self, module: nn.Module, args: tuple[Any, ...], logits: Any) -> Any:
        if not isinstance(logits, torch.Tensor) or logits.shape[-1] != self.cfg.rows:
            return None
        c = self.cfg
        if module.training:
            self._head_called = True
            self.flags.follow(logits.device)
            self.flags.saw("logits")
            with torch.no_grad():
                self._measure(logits.detach())
        if c.mask:
            # In place, after measuring: the mass reported is the one the mask removed.
            return masked_logits(logits, c.real_columns)
        return None

    def _hidden_post(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if module.training and isinstance(out, torch.Tensor):
            self._hidden = out  # a reference: autograd keeps it alive anyway

    def _model_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not module.training:
            return
        loss = find_loss(output)
        if loss is not None:
            self.loss.record(loss)
        hidden, self._hidden = self._hidden, None
        if hidden is not None and not self._head_called:
            self._measure_fused(hidden)

    def _measure_fused(self, hidden: torch.Tensor) -> None:
        """The forward computed its loss from the head's weight without calling the head (a
        fused linear-cross-entropy kernel, F.linear(h, wte.weight)): the logits of a sample of
        positions, from the final hidden states, measured as the head's would be. The mask
        cannot reach a fused kernel's logits; the verdict says so."""
        head = self._head
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or hidden.shape[-1] != weight.shape[-1]:
            return
        bias = getattr(head, "bias", None)
        self.flags.follow(hidden.device)
        self.flags.saw("logits")
        self.flags.add_fused()
        with torch.no_grad():
            positions = self._sample(hidden.detach().reshape(-1, hidden.shape[-1]))  # (n, d)
            if self.cfg.nonfinite:
                self.flags.add_nonfinite("hidden", nonfinite_count(positions))
            logits = torch.nn.functional.linear(positions.to(weight.dtype), weight,
                                                bias if isinstance(bias, torch.Tensor) else None)
            self._reduce(logits)  # (n, rows): already a sample

    # -- the logits' reductions --------------------------------------------------------------

    def _sample(self, flat: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.exact:
            return flat
        if compiling():
            # The step as a Python int would be a constant of the graph: a recompile per step.
            if self._offset.device != flat.device:
                self._offset = self._offset.to(flat.device)
            return sample_rows_at(flat, c.sample_tokens, self._offset)  # the same positions
        return sample_rows(flat, c.sample_tokens, self._step)

    def _measure(self, logits: torch.Tensor) -> None:
        c = self.cfg
        flat = logits.reshape(-1, c.rows)  # (tokens, rows); a view for contiguous logits
        self._reduce(self._sample(flat))
        if c.nonfinite and not c.exact and logits.dtype == torch.float16:
            # float16 logits can overflow at single (position, column) pairs the sample misses;
            # float32 / bfloat16 cannot without a non-finite input or weight, which the hidden
            # check and the sample (every position sees every weight) already catch.
            total = flat[:, : c.real_columns].sum(dtype=torch.float32)
            self.flags.nonfinite_at_least("logits", torch.isfinite(total).logical_not())

    def _reduce(self, positions: torch.Tensor) -> None:
        """Padding mass and non-finite counts of (n, rows) sampled logits, in chunks."""
        c, f = self.cfg, self.flags
        real = c.real_columns
        per_chunk = chunk_rows(c.rows, positions.device)
        measure_mass = c.padding_mass and real < c.rows
        for i in range(0, positions.shape[0], per_chunk):
            chunk = positions[i : i + per_chunk]  # (n, rows)
            if measure_mass:
                mass, lse_real = padding_mass_parts(chunk, real)  # (n,), (n,)
                # A NaN mass means NaN on the padding columns: count it as all the mass.
                f.add_padding_mass(torch.nan_to_num(mass, nan=1.0))
            else:
                lse_real = chunk[:, :real].sum(dim=-1, dtype=torch.float32)  # (n,)
            if c.padding_mass:
                f.add_positions(chunk.shape[0])
            if c.nonfinite:
                # Positions with a NaN or +Inf among the real-vocab logits make the position's
                # logsumexp (or sum) non-finite: counted per position, from values already
                # reduced.
                f.add_nonfinite("logits", nonfinite_count(lse_real))
