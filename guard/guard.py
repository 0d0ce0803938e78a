"""The Guard and `attach()`: a thin front over the device probe (guard/device/),
the step clock and the verdict (guard/step/) and the sinks (guard/sinks/)."""

from __future__ import annotations

import logging
import os
import weakref
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.device.compile import drop_compiled
from guard.device.flags import Flags
from guard.device.loss import LossShares, StepLoss, check_loss_options
from guard.device.probe import Probe, ProbeConfig
from guard.device.rows import PaddingRows, suppress_padding_ids
from guard.device.sharded import register_sharded
from guard.errors import AttachError, GuardViolation
from guard.policy import Action, Policy
from guard.policy_file import coerce_policy
from guard.sinks import Sink, open_sinks
from guard.sinks.embedded import EmbeddedSink
from guard.step.clock import StepClock, Steps, check_boundaries
from guard.step.episodes import Episodes
from guard.step.reading import Reading
from guard.step.record import Record
from guard.step.verdict import Verdict, attach_verdict, judge
from guard.vocab.discover import Heads, discover, unwrap
from guard.vocab.sizes import Audit, audit_sizes, real_vocab, shard_sizes

__all__ = ["Guard", "attach"]

log = logging.getLogger("guard")

# Models with a guard attached: a second attach would double-count and double-mask. Weak both
# ways: the Guard holds its model, so a strong value would keep every model alive.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Guard]] = weakref.WeakKeyDictionary()


