"""One rank of the pipeline-parallel tests (tests/integrations/test_pipeline.py); not a test.

usage: python -m torch.distributed.run --nproc-per-node N ... pp_worker.py OUT_DIR MODE

MODE `pp2`: pp_models.GPT split in 2 stages (one per rank), trained by torch's own pipelining
(`PipelineStage` and a schedule, 2 micro-batches) under each schedule (`gpipe`, `1f1b`), every
case of CASES; `tie`: the embedding and the head tied copies on the two stages, and untrained
rows on each (GPipe);
`pp3`: 3 stages (GPipe), a NaN born in the middle stage's backward;
`pp2tp2`: 4 ranks, a ("pp", "tp") mesh: 2 stages over "pp", each stage's ends vocab-parallel
over "tp" (pp_models.vocab_parallel: the head's logits a DTensor under `loss_parallel`), every
case of CASES, a NaN born in the first stage's backward and the tied copies, under each
schedule.
Every rank attaches to its `PipelineStage`; the last stage wraps the schedule's loss with
`g.loss_fn`. Each rank writes OUT_DIR/rank<N>.json: per schedule, per case, what the guard
did on this rank.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

import guard
from tests.integrations import pp_models as pm
from tests.integrations.dist_worker import finish, recorded, violation
from tests.integrations.tp_worker import DEFAULT, guard_local, logged, with_checks

STEPS, MICRO = 3, 2


@dataclass(frozen=True)
class Run:
    """Where this rank runs a case: the schedule, its stage of `stages`, the group the stages
    send over (None: the world) and the "tp" mesh its stage's ends are split over (None:
    whole)."""

    schedule: str
    index: int
    stages: int
    group: Any = None
    tp: Any = None

    def held(self, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's rows of a weight of the vocab (a shard under "tp"), and the global id
        of the first."""
        rows = guard_local(w)
        return rows, 0 if self.tp is None else self.tp.get_local_rank() * rows.shape[0]


def plain(schedule: str, stages: int | None = None) -> Run:
    """One stage per rank of the world."""
    return Run(schedule, dist.get_rank(), stages or dist.get_world_size())


