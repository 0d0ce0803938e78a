"""A short real training run, watched by a real Prometheus: every dashboard query and alert.

Three ranks of one run, each a tiny GPT (tests/conftest.py) with garbage in its padding rows
[100, 128), trained with AdamW under its own `guard.attach(..., vocab_size=100,
optimizer=opt)` (RANK set per attach), push through the library's real PushSink to a real
guard-server (EmbeddedServer, with a token) that Prometheus scrapes every 0.5 s with the alert
rules loaded. The faults come in turn, after Prometheus has seen every rank healthy:

  rank 0  the control: padding masked (action mask); no other fault. No alert fires for it.
  rank 1  training goes on through every fault: padding mass unmasked (warn) from step 1; a
          ghost label, id 110, at step 13 (token_range warn); id 97, one of four real rows
          zeroed before attach (a base model's untrained tokens), as input and label at step 14
          (untrained_rows repair: counted once, repaired there); a loss spike at step 15 (ln_f
          scaled x1000 for one step; loss_spike warn, default factor 10); a NaN at step 17 (one
          ln_f weight NaN for one step; nonfinite skip, so the weights stay finite); blind at
          step 19: the loop calls the model without targets, computes the loss itself and
          feeds g.step() none, so no labels and no loss reach the guard (coverage warn). It
          also pushes through a second sink holding a stale token, which guard-server rejects.
  rank 2  halted: padding masked; the same NaN at step 17 with nonfinite fail raises
          GuardViolation and the rank detaches. Its push queue holds one report and drains
          every 0.5 s, so it drops reports, as a slow guard-server would make it.

The queries go through Prometheus' HTTP API with the dashboard's variables substituted for
three selections: All / All, the faulty ranks (a multi-value selection), the clean rank.
GuardRankSilent cannot fire here (the server stamps report times itself and the test lasts
seconds, the rule wants 120 s of silence) and GuardServerDown neither (the target is up):
test_live_queries.py proves the first against a static exposition, and the promtool unit
tests (test_alert_rules.py) prove both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import guard
from guard.demo.model import GPT
from guard.sinks.push import PushSink
from guard_server import EmbeddedServer, Settings
from guard_server.testing import Prometheus, prometheus_binary, run_prometheus
from tests.conftest import batch, policy, tiny_gpt
from tests.dashboards.live import loaded_alerts, offered_variables
from tests.dashboards.queries import (
    ALERT_RULES,
    ALL,
    NEWER_GUARDS_ONLY,
    PanelQuery,
    alert_rules,
    dashboard_queries,
)

pytestmark = pytest.mark.prometheus

RUN = "live-train.1"  # the dot checks that the dashboard's regex matchers escape run ids
TOKEN = "live-training-token"
REAL, ROWS = 100, 128
GHOST = 110  # a label id in [real, rows): a ghost token the tokenizer cannot produce
UNTRAINED = range(96, 100)  # rank 1's real rows that were never trained (zero)
CLEAN_STEPS = 12  # before the faults: loss_spike needs its warmup (10) of finite losses
GHOST_STEP, UNTRAINED_STEP, SPIKE_STEP, NAN_STEP, BLIND_STEP, LAST_STEP = 13, 14, 15, 17, 19, 20

# Which ranks each alert expression must return, and the one extra label it must carry for
# them; absent: it returns nothing (for the clean rank 0 above all).
FIRING: dict[str, set[str]] = {
    "GuardNonFinite": {"1", "2"},
    "GuardPaddingMassHigh": {"1"},  # ranks 0 and 2 have the same mass; their masks keep it out
    "GuardHalted": {"2"},
    "GuardTokenOutOfRange": {"1"},
    "GuardLossSpike": {"1"},
    "GuardReportsDropped": {"2"},
    "GuardBlind": {"1"},
    "GuardUntrainedTokens": {"1"},
}
FIRING_LABELS: dict[str, tuple[str, set[str]]] = {
    "GuardNonFinite": ("tensor", {"logits", "hidden", "loss", "grad"}),
    "GuardHalted": ("check", {"nonfinite"}),
    "GuardTokenOutOfRange": ("kind", {"label"}),
    "GuardLossSpike": ("action", {"warn"}),
    "GuardUntrainedTokens": ("kind", {"input", "label"}),
}

# The dashboard's drop-downs: (run_id, rank, the ranks its series may carry).
SELECTIONS: dict[str, tuple[str, str | list[str], set[str]]] = {
    "all": (ALL, ALL, {"0", "1", "2"}),
    "faulty": (RUN, ["1", "2"], {"1", "2"}),
    "clean": (RUN, "0", {"0"}),
}
# Panels that rightly show no series for the clean rank: count() of nothing is nothing, and
# the stat's noValue shows it as 0.
EMPTY_WHEN_CLEAN = {"Halted ranks"}
PANEL_QUERIES = [
    pytest.param(name, query, id=f"{name}:{query.title}:{query.ref_id}")
    for name, (run_id, rank, _) in SELECTIONS.items()
    for query in dashboard_queries(run_id=run_id, rank=rank)
]


@dataclass
class Trainee:
    """One rank: a tiny GPT, its optimizer and the guard attached to both."""

    rank: int
    model: GPT
    opt: torch.optim.Optimizer
    g: guard.Guard
    halted: guard.GuardViolation | None = None
    faults: dict[int, str] = field(default_factory=dict)  # step -> ghost / spike / nan / blind
    untrained: bool = False  # rows UNTRAINED are zero: no batch uses them but at its fault

    def step(self, i: int) -> None:
        """Training step i (1-based), with this rank's fault at that step, if any."""
        if self.halted is not None:
            return
        fault = self.faults.get(i)
        x, y = batch(REAL, seed=i)
        if self.untrained:
            x, y = x % UNTRAINED.start, y % UNTRAINED.start
        if fault == "ghost":
            y[0, 0] = GHOST
        elif fault == "untrained":
            x[0, 0] = y[0, 0] = UNTRAINED[1]
        ln_f = self.model.ln_f.weight
        saved = ln_f.detach().clone() if fault in ("spike", "nan") else None
        with torch.no_grad():
            if fault == "spike":
                ln_f.mul_(1000.0)  # logits x1000: the loss jumps from ~4.7 to a few hundred
            elif fault == "nan":
                ln_f[0] = float("nan")  # NaN in the lm_head input, the logits and the loss
        try:
            self.opt.zero_grad()
            if fault == "blind":
                # A loop that computes the loss outside the model and forgets to feed it to
                # the guard: the forward sees no targets and returns no loss.
                logits, _ = self.model(x)  # (B, T, rows)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                self.g.step()
            else:
                _, loss = self.model(x, y)
            loss.backward()
            self.opt.step()  # the guard reads and acts in the optimizer's step pre-hook
        except guard.GuardViolation as exc:
            self.halted = exc
            self.g.detach()  # the final report carries the halt to guard-server
        finally:
            if saved is not None:  # the fault lasted one step
                with torch.no_grad():
                    ln_f.copy_(saved)


