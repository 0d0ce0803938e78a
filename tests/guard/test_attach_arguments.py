"""attach()'s arguments and torchrun's variables are looked at before anything is built (issue
41, item 7): a vocab_shard whose third element is no process group, an embedding= / lm_head=
that is no module (0, False, "", [] were taken for "find it", an empty nn.Sequential too), a
RANK or LOCAL_RANK that is no rank: each an AttachError naming the argument or the variable,
with no hook left behind."""

from __future__ import annotations

import pytest
from torch import nn

import guard
from tests.conftest import batch, hook_count, policy, tiny_gpt

QUIET = policy() | {"export": {"serve": None}}


def test_a_vocab_shard_group_that_is_no_process_group() -> None:
    model = tiny_gpt()
    with pytest.raises(guard.AttachError, match="vocab_shard's third element") as info:
        guard.attach(model, policy=QUIET, vocab_size=100, vocab_shard=(0, 128, "junk"))
    assert "'junk' (str)" in str(info.value)
    assert hook_count(model) == 0
    # None stands for "no other shard to combine with"; the model trains.
    with guard.attach(model, policy=QUIET, vocab_size=100, vocab_shard=(0, 128, None)) as g:
        _, loss = model(*batch())
        loss.backward()
        g.step(loss)
    assert g.stats["step"] == 1


@pytest.mark.parametrize("argument", ["embedding", "lm_head"])
@pytest.mark.parametrize("value", [0, False, "", [], nn.Sequential()],
                         ids=["0", "False", "empty-str", "empty-list", "empty-Sequential"])
def test_a_module_argument_that_is_no_module(argument: str, value: object) -> None:
    model = tiny_gpt()
    with pytest.raises(guard.AttachError, match=f"{argument}") as info:
        guard.attach(model, policy=QUIET, **{argument: value})  # type: ignore[arg-type]
    assert hook_count(model) == 0
    if not isinstance(value, nn.Module):
        assert f"{argument}= must be the model's {argument} module" in str(info.value)


@pytest.mark.parametrize("variable", ["RANK", "LOCAL_RANK"])
@pytest.mark.parametrize("value", ["abc", "1e3", "-1", "65536", "9" * 5000, "1.0"])
def test_a_rank_variable_that_is_no_rank(monkeypatch: pytest.MonkeyPatch, variable: str,
                                         value: str) -> None:
    monkeypatch.setenv(variable, value)
    model = tiny_gpt()
    with pytest.raises(guard.AttachError, match=f"environment variable {variable}="):
        guard.attach(model, policy=QUIET)
    assert hook_count(model) == 0


def test_rank_variables_torchrun_writes_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", " 3\n")  # as read from a file
    monkeypatch.setenv("LOCAL_RANK", "1")
    with guard.attach(tiny_gpt(), policy=QUIET) as g:
        assert g.rank == 3
