"""One rank of the pipeline-parallel tests (tests/integrations/test_pipeline.py); not a test.

usage: python -m torch.distributed.run --nproc-per-node N ... pp_worker.py OUT_DIR MODE

MODE `pp2`: pp_models.GPT split in 2 stages (one per rank), trained by torch's own pipelining
(`PipelineStage` and a schedule, 2 micro-batches) under each schedule (`gpipe`, `1f1b`), every
case of CASES; `tie`: the embedding and the head tied copies on the two stages, and untrained
rows on each (GPipe);
`pp3`: 3 stages (GPipe), a NaN born in the middle stage's backward.
Every rank attaches to its `PipelineStage`; the last stage wraps the schedule's loss with
`g.loss_fn`. Each rank writes OUT_DIR/rank<N>.json: per schedule, per case, what the guard
did on this rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

import guard
from tests.integrations import pp_models as pm
from tests.integrations.dist_worker import finish, violation
from tests.integrations.tp_worker import DEFAULT, logged, with_checks

STEPS, MICRO = 3, 2


class Pipe:
    """This rank's stage of a GPT split in `stages`, its schedule, its optimizer and its
    guard; `step` runs one training step as a torchtitan loop does."""

    def __init__(self, schedule: str, model: pm.GPT, policy: dict[str, Any],
                 stages: int | None = None, **attach: Any) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.index, self.stages = dist.get_rank(), stages or dist.get_world_size()
        self.module = pm.split(model, self.index, self.stages)
        self.stage = PipelineStage(self.module, self.index, self.stages, torch.device("cpu"))
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.guard = guard.attach(self.stage, policy=policy, vocab_size=pm.REAL,
                                  optimizer=self.opt, **attach)
        assert self.guard.stage is not None
        self.last = self.guard.stage.head
        # Every stage is given the loss (torch's schedules run a backward only then); the
        # last stage's goes through the guard.
        loss = self.guard.loss_fn(pm.loss_fn) if self.last else pm.loss_fn
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(self.stage, n_microbatches=MICRO, loss_fn=loss)
        self.before_update: Callable[[], None] = lambda: None

    def step(self, n: int, *, ghost: bool = False,
             at: dict[tuple[int, int], tuple[int, int]] | None = None) -> float | None:
        """Step `n`: this rank's part of the schedule, then the update; the last stage's loss
        (the micro-batches' mean). `at`: {position: (input id, label)} written in."""
        x, y = pm.batch(n, ghost=ghost)
        for (i, j), (xi, yi) in (at or {}).items():
            x[i, j], y[i, j] = xi, yi
        losses: list[torch.Tensor] = []
        if self.index == 0:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.before_update()
        self.opt.step()
        self.opt.zero_grad()
        return float(torch.stack(losses).detach().mean()) if losses else None

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.module.parameters()]

    def unchanged(self, before: list[torch.Tensor]) -> bool:
        return all(torch.equal(a.nan_to_num(), p.detach().nan_to_num())
                   for a, p in zip(before, self.module.parameters(), strict=True))


def stopped(pipe: Pipe, steps: int = STEPS, first: Callable[[int], None] = lambda n: None,
            **at: bool) -> dict[str, Any]:
    """Steps until the guard stops one: the step it raised at, its violation, and whether
    this rank's weights were left bitwise as they were before that step. `first(n)` runs
    before step n."""
    out: dict[str, Any] = {"raised_at": None}
    with pipe.guard:
        for n in range(1, steps + 1):
            first(n)
            before = pipe.weights()
            try:
                pipe.step(n, ghost=at.get("ghost", False) and n == 2)
            except guard.GuardViolation as e:
                out.update(raised_at=n, violation=violation(e), unchanged=pipe.unchanged(before))
                break
    return out


def healthy(schedule: str) -> dict[str, Any]:
    """The defaults on a healthy model: nothing fires, nothing is logged, on any stage."""
    with logged() as lines:
        pipe = Pipe(schedule, pm.build(), DEFAULT)
        with pipe.guard as g:
            losses = [pipe.step(n) for n in range(1, STEPS + 1)]
    return {"violations": g.stats["violations"], "logged": lines, "losses": losses,
            "stats_loss": g.stats["loss"]}


def garbage(schedule: str) -> dict[str, Any]:
    """Garbage in the head's padding rows (norm 1e4): padding_rows stops attach on every
    stage; with the rows left alone and no mask, padding_mass stops step 1 on every stage."""
    out: dict[str, Any] = {}
    try:
        Pipe(schedule, pm.build(garbage=True), with_checks(padding_rows={"action": "fail"}))
    except guard.GuardViolation as e:
        out["rows"] = violation(e)
    pol = with_checks(padding_rows={"action": "off"}, padding_mass={"action": "fail"})
    out["mass"] = stopped(Pipe(schedule, pm.build(garbage=True), pol))
    return out


def mask(schedule: str) -> dict[str, Any]:
    """The garbage rows left in place under the mask (the default): the losses of the same
    weights unsplit with the real rows only, and no gradient reaches a padding row."""
    whole = pm.build(garbage=True)
    ref = pm.real_rows(whole)
    pipe = Pipe(schedule, whole, with_checks(padding_rows={"action": "off"}))
    grads: list[float] = []
    head = pipe.module.output
    if head is not None:
        pipe.before_update = lambda: grads.append(float(head.weight.grad[pm.REAL:].abs().sum()))
    with pipe.guard as g:
        losses = [pipe.step(n) for n in range(1, STEPS + 1)]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reference = []
    for n in range(1, STEPS + 1):
        x, y = pm.batch(n)
        loss = pm.loss_fn(ref(x), y)
        reference.append(float(loss))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"losses": losses, "reference": reference, "padding_grad": grads,
            "violations": g.stats["violations"]}


