"""The `guard` command: demo, serve, audit."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]


def _demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    from guard.demo.run import run_demo

    return run_demo(args)


def _serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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


# Each entry adds one subcommand; the audit issue adds `audit`.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_demo, _serve]  # type: ignore[type-arg]


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
