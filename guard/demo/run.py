"""`guard demo`: the ghost-class failure of the seed, watched by every detector a user has.

All arms start from one seeded model and see the same batches of a synthetic corpus
(guard/demo/scenarios.py says what the padding rows hold):
  unguarded   the padded model, no guard; a NaN/Inf loss check and detect_anomaly watch this
              same run (they only observe), and fire only if the loss or a gradient goes
              non-finite.
  fail        the guard with checks.padding_mass.action: fail: stops at step 1.
  mask        the guard with checks.padding_mass.action: mask (the default): trains.
  reference   the same weights with a head over the 50000 real tokens only: what `mask` must
              match step for step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import guard
from guard.demo.arms import GENERATED, LR, ArmResult, Detectors, bound, generated_padding_ids, train
from guard.demo.data import Corpus
from guard.demo.padded import build
from guard.demo.plot import plot
from guard.demo.scenarios import REAL, ROWS, SCENARIOS, Scenario
from guard.demo.text import findings, mask_verdict, print_table
from guard.sinks.embedded import EmbeddedSink, start_embedded

__all__ = ["ArmResult", "run_demo"]


EXCESS = 10.0  # checks.padding_mass.excess: the demo's policies keep the default


def _policy(action: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "run_id": f"demo-{action}",
        "checks": {
            # 50016 is not a multiple of 64: reported at attach, not fatal, so the step checks
            # show.
            "alignment": {"action": "warn"},
            "padding_mass": {"action": action},
            # The guard would overwrite the garbage rows with the mean real row at attach
            # (repair, the default); here it only warns, so the arms show what the
            # padding-mass check sees of the garbage.
            "padding_rows": {"action": "warn"},
        },
        "export": {"serve": None, "push": args.push},
    }


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    # To a file or a pipe (not a terminal) lines are not folded at rich's 80 columns there.
    console = Console()
    console.soft_wrap = not console.is_terminal
    scenario = SCENARIOS[getattr(args, "scenario", "seed")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d, layers = 64, 2
    console.rule(f"[bold]logitguard demo: ghost classes ({scenario.name} scenario)")
    console.print(
        f"Model: a 2-layer GPT (d={d}), {'a tied' if scenario.tied else 'an untied'} lm_head "
        f"with {ROWS} rows for a {REAL}-token vocabulary, as in the seed (50000 padded to "
        f"50016).\nInjected: {scenario.garbage}. Nothing else is changed.\n"
        f"Data: a seeded synthetic bigram corpus over the {REAL} real ids (seed {args.seed}); "
        f"batches of 8x32 tokens, AdamW lr {LR}, {args.steps} steps per arm.\n"
    )
    padded, ref_model = build(scenario, args.seed, d, layers)
    console.print(str(guard.audit(padded, vocab_size=REAL)) + "\n")
    endpoint = None if args.no_serve else _start_endpoint(args.serve, console)
    arms, detectors = _run_arms(args, padded, ref_model, endpoint, console)
    unguarded, fail, mask, ref = arms
    diff = max((abs(a - b) for a, b in zip(mask.losses, ref.losses, strict=False)),
               default=math.nan)
    table = [unguarded, detectors.nan_check, detectors.anomaly, fail, mask, ref]
    _summary(console, table, args.steps, EXCESS)
    limit = bound(REAL, ROWS, EXCESS)
    said = findings(arms, detectors, limit, diff)
    console.print("\n[bold]What this run shows:[/]\n" + "\n".join(said))
    if scenario.searched:
        console.print(f"(Not this run: {scenario.searched})")
    if fail.verdict.startswith("stopped"):
        console.print(f"\nThe guard's message (fail arm):\n  {fail.verdict.split(': ', 1)[1]}")
    png = plot(table, scenario, out / "losses.png")
    console.print(f"\nLoss and padding mass per arm, detectors marked: {png}")
    _write_summary(out / "summary.json", scenario, table, diff, said)
    ok = _outcomes_ok(scenario, arms, detectors, diff)
    console.print("[green]demo: every outcome as expected[/]" if ok else
                  "[red]demo: an outcome differs from what the demo expects (see above)[/]")
    if endpoint is not None:
        _close_endpoint(endpoint, console)
    return 0 if ok else 1


def _run_arms(args: argparse.Namespace, padded: Any, ref_model: Any,
              endpoint: EmbeddedSink | None, console: Any) -> tuple[list[ArmResult], Detectors]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    corpus = Corpus(REAL, seed=args.seed)
    # The guard's own warnings would repeat what the summary says; the demo reports itself.
    guard_log = logging.getLogger("guard")
    level, guard_log.level = guard_log.level, logging.ERROR
    arms = [ArmResult("unguarded"), ArmResult("fail"), ArmResult("mask"), ArmResult("reference")]
    detectors = Detectors(ArmResult("NaN/Inf loss check"), ArmResult("detect_anomaly"))
    try:
        with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                      console=console) as progress:
            for arm in arms:
                task = progress.add_task(arm.name, total=args.steps)
                _run_arm(arm, args, padded, ref_model, endpoint, corpus,
                         lambda t=task: progress.advance(t), detectors)
    finally:
        guard_log.setLevel(level)
    for detector in (detectors.nan_check, detectors.anomaly):
        unguarded = arms[0]
        detector.losses, detector.padding_mass = unguarded.losses, unguarded.padding_mass
        detector.padding_ids = unguarded.padding_ids
        detector.verdict = detector.verdict or (
            "never fired" if detector.noticed is None else f"fired at step {detector.noticed}")
    return arms, detectors


def _run_arm(arm: ArmResult, args: argparse.Namespace, padded: Any, ref_model: Any,
             endpoint: EmbeddedSink | None, corpus: Corpus, tick: Any,
             detectors: Detectors) -> None:
    device = args.device
    model = (ref_model if arm.name == "reference" else copy.deepcopy(padded)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = None
    if arm.name in ("fail", "mask"):
        g = guard.attach(model, policy=_policy(arm.name, args), vocab_size=REAL, optimizer=opt)
        if endpoint is not None:  # both guarded arms feed the demo's one endpoint
            g.add_sink(EmbeddedSink(server=endpoint.server))
    try:
        train(arm, model, opt, corpus, args.steps, device, g, tick,
              detectors if arm.name == "unguarded" else None)
        if arm.name != "fail":  # a stopped run has no model to ship
            # Sampled while the guard (if any) is still attached: what generation sees.
            arm.padding_ids = generated_padding_ids(model, corpus, device, args.seed)
    finally:
        if g is not None:
            g.detach()
            arm.verdict = arm.verdict or mask_verdict(arm, EXCESS)
    if arm.name == "unguarded":
        arm.verdict = "nothing watches it"
    if arm.name == "reference":
        arm.verdict = "head over the real vocab only"


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else (format(x, spec) if math.isfinite(x) else str(x))


def _summary(console: Any, arms: list[ArmResult], steps: int, excess: float) -> None:
    from rich.table import Table

    t = Table(title=f"After {steps} steps (the NaN/Inf loss check and detect_anomaly watch "
                    "the unguarded run)")
    for col in ("arm", "noticed at step", "violations", f"loss @{steps}", "vs ref",
                "padding mass before any mask, step 1 / last", f"padding ids / {GENERATED}",
                "verdict"):
        t.add_column(col)
    ref_loss = arms[-1].final_loss
    for a in arms:
        gap = None if a.final_loss is None or ref_loss is None else a.final_loss - ref_loss
        stopped = a.steps_run < steps
        mass = a.padding_mass
        t.add_row(
            a.name,
            "never" if a.noticed is None and a.name != "reference" else _fmt(a.noticed, "d"),
            "-" if a.violations is None else str(a.violations),
            f"stopped @{a.steps_run}" if stopped else _fmt(a.final_loss, ".3f"),
            "-" if stopped else _fmt(gap, "+.3f"),
            "-" if not mass else f"{mass[0]:.2g} / {mass[-1]:.2g}",
            "-" if a.padding_ids is None else str(a.padding_ids),
            a.verdict.split(": ", 1)[0],
        )
    print_table(console, t)
    console.print(f"Two levels: 'noticed' is the first read at which the padding mass before any "
                  f"mask was over {excess:g}x what healthy padding rows take (a figure the guard "
                  "exports every step); 'violations' counts the steps whose loss trained on it "
                  "(fail stops at the first; mask keeps the padding columns out of the loss).")


def _write_summary(path: Path, scenario: Scenario, arms: list[ArmResult], diff: float,
                   said: list[str]) -> None:
    def finite(x: Any) -> Any:
        return None if isinstance(x, float) and not math.isfinite(x) else x

    rows = [{**asdict(a), "steps_run": a.steps_run, "final_loss": a.final_loss} for a in arms]
    path.write_text(json.dumps(
        {"scenario": scenario.name, "findings": said, "arms": rows,
         "mask_vs_reference_max_abs_diff": diff}, indent=2, default=finite))


def _outcomes_ok(scenario: Scenario, arms: list[ArmResult], detectors: Detectors,
                 diff: float) -> bool:
    unguarded, fail, mask, ref = arms
    guard_first = fail.verdict.startswith("stopped at step 1") and mask.noticed == 1
    tracks = mask.steps_run == ref.steps_run and diff < 1e-3 and mask.padding_ids == 0
    if scenario.name == "nan":
        return guard_first and tracks and detectors.nan_check.noticed == 1
    finite = all(math.isfinite(x) for x in unguarded.losses)
    return guard_first and tracks and finite and detectors.nan_check.noticed is None


def _start_endpoint(address: str, console: Any) -> EmbeddedSink | None:
    from guard.policy import Export

    host, port = Export(serve=address).serve_address() or ("127.0.0.1", 9464)
    endpoint = start_embedded(host, port)  # None, with the reason logged, when it cannot serve
    if endpoint is None:
        console.print("[yellow]no /metrics endpoint (see the warning above); continuing "
                      "without it[/]")
        return None
    console.print(f"Live metrics: {endpoint.metrics_url}  (runs demo-fail and demo-mask)\n")
    return endpoint


def _close_endpoint(endpoint: EmbeddedSink, console: Any) -> None:
    # The closing line must be true: when someone is at the terminal, the endpoint stays up
    # until they press Enter (or Ctrl-C); otherwise it goes now, and the demo says so.
    if sys.stdin.isatty():
        console.print(f"Metrics are up at {endpoint.metrics_url} until you press Enter "
                      "(or Ctrl-C).")
        with contextlib.suppress(EOFError, KeyboardInterrupt):
            input()
    endpoint.close()
    console.print("The metrics endpoint is closed; its figures are gone with it (push them "
                  "to a guard server with --push to keep them).")
