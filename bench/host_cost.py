"""The guard's fixed cost per step, where it dominates: a tiny model, so the step boundary's
host work (the read, the verdict, the record, the report to the sinks) is most of the time.

Arms, interleaved step by step in one process, each with its own copy of one tiny GPT (128
rows, d 32, 4 x 16 tokens) and AdamW: unguarded, and guarded with the default policy (serve
off) through `optimizer=`. Reported: the median step of each arm and the guard's added time
per step (median of the per-round differences), which is what a real model pays on top of
its own step whatever its size. Uses the public API only, so it runs against any tree:

    .venv/bin/python bench/host_cost.py
    cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/old/server /work/main/.venv/bin/python \\
        /work/main/bench/host_cost.py                       # another tree, same machine
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch

import guard
from guard.demo.model import GPT, GPTConfig

ROWS, REAL = 128, 100


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the host work is single-threaded; so is the comparison
    logging.getLogger("guard").setLevel(logging.ERROR)  # the padding mass warns every step
    base = GPT(GPTConfig(vocab_size=ROWS, block_size=16, n_layer=1, n_head=2, n_embd=32))
    models = {"unguarded": base, "guarded": copy.deepcopy(base)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = guard.attach(models["guarded"], vocab_size=REAL, optimizer=opts["guarded"],
                     policy={"export": {"serve": None}})
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in models}
    try:
        for i in range(args.warmup + args.steps):
            x = torch.randint(0, REAL, (4, 16), generator=gen)
            y = torch.randint(0, REAL, (4, 16), generator=gen)
            for name, model in models.items():
                t0 = time.perf_counter()
                _, loss = model(x, y)
                loss.backward()
                opts[name].step()
                opts[name].zero_grad()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        g.detach()
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    added = 1e3 * statistics.median(a - b for a, b in zip(times["guarded"], times["unguarded"],
                                                          strict=True))
    print(f"guard {guard.__file__}")
    print(f"unguarded {ms['unguarded']:.3f} ms, guarded {ms['guarded']:.3f} ms a step "
          f"({ms['guarded'] / ms['unguarded']:.2f}x); added {added:.3f} ms a step "
          f"({args.steps} steps)")


if __name__ == "__main__":
    main()
