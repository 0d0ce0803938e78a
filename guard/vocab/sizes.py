"""Vocabulary arithmetic and the attach-time audit of the three vocab sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TP_DEGREES", "Audit", "audit_sizes", "pad_vocab_size", "shard_sizes"]

# Tensor-parallel degrees the audit reports on: the ones real clusters use for the vocab split.
TP_DEGREES = (1, 2, 4, 8)

# Padding beyond one alignment block is there on purpose, and vendors reserve a little: Qwen2
# 271 rows of 151,936 (1/560), GPT-NeoX-20B 155 of 50,432 (1/325), Megatron's GPT-2 at TP 8
# 943 of 51,200 (1/54). More than 1/32 of the rows in padding is a tokenizer of another model
# (600 ids on 1024 rows: 41%).
_PADDING_SHARE = 32


def pad_vocab_size(n: int, multiple: int = 64) -> int:
    """Smallest multiple of `multiple` that is >= n (50257 -> 50304, 50000 -> 50048 for 64)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"pad_vocab_size: n must be a positive int, got {n!r}")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_vocab_size: multiple must be a positive int, got {multiple!r}")
    return ((n + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class Audit:
    """The three vocab sizes of a model and what is wrong with them."""

    real: int  # ids the tokenizer can produce
    rows: int  # rows of the output head: the logits' last dimension
    embedding_rows: int
    tied: bool
    pad_multiple: int
    tensor_parallel: int
    aligned: int  # pad_vocab_size(max(real, rows), pad_multiple * tensor_parallel)
    aligned_for_tp: dict[int, bool] = field(default_factory=dict)
    alignment_problems: tuple[str, ...] = ()
    vocab_problems: tuple[str, ...] = ()
    # Sizes that fit but look wrong (a tokenizer that is likely not the model's): a `vocab`
    # warning whatever the action, never a stop; `ok` stays true.
    vocab_warnings: tuple[str, ...] = ()

    @property
    def padding_columns(self) -> int:
        return max(self.rows - self.real, 0)

    @property
    def ok(self) -> bool:
        return not (self.alignment_problems or self.vocab_problems)

    def to_dict(self) -> dict[str, object]:
        return {
            "real": self.real,
            "rows": self.rows,
            "embedding_rows": self.embedding_rows,
            "aligned": self.aligned,
            "tied": self.tied,
            "pad_multiple": self.pad_multiple,
            "tensor_parallel": self.tensor_parallel,
            "aligned_for_tp": {str(tp): ok for tp, ok in self.aligned_for_tp.items()},
            "alignment_problems": list(self.alignment_problems),
            "vocab_problems": list(self.vocab_problems),
            "vocab_warnings": list(self.vocab_warnings),
            "ok": self.ok,
        }

    def __str__(self) -> str:
        tp = "  ".join(f"tp{d}:{'ok' if ok else 'NO'}" for d, ok in self.aligned_for_tp.items())
        lines = [
            f"vocab audit: real={self.real} rows={self.rows} aligned={self.aligned} "
            f"(multiple of {self.pad_multiple} x tp {self.tensor_parallel})",
            f"  embedding rows={self.embedding_rows}  head rows={self.rows}  "
            f"weights {'tied' if self.tied else 'untied'}  padding columns={self.padding_columns}",
            f"  aligned for {tp}",
        ]
        problems = self.alignment_problems + self.vocab_problems
        lines += [f"  warning: {w}" for w in self.vocab_warnings]
        if not problems:
            lines.append("  verdict: ok" + (" (but see the warning)" if self.vocab_warnings
                                            else ""))
            if self.padding_columns:
                lines.append(
                    f"  note: columns [{self.real}, {self.rows}) are padding; keep "
                    "checks.padding_mass.action: mask so they get no probability"
                )
            return "\n".join(lines)
        lines.append("  verdict: NOT OK")
        lines += [f"  - {p}" for p in problems]
        lines.append(
            f"  fix: build embedding and lm_head with {self.aligned} rows "
            f"(HF: model.resize_token_embeddings({self.real}, "
            f"pad_to_multiple_of={self.pad_multiple * self.tensor_parallel})), "
            f"and mask columns [{self.real}, {self.aligned}) (checks.padding_mass.action: mask)"
        )
        return "\n".join(lines)


def audit_sizes(
    *,
    real: int,
    rows: int,
    embedding_rows: int,
    tied: bool,
    pad_multiple: int = 64,
    tensor_parallel: int = 1,
) -> Audit:
    """Audit from sizes alone, so modules and checkpoint headers share one rule."""
    multiple = pad_multiple * tensor_parallel
    alignment: list[str] = []
    for name, n in (("head", rows), ("embedding", embedding_rows)):
        if n % multiple:
            alignment.append(
                f"{name} rows {n} are not a multiple of {multiple} "
                f"({pad_multiple} x tensor_parallel {tensor_parallel}); "
                f"next aligned size is {pad_vocab_size(n, multiple)}"
            )
        if name == "head" and rows == embedding_rows:
            break  # one message when both agree
    vocab: list[str] = []
    if embedding_rows != rows:
        vocab.append(
            f"embedding rows {embedding_rows} != head rows {rows}: ids and logits disagree "
            "on the vocabulary"
        )
    if real > rows:
        vocab.append(
            f"real vocab {real} > head rows {rows}: the tokenizer produces ids "
            f"[{rows}, {real}) that have no row (index error or silent garbage)"
        )
    if real > embedding_rows and embedding_rows != rows:
        vocab.append(f"real vocab {real} > embedding rows {embedding_rows}")
    warnings = []
    if (padding := rows - real) >= max(multiple, rows // _PADDING_SHARE):
        warnings.append(
            f"{padding} padding rows ({real} real ids in {rows} rows): more than aligning to a "
            f"multiple of {multiple} explains (fewer than {multiple}) and over 1/{_PADDING_SHARE}"
            " of the rows, so the real vocab is likely another model's (a tokenizer that does "
            "not belong to these weights?); if the rows were padded on purpose, set "
            "vocab.pad_multiple to the multiple they were padded to")
    return Audit(
        real=real,
        rows=rows,
        embedding_rows=embedding_rows,
        tied=tied,
        pad_multiple=pad_multiple,
        tensor_parallel=tensor_parallel,
        aligned=pad_vocab_size(max(real, rows, embedding_rows), multiple),
        aligned_for_tp={tp: rows % (pad_multiple * tp) == 0 for tp in TP_DEGREES},
        alignment_problems=tuple(alignment),
        vocab_problems=tuple(vocab),
        vocab_warnings=tuple(warnings),
    )


def shard_sizes(shard: tuple[int, int], head_rows: int, tensor_parallel: int) -> int:
    """Rows of the whole vocab for a head that holds columns [start, end) of it.

    Vocab-parallel heads (Megatron's VocabParallelEmbedding / ColumnParallelLinear, DTensor
    Shard(0)) split the rows in `tensor_parallel` equal shards; anything else is an error.
    """
    ok = (isinstance(shard, tuple | list) and len(shard) == 2
          and all(isinstance(n, int) and not isinstance(n, bool) for n in shard)
          and 0 <= shard[0] < shard[1])
    if not ok:
        raise ValueError(f"vocab_shard must be (start, end) with 0 <= start < end, got {shard!r}")
    start, end = shard
    width = end - start
    problems = []
    if width != head_rows:
        problems.append(f"it spans {width} ids but the head has {head_rows} output columns")
    elif start % width or end > width * tensor_parallel:
        problems.append(f"it is not one of vocab.tensor_parallel={tensor_parallel} equal shards "
                        f"of {width} columns")
    if problems:
        raise ValueError(f"vocab_shard=({start}, {end}): {problems[0]}; pass the global token "
                         "ids [start, end) of this rank's head columns and set "
                         "vocab.tensor_parallel to the tensor-parallel degree")
    return width * tensor_parallel
