"""Flags on a plain CPU tensor: writers, the typed Reading, lagged windows, thresholds."""

from __future__ import annotations

import pytest
import torch

from guard.device.flags import Flags
from guard.policy_file import coerce_policy

T = torch.tensor


def flags(threshold: float = 1e-6, rank: int = 0) -> Flags:
    pol = coerce_policy({"checks": {"padding_mass": {"threshold": threshold}}})
    return Flags.from_policy(pol, torch.device("cpu"), rank)


def test_an_empty_read_has_no_values_and_nothing_fired() -> None:
    r = flags().read(lagged=False)
    assert r is not None
    assert (r.local.padding_mass, r.local.padding_mass_max, r.local.loss) == (None, None, None)
    assert r.local.nonfinite == {"logits": 0, "hidden": 0, "loss": 0}
    assert r.local.out_of_range == {"input": 0, "label": 0}
    assert r.over == dict.fromkeys(("token_range", "padding_mass", "nonfinite", "loss_spike",
                                    "padding_rows", "coverage"))


def test_reading_names_the_values_as_on_the_wire() -> None:
    f = flags(rank=2)
    f.add_padding_mass(T([0.1, 0.3]))
    f.add_positions(2)
    f.add_padding_mass(T([0.2]))
    f.add_positions(2)  # two positions measured, one of them with no padding column left
    f.add_nonfinite("hidden", T(3))
    f.nonfinite_at_least("logits", T(True))
    f.nonfinite_at_least("logits", T(False))
    f.add_out_of_range("label", T(5), T(2), T(130))
    f.set_loss(T(2.5, dtype=torch.float64))
    f.add_spike(T(1.0), T(12.0))
    r = f.read(lagged=False)
    assert r is not None
    v = r.local
    assert v.padding_mass == pytest.approx(0.6 / 4) and v.padding_mass_max == pytest.approx(0.3)
    assert v.nonfinite == {"logits": 1, "hidden": 3, "loss": 0}
    assert v.out_of_range == {"input": 0, "label": 5}
    assert (v.loss, v.spike_ratio) == (2.5, 12.0)
    assert r.glob == r.local  # one process: the all-rank values are this rank's
    # Each check that crossed its threshold names this rank (2); the others none.
    assert (v.negative_labels, v.max_id) == (2, 130)
    # Each check that crossed its threshold names this rank (2); the others none.
    assert r.over == {"token_range": 2, "padding_mass": 2, "nonfinite": 2, "loss_spike": 2,
                      "padding_rows": None, "coverage": None}


def test_the_padding_mass_threshold_is_the_policys() -> None:
    f = flags(threshold=0.5)
    f.add_padding_mass(T([0.4]))
    f.add_positions(1)
    r = f.read(lagged=False)
    assert r is not None and r.fired("padding_mass") is None
    f.add_padding_mass(T([0.6]))
    f.add_positions(1)
    r = f.read(lagged=False)
    assert r is not None and r.fired("padding_mass") == 0


def test_a_read_resets_the_accumulator() -> None:
    f = flags()
    f.add_out_of_range("input", T(4), T(0), T(0))
    first, second = f.read(lagged=False), f.read(lagged=False)
    assert first is not None and second is not None
    assert first.local.out_of_range["input"] == 4 and second.local.out_of_range["input"] == 0


def test_a_lagged_read_on_the_cpu_is_the_current_one() -> None:
    # Only a CUDA copy can be read late; on the CPU the copy is the read.
    f = flags()
    f.set_loss(T(1.0))
    r = f.read(lagged=True)
    assert r is not None and r.local.loss == 1.0
    assert f.flush() is None


def test_a_step_that_saw_nothing_is_counted_blind_per_kind() -> None:
    f = flags()
    f.saw("logits")
    f.saw("loss")
    f.end_step()  # step 1: no labels
    f.end_step()  # step 2: nothing at all
    r = f.read(lagged=False)
    assert r is not None and r.local.blind == {"logits": 1, "labels": 2, "loss": 1}
    assert r.fired("coverage") == 0
    f.saw("logits")
    f.saw("labels")
    f.saw("loss")
    f.end_step()
    r = f.read(lagged=False)
    assert r is not None and r.local.blind == {"logits": 0, "labels": 0, "loss": 0}
    assert r.fired("coverage") is None


def test_blindness_only_counts_where_a_check_needs_the_data() -> None:
    off = {c: {"action": "off"} for c in ("token_range", "nonfinite", "loss_spike")}
    f = Flags.from_policy(coerce_policy({"checks": off}), torch.device("cpu"), 0)
    f.saw("logits")
    f.end_step()  # no labels, no loss: nothing needs them
    r = f.read(lagged=False)
    assert r is not None and r.local.blind["labels"] == 1 and r.fired("coverage") is None
