"""Static guard on the hot path: the modules that run inside hooks never read to the host."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import guard

HOT = ["hooks.py", "checks.py"]
# .item() / .cpu() / .tolist() / .numpy(), and bool(t) / float(t) / int(t) on a value
HOST_READ = re.compile(r"\.(item|cpu|tolist|numpy)\(|(?<![.\w])(bool|float|int)\((?![\"'])")


@pytest.mark.parametrize("name", HOT)
def test_no_host_read_in_hot_modules(name: str) -> None:
    src = (Path(guard.__file__).parent / name).read_text()
    hits = [(i, line) for i, line in enumerate(src.splitlines(), 1)
            if HOST_READ.search(line.split("#", 1)[0]) and "shape" not in line]
    assert hits == []
