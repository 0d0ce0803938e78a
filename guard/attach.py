"""`attach()` and the Guard: hooks, step boundaries and the action at each read."""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from guard.decide import attach_violations, evaluate, thresholds
from guard.discovery import Heads, discover, unwrap_compiled
from guard.episodes import Episodes
from guard.errors import AttachError, GuardViolation
from guard.flags import Flags, HostFlags
from guard.hooks import Probe, ProbeConfig
from guard.ledger import Ledger
from guard.policy import CHECKS, STEP_CHECKS, Policy, coerce_policy, default_run_id
from guard.resolve import check_skip, rank_of_process, real_vocab
from guard.sinks import Sink
from guard.sinks.push import PushSink
from guard.sinks.serve import start_embedded
from guard.spike import SpikeTracker
from guard.steploss import StepLoss
from guard.vocab import Audit, audit_sizes, shard_sizes

__all__ = ["Guard", "attach", "audit"]

log = logging.getLogger("guard")

# Models with a guard attached: a second attach would double-count and double-mask. Weak both
# ways: the Guard holds its model, so a strong value would keep every model alive.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Guard]] = weakref.WeakKeyDictionary()


def _attached(model: nn.Module) -> Guard | None:
    ref = _ATTACHED.get(model)
    return None if ref is None else ref()


