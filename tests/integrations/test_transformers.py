from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")  # Trainer needs it (the hf extra installs it)
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

import guard
from guard import AttachError, GuardViolation
from guard.integrations.transformers import (
    GuardCallback,
    PaddingMaskLogitsProcessor,
    guard_trainer,
)
from tests.conftest import findings, hook_count, policy

SENTENCES = [
    "the guard reads the flags once per step",
    "padding columns get no probability under the mask",
    "a ghost token is an id the tokenizer cannot produce",
    "every rank takes the same decision at the same step",
]
SEQ = 8


def word_tokenizer(extra: int = 0) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained here on SENTENCES, with `extra` added tokens."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]",
                                                                                 "[PAD]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    if extra:
        fast.add_tokens([f"extra{i}" for i in range(extra)])
    return fast


def gpt2(real: int, *, garbage: float | None = None) -> GPT2LMHeadModel:
    """A 1-layer GPT-2 whose vocab rows are `real` padded up to a multiple of 64."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=real, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                     bos_token_id=0, eos_token_id=0, pad_token_id=1)
    m = GPT2LMHeadModel(cfg)
    m.resize_token_embeddings(real, pad_to_multiple_of=64, mean_resizing=False)
    if garbage is not None:  # tied: what an uninitialised resize can leave in padding rows
        w = m.get_output_embeddings().weight
        with torch.no_grad():
            w[real:] = torch.randn(w.shape[0] - real, w.shape[1]) * garbage
    return m


def examples(tok: PreTrainedTokenizerFast, *, ghost: int | None = None) -> list[dict[str, Any]]:
    out = []
    for s in SENTENCES * 4:
        ids = tok(s)["input_ids"][:SEQ]
        ids = ids + [tok.pad_token_id] * (SEQ - len(ids))
        labels = list(ids) if ghost is None else [*ids[:-1], ghost]
        out.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)})
    return out


def trainer(model: nn.Module, tok: Any, data: list[dict[str, Any]], cb: GuardCallback | None,
            out: Path, steps: int = 3, accumulate: int = 1, **extra: Any) -> Trainer:
    args = TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, disable_tqdm=True, seed=0,
                             gradient_accumulation_steps=accumulate, **extra)
    return Trainer(model=model, args=args, train_dataset=data, processing_class=tok,
                   callbacks=[] if cb is None else [cb])


def test_trainer_is_guarded_step_by_step_and_detached_at_the_end(tmp_path: Path) -> None:
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real, garbage=1.0)
    cb = GuardCallback(policy=policy(padding_mass={"action": "mask"}))
    t = trainer(model, tok, examples(tok), cb, tmp_path)
    t.train()
    g = cb.guard
    assert g is not None and (g.real, g.rows) == (real, 64)  # the real vocab: the tokenizer's
    s = g.stats
    assert s["step"] == 3  # optimizer steps: the step pre-hook is the boundary
    assert isinstance(s["loss"], float) and s["loss"] > 0  # the model output's .loss
    assert s["padding_mass"] is not None and s["padding_mass"] > 0.01
    assert s["violations"] == {}  # the mask did its job
    # Detached: only the after-training mask on the head is left, until release().
    opt = t.optimizer.optimizer  # the torch optimizer inside accelerate's wrapper
    assert hook_count(model) == 1 and not opt._optimizer_step_pre_hooks
    cb.release()
    assert hook_count(model) == 0


def test_gradient_accumulation_reports_the_trainers_step_loss(tmp_path: Path) -> None:
    """With num_items_in_batch each micro-batch's .loss is a share of the step's loss: the
    guard sums the shares, so guard_loss is the loss the Trainer logs, not a quarter of it."""
    tok = word_tokenizer()
    model = gpt2(len(tok))
    cb = GuardCallback(policy=policy())
    t = trainer(model, tok, examples(tok), cb, tmp_path, steps=2, accumulate=4)
    t.train()
    assert cb.guard is not None
    logged = [e["loss"] for e in t.state.log_history if "loss" in e]
    assert cb.guard.stats["loss"] == pytest.approx(logged[-1], rel=1e-3)


def test_the_default_optimizer_drops_a_bad_update_with_no_host_sync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """adamw_torch_fused (the default on torch >= 2.8) takes found_inf: the default policy
    reads no step's flags before its update, and a ghost label at the last step, its update
    dropped on the device, raises at the end of train()."""
    from tests.guard.test_device_skip import HostReads

    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reads = HostReads(monkeypatch)
    cb = GuardCallback(policy=policy())
    t = trainer(model, tok, examples(tok, ghost=real + 3), cb, tmp_path, steps=1)
    with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 1: 4 label ids"):
        t.train()
    assert t.optimizer is not None and t.optimizer.optimizer.defaults["fused"] is True
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # Step 1's boundary queued its flags (no read); train's end read them, and raised.
    assert reads.events == ["sync"], reads.events
    assert t.state.global_step == 1


def test_fail_stops_train_before_the_update_with_the_guards_message(tmp_path: Path) -> None:
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = GuardCallback(policy=policy())
    t = trainer(model, tok, examples(tok, ghost=real + 3), cb, tmp_path)
    with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 1: 4 label ids "
                       rf"outside \[0, {real}\)") as e:
        t.train()
    assert (e.value.check, e.value.step) == ("token_range", 1)
    # The Trainer's default optimizer (adamw_torch_fused) dropped step 1's update on the
    # device; the raise came at step 2's read, before its update.
    assert t.state.global_step == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The next train() of the same callback starts from a fresh guard.
    t.train_dataset = examples(tok)
    t.train()
    assert cb.guard is not None and cb.guard.stats["step"] == 3


def test_tokenizer_larger_than_the_rows_stops_before_step_one(tmp_path: Path) -> None:
    tok = word_tokenizer(extra=50)  # more ids than the 64 rows
    model = gpt2(len(tok) - 50)
    t = trainer(model, tok, examples(tok), GuardCallback(policy=policy()), tmp_path)
    with pytest.raises(GuardViolation, match=rf"real vocab {len(tok)} > head rows 64"):
        t.train()
    assert hook_count(model) == 0


class NoHead(nn.Module):
    """Logits from the embedding matrix by hand: no module produces them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.emb(input_ids) @ self.emb.weight.T
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_model_without_a_head_is_an_attach_error_naming_lm_head(tmp_path: Path) -> None:
    tok = word_tokenizer()
    t = trainer(NoHead(), tok, examples(tok), GuardCallback(policy=policy()), tmp_path)
    with pytest.raises(AttachError, match=r"cannot find the output head.*pass lm_head="):
        t.train()


