"""Where untrained_rows' norm_ratio (1e-3) comes from: a row's norm over the median row norm, in
embeddings that are healthy (a normal init, rows trained on Zipf-distributed ids, HF's mean
resize, the trained mean a repair writes) and in rows no training reached (weight decay only).

    python bench/untrained_norms.py [--steps 300]

Prints one table row per case: the smallest and largest ratio over its rows, and what the
guard's rules find in it (guard/weights/features.py, the default policy).
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from guard.policy import UntrainedRowsCheck
from guard.weights.features import classify, row_features
from guard.weights.sharded import RowShard

RULES = UntrainedRowsCheck()


def ratios(w: torch.Tensor, rows: slice | torch.Tensor, reference: torch.Tensor) -> str:
    norms = w.detach().float()[rows].norm(dim=1) / reference.norm(dim=1).median()
    return f"{norms.min().item():.3g} | {norms.max().item():.3g}"


def found(w: torch.Tensor) -> int:
    why, _ = classify(*row_features(RowShard.of(w, "w"), w.shape[0]), epsilon=RULES.epsilon,
                      norm_ratio=RULES.norm_ratio, duplicates=RULES.duplicates)
    return int((why > 0).sum().item())


def zipf_llama(steps: int, rows: int = 4096, d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-layer Llama trained `steps` AdamW steps (lr 1e-3, weight decay 0.1) on ids drawn
    with Zipf weights over [0, rows - 512): the last 512 ids never appear. Its embedding, and
    how often each id was seen."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=rows, hidden_size=d, intermediate_size=2 * d,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    m = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    weights = 1.0 / torch.arange(1, rows - 512 + 1, dtype=torch.float64)  # Zipf, s = 1
    seen = torch.zeros(rows)
    for _ in range(steps):
        ids = torch.multinomial(weights, 16 * 64, replacement=True).view(16, 64)
        seen += torch.bincount(ids.flatten(), minlength=rows)
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return m.get_input_embeddings().weight.detach(), seen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    out = ["| case | rows x d | min / median | max / median | rows found untrained |",
           "|---|---|---|---|---|"]
    torch.manual_seed(0)
    for rows, d in ((128256, 512), (32000, 4096), (4096, 64)):
        w = torch.randn(rows, d) * 0.02
        out.append(f"| normal init (std 0.02) | {rows} x {d} | {ratios(w, slice(None), w)} | "
                   f"{found(w)} |")
    w, seen = zipf_llama(args.steps)
    once = seen > 0
    rare = (seen > 0) & (seen <= 3)
    out.append(f"| trained {args.steps} steps, ids seen | 4096 x 64 | "
               f"{ratios(w, once, w[once])} | {found(w[:-512])} |")
    out.append(f"| of them seen 1-3 times ({int(rare.sum())}) | 4096 x 64 | "
               f"{ratios(w, rare, w[once])} | - |")
    out.append(f"| never seen (weight decay only) | 512 x 64 | "
               f"{ratios(w, ~once, w[once])} | {found(w) - found(w[:-512])} |")
    mean = w[once].mean(dim=0, keepdim=True)
    out.append(f"| the trained mean (a repair) | 1 x 64 | {ratios(mean, slice(None), w[once])} "
               "| - |")
    decayed = w.clone()
    decayed[~once] *= 1e-4  # what 10^4 more steps of decay leave: lr 1e-3 x wd 0.1 = 1e-4
    out.append(f"| never seen, decayed to 1e-4 | 512 x 64 | {ratios(decayed, ~once, w[once])} "
               f"| {found(decayed) - found(decayed[:-512])} |")
    print("\n".join(out))


if __name__ == "__main__":
    main()
