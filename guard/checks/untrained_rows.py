"""untrained_rows: rows of the real vocabulary [0, real) that were never trained (the rules:
guard/checkpoint/untrained_rules.py), and the input ids and labels that fall on them in a step. Its
state (guard/stateful/untrained_rows.py) finds the rows at attach, counts the ids with lookup
tables on the device (guard/device/untrained_tables.py), repairs the rows and names the ids."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks.spec import Context, Found, Gauges, Raw, Setup, Slot, Spec, Stats, listed
from guard.policy import Action, Policy
from guard_server.wire import WEIGHTS, IdKind, WeightName

__all__ = ["INPUT", "LABEL", "LEFT", "NEW", "READ", "SLOTS", "SPEC", "UntrainedFigures"]

INPUT = Slot("untrained_rows.input")  # input ids on rows of the embedding never trained
LABEL = Slot("untrained_rows.label")  # labels on rows of the head (tied: the embedding) alike
SLOTS: Mapping[IdKind, Slot] = {"input": INPUT, "label": LABEL}
# Ids used since attach that no message has named yet: the host reads which only when this is
# non-zero (the state's detail), never at a step that brings nothing new.
NEW = Slot("untrained_rows.new", "max")
READ = Slot("untrained_rows.read", "max")  # 1 when the rows left were written this window
# Per weight, the untrained rows not repaired yet (a tied head: the embedding's, named twice).
LEFT: Mapping[WeightName, Slot] = {w: Slot(f"untrained_rows.{w}", "last", written=READ)
                                   for w in WEIGHTS}


@dataclass(frozen=True)
class UntrainedFigures:
    counts: Mapping[IdKind, int]  # ids that fell on untrained rows, per kind
    rows: Mapping[WeightName, int] | None  # untrained rows left per weight; None: not checked
    new: int  # ids used that no message has named yet


def _figures(raw: Raw) -> UntrainedFigures:
    rows = {w: int(raw[slot]) for w, slot in LEFT.items()} if raw[READ] else None
    return UntrainedFigures({k: int(raw[slot]) for k, slot in SLOTS.items()}, rows,
                            int(raw[NEW]))


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return dict.fromkeys(SLOTS.values(), 0.0)


def _stats(f: UntrainedFigures) -> Stats:
    return {"untrained_rows": None if f.rows is None else Gauges(f.rows.items()),
            "untrained_tokens": dict(f.counts)}


def _then(action: Action) -> str:
    """What happens next, and the fix where the action leaves the rows as they are."""
    if action is Action.REPAIR:
        return ("setting the rows of the ids used (embedding and head) to the mean of the "
                "trained rows in place, before the update (action: repair)")
    fix = ("Set checks.untrained_rows.action: repair to set them to the mean of the trained "
           "rows at their first use (what Unsloth's fix_untrained_tokens writes), or "
           "initialise those rows before training")
    if action is Action.FAIL:
        return f"stopping before the update (action: fail). {fix}"
    return (f"continuing (action: warn): the rows stay as they are and every step that uses "
            f"them is counted (untrained_tokens). {fix}")


def _describe(f: UntrainedFigures, c: Context) -> Found:
    seen, total = listed({("label" if k == "label" else "input id"): n
                          for k, n in f.counts.items()}, "{n} {k}{s}", " and ")
    which = c.detail or "the ids named when they were first used"
    kind = "+".join(k for k, n in f.counts.items() if n > 0)
    return Found(total, 0.0, kind=kind, text=(
        f"{seen} fell on rows of the real vocab that were never trained: {which}. A zero row "
        "gives the step an input that carries nothing and a logit that ranks nothing, and "
        "under LoRA (a frozen embedding) it never learns; "
        f"{_then(c.policy.action('untrained_rows'))}."))


SPEC = Spec("untrained_rows", (INPUT, LABEL, NEW, READ, *LEFT.values()), _figures, _thresholds,
            stats=_stats, describe=_describe)
