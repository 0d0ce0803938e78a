"""Forward hooks on the embedding, the lm_head and the model: they run the pure checks on
the device and accumulate into the flags. Nothing here reads a tensor to the host."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.checks import (
    chunk_rows,
    masked_logits,
    nonfinite_count,
    out_of_range_count,
    padding_mass_parts,
    sample_rows,
)
from guard.flags import Flags, Slot

__all__ = ["Probe", "ProbeConfig", "find_loss"]

_LABEL_KWARGS = ("labels", "targets")


@dataclass(frozen=True)
class ProbeConfig:
    """What the hooks compute; derived from the policy once at attach."""

    real: int  # real vocab, clipped to the head rows
    rows: int
    padding_mass: bool
    mask: bool
    sample_tokens: int
    exact: bool
    nonfinite: bool
    token_range: bool
    ignore_index: int | None


def find_loss(output: Any) -> torch.Tensor | None:
    """The scalar loss in a model's output: HF `.loss`, a dict's 'loss', or nanoGPT's tuple."""
    cand = getattr(output, "loss", None)
    if cand is None and isinstance(output, dict):
        cand = output.get("loss")
    if cand is None and isinstance(output, tuple | list):
        cand = next((o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0), None)
    if isinstance(cand, torch.Tensor) and cand.dim() == 0 and cand.is_floating_point():
        return cand
    return None


def _labels_position(model: nn.Module) -> int | None:
    """Index in *args of a `labels` / `targets` parameter of model.forward, if any."""
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return next((i for i, name in enumerate(params) if name in _LABEL_KWARGS), None)


class Probe:
    """Owns the hook handles; each hook adds device-side reductions to `flags`."""

    def __init__(self, cfg: ProbeConfig, flags: Flags) -> None:
        self.cfg = cfg
        self.flags = flags
        self.handles: list[RemovableHandle] = []
        self.step = 0  # host-side counter, only for the sampling offset
        self.on_loss: Callable[[torch.Tensor], None] | None = None
        self.on_forward_start: Callable[[], None] | None = None
        self.on_forward_end: Callable[[], None] | None = None
        # Sees each training forward's (args, kwargs): the localiser keeps the last ones.
        self.on_inputs: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None

    def install(self, model: nn.Module, embedding: nn.Module, head: nn.Module) -> None:
        self._label_pos = _labels_position(model)
        c = self.cfg
        self.handles.append(model.register_forward_pre_hook(self._model_pre, with_kwargs=True))
        if c.token_range:
            self.handles.append(embedding.register_forward_pre_hook(self._embedding_pre))
        if c.nonfinite:
            self.handles.append(head.register_forward_pre_hook(self._head_pre))
        if c.padding_mass or c.mask or c.nonfinite:
            self.handles.append(head.register_forward_hook(self._head_post))
        self.handles.append(model.register_forward_hook(self._model_post))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- hooks -------------------------------------------------------------------------------

    def _embedding_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            with torch.no_grad():
                self.flags.add(Slot.OOR_INPUT, out_of_range_count(args[0], self.cfg.real, None))

    def _model_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training:
            return
        if self.on_forward_start is not None:
            self.on_forward_start()
        if self.on_inputs is not None:
            self.on_inputs(args, kwargs)
        if not self.cfg.token_range:
            return
        labels = next((kwargs[k] for k in _LABEL_KWARGS if k in kwargs), None)
        if labels is None and self._label_pos is not None and len(args) > self._label_pos:
            labels = args[self._label_pos]
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
            with torch.no_grad():
                n = out_of_range_count(labels, self.cfg.real, self.cfg.ignore_index)
                self.flags.add(Slot.OOR_LABEL, n)

    def _head_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            self.flags.follow(args[0].device)
            with torch.no_grad():
                self.flags.add(Slot.NF_HIDDEN, nonfinite_count(args[0]))

    def _head_post(self, module: nn.Module, args: tuple[Any, ...], logits: Any) -> Any:
        if not isinstance(logits, torch.Tensor) or logits.shape[-1] != self.cfg.rows:
            return None
        c = self.cfg
        if module.training:
            self.flags.follow(logits.device)
            with torch.no_grad():
                self._measure(logits.detach())
        if c.mask:
            # In place, after measuring: the mass reported is the one the mask removed.
            return masked_logits(logits, c.real)
        return None

    def _measure(self, logits: torch.Tensor) -> None:
        c, f = self.cfg, self.flags
        flat = logits.reshape(-1, c.rows)  # (tokens, rows); a view for contiguous logits
        rows = flat if c.exact else sample_rows(flat, c.sample_tokens, self.step)
        step = chunk_rows(c.rows, flat.device)
        measure_mass = c.padding_mass and c.real < c.rows
        for i in range(0, rows.shape[0], step):
            chunk = rows[i : i + step]  # (n, rows)
            if measure_mass:
                mass, real_rows = padding_mass_parts(chunk, c.real)  # (n,), (n,)
                # A NaN mass means NaN on the padding columns: count it as all the mass.
                mass = torch.nan_to_num(mass, nan=1.0)
                f.add(Slot.PM_SUM, mass.sum())
                f.max(Slot.PM_MAX, mass.max())
            else:
                real_rows = chunk[:, : c.real].sum(dim=-1, dtype=torch.float32)
            if c.padding_mass:
                f.add_const(Slot.PM_COUNT, chunk.shape[0])
            if c.nonfinite:
                # Rows with a NaN or +Inf among the real-vocab logits make the row's logsumexp
                # (or sum) non-finite: counted per position, from values already reduced.
                f.add(Slot.NF_LOGITS, nonfinite_count(real_rows))
        if c.nonfinite and not c.exact and logits.dtype == torch.float16:
            # float16 logits can overflow at single (position, column) pairs the sample misses;
            # float32 / bfloat16 cannot without a non-finite input or weight, which the hidden
            # check and the sample (every position sees every weight) already catch.
            total = flat[:, : c.real].sum(dtype=torch.float32)
            f.max(Slot.NF_LOGITS, torch.isfinite(total).logical_not())

    def _model_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not module.training:
            return
        loss = find_loss(output)
        if loss is not None and self.on_loss is not None:
            self.on_loss(loss)
        if self.on_forward_end is not None:
            self.on_forward_end()
