"""The verdict from a Reading: which checks fire, on which rank, with which message."""

from __future__ import annotations

from typing import Any

import pytest

from guard.checks import coverage, loss, loss_spike, nonfinite, padding_mass, token_range
from guard.device.reading import Reading
from guard.errors import GuardViolation
from guard.policy import Action
from guard.policy_file import load_policy
from guard.step.verdict import Verdict, Violation, attach_verdict, judge
from guard.vocab.real import Real
from guard.vocab.sizes import audit_sizes
from tests.conftest import policy
from tests.guard.readings import reading


def verdict(r: Reading, **checks: dict[str, Any]) -> Verdict:
    return judge(r, load_policy(policy(**checks)), step=7, real=100, rows=128)


def test_a_clean_reading_is_no_violation() -> None:
    v = verdict(reading({}))
    assert v.violations == () and v.fail is None and not v.skip and v.error() is None


def test_every_rank_skips_on_the_all_reduced_values() -> None:
    # This rank's own values are clean; rank 3's loss was NaN: the decision is taken on the
    # combined values, so this rank drops the step too and every rank stays in lockstep.
    r = reading({nonfinite.LOSS: 1}, over={nonfinite.LOSS: 3})
    v = verdict(r, nonfinite={"action": "skip"})
    assert v.skip and v.fail is None
    (nf,) = v.violations
    assert (nf.check, nf.action, nf.rank, nf.step, nf.value) == ("nonfinite", Action.SKIP, 3,
                                                                 7, 1.0)
    assert nf.message.startswith("nonfinite on rank 3 at step 7: NaN/Inf values: 1 in the loss")


def test_padding_mass_message_gives_value_mean_columns_and_fix() -> None:
    r = reading({padding_mass.SUM: 1.7, padding_mass.COUNT: 2, padding_mass.MAX: 0.9,
                 padding_mass.LOSS_MAX: 0.9}, over={padding_mass.LOSS_MAX: 0})
    (pm,) = verdict(r, padding_mass={"action": "fail"}).violations
    assert pm.message == (
        "padding_mass on rank 0 at step 7: the loss trained on 0.9 of the probability (mean "
        "0.85) on the 28 padding columns [100, 128): 32.1x an average real id's share per "
        "padding column (healthy rows take about 1x, 0.219 in all, or less once trained), "
        "expected <= 10x; stopping (action: fail). Set checks.padding_mass.action: mask to take "
        "them out of softmax and gradient, and look at the padding rows of the head "
        "(checks.padding_rows).")
    assert (pm.value, pm.threshold) == (0.9, pytest.approx(280 / 380))
    absolute = verdict(r, padding_mass={"action": "warn", "threshold": 1e-6}).violations[0]
    assert "expected <= 1e-06 (checks.padding_mass.threshold); continuing" in absolute.message
    assert absolute.threshold == 1e-6


def test_under_mask_only_a_fused_loss_is_a_padding_mass_violation() -> None:
    # The mask did its job: the mass before it is a figure (no LOSS_MAX), nothing fires. A
    # forward whose loss a fused kernel computed is measured unmasked and fires.
    fused = reading({padding_mass.SUM: 0.9, padding_mass.COUNT: 1, padding_mass.MAX: 0.9,
                     padding_mass.LOSS_MAX: 0.9, padding_mass.FUSED: 1},
                    over={padding_mass.LOSS_MAX: 0})
    (pm,) = verdict(fused).violations
    assert pm.action is Action.MASK and "lm_head was not called: a fused kernel" in pm.message
    assert "Pass it the real rows lm_head.weight[:100]" in pm.message


def test_causes_come_first_and_fail_names_the_others() -> None:
    r = reading({token_range.LABEL: 2, nonfinite.LOSS: 1},
                over={token_range.LABEL: 1, nonfinite.LOSS: 1})
    v = verdict(r, nonfinite={"action": "warn"})
    assert [x.check for x in v.violations] == ["token_range", "nonfinite"]
    err = v.error()
    assert isinstance(err, GuardViolation) and (err.check, err.rank, err.step) == \
        ("token_range", 1, 7)
    assert str(err).endswith("(also at this step: nonfinite)")
    assert "2 label ids outside [0, 100) (ignore index -100 exempt)" in str(err)