class Guard:
    """A guard attached to one model; see `attach`."""

    def __init__(self, model: nn.Module, heads: Heads, policy: Policy, audit: Audit, *,
                 rank: int, optimizer: torch.optim.Optimizer | None = None,
                 vocab_shard: tuple[int, int] | None = None, steps: Steps = "auto",
                 loss_shares: LossShares = "last", loss_scale: float = 1.0) -> None:
        self.model, self.heads, self.policy, self.audit = model, heads, policy, audit
        self.rank, self.optimizer = rank, optimizer
        device = next((p.device for p in heads.lm_head.parameters()), torch.device("cpu"))
        flags = Flags.from_policy(policy, device, rank)
        loss = StepLoss.from_policy(policy, flags, shares=loss_shares, scale=loss_scale)
        cfg = ProbeConfig.from_policy(policy, audit, vocab_shard)
        # The head's padding starts at its real columns (fewer on the shard of a vocab-parallel
        # head); the embedding's at the real vocab, or like the head's when sharded alike.
        alike = vocab_shard is not None and heads.embedding_rows == heads.head_rows
        firsts = (cfg.real_columns if alike else min(audit.real, heads.embedding_rows),
                  cfg.real_columns)
        rows = PaddingRows.from_policy(policy, flags, heads.embedding, heads.lm_head, firsts,
                                       (heads.embedding_name, heads.lm_head_name))
        self.probe = Probe(cfg, flags, loss, rows)
        self.clock = StepClock.from_policy(policy, self.probe, self._on_read,
                                           optimizer=optimizer, steps=steps)
        self.episodes = Episodes.from_policy(policy, model)
        self.record = Record.from_policy(policy, audit, rank)
        self.handles: list[RemovableHandle] = []  # every hook of this guard, in one list
        self._detached = False

    # -- public ------------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """A plain-dict snapshot as of the last host read (DESIGN.md)."""
        return self.record.stats

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def real(self) -> int:
        return self.audit.real

    @property
    def rows(self) -> int:
        return self.audit.rows

    @property
    def vocab(self) -> dict[str, int]:
        return self.record.vocab.model_dump()

    @property
    def sinks(self) -> list[Sink]:
        return list(self.record.sinks)

    @property
    def metrics_url(self) -> str | None:
        """The embedded endpoint's /metrics URL, or None when none runs."""
        return next((s.metrics_url for s in self.record.sinks if isinstance(s, EmbeddedSink)),
                    None)

    def add_sink(self, sink: Sink) -> None:
        """Send this guard's reports to `sink` too (e.g. guard.sinks.MemorySink)."""
        self.record.sinks.append(sink)

    def step(self, loss: torch.Tensor | None = None, *, fallback: bool = False) -> None:
        """Feed the step's loss; without `optimizer=`, also mark a step boundary.

        `fallback`: use `loss` only when the model's forward returned none this step (a
        callback that sees the loss the trainer backpropagates, and the model's own too).
        """
        if self._detached:
            raise AttachError("this guard is detached; attach a new one")
        if loss is not None:
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"g.step(loss): expected a tensor, got {type(loss).__name__}")
            self.probe.loss.record(loss, given=True, fallback=fallback)
        if self.clock.boundary != "optimizer":
            self.clock.mark()

    def repair_padding_rows(self) -> None:
        """What `padding_rows: repair` does, now: the padding rows set to the mean of the
        current real rows, for what runs after the guard (the callbacks call it at the end of
        training: the real rows have moved since attach). A collective under FSDP2, so every
        rank calls it; nothing without the check or without padding rows."""
        if self.probe.rows is not None:
            self.probe.rows.repair()

    def detach(self) -> None:
        """Remove every hook, report the last values, close the sinks. Idempotent."""
        if self._detached:
            return
        self._detached = True
        self._remove()
        try:
            for reading, step in self.clock.finish():
                error = self._judge(reading, step, rerun=False).error()
                if error is not None:
                    log.error("%s", error)
        finally:
            self.record.emit(final=True)
            self.record.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "detached" if self._detached else f"step {self.clock.step}"
        return (f"<Guard {self.run_id} rank {self.rank} on {self.heads.lm_head_name}: "
                f"real {self.real} rows {self.rows}, {state}>")

    # -- wiring ------------------------------------------------------------------------------

    def _install(self) -> None:
        """alignment and vocab first: `fail` stops the job before any hook goes on."""
        verdict = attach_verdict(self.audit, self.policy, self.rank)
        self.record.add(verdict)
        if (error := verdict.error()) is not None:
            raise error
        if self.probe.rows is not None:  # the padding rows as they are before step 1
            self.probe.check_weights()
            # All ranks attach: one collective, so every rank repairs or stops alike.
            reading = self.probe.flags.read(lagged=False)
            if reading is not None and (error := self._judge(reading, 0, rerun=False).error()):
                raise error
        if self.policy.action("padding_rows") is Action.REPAIR:
            suppress_padding_ids(self.model, self.real, self.rows)  # global ids, sharded or not
        self.handles += self.probe.install(self.model, self.heads)
        self.handles += self.clock.install(self.model, self.optimizer)
        if self.episodes is not None and self.optimizer is not None:
            self.handles += self.episodes.install(self.probe.flags)
        _ATTACHED[self.model] = weakref.ref(self)
        if drop_compiled():
            log.info("guard: dropped torch.compile's cached graphs, which may run this model "
                     "traced without the guard's hooks; each compiled function recompiles once")

    def _remove(self) -> None:
        """Every hook and the registry entry; idempotent (detach and a failed attach)."""
        hooked = bool(self.handles)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if hooked:
            drop_compiled()  # graphs traced with the hooks would go on running them
        if self.episodes is not None:
            self.episodes.close()
        if (held := _ATTACHED.get(self.model)) is not None and held() is self:
            del _ATTACHED[self.model]

    # -- at a read: judge, record, act -------------------------------------------------------

    def _judge(self, reading: Reading, step: int, *, rerun: bool) -> Verdict:
        self.record.update(reading.local, step)
        rows = self.probe.rows
        verdict = judge(reading, self.policy, step=step, real=self.probe.cfg.real,
                        rows=self.rows, head=self.heads.lm_head_name,
                        weights=rows.names if rows is not None else "the padding rows")
        if self.episodes is not None:
            verdict, note = self.episodes.annotate(verdict, rerun_now=rerun,
                                                   step=self.clock.step, rank=self.rank)
            if note is not None:
                self.record.note(note)
        self.record.add(verdict)
        repair = [v for v in verdict.violations
                  if v.check == "padding_rows" and v.action is Action.REPAIR]
        if repair and rows is not None:
            rows.repair()
        return verdict

    def _on_read(self, reading: Reading, step: int, *, in_step: bool, closure: bool) -> bool:
        """The clock's one call per read; True: drop this optimizer step.

        `in_step`: the values are this step's, read in the optimizer's step pre-hook.
        """
        verdict = self._judge(reading, step, rerun=in_step)
        # Every rank reads the same all-reduced values, so every rank skips the same step.
        skip = in_step and verdict.skip
        if skip and closure:
            log.error("guard: optimizer.step(closure) recomputes the gradients, so skip cannot "
                      "drop step %d; it is applied", step)
            skip = False
        if skip:
            self.record.skipped()
        self.record.emit()
        if (error := verdict.error()) is not None:
            raise error
        return skip


