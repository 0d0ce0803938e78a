"""What `guard audit` costs on a Llama-3-sized embedding: 128256 x 4096 bfloat16 (1 GiB), its
last 256 rows zero as Llama-3 base's reserved tokens, written as one safetensors file; the
untrained rows are read a block at a time and measured with numpy
(guard/checkpoint/safetensors_untrained.py).

    python bench/audit_cost.py [--rows 128256] [--hidden 4096] [--dir /tmp/audit-cost]

Prints the wall time of the untrained-rows pass alone (in this process) and of `guard audit
--json` in a process of its own (no torch), with that process's peak memory and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from guard.checkpoint.safetensors_untrained import untrained_stats


def write(d: Path, rows: int, hidden: int, reserved: int) -> None:
    """The checkpoint (in a process of its own: this one never holds torch's gigabytes, so the
    audit's child inherits none of them in its peak RSS)."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    if (d / "model.safetensors").exists():
        return
    torch.manual_seed(0)
    w = (torch.randn(rows, hidden) * 0.02).to(torch.bfloat16)  # (rows, hidden)
    w[rows - reserved :] = 0
    save_file({"model.embed_tokens.weight": w}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"vocab_size": rows,
                                               "tie_word_embeddings": True}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--reserved", type=int, default=256)
    p.add_argument("--dir", default="/tmp/audit-cost")
    p.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    d = Path(args.dir)
    if args.write_only:
        write(d, args.rows, args.hidden, args.reserved)
        return
    subprocess.run([sys.executable, __file__, "--write-only", "--rows", str(args.rows),
                    "--hidden", str(args.hidden), "--reserved", str(args.reserved), "--dir",
                    str(d)], check=True)
    size = (d / "model.safetensors").stat().st_size
    started = time.perf_counter()
    stats = untrained_stats(d / "model.safetensors", "model.embed_tokens.weight", args.rows)
    rows_s = time.perf_counter() - started
    assert stats is not None and len(stats.ids) == args.reserved
    # The command itself, in a process of its own: no torch, its own peak memory.
    # Its peak is VmHWM, the child's own: ru_maxrss keeps the high-water mark of the parent it
    # was started from (vfork, then exec), which has just read the rows itself.
    child = ("import sys\nfrom guard.cli import main\ncode = main(sys.argv[1:])\n"
             "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith("
             "'VmHWM:')), file=sys.stderr)\nsys.exit(code)\n")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", child, "audit", str(d), "--json"],
                          capture_output=True, text=True, check=False)
    audit_s = time.perf_counter() - started
    peak = int(done.stderr.split()[-1]) / 1024  # KiB on Linux
    found = json.loads(done.stdout)["untrained_rows"][0]["ids"]
    assert done.returncode == 1 and len(found) == args.reserved
    print(f"{args.rows} x {args.hidden} bfloat16, {size / 2**30:.2f} GiB file: untrained-rows "
          f"pass {rows_s:.1f} s in process; `guard audit --json` {audit_s:.1f} s, peak RSS "
          f"{peak:.0f} MiB, exit {done.returncode}, {len(found)} untrained rows listed")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}")


if __name__ == "__main__":
    main()
