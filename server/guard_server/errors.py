"""Errors raised by the guard server.

Each error subclasses the builtin it refines and keeps its data as attributes::

    SettingsError(ValueError)         a GUARD_SERVER_* variable (or argument) is invalid
    BodyTooLargeError(ValueError)     a report body is over GUARD_SERVER_MAX_BODY_BYTES (413)
    BusyError(RuntimeError)           too many bodies are being read at once (429), or
                                      scrapes written at once (503)
    CapacityError(RuntimeError)       a batch would pass the caps on runs, ranks or series,
                                      or the byte budget (429)
    StepJumpError(ValueError)         a report's step runs further ahead than time allows (409)
    PortInUseError(OSError)           the embedded endpoint's port is taken
    AddressError(OSError)             `guard serve` cannot listen on its host and port
"""

from __future__ import annotations

import errno

__all__ = [
    "AddressError",
    "BodyTooLargeError",
    "BusyError",
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


class BusyError(RuntimeError):
    """As many requests of a kind as its GUARD_SERVER_MAX_INFLIGHT_* setting allows are being
    served and as many again wait their turn (or this one waited its turn in vain); this one
    was refused before any work on it: no byte of its body read, no scrape begun."""

    def __init__(self, limit: int, waited_s: float, *, setting: str = "MAX_INFLIGHT_BODIES",
                 serving: str = "reading {limit} request bodies",
                 consequence: str = "nothing was stored") -> None:
        self.limit = limit
        self.waited_s = waited_s  # 0 when the queue was full on arrival
        self.setting = "GUARD_SERVER_" + setting
        super().__init__(
            f"the server is {serving.format(limit=limit)} already ({self.setting}) and more "
            f"wait their turn; {consequence}. Retry in a few seconds."
        )


class CapacityError(RuntimeError):
    """A batch would add a run or a rank beyond the server's caps, or bytes beyond its budget;
    nothing was stored."""

    def __init__(self, run_id: str, rank: int, limit: int, *, scope: str) -> None:
        self.run_id = run_id
        self.rank = rank
        self.limit = limit
        self.scope = scope  # "runs", "ranks" (per run), "ranks_total", "series" or "bytes"
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
    "series": ("close to {limit} series for /metrics", "MAX_SERIES"),
    "bytes": ("state close to its budget of {limit} bytes", "MAX_BYTES"),
}


class StepJumpError(ValueError):
    """A report's step is further ahead of the rank's last step than its step allowance
    (GUARD_SERVER_STEP_BURST, refilled at GUARD_SERVER_MAX_STEP_RATE) lets it move; one forged
    step would otherwise freeze the rank."""

    def __init__(self, run_id: str, rank: int, index: int, step: int, bound: int) -> None:
        self.run_id = run_id
        self.rank = rank
        self.index = index  # of the report in the batch
        self.step = step
        self.bound = bound
        super().__init__(
            f"step {step} of run {run_id!r} rank {rank} is past {bound}, the furthest this "
            "rank's step may move now (GUARD_SERVER_STEP_BURST steps at once, refilled at "
            "GUARD_SERVER_MAX_STEP_RATE steps a second); nothing was stored"
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


class AddressError(OSError):
    """The server cannot listen where its settings say: `.setting` ("host" or "port") is the
    one to change, `.value` what it holds; `.invalid` when no machine could listen there (a
    port past 65535, a host that is no address), not just this one now (a port in use)."""

    def __init__(self, setting: str, value: object, problem: str, fix: str, *,
                 invalid: bool = False) -> None:
        self.setting = setting
        self.value = value
        self.invalid = invalid
        option = f"--{setting} / GUARD_SERVER_{setting.upper()}"
        super().__init__(f"{setting} {value} ({option}) {problem}; {fix}")
