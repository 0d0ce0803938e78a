from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from guard import padding_mass
from guard.device.id_ops import out_of_range_parts
from guard.device.ops import mask_padding_, nonfinite_count, sample_positions


def seed_logits(draws: int) -> torch.Tensor:
    """The seed's reproduction: randn logits over 50 real classes padded to 64, the padding
    columns holding the garbage value 8.0; one row per draw of the seed's script."""
    logits = torch.randn(draws, 64, generator=torch.Generator().manual_seed(0))
    logits[:, 50:] = 8.0
    return logits


def test_seed_reproduction_unmasked_and_masked() -> None:
    logits = seed_logits(500)
    mass = padding_mass(logits, 50)
    assert mass.shape == (500,)
    real_keep = torch.softmax(logits, -1)[:, :50].sum(-1)
    assert torch.allclose(1 - mass, real_keep, atol=1e-6)
    # The seed prints 0.007 for the real classes (mass 0.993) from one draw of its script.
    # Its own code gives less: 50 randn logits keep 50 e^0.5 / (50 e^0.5 + 14 e^8) ~ 0.002
    # (0.001-0.004 over 500 draws here). Both say the same thing: over 99% of the probability
    # is on the 14 ghost classes. Our mass equals softmax exactly (above).
    assert float(real_keep.max()) < 0.01
    assert float(mass.min()) > 0.99
    masked = mask_padding_(logits.clone(), 50)
    assert torch.softmax(masked, -1)[:, :50].sum(-1).allclose(torch.ones(500))
    assert float(padding_mass(masked, 50).max()) == 0.0


def test_no_padding_columns_is_zero() -> None:
    x = torch.randn(2, 3, 64)
    assert torch.equal(padding_mass(x, 64), torch.zeros(2, 3))


def test_half_precision_is_computed_in_float32() -> None:
    x = torch.randn(8, 128)
    x[:, 100:] = -14.0  # mass ~ 28 * e^-14 / ... ~ 1e-6: below bf16's resolution near 1
    ref = padding_mass(x.double(), 100)
    for dt in (torch.bfloat16, torch.float16):
        got = padding_mass(x.to(dt), 100)
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), ref.double(), rtol=0.1)


def test_huge_garbage_is_stable() -> None:
    x = torch.zeros(2, 64)
    x[:, 50:] = 1e30
    assert torch.equal(padding_mass(x, 50), torch.ones(2))
    x[:, 50:] = float("-inf")
    assert torch.equal(padding_mass(x, 50), torch.zeros(2))


def test_bad_vocab_real() -> None:
    with pytest.raises(ValueError, match=r"\[1, 64\]"):
        padding_mass(torch.zeros(2, 64), 65)
    with pytest.raises(TypeError):
        padding_mass(torch.zeros(2, 64), 50.0)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(real=st.integers(1, 40), extra=st.integers(0, 24), n=st.integers(1, 6),
       seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 30.0))
def test_masked_ce_equals_ce_over_real_columns(real: int, extra: int, n: int, seed: int,
                                               scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, real + extra, generator=g, dtype=torch.float64) * scale
    target = torch.randint(0, real, (n,), generator=g)
    masked = mask_padding_(logits.clone(), real)
    reference = F.cross_entropy(logits[:, :real], target)
    assert torch.allclose(F.cross_entropy(masked, target), reference)


