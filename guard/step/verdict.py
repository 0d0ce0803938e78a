"""The verdict of one read: from a `Reading` to violations with their messages, and whether
to stop or to drop the step. Pure Python: no tensor, no state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from guard.device.flags import NEEDS
from guard.errors import GuardViolation
from guard.policy import Action, Policy
from guard.step.reading import Reading, Values
from guard.vocab.sizes import Audit

__all__ = ["Note", "Verdict", "Violation", "attach_verdict", "judge"]

_NEXT = {
    Action.FAIL: "stopping (action: fail)",
    Action.SKIP: "skipping this optimizer step (action: skip)",
    Action.MASK: "masking the padding columns to -inf (action: mask)",
    Action.WARN: "continuing (action: warn)",
    Action.REPAIR: "setting them to the mean of the real rows in place (action: repair)",
}


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


# The tensors of the nonfinite check, in the order of the message: cause first.
_TENSORS = {"hidden": "lm_head input", "logits": "real-vocab logits", "loss": "loss"}


def _seen(counts: dict[str, int], each: str, sep: str) -> tuple[str, float]:
    """The non-zero counts as text (`each` formats one, with {n} and {k}) and their total."""
    parts = [(k, n) for k, n in counts.items() if n > 0]
    return sep.join(each.format(n=n, k=k) for k, n in parts), float(sum(n for _, n in parts))


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x == x and abs(x) < 1e4 else f"{x:.4g}"


@dataclass(frozen=True)
class _Context:
    """What a message needs besides the check's own values."""

    glob: Values
    policy: Policy
    next: str  # what happens next, from the action
    real: int
    rows: int
    head: str  # the head's name in the model
    weights: str  # the weights whose padding rows are checked, by name


@dataclass(frozen=True)
class _Found:
    value: float
    threshold: float
    text: str
    count: int = 1
    once: str | None = None


def _token_range(c: _Context) -> _Found:
    seen, total = _seen(c.glob.out_of_range, "{n} {k} ids", " and ")
    ignore = c.policy.checks.token_range.ignore_index
    exempt = "" if ignore is None else f" (ignore index {ignore} exempt)"
    why = []
    if (neg := c.glob.negative_labels) > 0:
        why.append(f"{neg} labels are negative: if they mark positions to ignore, set "
                   "checks.token_range.ignore_index to their value (nanoGPT ignores -1: "
                   "ignore_index: -1)")
    if c.real <= (top := c.glob.max_id) < c.rows:
        # Just above real, these are often special tokens the size given leaves out, not bad
        # data: the message leads with the fix for that case.
        why.append(f"ids in [{c.real}, {c.rows}) (highest {top}) are beyond the real vocab you "
                   f"gave ({c.real}): if your tokenizer has more ids (special tokens can sit "
                   "above a configured vocab size: Llama-3 reserves 256 ids above 128000 that "
                   "config.vocab_size leaves out, and litgpt's vocab_size alike), pass "
                   "tokenizer= or set vocab.real_size to its size; otherwise they are ghost "
                   "ids the tokenizer cannot produce")
    elif top >= c.rows:
        why.append(f"ids >= {c.rows} (highest {top}) have no row at all")
    return _Found(total, 0.0, (
        f"{seen} outside [0, {c.real}){exempt}: {'; '.join(why) or 'out of range'}; {c.next}. "
        f"Check the tokenizer / data pipeline against vocab {c.real}."))


def _padding_mass(c: _Context) -> _Found:
    top, mean = c.glob.padding_mass_max or 0.0, c.glob.padding_mass or 0.0
    threshold = c.policy.checks.padding_mass.threshold
    fix = ("The mask removes it from softmax and gradient." if c.policy.masks
           else "Set checks.padding_mass.action: mask to mask them instead.")
    if c.glob.fused and c.policy.masks:
        fix = (f"But {c.head} was not called: a fused kernel computed the loss from its weight "
               "(measured here from the final hidden states) and the guard cannot mask a "
               f"kernel's logits. Pass it the real rows {c.head}.weight[:{c.real}] "
               "(docs/integrations.md, fused heads): then the padding takes no part in the loss.")
    return _Found(top, threshold, (
        f"{_fmt(top)} of the probability (mean {_fmt(mean)}) is on the {c.rows - c.real} "
        f"padding columns [{c.real}, {c.rows}), expected <= {threshold:g}; {c.next}. {fix}"))


def _nonfinite(c: _Context) -> _Found:
    counts = {name: c.glob.nonfinite[k] for k, name in _TENSORS.items()}
    seen, total = _seen(counts, "{n} in the {k}", ", ")
    return _Found(total, 0.0, (
        f"NaN/Inf values: {seen}; expected none; {c.next}. Check the learning rate, the loss "
        f"scale and the padding rows [{c.real}, {c.rows}) of the embedding / lm_head."))


def _loss_spike(c: _Context) -> _Found:
    ls, ratio = c.policy.checks.loss_spike, c.glob.spike_ratio
    loss = c.glob.loss if c.glob.loss is not None else float("nan")
    return _Found(ratio, ls.factor, (
        f"loss {_fmt(loss)} is {_fmt(ratio)}x the median of its last {ls.window} losses, "
        f"expected <= {ls.factor:g}x (or a rise <= {ls.min_delta:g}); {c.next}. Look for "
        "unmasked padding columns, a bad batch or a too high learning rate."))


