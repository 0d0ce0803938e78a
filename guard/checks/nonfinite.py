"""nonfinite: NaN / Inf in the lm_head input, the real-vocab logits and the loss, and in the
gradients before the update (counted by its state, guard/stateful/nonfinite.py: the parameters
whose gradient holds one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks import token_range
from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, Stats
from guard.policy import Policy
from guard_server.wire import TENSORS, TensorKind

__all__ = ["FORWARD", "GRAD", "GRAD_SEEN", "HIDDEN", "LOGITS", "LOSS", "SLOTS", "SPEC",
           "Nonfinite"]

HIDDEN = Slot("nonfinite.hidden")  # positions whose lm_head input holds a NaN/Inf
LOGITS = Slot("nonfinite.logits")  # positions whose real-vocab logits hold a NaN or +Inf
LOSS = Slot("nonfinite.loss")  # non-finite losses
GRAD = Slot("nonfinite.grad")  # parameters whose gradient holds a NaN/Inf, before the update
GRAD_SEEN = Slot("nonfinite.grad_seen", "max")  # 1 when the window's gradients were checked
# Per tensor (the wire's TensorKind), in the order of the message: cause first (the backward
# follows the forward).
SLOTS: Mapping[TensorKind, Slot] = {"hidden": HIDDEN, "logits": LOGITS, "loss": LOSS,
                                    "grad": GRAD}
FORWARD: tuple[TensorKind, ...] = ("hidden", "logits", "loss")
_NAMES: Mapping[TensorKind, str] = {"hidden": "{n} positions in the lm_head input",
                                    "logits": "{n} in the real-vocab logits",
                                    "loss": "{n} in the loss",
                                    "grad": "{n} parameters' gradients"}


@dataclass(frozen=True)
class Nonfinite:
    # Per tensor, cause first; "grad" only where the window's gradients were checked.
    counts: Mapping[TensorKind, int]


def _figures(raw: Raw) -> Nonfinite:
    return Nonfinite({k: int(raw[slot]) for k, slot in SLOTS.items()
                      if k != "grad" or raw[GRAD_SEEN]})


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return dict.fromkeys(SLOTS.values(), 0.0)


def _stats(f: Nonfinite) -> Stats:
    # The wire's order (logits, hidden, loss, grad), as g.stats has always shown it.
    return {"nonfinite": {k: f.counts[k] for k in TENSORS if k in f.counts}}


# What usually makes a gradient non-finite while the forward is finite (docs/nonfinite.md).
_BACKWARD = ("an op whose gradient is infinite where its value is not (sqrt or pow at 0, the "
             "norm of a zero vector), a float16/bfloat16 overflow in a large activation's "
             "gradient, a custom autograd Function's backward, or attention's softmax at "
             "extreme logits")


def _describe(f: Nonfinite, c: Context) -> Found:
    parts = {k: n for k, n in f.counts.items() if n > 0}
    seen = ", ".join(_NAMES[k].format(n=n) for k, n in parts.items())
    total = float(sum(parts.values()))
    kind = "+".join(parts)
    ids = c.glob[token_range.SPEC]
    if kind == "loss" and c.policy.masks and ids.counts["label"] > 0 and \
            c.real <= ids.max_id < c.rows:
        # Only the loss, under the mask, with ghost labels: each has a -inf logit, so its
        # cross-entropy is +inf. The labels are the cause, not the weights.
        why = (f"the loss is +inf because {ids.counts['label']} labels are ghost ids in "
               f"[{c.real}, {c.rows}) (highest {ids.max_id}), whose logits the mask sets to -inf "
               "(see token_range): fix the labels, or give the real vocab that has these ids")
    elif kind == "grad":
        # The forward of the window was finite: the gradients went non-finite in the backward.
        named = f": {c.detail}" if c.detail else ""
        why = (f"the forward was finite (the lm_head input, the sampled logits and the loss), so "
               f"it was "
               f"born in the backward{named}. It is usually {_BACKWARD}. To find the op, run "
               "one step under torch.autograd.detect_anomaly(), which names the backward that "
               "made it (docs/nonfinite.md)")
    else:
        why = (f"Check the learning rate, the loss scale and the padding rows [{c.real}, "
               f"{c.rows}) of the embedding / lm_head")
        if "grad" in parts and c.detail:
            why += f"; the gradients followed the forward: {c.detail}"
    return Found(total, 0.0, kind=kind, text=(
        f"NaN/Inf values: {seen}; expected none; {c.next}. {why[0].upper()}{why[1:]}."))


SPEC = Spec("nonfinite", (*SLOTS.values(), GRAD_SEEN), _figures, _thresholds,
            ("logits", "loss"), _stats, _describe)
