"""The vocab sizes of a guarded model, resolved once at attach, and the public `audit()`.

Three sizes exist (docs/checks.md, "The real vocab"): `real` (ids the tokenizer can
produce), `rows` (of the embedding / lm_head) and the aligned size. A vocab-parallel head adds
its shard: the global ids [start, end) of its output columns. Everything downstream takes its
numbers from one `Sizes`, so no part computes a real vocab or a first padding row of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from guard.errors import AttachError
from guard.policy import VocabSection
from guard.vocab.discover import Heads, discover
from guard.vocab.layout import layout_of
from guard.vocab.parallel import VocabShard
from guard.vocab.real import GIVE_IT, Real, find_real
from guard.vocab.sizes import Audit, audit_sizes
from guard.wrappers import unwrap

__all__ = ["Sizes", "audit", "resolve"]


@dataclass(frozen=True)
class Sizes:
    """The vocab sizes of one guarded model on this process."""

    audit: Audit  # real, rows and embedding rows of the whole vocab, aligned, their problems
    shard: tuple[int, int] | None  # global ids [start, end) of this process's head columns
    columns: int  # of this process's head output: `rows`, or the shard's width
    real_columns: int  # head columns [0, real_columns) are real ids (fewer on a padding shard)
    # The first padding row of the embedding's weight and of the head's, in their own row
    # numbers: the real vocab, or the head's real columns on a shard.
    first_padding: tuple[int, int]
    found: Real  # where the real vocab came from (not found: every row taken as real)
    # The head's shard of the vocab and the ranks of the others (None: the whole vocab).
    tp: VocabShard | None = None

    @property
    def real(self) -> int:
        """The real vocab as given (it may exceed the rows: a `vocab` violation)."""
        return self.audit.real

    @property
    def rows(self) -> int:
        """Rows of the whole vocab (of every shard together)."""
        return self.audit.rows

    @property
    def mass_over(self) -> tuple[int, int]:
        """(real, columns) of the softmax the padding mass is measured over: the whole vocab,
        its shards' parts combined over their ranks; a shard's own columns in a process
        without the other shards (no torch.distributed)."""
        if self.tp is not None and self.tp.group is None:
            return self.real_columns, self.columns
        return self.real_rows, self.rows

    @property
    def real_rows(self) -> int:
        """Ids [0, real_rows) are real and have a row: the real vocab, clipped to the rows."""
        return min(self.audit.real, self.audit.rows)


def resolve(heads: Heads, vocab: VocabSection, *, vocab_size: int | None = None,
            tokenizer: Any = None, vocab_shard: tuple[Any, ...] | None = None,
            model: nn.Module | None = None) -> Sizes:
    """The sizes from the heads, the policy's vocab section and attach's arguments (else what
    `model` says of its real vocab); an AttachError names the argument that does not fit."""
    layout = layout_of(heads, model, vocab_shard, vocab.tensor_parallel)
    rows, head = layout.rows, layout.head
    found = find_real(model, {"vocab_size=": vocab_size,
                              "policy vocab.real_size": vocab.real_size}, tokenizer, rows)
    if not found.found and vocab.require_real_size:
        raise AttachError(
            f"the real vocab size was not found ({found.looked}) and the policy sets "
            f"vocab.require_real_size: true; give it: {GIVE_IT}")
    real = found.size
    if head is not None and real <= head.start:
        raise AttachError(
            f"the head's columns here, the ids [{head.start}, {head.end}) ({head.source}), "
            f"holds padding ids only (real vocab {real}): the guard needs at least one real id per "
            "shard of a vocab-parallel head; use fewer padding rows or a smaller "
            "tensor-parallel degree for the vocab")
    aud = audit_sizes(real=real, rows=rows, embedding_rows=layout.embedding_rows,
                      tied=heads.tied, pad_multiple=vocab.pad_multiple,
                      tensor_parallel=layout.tensor_parallel)
    if head is None:
        columns, real_columns, shard = rows, min(real, rows), None
    else:  # the head's columns are global ids [start, end): padding from id `real` on
        columns, shard = head.width, (head.start, head.end)
        real_columns = min(max(real - head.start, 0), columns)
    return Sizes(aud, shard, columns, real_columns, layout.first_padding(real), found, head)


def audit(model: nn.Module, *, vocab_size: int | None = None, tokenizer: Any = None,
          tensor_parallel: int = 1, pad_multiple: int = 64, embedding: nn.Module | None = None,
          lm_head: nn.Module | None = None) -> Audit:
    """The three vocab sizes of `model`, tied or not, and alignment for TP 1/2/4/8."""
    inner = unwrap(model)
    heads = discover(inner, embedding=embedding, lm_head=lm_head)
    vocab = VocabSection(pad_multiple=pad_multiple, tensor_parallel=tensor_parallel)
    return resolve(heads, vocab, vocab_size=vocab_size, tokenizer=tokenizer, model=inner).audit
