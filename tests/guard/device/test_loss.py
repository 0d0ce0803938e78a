"""loss_spike: the rule on plain tensors and synthetic loss curves, then through attach."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest
import torch

import guard
from guard import GuardViolation
from guard.checks import loss_spike
from guard.checks.loss import SPEC as step_loss_spec
from guard.device.flags import Flags
from guard.device.loss import SpikeTracker, StepLoss
from guard.device.loss import loss_spike as spike_rule
from guard.policy_file import load_policy
from tests.conftest import batch, no_host_reads, policy, tiny_gpt

DEFAULTS = {"window": 100, "factor": 10.0, "min_delta": 1.0, "warmup": 10}
# Tests below feed losses alone through g.step(loss), no forward: the checks that need logits
# or labels are blind by design there, so coverage is off for them.
LOSSES_ONLY = {"action": "off"}


def curves() -> dict[str, list[float]]:
    """The synthetic curves of docs/loss_spike.md (fixed seed)."""
    r = random.Random(0)

    def noisy(x: float, sigma: float) -> float:
        return x * math.exp(r.gauss(0, sigma))

    # The seed: a normal descent to 2.1 by step 30, then 2.1 -> 87.3 in five steps, then NaN.
    seed = [noisy(2.1 + 8.7 * math.exp(-i / 7), 0.03) for i in range(30)]
    seed += [noisy(2.1, 0.03) for _ in range(6)]
    seed += [2.1 * (87.3 / 2.1) ** (k / 5) for k in range(1, 6)] + [math.nan] * 5
    return {
        "seed": seed,
        "descent": [noisy(3 + 7.8 * math.exp(-i / 12), 0.05) for i in range(300)],
        "warmup_bump": [10.8, 11.6, 13.9, 12.5, 10.1, 9.0]
        + [noisy(2.5 + 6.5 * math.exp(-i / 10), 0.05) for i in range(200)],
        "noise": [noisy(2.5, 0.25) * (2.5 if i % 53 == 0 else 1) for i in range(1000)],
        "drift": [noisy(2 + 6 * i / 2000, 0.1) for i in range(2000)],
        "finetune": [noisy(0.05, 0.8) for _ in range(1000)],
        "moderate": [noisy(2.1, 0.05) for _ in range(300)] + [4, 8, 6, 3]
        + [noisy(2.1, 0.05) for _ in range(50)],
        "late_spike": [noisy(2.1, 0.05) for _ in range(500)] + [10, 40, 20]
        + [noisy(2.1, 0.05) for _ in range(50)],
    }


def fired(trace: list[float], **overrides: float) -> list[int]:
    kw = {**DEFAULTS, **overrides}
    t = SpikeTracker(window=int(kw["window"]), factor=kw["factor"], min_delta=kw["min_delta"],
                     warmup=int(kw["warmup"]), device=torch.device("cpu"), dtype=torch.float64)
    return [i for i, x in enumerate(trace) if t.update(torch.tensor(x))[0].item()]


# -- the rule --------------------------------------------------------------------------------


def test_pure_function_against_a_known_history() -> None:
    history = torch.tensor([2.0, 3.0, 1.0, 0.0, 100.0], dtype=torch.float64)
    accepted = torch.tensor([True, True, True, False, True])
    kw = {"factor": 10.0, "min_delta": 1.0, "warmup": 3}
    # median of the accepted (2, 3, 1, 100) is 2 (the lower middle): one old spike moves nothing
    spike, ratio = spike_rule(torch.tensor(25.0, dtype=torch.float64), history, accepted, **kw)
    assert bool(spike) and float(ratio) == 12.5
    spike, ratio = spike_rule(torch.tensor(19.0, dtype=torch.float64), history, accepted, **kw)
    assert not bool(spike) and float(ratio) == 9.5
    spike, ratio = spike_rule(torch.tensor(25.0, dtype=torch.float64), history, accepted,
                              **{**kw, "warmup": 5})
    assert not bool(spike) and float(ratio) == 0.0  # not enough history: no ratio either


def test_seed_spike_is_caught_before_its_peak() -> None:
    seed = curves()["seed"]
    hits = fired(seed)
    assert hits and hits[0] == 39  # loss 41.4, one step before the 87.3
    assert seed[hits[0]] < 87.3 and all(math.isfinite(seed[i]) for i in hits)


@pytest.mark.parametrize("name", ["descent", "warmup_bump", "noise", "drift", "finetune"])
def test_normal_curves_never_fire(name: str) -> None:
    assert fired(curves()[name]) == []


def test_min_delta_is_what_keeps_low_loss_noise_quiet() -> None:
    # Fine-tuning near 0.05: batches at 15x the median are ordinary, a rise of 0.7 nats is not
    # a collapse. Without min_delta the ratio alone fires.
    assert fired(curves()["finetune"], min_delta=0.0) != []


def test_first_steps_without_history_do_not_fire() -> None:
    trace = [10.8] * 9 + [500.0, 500.0]
    assert fired(trace) == [10]  # 9 losses are not enough; the 10th spike sees 10 of history
    assert fired([10.8, 500.0]) == []


def test_late_spike_fires_once_per_bad_step() -> None:
    assert fired(curves()["late_spike"]) == [501]  # 10 is 4.8x: below the factor; 40 is 19x


def test_factor_is_the_sensitivity_knob() -> None:
    c = curves()
    assert fired(c["moderate"]) == []  # a 4x bump is not a spike at the default 10x ...
    assert fired(c["moderate"], factor=3.0) == [301]  # ... it is at 3x,
    assert fired(c["noise"], factor=3.0) != []  # where heavy-tailed noise fires too


def test_nonfinite_losses_are_not_spikes_nor_history() -> None:
    t = SpikeTracker(**DEFAULTS, device=torch.device("cpu"), dtype=torch.float64)
    for x in [2.0] * 10 + [math.nan, math.inf, -math.inf]:
        spike, ratio = t.update(torch.tensor(x))
    assert float(spike) == 0.0 and float(ratio) == 0.0
    assert int(t.accepted.sum()) == 10
    assert float(t.update(torch.tensor(2.2))[1]) == pytest.approx(1.1)


def test_a_lasting_level_change_stops_firing_after_half_a_window() -> None:
    hits = fired([2.0] * 100 + [40.0] * 100)
    # 40 becomes the (lower) median once it fills half the window plus one: skip cannot drop
    # steps forever after a genuine change of level.
    assert hits == list(range(100, 151))


def test_anchor_rules_on_the_same_curves() -> None:
    """Why not the anchors (docs/loss_spike.md): each misses the seed or fires on noise."""
    c = curves()

    def megatron(tr: list[float]) -> list[int]:  # 10x the largest of the first 100
        cap = 10 * max(tr[:100])
        return [i for i, x in enumerate(tr) if i >= 100 and x > cap]

    def lightning(tr: list[float]) -> list[int]:  # window 10, rtol 2, rising, warmup 1
        w: deque[float] = deque(maxlen=10)
        out, last = [], 0.0
        for i, x in enumerate(tr):
            mean = sum(w) / len(w) if w else 0.0
            if i >= 1 and math.isfinite(x) and x > last and x - mean >= 2 * mean:
                out.append(i)
                continue
            if math.isfinite(x):
                w.append(x)
                last = x
        return out

    assert megatron(c["seed"]) == []  # the first 100 steps include the collapse itself
    assert lightning(c["seed"])[0] == 37  # earlier than ours, but ...
    assert lightning(c["noise"]) and lightning(c["finetune"])  # ... it fires on noise


# -- through attach --------------------------------------------------------------------------


def test_seed_curve_through_attach_warns_at_the_spike() -> None:
    m = tiny_gpt()
    seed = curves()["seed"][:41]  # the NaN after it is nonfinite's business
    with guard.attach(m, policy=policy(loss_spike={"action": "warn"}, coverage=LOSSES_ONLY),
                      vocab_size=100) as g:
        for x in seed:
            g.step(torch.tensor(x))
        assert g.stats["violations"] == {"loss_spike": {"warn": 2}}
        assert g.stats["loss"] == pytest.approx(87.3)


def test_spike_message_names_the_median_and_the_action(caplog: pytest.LogCaptureFixture) -> None:
    m = tiny_gpt()
    with guard.attach(m, policy=policy(loss_spike={"action": "warn"}, coverage=LOSSES_ONLY),
                      vocab_size=100) as g:
        for x in [2.0] * 10 + [30.0]:
            g.step(torch.tensor(x))
    assert ("loss_spike on rank 0 at step 11: loss 30 is 15x the median of its last 100 "
            "losses, expected <= 10x (or a rise <= 1); continuing (action: warn)") in caplog.text


def test_fail_stops_a_real_model_before_the_update() -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = guard.attach(m, policy=policy(loss_spike={"action": "fail"}, coverage=LOSSES_ONLY),
                     vocab_size=100,
                     optimizer=opt)
    for i in range(10):
        m(*batch(seed=i))[1].backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        m.ln_f.weight.mul_(300.0)  # logits x300: confidently wrong, loss 4.8 -> 92
    before = [p.detach().clone() for p in m.parameters()]
    _, loss = m(*batch(seed=10))
    loss.backward()
    with pytest.raises(GuardViolation) as e:
        opt.step()
    assert (e.value.check, e.value.step, e.value.action) == ("loss_spike", 11, "fail")
    assert e.value.value > 10.0 and e.value.threshold == 10.0
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    g.detach()


def test_read_every_keeps_a_spike_between_reads() -> None:
    m = tiny_gpt()
    pol = {**policy(loss_spike={"action": "warn"}, coverage=LOSSES_ONLY),
           "cadence": {"read_every": 5}}
    with guard.attach(m, policy=pol, vocab_size=100) as g:
        for x in [2.0] * 12 + [50.0] + [2.0] * 2:  # the spike is step 13, read at step 15
            g.step(torch.tensor(x))
        assert g.stats["violations"] == {"loss_spike": {"warn": 1}}
        assert g.stats["step"] == 15


def step_loss(**checks: dict[str, object]) -> StepLoss:
    pol = load_policy(policy(**checks))
    return StepLoss.from_policy(pol, Flags.from_policy(pol, torch.device("cpu"), rank=0))


def test_folding_the_loss_reads_nothing_to_the_host() -> None:
    loss = step_loss(loss_spike={"action": "warn"})
    with no_host_reads():
        for x in [2.0] * 12 + [50.0]:
            loss.record(torch.tensor(x))
            loss.fold()
    reading = loss.flags.read(lagged=False)
    assert reading is not None and reading.fired_on("loss_spike") == 0
    assert reading.local[step_loss_spec].value == 50.0
    assert reading.local[loss_spike.SPEC].ratio == pytest.approx(25.0)


def test_off_keeps_no_history() -> None:
    assert step_loss().spike is None
    with guard.attach(tiny_gpt(), policy=policy(coverage=LOSSES_ONLY), vocab_size=100) as g:
        for x in [2.0] * 10 + [500.0]:
            g.step(torch.tensor(x))
        assert g.stats["violations"] == {}
