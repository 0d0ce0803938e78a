"""TRL (issue 20): its trainers compute the loss through a fused LM head that reads
`get_output_embeddings().weight` (trl/trainer/utils.py `add_fused_lm_head`), so the head's
forward never runs and a mask on its output never applies. Under `mask` the guard hands that
head the real rows for the fused forward: the loss is the real-vocab loss, and the padding
rows get no gradient. Tested with SFTTrainer (default arguments, padding-free, packing) and
DPOTrainer; GRPO, RLOO and KTO go through the same `add_fused_lm_head`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

import guard
from guard.integrations.transformers import guard_trainer
from tests.conftest import hook_count
from tests.integrations.test_transformers import SENTENCES, word_tokenizer

# transformers 5.24 deprecates the gradient-checkpointing names that TRL 1.16 still uses.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`\w*gradient_checkpointing\w*` is deprecated:FutureWarning")

QUIET: dict[str, Any] = {"export": {"serve": None}}  # the default policy, no endpoint


def tokenizer() -> Any:
    tok = word_tokenizer()
    tok.eos_token = "[PAD]"
    return tok


def qwen2(real: int, *, garbage: float | None = None) -> Qwen2ForCausalLM:
    """A tiny Qwen2 (tied) resized with pad_to_multiple_of=64, as a user would."""
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=real, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, pad_token_id=1, eos_token_id=1,
                                     bos_token_id=1))
    m.resize_token_embeddings(real, pad_to_multiple_of=64, mean_resizing=False)
    if garbage is not None:
        with torch.no_grad():
            w = m.get_output_embeddings().weight
            w[real:] = torch.randn(w.shape[0] - real, w.shape[1]) * garbage
    return m


def real_only(model: Qwen2ForCausalLM, real: int) -> Qwen2ForCausalLM:
    """The same model with its padding rows cut off: its softmax is over the real ids only,
    the independent reference for the real-vocab loss."""
    ref = copy.deepcopy(model)
    ref.resize_token_embeddings(real)  # keeps rows [0, real)
    return ref


def sft(model: Qwen2ForCausalLM, tok: Any, out: Path, **options: Any) -> SFTTrainer:
    args = SFTConfig(output_dir=str(out), report_to=[], use_cpu=True, max_steps=3,
                     per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                     learning_rate=1e-3, disable_tqdm=True, seed=0, **options)
    return SFTTrainer(model=model, args=args, processing_class=tok,
                      train_dataset=Dataset.from_dict({"text": SENTENCES * 4}))


OPTIONS = {"default": {}, "padding_free": {"padding_free": True, "max_length": None},
           "packing": {"packing": True, "max_length": 16}}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_sft_trains_on_the_real_vocab_loss(option: str, tmp_path: Path) -> None:
    tok = tokenizer()
    real = len(tok)
    model = qwen2(real, garbage=1.0)
    reference = sft(real_only(model, real), tok, tmp_path / "ref", **OPTIONS[option])
    trainer = sft(model, tok, tmp_path / "run", **OPTIONS[option])
    batch = next(iter(trainer.get_train_dataloader()))
    with guard.attach(model, policy=QUIET, tokenizer=tok):
        loss = trainer.compute_loss(model, dict(batch))  # TRL's own loss: the fused head
        loss.backward()
    expected = reference.compute_loss(reference.model, dict(batch))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-4)
    # The padding rows get no gradient: the fused head was handed the real rows only.
    grad = model.get_output_embeddings().weight.grad
    assert grad is not None and grad[real:].abs().max() == 0 and grad[:real].abs().max() > 0
    assert model.get_output_embeddings().weight.shape[0] == 64  # nothing left behind
    assert "get_output_embeddings" not in model.__dict__


def test_sft_with_the_callback_measures_the_mass_and_records_no_violation(
        tmp_path: Path) -> None:
    tok = tokenizer()
    model = qwen2(len(tok))  # healthy rows (a normal init)
    trainer = sft(model, tok, tmp_path)
    cb = guard_trainer(trainer, policy=QUIET)
    trainer.train()
    g = cb.guard
    assert g is not None and g.stats["step"] == 3
    assert g.stats["padding_mass"] is not None and g.stats["padding_mass"] > 0.1
    assert g.stats["violations"] == {}


def test_without_the_guard_the_fused_loss_trains_the_padding_rows(tmp_path: Path) -> None:
    """What the guard fixes: unguarded, TRL's fused head puts gradient on every row."""
    tok = tokenizer()
    model = qwen2(len(tok), garbage=1.0)
    trainer = sft(model, tok, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.compute_loss(model, dict(batch)).backward()
    assert model.get_output_embeddings().weight.grad[len(tok):].abs().max() > 0  # type: ignore[index]


def test_dpo_policy_forwards_get_the_real_rows(tmp_path: Path) -> None:
    tok = tokenizer()
    real = len(tok)
    model = qwen2(real)  # healthy rows: no violation, but their gradient is what TRL's loss gives
    data = Dataset.from_dict({"prompt": SENTENCES[:2] * 4,
                              "chosen": SENTENCES[2:] * 4, "rejected": SENTENCES[:2] * 4})
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=2,
                     per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                     learning_rate=0.0, disable_tqdm=True, seed=0)
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                         processing_class=tok, train_dataset=data)
    grads: list[torch.Tensor] = []
    head = model.get_output_embeddings()
    head.weight.register_hook(lambda g: grads.append(g.detach().clone()) or None)
    cb = guard_trainer(trainer, policy=QUIET)
    trainer.train()
    assert cb.guard is not None and cb.guard.stats["violations"] == {}
    assert grads and all(g[real:].abs().max() == 0 for g in grads)
    assert any(g[:real].abs().max() > 0 for g in grads)


