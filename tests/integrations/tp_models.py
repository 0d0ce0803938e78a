"""The tiny models the tensor-parallel workers train (tests/integrations/tp_worker.py): one LM
made three ways, from the same full weights, so each rank's run can be held against the
real-vocab model trained in one process on the same batches.

- `TinyLM` under torch's `parallelize_module`, torchtitan's plan: the embedding
  `RowwiseParallel` (vocab-parallel rows, global ids in), the head `ColwiseParallel`, its
  logits a DTensor sharded on the vocab for `loss_parallel` ("dtensor"), ColwiseParallel's
  default local shard ("local"), whose loss gathers the shards, or every column gathered on
  every rank ("gathered", torchtitan's plan without loss_parallel);
- `MegatronLM`: Megatron-core's `LanguageModelEmbedding` (a `VocabParallelEmbedding`) and a
  `ColumnParallelLinear` head (`gather_output=False`), `vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import guard

REAL, D, B, T = 1000, 16, 4, 16


def rows_for(tp: int) -> int:
    return guard.pad_vocab_size(REAL, 64 * tp)  # 1024 at TP 2 and 4


def full_weights(rows: int, *, garbage: bool = False, untrained: tuple[int, ...] = (),
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """The embedding's and the head's whole weights, alike on every rank: normal real rows,
    padding rows the mean of the real ones (HF's mean resize: healthy), or garbage in the
    head's (an uninitialised resize, norms ~100x the real rows'); `untrained` real rows 0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("embedding", "head"):
        w = torch.randn(rows, D, generator=g) * 0.5
        w[REAL:] = w[:REAL].mean(dim=0)
        if garbage and name == "head":
            w[REAL:] = torch.randn(rows - REAL, D, generator=g) * 100.0
        w[list(untrained)] = 0.0
        out[name] = w
    return out


def batch(step: int, *, ghost: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and labels of the real vocab; `ghost`: one input id and one label are
    padding ids (global ids: the vocab-parallel embedding takes them so)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    x, y = (torch.randint(0, REAL, (B, T), generator=g) for _ in range(2))
    if ghost:
        x[1, 2], y[0, 0] = REAL + 3, REAL + 7
    return x, y


class TinyLM(nn.Module):
    """tok -> tanh -> norm -> lm_head; forward(idx, labels) returns (logits, loss) with the
    loss `self.loss` makes of the head's output."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tok = nn.Embedding(weights["embedding"].shape[0], D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, weights["head"].shape[0], bias=False)
        with torch.no_grad():
            self.tok.weight.copy_(weights["embedding"])
            self.lm_head.weight.copy_(weights["head"])
        self.loss: Any = cross_entropy
        self.into_head: Any = lambda h: h  # what the head's input goes through

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> tuple[Any, Any]:
        h = self.into_head(self.norm(torch.tanh(self.tok(idx))))
        logits = self.lm_head(h)  # (B, T, columns)
        return logits, self.loss(logits, labels)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def real_vocab(weights: dict[str, torch.Tensor]) -> TinyLM:
    """The same model with the real rows only: what a masked run must train like."""
    return TinyLM({k: w[:REAL] for k, w in weights.items()})


def parallelized(weights: dict[str, torch.Tensor], form: str, mesh: Any) -> TinyLM:
    """TinyLM under torch's tensor parallel on `mesh` (1-D), torchtitan's plan."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = TinyLM(weights)
    head = {"dtensor": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            "local": ColwiseParallel(),
            "gathered": ColwiseParallel(output_layouts=Replicate())}[form]
    parallelize_module(model, mesh, {"tok": RowwiseParallel(input_layouts=Replicate()),
                                     "lm_head": head})
    if form == "local":  # the local shard: the loss gathers every shard's columns
        model.loss = lambda logits, labels: cross_entropy(
            DTensor.from_local(logits, mesh, [Shard(-1)]).full_tensor(), labels)
    return model


def by_hand(weights: dict[str, torch.Tensor], start: int, end: int, mesh: Any) -> TinyLM:
    """TinyLM whose head is a plain nn.Linear holding rows [start, end) (sharded by hand), the
    embedding replicated; the loss gathers every shard's columns."""
    from torch.distributed.tensor import DTensor, Shard

    model = TinyLM({"embedding": weights["embedding"], "head": weights["head"][start:end]})
    model.loss = lambda logits, labels: cross_entropy(
        DTensor.from_local(logits, mesh, [Shard(-1)]).full_tensor(), labels)
    model.into_head = _SumGradients.apply  # Megatron's copy_to_tensor_model_parallel_region
    return model


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the shards' gradients of the head's input, so the
    replicated layers below a hand-sharded head train as the whole model's."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad)
        return grad


class MegatronLM(nn.Module):
    """Megatron-core's embedding and output layer around a tanh and a LayerNorm; forward
    returns (logits, loss), the logits this rank's columns, in Megatron's (T, B) order."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.language_model_embedding import (
            LanguageModelEmbedding,
        )
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.transformer.transformer_config import TransformerConfig

        rows = weights["head"].shape[0]
        config = TransformerConfig(num_layers=1, hidden_size=D, num_attention_heads=4,
                                   use_cpu_initialization=True, hidden_dropout=0.0,
                                   tensor_model_parallel_size=torch.distributed.get_world_size())
        self.embedding = LanguageModelEmbedding(config, vocab_size=rows, max_sequence_length=T,
                                                position_embedding_type="learned_absolute")
        self.final_layernorm = nn.LayerNorm(D)
        self.output_layer = ColumnParallelLinear(D, rows, config=config, bias=False,
                                                 init_method=nn.init.zeros_, gather_output=False)
        vocab = self.embedding.word_embeddings
        start, end = vocab.vocab_start_index, vocab.vocab_end_index
        with torch.no_grad():
            vocab.weight.copy_(weights["embedding"][start:end])
            self.embedding.position_embeddings.weight.zero_()  # and kept so: TinyLM has none
            self.output_layer.weight.copy_(weights["head"][start:end])
        self.embedding.position_embeddings.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> tuple[Any, Any]:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        positions = torch.arange(idx.shape[1]).expand_as(idx)
        h = self.final_layernorm(torch.tanh(self.embedding(idx, positions)))  # (T, B, D)
        logits, _ = self.output_layer(h)  # (T, B, columns): this rank's
        return logits, vocab_parallel_cross_entropy(logits, labels.t().contiguous()).mean()
