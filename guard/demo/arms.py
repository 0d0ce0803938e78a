"""One demo arm: a training run from the shared start, what it logged, and when each detector
watching it first noticed anything."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import guard
from guard.demo.data import Corpus
from guard.demo.model import GPT
from guard.demo.scenarios import REAL
from guard.device.hooks import hook

__all__ = ["ArmResult", "Detectors", "bound", "generated_padding_ids", "largest_spike", "train"]

BATCH, BLOCK = 8, 32
LR = 3e-3
GENERATED = 50  # tokens sampled from each arm's final model


@dataclass
class ArmResult:
    """What one arm did: its losses and padding mass per step and how it ended."""

    name: str
    losses: list[float] = field(default_factory=list)
    # The softmax mass on the padding columns per step, before any mask: measured on the
    # head's output ahead of the guard's own hook (the figure the README defines).
    padding_mass: list[float] = field(default_factory=list)
    noticed: int | None = None  # first step at which this arm's detector fired
    # Guarded arms: padding_mass violations (the loss trained on ghost classes), and the reads
    # whose padding mass before the mask was over the policy's bound (a figure).
    violations: int | None = None
    over_bound: int = 0
    verdict: str = ""
    padding_ids: int | None = None  # of GENERATED sampled tokens, how many were padding ids
    seconds: float = 0.0

    @property
    def steps_run(self) -> int:
        return len(self.losses)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


@dataclass
class Detectors:
    """What a user would otherwise rely on, watching the unguarded run: a NaN/Inf check on the
    loss every step, and torch.autograd.detect_anomaly around backward. They only observe."""

    nan_check: ArmResult
    anomaly: ArmResult


class _MassBeforeMask:
    """The padding mass of the head's output, taken by a forward hook that runs before the
    guard's (prepend): what the guard's mask does after it is not seen. Device ops in the
    hook; read at the step boundary."""

    def __init__(self, head: torch.nn.Module) -> None:
        self.mass: torch.Tensor | None = None
        self.handle = hook(head, self._hook, kind="forward", prepend=True)

    def _hook(self, module: torch.nn.Module, args: object, logits: torch.Tensor) -> None:
        with torch.no_grad():
            if logits.shape[-1] <= REAL:
                self.mass = None
                return
            p = torch.softmax(logits.detach().float(), dim=-1)
            self.mass = p[..., REAL:].sum(-1).mean()

    def read(self) -> float:
        return 0.0 if self.mass is None else float(self.mass)


def train(arm: ArmResult, model: GPT, opt: torch.optim.Optimizer, corpus: Corpus, steps: int,
          device: str, g: guard.Guard | None, tick: Callable[[], None],
          detectors: Detectors | None = None) -> None:
    """Train `steps` steps; a guard's `fail` ends the arm with its message."""
    start = time.perf_counter()
    model.train()
    probe = _MassBeforeMask(model.lm_head)
    try:
        for step in range(1, steps + 1):
            x, y = corpus.batch(step, BATCH, BLOCK)
            _, loss = model(x.to(device), y.to(device))
            assert loss is not None
            arm.losses.append(float(loss.detach()))  # the demo's own log, not the guard's
            arm.padding_mass.append(probe.read())
            if detectors is not None:
                _observe(detectors, step, loss)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if g is not None:
                _read(arm, g, step)
            tick()
    except guard.GuardViolation as e:
        arm.noticed = arm.noticed or e.step
        arm.violations = (arm.violations or 0) + 1
        arm.verdict = f"stopped at step {e.step}: {e}"
    finally:
        probe.handle.remove()
        arm.seconds = time.perf_counter() - start


def bound(real: int, rows: int, excess: float) -> float:
    """The padding mass at which each padding column takes `excess` times an average real id's
    probability (checks.padding_mass.excess): healthy rows take about 1x."""
    padding = rows - real
    return excess * padding / (real + excess * padding)


def _read(arm: ArmResult, g: guard.Guard, step: int) -> None:
    # The failure this demo is about, at both levels: the guard's violations (the loss trained
    # on ghost classes) and its figure (the mass before any mask over the bound). The
    # alignment warning at attach (50016 is not a multiple of 64) is printed apart.
    s = g.stats
    arm.violations = sum(s["violations"].get("padding_mass", {}).values())
    limit = bound(g.real, g.rows, g.policy.checks.padding_mass.excess)
    if s["padding_mass_max"] is not None and s["padding_mass_max"] > limit:
        arm.over_bound += 1
    if arm.noticed is None and (arm.violations or arm.over_bound):
        arm.noticed = step


def _observe(d: Detectors, step: int, loss: torch.Tensor) -> None:
    # What users write: a host-side finiteness check of the loss, and anomaly mode in backward
    # (which raises when a backward function returns NaN). Neither changes the numbers.
    if d.nan_check.noticed is None and not math.isfinite(float(loss.detach())):
        d.nan_check.noticed = step
    try:
        with warnings.catch_warnings():  # "Anomaly Detection has been enabled", every step
            warnings.simplefilter("ignore", UserWarning)
            with torch.autograd.detect_anomaly(check_nan=True):
                loss.backward()  # type: ignore[no-untyped-call]
    except RuntimeError as e:
        if d.anomaly.noticed is None:
            d.anomaly.noticed = step
            d.anomaly.verdict = f"raised at step {step}: {str(e).splitlines()[0]}"


def generated_padding_ids(model: GPT, corpus: Corpus, device: str, seed: int) -> int:
    """How many of GENERATED tokens sampled from `model` are padding ids (>= REAL)."""
    x, _ = corpus.batch(10_000 + seed, 1, 8)
    ids = x.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    count = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(GENERATED):
            logits, _ = model(ids[:, -BLOCK:])
            p = torch.softmax(logits[0, -1].float(), dim=-1)
            p = torch.nan_to_num(p, nan=0.0)
            nxt = torch.multinomial(p, 1, generator=gen) if float(p.sum()) > 0 else p.argmax()[None]
            count += int(nxt.item() >= REAL)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train(was_training)
    return count


def largest_spike(arm: ArmResult, ref: ArmResult, after: int = 5) -> tuple[int, float, float]:
    """(step, loss before, loss at it) of the arm's largest step-to-step rise in loss past
    step `after` that the reference did not have, or (0, nan, nan) when there is none."""
    best = (0, math.nan, math.nan)
    rise_best = 0.0
    for i in range(after, min(len(arm.losses), len(ref.losses))):
        rise = (arm.losses[i] - arm.losses[i - 1]) - (ref.losses[i] - ref.losses[i - 1])
        if math.isfinite(rise) and rise > rise_best:
            rise_best, best = rise, (i + 1, arm.losses[i - 1], arm.losses[i])
    return best
