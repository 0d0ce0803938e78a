"""One rank of the torchrun test (tests/integrations/test_distributed.py); not a test itself.

usage: python -m torch.distributed.run --nproc-per-node 2 ... dist_worker.py OUT_DIR SERVE_PORT
       [MODE]

MODE: `tiny` (the project's GPT, default), `ddp-wrapper` or `ddp-module` (nanoGPT's own
model.py inside DistributedDataParallel, called as nanoGPT's train.py does, `model(X, Y)`;
the guard attached to the wrapper or to its `.module`), `fsdp2` (nanoGPT under FSDP2's
`fully_shard`, each Block then the root: the weights are DTensors sharded by rows). Rank 1
alone feeds a ghost label at step 3; every rank writes OUT_DIR/rank<N>.json with the
step it raised at, the violation's data, its collective counts and its /metrics endpoint.
MODE `fsdp2-checks` runs the other checks under FSDP2 instead (FSDP2_CHECKS), one entry each;
`repair-order` two repairs at one read under FSDP2, the ranks under different hash seeds;
`nan-grad-ddp` / `nan-grad-fsdp2` a NaN born in rank 1's backward, under fail and skip
(`-fused` after either: with a fused AdamW, which drops the update on the device).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import httpx
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

import guard
from guard.device.flags import Flags
from tests.conftest import batch, policy, tiny_gpt
from tests.guard.test_backward_nan import NaNBackward
from tests.integrations.nanogpt import nanogpt

GHOST_RANK, GHOST_STEP, STEPS = 1, 3, 6


class Logged(logging.Handler):
    """The guard logger's warnings and errors while a case runs: a healthy run says none."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def count_calls(owner: Any, name: str, counts: dict[str, int], key: str) -> None:
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def wrapped_nanogpt(mode: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model the loop calls, the module the guard is attached to)."""
    from torch.nn.parallel import DistributedDataParallel

    if mode == "fsdp2":  # in place: the model is the FSDPModule, nothing wraps it
        model = sharded(nanogpt(garbage=None))
        return model, model
    ddp = DistributedDataParallel(nanogpt(garbage=None))
    return ddp, (ddp if mode == "ddp-wrapper" else ddp.module)


@functools.cache
def cpu_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    """nanoGPT under FSDP2 as its examples shard a transformer: each Block, then the root (the
    tied wte / lm_head and ln_f). Sharded by rows: rank r holds rows [64 r, 64 (r + 1)) of a
    128-row weight, as DTensors, outside forward and backward."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return model


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, *, real: int = 100,
          g: guard.Guard | None = None, nan_at: int | None = None) -> list[float]:
    """This rank's losses; each rank its own batches. `nan_at`: at that step rank 0 shows
    the guard a NaN loss (g.step), while the finite loss is backpropagated as before."""
    losses: list[float] = []
    for step in range(1, steps + 1):
        _, loss = model(*rank_batch(step, dist.get_rank(), real))
        losses.append(loss.item())
        loss.backward()
        if g is not None and step == nan_at and dist.get_rank() == 0:
            g.step(torch.tensor(float("nan")))
        opt.step()
        opt.zero_grad()
    return losses


