"""What padding rows take of the softmax, healthy and not: the measurement behind the default
`checks.padding_mass.excess` (docs/checks.md).

A GPT-2 built from a config (no download) over a 1003-id vocabulary, resized to 1024 rows
(`resize_token_embeddings(pad_to_multiple_of=64)`, 21 padding rows), before and after
training on a synthetic bigram corpus; its padding rows as HF leaves them (mean-resized, or
normal init) and as garbage leaves them. Per sampled position: the padding mass m and its
excess, m / P over (1 - m) / N: how many times an average real id's probability each padding
column takes.

    .venv/bin/python bench/healthy_padding.py            # prints the table
"""

from __future__ import annotations

import argparse
import copy
import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import guard
from guard.demo.data import Corpus

REAL, D = 1003, 64


def measure(model: GPT2LMHeadModel, x: torch.Tensor) -> tuple[float, float, float, float]:
    """(mass mean, mass max, excess p99, excess max) over every position of `x`."""
    model.eval()
    with torch.no_grad():
        logits = model(x).logits  # (B, T, rows)
    padding = logits.shape[-1] - REAL
    m = guard.padding_mass(logits, REAL).flatten().double()
    excess = torch.where(m < 1, m * REAL / (padding * (1 - m)), float("inf"))
    p99 = float(torch.quantile(excess, 0.99))  # nan where the positions above are all inf
    return float(m.mean()), float(m.max()), float("inf") if p99 != p99 else p99, float(
        excess.max())


def resized(model: GPT2LMHeadModel, *, mean: bool, garbage: float | None = None,
            zero: bool = False) -> GPT2LMHeadModel:
    m = copy.deepcopy(model)
    m.resize_token_embeddings(REAL, pad_to_multiple_of=64, mean_resizing=mean)
    w = m.get_output_embeddings().weight
    with torch.no_grad():
        if zero:
            w[REAL:] = 0
        elif garbage is not None:
            w[REAL:] = torch.randn(w.shape[0] - REAL, D,
                                   generator=torch.Generator().manual_seed(1)) * garbage
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training steps before the resize")
    args = p.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=REAL, n_embd=D, n_layer=2, n_head=2,
                                      n_positions=64, bos_token_id=0, eos_token_id=0))
    corpus = Corpus(REAL, seed=0, hot=512)
    x = corpus.batch(10**6, 32, 32)[0]  # held out: 1024 positions
    rows = [("untrained, HF normal init", resized(base, mean=False)),
            ("untrained, HF mean resize", resized(base, mean=True))]
    opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
    base.train()
    for step in range(args.steps):
        a, _ = corpus.batch(step, 16, 32)
        base(a, labels=a).loss.backward()
        opt.step()
        opt.zero_grad()
    rows += [(f"trained {args.steps} steps, HF normal init", resized(base, mean=False)),
             (f"trained {args.steps} steps, HF mean resize", resized(base, mean=True)),
             (f"trained {args.steps} steps, zero rows", resized(base, mean=False, zero=True)),
             ("trained, garbage std 0.5 (25x init)", resized(base, mean=False, garbage=0.5)),
             ("trained, garbage std 5 (the seed's)", resized(base, mean=False, garbage=5.0))]
    print(f"P/(N+P) = {21 / 1024:.4f}: 21 padding rows of 1024, each at an average real id's "
          "probability")
    print("| padding rows | mass mean | mass max | excess p99 | excess max |")
    print("|---|---|---|---|---|")
    for name, model in rows:
        mean, top, p99, worst = measure(model, x)
        print(f"| {name} | {mean:.3g} | {top:.3g} | {p99:.3g} | {worst:.3g} |")


if __name__ == "__main__":
    main()
