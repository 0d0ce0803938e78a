"""The probe on small modules: what it measures, what it masks, and that off costs no hook."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from guard.checks import loss, padding_mass, token_range
from guard.device.labels import labels_position
from guard.device.logits import ProbeConfig
from guard.device.ops import padding_mass as mass_of
from guard.device.ops import sample_positions
from guard.device.probe import Probe, find_loss
from guard.policy import Policy
from guard.policy_file import load_policy
from guard.vocab.discover import Heads
from guard.vocab.resolve import resolve
from tests.conftest import batch, policy, tiny_gpt


def heads_of(model: nn.Module, head: nn.Module | None = None) -> Heads:
    return Heads(model.wte, head or model.lm_head, "wte", "lm_head")  # type: ignore[arg-type]


def probe_for(model: nn.Module, pol: Policy,
              real: int = 100) -> tuple[Probe, list[torch.utils.hooks.RemovableHandle]]:
    heads = heads_of(model)
    probe = Probe.from_policy(pol, resolve(heads, pol.vocab, vocab_size=real), heads, rank=0)
    return probe, probe.install(model, heads)


def test_config_from_the_policy_and_a_vocab_shard() -> None:
    m = tiny_gpt()
    pol = load_policy(policy(padding_mass={"action": "warn", "sample_tokens": 8}))
    c = ProbeConfig.from_policy(pol, resolve(heads_of(m), pol.vocab, vocab_size=100))
    assert (c.real, c.columns, c.real_columns, c.mask, c.padding_mass, c.sample_tokens) == \
        (100, 128, 100, False, True, 8)
    half = nn.Linear(32, 64, bias=False)  # this rank's 64 columns of a 128-row head
    pol = load_policy({**policy(), "vocab": {"tensor_parallel": 2}})
    sizes = resolve(heads_of(m, half), pol.vocab, vocab_size=100, vocab_shard=(64, 128))
    shard = ProbeConfig.from_policy(pol, sizes)
    assert (shard.columns, shard.real_columns, shard.mask) == (64, 36, True)  # ids [64, 100)


@pytest.mark.parametrize(("sample_tokens", "sampled"), [(8, 2), (1, 1)])
def test_sampled_padding_mass_is_the_mean_over_a_32nd_of_the_positions(
    sample_tokens: int, sampled: int
) -> None:
    # 64 positions a forward: one in 32 of them (2), or sample_tokens where that is fewer; the
    # guard's share of the logits' work stays a 32nd of the loss's whatever the vocab.
    m = tiny_gpt(garbage=0.3)
    pol = load_policy(policy(padding_mass={"action": "warn", "sample_tokens": sample_tokens}))
    probe, _ = probe_for(m, pol)
    x, y = batch()
    logits, _ = m(x, y)
    flags = probe.flags
    # and the 2 positions of largest padding logit (issue 39: the hottest are always seen)
    assert flags.t[flags.layout.index[padding_mass.COUNT]] == sampled + 2
    reading = probe.read(lagged=False)
    flat = logits.detach().reshape(-1, 128)  # 64 positions, warn: not masked
    hottest = flat[flat[:, 100:].amax(dim=-1).topk(2).indices]
    expected = mass_of(torch.cat([sample_positions(flat, sampled, 0), hottest]), 100)
    assert reading is not None
    pm = reading.local[padding_mass.SPEC]
    assert pm.mean == pytest.approx(float(expected.mean()), rel=1e-5)
    assert pm.max == pytest.approx(float(expected.max()), rel=1e-5)


def test_mask_sets_the_padding_logits_to_minus_inf_in_every_position() -> None:
    m = tiny_gpt(garbage=0.3)
    probe_for(m, load_policy(policy()))
    logits, _ = m(*batch())
    assert torch.isneginf(logits[..., 100:]).all() and torch.isfinite(logits[..., :100]).all()


def test_ghost_ids_and_the_models_loss_reach_the_flags() -> None:
    m = tiny_gpt()
    probe, _ = probe_for(m, load_policy(policy()))
    x, y = batch()
    x[0, :3], y[1, 0], y[1, 1] = 110, 120, -100  # three ghost inputs, one ghost label
    _, out = m(x, y)
    probe.fold()
    reading = probe.read(lagged=False)
    assert reading is not None and reading.local[token_range.SPEC].counts == {"input": 3,
                                                                            "label": 1}
    # +inf: a masked ghost
    assert reading.local[loss.SPEC].value == pytest.approx(float(out.detach()))


def test_eval_forwards_are_not_measured() -> None:
    m = tiny_gpt(garbage=0.3)
    probe, _ = probe_for(m, load_policy(policy(padding_mass={"action": "warn"})))
    m.eval()
    m(*batch())
    reading = probe.read(lagged=False)
    assert reading is not None and reading.local[padding_mass.SPEC].mean is None


def test_checks_that_are_off_get_no_hook() -> None:
    off = {c: {"action": "off"} for c in ("padding_mass", "nonfinite", "token_range")}
    m = tiny_gpt()
    _, handles = probe_for(m, load_policy(policy(**off)))
    assert len(handles) == 2  # the model's own pre- and post-hook: labels, loss
    assert not m.wte._forward_pre_hooks and not m.lm_head._forward_hooks


def test_find_loss_in_the_usual_outputs() -> None:
    loss = torch.tensor(1.5)
    assert find_loss((torch.ones(2, 3), loss)) is loss  # nanoGPT
    assert find_loss({"loss": loss, "logits": torch.ones(2)}) is loss
    assert find_loss(torch.ones(2, 3)) is None
    assert find_loss((torch.ones(2), torch.tensor(3))) is None  # an int is not a loss


def test_labels_position_from_the_signature() -> None:
    class M(nn.Module):
        def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> None: ...

    assert labels_position(M()) == 1 and labels_position(nn.Linear(2, 2)) is None