@dataclass
class Live:
    """Prometheus after the run, and what the run did."""

    prom: Prometheus
    trainees: list[Trainee]


def _attach(
    rank: int, env: pytest.MonkeyPatch, checks: dict[str, Any], push: str | None,
    untrained: bool = False,
) -> Trainee:
    env.setenv("RANK", str(rank))  # the guard takes its rank from RANK at attach
    model = tiny_gpt(ROWS, seed=rank, garbage=0.5, real=REAL)
    if untrained:
        with torch.no_grad():
            model.lm_head.weight[UNTRAINED] = 0.0  # tied: the embedding's rows too
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pol = policy(**checks) | {"run_id": RUN}
    pol["export"] = {"serve": None, "push": push}  # the policy's push sink takes GUARD_TOKEN
    g = guard.attach(model, policy=pol, vocab_size=REAL, optimizer=opt)
    return Trainee(rank, model, opt, g, untrained=untrained)


def _train(stack: ExitStack, env: pytest.MonkeyPatch, url: str) -> list[Trainee]:
    """Attach the three ranks; their faults wait for their steps."""
    warn, mask = {"action": "warn"}, {"action": "mask"}
    common = {"token_range": warn, "loss_spike": warn}
    clean = _attach(0, env, common | {"padding_mass": mask, "nonfinite": warn}, url)
    faulty = _attach(1, env, common | {"padding_mass": warn, "nonfinite": {"action": "skip"}}, url,
                     untrained=True)
    faulty.g.add_sink(PushSink(url, token="stale-token", flush_interval_s=0.2))
    faulty.faults = {GHOST_STEP: "ghost", UNTRAINED_STEP: "untrained", SPIKE_STEP: "spike",
                     NAN_STEP: "nan", BLIND_STEP: "blind"}
    halts = _attach(2, env, common | {"padding_mass": mask, "nonfinite": {"action": "fail"}}, None)
    halts.g.add_sink(PushSink(url, token=TOKEN, max_queue=1, flush_interval_s=0.5))
    halts.faults = {NAN_STEP: "nan"}
    trainees = [clean, faulty, halts]
    for t in trainees:
        stack.callback(t.g.detach)  # idempotent; detaches whatever a failure left attached
    return trainees


