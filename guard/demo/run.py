"""`guard demo`: the ghost-class collapse, reproduced and stopped, in four short runs.

All arms start from one seeded model and see the same batches of a synthetic corpus:
  unguarded   the model as the seed describes it: vocab 50000 padded to 50016 rows whose
              padding rows hold garbage; no guard. It collapses.
  fail        the same, with the guard and checks.padding_mass.action: fail: stops at step 1,
              before the first optimizer step, with the guard's message.
  mask        the same, with checks.padding_mass.action: mask (the default).
  reference   the same weights with a head over the 50000 real tokens only: what `mask` must
              match step for step.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import guard
from guard.demo.data import Corpus
from guard.demo.model import GPT, GPTConfig

__all__ = ["ArmResult", "run_demo"]

REAL = 50000  # the seed's vocabulary
ROWS = 50016  # the seed's padded size (not a multiple of 64: 50000 pads to 50048)
BATCH, BLOCK = 8, 32
LR = 3e-3
# A loss above twice ln(REAL) (21.6: twice what uniform guessing scores) is no longer training.
COLLAPSE_LOSS = 2 * math.log(REAL)


@dataclass
class ArmResult:
    """What one arm did: the losses it logged and how it ended."""

    name: str
    losses: list[float] = field(default_factory=list)
    first_bad: int | None = None
    verdict: str = ""
    seconds: float = 0.0

    @property
    def steps_run(self) -> int:
        return len(self.losses)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


def uninitialised(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Garbage like torch.empty can hand back after a resize: arbitrary float32 bit patterns
    (NaN / Inf patterns replaced by 0, so the garbage itself is finite)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def build(seed: int, d: int, layers: int) -> tuple[GPT, GPT]:
    """(padded model with garbage padding rows, reference over the real vocab only)."""
    torch.manual_seed(seed)
    padded = GPT(GPTConfig(vocab_size=ROWS, block_size=BLOCK, n_layer=layers, n_head=2,
                           n_embd=d))
    with torch.no_grad():
        padded.wte.weight[REAL:] = uninitialised((ROWS - REAL, d), seed + 1)  # tied: lm_head too
    ref = GPT(GPTConfig(vocab_size=REAL, block_size=BLOCK, n_layer=layers, n_head=2, n_embd=d))
    state = {k: (v[:REAL] if k in ("wte.weight", "lm_head.weight") else v)
             for k, v in padded.state_dict().items()}
    ref.load_state_dict(state)
    return padded, ref


def _policy(action: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "run_id": f"demo-{action}",
        "checks": {
            # 50016 is not a multiple of 64: reported, not fatal, so the step checks show.
            "alignment": {"action": "warn"},
            "padding_mass": {"action": action},
        },
        "export": {"serve": None, "push": args.push},
    }


def train(arm: ArmResult, model: GPT, corpus: Corpus, steps: int, device: str,
          g: guard.Guard | None, opt: torch.optim.Optimizer, tick: Any) -> None:
    start = time.perf_counter()
    model.train()
    try:
        for step in range(1, steps + 1):
            x, y = corpus.batch(step, BATCH, BLOCK)
            _, loss = model(x.to(device), y.to(device))
            arm.losses.append(float(loss.detach()))  # the demo's own log, not the guard's
            if arm.first_bad is None and not (arm.losses[-1] < COLLAPSE_LOSS):
                arm.first_bad = step
            loss.backward()
            opt.step()  # with a guard: its step pre-hook reads the flags first
            opt.zero_grad(set_to_none=True)
            tick()
    except guard.GuardViolation as e:
        arm.verdict = f"stopped at step {e.step}: {e}"
    finally:
        arm.seconds = time.perf_counter() - start


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    d, layers = 64, 2
    console.rule("[bold]logitguard demo: ghost classes")
    console.print(
        f"Model: a 2-layer GPT (d={d}), tied embedding / lm_head with {ROWS} rows for a "
        f"{REAL}-token vocabulary, as in the seed (50000 padded to 50016).\n"
        f"Injected: rows [{REAL}, {ROWS}) of the tied embedding / lm_head hold garbage as an "
        "uninitialised resize leaves it: arbitrary float32 bit patterns (finite ones, so up "
        "to ~3e38). Nothing else is changed.\n"
        f"Data: a seeded synthetic bigram corpus over the {REAL} real ids (seed {args.seed}); "
        f"batches of {BATCH}x{BLOCK} tokens, AdamW lr {LR}, {args.steps} steps per arm.\n"
    )
    padded, ref_model = build(args.seed, d, layers)
    console.print(str(guard.audit(padded, vocab_size=REAL)) + "\n")

    server = None
    if not args.no_serve:
        server = _start_server(args.serve, console)
    corpus = Corpus(REAL, seed=args.seed)
    # The guard's own warnings would repeat what the summary says; the demo reports itself.
    guard_log = logging.getLogger("guard")
    level, guard_log.level = guard_log.level, logging.ERROR
    arms = [ArmResult("unguarded"), ArmResult("fail"), ArmResult("mask"), ArmResult("reference")]
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[note]}"), console=console) as progress:
        for arm in arms:
            model = (ref_model if arm.name == "reference" else copy.deepcopy(padded)).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            task = progress.add_task(arm.name, total=args.steps, note="")
            g = None
            if arm.name in ("fail", "mask"):
                g = guard.attach(model, policy=_policy(arm.name, args), vocab_size=REAL,
                                 optimizer=opt)
                if server is not None:
                    from guard.sinks.embedded import EmbeddedSink

                    g.add_sink(EmbeddedSink(server=server))
            try:
                train(arm, model, corpus, args.steps, device, g,
                      opt, lambda t=task: progress.advance(t))
            finally:
                if g is not None:
                    g.detach()
                    arm.verdict = arm.verdict or _verdict(g.stats)
            if arm.name == "unguarded":
                arm.verdict = _collapse_verdict(arm)
            if arm.name == "reference":
                arm.verdict = "head over the real vocab only"
            progress.update(task, note=arm.verdict.split(":")[0])
    guard_log.setLevel(level)
    mask, ref = arms[2], arms[3]
    pairs = zip(mask.losses, ref.losses, strict=False)
    diff = max((abs(a - b) for a, b in pairs), default=math.nan)
    _summary(console, Table, arms, diff)
    plot = _plot(arms, out / "losses.png")
    console.print(f"\nLoss curves: {plot}")
    (out / "summary.json").write_text(json.dumps(
        {"arms": [{**asdict(a), "steps_run": a.steps_run, "final_loss": a.final_loss}
                  for a in arms], "mask_vs_reference_max_abs_diff": diff}, indent=2,
        default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else x))
    ok = _outcomes_ok(arms, diff)
    if server is not None:
        console.print(f"Metrics stay up until exit: {server.url}/metrics")
        server.stop()
    console.print("[green]demo: all three outcomes as expected[/]" if ok else
                  "[red]demo: an outcome differs from what the demo expects (see above)[/]")
    return 0 if ok else 1


def _start_server(address: str, console: Any) -> Any:
    from guard.policy import Export

    host, port = Export(serve=address).serve_address() or ("127.0.0.1", 9464)
    try:
        from guard_server.embedded import EmbeddedServer

        server = EmbeddedServer.for_trainer(host, port)
        url = server.start()
    except (ImportError, OSError, RuntimeError) as e:
        console.print(f"[yellow]no /metrics endpoint ({e}); continuing without it[/]")
        return None
    console.print(f"Live metrics: {url}/metrics  (runs demo-fail and demo-mask)\n")
    return server


def _collapse_verdict(arm: ArmResult) -> str:
    if arm.first_bad is None:
        return "did not collapse"
    after = arm.losses[arm.first_bad - 1 :]
    back = next((arm.first_bad + i for i, x in enumerate(after) if x < COLLAPSE_LOSS), None)
    tail = "never recovered" if back is None else f"back under {COLLAPSE_LOSS:.1f} at step {back}"
    return f"collapsed at step {arm.first_bad} (loss {_fmt(after[0])}), {tail}"


def _verdict(stats: dict[str, Any]) -> str:
    v = stats["violations"].get("padding_mass", {})
    mass = stats["padding_mass"]
    return (f"masked every step ({v.get('mask', 0)} reads with mass {mass:.3g} before the mask)"
            if v.get("mask") else f"no padding-mass violation (mass {mass})")


def _fmt(x: float | None) -> str:
    return "-" if x is None else (f"{x:.4g}" if math.isfinite(x) else str(x))


def _summary(console: Any, table_cls: Any, arms: list[ArmResult], diff: float) -> None:
    t = table_cls(title="Summary")
    for col in ("arm", "steps run", "final loss", "first bad step", "guard verdict"):
        t.add_column(col)
    for a in arms:
        short = a.verdict.split(": ", 1)[0] + (" (message below)" if ": " in a.verdict else "")
        t.add_row(a.name, str(a.steps_run), _fmt(a.final_loss), _fmt(a.first_bad), short)
    console.print(t)
    console.print(f"mask vs reference: largest loss difference over all steps {diff:.3g}")
    fail = arms[1]
    if fail.verdict.startswith("stopped"):
        console.print(f"\nThe guard's message (fail arm):\n  {fail.verdict.split(': ', 1)[1]}")


def _plot(arms: list[ArmResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    style = {"unguarded": ("tab:red", "-"), "fail": ("tab:orange", "-"),
             "mask": ("tab:green", "-"), "reference": ("black", "--")}
    top = max((x for a in arms for x in a.losses if math.isfinite(x)), default=1.0)
    for a in arms:
        color, ls = style[a.name]
        xs = list(range(1, a.steps_run + 1))
        finite = [(x, y) for x, y in zip(xs, a.losses, strict=True) if math.isfinite(y)]
        if finite:
            ax.plot(*zip(*finite, strict=True), ls, color=color, label=a.name, marker="."
                    if len(finite) < 3 else None)
        bad = [x for x, y in zip(xs, a.losses, strict=True) if not math.isfinite(y)]
        if bad:
            ax.plot(bad, [top * 2] * len(bad), "x", color=color,
                    label=f"{a.name}: loss NaN/Inf")
        if a.name == "fail" and a.verdict.startswith("stopped"):
            ax.annotate("fail: stopped here", (max(a.steps_run, 1), a.losses[-1] if a.losses
                        else top), textcoords="offset points", xytext=(10, 10), color=color)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (log scale)")
    ax.set_title(f"vocab {REAL} padded to {ROWS}, garbage padding rows")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _outcomes_ok(arms: list[ArmResult], diff: float) -> bool:
    unguarded, fail, mask, ref = arms
    return (unguarded.first_bad is not None
            and fail.verdict.startswith("stopped at step 1")
            and mask.first_bad is None and mask.steps_run == ref.steps_run
            and diff < 1e-3)
