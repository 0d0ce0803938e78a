"""What the generator scripts share: write the generated file, or with --check say whether the
committed one is stale (exit 1), so CI and a test can hold a generated file to its source."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def main(render: Callable[[], str], output: Path, script: str, doc: str,
         argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if the committed file differs"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not output.exists() or output.read_text() != text:
            print(f"{output.name} is out of date: run {script}", file=sys.stderr)
            return 1
        return 0
    output.write_text(text)
    return 0
