"""A resumed run through the frameworks (issue 39, item 4): the HF Trainer's
`train(resume_from_checkpoint=...)` and Lightning's `fit(ckpt_path=...)` restore the guard's
state saved with the checkpoint, so a loss spike two steps after the resume is reported (a
fresh window would still be warming up), the step goes on and so do the counters."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")  # the HF Trainer needs it (the hf extra installs it)
pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from guard import AttachError  # noqa: E402
from guard.integrations import lightning as pl_guard  # noqa: E402
from guard.integrations.transformers import GuardCallback, guard_trainer  # noqa: E402
from tests.conftest import batch, policy  # noqa: E402
from tests.integrations.test_lightning import LM  # noqa: E402
from tests.integrations.test_transformers import SENTENCES, SEQ, gpt2, word_tokenizer  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '(train|val)_dataloader' does not have many workers"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"
                               ":FutureWarning"),
]

# warmup 5: two steps after a resume at step 6 a fresh window holds 1 loss, too few to judge.
SPIKY = policy(loss_spike={"action": "warn", "warmup": 5}, token_range={"action": "warn"})


# -- HF Trainer ------------------------------------------------------------------------------


def ghost_examples(tok: Any) -> list[dict[str, torch.Tensor]]:
    """Every example has one ghost input id (a padding row's: counted by token_range, every
    step); its label is ignored, so the loss stays finite under the mask."""
    ghost = len(tok) + 1
    out = []
    for s in SENTENCES * 4:
        ids = tok(s)["input_ids"][:SEQ - 1]
        ids = ids + [tok.pad_token_id] * (SEQ - 1 - len(ids)) + [ghost]
        labels = [*ids[:-1], -100]
        out.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)})
    return out


def spiking_loss(at_call: int | None) -> Any:
    """A compute_loss_func: the model's own loss, times 30 at its `at_call`-th call."""
    calls = [0]

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
        calls[0] += 1
        logits, target = outputs.logits[:, :-1].float(), labels[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
        loss = loss / (target != -100).sum()
        return loss * 30 if calls[0] == at_call else loss

    return loss_func


def hf_run(out: Path, steps: int, spike_at_call: int | None = None,
           **extra: Any) -> tuple[Trainer, GuardCallback]:
    tok = word_tokenizer()
    args = TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=4, save_strategy="steps", save_steps=6,
                             logging_steps=1, learning_rate=1e-3, disable_tqdm=True, seed=0,
                             **extra)
    t = Trainer(model=gpt2(len(tok)), args=args, train_dataset=ghost_examples(tok),
                processing_class=tok, compute_loss_func=spiking_loss(spike_at_call))
    return t, guard_trainer(t, policy=SPIKY)


def test_hf_trainer_resumes_the_guard_from_the_checkpoint(tmp_path: Path) -> None:
    t, cb = hf_run(tmp_path, 6)
    t.train()
    assert cb.guard is not None
    before = cb.guard.stats
    assert before["step"] == 6 and before["out_of_range"]["input"] == 24  # 4 a step
    # Saved where the Trainer saves its stateful callbacks.
    saved = json.loads((tmp_path / "checkpoint-6/trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["GuardCallback"]["attributes"]["guard_state"]
    assert state["step"] == 6 and state["loss_window"]["seen"] == 6

    t, cb = hf_run(tmp_path, 8, spike_at_call=2)  # the second step after the resume: step 8
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert cb.guard is not None
    s = cb.guard.stats
    assert s["step"] == 8 and s["violations"]["loss_spike"] == {"warn": 1}
    assert s["out_of_range"]["input"] == 32 and s["violations"]["token_range"] == {"warn": 8}


def test_hf_trainer_refuses_to_rebuild_the_callback(tmp_path: Path) -> None:
    """restore_callback_states_from_checkpoint=True makes the Trainer replace the callback by
    one built without arguments (no policy, no tokenizer, no Trainer): said, not run."""
    t, _ = hf_run(tmp_path, 6)
    t.train()
    t, _ = hf_run(tmp_path, 8, restore_callback_states_from_checkpoint=True)
    with pytest.raises(AttachError, match="restore_callback_states_from_checkpoint=True rebuilt"):
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))


def test_hf_trainer_says_when_the_checkpoint_has_no_guard_state(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A guard added at the resume starts empty, says so, and the Trainer's save at step 8
    finds the callback's entry in its state (the checkpoint of step 6 has none)."""
    t, cb = hf_run(tmp_path, 6)
    t.callback_handler.remove_callback(cb)  # trained without the guard
    t.train()
    t, cb = hf_run(tmp_path, 8)
    with caplog.at_level(logging.WARNING, logger="guard"):
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert "resuming at step 6 from a checkpoint without the guard's state: its loss " \
           "window and counters start empty" in caplog.text
    assert cb.guard is not None and cb.guard.stats["step"] == 2


# -- Lightning -------------------------------------------------------------------------------


class SpikyLM(LM):
    """The loss, computed in training_step (the one the guard sees: the model returns none),
    x30 at global step `spike_at` (0-based: the step numbered spike_at + 1)."""

    def __init__(self, spike_at: int | None = None) -> None:
        super().__init__()
        self.spike_at = spike_at

    def training_step(self, b: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = b
        logits, _ = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return loss * 30 if self.trainer.global_step == self.spike_at else loss


def ghost_loader() -> DataLoader[Any]:
    """12 samples, 2 a step (6 steps an epoch), each with one ghost input id (a padding row's:
    2 counted a step)."""
    xs, ys = zip(*(batch(seed=i, b=1) for i in range(12)), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    x[:, 0] = 120  # the real vocab is 100, the rows 128
    return DataLoader(TensorDataset(x, y), batch_size=2)


def pl_fit(lm: LM, steps: int, root: Path, **kw: Any) -> pl_guard.GuardCallback:
    """Fit `steps` steps, saving a checkpoint at the end of the first epoch, step 6
    (root/six.ckpt; mid-epoch, Lightning warns that the data loader cannot resume)."""
    cb = pl_guard.GuardCallback(policy=SPIKY, vocab_size=100)
    every6 = ModelCheckpoint(dirpath=root, filename="six", every_n_epochs=1, save_top_k=-1,
                             save_on_train_epoch_end=True)
    t = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, default_root_dir=root,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[cb, every6])
    t.fit(lm, ghost_loader(), **kw)
    return cb


# The resumed fit saves where the first one did, as a resumed job does: Lightning says so.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_fit_resumes_the_guard_from_the_checkpoint(tmp_path: Path) -> None:
    cb = pl_fit(SpikyLM(), 6, tmp_path)
    assert cb.guard is not None and cb.guard.stats["step"] == 6
    ckpt = torch.load(tmp_path / "six.ckpt", weights_only=True)
    held = [v for k, v in ckpt["callbacks"].items() if "GuardCallback" in str(k)]
    assert len(held) == 1 and held[0]["step"] == 6
    assert held[0]["totals"]["out_of_range"]["input"] == 12

    # The loss at step 8 (global_step 7 while it runs) is x30.
    cb = pl_fit(SpikyLM(spike_at=7), 8, tmp_path, ckpt_path=tmp_path / "six.ckpt")
    assert cb.guard is not None
    s = cb.guard.stats
    assert s["step"] == 8 and s["violations"]["loss_spike"] == {"warn": 1}
    assert s["out_of_range"]["input"] == 16 and s["violations"]["token_range"] == {"warn": 8}
