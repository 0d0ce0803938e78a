"""One rank of the torchrun test (tests/integrations/test_distributed.py); not a test itself.

usage: python -m torch.distributed.run --nproc-per-node 2 ... dist_worker.py OUT_DIR SERVE_PORT
       [MODE]

MODE: `tiny` (the project's GPT, default), `ddp-wrapper` or `ddp-module` (nanoGPT's own
model.py inside DistributedDataParallel, called as nanoGPT's train.py does, `model(X, Y)`;
the guard attached to the wrapper or to its `.module`). Rank 1 alone feeds a ghost label at
step 3; every rank writes OUT_DIR/rank<N>.json with the
step it raised at, the violation's data, its collective counts and its /metrics endpoint.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

import guard
from guard.device.flags import Flags
from tests.conftest import batch, policy, tiny_gpt

GHOST_RANK, GHOST_STEP, STEPS = 1, 3, 6


def count_calls(owner: Any, name: str, counts: dict[str, int], key: str) -> None:
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def nanogpt(mode: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model the loop calls, the module the guard is attached to)."""
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "nanogpt"))
    import model as nano  # nanoGPT's own model.py

    torch.manual_seed(0)
    cfg = nano.GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=32,
                         dropout=0.0, bias=False)
    ddp = DistributedDataParallel(nano.GPT(cfg))
    return ddp, (ddp if mode == "ddp-wrapper" else ddp.module)


def main(out: Path, serve_port: int, mode: str = "tiny") -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    counts = {"all_reduce": 0, "read": 0, "other_collectives": 0}
    count_calls(dist, "all_reduce", counts, "all_reduce")
    for name in ("broadcast", "all_gather", "all_gather_into_tensor", "reduce", "barrier",
                 "reduce_scatter", "all_to_all", "send", "recv"):
        count_calls(dist, name, counts, "other_collectives")
    count_calls(Flags, "read", counts, "read")

    model = target = tiny_gpt()
    if mode != "tiny":
        model, target = nanogpt(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pol = policy()
    pol["export"] = {"serve": f"127.0.0.1:{serve_port}"}
    result: dict[str, Any] = {"rank": rank, "raised_at": None}
    try:
        with guard.attach(target, policy=pol, vocab_size=100, optimizer=opt) as g:
            result.update(run_id=g.run_id, guard_rank=g.rank,
                          metrics_url=g.metrics_url)
            for step in range(1, STEPS + 1):
                x, y = batch(seed=step)
                if rank == GHOST_RANK and step == GHOST_STEP:
                    y[0, 0] = 120  # a padding id: the real vocab is 100
                _, loss = model(x, y)
                loss.backward()
                opt.step()  # the guard reads (one all-reduce) in the step pre-hook
                opt.zero_grad()
                if step == 2 and g.metrics_url:
                    result["metrics"] = httpx.get(g.metrics_url, timeout=10).text
    except guard.GuardViolation as e:
        result.update(raised_at=step, check=e.check, step=e.step, violation_rank=e.rank,
                      message=str(e))
    result["counts"] = counts
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
