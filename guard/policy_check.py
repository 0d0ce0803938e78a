"""`guard policy check FILE [FILE...]`: validate policy files before a run (runs at the command
line, never in training); the same messages as attach, one line per problem, status 0/1."""

from __future__ import annotations

import argparse
from typing import TypeAlias

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_policy(sub: Subparsers) -> None:
    p = sub.add_parser("policy", help="work with policy files (check)",
                       description="Policy files, as guard.load_policy and attach(policy=...) "
                       "read them.")
    inner = p.add_subparsers(dest="policy_command", required=True)
    c = inner.add_parser("check", help="check policy files (YAML, TOML, JSON) before a run",
                         description="Load each file as attach(policy=FILE) does and print "
                         "one line per problem, `FILE: problem`. Exit status: 0 every file "
                         "valid, 1 a problem in any file (for CI).")
    c.add_argument("files", nargs="+", metavar="FILE", help="policy file(s) to check")
    c.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    from guard.errors import PolicyError
    from guard.policy_file import load_policy

    status = 0
    for path in args.files:
        try:
            load_policy(path)
        except PolicyError as e:
            status = 1
            for problem in e.problems:
                print(f"{e.source}: {problem}")
        else:
            print(f"{path}: ok")
    return status