# -- generate() ------------------------------------------------------------------------------


def generated(model: nn.Module, prompt: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1, **kw)
    return out[:, prompt.shape[1]:]


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_never_emits_padding_ids(use_cache: bool) -> None:
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real, garbage=3.0).eval()
    prompt = torch.tensor(tok(SENTENCES[:2])["input_ids"])[:, :4]
    assert (generated(model, prompt, use_cache=use_cache) >= real).any()  # unguarded: ghosts
    with guard.attach(model, policy=policy(), tokenizer=tok):  # mask is the default action
        assert (generated(model, prompt, use_cache=use_cache) < real).all()
        logits = model(prompt, logits_to_keep=1).logits  # (B, 1, rows)
        assert logits.shape == (2, 1, 64) and torch.isneginf(logits[..., real:]).all()
    processors = LogitsProcessorList([PaddingMaskLogitsProcessor(real)])
    assert (generated(model, prompt, use_cache=use_cache, logits_processor=processors)
            < real).all()


def test_logits_processor_masks_logits_and_renormalises_log_probabilities() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    scores = torch.randn(2, 64) * 3 - 50  # raw logits (greedy, sampling), GPT-2-like scale
    given = scores.clone()
    want = torch.log_softmax(scores[:, :40], dim=-1)
    out = PaddingMaskLogitsProcessor(40)(ids, scores)
    assert torch.equal(scores, given)  # the caller's scores stay as given
    # A constant per row: greedy and sampling choose as before.
    assert torch.allclose(out[:, :40], want, atol=1e-5) and torch.isneginf(out[:, 40:]).all()
    log_probs = torch.log_softmax(scores, dim=-1)  # what beam search hands the processors
    out = PaddingMaskLogitsProcessor(40)(ids, log_probs)
    assert torch.allclose(out[:, :40], want, atol=1e-5) and torch.isneginf(out[:, 40:]).all()
    # suppress_tokens ran first (a repaired checkpoint): the padding already -inf.
    suppressed = log_probs.clone()
    suppressed[:, 40:] = float("-inf")
    out = PaddingMaskLogitsProcessor(40)(ids, suppressed)
    assert torch.allclose(out[:, :40], want, atol=1e-5)
    with pytest.raises(ValueError, match="positive int"):
        PaddingMaskLogitsProcessor(0)


