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
from tests.integrations.ds_worker import CASES, REAL, STEPS, batch, config, fault, gpt2, \
    labels, padding, rows


class Steps(TrainerCallback):
    """The step under way (1-based) for the faults, and each step's logged loss."""

    def __init__(self, now: dict[str, int]) -> None:
        self.now, self.losses = now, list[float]()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.now["step"] = state.global_step + 1

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def trainer_case(stage: int, name: str) -> dict[str, Any]:
    garbage, pol, kind = CASES[name]
    model = gpt2(garbage)
    start = rows(model)
    now = {"step": 0}
    fault(model, kind, now)
    rank = dist.get_rank()
    data = [{"input_ids": batch(i, rank)[0]} for i in range(STEPS * 2)]

    collated = {"n": 0}  # the loader collates each step's batch once, in order

    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        x = torch.stack([r["input_ids"] for r in rows])
        collated["n"] += 1
        return {"input_ids": x, "labels": labels(x, kind, collated["n"])}

    steps = Steps(now)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_steps=STEPS,
                                 per_device_train_batch_size=2, save_strategy="no",
                                 logging_steps=1, learning_rate=1e-2, disable_tqdm=True,
                                 seed=0, weight_decay=0.0, deepspeed=config(stage, auto=True))
        t = Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                    callbacks=[steps])
        t.remove_callback(PrinterCallback)  # the logs on stdout
        cb = guard_trainer(t, policy=pol, vocab_size=REAL)
        res: dict[str, Any] = {"raised": None}
        try:
            t.train()
        except guard.GuardViolation as e:
            res["raised"] = {"check": e.check, "step": e.step, "rank": e.rank,
                             "message": str(e), "global_step": t.state.global_step}
        assert cb.guard is not None
        res.update(stats=cb.guard.stats, losses=steps.losses, global_step=t.state.global_step,
                   start=start)
        if name in ("mask", "repair", "healthy") and res["raised"] is None:
            res["padding"] = padding(model)
        cb.release()
    return res
