"""Flags on a plain CPU tensor: writers, the typed Reading, lagged windows, thresholds."""

from __future__ import annotations

import pytest
import torch

from guard.checks import CHECKS, coverage, loss, loss_spike, nonfinite, padding_mass, token_range
from guard.device.flags import Flags
from guard.policy_file import load_policy

T = torch.tensor


def flags(threshold: float = 1e-6, rank: int = 0) -> Flags:
    pol = load_policy({"checks": {"padding_mass": {"threshold": threshold}}})
    return Flags.from_policy(pol, torch.device("cpu"), rank)


def test_an_empty_read_has_no_values_and_nothing_fired() -> None:
    r = flags().read(lagged=False)
    assert r is not None
    pm = r.local[padding_mass.SPEC]
    assert (pm.mean, pm.max, r.local[loss.SPEC].value) == (None, None, None)
    assert r.local[nonfinite.SPEC].counts == {"hidden": 0, "logits": 0, "loss": 0}
    assert r.local[token_range.SPEC].counts == {"input": 0, "label": 0}
    assert r.over == dict.fromkeys(s.name for s in CHECKS)  # every check, none fired
    assert r.crossed == frozenset()


def test_each_slot_reduces_as_its_spec_says_and_the_reading_is_typed_per_spec() -> None:
    f = flags(rank=2)
    for masses in ([0.1, 0.3], [0.2]):  # sums add, maxima max
        f.put(padding_mass.SUM, T(masses).sum())
        f.put(padding_mass.MAX, T(masses).max())
        f.put(padding_mass.LOSS_MAX, T(masses).max())  # nothing masked them
        f.put(padding_mass.COUNT, 2)  # two positions, one with no padding column left
    f.put(nonfinite.HIDDEN, T(3))
    f.at_least(nonfinite.LOGITS, T(True))
    f.at_least(nonfinite.LOGITS, T(False))
    f.put(token_range.LABEL, T(5))
    f.put(token_range.NEGATIVE, T(2))
    f.put(token_range.TOP["label"], T(130 * token_range.POSITIONS + 37))  # id 130 at 37
    f.put(token_range.WIDTH["label"], 16)  # labels (b, 16): at [2, 5]
    f.put(loss.VALUE, T(9.0, dtype=torch.float64))
    f.put(loss.VALUE, T(2.5, dtype=torch.float64))  # last: overwritten
    f.put(loss.SEEN, 1.0)
    f.put(loss_spike.SPIKE, T(1.0))
    f.put(loss_spike.RATIO, T(12.0))
    r = f.read(lagged=False)
    assert r is not None
    v = r.local
    pm = v[padding_mass.SPEC]
    assert pm.mean == pytest.approx(0.6 / 4) and pm.max == pytest.approx(0.3)
    assert v[nonfinite.SPEC].counts == {"hidden": 3, "logits": 1, "loss": 0}
    tr = v[token_range.SPEC]
    assert (tr.counts, tr.negative_labels, tr.max_id) == ({"input": 0, "label": 5}, 2, 130)
    assert tr.where == {"label": "130 at [2, 5]"}
    assert (v[loss.SPEC].value, v[loss_spike.SPEC].ratio) == (2.5, 12.0)
    assert r.glob == r.local  # one process: the all-rank values are this rank's
    # Each check that crossed its threshold names this rank (2); the others none.
    assert r.over == {"token_range": 2, "padding_mass": 2, "nonfinite": 2, "loss_spike": 2,
                      "padding_rows": None, "coverage": None, "untrained_rows": None,
                      "vocab": None}
    assert r.crossed == {padding_mass.LOSS_MAX, nonfinite.HIDDEN, nonfinite.LOGITS,
                         token_range.LABEL, loss_spike.SPIKE}


def test_the_padding_mass_threshold_is_the_policys() -> None:
    # An absolute threshold where the policy sets one; on the mass the loss trained on only.
    f = flags(threshold=0.5)
    f.put(padding_mass.LOSS_MAX, T(0.4))
    f.put(padding_mass.MAX, T(0.9))  # before a mask: a figure, never a violation
    r = f.read(lagged=False)
    assert r is not None and r.fired_on("padding_mass") is None
    f.put(padding_mass.LOSS_MAX, T(0.6))
    r = f.read(lagged=False)
    assert r is not None and r.fired_on("padding_mass") == 0