def test_label_smoothing_over_padding_columns_is_refused_at_train_begin(tmp_path: Path) -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok))
    cb = GuardCallback(policy=policy())
    t = trainer(model, tok, examples(tok), cb, tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(AttachError, match=r"label_smoothing_factor=0\.1 smooths over all 64 "
                       r"columns of the logits, the \d+ padding columns .* Or set "
                       r"label_smoothing_factor=0"):
        t.train()
    assert t.state.global_step == 0 and hook_count(model) == 0


def smoothed_loss(columns: int | None) -> Any:
    """A compute_loss_func smoothing over the first `columns` columns (None: all of them)."""
    import torch.nn.functional as F

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
        logits = outputs.logits[:, :-1, :columns]
        return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(),
                               label_smoothing=0.1)

    return loss_func


def test_compute_loss_func_infinite_loss_stops_train_at_step_one(tmp_path: Path) -> None:
    """Smoothed over all columns, the masked padding makes the loss +inf (the Trainer would
    log 0.0): the guard sees the loss the Trainer backpropagates, and fail stops."""
    tok = word_tokenizer()
    model = gpt2(len(tok))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    t = trainer(model, tok, examples(tok), None, tmp_path)
    t.compute_loss_func = smoothed_loss(None)
    cb = guard_trainer(t, policy=policy(nonfinite={"action": "fail"}))
    with pytest.raises(GuardViolation, match=r"nonfinite on rank 0 at step 1: NaN/Inf values: "
                       r"1 in the loss; expected none; stopping \(action: fail\)") as e:
        t.train()
    assert (e.value.check, e.value.step) == ("nonfinite", 1) and t.state.global_step == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert cb.guard is not None and cb.guard.stats["loss"] == float("inf")


def test_compute_loss_func_loss_is_the_guards_and_the_original_is_back_after_train(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from transformers import TrainerCallback

    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real)
    loss_func = smoothed_loss(real)  # the user's own loss, over the real vocab
    seen: list[tuple[float, float | None]] = []

    class Losses(TrainerCallback):  # the Trainer's logged loss and the guard's, per step
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kwargs: Any) -> None:
            if logs and "loss" in logs and cb.guard is not None:
                seen.append((logs["loss"], cb.guard.stats["loss"]))

    data = examples(tok)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=3,
                             per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, disable_tqdm=True, seed=0,
                             gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=1)
    t = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4],
                processing_class=tok, callbacks=[Losses()], compute_loss_func=loss_func)
    cb = guard_trainer(t, policy=policy(loss_spike={"action": "warn"}))
    with caplog.at_level(logging.WARNING, logger="guard"):
        t.train()
    # The step's loss is the sum of its micro-batches', as the Trainer logs it; evaluation's
    # losses (after every step here) are no training step's. The fused AdamW drops a bad update
    # on the device, so the flags are read one step late: at step s, step s - 1's loss.
    logged, guarded = zip(*seen, strict=True)
    assert len(seen) == 3 and guarded[0] is None
    assert guarded[1:] == pytest.approx(logged[:-1], rel=1e-3)
    blind = findings(caplog, "coverage")
    assert len(blind) == 1 and "at step 1" in blind[0]  # said once, at the first step
    assert "token_range saw no labels" in blind[0] and "saw no loss" not in blind[0]
    assert cb.guard is not None and cb.guard.stats["violations"]["coverage"] == {"warn": 3}
    assert t.compute_loss_func is loss_func  # the original back after train()


