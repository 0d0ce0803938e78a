"""Errors raised by the guard server.

Each error subclasses the builtin it refines and keeps its data as attributes::

    SettingsError(ValueError)         a GUARD_SERVER_* variable (or argument) is invalid
    BodyTooLargeError(ValueError)     a report body is over GUARD_SERVER_MAX_BODY_BYTES (413)
    CapacityError(RuntimeError)       a batch would exceed the caps on runs or ranks (429)
    PortInUseError(OSError)           the embedded endpoint's port is taken
"""

from __future__ import annotations

import errno

__all__ = ["BodyTooLargeError", "CapacityError", "PortInUseError", "SettingsError"]


class SettingsError(ValueError):
    """A setting is invalid; `.problems` maps each variable name to what is wrong with it."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems
        lines = "; ".join(f"{name}: {why}" for name, why in problems.items())
        super().__init__(f"invalid guard server settings: {lines}")


class BodyTooLargeError(ValueError):
    """A report body is, or declares itself, larger than the server accepts."""

    def __init__(self, limit: int, seen: int) -> None:
        self.limit = limit
        self.seen = seen
        super().__init__(
            f"request body of at least {seen} bytes is over the limit of {limit} bytes "
            "(GUARD_SERVER_MAX_BODY_BYTES); nothing was stored. Send smaller batches."
        )


class CapacityError(RuntimeError):
    """A batch would add a run or a rank beyond the server's caps; nothing was stored."""

    def __init__(self, run_id: str, rank: int, limit: int, *, scope: str) -> None:
        self.run_id = run_id
        self.rank = rank
        self.limit = limit
        self.scope = scope  # "runs" or "ranks"
        where = "runs" if scope == "runs" else f"ranks in run {run_id!r}"
        super().__init__(
            f"report from run {run_id!r} rank {rank} rejected: the server already holds "
            f"{limit} {where} (its cap); nothing was stored. Raise GUARD_SERVER_MAX_"
            f"{'RUNS' if scope == 'runs' else 'RANKS_PER_RUN'} or wait for idle ranks to expire."
        )


class PortInUseError(OSError):
    """The embedded endpoint could not bind its address because another socket holds it."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            errno.EADDRINUSE,
            f"cannot serve guard metrics on {host}:{port}: the address is already in use",
        )
        self.host = host
        self.port = port
