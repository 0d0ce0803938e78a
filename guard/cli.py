"""The `guard` command: demo, serve, audit."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeAlias

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _demo(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="reproduce the ghost-class collapse and stop it",
                       description="Train a small GPT three times from one seed: unguarded "
                       "(collapses), guarded with fail (stops), guarded with mask (trains).")
    p.add_argument("--steps", type=int, default=60, help="training steps per arm (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="guard-demo-out", help="folder for the plot and summary")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--no-serve", action="store_true", help="no embedded /metrics endpoint")
    p.add_argument("--serve", default="127.0.0.1:9464", help="host:port of /metrics")
    p.add_argument("--push", default=None, help="also push reports to a guard server URL")
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
    p = sub.add_parser("serve", help="run the guard server (POST /v1/reports, GET /metrics)")
    p.add_argument("--host", default=None, help="default GUARD_SERVER_HOST or 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default GUARD_SERVER_PORT or 9400")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from guard_server import Settings, serve
    except ImportError as e:
        print(f"guard serve needs the serve extra (pip install 'logitguard[serve]'): {e}",
              file=sys.stderr)
        return 2
    try:
        settings = Settings()
    except ValueError as e:  # SettingsError names the GUARD_SERVER_* variable
        print(f"guard serve: {e}", file=sys.stderr)
        return 2
    serve(args.host, args.port, settings=settings)
    return 0


def _audit(sub: Subparsers) -> None:
    p = sub.add_parser("audit", help="audit the vocab sizes of a Hugging Face model directory",
                       description="Read config.json, the tokenizer files and the safetensors "
                       "headers (no weights loaded) and check the three vocab sizes, tying and "
                       "alignment. Exit status: 0 clean, 1 violations, 2 unreadable input.")
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

    from guard.errors import CheckpointError
    from guard.vocab.checkpoint import audit_checkpoint

    for flag, n in (("--tensor-parallel", args.tensor_parallel),
                    ("--pad-multiple", args.pad_multiple), ("--vocab-size", args.vocab_size)):
        if n is not None and n < 1:
            print(f"guard audit: {flag} must be a positive integer, got {n}", file=sys.stderr)
            return 2
    try:
        result = audit_checkpoint(args.path, tensor_parallel=args.tensor_parallel,
                                  pad_multiple=args.pad_multiple, vocab_size=args.vocab_size)
    except CheckpointError as e:
        if args.json:
            print(json.dumps({"path": args.path, "ok": False,
                              "error": {"file": e.path, "expected": e.expected}}))
        print(f"guard audit: cannot read {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0 if result.ok else 1


# Each entry adds one subcommand.
SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_demo, _serve, _audit]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="guard", description="logitguard: vocab guardrails "
                                     "for language-model training")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("guard").setLevel(logging.INFO)  # e.g. the /metrics URL
    run: Command = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
