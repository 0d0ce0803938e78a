"""The guard's figures in the trainers' own logs: a real HF Trainer writing TensorBoard event
files, real Lightning runs writing metrics.csv and TensorBoard event files."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")  # the HF Trainer needs it (the hf extra installs it)
pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)
from transformers import (  # noqa: E402
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from guard.integrations import lightning as pl_guard  # noqa: E402
from guard.integrations.transformers import GuardCallback, guard_trainer  # noqa: E402
from tests.conftest import no_host_reads, policy  # noqa: E402
from tests.integrations.test_lightning import LM, loader  # noqa: E402
from tests.integrations.test_transformers import examples, gpt2, word_tokenizer  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:The '(train|val)_dataloader' does not have many workers"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"
                               ":FutureWarning"),
]

STEPS = 3
# The Trainer's default optimizer is fused: read before the update, so each step's figures are
# its own (the lagged read of docs/checks.md's `cadence.fail_read` logs step s - 1's at s).
WARN = {**policy(padding_mass={"action": "warn"}, token_range={"action": "warn"}),
        "cadence": {"fail_read": "before_update"}}
# Every figure a run with WARN logs: the enabled checks' violations at their action.
KEYS = {"step", "padding_mass", "padding_mass_max", "nonfinite/logits", "nonfinite/hidden",
        "nonfinite/loss", "out_of_range/input", "out_of_range/label", "skipped_steps",
        "violations/alignment/fail", "violations/vocab/fail", "violations/padding_mass/warn",
        "violations/nonfinite/fail", "violations/token_range/warn", "violations/coverage/warn",
        "untrained_rows/embedding", "untrained_rows/lm_head", "untrained_tokens/input",
        "untrained_tokens/label", "violations/untrained_rows/repair",
        # The gradients, checked before each update, and the logits' log Z.
        "nonfinite/grad", "grad_norm", "grad_norm_top_share", "logsumexp", "logsumexp_max"}
# Where the optimizer's step is the boundary, the updates the loop skipped are a figure too.
OPTIMIZER_KEYS = KEYS | {"scaler_skipped_steps"}


def strict(cb: GuardCallback) -> GuardCallback:
    """The real callback, its logging under no_host_reads(): every way a tensor reaches the
    host raises, so the figures must come from what the guard's own read left there."""
    on_log = cb.on_log

    def logging_strictly(*args: Any, **kwargs: Any) -> None:
        with no_host_reads():
            on_log(*args, **kwargs)

    cb.on_log = logging_strictly  # type: ignore[method-assign]
    return cb


class LogsSeen(TrainerCallback):
    """A user callback that writes logs, as a reporter does: what its on_log saw."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        self.seen.append({**logs, "global_step": state.global_step})


def scalars(logdir: Path, prefix: str = "") -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files under `logdir` whose tag starts with
    `prefix + "guard/"`, as (step, value) pairs, the prefix stripped."""
    files = list(logdir.rglob("events.out.tfevents.*"))
    assert files, f"no event files under {logdir}"
    out: dict[str, list[tuple[int, float]]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith(prefix + "guard/"):
                out.setdefault(tag[len(prefix) + len("guard/"):], []).extend(
                    (e.step, e.value) for e in acc.Scalars(tag))
    return out


def hf_trainer(out: Path, model: Any, tok: Any, data: list[dict[str, Any]],
               callbacks: list[TrainerCallback], *, eval_dataset: Any = None,
               report_to: list[str] | None = None, **extra: Any) -> Trainer:
    settings: dict[str, Any] = {"max_steps": STEPS, **extra}
    args = TrainingArguments(output_dir=str(out), report_to=report_to or [], use_cpu=True,
                             per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, disable_tqdm=True, seed=0, **settings)
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=eval_dataset,
                   processing_class=tok, callbacks=callbacks)


