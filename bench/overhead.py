"""Training-step overhead of the guard, as ratios against an unguarded baseline run side by side.

Every arm trains its own copy of one GPT-style model (same init, same batches); the arms take
turns step by step in one process (`in_turn`), so drift in the machine hits all of them
alike. Reported: median step time (forward, backward, AdamW) of each arm over the baseline's
median, and the paired ratios (`paired_ratio`). Each model copy has a speed of its own in a
process (the `copy` arm's A/A ratios range 0.98x-1.013x): a figure held against 1% needs many
processes, `bench/overhead_runs.py`.

    python bench/overhead.py                      # CPU default, a few minutes on 2 cores
    python bench/overhead.py --device cuda --n-embd 768 --n-layer 12 --batch 8 --block 1024
    python bench/overhead.py --write docs/benchmarks.md
    python bench/overhead.py --sweep --write docs/benchmarks.md   # the vocabulary sweep
    python bench/overhead.py --arms baseline,default --clip 1.0  # every arm clips, as HF does

Arms: default policy, mask, all checks warn, exact padding mass, the default policy reading
before each update (`sync-fail`: `cadence.fail_read: before_update`, today's synchronous fail),
and the anchors torch.autograd.detect_anomaly() and transformers' DebugUnderflowOverflow;
`copy` (asked for by name), an unguarded copy of the baseline: the A/A control, whose ratios
are what the run cannot resolve.
`--fused`: each arm beside its twin with a fused AdamW (`NAME+fused`, against
`baseline+fused`), whose found_inf lets fail/skip drop a bad update on the device. Peak memory
with and without the mask is measured in child processes (one arm each).

`--sweep`: the worst case for the guard's logits work, a head-dominated model (2 layers, d 64,
tied, so the head and the loss over the vocabulary are most of the step) at five vocabulary
sizes, baseline against the given arms (default: the default policy), each size in one
interleaved run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

# Runs against the installed package (scripts/bootstrap: pip install -e .).
import guard
from guard.demo.model import GPT, GPTConfig

T = TypeVar("T")
REAL, ROWS = 50257, 50304  # GPT-2's tokenizer, padded to a multiple of 64
# (what, real ids, rows). Heads without padding rows of their own get 64, so every size
# measures the padding mass: the guard's costliest case.
SWEEP = [
    ("Llama 2 + 64 padding rows", 32000, 32064),
    ("GPT-2", 50257, 50304),
    ("Llama 3 + 64 padding rows", 128256, 128320),
    ("Qwen2 (151,665 ids in 151,936 rows)", 151665, 151936),
    ("Gemma + 64 padding rows", 256000, 256064),
]
HEAD_DOMINATED = {"n_layer": 2, "n_embd": 64, "n_head": 2}  # the sweep's model
QUIET = {"export": {"serve": None}}
ARMS: dict[str, dict[str, Any] | str | None] = {
    "baseline": None,
    # An unguarded copy of the baseline: the A/A control. Its ratios are the run's noise floor
    # (different memory, the same work), what no other arm's ratio can be told apart from.
    "copy": None,
    "default": {},
    "mask": {"checks": {"padding_mass": {"action": "mask"}, "nonfinite": {"action": "warn"},
                        "token_range": {"action": "warn"}, "loss_spike": {"action": "off"}}},
    "all-warn": {"checks": {c: {"action": "warn"} for c in
                            ("alignment", "vocab", "padding_mass", "nonfinite", "token_range",
                             "loss_spike")}},
    "exact": {"checks": {"padding_mass": {"action": "mask", "exact": True}}},
    "sync-fail": {"cadence": {"fail_read": "before_update"}},
    "detect_anomaly": "anomaly",
    "DebugUnderflowOverflow": "debug_uo",
}


def _policy(arm: dict[str, Any]) -> dict[str, Any]:
    return {**QUIET, **arm}


class Arm:
    """One model copy, its optimizer and whatever wraps its step."""

    def __init__(self, name: str, base: GPT, device: str, real: int = REAL) -> None:
        self.name = name
        self.model = copy.deepcopy(base).to(device)
        # NAME+fused: the same arm with a fused AdamW (for-loop / foreach otherwise).
        self.kind = name.removesuffix("+fused")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4,
                                     fused=name.endswith("+fused"))
        self.times: list[float] = []
        self.cpu: list[float] = []  # process CPU seconds: what a busy machine cannot inflate
        self.guard: guard.Guard | None = None
        self.debug: Any = None
        spec = ARMS[self.kind]
        if isinstance(spec, dict):
            self.guard = guard.attach(self.model, policy=_policy(spec), vocab_size=real,
                                      optimizer=self.opt)
        elif spec == "debug_uo":
            from transformers.debug_utils import DebugUnderflowOverflow

            self.debug = DebugUnderflowOverflow(self.model, max_frames_to_save=1)

    def context(self) -> contextlib.AbstractContextManager[Any]:
        if ARMS[self.kind] == "anomaly":
            return torch.autograd.detect_anomaly(check_nan=True)
        return contextlib.nullcontext()

    def step(self, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None],
             clip: float | None = None) -> None:
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        with self.context():
            _, loss = self.model(x, y)
            loss.backward()
        if clip is not None:  # the HF Trainer's default loop: clip, then step
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync()
        self.times.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)


def batches(
    n: int, b: int, t: int, device: str, seed: int = 0, real: int = REAL
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, real, (b, t + 1), generator=g).to(device)
        yield x[:, :-1], x[:, 1:]


def in_turn(arms: list[T], i: int) -> list[T]:
    """Round i's order, rotated so that every arm takes every place in a round equally often:
    a step's time depends on what ran just before it (caches, the allocator), and under a
    reversal the middle arms never went first or last, which biased them against the baseline
    (an unguarded copy read 0.994x)."""
    k = i % len(arms)
    return arms[k:] + arms[:k]


def run_interleaved(args: argparse.Namespace, names: list[str], real: int = REAL,
                    rows: int = ROWS, shape: dict[str, int] | None = None) -> dict[str, Arm]:
    """The arms after their timed steps; `shape` (n_layer, n_embd, n_head) overrides the
    args'."""
    torch.manual_seed(0)
    dims = shape or {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head}
    base = GPT(GPTConfig(vocab_size=rows, block_size=args.block, n_layer=dims["n_layer"],
                         n_embd=dims["n_embd"], n_head=dims["n_head"]))
    arms = [Arm(n, base, args.device, real) for n in names]
    del base
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    data = batches(args.warmup + args.steps, args.batch, args.block, args.device, real=real)
    for i, (x, y) in enumerate(data):
        for arm in in_turn(arms, i):
            arm.step(x, y, sync, args.clip)
        if i == args.warmup - 1:
            for arm in arms:
                arm.times.clear()
                arm.cpu.clear()
    for arm in arms:
        if arm.guard is not None:
            arm.guard.detach()
    return {a.name: a for a in arms}


