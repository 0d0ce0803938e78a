"""GPU only: a guarded training loop under torch.cuda.set_sync_debug_mode("error") between reads.

The guard reads its flags every `--read-every` steps. On every other step the loop runs with
CUDA's sync debug mode set to "error", so any host synchronisation (an .item(), a blocking
copy, a data-dependent shape) inside the guard's hooks or its step pre-hook raises. The read
steps run in the default mode: a read is the one place the guard is allowed to wait.

    python bench/sync_check.py --steps 40 --read-every 10                  # the default policy
    python bench/sync_check.py --policy warn --optimizer foreach          # warn/mask only
    python bench/sync_check.py --policy skip --nan-at 15                  # a dropped update

`--policy default` (the policy's defaults: nonfinite and token_range fail) with a fused AdamW
reads one read late, the bad update dropped on the device (`cadence.fail_read`, docs/checks.md);
`--nan-at N` makes step N's logits NaN: under `default` the GuardViolation comes at the next
read, naming step N, under `skip` training goes on; either way nothing syncs between reads.
Prints one line per read and "no synchronisation between reads" at the end; exits 1 on a
sync (naming the step), 2 without CUDA.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

import guard
from guard.demo.model import GPT, GPTConfig

REAL, ROWS = 50257, 50304


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--read-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--policy", choices=("default", "skip", "warn"), default="default")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused")
    p.add_argument("--nan-at", type=int, default=0, help="make this step's logits NaN")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("sync_check: needs a CUDA device", file=sys.stderr)
        return 2
    logging.getLogger("guard").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=ROWS, block_size=args.block, n_layer=4, n_head=4,
                          n_embd=256)).cuda()
    fused = args.optimizer == "fused"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused, foreach=not fused)
    # warn/mask only: the read is lagged (non-blocking copy to pinned memory, read next time);
    # default / skip with a fused AdamW: lagged too, the bad update dropped on the device.
    actions = {"warn": "warn", "skip": "skip"}.get(args.policy)
    policy = {"export": {"serve": None}, "cadence": {"read_every": args.read_every},
              "checks": {} if actions is None else {c: {"action": actions} for c in
                                                    ("nonfinite", "loss_spike")}}
    g = guard.attach(model, policy=policy, vocab_size=REAL, optimizer=opt)
    if args.nan_at:
        model.lm_head.register_forward_hook(
            lambda m, a, out: out * float("nan") if step == args.nan_at else None)
    step = 0
    data = torch.randint(0, REAL, (args.steps, args.batch, args.block + 1), device="cuda")
    for step in range(1, args.steps + 1):
        reads_now = step % args.read_every == 0
        torch.cuda.set_sync_debug_mode("default" if reads_now or step <= 2 else "error")
        try:
            x, y = data[step - 1, :, :-1], data[step - 1, :, 1:]
            _, loss = model(x, y)
            loss.backward()
            opt.step()  # the guard's step pre-hook: its boundary, and a read every N steps
            opt.zero_grad(set_to_none=True)
        except guard.GuardViolation as e:
            torch.cuda.set_sync_debug_mode("default")
            print(f"step {step}: GuardViolation at the read, naming step {e.step}: {e.check}")
            break
        except RuntimeError as e:
            torch.cuda.set_sync_debug_mode("default")
            print(f"sync_check: step {step} synchronised: {e}", file=sys.stderr)
            return 1
        torch.cuda.set_sync_debug_mode("default")
        if reads_now:
            print(f"step {step}: read, stats {g.stats['step']} padding_mass "
                  f"{g.stats['padding_mass']}")
    g.detach()
    print(f"no synchronisation between reads ({step} steps, a read every {args.read_every}, "
          f"policy {args.policy}, {args.optimizer} AdamW; steps 1-2 warm up allocator and "
          "kernels in default mode)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
