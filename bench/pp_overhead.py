"""Training-step overhead of the guard on a pipeline, guarded vs unguarded side by side, under
torchrun on gloo (CPU): 2 stages, torch's `PipelineStage` and `ScheduleGPipe`.

    python bench/pp_overhead.py                          # a minute or two on 2 cores
    python bench/pp_overhead.py --write docs/benchmarks.md

It launches itself under torchrun with 2 ranks (one thread each), one stage a rank. Each rank holds
its stage of three copies of one GPT-style model (same init and batches), split torchtitan's way:
stage 0 the token embedding and the first half of the blocks, stage 1 the rest, the final norm and
an untied head. The arms take turns step by step, so drift in the machine hits them alike:
`unguarded`; `guarded`, the default policy attached to each `PipelineStage`; `unguarded, tied`:
the embedding and the head tied copies on the two stages, their gradients all-reduced before
each update (Megatron's embedding group); `guarded, tied`: the same guarded with
`tied_across_stages=True`, the rows' checksums compared at every read (`checks.vocab.tie_every:
1`, the dearest setting; the default is 10). Each guarded arm is compared with its unguarded
twin. Reported: each arm's median step (the schedule's forward and backward over the micro-
batches, then AdamW) and its ratio to the unguarded one, as rank 0 measured them (the ranks step in
lockstep), and the time of one checksum pass of a copy.
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for bench.*

import guard
from bench.ranked import REAL, ROWS, arguments, interleaved, machine, under_torchrun

POLICY: dict[str, Any] = {"export": {"serve": None}}
ARMS = ("unguarded", "guarded", "unguarded, tied", "guarded, tied")
BASE = {"guarded": "unguarded", "guarded, tied": "unguarded, tied"}  # each arm's baseline
SECTION = "Pipeline parallel overhead (cpu)"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arguments(p, steps=15, section=SECTION)
    p.add_argument("--micro", type=int, default=2)
    return p.parse_args()


class Stage(nn.Module):
    """One stage: the embedding (stage 0) or the norm and the head (stage 1), and its blocks."""

    def __init__(self, args: argparse.Namespace, first: bool, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        d = args.n_embd
        emb = nn.Embedding(ROWS, d)
        head = nn.Linear(d, ROWS, bias=False)
        with torch.no_grad():
            if tied:
                head.weight.copy_(emb.weight)
        blocks = [nn.TransformerEncoderLayer(d, 2, 4 * d, dropout=0.0, batch_first=True,
                                             norm_first=True) for _ in range(args.n_layer)]
        half = args.n_layer // 2
        self.layers = nn.ModuleList(blocks[:half] if first else blocks[half:])
        self.tok_embeddings = emb if first else None
        self.norm = None if first else nn.LayerNorm(d)
        self.output = None if first else head
        self.mask = nn.Transformer.generate_square_subsequent_mask(args.block)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers:
            h = layer(h, src_mask=self.mask, is_causal=True)
        if self.norm is not None and self.output is not None:
            h = self.output(self.norm(h))
        return h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Arm:
    """One copy of the pipeline on this rank: its stage, schedule, optimizer, maybe a guard."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        rank = dist.get_rank()
        tied = name.endswith("tied")
        self.module = Stage(args, rank == 0, tied)
        stage = PipelineStage(self.module, rank, 2, torch.device("cpu"))
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        policy = {**POLICY, "checks": {"vocab": {"tie_every": 1}}} if tied else POLICY
        self.g = None if name.startswith("unguarded") else guard.attach(
            stage, policy=policy, vocab_size=REAL, optimizer=self.opt,
            tied_across_stages=tied or None)
        loss = self.g.loss_fn(loss_fn) if self.g is not None and rank == 1 else loss_fn
        self.schedule = ScheduleGPipe(stage, n_microbatches=args.micro, loss_fn=loss)
        copy = self.module.tok_embeddings or self.module.output
        self.copy = copy.weight if tied and copy is not None else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if dist.get_rank() == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y)
        if self.copy is not None:  # the tied copies' gradients summed (Megatron's all-reduce)
            dist.all_reduce(self.copy.grad)
        self.opt.step()
        self.opt.zero_grad()


def ranks(args: argparse.Namespace) -> None:
    from guard.device.checksums import block_checksums

    dist.init_process_group("gloo")
    arms = {name: Arm(args, name) for name in ARMS}
    times = interleaved(args, {name: arm.step for name, arm in arms.items()})
    stats = [a.g.stats for a in arms.values() if a.g is not None]
    for a in arms.values():
        if a.g is not None:
            a.g.detach()
    copy = arms["guarded, tied"].copy
    assert copy is not None
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        block_checksums(copy.detach())
        passes.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        report(args, times, statistics.median(passes) * 1e3, stats)
    dist.destroy_process_group()


def report(args: argparse.Namespace, times: dict[str, list[float]], checksum_ms: float,
           stats: list[dict[str, Any]]) -> None:
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    lines = ["| arm | median step (ms) | ratio vs its baseline | paired ratio (median of each "
             "step's) |", "|---|---|---|---|"]
    for n, v in med.items():
        b = BASE.get(n, n)
        paired = statistics.median(x / y for x, y in zip(times[n], times[b], strict=True))
        lines.append(f"| {n} | {v:.1f} | {v / med[b]:.3f}x vs {b} | {paired:.3f}x |")
    text = (machine(" shared with other jobs") +
            f"Command: `python bench/pp_overhead.py {' '.join(sys.argv[1:])}` (PP 2 on gloo, "
            f"one thread a rank, torch's PipelineStage and ScheduleGPipe with {args.micro} "
            f"micro-batches; {args.n_layer} blocks, d={args.n_embd}, batch {args.batch} x "
            f"{args.block} tokens, vocab {REAL} real / {ROWS} rows, untied head; "
            f"{args.steps} timed steps per arm after {args.warmup} warm-up, interleaved; rank "
            "0's times, the stages in lockstep).\n\n" + "\n".join(lines) +
            f"\n\nOne checksum pass of a {ROWS} x {args.n_embd} float32 copy (the tie check's "
            f"device work on each of the two stages at a read, guard/device/checksums.py): "
            f"{checksum_ms:.2f} ms. Violations: "
            f"{[s['violations'] for s in stats]} (rank 0's guards).\n")
    print(text)
    if args.write:
        from bench.overhead import write_section

        write_section(args.write, SECTION, text)


def main() -> None:
    args = parse()
    if under_torchrun(__file__, 2, 29538):
        ranks(args)


if __name__ == "__main__":
    main()
