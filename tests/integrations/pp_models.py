"""The tiny GPT the pipeline workers train (tests/integrations/pp_worker.py), split the way
torchtitan splits a model for pipeline parallelism: the whole model built on every rank from
the same weights, then each stage deletes what it does not hold (its forward skips a missing
part). Stage 0 keeps the token embedding and the first block, the last stage the last block,
the final norm and the untied `output` head; a middle stage (3 stages) the block between.

The real vocab is 1000 ids in 1024 rows; the unsplit model, and its real-rows copy, are the
references a pipeline run is held against, in the same process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REAL, ROWS, D, B, T, LAYERS = 1000, 1024, 16, 4, 8, 3


class Block(nn.Module):
    """Causal self-attention and an MLP, each after a LayerNorm, each a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (x.view(b, t, 2, D // 2).transpose(1, 2)
                   for x in self.qkv(self.ln1(h)).split(D, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    """torchtitan's shape: `tok_embeddings`, `layers` (a ModuleDict, so a stage keeps its
    layers' names), `norm`, `output`; each may be None on a stage."""

    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(rows, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(D)
        self.output: nn.Linear | None = nn.Linear(D, rows, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build(*, garbage: bool = False, tied: bool = False, seed: int = 0) -> GPT:
    """The whole model, alike on every rank: the padding rows the mean of the real ones (a
    mean resize: healthy), or the head's garbage (norm 1e4, an uninitialised resize); `tied`:
    the head a copy of the embedding (two parameters, as two stages hold them)."""
    torch.manual_seed(seed)
    model = GPT()
    assert model.tok_embeddings is not None and model.output is not None
    with torch.no_grad():
        for w in (model.tok_embeddings.weight, model.output.weight):
            w.normal_(0.0, 0.5)
            w[REAL:] = w[:REAL].mean(dim=0)
        if tied:
            model.output.weight.copy_(model.tok_embeddings.weight)
        if garbage:
            rows = torch.randn(ROWS - REAL, D)
            model.output.weight[REAL:] = rows / rows.norm(dim=-1, keepdim=True) * 1e4
    return model


def split(model: GPT, stage: int, stages: int) -> GPT:
    """Stage `stage` of `stages`, torchtitan's way: the layers [first, last) it holds kept,
    the rest deleted; the embedding on stage 0 only, the norm and the head on the last."""
    per = {2: [(0, 1), (1, 3)], 3: [(0, 1), (1, 2), (2, 3)]}[stages][stage]
    for name in list(model.layers):
        if not per[0] <= int(name) < per[1]:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


def real_rows(model: GPT) -> GPT:
    """The same weights with the real rows only: what a masked run must train like."""
    ref = GPT(REAL)
    ref.load_state_dict({k: v[:REAL] if k in ("tok_embeddings.weight", "output.weight") else v
                         for k, v in model.state_dict().items()})
    return ref


def batch(step: int, *, ghost: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) input ids and labels of the real vocab, alike on every rank; `ghost`: one input
    id a padding id."""
    g = torch.Generator().manual_seed(step)
    x, y = (torch.randint(0, REAL, (B, T), generator=g) for _ in range(2))
    if ghost:
        x[1, 2] = REAL + 3
    return x, y


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> Any:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def vocab_parallel(model: GPT, mesh: Any) -> GPT:
    """A stage's ends split over `mesh` (the "tp" dim of a pipeline x tensor-parallel mesh),
    torchtitan's plan: the embedding `RowwiseParallel` (vocab-parallel rows, global ids in,
    its output replicated), the head `ColwiseParallel` with its logits a DTensor sharded on
    the vocab (for `loss_parallel`); the blocks replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    return model