def ghost(schedule: str) -> dict[str, Any]:
    """A padding id among step 2's input ids, seen by stage 0 alone: every stage stops."""
    pipe = Pipe(schedule, pm.build(), DEFAULT)
    out = stopped(pipe, ghost=True)
    out["out_of_range"] = pipe.guard.stats["out_of_range"]
    return out


CASES: dict[str, Callable[[str], dict[str, Any]]] = {
    "healthy": healthy, "garbage": garbage, "mask": mask, "ghost": ghost}


def nan_middle(schedule: str) -> dict[str, Any]:
    """3 stages: at step 2 a NaN is born in the backward of the middle stage's MLP (its
    forward finite); every stage stops before its update, the middle stage's parameter
    named."""
    from tests.guard.test_backward_nan import NaNBackward

    out: dict[str, Any] = {}
    with logged() as lines:
        pipe = Pipe(schedule, pm.build(), DEFAULT)
        with pipe.guard as g:
            for n in range(1, STEPS + 1):
                pipe.step(n)
        out["healthy"] = {"violations": g.stats["violations"], "logged": lines}
    pipe = Pipe(schedule, pm.build(), DEFAULT)
    now = {"step": 0}
    if dist.get_rank() == 1:
        def fault(module: Any, args: Any, y: torch.Tensor) -> Any:
            return NaNBackward.apply(y) if now["step"] == 2 else None

        pipe.module.layers["1"].mlp.register_forward_hook(fault)
    out["nan"] = stopped(pipe, first=lambda n: now.update(step=n))
    return out


def untrained(schedule: str) -> dict[str, Any]:
    """Rows 10 and 11 of the embedding and 600 of the head never trained (zero): input id 10
    and label 600 at step 2 repair them on the stage that holds each, every stage at the
    same read (the untrained ids one list on every stage)."""
    model = pm.build()
    assert model.tok_embeddings is not None and model.output is not None
    with torch.no_grad():
        model.tok_embeddings.weight[[10, 11]] = 0.0
        model.output.weight[600] = 0.0
    pipe = Pipe(schedule, model, DEFAULT)
    m = pipe.module
    with logged() as lines, pipe.guard as g:
        for n in range(1, STEPS + 1):
            pipe.step(n, at={(0, 0): (10, 600)} if n == 2 else None)
    rows = {"embedding": m.tok_embeddings.weight[[10, 11]] if m.tok_embeddings else None,
            "head": m.output.weight[[600]] if m.output else None}
    said = [line for line in lines if line.startswith("untrained_rows on rank 1 at step 2")]
    return {"violations": g.stats["violations"], "message": said[0] if said else None,
            "repaired": {
        k: [bool(r.abs().sum() > 0) for r in w] for k, w in rows.items() if w is not None}}


def tied_pipe(schedule: str, model: pm.GPT, policy: dict[str, Any]) -> Pipe:
    """The embedding and the head tied copies on the first and the last stage, their
    gradients summed before each update (Megatron's embedding group all-reduce)."""
    pipe = Pipe(schedule, model, policy, tied_across_stages=True)
    m = pipe.module
    copy = m.tok_embeddings if m.tok_embeddings is not None else m.output
    assert copy is not None

    def sync() -> None:
        dist.all_reduce(copy.weight.grad)

    pipe.before_update = sync
    return pipe


def tied(schedule: str) -> dict[str, Any]:
    """Tied copies kept in step: quiet; one copy written between steps 1 and 2 (rows 5 and
    700 of the head): every stage stops at step 2's read, before the update; one copy loaded
    apart before attach: attach stops."""
    out: dict[str, Any] = {}
    with logged() as lines:
        pipe = tied_pipe(schedule, pm.build(tied=True), DEFAULT)
        with pipe.guard as g:
            for n in range(1, STEPS + 1):
                pipe.step(n)
        out["healthy"] = {"violations": g.stats["violations"], "logged": lines}
    every = with_checks(vocab={"tie_every": 1})  # the drift named at the next read
    pipe = tied_pipe(schedule, pm.build(tied=True), every)
    head = pipe.module.output

    def write(n: int) -> None:  # one copy written between steps 1 and 2
        if n == 2 and head is not None:
            with torch.no_grad():
                head.weight[[5, 700], 3] += 1e-3

    out["drift"] = stopped(pipe, first=write)
    model = pm.build(tied=True)
    if dist.get_rank() == dist.get_world_size() - 1:
        assert model.output is not None
        with torch.no_grad():
            model.output.weight[999] *= 2.0  # a resume that loaded this copy only
    try:
        tied_pipe(schedule, model, DEFAULT)
    except guard.GuardViolation as e:
        out["at_attach"] = violation(e)
    return out


def recorded(case: Callable[[str], dict[str, Any]], schedule: str) -> dict[str, Any]:
    """The case's results, or the error it raised (the test then fails on that case alone,
    unless the error left another rank waiting in a collective: the launch's timeout)."""
    try:
        return case(schedule)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    cases, schedules = {"pp2": (CASES, ("gpipe", "1f1b")),
                        "tie": ({"tied": tied, "untrained": untrained}, ("gpipe",)),
                        "pp3": ({"nan_middle": nan_middle}, ("gpipe",))}[mode]
    result = {schedule: {name: recorded(case, schedule) for name, case in cases.items()}
              for schedule in schedules}
    finish(out, dist.get_rank(), result)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