def test_hf_trainer_reports_the_guard_figures_to_tensorboard(tmp_path: Path) -> None:
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real, garbage=1.0)  # padding rows of garbage: mass on the padding columns
    seen = LogsSeen()  # a user's callback that logs: it must see the figures too
    t = hf_trainer(tmp_path, model, tok, examples(tok, ghost=real + 3), [seen],
                   report_to=["tensorboard"])  # event files under output_dir/runs/
    cb = strict(guard_trainer(t, policy=WARN))
    t.train()
    g = cb.guard
    assert g is not None

    # TensorBoardCallback writes logs keys under train/: one point per logged step, each
    # step's own read (on the CPU the read is not lagged); the run's totals, logged at step 3
    # too, add none.
    tb = scalars(tmp_path, "train/")
    assert set(tb) == OPTIMIZER_KEYS
    assert all([s for s, _ in points] == [1, 2, 3] for points in tb.values())
    value = {k: [v for _, v in points] for k, points in tb.items()}
    assert value["step"] == [1, 2, 3]
    # Each batch of 4 examples ends on one ghost label: counters are running totals.
    assert value["out_of_range/label"] == [4, 8, 12]
    assert value["violations/token_range/warn"] == [1, 2, 3]
    assert value["out_of_range/input"] == [0, 0, 0]
    assert all(0.01 < m <= x <= 1 for m, x in zip(value["padding_mass"],
                                                  value["padding_mass_max"], strict=True))
    assert value["violations/padding_mass/warn"] == [1, 2, 3]
    assert all(value[k] == [0, 0, 0] for k in KEYS if k.startswith("nonfinite/"))
    assert value["violations/coverage/warn"] == [0, 0, 0]  # logits, labels and loss all seen
    assert value["skipped_steps"] == value["scaler_skipped_steps"] == [0, 0, 0]
    assert all(n > 0 for n in value["grad_norm"])
    # The last point is the guard's own record: float32 in the event file.
    s = g.stats
    assert value["padding_mass"][-1] == pytest.approx(s["padding_mass"], rel=1e-6)
    assert value["out_of_range/label"][-1] == s["out_of_range"]["label"]

    # The callback listed before the guard's saw the figures in the same logs dict.
    train_logs = [e for e in seen.seen if "loss" in e]
    assert [e["guard/step"] for e in train_logs] == [1.0, 2.0, 3.0]
    assert [e["guard/out_of_range/label"] for e in train_logs] == [4.0, 8.0, 12.0]
    totals = next(e for e in seen.seen if "train_runtime" in e)
    assert not any(k.startswith("guard/") for k in totals)  # step 3's figures went already
    # guard_trainer put it ahead of the first logging callback; the others keep their order.
    names = [type(c).__name__ for c in t.callback_handler.callbacks]
    assert names == ["DefaultFlowCallback", "GuardCallback", "TensorBoardCallback",
                     "LogsSeen", "PrinterCallback"]


def test_hf_trainer_logs_nothing_before_the_guards_first_read(tmp_path: Path) -> None:
    """The first read is step 1's: an evaluation logged before training starts gets no
    figures (zeros would claim a clean step that never ran)."""
    tok = word_tokenizer()
    cb = GuardCallback(policy=WARN)
    seen = LogsSeen()
    t = hf_trainer(tmp_path, gpt2(len(tok)), tok, examples(tok), [cb, seen], max_steps=1,
                   eval_dataset=examples(tok)[:4], eval_on_start=True, eval_strategy="steps",
                   eval_steps=1)
    t.train()
    first, *rest = seen.seen
    assert "eval_loss" in first and not any(k.startswith("guard/") for k in first)
    # Step 1 logs its training figures, then its evaluation and the run's totals: one set.
    assert [("eval_loss" in e, "guard/step" in e) for e in rest if e["global_step"] == 1] == [
        (False, True), (True, False), (False, False)]


def lightning_fit(lm: LM, cb: pl_guard.GuardCallback, logger: Any) -> Any:
    t = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=logger, log_every_n_steps=1,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[cb])
    t.fit(lm, loader(ghost_at=1))  # one ghost label, in the first batch
    return t


