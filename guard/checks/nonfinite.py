"""nonfinite: NaN / Inf in the lm_head input, the real-vocab logits and the loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks import token_range
from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, Stats, listed
from guard.policy import Policy
from guard_server.wire import TENSORS, TensorKind

__all__ = ["HIDDEN", "LOGITS", "LOSS", "SLOTS", "SPEC", "Nonfinite"]

HIDDEN = Slot("nonfinite.hidden")  # non-finite values in the lm_head input
LOGITS = Slot("nonfinite.logits")  # positions whose real-vocab logits hold a NaN or +Inf
LOSS = Slot("nonfinite.loss")  # non-finite losses
# Per tensor (the wire's TensorKind), in the order of the message: cause first.
SLOTS: Mapping[TensorKind, Slot] = {"hidden": HIDDEN, "logits": LOGITS, "loss": LOSS}
_NAMES: Mapping[TensorKind, str] = {"hidden": "lm_head input", "logits": "real-vocab logits",
                                    "loss": "loss"}


@dataclass(frozen=True)
class Nonfinite:
    counts: Mapping[TensorKind, int]  # per tensor, cause first


def _figures(raw: Raw) -> Nonfinite:
    return Nonfinite({k: int(raw[slot]) for k, slot in SLOTS.items()})


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return dict.fromkeys(SLOTS.values(), 0.0)


def _stats(f: Nonfinite) -> Stats:
    # The wire's order (logits, hidden, loss), as g.stats has always shown it.
    return {"nonfinite": {k: f.counts[k] for k in TENSORS}}


def _describe(f: Nonfinite, c: Context) -> Found:
    seen, total = listed({_NAMES[k]: n for k, n in f.counts.items()}, "{n} in the {k}", ", ")
    kind = "+".join(k for k, n in f.counts.items() if n > 0)
    ids = c.glob[token_range.SPEC]
    if kind == "loss" and c.policy.masks and ids.counts["label"] > 0 and \
            c.real <= ids.max_id < c.rows:
        # Only the loss, under the mask, with ghost labels: each has a -inf logit, so its
        # cross-entropy is +inf. The labels are the cause, not the weights.
        why = (f"the loss is +inf because {ids.counts['label']} labels are ghost ids in "
               f"[{c.real}, {c.rows}) (highest {ids.max_id}), whose logits the mask sets to -inf "
               "(see token_range): fix the labels, or give the real vocab that has these ids")
    else:
        why = (f"Check the learning rate, the loss scale and the padding rows [{c.real}, "
               f"{c.rows}) of the embedding / lm_head")
    return Found(total, 0.0, kind=kind, text=(
        f"NaN/Inf values: {seen}; expected none; {c.next}. {why[0].upper()}{why[1:]}."))


SPEC = Spec("nonfinite", tuple(SLOTS.values()), _figures, _thresholds, ("logits", "loss"),
            _stats, _describe)