def rank_batch(step: int, rank: int, real: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(real, seed=10 * step + rank)


def violation(e: guard.GuardViolation) -> dict[str, Any]:
    return {"check": e.check, "step": e.step, "rank": e.rank, "message": str(e)}


def padding_rows_under_fsdp2() -> dict[str, Any]:
    """Garbage in rows [20, 64) of a 64-row vocab, split between the shards at row 32: rank 0
    holds real rows and padding, rank 1 padding only (no real row to scale its norms by)."""
    from torch.distributed.tensor.debug import CommDebugMode

    real, rows = 20, 64
    out: dict[str, Any] = {}
    clean = sharded(nanogpt(garbage=None, rows=rows, real=real))  # rows initialised as real ones
    with guard.attach(clean, policy=policy(padding_rows={"action": "warn"}),
                      vocab_size=real) as g:
        pass
    out["clean_violations"] = g.stats["violations"]
    model = nanogpt(garbage=1e3, rows=rows, real=real)
    before = model.lm_head.weight.detach().clone()  # (64, 32), the whole weight
    sharded(model)
    weight: Any = model.lm_head.weight  # a DTensor: this rank's 32 rows
    try:
        guard.attach(model, policy=policy(padding_rows={"action": "fail"}), vocab_size=real)
    except guard.GuardViolation as e:
        out["fail"] = violation(e)
    out["fail_left_rows"] = torch.equal(weight.full_tensor(), before)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with guard.attach(model, policy=policy(padding_rows={"action": "repair"}), vocab_size=real,
                      optimizer=opt) as g:
        full = weight.full_tensor()
        mean = before[:real].float().mean(dim=0)  # the real rows', of the whole weight
        out["mean_local_rows"] = int(torch.isclose(weight.to_local(), mean, atol=1e-6)
                                     .all(dim=-1).sum())
        out["repaired"] = bool(torch.allclose(full[real:], mean.expand(rows - real, -1),
                                              atol=1e-6)) and torch.equal(full[:real],
                                                                          before[:real])
        for step in range(1, 4):
            _, loss = model(*rank_batch(step, dist.get_rank(), real))
            loss.backward()
            if step == 2 and dist.get_rank() == 0:
                with torch.no_grad():
                    weight.to_local()[real:] = 1e3  # rank 0's padding rows [20, 32), mid-run
            with CommDebugMode() as comm:  # counts DTensor's collectives too (a gather)
                opt.step()  # the read: the rows each rank holds, checked and repaired
            out.setdefault("step_collectives", []).append(
                {str(op): n for op, n in comm.get_comm_counts().items()})
            opt.zero_grad()
    out["violations"] = g.stats["violations"]
    full = weight.full_tensor()
    out["no_garbage_after_training"] = bool(full[real:].norm(dim=-1).amax()
                                            <= full[:real].norm(dim=-1).amax())
    return out


def real_vocab_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same nanoGPT with the real rows only: what the mask must train like."""
    ref = nanogpt(garbage=None, rows=100)
    ref.load_state_dict({k: v[:100] if k in ("transformer.wte.weight", "lm_head.weight") else v
                         for k, v in model.state_dict().items()})
    return ref


def mask_under_fsdp2() -> dict[str, Any]:
    """The mask trains the sharded 128-row model as a 100-row one trained in one process on
    both ranks' batches; without it the loss is off from step 1 (padding_mass: fail)."""
    out: dict[str, Any] = {}
    model = nanogpt(garbage=None)
    ref = real_vocab_copy(model)
    sharded(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with guard.attach(model, policy=policy(padding_mass={"action": "mask"}), vocab_size=100,
                      optimizer=opt) as g:
        out["losses"] = train(model, opt, 4)
    out["stats"] = g.stats
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out["reference"] = []
    for step in range(1, 5):  # the global batch: every rank's, as FSDP2 averages them
        xs, ys = zip(*(rank_batch(step, r) for r in range(dist.get_world_size())), strict=True)
        _, loss = ref(torch.cat(xs), torch.cat(ys))
        out["reference"].append(loss.item())
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    unmasked = sharded(nanogpt(garbage=None))
    opt = torch.optim.AdamW(unmasked.parameters(), lr=1e-2)
    out["fail"] = None
    with guard.attach(unmasked, policy=policy(padding_mass={"action": "fail"}), vocab_size=100,
                      optimizer=opt) as g:
        try:
            train(unmasked, opt, 2, g=g)
        except guard.GuardViolation as e:
            out["fail"] = violation(e)
    out["unmasked_loss"] = g.stats["loss"]  # this rank's, at the last step
    return out


def nonfinite_under_fsdp2() -> dict[str, Any]:
    """A NaN loss on rank 0 at step 2: `fail` stops both ranks there, localised by a re-run of
    the forward (FSDP2 gathers the weights for it); under `warn` training goes on exactly as
    a run without the NaN."""
    out: dict[str, Any] = {}
    for action, nan_at in (("warn", None), ("warn", 2), ("fail", 2)):
        model = sharded(nanogpt(garbage=None))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with guard.attach(model, policy=policy(nonfinite={"action": action}), vocab_size=100,
                          optimizer=opt) as g:
            key = f"{action}-{nan_at}"
            try:
                out[key] = {"losses": train(model, opt, 4, g=g, nan_at=nan_at)}
            except guard.GuardViolation as e:
                out[key] = violation(e)
        out[key]["stats"] = g.stats
    return out


def untrained_under_fsdp2() -> dict[str, Any]:
    """Rows [60, 70) of the real vocab never trained (zero), across the shards' boundary at
    row 64; at step 1 rank 0's input ids use 61 only and rank 1's 66 only. Under repair both
    rows are set to the mean of the whole weight's trained rows on the rank that holds them,
    and both ranks name both ids."""
    untrained, used = list(range(60, 70)), {0: 61, 1: 66}
    model = nanogpt(garbage=None)
    with torch.no_grad():
        model.lm_head.weight[untrained] = 0.0  # tied: wte's rows too
    keep = torch.ones(128, dtype=torch.bool)
    keep[untrained] = False
    keep[100:] = False  # padding rows
    mean = model.lm_head.weight.detach()[keep].mean(dim=0)
    sharded(model)
    weight: Any = model.lm_head.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the rows stay as the repair left them
    out: dict[str, Any] = {}
    with guard.attach(model, policy=policy(), vocab_size=100, optimizer=opt) as g:
        out["found"] = g.stats["untrained_rows"]
        x, y = rank_batch(1, dist.get_rank())
        x, y = x % 60, y % 60  # no untrained id but this rank's one
        x[0, 0] = used[dist.get_rank()]
        model(x, y)[1].backward()
        opt.step()
        model(x, y)[1].backward()  # the same id again: no longer untrained
        opt.step()
    full = weight.full_tensor()
    out["stats"] = {k: g.stats[k] for k in ("untrained_rows", "untrained_tokens", "violations")}
    out["repaired"] = [i for i in untrained if torch.allclose(full[i], mean, atol=1e-6)]
    out["zero"] = [i for i in untrained if not full[i].any()]
    return out


def both_repairs_at_one_read() -> dict[str, Any]:
    """padding_rows and untrained_rows repair at the same read, each a collective under FSDP2
    (the sums of the rows its mean is taken over; the ids used, max-combined): garbage written
    into the padding rows and an untrained id used on each rank at step 2. The
    ranks run under different PYTHONHASHSEEDs (the test's), so an order taken from a set of
    check names would differ between them."""
    untrained, used = list(range(60, 70)), {0: 61, 1: 66}
    model = nanogpt(garbage=None)  # 128 rows, real 100: rank 1 holds the padding rows
    with torch.no_grad():
        model.lm_head.weight[untrained] = 0.0  # tied: wte's rows too
    sharded(model)
    weight: Any = model.lm_head.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the rows stay as the repairs left them
    repair = policy(padding_rows={"action": "repair"})
    with guard.attach(model, policy=repair, vocab_size=100, optimizer=opt) as g:
        for step in (1, 2):  # step 1 trains on trained ids only (FSDP2 sets itself up)
            x, y = rank_batch(step, dist.get_rank())
            x, y = x % 60, y % 60
            if step == 2:
                x[0, 0] = used[dist.get_rank()]
            model(x, y)[1].backward()
            if step == 2 and dist.get_rank() == 1:
                with torch.no_grad():
                    weight.to_local()[100 - 64 :] = 1e3  # global rows [100, 128)
            opt.step()  # step 2's read: both checks fire, both repair
    full = weight.full_tensor()
    trained = torch.ones(100, dtype=torch.bool)
    trained[untrained] = False
    return {"violations": g.stats["violations"],
            "untrained_repaired": [i for i in (61, 66) if torch.allclose(
                full[i], full[:100][trained].mean(dim=0), atol=1e-6)],
            # padding_rows repairs after untrained_rows (the table's order): the mean of the
            # real rows as that repair left them.
            "padding_repaired": bool(torch.allclose(
                full[100:], full[:100].mean(dim=0).expand(28, -1), atol=1e-6))}


NAN_RANK, NAN_STEP = 1, 2


def nan_gradient(wrap: str, fused: bool = False) -> dict[str, Any]:
    """nanoGPT under DDP or FSDP2; at step 2 rank 1 alone makes a NaN in the backward of its
    first block (its forward finite). Under fail both ranks stop before that update, their
    weights as they were; under skip both drop it and train on alike. `fused`: a fused AdamW
    drops step 2's update on the device on both ranks (`dropped`: the weights after step 2 are
    step 1's) and fail raises at step 3's read."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for action in ("fail", "skip"):
        model = nanogpt(garbage=None)
        model = sharded(model) if wrap == "fsdp2" else DistributedDataParallel(model)
        inner = model if wrap == "fsdp2" else model.module
        step_now = {"step": 0}

        def fault(module: Any, args: Any, y: torch.Tensor, now: dict[str, int] = step_now) -> Any:
            hit = now["step"] == NAN_STEP and dist.get_rank() == NAN_RANK
            return NaNBackward.apply(y) if hit else None

        inner.transformer.h[0].register_forward_hook(fault)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
        res: dict[str, Any] = {"raised_at": None}
        after: dict[int, list[torch.Tensor]] = {}
        with guard.attach(inner, policy=policy(nonfinite={"action": action}), vocab_size=100,
                          optimizer=opt) as g:
            try:
                for step in range(1, 5):
                    step_now["step"] = step
                    _, loss = model(*rank_batch(step, dist.get_rank()))
                    loss.backward()
                    before = [p.detach().clone() for p in model.parameters()]
                    opt.step()
                    opt.zero_grad()
                    after[step] = [p.detach().clone() for p in model.parameters()]
            except guard.GuardViolation as e:
                res.update(raised_at=step, violation=violation(e), unchanged=all(
                    torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(),
                                                               strict=True)))
            after.setdefault(2, [p.detach().clone() for p in model.parameters()])
        res["dropped"] = all(torch.equal(a, b) for a, b in zip(after[1], after[2], strict=True))
        res["stats"] = {k: g.stats[k] for k in ("skipped_steps", "violations", "nonfinite")}
        res["finite"] = all(bool(torch.isfinite(p.detach()).all()) for p in model.parameters())
        out[action] = res
    return out


FSDP2_CHECKS = {"padding_rows": padding_rows_under_fsdp2, "mask": mask_under_fsdp2,
                "nonfinite": nonfinite_under_fsdp2, "untrained": untrained_under_fsdp2}


def recorded(case: Callable[[Any], dict[str, Any]], run: Any) -> dict[str, Any]:
    """A case's results on `run`, or the error it raised (the test then fails on that case
    alone, unless the error left another rank waiting in a collective: the launch's
    timeout)."""
    try:
        return case(run)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def finish(out: Path, rank: int, result: Any) -> NoReturn:
    """Write this rank's result and end the process without Python's finalisation. Gloo's
    worker thread drops its last reference to a finished collective a moment after the
    caller's wait returns; when that reference holds a tensor it takes the GIL, and if the
    interpreter is finalising by then the thread exits inside a C++ destructor: "terminate
    called without an active exception", SIGABRT (seen in ~1 run in 3 on a loaded 2-core
    machine, after every result was written; a core dump shows the gloo runLoop in
    ~AsyncAllgatherCoalescedWork). That is torch's shutdown race, not the guard's: the
    results are written and flushed first, so skipping finalisation loses nothing."""
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(out: Path, serve_port: int, mode: str = "tiny") -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    if mode == "fsdp2-checks":
        finish(out, rank, {name: check() for name, check in FSDP2_CHECKS.items()})
    if mode == "repair-order":
        finish(out, rank, both_repairs_at_one_read())
    if mode.startswith("nan-grad-"):
        wrap, _, fused = mode.removeprefix("nan-grad-").partition("-")
        finish(out, rank, nan_gradient(wrap, fused == "fused"))
    counts = {"all_reduce": 0, "read": 0, "other_collectives": 0}
    count_calls(dist, "all_reduce", counts, "all_reduce")
    for name in ("broadcast", "all_gather", "all_gather_into_tensor", "reduce", "barrier",
                 "reduce_scatter", "all_to_all", "send", "recv"):
        count_calls(dist, name, counts, "other_collectives")
    count_calls(Flags, "read", counts, "read")

    model = target = tiny_gpt()
    if mode != "tiny":
        model, target = wrapped_nanogpt(mode)
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
    finish(out, rank, result)


if __name__ == "__main__":
    # GUARD_TEST_HASHSEEDS="a,b": rank r re-executes itself under PYTHONHASHSEED of the r-th
    # (the seed is read when the interpreter starts; torchrun gives both ranks one environment).
    seeds = os.environ.get("GUARD_TEST_HASHSEEDS", "").split(",")
    mine = seeds[int(os.environ.get("LOCAL_RANK", "0"))] if len(seeds) > 1 else None
    if mine is not None and os.environ.get("PYTHONHASHSEED") != mine:
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "PYTHONHASHSEED": mine})
    main(Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
