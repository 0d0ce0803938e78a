"""The device side of the guard: forward hooks on the embedding, the lm_head and the model that
write into the checks' slots (guard/checks/), and what the step clock and the reader ask of
it at a boundary. Nothing in a hook reads a tensor to the host."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from guard.checks import coverage, grads, nonfinite
from guard.device.dtensors import head_output, local
from guard.device.flags import Flags
from guard.device.fused import FusedHead
from guard.device.hooks import Handle, hook, register
from guard.device.ids import IdHooks
from guard.device.logits import Logits, ProbeConfig
from guard.device.loss import LossShares, StepLoss
from guard.device.ops import mask_padding, nonfinite_positions
from guard.device.reading import Reading
from guard.device.site import LogitsSite, find_loss
from guard.device.watched import Watched
from guard.policy import Policy
from guard.vocab.discover import Heads
from guard.vocab.resolve import Sizes

__all__ = ["Probe", "find_loss", "mask_hook"]

log = logging.getLogger("guard")


class Probe:
    """Hooks that add reductions to the flags and feed the model's loss to the step's loss;
    `install` returns their handles (the guard owns and removes them)."""

    def __init__(self, cfg: ProbeConfig, flags: Flags, loss: StepLoss) -> None:
        self.cfg = cfg
        self.flags = flags
        self.loss = loss
        self.logits = Logits(cfg, flags)
        self.states: Watched | None = None  # the stateful checks', given at install
        self.ids = IdHooks(cfg, flags)
        # This forward's final hidden states, and whether it called the head: a forward that
        # computes its loss from the head's weight without calling it (a fused
        # linear-cross-entropy kernel) is measured from the hidden states instead.
        self._hidden: torch.Tensor | None = None
        self._head_called = False
        self._head: nn.Module | None = None  # the module holding the head's weight
        self._head_hooked = False  # hooks on the head's output (the logits checks are on)
        self._stage_loss = False  # g.loss_fn wraps a last stage's loss: the output goes there
        # Where the logits the loss sees come out: measured and masked there.
        self.site = LogitsSite(cfg, self.logits)
        self.fused: FusedHead | None = None  # a fused LM head handed the real rows (TRL)
        self._skips_watched = False  # the clock tells the updates the loop skipped
        # A pipeline stage: every stage reads at attach, whatever its own states need, since
        # the read is a collective of every rank (guard/vocab/stage.py).
        self.pipelined = False
        # torch's PipelineStage is running its shape inference (guard/device/pipeline.py).
        self.inferring = False

    @classmethod
    def from_policy(cls, policy: Policy, sizes: Sizes, heads: Heads, *, rank: int,
                    loss_shares: LossShares = "last", loss_scale: float = 1.0) -> Probe:
        device = next((p.device for p in heads.head_holder.parameters()), torch.device("cpu"))
        real, columns = sizes.mass_over  # the softmax the padding mass is over
        flags = Flags.from_policy(policy, device, rank, real=real, columns=columns)
        loss = StepLoss.from_policy(policy, flags, shares=loss_shares, scale=loss_scale)
        return cls(ProbeConfig.from_policy(policy, sizes), flags, loss)

    # -- at a boundary (the step clock) ------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.flags.device

    @property
    def reads_at_attach(self) -> bool:
        """Something is checked before step 1 (the weights' rows: padding, untrained)."""
        return self.pipelined or (self.states is not None and self.states.reads_at_attach)

    def end_step(self, step: int) -> None:
        """Step `step` ended: fold its loss, count what it did not see, move the sample."""
        for level, text in self.site.notes:
            log.log(level, "%s", text)
        self.site.notes.clear()
        self.logits.begin(step)
        self.loss.fold()
        if self.states is not None:  # the gradients, before the update
            self.states.end_step()
        self.flags.end_step()

    def watch_skips(self) -> None:
        """From now on the clock tells each update the loop skipped (a figure from then)."""
        self._skips_watched = True

    def skipped_update(self) -> None:
        """A step ended without an optimizer step although its backward ran (GradScaler)."""
        self.flags.put(grads.SKIPPED, 1.0)

    def read(self, *, lagged: bool, reduce: bool = True, weights: bool = True) -> Reading | None:
        """The flags, after each state's reductions (device ops; not `weights`: the read of
        detach, only those that run there)."""
        if self.states is not None:
            self.states.check(weights=weights)
        if self.logits.sharded is not None:  # every rank of a vocab-parallel head's group
            self.logits.sharded.combine(reduce=reduce)
        if self._skips_watched:
            self.flags.put(grads.WATCHED, 1.0)
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

    def stage_loss(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A pipeline schedule's `loss_fn(output, target)` (the last stage's): the target
        checked as labels and the loss recorded, per micro-batch, in a training step."""
        self._stage_loss = True
        return register(_stage_loss(self, fn))

    # -- hooks -------------------------------------------------------------------------------

    def install(self, model: nn.Module, heads: Heads, states: Watched | None = None,
                caller: nn.Module | None = None) -> list[Handle]:
        """Hooks for the enabled checks only (a check that is off costs nothing), and the
        stateful checks' `states`, which count ids in the id hooks and read before each read.
        `caller`: the module whose forward hooks see each call of `model` (a wrapper that
        calls the model's forward method past its hooks; `model` itself otherwise)."""
        caller = model if caller is None else caller
        self.states = states
        self.ids = IdHooks(self.cfg, self.flags, states)
        self._head = heads.head_holder  # its weight: a fused loss is measured with it
        c = self.cfg
        handles: list[Handle] = [hook(caller, self._model_pre, kind="forward_pre",
                                      compiled="eager", with_kwargs=True)]
        handles += self.ids.install(caller, model, heads.inputs)
        if c.nonfinite:
            handles.append(hook(heads.lm_head, self._head_pre, kind="forward_pre"))
        self._head_hooked = c.padding_mass or c.mask or c.nonfinite  # config flags, no tensor
        if self._head_hooked:
            # Ahead of tensor parallel's own output hook, which may gather the logits or
            # hand out a local view autograd forbids masking in place: the head's DTensor.
            handles.append(hook(heads.lm_head, self._head_post, kind="forward",
                                prepend=c.dtensor_head))
            if heads.final_norm is not None:
                handles.append(hook(heads.final_norm, self._hidden_post, kind="forward"))
            handles += self.site.install(model, heads.lm_head_name)
            if c.mask and c.real_columns < c.columns and c.real_columns == c.real:
                self.fused = FusedHead(model, heads, c.real_columns)
                handles.append(self.fused)
        handles.append(hook(caller, self._model_post, kind="forward", compiled="eager"))
        return handles

    def _model_pre(self, module: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        self.site.begin(module.training)
        fused = self.fused is not None and FusedHead.asked(kwargs)
        if fused and self.fused is not None:
            self.fused.on()
        if module.training:
            self._hidden, self._head_called = None, False
        return self.ids.labels(module.training, args, kwargs, fused=fused)

    def _head_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and args and isinstance(args[0], torch.Tensor):
            hidden = local(args[0])  # a DTensor's: tensor parallel hands the head one
            self.flags.follow(hidden.device)
            with torch.no_grad():
                self.flags.put(nonfinite.HIDDEN, nonfinite_positions(hidden))

    def _head_post(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        found = head_output(out, self.cfg.head_columns)
        if found is None:
            return None
        if module.training:
            self._head_called = True
            self.flags.follow(found.columns.device)
            self.flags.mark(coverage.SEEN["logits"])
        if found.masked is found.columns:
            masked = self.site.at_head(found.columns, module.training)
        else:  # a DTensor, or gathered: this rank measures its columns, masks the whole
            masked = self.site.at_part(found.columns, found.masked, found.real, module.training)
        return None if masked is None or masked is found.masked else found.put(masked)

    def loss_input(self, output: Any) -> Any:
        """A last stage's output as its loss_fn is given it, in a training forward: the
        logits of a head whose forward hooks did not run (DeepSpeed calls a `TiedLayerSpec`
        head through its `forward_fn`, past the module) measured and masked here, as the
        head's hook does; else as given. An output that is no logits (a loss_fn computing a
        fused loss from the head's weight): the final hidden states measured as a fused
        head's."""
        hidden, self._hidden = self._hidden, None  # kept past the forward for this call
        if self._head_called or not self._head_hooked or self._head is None:
            return output
        if head_output(output, self.cfg.head_columns) is None:  # a fused loss_fn: not logits
            if hidden is not None:
                self.logits.measure_fused(hidden, self._head, masked=False)
            return output
        masked = self._head_post(self._head, (), output)
        return output if masked is None else masked

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
            if self._stage_loss and not fused:  # the loss_fn next: its logits, if it has them
                self._hidden = hidden
            else:
                self.logits.measure_fused(hidden, self._head, masked=fused)


def _stage_loss(probe: Probe, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def guarded_loss_fn(output: Any, target: Any) -> Any:
        training = torch.is_grad_enabled() and not probe.inferring
        if training:
            output = probe.loss_input(output)
        loss = fn(output, probe.ids.target(target) if training else target)
        if training and isinstance(loss, torch.Tensor):
            probe.loss.record(loss, given=True)
        return loss

    return guarded_loss_fn


def mask_hook(real: int, columns: int) -> Callable[[nn.Module, Any, Any], Any]:
    """A forward hook for the head that masks the padding columns [real, columns) of its
    output (what `detach(keep_mask=True)` leaves behind)."""

    def mask(module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.shape[-1] == columns:
            return mask_padding(out, real)
        return None

    return mask
