"""What the hostile-checkpoint tests share: a small valid checkpoint written without torch, raw
safetensors files, and `guard audit` run in a child process whose peak memory is measured."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

EMBEDDING = "model.embed_tokens.weight"
# What `guard audit` of a small checkpoint holds at its peak (Python, numpy, safetensors,
# tokenizers: ~60-80 MiB); a case that read what the file claims would pass it many times over.
BOUND_MIB = 200
# A hang guard only, never a pass criterion: a case that blocked (a FIFO) or ran on (a varint
# without end) would meet it; a loaded machine is far inside it.
HANG_S = 120

# The peak is this process's own (VmHWM): ru_maxrss would count the parent's pages the child
# was started from (vfork, then exec, keeps the high-water mark).
_CHILD = """\
import sys
from guard.cli import main
try:
    code = main(sys.argv[2:])
finally:
    sys.stdout.flush()
    peak = next(line.split()[1] for line in open("/proc/self/status")
                if line.startswith("VmHWM:"))
    with open(sys.argv[1], "w") as f:
        f.write(peak)
sys.exit(code)
"""


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str
    peak_mib: float
    seconds: float

    def refused(self, blamed: Path | str, *says: str) -> None:
        """Exit 2, one line on stderr naming `blamed` and saying each of `says`."""
        assert self.code == 2, (self.code, self.out, self.err)
        assert self.err.count("\n") == 1 and self.err.startswith("guard audit: cannot read "), \
            self.err
        assert str(blamed) in self.err, self.err
        for text in says:
            assert text in self.err, (text, self.err)
        assert self.peak_mib < BOUND_MIB, self.peak_mib


def audit(d: Path, *args: str, env: dict[str, str] | None = None) -> Run:
    """`guard audit DIR ARGS` in a child process (text output unless --json is given)."""
    peak = d.parent / f".peak-{d.name}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(peak), "audit", str(d), *args],
                          capture_output=True, timeout=HANG_S, env={**os.environ, **(env or {})})
    seconds = time.monotonic() - started
    kib = int(peak.read_text()) if peak.exists() else 0
    return Run(done.returncode, done.stdout.decode("utf-8", "replace"),
               done.stderr.decode("utf-8", "replace"), kib / 1024, seconds)


def audit_json(d: Path) -> tuple[Run, dict[str, Any]]:
    """--json: the run and its stdout, which is always one JSON object."""
    run = audit(d, "--json")
    return run, json.loads(run.out)


def tokenizer(d: Path, real: int) -> None:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(real)}, unk_token="t0"))
    tok.save(str(d / "tokenizer.json"))


def checkpoint(d: Path, rows: int = 128, cols: int = 8, *, real: int = 100,
               name: str = EMBEDDING) -> Path:
    """A valid tied checkpoint: `rows` x `cols` float32 embedding, `real` tokenizer ids."""
    d.mkdir(parents=True, exist_ok=True)
    w = np.random.default_rng(0).normal(0, 0.02, (rows, cols)).astype(np.float32)
    save_file({name: w}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"vocab_size": rows, "tie_word_embeddings": True}))
    tokenizer(d, real)
    return d


def raw_safetensors(path: Path, header: dict[str, Any] | bytes, data: bytes = b"") -> Path:
    """A safetensors file of exactly this header (JSON, or raw bytes) and data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def entry(shape: object, offsets: object, dtype: str = "F32") -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}
