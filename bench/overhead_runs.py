"""The paired ratios of `bench/overhead.py` over many fresh processes, with their spread.

One run of overhead.py resolves about 0.2% between its arms (an unguarded `copy` of the
baseline reads 1.000-1.003x), yet two runs of one tree differ by 0.5%: an effect of the
process as a whole (where its tensors landed, which pages are huge), the same for every step
of a run, that more steps cannot average out. More processes can: this runs overhead.py's
interleaved arms in `--runs` fresh child processes, one after the other, and reports each
arm's paired CPU-time and wall-time ratios per run, their median and their range.

    python bench/overhead_runs.py --runs 8 --arms baseline,copy,default --steps 20
    python bench/overhead_runs.py --runs 8 --arms baseline,copy,default,mask --steps 20 --fused

Every option but --runs is overhead.py's (its --write, --sweep and memory runs excepted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import overhead  # bench/ is sys.path[0] when this runs as a script


def child(argv: list[str]) -> None:
    """One run: overhead.py's arms interleaved in this process; one JSON line of ratios."""
    p = overhead.parser()
    args = p.parse_args(argv)
    overhead.setup(args)
    arms = overhead.run_interleaved(args, overhead.arm_names(args, p))
    out: dict[str, dict[str, float]] = {}
    for n, a in arms.items():
        if overhead.base_of(n, arms) != n:  # not a baseline
            wall, cpu = overhead.ratios(arms, n)
            out[n] = {"cpu": cpu, "wall": wall, "step_ms": statistics.median(a.times) * 1e3}
    print(json.dumps(out))


def table(runs: list[dict[str, dict[str, float]]]) -> str:
    names = list(runs[0])
    lines = ["| arm | paired CPU-time ratio: median (min-max) | paired wall-time ratio: median "
             "(min-max) | per run, CPU / wall |", "|---|---|---|---|"]
    for n in names:
        cells = []
        for key in ("cpu", "wall"):
            v = [r[n][key] for r in runs]
            cells.append(f"**{statistics.median(v):.4f}x** ({min(v):.3f}-{max(v):.3f})")
        each = ", ".join(f"{r[n]['cpu']:.3f}/{r[n]['wall']:.3f}" for r in runs)
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | {each} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=8, help="fresh processes, one after the other")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    own, rest = p.parse_known_args()
    if own.child:
        child(rest)
        return
    if own.runs < 1:
        p.error(f"--runs must be at least 1, got {own.runs}")
    refused = {"--write", "--sweep", "--memory-child"} & {a.split("=")[0] for a in rest}
    if refused:
        p.error(f"{', '.join(sorted(refused))}: overhead.py's own; not over many runs")
    overhead.arm_names(overhead.parser().parse_args(rest), p)  # a bad option fails here
    load_before = os.getloadavg()[0]
    start = time.strftime("%H:%M", time.gmtime())
    runs: list[dict[str, dict[str, float]]] = []
    for i in range(own.runs):
        done = subprocess.run([sys.executable, __file__, "--child", *rest, "--no-memory"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            p.error(f"run {i + 1} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"run {i + 1}: " + ", ".join(f"{n} {r['cpu']:.3f}x / {r['wall']:.3f}x"
                                           for n, r in runs[-1].items()), flush=True)
    cmd = "python bench/overhead_runs.py " + " ".join(sys.argv[1:])
    end = time.strftime("%H:%M", time.gmtime())
    print(f"\nMachine: {overhead.machine()}; guard {overhead.guard.__file__}; 1-minute load "
          f"average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; {start}-{end} "
          f"UTC.\n\nCommand: `{cmd}` ({own.runs} fresh processes; in each, the arms "
          "interleaved as overhead.py runs them, ratios paired against the baseline).\n")
    print(table(runs))


if __name__ == "__main__":
    main()
