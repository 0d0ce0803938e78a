"""Errors raised by the guard server.

Each error subclasses the builtin it refines and keeps its data as attributes::

    SettingsError(ValueError)         a GUARD_SERVER_* variable (or argument) is invalid
    BodyTooLargeError(ValueError)     a report body is over GUARD_SERVER_MAX_BODY_BYTES (413)
    CapacityError(RuntimeError)       a batch would pass the caps on runs or ranks, or the
                                      byte budget (429)
    StepJumpError(ValueError)         a report's step runs further ahead than time allows (409)
    PortInUseError(OSError)           the embedded endpoint's port is taken
"""

from __future__ import annotations

import errno

__all__ = [
    "BodyTooLargeError",
    "CapacityError",
    "PortInUseError",
    "SettingsError",
    "StepJumpError",
]


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
    """A batch would add a run or a rank beyond the server's caps, or bytes beyond its budget;
    nothing was stored."""

    def __init__(self, run_id: str, rank: int, limit: int, *, scope: str) -> None:
        self.run_id = run_id
        self.rank = rank
        self.limit = limit
        self.scope = scope  # "runs", "ranks" (per run), "ranks_total" or "bytes"
        what, setting = _CAPS[scope]
        held = what.format(run_id=run_id, limit=limit)
        super().__init__(
            f"report from run {run_id!r} rank {rank} rejected: the server already holds "
            f"{held} (its cap); nothing was stored. Raise GUARD_SERVER_{setting} or wait for "
            "idle ranks to expire."
        )


# scope -> (what is held, the setting that caps it)
_CAPS = {
    "runs": ("{limit} runs", "MAX_RUNS"),
    "ranks": ("{limit} ranks in run {run_id!r}", "MAX_RANKS_PER_RUN"),
    "ranks_total": ("{limit} ranks over all runs", "MAX_RANKS"),
    "bytes": ("state close to its budget of {limit} bytes", "MAX_BYTES"),
}


class StepJumpError(ValueError):
    """A report's step is further ahead of the rank's last step than the time since can
    justify (GUARD_SERVER_MAX_STEP_RATE); one forged step would otherwise freeze the rank."""

    def __init__(self, run_id: str, rank: int, index: int, step: int, bound: int) -> None:
        self.run_id = run_id
        self.rank = rank
        self.index = index  # of the report in the batch
        self.step = step
        self.bound = bound
        super().__init__(
            f"step {step} of run {run_id!r} rank {rank} is past {bound}, the furthest this "
            "rank can have reached since its last report (GUARD_SERVER_MAX_STEP_RATE steps a "
            "second plus GUARD_SERVER_STEP_BURST); nothing was stored"
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
