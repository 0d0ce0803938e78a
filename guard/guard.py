"""The Guard and `attach()`: a thin front over the device probe (guard/device/), the step
clock and the reader (guard/step/) and the sinks (guard/sinks/)."""

from __future__ import annotations

import logging
import os
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import nn

from guard.arguments import check_arguments
from guard.device.compile import drop_compiled
from guard.device.hooks import Handle, hook
from guard.device.loss import LossShares
from guard.device.probe import Probe, mask_hook
from guard.device.rows import suppress_padding_ids
from guard.device.sharded import register_sharded
from guard.errors import AttachError, GuardViolation
from guard.policy import Action, Policy
from guard.sinks import Sink, open_sinks
from guard.sinks.embedded import EmbeddedSink
from guard.step.clock import StepClock, Steps
from guard.step.episodes import Episodes
from guard.step.reader import Names, Reader
from guard.step.record import Record
from guard.step.verdict import Note, attach_verdict
from guard.vocab.discover import Heads, discover
from guard.vocab.resolve import Sizes, resolve
from guard.vocab.sizes import Audit

__all__ = ["Guard", "attach"]

log = logging.getLogger("guard")

# Models with a guard attached: a second attach would double-count and double-mask. Weak both
# ways: the Guard holds its model, so a strong value would keep every model alive.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Guard]] = weakref.WeakKeyDictionary()


class Guard:
    """A guard attached to one model; see `attach`."""

    def __init__(self, model: nn.Module, heads: Heads, policy: Policy, sizes: Sizes, *,
                 rank: int, optimizer: torch.optim.Optimizer | None = None,
                 steps: Steps = "auto", loss_shares: LossShares = "last",
                 loss_scale: float = 1.0, tokenizer: Any = None,
                 caller: nn.Module | None = None) -> None:
        self._model, self._heads, self._policy, self._sizes = model, heads, policy, sizes
        # The module whose forward hooks see each call: the model, unless a wrapper calls its
        # forward method past them (guard/wrappers.py).
        self._caller = caller if caller is not None else model
        self._optimizer = optimizer
        self._probe = Probe.from_policy(policy, sizes, heads, rank=rank, tokenizer=tokenizer,
                                        model=model, loss_shares=loss_shares,
                                        loss_scale=loss_scale)
        self._record = Record.from_policy(policy, sizes.audit, rank)
        self._episodes = Episodes.from_policy(policy, self._caller)  # re-runs what was called
        rows = self._probe.rows
        names = Names(heads.lm_head_name, rows.names if rows is not None else "the padding rows")
        reader = Reader(policy, sizes, names, self._record, self._episodes, self._probe.repairs(),
                        self._probe.details())
        self._clock = StepClock.from_policy(policy, self._probe, reader, optimizer=optimizer,
                                            steps=steps)
        self._handles: list[Handle] = []  # every hook of this guard, in one list
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
    def stats(self) -> dict[str, Any]:
        """A plain-dict snapshot as of the last host read (DESIGN.md)."""
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

    # -- what it does ------------------------------------------------------------------------

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

    def repair_padding_rows(self) -> None:
        """Under `padding_rows: repair`, the padding rows set to the mean of the real rows now,
        for what runs after the guard (the callbacks call it at the end of training). A
        collective under FSDP2, so every rank calls it; nothing under another action."""
        repair = self._probe.repairs().get("padding_rows")
        if repair is not None and self._policy.action("padding_rows") is Action.REPAIR:
            repair()

    def detach(self, *, keep_mask: bool = False) -> None:
        """Remove every hook, report the last values, close the sinks. Idempotent.

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
            self._clock.finish()
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
        self.detach()

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
            self._install()
        except BaseException as e:
            self._remove()
            if isinstance(e, GuardViolation):
                self._record.emit(final=True)
            self._record.close()
            raise

    def _install(self) -> None:
        """alignment and vocab first: `fail` stops the job before any hook goes on."""
        verdict = attach_verdict(self._sizes.audit, self._policy, self.rank,
                                 found=self._sizes.found)
        self._record.add(verdict)
        if (error := verdict.error()) is not None:
            raise error
        # Everything that can refuse first; what changes the model last (a refused attach
        # leaves weights, generation_config and hooks as they were).
        self._handles += self._probe.install(self._model, self._heads, self._caller)
        self._handles += self._clock.install(self._caller, self._optimizer)
        if self._episodes is not None and self._optimizer is not None:
            self._handles += self._episodes.install(self._probe)
        if (u := self._probe.untrained) and (said := u.attach_message(self.rank)):  # logged
            self._record.note(Note("untrained_rows", u.policy.action("untrained_rows"), 0, said))
        self._clock.start()  # the weights' rows as they are before step 1 (a repair, or a fail)
        if self._policy.action("padding_rows") is Action.REPAIR:
            suppress_padding_ids(self._model, self.real, self.rows)  # global ids, sharded or not
        _ATTACHED[self._model] = weakref.ref(self)
        if drop_compiled():
            log.info("guard: dropped torch.compile's cached graphs, which may run this model "
                     "traced without the guard's hooks; each compiled function recompiles once")

    def _remove(self) -> None:
        """Every hook and the registry entry; idempotent (detach and a failed attach)."""
        hooked = bool(self._handles)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if hooked:
            drop_compiled()  # graphs traced with the hooks would go on running them
        if self._episodes is not None:
            self._episodes.close()
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
    vocab_shard: tuple[int, int] | None = None,
    steps: Steps = "auto",
    loss_shares: LossShares | None = None,
    loss_scale: float = 1.0,
) -> Guard:
    """Hook the embedding and lm_head of `model` and check every step (DESIGN.md).

    `optimizer`: a torch optimizer, or a framework's wrapper of one (accelerate, Lightning,
    DeepSpeed). `vocab_shard=(start, end)`: the lm_head is this rank's shard of a
    vocab-parallel head, its columns are the global token ids [start, end)
    (docs/integrations.md, tensor parallel). `steps="manual"`: only `g.step()` marks step
    boundaries. `loss_shares`: the step's loss is the last micro-batch's, the `"sum"` of their
    losses (HF Trainer), or their `"mean"` (the default under accelerate's gradient
    accumulation), times `loss_scale`.
    """
    a = check_arguments(model, policy, optimizer, steps, loss_shares, loss_scale)
    if (ref := _ATTACHED.get(a.model)) is not None and (held := ref()) is not None:
        raise AttachError(
            f"a guard is already attached to this model ({held!r}); call detach() on it first")
    register_sharded(a.model)  # FSDP2: the parameters the optimizer updates, not gathered copies
    heads = discover(a.model, embedding=embedding, lm_head=lm_head)
    sizes = resolve(heads, a.policy.vocab, vocab_size=vocab_size, tokenizer=tokenizer,
                    vocab_shard=vocab_shard, model=a.model)
    g = Guard(a.model, heads, a.policy, sizes, rank=a.rank, optimizer=a.optimizer, steps=steps,
              loss_shares=a.loss_shares, loss_scale=float(loss_scale), tokenizer=tokenizer,
              caller=a.caller)
    g._open(a.local_rank)
    inside = f" (inside {' > '.join(a.wrappers)})" if a.wrappers else ""
    log.info("guard attached to %s / %s%s: %s", heads.embedding_name, heads.lm_head_name, inside,
             str(sizes.audit).splitlines()[0])
    return g