def cycle_added(base: list[float], arm: list[float], cycle: int) -> float:
    """The median difference per step over whole cycles of `cycle` rounds (`in_turn`'s, one
    for each arm): in a cycle every arm took every place once, so a cycle's difference holds
    no effect of the places, where a single round's does (with three arms the rounds'
    differences are three places' effects, whose median is one of them, not zero)."""
    n = min(len(base), len(arm)) // cycle * cycle
    if n == 0:
        raise ValueError(f"fewer steps ({len(base)}) than a cycle of {cycle} rounds")
    return statistics.median(sum(arm[i:i + cycle]) - sum(base[i:i + cycle])
                             for i in range(0, n, cycle)) / cycle


def paired_ratio(base: list[float], arm: list[float], cycle: int = 2) -> float:
    """1 + the median difference per step over cycles of rounds (`cycle_added`; `cycle`: the
    number of arms run together, at least 2) over the baseline's median step: a cycle's steps
    run close together, so a machine that slows down for a while slows both."""
    return 1.0 + cycle_added(base, arm, max(cycle, 2)) / statistics.median(base)


def base_of(n: str, arms: dict[str, Arm]) -> str:
    """The arm `n` is compared with: a fused arm against the fused baseline."""
    return "baseline+fused" if n.endswith("+fused") and "baseline+fused" in arms else \
        "baseline"