def test_dpo_reference_model_is_masked_too_so_rewards_start_at_zero(tmp_path: Path) -> None:
    """Issue 39 item 5: with hot padding rows and the policy equal to the reference, DPO's
    rewards at the first step are ~0 only if the reference's padding is masked as the
    policy's is (unmasked they follow the padding rows)."""
    tok = tokenizer()
    model = qwen2(len(tok), garbage=3.0)
    data = Dataset.from_dict({"prompt": SENTENCES[:2] * 4,
                              "chosen": SENTENCES[2:] * 4, "rejected": SENTENCES[:2] * 4})
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                     per_device_train_batch_size=4, save_strategy="no", logging_steps=1,
                     learning_rate=0.0, disable_tqdm=True, seed=0)
    ref = copy.deepcopy(model)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tok,
                         train_dataset=data)
    cb = guard_trainer(trainer, policy=QUIET)
    trainer.train()
    (logs,) = [e for e in trainer.state.log_history if "rewards/chosen" in e]
    assert abs(logs["rewards/chosen"]) < 1e-4 and abs(logs["rewards/rejected"]) < 1e-4
    assert logs["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: no preference yet
    cb.release()  # the reference's hooks go with the policy's after-training mask
    assert hook_count(ref) == 0 and "get_output_embeddings" not in ref.__dict__


@pytest.mark.filterwarnings("ignore:`label_smoothing_factor` is deprecated:FutureWarning")
def test_sft_label_smoothing_trains_the_real_vocab_smoothed_loss(tmp_path: Path) -> None:
    """Issue 39 item 2 through TRL: SFTTrainer smooths with the Trainer's label smoother, which
    guard_trainer runs over the real columns (unguarded over the masked padding: +inf)."""
    tok = tokenizer()
    real = len(tok)
    model = qwen2(real, garbage=1.0)
    reference = sft(real_only(model, real), tok, tmp_path / "ref", label_smoothing_factor=0.1)
    trainer = sft(model, tok, tmp_path / "run", label_smoothing_factor=0.1)
    cb = guard_trainer(trainer, policy=QUIET)
    reference.train()
    trainer.train()
    want = [e["loss"] for e in reference.state.log_history if "loss" in e]
    loss = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(loss) == 3 and loss[0] == pytest.approx(want[0], abs=1e-4) and want[0] > 0
    assert cb.guard is not None  # its garbage rows repaired at attach; the loss finite
    assert set(cb.guard.stats["violations"]) == {"padding_rows"}
