"""The untrained_rows check's state: at attach the rows of the real vocab that were never
trained are found on the device (guard/weights/features.py), read back once and named
(ids, tokens, the weights, whether they can learn); every step the ids that fall on them are
counted on the device and, under `repair`, their rows repaired (guard/device/
untrained_tables.py); at a violation, the ids used that no message named yet."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from guard.checkpoint.tokenizer_files import tokenizer_tokens
from guard.checkpoint.untrained_rules import by_reason, id_list, reasons
from guard.checks import untrained_rows
from guard.device.reading import Reading
from guard.device.untrained_tables import UntrainedTables, UntrainedWeight
from guard.policy import Action, Policy
from guard.stateful.stages import from_the_rank_that_fired, ids_of_every_stage
from guard.stateful.state import Attaching, CheckState, Finding
from guard.vocab.discover import weight_shape
from guard.vocab.real import checkpoint_dir
from guard.vocab.stage import Stage
from guard.weights.features import classify, row_features
from guard.weights.masters import Masters
from guard.weights.rows import rows_of
from guard.weights.vocab import unread_rows, vocab_weights
from guard.weights.zero_rows import unreadable
from guard_server.wire import IdKind

__all__ = ["UntrainedRowsState", "token_names"]

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


class UntrainedRowsState(CheckState):
    """What was found at attach, and the lookup tables that watch it on the device."""

    spec = untrained_rows.SPEC

    def __init__(self, weights: list[UntrainedWeight], tables: UntrainedTables, policy: Policy,
                 tokens: dict[int, str], modules: tuple[str, str]) -> None:
        self.weights = [w for w in weights if w.ids]
        self.tables = tables
        self.policy, self.tokens = policy, tokens
        self._modules = modules  # the embedding's and the head's names, for PEFT's message
        self._named: set[int] = set()  # the ids a message named
        self._unread: str | None = None  # the weights whose rows cannot be read, and why
        self.stage: Stage | None = None  # a pipeline stage: its rows are some of the ids'

    @classmethod
    def attach(cls, at: Attaching) -> UntrainedRowsState | None:
        """The untrained rows of the embedding and an untied head (None: the head is a
        vocab-parallel shard held as a plain tensor, Megatron's or one sharded by hand, which
        it does not read; a DTensor's rows it reads in global numbers)."""
        sizes, heads = at.sizes, at.heads
        if sizes.tp is not None and not sizes.tp.dtensor:
            log.info("untrained_rows does not read a vocab-parallel head held as a plain "
                     "tensor (%s, ids %s): run `guard audit` on the checkpoint instead",
                     sizes.tp.source, sizes.shard)
            return None
        rules = at.policy.checks.untrained_rows
        found = []
        with torch.no_grad():
            for h in vocab_weights(heads, sizes.first_padding):
                if unreadable(h.tensor) is not None:  # said at attach (unread)
                    continue
                shard = rows_of(h.tensor, h.name, "untrained_rows")
                features, prints = row_features(shard, min(h.real, weight_shape(h.tensor)[0]))
                why, reference = classify(features, prints, epsilon=rules.epsilon,
                                          norm_ratio=rules.norm_ratio,
                                          duplicates=rules.duplicates)
                ids = why.nonzero().flatten().tolist()  # attach: the one read of what was found
                # nn.Embedding keeps its padding_idx row at zero and never updates it (HF sets
                # it from config.pad_token_id): a row by design, left out and out of the mean.
                pad = getattr(heads.embedding, "padding_idx", None) \
                    if "embedding" in h.roles else None
                exempt = [pad] if isinstance(pad, int) and 0 <= pad < h.real else []
                kept = [(i, w) for i, w in zip(ids, why[ids].tolist(), strict=True)
                        if i not in exempt]
                ref = reference.item()
                found.append(UntrainedWeight(h, shard, [i for i, _ in kept], [w for _, w in kept],
                                             ref if math.isfinite(ref) else 0.0, exempt))
        every = ids_of_every_stage(sorted({i for w in found for i in w.ids}), at.stage)
        tokens = token_names(every, at.tokenizer, at.model)
        tables = UntrainedTables(found, at.flags, Masters(at.optimizer), every)
        state = cls(found, tables, at.policy, tokens, (heads.embedding_name, heads.lm_head_name))
        state._unread = unread_rows(heads, sizes.first_padding)
        state.stage = at.stage
        return state

    def unread(self) -> str | None:
        return self._unread

    @property
    def reads_at_attach(self) -> bool:
        # When no row is untrained the first step's read says so (the rows left: 0).
        return self.tables.n > 0

    def watches(self, kind: IdKind) -> bool:
        return self.tables.watches(kind)

    def count(self, kind: IdKind, ids: torch.Tensor) -> None:
        self.tables.count(kind, ids)

    def check(self) -> None:
        self.tables.check()

    def repair(self) -> None:
        self.tables.repair()

    def findings(self) -> tuple[Finding, ...]:
        out = []
        for w in self.weights:
            why = {i: name for name, ids in by_reason(w.ids, w.why).items() for i in ids}
            out.append(Finding("untrained_rows", w.weight.name, w.weight.roles, tuple(w.ids),
                               tuple(why[i] for i in w.ids)))
        return tuple(out)

    def _frozen(self, weights: list[UntrainedWeight]) -> str:
        """What a frozen weight means for its rows, and the fix; "" when all can learn."""
        frozen = [w.weight.name for w in weights if not w.weight.tensor.requires_grad]
        if not frozen:
            return ""
        mean = ("; the repair gives them the mean of the trained rows, no more"
                if self.policy.action("untrained_rows") is Action.REPAIR else "")
        return (f" {' and '.join(frozen)} {'is' if len(frozen) == 1 else 'are'} frozen "
                f"(requires_grad=False, as LoRA leaves them): these rows can never learn{mean}"
                ". To train them, make the embedding and the head trainable (PEFT: "
                f"modules_to_save={[m.rsplit('.', 1)[-1] for m in self._modules]!r}, or "
                "trainable_token_indices with these ids).")

    def attach_note(self, rank: int) -> str | None:
        if not self.weights:
            return None
        real = max(w.weight.real for w in self.weights)
        total = len({i for w in self.weights for i in w.ids})
        rules = self.policy.checks.untrained_rows
        found = "; ".join(f"{w.weight.name}: {len(w.ids)} rows, ids {id_list(w.ids, self.tokens)}"
                          f" ({reasons(w.ids, w.why, rules, w.reference)})" for w in self.weights)
        action = self.policy.action("untrained_rows")
        then = {Action.REPAIR: "their rows are set to the mean of the trained rows before its "
                               "update (action: repair)",
                Action.FAIL: "training stops before its update (action: fail)",
                Action.WARN: "it is logged (action: warn)"}[action]
        return (f"untrained_rows on rank {rank} at attach: {total} ids of the real vocab [0, "
                f"{real}) have rows that look never trained: {found}. A training step that uses "
                f"them is counted (untrained_tokens), and {then}.{self._frozen(self.weights)}")

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        """The ids used that no message named yet (one read of n + 1 marks, only when NEW says
        there are some), and where their rows are."""
        if reading.glob[untrained_rows.SPEC].new <= 0:
            return ""
        new = self.tables.take_new(reduce=reduce).tolist()
        ids = [i for i, hit in zip(self.tables.ids, new, strict=True) if hit]
        earlier, self._named = bool(self._named), self._named | set(ids)
        weights = [w for w in self.weights if set(w.ids) & set(ids)]
        where = from_the_rank_that_fired(" and ".join(w.weight.name for w in weights), reading,
                                         self.check_name, self.stage, reduce=reduce,
                                         every_rank=True)
        return (f"{'among them, first used now: ' if earlier else ''}"
                f"{'id' if len(ids) == 1 else 'ids'} {id_list(ids, self.tokens)} (untrained in "
                f"{where}){self._frozen(weights)}")

