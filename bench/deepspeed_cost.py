"""What the guard's reads cost under DeepSpeed ZeRO on the CPU (docs/integrations.md, DeepSpeed).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \\
        bench/deepspeed_cost.py [--stage 3] [--rows 50304] [--real 50257] [--n-embd 256]

Two gloo ranks, a GPT-2 (2 layers) whose tied embedding has `rows` rows, ZeRO stage `--stage`,
the guard attached to the engine with the default policy. Measured: attach (its reads of the
weights: the padding rows' scale, the untrained rows' features); then on each rank, the median
of `--repeat` calls at a step boundary (after the backward, before the step): the padding
rows' check (under ZeRO-3 from the partitions, one all-reduce of their squared norms) and the
gradient check (one `torch._foreach_norm` over ZeRO's gradient partitions); and the training
step (forward, backward, step) with and without the guard, `--steps` interleaved steps each,
medians. Rank 0 prints one line of JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import guard


def model(args: argparse.Namespace) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=args.rows, n_embd=args.n_embd, n_layer=2,
                                      n_head=4, n_positions=args.block))


def engine(args: argparse.Namespace) -> Any:
    m = model(args)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization":
           {"stage": args.stage}, "steps_per_print": 10**9}
    return deepspeed.initialize(model=m, optimizer=opt, config=cfg)[0]


def timed(fn: Any, n: int) -> float:
    """Median ms of n calls (every rank calls: some are collectives)."""
    out = []
    for _ in range(n):
        dist.barrier()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--rows", type=int, default=50304)
    p.add_argument("--real", type=int, default=50257)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    plain, guarded = engine(args), engine(args)
    dist.barrier()
    t = time.perf_counter()
    g = guard.attach(guarded, policy={"export": {"serve": None}}, vocab_size=args.real)
    attach_ms = (time.perf_counter() - t) * 1e3
    states = {type(s).__name__: s for s in g._parts.states}
    x = torch.randint(0, args.real, (args.batch, args.block),
                      generator=torch.Generator().manual_seed(rank))
    steps: dict[str, list[float]] = {"plain": [], "guarded": []}
    for _ in range(args.steps):
        for name, e in (("plain", plain), ("guarded", guarded)):
            dist.barrier()
            t = time.perf_counter()
            e.backward(e(input_ids=x, labels=x).loss)
            e.step()
            steps[name].append((time.perf_counter() - t) * 1e3)
    guarded.backward(guarded(input_ids=x, labels=x).loss)  # gradients to read, not applied
    rows = states["PaddingRowsState"].rows
    norms = states["GradState"].norms
    out = {"stage": args.stage, "rows": args.rows, "n_embd": args.n_embd,
           "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                         for p in guarded.module.parameters()),
           "attach_ms": attach_ms,
           "padding_rows_check_ms": timed(rows.check, args.repeat),
           "grad_check_ms": timed(lambda: (norms.measure(), norms.before_read()), args.repeat),
           "step_ms_plain": statistics.median(steps["plain"]),
           "step_ms_guarded": statistics.median(steps["guarded"])}
    if rank == 0:
        print(json.dumps(out))
    dist.barrier()


if __name__ == "__main__":
    main()
