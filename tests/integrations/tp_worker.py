"""One rank of the tensor-parallel tests (tests/integrations/test_tp_*.py); not a test itself.

usage: python -m torch.distributed.run --nproc-per-node N ... tp_worker.py OUT_DIR MODE

MODE `torch`: tp_models.TinyLM under torch's parallelize_module on all N ranks, its logits in
each form (`dtensor` under loss_parallel, ColwiseParallel's `local` shard, `gathered` by
ColwiseParallel(output_layouts=Replicate())); `megatron`: tp_models.MegatronLM, Megatron-
core's layers on N tensor-parallel ranks; `mesh`: FSDP2 over tensor parallel on a 2 x 2 mesh
(tp_mesh.py). Each runs the cases of CASES and writes OUT_DIR/rank<N>.json: per form, per
case, what the guard did on this rank.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

import guard
from guard.checks.padding_mass import bound
from guard.policy import Policy
from tests.integrations.dist_worker import Logged, finish, recorded, violation
from tests.integrations.tp_checks import HAND
from tests.integrations.tp_models import REAL, TinyLM, batch, full_weights, real_vocab, rows_for

DEFAULT: dict[str, Any] = {"export": {"serve": None}}  # the library's defaults otherwise
STEPS = 3


@contextlib.contextmanager
def logged() -> Iterator[list[str]]:
    handler = Logged()
    log = logging.getLogger("guard")
    log.addHandler(handler)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)


def with_checks(**checks: dict[str, Any]) -> dict[str, Any]:
    return {**DEFAULT, "checks": checks}


class Run:
    """Builds, steps and pokes one kind of tensor-parallel model (a form of it)."""

    def __init__(self, build: Callable[[dict[str, torch.Tensor]], torch.nn.Module],
                 context: Callable[[], Any] = contextlib.nullcontext, *, seed: int = 0,
                 tp: int = 0, shard: tuple[int, int] | None = None) -> None:
        self.build, self.context, self.seed = build, context, seed
        self.tp = tp or dist.get_world_size()
        self.rows = rows_for(self.tp)
        self.shard = shard  # given as vocab_shard= (a head sharded by hand)

    def attach(self, model: torch.nn.Module, policy: dict[str, Any],
               optimizer: torch.optim.Optimizer | None = None,
               vocab_shard: tuple[int, int] | None = None) -> guard.Guard:
        """The attach call that works for this model: a hand-sharded head says its shard."""
        if self.shard is None:
            return guard.attach(model, policy=policy, vocab_size=REAL, optimizer=optimizer,
                                vocab_shard=vocab_shard)
        return guard.attach(model, policy={**policy, "vocab": {"tensor_parallel": self.tp}},
                            vocab_size=REAL, optimizer=optimizer, vocab_shard=self.shard)

    def weights(self, **kw: Any) -> dict[str, torch.Tensor]:
        return full_weights(self.rows, **kw)

    def step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int,
             ghost: bool = False) -> float:
        x, y = batch(n, ghost=ghost, seed=self.seed)
        with self.context():  # loss_parallel: forward and backward
            _, loss = model(x, labels=y)
            loss.backward()
        value = float(guard_local(loss))
        opt.step()
        opt.zero_grad()
        return value


def guard_local(t: Any) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def head_weight(model: torch.nn.Module) -> torch.Tensor:
    head = getattr(model, "lm_head", None) or getattr(model, "output_layer")  # noqa: B009
    return guard_local(head.weight)


def padding_rows_here(model: torch.nn.Module) -> torch.Tensor:
    """The head's padding rows this rank holds, as a local (k, D) view of its weight."""
    w = head_weight(model)
    start = dist.get_rank() * w.shape[0]  # TP on every rank: rank r holds rows [r W, (r+1) W)
    return w[max(REAL - start, 0):]


def healthy(run: Run) -> dict[str, Any]:
    """The defaults on a healthy model: nothing fires, nothing is logged; unmasked and exact,
    the padding mass is the whole vocab's, alike on every rank."""
    out: dict[str, Any] = {}
    with logged() as lines:
        model = run.build(run.weights())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with run.attach(model, DEFAULT, opt) as g:
            for n in range(1, STEPS + 1):
                run.step(model, opt, n)
        out["violations"] = g.stats["violations"]
        exact = with_checks(padding_mass={"action": "warn", "exact": True})
        model = run.build(run.weights())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with run.attach(model, exact, opt) as g:
            run.step(model, opt, 1)
        out["unmasked"] = {k: g.stats[k] for k in ("padding_mass", "padding_mass_max",
                                                    "logsumexp", "violations")}
    out["logged"] = lines
    full = TinyLM(run.weights())  # the same weights, all rows, in one process
    x, _ = batch(1, seed=run.seed)
    with torch.no_grad():
        logits, _ = full(x, labels=x)
        mass = guard.padding_mass(logits, REAL)
        out["whole"] = {"mean": float(mass.mean()), "max": float(mass.max()),
                        "logsumexp": float(torch.logsumexp(logits[..., :REAL], -1).mean())}
    return out


