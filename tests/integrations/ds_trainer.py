"""The HF Trainer cases of the DeepSpeed worker (tests/integrations/ds_worker.py): the same
cases through `TrainingArguments(deepspeed=<a ZeRO config dict>, use_cpu=True)` and
`guard_trainer`, as docs/integrations.md says; not a test itself."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

import guard
from guard.integrations.transformers import guard_trainer
from tests.integrations import ds_worker as w


class Steps(TrainerCallback):
    """The step under way (1-based) for the faults, DeepSpeed's fp32 copy as it begins, and
    each step's logged loss."""

    def __init__(self, now: dict[str, int], model: torch.nn.Module) -> None:
        self.now, self.model, self.losses = now, model, list[float]()
        self.masters: list[torch.Tensor] = []
        self.unchanged: bool | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.now["step"] = state.global_step + 1
        self.masters = [m.detach().clone() for m in w.masters(self.model)]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.now["step"] == w.FAULT_STEP:  # what a skipped update left
            self.unchanged = all(torch.equal(a, b) for a, b in
                                 zip(self.masters, w.masters(self.model), strict=True))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def trainer_case(stage: int, name: str) -> dict[str, Any]:
    garbage, pol, kind = w.CASES[name]
    model = w.gpt2(garbage)
    start = w.rows(model)
    now = {"step": 0}
    w.fault(model, kind, now)
    rank = dist.get_rank()
    data = [{"input_ids": w.batch(i, rank)[0]} for i in range(w.STEPS * 2)]

    collated = {"n": 0}  # the loader collates each step's batch once, in order

    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        x = torch.stack([r["input_ids"] for r in rows])
        collated["n"] += 1
        return {"input_ids": x, "labels": w.labels(x, kind, collated["n"])}

    steps = Steps(now, model)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_steps=w.STEPS,
                                 per_device_train_batch_size=2, save_strategy="no",
                                 logging_steps=1, learning_rate=1e-2, disable_tqdm=True,
                                 seed=0, weight_decay=0.0, deepspeed=w.config(stage, auto=True))
        t = Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                    callbacks=[steps])
        t.remove_callback(PrinterCallback)  # the logs on stdout
        cb = guard_trainer(t, policy=pol, vocab_size=w.REAL)
        res: dict[str, Any] = {"raised": None}
        try:
            t.train()
        except guard.GuardViolation as e:
            res["raised"] = {"check": e.check, "step": e.step, "rank": e.rank,
                             "message": str(e), "global_step": t.state.global_step,
                             "unchanged": all(torch.equal(a, b) for a, b in zip(
                                 steps.masters, w.masters(model), strict=True))}
        assert cb.guard is not None
        res.update(stats=cb.guard.stats, losses=steps.losses, global_step=t.state.global_step,
                   start=start, unchanged=steps.unchanged)
        if name in ("mask", "repair", "healthy") and res["raised"] is None:
            res["padding"] = w.padding(model)
        cb.release()
    return res
