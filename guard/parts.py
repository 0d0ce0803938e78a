"""The parts of one guard, wired together at attach: on the device side the probe and the
stateful checks' states, on the host the record, the localiser, the reader and the step clock.
Their hooks go on together, in one list, and come off together: a refused attach leaves none."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from guard.checks import padding_mass
from guard.device.compile import drop_compiled
from guard.device.hooks import Handle
from guard.device.loss import LossShares
from guard.device.probe import Probe
from guard.policy import Policy
from guard.stateful import Attaching, States, attach_states
from guard.stateful.lasting import lasting
from guard.step.clock import StepClock, Steps
from guard.step.episodes import Episodes
from guard.step.reader import Names, Reader
from guard.step.record import Record
from guard.step.skip import boundary_of, device_skip
from guard.step.verdict import Note, attach_verdict
from guard.vocab.discover import Heads
from guard.vocab.resolve import Sizes
from guard.vocab.stage import Stage
from guard.weights.masters import Masters
from guard.weights.vocab import vocab_weights

__all__ = ["Parts"]

log = logging.getLogger("guard")


@dataclass
class Parts:
    """What a Guard is made of, for one model on one rank."""

    model: nn.Module
    heads: Heads
    policy: Policy
    sizes: Sizes
    optimizer: torch.optim.Optimizer | None
    probe: Probe
    states: States  # the stateful checks', one state each
    record: Record
    episodes: Episodes | None
    clock: StepClock
    caller: nn.Module  # whose forward hooks see each call of the model: the model, mostly
    stage: Stage | None = None  # the pipeline stage, where the model is one
    handles: list[Handle] = field(default_factory=list)  # every hook, in one list

    @classmethod
    def build(cls, model: nn.Module, heads: Heads, policy: Policy, sizes: Sizes, *, rank: int,
              optimizer: torch.optim.Optimizer | None = None, steps: Steps = "auto",
              loss_shares: LossShares = "last", loss_scale: float = 1.0,
              tokenizer: Any = None, scaled: bool = False,
              caller: nn.Module | None = None, outer: object | None = None,
              stage: Stage | None = None) -> Parts:
        """`caller`: the module whose forward hooks see each call of `model` (a wrapper that
        calls the model's forward method past its hooks, guard/wrappers.py); `outer`: a
        DeepSpeed optimizer around `optimizer`, whose step is the boundary (guard/step/
        zero.py)."""
        # A repair where the optimizer's own copy of a weight is out of reach would be undone
        # at the next update: said here, and such repairs warn instead.
        policy = lasting(policy, [(w.name, w.tensor) for w in
                                  vocab_weights(heads, sizes.first_padding)], Masters(optimizer))
        probe = Probe.from_policy(policy, sizes, heads, rank=rank, loss_shares=loss_shares,
                                  loss_scale=loss_scale)
        probe.pipelined = stage is not None  # every stage reads at attach: one collective
        # The probe, the reader and the guard share the states: one object per check.
        states = attach_states(Attaching(policy, probe.flags, heads, sizes, model, rank,
                                         tokenizer, optimizer, scaled, caller, stage))
        record = Record.from_policy(policy, sizes.audit, rank)
        record.mass_bound = padding_mass.reported_bound(policy, *sizes.mass_over)
        caller = model if caller is None else caller
        episodes = Episodes.from_policy(policy, caller)  # re-runs what was called
        reader = Reader(policy, sizes, Names(heads.lm_head_name), record, episodes, states)
        skip = device_skip(policy, optimizer, probe.flags,
                           hooked=outer is None and boundary_of(optimizer, steps) == "optimizer")
        clock = StepClock.from_policy(policy, probe, reader, optimizer=optimizer, steps=steps,
                                      outer=outer, skip=skip)
        return cls(model, heads, policy, sizes, optimizer, probe, states, record, episodes,
                   clock, caller, stage)

    def install(self) -> None:
        """alignment and vocab first: `fail` stops the job before any hook goes on. Everything
        that can refuse comes before what changes the model (a refused attach leaves weights,
        generation_config and hooks as they were)."""
        verdict = attach_verdict(self.sizes.audit, self.policy, self.record.rank,
                                 found=self.sizes.found, unread=self.states.unread())
        self.record.add(verdict)
        if (error := verdict.error()) is not None:
            raise error
        self.handles += self.probe.install(self.model, self.heads, self.states, self.caller)
        self.handles += self.states.install()
        self.handles += self.clock.install(self.caller, self.optimizer)
        if self.episodes is not None and self.optimizer is not None:
            self.handles += self.episodes.install(self.probe)
        for check, said in self.states.attach_notes(self.record.rank):  # report and log
            self.record.note(Note(check, self.policy.action(check), 0, said))
        self.clock.start()  # the weights' rows as they are before step 1 (a repair, or a fail)
        self.states.after_attach(self.model)
        if drop_compiled():
            log.info("dropped torch.compile's cached graphs, which may run this model "
                     "traced without the guard's hooks; each compiled function recompiles once")

    def remove(self) -> None:
        """Every hook; idempotent (detach and a failed attach)."""
        hooked = bool(self.handles)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.clock.remove()
        if hooked:
            drop_compiled()  # graphs traced with the hooks would go on running them
        if self.episodes is not None:
            self.episodes.close()