def _rank_of_process() -> tuple[int, int]:
    """(global rank, local rank) from torch.distributed, else torchrun's environment."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    return rank, int(os.environ.get("LOCAL_RANK", "0"))


def attach(
    model: nn.Module,
    *,
    policy: Policy | dict[str, Any] | str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    tokenizer: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    embedding: nn.Module | None = None,
    lm_head: nn.Module | None = None,
    vocab_shard: tuple[int, int] | None = None,
    steps: Steps = "auto",
    loss_shares: LossShares = "last",
    loss_scale: float = 1.0,
) -> Guard:
    """Hook the embedding and lm_head of `model` and check every step (DESIGN.md).

    `vocab_shard=(start, end)`: the lm_head is this rank's shard of a vocab-parallel head, its
    columns are the global token ids [start, end) (docs/integrations.md, tensor parallel).
    `steps="manual"`: only `g.step()` marks step boundaries. `loss_shares="sum"`: the step's
    loss is the sum of its micro-batches' losses, times `loss_scale` (HF Trainer).
    """
    pol = coerce_policy(policy)
    model = unwrap(model)
    check_boundaries(pol, optimizer, steps)
    check_loss_options(loss_shares, loss_scale)
    if (ref := _ATTACHED.get(model)) is not None and (held := ref()) is not None:
        raise AttachError(
            f"a guard is already attached to this model ({held!r}); call detach() on it first")
    register_sharded(model)  # FSDP2: the parameters the optimizer updates, not gathered copies
    heads = discover(model, embedding=embedding, lm_head=lm_head)
    rows, embedding_rows, shard = heads.head_rows, heads.embedding_rows, None
    if vocab_shard is not None:
        try:
            rows = shard_sizes(vocab_shard, heads.head_rows, pol.vocab.tensor_parallel)
        except ValueError as e:
            raise AttachError(str(e)) from None
        shard = (vocab_shard[0], vocab_shard[1])
        if embedding_rows == heads.head_rows:  # a vocab-parallel embedding, sharded alike
            embedding_rows = rows
    real = real_vocab({"vocab_size=": vocab_size, "policy vocab.real_size": pol.vocab.real_size},
                      tokenizer, rows)
    if shard is not None and real <= shard[0]:
        raise AttachError(
            f"vocab_shard={shard} holds padding ids only (real vocab {real}): the guard needs "
            "at least one real id per shard of a vocab-parallel head; use fewer padding rows "
            "or a smaller tensor-parallel degree for the vocab")
    aud = audit_sizes(real=real, rows=rows, embedding_rows=embedding_rows, tied=heads.tied,
                      pad_multiple=pol.vocab.pad_multiple,
                      tensor_parallel=pol.vocab.tensor_parallel)
    rank, local_rank = _rank_of_process()
    g = Guard(model, heads, pol, aud, rank=rank, optimizer=optimizer, vocab_shard=shard,
              steps=steps, loss_shares=loss_shares, loss_scale=float(loss_scale))
    try:
        for sink in open_sinks(pol.export, local_rank):
            g.add_sink(sink)
        g._install()
    except BaseException as e:
        # Nothing of a failed attach stays behind: hooks, registry entry, server thread.
        g._remove()
        if isinstance(e, GuardViolation):
            g.record.emit(final=True)  # the halt reaches the metrics before the job stops
        g.record.close()
        raise
    log.info("guard attached to %s / %s: %s", heads.embedding_name, heads.lm_head_name,
             str(aud).splitlines()[0])
    return g