def garbage(run: Run) -> dict[str, Any]:
    """Garbage in the head's padding rows: padding_rows stops attach, padding_mass (rows left
    alone, no mask) step 1, on every rank."""
    out: dict[str, Any] = {}
    try:
        run.attach(run.build(run.weights(garbage=True)),
                   with_checks(padding_rows={"action": "fail"}))
    except guard.GuardViolation as e:
        out["rows"] = violation(e)
    pol = with_checks(padding_rows={"action": "off"}, padding_mass={"action": "fail"})
    model = run.build(run.weights(garbage=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with run.attach(model, pol, opt) as g:
        try:
            run.step(model, opt, 1)
        except guard.GuardViolation as e:
            out["mass"] = {**violation(e), "threshold": e.threshold}
    out["mass_max"] = g.stats["padding_mass_max"]
    out["whole_threshold"] = bound(Policy.model_validate(pol), REAL, run.rows)
    return out


def mask(run: Run) -> dict[str, Any]:
    """Garbage rows left in place under the mask: the real-vocab model's losses, and no
    gradient reaches a padding row."""
    weights = run.weights(garbage=True)
    model = run.build(weights)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    pol = with_checks(padding_rows={"action": "off"})
    with run.attach(model, pol, opt) as g:
        for n in range(1, STEPS + 1):
            x, y = batch(n, seed=run.seed)
            with run.context():
                _, loss = model(x, labels=y)
                loss.backward()
            losses.append(float(guard_local(loss)))
            grad = getattr(model, "lm_head", None) or model.output_layer
            local_grad = guard_local(grad.weight.grad)
            pad = padding_rows_here(model).shape[0]
            grads.append(float(local_grad[local_grad.shape[0] - pad:].abs().sum()) if pad else 0.0)
            opt.step()
            opt.zero_grad()
    ref = real_vocab(weights)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reference = []
    for n in range(1, STEPS + 1):
        x, y = batch(n, seed=run.seed)
        _, loss = ref(x, y)
        reference.append(float(loss))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"losses": losses, "reference": reference, "padding_grad": grads,
            "held": padding_rows_here(model).shape[0], "violations": g.stats["violations"]}


def ghost(run: Run) -> dict[str, Any]:
    """A padding id among step 2's labels: every rank stops there, before the update."""
    model = run.build(run.weights())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"raised_at": None}
    with run.attach(model, DEFAULT, opt) as g:
        for n in range(1, STEPS + 1):
            before = head_weight(model).detach().clone()
            try:
                run.step(model, opt, n, ghost=n == 2)
            except guard.GuardViolation as e:
                out.update(raised_at=n, violation=violation(e),
                           unchanged=torch.equal(before, head_weight(model)))
                break
    out["out_of_range"] = g.stats["out_of_range"]
    return out


def nan(run: Run) -> dict[str, Any]:
    """A NaN in rank 0's head columns before step 2: every rank stops there (fail), naming
    rank 0."""
    model = run.build(run.weights())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"raised_at": None}
    with run.attach(model, DEFAULT, opt) as g:
        for n in range(1, STEPS + 1):
            if n == 2 and dist.get_rank() == 0:
                with torch.no_grad():
                    head_weight(model)[3, 0] = float("nan")
            before = [p.detach().clone() for p in model.parameters()]
            try:
                run.step(model, opt, n)
            except guard.GuardViolation as e:
                out.update(raised_at=n, violation=violation(e), unchanged=all(
                    torch.equal(guard_local(a).nan_to_num(), guard_local(p.detach()).nan_to_num())
                    for a, p in zip(before, model.parameters(), strict=True)))
                break
    out["logits"] = g.stats["nonfinite"]["logits"]
    return out


def attach_calls(run: Run) -> dict[str, Any]:
    """What attach takes and refuses of a DTensor head: the shard read from the placement
    (vocab_shard=, given too, must agree with it), the tensor-parallel degree from the mesh."""
    start, width = dist.get_rank() * run.rows // run.tp, run.rows // run.tp
    out: dict[str, Any] = {}
    calls = {"agreeing": {"vocab_shard": (start, start + width), "policy": {
                 **DEFAULT, "vocab": {"tensor_parallel": run.tp}}},
             "another shard": {"vocab_shard": (0, width) if start else (width, 2 * width)},
             "another degree": {"policy": {**DEFAULT, "vocab": {"tensor_parallel": 8}}}}
    for name, kw in calls.items():
        try:
            with run.attach(run.build(run.weights()), kw.get("policy", DEFAULT),
                            vocab_shard=kw.get("vocab_shard")) as g:
                out[name] = {"rows": g.rows, "tp": g.audit.tensor_parallel}
        except guard.AttachError as e:
            out[name] = {"error": str(e)}
    return out


CASES = {"healthy": healthy, "garbage": garbage, "mask": mask, "ghost": ghost, "nan": nan}


def torch_runs() -> dict[str, Run]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from tests.integrations.tp_models import by_hand, parallelized

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    runs = {form: Run(lambda w, form=form: parallelized(w, form, mesh),
                      loss_parallel if form == "dtensor" else contextlib.nullcontext)
            for form in ("dtensor", "local", "gathered")}
    width = rows_for(dist.get_world_size()) // dist.get_world_size()
    start = dist.get_rank() * width
    runs["hand"] = Run(lambda w: by_hand(w, start, start + width, mesh),
                       shard=(start, start + width))
    return runs


def megatron_runs() -> dict[str, Run]:
    from megatron.core import parallel_state

    from tests.integrations.tp_models import MegatronLM

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return {"megatron": Run(MegatronLM)}


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if mode == "mesh":
        from tests.integrations.tp_mesh import mesh_cases

        finish(out, dist.get_rank(), mesh_cases())
    runs = torch_runs() if mode == "torch" else megatron_runs()
    result: dict[str, Any] = {form: {name: recorded(case, run) for name, case in CASES.items()
                                     if form != "hand" or name in HAND}
                              for form, run in runs.items()}
    result["attach"] = recorded(attach_calls, next(iter(runs.values())))
    finish(out, dist.get_rank(), result)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