@settings(max_examples=30, deadline=None)
@given(real=st.integers(2, 30), extra=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_padding_columns_get_exactly_zero_gradient_under_mask(real: int, extra: int,
                                                              seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(real + extra, 8, generator=g, requires_grad=True)
    h = torch.randn(5, 8, generator=g)
    target = torch.randint(0, real, (5,), generator=g)
    logits = h @ w.T
    mask_padding_(logits, real)
    F.cross_entropy(logits, target).backward()
    assert w.grad is not None
    assert torch.count_nonzero(w.grad[real:]) == 0
    assert torch.count_nonzero(w.grad[:real]) > 0


def test_sample_positions_is_a_strided_view() -> None:
    flat = torch.arange(1000.0).view(100, 10)
    s = sample_positions(flat, 8, offset=3)
    assert s.shape == (8, 10)
    assert s.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # no copy
    assert s[0, 0] == 30.0 and s[1, 0] == 150.0  # stride 12, offset 3
    assert sample_positions(flat, 500, 0) is flat


def test_nonfinite_and_out_of_range_counts() -> None:
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])
    assert int(nonfinite_count(t)) == 3
    assert int(nonfinite_count(torch.tensor([1, 2]))) == 0
    ids = torch.tensor([0, 5, 99, 100, 127, 128, -1, -100])
    assert int(out_of_range_parts(ids, 100, -100)[0]) == 4  # 100, 127, 128, -1
    assert int(out_of_range_parts(ids, 100, None)[0]) == 5


def _out_of_range_reference(ids: list[int], real: int,
                            ignore: int | None) -> tuple[int, int, int]:
    """out_of_range_parts in plain Python: (count, negative, id * POSITIONS + position of the
    highest id >= real, the last position where it repeats; 0 if none)."""
    from guard.checks.token_range import POSITIONS

    bad = [i for i in ids if (i < 0 or i >= real) and i != ignore]
    high = [(i, p) for p, i in enumerate(ids) if i >= real]
    return len(bad), sum(i < 0 for i in bad), max((i * POSITIONS + p for i, p in high),
                                                   default=0)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(-120, 140), max_size=40),
       ignore=st.sampled_from([None, -100, -1, 120]),
       dtype=st.sampled_from([torch.int64, torch.int32]), held=st.integers(0, 8))
def test_out_of_range_parts_match_a_plain_reference(ids: list[int], ignore: int | None,
                                                    dtype: torch.dtype, held: int) -> None:
    from guard.device.id_ops import flat_positions

    # With positions made here, or kept from a larger forward (`held` more) and sliced.
    for positions in (None, flat_positions(len(ids) + held, torch.device("cpu"))):
        parts = out_of_range_parts(torch.tensor(ids, dtype=dtype).view(-1, 1), 100, ignore,
                                   positions)
        assert tuple(int(x) for x in parts) == _out_of_range_reference(ids, 100, ignore)
        assert all(x.dim() == 0 for x in parts)


