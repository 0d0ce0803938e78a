"""vocab, at each read: the embedding and the head that were tied at attach still share one
weight (its state, guard/stateful/vocab.py, compares them on the host). The attach-time part of
the check, the three sizes: guard/step/verdict.py (`attach_verdict`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec
from guard.policy import Policy

__all__ = ["DRIFTED", "SPEC", "UNTIED", "Vocab"]

UNTIED = Slot("vocab.untied", "max")  # 1 when the tie of attach is broken
# 1 when two tied copies on two pipeline stages differ (guard/stateful/tie_across.py)
DRIFTED = Slot("vocab.drifted", "max")


@dataclass(frozen=True)
class Vocab:
    untied: bool
    drifted: bool = False


def _figures(raw: Raw) -> Vocab:
    return Vocab(raw[UNTIED] > 0, raw[DRIFTED] > 0)


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return {UNTIED: 0.0, DRIFTED: 0.0}


def _describe(f: Vocab, c: Context) -> Found:
    if f.drifted and not f.untied:
        return Found(1.0, 0.0, once="drifted", kind="drifted", text=(
            f"the tied copies of the token embedding and the lm_head on two pipeline stages "
            f"no longer agree: {c.detail or 'their rows differ'}; expected them equal (the "
            "framework syncs them at start-up and all-reduces their gradients each step: a "
            "meta-device init that skipped the sync, two optimizers updating the copies "
            f"differently, or a resume that loaded one copy); {c.next}. Copy one into the "
            "other (Megatron: the embedding group's sync at start-up) and resume from a "
            "checkpoint saved before the drift."))
    weights = c.detail or "the embedding's and the head's weights"
    return Found(1.0, 0.0, once="untied", kind="untied", text=(
        f"{weights} were one tied weight at attach and are two now: one of them was "
        "re-created (a resize that did not tie them again, to_empty(), a load or an assignment "
        "that replaced a parameter), so the head learns apart from the embedding and a "
        f"checkpoint saved as tied keeps one of them; expected them tied; {c.next}. Tie them "
        "again (HF: model.tie_weights(); else lm_head.weight = embedding.weight), or untie "
        "them on purpose (tie_word_embeddings=False) and attach again."))


SPEC = Spec("vocab", (UNTIED, DRIFTED), _figures, _thresholds, describe=_describe)
