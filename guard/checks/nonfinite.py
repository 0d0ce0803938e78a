"""nonfinite: NaN / Inf in the lm_head input, the real-vocab logits and the loss, and in the
gradients before the update (counted by its state, guard/stateful/nonfinite.py: the parameters
whose gradient holds one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks import coverage, token_range
from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, Stats
from guard.policy import Policy
from guard_server.wire import TENSORS, TensorKind

__all__ = ["FORWARD", "GRAD", "GRAD_SEEN", "HIDDEN", "LOGITS", "LOSS", "LOSS_INF", "SLOTS",
           "SPEC", "Nonfinite"]

HIDDEN = Slot("nonfinite.hidden")  # positions whose lm_head input holds a NaN/Inf
LOGITS = Slot("nonfinite.logits")  # positions whose real-vocab logits hold a NaN or +Inf
LOSS = Slot("nonfinite.loss")  # non-finite losses
LOSS_INF = Slot("nonfinite.loss_inf")  # of those, +inf ones (not NaN): names the cause
GRAD = Slot("nonfinite.grad")  # parameters whose gradient holds a NaN/Inf, before the update
GRAD_SEEN = Slot("nonfinite.grad_seen", "max")  # 1 when the window's gradients were checked
# Per tensor (the wire's TensorKind), in the order of the message: cause first (the backward
# follows the forward).
SLOTS: Mapping[TensorKind, Slot] = {"hidden": HIDDEN, "logits": LOGITS, "loss": LOSS,
                                    "grad": GRAD}
FORWARD: tuple[TensorKind, ...] = ("hidden", "logits", "loss")
_TENSOR: Mapping[TensorKind, str] = {"hidden": "lm_head input", "logits": "real-vocab logits",
                                     "loss": "loss", "grad": "gradients"}
_NAMES: Mapping[TensorKind, str] = {"hidden": "{n} positions in the lm_head input",
                                    "logits": "{n} in the real-vocab logits",
                                    "loss": "{n} in the loss",
                                    "grad": "{n} parameters' gradients"}


@dataclass(frozen=True)
class Nonfinite:
    # Per tensor, cause first; "grad" only where the window's gradients were checked.
    counts: Mapping[TensorKind, int]
    inf_losses: int = 0  # of the non-finite losses, those that are +inf


def _figures(raw: Raw) -> Nonfinite:
    return Nonfinite({k: int(raw[slot]) for k, slot in SLOTS.items()
                      if k != "grad" or raw[GRAD_SEEN]}, int(raw[LOSS_INF]))


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


def _weights(c: Context) -> str:
    return (f"check the learning rate, the loss scale and the padding rows [{c.real}, "
            f"{c.rows}) of the embedding / lm_head")


def _why(f: Nonfinite, c: Context) -> str:
    """The likely cause. Under the mask a label in [real, rows) has a -inf logit, so its
    cross-entropy is +inf: ghost labels are named as the cause of a non-finite loss whatever
    else the step saw, and labels the guard did not see are named as a suspect before the
    weights are blamed. Gradients alone went non-finite in the backward."""
    parts = [k for k, n in f.counts.items() if n > 0]
    if parts == ["grad"]:
        # The forward of the window was finite: the gradients went non-finite in the backward.
        named = f": {c.detail}" if c.detail else ""
        return (f"the forward was finite (the lm_head input, the sampled logits and the loss), "
                f"so it was born in the backward{named}. It is usually {_BACKWARD}. To find the "
                "op, run one step under torch.autograd.detect_anomaly(), which names the "
                "backward that made it (docs/nonfinite.md)")
    grads = (f"; the gradients followed the forward: {c.detail}"
             if "grad" in parts and c.detail else "")
    if not (f.counts.get("loss", 0) > 0 and c.policy.masks):
        return _weights(c) + grads
    ids = c.glob[token_range.SPEC]
    if ids.counts["label"] > 0 and c.real <= ids.max_id < c.rows:
        rest = [_TENSOR[k] for k in ("hidden", "logits") if f.counts[k]]
        n = ids.counts["label"]
        ghosts = "label is a ghost id" if n == 1 else "labels are ghost ids"
        return (f"the loss is +inf because {n} {ghosts} in "
                f"[{c.real}, {c.rows}) (highest {ids.max_id}), whose logits the mask sets to "
                "-inf (see token_range): fix the labels, or give the real vocab that has these "
                "ids" + (f"; for the {' and the '.join(rest)}, {_weights(c)}" if rest else ""))
    blind = c.glob[coverage.SPEC].blind["labels"] > 0
    if f.inf_losses > 0:
        # Labels in range, or unseen: the usual +inf under the mask is a loss over every column
        # (label smoothing, a KL to a full distribution), whose padding columns are -inf.
        return (f"the loss is inf: a loss over every column with the padding columns masked to "
                f"-inf (label smoothing?): compute it over logits[..., :{c.real}]"
                + (f"; or a label in [{c.real}, {c.rows}): this step's labels were not checked "
                   "(see coverage)" if blind else "") + grads)
    if blind:
        return (f"this step's labels were not checked (token_range is off, or they did not "
                f"reach the guarded forward: see coverage), and a label in [{c.real}, "
                f"{c.rows}) makes the loss +inf under the mask: look at the labels first; "
                f"then {_weights(c)}{grads}")
    return _weights(c) + grads


def _describe(f: Nonfinite, c: Context) -> Found:
    parts = {k: n for k, n in f.counts.items() if n > 0}
    seen = ", ".join(_NAMES[k].format(n=n) for k, n in parts.items())
    why = _why(f, c)
    return Found(float(sum(parts.values())), 0.0, kind="+".join(parts), text=(
        f"NaN/Inf values: {seen}; expected none; {c.next}. {why[0].upper()}{why[1:]}."))


SPEC = Spec("nonfinite", (*SLOTS.values(), LOSS_INF, GRAD_SEEN), _figures, _thresholds,
            ("logits", "loss"), _stats, _describe)
