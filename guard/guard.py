"""The Guard and `attach()`: a thin front over its parts (guard/parts.py: the device probe, the
stateful checks' states, the step clock and the reader) and the sinks (guard/sinks/)."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from guard.arguments import check_arguments
from guard.checks.padding_mass import mask_note
from guard.device.hooks import Handle, hook
from guard.device.loss import LossShares
from guard.device.pipeline import quiet_inference
from guard.device.probe import mask_hook
from guard.errors import AttachError, GuardViolation
from guard.parts import Parts
from guard.policy import Policy
from guard.sinks import Sink, open_sinks
from guard.sinks.embedded import EmbeddedSink
from guard.stateful import Finding
from guard.step.clock import Steps
from guard.step.resume import Resumable
from guard.vocab.resolve import resolve
from guard.vocab.sizes import Audit
from guard.vocab.stage import Stage, stage_heads, stage_of
from guard.weights.sharded import register_sharded

__all__ = ["Guard", "attach"]

log = logging.getLogger("guard")

# Models with a guard attached: a second attach would double-count and double-mask. Weak both
# ways: the Guard holds its model, so a strong value would keep every model alive.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Guard]] = weakref.WeakKeyDictionary()


class Guard(Resumable):
    """A guard attached to one model; see `attach`. `state_dict()` / `load_state_dict()`:
    guard/step/resume.py."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts
        self._model, self._heads, self._policy, self._sizes = (parts.model, parts.heads,
                                                               parts.policy, parts.sizes)
        self._record, self._clock, self._probe = parts.record, parts.clock, parts.probe
        self._kept: Handle | None = None  # the mask `detach(keep_mask=True)` leaves
        self._detached = False

    # -- what it watches ---------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The module the guard hooks (inside any DDP / compile wrapper it was given)."""
        return self._model

    @property
    def lm_head(self) -> nn.Module:
        """The head module whose output the guard measures (and masks)."""
        return self._heads.lm_head

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def audit(self) -> Audit:
        """The three vocab sizes of the guarded model and their problems."""
        return self._sizes.audit

    @property
    def real(self) -> int:
        return self._sizes.real

    @property
    def rows(self) -> int:
        return self._sizes.rows

    @property
    def rank(self) -> int:
        return self._record.rank

    # -- what it found -----------------------------------------------------------------------

    @property
    def findings(self) -> tuple[Finding, ...]:
        """The rows the stateful checks found at attach (untrained_rows: the rows of the real
        vocab never trained, per weight, with their ids and why), in the checks' order."""
        return self._parts.states.findings()

    @property
    def stats(self) -> dict[str, Any]:
        """A plain-dict snapshot as of the last host read (README.md, "Use")."""
        return self._record.stats

    def figures(self) -> dict[str, float]:
        """The last read's host values as `{"guard/<name>": float}`, for a trainer's loggers
        ({} before the first training read; no device read)."""
        return self._record.scalars()

    @property
    def run_id(self) -> str:
        return self._record.run_id

    @property
    def vocab(self) -> dict[str, int]:
        return self._record.vocab.model_dump()

    @property
    def sinks(self) -> list[Sink]:
        return list(self._record.sinks)

    @property
    def metrics_url(self) -> str | None:
        """The embedded endpoint's /metrics URL, or None when none runs."""
        return next((s.metrics_url for s in self._record.sinks if isinstance(s, EmbeddedSink)),
                    None)

    @property
    def stage(self) -> Stage | None:
        """The pipeline stage this guard watches (None: a whole model)."""
        return self._parts.stage

    # -- what it does ------------------------------------------------------------------------

    def loss_fn(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """`fn(output, target)`, a pipeline schedule's `loss_fn` on the last stage, with the
        target checked as labels (token_range, untrained_rows) and the loss recorded, once per
        micro-batch (the step's loss is their mean)."""
        return self._probe.stage_loss(fn)

    def add_sink(self, sink: Sink) -> None:
        """Send this guard's reports to `sink` too (e.g. guard.sinks.MemorySink)."""
        self._record.sinks.append(sink)

    def step(self, loss: torch.Tensor | None = None, *, fallback: bool = False) -> None:
        """Feed the step's loss; without `optimizer=`, also mark a step boundary. `fallback`:
        use `loss` only when the model's forward returned none this step (a callback that
        sees the loss the trainer backpropagates, and the model's own too)."""
        if self._detached:
            raise AttachError("this guard is detached; attach a new one")
        if loss is not None:
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"g.step(loss): expected a tensor, got {type(loss).__name__}")
            self._probe.record_loss(loss, fallback=fallback)
        if self._clock.boundary != "optimizer":
            self._clock.mark()

    def repair(self) -> None:
        """What each check under `repair` repairs, now, for what runs after the guard (the
        callbacks call it at the end of training): the padding rows set to the mean of the real
        rows, the untrained rows of the ids used to the mean of the trained ones. Collectives
        when distributed, so every rank calls it; nothing under another action."""
        self._parts.states.repair_under(self._policy)

    def detach(self, *, keep_mask: bool = False, raise_late: bool = False) -> None:
        """Remove every hook, report the last values, close the sinks. Idempotent.

        `raise_late`: where the flags are read one read late (`cadence.fail_read`), a `fail`
        at the last step, whose update the optimizer dropped, raises its GuardViolation here
        (else it is logged). The `with` block's exit without an exception and the callbacks'
        end of training pass it.

        `keep_mask`: under `padding_mass: mask`, leave the padding columns of the head's output
        masked in this process, so evaluation and generation after training score as a head
        over the real vocab does (the callbacks do this at the end of training); `release()`
        removes it.
        """
        if self._detached:
            return
        self._detached = True
        self._remove()
        try:
            self._clock.finish(raise_late=raise_late)
        finally:
            self._record.emit(final=True)
            self._record.close()
            self._record.summarise()
        s = self._sizes
        if keep_mask and self._policy.masks and s.shard is None and s.real < s.rows:
            self._kept = hook(self._heads.lm_head, mask_hook(s.real_columns, s.columns),
                              kind="forward")

    def release(self) -> None:
        """Remove the mask `detach(keep_mask=True)` left on the head; idempotent."""
        if self._kept is not None:
            self._kept.remove()
            self._kept = None

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.detach(raise_late=et is None)

    def __repr__(self) -> str:
        state = "detached" if self._detached else f"step {self._clock.step}"
        return (f"<Guard {self.run_id} rank {self.rank} on {self._heads.lm_head_name}: "
                f"real {self.real} rows {self.rows}, {state}>")

    # -- wiring ------------------------------------------------------------------------------

    def _open(self, local_rank: int) -> None:
        """Sinks and hooks; on any error nothing stays behind (hooks, registry entry, server
        thread), and a halt reaches the metrics before the job stops."""
        try:
            for sink in open_sinks(self._policy.export, local_rank):
                self.add_sink(sink)
            self._parts.install()
            _ATTACHED[self._model] = weakref.ref(self)
        except BaseException as e:
            self._remove()
            if isinstance(e, GuardViolation):
                self._record.emit(final=True)
            self._record.close()
            raise

    def _remove(self) -> None:
        """Every hook and the registry entry; idempotent (detach and a failed attach)."""
        self._parts.remove()
        if (held := _ATTACHED.get(self._model)) is not None and held() is self:
            del _ATTACHED[self._model]