def test_by_default_the_bound_is_ten_times_an_average_real_ids_share() -> None:
    # 100 real columns of 128: each of the 28 padding columns may take up to 10x an average
    # real id's probability, m / 28 = 10 (1 - m) / 100, m = 280 / 380.
    pol = load_policy({})
    f = Flags.from_policy(pol, torch.device("cpu"), 0, real=100, columns=128)
    bound = 280 / 380
    f.put(padding_mass.LOSS_MAX, T(bound - 1e-6))
    r = f.read(lagged=False)
    assert r is not None and r.fired_on("padding_mass") is None
    f.put(padding_mass.LOSS_MAX, T(bound + 1e-6))
    r = f.read(lagged=False)
    assert r is not None and r.fired_on("padding_mass") == 0
    no_padding = Flags.from_policy(pol, torch.device("cpu"), 0, real=128, columns=128)
    no_padding.put(padding_mass.LOSS_MAX, T(1.0))
    r = no_padding.read(lagged=False)
    assert r is not None and r.fired_on("padding_mass") is None


def test_a_read_resets_the_accumulator() -> None:
    f = flags()
    f.put(token_range.INPUT, T(4))
    first, second = f.read(lagged=False), f.read(lagged=False)
    assert first is not None and second is not None
    assert first.local[token_range.SPEC].counts["input"] == 4
    assert second.local[token_range.SPEC].counts["input"] == 0


def test_a_lagged_read_returns_the_previous_reads_values_and_flush_the_last() -> None:
    # On every device alike (a DeviceSkip lags on the CPU too): the first lagged read has
    # nothing before it, each later one the window before it, detach's flush the last window.
    f = flags()
    f.put(loss.VALUE, T(1.0))
    f.put(loss.SEEN, 1.0)
    assert f.read(lagged=True) is None
    f.put(loss.VALUE, T(2.0))
    f.put(loss.SEEN, 1.0)
    r = f.read(lagged=True)
    assert r is not None and r.local[loss.SPEC].value == 1.0
    last = f.flush()
    assert last is not None and last.local[loss.SPEC].value == 2.0
    assert f.flush() is None


def test_a_step_that_saw_nothing_is_counted_blind_per_kind() -> None:
    f = flags()
    f.mark(coverage.SEEN["logits"])
    f.mark(coverage.SEEN["loss"])
    f.mark(coverage.SEEN["inputs"])
    f.end_step()  # step 1: no labels
    f.end_step()  # step 2: nothing at all
    r = f.read(lagged=False)
    assert r is not None and r.local[coverage.SPEC].blind == {"logits": 1, "inputs": 1,
                                                               "labels": 2, "loss": 1}
    assert r.fired_on("coverage") == 0
    for kind in ("logits", "inputs", "labels", "loss"):
        f.mark(coverage.SEEN[kind])
    f.end_step()
    r = f.read(lagged=False)
    assert r is not None and r.local[coverage.SPEC].blind == {"logits": 0, "inputs": 0,
                                                               "labels": 0, "loss": 0}
    assert r.fired_on("coverage") is None


def test_blindness_only_counts_where_a_check_needs_the_data() -> None:
    off = {c: {"action": "off"} for c in ("token_range", "nonfinite", "loss_spike")}
    f = Flags.from_policy(load_policy({"checks": off}), torch.device("cpu"), 0)
    f.mark(coverage.SEEN["logits"])
    f.end_step()  # no labels, no loss: nothing needs them
    r = f.read(lagged=False)
    assert r is not None and r.local[coverage.SPEC].blind["labels"] == 1
    assert r.fired_on("coverage") is None and r.crossed == frozenset()


def test_two_windows_read_as_one_keep_the_newer_loss_only_where_it_wrote_one() -> None:
    from guard.device.reading import LAYOUT
    from tests.guard.readings import raw

    old = raw({loss.VALUE: 3.0, loss.SEEN: 1, token_range.INPUT: 2, padding_mass.MAX: 0.5})
    new = raw({token_range.INPUT: 1, padding_mass.MAX: 0.25})  # no loss in the newer window
    both = LAYOUT.values(LAYOUT.combine(old, new))
    assert both[loss.SPEC].value == 3.0
    assert both[token_range.SPEC].counts["input"] == 3
    assert LAYOUT.combine(old, new)[LAYOUT.index[padding_mass.MAX]] == 0.5
    newer = raw({loss.VALUE: 1.5, loss.SEEN: 1})
    assert LAYOUT.values(LAYOUT.combine(old, newer))[loss.SPEC].value == 1.5
