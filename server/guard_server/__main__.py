"""`python -m guard_server [--host H] [--port P]`: run the server in the foreground."""

from __future__ import annotations

import argparse
import sys

from guard_server.errors import AddressError, SettingsError
from guard_server.runner import serve


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and serve until interrupted; 2 on bad settings, 3 when the
    address cannot be listened on."""
    parser = argparse.ArgumentParser(
        prog="python -m guard_server",
        description="Collect logitguard reports and serve them to Prometheus. Other settings "
        "come from GUARD_SERVER_* variables; the token from GUARD_TOKEN.",
    )
    parser.add_argument("--host", help="address to bind (default: GUARD_SERVER_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: GUARD_SERVER_PORT or 9400)")
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port)
    except SettingsError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    except AddressError as exc:  # as `guard serve`: 2 invalid, 3 not available now
        parser.exit(2 if exc.invalid else 3, f"{parser.prog}: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