def _padding_rows(c: _Context) -> _Found:
    factor = c.policy.checks.padding_rows.factor
    bad, ratio = c.glob.rows_nonfinite, c.glob.rows_ratio
    seen = ", ".join(part for part in (
        f"{bad} non-finite values" if bad else "",
        f"the largest norm {_fmt(ratio)}x the largest real row's" if ratio > factor else "",
    ) if part)
    fix = ("" if c.policy.action("padding_rows") is Action.REPAIR else
           " Set checks.padding_rows.action: repair to overwrite them with the mean real row.")
    return _Found(ratio if not bad else float(bad), factor, (
        f"rows [{c.real}, {c.rows}) of {c.weights}: {seen}, expected "
        f"finite and <= {factor:g}x: what an uninitialised resize leaves, which poisons the "
        f"logits wherever the mask is not (evaluation, generation, a saved checkpoint); "
        f"{c.next}.{fix}"))


def _blind(kind: str, head: str) -> str:
    """What was not seen, the likely cause and the fix, per kind of data."""
    return {
        "logits": f"no logits: {head} was not called in the training forward and no final "
                  "norm was found to measure its input from. Fix: call the head module, or "
                  "pass lm_head= the module that produces the logits",
        "labels": "no labels: no labels= / targets= argument reached the model's forward (the "
                  "loss is computed outside the model: HF Trainer with label_smoothing_factor "
                  "or compute_loss_func, or a wrapper that hides the signature); input ids are "
                  "still checked. Fix: pass the labels to the model's forward",
        "loss": "no loss: the forward returned none (HF .loss, a (logits, loss) tuple, a "
                "dict's 'loss' or a 0-dim tensor) and no g.step(loss) gave one. Fix: return "
                "the loss from forward, or call g.step(loss) each step",
    }[kind]


def _coverage(c: _Context) -> _Found | None:
    parts, worst = [], 0
    for kind, n in c.glob.blind.items():
        checks = [ch for ch in NEEDS[kind] if c.policy.enabled(ch)]
        if n > 0 and checks:
            parts.append((kind, f"{' and '.join(checks)} saw {_blind(kind, c.head)}"))
            worst = max(worst, n)
    if not parts:
        return None  # no check that is on needs what was not seen
    text = "; ".join(p for _, p in parts)
    return _Found(float(worst), 0.0, (
        f"blind in {worst} training step(s): {text}; {c.next}. Until then these checks "
        "check nothing (logged once, counted every blind step)."),
        count=worst, once="+".join(kind for kind, _ in parts))


# The per-step checks in the order of a verdict, cause first: ghost ids explain an infinite
# loss under the mask, not the reverse; a blind check explains a quiet one.
_DESCRIBE: dict[str, Callable[[_Context], _Found | None]] = {
    "token_range": _token_range,
    "padding_mass": _padding_mass,
    "nonfinite": _nonfinite,
    "loss_spike": _loss_spike,
    "padding_rows": _padding_rows,
    "coverage": _coverage,
}


def judge(reading: Reading, policy: Policy, *, step: int, real: int, rows: int,
          head: str = "lm_head", weights: str = "the embedding / lm_head weights") -> Verdict:
    """The verdict on the all-rank values, so every rank decides alike.

    `real` and `rows`: the whole head's real vocab and rows; `head` its name and `weights`
    those whose padding rows are checked, for the messages.
    """
    out = []
    for check, describe in _DESCRIBE.items():
        rank = reading.fired(check)
        if rank is None or not policy.enabled(check):
            continue
        action = policy.action(check)
        f = describe(_Context(reading.glob, policy, _NEXT[action], real, rows, head, weights))
        if f is None:
            continue
        out.append(Violation(check, action, step, f"{check} on rank {rank} at step {step}: "
                             f"{f.text}", rank=rank, value=f.value, threshold=f.threshold,
                             count=f.count, once=f.once and f"{check}:{f.once}"))
    return Verdict(tuple(out))


def attach_verdict(audit: Audit, policy: Policy, rank: int) -> Verdict:
    """The attach-time checks, alignment and vocab, at step 0: `fail` stops before step 1."""
    multiple = audit.pad_multiple * audit.tensor_parallel
    out = []
    for check, problems in (("alignment", audit.alignment_problems),
                            ("vocab", audit.vocab_problems)):
        action = policy.action(check)
        if action is Action.OFF or not problems:
            continue
        next_ = ("stopping before the first step (action: fail)" if action is Action.FAIL
                 else "continuing (action: warn)")
        message = (f"{check} on rank {rank} at attach: {'; '.join(problems)}; {next_}. Fix: "
                   f"build embedding and lm_head with {audit.aligned} rows (a multiple of "
                   f"{multiple}) and mask columns [{audit.real}, {audit.aligned}) with "
                   "checks.padding_mass.action: mask.")
        value = float(audit.rows if check == "alignment" else audit.real)
        threshold = float(multiple if check == "alignment" else audit.rows)
        out.append(Violation(check, action, 0, message, rank=rank, value=value,
                             threshold=threshold))
    return Verdict(tuple(out))