def test_fail_wins_over_skip() -> None:
    r = reading({loss.VALUE: 50.0, loss.SEEN: 1, loss_spike.SPIKE: 1, loss_spike.RATIO: 25.0,
                 nonfinite.LOGITS: 2}, over={nonfinite.LOGITS: 0, loss_spike.SPIKE: 0})
    v = verdict(r, nonfinite={"action": "fail"}, loss_spike={"action": "skip"})
    assert v.fail is not None and v.fail.check == "nonfinite" and not v.skip


def test_loss_spike_message_gives_the_ratio_and_the_window() -> None:
    r = reading({loss.VALUE: 50.0, loss.SEEN: 1, loss_spike.SPIKE: 1, loss_spike.RATIO: 25.0},
                over={loss_spike.SPIKE: 0})
    (ls,) = verdict(r, loss_spike={"action": "warn"}).violations
    assert ls.message.startswith("loss_spike on rank 0 at step 7: loss 50 is 25x the median "
                                 "of its last 100 losses, expected <= 10x")


def test_a_check_that_is_off_never_fires() -> None:
    r = reading({token_range.INPUT: 1}, over={token_range.INPUT: 0})
    assert verdict(r, token_range={"action": "off"}).violations == ()


@pytest.mark.parametrize(("action", "next_"), [("fail", "stopping before the first step"),
                                               ("warn", "continuing (action: warn)")])
def test_attach_verdict_for_an_unaligned_head(action: str, next_: str) -> None:
    audit = audit_sizes(real=90, rows=100, embedding_rows=100, tied=True)
    v = attach_verdict(audit, load_policy(policy(alignment={"action": action})), rank=0)
    (al,) = v.violations
    assert (al.check, al.step, al.value, al.threshold) == ("alignment", 0, 100.0, 64.0)
    assert next_ in al.message and "build embedding and lm_head with 128 rows" in al.message
    assert (v.fail is not None) == (action == "fail")


@pytest.mark.parametrize("action", ["fail", "warn"])
def test_a_tokenizer_far_smaller_than_the_rows_is_a_vocab_warning_never_a_stop(
        action: str) -> None:
    """600 ids on 1024 rows: 424 padding rows, more than any alignment explains (issue 19). A
    warning whatever the action: a suspicion is never a stop."""
    audit = audit_sizes(real=600, rows=1024, embedding_rows=1024, tied=True)
    assert audit.ok and audit.vocab_warnings
    v = attach_verdict(audit, load_policy(policy(vocab={"action": action})), rank=0,
                       found=Real(600, "len(tokenizer)", given=True))
    (w,) = v.violations
    assert (w.check, w.action, w.value) == ("vocab", Action.WARN, 424.0) and v.fail is None
    assert w.message.startswith("vocab on rank 0 at attach: the real vocab 600 (len(tokenizer))"
                                ": 424 padding rows (600 real ids in 1024 rows): more than "
                                "aligning to a multiple of 64 explains")
    assert "likely another model's" in w.message
    off = attach_verdict(audit, load_policy(policy(vocab={"action": "off"})), rank=0)
    assert off.violations == ()


@pytest.mark.parametrize(("real", "rows"), [(1003, 1024), (151_665, 151_936), (50_277, 50_432),
                                            (50_257, 51_200), (100, 128), (32_100, 32_128)])
def test_padding_a_model_really_has_is_no_warning(real: int, rows: int) -> None:
    """One alignment block, and what vendors reserve (Qwen2, GPT-NeoX-20B, Megatron's GPT-2 at
    tensor parallel 8, T5): no warning."""
    assert audit_sizes(real=real, rows=rows, embedding_rows=rows, tied=True).vocab_warnings == ()


