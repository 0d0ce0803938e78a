"""Forward hooks on the embedding, the lm_head and the model: they run the pure checks on
the device and accumulate into the flags. Nothing here reads a tensor to the host."""

from __future__ import annotations

import functools
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
    sample_rows_at,
)
from guard.flags import Flags, Slot

__all__ = ["Probe", "ProbeConfig", "find_loss"]

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

    @property
    def real_columns(self) -> int:
        return min(self.real, self.rows) if self.head_real is None else self.head_real


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


@functools.cache
def _model_hooks_eager_at_top_level() -> None:
    """torch.compile(model) runs the model's hooks as frames of their own (dynamo skips
    nn.Module._call_impl): these two then run eagerly, as in an uncompiled model (tiny ops
    and host bookkeeping: not worth a frame, and dynamo warns building a frame whose inputs are
    the model's non-leaf outputs). Inlined into a larger compiled function they are traced as
    usual, so that one stays a single graph (fullgraph=True works)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # another torch: the hooks stay frames of their own
        return
    skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # this frame and its callees
    for hook in (Probe._model_pre, Probe._model_post):
        set_code_exec_strategy(hook.__code__, skip)


class Probe:
    """Owns the hook handles; each hook adds device-side reductions to `flags`."""

    def __init__(self, cfg: ProbeConfig, flags: Flags) -> None:
        self.cfg = cfg
        self.flags = flags
        self.handles: list[RemovableHandle] = []
        self._step = 0
        # The sampling offset as a device tensor too, for compiled forwards (`_sample`).
        self._offset = torch.zeros((), dtype=torch.int64)
        self.on_loss: Callable[[torch.Tensor], None] | None = None
        # Host work at the start of a training forward (the forward-mode step boundary): set
        # before install, or no hook is registered for it.
        self.on_forward_start: Callable[[], None] | None = None
        self._start_handle: RemovableHandle | None = None
        self.on_forward_end: Callable[[], None] | None = None
        # Sees each training forward's (args, kwargs): the localiser keeps the last ones.
        self.on_inputs: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None

    @property
    def step(self) -> int:
        """Host-side step counter, only for the sampling offset."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self._offset.fill_(value)  # a device write at the step boundary, never a read

    def install(self, model: nn.Module, embedding: nn.Module, head: nn.Module) -> None:
        self._label_pos = _labels_position(model)
        c = self.cfg
        _model_hooks_eager_at_top_level()
        if self.on_forward_start is not None:
            # Host work (it may read the flags), so torch.compile must not trace it: disabled,
            # it runs eagerly before the compiled frame of a compiled model; inlined into a
            # larger compiled function it costs one graph break. Registered first: the
            # boundary closes the previous step before this forward adds to the flags.
            start = torch.compiler.disable(self._forward_start_pre)
            self._start_handle = model.register_forward_pre_hook(start)
            self.handles.append(self._start_handle)
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

    def drop_forward_start(self) -> None:
        """Stop calling on_forward_start: the caller marks the step boundaries from now on."""
        if self._start_handle is not None:
            self._start_handle.remove()
            self.handles.remove(self._start_handle)
            self._start_handle = None

    # -- hooks -------------------------------------------------------------------------------

    def _embedding_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            with torch.no_grad():
                self.flags.add(Slot.OOR_INPUT, out_of_range_count(args[0], self.cfg.real, None))

    def _forward_start_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # A step is a training forward that builds a graph: a no_grad forward in train mode
        # (sampling, a probe) is not, or ranks would count steps, and collectives, apart.
        if module.training and torch.is_grad_enabled() and self.on_forward_start is not None:
            self.on_forward_start()

    def _model_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training:
            return
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
            return masked_logits(logits, c.real_columns)
        return None

    def _sample(self, flat: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.exact:
            return flat
        if torch.compiler.is_compiling():
            # The step as a Python int would be a constant of the graph: a recompile per step.
            if self._offset.device != flat.device:
                self._offset = self._offset.to(flat.device)
            return sample_rows_at(flat, c.sample_tokens, self._offset)  # the same rows
        return sample_rows(flat, c.sample_tokens, self._step)

    def _measure(self, logits: torch.Tensor) -> None:
        c, f = self.cfg, self.flags
        real = c.real_columns
        flat = logits.reshape(-1, c.rows)  # (tokens, rows); a view for contiguous logits
        rows = self._sample(flat)
        step = chunk_rows(c.rows, flat.device)
        measure_mass = c.padding_mass and real < c.rows
        for i in range(0, rows.shape[0], step):
            chunk = rows[i : i + step]  # (n, rows)
            if measure_mass:
                mass, real_rows = padding_mass_parts(chunk, real)  # (n,), (n,)
                # A NaN mass means NaN on the padding columns: count it as all the mass.
                mass = torch.nan_to_num(mass, nan=1.0)
                f.add(Slot.PM_SUM, mass.sum())
                f.max(Slot.PM_MAX, mass.max())
            else:
                real_rows = chunk[:, :real].sum(dim=-1, dtype=torch.float32)
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
            total = flat[:, :real].sum(dtype=torch.float32)
            f.max(Slot.NF_LOGITS, torch.isfinite(total).logical_not())

    def _model_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not module.training:
            return
        loss = find_loss(output)
        if loss is not None and self.on_loss is not None:
            self.on_loss(loss)
        if self.on_forward_end is not None and torch.is_grad_enabled():
            self.on_forward_end()