def attach(
    model: nn.Module,
    *,
    policy: Policy | dict[str, Any] | str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    tokenizer: Any = None,
    optimizer: Any = None,
    embedding: nn.Module | None = None,
    lm_head: nn.Module | None = None,
    vocab_shard: tuple[int, int] | tuple[int, int, Any] | None = None,
    steps: Steps = "auto",
    loss_shares: LossShares | None = None,
    loss_scale: float = 1.0,
    scaler: Any = None,
    tied_across_stages: bool | None = None,
) -> Guard:
    """Hook the embedding and lm_head of `model` and check every step (README.md, "Use").

    `optimizer`: a torch optimizer, or a framework's wrapper of one (accelerate, Lightning,
    DeepSpeed). `vocab_shard=(start, end)`: the lm_head, sharded by hand, is this rank's
    shard of a vocab-parallel head, its columns the global token ids [start, end), with the
    process group of the other shards' ranks as a third element where the world is not the
    tensor-parallel group; a DTensor head or Megatron's layers say it themselves
    (docs/integrations.md, tensor parallel). `steps="manual"`: only `g.step()` marks step
    boundaries. `loss_shares`: the step's loss is the last micro-batch's, the `"sum"` of their
    losses (HF Trainer), or their `"mean"` (the default under accelerate's gradient
    accumulation), times `loss_scale`. `scaler`: the `torch.amp.GradScaler` of a loop that
    marks its steps with `g.step()` (Lightning's callback passes its own): an inf/NaN gradient
    at the boundary is the scaler's to skip, a figure, not a violation (with `optimizer=` the
    guard needs none: the scaler calls the optimizer's step only when the gradients are finite).

    A pipeline stage (torch's `PipelineStage`, DeepSpeed's `PipelineModule`, or a module that
    holds only one end of the model, or neither) is guarded for what it holds, every stage
    deciding alike at each read (docs/integrations.md, pipeline parallel); the last stage's
    loss and labels come through `g.loss_fn(loss_fn)`. `tied_across_stages=True` (on every
    rank): the first stage's embedding and the last stage's head are tied copies, checked to
    agree at attach and every `checks.vocab.tie_every` reads.
    """
    inner, stage = stage_of(model)
    a = check_arguments(inner, policy, optimizer, steps, loss_shares, loss_scale, scaler)
    if (ref := _ATTACHED.get(a.model)) is not None and (held := ref()) is not None:
        raise AttachError(
            f"a guard is already attached to this model ({held!r}); call detach() on it first")
    register_sharded(a.model)  # FSDP2: the parameters the optimizer updates, not gathered copies
    heads, stage = stage_heads(a.model, embedding=embedding, lm_head=lm_head, stage=stage,
                               vocab_size=vocab_size, tied=tied_across_stages)
    sizes = resolve(heads, a.policy.vocab, vocab_size=vocab_size, tokenizer=tokenizer,
                    vocab_shard=vocab_shard, model=a.model)
    # A stage's loss comes once per micro-batch, each its micro-batch's mean.
    shares = "mean" if stage is not None and stage.head and loss_shares is None \
        else a.loss_shares
    g = Guard(Parts.build(a.model, heads, a.policy, sizes, rank=a.rank, optimizer=a.optimizer,
                          steps=steps, loss_shares=shares, loss_scale=float(loss_scale),
                          tokenizer=tokenizer, scaled=a.scaled,
                          caller=a.caller, outer=a.outer, stage=stage))
    g._open(a.local_rank)
    if model is not inner:  # torch's PipelineStage: its shape inference is no training step
        g._parts.handles += quiet_inference(model, a.model, g._parts.probe)
    inside = f" (inside {' > '.join(a.wrappers)})" if a.wrappers else ""
    tp = sizes.tp
    shard = "" if tp is None else (f"; this rank's head columns are the ids [{tp.start}, "
                                   f"{tp.end}) of {tp.rows} ({tp.source}, {tp.degree} ranks)")
    note = mask_note(a.policy, sizes.real, sizes.rows) if tp is None and stage is None else ""
    log.info("attached to %s / %s%s: %s%s%s", heads.embedding_name, heads.lm_head_name,
             inside, str(sizes.audit).splitlines()[0], shard, note)
    return g