@pytest.mark.parametrize("action", ["warn", "fail"])
def test_a_real_vocab_not_found_is_a_blind_attach(action: str) -> None:
    audit = audit_sizes(real=1024, rows=1024, embedding_rows=1024, tied=True)
    found = Real(1024, "", looked="its config keeps no unpadded size")
    v = attach_verdict(audit, load_policy(policy(coverage={"action": action})), rank=0,
                       found=found)
    (cv,) = v.violations
    assert (cv.check, cv.action.value, cv.step) == ("coverage", action, 0)
    assert cv.message.startswith(
        "coverage on rank 0 at attach: the real vocab size was not found (none was given, and "
        "its config keeps no unpadded size); every one of the 1024 rows is taken as real, so no "
        "padding column is measured or masked and no ghost id in [real, rows) is seen;")
    assert "Give it: guard.attach(model, tokenizer=tok), guard.attach(model, " \
           "vocab_size=len(tok)), or vocab.real_size in the policy" in cv.message
    assert (v.fail is not None) == (action == "fail")
    given = attach_verdict(audit, load_policy(policy()), rank=0,
                           found=Real(1024, "vocab_size=", given=True))
    assert given.violations == ()


def test_the_error_keeps_the_violations_data() -> None:
    v = Verdict((Violation("padding_mass", Action.FAIL, 3, "m", rank=2, value=0.5,
                          threshold=1e-6),))
    err = v.error()
    assert err is not None
    assert (err.check, err.step, err.rank, err.value, err.threshold, err.action) == \
        ("padding_mass", 3, 2, 0.5, 1e-6, "fail")


def test_negative_labels_name_the_ignore_index_setting() -> None:
    r = reading({token_range.LABEL: 6, token_range.NEGATIVE: 6}, over={token_range.LABEL: 0})
    (tr,) = verdict(r).violations
    assert "6 labels are negative: if they mark positions to ignore, set " \
           "checks.token_range.ignore_index to their value (nanoGPT ignores -1: " \
           "ignore_index: -1)" in tr.message
    assert "ghost tokens" not in tr.message


def test_ids_just_above_real_may_be_special_tokens() -> None:
    r = reading({token_range.INPUT: 2, token_range.TOP["input"]: 101 * token_range.POSITIONS},
                over={token_range.INPUT: 0})
    (tr,) = judge(r, load_policy(policy()), step=7, real=100, rows=128,
                  real_from="vocab_size=").violations
    # The likely cause first: a real vocab larger than the one given, and how to pass it.
    assert "ids in [100, 128) (highest 101) are beyond the real vocab 100 (vocab_size=): if " \
           "your tokenizer has more ids (special tokens" in tr.message
    assert "pass tokenizer= or set vocab.real_size to its size; otherwise they are ghost ids " \
           "the tokenizer cannot produce" in tr.message
    assert tr.message.index("pass tokenizer=") < tr.message.index("ghost ids")


def test_ghost_ids_beyond_a_given_tokenizer_do_not_ask_for_the_tokenizer() -> None:
    """The user passed tokenizer=: the hint names the tokenizer's size and the likely causes,
    not "pass tokenizer=" (issue 19)."""
    r = reading({token_range.LABEL: 1, token_range.TOP["label"]: 101 * token_range.POSITIONS},
                over={token_range.LABEL: 0})
    (tr,) = judge(r, load_policy(policy()), step=7, real=100, rows=128,
                  real_from="len(tokenizer)").violations
    assert "ids in [100, 128) (highest 101) are beyond the tokenizer you gave (100 ids): ghost " \
           "ids it cannot produce" in tr.message
    assert "pass tokenizer=" not in tr.message


def test_ids_without_a_row_are_out_of_range_not_special_tokens() -> None:
    r = reading({token_range.INPUT: 1, token_range.TOP["input"]: 130 * token_range.POSITIONS + 5,
                 token_range.WIDTH["input"]: 4}, over={token_range.INPUT: 0})
    (tr,) = verdict(r).violations
    assert "ids >= 128 (highest 130) have no row at all: the guard replaced them on the device " \
           "(input ids by 0, labels by the ignore index -100, which must be the one the loss " \
           "ignores)" in tr.message
    assert "the highest: input ids 130 at [1, 1]" in tr.message  # flat 5 of rows of 4
    assert "beyond the real vocab" not in tr.message and "tokenizer=" not in tr.message


