from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import guard
from guard.vocab.sizes import audit_sizes, pad_vocab_size


@given(n=st.integers(1, 10**7), m=st.integers(1, 4096))
def test_pad_is_the_smallest_multiple_not_below_n(n: int, m: int) -> None:
    p = pad_vocab_size(n, m)
    assert p % m == 0
    assert n <= p < n + m


def test_seed_and_gpt2_numbers() -> None:
    assert pad_vocab_size(50000) == 50048
    assert pad_vocab_size(50257) == 50304
    assert pad_vocab_size(50304) == 50304
    assert pad_vocab_size(50257, 64 * 8) == 50688


@pytest.mark.parametrize("bad", [0, -1, 1.5, "64", True])
def test_pad_rejects_bad_input(bad: object) -> None:
    with pytest.raises(ValueError, match="positive int"):
        pad_vocab_size(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple"):
        pad_vocab_size(64, bad)  # type: ignore[arg-type]


def test_audit_of_unaligned_gpt2_vocab() -> None:
    a = audit_sizes(real=50257, rows=50257, embedding_rows=50257, tied=True)
    assert (a.real, a.rows, a.aligned) == (50257, 50257, 50304)
    assert not a.ok and a.alignment_problems and not a.vocab_problems
    assert a.aligned_for_tp == {1: False, 2: False, 4: False, 8: False}
    text = str(a)
    assert "NOT OK" in text and "50304" in text and "pad_to_multiple_of=64" in text


def test_audit_of_padded_vocab_reports_tp_degrees() -> None:
    a = audit_sizes(real=50257, rows=50304, embedding_rows=50304, tied=False)
    assert a.ok and a.padding_columns == 47
    assert a.aligned_for_tp == {1: True, 2: True, 4: False, 8: False}  # 50304 = 128 * 393
    assert "untied" in str(a) and "[50257, 50304)" in str(a)
    tp8 = audit_sizes(real=50257, rows=50304, embedding_rows=50304, tied=True, tensor_parallel=8)
    assert not tp8.ok and tp8.aligned == 50688


def test_audit_vocab_problems() -> None:
    a = audit_sizes(real=200, rows=128, embedding_rows=192, tied=False)
    assert len(a.vocab_problems) == 3
    assert any("embedding rows 192 != head rows 128" in p for p in a.vocab_problems)
    assert a.to_dict()["ok"] is False


def test_audit_of_models(gpt: object) -> None:
    from tests.conftest import tiny_gpt

    a = guard.audit(tiny_gpt(rows=100), vocab_size=100)
    assert not a.ok and a.aligned == 128 and a.tied
    b = guard.audit(tiny_gpt(rows=128, tie=False), vocab_size=100, tensor_parallel=2)
    assert b.ok and not b.tied and b.aligned_for_tp[2] and not b.aligned_for_tp[4]