@settings(max_examples=25, deadline=None)
@given(real=st.integers(2, 30), extra=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_mask_padding_gradient_equals_real_only_gradient(real: int, extra: int,
                                                          seed: int) -> None:
    from guard.device.ops import mask_padding

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(real + extra, 8, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    target = torch.randint(0, real, (6,), generator=g)
    logits = mask_padding(h @ w.T, real)  # (2, 3, rows), autograd path
    F.cross_entropy(logits.view(-1, real + extra), target).backward()
    w_ref = w.detach()[:real].clone().requires_grad_(True)
    F.cross_entropy((h @ w_ref.T).view(-1, real), target).backward()
    assert w.grad is not None and w_ref.grad is not None
    assert torch.allclose(w.grad[:real], w_ref.grad)
    assert torch.count_nonzero(w.grad[real:]) == 0


def test_mask_padding_backward_from_an_expanded_gradient() -> None:
    from guard.device.ops import mask_padding

    w = torch.randn(10, 4, requires_grad=True)
    logits = mask_padding(torch.randn(3, 4) @ w.T, 7)
    logits[:, :7].sum().backward()  # the gradient reaching the mask is an expand of ones
    assert w.grad is not None and torch.count_nonzero(w.grad[7:]) == 0


def testlogsumexp_matches_torch_on_edge_rows() -> None:
    from guard.device.ops import logsumexp

    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, 1.0, 2.0], [1e30, -1e30, 0.0], [-inf, -inf, -inf],
                      [inf, 1.0, 0.0], [nan, 1.0, 0.0], [-inf, 3.0, -inf]])
    assert torch.allclose(logsumexp(x), torch.logsumexp(x, dim=-1), equal_nan=True)
    y = torch.randn(7, 300) * 50
    assert torch.allclose(logsumexp(y), torch.logsumexp(y, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_chunks_through_a_scratch_buffer_give_the_same_figures(dtype: torch.dtype) -> None:
    from guard.device.ops import padding_mass_parts, reduction_dtype

    inf, nan = float("inf"), float("nan")
    x = (torch.randn(37, 300, generator=torch.Generator().manual_seed(0)) * 20).to(dtype)
    x[3, 7], x[4, :] = nan, -inf  # a NaN real logit; a row the mask would leave
    x[5, 260], x[6, 10] = inf, -inf
    scratch = torch.full((7 * 250,), 123.0, dtype=reduction_dtype(x))  # stale values
    mass, lse = padding_mass_parts(x, 250, per_chunk=7, scratch=scratch)
    ref_mass, ref_lse = padding_mass_parts(x, 250)  # at once, fresh temporaries
    assert torch.equal(mass.nan_to_num(7.0), ref_mass.nan_to_num(7.0))
    assert torch.equal(lse.nan_to_num(7.0), ref_lse.nan_to_num(7.0))
    assert lse.dtype == reduction_dtype(x)
    exact = torch.logsumexp(x[:, :250].double(), dim=-1)  # half input: computed in float32
    assert torch.allclose(lse.double(), exact, rtol=1e-6, equal_nan=True)


def test_a_32nd_of_a_forwards_positions_is_sampled_and_the_chunks_are_sized() -> None:
    from guard.device.ops import CHUNK_SHARE, chunk_positions, sample_size

    assert [sample_size(n, 256) for n in (1, 31, 32, 1024, 8192, 65536)] == [1, 1, 1, 32,
                                                                             256, 256]
    assert sample_size(1024, 8) == 8  # sample_tokens, where fewer
    cpu = torch.device("cpu")
    for rows, n in ((151936, 1024), (50304, 8192), (128, 64)):
        # An exact-mode chunk holds as many positions as a sample: a few large ops, not dozens.
        assert chunk_positions(rows, cpu, n) >= sample_size(n, 256)
        # Exact mode: chunks of a sixteenth of the forward (or 8 MB, where that is more).
        assert chunk_positions(rows, cpu, n) == max(n // CHUNK_SHARE, (1 << 21) // rows, 1)
        # A sample (one thread) goes in chunks of at most 4 MB of float32, for the cache.
        assert chunk_positions(rows, cpu, n, sample=True) == max(1, (1 << 20) // rows)


def test_the_guards_ops_run_in_one_thread_on_the_cpu_and_the_count_comes_back() -> None:
    from guard.device.ops import one_thread

    cpu, before = torch.device("cpu"), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread(cpu):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ZeroDivisionError), one_thread(cpu):
            1 / 0  # noqa: B018 - an error inside a hook
        assert torch.get_num_threads() == 2
        with one_thread(torch.device("meta")):  # not the CPU: left alone
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_guarded_step_leaves_the_thread_count_as_it_found_it() -> None:
    import guard
    from tests.conftest import batch, policy, tiny_gpt

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = tiny_gpt(garbage=0.3)
        seen: list[int] = []
        with guard.attach(m, vocab_size=100, policy=policy(padding_mass={"action": "mask"})):
            # After the guard's own hook on the head: the model's next op runs as configured.
            m.lm_head.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
            _, loss = m(*batch())
            loss.backward()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_not_finite_is_torch_isfinite_negated(dtype: torch.dtype) -> None:
    from guard.device.ops import not_finite

    info = torch.finfo(dtype)
    inf, nan = float("inf"), float("nan")
    t = torch.tensor([0.0, -0.0, 1.0, -1.0, nan, inf, -inf, info.max, -info.max, info.tiny,
                      info.tiny / 4, info.eps], dtype=dtype)  # tiny / 4: a subnormal
    found = not_finite(t)
    assert found.dtype == torch.bool
    assert found.tolist() == torch.isfinite(t).logical_not().tolist()
    assert found.tolist() == [False] * 4 + [True] * 3 + [False] * 5
