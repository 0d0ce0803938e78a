"""vocab, at each read: the embedding and the head that were tied at attach still share one
weight (its state, guard/stateful/vocab.py, compares them on the host). The attach-time part of
the check, the three sizes: guard/step/verdict.py (`attach_verdict`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec
from guard.policy import Policy

__all__ = ["SPEC", "UNTIED", "Vocab"]

UNTIED = Slot("vocab.untied", "max")  # 1 when the tie of attach is broken


@dataclass(frozen=True)
class Vocab:
    untied: bool


def _figures(raw: Raw) -> Vocab:
    return Vocab(raw[UNTIED] > 0)


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return {UNTIED: 0.0}


def _describe(f: Vocab, c: Context) -> Found:
    weights = c.detail or "the embedding's and the head's weights"
    return Found(1.0, 0.0, once="untied", kind="untied", text=(
        f"{weights} were one tied weight at attach and are two now: one of them was "
        "re-created (a resize that did not tie them again, to_empty(), a load or an assignment "
        "that replaced a parameter), so the head learns apart from the embedding and a "
        f"checkpoint saved as tied keeps one of them; expected them tied; {c.next}. Tie them "
        "again (HF: model.tie_weights(); else lm_head.weight = embedding.weight), or untie "
        "them on purpose (tie_word_embeddings=False) and attach again."))


SPEC = Spec("vocab", (UNTIED,), _figures, _thresholds, describe=_describe)
