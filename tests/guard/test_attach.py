from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import guard
from guard import GuardViolation
from guard.sinks import MemorySink
from tests.conftest import batch, hook_count, no_host_reads, policy, tiny_gpt
from tests.guard.vocab.test_discover import hf_gpt2

STATS_KEYS = {"step", "loss", "padding_mass", "padding_mass_max", "nonfinite", "out_of_range",
              "untrained_rows", "untrained_tokens", "violations", "skipped_steps",
              "grad_norm", "grad_norm_top", "grad_norm_top_share", "scaler_skipped_steps",
              "logsumexp",
              "logsumexp_max"}
ALL_WARN = policy(alignment={"action": "warn"}, vocab={"action": "warn"},
                  padding_mass={"action": "warn"}, nonfinite={"action": "warn"},
                  token_range={"action": "warn"}, padding_rows={"action": "warn"})


def train(model: nn.Module, steps: int, *, g: guard.Guard | None = None,
          opt: torch.optim.Optimizer | None = None, x: torch.Tensor | None = None,
          y: torch.Tensor | None = None) -> list[torch.Tensor]:
    """AdamW steps on fixed data; returns the losses (detached)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(steps):
        xb, yb = (x, y) if x is not None and y is not None else batch(seed=i)
        _, loss = model(xb, yb)
        loss.backward()
        if g is not None:  # a guard attached without the optimizer: g.step marks the step
            g.step(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


# -- attach-time checks ----------------------------------------------------------------------


def test_unaligned_vocab_fails_at_attach_with_the_fix() -> None:
    m = tiny_gpt(rows=100)
    with pytest.raises(GuardViolation) as e:
        guard.attach(m, policy=policy(), vocab_size=100)
    v = e.value
    assert (v.check, v.step, v.rank, v.action, v.value, v.threshold) == \
        ("alignment", 0, 0, "fail", 100.0, 64.0)
    assert "head rows 100 are not a multiple of 64" in str(v) and "128 rows" in str(v)
    assert hook_count(m) == 0  # nothing installed
    with guard.attach(m, policy=policy(alignment={"action": "warn"}), vocab_size=100) as g:
        assert g.stats["violations"] == {"alignment": {"warn": 1}}
    with guard.attach(m, policy=policy(alignment={"action": "off"}), vocab_size=100) as g:
        assert g.stats["violations"] == {}


def test_tensor_parallel_alignment() -> None:
    m = tiny_gpt(rows=128)
    with pytest.raises(GuardViolation, match="multiple of 256"):
        guard.attach(m, policy={**policy(), "vocab": {"tensor_parallel": 4}}, vocab_size=100)


def test_tokenizer_larger_than_rows_is_a_vocab_violation() -> None:
    m = tiny_gpt(rows=128)
    with pytest.raises(GuardViolation, match=r"real vocab 130 > head rows 128") as e:
        guard.attach(m, policy=policy(), vocab_size=130)
    assert e.value.check == "vocab"


# -- per-step checks and actions -------------------------------------------------------------


def test_padding_mass_warn_measures_and_counts() -> None:
    m = tiny_gpt(garbage=3.0)
    with guard.attach(m, policy=policy(padding_mass={"action": "warn"}), vocab_size=100) as g:
        train(m, 3, g=g)
        s = g.stats
    assert set(s) == STATS_KEYS
    assert s["step"] == 3 and s["violations"] == {"padding_mass": {"warn": 3}}
    assert 0.5 < s["padding_mass"] <= s["padding_mass_max"] <= 1
    assert isinstance(s["loss"], float)


def test_healthy_padding_rows_are_a_figure_not_a_violation() -> None:
    """Padding rows initialised like the real ones take about P / (N + P) of the probability
    (28 / 128 here): measured and reported, never a violation, under any action."""
    for action in ("warn", "fail", "mask"):
        m = tiny_gpt()
        with guard.attach(m, policy=policy(padding_mass={"action": action}),
                          vocab_size=100) as g:
            train(m, 3, g=g)
        s = g.stats
        assert s["violations"] == {} and s["step"] == 3, action
        assert 0.15 < s["padding_mass"] < 0.3, action


def test_padding_mass_matches_the_pure_function_when_exact() -> None:
    m = tiny_gpt(garbage=0.3)
    x, y = batch()
    with torch.no_grad():
        logits, _ = m(x, y)
    expected = guard.padding_mass(logits, 100)
    pol = policy(padding_mass={"action": "warn", "exact": True})
    with guard.attach(m, policy=pol, vocab_size=100) as g:
        m(x, y)  # one training-mode forward is one step, read at detach
    s = g.stats
    assert s["step"] == 1
    assert s["padding_mass"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert s["padding_mass_max"] == pytest.approx(float(expected.max()), rel=1e-5)


def test_padding_mass_fail_names_columns_and_fix() -> None:
    m = tiny_gpt(garbage=0.5)
    g = guard.attach(m, policy=policy(padding_mass={"action": "fail"}), vocab_size=100)
    m(*batch())
    with pytest.raises(GuardViolation) as e:
        m(*batch())  # without optimizer= / g.step(), step 1 ends when step 2 starts
    g.detach()
    v = e.value
    assert v.check == "padding_mass" and v.step == 1 and v.value > 280 / 380
    assert v.threshold == pytest.approx(280 / 380)  # 10x an average real id's share
    msg = str(v)
    assert "rank 0 at step 1" in msg and "28 padding columns [100, 128)" in msg
    assert "expected <= 10x" in msg and "checks.padding_mass.action: mask" in msg


def test_mask_trains_like_a_model_over_the_real_vocab_only() -> None:
    """Masked CE over 128 rows == CE over the 100 real columns; padding rows get zero grad."""
    m = tiny_gpt(tie=False, garbage=3.0)
    ref = copy.deepcopy(m)
    x, y = batch()
    with guard.attach(m, policy=policy(), vocab_size=100) as g:
        logits, loss = m(x, y)
        loss.backward()
    assert g.stats["violations"] == {}  # the mask did its job: the loss saw no padding
    assert g.stats["padding_mass"] > 0.9  # measured before the mask: the garbage's
    ref_logits, _ = ref(x)
    ref_loss = F.cross_entropy(ref_logits[..., :100].reshape(-1, 100), y.view(-1))
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    assert torch.isinf(logits[..., 100:]).all()
    assert m.lm_head.weight.grad is not None
    assert torch.count_nonzero(m.lm_head.weight.grad[100:]) == 0
    assert torch.count_nonzero(m.lm_head.weight.grad[:100]) > 0


def test_mask_applies_in_eval_so_generation_never_picks_a_ghost() -> None:
    m = tiny_gpt(garbage=5.0).eval()
    with guard.attach(m, policy=policy(), vocab_size=100):
        logits, _ = m(batch()[0])
    assert int(logits.argmax(-1).max()) < 100


def test_warn_leaves_adamw_steps_bitwise_identical() -> None:
    base = tiny_gpt(garbage=3.0)
    guarded = copy.deepcopy(base)
    ref_losses = train(base, 5)
    opt = torch.optim.AdamW(guarded.parameters(), lr=1e-2)
    with guard.attach(guarded, policy=ALL_WARN, vocab_size=100, optimizer=opt) as g:
        losses = train(guarded, 5, opt=opt)
        assert g.stats["step"] == 5 and g.stats["violations"]["padding_mass"] == {"warn": 5}
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    for p, q in zip(base.parameters(), guarded.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fail_with_optimizer_raises_before_the_weights_change() -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt)
    train(m, 2, opt=opt)
    with torch.no_grad():
        m.ln_f.weight[3] = float("nan")  # poisons the lm_head input at every position
    before = copy.deepcopy(m.state_dict())
    state_before = copy.deepcopy(opt.state_dict())
    _, loss = m(*batch())
    loss.backward()
    with pytest.raises(GuardViolation) as e:
        opt.step()
    assert e.value.check == "nonfinite" and e.value.step == 3
    assert "in the lm_head input" in str(e.value) and "in the loss" in str(e.value)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]) or (v.isnan() == before[k].isnan()).all()
        assert torch.allclose(v, before[k], equal_nan=True)
    assert opt.state_dict()["state"][0]["step"] == state_before["state"][0]["step"]
    g.detach()


def test_nonfinite_in_logits_only_is_detected() -> None:
    m = tiny_gpt(tie=False)
    with torch.no_grad():
        m.lm_head.weight[7, 0] = float("inf")  # one real column goes non-finite
    pol = policy(nonfinite={"action": "warn"}, padding_mass={"action": "off"})
    with guard.attach(m, policy=pol, vocab_size=100) as g:
        m(*batch())
    nf = g.stats["nonfinite"]
    assert nf["hidden"] == 0 and nf["logits"] >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_nonfinite_logit_outside_the_sample(dtype: torch.dtype) -> None:
    """float16 logits can overflow at one (position, column): a full pass detects it. In float32
    a lone non-finite logit needs a non-finite input or weight, which other checks see; the
    loss check still catches it."""
    m = tiny_gpt(tie=False)
    x, y = batch(b=8, t=32)  # 256 positions, sample of 4
    pol = policy(nonfinite={"action": "warn"}, padding_mass={"action": "off", "sample_tokens": 4})
    with guard.attach(m, policy=pol, vocab_size=100) as g:
        def poison(mod: nn.Module, a: tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
            out = out.to(dtype)
            out[0, 5, 3] = float("inf")  # a position the strided sample skips
            return out
        h = m.lm_head.register_forward_hook(poison, prepend=True)
        m(x, y)
        h.remove()
    nf = g.stats["nonfinite"]
    assert nf["loss"] == 1 and nf["hidden"] == 0
    assert nf["logits"] == (1 if dtype == torch.float16 else 0)


def test_ghost_input_ids_and_labels() -> None:
    m = tiny_gpt()
    x, y = batch()
    x[0, 0] = 110  # a ghost id: a row exists, the tokenizer never produces it
    y[1, 2] = 127
    y[2, :4] = -100  # sequence padding: exempt
    pol = policy(token_range={"action": "warn"})
    with guard.attach(m, policy=pol, vocab_size=100) as g:
        m(x, y)
    assert g.stats["out_of_range"] == {"input": 1, "label": 1}
    with guard.attach(m, policy=policy(), vocab_size=100) as g:
        _, loss = m(x, y)
        with pytest.raises(GuardViolation, match=r"1 input id and 1 label id outside \[0, 100\)"
                           r".*also at this step: nonfinite"):
            g.step(loss)  # the ghost label's logit is masked to -inf: the loss is inf too
    with guard.attach(m, policy=policy(token_range={"ignore_index": None, "action": "warn"}),
                      vocab_size=100) as g:
        m(x, y)
    assert g.stats["out_of_range"] == {"input": 1, "label": 5}


def test_hf_model_labels_kwarg_and_ghost_labels() -> None:
    m = hf_gpt2()
    m.train()
    x, y = batch()
    y[0, 0] = 120
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    pol = policy(token_range={"action": "warn"})
    with guard.attach(m, policy=pol, vocab_size=100, optimizer=opt) as g:
        out = m(input_ids=x, labels=y)
        out.loss.backward()
        opt.step()
        s = g.stats
    assert s["out_of_range"] == {"input": 0, "label": 1} and s["step"] == 1
    assert s["loss"] == pytest.approx(float(out.loss.detach()))


def test_hf_model_each_check() -> None:
    m = hf_gpt2()
    m.train()
    w = m.get_output_embeddings().weight
    with torch.no_grad():
        w[100:] = torch.randn(w.shape[0] - 100, w.shape[1],
                              generator=torch.Generator().manual_seed(0)) * 3.0
    with guard.attach(m, policy=ALL_WARN, vocab_size=100) as g:
        m(input_ids=batch()[0], labels=batch()[1])
    assert g.stats["padding_mass"] > 0.5 and g.stats["violations"]["padding_mass"] == {"warn": 1}
    with guard.attach(m, policy=policy(), vocab_size=100) as g:
        logits = m(input_ids=batch()[0]).logits
    # no labels, no loss in that forward: coverage says so; padding_mass says nothing
    assert torch.isinf(logits[..., 100:]).all() and "padding_mass" not in g.stats["violations"]


# -- step boundaries, cadence, detach --------------------------------------------------------


def test_each_training_forward_is_a_step_without_optimizer() -> None:
    m = tiny_gpt()
    with guard.attach(m, policy=policy(), vocab_size=100) as g:
        m(*batch())
        m(*batch())
        assert g.stats["step"] == 1  # the second forward closed the first step
        m.eval()
        m(*batch())  # eval forwards are not steps
    assert g.stats["step"] == 2


def test_g_step_marks_boundaries_and_feeds_the_loss() -> None:
    m = tiny_gpt()
    with guard.attach(m, policy=policy(nonfinite={"action": "warn"}), vocab_size=100) as g:
        m(*batch())
        g.step(torch.tensor(float("nan")))
        assert g.stats["step"] == 1
        assert g.stats["nonfinite"]["loss"] == 1


def test_read_every_reads_the_flags_every_n_steps() -> None:
    m = tiny_gpt(garbage=0.5)
    sink = MemorySink()
    pol = {**policy(padding_mass={"action": "warn"}), "cadence": {"read_every": 3}}
    with guard.attach(m, policy=pol, vocab_size=100) as g:
        g.add_sink(sink)
        for _ in range(8):
            m(*batch())
        assert g.stats["step"] == 6
        assert g.stats["violations"] == {"padding_mass": {"warn": 2}}
    assert [r.step for r in sink.reports] == [3, 6, 8]
    assert sink.reports[-1].final and (sink.reports[0].padding_mass or 0) > 0
    assert all(r.vocab.model_dump() == {"real": 100, "rows": 128, "aligned": 128}
               for r in sink.reports)


def test_detach_removes_every_hook_and_is_idempotent() -> None:
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters())
    before = hook_count(m)
    g = guard.attach(m, policy=policy(), vocab_size=100, optimizer=opt)
    assert hook_count(m) > before and len(opt._optimizer_step_pre_hooks) == 1
    g.detach()
    g.detach()
    assert hook_count(m) == before and len(opt._optimizer_step_pre_hooks) == 0
    with pytest.raises(guard.AttachError, match="detached"):
        g.step()


def test_context_manager_detaches_after_a_violation() -> None:
    m = tiny_gpt(garbage=0.5)
    pol = policy(padding_mass={"action": "fail"})
    with pytest.raises(GuardViolation), guard.attach(m, policy=pol, vocab_size=100) as g:
        g.step(m(*batch())[1])
    assert hook_count(m) == 0


def test_violation_pickles_with_its_data() -> None:
    import pickle

    v = GuardViolation("m", check="nonfinite", step=3, rank=1, value=2.0, threshold=0.0)
    w = pickle.loads(pickle.dumps(v))
    assert (w.check, w.step, w.rank, w.value, str(w)) == ("nonfinite", 3, 1, 2.0, "m")


# -- the hot path ----------------------------------------------------------------------------


def test_hooks_never_read_a_tensor_to_the_host() -> None:
    """Every hook the guard registers runs inside no_host_reads: the probe's, the clock's
    forward boundary, the kept inputs for a re-run, and the localiser's flag hooks on every
    module (armed by a NaN that a read could not localise at once)."""
    m = tiny_gpt(garbage=0.5)
    x, y = batch()
    x[0, 0] = 110
    pol = {**ALL_WARN, "checks": {**ALL_WARN["checks"], "padding_mass": {"action": "mask"}}}
    with guard.attach(m, policy=pol, vocab_size=100) as g:
        _, loss = m(x, y)
        before = hook_count(m)
        g.step(loss * float("nan"))  # nonfinite warns and arms the localiser for next time
        assert hook_count(m) > before + len(list(m.modules())) - 1
        with no_host_reads():
            for _ in range(2):
                _, loss = m(x, y)
                loss.backward()  # the model's loss: recorded by its hook
        g.step()
        assert g.stats["out_of_range"]["input"] == 3 and g.stats["padding_mass"] > 0
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with guard.attach(m, policy=pol, vocab_size=100, optimizer=opt) as g:
        with no_host_reads():  # the optimizer's boundary: forwards and backwards run hooks only
            _, loss = m(x, y)
            loss.backward()
        opt.step()
        assert g.stats["step"] == 1
    # and the guard really would have been caught:
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        torch.ones(1).item()


# -- regressions found in review -------------------------------------------------------------


def test_no_grad_training_forwards_are_not_steps() -> None:
    """Ranks must count steps alike: a sampling forward left in train mode is not a step."""
    m = tiny_gpt()
    with guard.attach(m, policy=policy(), vocab_size=100) as g:
        m(*batch())
        with torch.no_grad():
            m(*batch())  # e.g. generating samples on rank 0 only
        m(*batch())
        assert g.stats["step"] == 1
    assert g.stats["step"] == 2


def test_a_failed_attach_leaves_nothing_behind() -> None:
    import threading

    m = tiny_gpt(rows=100)
    before = hook_count(m)
    pol = {**policy(), "export": {"serve": "127.0.0.1:0"}}
    with pytest.raises(GuardViolation):
        guard.attach(m, policy=pol, vocab_size=100)  # alignment: fail, after the server started
    assert hook_count(m) == before
    assert not [t for t in threading.enumerate() if t.name.startswith("guard-metrics")]

    class Wrapper:  # e.g. DeepSpeed's: the torch optimizer under .optimizer
        def __init__(self, opt: object) -> None:
            self.optimizer = opt

        def step(self) -> None:
            pass

    ok = tiny_gpt()
    unreachable = Wrapper(Wrapper(None))  # nothing hookable inside
    with pytest.raises(guard.AttachError, match=r"optimizer=: cannot reach a torch.optim."
                       r"Optimizer through Wrapper > Wrapper .*pass the torch optimizer it "
                       r"wraps"):
        guard.attach(ok, policy=policy(), vocab_size=100, optimizer=unreachable)
    assert hook_count(ok) == 0
    inner = torch.optim.SGD(ok.parameters(), lr=0.1)
    with guard.attach(ok, policy=policy(), vocab_size=100, optimizer=Wrapper(inner)):
        assert len(inner._optimizer_step_pre_hooks) == 1  # the boundary: the torch optimizer


def test_the_registry_does_not_keep_models_alive() -> None:
    import gc
    import weakref

    m = tiny_gpt()
    g = guard.attach(m, policy=policy(), vocab_size=100)
    ref = weakref.ref(m)
    del m, g
    gc.collect()
    assert ref() is None


def test_the_models_loss_fed_to_g_step_after_the_update_counts_once() -> None:
    m = tiny_gpt()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pol = policy(nonfinite={"action": "skip"})
    with guard.attach(m, policy=pol, vocab_size=100, optimizer=opt) as g:
        for i in range(3):
            out = m(*batch(seed=i))[1]
            loss = out * float("nan") if i == 0 else out  # NaN at step 1 only
            loss.backward()
            g.step(loss)  # before the update: replaces the model's output loss
            opt.step()
            g.step(loss)  # after it too, as some loops do: the same tensor, counted once
            opt.zero_grad()
    assert g.stats["skipped_steps"] == 1 and g.stats["nonfinite"]["loss"] == 1


# -- integration keywords --------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"steps": "optimizer"}, r"steps='optimizer': expected one of auto, manual"),
    ({"loss_shares": "median"}, r"loss_shares='median': expected one of last, sum, mean"),
    ({"loss_scale": 0.0}, r"loss_scale=0.0: expected a finite number > 0"),
    ({"loss_scale": float("inf")}, r"loss_scale=inf"),
    ({"steps": "manual", "optimizer": "opt"}, r"steps='manual' marks steps with g.step\(\) only"),
])
def test_bad_integration_keywords_are_refused_by_name(kwargs: dict[str, object],
                                                     error: str) -> None:
    m = tiny_gpt()
    if kwargs.get("optimizer") == "opt":
        kwargs = {**kwargs, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1)}
    with pytest.raises(guard.AttachError, match=error):
        guard.attach(m, policy=policy(), **kwargs)  # type: ignore[arg-type]
    assert hook_count(m) == 0


def test_manual_steps_count_only_g_step_across_accumulated_forwards() -> None:
    m = tiny_gpt()
    with guard.attach(m, policy=policy(), vocab_size=100, steps="manual") as g:
        for _ in range(2):
            for i in range(3):  # three micro-batches per step: no boundary in between
                m(*batch(seed=i))[1].backward()
            g.step()
        assert g.stats["step"] == 2


def test_loss_shares_sum_reports_the_sum_of_the_micro_batch_losses() -> None:
    m = tiny_gpt()
    with guard.attach(m, policy=policy(), vocab_size=100, steps="manual",
                      loss_shares="sum", loss_scale=2.0) as g:
        losses = [float(m(*batch(seed=i))[1].detach()) for i in range(3)]
        g.step()
        assert g.stats["loss"] == pytest.approx(2.0 * sum(losses), rel=1e-6)
    with guard.attach(m, policy=policy(), vocab_size=100, steps="manual") as g:
        losses = [float(m(*batch(seed=i))[1].detach()) for i in range(3)]
        g.step()
        assert g.stats["loss"] == pytest.approx(losses[-1], rel=1e-6)  # last, by default


def test_a_fallback_loss_counts_only_when_the_model_gave_none() -> None:
    m = tiny_gpt()
    with guard.attach(m, policy=policy(), vocab_size=100, steps="manual") as g:
        _, loss = m(*batch())
        g.step(torch.tensor(123.0), fallback=True)  # the model's own loss wins
        assert g.stats["loss"] == pytest.approx(float(loss.detach()))
        m(batch()[0])  # no targets: no loss from the model
        g.step(torch.tensor(123.0), fallback=True)
        assert g.stats["loss"] == 123.0


def test_a_run_id_from_torchrun_with_a_trailing_newline_trains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A TORCHELASTIC_RUN_ID read from a file: pydantic's pattern refuses the newline that
    # re.match's `$` let through, and the first step boundary used to raise.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7\n")
    m, sink = tiny_gpt(), MemorySink()
    with guard.attach(m, policy=policy(), vocab_size=100) as g:
        g.add_sink(sink)
        for _ in range(2):
            m(*batch())
    assert g.run_id == "job-7" and [r.step for r in sink.reports] == [1, 2]


def test_a_run_id_from_torchrun_that_is_no_run_id_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job 7")
    with caplog.at_level(logging.WARNING, logger="guard"), guard.attach(
            tiny_gpt(), policy=policy(), vocab_size=100) as g:
        pass
    assert g.run_id != "job 7"
    assert any("TORCHELASTIC_RUN_ID 'job 7' is no run_id" in r.getMessage()
               for r in caplog.records)
