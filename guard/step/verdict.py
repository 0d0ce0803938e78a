"""The verdict of one read: from a `Reading` to violations with their messages (each check's
spec describes its own, guard/checks/), and whether to stop or to drop the step. Pure Python:
no tensor, no state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from guard.checks import CHECKS, Context, watching
from guard.device.reading import Reading
from guard.errors import GuardViolation
from guard.policy import Action, Policy
from guard.vocab.real import GIVE_IT, Real
from guard.vocab.sizes import Audit
from guard_server.wire import CheckName

__all__ = ["Note", "Verdict", "Violation", "attach_verdict", "judge"]

_NEXT = {
    Action.FAIL: "stopping (action: fail)",
    Action.SKIP: "skipping this optimizer step (action: skip)",
    Action.MASK: "masking the padding columns to -inf (action: mask)",
    Action.WARN: "continuing (action: warn)",
    Action.REPAIR: "setting them to the mean of the real rows in place (action: repair)",
}
_STOP = "stopping before the first step (action: fail)"  # a fail at attach


@dataclass(frozen=True)
class Note:
    """An event for the report: what a check saw at a step, and the module, when localised.
    A plain Note is not a violation of its own (nothing is counted)."""

    check: str
    action: Action
    step: int
    message: str
    module: str | None = None


@dataclass(frozen=True, kw_only=True)
class Violation(Note):
    """One check over its threshold at one read; `rank` is the highest rank that saw it."""

    rank: int
    value: float
    threshold: float
    count: int = 1  # training steps it stands for (coverage counts each blind step)
    once: str | None = None  # a key: only the first violation with it is logged and reported
    kind: str = ""  # what it saw (a tensor, a kind of id): a new kind is logged at once


@dataclass(frozen=True)
class Verdict:
    """The violations of one read, cause first, and what they decide."""

    violations: tuple[Violation, ...] = ()

    @property
    def fail(self) -> Violation | None:
        """The first violation whose action is fail: the job stops."""
        return next((v for v in self.violations if v.action is Action.FAIL), None)

    @property
    def skip(self) -> bool:
        """Drop this optimizer step: a check says skip and none says fail."""
        return self.fail is None and any(v.action is Action.SKIP for v in self.violations)

    def error(self) -> GuardViolation | None:
        """The error to raise for `fail`, naming the other checks that fired with it."""
        v = self.fail
        if v is None:
            return None
        others = [o.check for o in self.violations if o is not v]
        also = f" (also at this step: {', '.join(others)})" if others else ""
        return GuardViolation(v.message + also, check=v.check, step=v.step, rank=v.rank,
                              value=v.value, threshold=v.threshold, action=v.action.value,
                              module=v.module)


def judge(reading: Reading, policy: Policy, *, step: int, real: int, rows: int,
          head: str = "lm_head", real_from: str = "",
          mass: tuple[int, int] | None = None) -> Verdict:
    """The verdict on the all-rank figures, so every rank decides alike: each enabled check
    that fired, described by its spec (guard/checks/), in the table's order (cause first).

    `real` and `rows`: the whole head's real vocab (clipped to the rows) and rows, `real_from`
    where the real vocab came from; `head` its name, for the messages; what a check's state
    adds to its message comes with the reading (`Reading.details`); `mass`, the (real,
    columns) the padding mass was measured over where not the whole vocab's.
    """
    watched = watching(policy)
    out = []
    for spec in CHECKS:
        rank = reading.fired_on(spec.check)
        if rank is None or spec.describe is None or not policy.enabled(spec.check):
            continue
        action = policy.action(spec.check)
        ctx = Context(reading.glob, policy, _NEXT[action], real, rows, head, reading.crossed,
                      watched, real_from, reading.details.get(spec.check, ""),
                      None if mass == (real, rows) else mass)
        found = spec.describe(reading.glob[spec], ctx)
        if found is None:
            continue
        out.append(Violation(spec.name, action, step, f"{spec.name} on rank {rank} at step "
                             f"{step}: {found.text}", rank=rank, value=found.value,
                             threshold=found.threshold, count=found.count,
                             once=found.once and f"{spec.name}:{found.once}", kind=found.kind))
    return Verdict(tuple(out))


def attach_verdict(audit: Audit, policy: Policy, rank: int, *,
                   found: Real | None = None,
                   unread: Sequence[tuple[CheckName, str]] = ()) -> Verdict:
    """The attach-time checks at step 0, alignment and vocab (`fail` stops before step 1),
    and coverage of the real vocab: `found` says where it came from (not found: every row is
    taken as real, and the checks of padding columns and ghost ids see nothing); `unread`: per
    check, the weights whose rows it cannot read between steps, and why (never taken for
    healthy ones)."""
    multiple = audit.pad_multiple * audit.tensor_parallel
    out = []
    attach_checks: tuple[tuple[CheckName, tuple[str, ...]], ...] = (
        ("alignment", audit.alignment_problems), ("vocab", audit.vocab_problems))
    for check, problems in attach_checks:
        action = policy.action(check)
        if action is Action.OFF or not problems:
            continue
        next_ = _STOP if action is Action.FAIL else "continuing (action: warn)"
        message = (f"{check} on rank {rank} at attach: {'; '.join(problems)}; {next_}. Fix: "
                   f"build embedding and lm_head with {audit.aligned} rows (a multiple of "
                   f"{multiple}) and mask columns [{audit.real}, {audit.aligned}) with "
                   "checks.padding_mass.action: mask.")
        value = float(audit.rows if check == "alignment" else audit.real)
        threshold = float(multiple if check == "alignment" else audit.rows)
        out.append(Violation(check, action, 0, message, rank=rank, value=value,
                             threshold=threshold))
    source = "" if found is None or not found.source else f" ({found.source})"
    if audit.vocab_warnings and policy.enabled("vocab"):
        # A suspicion, not a proof: warned and counted whatever the action, never a stop.
        out.append(Violation("vocab", Action.WARN, 0, (
            f"vocab on rank {rank} at attach: the real vocab {audit.real}{source}: "
            f"{'; '.join(audit.vocab_warnings)}; continuing (a warning whatever the action)."),
            rank=rank, value=float(audit.rows - audit.real), threshold=float(multiple)))
    if found is not None and not found.found and policy.enabled("coverage"):
        action = policy.action("coverage")
        out.append(Violation("coverage", action, 0, (
            f"coverage on rank {rank} at attach: the real vocab size was not found (none was "
            f"given, and {found.looked}); every one of the {audit.rows} rows is taken as real, "
            f"so no padding column is measured or masked and no ghost id in [real, rows) is "
            f"seen; {_STOP if action is Action.FAIL else _NEXT[action]}. "
            f"Give it: {GIVE_IT}; vocab.require_real_size: true makes this an error."),
            rank=rank, value=1.0, threshold=0.0, once="coverage:real_vocab"))
    if unread and policy.enabled("coverage"):
        action = policy.action("coverage")
        what = "; ".join(f"{check} cannot read {why}" for check, why in unread)
        out.append(Violation("coverage", action, 0, (
            f"coverage on rank {rank} at attach: {what}, so those rows are neither checked nor "
            f"repaired; {_STOP if action is Action.FAIL else _NEXT[action]}. Fix: keep the "
            "weights' partitions in memory (ZeRO-3's offload_param to cpu, not nvme), or turn "
            "those checks off."), rank=rank, value=1.0, threshold=0.0, once="coverage:rows"))
    return Verdict(tuple(out))
