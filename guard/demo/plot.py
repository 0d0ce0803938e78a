"""The demo's PNG: loss and padding mass per arm, each detector's firing step marked."""

from __future__ import annotations

import math
from pathlib import Path

from guard.demo.arms import ArmResult, bound
from guard.demo.scenarios import REAL, ROWS, Scenario

__all__ = ["plot"]

_STYLE = {
    "unguarded": ("tab:red", "-"),
    "NaN/Inf loss check": ("tab:purple", ":"),
    "detect_anomaly": ("tab:brown", ":"),
    "fail": ("tab:orange", "-"),
    "mask": ("tab:green", "-"),
    "reference": ("black", "--"),
}


def plot(arms: list[ArmResult], scenario: Scenario, path: Path) -> Path:
    """Two panels sharing the step axis: training loss, and the softmax mass on the padding
    columns (log scales); a vertical line where each detector first fired, a note where
    one never did."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, mass_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for a in arms:
        color, ls = _STYLE[a.name]
        if a.name not in ("NaN/Inf loss check", "detect_anomaly"):  # they share unguarded's run
            _curve(loss_ax, a.losses, color, ls, a.name)
            _curve(mass_ax, a.padding_mass, color, ls, a.name)  # zeros (masked) are not drawn
        if a.noticed is not None:
            for ax in (loss_ax, mass_ax):
                ax.axvline(a.noticed, color=color, ls=":", lw=1.5)
    fired = [a for a in arms if a.noticed is not None]
    for row, a in enumerate(fired):  # one label line each, so labels at one step do not overlap
        loss_ax.annotate(f"{a.name}: step {a.noticed}", (a.noticed, 1.0),
                         xycoords=("data", "axes fraction"), xytext=(4, -14 - 12 * row),
                         textcoords="offset points", color=_STYLE[a.name][0], fontsize=8)
    zero = [a.name for a in arms if a.padding_mass and not any(a.padding_mass)]
    if zero:
        mass_ax.text(0.99, 0.02, "exactly 0 every step: " + ", ".join(zero), ha="right",
                     transform=mass_ax.transAxes, fontsize=8, color="dimgray")
    silent = [a.name for a in arms if a.noticed is None and a.name not in ("reference",
                                                                           "unguarded")]
    if silent:
        loss_ax.text(0.99, 0.02, "never fired: " + ", ".join(silent), ha="right",
                     transform=loss_ax.transAxes, fontsize=8, color="dimgray")
    # The two levels: what healthy padding rows take (each column at an average real id's
    # probability), and the guard's bound at the default excess (10x that per column).
    healthy, limit = (ROWS - REAL) / ROWS, bound(REAL, ROWS, 10.0)
    mass_ax.axhline(healthy, color="green", lw=0.8, ls="--")
    mass_ax.text(1, healthy, " healthy rows' share P/(N+P)", va="top", fontsize=8,
                 color="green")
    mass_ax.axhline(limit, color="gray", lw=0.8, ls="--")
    mass_ax.text(1, limit, " the guard's bound (10x an average real id's share)",
                 va="bottom", fontsize=8, color="gray")
    loss_ax.set_yscale("log")
    mass_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss")
    mass_ax.set_ylabel("padding mass, before any mask")
    mass_ax.set_xlabel("step")
    loss_ax.set_title(f"vocab {REAL} padded to {ROWS}: {scenario.name} scenario")
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curve(ax: object, ys: list[float], color: str, ls: str, label: str) -> None:
    points = [(i + 1, y) for i, y in enumerate(ys) if math.isfinite(y) and y > 0]
    if points:
        xs, vals = zip(*points, strict=True)
        ax.plot(xs, vals, ls, color=color, label=label,  # type: ignore[attr-defined]
                marker="." if len(points) < 3 else None)
    bad = [i + 1 for i, y in enumerate(ys) if not math.isfinite(y)]
    if bad:
        ax.plot(bad, [1.0] * len(bad), "x", color=color,  # type: ignore[attr-defined]
                transform=ax.get_xaxis_transform(),  # type: ignore[attr-defined]
                label=f"{label}: NaN/Inf")