class Pipe:
    """This rank's stage of a GPT split in `run.stages`, its schedule, its optimizer and its
    guard; `step` runs one training step as a torchtitan loop does."""

    def __init__(self, run: Run, model: pm.GPT, policy: dict[str, Any], **attach: Any) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.run, self.index, self.stages = run, run.index, run.stages
        self.module = pm.split(model, self.index, self.stages)
        if run.tp is not None:
            pm.vocab_parallel(self.module, run.tp)
        self.stage = PipelineStage(self.module, self.index, self.stages, torch.device("cpu"),
                                   group=run.group)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.guard = guard.attach(self.stage, policy=policy, vocab_size=pm.REAL,
                                  optimizer=self.opt, **attach)
        assert self.guard.stage is not None
        self.last = self.guard.stage.head
        # Every stage is given the loss (torch's schedules run a backward only then); the
        # last stage's goes through the guard.
        loss = self.guard.loss_fn(pm.loss_fn) if self.last else pm.loss_fn
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[run.schedule]
        self.schedule = kind(self.stage, n_microbatches=MICRO, loss_fn=loss)
        self.before_update: Callable[[], None] = lambda: None
        if run.tp is None:
            self.context: Callable[[], Any] = contextlib.nullcontext
        else:
            from torch.distributed.tensor.parallel import loss_parallel
            self.context = loss_parallel

    def step(self, n: int, *, ghost: bool = False,
             at: dict[tuple[int, int], tuple[int, int]] | None = None) -> float | None:
        """Step `n`: this rank's part of the schedule, then the update; the last stage's loss
        (the micro-batches' mean). `at`: {position: (input id, label)} written in."""
        x, y = pm.batch(n, ghost=ghost)
        for (i, j), (xi, yi) in (at or {}).items():
            x[i, j], y[i, j] = xi, yi
        losses: list[torch.Tensor] = []
        with self.context():  # loss_parallel under "tp": the forward and the backward
            if self.index == 0:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        self.before_update()
        self.opt.step()
        self.opt.zero_grad()
        return float(torch.stack([guard_local(t).detach() for t in losses]).mean()) \
            if losses else None

    def weights(self) -> list[torch.Tensor]:
        return [guard_local(p.detach()).clone() for p in self.module.parameters()]

    def unchanged(self, before: list[torch.Tensor]) -> bool:
        return all(torch.equal(a.nan_to_num(), guard_local(p.detach()).nan_to_num())
                   for a, p in zip(before, self.module.parameters(), strict=True))

    def rows(self, w: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        """This rank's rows of `w` (a vocab-parallel shard or whole), and the local rows of
        those of `ids` it holds."""
        local, start = self.run.held(w)
        return local, [i - start for i in ids if start <= i < start + local.shape[0]]


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


def healthy(run: Run) -> dict[str, Any]:
    """The defaults on a healthy model: nothing fires, nothing is logged, on any stage."""
    with logged() as lines:
        pipe = Pipe(run, pm.build(), DEFAULT)
        with pipe.guard as g:
            losses = [pipe.step(n) for n in range(1, STEPS + 1)]
    return {"violations": g.stats["violations"], "logged": lines, "losses": losses,
            "stats_loss": g.stats["loss"]}


def garbage(run: Run) -> dict[str, Any]:
    """Garbage in the head's padding rows (norm 1e4): padding_rows stops attach on every
    stage; with the rows left alone and no mask, padding_mass stops step 1 on every stage."""
    out: dict[str, Any] = {}
    try:
        Pipe(run, pm.build(garbage=True), with_checks(padding_rows={"action": "fail"}))
    except guard.GuardViolation as e:
        out["rows"] = violation(e)
    pol = with_checks(padding_rows={"action": "off"}, padding_mass={"action": "fail"})
    out["mass"] = stopped(Pipe(run, pm.build(garbage=True), pol))
    return out


def mask(run: Run) -> dict[str, Any]:
    """The garbage rows left in place under the mask (the default): the losses of the same
    weights unsplit with the real rows only, and no gradient reaches a padding row."""
    whole = pm.build(garbage=True)
    ref = pm.real_rows(whole)
    pipe = Pipe(run, whole, with_checks(padding_rows={"action": "off"}))
    grads: list[float] = []
    head = pipe.module.output
    if head is not None:
        def padding_grad() -> None:  # the padding rows this rank holds (none: 0.0)
            local, start = run.held(head.weight.grad)
            grads.append(float(local[max(pm.REAL - start, 0):].abs().sum()))

        pipe.before_update = padding_grad
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


def ghost(run: Run) -> dict[str, Any]:
    """A padding id among step 2's input ids, seen by stage 0 alone: every stage stops."""
    pipe = Pipe(run, pm.build(), DEFAULT)
    out = stopped(pipe, ghost=True)
    out["out_of_range"] = pipe.guard.stats["out_of_range"]
    return out


CASES: dict[str, Callable[[Run], dict[str, Any]]] = {
    "healthy": healthy, "garbage": garbage, "mask": mask, "ghost": ghost}


def nan_born(run: Run) -> dict[str, Any]:
    """At step 2 a NaN is born in the backward of an MLP (its forward finite): the middle
    stage's of 3, the first stage's of 2; every stage stops before its update, the parameter
    of the stage where it was born named."""
    from tests.guard.test_backward_nan import NaNBackward

    out: dict[str, Any] = {}
    with logged() as lines:
        pipe = Pipe(run, pm.build(), DEFAULT)
        with pipe.guard as g:
            for n in range(1, STEPS + 1):
                pipe.step(n)
        out["healthy"] = {"violations": g.stats["violations"], "logged": lines}
    pipe = Pipe(run, pm.build(), DEFAULT)
    now = {"step": 0}
    born = 1 if run.stages == 3 else 0  # the stage, and the layer it holds
    if run.index == born:
        def fault(module: Any, args: Any, y: torch.Tensor) -> Any:
            return NaNBackward.apply(y) if now["step"] == 2 else None

        pipe.module.layers[str(born)].mlp.register_forward_hook(fault)
    out["nan"] = stopped(pipe, first=lambda n: now.update(step=n))
    return out


def untrained(run: Run) -> dict[str, Any]:
    """Rows 10 and 11 of the embedding and 600 of the head never trained (zero): input id 10
    and label 600 at step 2 repair them on the stage that holds each, every stage at the
    same read (the untrained ids one list on every stage)."""
    model = pm.build()
    assert model.tok_embeddings is not None and model.output is not None
    with torch.no_grad():
        model.tok_embeddings.weight[[10, 11]] = 0.0
        model.output.weight[600] = 0.0
    pipe = Pipe(run, model, DEFAULT)
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


def tied_pipe(run: Run, model: pm.GPT, policy: dict[str, Any]) -> Pipe:
    """The embedding and the head tied copies on the first and the last stage, their
    gradients summed before each update (Megatron's embedding group all-reduce: over "pp",
    the ranks holding the same rows of the two copies)."""
    pipe = Pipe(run, model, policy, tied_across_stages=True)
    m = pipe.module
    copy = m.tok_embeddings if m.tok_embeddings is not None else m.output
    assert copy is not None

    def sync() -> None:
        grad = copy.weight.grad
        if run.tp is not None:  # a vocab-parallel embedding's comes back replicated: its rows
            grad = copy.weight.grad = grad.redistribute(placements=copy.weight.placements)
        dist.all_reduce(guard_local(grad), group=run.group)

    pipe.before_update = sync
    return pipe


def tied(run: Run) -> dict[str, Any]:
    """Tied copies kept in step: quiet; one copy written between steps 1 and 2 (rows 5 and
    700 of the head): every stage stops at step 2's read, before the update; one copy loaded
    apart before attach: attach stops."""
    out: dict[str, Any] = {}
    with logged() as lines:
        pipe = tied_pipe(run, pm.build(tied=True), DEFAULT)
        with pipe.guard as g:
            for n in range(1, STEPS + 1):
                pipe.step(n)
        out["healthy"] = {"violations": g.stats["violations"], "logged": lines}
    every = with_checks(vocab={"tie_every": 1})  # the drift named at the next read
    pipe = tied_pipe(run, pm.build(tied=True), every)
    head = pipe.module.output

    def write(n: int) -> None:  # one copy written between steps 1 and 2
        if n == 2 and head is not None:
            local, rows = pipe.rows(head.weight, [5, 700])
            with torch.no_grad():
                local[rows, 3] += 1e-3

    out["drift"] = stopped(pipe, first=write)
    model = pm.build(tied=True)
    if run.index == run.stages - 1:
        assert model.output is not None
        with torch.no_grad():
            model.output.weight[999] *= 2.0  # a resume that loaded this copy only
    try:
        tied_pipe(run, model, DEFAULT)
    except guard.GuardViolation as e:
        out["at_attach"] = violation(e)
    return out


def pp_tp() -> list[Run]:
    """2 stages over the "pp" dim of a (2, 2) mesh, each stage's ends split over "tp"."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    index = mesh.get_coordinate()[0]
    return [Run(schedule, index, 2, mesh["pp"].get_group(), mesh["tp"])
            for schedule in ("gpipe", "1f1b")]


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    cases, runs = {
        "pp2": (CASES, lambda: [plain("gpipe"), plain("1f1b")]),
        "tie": ({"tied": tied, "untrained": untrained}, lambda: [plain("gpipe")]),
        "pp3": ({"nan_middle": nan_born}, lambda: [plain("gpipe")]),
        "pp2tp2": ({**CASES, "nan_first": nan_born, "tied": tied}, pp_tp)}[mode]
    result = {run.schedule: {name: recorded(case, run) for name, case in cases.items()}
              for run in runs()}
    finish(out, dist.get_rank(), result)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