def _steps(trainees: list[Trainee], steps: range) -> None:
    for i in steps:
        for t in trainees:  # the ranks in lock step, as in data-parallel training
            t.step(i)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """A real Prometheus that has seen the run healthy, then its faults and its end."""
    # Module scope: the tests only read, and the run with its Prometheus costs seconds.
    if prometheus_binary() is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    with ExitStack() as stack, pytest.MonkeyPatch.context() as env:
        for name in os.environ.copy():  # a developer's settings must not change the outcome
            if name.upper().startswith(("GUARD_SERVER_", "GUARD_TOKEN")):
                env.delenv(name)
        settings = Settings(port=0, token=TOKEN, log_level="warning")
        server = stack.enter_context(EmbeddedServer(port=0, settings=settings))
        assert server.url is not None
        env.setenv("GUARD_TOKEN", TOKEN)
        prom = stack.enter_context(
            run_prometheus([server.url], scrape_interval_s=0.5, rule_files=[ALERT_RULES])
        )
        trainees = _train(stack, env, server.url)
        _steps(trainees, range(1, CLEAN_STEPS + 1))
        # Two healthy samples of every rank before any fault, so increase() and rate() see
        # the faults as increments, as they would in a long run.
        prom.wait_for(
            f'count(count_over_time(guard_step{{run_id="{RUN}"}}[1m]) >= 2) == 3', timeout_s=20
        )
        _steps(trainees, range(CLEAN_STEPS + 1, LAST_STEP + 1))
        for t in trainees:
            t.g.detach()  # final reports: the push sinks flush before detach returns
        ended = time.time()
        # A scrape of every rank after the last report landed.
        prom.wait_for(f'min(timestamp(guard_step{{run_id="{RUN}"}})) > {ended}', timeout_s=20)
        yield Live(prom, trainees)


def _by(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in result}


def _positive(result: list[dict[str, Any]], *labels: str) -> set[tuple[str, ...]]:
    return {key for key, value in _by(result, *labels).items() if value > 0}


def _panel(title: str, selection: str = "all") -> str:
    run_id, rank, _ = SELECTIONS[selection]
    return next(q.expr for q in dashboard_queries(run_id=run_id, rank=rank) if q.title == title)


