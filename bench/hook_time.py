"""The guard's own time a step, measured where it is spent: the thread CPU time inside each hook
the guard put on the bench model of `bench/overhead.py` (its forward hooks and pre-hooks, the
optimizer's step hooks), per step. No baseline arm: what overhead.py's ratios cannot resolve
on a noisy machine (their run-to-run spread, +-1% of a 900 ms step, is more than a millisecond
of the guard's work), this measures directly, on one thread so that CPU time is work.

`--clock wall`: the hooks' wall time instead (at `--threads 2`, what they add to a step of the
model's two threads); the backward of the padding mask (guard/device/ops.py `_MaskPadding`, in
the engine, no hook) is timed too where the tree has it.

What it leaves out: what the guard's work does to the model's own ops (caches, the
allocator), which only the paired ratios of overhead.py and step_anatomy.py see.

    python bench/hook_time.py --steps 20
    python bench/hook_time.py --steps 20 --threads 2 --clock wall
    cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/old/server python /work/main/bench/hook_time.py

Uses the public API and torch's hook dicts (and the mask's Function, where there is one): it
runs on any tree.
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import guard
from guard.demo.model import GPT, GPTConfig

CLOCKS: dict[str, Callable[[], float]] = {"thread": time.thread_time, "wall": time.perf_counter}


def timed(fn: Callable[..., Any], name: str, spent: dict[str, float],
          clock: Callable[[], float] = time.thread_time) -> Callable[..., Any]:
    """`fn` adding its time by `clock` to spent[name] at each call."""

    def hook(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += clock() - start

    return hook


def time_mask_backward(spent: dict[str, float], clock: Callable[[], float]) -> None:
    """Time the padding mask's backward, which the autograd engine calls (no hook sees it)."""
    import guard.device.ops

    fn = getattr(guard.device.ops, "_MaskPadding", None)
    if fn is not None:
        fn.backward = staticmethod(timed(fn.backward, "engine: _MaskPadding.backward", spent,
                                         clock))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="thread")
    args = p.parse_args()
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    logging.getLogger("guard").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=128, n_layer=4, n_head=4, n_embd=256))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = guard.attach(model, vocab_size=50257, optimizer=opt, policy={"export": {"serve": None}})
    spent: dict[str, float] = collections.defaultdict(float)
    for name, module in model.named_modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, fn in list(hooks.items()):
                hooks[key] = timed(fn, f"{name or 'model'}: {fn.__qualname__}", spent,
                                   clock)
    for hooks in (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks):
        for key, fn in list(hooks.items()):
            hooks[key] = timed(fn, f"optimizer: {fn.__qualname__}", spent, clock)
    time_mask_backward(spent, clock)
    gen = torch.Generator().manual_seed(0)
    per_step: list[float] = []
    per_hook: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for i in range(args.warmup + args.steps):
            x = torch.randint(0, 50257, (8, 129), generator=gen)
            spent.clear()
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                per_step.append(sum(spent.values()))
                for name, s in spent.items():
                    per_hook[name].append(s)
    finally:
        g.detach()
    print(f"guard {guard.__file__}; {args.threads} thread(s); {args.steps} steps; "
          f"{args.clock} time")
    print(f"the guard's hooks: {1e3 * statistics.median(per_step):.2f} ms a step (median; "
          f"mean {1e3 * statistics.mean(per_step):.2f})")
    for name, values in sorted(per_hook.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {1e3 * statistics.median(values):.3f} ms  {name}")


if __name__ == "__main__":
    main()