def test_coverage_names_what_was_not_seen_and_only_what_crossed() -> None:
    # The device decides which blind slots are violations (thresholds only where a check that
    # is on needs the data); the message names the checks that need them.
    blind = {coverage.BLIND["labels"]: 3, coverage.BLIND["loss"]: 2}
    r = reading(blind, over=dict.fromkeys(blind, 0))
    (cv,) = verdict(r).violations
    assert cv.message.startswith("coverage on rank 0 at step 7: blind in 3 training step(s): "
                                 "token_range saw no labels")
    assert "nonfinite saw no loss" in cv.message  # loss_spike is off in the test policy
    assert (cv.count, cv.once) == (3, "coverage:labels+loss")
    uncrossed = reading(blind, over={coverage.BLIND["labels"]: 0})
    (cv,) = verdict(uncrossed).violations
    assert "no loss" not in cv.message and cv.once == "coverage:labels"


def _ghost_labels() -> dict[Any, float]:
    return {token_range.LABEL: 2, token_range.TOP["label"]: 117 * token_range.POSITIONS}


@pytest.mark.parametrize("also", [{}, {nonfinite.HIDDEN: 4.0}], ids=["loss only", "and hidden"])
def test_ghost_labels_are_named_as_the_infinite_losss_cause_whatever_else(
        also: dict[Any, float]) -> None:
    """Under the mask a ghost label's loss is +inf: named as the cause of the loss, never the
    learning rate, also when the step saw another non-finite tensor (issue 33)."""
    glob = {**_ghost_labels(), nonfinite.LOSS: 1, **also}
    r = reading(glob, over=dict.fromkeys([token_range.LABEL, nonfinite.LOSS, *also], 0))
    tr, nf = verdict(r, token_range={"action": "warn"}).violations
    assert (tr.check, nf.check) == ("token_range", "nonfinite")
    assert "The loss is +inf because 2 labels are ghost ids in [100, 128) (highest 117)" \
        in nf.message
    assert ("for the lm_head input, check the learning rate" in nf.message) is bool(also)
    assert verdict(r, token_range={"action": "warn"}).error() is not None  # nonfinite: fail


def test_labels_not_seen_are_the_first_suspect_of_an_infinite_loss() -> None:
    glob = {nonfinite.LOSS: 1, coverage.BLIND["labels"]: 1}
    r = reading(glob, over={nonfinite.LOSS: 0, coverage.BLIND["labels"]: 0})
    nf = next(v for v in verdict(r).violations if v.check == "nonfinite")
    assert "This step's labels were not checked (token_range is off, or they did not reach " \
           "the guarded forward: see coverage), and a label in [100, 128) makes the loss +inf " \
           "under the mask: look at the labels first; then check the learning rate" in nf.message
    seen = reading({nonfinite.LOSS: 1}, over={nonfinite.LOSS: 0})
    (nf,) = verdict(seen).violations
    assert "labels" not in nf.message and "Check the learning rate" in nf.message


def test_an_inf_loss_with_labels_in_range_is_named_a_loss_over_every_column() -> None:
    """+inf, not NaN, under the mask with no ghost label: a loss over every column (label
    smoothing) met the -inf padding columns (issue 39 item 2); labels unseen stay a suspect."""
    over = {nonfinite.LOSS: 0, nonfinite.LOSS_INF: 0, coverage.BLIND["labels"]: 0}
    r = reading({nonfinite.LOSS: 1, nonfinite.LOSS_INF: 1}, over=over)
    nf = next(v for v in verdict(r).violations if v.check == "nonfinite")
    assert "The loss is inf: a loss over every column with the padding columns masked to -inf " \
           "(label smoothing?): compute it over logits[..., :100]." in nf.message
    blind = reading({nonfinite.LOSS: 1, nonfinite.LOSS_INF: 1, coverage.BLIND["labels"]: 1},
                    over=over)
    nf = next(v for v in verdict(blind).violations if v.check == "nonfinite")
    assert "logits[..., :100]; or a label in [100, 128): this step's labels were not " \
           "checked" in nf.message
    nan = reading({nonfinite.LOSS: 1}, over={nonfinite.LOSS: 0})
    assert all("label smoothing" not in v.message for v in verdict(nan).violations)
