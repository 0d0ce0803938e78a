"""log Z of the real-vocab logits, a figure from the padding mass's own logsumexp: its mean and
largest over the measured positions, in g.stats, the loggers and the report."""

from __future__ import annotations

import torch

import guard
from guard.sinks import MemorySink
from tests.conftest import batch, policy, tiny_gpt


def test_log_z_is_the_mean_and_max_of_the_real_columns_logsumexp() -> None:
    m = tiny_gpt(garbage=0.5)
    sink = MemorySink()
    exact = policy(padding_mass={"action": "warn", "exact": True})
    with guard.attach(m, policy=exact, vocab_size=100) as g:
        g.add_sink(sink)
        logits, loss = m(*batch())
        g.step(loss)
    z = torch.logsumexp(logits.detach().double()[..., :100], dim=-1).flatten()  # (positions,)
    s = g.stats
    assert abs(s["logsumexp"] - float(z.mean())) < 1e-4
    assert abs(s["logsumexp_max"] - float(z.max())) < 1e-4
    report = sink.batch().reports[0]
    assert (report.logsumexp, report.logsumexp_max) == (s["logsumexp"], s["logsumexp_max"])
    assert g.figures()["guard/logsumexp_max"] == s["logsumexp_max"]


def test_a_negative_log_z_is_reported_as_it_is() -> None:
    # Logits pushed far below 0 (a z-loss can): log Z < 0, which a max over zeroed flags would
    # lose.
    m = tiny_gpt()
    with torch.no_grad():
        m.lm_head.weight.mul_(0.0)
    m.lm_head.register_forward_hook(lambda mod, a, out: out - 30.0)  # before the guard's
    with guard.attach(m, policy=policy(padding_mass={"action": "warn", "exact": True}),
                      vocab_size=100) as g:
        _, loss = m(*batch())
        g.step(loss)
    expected = float(torch.logsumexp(torch.full((100,), -30.0, dtype=torch.float64), dim=0))
    assert abs(g.stats["logsumexp"] - expected) < 1e-4
    assert abs(g.stats["logsumexp_max"] - expected) < 1e-4 and expected < 0


def test_without_padding_columns_there_is_no_log_z_figure() -> None:
    m = tiny_gpt(rows=100)
    with guard.attach(m, policy=policy(alignment={"action": "off"}), vocab_size=100) as g:
        _, loss = m(*batch())
        g.step(loss)
    assert g.stats["logsumexp"] is None and g.stats["logsumexp_max"] is None
