"""The host side of the untrained_rows check: at attach, the rows of the real vocab that were
never trained are found on the device (guard/device/untrained_rules.py), read back once, and
named (ids, tokens, the weights, whether they can learn); at a violation, the ids used that no
message named yet. The counting per step and the repair: guard/device/untrained.py."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from guard.checks import untrained_rows as spec
from guard.device.flags import Flags
from guard.device.reading import Reading
from guard.device.rows import head_weights
from guard.device.sharded import RowShard
from guard.device.untrained import Rows, UntrainedRows
from guard.device.untrained_rules import classify, row_features
from guard.policy import Action, Policy
from guard.vocab.discover import Heads
from guard.vocab.real import checkpoint_dir
from guard.vocab.resolve import Sizes
from guard.vocab.tokenizer_files import tokenizer_tokens
from guard.vocab.untrained_rules import id_list, reasons

__all__ = ["Untrained", "find_untrained", "token_names"]

log = logging.getLogger("guard")

def token_names(ids: list[int], tokenizer: Any = None, model: Any = None) -> dict[int, str]:
    """id -> token: from the tokenizer given, else the tokenizer files of the directory the
    model was loaded from; {} when neither names them."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if callable(convert) and ids:
        names = convert(list(ids))
        if isinstance(names, list):
            return {i: t for i, t in zip(ids, names, strict=False) if isinstance(t, str)}
    where = checkpoint_dir(model)
    try:
        return tokenizer_tokens(Path(where), ids) if where is not None and ids else {}
    except Exception:  # names are a courtesy; find_real said why they fail
        return {}


class Untrained:
    """What was found at attach, and the device state that watches it."""

    def __init__(self, weights: list[Rows], flags: Flags, policy: Policy,
                 tokens: dict[int, str], embedding: str, head: str) -> None:
        self.weights = [w for w in weights if w.ids]
        self.device = UntrainedRows(weights, flags)
        self.policy, self.tokens = policy, tokens
        self._modules = (embedding, head)  # the modules' own names, for PEFT's modules_to_save
        self._named: set[int] = set()  # the ids a message named

    def _frozen(self, weights: list[Rows]) -> str:
        """What a frozen weight means for its rows, and the fix; "" when all can learn."""
        frozen = [w.head.name for w in weights if not w.head.weight.requires_grad]
        if not frozen:
            return ""
        mean = ("; the repair gives them the mean of the trained rows, no more"
                if self.policy.action("untrained_rows") is Action.REPAIR else "")
        return (f" {' and '.join(frozen)} {'is' if len(frozen) == 1 else 'are'} frozen "
                f"(requires_grad=False, as LoRA leaves them): these rows can never learn{mean}"
                ". To train them, make the embedding and the head trainable (PEFT: "
                f"modules_to_save={[m.rsplit('.', 1)[-1] for m in self._modules]!r}, or "
                "trainable_token_indices with these ids).")

    def attach_message(self, rank: int) -> str | None:
        """What was found, said once at attach (None: nothing)."""
        if not self.weights:
            return None
        real = max(w.head.real for w in self.weights)
        total = len({i for w in self.weights for i in w.ids})
        rules = self.policy.checks.untrained_rows
        found = "; ".join(f"{w.head.name}: {len(w.ids)} rows, ids {id_list(w.ids, self.tokens)} "
                          f"({reasons(w.ids, w.why, rules, w.reference)})" for w in self.weights)
        action = self.policy.action("untrained_rows")
        then = {Action.REPAIR: "their rows are set to the mean of the trained rows before its "
                               "update (action: repair)",
                Action.FAIL: "training stops before its update (action: fail)",
                Action.WARN: "it is logged (action: warn)"}[action]
        return (f"untrained_rows on rank {rank} at attach: {total} ids of the real vocab [0, "
                f"{real}) have rows that look never trained: {found}. A training step that uses "
                f"them is counted (untrained_tokens), and {then}.{self._frozen(self.weights)}")

    def detail(self, reading: Reading, reduce: bool) -> str:
        """At a violation: the ids used that no message named yet (one read of n + 1 marks,
        only when NEW says there are some), and where their rows are."""
        if reading.glob[spec.SPEC].new <= 0:
            return ""
        new = self.device.take_new(reduce=reduce).tolist()
        ids = [i for i, hit in zip(self.device.ids, new, strict=True) if hit]
        earlier, self._named = bool(self._named), self._named | set(ids)
        weights = [w for w in self.weights if set(w.ids) & set(ids)]
        where = " and ".join(w.head.name for w in weights)
        return (f"{'among them, first used now: ' if earlier else ''}"
                f"{'id' if len(ids) == 1 else 'ids'} {id_list(ids, self.tokens)} (untrained in "
                f"{where}){self._frozen(weights)}")


def find_untrained(policy: Policy, flags: Flags, heads: Heads, sizes: Sizes, *,
                   tokenizer: Any = None, model: Any = None) -> Untrained | None:
    """The untrained rows of the embedding and an untied head (None: the check is off, or
    the head is a vocab-parallel shard, which it does not read)."""
    if not policy.enabled("untrained_rows"):
        return None
    if sizes.shard is not None:
        log.info("guard: untrained_rows does not read a vocab-parallel head (vocab_shard=%s): "
                 "run `guard audit` on the checkpoint instead", sizes.shard)
        return None
    rules = policy.checks.untrained_rows
    found = []
    with torch.no_grad():
        for h in head_weights(heads, sizes.first_padding):
            shard = RowShard.of(h.weight, h.name, "untrained_rows")
            features, prints = row_features(shard, min(h.real, h.weight.shape[0]))
            why, reference = classify(features, prints, epsilon=rules.epsilon,
                                      norm_ratio=rules.norm_ratio, duplicates=rules.duplicates)
            ids = why.nonzero().flatten().tolist()  # attach: the one read of what was found
            # nn.Embedding keeps its padding_idx row at zero and never updates it (HF sets it
            # from config.pad_token_id): a row by design, left out and out of the mean.
            pad = getattr(heads.embedding, "padding_idx", None) if "embedding" in h.roles \
                else None
            exempt = [pad] if isinstance(pad, int) and 0 <= pad < h.real else []
            kept = [(i, w) for i, w in zip(ids, why[ids].tolist(), strict=True) if i not in exempt]
            ref = reference.item()
            found.append(Rows(h, shard, [i for i, _ in kept], [w for _, w in kept],
                              ref if math.isfinite(ref) else 0.0, exempt))
    tokens = token_names(sorted({i for w in found for i in w.ids}), tokenizer, model)
    return Untrained(found, flags, policy, tokens, heads.embedding_name, heads.lm_head_name)