class StrictLightningGuard(pl_guard.GuardCallback):
    """Lightning's callback, its logging under no_host_reads() (the read itself is before)."""

    def _log_figures(self, pl_module: Any) -> None:
        with no_host_reads():
            super()._log_figures(pl_module)


class LoggingLM(LM):
    """The test module, logging its loss as a user's module does."""

    def training_step(self, b: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        loss = super().training_step(b, i)
        self.log("train_loss", loss)
        return loss


def test_lightning_writes_the_guard_figures_to_metrics_csv(tmp_path: Path) -> None:
    lm = LoggingLM(garbage=3.0)
    cb = StrictLightningGuard(policy=WARN, vocab_size=100)
    logger = CSVLogger(tmp_path, name="run", version=0)
    lightning_fit(lm, cb, logger)
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # In the module's own rows: Lightning writes both in one log_metrics call per step.
    assert all(r["guard/step"] and r["train_loss"] for r in rows)
    assert {k[len("guard/"):] for k in rows[0] if k.startswith("guard/")} == KEYS
    # One row per optimizer step; Lightning's step counts the batches stepped before it.
    assert [(int(r["step"]), float(r["guard/step"])) for r in rows] == [(0, 1), (1, 2), (2, 3)]
    col = {k: [float(r["guard/" + k]) for r in rows] for k in KEYS}
    assert col["out_of_range/label"] == [1, 1, 1]  # a running total: the ghost was in step 1
    assert col["violations/token_range/warn"] == [1, 1, 1]
    assert all(m > 0.05 for m in col["padding_mass"])  # garbage rows, unmasked (warn)
    assert col["violations/padding_mass/warn"] == [1, 2, 3]
    assert all(col[k] == [0, 0, 0] for k in ("nonfinite/loss", "skipped_steps",
                                             "violations/coverage/warn"))
    assert cb.guard is not None
    assert col["padding_mass"][-1] == pytest.approx(cb.guard.stats["padding_mass"])


def test_lightning_writes_the_guard_figures_to_tensorboard(tmp_path: Path) -> None:
    lm = LM(garbage=3.0)
    cb = pl_guard.GuardCallback(policy=WARN, vocab_size=100)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    lightning_fit(lm, cb, logger)
    tb = scalars(Path(logger.log_dir))
    assert set(tb) == KEYS
    assert tb["step"] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert [v for _, v in tb["out_of_range/label"]] == [1, 1, 1]
    assert [v for _, v in tb["violations/padding_mass/warn"]] == [1, 2, 3]


def test_hf_callback_given_as_callbacks_says_what_needs_the_trainer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Given in callbacks=[...] (or called by a wrapper), the callback has no Trainer: it runs
    after the reporters and cannot wrap a compute_loss_func, and says so with the fix."""
    tok = word_tokenizer()
    model = gpt2(len(tok))
    cb = GuardCallback(policy=WARN)
    t = hf_trainer(tmp_path, model, tok, examples(tok), [cb], report_to=["tensorboard"])
    t.train()
    assert "GuardCallback was given as callbacks=[...], so it runs after the report_to " \
           "callbacks (tensorboard: they log no guard/ figures) and cannot see a " \
           "compute_loss_func's loss" in caplog.text
    assert [r.levelname for r in caplog.records if "callbacks=[...]" in r.message] == ["WARNING"]
    assert "use guard.integrations.transformers.guard_trainer(trainer, ...)" in caplog.text
    assert not scalars(tmp_path, "train/")  # indeed: no figures reached TensorBoard
    assert cb.guard is not None and cb.guard.stats["step"] == STEPS  # guarded all the same

def test_hf_callback_given_as_callbacks_without_reporters_only_informs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No report_to: nothing is lost that coverage would not report, so no warning."""
    import logging

    tok = word_tokenizer()
    t = hf_trainer(tmp_path, gpt2(len(tok)), tok, examples(tok), [GuardCallback(policy=WARN)],
                   max_steps=1)
    with caplog.at_level(logging.INFO, logger="guard"):
        t.train()
    said = [r.levelname for r in caplog.records if "callbacks=[...]" in r.message]
    assert said == ["INFO"]
