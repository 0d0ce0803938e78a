"""untrained_rows on real transformers models: a Llama-style model whose chat-control rows were
never trained (zero, or 1e-23 in bfloat16, as Llama-3 base ships them), fine-tuned with the
chat template that uses them: found at attach, counted in the step that uses them, repaired to
the trained mean before the update, or stopped before it; healthy models report none."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")  # Trainer needs it (the hf extra installs it)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import guard
from guard import GuardViolation
from guard.cli import main
from guard.device.untrained_tables import UntrainedTables
from guard.integrations.transformers import guard_trainer
from tests.conftest import findings, no_host_reads
from tests.integrations.chat_llama import (
    CHAT,
    ROWS,
    chat_tokenizer,
    chats,
    ids_of,
    llama,
    reserved,
    stacked,
)

QUIET: dict[str, Any] = {"export": {"serve": None}, "checks": {"loss_spike": {"action": "off"}}}
# Llama-3 base: zero rows (float32 here), and the ~1e-23 bfloat16 keeps in them.
KINDS = [pytest.param(0.0, torch.float32, id="zero"),
         pytest.param(1e-23, torch.bfloat16, id="1e-23-bf16")]


def rules(action: str | None = None) -> dict[str, Any]:
    checks = dict(QUIET["checks"])
    if action is not None:
        checks["untrained_rows"] = {"action": action}
    return {**QUIET, "checks": checks}


def trained_mean(w: torch.Tensor, untrained: list[int]) -> torch.Tensor:
    keep = torch.ones(w.shape[0], dtype=torch.bool)
    keep[untrained] = False
    return w.detach()[keep].float().mean(dim=0)


@pytest.mark.parametrize(("value", "dtype"), KINDS)
def test_found_at_attach_with_their_ids_and_tokens(value: float, dtype: torch.dtype,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    tok = chat_tokenizer()
    bad = ids_of(tok, CHAT) + reserved(tok)[:1]
    m = llama(tok, bad, value=value, dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=rules(), tokenizer=tok) as g:
        assert g.stats["untrained_rows"] == {"embedding": 4, "lm_head": 4}
        assert g.stats["violations"] == {}  # found is no violation: training on them is
    (said,) = [r.message for r in caplog.records if "at attach" in r.message]
    names = ", ".join(f"{i} {t!r}" for i, t in zip(bad, [*CHAT, tok.convert_ids_to_tokens(
        bad[3])], strict=True))
    assert said.startswith(f"untrained_rows on rank 0 at attach: 4 ids of the real vocab "
                           f"[0, {ROWS}) have rows that look never trained: "
                           f"model.embed_tokens.weight: 4 rows, ids {names} (4 near zero "
                           "(every |value| <= 1e-16)); lm_head.weight: 4 rows, ids")
    assert "their rows are set to the mean of the trained rows before its update" in said


@pytest.mark.parametrize(("value", "dtype"), KINDS)
def test_counted_in_the_step_that_uses_them_and_repaired_to_the_trained_mean_first(
        value: float, dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:
    tok = chat_tokenizer()
    used, unused = ids_of(tok, CHAT), reserved(tok)[:1]
    m = llama(tok, used + unused, value=value, dtype=dtype)
    emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
    # The mean of the rows that trained: the embedding's padding_idx row (zero by design,
    # never updated) is none of them.
    means = [trained_mean(emb, [*used, *unused, tok.pad_token_id]),
             trained_mean(head, used + unused)]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    seen: list[torch.Tensor] = []
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=rules(), tokenizer=tok, optimizer=opt) as g:
        # Runs after the guard's step pre-hook, before the update: the rows as repaired.
        opt.register_step_pre_hook(lambda *_: seen.extend(w[used].detach().clone()
                                                          for w in (emb, head)))
        b = stacked(chats(tok)[:4])
        m(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        first = dict(g.stats["untrained_tokens"])
        m(**b).loss.backward()  # the same ids: their rows are trained ones now
        opt.step()
    chat = torch.tensor(used)
    assert first == {"input": int(torch.isin(b["input_ids"], chat).sum()),
                     "label": int(torch.isin(b["labels"], chat).sum())} and first["input"] > 0
    assert g.stats["untrained_tokens"] == first  # nothing more at step 2
    assert g.stats["violations"] == {"untrained_rows": {"repair": 1}}
    assert g.stats["untrained_rows"] == {"embedding": 1, "lm_head": 1}  # the unused one
    close = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else \
        {"rtol": 8e-3, "atol": 1e-6}  # one bfloat16 rounding
    for rows, mean in zip(seen[:2], means, strict=True):  # repaired before step 1's update
        torch.testing.assert_close(rows.float(), mean.to(dtype).float().expand_as(rows),
                                   **close)
    assert torch.count_nonzero(emb.detach()[unused].float()) == 0 if value == 0 else \
        torch.equal(emb.detach()[unused], torch.full_like(emb[unused], value))  # not used
    (said,) = [r.message for r in caplog.records
               if r.message.startswith("untrained_rows on rank 0 at step 1")]
    names = ", ".join(f"{i} {t!r}" for i, t in zip(used, CHAT, strict=True))
    n_in, n_label = first["input"], first["label"]
    assert said.startswith(f"untrained_rows on rank 0 at step 1: {n_in} input "
                           f"id{'' if n_in == 1 else 's'} and {n_label} "
                           f"label{'' if n_label == 1 else 's'} fell on rows of the real vocab "
                           f"that were never trained: ids {names} (untrained in "
                           "model.embed_tokens.weight and lm_head.weight)")
    assert said.endswith("setting the rows of the ids used (embedding and head) to the mean "
                         "of the trained rows in place, before the update (action: repair).")


def hf_trainer(model: torch.nn.Module, tok: Any, out: Path, steps: int = 3) -> Trainer:
    args = TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=chats(tok), processing_class=tok)


def test_fail_stops_the_trainer_before_the_update_with_ids_tokens_and_the_fix(
        tmp_path: Path) -> None:
    tok = chat_tokenizer()
    m = llama(tok, ids_of(tok, CHAT))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    t = hf_trainer(m, tok, tmp_path)
    guard_trainer(t, policy=rules("fail"))
    with pytest.raises(GuardViolation, match=(
            r"untrained_rows on rank 0 at step 1: \d+ input ids? and \d+ labels? fell on rows of "
            r"the real vocab that were never trained: ids \d+ '<\|start_header_id\|>', \d+ "
            r"'<\|end_header_id\|>', \d+ '<\|eot_id\|>' \(untrained in .*\)\..*stopping before "
            r"the update \(action: fail\)\. Set checks\.untrained_rows\.action: repair")) as e:
        t.train()
    # The fused AdamW (the Trainer's default) dropped step 1's update; raised at step 2's read.
    assert (e.value.check, e.value.step, t.state.global_step) == ("untrained_rows", 1, 1)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_sft_under_the_default_is_told_at_train_begin_repaired_at_step_1_and_trains_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tok = chat_tokenizer()
    used = ids_of(tok, CHAT)
    m = llama(tok, used)
    t = hf_trainer(m, tok, tmp_path)
    # The repair before step 1's update needs the read before it: with the lagged read of a
    # fused optimizer (docs/checks.md, cadence.fail_read) it comes at step 2's, as on a GPU.
    cb = guard_trainer(t, policy={**QUIET, "cadence": {"fail_read": "before_update"}})
    with caplog.at_level(logging.WARNING, logger="guard"):
        t.train()
    said = findings(caplog, "untrained_rows")
    assert said[0].startswith("untrained_rows on rank 0 at attach")  # at train begin
    assert said[1].startswith("untrained_rows on rank 0 at step 1") and len(said) == 2
    assert cb.guard is not None and cb.guard.stats["untrained_rows"] == {"embedding": 0,
                                                                         "lm_head": 0}
    for w in (m.get_input_embeddings().weight, m.get_output_embeddings().weight):
        rows = w.detach()[used]
        assert torch.count_nonzero(rows) == rows.numel() and not torch.equal(rows[0], rows[1])
    figures = cb.figures()  # what the trainer's loggers got at the last log
    assert figures["guard/untrained_tokens/input"] > 0
    assert figures["guard/violations/untrained_rows/repair"] == 1.0


@pytest.mark.parametrize("model", ["llama", "llama-trained", "gpt2-tied", "mean-resized"])
def test_a_healthy_model_reports_none(model: str, caplog: pytest.LogCaptureFixture) -> None:
    tok = chat_tokenizer()
    if model == "gpt2-tied":
        torch.manual_seed(0)
        m: torch.nn.Module = GPT2LMHeadModel(GPT2Config(vocab_size=ROWS, n_embd=32, n_layer=1,
                                                        n_head=2, n_positions=64))
    elif model == "mean-resized":  # HF's mean resize: new rows around the mean, not at it
        m = llama(tok)
        m.resize_token_embeddings(ROWS + 64, mean_resizing=True)
    else:
        m = llama(tok)
    if model == "llama-trained":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        for i in range(30):
            m(**stacked(chats(tok)[i % 4 * 4 : i % 4 * 4 + 4])).loss.backward()
            opt.step()
            opt.zero_grad()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    rows = m.get_input_embeddings().weight.shape[0]  # every row real
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=rules("fail"), optimizer=opt, vocab_size=rows) as g:
        m(**stacked(chats(tok)[:4])).loss.backward()
        opt.step()  # fail would raise here
    assert g.stats["untrained_rows"] == {"embedding": 0, "lm_head": 0}
    assert g.stats["untrained_tokens"] == {"input": 0, "label": 0}
    assert g.stats["violations"] == {} and "untrained_rows" not in caplog.text


def test_a_frozen_embedding_is_said_to_never_learn_and_how_to_train_it(
        caplog: pytest.LogCaptureFixture) -> None:
    tok = chat_tokenizer()
    m = llama(tok, ids_of(tok, CHAT))
    for w in (m.get_input_embeddings().weight, m.get_output_embeddings().weight):
        w.requires_grad_(False)  # what LoRA leaves
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=rules(), tokenizer=tok):
        pass
    assert ("model.embed_tokens.weight and lm_head.weight are frozen (requires_grad=False, as "
            "LoRA leaves them): these rows can never learn; the repair gives them the mean of "
            "the trained rows, no more. To train them, make the embedding and the head "
            "trainable (PEFT: modules_to_save=['embed_tokens', 'lm_head'], or "
            "trainable_token_indices with these ids).") in caplog.text


def test_warn_counts_every_step_and_reads_the_ids_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = chat_tokenizer()
    m = llama(tok, ids_of(tok, CHAT))
    b = stacked(chats(tok)[:2])
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(m, policy=rules("warn"), tokenizer=tok) as g:
        taken = []
        take = UntrainedTables.take_new
        monkeypatch.setattr(UntrainedTables, "take_new",
                            lambda self, **kw: taken.append(1) or take(self, **kw))
        for _ in range(3):
            with no_host_reads():  # the hooks count on the device
                m(**b).loss.backward()
            g.step()
    n = int(torch.isin(b["input_ids"], torch.tensor(ids_of(tok, CHAT))).sum())
    assert g.stats["untrained_tokens"]["input"] == 3 * n
    assert g.stats["violations"] == {"untrained_rows": {"warn": 3}}
    assert taken == [1]  # the ids were read once, at the step that first used them
    steps = [r.message for r in caplog.records if "at step" in r.message]
    assert "'<|eot_id|>'" in steps[0] and "the ids named when they were first used" in steps[1]


def audit(capsys: pytest.CaptureFixture[str], d: Path) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()  # what ran before (the Trainer prints its logs)
    code = main(["audit", str(d), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("value", "dtype"), KINDS)
def test_audit_of_the_saved_checkpoint_lists_them_before_the_repair_and_none_after(
        value: float, dtype: torch.dtype, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    tok = chat_tokenizer()
    used = ids_of(tok, CHAT)
    m = llama(tok, used, value=value, dtype=dtype)
    m.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    code, before = audit(capsys, tmp_path / "base")
    assert code == 1 and before["ok"] is False  # a fault to fix before training
    tokens = {str(i): t for i, t in zip(used, CHAT, strict=True)}
    assert [(u["tensor"], u["ids"], u["near_zero"], u["tokens"])
            for u in before["untrained_rows"]] == [
        ("model.embed_tokens.weight", used, used, tokens),
        ("lm_head.weight", used, used, tokens)]
    t = hf_trainer(m, tok, tmp_path / "run")
    cb = guard_trainer(t, policy=QUIET)
    t.train()  # under the default: repaired at step 1, then trained
    assert cb.guard is not None
    found = [f for f in cb.guard.findings if f.check == "untrained_rows"]
    assert [list(f.ids) for f in found] == [used, used]  # as audited
    assert found[0].reasons == ("near_zero",) * len(used)
    m.save_pretrained(tmp_path / "tuned")
    tok.save_pretrained(tmp_path / "tuned")
    code, after = audit(capsys, tmp_path / "tuned")
    assert code == 0 and after["ok"] is True
    assert [u["ids"] for u in after["untrained_rows"]] == [[], []]


@pytest.mark.filterwarnings("ignore:The '(train|val)_dataloader' does not have many workers")
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"
                            ":FutureWarning")
def test_lightning_tells_it_at_fit_start_and_repairs_at_step_1(
        caplog: pytest.LogCaptureFixture) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from guard.integrations.lightning import GuardCallback

    tok = chat_tokenizer()
    used = ids_of(tok, CHAT)

    class Chat(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = llama(tok, used)

        def training_step(self, b: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**b).loss
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    lm, cb = Chat(), GuardCallback(policy=QUIET, tokenizer=tok)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])
    with caplog.at_level(logging.WARNING, logger="guard"):
        trainer.fit(lm, DataLoader(chats(tok), batch_size=4))  # type: ignore[arg-type]
    said = findings(caplog, "untrained_rows")
    assert said[0].startswith("untrained_rows on rank 0 at attach") and "'<|eot_id|>'" in said[0]
    assert said[1].startswith("untrained_rows on rank 0 at step 1") and len(said) == 2
    assert cb.guard is not None and cb.guard.stats["violations"]["untrained_rows"] == {
        "repair": 1}
