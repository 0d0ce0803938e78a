"""Prometheus `file_sd` targets for every rank of a job: one embedded endpoint per GPU.

Each rank serves /metrics on `export.serve`'s port + LOCAL_RANK, so a node with 8 GPUs has
8 targets, host:9464 to host:9471. `expand_hostlist` reads Slurm's compressed node lists
(`SLURM_JOB_NODELIST`, `node[01-04,07]`) in pure Python, so a login node needs no Slurm
tools and no torch to write the file (`guard targets`, docs/scale.md).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_HOSTS", "RESERVED_LABELS", "expand_hostlist", "target_groups"]

# A bound on the expansion, checked before expanding, so a typo such as `n[0-99999999]`
# is an error, not a hundred million strings; far above any cluster's node count.
MAX_HOSTS = 100_000
# Labels the guard's metrics carry themselves: a target label of the same name would make
# Prometheus rename the metric's own to `exported_<name>` (honor_labels: false), and every
# dashboard query and alert rule would lose its run_id / rank. `job` and `instance` are the
# scrape config's.
RESERVED_LABELS = frozenset({"run_id", "rank", "tensor", "kind", "check", "action", "reason",
                             "job", "instance"})

_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top(spec: str) -> list[str]:
    """Split at commas and whitespace outside brackets: `a[1,3],b` -> ["a[1,3]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec + ","):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {spec!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {spec!r}: ']' without '[' at position {i}")
        elif depth == 0 and (ch == "," or ch.isspace()):
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {spec!r}: '[' not closed")
    return [p for p in parts if p]


def _numbers(spec: str, body: str) -> list[str]:
    """`01-03,7` -> ["01", "02", "03", "7"]: zero padding to the width of each lower bound."""
    found: list[str] = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"hostlist {spec!r}: [{body}] holds {item!r}, expected N or N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"hostlist {spec!r}: range {item!r} runs backwards")
        if len(found) + int(hi) - int(lo) >= MAX_HOSTS:
            raise ValueError(f"hostlist {spec!r}: [{body}] names more than {MAX_HOSTS} hosts")
        found += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return found


def _expand_one(spec: str, part: str) -> list[str]:
    # `rack[1-2]-n[01-02]` -> literal and bracket pieces; the product keeps the last fastest.
    if "[]" in part:
        raise ValueError(f"hostlist {spec!r}: empty brackets in {part!r}")
    pieces: list[list[str]] = []
    for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
        if literal:
            pieces.append([literal])
        if body:
            pieces.append(_numbers(spec, body))
    total = 1
    for piece in pieces:
        total *= len(piece)
    if total > MAX_HOSTS:
        raise ValueError(f"hostlist {spec!r}: {part!r} names {total} hosts, more than {MAX_HOSTS}")
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's hostlist syntax, expanded in order: `node[01-02,07],gpu3` -> node01 node02
    node07 gpu3. ValueError names the part it cannot read, a duplicate, or an empty list."""
    hosts: list[str] = []
    for part in _split_top(spec.strip()):
        hosts += _expand_one(spec, part)
    if not hosts:
        raise ValueError(f"hostlist {spec!r} names no host")
    if len(hosts) > MAX_HOSTS:
        raise ValueError(f"hostlist {spec!r} names {len(hosts)} hosts, more than {MAX_HOSTS}")
    seen: set[str] = set()
    for host in hosts:
        if not _HOST.fullmatch(host):
            raise ValueError(f"hostlist {spec!r}: {host!r} is not a host name")
        if host in seen:
            raise ValueError(f"hostlist {spec!r} names {host} twice")
        seen.add(host)
    return hosts


def target_groups(
    hosts: Sequence[str], ranks_per_host: int, port: int = 9464,
    labels: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One file_sd target group per host: its ranks' ports port .. port + ranks_per_host - 1,
    labelled `node` (and `labels`). ValueError for a port past 65535 or a reserved label."""
    if ranks_per_host < 1:
        raise ValueError(f"ranks per host must be >= 1, got {ranks_per_host}")
    if not 1 <= port <= 65535 or port + ranks_per_host - 1 > 65535:
        raise ValueError(f"ports {port}..{port + ranks_per_host - 1} are not all in 1..65535")
    extra = dict(labels or {})
    for name in extra:
        if not _LABEL.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"{name!r} is not a Prometheus target label name")
        if name in RESERVED_LABELS or name == "node":
            raise ValueError(f"label {name!r} is reserved: the guard's metrics or this file "
                             "set it already; pick another name")
    return [
        {"targets": [f"{host}:{port + i}" for i in range(ranks_per_host)],
         "labels": {"node": host, **extra}}
        for host in hosts
    ]