class Guard:
    """A guard attached to one model; see `attach`."""

    def __init__(
        self,
        model: nn.Module,
        heads: Heads,
        policy: Policy,
        audit: Audit,
        optimizer: torch.optim.Optimizer | None,
        vocab_shard: tuple[int, int] | None = None,
    ) -> None:
        self.model, self.heads, self.policy, self.audit = model, heads, policy, audit
        self.vocab_shard = vocab_shard
        self.optimizer = optimizer
        self.rank, self.local_rank = rank_of_process()
        self.run_id = policy.run_id or default_run_id()
        self.real = audit.real
        self.rows = audit.rows
        c = policy.checks
        self.cfg = ProbeConfig(
            real=min(audit.real, audit.rows),
            rows=audit.rows,
            padding_mass=c.padding_mass.action != "off",
            mask=c.padding_mass.action == "mask",
            sample_tokens=c.padding_mass.sample_tokens,
            exact=c.padding_mass.exact,
            nonfinite=c.nonfinite.action != "off",
            token_range=c.token_range.action != "off",
            ignore_index=c.token_range.ignore_index,
        )
        if vocab_shard is not None:
            # The head's columns are global ids [start, end): padding from id `real` on.
            start, end = vocab_shard
            self.cfg = replace(self.cfg, rows=end - start,
                               head_real=min(max(audit.real - start, 0), end - start))
        device = next((p.device for p in heads.lm_head.parameters()), torch.device("cpu"))
        self.flags = Flags(device, thresholds(policy), self.rank)
        self.probe = Probe(self.cfg, self.flags)
        ls = policy.checks.loss_spike
        self.spike = None if ls.action == "off" else SpikeTracker(
            window=ls.window, factor=ls.factor, min_delta=ls.min_delta, warmup=ls.warmup,
            device=self.flags.device, dtype=self.flags.t.dtype)
        # Which module went non-finite, once per run of nonfinite reads (guard/episodes.py).
        localise = c.nonfinite.action != "off" and c.nonfinite.localise
        self.episodes = Episodes(model) if localise else None
        # Only warn/mask/off: the host may read one step late and never stall the device.
        self.lagged = all(policy.action(ch) in ("warn", "mask", "off") for ch in STEP_CHECKS)
        self.ledger = Ledger(
            {"real": audit.real, "rows": audit.rows, "aligned": audit.aligned},
            # Reported as 0 until they fire, so counter series exist from the first scrape.
            {ch: policy.action(ch) for ch in CHECKS if policy.action(ch) != "off"},
        )
        self._handles: list[RemovableHandle] = []
        self._step = 0
        self._read_step = 0  # step whose values a lagged read returns next
        self._explicit = False
        self._forward_pending = False  # forward mode: a forward ended, its boundary not yet run
        self.step_loss = StepLoss(self.flags, count_nonfinite=self.cfg.nonfinite,
                                  spike=self.spike)
        self._detached = False
        self.metrics_url: str | None = None  # the embedded endpoint, when it runs

    # -- public ------------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """A plain-dict snapshot as of the last host read (DESIGN.md)."""
        return self.ledger.stats

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self.ledger.vocab)

    @property
    def sinks(self) -> list[Sink]:
        return self.ledger.sinks

    def _export(self) -> None:
        """Sinks from the policy's export section; a sink that cannot start is a warning."""
        ex = self.policy.export
        address = ex.serve_address(self.local_rank)
        if address is not None:
            sink = start_embedded(*address)
            if sink is not None:
                self.metrics_url = f"{sink.url}/metrics"
                self.add_sink(sink)
        if ex.push is not None:
            self.add_sink(PushSink(ex.push))

    def add_sink(self, sink: Sink) -> None:
        """Send this guard's reports to `sink` too (e.g. guard.sinks.MemorySink)."""
        bind = getattr(sink, "bind", None)
        if callable(bind):
            bind(self.run_id, self.rank)
        self.ledger.sinks.append(sink)

    def step(self, loss: torch.Tensor | None = None) -> None:
        """Feed the loss; without `optimizer=`, also mark an optimizer-step boundary."""
        if self._detached:
            raise AttachError("this guard is detached; attach a new one")
        if loss is not None:
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"g.step(loss): expected a tensor, got {type(loss).__name__}")
            self.step_loss.record(loss, given=True)
        if self.optimizer is None:
            self.manual_steps()
            self._boundary()

    def manual_steps(self) -> None:
        """Only `g.step()` marks step boundaries from now on, before its first call too: for
        loops that call it at every optimizer step (the Lightning callback) and accumulate
        gradients over several training forwards."""
        self._explicit = True
        self._forward_pending = False
        self.probe.drop_forward_start()

    def detach(self) -> None:
        """Remove every hook, report the last values, close the sinks. Idempotent."""
        if self._detached:
            return
        self._detached = True
        for h in self.probe.handles + self._handles:
            h.remove()
        self.probe.handles.clear()
        self._handles.clear()
        if self.episodes is not None:
            self.episodes.close()
        _ATTACHED.pop(self.model, None)
        try:
            if self._forward_pending:
                self._forward_pending = False
                self._step += 1
            self.step_loss.fold()
            pending = self.flags.flush()
            if pending is not None:
                self._apply(pending, self._read_step, raise_fail=False, emit=False)
            # Local only: one rank may detach alone (an exception unwinding a `with`), and a
            # collective the other ranks do not join would hang them.
            current = self.flags.read(lagged=False, reduce=False)
            if current is not None and self._step > self._read_step:
                self._apply(current, self._step, raise_fail=False, emit=False)
        finally:
            self.ledger.emit(final=True)
            self.ledger.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "detached" if self._detached else f"step {self._step}"
        return (f"<Guard {self.run_id} rank {self.rank} on {self.heads.lm_head_name}: "
                f"real {self.real} rows {self.rows}, {state}>")

    # -- wiring ------------------------------------------------------------------------------

    def _install(self) -> None:
        self.probe.on_loss = self.step_loss.record
        if self.optimizer is None and not self._explicit:
            self.probe.on_forward_start = self._forward_start
        self.probe.on_forward_end = self._forward_end
        if self.episodes is not None and self.optimizer is not None:
            self.probe.on_inputs = self._keep_inputs
        self.probe.install(self.model, self.heads.embedding, self.heads.lm_head)
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_pre))
        _ATTACHED[self.model] = weakref.ref(self)

    # Without optimizer= and g.step(), a training forward is a step. Its boundary runs when the
    # next training forward starts (or at detach), not when it ends: a loop that calls
    # g.step(loss) after its first forward is then never counted twice.
    def _forward_end(self) -> None:
        if self.optimizer is None and not self._explicit:
            self._forward_pending = True

    def _forward_start(self) -> None:
        if self._forward_pending:
            self._forward_pending = False
            self._boundary()

    def _optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Before the update, so `fail` leaves the weights untouched and `skip` can drop it.
        # The hook sees step's own args: (optimizer, closure?) and kwargs.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if self._boundary(in_step=True, closure=closure is not None):
            # skip: every torch optimizer passes over a parameter whose .grad is None, so
            # neither the weight (decoupled weight decay included) nor its state (Adam moments
            # and step, SGD momentum) moves, on the for-loop, foreach and fused paths alike.
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _keep_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.episodes is not None:
            self.episodes.keep(args, kwargs, self.flags.device.type)

    def _boundary(self, *, raise_fail: bool = True, in_step: bool = False,
                  closure: bool = False) -> bool:
        """Fold the loss, read the flags when due, act; True when the step is to be skipped.

        `in_step`: called from the optimizer's step pre-hook, before the weights change.
        """
        self._step += 1
        self.probe.step = self._step
        self.step_loss.fold()
        if self._step % self.policy.cadence.read_every:
            return False
        # On the CPU a copy to the host is the read itself: nothing to gain from lagging.
        lagged = self.lagged and self.flags.device.type == "cuda"
        values = self.flags.read(lagged=lagged)
        step = self._read_step if lagged else self._step
        self._read_step = self._step
        if values is None:
            return False
        return self._apply(values, step, raise_fail=raise_fail, in_step=in_step and not lagged,
                           closure=closure)

    # -- host side, at a read ----------------------------------------------------------------

    def _apply(self, values: HostFlags, step: int, *, raise_fail: bool, emit: bool = True,
               in_step: bool = False, closure: bool = False) -> bool:
        """Stats, violations, report and action for one read; True: skip this optimizer step.

        `in_step`: the values are this step's, read in the optimizer's step pre-hook.
        """
        local, glob, who = values
        self.ledger.update(local, step)
        found = evaluate(glob, who, step=step, rank=self.rank, policy=self.policy,
                         real=self.cfg.real, rows=self.rows)
        if self.episodes is not None:
            found, note = self.episodes.annotate(found, rerun_now=in_step, step=self._step,
                                                 rank=self.rank,
                                                 action=self.policy.action("nonfinite"))
            if note is not None:
                self.ledger.note(note)
        for v in found:
            self.ledger.record(v)
        fail = next((v for v in found if v.action == "fail"), None)
        if fail is not None:
            self.ledger.halted = fail.check
        # Every rank reads the same all-reduced values, so every rank skips the same step.
        skip = in_step and fail is None and any(v.action == "skip" for v in found)
        if skip and closure:
            log.error("guard: optimizer.step(closure) recomputes the gradients, so skip cannot "
                      "drop step %d; it is applied", step)
            skip = False
        if skip:
            self.ledger.skipped()
        if emit:
            self.ledger.emit()
        if fail is not None:
            others = [v.check for v in found if v is not fail]
            also = f" (also at this step: {', '.join(others)})" if others else ""
            message = fail.message + also
            if raise_fail:
                raise GuardViolation(message, check=fail.check, step=fail.step,
                                     rank=fail.rank, value=fail.value,
                                     threshold=fail.threshold, action="fail",
                                     module=fail.module)
            log.error("%s", message)
        return skip

    def _attach_checks(self) -> None:
        """alignment and vocab, before any hook: `fail` stops the job before step 1."""
        found = attach_violations(self.audit, self.policy, self.rank)
        for v in found:
            self.ledger.record(v)
        fail = next((v for v in found if v.action == "fail"), None)
        if fail is not None:
            self.ledger.halted = fail.check
            raise GuardViolation(fail.message, check=fail.check, step=0, rank=self.rank,
                                 value=fail.value, threshold=fail.threshold, action="fail")


