"""The `guard` command: demo, serve, audit, targets, policy check.

Only `guard demo` imports torch: serve, audit, targets and --version start without it.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias

from guard.policy_check import add_policy

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]
# What a shell reports for a process killed by SIGPIPE (128 + 13): `guard ... | head`.
SIGPIPE_STATUS = 141
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _demo(sub: Subparsers) -> None:
    from guard.demo.scenarios import SCENARIOS  # text only: no torch

    p = sub.add_parser("demo", help="reproduce the seed's ghost classes and stop them",
                       description="Train a small GPT whose padding rows hold garbage four "
                       "times from one seed: unguarded (watched by a NaN/Inf loss check and "
                       "detect_anomaly), guarded with fail (stops at step 1), guarded with "
                       "mask (trains like the reference), and a reference whose head covers "
                       "the real vocabulary only.")
    p.add_argument("--steps", type=int, default=60, help="training steps per arm (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="guard-demo-out", help="folder for the plot and summary")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--no-serve", action="store_true", help="no embedded /metrics endpoint")
    p.add_argument("--serve", default="127.0.0.1:9464", help="host:port of /metrics")
    p.add_argument("--push", default=None, help="also push reports to a guard server URL")
    p.add_argument("--scenario", choices=list(SCENARIOS), default="seed",
                   help="; ".join(f"{name}{' (default)' if name == 'seed' else ''}: "
                                  f"{scenario.summary}" for name, scenario in SCENARIOS.items()))
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from guard.demo.run import run_demo

    problem = None
    if args.steps < 1:
        problem = f"--steps must be >= 1, got {args.steps}"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        problem = problem or f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1)"
    else:
        if device.type == "cuda" and not torch.cuda.is_available():
            problem = problem or ("--device cuda: this torch has no CUDA device "
                                  f"(torch {torch.__version__}); see README, GPU")
    if problem:
        print(f"guard demo: {problem}", file=sys.stderr)
        return 2
    return run_demo(args)


def _serve(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="run the guard server (POST /v1/reports, GET /metrics)",
                       description="Collect the reports that trainers push (export.push) and "
                       "serve them to Prometheus. Other settings come from GUARD_SERVER_* "
                       "variables, the token from GUARD_TOKEN (docs/server.md). Exit status: 0 "
                       "stopped (Ctrl-C, SIGTERM), 2 an invalid option or setting, 3 the "
                       "address cannot be listened on now (a port in use, an address of "
                       "another machine, a privileged port); each error is one line naming "
                       "the option and the fix.")
    p.add_argument("--host", default=None, help="default GUARD_SERVER_HOST or 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default GUARD_SERVER_PORT or 9400")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from guard_server import AddressError, Settings, serve
    except ImportError as e:
        print(f"guard serve needs the serve extra (pip install 'logitguard[serve]'): {e}",
              file=sys.stderr)
        return 2
    try:
        settings = Settings()
    except ValueError as e:  # SettingsError names the GUARD_SERVER_* variable
        print(f"guard serve: {e}", file=sys.stderr)
        return 2
    try:
        serve(args.host, args.port, settings=settings)
    except AddressError as e:
        print(f"guard serve: {e}", file=sys.stderr)
        return 2 if e.invalid else 3
    return 0


def _audit(sub: Subparsers) -> None:
    p = sub.add_parser("audit", help="audit the vocab sizes of a Hugging Face model directory",
                       description="Read config.json, the tokenizer files and the safetensors "
                       "files (no model loaded, no torch) and check the three vocab sizes, "
                       "tying and alignment, the padding rows and the rows of the real vocab "
                       "that were never trained. Exit status: 0 clean, 1 violations (untrained "
                       "rows included: a fine-tune that uses them trains on them), 2 unreadable "
                       "input.")
    p.add_argument("path", help="model directory (as written by save_pretrained)")
    p.add_argument("--json", action="store_true", help="print the audit as JSON")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="tensor-parallel degree the rows must divide into (default 1)")
    p.add_argument("--pad-multiple", type=int, default=64, metavar="M",
                   help="alignment per tensor-parallel shard (default 64)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="real vocab size, instead of reading it from the tokenizer files")
    p.set_defaults(run=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    import json

    from guard.checkpoint_audit import audit_checkpoint
    from guard.errors import CheckpointError
    from guard.quote import quote, shown

    for flag, n in (("--tensor-parallel", args.tensor_parallel),
                    ("--pad-multiple", args.pad_multiple), ("--vocab-size", args.vocab_size)):
        if n is not None and n < 1:
            print(f"guard audit: {flag} must be a positive integer, got {n}", file=sys.stderr)
            return 2
    # What a checkpoint names is printed escaped; a terminal that cannot show a character gets
    # its escape rather than an exception.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    try:
        result = audit_checkpoint(args.path, tensor_parallel=args.tensor_parallel,
                                  pad_multiple=args.pad_multiple, vocab_size=args.vocab_size)
    except Exception as e:  # untrusted input: one line, never a traceback
        error = e if isinstance(e, CheckpointError) else CheckpointError(
            args.path, f"unexpected {type(e).__name__} ({quote(str(e), 200)}); a bug of guard "
            "audit, please report it with the files")
        if args.json:
            print(json.dumps({"path": args.path, "ok": False,
                              "error": {"file": error.path, "expected": error.expected}}))
        print(f"guard audit: cannot read {shown(error.path, 300)}: "
              f"{shown(error.expected, 2000)}", file=sys.stderr)
        return 2
    print(json.dumps(_finite(result.to_dict()), indent=2, allow_nan=False) if args.json
          else result)
    return 0 if result.ok else 1


def _finite(value: object) -> object:
    """`value` with every non-finite float as null: JSON has no NaN or Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _targets(sub: Subparsers) -> None:
    p = sub.add_parser("targets", help="print Prometheus file_sd targets for every rank of a job",
                       description="One target per rank: the ranks of a node serve /metrics "
                       "on --port + LOCAL_RANK (export.serve). Prints the file_sd JSON, one "
                       "target group per node labelled `node`, or writes it to --out for a "
                       "file_sd_configs glob. Exit status: 0 written, 2 bad input. "
                       "See docs/scale.md.")
    p.add_argument("--nodes", default=None, metavar="HOSTLIST",
                   help="Slurm hostlist or comma list, e.g. node[01-04,07] "
                   "(default: $SLURM_JOB_NODELIST)")
    p.add_argument("--gpus-per-node", type=int, required=True, metavar="N",
                   help="ranks per node, one endpoint each")
    p.add_argument("--port", type=int, default=9464,
                   help="port of local rank 0, export.serve's port (default 9464)")
    p.add_argument("--run-id", default=None,
                   help="add the target label guard_run_id (not run_id: the metrics carry "
                   "run_id themselves, and Prometheus would rename theirs)")
    p.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                   help="add a target label to every group (repeatable)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="write the file (atomically: Prometheus never reads half of it) "
                   "instead of printing it")
    p.set_defaults(run=_run_targets)


