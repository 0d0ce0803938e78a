"""coverage: every enabled per-step check saw its data in each training step (logits through
the head, input ids through the embedding, labels, a loss); a blind step is counted, and
logged at the first one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks.spec import Context, Found, Raw, SeenKind, Setup, Slot, Spec
from guard.policy import Policy

__all__ = ["BLIND", "SEEN", "SPEC", "Coverage"]

# Per kind, a mark set when the step's data reached the guard (reset at each step boundary),
# and the count of the window's steps that ended without it.
SEEN: Mapping[SeenKind, Slot] = {k: Slot(f"coverage.seen_{k}", "max")
                                 for k in ("logits", "inputs", "labels", "loss")}
BLIND: Mapping[SeenKind, Slot] = {k: Slot(f"coverage.blind_{k}", without=seen)
                                  for k, seen in SEEN.items()}


@dataclass(frozen=True)
class Coverage:
    blind: Mapping[SeenKind, int]  # training steps of the window without each kind of data


def _figures(raw: Raw) -> Coverage:
    return Coverage({k: int(raw[slot]) for k, slot in BLIND.items()})


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    # A blind step is a violation only where a check that is on needs the data: decided here,
    # once, on the device (the verdict reads which slots crossed).
    return {BLIND[kind]: 0.0 for kind in setup.watching}


def _blind(kind: SeenKind, head: str, looked: str) -> str:
    """What was not seen, the likely cause and the fix, per kind of data; `looked`: what the
    guard looked for in the forward's arguments, and the ways to give labels (the probe's)."""
    return {
        "logits": f"no logits: {head} was not called in the training forward and no final "
                  "norm was found to measure its input from. Fix: call the head module, or "
                  "pass lm_head= the module that produces the logits",
        "inputs": "no input ids: no module that embeds with the embedding's weight was called "
                  "with ids in the training forward (inputs_embeds passed instead, or ids "
                  "embedded by F.embedding on the weight), so ghost input ids go unseen; labels "
                  "are still checked. Fix: pass input_ids to the model, or embedding= the "
                  "module that embeds them",
        "labels": f"no labels: {looked}; input ids are still checked" if looked else
                  "no labels: no labels= / targets= argument reached the model's forward; "
                  "input ids are still checked. Fix: pass the labels to the model's forward",
        "loss": "no loss: the forward returned none (HF .loss, a (logits, loss) tuple, a "
                "dict's 'loss' or a 0-dim tensor) and no g.step(loss) gave one. Fix: return "
                "the loss from forward, or call g.step(loss) each step",
    }[kind]


def _describe(f: Coverage, c: Context) -> Found | None:
    kinds = [k for k, slot in BLIND.items() if slot in c.crossed]
    if not kinds:
        return None
    text = "; ".join(f"{' and '.join(c.watching[k])} saw {_blind(k, c.head, c.detail)}"
                     for k in kinds)
    worst = max(f.blind[k] for k in kinds)
    return Found(float(worst), 0.0, (
        f"blind in {worst} training step(s): {text}; {c.next}. Until then these checks "
        "check nothing (logged once, counted every blind step)."),
        count=worst, once="+".join(kinds))


SPEC = Spec("coverage", (*SEEN.values(), *BLIND.values()), _figures, _thresholds,
            describe=_describe)