def test_beam_search_with_the_processor_equals_the_real_vocab_model() -> None:
    """Garbage padding rows, no guard: beams and their scores as with a head over the real
    vocab only (greedy and sampling were right before; beam search was scored on garbage)."""
    tok = word_tokenizer()
    real = len(tok)
    padded = gpt2(real, garbage=4.0)
    ref = gpt2(real)
    ref.resize_token_embeddings(real)  # the same weights, cut to the real rows
    with torch.no_grad():
        ref.get_input_embeddings().weight.copy_(padded.get_input_embeddings().weight[:real])
    prompt = torch.tensor([[2, 3], [4, 5]])
    kw = {"max_new_tokens": 12, "num_beams": 3, "do_sample": False, "pad_token_id": 1,
          "output_scores": True, "return_dict_in_generate": True}
    processors = LogitsProcessorList([PaddingMaskLogitsProcessor(real)])
    padded.eval()
    ref.eval()
    got = padded.generate(prompt, logits_processor=processors, **kw)
    want = ref.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.allclose(got.sequences_scores, want.sequences_scores, atol=1e-4)


# -- after training: evaluation, generation and checkpoints without the guard ---------------


def real_vocab_copy(model: GPT2LMHeadModel, real: int) -> GPT2LMHeadModel:
    """The same weights with a head over the real vocab only: the reference."""
    import copy

    ref = copy.deepcopy(model)
    for h in list(ref.lm_head._forward_hooks):  # a copy of the model copies its hooks too
        del ref.lm_head._forward_hooks[h]
    ref.resize_token_embeddings(real)
    return ref


def generated_ids(model: nn.Module, **kw: Any) -> torch.Tensor:
    prompt = torch.tensor([[2, 3, 4], [5, 6, 7]])
    model.eval()
    torch.manual_seed(0)
    out: torch.Tensor = model.generate(prompt, max_new_tokens=16, pad_token_id=1, **kw)
    return out[:, prompt.shape[1]:]


MODES = {"greedy": {"do_sample": False}, "sample": {"do_sample": True, "top_k": 0},
         "beam": {"do_sample": False, "num_beams": 3}}


def test_after_train_evaluate_generate_save_and_load_are_safe(tmp_path: Path) -> None:
    import math

    from guard.cli import main as guard_cli

    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real, garbage=1.0)  # an uninitialised resize: garbage padding rows
    cb = GuardCallback(policy={"export": {"serve": None}})  # the default policy
    data = examples(tok)
    t = trainer(model, tok, data, cb, tmp_path / "run")
    t.train()
    assert cb.guard is not None
    assert cb.guard.stats["violations"]["padding_rows"] == {"repair": 1}
    # Repaired at attach, and at the end of training to the mean of the real rows as they are.
    w = model.lm_head.weight.detach()
    assert torch.allclose(w[real:], w[:real].mean(dim=0).expand(64 - real, -1), atol=1e-6)

    # evaluate() after train(): the real-vocab model's loss, up to float noise.
    ref = real_vocab_copy(model, real)
    eval_loss = t.evaluate(eval_dataset=data)["eval_loss"]
    ref_loss = trainer(ref, tok, data, GuardCallback(policy={"export": {"serve": None}}),
                       tmp_path / "ref").evaluate(eval_dataset=data)["eval_loss"]
    assert eval_loss == pytest.approx(ref_loss, abs=1e-5)
    # generate(): greedy, sampling and beam search never emit a padding id.
    for kw in MODES.values():
        assert (generated_ids(model, **kw) < real).all()

    # save -> load, in a model no guard or hook has seen.
    out = tmp_path / "saved"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert loaded.generation_config.suppress_tokens == list(range(real, 64))
    for kw in MODES.values():
        assert (generated_ids(loaded, **kw) < real).all()
    # Its loss is the reference's plus the padding columns' residual probability: mean rows
    # give each the mean real logit, so per token the loss grows by at most log(1 + P / N).
    x = torch.stack([d["input_ids"] for d in data])
    with torch.no_grad():
        got = float(loaded(x, labels=x).loss)
        want = float(ref(x, labels=x).loss)
    bound = math.log1p((64 - real) / real)
    assert want <= got <= want + bound + 1e-5
    # Beam search with the processor on the loaded model (whose suppress_tokens already set
    # the padding to -inf before the processor runs): the real-vocab model's beams and scores.
    ref.generation_config.suppress_tokens = None  # ids past its vocab
    kw = {"max_new_tokens": 8, "num_beams": 3, "do_sample": False, "pad_token_id": 1,
          "output_scores": True, "return_dict_in_generate": True}
    prompt = torch.tensor([[2, 3], [4, 5]])
    beams = loaded.eval().generate(
        prompt, logits_processor=LogitsProcessorList([PaddingMaskLogitsProcessor(real)]), **kw)
    ref_beams = ref.eval().generate(prompt, **kw)
    assert torch.equal(beams.sequences, ref_beams.sequences)
    assert torch.allclose(beams.sequences_scores, ref_beams.sequences_scores, atol=1e-4)
    assert guard_cli(["audit", str(out)]) == 0  # no garbage left behind