def ratios(arms: dict[str, Arm], n: str) -> tuple[float, float]:
    """Arm n's paired (wall-time, CPU-time) ratios against its baseline (`base_of`), over
    cycles of one round an arm."""
    base, arm = arms[base_of(n, arms)], arms[n]
    return (paired_ratio(base.times, arm.times, len(arms)),
            paired_ratio(base.cpu, arm.cpu, len(arms)))


def peak_memory(args: argparse.Namespace, name: str) -> float:
    """Peak memory (MiB) of a child process training one arm: CUDA allocator peak, or RSS."""
    cmd = [sys.executable, __file__, "--memory-child", name, "--device", args.device,
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head",
           str(args.n_head), "--batch", str(args.batch), "--block", str(args.block)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_mib"])


def memory_child(args: argparse.Namespace) -> None:
    import resource

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=ROWS, block_size=args.block, n_layer=args.n_layer,
                         n_head=args.n_head, n_embd=args.n_embd))
    arm = Arm(args.memory_child, base, args.device)
    del base
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for x, y in batches(3, args.batch, args.block, args.device):
        arm.step(x, y, sync)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"peak_mib": peak}))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    desc = f"{cpu}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name(0)}"
    return f"{desc}; Python {platform.python_version()}, torch {torch.__version__}"


def sweep(args: argparse.Namespace, names: list[str]) -> str:
    """The vocabulary sweep's section: per size, the baseline's median step and each arm's
    ratio, of wall time and of process CPU time (`paired_ratio`)."""
    guarded = [n for n in names if n != "baseline"]
    head = "| vocabulary | real / rows | baseline step (ms) | " + " | ".join(
        f"{n}: wall-time ratio | {n}: CPU-time ratio" for n in guarded) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(guarded))]
    for what, real, rows in SWEEP:
        if args.only and str(real) not in args.only.split(","):
            continue
        arms = run_interleaved(args, names, real, rows, HEAD_DOMINATED)
        cells = " | ".join(f"**{wall:.3f}x** | {cpu:.3f}x"
                           for wall, cpu in (ratios(arms, n) for n in guarded))
        step = statistics.median(arms["baseline"].times) * 1e3
        lines.append(f"| {what} | {real:,} / {rows:,} | {step:.1f} | {cells} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default=None, metavar="REAL,...",
                   help="the sweep's sizes with these real-id counts only (e.g. 32000,151665)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's); 1 makes the CPU-time "
                   "ratio the work's alone, without threads waiting for each other")
    p.add_argument("--arms", default=None, help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                   help="every arm clips its gradients (clip_grad_norm_) before the update, "
                   "as the HF Trainer does by default (1.0)")
    p.add_argument("--sweep", action="store_true",
                   help="the vocabulary sweep on a head-dominated model (arms: --arms, "
                   "default: baseline,default)")
    p.add_argument("--write", type=Path, help="replace the Overhead (--sweep: the Vocabulary "
                   "size) section of this markdown file")
    p.add_argument("--fused", action="store_true",
                   help="each arm beside its twin with a fused AdamW (NAME+fused)")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    return p


