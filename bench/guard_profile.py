"""Where the guard's time goes in a training step: torch.profiler over the default policy on
the head-dominated model of `bench/overhead.py --sweep`, each op's own time charged to the
guard function that called it (the innermost guard/ frame among its profiler parents).

    .venv/bin/python bench/guard_profile.py --threads 1          # Qwen2's 151,665 / 151,936
    .venv/bin/python bench/guard_profile.py --real 50257 --rows 50304
    cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/old/server .venv/bin/python \\
        /work/main/bench/guard_profile.py --threads 1            # another tree, same machine

Reported: ms a step spent inside ops (the profiler times each op from start to end, so on a
busy machine, and with threads that wait for each other, an op takes longer than its work),
for the whole step and per guard function, and the ops each guard function calls a step (the
count tests/guard/device/test_op_budget.py keeps in a budget). Uses the public API only: it
runs on any tree.
"""

from __future__ import annotations

import argparse
import collections
import logging
import re
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import guard
from guard.demo.model import GPT, GPTConfig

# A Python frame of the profile: "guard/<path>.py(<line>): <function>"
_FRAME = re.compile(r"guard/([\w/]+)\.py\(\d+\): (\w+)$")


def charged(event: Any) -> str | None:
    """`path.function` of the innermost guard/ frame above an op (its profiler parents), or
    None: the model's and the optimizer's own ops."""
    parent = event.cpu_parent
    while parent is not None:
        found = _FRAME.search(parent.name)
        if found is not None and not found.group(1).startswith("demo/"):
            return f"{found.group(1)}.{found.group(2)}"
        parent = parent.cpu_parent
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--real", type=int, default=151665)
    p.add_argument("--rows", type=int, default=151936)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    # The model: the sweep's head-dominated one by default; the bench model of
    # bench/overhead.py is --n-layer 4 --n-embd 256 --n-head 4 --real 50257 --rows 50304.
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--mask", action="store_true", help="bench/overhead.py's mask arm's policy")
    p.add_argument("--ops", action="store_true",
                   help="under each guard function, its aten ops and their ms a step")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.getLogger("guard").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.rows, block_size=args.block, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=False)
    policy: dict[str, Any] = {"export": {"serve": None}}
    if args.mask:
        policy["checks"] = {"padding_mass": {"action": "mask"}, "nonfinite": {"action": "warn"},
                            "token_range": {"action": "warn"}, "loss_spike": {"action": "off"}}
    g = guard.attach(model, policy=policy, vocab_size=args.real, optimizer=opt)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        x = torch.randint(0, args.real, (args.batch, args.block + 1), generator=gen)
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(args.steps):
            step()
    g.detach()
    parts: collections.Counter[str] = collections.Counter()
    ops: collections.Counter[tuple[str, str]] = collections.Counter()
    # Ops called by the guard function itself (not an op's own inner ops): what its Python
    # issues, each a dispatch that costs host time in a step (tests/guard/device/test_op_budget.py).
    calls: collections.Counter[str] = collections.Counter()
    total = 0.0
    for event in prof.events():
        if not event.name.startswith("aten::"):  # Python frames and annotations: no work
            continue
        total += event.self_cpu_time_total
        where = charged(event)
        if where is not None:
            parts[where] += event.self_cpu_time_total
            parent = event.cpu_parent
            if parent is None or not parent.name.startswith("aten::"):
                calls[where] += 1
            ops[where, event.name] += event.self_cpu_time_total
    per_step = {k: v / args.steps / 1e3 for k, v in parts.items()}
    print(f"guard {guard.__file__}; {torch.get_num_threads()} threads; vocab {args.real} real "
          f"/ {args.rows} rows; batch {args.batch} x {args.block}")
    print(f"| part | ms a step inside its ops | ops it calls a step |\n|---|---|---|\n"
          f"| the whole step (all ops) | {total / args.steps / 1e3:.1f} | |")
    print(f"| the guard (ops called from guard/) | {sum(per_step.values()):.1f} | "
          f"{sum(calls.values()) / args.steps:.0f} |")
    for where, ms in sorted(per_step.items(), key=lambda kv: -kv[1]):
        if ms >= 0.05:
            print(f"| `{where}` | {ms:.2f} | {calls[where] / args.steps:.0f} |")
            for (at, op), us in sorted(ops.items(), key=lambda kv: -kv[1]):
                if args.ops and at == where and us / args.steps >= 20:
                    print(f"| &nbsp;&nbsp;`{op}` | {us / args.steps / 1e3:.2f} | |")


if __name__ == "__main__":
    main()
