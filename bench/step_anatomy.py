"""Where a guarded step's added time goes, phase by phase: the bench model of
`bench/overhead.py` (4 layers, d 256, batch 8 x 128, vocab 50257 / 50304, AdamW foreach),
baseline and guarded arms interleaved step by step in one process, and each step cut into
forward, backward, the loop's clip (`--clip`), the guard's step pre-hook (the gradient check
and the read), AdamW's own update, zero_grad, and the cyclic garbage collector's time inside
the step. Per phase: the median difference a step over cycles of rounds (every arm in every
place once) over the baseline's median step (paired, as overhead.py), in the
main thread's CPU time (`time.thread_time`; with one torch thread, the step's work, which a
busy machine inflates less than wall time) and in wall time; and the minor page faults each
phase adds (fresh pages from the allocator, zeroed by the kernel: a count load cannot move).

    python bench/step_anatomy.py --steps 20                 # default policy, one thread
    python bench/step_anatomy.py --arms baseline,default,mask --steps 20
    python bench/step_anatomy.py --clip 1.0                 # the HF Trainer's loop
    cd /tmp/old && PYTHONPATH=/tmp/old python /work/wt/bench/step_anatomy.py   # another tree

Uses the public API only: it runs on any tree since issue 10. A phase nobody's work grew in
reads 0.000; the phases add up to the step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from overhead import cycle_added, in_turn  # bench/ is sys.path[0] when this runs as a script

import guard
from guard.demo.model import GPT, GPTConfig

POLICIES: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "default": {},
    "mask": {"checks": {"padding_mass": {"action": "mask"}, "nonfinite": {"action": "warn"},
                        "token_range": {"action": "warn"}, "loss_spike": {"action": "off"}}},
}
PHASES = ("forward", "backward", "clip", "guard pre-hook", "AdamW", "zero_grad", "gc", "step")
_GC: dict[str, float] = {"start": 0.0, "spent": 0.0, "count": 0.0}


def _gc_clock(phase: str, info: dict[str, Any]) -> None:
    """gc.callbacks: the collector's CPU time, whoever triggered it."""
    if phase == "start":
        _GC["start"] = time.thread_time()
    else:
        _GC["spent"] += time.thread_time() - _GC["start"]
        _GC["count"] += 1


def _now() -> tuple[float, float, float]:
    """This thread's CPU seconds, wall seconds, and minor page faults (the allocator handing
    fresh pages: a count a busy machine does not change)."""
    return (time.thread_time(), time.perf_counter(),
            float(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt))


class Arm:
    """One model copy and its optimizer, the marks its step pre-hooks take."""

    def __init__(self, name: str, base: GPT, real: int) -> None:
        self.name = name
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=False)
        self.marks: dict[str, tuple[float, float, float]] = {}
        self.cpu: dict[str, list[float]] = {p: [] for p in PHASES}
        self.wall: dict[str, list[float]] = {p: [] for p in PHASES}
        self.faults: dict[str, list[float]] = {p: [] for p in PHASES}  # minor page faults
        # Before the guard's step pre-hook, after it, and after the update.
        self.opt.register_step_pre_hook(self._mark("pre"))
        self.guard = None
        policy = POLICIES[name]
        if policy is not None:
            self.guard = guard.attach(self.model, policy={"export": {"serve": None}, **policy},
                                      vocab_size=real, optimizer=self.opt)
        self.opt.register_step_pre_hook(self._mark("update"))
        self.opt.register_step_post_hook(self._mark("post"))

    def _mark(self, key: str) -> Callable[..., None]:
        def mark(*_: Any) -> None:
            self.marks[key] = _now()
        return mark

    def step(self, x: torch.Tensor, y: torch.Tensor, clip: float | None) -> None:
        now = _now
        gc0 = _GC["spent"]
        t0 = now()
        _, loss = self.model(x, y)
        t1 = now()
        loss.backward()
        t2 = now()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        t2c = now()
        self.opt.step()
        t3 = now()
        self.opt.zero_grad(set_to_none=True)
        t4 = now()
        m = self.marks
        cuts = {"forward": (t0, t1), "backward": (t1, t2), "clip": (t2, t2c),
                "guard pre-hook": (m["pre"], m["update"]), "AdamW": (m["update"], m["post"]),
                "zero_grad": (t3, t4), "step": (t0, t4)}
        for phase, (a, b) in cuts.items():
            self.cpu[phase].append(b[0] - a[0])
            self.wall[phase].append(b[1] - a[1])
            self.faults[phase].append(b[2] - a[2])
        self.faults["gc"].append(0.0)
        spent = _GC["spent"] - gc0
        self.cpu["gc"].append(spent)
        self.wall["gc"].append(spent)


def paired(base: list[float], arm: list[float], step: list[float], cycle: int) -> float:
    """The median difference per step over whole cycles of rounds (overhead.cycle_added) over
    the baseline's median step."""
    return cycle_added(base, arm, cycle) / statistics.median(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="baseline,default")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                   help="clip_grad_norm_ before the update, in every arm (the HF Trainer's 1.0)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    args = p.parse_args()
    logging.getLogger("guard").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    real, rows = 50257, 50304
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=rows, block_size=args.block, n_layer=args.n_layer,
                         n_embd=args.n_embd, n_head=4))
    names = args.arms.split(",")
    arms = [Arm(n, base, real) for n in names]
    gc.callbacks.append(_gc_clock)
    load = os.getloadavg()[0]
    g = torch.Generator().manual_seed(0)
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, real, (args.batch, args.block + 1), generator=g)
        for arm in in_turn(arms, i):
            arm.step(x[:, :-1], x[:, 1:], args.clip)
        if i == args.warmup - 1:
            for arm in arms:
                for d in (arm.cpu, arm.wall, arm.faults):
                    for v in d.values():
                        v.clear()
    gc.callbacks.remove(_gc_clock)
    b = arms[0]
    print(f"guard {guard.__file__}; {torch.get_num_threads()} thread(s); 1-minute load "
          f"{load:.2f} before, {os.getloadavg()[0]:.2f} after; baseline step "
          f"{statistics.median(b.cpu['step']) * 1e3:.0f} ms CPU, "
          f"{statistics.median(b.wall['step']) * 1e3:.0f} ms wall; {args.steps} steps\n")
    print("| phase | " + " | ".join(f"{a.name}: CPU / wall / page faults added" for a in arms[1:])
          + " |")
    print("|---|" + "---|" * (len(arms) - 1))
    for phase in PHASES:
        c = max(len(arms), 2)
        cells = [f"{paired(b.cpu[phase], a.cpu[phase], b.cpu['step'], c) * 100:+.2f}% / "
                 f"{paired(b.wall[phase], a.wall[phase], b.wall['step'], c) * 100:+.2f}% / "
                 f"{cycle_added(b.faults[phase], a.faults[phase], c):+.0f}"
                 for a in arms[1:]]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    for a in arms:
        if a.guard is not None:
            a.guard.detach()


if __name__ == "__main__":
    main()