def setup(args: argparse.Namespace) -> None:
    # Arms with warn/mask log each violation; the figures are the output here.
    logging.getLogger("guard").setLevel(logging.ERROR)
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def arm_names(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    """The arms to run, the baseline first (and its fused twin with --fused)."""
    names: list[str] = args.arms.split(",") if args.arms else (
        ["baseline", "default"] if args.sweep else [n for n in ARMS if n != "copy"])
    if "baseline" not in names:
        names.insert(0, "baseline")
    if args.fused:
        names += [f"{n}+fused" for n in names if not n.endswith("+fused")]
    unknown = {n.removesuffix("+fused") for n in names} - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if args.steps < len(names):  # the ratios are taken over cycles of len(names) rounds
        p.error(f"--steps {args.steps}: fewer than the {len(names)} arms (ratios are taken "
                f"over cycles of one round an arm)")
    return names


def main() -> None:
    p = parser()
    args = p.parse_args()
    setup(args)
    if args.memory_child:
        memory_child(args)
        return
    names = arm_names(args, p)
    cmd = "python bench/overhead.py " + " ".join(sys.argv[1:])
    load_before = os.getloadavg()[0]
    if args.sweep:
        table = sweep(args, names)
        load = f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
        text = (f"Machine: {machine()}; {load}; {torch.get_num_threads()} threads.\n\n"
                f"Command: `{cmd.strip()}` (model: {HEAD_DOMINATED['n_layer']} layers, "
                f"d={HEAD_DOMINATED['n_embd']}, tied, batch {args.batch} x {args.block} tokens; "
                f"{args.steps} timed steps per arm and size after {args.warmup} warm-up, "
                "interleaved; ratios: 1 + the median difference a step over cycles of rounds "
                "(every arm in every place once) over the baseline's median step, of wall time "
                "and of process CPU time)."
                f"\n\n{table}\n")
        print(text)
        if args.write:
            write_section(args.write, f"Vocabulary size ({args.device})", text)
        return
    arms = run_interleaved(args, names)
    med = {n: statistics.median(a.times) for n, a in arms.items()}

    added = {n: med[n] - med[base_of(n, arms)] for n in names}
    # The paired ratios compare each round's steps, run back to back: what a drifting or busy
    # machine does to both cancels out; process CPU time is what load cannot inflate.
    lines = ["| arm | median step (ms) | ratio of medians | paired wall-time ratio | "
             "paired CPU-time ratio |", "|---|---|---|---|---|"]
    for n in names:
        wall, cpu = ratios(arms, n)
        lines.append(f"| {n} | {med[n] * 1e3:.1f} | {med[n] / med[base_of(n, arms)]:.3f}x | "
                     f"{wall:.3f}x | {cpu:.3f}x |")
    if "detect_anomaly" in med and "default" in med:
        da, dflt = added["detect_anomaly"], added["default"]
        lines.append("")
        if dflt > 0:
            lines.append(f"Added time: default {dflt * 1e3:.2f} ms, detect_anomaly "
                         f"{da * 1e3:.1f} ms: the default policy adds {da / dflt:.0f}x less "
                         "time than detect_anomaly.")
        else:  # the medians' noise is larger than what the guard adds
            lines.append(f"Added time: default {dflt * 1e3:.2f} ms (below this run's noise), "
                         f"detect_anomaly {da * 1e3:.1f} ms.")
    if not args.no_memory:
        base_mem, mask_mem = peak_memory(args, "baseline"), peak_memory(args, "mask")
        lines.append("")
        lines.append(f"Peak memory ({'CUDA allocator' if args.device.startswith('cuda') else 'RSS'}"
                     f", child process per arm): baseline {base_mem:.0f} MiB, mask "
                     f"{mask_mem:.0f} MiB: {mask_mem / base_mem:.3f}x.")
    load = f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    header = (f"Machine: {machine()}; {load}.\n\nCommand: `{cmd.strip()}` (model: "
              f"{args.n_layer} layers, d={args.n_embd}, batch {args.batch} x {args.block} "
              f"tokens, vocab {REAL} real / {ROWS} rows; {args.steps} timed steps per arm "
              f"after {args.warmup} warm-up, interleaved).\n")
    text = header + "\n" + "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(args.write, f"Overhead ({args.device})", text)


def write_section(path: Path, title: str, body: str) -> None:
    """Replace (or append) the `## {title}` section of a markdown file."""
    head = f"## {title}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    parts = text.split("\n## ")
    kept = [parts[0]] + [s for s in parts[1:] if not s.startswith(title + "\n")]
    out = "\n## ".join(kept).rstrip("\n") + f"\n\n{head}\n\n{body}"
    path.write_text(out)


if __name__ == "__main__":
    main()
