"""A pipeline stage at attach: which ends of the model it holds (the token embedding on the
first stage, the lm_head on the last, both, or neither in the middle), found from the module,
from torch's `PipelineStage` or DeepSpeed's `PipelineModule`, and whether the two ends are tied
copies held by two stages (Megatron's `share_embeddings_and_output_weights`, DeepSpeed's
`TiedLayerSpec`, or `tied_across_stages=True`).

An end the stage does not hold is an `Absent` stand-in: a module never called, whose weight
has a shape (the rows the other end or the vocab says) and no tensor, so the checks of that
end see nothing on this stage and read no rows; coverage counts only what the stage holds.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from guard.errors import AttachError
from guard.vocab import megatron
from guard.vocab.discover import Heads, discover, weight_shape
from guard.vocab.names import HEAD_NAMES
from guard.vocab.sizes import pad_vocab_size

__all__ = ["Absent", "Stage", "forward_fn_head", "stage_heads", "stage_of"]

log = logging.getLogger("guard")


@dataclass(frozen=True)
class Stage:
    """What this process's stage holds of the model, and where that was learnt."""

    embedding: bool  # the token embedding (the first stage)
    head: bool  # the lm_head and the loss (the last stage)
    index: int | None = None  # of the stage in the pipeline, where known
    count: int | None = None  # stages in the pipeline, where known
    tied: bool = False  # the embedding and the head are tied copies on two stages
    source: str = "the module"  # PipelineStage, DeepSpeed's PipelineModule, the module

    @property
    def name(self) -> str:
        where = "" if self.index is None else f" {self.index}" + (
            "" if self.count is None else f" of {self.count}")
        holds = {(True, True): "both ends", (True, False): "the embedding",
                 (False, True): "the head", (False, False): "neither end"}[
            (self.embedding, self.head)]
        return f"pipeline stage{where} ({holds})"


class _Shape:
    """A weight that is only a shape: no tensor, so no check reads or writes its rows."""

    def __init__(self, rows: int, width: int) -> None:
        self.shape = (rows, width)


class Absent(nn.Module):
    """The end a pipeline stage does not hold: never called, so its hooks never run."""

    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.weight: Any = _Shape(rows, width)
        self.num_embeddings = self.out_features = rows


def stage_of(obj: object) -> tuple[object, Stage | None]:
    """(the module inside, what its pipeline says of the stage) for torch's `PipelineStage`
    (its `.submod`) and DeepSpeed's `PipelineModule` (the module itself); (obj, None) else."""
    # A PipelineStage is not a module; a module's getattr can raise other than AttributeError
    # (a compiled module without its _orig_mod: KeyError), so modules are not asked.
    submod = None if isinstance(obj, nn.Module) else getattr(obj, "submod", None)
    if isinstance(submod, nn.Module) and isinstance(getattr(obj, "stage_index", None), int) \
            and isinstance(getattr(obj, "num_stages", None), int):
        held: Any = obj
        i, n = int(held.stage_index), int(held.num_stages)
        return submod, Stage(i == 0, i == n - 1, i, n, source="PipelineStage")
    if isinstance(obj, nn.Module) and type(obj).__name__ == "PipelineModule" and \
            isinstance(getattr(obj, "stage_id", None), int):
        ds: Any = obj
        i, n = int(ds.stage_id), int(ds.num_stages)
        tied = bool(getattr(obj, "tied_modules", None)) and n > 1
        return obj, Stage(i == 0, i == n - 1, i, n, tied, "DeepSpeed's PipelineModule")
    return obj, None


def _ends(model: nn.Module, embedding: nn.Module | None,
          lm_head: nn.Module | None) -> tuple[bool, bool]:
    """Whether `model` holds an embedding and a head at all (given, or any candidate)."""
    has_emb = embedding is not None or any(
        isinstance(m, nn.Embedding) or megatron.is_vocab_parallel_embedding(m)
        for m in model.modules())
    has_head = lm_head is not None or any(
        (isinstance(m, nn.Linear) or megatron.is_column_parallel(m))
        and n.rsplit(".", 1)[-1] in HEAD_NAMES
        for n, m in model.named_modules())
    return has_emb, has_head