def test_guard_trainer_needs_a_trainer() -> None:
    with pytest.raises(AttachError, match=r"guard_trainer needs a transformers\.Trainer, got "
                       r"GuardCallback; for a plain loop use guard\.attach"):
        guard_trainer(GuardCallback())  # type: ignore[arg-type]


@pytest.mark.parametrize("mean_resizing", [True, False])
def test_a_healthy_resized_model_records_no_violation_and_fail_never_stops(
        tmp_path: Path, mean_resizing: bool) -> None:
    """HF's resize_token_embeddings(pad_to_multiple_of=64), mean-resized (HF's default) or
    normal-initialised: the padding columns take their healthy share, P / (N + P), which is a
    figure. Under the default policy with padding_mass: fail, no check fires and the Trainer
    runs to the end."""
    tok = word_tokenizer()
    real = len(tok)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=real, n_embd=32, n_layer=1, n_head=2,
                                       n_positions=32, bos_token_id=0, eos_token_id=0,
                                       pad_token_id=1))
    model.resize_token_embeddings(real, pad_to_multiple_of=64, mean_resizing=mean_resizing)
    t = trainer(model, tok, examples(tok), None, tmp_path, steps=3)
    cb = guard_trainer(t, policy={"export": {"serve": None},
                                  "checks": {"padding_mass": {"action": "fail"}}})
    t.train()
    assert t.state.global_step == 3 and cb.guard is not None
    s = cb.guard.stats
    assert s["violations"] == {} and s["step"] == 3
    healthy = (64 - real) / 64
    assert 0.5 * healthy < s["padding_mass"] < 1.5 * healthy


