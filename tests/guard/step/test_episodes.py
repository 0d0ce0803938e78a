"""Episodes: which module went non-finite, once per run of nonfinite reads."""

from __future__ import annotations

import torch

from guard.policy import Action
from guard.policy_file import load_policy
from guard.step.episodes import Episodes
from guard.step.localise import capture
from guard.step.verdict import Verdict, Violation
from tests.conftest import batch, policy, tiny_gpt

NF = Violation("nonfinite", Action.WARN, 5, "nonfinite on rank 0 at step 5: NaN", rank=0,
               value=1.0, threshold=0.0)


def poisoned() -> torch.nn.Module:
    m = tiny_gpt()
    with torch.no_grad():
        m.blocks[1].mlp[0].weight[5, 3] = float("nan")
    return m


def test_off_or_without_localise_there_is_nothing_to_keep() -> None:
    m = tiny_gpt()
    assert Episodes.from_policy(load_policy(policy(nonfinite={"action": "off"})), m) is None
    pol = load_policy(policy(nonfinite={"localise": False}))
    assert Episodes.from_policy(pol, m) is None


def test_a_rerun_names_the_module_once_per_episode() -> None:
    m = poisoned()
    e = Episodes(m, Action.WARN)
    e.inputs = capture(batch(), {}, "cpu")
    v, note = e.annotate(Verdict((NF,)), rerun_now=True, step=5, rank=0)
    (nf,) = v.violations
    assert note is None and nf.module == "blocks.1.mlp.0" and "Localisation:" in nf.message
    again, _ = e.annotate(Verdict((NF,)), rerun_now=True, step=6, rank=0)
    assert again.violations == (NF,)  # the same episode: not localised twice
    e.annotate(Verdict(), rerun_now=True, step=7, rank=0)  # a clean read ends it
    third, _ = e.annotate(Verdict((NF,)), rerun_now=True, step=8, rank=0)
    assert third.violations[0].module == "blocks.1.mlp.0"


def test_without_a_rerun_flags_are_armed_for_the_next_forward() -> None:
    m = poisoned()
    e = Episodes(m, Action.WARN)
    v, note = e.annotate(Verdict((NF,)), rerun_now=False, step=5, rank=0)
    assert v.violations == (NF,) and note is None
    m(*batch())  # the next training forward, with the flags armed
    _, note = e.annotate(Verdict((NF,)), rerun_now=False, step=6, rank=0)
    assert note is not None and note.module == "blocks.1.mlp.0" and note.step == 6
    assert "armed after step 5" in note.message
    e.close()
