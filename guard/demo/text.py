"""What `guard demo` says about the run it just did: every sentence computed from the arms'
recorded series (losses, padding mass before any mask, detector steps), and the table printed
whole when the output is a file or a pipe (rich would cut it to 80 columns there)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from guard.demo.arms import ArmResult, Detectors, largest_spike

__all__ = ["detector_sentence", "findings", "mask_verdict", "mass_sentence", "print_table",
           "spans"]

SPANS_SHOWN = 4  # stretches of steps named in a sentence; more are counted, not listed


def _g(x: float) -> str:
    return format(x, ".2g") if math.isfinite(x) else str(x)


def spans(steps: Sequence[int], shown: int = SPANS_SHOWN) -> str:
    """Ascending steps as stretches: [1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10"."""
    runs: list[tuple[int, int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    text = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:shown]]
    more = len(runs) - shown
    return ", ".join(text) + (f" and {more} more stretch{'es' if more > 1 else ''}"
                              if more > 0 else "")


def mass_sentence(arm: ArmResult, limit: float) -> str:
    """How the arm's padding mass (before any mask) stood against the guard's bound: at how
    many steps over it, where, how far at most, and where it ended."""
    mass = arm.padding_mass
    if not mass:
        return f"The {arm.name} run measured no padding mass."
    finite = [(i + 1, m) for i, m in enumerate(mass) if math.isfinite(m)]
    over = [s for s, m in finite if m > limit]
    head = f"The {arm.name} run's padding mass (before any mask)"
    bad = len(mass) - len(finite)
    nonfinite = f"; it was not finite at {bad} of {len(mass)} steps" if bad else ""
    if not finite:
        return f"{head} was not finite at any of its {len(mass)} steps."
    top_step, top = max(finite, key=lambda p: p[1])
    if not over:
        return (f"{head} stayed under the guard's bound of {_g(limit)} at all {len(finite)} "
                f"steps measured (at most {_g(top)}, step {top_step}){nonfinite}.")
    last_step, last = finite[-1]
    end = (f"{last / limit:.3g}x the bound" if last > limit else
           f"under the bound ({last / limit:.2g} of it)")
    return (f"{head} was over the guard's bound of {_g(limit)} at {len(over)} of {len(mass)} "
            f"steps (steps {spans(over)}), at most {top / limit:.3g}x the bound (step {top_step}); "
            f"at step {last_step} it is {_g(last)}, {end}{nonfinite}.")


def detector_sentence(detectors: Detectors) -> str:
    """What the NaN/Inf loss check and detect_anomaly did, watching the unguarded run."""
    said = [f"{d.name} {'never fired' if d.noticed is None else f'fired at step {d.noticed}'}"
            for d in (detectors.nan_check, detectors.anomaly)]
    return f"Watching it, the {said[0]}, and {said[1]}."


def _loss_sentences(unguarded: ArmResult, ref: ArmResult) -> list[str]:
    bad = next((i + 1 for i, x in enumerate(unguarded.losses) if not math.isfinite(x)), None)
    n = unguarded.steps_run
    if bad is not None:
        return [f"Unguarded, the loss was non-finite ({unguarded.losses[bad - 1]}) first at "
                f"step {bad} of {n}."]
    said = []
    step, before, at = largest_spike(unguarded, ref)
    if step and at - before > 1.0:
        said.append(f"Unguarded, the loss spiked at step {step} ({before:.2f} -> {at:.2f}), "
                    "which the reference did not.")
    final, ref_final = unguarded.final_loss, ref.final_loss
    if final is not None and ref_final is not None and math.isfinite(ref_final):
        said.append(f"The unguarded loss stayed finite at all {n} steps and ends at "
                    f"{final:.3f} against the reference's {ref_final:.3f} "
                    f"({final - ref_final:+.3f}).")
    return said


def _guard_sentence(fail: ArmResult, mask: ArmResult, ref: ArmResult, diff: float) -> str:
    stop = (f"fail stopped the run at step {fail.steps_run}" if fail.verdict.startswith("stopped")
            else f"fail ran all {fail.steps_run} steps")
    tracks = (f"its loss within {diff:.2g} of the reference's at every step"
              if math.isfinite(diff) and mask.steps_run == ref.steps_run else
              "its loss not comparable with the reference's")
    noticed = ("never noticed anything" if fail.noticed is None and mask.noticed is None else
               f"noticed at step {fail.noticed if fail.noticed is not None else mask.noticed}")
    return (f"The guard {noticed}: {stop}; mask trained with {mask.violations or 0} "
            f"violation{'' if mask.violations == 1 else 's'} (steps whose loss saw the padding "
            f"columns), {tracks}.")


def findings(arms: Sequence[ArmResult], detectors: Detectors, limit: float,
             diff: float) -> list[str]:
    """The closing sentences, each from this run's series: the unguarded loss against the
    reference, its padding mass against the guard's bound `limit`, the detectors, the guard."""
    unguarded, fail, mask, ref = arms
    return [*_loss_sentences(unguarded, ref), mass_sentence(unguarded, limit),
            detector_sentence(detectors), _guard_sentence(fail, mask, ref, diff)]


def mask_verdict(arm: ArmResult, excess: float) -> str:
    """The mask arm's verdict: its reads over the bound, and whether the loss saw any."""
    v = arm.violations or 0
    saw = "the loss never saw it" if v == 0 else "the loss saw it at those steps"
    return (f"masked: padding mass over {excess:g}x healthy before the mask at {arm.over_bound} "
            f"of {arm.steps_run} reads; {v} violation{'' if v == 1 else 's'}: {saw}")


def print_table(console: Any, table: Any) -> None:
    """`table` on `console`; to a file or a pipe at its natural width (rich's width there is
    80 columns, which would fold or cut the cells), at a terminal at the terminal's."""
    from rich.console import Console
    from rich.measure import Measurement

    if console.is_terminal:
        console.print(table)
        return
    wide = console.options.update(width=10_000, max_width=10_000)
    width = Measurement.get(console, wide, table).maximum
    Console(file=console.file, width=max(width, console.width), color_system=None,
            soft_wrap=True).print(table)