def stage_heads(model: nn.Module, *, embedding: nn.Module | None, lm_head: nn.Module | None,
                stage: Stage | None, vocab_size: int | None,
                tied: bool | None) -> tuple[Heads, Stage | None]:
    """The heads of a whole model as `discover` finds them (stage None), or of a stage: the
    ends it holds, an `Absent` stand-in for the others. A module without an embedding or
    without a head is a stage (a model cannot train without both); one the pipeline says
    should hold an end it lacks is an AttachError naming the argument that gives it."""
    if stage is None and tied is None:
        # A whole model first: discovery knows more head shapes (torchtune's TiedLinear, a
        # head found by its rows) than the stage test below. A module it cannot read is a
        # stage only in a distributed run, where a pipeline can hold the other end; in one
        # process it is a model missing a part, and discovery's error says which to pass.
        try:
            return discover(model, embedding=embedding, lm_head=lm_head), None
        except AttachError as e:
            if not _distributed():
                raise AttachError(f"{e}; if this module is one stage of a pipeline, attach "
                                  "it on every rank under torch.distributed, or attach its "
                                  "PipelineStage") from None
    has_emb, has_head = _ends(model, embedding, lm_head)
    if stage is None and has_emb and has_head:
        return discover(model, embedding=embedding, lm_head=lm_head), None
    if stage is None:
        stage = Stage(has_emb, has_head)
    if stage.head and not has_head and lm_head is None:
        lm_head = forward_fn_head(model)
        has_head = lm_head is not None
    if tied is not None:
        stage = Stage(stage.embedding, stage.head, stage.index, stage.count, tied, stage.source)
    for end, holds, arg in (("embedding", has_emb, "embedding="), ("head", has_head,
                                                                  "lm_head=")):
        if getattr(stage, end) and not holds:
            raise AttachError(f"{stage.name} ({stage.source}) should hold the {end} but none "
                              f"was found in {type(model).__name__}; pass {arg}<its module>")
    if stage.embedding and stage.head:
        return discover(model, embedding=embedding, lm_head=lm_head), stage
    found = _held(model, embedding, lm_head, stage)
    rows = _rows(found, vocab_size)
    width = weight_shape(getattr(found, "weight", None))[-1:] or (1,) if found else (1,)
    absent = Absent(rows, width[0])
    if stage.embedding:
        heads = Heads(found or absent, absent, _name(model, found), "<no head on this stage>")
    elif stage.head:
        full = discover(model, embedding=absent, lm_head=lm_head)
        heads = Heads(absent, full.lm_head, "<no embedding on this stage>", full.lm_head_name,
                      full.final_norm, (), full.head_weights)
    else:
        heads = Heads(absent, Absent(rows, 1), "<no embedding on this stage>",
                      "<no head on this stage>")
    log.info("%s (from %s): checking %s", stage.name, stage.source, _checks(stage))
    return heads, stage


def forward_fn_head(model: nn.Module) -> nn.Module | None:
    """The head of DeepSpeed's last stage when it is a tied module called through a
    `forward_fn` (`TiedLayerSpec(key, ..., forward_fn=...)` puts `partial(forward_fn, module)`
    in the stage's `forward_funcs`): the last such module. Its forward hooks never run: the
    guard measures and masks its logits where `g.loss_fn` is given them."""
    calls = getattr(model, "forward_funcs", None)
    if type(model).__name__ != "PipelineModule" or not isinstance(calls, list):
        return None
    found = [c.args[0] for c in calls if isinstance(c, functools.partial) and c.args
             and isinstance(c.args[0], nn.Module)]
    return found[-1] if found else None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _held(model: nn.Module, embedding: nn.Module | None, lm_head: nn.Module | None,
          stage: Stage) -> nn.Module | None:
    if stage.embedding:
        if embedding is not None:
            return embedding
        embs = [m for m in model.modules() if isinstance(m, nn.Embedding)
                or megatron.is_vocab_parallel_embedding(m)]
        if len(embs) != 1:
            raise AttachError(f"{stage.name}: {len(embs)} embedding modules; pass "
                              "embedding=<the token embedding module>")
        return embs[0]
    if stage.head:
        return discover(model, embedding=Absent(1, 1), lm_head=lm_head).head_holder
    return None


def _rows(found: nn.Module | None, vocab_size: int | None) -> int:
    if found is not None:
        rows = megatron.rows_of(found)
        return rows if rows is not None else weight_shape(getattr(found, "weight", None))[0]
    if vocab_size is None:  # a middle stage: no rows of its own, none read
        return 1
    return pad_vocab_size(vocab_size)


def _name(model: nn.Module, m: nn.Module | None) -> str:
    return next((n for n, x in model.named_modules() if x is m), "<embedding>")


def _checks(stage: Stage) -> str:
    parts = ["its parameters' gradients"]
    if stage.embedding:
        parts.insert(0, "the input ids and the embedding's rows")
    if stage.head:
        parts.insert(0, "the logits, the labels and the loss (wrap the schedule's loss_fn "
                        "with g.loss_fn) and the head's rows")
    return ", ".join(parts)
