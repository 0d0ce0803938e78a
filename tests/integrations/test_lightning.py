from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from guard import GuardViolation  # noqa: E402
from guard.integrations.lightning import GuardCallback, guarded_module  # noqa: E402
from tests.conftest import batch, hook_count, policy, tiny_gpt  # noqa: E402

# pytest turns warnings into errors; these two come from Lightning itself, not the guard:
# a DataLoader without worker processes may be a bottleneck (true for real data, irrelevant
# for these in-memory tensors), and Lightning 2.6 builds torch's LeafSpec, which torch 2.13
# deprecates.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The '(train|val)_dataloader' does not have many workers"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"
                               ":FutureWarning"),
]


class LM(pl.LightningModule):
    """A LightningModule around the nanoGPT test model; `outside_loss`: the model returns
    logits only and training_step computes the loss."""

    def __init__(self, garbage: float | None = None, outside_loss: bool = False) -> None:
        super().__init__()
        self.model = tiny_gpt(garbage=garbage)
        self.outside_loss = outside_loss
        self.losses: list[float] = []

    def training_step(self, b: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = b
        if self.outside_loss:
            logits, _ = self.model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        else:
            _, loss = self.model(x, y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(n: int = 8, ghost_at: int | None = None) -> DataLoader[Any]:
    xs, ys = zip(*(batch(seed=i, b=1) for i in range(n)), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    if ghost_at is not None:
        y[ghost_at, 0] = 120  # a padding id: the tokenizer's vocab is 100
    return DataLoader(TensorDataset(x, y), batch_size=2)


def fit(module: pl.LightningModule, cb: GuardCallback, steps: int, data: DataLoader[Any],
        **kw: Any) -> pl.Trainer:
    t = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], **kw)
    t.fit(module, data)
    return t


def test_fit_is_guarded_per_optimizer_step_and_detached() -> None:
    lm = LM(garbage=3.0)
    assert guarded_module(lm) is lm.model
    cb = GuardCallback(policy=policy(), vocab_size=100)
    fit(lm, cb, 3, loader())
    s = cb.guard.stats if cb.guard else {}
    assert s["step"] == 3 and s["loss"] == pytest.approx(lm.losses[-1])
    assert s["violations"] == {} and s["padding_mass"] > 0.05  # the mask did its job
    assert hook_count(lm) == 1  # the after-training mask on the head, until release()
    cb.release()
    assert hook_count(lm) == 0


def test_gradient_accumulation_counts_optimizer_steps() -> None:
    lm = LM()
    cb = GuardCallback(policy=policy(), vocab_size=100)
    fit(lm, cb, 2, loader(), accumulate_grad_batches=2)
    assert len(lm.losses) == 4 and cb.guard is not None and cb.guard.stats["step"] == 2


def test_loss_computed_in_training_step_is_reported() -> None:
    lm = LM(outside_loss=True)
    cb = GuardCallback(policy=policy(), vocab_size=100)
    fit(lm, cb, 2, loader())
    assert cb.guard is not None and cb.guard.stats["loss"] == pytest.approx(lm.losses[-1])


def test_fail_stops_fit_before_the_update_with_the_guards_message() -> None:
    lm = LM()
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    cb = GuardCallback(policy=policy(), vocab_size=100)
    with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 1: 1 label id "
                       r"outside \[0, 100\)") as e:
        fit(lm, cb, 3, loader(ghost_at=1))
    assert (e.value.check, e.value.step) == ("token_range", 1)
    assert all(torch.equal(before[k], v) for k, v in lm.state_dict().items())
    assert hook_count(lm) == 0  # on_exception detached it


def test_generation_after_fit_never_picks_a_padding_id() -> None:
    lm = LM(garbage=1e3)  # garbage far larger than any real logit
    cb = GuardCallback(policy={"export": {"serve": None}}, vocab_size=100)  # the defaults
    fit(lm, cb, 3, loader())
    assert cb.guard is not None
    assert cb.guard.stats["violations"]["padding_rows"] == {"repair": 1}
    model = lm.model.eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(20):  # greedy decoding, as generate() does it
            logits, _ = model(ids[:, -32:])
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert (ids < 100).all()
        assert torch.isneginf(model(ids[:, -32:])[0][..., 100:]).all()  # still masked
    cb.release()  # the rows stay repaired: the real rows' mean as training left them
    w = model.lm_head.weight.detach()
    assert torch.allclose(w[100:], w[:100].mean(dim=0).expand(28, -1), atol=1e-6)


def test_a_nan_born_in_the_backward_stops_fit_before_that_update() -> None:
    # The callback's boundary (on_before_optimizer_step) comes after the closure's backward:
    # the gradients are complete there, the update not made.
    from tests.guard.test_backward_nan import custom_op

    lm = LM()
    lm.model.blocks[0].register_forward_hook(lambda m, a, out: custom_op(out))
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    cb = GuardCallback(policy=policy(), vocab_size=100)
    with pytest.raises(GuardViolation, match=r"nonfinite on rank 0 at step 1: NaN/Inf values: "
                       r"\d+ parameters' gradients") as e:
        fit(lm, cb, 3, loader())
    assert "born in the backward" in str(e.value) and "blocks.0.attn.weight" in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in lm.state_dict().items())
