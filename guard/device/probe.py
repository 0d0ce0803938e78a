"""The device side of the guard: forward hooks on the embedding, the lm_head and the model that
write into the checks' slots (guard/checks/), and what the step clock and the reader ask of
it at a boundary. Nothing in a hook reads a tensor to the host."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from guard.checks import coverage, nonfinite, token_range
from guard.device.flags import Flags
from guard.device.fused import FusedHead
from guard.device.hooks import Handle, hook
from guard.device.labels import LabelsArg, labels_position
from guard.device.logits import Logits, ProbeConfig
from guard.device.loss import LossShares, StepLoss
from guard.device.ops import mask_padding, nonfinite_count, out_of_range_parts, within_rows
from guard.device.reading import Reading
from guard.device.rows import PaddingRows
from guard.device.site import LogitsSite, find_loss
from guard.policy import Policy
from guard.vocab.discover import Heads
from guard.vocab.resolve import Sizes
from guard.vocab.untrained import Untrained, find_untrained

__all__ = ["Probe", "find_loss", "labels_position", "mask_hook"]

log = logging.getLogger("guard")

class Probe:
    """Hooks that add reductions to the flags and feed the model's loss to the step's loss;
    `install` returns their handles (the guard owns and removes them)."""

    def __init__(self, cfg: ProbeConfig, flags: Flags, loss: StepLoss,
                 rows: PaddingRows | None = None, untrained: Untrained | None = None) -> None:
        self.cfg = cfg
        self.flags = flags
        self.loss = loss
        self.rows = rows  # the padding rows of the weights, checked before each read
        self.untrained = untrained  # the real vocab's rows never trained, found at attach
        # Its lookup tables count the ids in the hooks that read them for token_range.
        self._counts = None if untrained is None else untrained.device
        # Per kind of id, the tables that count it, where any row it looks up is untrained.
        self._input_counts, self._label_counts = (
            self._counts if self._counts is not None and self._counts.watches(k) else None
            for k in ("input", "label"))
        self.logits = Logits(cfg, flags)
        self._labels = LabelsArg(None, "forward")  # set at install, from the model
        # This forward's final hidden states, and whether it called the head: a forward that
        # computes its loss from the head's weight without calling it (a fused
        # linear-cross-entropy kernel) is measured from the hidden states instead.
        self._hidden: torch.Tensor | None = None
        self._head_called = False
        self._head: nn.Module | None = None  # the module holding the head's weight
        # Where the logits the loss sees come out: measured and masked there.
        self.site = LogitsSite(cfg, self.logits)
        self.fused: FusedHead | None = None  # a fused LM head handed the real rows (TRL)

    @classmethod
    def from_policy(cls, policy: Policy, sizes: Sizes, heads: Heads, *, rank: int,
                    loss_shares: LossShares = "last", loss_scale: float = 1.0,
                    tokenizer: Any = None, model: nn.Module | None = None) -> Probe:
        """`tokenizer` and `model` name the tokens of rows found untrained."""
        device = next((p.device for p in heads.head_holder.parameters()), torch.device("cpu"))
        flags = Flags.from_policy(policy, device, rank, real=sizes.real_columns,
                                  columns=sizes.columns)
        loss = StepLoss.from_policy(policy, flags, shares=loss_shares, scale=loss_scale)
        rows = PaddingRows.from_policy(policy, flags, heads, sizes.first_padding)
        untrained = find_untrained(policy, flags, heads, sizes, tokenizer=tokenizer, model=model)
        return cls(ProbeConfig.from_policy(policy, sizes), flags, loss, rows, untrained)

    # -- at a boundary (the step clock) ------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.flags.device

    @property
    def reads_at_attach(self) -> bool:
        """Something is checked before step 1: the padding rows of the weights, rows of the
        real vocab found untrained (when none is, the first step's read says so)."""
        return self.rows is not None or (self._counts is not None and self._counts.n > 0)

    def end_step(self, step: int) -> None:
        """Step `step` ended: fold its loss, count what it did not see, move the sample."""
        for level, text in self.site.notes:
            log.log(level, "%s", text)
        self.site.notes.clear()
        self.logits.begin(step)
        self.loss.fold()
        self.flags.end_step()

    def read(self, *, lagged: bool, reduce: bool = True, weights: bool = True) -> Reading | None:
        """The flags, after checking the weights' padding rows (device ops) when `weights`."""
        if weights and self.rows is not None:
            self.rows.check()
        if self._counts is not None:
            self._counts.check()
        return self.flags.read(lagged=lagged, reduce=reduce)

    def flush(self) -> Reading | None:
        """Whatever a lagged read left queued (at detach)."""
        return self.flags.flush()

    def fold(self) -> None:
        """The loss seen since the last boundary into the flags (at detach)."""
        self.loss.fold()

    def record_loss(self, loss: torch.Tensor, *, fallback: bool = False) -> None:
        """A loss given by `g.step(loss)` (see StepLoss.record)."""
        self.loss.record(loss, given=True, fallback=fallback)

    def repairs(self) -> dict[str, Callable[[], None]]:
        """Per check, what its `repair` action does (the reader calls it at a violation)."""
        out = {} if self.rows is None else {"padding_rows": self.rows.repair}
        if self._counts is not None:
            out["untrained_rows"] = self._counts.repair
        return out

    def details(self) -> dict[str, Callable[[Reading, bool], str]]:
        """Per check, what the host adds to its message at a violation (the reader calls it
        with the reading and whether it was combined over ranks)."""
        out: dict[str, Callable[[Reading, bool], str]] = {
            "coverage": lambda reading, combined: self._labels.looked_for()}
        if self.untrained is not None:
            out["untrained_rows"] = self.untrained.detail
        return out

    # -- hooks -------------------------------------------------------------------------------

    def install(self, model: nn.Module, heads: Heads,
                caller: nn.Module | None = None) -> list[Handle]:
        """Hooks for the enabled checks only: a check that is off costs nothing. `caller`: the
        module whose forward hooks see each call of `model` (a wrapper that calls the model's
        forward method past its hooks; `model` itself otherwise)."""
        caller = model if caller is None else caller
        self._labels = LabelsArg.of(caller, model)  # the model's own forward, inside wrappers
        self._head = heads.head_holder  # its weight: a fused loss is measured with it
        c = self.cfg
        handles: list[Handle] = [hook(caller, self._model_pre, kind="forward_pre",
                                      compiled="eager", with_kwargs=True)]
        if c.token_range or self._input_counts is not None:
            handles += [hook(m, self._embedding_pre, kind="forward_pre") for m in heads.inputs]
        if c.nonfinite:
            handles.append(hook(heads.lm_head, self._head_pre, kind="forward_pre"))
        if c.padding_mass or c.mask or c.nonfinite:
            handles.append(hook(heads.lm_head, self._head_post, kind="forward"))
            if heads.final_norm is not None:
                handles.append(hook(heads.final_norm, self._hidden_post, kind="forward"))
            handles += self.site.install(model, heads.lm_head_name)
            if c.mask and c.real_columns < c.columns and c.real_columns == c.real:
                self.fused = FusedHead(model, heads, c.real_columns)
                handles.append(self.fused)
        handles.append(hook(caller, self._model_post, kind="forward", compiled="eager"))
        return handles

    def _embedding_pre(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        if not (module.training and args and isinstance(args[0], torch.Tensor)):
            return None
        ids = args[0]
        if ids.is_floating_point():  # embeddings of something else
            return None
        if self._input_counts is not None:
            self._input_counts.count("input", ids)
        if not self.cfg.token_range:
            return None
        self.flags.mark(coverage.SEEN["inputs"])
        with torch.no_grad():
            self._out_of_range("input", ids, None)
            # An id with no row would end the step in an index error (on a GPU, a device-side
            # assert that kills the process) before the guard could say anything: it is
            # replaced by id 0 and counted, and the read says where it was.
            safe = within_rows(ids, self.cfg.input_rows, 0)
        return (safe, *args[1:])

    def _model_pre(self, module: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        self.site.begin(module.training)
        fused = self.fused is not None and FusedHead.asked(kwargs)
        if fused and self.fused is not None:
            self.fused.on()
        if module.training:
            self._hidden, self._head_called = None, False
        counts = self._label_counts if module.training else None
        checked = module.training and self.cfg.token_range
        if not (checked or fused or counts is not None):
            return None
        at, labels = self._labels.find(args, kwargs)
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
            return None
        if counts is not None:
            counts.count("label", labels)
        if not (checked or fused):
            return None
        ignore = self.cfg.ignore_index
        with torch.no_grad():
            if checked:
                self.flags.mark(coverage.SEEN["labels"])
                self._out_of_range("label", labels, ignore)
            # As the embedding's ids: a label past the rows, which the loss would index out of
            # bounds, becomes the ignore index (torch's and HF's -100 where the policy has
            # none), counted above; with the fused head cut to the real rows, a label past
            # them. Negative labels stay: they are the loss's own ignore value (HF -100,
            # nanoGPT -1), or a setting the message names.
            safe = within_rows(labels, self.cfg.real if fused else self.cfg.rows,
                               -100 if ignore is None else ignore, negative=False)
        if isinstance(at, str):
            return args, {**kwargs, at: safe}
        if isinstance(at, int):
            return (*args[:at], safe, *args[at + 1:]), kwargs
        return None

    def _out_of_range(self, kind: token_range.Kind, ids: torch.Tensor,
                      ignore_index: int | None) -> None:
        n, negative, top = out_of_range_parts(ids, self.cfg.real, ignore_index)
        f = self.flags
        f.put(token_range.SLOTS[kind], n)
        if kind == "label":
            f.put(token_range.NEGATIVE, negative)
        f.put(token_range.TOP[kind], top)
        f.put(token_range.WIDTH[kind], ids.shape[-1] if ids.dim() else 0)

    def _head_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            self.flags.follow(args[0].device)
            with torch.no_grad():
                self.flags.put(nonfinite.HIDDEN, nonfinite_count(args[0]))

    def _head_post(self, module: nn.Module, args: tuple[Any, ...], logits: Any) -> Any:
        if not isinstance(logits, torch.Tensor) or logits.shape[-1] != self.cfg.columns:
            return None
        if module.training:
            self._head_called = True
            self.flags.follow(logits.device)
            self.flags.mark(coverage.SEEN["logits"])
        return self.site.at_head(logits, module.training)

    def _hidden_post(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if module.training and isinstance(out, torch.Tensor):
            self._hidden = out  # a reference: autograd keeps it alive anyway

    def _model_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        replaced = self.site.at_output(output, module.training)
        fused = self.fused is not None and self.fused.active
        if fused and self.fused is not None:
            self.fused.off()
        if module.training:
            self._after_training(output, fused=fused)
        return replaced

    def _after_training(self, output: Any, *, fused: bool) -> None:
        """The loss the forward returned, and a fused head's logits from the hidden states
        (`fused`: it was handed the real rows, so its loss is the masked one)."""
        loss = find_loss(output)
        if loss is not None:
            self.loss.record(loss)
        hidden, self._hidden = self._hidden, None
        if hidden is not None and not self._head_called and self._head is not None:
            self.logits.measure_fused(hidden, self._head, masked=fused)


def mask_hook(real: int, columns: int) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook for the head that masks the padding columns [real, columns) of its
    output (what `detach(keep_mask=True)` leaves behind)."""

    def mask(module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.shape[-1] == columns:
            return mask_padding(out, real)
        return None

    return mask