def _run_targets(args: argparse.Namespace) -> int:
    import json
    import os
    from pathlib import Path

    from guard.targets import expand_hostlist, target_groups

    nodes = args.nodes or os.environ.get("SLURM_JOB_NODELIST")
    if not nodes:
        print("guard targets: give --nodes (a Slurm hostlist such as node[01-04]) or run "
              "inside a Slurm job (SLURM_JOB_NODELIST)", file=sys.stderr)
        return 2
    labels: dict[str, str] = {}
    for item in args.label:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"guard targets: --label {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        labels[name] = value
    if args.run_id is not None:
        labels["guard_run_id"] = args.run_id
    try:
        groups = target_groups(expand_hostlist(nodes), args.gpus_per_node, args.port, labels)
    except ValueError as e:
        print(f"guard targets: {e}", file=sys.stderr)
        return 2
    text = json.dumps(groups, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    # Written beside the target and renamed over it: file_sd reloads on change, and a
    # dot-name ending in .tmp never matches a `*.json` glob while it is being written.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"guard targets: cannot write {out}: {e}", file=sys.stderr)
        return 2
    return 0


class _Version(argparse.Action):
    """`guard --version`: the installed package's version, looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("logitguard")
        except PackageNotFoundError:
            found = "unknown (not installed: pip install -e .)"
        print(f"logitguard {found}")  # stdout, as argparse's own version action
        parser.exit()


# Each entry adds one subcommand.
SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_demo, _serve, _audit, _targets, add_policy]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="guard", description="logitguard: vocab guardrails "
                                     "for language-model training", epilog="A command whose "
                                     "output is closed early (guard audit --json DIR | head) "
                                     f"ends quietly with status {SIGPIPE_STATUS}, as one "
                                     "killed by SIGPIPE.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("guard").setLevel(logging.INFO)  # e.g. the /metrics URL
    run: Command = args.run
    try:
        return run(args)
    except BrokenPipeError:
        # The reader went away (`guard audit --json DIR | head`): end quietly, as a process
        # killed by SIGPIPE does. The interpreter's last flush of stdout would raise again, so
        # stdout is pointed at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
