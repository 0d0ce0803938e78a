"""FSDP2 over tensor parallel on a 2 x 2 gloo mesh (torchtitan's layout: parallelize_module on
the "tp" dim, then fully_shard on "dp"), for tests/integrations/test_tp_torch.py via
tp_worker.py's `mesh` mode. The head's rows are split twice: rank (dp, tp) holds rows
[512 tp + 256 dp, + 256) of 1024, so rank 3 (dp 1, tp 1) holds the padding rows [1000, 1024).
The weights' rows checks run on it: padding rows found and repaired, untrained rows found
and repaired where any rank used them, a healthy model quiet."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import guard
from tests.integrations.tp_models import REAL, batch, parallelized
from tests.integrations.tp_worker import DEFAULT, Run, logged, violation, with_checks

UNTRAINED = (10, 11, 12, 300, 301, 302, 600, 601, 602)  # on ranks 0, 2 and 1
USED = {0: 11, 1: 601}  # the untrained id each data-parallel group's batch uses at step 1


def mesh_cases() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]

    def build(w: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = parallelized(w, "dtensor", mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        return model

    run = Run(build, loss_parallel, seed=dp, tp=2)
    out: dict[str, Any] = {"placements": None}
    try:
        model = build(run.weights(garbage=True))
        out["placements"] = str(tuple(model.lm_head.weight.placements))
        guard.attach(model, policy=with_checks(padding_rows={"action": "fail"}),
                     vocab_size=REAL)
    except guard.GuardViolation as e:
        out["fail"] = violation(e)
    out["repair"] = repair(run)
    out["untrained"] = untrained(run, dp)
    with logged() as lines:
        model = build(run.weights())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with guard.attach(model, policy=DEFAULT, vocab_size=REAL, optimizer=opt) as g:
            for n in (1, 2):
                run.step(model, opt, n)
    out["healthy"] = {"violations": g.stats["violations"], "logged": lines}
    return out


def repair(run: Run) -> dict[str, Any]:
    """Garbage padding rows, the default action: set to the mean of the real rows in place
    before step 1, on the rank that holds them; then training goes on quiet."""
    weights = run.weights(garbage=True)
    model = run.build(weights)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with guard.attach(model, policy=DEFAULT, vocab_size=REAL, optimizer=opt) as g:
        full = model.lm_head.weight.full_tensor()  # every rank: a collective
        mean = weights["head"][:REAL].mean(dim=0)
        fixed = bool(torch.allclose(full[REAL:], mean.expand(full.shape[0] - REAL, -1),
                                    atol=1e-5)) and torch.equal(full[:REAL], weights["head"][:REAL])
        for n in (1, 2):
            run.step(model, opt, n)
    return {"fixed": fixed, "violations": g.stats["violations"]}


def untrained(run: Run, dp: int) -> dict[str, Any]:
    """Untrained real rows spread over three ranks' blocks: found at attach as one vocab, and
    the rows of the ids used on any rank repaired, on the ranks holding them."""
    weights = run.weights(untrained=UNTRAINED)
    model = run.build(weights)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with guard.attach(model, policy=DEFAULT, vocab_size=REAL, optimizer=opt) as g:
        found = dict(g.stats["untrained_rows"])
        x, y = batch(1, seed=run.seed)
        x = x % 5 + 20  # trained ids, but this group's untrained one
        x[0, 0] = USED[dp]
        with run.context():
            _, loss = model(x, labels=y % 5 + 20)
            loss.backward()
        opt.step()
    trained = [i for i in range(REAL) if i not in UNTRAINED]
    out: dict[str, Any] = {"found": found, "violations": g.stats["violations"]}
    for name, module in (("embedding", model.tok), ("head", model.lm_head)):
        full = module.weight.full_tensor()
        mean = weights[name][trained].mean(dim=0)
        out[name] = {"repaired": [i for i in UNTRAINED if torch.allclose(full[i], mean,
                                                                          atol=1e-5)],
                     "zero": [i for i in UNTRAINED if not full[i].any()]}
    out["rank"] = dist.get_rank()
    return out
