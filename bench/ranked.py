"""What the torchrun benchmarks (bench/pp_overhead.py, bench/tp_overhead.py) share: their
model and timing arguments, the launch of the script itself under torchrun, the arms stepped
in turn with a barrier before each (so drift in the machine hits them alike), and the machine
line of their report."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

REAL, ROWS = 50257, 50304  # GPT-2's tokenizer, padded to a multiple of 64 (x 2 for TP 2)


def arguments(p: argparse.ArgumentParser, *, steps: int, section: str) -> None:
    """The model's size, the batch and the timed steps; `--write` replaces `section`."""
    p.add_argument("--n-layer", type=int, default=2, help="blocks in all")
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--write", type=Path, help=f"replace the '{section}' section of this "
                   "markdown file")


def under_torchrun(script: str, nproc: int, port: int) -> bool:
    """True on a rank; else launches `script` under torchrun with `nproc` ranks (one thread
    each) and exits with its status."""
    if "LOCAL_RANK" in os.environ:
        return True
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), script, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    sys.exit(subprocess.call(cmd, env=env))


def interleaved(args: argparse.Namespace,
                arms: Mapping[str, Callable[[torch.Tensor, torch.Tensor], None]]
                ) -> dict[str, list[float]]:
    """Each arm's step times (s) after the warm-up: every step one batch of ids and labels
    (the same on every rank), given to each arm in turn after a barrier."""
    times: dict[str, list[float]] = {n: [] for n in arms}
    gen = torch.Generator().manual_seed(0)
    for step in range(args.warmup + args.steps):
        x, y = (torch.randint(0, REAL, (args.batch, args.block), generator=gen)
                for _ in range(2))
        for name, arm in arms.items():
            dist.barrier()
            start = time.perf_counter()
            arm(x, y)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return times


def machine(shared: str = "") -> str:
    """The report's first line: the CPU, its cores, the load at the end, the versions."""
    return (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
            f"{shared} (load average {os.getloadavg()[0]:.1f} at the end); Python "
            f"{platform.python_version()}, torch {torch.__version__}.\n\n")
