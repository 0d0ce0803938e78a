"""Training-step overhead of the guard on a tensor-parallel head, guarded vs unguarded side by
side, under torchrun on gloo (CPU).

    python bench/tp_overhead.py                          # TP 2, a minute or two on 2 cores
    python bench/tp_overhead.py --write docs/benchmarks.md

It launches itself under torchrun with `--tp` ranks (one thread each). Each rank trains two
copies of one GPT-style model (guard/demo/model.py, untied), same init and batches, through
torch's parallelize_module with torchtitan's vocab plan: the embedding RowwiseParallel, the
head ColwiseParallel with its logits a DTensor sharded on the vocab, the loss under
loss_parallel; the blocks are replicated. The arms take turns step by step, so drift in the
machine hits both alike; the guarded one runs the default policy, whose padding mass is
combined over the two ranks at each read (one all_gather of 2 floats per sampled position
and rank). Reported: each arm's median step (forward, backward, AdamW) and their ratio, as
rank 0 measured them; the ranks step in lockstep (every step has collectives).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for bench.*

import guard
from bench.ranked import REAL, ROWS, arguments, interleaved, machine, under_torchrun
from guard.demo.model import GPT, GPTConfig

SECTION = "Tensor parallel overhead (cpu)"
POLICY: dict[str, Any] = {"export": {"serve": None}}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    arguments(p, steps=20, section=SECTION)
    return p.parse_args()


def model(args: argparse.Namespace, mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=ROWS, block_size=args.block, n_layer=args.n_layer,
                      n_head=2, n_embd=args.n_embd, tie_weights=False))
    return parallelize_module(m, mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def ranks(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",))
    arms = {name: model(args, mesh) for name in ("unguarded", "guarded")}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, m in arms.items()}
    g = guard.attach(arms["guarded"], policy=POLICY, vocab_size=REAL, optimizer=opts["guarded"])
    combines = timed_combine(g)

    def step(name: str) -> Any:
        def one(x: torch.Tensor, y: torch.Tensor) -> None:
            with loss_parallel():
                _, loss = arms[name](x, y)
                loss.backward()
            opts[name].step()
            opts[name].zero_grad()

        return one

    times = interleaved(args, {name: step(name) for name in arms})
    g.detach()
    if dist.get_rank() == 0:
        report(args, times, combines[args.warmup:], g.stats)
    dist.destroy_process_group()


def timed_combine(g: guard.Guard) -> list[float]:
    """The seconds each read's combine of the padding mass over the ranks took (its
    all_gather and the logsumexp over the shards), as the guarded arm runs."""
    sharded = g._probe.logits.sharded  # the bench looks inside; the library never does
    assert sharded is not None, "the head is not vocab-parallel"
    spent: list[float] = []
    combine = sharded.combine

    def timed(*, reduce: bool) -> None:
        start = time.perf_counter()
        combine(reduce=reduce)
        spent.append(time.perf_counter() - start)

    sharded.combine = timed  # type: ignore[method-assign]
    return spent


def report(args: argparse.Namespace, times: dict[str, list[float]], combines: list[float],
           stats: dict[str, Any]) -> None:
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    base = med["unguarded"]
    lines = ["| arm | median step (ms) | ratio vs unguarded |", "|---|---|---|"]
    lines += [f"| {n} | {v:.1f} | {v / base:.3f}x |" for n, v in med.items()]
    header = (machine() + f"Command: `python bench/tp_overhead.py --write docs/benchmarks.md` (TP "
              f"{args.tp} on gloo, one thread a rank; {args.n_layer} layers, d={args.n_embd}, "
              f"batch {args.batch} x {args.block} tokens, vocab {REAL} real / {ROWS} rows, "
              f"{ROWS // args.tp} columns a rank; {args.steps} timed steps per arm after "
              f"{args.warmup} warm-up, interleaved).\n")
    added = med["guarded"] - base
    combine = statistics.median(combines) * 1e3
    paired = statistics.median(g / u for g, u in zip(times["guarded"], times["unguarded"],
                                                      strict=True))
    lines.append(f"| paired (median of each step's guarded / unguarded) | | {paired:.3f}x |")
    text = (header + "\n" + "\n".join(lines) + f"\n\nAdded time a step: {added:.2f} ms; of "
            f"it, the read's combine of the padding mass over the ranks (one all_gather of "
            f"{stats_positions(args)} sampled positions x 2 floats a rank, and the logsumexp "
            f"over the shards) took {combine:.3f} ms at the median. Violations: "
            f"{stats['violations'] or 'none'}; padding mass {stats['padding_mass']:.3g} (the "
            "whole vocab's, alike on both ranks).\n")
    print(text)
    if args.write:
        from bench.overhead import write_section

        write_section(args.write, SECTION, text)


def stats_positions(args: argparse.Namespace) -> int:
    """Positions the default policy samples a forward (ops.sample_size)."""
    from guard.device.ops import sample_size

    return sample_size(args.batch * args.block, 256)


def main() -> None:
    args = parse()
    if under_torchrun(__file__, args.tp, 29531):
        ranks(args)


if __name__ == "__main__":
    main()
