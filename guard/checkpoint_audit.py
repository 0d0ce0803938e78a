"""The vocab audit of a Hugging Face model directory, without loading a weight (`guard audit`).

Sizes come from config.json, the tokenizer files (tokenizer.json, else vocab.json /
added_tokens.json, else a sentencepiece tokenizer.model) and the safetensors headers; the
files whose rows are read are validated by the safetensors library. The directory is
untrusted input: every file is read within a bound (guard/checkpoint/files.py), and names from it
are printed escaped. The same `audit_sizes` rule as `guard.attach` decides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from guard.checkpoint.files import load_json
from guard.checkpoint.safetensors_header import Tensor, read_tensors, safetensors_shapes
from guard.checkpoint.safetensors_rows import RowStats, row_stats
from guard.checkpoint.safetensors_untrained import UntrainedStats, untrained_stats
from guard.checkpoint.tokenizer_files import tokenizer_tokens, tokenizer_vocab
from guard.errors import CheckpointError
from guard.quote import quote, shown
from guard.vocab.names import HEAD_NAMES, NESTED_HEADS
from guard.vocab.sizes import Audit, audit_sizes

__all__ = ["CheckpointAudit", "TensorInfo", "audit_checkpoint", "safetensors_shapes"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Where HF architectures keep the token embedding (name suffixes) and the output head (GPT-2
# wte, Llama/Mistral/OPT embed_tokens, BLOOM/BERT word_embeddings, GPT-NeoX embed_in, T5
# shared); the head's names are guard/vocab/names.py's, shared with discovery.
_EMBEDDING = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
              "tok_embeddings.weight", "shared.weight")
_HEAD = tuple(f"{n}.weight" for n in NESTED_HEADS)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    file: str
    # The path read, when the weight map points outside the directory (`../x`, an absolute
    # path: transformers joins them the same way, so the audit reads what loading would).
    outside: str | None = None
    tensor: Tensor | None = field(default=None, compare=False, repr=False)  # validated

    def describe(self) -> str:
        where = f" (outside the checkpoint directory: read {shown(self.outside)})" \
            if self.outside is not None else ""
        return f"{shown(self.name)} {list(self.shape)} in {shown(self.file)}{where}"

    def to_dict(self) -> dict[str, object]:
        outside = {} if self.outside is None else {"outside": self.outside}
        return {"name": self.name, "shape": list(self.shape), "file": self.file, **outside}


Shapes = dict[str, dict[str, tuple[int, ...]]]  # file -> tensor name -> shape


def _weight_files(d: Path) -> tuple[dict[str, str], Shapes]:
    """Tensor name -> file name, from the shard index or the single file's header (and the
    shapes of that header, read once)."""
    index = d / INDEX
    if index.exists():
        data = load_json(index, 'a JSON object with a "weight_map" of tensor name -> file')
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(str(index), 'expected a "weight_map" of tensor name -> file')
        for name, file in wm.items():
            if not isinstance(file, str) or not file or "\0" in file:
                raise CheckpointError(str(index), f"weight_map[{quote(name)}] is "
                                      f"{quote(file)}; expected a file name")
        return wm, {}
    if (d / SINGLE).exists():
        shapes = safetensors_shapes(d / SINGLE)
        return dict.fromkeys(shapes, SINGLE), {SINGLE: shapes}
    other = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    found = f"; found {', '.join(other[:3])}, which this audit does not read" if other else ""
    raise CheckpointError(str(d), f"no {SINGLE} or {INDEX}{found}. Save with "
                          "save_pretrained(..., safe_serialization=True)")


def _outside(d: Path, file: str) -> str | None:
    """The real path of `file` when it lies outside `d` (after `..` and links), else None."""
    real, root = os.path.realpath(d / file), os.path.realpath(d)
    return None if os.path.commonpath([real, root]) == root else real


def _pick(names: list[str], suffixes: tuple[str, ...]) -> str | None:
    hits = [n for n in names if any(n == s or n.endswith("." + s) for s in suffixes)]
    return min(hits, key=lambda n: (len(n), n)) if hits else None  # the outermost one


def _find_heads(d: Path) -> tuple[TensorInfo, TensorInfo | None]:
    files, cache = _weight_files(d)
    names = sorted(files)
    emb_name, head_name = _pick(names, _EMBEDDING), _pick(names, _HEAD)
    if head_name is None:  # the generic names (original Llama's output): top level only
        head_name = next((f"{n}.weight" for n in HEAD_NAMES if f"{n}.weight" in files), None)
    if emb_name is None:
        where = INDEX if (d / INDEX).exists() else SINGLE
        raise CheckpointError(str(d / where), "no token embedding tensor; expected a name "
                              f"ending in one of {', '.join(_EMBEDDING)}")
    def info(name: str) -> TensorInfo:
        file = files[name]
        if file not in cache:
            cache[file] = safetensors_shapes(d / file)
        shape = cache[file].get(name)
        if shape is None or len(shape) != 2:
            raise CheckpointError(str(d / file), f"expected a 2-D tensor {name!r} (rows, hidden), "
                                  f"got {'none' if shape is None else list(shape)}")
        return TensorInfo(name, shape, file, _outside(d, file))

    found = [info(emb_name), *([] if head_name is None else [info(head_name)])]
    # The files whose rows are read: each validated whole by the library, once.
    tensors: dict[str, Tensor] = {}
    for file in {t.file for t in found}:
        tensors |= read_tensors(d / file, [t.name for t in found if t.file == file])
    emb, *head = [replace(t, tensor=tensors[t.name]) for t in found]
    return emb, head[0] if head else None


@dataclass(frozen=True)
class CheckpointAudit:
    """What `guard audit PATH` reports: where each size came from, and the audit."""

    path: str
    config_vocab_size: int | None
    real_source: str
    embedding: TensorInfo
    lm_head: TensorInfo | None  # None: absent from the checkpoint, tied to the embedding
    tie_source: str
    audit: Audit
    padding_rows: tuple[RowStats, ...] = ()
    unread_rows: tuple[str, ...] = ()  # tensors whose dtype the row reader does not decode
    # The rows of the real vocab that look never trained, per tensor (the embedding, an untied
    # head): a fault to fix before training, which a fine-tune that uses them trains on.
    untrained_rows: tuple[UntrainedStats, ...] = ()

    @property
    def ok(self) -> bool:
        return self.audit.ok and all(r.ok for r in self.padding_rows) and \
            all(u.ok for u in self.untrained_rows)

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "config_vocab_size": self.config_vocab_size,
                "real_source": self.real_source, "embedding": self.embedding.to_dict(),
                "lm_head": None if self.lm_head is None else self.lm_head.to_dict(),
                "tie_source": self.tie_source,
                "audit": self.audit.to_dict(),
                "padding_rows": [r.to_dict() for r in self.padding_rows],
                "untrained_rows": [u.to_dict() for u in self.untrained_rows],
                "unread_rows": list(self.unread_rows), "ok": self.ok}

    def __str__(self) -> str:
        h = self.lm_head
        head = (h.describe() if h is not None
                else "absent from the checkpoint (tied to the embedding)")
        lines = [
            f"checkpoint {shown(self.path)}",
            f"  config.json   vocab_size={self.config_vocab_size}",
            f"  tokenizer     real vocab {self.audit.real} from {shown(self.real_source)}",
            f"  embedding     {self.embedding.describe()}",
            f"  lm_head       {head}",
            f"  tied          {'yes' if self.audit.tied else 'no'} ({self.tie_source})",
        ]
        lines += [f"  rows          {r.describe()}" for r in self.padding_rows]
        lines += [f"  untrained     {u.describe()}" for u in self.untrained_rows]
        lines += [f"  rows          {shown(name)}: dtype not read; its rows are not checked"
                  for name in self.unread_rows]
        bad = [r for r in self.padding_rows if not r.ok]
        untrained = [u for u in self.untrained_rows if not u.ok]
        sizes = str(self.audit)
        if bad or untrained:  # the sizes may be fine; the checkpoint is not
            rows = " and ".join(w for w, b in (("padding rows", bad), ("untrained rows",
                                                                      untrained)) if b)
            sizes = sizes.replace("  verdict: ok", f"  verdict: NOT OK (sizes ok, {rows} not)")
        text = "\n".join(lines) + "\n" + sizes
        if bad:
            text += ("\n  padding rows NOT OK: " + "; ".join(r.describe() for r in bad) +
                     "\n  fix: overwrite them with the mean real row (guard.attach's "
                     "checks.padding_rows.action: repair does it in place) and save again; "
                     "until then they take probability wherever the padding columns are not "
                     "masked")
        if untrained:
            text += ("\n  untrained rows NOT OK: rows of the real vocab that no training reached"
                     " (their ids are above); a fine-tune that uses them trains on them. fix: "
                     "set them to the mean of the trained rows (guard.attach's "
                     "checks.untrained_rows.action: repair does it at their first use) and "
                     "save again")
        return text


def audit_checkpoint(path: str | Path, *, tensor_parallel: int = 1, pad_multiple: int = 64,
                     vocab_size: int | None = None) -> CheckpointAudit:
    """Audit a model directory; raises CheckpointError when it cannot be read."""
    d = Path(path)
    expected = "expected a Hugging Face model directory (config.json, tokenizer files, " \
               "*.safetensors)"
    if not d.exists():
        raise CheckpointError(str(d), f"does not exist; {expected}")
    if not d.is_dir():
        raise CheckpointError(str(d), f"not a directory; {expected}")
    config = load_json(d / "config.json", "the model's config.json (a JSON object)")
    if not isinstance(config, dict):
        raise CheckpointError(str(d / "config.json"), "expected a JSON object")
    # Multimodal configs keep the language model's vocab under text_config.
    sub = config.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else {}
    cfg_vocab = config.get("vocab_size", text.get("vocab_size"))
    cfg_vocab = cfg_vocab if isinstance(cfg_vocab, int) and not isinstance(cfg_vocab, bool) \
        and 0 <= cfg_vocab < 2**63 else None
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))

    emb, head = _find_heads(d)
    problems: list[str] = []
    if head is None:
        tied, tie_source = True, "no lm_head weight in the checkpoint"
        if tie is False:
            problems.append("config.json says tie_word_embeddings: false but the checkpoint has "
                            "no lm_head weight: loading it initialises a random output head")
    elif isinstance(tie, bool):
        tied, tie_source = tie, f"config.json tie_word_embeddings: {str(tie).lower()}"
    else:
        tied, tie_source = False, "lm_head weight saved, no tie_word_embeddings in config.json"
    rows = (head or emb).shape[0]
    if cfg_vocab is not None and cfg_vocab != rows:
        problems.append(f"config.json vocab_size {cfg_vocab} != {rows} rows of "
                        f"{shown((head or emb).name)}: the config and the weights disagree")

    if vocab_size is not None:
        real, source = vocab_size, "--vocab-size"
    else:
        found, source = tokenizer_vocab(d)
        real = found if found is not None else rows
        if found is None:
            source += f"; assumed = rows ({rows}), pass --vocab-size to audit the tokenizer"
    aud = audit_sizes(real=real, rows=rows, embedding_rows=emb.shape[0], tied=tied,
                      pad_multiple=pad_multiple, tensor_parallel=tensor_parallel)
    if problems:
        aud = replace(aud, vocab_problems=aud.vocab_problems + tuple(problems))
    tensors = [emb] if head is None else [emb, head]
    rows_read, unread = _padding_rows(d, real, tensors)
    pad = config.get("pad_token_id", text.get("pad_token_id"))
    untrained = _untrained_rows(d, min(real, rows), tensors,
                                pad if isinstance(pad, int) and not isinstance(pad, bool) else None)
    return CheckpointAudit(str(d), cfg_vocab, source, emb, head, tie_source, aud, rows_read,
                           unread, untrained)


def _untrained_rows(d: Path, real: int, tensors: list[TensorInfo],
                    pad: int | None) -> tuple[UntrainedStats, ...]:
    """The rows of [0, real) of each tensor that look never trained, by the guard's default
    rules, with their tokens; the embedding's pad row (HF's padding_idx: zero by design, never
    updated) is exempt, as at attach. Tensors whose dtype is not read are left out (unread)."""
    found = []
    for t in tensors:
        exempt = (pad,) if pad is not None and t is tensors[0] else ()
        stats = untrained_stats(d / t.file, t.name, real, exempt=exempt, tensor=t.tensor)
        if stats is not None:
            found.append(stats)
    ids = sorted({i for s in found for i in s.ids})
    try:
        tokens = tokenizer_tokens(d, ids) if ids else {}
    except CheckpointError:
        tokens = {}  # the sizes already read the tokenizer files; names are a courtesy
    return tuple(replace(s, tokens={i: tokens[i] for i in s.ids if i in tokens}) for s in found)


def _padding_rows(d: Path, real: int,
                  tensors: list[TensorInfo]) -> tuple[tuple[RowStats, ...], tuple[str, ...]]:
    """The padding rows [real, rows) of each tensor (read as a slice), and the tensors whose
    dtype this audit does not decode."""
    read, unread = [], []
    for t in tensors:
        if t.shape[0] <= real:
            continue
        stats = row_stats(d / t.file, t.name, real, t.shape[0], tensor=t.tensor)
        if stats is None:
            unread.append(t.name)
        else:
            read.append(stats)
    return tuple(read), tuple(unread)