def test_a_run_that_warns_every_step_says_when_its_log_thins_out_and_sums_up_at_the_end(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """21 steps of garbage padding rows under warn: 5 messages, the fifth saying that the log
    thins out from there and where every violation is counted, and the summary at train end
    that counts the 16 not logged one by one."""
    import logging

    tok = word_tokenizer()
    t = trainer(gpt2(len(tok), garbage=5.0), tok, examples(tok) * 6, None, tmp_path, steps=21)
    cb = guard_trainer(t, policy=policy(padding_mass={"action": "warn"}))
    with caplog.at_level(logging.WARNING, logger="guard"):
        t.train()
    said = [r.getMessage() for r in caplog.records if "padding_mass" in r.getMessage()]
    assert len(said) == 6 and cb.guard is not None
    assert cb.guard.stats["violations"]["padding_mass"] == {"warn": 21}
    assert said[4].endswith("(occurrence 5; from here on 1 in 100 is logged, and any that is "
                            "worse; every one is counted in g.stats['violations'] and "
                            "guard_violations_total)")
    assert said[5].startswith("padding_mass at detach: 21 violation step(s) (warn)")
    assert said[5].endswith("the last at step 21; 16 not logged one by one")


def test_an_infinite_loss_from_ghost_labels_names_the_labels(
        caplog: pytest.LogCaptureFixture) -> None:
    """Under the mask a ghost label's logit is -inf, so its cross-entropy is +inf: the
    nonfinite message names the ghost labels, not the learning rate or the weights."""
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ids = examples(tok)[0]["input_ids"][None]  # (1, SEQ)
    labels = ids.clone()
    labels[0, 3] = real + 2  # a ghost id: it has a row, the tokenizer never produces it
    pol = policy(nonfinite={"action": "warn"}, token_range={"action": "warn"})
    with guard.attach(model, policy=pol, tokenizer=tok, optimizer=opt) as g:
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    assert g.stats["nonfinite"]["loss"] == 1 and g.stats["out_of_range"]["label"] == 1
    (said,) = findings(caplog, "nonfinite")
    assert f"The loss is +inf because 1 label is a ghost id in [{real}, 64) (highest " \
           f"{real + 2}), whose logits the mask sets to -inf (see token_range)" in said
    assert "learning rate" not in said


def test_padding_rows_say_the_weights_diverged_and_write_no_nan(
        caplog: pytest.LogCaptureFixture) -> None:
    """A NaN spread through the real rows: padding_rows does not blame a resize and does not
    'repair' the padding rows with the real rows' non-finite mean."""
    tok = word_tokenizer()
    real = len(tok)
    model = gpt2(real)
    model.train()
    pol = policy(nonfinite={"action": "warn"}, padding_rows={"action": "repair"})
    ids = examples(tok)[0]["input_ids"][None]
    with guard.attach(model, policy=pol, tokenizer=tok) as g:
        w = model.get_output_embeddings().weight  # tied: the embedding's too
        with torch.no_grad():
            w[real:] = torch.randn(64 - real, w.shape[1]) * 5.0  # garbage, after attach
            w[2, 0] = float("nan")  # and a real row diverged
        padding = w[real:].detach().clone()
        model(input_ids=ids, labels=ids).loss.backward()
        g.step()  # the read, and the repair it would do
        assert torch.equal(w[real:], padding)  # left as they were: no NaN written
    assert g.stats["violations"]["padding_rows"] == {"repair": 1}
    (said,) = findings(caplog, "padding_rows")
    assert "the weights diverged, which no resize explains; not repairing them" in said
    assert "uninitialised resize" not in said


@pytest.mark.parametrize("where", ["label", "input"])
def test_an_id_without_a_row_ends_in_the_guards_message_not_an_index_error(where: str) -> None:
    """Label 5000 or input id 5000 on a 64-row model: torch would raise `Target 5000 is out of
    bounds` / `index out of range` (on a GPU, a device-side assert that kills the process)
    inside the forward. The guard replaces the id on the device, so the step ends in its own
    GuardViolation before the update, naming the id and where it was."""
    tok = word_tokenizer()
    model = gpt2(len(tok))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.stack([examples(tok)[i]["input_ids"] for i in range(2)])  # (2, SEQ)
    labels = ids.clone()
    (labels if where == "label" else ids)[1, 5] = 5000
    with guard.attach(model, policy=policy(), tokenizer=tok, optimizer=opt):
        model(input_ids=ids, labels=labels).loss.backward()  # no IndexError
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 1: 1 "
                           rf"{where} id outside \[0, {len(tok)}\).*ids >= 64 \(highest 5000\)"
                           r" have no row at all.*the highest: "
                           rf"{'labels' if where == 'label' else 'input ids'} 5000 at \[1, 5\]"):
            opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_under_warn_an_id_without_a_row_is_left_out_and_training_goes_on() -> None:
    tok = word_tokenizer()
    model = gpt2(len(tok))
    model.train()
    ids = torch.stack([examples(tok)[i]["input_ids"] for i in range(2)])
    labels = ids.clone()
    labels[0, 3] = 5000
    ignored = labels.clone()
    ignored[0, 3] = -100
    torch.manual_seed(1)  # the same dropout masks in both forwards
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ignored).loss  # the label left out
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warn = policy(token_range={"action": "warn"}, padding_mass={"action": "warn"})  # no mask
    with guard.attach(model, policy=warn, tokenizer=tok, optimizer=opt) as g:
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
    assert torch.equal(loss.detach(), expected)  # bitwise: only the label without a row moved
    assert g.stats["out_of_range"]["label"] == 1
    assert g.stats["violations"]["token_range"] == {"warn": 1}


def test_a_nan_born_in_the_backward_stops_train_before_that_update(tmp_path: Path) -> None:
    # The Trainer clips the gradients (max_grad_norm 1.0) and then steps: the guard reads the
    # gradients in the optimizer's step pre-hook, after the clip, before the update.
    from tests.guard.test_backward_nan import custom_op

    tok = word_tokenizer()
    model = gpt2(len(tok))
    model.transformer.h[0].register_forward_hook(
        lambda m, a, out: custom_op(out) if isinstance(out, torch.Tensor)
        else (custom_op(out[0]), *out[1:]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = GuardCallback(policy=policy())
    t = trainer(model, tok, examples(tok), cb, tmp_path)
    with pytest.raises(GuardViolation) as e:
        t.train()
    assert (e.value.check, e.value.step) == ("nonfinite", 1)
    assert "born in the backward" in str(e.value) and "transformer.h.0" in str(e.value)
    assert t.state.global_step == 1  # its update dropped on the device, raised at step 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
