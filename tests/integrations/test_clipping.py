"""The NaN's origin under the loops' own gradient clipping (issue 39 item 3, issue 40 item 3):
the HF Trainer (max_grad_norm 1.0 by default), accelerate's `clip_grad_norm_` and Lightning's
`gradient_clip_val`. A NaN written into one expert's gradient of a mixture of experts is
stopped before the update and named there, not in every parameter the clip spread it to; and
the gradients are read once a step, by the clip or by the guard, never both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
from transformers import MixtralConfig, MixtralForCausalLM

import guard
from guard import GuardViolation
from guard.integrations.transformers import GuardCallback
from tests.conftest import policy
from tests.guard.device.test_clip import foreach_norms  # noqa: F401 (a fixture)
from tests.integrations.test_transformers import examples, trainer, word_tokenizer

EXPERTS = "model.layers.1.mlp.experts.down_proj"  # every expert's down projection, (E, d, f)


def mixtral(rows: int) -> MixtralForCausalLM:
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=rows, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                        pad_token_id=1, bos_token_id=0, eos_token_id=0)
    return MixtralForCausalLM(cfg)


def nan_in_expert(param: nn.Parameter, expert: int = 2) -> None:
    """A NaN in one expert's slice of the gradient (a row of a 2-d one), in the backward."""
    def poison(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        out[expert].view(-1)[0] = float("nan")
        return out
    param.register_hook(poison)


def test_the_trainers_clip_does_not_hide_the_experts_nan(tmp_path: Path) -> None:
    tok = word_tokenizer()
    model = mixtral(64)
    named = dict(model.named_parameters())
    nan_in_expert(named[EXPERTS])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    t = trainer(model, tok, examples(tok), GuardCallback(policy=policy()), tmp_path)
    assert t.args.max_grad_norm == 1.0  # the Trainer's default: it clips
    with pytest.raises(GuardViolation) as e:
        t.train()
    assert (e.value.check, e.value.step) == ("nonfinite", 1)
    # By the update, the clip has made all 21 gradients NaN; the one named is where it was born.
    assert f"the gradient of {EXPERTS} (1 of {len(named)} parameters)" in str(e.value)
    # The fused AdamW dropped step 1's update on the device; the lagged read raised at step 2's
    # boundary, before its update: the Trainer counted one step, the weights never moved.
    assert t.state.global_step == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_trainer_reads_the_gradients_once_a_step(tmp_path: Path,
                                                     foreach_norms: list[int]) -> None:  # noqa: F811
    tok = word_tokenizer()
    model = mixtral(64)
    n = len(list(model.parameters()))
    cb = GuardCallback(policy=policy())
    t = trainer(model, tok, examples(tok), cb, tmp_path, steps=2)
    t.train()
    assert foreach_norms == [n, n]  # the clip's, one a step
    assert cb.guard is not None
    logged = [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h]
    assert cb.guard.stats["grad_norm"] == pytest.approx(logged[-1], rel=1e-5)


@pytest.fixture
def fresh_accelerator() -> Iterator[Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_accelerates_clip_does_not_hide_the_experts_nan(fresh_accelerator: Any) -> None:
    acc = fresh_accelerator
    model = mixtral(64)
    nan_in_expert(dict(model.named_parameters())[EXPERTS])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(2, 60, (2, 8))
    with guard.attach(model, policy=policy(), vocab_size=60, optimizer=opt):
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(GuardViolation) as e:
            opt.step()
    assert f"the gradient of {EXPERTS} (1 of" in str(e.value)



# Lightning's own warnings (tests/integrations/test_lightning.py says why).
lightning_noise = pytest.mark.filterwarnings(
    "ignore:The '(train|val)_dataloader' does not have many workers",
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")


def lightning_fit(nan: bool) -> tuple[Any, Any]:
    """Two steps of fit with `gradient_clip_val=1.0`; `nan`: one in a row of an MLP weight."""
    pytest.importorskip("lightning.pytorch")
    from guard.integrations.lightning import GuardCallback as LightningCallback
    from tests.integrations.test_lightning import LM, fit, loader

    lm = LM()
    if nan:
        nan_in_expert(dict(lm.named_parameters())["model.blocks.1.mlp.0.weight"], 3)
    cb = LightningCallback(policy=policy(), vocab_size=100)
    fit(lm, cb, 2, loader(), gradient_clip_val=1.0)
    return lm, cb


@lightning_noise
def test_lightnings_clip_after_the_boundary_takes_the_guards_norms(
        foreach_norms: list[int]) -> None:  # noqa: F811
    lm, cb = lightning_fit(nan=False)
    n = len(list(lm.parameters()))
    assert foreach_norms == [n, n]  # the guard's at each boundary; the clip read none
    assert cb.guard is not None and cb.guard.stats["nonfinite"]["grad"] == 0


@lightning_noise
def test_lightnings_clip_does_not_hide_the_nan() -> None:
    with pytest.raises(GuardViolation) as e:
        lightning_fit(nan=True)
    assert (e.value.check, e.value.step) == ("nonfinite", 1)
    # The guard watches the module inside the LightningModule: its names are the model's.
    assert "the gradient of blocks.1.mlp.0.weight (1 of 28 parameters)" in str(e.value)