def audit(
    model: nn.Module,
    *,
    vocab_size: int | None = None,
    tokenizer: Any = None,
    tensor_parallel: int = 1,
    pad_multiple: int = 64,
    embedding: nn.Module | None = None,
    lm_head: nn.Module | None = None,
) -> Audit:
    """The three vocab sizes of `model`, tied or not, and alignment for TP 1/2/4/8."""
    model = unwrap_compiled(model)  # type: ignore[assignment]
    heads = discover(model, embedding=embedding, lm_head=lm_head)
    real = real_vocab(vocab_size, tokenizer, Policy(), heads.head_rows)
    return audit_sizes(real=real, rows=heads.head_rows, embedding_rows=heads.embedding_rows,
                       tied=heads.tied, pad_multiple=pad_multiple, tensor_parallel=tensor_parallel)


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
) -> Guard:
    """Hook the embedding and lm_head of `model` and check every step (DESIGN.md).

    `vocab_shard=(start, end)`: the lm_head is this rank's shard of a vocab-parallel head, its
    columns are the global token ids [start, end) (docs/integrations.md, tensor parallel).
    """
    pol = coerce_policy(policy)
    model = unwrap_compiled(model)  # type: ignore[assignment]
    check_skip(pol, optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise AttachError(
            f"optimizer= must be a torch.optim.Optimizer (its step pre-hook is the step "
            f"boundary), got {type(optimizer).__name__}; pass the torch optimizer a wrapper "
            "holds (accelerate: wrapper.optimizer), or use guard.integrations"
        )
    if isinstance(model, nn.Module) and (held := _attached(model)) is not None:
        raise AttachError(
            f"a guard is already attached to this model ({held!r}); call detach() on it first"
        )
    heads = discover(model, embedding=embedding, lm_head=lm_head)
    rows, embedding_rows = heads.head_rows, heads.embedding_rows
    if vocab_shard is not None:
        tp = pol.vocab.tensor_parallel
        try:
            rows = shard_sizes(vocab_shard, heads.head_rows, tp)
        except ValueError as e:
            raise AttachError(str(e)) from None
        if embedding_rows == heads.head_rows:  # a vocab-parallel embedding, sharded alike
            embedding_rows = rows
    real = real_vocab(vocab_size, tokenizer, pol, rows)
    if vocab_shard is not None and real <= vocab_shard[0]:
        raise AttachError(
            f"vocab_shard={tuple(vocab_shard)} holds padding ids only (real vocab {real}): the "
            "guard needs at least one real id per shard of a vocab-parallel head; use fewer "
            "padding rows or a smaller tensor-parallel degree for the vocab")
    aud = audit_sizes(real=real, rows=rows, embedding_rows=embedding_rows,
                      tied=heads.tied, pad_multiple=pol.vocab.pad_multiple,
                      tensor_parallel=pol.vocab.tensor_parallel)
    g = Guard(model, heads, pol, aud, optimizer,
              None if vocab_shard is None else (vocab_shard[0], vocab_shard[1]))
    try:
        g._export()
        g._attach_checks()
        g._install()
    except BaseException as e:
        # Nothing of a failed attach stays behind: hooks, registry entry, server thread.
        g.probe.remove()
        for h in g._handles:
            h.remove()
        _ATTACHED.pop(model, None)
        if isinstance(e, GuardViolation):
            g.ledger.emit(final=True)  # the halt reaches the metrics before the job stops
        g.ledger.close()
        raise
    log.info("guard attached to %s / %s: %s", heads.embedding_name, heads.lm_head_name,
             str(aud).splitlines()[0])
    return g