def test_the_run_went_as_scripted(live: Live) -> None:
    clean, faulty, halted = live.trainees
    assert clean.halted is None and faulty.halted is None
    assert halted.halted is not None and halted.halted.check == "nonfinite"
    assert halted.halted.step == NAN_STEP
    assert faulty.g.stats["out_of_range"]["label"] == 1
    assert faulty.g.stats["violations"]["loss_spike"] == {"warn": 1}
    assert faulty.g.stats["violations"]["coverage"] == {"warn": 1}  # one blind step
    assert faulty.g.stats["untrained_tokens"] == {"input": 1, "label": 1}
    assert faulty.g.stats["violations"]["untrained_rows"] == {"repair": 1}
    assert "coverage" not in halted.g.stats["violations"]
    assert faulty.g.stats["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in faulty.model.parameters()), "skip left a NaN"
    # The clean rank's mask kept its garbage rows out of the loss: no violation at all (the
    # faulty rank, unmasked, counts one wherever the loss trained on them).
    assert clean.g.stats["violations"] == {}
    assert faulty.g.stats["violations"]["padding_mass"]["warn"] >= 1


@pytest.mark.parametrize(("selection", "query"), PANEL_QUERIES)
def test_panel_query_returns_series(live: Live, selection: str, query: PanelQuery) -> None:
    result = live.prom.query(query.expr)
    if not (selection == "clean" and query.title in EMPTY_WHEN_CLEAN) and \
            (query.title, query.ref_id) not in NEWER_GUARDS_ONLY:
        assert result, f"panel {query.title!r} ({query.ref_id}) shows no data: {query.expr}"
    ranks = {series["metric"].get("rank") for series in result} - {None}
    allowed = SELECTIONS[selection][2]
    assert ranks <= allowed, f"panel {query.title!r} ignores the rank variable: {ranks}"


def test_panels_show_the_faults(live: Live) -> None:
    q = live.prom.query
    # Padding mass is measured before the mask, so every rank shows its garbage rows.
    mass = _by(q(_panel("Padding mass, mean (pre-mask)")), "rank")
    assert set(mass) == {("0",), ("1",), ("2",)} and min(mass.values()) > 1e-6, mass
    assert _positive(q(_panel("Non-finite values by tensor")), "rank", "tensor") == {
        (rank, tensor) for rank in ("1", "2") for tensor in ("logits", "hidden", "loss", "grad")
    }
    assert _positive(q(_panel("Ghost tokens by kind")), "rank", "kind") == {("1", "label")}
    assert _positive(q(_panel("Violations by check and action")), "check", "action") == {
        ("padding_mass", "warn"), ("token_range", "warn"),
        ("loss_spike", "warn"), ("nonfinite", "skip"), ("nonfinite", "fail"),
        ("coverage", "warn"), ("untrained_rows", "repair"),
    }  # fmt: skip
    assert _positive(q(_panel("Untrained tokens by kind")), "rank", "kind") == {
        ("1", "input"), ("1", "label")}
    # Four rows zeroed on rank 1, one used and repaired (tied: the embedding's, named twice).
    assert _by(q(_panel("Untrained rows left")), "weight") == {("embedding",): 3,
                                                                ("lm_head",): 3}
    assert _positive(q(_panel("Skipped optimizer steps")), "rank") == {("1",)}
    assert _positive(q(_panel("Blind checks (coverage)")), "rank") == {("1",)}
    assert _by(q(_panel("Halted ranks")), "run_id") == {("",): 1.0}
    assert _by(q(_panel("Latest step, finished ranks")), "run_id") == {(RUN,): float(LAST_STEP)}
    assert _by(q(_panel("Vocab sizes (real / rows / aligned)")), "kind") == {
        ("real",): REAL,
        ("rows",): ROWS,
        ("aligned",): ROWS,
    }
    assert _positive(q(_panel("Server rejects by reason")), "reason") == {("unauthorized",)}
    assert _positive(q(_panel("Step rate")), "rank") == {("0",), ("1",), ("2",)}


def test_variables_offer_the_run_and_its_ranks(live: Live) -> None:
    assert offered_variables(live.prom, RUN) == {"run_id": {RUN}, "rank": {"0", "1", "2"}}


def test_prometheus_loaded_every_rule(live: Live) -> None:
    assert loaded_alerts(live.prom) == {rule["alert"] for rule in alert_rules()}


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_expression_fires_for_the_faulty_ranks(live: Live, rule: dict[str, Any]) -> None:
    result = live.prom.query(rule["expr"])
    ranks = {series["metric"].get("rank") for series in result}
    assert ranks == FIRING.get(rule["alert"], set()), rule["expr"]
    assert {series["metric"]["run_id"] for series in result} <= {RUN}
    if rule["alert"] in FIRING_LABELS:
        label, values = FIRING_LABELS[rule["alert"]]
        assert {series["metric"][label] for series in result} == values, rule["expr"]
